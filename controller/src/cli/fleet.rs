//! `stead fleet …`: the fleet's desired allocs and status in etcd, edited and shown.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use etcd_client::{Client, GetOptions};
use stead_schemas::fleet::{DEFAULT_PREFIX, FleetAllocStatus, FleetNodeStatus};
use stead_schemas::spec::Name;
use stead_schemas::{Diagnostic, Location, parse_spec_bytes};

use super::{EXIT_INVALID, EXIT_OK};
use crate::fleet::{FleetKeys, KeyEdit, Target};
use crate::spec_files::{collect_spec_files, read_spec_file};

/// Where the fleet is.
#[derive(Debug, Args)]
pub(super) struct FleetArgs {
    /// The etcd cluster's client URLs, comma-separated.
    #[arg(long, env = "STEAD_ETCD", value_delimiter = ',', global = true)]
    etcd: Vec<String>,
    /// The key prefix.
    #[arg(long, default_value = DEFAULT_PREFIX, global = true)]
    prefix: String,
}

/// Which node's keys a command edits.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub(super) struct TargetArgs {
    /// One node.
    #[arg(long)]
    node: Option<String>,
    /// Every node whose labels the spec's `metadata.nodeSelector` matches.
    #[arg(long)]
    all: bool,
}

/// What `apply` and `diff` take.
#[derive(Debug, Args)]
pub(super) struct ApplyArgs {
    /// Spec files or directories of them.
    #[arg(short = 'f', long = "file", required = true)]
    files: Vec<PathBuf>,
    #[command(flatten)]
    target: TargetArgs,
    /// Also delete (or, for `diff`, show) the target's allocs the files do not declare.
    #[arg(long)]
    prune: bool,
}

