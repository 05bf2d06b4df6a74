//! A YAML document as a tree of located nodes, parsed by serde-saphyr within a budget.
//!
//! The spec decoder walks this tree rather than deserializing straight into the spec
//! types, so that it can report every problem at once, each at its own line and column.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::{Budget, DuplicateKeyPolicy, Options, Spanned};

use crate::diagnostic::Location;

/// The largest spec file accepted, in bytes. Specs are small; anything larger is a
/// mistake or an attack, and is refused before it is parsed.
pub const MAX_SPEC_FILE_BYTES: usize = 1024 * 1024;

/// The deepest nesting of sequences and mappings accepted; specs need about eight.
const MAX_DEPTH: usize = 32;

/// One YAML node and where it starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// Where the node starts in its file.
    pub location: Location,
    /// What the node holds.
    pub value: Value,
}

/// The content of a [`Node`].
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `null`, `~` or an empty value.
    Null,
    /// `true` or `false` (YAML 1.2: `yes`, `on` and the like are strings).
    Bool(bool),
    /// A whole number.
    Integer(i128),
    /// A number with a fraction or an exponent.
    Float(f64),
    /// Any other scalar.
    String(String),
    /// A sequence, in order.
    Sequence(Vec<Node>),
    /// A mapping, entries in document order. Keys may repeat: the parser lets duplicates
    /// through so that each document reports its own (see `decode::report_duplicate_keys`).
    Mapping(Vec<(Node, Node)>),
}

impl Value {
    /// The name of this kind of value, as used in "expected a string, found …" messages.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Integer(_) => "an integer",
            Value::Float(_) => "a number",
            Value::String(_) => "a string",
            Value::Sequence(_) => "a sequence",
            Value::Mapping(_) => "a mapping",
        }
    }

    /// This value as JSON, for validating documents against the JSON Schema.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Value::Null => serde_json::Value::Null,
            Value::Bool(b) => serde_json::Value::Bool(*b),
            Value::Integer(i) => match (i64::try_from(*i), u64::try_from(*i)) {
                (Ok(i), _) => serde_json::Value::from(i),
                (_, Ok(u)) => serde_json::Value::from(u),
                _ => serde_json::Value::from(*i as f64),
            },
            Value::Float(f) => serde_json::Value::from(*f),
            Value::String(s) => serde_json::Value::String(s.clone()),
            Value::Sequence(items) => items.iter().map(|n| n.value.to_json()).collect(),
            // A repeated key keeps its first value, as the decoder reads it.
            Value::Mapping(entries) => {
                let mut object = serde_json::Map::new();
                for (k, v) in entries {
                    object
                        .entry(k.value.key_text())
                        .or_insert_with(|| v.value.to_json());
                }
                serde_json::Value::Object(object)
            }
        }
    }

    /// The text of a mapping key, however it was typed (`1: x` has the key `1`).
    pub fn key_text(&self) -> String {
        match self {
            Value::Null => "null".to_owned(),
            Value::Bool(b) => b.to_string(),
            Value::Integer(i) => i.to_string(),
            Value::Float(f) => f.to_string(),
            Value::String(s) => s.clone(),
            Value::Sequence(_) => "[…]".to_owned(),
            Value::Mapping(_) => "{…}".to_owned(),
        }
    }
}

/// A file that could not be parsed as YAML; the first problem found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// Where the problem is.
    pub location: Location,
    /// What is wrong, lowercase, without the location.
    pub message: String,
}

impl ParseError {
    /// The error for a file over [`MAX_SPEC_FILE_BYTES`].
    pub fn too_large() -> Self {
        ParseError {
            location: Location::START,
            message: format!(
                "file is larger than {MAX_SPEC_FILE_BYTES} bytes, the most a spec file may have"
            ),
        }
    }
}

/// Parses every document of a YAML stream. Empty documents are skipped.
///
/// Duplicate keys are kept, in order, for the decoder to report per document (as a parse
/// error one duplicate would cost every document of its file). A budget caps events,
/// aliases and nesting, so that an alias-expansion bomb or a deeply nested file fails fast
/// instead of eating memory.
pub fn parse_documents(source: &str) -> Result<Vec<Node>, ParseError> {
    if source.len() > MAX_SPEC_FILE_BYTES {
        return Err(ParseError::too_large());
    }
    let mut options = Options::default();
    options.duplicate_keys = DuplicateKeyPolicy::PassThrough;
    // YAML 1.2: only `true` and `false` (any case of the first letter, or all caps) are
    // booleans; `yes`, `on`, `y` and the like are text, as editors and the JSON Schema
    // read them (0068).
    options.strict_booleans = true;
    options.with_snippet = false;
    let mut budget = Budget::default();
    budget.max_events = 200_000;
    budget.max_aliases = 1_000;
    budget.max_anchors = 1_000;
    budget.max_depth = MAX_DEPTH;
    options.budget = Some(budget);
    options.alias_limits.max_total_replayed_events = 10_000;
    let documents: Vec<Spanned<Value>> =
        serde_saphyr::from_str_multiple_with_options(source, options).map_err(|error| {
            let location = error
                .location()
                .map(|l| Location::new(l.line(), l.column()))
                .unwrap_or(Location::START);
            ParseError {
                location,
                message: plain_message(&error),
            }
        })?;
    Ok(documents.into_iter().map(node_from_spanned).collect())
}

fn node_from_spanned(spanned: Spanned<Value>) -> Node {
    Node {
        location: Location::new(spanned.referenced.line(), spanned.referenced.column()),
        value: spanned.value,
    }
}

