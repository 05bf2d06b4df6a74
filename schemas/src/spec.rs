//! The alloc spec, `apiVersion: stead/v1`, `kind: Alloc`, as typed data.
//!
//! Every optional field is an `Option`: an unset value and a zero value are different
//! things (unset means "the default", which may change with the alloc type or the agent).
//! Values of these types come only from [`crate::decode`], which validates them, or from
//! code that builds them by hand; [`crate::normalize`] fills in the defaults.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::duration::Duration;

/// The only `apiVersion` this version of stead reads.
pub const API_VERSION: &str = "stead/v1";
/// The `kind` of an alloc spec document.
pub const KIND_ALLOC: &str = "Alloc";

/// One alloc spec document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(
    title = "stead alloc spec",
    description = "A group of tasks that live and die together on one node."
)]
pub struct AllocSpec {
    /// Always `stead/v1`.
    #[schemars(schema_with = "api_version_schema")]
    pub api_version: String,
    /// Always `Alloc`.
    #[schemars(schema_with = "kind_schema")]
    pub kind: String,
    /// Name and labels.
    pub metadata: Metadata,
    /// What to run.
    pub spec: AllocBody,
}

fn api_version_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "const": API_VERSION })
}

fn kind_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "const": KIND_ALLOC })
}

/// `metadata`: identity of the alloc.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Metadata {
    /// Unique on the node.
    pub name: Name,
    /// Free-form labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<LabelKey, String>>,
    /// For a spec under the fleet's `desired/_all/` prefix: the node labels it needs,
    /// each equal (as a DaemonSet's `nodeSelector`); unset runs it on every node. It says
    /// where an alloc runs, not what it is, so it is not part of the revision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<LabelKey, String>>,
}

impl Metadata {
    /// Whether a node with `labels` is one this spec's `nodeSelector` picks.
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        self.node_selector.as_ref().is_none_or(|selector| {
            selector
                .iter()
                .all(|(key, value)| labels.get(key.as_ref()) == Some(value))
        })
    }
}

/// `spec`: the group of tasks and its policies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllocBody {
    /// `service` (default) or `batch`; sets restart defaults and whether successful exits restart.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub alloc_type: Option<AllocType>,
    /// `run` (default) or `stop`; `stop` keeps the alloc and stops its tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_status: Option<DesiredStatus>,
    /// The group's restart policy; tasks may override it field by field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<RestartSpec>,
    /// The alloc's scratch disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ephemeral_disk: Option<EphemeralDiskSpec>,
    /// Time between deregistration and the kill of the group's tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown_delay: Option<Duration>,
    /// The tasks; names are unique, at least one is a main task, at most one leads.
    #[schemars(length(min = 1), extend("allOf" = [
        {"contains": main_task_schema()},
        {"contains": {"properties": {"leader": {"const": true}}, "required": ["leader"]}, "minContains": 0, "maxContains": 1},
    ]))]
    pub tasks: Vec<TaskSpec>,
}

/// Whether the alloc is a long-running service or a run-to-completion batch job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AllocType {
    /// Long-running: successful exits of main tasks restart.
    Service,
    /// Runs to completion: successful exits do not restart.
    Batch,
}

/// Whether the alloc's tasks should run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DesiredStatus {
    /// Run the tasks.
    Run,
    /// Stop the tasks, keep the alloc.
    Stop,
}

/// A restart policy as written; unset fields take the group's value, then the type's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RestartSpec {
    /// Failures allowed within `interval`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    /// The window in which failures are counted; at least 5s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<Duration>,
    /// Wait before a restart (plus up to a quarter of it, at random).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay: Option<Duration>,
    /// What to do past `attempts`: `fail` the task, or `delay` until the window ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<RestartMode>,
    /// When set, the delay doubles per consecutive restart up to this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_delay: Option<Duration>,
}

/// What a task does once it has used up its restart attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RestartMode {
    /// The task fails.
    Fail,
    /// The task waits out the rest of the interval, then tries again.
    Delay,
}

/// The alloc's scratch disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EphemeralDiskSpec {
    /// Size in megabytes, at least 10; the tasks' logs must fit in it.
    #[serde(rename = "sizeMB", default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 10))]
    pub size_mb: Option<u64>,
    /// Carry `alloc/data` and each task's `local` over to the next revision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticky: Option<bool>,
    /// Like `sticky`; kept for Nomad compatibility.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrate: Option<bool>,
}