/// `stead fleet …`.
#[derive(Debug, Subcommand)]
pub(super) enum FleetCommand {
    /// Validate spec files, then write each alloc under a node's key (or `_all`), printing
    /// what changes; a key edited by someone else meanwhile is a conflict.
    Apply(ApplyArgs),
    /// Print what `apply` would change (with a diff of each key), without changing it;
    /// exits 1 when something would.
    Diff(ApplyArgs),
    /// Delete an alloc's key: the node (or every node) stops and removes it.
    Delete {
        /// The alloc.
        alloc: String,
        #[command(flatten)]
        target: TargetArgs,
    },
    /// Every node: up or down (by its lease), its allocs by client status, the age of its
    /// newest status, and its failing allocs with their last event.
    Status {
        /// Only this node.
        #[arg(long)]
        node: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The nodes that claim a name now, with their labels.
    Nodes {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Runs a `stead fleet` command.
pub(super) fn run(
    args: &FleetArgs,
    command: FleetCommand,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    if args.etcd.is_empty() {
        bail!("no etcd cluster named: give --etcd URLS or set STEAD_ETCD");
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(async {
        let client = crate::fleet::connect(&args.etcd, Some(std::time::Duration::from_secs(10)))
            .await
            .context("connecting to etcd")?;
        let keys = FleetKeys::new(&args.prefix);
        match command {
            FleetCommand::Apply(args) => apply(&client, &keys, &args, true, out).await,
            FleetCommand::Diff(args) => apply(&client, &keys, &args, false, out).await,
            FleetCommand::Delete { alloc, target } => {
                delete(&client, &keys, &alloc, &target, out).await
            }
            FleetCommand::Status { node, json } => {
                status(&client, &keys, node.as_deref(), json, out).await
            }
            FleetCommand::Nodes { json } => nodes(&client, &keys, json, out).await,
        }
    })
}

impl TargetArgs {
    fn target(&self) -> anyhow::Result<Target> {
        match (&self.node, self.all) {
            (Some(node), false) => {
                node.parse::<Name>()
                    .map_err(|why| anyhow::anyhow!("--node: {why}"))?;
                Ok(Target::Node(node.clone()))
            }
            _ => Ok(Target::All),
        }
    }
}

/// One spec to write: its alloc and its document's text.
struct Document {
    alloc: Name,
    text: String,
    path: PathBuf,
}

/// Reads and validates `paths`: the documents, or every problem found.
fn read_documents(paths: &[PathBuf]) -> Result<Vec<Document>, Vec<Diagnostic>> {
    let (files, unreadable) = collect_spec_files(paths);
    let mut problems = super::listing_problems(paths, &files, &unreadable);
    let mut documents = Vec::new();
    let mut declared: BTreeMap<Name, PathBuf> = BTreeMap::new();
    for found in files {
        let bytes = match read_spec_file(&found.path) {
            Ok(bytes) => bytes,
            Err(error) => {
                problems.push(Diagnostic::new(
                    &found.path,
                    Location::START,
                    "",
                    format!("cannot read: {error}"),
                ));
                continue;
            }
        };
        let file = parse_spec_bytes(&found.path, &bytes);
        problems.extend(file.all_diagnostics());
        let text = String::from_utf8_lossy(&bytes);
        let texts = split_documents(&text);
        let specs: Vec<_> = file.specs().collect();
        for (index, spec) in specs.iter().enumerate() {
            let alloc = spec.spec.metadata.name.clone();
            if let Some(first) = declared.insert(alloc.clone(), found.path.clone()) {
                problems.push(Diagnostic::new(
                    &found.path,
                    Location::START,
                    "metadata.name",
                    format!(
                        "alloc {:?} is also declared in {}",
                        alloc.as_str(),
                        first.display()
                    ),
                ));
            }
            // Each document's own text; JSON (which is YAML) where it cannot be told apart.
            let text = match texts.len() == file.documents.len() {
                true => texts[index].clone(),
                false => serde_json::to_string_pretty(&spec.spec).expect("a spec serializes"),
            };
            documents.push(Document {
                alloc,
                text,
                path: found.path.clone(),
            });
        }
    }
    match problems.is_empty() {
        true => Ok(documents),
        false => Err(problems),
    }
}

/// The documents of a YAML stream's text, split at `---` lines; those holding nothing
/// but comments and blank lines are left out, as the parser leaves them out.
fn split_documents(text: &str) -> Vec<String> {
    let mut documents = vec![String::new()];
    for line in text.split_inclusive('\n') {
        if line.starts_with("---") && line[3..].trim().is_empty() {
            documents.push(String::new());
        } else if line.starts_with("...") && line[3..].trim().is_empty() {
            continue;
        } else if let Some(last) = documents.last_mut() {
            last.push_str(line);
        }
    }
    documents
        .into_iter()
        .filter(|d| {
            d.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        })
        .collect()
}

/// `apply` (`write`) or `diff`.
async fn apply(
    client: &Client,
    keys: &FleetKeys,
    args: &ApplyArgs,
    write: bool,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let (paths, target, prune) = (&args.files, &args.target, args.prune);
    let documents = match read_documents(paths) {
        Ok(documents) => documents,
        Err(problems) => {
            for problem in problems {
                writeln!(out, "{problem}")?;
            }
            writeln!(out, "nothing applied: fix the problems above first")?;
            return Ok(EXIT_INVALID);
        }
    };
    let target = target.target()?;
    let prefix = keys.desired_of(&target);
    let current = retried(|| {
        let mut kv = client.kv_client();
        let prefix = prefix.clone();
        async move {
            kv.get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
                .await
        }
    })
    .await
    .context("reading the desired keys")?;
    let revision = current.header().map_or(0, |h| h.revision());
    let existing: BTreeMap<String, (String, i64)> = current
        .kvs()
        .iter()
        .filter_map(|kv| {
            Some((
                kv.key_str().ok()?.to_owned(),
                (
                    String::from_utf8_lossy(kv.value()).into_owned(),
                    kv.mod_revision(),
                ),
            ))
        })
        .collect();
    let mut changes: Vec<(String, Option<String>, &'static str)> = Vec::new();
    let mut declared = BTreeSet::new();
    for document in &documents {
        let key = keys.desired_key(&target, &document.alloc);
        declared.insert(key.clone());
        let verb = match existing.get(&key) {
            None => "created",
            Some((text, _)) if *text == document.text => {
                writeln!(
                    out,
                    "{}: unchanged ({})",
                    cell(&key),
                    cell(&document.path.display().to_string())
                )?;
                continue;
            }
            Some(_) => "configured",
        };
        changes.push((key, Some(document.text.clone()), verb));
    }
    if prune {
        for key in existing.keys().filter(|k| !declared.contains(*k)) {
            changes.push((key.clone(), None, "pruned"));
        }
    }
    for (key, text, verb) in &changes {
        let verb = match write {
            true => (*verb).to_owned(),
            false => format!("would be {verb}"),
        };
        writeln!(out, "{}: {verb}", cell(key))?;
        if !write {
            // What would change, as a unified diff of the key's text.
            let before = existing.get(key).map_or("", |(text, _)| text.as_str());
            let after = text.as_deref().unwrap_or("");
            let diff = similar::TextDiff::from_lines(before, after);
            let shown = diff
                .unified_diff()
                .context_radius(2)
                .header(&format!("etcd:{key}"), "applied")
                .to_string();
            write!(out, "{}", super::render::terminal_text(&shown))?;
        }
    }
    if !write {
        return Ok(if changes.is_empty() {
            EXIT_OK
        } else {
            EXIT_INVALID
        });
    }
    if changes.is_empty() {
        return Ok(EXIT_OK);
    }
    // All or nothing, and only over what was read: a key created, changed or deleted
    // since is a conflict.
    let edits: Vec<KeyEdit> = changes
        .into_iter()
        .map(|(key, value, _)| KeyEdit {
            read_at: existing.get(&key).map_or(0, |(_, at)| *at),
            key,
            value,
        })
        .collect();
    // Tried again while the cluster elects a leader: the compare-and-swap keeps a second
    // try from writing over anything (a first try that was applied makes it a conflict).
    let mut tries = 0;
    let done = retried(|| {
        tries += 1;
        crate::fleet::write_edits(client, &edits)
    })
    .await
    .context("writing the desired keys")?;
    if !done && tries > 1 {
        bail!(
            "conflict, or an earlier try of this write was applied while etcd did not answer: see `stead fleet diff`"
        );
    }
    if !done {
        bail!(
            "conflict: a key under {prefix} changed after it was read at revision {revision}; nothing was written, run the command again"
        );
    }
    Ok(EXIT_OK)
}

async fn delete(
    client: &Client,
    keys: &FleetKeys,
    alloc: &str,
    target: &TargetArgs,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let alloc: Name = alloc
        .parse()
        .map_err(|why| anyhow::anyhow!("alloc: {why}"))?;
    let key = keys.desired_key(&target.target()?, &alloc);
    let deleted = retried(|| {
        let mut kv = client.kv_client();
        let key = key.clone();
        async move { kv.delete(key.as_str(), None).await }
    })
    .await
    .context("deleting the key")?;
    if deleted.deleted() == 0 {
        bail!("{key} does not exist");
    }
    writeln!(out, "{key}: deleted")?;
    Ok(EXIT_OK)
}

/// Every key below `prefix` with its value.
async fn list(client: &Client, prefix: &str) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let listed = retried(|| {
        let mut kv = client.kv_client();
        async move { kv.get(prefix, Some(GetOptions::new().with_prefix())).await }
    })
    .await
    .with_context(|| format!("reading {prefix}"))?;
    Ok(listed
        .kvs()
        .iter()
        .filter_map(|kv| Some((kv.key_str().ok()?.to_owned(), kv.value().to_vec())))
        .collect())
}

/// The nodes up now, by name.
async fn up_nodes(
    client: &Client,
    keys: &FleetKeys,
) -> anyhow::Result<BTreeMap<String, FleetNodeStatus>> {
    Ok(list(client, &keys.nodes())
        .await?
        .into_iter()
        .filter_map(|(key, value)| {
            let name = key.strip_prefix(&keys.nodes())?.to_owned();
            Some((name, serde_json::from_slice(&value).ok()?))
        })
        .collect())
}

async fn nodes(
    client: &Client,
    keys: &FleetKeys,
    json: bool,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let up = up_nodes(client, keys).await?;
    if json {
        writeln!(out, "{}", serde_json::to_string_pretty(&up)?)?;
        return Ok(EXIT_OK);
    }
    writeln!(out, "NAME\tVERSION\tHOST\tCLAIMED\tLABELS")?;
    for (name, node) in &up {
        let labels: Vec<String> = node
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        writeln!(
            out,
            "{}\t{}\t{}\t{}\t{}",
            cell(name),
            cell(&node.version),
            cell(&node.hostname),
            node.claimed_at,
            cell(&labels.join(","))
        )?;
    }
    Ok(EXIT_OK)
}

async fn status(
    client: &Client,
    keys: &FleetKeys,
    only: Option<&str>,
    json: bool,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let up = up_nodes(client, keys).await?;
    let mut statuses: BTreeMap<String, BTreeMap<String, FleetAllocStatus>> = BTreeMap::new();
    for (key, value) in list(client, &keys.status()).await? {
        let Some((node, alloc)) = keys.parse_status(&key) else {
            continue;
        };
        if let Ok(status) = serde_json::from_slice::<FleetAllocStatus>(&value) {
            statuses.entry(node).or_default().insert(alloc, status);
        }
    }
    // Nodes named by a desired key but never seen are shown too (down).
    let mut names: BTreeSet<String> = up.keys().chain(statuses.keys()).cloned().collect();
    for (key, _) in list(client, &keys.desired()).await? {
        if let Some((Target::Node(node), _)) = keys.parse_desired(&key) {
            names.insert(node);
        }
    }
    if let Some(only) = only {
        names.retain(|n| n == only);
    }
    let now = crate::clock::Clock::system().now();
    let rows: Vec<NodeRow> = names
        .iter()
        .map(|name| NodeRow::of(name, up.get(name), statuses.get(name), now))
        .collect();
    if json {
        let report: Vec<serde_json::Value> = rows.iter().map(NodeRow::to_json).collect();
        writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?;
        return Ok(EXIT_OK);
    }
    writeln!(out, "NODE\tSTATE\tALLOCS\tLAST STATUS\tFAILING")?;
    for row in &rows {
        let allocs: Vec<String> = row
            .allocs
            .iter()
            .map(|(status, count)| format!("{count} {}", cell(status)))
            .collect();
        let failing: Vec<String> = row
            .failing
            .iter()
            .map(|(alloc, event)| format!("{} ({})", cell(alloc), cell(event)))
            .collect();
        writeln!(
            out,
            "{}\t{}\t{}\t{}\t{}",
            cell(&row.node),
            if row.up { "up" } else { "down" },
            if allocs.is_empty() {
                "-".to_owned()
            } else {
                allocs.join(", ")
            },
            row.age.map_or("-".to_owned(), |s| format!("{s}s ago")),
            failing.join("; "),
        )?;
    }
    Ok(EXIT_OK)
}

/// One node in `stead fleet status`.
struct NodeRow {
    node: String,
    /// Whether its key (under its agent's lease) exists.
    up: bool,
    labels: Option<BTreeMap<String, String>>,
    /// Its allocs by client status.
    allocs: BTreeMap<String, usize>,
    /// Seconds since its newest status was written.
    age: Option<u64>,
    /// Its failing allocs, each with its last event.
    failing: Vec<(String, String)>,
}

impl NodeRow {
    fn of(
        node: &str,
        claim: Option<&FleetNodeStatus>,
        statuses: Option<&BTreeMap<String, FleetAllocStatus>>,
        now: stead_schemas::Timestamp,
    ) -> Self {
        let statuses = statuses.into_iter().flatten();
        let mut row = NodeRow {
            node: node.to_owned(),
            up: claim.is_some(),
            labels: claim.map(|c| c.labels.clone()),
            allocs: BTreeMap::new(),
            age: None,
            failing: Vec::new(),
        };
        let mut newest = None;
        for (alloc, written) in statuses {
            let status = &written.status;
            *row.allocs.entry(status.client_status.clone()).or_default() += 1;
            newest = newest.max(Some(written.written_at));
            if status.client_status == "failed" || status.tasks.values().any(|t| t.failed) {
                let last = status
                    .tasks
                    .values()
                    .flat_map(|t| t.events.iter())
                    .max_by_key(|e| e.time)
                    .map(|e| format!("{}: {}", e.event_type, e.message))
                    .unwrap_or_default();
                row.failing.push((alloc.clone(), last));
            }
        }
        row.age = newest.map(|at| now.saturating_duration_since(at).as_secs());
        row
    }

    fn to_json(&self) -> serde_json::Value {
        let failing: Vec<serde_json::Value> = self
            .failing
            .iter()
            .map(|(alloc, last)| serde_json::json!({"alloc": alloc, "lastEvent": last}))
            .collect();
        serde_json::json!({
            "node": self.node,
            "up": self.up,
            "labels": self.labels,
            "allocs": self.allocs,
            "lastStatusAgeSeconds": self.age,
            "failing": failing,
        })
    }
}

/// Runs `request` up to five times, 200 ms apart, while it fails (a cluster electing a
/// leader answers `no leader` for a moment); the last error otherwise.
async fn retried<T, E, F, Fut>(mut request: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut tries = 1;
    loop {
        match request().await {
            Err(_) if tries < 5 => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            done => return done,
        }
    }
}

/// `text`, from etcd, as one cell of a tab-separated row: every control character
/// (a tab, a newline, an escape) shown escaped, so no value forges a column, a row or a
/// terminal command.
fn cell(text: &str) -> String {
    text.chars()
        .map(|c| match c.is_control() {
            true => c.escape_default().to_string(),
            false => c.to_string(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cell_escapes_what_would_forge_a_column_a_row_or_a_terminal_command() {
        assert_eq!(cell("web-1"), "web-1");
        assert_eq!(cell("a\tb\nc\u{1b}[2J"), "a\\tb\\nc\\u{1b}[2J");
    }

    #[test]
    fn documents_are_split_at_separator_lines_and_empty_ones_dropped() {
        let text = "# head\n---\na: 1\n---  \n# only a comment\n---\nb: 2\n...\n";
        assert_eq!(split_documents(text), ["a: 1\n", "b: 2\n"]);
    }
}
