//! Durations as operators write them in specs: `15s`, `30m`, `1h30m`, `250ms`.
//!
//! The text form is Go's (`time.ParseDuration` / `Duration.String`), so messages such as
//! `interval 30m0s` read exactly as they do in Nomad.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A non-negative span of time written as a string in specs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Duration(std::time::Duration);

/// Why a duration string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Empty input.
    #[error("empty duration")]
    Empty,
    /// A leading `-`.
    #[error("duration {0:?} is negative")]
    Negative(String),
    /// Not of the form `<number><unit>…`.
    #[error(
        "invalid duration {0:?}; expected a number and a unit such as \"15s\", \"30m\" or \"1h30m\""
    )]
    Invalid(String),
    /// A number without a unit.
    #[error("duration {0:?} has no unit; use ns, us, ms, s, m or h")]
    MissingUnit(String),
    /// An unknown unit.
    #[error("duration {input:?} has unknown unit {unit:?}; use ns, us, ms, s, m or h")]
    UnknownUnit {
        /// The whole input.
        input: String,
        /// The unit that was not recognised.
        unit: String,
    },
    /// More than ten years.
    #[error("duration {0:?} is too long")]
    Overflow(String),
}

/// Ten years: a bound that keeps arithmetic on durations far from overflow.
const MAX_NANOS: u128 = 10 * 365 * 24 * 3_600 * 1_000_000_000;

impl Duration {
    /// Zero.
    pub const ZERO: Duration = Duration(std::time::Duration::ZERO);

    /// A duration of `secs` seconds.
    pub const fn from_secs(secs: u64) -> Self {
        Duration(std::time::Duration::from_secs(secs))
    }

    /// A duration of `millis` milliseconds.
    pub const fn from_millis(millis: u64) -> Self {
        Duration(std::time::Duration::from_millis(millis))
    }

    /// The standard library duration.
    pub const fn get(self) -> std::time::Duration {
        self.0
    }

    /// Rounded for people to read, as Go's `Round` would be asked to: to the second from a
    /// minute on (`1m30s`), to 10 ms from a second on (`5.24s`), to 10 µs from a
    /// millisecond on (`250.12ms`); shorter ones as they are. Half rounds up.
    pub fn for_people(self) -> Self {
        let nanos = self.0.as_nanos();
        let unit: u128 = match nanos {
            n if n >= 60_000_000_000 => 1_000_000_000,
            n if n >= 1_000_000_000 => 10_000_000,
            n if n >= 1_000_000 => 10_000,
            _ => return self,
        };
        let rounded = (nanos + unit / 2) / unit * unit;
        let secs = u64::try_from(rounded / 1_000_000_000).unwrap_or(u64::MAX);
        let sub = u32::try_from(rounded % 1_000_000_000).unwrap_or(0);
        Duration(std::time::Duration::new(secs, sub))
    }
}

impl From<std::time::Duration> for Duration {
    fn from(d: std::time::Duration) -> Self {
        Duration(d)
    }
}

impl From<Duration> for std::time::Duration {
    fn from(d: Duration) -> Self {
        d.0
    }
}

impl FromStr for Duration {
    type Err = DurationError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let s = input.trim();
        if s.is_empty() {
            return Err(DurationError::Empty);
        }
        if s.starts_with('-') {
            return Err(DurationError::Negative(input.to_owned()));
        }
        let s = s.strip_prefix('+').unwrap_or(s);
        if s == "0" {
            return Ok(Duration::ZERO);
        }
        let invalid = || DurationError::Invalid(input.to_owned());
        let mut total: u128 = 0;
        let mut rest = s;
        while !rest.is_empty() {
            let number_end = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .unwrap_or(rest.len());
            let number = &rest[..number_end];
            if number.is_empty() || number == "." || number.matches('.').count() > 1 {
                return Err(invalid());
            }
            rest = &rest[number_end..];
            let unit_end = rest
                .find(|c: char| c.is_ascii_digit() || c == '.')
                .unwrap_or(rest.len());
            let unit = &rest[..unit_end];
            rest = &rest[unit_end..];
            let unit_nanos: u128 = match unit {
                "" => return Err(DurationError::MissingUnit(input.to_owned())),
                "ns" => 1,
                "us" | "µs" | "μs" => 1_000,
                "ms" => 1_000_000,
                "s" => 1_000_000_000,
                "m" => 60_000_000_000,
                "h" => 3_600_000_000_000,
                other => {
                    return Err(DurationError::UnknownUnit {
                        input: input.to_owned(),
                        unit: other.to_owned(),
                    });
                }
            };
            let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
            let overflow = || DurationError::Overflow(input.to_owned());
            let whole: u128 = if whole.is_empty() {
                0
            } else {
                whole.parse().map_err(|_| overflow())?
            };
            let mut nanos = whole.checked_mul(unit_nanos).ok_or_else(overflow)?;
            let mut scale = unit_nanos;
            for digit in fraction.chars().take(18) {
                scale /= 10;
                let digit = u128::from(digit.to_digit(10).ok_or_else(invalid)?);
                nanos += digit * scale;
            }
            total = total.checked_add(nanos).ok_or_else(overflow)?;
            if total > MAX_NANOS {
                return Err(overflow());
            }
        }
        let secs = u64::try_from(total / 1_000_000_000).expect("bounded by MAX_NANOS");
        let nanos = u32::try_from(total % 1_000_000_000).expect("below one second");
        Ok(Duration(std::time::Duration::new(secs, nanos)))
    }
}

