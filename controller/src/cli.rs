//! The `stead` command line: argument parsing, the commands that need no agent
//! (`validate`, `schema`), and the commands that ask a running agent over its HTTP API
//! (`alloc …`, `node status`).
//!
//! [`run`] is the entry point: tests call it in-process with their own output buffers.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use serde_json::json;
use stead_schemas::{Diagnostic, Location, SpecFile, parse_spec_bytes};

use crate::spec_files::{collect_spec_files, read_spec_file};

mod client;
mod exec;
mod fleet;
mod remote;
mod render;
mod token;

/// Exit code: everything was valid.
pub const EXIT_OK: u8 = 0;
/// Exit code: something was invalid or unreadable.
pub const EXIT_INVALID: u8 = 1;
/// Exit code: the command line itself was wrong.
pub const EXIT_USAGE: u8 = 2;

/// What `stead --help` opens with: what stead is.
pub const ABOUT: &str =
    "stead: a node agent that keeps the allocs declared in YAML files running exactly as declared";
/// What `stead --help` (not `-h`) ends with: what an alloc is and what the commands do.
const MORE_ABOUT: &str = "An alloc is a group of tasks (processes) that live and die together. \
`stead agent` watches a directory of alloc specs and converges the node on them: it starts, \
restarts (Nomad's restart policies), stops and replaces tasks, keeps its state in an \
embedded store that survives crashes, and leaves tasks running across its own restarts. \
The other commands validate specs and talk to a running agent's HTTP API.";

/// The `stead` command line.
#[derive(Debug, Parser)]
#[command(
    name = "stead",
    version,
    about = ABOUT,
    long_about = None,
    after_long_help = MORE_ABOUT,
    max_term_width = 100
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Check spec files (or directories of them) and print every problem found.
    ///
    /// Exits 0 when all are valid, 1 when any is not, 2 on a usage error.
    Validate {
        /// Files or directories; directories are searched recursively for *.yaml and *.yml,
        /// skipping hidden files and editor temporaries.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print the JSON Schema of the alloc spec, for editors.
    Schema,
    /// Inspect and act on the agent's allocs.
    Alloc {
        #[command(flatten)]
        client: remote::ClientArgs,
        #[command(subcommand)]
        command: remote::AllocCommand,
    },
    /// Inspect the node the agent runs on.
    Node {
        #[command(flatten)]
        client: remote::ClientArgs,
        #[command(subcommand)]
        command: remote::NodeCommand,
    },
    /// Edit and show a fleet's desired allocs and status in etcd.
    Fleet {
        #[command(flatten)]
        fleet: fleet::FleetArgs,
        #[command(subcommand)]
        command: fleet::FleetCommand,
    },
    /// Run the agent: keep the allocs declared in the specs directory running.
    Agent(crate::agent::AgentArgs),
}

/// Runs the CLI with `args` (the first is the program name) and returns the exit code.
pub fn run(
    args: impl IntoIterator<Item = impl Into<OsString> + Clone>,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> u8 {
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(error) => {
            let code = if error.use_stderr() {
                EXIT_USAGE
            } else {
                EXIT_OK
            };
            let rendered = error.render().to_string();
            let target: &mut dyn Write = if error.use_stderr() { err } else { out };
            // Nothing sensible is left to do when the terminal is gone.
            let _ = target.write_all(rendered.as_bytes());
            return code;
        }
    };
    let result = match cli.command {
        Command::Validate { paths, json } => validate(&paths, json, out),
        Command::Schema => schema(out),
        Command::Alloc { client, command } => remote::alloc(&client, command, out, err),
        Command::Node { client, command } => remote::node(&client, command, out),
        Command::Fleet { fleet, command } => fleet::run(&fleet, command, out),
        Command::Agent(args) => crate::agent::main(&args),
    };
    result.unwrap_or_else(|error| {
        let message = format!("{error:#}");
        let _ = writeln!(err, "error: {}", render::terminal_text(&message));
        EXIT_INVALID
    })
}

fn schema(out: &mut dyn Write) -> anyhow::Result<u8> {
    let schema = serde_json::to_string_pretty(&stead_schemas::spec_json_schema())?;
    writeln!(out, "{schema}").context("writing the schema")?;
    Ok(EXIT_OK)
}