/// A task without `lifecycle` (or with `lifecycle: null`): a main task.
fn main_task_schema() -> serde_json::Value {
    serde_json::json!({"anyOf": [
        {"not": {"required": ["lifecycle"]}},
        {"properties": {"lifecycle": {"type": "null"}}},
    ]})
}

/// The rules of a task that relate its fields: the config follows the driver, a leader is
/// a main task, and `alloc` names no task.
fn task_rules_schema() -> serde_json::Value {
    serde_json::json!([
        {"if": {"properties": {"driver": {"const": "exec"}}, "required": ["driver"]},
         "then": {"properties": {"config": {"$ref": "#/$defs/ExecConfig"}}}},
        {"if": {"properties": {"driver": {"const": "mock"}}, "required": ["driver"]},
         "then": {"properties": {"config": {"$ref": "#/$defs/MockConfig"}}}},
        {"if": {"properties": {"leader": {"const": true}}, "required": ["leader"]},
         "then": main_task_schema()},
        {"properties": {"name": {"not": {"const": RESERVED_TASK_NAME}}}},
    ])
}

/// One task of an alloc.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("allOf" = task_rules_schema()))]
pub struct TaskSpec {
    /// Unique within the alloc.
    pub name: Name,
    /// Which driver runs the task.
    pub driver: DriverKind,
    /// The driver's options, validated by the driver's own schema.
    pub config: DriverConfig,
    /// Environment variables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "env_schema")]
    pub env: Option<BTreeMap<EnvName, String>>,
    /// The user the task runs as (a name or a numeric uid).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<UserName>,
    /// When the leader dies, the rest of the alloc is killed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leader: Option<bool>,
    /// Makes the task a prestart, poststart or poststop task instead of a main task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<LifecycleSpec>,
    /// Overrides the group's restart policy field by field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<RestartSpec>,
    /// Time between `killSignal` and SIGKILL (capped by the agent's `maxKillTimeout`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kill_timeout: Option<Duration>,
    /// The signal sent first when the task is stopped (not SIGSTOP or SIGCONT, which do
    /// not end a task).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "kill_signal_schema")]
    pub kill_signal: Option<Signal>,
    /// Time between the shutdown-delay event and the kill.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown_delay: Option<Duration>,
    /// Log rotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logs: Option<LogsSpec>,
    /// Resources the task needs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourcesSpec>,
    /// Health checks, run while the task runs; names are unique in the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checks: Option<Vec<CheckSpec>>,
}

/// The environment: names as [`EnvName`] takes them, values a process can carry.
fn env_schema(generator: &mut SchemaGenerator) -> Schema {
    let name = EnvName::json_schema(generator);
    json_schema!({
        "type": ["object", "null"],
        "propertyNames": name,
        "additionalProperties": process_text_schema(),
    })
}

/// Rust's `char::is_whitespace`, as the inside of a regular expression's class: the
/// characters themselves, which every regex dialect reads alike.
const WHITESPACE_CLASS: &str = "\t\n\u{b}\u{c}\r \u{85}\u{a0}\u{1680}\u{2000}-\u{200a}\u{2028}\u{2029}\u{202f}\u{205f}\u{3000}";

/// Rust's `char::is_control` (Unicode's Cc), as the inside of a regular expression's class.
const CONTROL_CLASS: &str = "\\x00-\\x1F\\x7F-\\x9F";

/// An exec driver's command: not blank, no whitespace around it, no NUL byte.
fn exec_command_schema(_: &mut SchemaGenerator) -> Schema {
    let ws = WHITESPACE_CLASS;
    json_schema!({
        "type": "string",
        "pattern": format!("^[^{ws}\\x00]([^\\x00]*[^{ws}\\x00])?$"),
    })
}

/// An exec check's command: not blank, no NUL byte (`null` is unset).
fn check_command_schema(_: &mut SchemaGenerator) -> Schema {
    let ws = WHITESPACE_CLASS;
    json_schema!({
        "type": ["string", "null"],
        "pattern": format!("^[^\\x00]*[^{ws}\\x00][^\\x00]*$"),
    })
}

/// Arguments of a command: text without a NUL byte (`null` is unset).
fn args_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({"type": ["array", "null"], "items": process_text_schema()})
}

/// Text a command line or an environment can carry: no NUL byte.
fn process_text_schema() -> serde_json::Value {
    serde_json::json!({"type": "string", "pattern": "^[^\\x00]*$"})
}

