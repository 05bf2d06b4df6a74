//! Reading spec files: YAML documents into validated alloc specs, with every diagnostic.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::decode::{
    Decode, Decoder, Fields, decode_tasks, field_node, node_location, report_duplicate_keys,
};
use crate::diagnostic::{Diagnostic, FieldPath, Location};
use crate::normalize::{AllocId, Revision};
use crate::rules::ValidatorOnlyRule;
use crate::spec::*;
use crate::yaml::{MAX_SPEC_FILE_BYTES, Node, ParseError, Value, parse_documents};

/// A spec that passed validation, with its identity.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidSpec {
    /// The spec as written (unset fields stay unset).
    pub spec: AllocSpec,
    /// The hash of its normalized form.
    pub revision: Revision,
    /// `<name>-<first 8 hex of revision>`.
    pub id: AllocId,
}

impl ValidSpec {
    /// Wraps a spec that has been validated, computing its revision and id.
    fn new(spec: AllocSpec) -> Self {
        let revision = Revision::of(&spec);
        let id = AllocId::new(&spec.metadata.name, &revision);
        ValidSpec { spec, revision, id }
    }

    /// The alloc's name.
    pub fn name(&self) -> &Name {
        &self.spec.metadata.name
    }
}

/// One document of a spec file.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecDocument {
    /// Where the document starts.
    pub location: Location,
    /// The alloc name, when one could be read even if the rest is invalid; this lets the
    /// agent attach the diagnostics of a broken edit to the alloc that keeps running.
    pub name: Option<Name>,
    /// The spec, when the document is valid.
    pub spec: Option<ValidSpec>,
    /// Every problem found in this document; empty exactly when `spec` is set.
    pub diagnostics: Vec<Diagnostic>,
}

/// A parsed spec file: its documents, or the one problem that made it unreadable.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecFile {
    /// The file's path, as given.
    pub path: PathBuf,
    /// The non-empty documents, in order.
    pub documents: Vec<SpecDocument>,
    /// Problems with the file as a whole (unreadable, not YAML, names declared twice).
    pub diagnostics: Vec<Diagnostic>,
}

impl SpecFile {
    /// Every diagnostic of the file, in file order.
    pub fn all_diagnostics(&self) -> Vec<Diagnostic> {
        let mut all: Vec<Diagnostic> = self
            .diagnostics
            .iter()
            .chain(self.documents.iter().flat_map(|d| &d.diagnostics))
            .cloned()
            .collect();
        all.sort();
        all
    }

    /// The valid specs of the file.
    pub fn specs(&self) -> impl Iterator<Item = &ValidSpec> {
        self.documents.iter().filter_map(|d| d.spec.as_ref())
    }

    /// Whether the file has no problem at all.
    pub fn is_valid(&self) -> bool {
        self.diagnostics.is_empty() && self.documents.iter().all(|d| d.diagnostics.is_empty())
    }
}

/// Parses and validates the spec file at `path` whose raw content is `bytes`: text in
/// UTF-8, at most [`MAX_SPEC_FILE_BYTES`] (a caller may pass only the first
/// `MAX_SPEC_FILE_BYTES + 1` bytes of a larger file).
pub fn parse_spec_bytes(path: &Path, bytes: &[u8]) -> SpecFile {
    let failed = |error: ParseError| SpecFile {
        path: path.to_owned(),
        documents: Vec::new(),
        diagnostics: vec![Diagnostic::new(path, error.location, "", error.message)],
    };
    if bytes.len() > MAX_SPEC_FILE_BYTES {
        return failed(ParseError::too_large());
    }
    match std::str::from_utf8(bytes) {
        Ok(source) => parse_spec_file(path, source),
        Err(error) => {
            let valid =
                std::str::from_utf8(&bytes[..error.valid_up_to()]).expect("valid up to here");
            let line = valid.matches('\n').count() + 1;
            let column = valid.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            failed(ParseError {
                location: Location::new(line as u64, column as u64),
                message: "file is not valid utf-8 text".to_owned(),
            })
        }
    }
}