/// What is wrong with the spec files found at `paths` before any is read: the entries
/// that could not be listed, and nothing found at all (a mistyped path or extension is a
/// mistake, not a success).
fn listing_problems(
    paths: &[PathBuf],
    files: &[crate::spec_files::FoundSpec],
    unreadable: &[crate::spec_files::SpecFileError],
) -> Vec<Diagnostic> {
    let mut diagnostics: Vec<Diagnostic> = unreadable
        .iter()
        .map(|e| {
            Diagnostic::new(
                &e.path,
                Location::START,
                "",
                format!("cannot read: {}", e.source),
            )
        })
        .collect();
    if files.is_empty() && unreadable.is_empty() {
        for path in paths {
            diagnostics.push(Diagnostic::new(
                path,
                Location::START,
                "",
                "no spec files here: a spec file ends in .yaml or .yml",
            ));
        }
    }
    diagnostics
}

fn validate(paths: &[PathBuf], as_json: bool, out: &mut dyn Write) -> anyhow::Result<u8> {
    let (files, unreadable) = collect_spec_files(paths);
    let mut diagnostics = listing_problems(paths, &files, &unreadable);
    let mut parsed: Vec<SpecFile> = Vec::new();
    for path in files.iter().map(|found| &found.path) {
        match read_spec_file(path) {
            Ok(bytes) => parsed.push(parse_spec_bytes(path, &bytes)),
            Err(error) => diagnostics.push(Diagnostic::new(
                path,
                Location::START,
                "",
                format!("cannot read: {error}"),
            )),
        }
    }
    // An alloc name may be declared once on a node, whichever file declares it.
    let mut declared: BTreeMap<String, (PathBuf, Location)> = BTreeMap::new();
    for file in &parsed {
        diagnostics.extend(file.all_diagnostics());
        for document in &file.documents {
            let Some(name) = &document.name else { continue };
            match declared.get(name.as_str()) {
                Some((first, at)) if first != &file.path => diagnostics.push(Diagnostic::new(
                    &file.path,
                    document.location,
                    "metadata.name",
                    format!(
                        "alloc {:?} is already declared in {}:{at}",
                        name.as_str(),
                        first.display()
                    ),
                )),
                Some(_) => {}
                None => {
                    declared.insert(
                        name.as_str().to_owned(),
                        (file.path.clone(), document.location),
                    );
                }
            }
        }
    }
    let specs: Vec<_> = parsed
        .iter()
        .flat_map(|f| f.specs().map(move |s| (&f.path, s)))
        .collect();
    if as_json {
        let document = json!({
            "valid": diagnostics.is_empty(),
            "files": files.len(),
            "allocs": specs.iter().map(|(path, spec)| json!({
                "file": path,
                "name": spec.name().as_str(),
                "id": spec.id.as_str(),
                "revision": spec.revision.as_str(),
            })).collect::<Vec<_>>(),
            "diagnostics": diagnostics,
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&document)?)?;
    } else {
        for diagnostic in &diagnostics {
            writeln!(out, "{diagnostic}")?;
        }
        if diagnostics.is_empty() {
            for (path, spec) in &specs {
                writeln!(out, "{}: {} ok", path.display(), spec.id)?;
            }
        }
        let problems = diagnostics.len();
        writeln!(
            out,
            "{} {} checked, {} {} valid, {problems} {}",
            files.len(),
            plural(files.len(), "file", "files"),
            specs.len(),
            plural(specs.len(), "alloc", "allocs"),
            plural(problems, "problem", "problems"),
        )?;
    }
    Ok(if diagnostics.is_empty() {
        EXIT_OK
    } else {
        EXIT_INVALID
    })
}

fn plural<'a>(n: usize, one: &'a str, many: &'a str) -> &'a str {
    if n == 1 { one } else { many }
}

#[cfg(test)]
mod help_tests {
    use super::*;

    #[test]
    fn help_opens_with_what_stead_is_not_the_crate_description() {
        for flag in ["-h", "--help"] {
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let code = run(["stead", flag], &mut out, &mut err);
            assert_eq!(code, EXIT_OK);
            let text = String::from_utf8(out).expect("utf-8");
            assert!(
                text.starts_with(ABOUT),
                "`stead {flag}` opens with what stead is:\n{text}"
            );
            assert!(!text.contains("stead's shell"), "{text}");
        }
    }
}