/// Which fields each check type takes: the ones it needs, and the others it may set.
fn check_rules_schema() -> serde_json::Value {
    let all = ["host", "port", "path", "method", "command", "args"];
    let rule = |kind: &str, needs: &[&str], takes: &[&str]| {
        let mut properties = serde_json::Map::new();
        for field in all {
            if !takes.contains(&field) {
                properties.insert(field.to_owned(), serde_json::json!({"type": "null"}));
            }
        }
        for field in needs {
            properties.insert(
                (*field).to_owned(),
                serde_json::json!({"not": {"type": "null"}}),
            );
        }
        serde_json::json!({
            "if": {"properties": {"type": {"const": kind}}, "required": ["type"]},
            "then": {"required": needs, "properties": properties},
        })
    };
    serde_json::json!([
        rule("http", &["port"], &["host", "port", "path", "method"]),
        rule("tcp", &["port"], &["host", "port"]),
        rule("exec", &["command"], &["command", "args"]),
    ])
}

/// A health check of one task: an HTTP request, a TCP connect or a command, run every
/// `interval` while the task runs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("allOf" = check_rules_schema()))]
pub struct CheckSpec {
    /// Unique within the task; the same rules as task names.
    pub name: Name,
    /// `http`, `tcp` or `exec`.
    #[serde(rename = "type")]
    pub check_type: CheckType,
    /// The host to reach (http, tcp): an IP address or a DNS name; 127.0.0.1 when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<CheckHost>,
    /// The port to reach (http, tcp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<u16>,
    /// The request path (http), `/` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<HttpPath>,
    /// The request method (http), `GET` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<HttpMethod>,
    /// The program to run (exec), in the task's dir, environment and user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "check_command_schema")]
    pub command: Option<String>,
    /// Its arguments (exec).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "args_schema")]
    pub args: Option<Vec<String>>,
    /// Time between checks, at least 1s (default 10s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<Duration>,
    /// How long one check may take: at least 1s and at most `interval` (default 2s, or
    /// `interval` when that is shorter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<Duration>,
    /// Restart the task when the check stays unhealthy; without it the check only reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<CheckRestartSpec>,
}

/// What a check does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CheckType {
    /// An HTTP request: 2xx and 3xx pass, 429 warns, anything else is critical.
    Http,
    /// A TCP connect: passes when it connects.
    Tcp,
    /// A command: exit 0 passes, 1 warns, anything else is critical.
    Exec,
}

impl CheckType {
    /// The name used in specs.
    pub fn as_str(self) -> &'static str {
        match self {
            CheckType::Http => "http",
            CheckType::Tcp => "tcp",
            CheckType::Exec => "exec",
        }
    }
}

/// When a failing check restarts its task (Nomad's `check_restart`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CheckRestartSpec {
    /// How many consecutive intervals the check may fail; the task restarts when it has
    /// stayed unhealthy for `interval × (limit − 1)`. At least 1.
    #[schemars(range(min = 1))]
    pub limit: u32,
    /// Time after each (re)start of the task during which failures are not counted
    /// (default 1s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace: Option<Duration>,
    /// Whether a warning counts as passing (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore_warnings: Option<bool>,
}

fn kill_signal_schema(_: &mut SchemaGenerator) -> Schema {
    let names: Vec<&str> = SIGNAL_NAMES
        .iter()
        .copied()
        .filter(|name| !NOT_KILL_SIGNALS.iter().any(|(not, _)| not == name))
        .collect();
    json_schema!({ "anyOf": [{ "enum": names }, { "type": "null" }] })
}

/// The drivers stead has.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum DriverKind {
    /// Real processes.
    Exec,
    /// In-process fake, for tests and benchmarks.
    Mock,
}

impl DriverKind {
    /// Every driver, in the order they are listed to users.
    pub const ALL: [DriverKind; 2] = [DriverKind::Exec, DriverKind::Mock];

    /// The name used in specs.
    pub fn as_str(self) -> &'static str {
        match self {
            DriverKind::Exec => "exec",
            DriverKind::Mock => "mock",
        }
    }
}

impl fmt::Display for DriverKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A task's driver options; which variant is allowed follows from the task's `driver`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum DriverConfig {
    /// Options of the `exec` driver.
    Exec(ExecConfig),
    /// Options of the `mock` driver.
    Mock(MockConfig),
}

