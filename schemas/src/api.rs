//! The HTTP API's own documents (beyond the alloc status of [`crate::status`]): errors,
//! the alloc list, the node, health, and the bodies and queries of requests.
//!
//! camelCase JSON; times are RFC 3339. The CLI and the tests read these same types, so a
//! change here is an API change.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::time::Timestamp;

/// The body of every error response: a stable, machine-readable `code` and a lowercase
/// human `message`; `details` lists individual problems when there are several.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ErrorBody {
    /// What went wrong, stable across releases: `alloc_not_found`, `task_not_found`,
    /// `task_not_running`, `invalid_signal`, `invalid_request`, `unauthorized`,
    /// `body_too_large`, `not_found`, `method_not_allowed`, `metrics_disabled`,
    /// `shutting_down`, `driver_error`, `internal`; for exec also `upgrade_required`,
    /// `too_many_execs`, `exec_unsupported`, `command_not_found` and
    /// `command_not_executable`.
    pub code: String,
    /// What went wrong, for people.
    pub message: String,
    /// Individual problems, when there are several.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub details: Vec<String>,
}

/// One alloc in `GET /v1/allocs` and `stead alloc list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AllocListItem {
    /// The alloc's name.
    pub name: String,
    /// `<name>-<first 8 hex of revision>`.
    pub id: String,
    /// `run` or `stop`.
    pub desired_status: String,
    /// `pending`, `running`, `complete` or `failed`.
    pub client_status: String,
    /// How many tasks the alloc has.
    pub tasks: u32,
    /// How many of them run now.
    pub running_tasks: u32,
    /// Restarts over all tasks.
    pub restarts: u32,
    /// When the newest task event happened.
    pub modified_at: Option<Timestamp>,
    /// Whether a broken edit of the spec is waiting while the last good revision runs.
    pub spec_error: bool,
    /// The newest event of any of its tasks; left out before the first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_event: Option<AllocEvent>,
    /// What its running tasks use now, summed over those the node measures; only with
    /// `?usage=true`, and left out when none is measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<AllocUsage>,
}

/// One task event of an alloc, with the task it happened to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AllocEvent {
    /// The task's name.
    pub task: String,
    /// Nomad's event type string, such as `Terminated`.
    #[serde(rename = "type")]
    pub event_type: String,
    /// When it happened.
    pub time: Timestamp,
    /// Nomad's description.
    pub message: String,
}

/// What an alloc's running tasks use now, from their cgroups.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AllocUsage {
    /// CPU used since the node's previous measurement of the alloc (at least a second
    /// earlier), in percent of one core; `null` on the first.
    pub cpu_percent: Option<f64>,
    /// Memory charged now, in bytes; `null` without the memory controller.
    pub memory_bytes: Option<u64>,
}

/// The node, as `GET /v1/node` and `stead node status` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    /// The node's name (its host name).
    pub name: String,
    /// The agent's version.
    pub version: String,
    /// When the agent started.
    pub started_at: Timestamp,
    /// The node's time when this document was made.
    pub time: Timestamp,
    /// Allocs by client status (`pending`, `running`, `complete`, `failed`), all present.
    pub allocs: BTreeMap<String, u32>,
    /// Each enabled driver, by name.
    pub drivers: BTreeMap<String, DriverStatus>,
    /// Device groups, sorted by `vendor/type/name`: every group a plugin reports, and
    /// every group an alloc holds an instance of.
    pub devices: Vec<DeviceGroupStatus>,
    /// Each configured device plugin, sorted by name: whether it reports, and what it
    /// says of its devices.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_plugins: Vec<DevicePluginStatus>,
    /// The node's CPU and memory, and what running allocs reserve of them; `null` from
    /// an agent that does not report them.
    #[serde(default)]
    pub resources: Option<NodeResources>,
}

/// The node's CPU and memory, and the sums that running allocs' tasks reserve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeResources {
    /// CPU cores the agent may use.
    pub cpu_cores: u32,
    /// The MHz of one core, from the node's fingerprint: what `cpuHardLimit` divides by.
    pub cpu_mhz_per_core: u32,
    /// Cores times the MHz of one: the node's CPU, in the unit of a task's `cpu`.
    #[serde(rename = "cpuMHz")]
    pub cpu_mhz: u64,
    /// The node's memory, in MiB.
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    /// The `cpu` of every task of running allocs, summed.
    #[serde(rename = "reservedCpuMHz")]
    pub reserved_cpu_mhz: u64,
    /// The `memoryMB` of every task of running allocs, summed.
    #[serde(rename = "reservedMemoryMB")]
    pub reserved_memory_mb: u64,
}