/// Parses and validates the spec file at `path` whose content is `source`.
pub fn parse_spec_file(path: &Path, source: &str) -> SpecFile {
    parse_with(
        path,
        source,
        Rules {
            interpolation: true,
        },
    )
}

/// Parses and validates a spec that an agent stored (`source` is its JSON), by the rules
/// it was accepted under: a `${…}` that no variable answers, written before the agent
/// interpolated, is not refused (it stays as written when the task starts), so an
/// upgrade never stops an alloc that ran.
pub fn parse_stored_spec(path: &Path, source: &str) -> SpecFile {
    parse_with(
        path,
        source,
        Rules {
            interpolation: false,
        },
    )
}

/// Which of the rules that were added over time apply.
#[derive(Debug, Clone, Copy)]
struct Rules {
    /// `${…}` must name a known variable.
    interpolation: bool,
}

fn parse_with(path: &Path, source: &str, rules: Rules) -> SpecFile {
    let mut file = SpecFile {
        path: path.to_owned(),
        documents: Vec::new(),
        diagnostics: Vec::new(),
    };
    let nodes = match parse_documents(source) {
        Ok(nodes) => nodes,
        Err(error) => {
            file.diagnostics
                .push(Diagnostic::new(path, error.location, "", error.message));
            return file;
        }
    };
    if nodes.is_empty() {
        file.diagnostics.push(Diagnostic::new(
            path,
            Location::START,
            "",
            "file has no documents; expected at least one alloc spec",
        ));
    }
    let mut seen: BTreeMap<Name, Location> = BTreeMap::new();
    for node in &nodes {
        let document = decode_document(path, node, rules);
        if let Some(name) = &document.name {
            if let Some(first) = seen.get(name) {
                let location = name_location(node).unwrap_or(node.location);
                file.diagnostics.push(
                    Diagnostic::new(
                        path,
                        location,
                        "metadata.name",
                        format!(
                            "alloc {:?} is already declared at line {}",
                            name.as_str(),
                            first.line
                        ),
                    )
                    .only_validator(ValidatorOnlyRule::DuplicateAllocName),
                );
            } else {
                seen.insert(name.clone(), name_location(node).unwrap_or(node.location));
            }
        }
        file.documents.push(document);
    }
    file
}

fn name_location(document: &Node) -> Option<Location> {
    let metadata = field_node(document, "metadata")?;
    Some(node_location(metadata, "name"))
}

/// The value of `key` in mapping `node`, when written and not null.
fn written<'n>(node: &'n Node, key: &str) -> Option<&'n Node> {
    field_node(node, key).filter(|value| value.value != Value::Null)
}

fn decode_document(path: &Path, node: &Node, rules: Rules) -> SpecDocument {
    let mut cx = Decoder::new(path);
    report_duplicate_keys(node, &FieldPath::root(), &mut cx);
    let spec = decode_alloc(node, &mut cx);
    if rules.interpolation {
        crate::interpolate::check_document(node, &mut cx);
    }
    let name = spec.as_ref().map(|s| s.metadata.name.clone()).or_else(|| {
        let name = field_node(field_node(node, "metadata")?, "name")?;
        match &name.value {
            Value::String(s) => s.parse().ok(),
            _ => None,
        }
    });
    let spec = spec
        .filter(|_| cx.diagnostics.is_empty())
        .map(ValidSpec::new);
    SpecDocument {
        location: node.location,
        name,
        spec,
        diagnostics: cx.diagnostics,
    }
}