/// Options of the `exec` driver.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExecConfig {
    /// The program: an absolute path, or a name looked up in `PATH`.
    #[schemars(schema_with = "exec_command_schema")]
    pub command: String,
    /// Its arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "args_schema")]
    pub args: Option<Vec<String>>,
}

/// Options of the `mock` driver (Nomad's mock driver, camelCased).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MockConfig {
    /// How long the task runs before it exits by itself; unset runs until killed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_for: Option<Duration>,
    /// The exit code when `runFor` ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The signal the task reports having died of when `runFor` ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub exit_signal: Option<i32>,
    /// An error reported on exit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_err_msg: Option<String>,
    /// Starting fails with this error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_error: Option<String>,
    /// Whether `startError` is recoverable (retried by the restart policy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_error_recoverable: Option<bool>,
    /// Starting blocks this long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_block_for: Option<Duration>,
    /// After a kill signal, the task takes this long to exit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kill_after: Option<Duration>,
    /// Signalling the task fails with this error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal_error: Option<String>,
    /// Written to stdout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_string: Option<String>,
    /// How many times `stdoutString` is written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_repeat: Option<u32>,
    /// The pause between repeats of `stdoutString`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_repeat_duration: Option<Duration>,
}

/// When a non-main task runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend(
    "if" = {"properties": {"hook": {"const": "poststop"}}, "required": ["hook"]},
    "then" = {"properties": {"sidecar": {"not": {"const": true}}}}
))]
pub struct LifecycleSpec {
    /// The stage the task belongs to.
    pub hook: LifecycleHook,
    /// Keep running beside the main tasks (prestart and poststart only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sidecar: Option<bool>,
}

/// Lifecycle stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum LifecycleHook {
    /// Before the main tasks.
    Prestart,
    /// Once the main tasks run.
    Poststart,
    /// After every other task is dead.
    Poststop,
}

impl LifecycleHook {
    /// The name used in specs.
    pub fn as_str(self) -> &'static str {
        match self {
            LifecycleHook::Prestart => "prestart",
            LifecycleHook::Poststart => "poststart",
            LifecycleHook::Poststop => "poststop",
        }
    }
}

/// Log rotation of one task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LogsSpec {
    /// How many files of each stream are kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_files: Option<u32>,
    /// Size at which a file is rotated, in megabytes.
    #[serde(
        rename = "maxFileSizeMB",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(range(min = 1))]
    pub max_file_size_mb: Option<u32>,
}

/// Resources of one task, and the limits the exec driver enforces through cgroups.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend(
    "dependentRequired" = {"memoryMaxMB": ["memoryMB"]},
    "if" = {"properties": {"cpuHardLimit": {"const": true}}, "required": ["cpuHardLimit"]},
    "then" = {"required": ["cpu"]}
))]
pub struct ResourcesSpec {
    /// CPU in MHz, as Nomad's `cpu`, at least 1: the task's relative weight against the
    /// other tasks of the node when the CPU is contended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub cpu: Option<u32>,
    /// Also cap the task at `cpu` MHz, i.e. `cpu / MHz of one core` cores, even on an
    /// idle node (default false). Needs `cpu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_hard_limit: Option<bool>,
    /// Memory in megabytes, at least 10: the hard limit, or with `memoryMaxMB` the
    /// reservation the kernel protects from reclaim.
    #[serde(rename = "memoryMB", default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 10))]
    pub memory_mb: Option<u32>,
    /// The hard memory limit in megabytes, at least `memoryMB` (Nomad's `memory_max`).
    /// Needs `memoryMB`.
    #[serde(
        rename = "memoryMaxMB",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(range(min = 10))]
    pub memory_max_mb: Option<u32>,
    /// The most processes and threads the task may have at once, at least 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub pids: Option<u32>,
    /// On an out-of-memory kill, kill every process of the task rather than only the
    /// one the kernel chose (default false).
    #[serde(
        rename = "oomKillGroup",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub oom_kill_group: Option<bool>,
    /// Devices to reserve.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<DeviceRequest>>,
}

/// A request for `count` instances of a device.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceRequest {
    /// `vendor/type` or `vendor/type/name`.
    pub name: DeviceName,
    /// How many instances (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub count: Option<u32>,
}