impl fmt::Display for Duration {
    /// Go's `Duration.String`: `0s`, `250ms`, `15s`, `1m30s`, `30m0s`, `1h30m0s`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nanos = self.0.as_nanos();
        if nanos == 0 {
            return f.write_str("0s");
        }
        if nanos < 1_000 {
            return write!(f, "{nanos}ns");
        }
        if nanos < 1_000_000 {
            return write!(f, "{}µs", decimal(nanos, 1_000));
        }
        if nanos < 1_000_000_000 {
            return write!(f, "{}ms", decimal(nanos, 1_000_000));
        }
        let hours = nanos / 3_600_000_000_000;
        let minutes = (nanos / 60_000_000_000) % 60;
        let seconds = decimal(nanos % 60_000_000_000, 1_000_000_000);
        if hours > 0 {
            write!(f, "{hours}h{minutes}m{seconds}s")
        } else if minutes > 0 {
            write!(f, "{minutes}m{seconds}s")
        } else {
            write!(f, "{seconds}s")
        }
    }
}

/// `value / unit` as a decimal with trailing zeros trimmed: `decimal(1_500, 1_000)` is `1.5`.
fn decimal(value: u128, unit: u128) -> String {
    let whole = value / unit;
    let fraction = value % unit;
    if fraction == 0 {
        return whole.to_string();
    }
    let width = unit.ilog10() as usize;
    let digits = format!("{fraction:0width$}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

impl Serialize for Duration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Duration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = Cow::<'de, str>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// The pattern of a duration string, for the JSON Schema.
pub const DURATION_PATTERN: &str =
    r"^\+?(0|(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h))+)$";

impl JsonSchema for Duration {
    fn schema_name() -> Cow<'static, str> {
        "Duration".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": DURATION_PATTERN,
            "description": "A duration such as \"15s\", \"30m\" or \"1h30m\" (units ns, us, ms, s, m, h).",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_for_people_are_rounded_to_what_matters_at_their_scale() {
        for (nanos, shown) in [
            (5_242_921_168_u64, "5.24s"),
            (5_245_000_000, "5.25s"),
            (90_400_000_000, "1m30s"),
            (89_600_000_000, "1m30s"),
            (580_000_000_000, "9m40s"),
            (3_600_499_999_999, "1h0m0s"),
            (250_123_456, "250.12ms"),
            (999_999_999, "1s"),
            (1, "1ns"),
            (0, "0s"),
        ] {
            let duration = Duration::from(std::time::Duration::from_nanos(nanos));
            assert_eq!(duration.for_people().to_string(), shown, "{nanos} ns");
        }
    }

    fn parse(s: &str) -> Result<Duration, DurationError> {
        s.parse()
    }

    #[test]
    fn parses_go_style_durations() {
        let table = [
            ("0", 0),
            ("0s", 0),
            ("15s", 15_000_000_000),
            ("30m", 1_800_000_000_000),
            ("1h30m", 5_400_000_000_000),
            ("250ms", 250_000_000),
            ("1.5s", 1_500_000_000),
            ("2us", 2_000),
            ("2µs", 2_000),
            ("7ns", 7),
            ("1h1m1s1ms", 3_661_001_000_000),
        ];
        for (input, nanos) in table {
            assert_eq!(parse(input).unwrap().get().as_nanos(), nanos, "{input}");
        }
    }

    #[test]
    fn refuses_malformed_durations_with_a_reason() {
        assert_eq!(parse(""), Err(DurationError::Empty));
        assert_eq!(parse("-5s"), Err(DurationError::Negative("-5s".into())));
        assert_eq!(parse("15"), Err(DurationError::MissingUnit("15".into())));
        assert_eq!(
            parse("5d"),
            Err(DurationError::UnknownUnit {
                input: "5d".into(),
                unit: "d".into()
            })
        );
        assert_eq!(parse("s"), Err(DurationError::Invalid("s".into())));
        assert_eq!(parse("1..5s"), Err(DurationError::Invalid("1..5s".into())));
        assert_eq!(
            parse("100000h"),
            Err(DurationError::Overflow("100000h".into()))
        );
    }

    #[test]
    fn displays_like_go() {
        let table = [
            (0, "0s"),
            (7, "7ns"),
            (1_500, "1.5µs"),
            (250_000_000, "250ms"),
            (15_000_000_000, "15s"),
            (15_200_000_000, "15.2s"),
            (90_000_000_000, "1m30s"),
            (1_800_000_000_000, "30m0s"),
            (5_400_000_000_000, "1h30m0s"),
            (86_400_000_000_000, "24h0m0s"),
        ];
        for (nanos, text) in table {
            let d = Duration(std::time::Duration::from_nanos(nanos));
            assert_eq!(d.to_string(), text);
            assert_eq!(parse(text).unwrap(), d, "{text} parses back");
        }
    }
}
