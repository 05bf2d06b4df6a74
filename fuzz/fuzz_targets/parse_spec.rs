//! Fuzzes the spec parser: any input must parse without panicking, and the result must
//! hold the invariants every `SpecFile` promises.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use stead_schemas::parse_spec_bytes;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.yaml");
    let file = parse_spec_bytes(path, data);

    let all = file.all_diagnostics();
    for diagnostic in &all {
        assert!(diagnostic.location.line >= 1, "line 0: {diagnostic:?}");
        assert!(diagnostic.location.column >= 1, "column 0: {diagnostic:?}");
    }
    assert_eq!(file.is_valid(), all.is_empty(), "is_valid disagrees: {all:?}");
    for document in &file.documents {
        assert_eq!(
            document.spec.is_some(),
            document.diagnostics.is_empty(),
            "spec and diagnostics disagree: {document:?}"
        );
    }

    // A valid spec survives a round trip through YAML unchanged.
    for spec in file.specs() {
        let yaml = serde_saphyr::to_string(&spec.spec).expect("a valid spec serializes");
        let again = parse_spec_bytes(path, yaml.as_bytes());
        let respecs: Vec<_> = again.specs().collect();
        assert!(
            again.is_valid() && respecs.len() == 1,
            "re-serialized spec does not parse back: {:?}\n---\n{yaml}",
            again.all_diagnostics()
        );
        assert_eq!(respecs[0].spec, spec.spec, "round trip changed the spec:\n{yaml}");
        assert_eq!(respecs[0].revision, spec.revision, "round trip changed the revision");
    }
});