/// One driver's fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DriverStatus {
    /// `healthy`, `unhealthy` or `undetected`.
    pub health: String,
    /// Why it has that health.
    pub description: String,
    /// Facts about the driver (versions, capabilities).
    pub attributes: BTreeMap<String, String>,
}

/// One group of devices of one vendor, type and name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceGroupStatus {
    /// The vendor, such as `nvidia`.
    pub vendor: String,
    /// The type, such as `gpu`.
    #[serde(rename = "type")]
    pub device_type: String,
    /// The model name.
    pub name: String,
    /// The device plugin that reports it; unset when none does (an alloc holds an
    /// instance of it, restored before its plugin reported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin: Option<String>,
    /// Facts shared by every instance.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, String>,
    /// The instances of the group, sorted by id.
    pub instances: Vec<DeviceInstanceStatus>,
}

/// One device plugin on the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DevicePluginStatus {
    /// The plugin's name (`static`, `nvidia`).
    pub name: String,
    /// `reporting` (its last report was taken), `starting` (none yet) or `failed` (it
    /// stopped or sent an invalid report: its devices are unhealthy until it reports
    /// again).
    pub state: String,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What its last report says beside its devices: why it has none, say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// How many device instances it reports.
    pub instances: u32,
}

/// One device instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceInstanceStatus {
    /// The instance's id within its group.
    pub id: String,
    /// Whether it is usable.
    pub healthy: bool,
    /// Why it is not healthy, when known (or that no plugin reports it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Facts about this instance alone (bus id, memory).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, String>,
    /// The task that holds it; unset when free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_by: Option<DeviceHolder>,
}

/// The task that holds a device instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceHolder {
    /// The alloc's name.
    pub alloc: String,
    /// The task's name.
    pub task: String,
}

/// `GET /v1/health`: whether each part of the agent works.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthStatus {
    /// `shutting down` once the agent's shutdown (detach or drain) has begun; else `ok`
    /// when every part is healthy, `degraded` when one is not.
    pub status: String,
    /// Each part (`store`, `driver.<name>`), by name.
    pub components: BTreeMap<String, ComponentHealth>,
}

/// One part of the agent in [`HealthStatus`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ComponentHealth {
    /// Whether it works.
    pub healthy: bool,
    /// What is known about it; left out for a request without the API's token, since
    /// it may name allocs and paths.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// `GET /v1/allocs/{name}/stats`: what the alloc's running tasks use now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AllocStats {
    /// The alloc's name.
    pub name: String,
    /// The alloc's id.
    pub id: String,
    /// When the measurement was taken.
    pub time: Timestamp,
    /// Each running task whose driver measures it (the mock driver does not), by name.
    pub tasks: BTreeMap<String, TaskStats>,
    /// Each task's device instances with their stats, by task name; left out when none.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub task_devices: BTreeMap<String, Vec<DeviceStatsEntry>>,
    /// Each device group the alloc uses, with every instance any of its tasks holds: two
    /// tasks on instances of one group give one entry. Left out when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_groups: Vec<DeviceGroupStats>,
}

/// One device instance's stats.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceStatsEntry {
    /// The device group, `vendor/type/name`.
    pub group: String,
    /// The instance's id.
    pub id: String,
    /// Its measurements by name; `None` when its plugin had none.
    pub stats: Option<BTreeMap<String, f64>>,
}

/// The instances of one device group an alloc uses, with their stats.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceGroupStats {
    /// The device group, `vendor/type/name`.
    pub group: String,
    /// Each instance any task of the alloc holds, by id.
    pub instances: Vec<DeviceStatsEntry>,
}

/// What one task's processes use.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskStats {
    /// CPU use since the previous measurement of the task, in percent of one core.
    pub cpu_percent: f64,
    /// CPU time used so far (user plus system), in seconds.
    pub cpu_seconds: f64,
    /// Resident memory, in bytes.
    pub rss_bytes: u64,
    /// How many processes the task has.
    pub processes: u32,
    /// What the kernel counts for the task's cgroup; left out when it has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<CgroupStats>,
}

/// One task's use and limits as its cgroup counts them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CgroupStats {
    /// Memory charged to the task now (page cache included), in bytes; `null` without
    /// the memory controller.
    pub memory_bytes: Option<u64>,
    /// The most memory charged to it at once, in bytes; `null` where the kernel does not
    /// count it.
    pub memory_peak_bytes: Option<u64>,
    /// Its hard memory limit, in bytes; `null`: none.
    pub memory_limit_bytes: Option<u64>,
    /// CPU time it used, in seconds.
    pub cpu_seconds: f64,
    /// How long its CPU quota held it back, in seconds; `null` where not counted.
    pub cpu_throttled_seconds: Option<f64>,
    /// Its processes and threads now; `null` where not counted.
    pub pids: Option<u64>,
    /// The most it may have; `null`: no limit.
    pub pids_limit: Option<u64>,
    /// Processes of it the kernel's OOM killer killed in this run.
    pub oom_kills: u64,
}

