//! Enforces the invariants of ARCHITECTURE.md that the compiler does not.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use stead_tests::workspace_dir;

/// Every `.rs` file of the project, outside build output.
fn rust_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, files: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("readable directory") {
            let entry = entry.expect("readable entry");
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if entry.file_type().expect("file type").is_dir() {
                if !(name.starts_with('.')
                    || name == "target"
                    || name == "corpus"
                    || name == "artifacts")
                {
                    walk(&path, files);
                }
            } else if name.ends_with(".rs") {
                files.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(&workspace_dir(), &mut files);
    files.sort();
    files
}

fn relative(path: &Path) -> String {
    path.strip_prefix(workspace_dir())
        .expect("inside the workspace")
        .display()
        .to_string()
}

#[test]
fn every_rust_file_opens_with_a_module_doc_line() {
    let offenders: Vec<String> = rust_files()
        .into_iter()
        .filter(|path| {
            let text = std::fs::read_to_string(path).expect("readable source");
            !text.starts_with("//!")
        })
        .map(|p| relative(&p))
        .collect();
    assert!(
        offenders.is_empty(),
        "files without a leading `//!` line: {offenders:?}"
    );
}

/// What `cargo <args> --manifest-path <the workspace's>` prints, once it succeeded.
fn cargo_stdout(args: &[&str]) -> Vec<u8> {
    let output = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .args(args)
        .arg("--manifest-path")
        .arg(workspace_dir().join("Cargo.toml"))
        .output()
        .expect("cargo runs");
    assert!(
        output.status.success(),
        "cargo {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output.stdout
}

/// The transitive normal (non-dev, non-build) dependencies of each workspace package.
fn dependency_closure() -> BTreeMap<String, BTreeSet<String>> {
    let stdout = cargo_stdout(&["metadata", "--format-version", "1", "--locked"]);
    let metadata: serde_json::Value = serde_json::from_slice(&stdout).expect("json");
    let names: BTreeMap<&str, &str> = metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| {
            (
                p["id"].as_str().expect("id"),
                p["name"].as_str().expect("name"),
            )
        })
        .collect();
    let mut edges: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for node in metadata["resolve"]["nodes"]
        .as_array()
        .expect("resolve nodes")
    {
        let id = node["id"].as_str().expect("id");
        let normal = node["deps"]
            .as_array()
            .expect("deps")
            .iter()
            .filter(|dep| {
                dep["dep_kinds"]
                    .as_array()
                    .expect("dep kinds")
                    .iter()
                    .any(|k| k["kind"].is_null())
            })
            .map(|dep| dep["pkg"].as_str().expect("pkg"))
            .collect();
        edges.insert(id, normal);
    }
    let mut closure = BTreeMap::new();
    for member in metadata["workspace_members"].as_array().expect("members") {
        let root = member.as_str().expect("member id");
        let mut seen = BTreeSet::new();
        let mut stack = vec![root];
        while let Some(id) = stack.pop() {
            for dep in edges.get(id).into_iter().flatten() {
                if seen.insert(names[dep].to_owned()) {
                    stack.push(dep);
                }
            }
        }
        closure.insert(names[root].to_owned(), seen);
    }
    closure
}

/// The crates of `forbidden` that `package` depends on, even transitively.
fn forbidden_dependencies<'a>(
    closure: &'a BTreeMap<String, BTreeSet<String>>,
    package: &str,
    forbidden: &[&str],
) -> Vec<&'a String> {
    closure[package]
        .iter()
        .filter(|dep| forbidden.contains(&dep.as_str()))
        .collect()
}

#[test]
fn reconcilers_depend_on_no_runtime_storage_web_or_anyhow_crate() {
    let closure = dependency_closure();
    let forbidden = [
        "tokio",
        "rocksdb",
        "librocksdb-sys",
        "axum",
        "hyper",
        "anyhow",
        "mio",
        "notify",
    ];
    let found = forbidden_dependencies(&closure, "stead-reconcilers", &forbidden);
    assert!(found.is_empty(), "stead-reconcilers depends on {found:?}");
}

