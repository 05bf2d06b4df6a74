//! The versioned records the agent persists: one [`AllocRecord`] per alloc name.
//!
//! A record is everything a restarted agent needs to carry on with an alloc: the spec as
//! written, whether the spec file is gone, the reconciler's state, the driver handles
//! of its tasks and the device instances they hold. It is written as one unit per
//! change, so it is never half updated.
//!
//! The format is JSON in camelCase. Optional fields are left out when unset, and an unset
//! value is never stored as zero. Unknown fields are ignored; incompatible changes bump
//! [`ALLOC_RECORD_VERSION`], and [`AllocRecord::decode`] migrates older records and refuses
//! newer ones. Task names and event types are plain strings here, so that a record a later
//! check would refuse still decodes, and the agent's conversion names what is wrong.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::Timestamp;
use crate::device::AssignedDevice;
use crate::diagnostic::Diagnostic;
use crate::spec::{AllocSpec, DriverKind, Name};

/// The version of [`AllocRecord`] this agent writes, and the newest it reads.
pub const ALLOC_RECORD_VERSION: u32 = 1;

/// Everything persisted about one alloc, stored under its name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AllocRecord {
    /// The record format's version; [`ALLOC_RECORD_VERSION`] when written by this agent.
    pub version: u32,
    /// The alloc's name; the record's key, so it equals `spec.metadata.name`.
    pub name: Name,
    /// The spec as written (not normalized).
    pub spec: AllocSpec,
    /// The spec's revision, 64 lowercase hex digits.
    pub revision: String,
    /// The spec file is gone: the alloc is being stopped, then destroyed.
    pub removed: bool,
    /// The reconciler's state.
    pub state: AllocStateRecord,
    /// The driver handle of each task that has a process, by task name.
    pub handles: BTreeMap<String, TaskHandleRecord>,
    /// The device instances each task holds, by task name; left out when none.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub devices: BTreeMap<String, Vec<AssignedDevice>>,
    /// A user stopped the alloc (`stead alloc stop`), whatever its spec says, until a
    /// user starts it again; left out when not.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stopped_by_user: bool,
}

/// The state of one alloc revision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AllocStateRecord {
    /// Each task's state, by task name.
    pub tasks: BTreeMap<String, TaskStateRecord>,
    /// The shutdown in progress, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shutdown: Option<ShutdownRecord>,
    /// Whether the prestart stage completed.
    pub main_released: bool,
    /// Whether every main task has run.
    pub poststart_released: bool,
}

/// A shutdown of the whole alloc in progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShutdownRecord {
    /// Why.
    pub reason: ShutdownReasonRecord,
    /// When it began.
    pub at: Timestamp,
}

/// Why the whole alloc is shutting down: `{"kind": "taskFailed", "task": "web"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum ShutdownReasonRecord {
    /// It was asked to stop.
    Stop,
    /// A task failed.
    TaskFailed {
        /// The task that failed.
        task: String,
    },
    /// The leader died.
    LeaderDead,
}

/// The state of one task.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskStateRecord {
    /// Pending, running or dead.
    pub phase: TaskPhaseRecord,
    /// Whether the task failed.
    pub failed: bool,
    /// How many times the task was restarted.
    pub restarts: u32,
    /// How many of its runs the kernel's OOM killer ended; left out when none, so the
    /// records written before it existed read as zero.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub oom_kills: u32,
    /// When it last restarted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_restart: Option<Timestamp>,
    /// When it last started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Timestamp>,
    /// When it died for good.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Timestamp>,
    /// The restart policy's bookkeeping.
    pub tracker: RestartTrackerRecord,
    /// What the driver is doing for the task.
    pub process: ProcessRecord,
    /// When a pending restart is due.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_at: Option<Timestamp>,
    /// The kill in progress, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kill: Option<KillRecord>,
    /// Whether `Task Setup` was emitted.
    pub set_up: bool,
    /// History, oldest first.
    pub events: Vec<TaskEventRecord>,
    /// The health checks' state in the current run, by check name; left out when none.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub checks: BTreeMap<String, CheckStateRecord>,
}

/// One health check's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckStateRecord {
    /// `pending`, `passing`, `warning` or `critical`.
    pub status: String,
    /// The last result's output.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub output: String,
    /// When the status took its current value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Timestamp>,
    /// How many results in a row had this status.
    pub consecutive: u32,
    /// When the check became unhealthy, for its restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unhealthy_since: Option<Timestamp>,
}