/// The parser's message in our words where we have better ones (budget breaches), else
/// its own message: one line, lowercase first letter, no location,
/// no final period.
fn plain_message(error: &serde_saphyr::Error) -> String {
    use serde_saphyr::Error as E;
    use serde_saphyr::budget::BudgetBreach as B;
    let mut inner = error;
    while let E::AliasError { error, .. } | E::WithSnippet { error, .. } = inner {
        inner = error;
    }
    match inner {
        E::AliasReplayLimitExceeded { .. }
        | E::AliasExpansionLimitExceeded { .. }
        | E::AliasReplayStackDepthExceeded { .. }
        | E::AliasReplayCounterOverflow { .. }
        | E::Budget {
            breach: B::Aliases { .. } | B::Anchors { .. },
            ..
        } => {
            return "anchors and aliases expand too much; a spec may not use aliases to multiply its size".to_owned();
        }
        E::Budget {
            breach: B::Depth { .. },
            ..
        } => return format!("nesting is deeper than {MAX_DEPTH} levels"),
        E::Budget { .. } => return "file is too large or complex to be a spec".to_owned(),
        _ => {}
    }
    let mut rendered = inner.to_string();
    if let Some(location) = error.location() {
        for suffix in [
            format!(" at line {}, column {}", location.line(), location.column()),
            format!(" at line {} column {}", location.line(), location.column()),
        ] {
            if let Some(stripped) = rendered.strip_suffix(&suffix) {
                rendered = stripped.to_owned();
            }
        }
    }
    let rendered = rendered.lines().next().unwrap_or_default().trim();
    let rendered = rendered.trim_end_matches('.');
    let mut chars = rendered.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => "invalid yaml".to_owned(),
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ValueVisitor)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("any yaml value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        Value::deserialize(deserializer)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Integer(v.into()))
    }
    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Value, E> {
        Ok(Value::Integer(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Integer(v.into()))
    }
    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Value, E> {
        match i128::try_from(v) {
            Ok(v) => Ok(Value::Integer(v)),
            Err(_) => Ok(Value::Float(v as f64)),
        }
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Ok(Value::Float(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Value, E> {
        Ok(Value::String(String::from_utf8_lossy(v).into_owned()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Spanned<Value>>()? {
            items.push(node_from_spanned(item));
        }
        Ok(Value::Sequence(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<Spanned<Value>>()? {
            let value = map.next_value::<Spanned<Value>>()?;
            entries.push((node_from_spanned(key), node_from_spanned(value)));
        }
        Ok(Value::Mapping(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_carry_the_line_and_column_where_they_start() {
        let docs = parse_documents("a: 1\nb:\n  - x\n  - {c: true}\n---\nd: ~\n").unwrap();
        assert_eq!(docs.len(), 2);
        let Value::Mapping(entries) = &docs[0].value else {
            panic!("not a mapping")
        };
        assert_eq!(entries[0].0.location, Location::new(1, 1));
        assert_eq!(entries[0].1.value, Value::Integer(1));
        assert_eq!(entries[0].1.location, Location::new(1, 4));
        let Value::Sequence(items) = &entries[1].1.value else {
            panic!("not a sequence")
        };
        assert_eq!(items[0].location, Location::new(3, 5));
        assert_eq!(items[1].location, Location::new(4, 5));
        let Value::Mapping(second) = &docs[1].value else {
            panic!("not a mapping")
        };
        assert_eq!(second[0].1.value, Value::Null);
    }

    #[test]
    fn duplicate_keys_reach_the_tree_in_order_with_their_locations() {
        let docs = parse_documents("a: 1\nb: {c: 2, c: 3}\na: 4\n---\nd: 5\n").unwrap();
        assert_eq!(
            docs.len(),
            2,
            "a duplicate fails no document at parse level"
        );
        let Value::Mapping(entries) = &docs[0].value else {
            panic!("not a mapping")
        };
        let keys: Vec<(String, Location)> = entries
            .iter()
            .map(|(k, _)| (k.value.key_text(), k.location))
            .collect();
        assert_eq!(
            keys,
            [
                ("a".to_owned(), Location::new(1, 1)),
                ("b".to_owned(), Location::new(2, 1)),
                ("a".to_owned(), Location::new(3, 1)),
            ]
        );
        assert_eq!(entries[2].1.value, Value::Integer(4));
        let Value::Mapping(inner) = &entries[1].1.value else {
            panic!("not a mapping")
        };
        assert_eq!(inner.len(), 2);
        assert_eq!(inner[1].0.location, Location::new(2, 11));
    }

    #[test]
    fn yes_and_on_are_strings_and_a_repeated_key_keeps_its_first_value_in_json() {
        let docs = parse_documents("a: yes\nb: on\nc: True\nd: 1\nd: 2\n").unwrap();
        assert_eq!(
            docs[0].value.to_json(),
            serde_json::json!({"a": "yes", "b": "on", "c": true, "d": 1})
        );
    }

    #[test]
    fn an_alias_bomb_is_refused() {
        let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for (prev, name) in ["a", "b", "c", "d", "e", "f", "g", "h", "i"]
            .iter()
            .zip(["b", "c", "d", "e", "f", "g", "h", "i", "j"])
        {
            bomb.push_str(&format!(
                "{name}: &{name} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"
            ));
        }
        let error = parse_documents(&bomb).unwrap_err();
        assert!(!error.message.is_empty());
    }
}