#[test]
fn the_runtime_depends_on_no_rocksdb_web_framework_argument_parser_or_http_client() {
    let closure = dependency_closure();
    let forbidden = [
        "rocksdb",
        "librocksdb-sys",
        "axum",
        "hyper",
        "clap",
        "reqwest",
        "anyhow",
    ];
    let found = forbidden_dependencies(&closure, "stead-runtime", &forbidden);
    assert!(found.is_empty(), "stead-runtime depends on {found:?}");
    // The one C++ build is the store's, and only the binary's crate brings the rest.
    assert!(closure["stead-store-rocksdb"].contains("librocksdb-sys"));
    assert!(closure["stead-controller"].contains("axum"));
}

#[test]
fn serde_derives_appear_only_in_schemas() {
    let format_free = [
        workspace_dir().join("reconcilers"),
        workspace_dir().join("controller"),
    ];
    let offenders: Vec<String> = rust_files()
        .into_iter()
        .filter(|path| format_free.iter().any(|dir| path.starts_with(dir)))
        .filter(|path| {
            let text = std::fs::read_to_string(path).expect("readable source");
            text.lines().any(|line| {
                line.trim_start().starts_with("#[derive(")
                    && (line.contains("Serialize") || line.contains("Deserialize"))
            })
        })
        .map(|p| relative(&p))
        .collect();
    assert!(
        offenders.is_empty(),
        "only stead-schemas defines formats, yet serde derives appear in {offenders:?}"
    );
}

#[test]
fn only_the_clock_module_reads_the_clock() {
    let clock = workspace_dir().join("controller/runtime/src/clock.rs");
    let offenders: Vec<String> = rust_files()
        .into_iter()
        .filter(|path| path != &clock && !path.starts_with(workspace_dir().join("tests")))
        .filter(|path| {
            let text = std::fs::read_to_string(path).expect("readable source");
            [
                "Instant::now(",
                "SystemTime::now(",
                "Utc::now(",
                "Local::now(",
            ]
            .iter()
            .any(|needle| text.contains(needle))
        })
        .map(|p| relative(&p))
        .collect();
    assert!(
        offenders.is_empty(),
        "clock reads outside controller/runtime/src/clock.rs: {offenders:?}"
    );
}

#[test]
fn reconcilers_clippy_config_forbids_clocks_io_and_sleep() {
    let config = std::fs::read_to_string(workspace_dir().join("reconcilers/clippy.toml"))
        .expect("reconcilers/clippy.toml exists");
    for needle in [
        "std::time::Instant::now",
        "std::time::SystemTime::now",
        "std::thread::sleep",
        "std::fs::",
    ] {
        assert!(
            config.contains(needle),
            "reconcilers/clippy.toml does not disallow {needle}"
        );
    }
}