/// A task's phase as users see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum TaskPhaseRecord {
    /// Not started yet, or waiting to restart.
    Pending,
    /// Its process runs.
    Running,
    /// Finished for good.
    Dead,
}

/// What the driver is doing for a task: `{"state": "running", "since": "…"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "camelCase")]
pub enum ProcessRecord {
    /// Nothing runs.
    Idle,
    /// A start call is in flight.
    Starting {
        /// When it was issued.
        since: Timestamp,
    },
    /// The task runs.
    Running {
        /// When it started.
        since: Timestamp,
    },
}

/// A kill of one task in progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KillRecord {
    /// Why.
    pub reason: KillReasonRecord,
    /// When the kill signal is due.
    pub signal_at: Timestamp,
    /// When the kill signal was sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signalled_at: Option<Timestamp>,
    /// When SIGKILL was sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forced_at: Option<Timestamp>,
    /// Whether an in-flight start was asked to stop.
    pub cancel_requested: bool,
}

/// Why a task is being killed: `{"kind": "siblingFailed", "task": "db"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum KillReasonRecord {
    /// The alloc is stopping.
    Stop,
    /// A user asked for a restart.
    UserRestart,
    /// Another task failed.
    SiblingFailed {
        /// The task that failed.
        task: String,
    },
    /// The leader died.
    LeaderDead,
    /// Every main task died and this is a sidecar.
    MainTasksDead,
    /// A health check stayed unhealthy.
    Unhealthy {
        /// The check.
        check: String,
        /// The restart delay's random draw.
        jitter: u32,
    },
}

/// A task's restart history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RestartTrackerRecord {
    /// When the current window began.
    pub window_start: Timestamp,
    /// Automatic restart decisions taken in the current window.
    pub attempts_in_window: u32,
    /// Restarts granted since the task last ran for a whole interval.
    pub consecutive_restarts: u32,
}

/// One entry of a task's history.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskEventRecord {
    /// Nomad's type string, such as `Restart Signaled`.
    #[serde(rename = "type")]
    pub event_type: String,
    /// When it happened.
    pub time: Timestamp,
    /// Nomad's description of it.
    pub message: String,
    /// The exit code, for `Terminated`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// The signal that ended the task, for `Terminated`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// For `Terminated`: the kernel's OOM killer killed a process of the task.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub oom_killed: bool,
}

/// A started task as its driver identifies it, so a restarted agent can recover it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskHandleRecord {
    /// The driver that started the task.
    pub driver: DriverKind,
    /// The driver's id of this run of the task.
    pub id: String,
    /// The process id, for drivers that run processes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// When the driver started the task.
    pub started_at: Timestamp,
}

/// Why a stored record cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The bytes are not a record of any version.
    #[error("record is malformed")]
    Malformed {
        /// What the JSON decoder refused.
        #[source]
        source: serde_json::Error,
    },
    /// A newer agent wrote the record.
    #[error("record version {found} is newer than the newest this agent reads ({supported})")]
    FutureVersion {
        /// The record's version.
        found: u32,
        /// [`ALLOC_RECORD_VERSION`].
        supported: u32,
    },
    /// An older version no agent ever wrote.
    #[error("record version {found} is unknown")]
    UnknownVersion {
        /// The record's version.
        found: u32,
    },
    /// The record is stored under another alloc's name (the key is in the caller's context).
    #[error("record belongs to alloc {found}")]
    NameMismatch {
        /// The name inside the record.
        found: Name,
    },
    /// A task name in the record is not a valid name.
    #[error("invalid task name at {field}: {reason}")]
    InvalidTaskName {
        /// Where in the record, such as `state.tasks` or `state.shutdown.reason.task`.
        field: String,
        /// The name as stored.
        task: String,
        /// Why it is invalid (names the task).
        reason: String,
    },
    /// The stored spec does not pass this agent's validation.
    #[error("stored spec is invalid: {}", join_diagnostics(.diagnostics))]
    InvalidSpec {
        /// Every problem found.
        diagnostics: Vec<Diagnostic>,
    },
    /// The state's tasks are not the spec's tasks.
    #[error("stored state has tasks {state_tasks:?} but the spec has {spec_tasks:?}")]
    TasksMismatch {
        /// The task names of the spec.
        spec_tasks: Vec<String>,
        /// The task names of the state.
        state_tasks: Vec<String>,
    },
    /// A check status this agent does not know.
    #[error("task {task} has check {check} in unknown status {status:?}")]
    UnknownCheckStatus {
        /// The task.
        task: String,
        /// The check.
        check: String,
        /// The status as stored.
        status: String,
    },
    /// A task event whose type this agent does not know.
    #[error("task {task} has an event of unknown type {event_type:?}")]
    UnknownEventType {
        /// The task whose history holds the event.
        task: String,
        /// The type string as stored.
        event_type: String,
    },
}

