//! Every invalid spec fixture yields exactly its snapshot of diagnostics, and every
//! example in `deploy/examples` is valid.

use std::path::Path;

use stead_tests::{check_snapshot, package_dir, stead, workspace_dir};

fn fixture_paths(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("fixture directory exists")
        .map(|e| {
            e.expect("readable entry")
                .file_name()
                .into_string()
                .expect("utf-8 name")
        })
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    names.sort();
    names
}

#[test]
fn every_invalid_fixture_reports_exactly_its_expected_diagnostics() {
    check_fixtures("invalid", 40);
}

#[test]
fn every_tricky_spec_reports_exactly_its_expected_diagnostics() {
    check_fixtures("tricky", 19);
}

/// Runs `stead validate` on every fixture of `fixtures/<dir>` (at least `at_least`) and
/// compares its output with the fixture's `.expected` snapshot.
fn check_fixtures(dir_name: &str, at_least: usize) {
    let dir = package_dir().join("fixtures").join(dir_name);
    let names = fixture_paths(&dir);
    assert!(
        names.len() >= at_least,
        "only {} {dir_name} fixtures",
        names.len()
    );
    // Relative paths keep the snapshots independent of where the checkout lives: cargo
    // runs the tests in the package dir, which this test must not change for the others.
    assert_eq!(
        std::env::current_dir().expect("a working directory"),
        package_dir(),
        "the tests run in the package dir"
    );
    let mut failures = Vec::new();
    for name in &names {
        let relative = format!("fixtures/{dir_name}/{name}");
        let (code, out, err) = stead(&["validate", &relative]);
        if code != 1 {
            failures.push(format!("{name}: exit code {code}, expected 1\n{out}{err}"));
            continue;
        }
        let snapshot = dir.join(name.replace(".yaml", ".expected"));
        if let Err(difference) = check_snapshot(&snapshot, &out) {
            failures.push(difference);
        }
        // Every diagnostic carries a file, a line and a column.
        for line in out.lines().filter(|l| l.starts_with("fixtures/")) {
            let mut parts = line.splitn(4, ':');
            let (_, line_no, column) = (parts.next(), parts.next(), parts.next());
            let located = line_no.is_some_and(|l| l.parse::<u32>().is_ok_and(|l| l > 0))
                && column.is_some_and(|c| c.parse::<u32>().is_ok_and(|c| c > 0));
            if !located {
                failures.push(format!(
                    "{name}: diagnostic without line and column: {line}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn a_ten_megabyte_file_is_refused_without_being_parsed() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("huge.yaml");
    let mut text =
        String::from("apiVersion: stead/v1\nkind: Alloc\nmetadata:\n  name: huge\n  labels:\n");
    let mut i = 0;
    while text.len() < 10 * 1024 * 1024 {
        text.push_str(&format!("    key{i}: \"{}\"\n", "x".repeat(100)));
        i += 1;
    }
    std::fs::write(&path, &text).expect("write the file");
    let (code, out, _) = stead(&["validate", path.to_str().expect("utf-8 path")]);
    assert_eq!(code, 1);
    assert!(
        out.starts_with(&format!(
            "{}:1:1: file is larger than 1048576 bytes, the most a spec file may have\n",
            path.display()
        )),
        "{out}"
    );
}

#[test]
fn validating_a_directory_without_spec_files_fails_naming_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("web.YAML"), "").expect("write");
    std::fs::write(dir.path().join("notes.txt"), "").expect("write");
    let path = dir.path().to_str().expect("utf-8 path");
    let (code, out, _) = stead(&["validate", path]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(
        out,
        format!(
            "{path}:1:1: no spec files here: a spec file ends in .yaml or .yml\n0 files checked, 0 allocs valid, 1 problem\n"
        )
    );
}

#[test]
fn every_example_in_deploy_is_valid() {
    let examples = workspace_dir().join("deploy/examples");
    let (code, out, err) = stead(&["validate", examples.to_str().expect("utf-8 path")]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("3 files checked, 3 allocs valid, 0 problems"),
        "{out}"
    );
}
