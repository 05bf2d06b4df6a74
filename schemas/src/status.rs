//! What the agent shows about allocs and tasks: the documents of `GET /v1/allocs/{name}`
//! and `stead alloc status --json`. camelCase; times are RFC 3339.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::time::Timestamp;

/// One alloc, as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AllocStatus {
    /// The alloc's name.
    pub name: String,
    /// `<name>-<first 8 hex of revision>`.
    pub id: String,
    /// The full revision hash.
    pub revision: String,
    /// `run` or `stop` (a removed spec, or a user's stop, shows `stop`).
    pub desired_status: String,
    /// A user stopped the alloc (`stead alloc stop`) whatever its spec says; `stead
    /// alloc start` clears it. Left out when not.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stopped_by_user: bool,
    /// `pending`, `running`, `complete` or `failed`.
    pub client_status: String,
    /// The diagnostics of a broken edit while the last good revision keeps running.
    pub spec_error: Option<String>,
    /// Why the alloc's state on this node cannot be carried on: its stored state could
    /// not be resumed after an agent restart (a corrupt record, a record of a newer
    /// agent, a missing alloc dir), or its new revision cannot take the sticky disk over
    /// yet (the stopped old revision is shown meanwhile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_error: Option<String>,
    /// The file (or key) the running revision's spec was read from; left out when the
    /// agent has not read it since it started (a restored alloc before the first pass).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_file: Option<String>,
    /// Whether every task with health checks that is not dead runs and passes all of
    /// them; `null` when no task has checks.
    #[serde(default)]
    pub healthy: Option<bool>,
    /// Each task, by name. Boxed: a map node has room for eleven values and most allocs
    /// have a few tasks, so unboxed statuses left most of 2.7 KB per alloc empty.
    pub tasks: BTreeMap<String, Box<TaskStatus>>,
}

/// One task, as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskStatus {
    /// `pending`, `running` or `dead`.
    pub state: String,
    /// Its lifecycle stage, as Nomad shows it: `prestart`, `poststart` or `poststop`,
    /// with ` sidecar` after a sidecar's; left out for a main task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<String>,
    /// Whether the task failed.
    pub failed: bool,
    /// Restarts so far.
    pub restarts: u32,
    /// Runs the kernel's OOM killer ended, so far; left out when none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub oom_kills: u32,
    /// When it last restarted.
    pub last_restart: Option<Timestamp>,
    /// When it last started.
    pub started_at: Option<Timestamp>,
    /// When it died for good.
    pub finished_at: Option<Timestamp>,
    /// The process id, for drivers that have one.
    pub pid: Option<u32>,
    /// How its last run ended; left out before the first ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<TaskExitStatus>,
    /// The device instances the task holds, each with its health; left out when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<TaskDeviceStatus>,
    /// The task's health checks, in spec order; left out when it has none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checks: Vec<TaskCheckStatus>,
    /// History, oldest first.
    pub events: Vec<TaskEventStatus>,
}

/// How a run of a task ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskExitStatus {
    /// When.
    pub time: Timestamp,
    /// The exit code (128 + n after signal n).
    pub exit_code: i32,
    /// The signal that ended it, if one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// Whether the kernel's OOM killer killed a process of it (read from its cgroup,
    /// never guessed from the exit code).
    pub oom_killed: bool,
}

/// One health check of a task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskCheckStatus {
    /// The check's name.
    pub name: String,
    /// `pending`, `passing`, `warning` or `critical`.
    pub status: String,
    /// What the last result said: an http check's status line and up to 4 KiB of its
    /// body, a tcp check's connect error, an exec check's output.
    pub output: String,
    /// When the status took its current value; `null` while pending.
    pub since: Option<Timestamp>,
}

/// A device instance a task holds. An unhealthy one is flagged here; the task keeps it
/// and runs on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskDeviceStatus {
    /// The device group, `vendor/type/name`.
    pub group: String,
    /// The instance's id.
    pub id: String,
    /// Whether it is healthy now.
    pub healthy: bool,
    /// Why not, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// One task event, as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskEventStatus {
    /// Nomad's event type string, such as `Terminated`.
    #[serde(rename = "type")]
    pub event_type: String,
    /// When it happened.
    pub time: Timestamp,
    /// Nomad's description.
    pub message: String,
    /// For `Terminated`: the exit code.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub exit_code: Option<i32>,
    /// For `Terminated`: the signal.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub signal: Option<i32>,
    /// For `Terminated`: the kernel's OOM killer killed a process of the task; left out
    /// when not.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub oom_killed: bool,
}

/// Whether a count is zero, so that it is left out of a document (serde's predicate).
fn is_zero(count: &u32) -> bool {
    *count == 0
}