/// The body of `POST /v1/allocs/{name}/restart`; an empty body restarts every running task.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RestartRequest {
    /// The task to restart; unset restarts every running task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
}

/// The body of `POST /v1/allocs/{name}/signal`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SignalRequest {
    /// The task to signal.
    pub task: String,
    /// The signal's name, such as `SIGHUP`.
    pub signal: String,
}

/// The `Upgrade` protocol of `POST /v1/allocs/{name}/exec/{task}`: after `101 Switching
/// Protocols` the connection carries [`crate::exec_stream`] frames both ways.
pub const EXEC_UPGRADE_PROTOCOL: &str = "stead-exec";

/// The body of `POST /v1/allocs/{name}/exec/{task}`: the command to run in the task's
/// context, and how its input and output are wired.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExecRequest {
    /// The program and its arguments; the program is an absolute path or a name looked
    /// up in the task's `PATH`. Invariant: not empty.
    pub command: Vec<String>,
    /// Run it on a pseudo-terminal (its standard input, output and error), sized
    /// `width` by `height` when given.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tty: bool,
    /// Forward the client's `stdin` frames; otherwise the command reads `/dev/null`
    /// (or, with `tty`, a terminal nobody types into).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stdin: bool,
    /// The terminal's columns, with `tty`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<u16>,
    /// The terminal's rows, with `tty`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub height: Option<u16>,
    /// `TERM` for the command, with `tty`, unless the task's env sets one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub term: Option<String>,
}

/// Which output of a task to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogStream {
    /// Standard output.
    #[default]
    Stdout,
    /// Standard error.
    Stderr,
}

impl LogStream {
    /// `stdout` or `stderr`, as in the log files' names.
    pub fn as_str(self) -> &'static str {
        match self {
            LogStream::Stdout => "stdout",
            LogStream::Stderr => "stderr",
        }
    }
}

/// Where a log `offset` counts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogOrigin {
    /// From the oldest byte still kept.
    #[default]
    Start,
    /// Back from the newest byte.
    End,
}

/// The query of `GET /v1/allocs/{name}/logs/{task}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LogsQuery {
    /// Which output (`type=stdout|stderr`; default stdout).
    #[serde(rename = "type", default)]
    pub stream: LogStream,
    /// Keep streaming new output, across file rotations, until the task is dead.
    #[serde(default)]
    pub follow: bool,
    /// Bytes to skip from `origin` (default 0).
    #[serde(default)]
    pub offset: u64,
    /// Where `offset` counts from (default `start`).
    #[serde(default)]
    pub origin: LogOrigin,
    /// Read the logs of the revision the current one replaced (kept one revision back,
    /// until the alloc is collected); never followed.
    #[serde(default)]
    pub previous: bool,
}

/// The query of `GET /v1/allocs`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AllocsQuery {
    /// Measure what each alloc's running tasks use now (`usage=true`): a few small
    /// reads per running task.
    #[serde(default)]
    pub usage: bool,
}

/// The query of the status page's node view (`GET /ui`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UiQuery {
    /// Only allocs whose name contains it are listed (`q=web`).
    #[serde(default)]
    pub q: String,
}

/// The response header of a logs request saying how many bytes of the body already
/// existed when the request was served (the rest arrived while following).
pub const LOG_BACKLOG_HEADER: &str = "stead-log-backlog";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_query_defaults_to_stdout_from_the_start_without_following() {
        let query: LogsQuery = serde_json::from_str("{}").expect("defaults apply");
        assert_eq!(query, LogsQuery::default());
        assert_eq!(query.stream, LogStream::Stdout);
        assert_eq!(query.origin, LogOrigin::Start);
    }

    #[test]
    fn error_bodies_omit_empty_details() {
        let body = ErrorBody {
            code: "alloc_not_found".to_owned(),
            message: "alloc \"web\" not found".to_owned(),
            details: Vec::new(),
        };
        assert_eq!(
            serde_json::to_string(&body).expect("serializes"),
            r#"{"code":"alloc_not_found","message":"alloc \"web\" not found"}"#
        );
    }
}

/// What `POST /v1/gc` and `POST /v1/allocs/{name}/gc` (`stead alloc gc`) did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GcResult {
    /// The allocs destroyed: their tasks' dirs, logs and records are gone.
    pub collected: Vec<String>,
    /// The allocs that were not, with why (a spec that came back meanwhile, say).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<GcRefusal>,
}

/// An alloc garbage collection left.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GcRefusal {
    /// The alloc.
    pub name: String,
    /// Why it stays.
    pub reason: String,
}