/// Declares a string newtype whose values are checked by `check` before it exists.
macro_rules! checked_string {
    ($(#[$meta:meta])* $name:ident, $schema:expr, $check:path) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            /// The text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                $check(s).map(|()| $name(s.to_owned()))
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let text = Cow::<'de, str>::deserialize(deserializer)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }

        impl JsonSchema for $name {
            fn schema_name() -> Cow<'static, str> {
                stringify!($name).into()
            }
            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                $schema
            }
        }
    };
}

/// The one valid name a task may not have: each task's dir sits beside the alloc's
/// shared `alloc/` dir.
pub(crate) const RESERVED_TASK_NAME: &str = "alloc";

/// The pattern of alloc and task names (an RFC 1123 DNS label).
pub const NAME_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// The longest alloc or task name.
pub const NAME_MAX_LEN: usize = 63;

checked_string!(
    /// An alloc or task name: an RFC 1123 label, so it is safe in paths, env and URLs.
    Name,
    json_schema!({ "type": "string", "pattern": NAME_PATTERN, "minLength": 1, "maxLength": NAME_MAX_LEN }),
    check_name
);

fn check_name(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("name is empty".to_owned());
    }
    if s.len() > NAME_MAX_LEN {
        return Err(format!(
            "name {s:?} is {} characters long; at most {NAME_MAX_LEN} are allowed",
            s.chars().count()
        ));
    }
    let bytes = s.as_bytes();
    let inner_ok = bytes
        .iter()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-');
    let ends_ok = bytes[0] != b'-' && bytes[bytes.len() - 1] != b'-';
    if inner_ok && ends_ok {
        Ok(())
    } else {
        Err(format!(
            "name {s:?} is invalid; use lowercase letters, digits and '-', starting and ending with a letter or digit"
        ))
    }
}

checked_string!(
    /// A label key: letters, digits, `-`, `_`, `.`, with an optional `prefix/`, at most 253 characters.
    LabelKey,
    json_schema!({ "type": "string", "pattern": "^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$" }),
    check_label_key
);

fn check_label_key(s: &str) -> Result<(), String> {
    let (prefix, name) = match s.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, s),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric();
    let prefix_ok = prefix.is_none_or(|p| {
        !p.is_empty()
            && p.len() <= 253
            && p.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'.'))
            && p.as_bytes()[0].is_ascii_alphanumeric()
            && p.as_bytes()[p.len() - 1].is_ascii_alphanumeric()
    });
    if name_ok && prefix_ok {
        Ok(())
    } else {
        Err(format!(
            "label key {s:?} is invalid; use an optional dns prefix and '/', then letters, digits, '-', '_' or '.' (at most 63)"
        ))
    }
}

checked_string!(
    /// An environment variable name: anything a process's environment can carry (not
    /// empty, no `=`, no NUL byte), such as `PORT` or Nomad's `discovery.type`, but not
    /// starting with `STEAD_`, which the agent sets.
    EnvName,
    json_schema!({ "type": "string", "pattern": "^[^=\\x00]+$", "not": { "pattern": "^STEAD_" } }),
    check_env_name
);

fn check_env_name(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("environment variable name is empty".to_owned());
    }
    if s.contains('=') {
        return Err(format!(
            "environment variable name {s:?} holds '=', which would end the name in the task's environment"
        ));
    }
    if s.contains('\0') {
        return Err(format!(
            "environment variable name {s:?} holds a NUL byte, which an environment cannot carry"
        ));
    }
    if s.starts_with("STEAD_") {
        return Err(format!(
            "environment variable {s:?} is reserved; names starting with STEAD_ are set by the agent"
        ));
    }
    Ok(())
}

checked_string!(
    /// A user to run as: a name, as the passwd file spells it, or a numeric uid. Names are
    /// held to what the passwd format and a lookup can carry (systemd's relaxed rule), not
    /// to one distribution's `useradd` pattern: `john.doe` and `Svc` are real accounts.
    UserName,
    user_name_schema(),
    check_user_name
);

/// A numeric uid (below 2^32, leading zeros allowed) or a name the passwd file can hold.
fn user_name_schema() -> Schema {
    let ws = WHITESPACE_CLASS;
    let cc = CONTROL_CLASS;
    let uid = "^0*([0-9]{1,9}|[1-3][0-9]{9}|4[01][0-9]{8}|42[0-8][0-9]{7}|429[0-3][0-9]{6}|4294[0-8][0-9]{5}|42949[0-5][0-9]{4}|429496[0-6][0-9]{3}|4294967[01][0-9]{2}|42949672[0-8][0-9]|429496729[0-5])$";
    json_schema!({ "type": "string", "anyOf": [
        { "pattern": uid },
        { "allOf": [
            { "pattern": format!("^[^-:/,{ws}{cc}][^:/,{ws}{cc}]{{0,255}}$") },
            { "not": { "pattern": "^[0-9]+$" } },
            { "not": { "pattern": "^\\.\\.?$" } },
        ] },
    ] })
}

