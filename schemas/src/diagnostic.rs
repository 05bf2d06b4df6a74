//! Diagnostics: what is wrong with a spec, where (`file:line:col`) and in which field.

use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::rules::ValidatorOnlyRule;

/// A position in a source file, 1-based.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Location {
    /// Line, from 1.
    pub line: u32,
    /// Column in characters, from 1.
    pub column: u32,
}

impl Location {
    /// The first character of a file.
    pub const START: Location = Location { line: 1, column: 1 };

    /// A location at `line` and `column`, both 1-based (0 is taken as 1).
    pub fn new(line: u64, column: u64) -> Self {
        let clamp = |n: u64| u32::try_from(n.max(1)).unwrap_or(u32::MAX);
        Location {
            line: clamp(line),
            column: clamp(column),
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

/// One problem found in a spec file.
///
/// Displays as `file:line:col: field.path: message` (the field path is left out when the
/// problem is not about a field, such as a YAML syntax error).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Diagnostic {
    /// The file the problem is in.
    pub file: PathBuf,
    /// Where in the file.
    #[serde(flatten)]
    pub location: Location,
    /// The field, as `spec.tasks[1].resources.memoryMB`; empty when not about one field.
    pub path: String,
    /// What is wrong: lowercase, no trailing period.
    pub message: String,
    /// The rule broken, when only the validator applies it (the JSON Schema cannot);
    /// `None` for a rule both apply. Not part of the wire format.
    #[serde(skip)]
    pub rule: Option<ValidatorOnlyRule>,
}

impl Diagnostic {
    /// A diagnostic about `path` at `location` in `file`.
    pub fn new(
        file: &Path,
        location: Location,
        path: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Diagnostic {
            file: file.to_owned(),
            location,
            path: path.into(),
            message: message.into(),
            rule: None,
        }
    }

    /// This diagnostic, marked as breaking `rule`, which only the validator applies.
    pub fn only_validator(mut self, rule: ValidatorOnlyRule) -> Self {
        self.rule = Some(rule);
        self
    }
}

impl fmt::Display for Diagnostic {
    /// One line whatever the file's name or the spec's text hold: control characters
    /// (a newline, an ESC) are shown escaped, so a diagnostic never forges a line of a
    /// log or reaches a terminal as a command.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_escaped(f, &self.file.display().to_string())?;
        write!(f, ":{}: ", self.location)?;
        if !self.path.is_empty() {
            write_escaped(f, &self.path)?;
            f.write_str(": ")?;
        }
        write_escaped(f, &self.message)
    }
}

/// The candidate closest to `word`, when one is close enough to be what was meant: at
/// most one edit (insertion, deletion, substitution or swap of two neighbours) per three
/// characters of the candidate, and at least one, ignoring case. Ties go to the first.
/// Spec diagnostics and the API's "not found" answers both suggest with it.
pub fn closest<'c>(word: &str, candidates: impl IntoIterator<Item = &'c str>) -> Option<&'c str> {
    let lower = word.to_lowercase();
    candidates
        .into_iter()
        .map(|c| {
            let distance = strsim::damerau_levenshtein(&lower, &c.to_lowercase());
            (distance, c)
        })
        .filter(|(distance, c)| *distance <= (c.chars().count() / 3).max(1))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, c)| c)
}

/// `text` with its control characters escaped as Rust writes them (`\n`, `\u{1b}`).
fn write_escaped(f: &mut fmt::Formatter<'_>, text: &str) -> fmt::Result {
    for c in text.chars() {
        if c.is_control() {
            write!(f, "{}", c.escape_default())?;
        } else {
            f.write_char(c)?;
        }
    }
    Ok(())
}

/// Whether `name` is written as it is in a path: letters, digits, `_` and `-`.
fn is_plain(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// A field path under construction: `spec.tasks[0].restart.delay`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldPath(String);

impl FieldPath {
    /// The path of a document's root.
    pub fn root() -> Self {
        FieldPath(String::new())
    }

    /// The path of field `name` below this one; a name that is not an identifier (an
    /// unknown key as written) is quoted, as [`FieldPath::key`] quotes it.
    pub fn field(&self, name: &str) -> Self {
        if !is_plain(name) {
            FieldPath(format!("{}[{name:?}]", self.0))
        } else if self.0.is_empty() {
            FieldPath(name.to_owned())
        } else {
            FieldPath(format!("{}.{name}", self.0))
        }
    }

    /// The path of item `index` of the sequence at this path.
    pub fn index(&self, index: usize) -> Self {
        FieldPath(format!("{}[{index}]", self.0))
    }

    /// The path of entry `key` of the map at this path (`env.PORT`, or `env["a.b"]`).
    pub fn key(&self, key: &str) -> Self {
        self.field(key)
    }

    /// The path as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closest_suggests_a_candidate_within_one_edit_per_three_characters() {
        let names = ["web", "worker", "db", "nightly-report"];
        for (word, expected) in [
            ("wbe", Some("web")),
            ("WEB", Some("web")),
            ("wb", Some("web")),
            ("workr", Some("worker")),
            ("dv", Some("db")),
            ("nightly-reprot", Some("nightly-report")),
            ("nightlyreport", Some("nightly-report")),
            ("api", None),
            ("w", None),
            ("queue", None),
        ] {
            assert_eq!(closest(word, names), expected, "{word}");
        }
        assert_eq!(closest("web", []), None);
    }

    #[test]
    fn diagnostics_display_as_file_line_column_path_message() {
        let d = Diagnostic::new(
            Path::new("specs/web.yaml"),
            Location::new(12, 7),
            FieldPath::root()
                .field("spec")
                .field("tasks")
                .index(1)
                .field("killTimeout")
                .as_str(),
            "invalid duration \"5x\"",
        );
        assert_eq!(
            d.to_string(),
            "specs/web.yaml:12:7: spec.tasks[1].killTimeout: invalid duration \"5x\""
        );
    }

    #[test]
    fn map_keys_that_are_not_identifiers_are_quoted_in_paths() {
        let p = FieldPath::root().field("metadata").field("labels");
        assert_eq!(p.key("team").as_str(), "metadata.labels.team");
        assert_eq!(
            p.key("example.com/tier").as_str(),
            "metadata.labels[\"example.com/tier\"]"
        );
    }

    #[test]
    fn a_diagnostic_is_one_line_whatever_the_keys_file_name_and_message_hold() {
        let path = FieldPath::root().field("spec").field("a\nb\u{1b}[31mRED");
        assert_eq!(path.as_str(), "spec[\"a\\nb\\u{1b}[31mRED\"]");
        let d = Diagnostic::new(
            Path::new("specs/x\ny\u{1b}.yaml"),
            Location::new(9, 7),
            path.as_str(),
            "unknown field \"a\nb\"",
        );
        let shown = d.to_string();
        assert!(
            !shown.contains('\n') && !shown.contains('\u{1b}'),
            "{shown}"
        );
        assert_eq!(
            shown,
            "specs/x\\ny\\u{1b}.yaml:9:7: spec[\"a\\nb\\u{1b}[31mRED\"]: unknown field \"a\\nb\""
        );
    }
}
