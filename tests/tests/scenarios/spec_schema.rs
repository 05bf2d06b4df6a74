//! `stead schema` prints a JSON Schema that agrees with the validator: every example
//! validates against it, and structural mistakes fail it too.

use stead_schemas::yaml::parse_documents;
use stead_tests::{package_dir, stead, workspace_dir};

/// The schema exactly as the CLI prints it.
fn printed_schema() -> serde_json::Value {
    let (code, out, err) = stead(&["schema"]);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).expect("stead schema prints JSON")
}

/// The documents of a YAML file as JSON values.
fn documents_as_json(path: &std::path::Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).expect("readable file");
    parse_documents(&text)
        .expect("parsable yaml")
        .iter()
        .map(|node| node.value.to_json())
        .collect()
}

#[test]
fn every_example_validates_against_the_printed_schema() {
    let validator = jsonschema::validator_for(&printed_schema()).expect("a valid JSON Schema");
    let mut checked = 0;
    for entry in std::fs::read_dir(workspace_dir().join("deploy/examples")).expect("examples") {
        let path = entry.expect("entry").path();
        for document in documents_as_json(&path) {
            let errors: Vec<String> = validator
                .iter_errors(&document)
                .map(|e| format!("{}: {e}", e.instance_path()))
                .collect();
            assert!(errors.is_empty(), "{}: {errors:#?}", path.display());
            checked += 1;
        }
    }
    assert!(checked >= 3, "only {checked} example documents");
}

#[test]
fn the_schema_rejects_structural_mistakes_the_validator_rejects() {
    let validator = jsonschema::validator_for(&printed_schema()).expect("a valid JSON Schema");
    let fixtures = [
        "unknown-top-level-field",
        "unknown-task-field",
        "unknown-resources-field",
        "unknown-mock-option",
        "unknown-exec-option",
        "unknown-driver",
        "exec-without-command",
        "bad-name-dot-dot",
        "bad-name-too-long",
        "bad-duration-unit",
        "bad-duration-without-unit",
        "bad-restart-mode",
        "bad-signal",
        "check-bad-values",
        "check-out-of-range",
        "kill-signal-stop-cont",
        "wrong-type-env-integer",
        "wrong-type-tasks-mapping",
        "wrong-api-version",
        "no-tasks",
        "device-count-zero",
        "resources-below-minimums",
        "resources-limit-dependencies",
        "disk-size-below-minimum",
    ];
    for name in fixtures {
        let path = package_dir().join(format!("fixtures/invalid/{name}.yaml"));
        for document in documents_as_json(&path) {
            assert!(
                !validator.is_valid(&document),
                "{name}: the schema accepts what the validator rejects"
            );
        }
    }
}

#[test]
fn the_schema_needs_memory_under_a_memory_maximum_and_cpu_under_a_hard_cpu_limit() {
    let validator = jsonschema::validator_for(&printed_schema()).expect("a valid JSON Schema");
    let with = |resources: serde_json::Value| {
        serde_json::json!({
            "apiVersion": "stead/v1",
            "kind": "Alloc",
            "metadata": {"name": "web"},
            "spec": {"tasks": [{
                "name": "main",
                "driver": "exec",
                "config": {"command": "/bin/true"},
                "resources": resources,
            }]},
        })
    };
    for (resources, valid) in [
        (
            serde_json::json!({"memoryMB": 64, "memoryMaxMB": 128}),
            true,
        ),
        (serde_json::json!({"memoryMaxMB": 128}), false),
        (serde_json::json!({"cpu": 100, "cpuHardLimit": true}), true),
        (serde_json::json!({"cpuHardLimit": true}), false),
        (serde_json::json!({"cpuHardLimit": false}), true),
        (serde_json::json!({"pids": 0}), false),
        (serde_json::json!({"pids": 5, "oomKillGroup": true}), true),
    ] {
        assert_eq!(
            validator.is_valid(&with(resources.clone())),
            valid,
            "{resources}"
        );
    }
}

#[test]
fn the_duration_pattern_agrees_with_the_duration_parser() {
    let schema = serde_json::json!({
        "type": "string",
        "pattern": stead_schemas::duration::DURATION_PATTERN,
    });
    let validator = jsonschema::validator_for(&schema).expect("a valid pattern");
    for text in [
        "0", "15s", "1h30m", "1.5s", "250ms", "2us", "7ns", "15", "5d", "-1s", "s", "1h 30m", "",
    ] {
        let parses = text.parse::<stead_schemas::Duration>().is_ok();
        let matches = validator.is_valid(&serde_json::json!(text));
        assert_eq!(
            parses, matches,
            "{text:?}: parser says {parses}, pattern says {matches}"
        );
    }
}