fn decode_alloc(node: &Node, cx: &mut Decoder<'_>) -> Option<AllocSpec> {
    let root = FieldPath::root();
    let mut fields = Fields::new(node, &root, &["apiVersion", "kind", "metadata", "spec"], cx)?;
    let api_version = fields.required::<String>("apiVersion", cx);
    let kind = fields.required::<String>("kind", cx);
    if let Some(kind) = &kind
        && kind != KIND_ALLOC
    {
        cx.report(
            node_location(node, "kind"),
            &root.field("kind"),
            format!("unknown kind {kind:?}; expected {KIND_ALLOC:?}"),
        );
        return None;
    }
    if let Some(version) = &api_version
        && version != API_VERSION
    {
        cx.report(
            node_location(node, "apiVersion"),
            &root.field("apiVersion"),
            format!("unsupported apiVersion {version:?}; expected {API_VERSION:?}"),
        );
        return None;
    }
    let metadata = fields.required::<Metadata>("metadata", cx);
    let body = match fields.node("spec") {
        Some(body) => decode_body(body, &root.field("spec"), cx),
        None => fields.required::<AllocBody>("spec", cx),
    };
    if !fields.finish(cx) {
        return None;
    }
    Some(AllocSpec {
        api_version: api_version?,
        kind: kind?,
        metadata: metadata?,
        spec: body?,
    })
}

impl Decode for AllocBody {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        decode_body(node, path, cx)
    }
}