fn check_user_name(s: &str) -> Result<(), String> {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return match s.parse::<u32>() {
            Ok(_) => Ok(()),
            Err(_) => Err(format!(
                "user {s:?} is invalid: a numeric uid is below 2^32"
            )),
        };
    }
    let why = if s.is_empty() {
        Some("it is empty")
    } else if s.len() > 256 {
        Some("it is longer than 256 bytes")
    } else if s == "." || s == ".." {
        Some("it is a path component")
    } else if s.starts_with('-') {
        Some("it starts with '-'")
    } else if s
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || matches!(c, ':' | '/' | ','))
    {
        Some("it holds whitespace, a control character, ':', '/' or ','")
    } else {
        None
    };
    match why {
        None => Ok(()),
        Some(why) => Err(format!(
            "user {s:?} is invalid: {why}; use the account's name or a numeric uid"
        )),
    }
}

checked_string!(
    /// The host of an http or tcp check: an IPv4 or IPv6 address, or a DNS name.
    CheckHost,
    json_schema!({ "type": "string", "anyOf": [
        { "pattern": "^[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?(\\.[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?)*\\.*$", "maxLength": 253 },
        { "pattern": "^[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*$", "format": "ipv6" },
    ] }),
    check_host
);

fn check_host(s: &str) -> Result<(), String> {
    if s.parse::<std::net::IpAddr>().is_ok() {
        return Ok(());
    }
    let labels_ok = !s.is_empty()
        && s.len() <= 253
        && s.trim_end_matches('.').split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if labels_ok {
        Ok(())
    } else {
        Err(format!(
            "host {s:?} is invalid; use an IP address or a DNS name such as \"db.internal\""
        ))
    }
}

checked_string!(
    /// The path (and query) of an http check: starts with `/`, printable ASCII, no spaces.
    HttpPath,
    json_schema!({ "type": "string", "pattern": "^/[!-~]*$", "maxLength": 2048 }),
    check_http_path
);

fn check_http_path(s: &str) -> Result<(), String> {
    if !s.starts_with('/') {
        return Err(format!("path {s:?} must start with '/'"));
    }
    if s.len() > 2048 {
        return Err(format!(
            "path is {} bytes long; at most 2048 are allowed",
            s.len()
        ));
    }
    if let Some(c) = s.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!(
            "path {s:?} holds {c:?}; percent-encode spaces, control and non-ASCII characters"
        ));
    }
    Ok(())
}

checked_string!(
    /// The method of an http check, such as `GET` or `HEAD`: an uppercase HTTP token.
    HttpMethod,
    json_schema!({ "type": "string", "pattern": "^[A-Z]{1,16}$" }),
    check_http_method
);

fn check_http_method(s: &str) -> Result<(), String> {
    if !s.is_empty() && s.len() <= 16 && s.bytes().all(|b| b.is_ascii_uppercase()) {
        Ok(())
    } else {
        Err(format!(
            "method {s:?} is invalid; use an uppercase HTTP method such as GET, HEAD or POST"
        ))
    }
}

checked_string!(
    /// A device request name: `vendor/type` or `vendor/type/name`.
    DeviceName,
    json_schema!({ "type": "string", "pattern": "^[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*(/[A-Za-z0-9][-A-Za-z0-9_.]*)?$" }),
    check_device_name
);

fn check_device_name(s: &str) -> Result<(), String> {
    let parts: Vec<&str> = s.split('/').collect();
    if (parts.len() == 2 || parts.len() == 3)
        && parts
            .iter()
            .all(|part| crate::device::is_device_name_part(part))
    {
        Ok(())
    } else {
        Err(format!(
            "device {s:?} is invalid; use vendor/type or vendor/type/name, such as \"nvidia/gpu\""
        ))
    }
}

impl DeviceName {
    /// The vendor part.
    pub fn vendor(&self) -> &str {
        self.0
            .split('/')
            .next()
            .expect("checked: three parts at most, two at least")
    }

