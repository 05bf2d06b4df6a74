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
pub mod normalize;
pub mod record;
pub mod spec;
pub mod status;
pub mod time;
mod validate;
pub mod yaml;

pub use diagnostic::{Diagnostic, FieldPath, Location};
pub use duration::Duration;
pub use normalize::{AllocId, RestartPolicy, Revision, normalize};
pub use time::Timestamp;
pub use validate::{SpecDocument, SpecFile, ValidSpec, parse_spec_bytes, parse_spec_file};
pub use yaml::MAX_SPEC_FILE_BYTES;

/// The JSON Schema of an alloc spec document, for editors and CI.
pub fn spec_json_schema() -> serde_json::Value {
    let schema = schemars::schema_for!(spec::AllocSpec);
    serde_json::to_value(schema).expect("a JSON Schema is JSON")
}