fn decode_body(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<AllocBody> {
    const KNOWN: &[&str] = &[
        "type",
        "desiredStatus",
        "restart",
        "ephemeralDisk",
        "shutdownDelay",
        "tasks",
    ];
    let mut fields = Fields::new(node, path, KNOWN, cx)?;
    let alloc_type = fields.optional::<AllocType>("type", cx);
    let desired_status = fields.optional("desiredStatus", cx);
    let restart = fields.optional::<RestartSpec>("restart", cx);
    let ephemeral_disk = fields.optional::<EphemeralDiskSpec>("ephemeralDisk", cx);
    let shutdown_delay = fields.optional("shutdownDelay", cx);
    let tasks = match fields.node("tasks") {
        Some(tasks) => decode_tasks(tasks, &path.field("tasks"), cx),
        None => {
            fields.required::<Vec<TaskSpec>>("tasks", cx);
            None
        }
    };
    let valid_fields = fields.finish(cx);
    let tasks = tasks?;
    // Cross-field rules run over whatever decoded, so their problems are reported
    // together with the structural ones.
    let mut body = AllocBody {
        alloc_type,
        desired_status,
        restart,
        ephemeral_disk,
        shutdown_delay,
        tasks: tasks.tasks.iter().map(|(_, t)| t.clone()).collect(),
    };
    let group_ok = check_body(node, path, &body, &tasks.tasks, tasks.failed_main, cx);
    if !(valid_fields && tasks.complete && group_ok) {
        return None;
    }
    body.tasks = tasks.tasks.into_iter().map(|(_, t)| t).collect();
    Some(body)
}

/// The rules that relate fields to each other; true when all hold.
fn check_body(
    body_node: &Node,
    path: &FieldPath,
    body: &AllocBody,
    tasks: &[(usize, TaskSpec)],
    failed_main: bool,
    cx: &mut Decoder<'_>,
) -> bool {
    let before = cx.diagnostics.len();
    let tasks_node = field_node(body_node, "tasks");
    let task_node = |index: usize| match tasks_node.map(|n| &n.value) {
        Some(Value::Sequence(items)) => items.get(index),
        _ => None,
    };

    // The group's restart policy, over the type's defaults.
    if let Some(restart) = &body.restart {
        let restart_node =
            field_node(body_node, "restart").expect("restart decoded from this node");
        for (causes, message) in body.group_restart_policy().problems_with_causes() {
            let field = written_field(restart, causes);
            cx.report_only_validator(
                ValidatorOnlyRule::RestartPolicy,
                node_location(restart_node, field),
                &path.field("restart").field(field),
                message,
            );
        }
    }

    let mut names: BTreeMap<&Name, usize> = BTreeMap::new();
    let mut leader: Option<usize> = None;
    for (index, task) in tasks {
        let task_path = path.field("tasks").index(*index);
        let Some(node) = task_node(*index) else {
            continue;
        };
        if let Some(first) = names.insert(&task.name, *index) {
            names.insert(&task.name, first);
            cx.report_only_validator(
                ValidatorOnlyRule::UniqueTaskNames,
                node_location(node, "name"),
                &task_path.field("name"),
                format!(
                    "task name {:?} is already used by {}",
                    task.name.as_str(),
                    path.field("tasks").index(first)
                ),
            );
        }
        if task.leader == Some(true) {
            match leader {
                Some(first) => cx.report(
                    node_location(node, "leader"),
                    &task_path.field("leader"),
                    format!(
                        "only one task may be the leader; {} already is",
                        path.field("tasks").index(first)
                    ),
                ),
                None => leader = Some(*index),
            }
        }
        // A task's own restart block is checked as it applies: over the group's policy.
        if let Some(restart) = &task.restart {
            let restart_node = field_node(node, "restart").expect("restart decoded from this node");
            for (causes, message) in task.restart_policy(body).problems_with_causes() {
                let field = written_field(restart, causes);
                cx.report_only_validator(
                    ValidatorOnlyRule::RestartPolicy,
                    node_location(restart_node, field),
                    &task_path.field("restart").field(field),
                    message,
                );
            }
        }
        let (max_files, max_file_size_mb) = task.effective_logs();
        let logs_mb = u64::from(max_files) * u64::from(max_file_size_mb);
        let disk_mb = body.effective_disk_size_mb();
        if logs_mb >= disk_mb {
            // What was written: the logs' one written field or their block, else the
            // disk's size or its block.
            let (location, field_path) = match written(node, "logs") {
                Some(logs) => {
                    let fields: Vec<&str> = ["maxFiles", "maxFileSizeMB"]
                        .into_iter()
                        .filter(|f| written(logs, f).is_some())
                        .collect();
                    match fields[..] {
                        [field] => (
                            node_location(logs, field),
                            task_path.field("logs").field(field),
                        ),
                        _ => (logs.location, task_path.field("logs")),
                    }
                }
                None => match written(body_node, "ephemeralDisk") {
                    Some(disk) => match written(disk, "sizeMB") {
                        Some(size) => (size.location, path.field("ephemeralDisk").field("sizeMB")),
                        None => (disk.location, path.field("ephemeralDisk")),
                    },
                    None => (node.location, task_path.field("logs")),
                },
            };
            cx.report_only_validator(
                ValidatorOnlyRule::LogsFitDisk,
                location,
                &field_path,
                format!(
                    "task {:?} may keep {logs_mb} MB of logs ({max_files} files of {max_file_size_mb} MB), which does not fit in the {disk_mb} MB ephemeral disk; logs must be smaller than the disk",
                    task.name.as_str()
                ),
            );
        }
    }
    // A task that did not decode counts as main when it writes no lifecycle: the rule is
    // judged whatever else is wrong, as the schema judges it.
    if !failed_main && !tasks.iter().any(|(_, t)| t.is_main()) {
        cx.report(
            tasks_node.map_or(body_node.location, |t| t.location),
            &path.field("tasks"),
            "an alloc needs at least one main task (a task without lifecycle)",
        );
    }
    cx.diagnostics.len() == before
}

/// The field to point at for a restart problem: the first of its causes this block
/// sets (so the diagnostic lands on what was written), else the field it is about.
fn written_field(spec: &RestartSpec, causes: &[&'static str]) -> &'static str {
    let set = |f: &str| match f {
        "attempts" => spec.attempts.is_some(),
        "interval" => spec.interval.is_some(),
        "delay" => spec.delay.is_some(),
        "mode" => spec.mode.is_some(),
        "maxDelay" => spec.max_delay.is_some(),
        _ => false,
    };
    causes.iter().copied().find(|f| set(f)).unwrap_or(causes[0])
}