/// Whether a count is zero, so that it is left out of a record (serde's predicate).
fn is_zero(count: &u32) -> bool {
    *count == 0
}

fn join_diagnostics(diagnostics: &[Diagnostic]) -> String {
    let messages: Vec<String> = diagnostics.iter().map(ToString::to_string).collect();
    messages.join("; ")
}

/// Just the version of a record, read before anything else.
#[derive(Deserialize)]
struct VersionProbe {
    version: u32,
}

impl AllocRecord {
    /// The record as stored: compact JSON.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self)
            .expect("record types serialize to JSON: string keys, no non-finite floats")
    }

    /// Reads a stored record of this or an older version, migrating it to the current one.
    pub fn decode(bytes: &[u8]) -> Result<AllocRecord, RecordError> {
        let malformed = |source| RecordError::Malformed { source };
        let VersionProbe { version } = serde_json::from_slice(bytes).map_err(malformed)?;
        if version > ALLOC_RECORD_VERSION {
            return Err(RecordError::FutureVersion {
                found: version,
                supported: ALLOC_RECORD_VERSION,
            });
        }
        let value = serde_json::from_slice(bytes).map_err(malformed)?;
        let current = migrate(version, value)?;
        serde_json::from_value(current).map_err(malformed)
    }
}

/// Rewrites a record of version `found` (at most the current one) into the current
/// version's JSON, one version step at a time.
///
/// Version 1 is the first, so today this is the identity. A version 2 adds an arm
/// `1 => migrate(2, v1_to_v2(value))` and changes the current version's arm to 2.
fn migrate(found: u32, value: serde_json::Value) -> Result<serde_json::Value, RecordError> {
    match found {
        ALLOC_RECORD_VERSION => Ok(value),
        _ => Err(RecordError::UnknownVersion { found }),
    }
}

#[cfg(test)]
mod tests {
    use expect_test::expect;

    use super::*;
    use crate::spec::{AllocBody, DriverConfig, MockConfig, TaskSpec};

    fn at(secs: u64) -> Timestamp {
        Timestamp::from_since_epoch(std::time::Duration::from_secs(secs))
    }

    fn one_task_record() -> AllocRecord {
        let name: Name = "web".parse().expect("valid name");
        let task = TaskSpec {
            name: "server".parse().expect("valid name"),
            driver: DriverKind::Mock,
            config: DriverConfig::Mock(MockConfig::default()),
            env: None,
            user: None,
            leader: None,
            lifecycle: None,
            restart: None,
            kill_timeout: None,
            kill_signal: None,
            shutdown_delay: None,
            logs: None,
            resources: None,
            checks: None,
        };
        let spec = AllocSpec {
            api_version: crate::spec::API_VERSION.to_owned(),
            kind: crate::spec::KIND_ALLOC.to_owned(),
            metadata: crate::spec::Metadata {
                name: name.clone(),
                labels: None,
                node_selector: None,
            },
            spec: AllocBody {
                alloc_type: None,
                desired_status: None,
                restart: None,
                ephemeral_disk: None,
                shutdown_delay: None,
                tasks: vec![task],
            },
        };
        let server = TaskStateRecord {
            phase: TaskPhaseRecord::Running,
            failed: false,
            restarts: 0,
            oom_kills: 0,
            last_restart: None,
            started_at: Some(at(1_795_306_201)),
            finished_at: None,
            tracker: RestartTrackerRecord {
                window_start: at(1_795_306_200),
                attempts_in_window: 0,
                consecutive_restarts: 0,
            },
            process: ProcessRecord::Running {
                since: at(1_795_306_201),
            },
            restart_at: None,
            kill: None,
            set_up: true,
            events: vec![TaskEventRecord {
                event_type: "Started".to_owned(),
                time: at(1_795_306_201),
                message: "Task started by client".to_owned(),
                exit_code: None,
                signal: None,
                oom_killed: false,
            }],
            checks: BTreeMap::new(),
        };
        AllocRecord {
            version: ALLOC_RECORD_VERSION,
            name,
            revision: "0756062463a747c0d72ff9cb530347081627f1ed873f184b3e1bb47ed1bf521c".to_owned(),
            spec,
            removed: false,
            stopped_by_user: false,
            state: AllocStateRecord {
                tasks: BTreeMap::from([("server".to_owned(), server)]),
                shutdown: None,
                main_released: true,
                poststart_released: true,
            },
            handles: BTreeMap::from([(
                "server".to_owned(),
                TaskHandleRecord {
                    driver: DriverKind::Mock,
                    id: "web-server-1".to_owned(),
                    pid: None,
                    started_at: at(1_795_306_201),
                },
            )]),
            devices: BTreeMap::new(),
        }
    }

