//! Points in time as stead records and shows them: an offset from the Unix epoch,
//! displayed and serialized as RFC 3339 in UTC.
//!
//! No code here reads a clock; the agent's clock module produces timestamps.

use std::fmt;
use std::ops::Add;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A point in time: the offset from the Unix epoch (1970-01-01T00:00:00Z).
///
/// Every timestamp shares that epoch, so timestamps survive agent restarts and compare
/// across processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(Duration);

impl Timestamp {
    /// The epoch itself.
    pub const EPOCH: Timestamp = Timestamp(Duration::ZERO);

    /// The point `offset` after the epoch.
    pub const fn from_since_epoch(offset: Duration) -> Self {
        Timestamp(offset)
    }

    /// How long after the epoch this point is.
    pub const fn since_epoch(self) -> Duration {
        self.0
    }

    /// How long after `earlier` this point is, or zero when it is not after it.
    pub fn saturating_duration_since(self, earlier: Timestamp) -> Duration {
        self.0.saturating_sub(earlier.0)
    }

    /// The later of the two.
    pub fn max(self, other: Timestamp) -> Timestamp {
        Ord::max(self, other)
    }
}

impl Add<Duration> for Timestamp {
    type Output = Timestamp;

    /// The point `offset` later.
    ///
    /// # Panics
    ///
    /// When the result does not fit, as `std::time::Instant` does.
    fn add(self, offset: Duration) -> Timestamp {
        Timestamp(
            self.0
                .checked_add(offset)
                .expect("timestamp overflow: offsets are bounded far below Duration::MAX"),
        )
    }
}

impl fmt::Display for Timestamp {
    /// RFC 3339 in UTC, with the fraction of a second trimmed: `2026-11-22T00:10:54.25Z`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.0.as_secs();
        let (year, month, day) = civil_from_days(secs / 86_400);
        let rem = secs % 86_400;
        write!(
            f,
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}",
            rem / 3600,
            rem / 60 % 60,
            rem % 60
        )?;
        let nanos = self.0.subsec_nanos();
        if nanos != 0 {
            let digits = format!("{nanos:09}");
            write!(f, ".{}", digits.trim_end_matches('0'))?;
        }
        f.write_str("Z")
    }
}

/// Days since the epoch to a proleptic Gregorian `(year, month, day)` (Hinnant's algorithm).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// `(year, month, day)` to days since the epoch; the inverse of [`civil_from_days`].
fn days_from_civil(year: u64, month: u64, day: u64) -> Option<u64> {
    let year = if month <= 2 {
        year.checked_sub(1)?
    } else {
        year
    };
    let era = year / 400;
    let yoe = year - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe).checked_sub(719_468)
}

impl std::str::FromStr for Timestamp {
    type Err = String;

    /// Parses the UTC form [`Display`](fmt::Display) writes: `YYYY-MM-DDTHH:MM:SS[.fraction]Z`.
    fn from_str(s: &str) -> Result<Self, String> {
        let invalid = || format!("invalid timestamp {s:?}; expected RFC 3339 in UTC");
        let body = s.strip_suffix('Z').ok_or_else(invalid)?;
        let (date, time) = body.split_once('T').ok_or_else(invalid)?;
        let number = |t: &str| t.parse::<u64>().map_err(|_| invalid());
        let mut date_parts = date.splitn(3, '-');
        let (year, month, day) = (
            number(date_parts.next().unwrap_or(""))?,
            number(date_parts.next().unwrap_or(""))?,
            number(date_parts.next().unwrap_or(""))?,
        );
        let (clock, fraction) = time.split_once('.').unwrap_or((time, ""));
        let mut clock_parts = clock.splitn(3, ':');
        let (hour, minute, second) = (
            number(clock_parts.next().unwrap_or(""))?,
            number(clock_parts.next().unwrap_or(""))?,
            number(clock_parts.next().unwrap_or(""))?,
        );
        if !(1..=12).contains(&month)
            || !(1..=31).contains(&day)
            || hour > 23
            || minute > 59
            || second > 60
        {
            return Err(invalid());
        }
        if fraction.len() > 9 || !fraction.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid());
        }
        let nanos = if fraction.is_empty() {
            0
        } else {
            number(&format!("{fraction:0<9}"))?
        };
        let days = days_from_civil(year, month, day).ok_or_else(invalid)?;
        let secs = days * 86_400 + hour * 3600 + minute * 60 + second;
        Ok(Timestamp(Duration::new(
            secs,
            u32::try_from(nanos).map_err(|_| invalid())?,
        )))
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = std::borrow::Cow::<'de, str>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn displays_rfc3339_in_utc_and_parses_back() {
        let table = [
            (0, 0, "1970-01-01T00:00:00Z"),
            (951_782_400, 0, "2000-02-29T00:00:00Z"),
            (1_795_306_254, 250_000_000, "2026-11-22T00:10:54.25Z"),
            (4_107_542_399, 1, "2100-02-28T23:59:59.000000001Z"),
        ];
        for (secs, nanos, text) in table {
            let t = Timestamp::from_since_epoch(Duration::new(secs, nanos));
            assert_eq!(t.to_string(), text);
            assert_eq!(text.parse::<Timestamp>(), Ok(t));
        }
    }

    #[test]
    fn refuses_malformed_timestamps() {
        for bad in [
            "",
            "2026-11-22",
            "2026-11-22T00:00:00",
            "2026-13-01T00:00:00Z",
            "x",
        ] {
            assert!(bad.parse::<Timestamp>().is_err(), "{bad}");
        }
    }
}