    /// The device type part.
    pub fn device_type(&self) -> &str {
        self.0
            .split('/')
            .nth(1)
            .expect("checked: two parts at least")
    }

    /// The model name part, when given.
    pub fn model(&self) -> Option<&str> {
        self.0.split('/').nth(2)
    }
}

/// The signals stead sends to tasks, by name: a task's `killSignal` (any but SIGSTOP and
/// SIGCONT) and a user's `alloc signal`.
pub const SIGNAL_NAMES: [&str; 13] = [
    "SIGABRT", "SIGALRM", "SIGHUP", "SIGINT", "SIGKILL", "SIGQUIT", "SIGTERM", "SIGUSR1",
    "SIGUSR2", "SIGWINCH", "SIGPWR", "SIGSTOP", "SIGCONT",
];

/// Signals that may be sent to a task but cannot be its `killSignal`, with why: they do
/// not end it, so every stop would wait out the whole kill timeout.
pub(crate) const NOT_KILL_SIGNALS: [(&str, &str); 2] = [
    ("SIGSTOP", "it freezes the task"),
    ("SIGCONT", "it only resumes a stopped task"),
];

checked_string!(
    /// A signal name such as `SIGINT`.
    Signal,
    json_schema!({ "enum": SIGNAL_NAMES }),
    check_signal
);

fn check_signal(s: &str) -> Result<(), String> {
    if SIGNAL_NAMES.contains(&s) {
        Ok(())
    } else {
        Err(format!(
            "unknown signal {s:?}; expected one of {}",
            SIGNAL_NAMES.join(", ")
        ))
    }
}

impl Signal {
    /// `SIGINT`, the default kill signal of the exec driver.
    pub fn sigint() -> Self {
        Signal("SIGINT".to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_dns_label_rules() {
        for ok in ["web", "a", "web-2", "0abc", &"a".repeat(63)] {
            assert!(ok.parse::<Name>().is_ok(), "{ok}");
        }
        for bad in [
            "",
            "../x",
            "A_B",
            "-web",
            "web-",
            "web.api",
            "we b",
            &"a".repeat(64),
        ] {
            assert!(bad.parse::<Name>().is_err(), "{bad}");
        }
    }

    #[test]
    fn device_names_split_into_vendor_type_and_model() {
        let d: DeviceName = "nvidia/gpu/a100".parse().unwrap();
        assert_eq!(
            (d.vendor(), d.device_type(), d.model()),
            ("nvidia", "gpu", Some("a100"))
        );
        let d: DeviceName = "acme/fpga".parse().unwrap();
        assert_eq!(d.model(), None);
        for bad in ["gpu", "a/b/c/d", "a//b", "/gpu"] {
            assert!(bad.parse::<DeviceName>().is_err(), "{bad}");
        }
    }

    #[test]
    fn env_names_are_what_an_environment_carries_but_the_stead_prefix() {
        for ok in [
            "PORT",
            "_x1",
            "1X",
            "discovery.type",
            "a-b",
            "STEAD",
            "stead_x",
        ] {
            assert!(ok.parse::<EnvName>().is_ok(), "{ok}");
        }
        for bad in ["", "A=B", "=", "NUL\0", "STEAD_ALLOC_ID", "STEAD_"] {
            assert!(bad.parse::<EnvName>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn user_names_are_what_the_passwd_file_can_hold_or_a_numeric_uid() {
        for ok in [
            "web",
            "john.doe",
            "Svc",
            "_apt",
            "build-01",
            "0",
            "65534",
            "4294967295",
        ] {
            assert!(ok.parse::<UserName>().is_ok(), "{ok}");
        }
        for bad in [
            "",
            "Web User",
            "a:b",
            "a/b",
            "a,b",
            "-x",
            ".",
            "..",
            "tab\t",
            "4294967296",
        ] {
            assert!(bad.parse::<UserName>().is_err(), "{bad:?}");
        }
        let long = "u".repeat(257);
        assert!(long.parse::<UserName>().is_err());
    }

    #[test]
    fn label_keys_take_an_optional_prefix() {
        for ok in ["team", "app.kubernetes.io/name", "Tier_1"] {
            assert!(ok.parse::<LabelKey>().is_ok(), "{ok}");
        }
        for bad in ["", "-x", "a/", "/a", "UPPER.example/x"] {
            assert!(bad.parse::<LabelKey>().is_err(), "{bad}");
        }
    }
}
