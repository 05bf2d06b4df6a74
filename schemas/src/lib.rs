//! stead's formats: the alloc spec (`stead/v1`), its validation and diagnostics, its
//! normalized form and revision, and the JSON Schema editors validate against.
//!
//! This is the only crate with serde derives: everything that reaches the wire or the
//! disk is defined here, and a change here is reviewed as a format change.

pub mod api;
pub mod config;
mod decode;
pub mod device;
pub mod diagnostic;
pub mod duration;
pub mod exec_stream;
pub mod fleet;
pub mod interpolate;
pub mod normalize;
pub mod record;
pub mod rules;
pub mod spec;
pub mod status;
pub mod time;
mod validate;
pub mod yaml;

pub use diagnostic::{Diagnostic, FieldPath, Location};
pub use duration::Duration;
pub use normalize::{AllocId, RestartPolicy, Revision, normalize};
pub use time::Timestamp;
pub use validate::{
    SpecDocument, SpecFile, ValidSpec, parse_spec_bytes, parse_spec_file, parse_stored_spec,
};
pub use yaml::MAX_SPEC_FILE_BYTES;

/// The JSON Schema of an alloc spec document, for editors and CI.
pub fn spec_json_schema() -> serde_json::Value {
    let schema = schemars::schema_for!(spec::AllocSpec);
    let mut schema = serde_json::to_value(schema).expect("a JSON Schema is JSON");
    let description = match schema.get("description").and_then(|d| d.as_str()) {
        Some(description) => format!("{description} {}", rules::ValidatorOnlyRule::schema_note()),
        None => rules::ValidatorOnlyRule::schema_note(),
    };
    schema["description"] = serde_json::Value::String(description);
    bound_integers(&mut schema);
    schema
}

/// Gives every integer schemars marks with its Rust type (`"format": "uint32"`) that
/// type's bounds as `minimum` and `maximum`, where no tighter bound is set: validators
/// need not assert such formats, and the decoder refuses what the type cannot hold.
fn bound_integers(schema: &mut serde_json::Value) {
    match schema {
        serde_json::Value::Object(object) => {
            let bounds: Option<(serde_json::Value, serde_json::Value)> =
                match object.get("format").and_then(|f| f.as_str()) {
                    Some("uint16") => Some((0.into(), u16::MAX.into())),
                    Some("uint32") => Some((0.into(), u32::MAX.into())),
                    Some("uint64") => Some((0.into(), u64::MAX.into())),
                    Some("int32") => Some((i32::MIN.into(), i32::MAX.into())),
                    _ => None,
                };
            if let Some((min, max)) = bounds {
                object.entry("minimum").or_insert(min);
                object.entry("maximum").or_insert(max);
            }
            object.values_mut().for_each(bound_integers);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(bound_integers),
        _ => {}
    }
}