/// The crates `package` links when built alone with `features` for `target`, as
/// `cargo tree` resolves them (features unified for that package only, as its own
/// build does; not the workspace's unified graph).
fn linked_crates(package: &str, features: &str, target: &str) -> BTreeSet<String> {
    let stdout = cargo_stdout(&[
        "tree",
        "--locked",
        "--edges",
        "normal",
        "--prefix",
        "none",
        "--format",
        "{p}",
        "--package",
        package,
        "--features",
        features,
        "--target",
        target,
    ]);
    String::from_utf8_lossy(&stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != package)
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_supervisor_links_only_crates_that_build_without_std_or_a_c_library() {
    // The shipped supervisor is freestanding (no C library, no `std`): every crate it
    // links must build that way. A crate is added here only once that is checked.
    let allowed = [
        // Raw system calls and their numbers.
        "rustix",
        "linux-raw-sys",
        "bitflags",
        // Typed errors (without its `std` feature), and its derive.
        "thiserror",
        "thiserror-impl",
        "proc-macro2",
        "quote",
        "syn",
        "unicode-ident",
        // The binary's heap.
        "talc",
        "allocator-api2",
        "spinning_top",
        "lock_api",
        "scopeguard",
    ];
    // The platform its own runtime runs on (elsewhere the release script ships the
    // standard library's): there rustix must not go through the C library.
    let target = "x86_64-unknown-linux-gnu";
    let linked = linked_crates("stead-supervisor", "runtime", target);
    let unexpected: Vec<&String> = linked
        .iter()
        .filter(|name| !allowed.contains(&name.as_str()))
        .collect();
    assert!(
        unexpected.is_empty(),
        "stead-supervisor links {unexpected:?} on {target}"
    );
    assert!(linked.contains("rustix"), "{linked:?}");
}

/// The first segment of `path`: up to the first character that cannot be in a name.
fn first_segment(path: &str) -> &str {
    let path = path.trim_start();
    let end = path
        .find(|c: char| !c.is_alphanumeric() && c != '_')
        .unwrap_or(path.len());
    &path[..end]
}

/// The first path segments named right after `crate::` in `code`: one, or each item's
/// of a `crate::{a, b::c}` group (braces nest; a group may span lines).
fn crate_paths(code: &str) -> Vec<&str> {
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        let Some(group) = rest.strip_prefix('{') else {
            found.push(first_segment(rest));
            continue;
        };
        // The group's top-level items, up to its closing brace.
        let (mut depth, mut start) = (0usize, 0usize);
        for (index, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    found.push(first_segment(&group[start..index]));
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    found.push(first_segment(&group[start..index]));
                    start = index + 1;
                }
                _ => {}
            }
        }
    }
    found
}

/// The modules (first path segment below the crate root) each module of the crate in
/// `src` refers to through `crate::`, leaving out comments and itself: its module graph.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in rust_files()
        .into_iter()
        .filter(|path| path.starts_with(src))
    {
        let relative = path.strip_prefix(src).expect("below src");
        let module = relative
            .components()
            .next()
            .expect("a file")
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_owned();
        if module == "lib" || module == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("readable source");
        let code: String = text
            .lines()
            .map(|line| line.split("//").next().unwrap_or_default())
            .collect::<Vec<_>>()
            .join(" ");
        let edges = graph.entry(module.clone()).or_default();
        for name in crate_paths(&code) {
            let is_module = !name.is_empty()
                && name.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                && name != module;
            if is_module {
                edges.insert(name.to_owned());
            }
        }
    }
    graph
}

#[test]
fn crate_paths_are_read_across_lines_and_nested_groups() {
    let code = "use crate::node::Node; use crate::{ alloc::{Worker, Start},  queue, \n  metrics::X, }; x = crate::errors::error_chain(e);";
    assert_eq!(
        crate_paths(code),
        ["node", "alloc", "queue", "metrics", "", "errors"]
    );
}

/// A cycle of `graph`, as the modules along it, when it has one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|n| n == node) {
            let mut cycle = path[start..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_module_graph_of_every_shell_crate_is_acyclic() {
    for krate in ["controller", "controller/runtime"] {
        let graph = module_graph(&workspace_dir().join(krate).join("src"));
        assert!(graph.len() >= 4, "{krate}: modules found: {graph:?}");
        if let Some(cycle) = find_cycle(&graph) {
            panic!(
                "{krate}: modules import each other in a circle: {}",
                cycle.join(" -> ")
            );
        }
    }
}

#[test]
fn the_cycle_check_finds_a_circle_of_modules() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("node", &["alloc", "queue"][..]),
        ("alloc", &["queue", "metrics"][..]),
        ("metrics", &["node"][..]),
        ("queue", &[][..]),
    ]
    .into_iter()
    .map(|(module, uses)| {
        (
            module.to_owned(),
            uses.iter().map(|u| (*u).to_owned()).collect(),
        )
    })
    .collect();
    assert_eq!(
        find_cycle(&graph),
        Some(
            ["alloc", "metrics", "node", "alloc"]
                .map(str::to_owned)
                .to_vec()
        )
    );
    let mut acyclic = graph;
    acyclic.insert("metrics".to_owned(), BTreeSet::new());
    assert_eq!(find_cycle(&acyclic), None);
}