    #[test]
    fn record_json_format_is_stable() {
        let json = serde_json::to_string_pretty(&one_task_record()).expect("serializes");
        expect![[r#"
            {
              "version": 1,
              "name": "web",
              "spec": {
                "apiVersion": "stead/v1",
                "kind": "Alloc",
                "metadata": {
                  "name": "web"
                },
                "spec": {
                  "tasks": [
                    {
                      "name": "server",
                      "driver": "mock",
                      "config": {}
                    }
                  ]
                }
              },
              "revision": "0756062463a747c0d72ff9cb530347081627f1ed873f184b3e1bb47ed1bf521c",
              "removed": false,
              "state": {
                "tasks": {
                  "server": {
                    "phase": "running",
                    "failed": false,
                    "restarts": 0,
                    "startedAt": "2026-11-22T00:10:01Z",
                    "tracker": {
                      "windowStart": "2026-11-22T00:10:00Z",
                      "attemptsInWindow": 0,
                      "consecutiveRestarts": 0
                    },
                    "process": {
                      "state": "running",
                      "since": "2026-11-22T00:10:01Z"
                    },
                    "setUp": true,
                    "events": [
                      {
                        "type": "Started",
                        "time": "2026-11-22T00:10:01Z",
                        "message": "Task started by client"
                      }
                    ]
                  }
                },
                "mainReleased": true,
                "poststartReleased": true
              },
              "handles": {
                "server": {
                  "driver": "mock",
                  "id": "web-server-1",
                  "startedAt": "2026-11-22T00:10:01Z"
                }
              }
            }"#]]
        .assert_eq(&json);
    }

    #[test]
    fn record_decodes_what_it_encodes() {
        let record = one_task_record();
        let decoded = AllocRecord::decode(&record.encode()).expect("decodes");
        assert_eq!(decoded, record);
    }

    #[test]
    fn record_decode_ignores_unknown_fields_of_the_same_version() {
        let mut value = serde_json::to_value(one_task_record()).expect("serializes");
        value["addedLater"] = serde_json::json!({"x": 1});
        value["state"]["tasks"]["server"]["alsoNew"] = serde_json::json!(true);
        let bytes = serde_json::to_vec(&value).expect("serializes");
        assert_eq!(
            AllocRecord::decode(&bytes).expect("decodes"),
            one_task_record()
        );
    }

    #[test]
    fn record_of_a_newer_version_is_refused_as_future() {
        let mut value = serde_json::to_value(one_task_record()).expect("serializes");
        value["version"] = serde_json::json!(2);
        let bytes = serde_json::to_vec(&value).expect("serializes");
        let error = AllocRecord::decode(&bytes).expect_err("future version");
        assert!(
            matches!(
                error,
                RecordError::FutureVersion {
                    found: 2,
                    supported: 1
                }
            ),
            "{error:?}"
        );
        assert_eq!(
            error.to_string(),
            "record version 2 is newer than the newest this agent reads (1)"
        );
    }

    #[test]
    fn record_of_a_version_before_the_first_is_unknown() {
        let mut value = serde_json::to_value(one_task_record()).expect("serializes");
        value["version"] = serde_json::json!(0);
        let bytes = serde_json::to_vec(&value).expect("serializes");
        let error = AllocRecord::decode(&bytes).expect_err("unknown version");
        assert!(
            matches!(error, RecordError::UnknownVersion { found: 0 }),
            "{error:?}"
        );
    }

    #[test]
    fn record_garbage_or_without_version_is_malformed_with_the_json_error_as_source() {
        for bytes in [
            &b"\x00\xffnot json"[..],
            br#"{"name": "web"}"#,
            br#"{"version": "one"}"#,
            br#"{"version": 1, "name": "web"}"#,
        ] {
            let error = AllocRecord::decode(bytes).expect_err("malformed");
            assert!(matches!(error, RecordError::Malformed { .. }), "{error:?}");
            assert_eq!(error.to_string(), "record is malformed");
            assert!(std::error::Error::source(&error).is_some());
        }
    }
}
