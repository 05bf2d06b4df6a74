//! Persisted state: the [`Store`] seam, write deduplication, and the conversions between
//! the reconcilers' state and the records of [`stead_schemas::record`].
//!
//! Each alloc's worker owns its alloc's record and writes it whole after every change;
//! a write whose encoding equals the last one written under that name is skipped and
//! counted, as Nomad's boltdd does. A record that cannot be read fails its own alloc and
//! no other: [`Store::load_allocs`] reports it as a [`CorruptRecord`] beside the rest.
//!
//! Implementations: [`MemoryStore`] here, and `RocksDbStore` in `stead-store-rocksdb`.
//! Both pass [`conformance`].

pub mod conformance;
pub mod faulty;
pub mod memory;
pub mod writer;

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use stead_reconcilers::alloc::{AllocState, Shutdown, ShutdownReason};
use stead_reconcilers::check::{CheckState, CheckStatus};
use stead_reconcilers::event::{TaskEvent, TaskEventType};
use stead_reconcilers::restart::{Jitter, RestartTracker};
use stead_reconcilers::task::{KillProgress, KillReason, Process, TaskPhase, TaskState};
use stead_schemas::ValidSpec;
use stead_schemas::device::AssignedDevice;
use stead_schemas::record::{
    AllocRecord, AllocStateRecord, CheckStateRecord, KillReasonRecord, KillRecord, ProcessRecord,
    RecordError, RestartTrackerRecord, ShutdownReasonRecord, ShutdownRecord, TaskEventRecord,
    TaskHandleRecord, TaskPhaseRecord, TaskStateRecord,
};
use stead_schemas::spec::Name;

use crate::driver::TaskHandle;

pub use faulty::FaultyStore;
pub use memory::MemoryStore;
pub use writer::{StoreWrite, StoreWriter};

/// Where allocs' records are kept across agent restarts.
///
/// Calls are synchronous and may block on disk; workers write through the node's
/// [`StoreWriter`], which keeps them off the async runtime's threads. Each alloc's records
/// are written by one worker at a time.
pub trait Store: Send + Sync + 'static {
    /// Writes the alloc's record atomically, replacing any earlier one.
    fn put_alloc(&self, record: &AllocRecord) -> Result<(), StoreError>;
    /// Removes the alloc's record; removing a missing one is not an error.
    fn delete_alloc(&self, name: &Name) -> Result<(), StoreError>;
    /// Every stored alloc, by name in ascending order: decoded records, or per-record
    /// errors naming the alloc (a corrupt record must not hide the others).
    fn load_allocs(&self) -> Result<Vec<Result<AllocRecord, CorruptRecord>>, StoreError>;
    /// Counters: writes performed, writes skipped because the content hash equals the last
    /// written one for that key, deletes.
    fn metrics(&self) -> StoreMetrics;
    /// Whether calls block on storage: then the node's [`StoreWriter`] writes on a thread
    /// of its own rather than on the async runtime's.
    fn blocks(&self) -> bool {
        true
    }
}

/// What a store did since it was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreMetrics {
    /// Records written.
    pub writes: u64,
    /// Writes skipped because the record was unchanged since the last write of its name.
    pub skipped_writes: u64,
    /// Records deleted (including deletes of records that were not there).
    pub deletes: u64,
    /// Bytes handed to storage by the writes (keys and values).
    pub bytes_written: u64,
}

/// A store operation that failed as a whole.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Writing an alloc's record failed; the earlier record, if any, is still there.
    #[error("writing the record of alloc {name} failed")]
    Write {
        /// The alloc.
        name: Name,
        /// What the storage reported.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// Deleting an alloc's record failed.
    #[error("deleting the record of alloc {name} failed")]
    Delete {
        /// The alloc.
        name: Name,
        /// What the storage reported.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// Listing the stored records failed.
    #[error("reading the stored allocs failed")]
    Load {
        /// What the storage reported.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

/// A stored record that cannot be used; it fails its own alloc only.
#[derive(Debug, thiserror::Error)]
#[error("stored record of alloc {name:?} is unusable")]
pub struct CorruptRecord {
    /// The key the record is stored under: the alloc's name, unless the key is corrupt too.
    pub name: String,
    /// What is wrong with it.
    #[source]
    pub source: RecordError,
}

/// Decodes the record stored under `key`, which must be the record's own alloc name.
///
/// Every store's `load_allocs` decodes through this, so they agree on what is corrupt.
pub fn decode_stored(key: &str, bytes: &[u8]) -> Result<AllocRecord, CorruptRecord> {
    let corrupt = |source| CorruptRecord {
        name: key.to_owned(),
        source,
    };
    let record = AllocRecord::decode(bytes).map_err(corrupt)?;
    if record.name.as_str() != key {
        return Err(corrupt(RecordError::NameMismatch { found: record.name }));
    }
    Ok(record)
}

/// Write deduplication and counters, shared by every [`Store`] implementation.
///
/// Remembers, per alloc name, a hash of the bytes last written or read; a write of the
/// same bytes is skipped. Any failed or outside write forgets the name, so the index never
/// claims content the storage might not hold.
#[derive(Debug, Default)]
pub struct DedupeIndex {
    /// Hash of the bytes the storage holds under each name, when known.
    hashes: Mutex<HashMap<String, u64>>,
    writes: AtomicU64,
    skipped_writes: AtomicU64,
    deletes: AtomicU64,
    bytes_written: AtomicU64,
}

impl DedupeIndex {
    /// An index that knows nothing yet.
    pub fn new() -> Self {
        DedupeIndex::default()
    }

    /// Encodes `record` and hands the bytes to `write`, unless they equal the bytes last
    /// written under its name. `write` must store them atomically under the record's name.
    pub fn put(
        &self,
        record: &AllocRecord,
        write: impl FnOnce(&[u8]) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let key = record.name.as_str();
        let bytes = record.encode();
        let hash = hash_bytes(&bytes);
        if self.hashes().get(key) == Some(&hash) {
            self.skipped_writes.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        // The lock is not held across the write: each name has one writer, its worker.
        match write(&bytes) {
            Ok(()) => {
                self.hashes().insert(key.to_owned(), hash);
                self.writes.fetch_add(1, Ordering::Relaxed);
                self.bytes_written
                    .fetch_add((key.len() + bytes.len()) as u64, Ordering::Relaxed);
                Ok(())
            }
            Err(error) => {
                self.forget(key);
                Err(error)
            }
        }
    }

    /// Runs `delete` for `name` and forgets what was stored under it.
    pub fn delete(
        &self,
        name: &Name,
        delete: impl FnOnce() -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let result = delete();
        self.forget(name.as_str());
        if result.is_ok() {
            self.deletes.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    /// Remembers that the storage holds `bytes` under `key`, as read by `load_allocs`, so
    /// that writing the same record again is skipped.
    pub fn remember(&self, key: &str, bytes: &[u8]) {
        self.hashes().insert(key.to_owned(), hash_bytes(bytes));
    }

    /// Forgets what the storage holds under `key`, after a write that bypassed the index.
    pub fn forget(&self, key: &str) {
        self.hashes().remove(key);
    }

    /// The counters so far.
    pub fn metrics(&self) -> StoreMetrics {
        StoreMetrics {
            writes: self.writes.load(Ordering::Relaxed),
            skipped_writes: self.skipped_writes.load(Ordering::Relaxed),
            deletes: self.deletes.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
        }
    }

    fn hashes(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        // A panic elsewhere cannot leave the map half updated: every update is one call.
        self.hashes.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A 64-bit hash of `bytes`: enough to tell an unchanged record from a changed one.
fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    bytes.hash(&mut hasher);
    hasher.finish()
}

/// An alloc as a restarted agent resumes it.
#[derive(Debug)]
pub struct RestoredAlloc {
    /// The spec it ran, validated again.
    pub spec: ValidSpec,
    /// The reconciler's state.
    pub state: AllocState,
    /// Its tasks' driver handles.
    pub handles: BTreeMap<Name, TaskHandle>,
    /// Whether its spec file was removed.
    pub removed: bool,
    /// The device instances its tasks hold.
    pub devices: BTreeMap<Name, Vec<AssignedDevice>>,
    /// A user stopped it (`stead alloc stop`).
    pub stopped_by_user: bool,
}

/// Turns a loaded record back into what a worker runs on.
///
/// The spec is validated again, so a restored alloc holds the same proofs as a fresh one,
/// and its revision is computed by this agent (the stored one is informational: were
/// normalization to change between versions, the alloc keeps matching its spec file).
/// Every task of the spec must have a state, and no other task may.
pub fn restore_record(record: AllocRecord) -> Result<RestoredAlloc, CorruptRecord> {
    let name = record.name.to_string();
    let corrupt = |source| CorruptRecord {
        name: name.clone(),
        source,
    };
    let spec = revalidate(&record).map_err(corrupt)?;
    let state = state_from_record(record.state).map_err(corrupt)?;
    let handles = handles_from_record(record.handles).map_err(corrupt)?;
    let spec_tasks: Vec<&Name> = spec.spec.spec.tasks.iter().map(|t| &t.name).collect();
    let state_tasks: Vec<&Name> = state.tasks.keys().collect();
    let mut sorted_spec_tasks = spec_tasks.clone();
    sorted_spec_tasks.sort();
    if sorted_spec_tasks != state_tasks {
        return Err(corrupt(RecordError::TasksMismatch {
            spec_tasks: spec_tasks.iter().map(ToString::to_string).collect(),
            state_tasks: state_tasks.iter().map(ToString::to_string).collect(),
        }));
    }
    let devices = record
        .devices
        .into_iter()
        .map(|(task, devices)| Ok((parse_task_name(&task, || "devices".to_owned())?, devices)))
        .collect::<Result<_, RecordError>>()
        .map_err(corrupt)?;
    Ok(RestoredAlloc {
        spec,
        state,
        handles,
        removed: record.removed,
        devices,
        stopped_by_user: record.stopped_by_user,
    })
}

/// Runs the stored spec through the agent's spec validation (JSON is YAML).
fn revalidate(record: &AllocRecord) -> Result<ValidSpec, RecordError> {
    let source = serde_json::to_string_pretty(&record.spec)
        .expect("spec types serialize to JSON: string keys, no non-finite floats");
    let path = PathBuf::from(format!("<stored record of {}>", record.name));
    let file = stead_schemas::parse_stored_spec(&path, &source);
    let diagnostics = file.all_diagnostics();
    let mut specs = file.specs().cloned();
    match (specs.next(), specs.next()) {
        (Some(spec), None) if diagnostics.is_empty() && spec.name() == &record.name => Ok(spec),
        (Some(spec), None) if diagnostics.is_empty() => Err(RecordError::NameMismatch {
            found: spec.name().clone(),
        }),
        _ => Err(RecordError::InvalidSpec { diagnostics }),
    }
}

/// The record of an alloc's state.
pub fn state_to_record(state: &AllocState) -> AllocStateRecord {
    AllocStateRecord {
        tasks: state
            .tasks
            .iter()
            .map(|(name, task)| (name.to_string(), task_to_record(task)))
            .collect(),
        shutdown: state.shutdown.as_ref().map(|shutdown| ShutdownRecord {
            reason: match &shutdown.reason {
                ShutdownReason::Stop => ShutdownReasonRecord::Stop,
                ShutdownReason::TaskFailed(task) => ShutdownReasonRecord::TaskFailed {
                    task: task.to_string(),
                },
                ShutdownReason::LeaderDead => ShutdownReasonRecord::LeaderDead,
            },
            at: shutdown.at,
        }),
        main_released: state.main_released,
        poststart_released: state.poststart_released,
    }
}

/// An alloc's state from its record; fails on a task name that is not a valid name or an
/// event type this agent does not know, naming it.
pub fn state_from_record(record: AllocStateRecord) -> Result<AllocState, RecordError> {
    let tasks = record
        .tasks
        .into_iter()
        .map(|(task, state)| {
            let name = parse_task_name(&task, || "state.tasks".to_owned())?;
            Ok((name, Box::new(task_from_record(&task, state)?)))
        })
        .collect::<Result<BTreeMap<_, _>, RecordError>>()?;
    let shutdown = match record.shutdown {
        None => None,
        Some(shutdown) => Some(Shutdown {
            reason: match shutdown.reason {
                ShutdownReasonRecord::Stop => ShutdownReason::Stop,
                ShutdownReasonRecord::TaskFailed { task } => {
                    ShutdownReason::TaskFailed(parse_task_name(&task, || {
                        "state.shutdown.reason.task".to_owned()
                    })?)
                }
                ShutdownReasonRecord::LeaderDead => ShutdownReason::LeaderDead,
            },
            at: shutdown.at,
        }),
    };
    Ok(AllocState {
        tasks,
        shutdown,
        main_released: record.main_released,
        poststart_released: record.poststart_released,
    })
}

fn task_to_record(task: &TaskState) -> TaskStateRecord {
    TaskStateRecord {
        phase: match task.phase {
            TaskPhase::Pending => TaskPhaseRecord::Pending,
            TaskPhase::Running => TaskPhaseRecord::Running,
            TaskPhase::Dead => TaskPhaseRecord::Dead,
        },
        failed: task.failed,
        restarts: task.restarts,
        oom_kills: task.oom_kills,
        last_restart: task.last_restart,
        started_at: task.started_at,
        finished_at: task.finished_at,
        tracker: RestartTrackerRecord {
            window_start: task.tracker.window_start,
            attempts_in_window: task.tracker.attempts_in_window,
            consecutive_restarts: task.tracker.consecutive_restarts,
        },
        process: match task.process {
            Process::Idle => ProcessRecord::Idle,
            Process::Starting { since } => ProcessRecord::Starting { since },
            Process::Running { since } => ProcessRecord::Running { since },
        },
        restart_at: task.restart_at,
        kill: task.kill.as_ref().map(|kill| KillRecord {
            reason: match &kill.reason {
                KillReason::Stop => KillReasonRecord::Stop,
                KillReason::UserRestart => KillReasonRecord::UserRestart,
                KillReason::SiblingFailed(task) => KillReasonRecord::SiblingFailed {
                    task: task.to_string(),
                },
                KillReason::LeaderDead => KillReasonRecord::LeaderDead,
                KillReason::MainTasksDead => KillReasonRecord::MainTasksDead,
                KillReason::Unhealthy { check, jitter } => KillReasonRecord::Unhealthy {
                    check: check.to_string(),
                    jitter: jitter.bits(),
                },
            },
            signal_at: kill.signal_at,
            signalled_at: kill.signalled_at,
            forced_at: kill.forced_at,
            cancel_requested: kill.cancel_requested,
        }),
        set_up: task.set_up,
        events: task
            .events
            .iter()
            .map(|event| TaskEventRecord {
                event_type: event.event_type.as_str().to_owned(),
                time: event.time,
                message: event.message.clone(),
                exit_code: event.exit_code,
                signal: event.signal,
                oom_killed: event.oom_killed,
            })
            .collect(),
        checks: task
            .checks
            .iter()
            .map(|(check, state)| {
                let record = CheckStateRecord {
                    status: state.status.as_str().to_owned(),
                    output: state.output.clone(),
                    since: state.since,
                    consecutive: state.consecutive,
                    unhealthy_since: state.unhealthy_since,
                };
                (check.to_string(), record)
            })
            .collect(),
    }
}

fn task_from_record(task: &str, record: TaskStateRecord) -> Result<TaskState, RecordError> {
    let kill = match record.kill {
        None => None,
        Some(kill) => Some(KillProgress {
            reason: match kill.reason {
                KillReasonRecord::Stop => KillReason::Stop,
                KillReasonRecord::UserRestart => KillReason::UserRestart,
                KillReasonRecord::SiblingFailed { task: sibling } => {
                    KillReason::SiblingFailed(parse_task_name(&sibling, || {
                        format!("state.tasks.{task}.kill.reason.task")
                    })?)
                }
                KillReasonRecord::LeaderDead => KillReason::LeaderDead,
                KillReasonRecord::MainTasksDead => KillReason::MainTasksDead,
                KillReasonRecord::Unhealthy { check, jitter } => KillReason::Unhealthy {
                    check: parse_task_name(&check, || {
                        format!("state.tasks.{task}.kill.reason.check")
                    })?,
                    jitter: Jitter::from_bits(jitter),
                },
            },
            signal_at: kill.signal_at,
            signalled_at: kill.signalled_at,
            forced_at: kill.forced_at,
            cancel_requested: kill.cancel_requested,
        }),
    };
    let events = record
        .events
        .into_iter()
        .map(|event| {
            let event_type = TaskEventType::parse(&event.event_type).ok_or_else(|| {
                RecordError::UnknownEventType {
                    task: task.to_owned(),
                    event_type: event.event_type.clone(),
                }
            })?;
            Ok(TaskEvent {
                event_type,
                time: event.time,
                message: event.message,
                exit_code: event.exit_code,
                signal: event.signal,
                oom_killed: event.oom_killed,
            })
        })
        .collect::<Result<VecDeque<_>, RecordError>>()?;
    let checks = record
        .checks
        .into_iter()
        .map(|(check, state)| {
            let name = parse_task_name(&check, || format!("state.tasks.{task}.checks"))?;
            let status = CheckStatus::parse(&state.status).ok_or_else(|| {
                RecordError::UnknownCheckStatus {
                    task: task.to_owned(),
                    check: check.clone(),
                    status: state.status.clone(),
                }
            })?;
            let state = CheckState {
                status,
                output: state.output,
                since: state.since,
                consecutive: state.consecutive,
                unhealthy_since: state.unhealthy_since,
            };
            Ok((name, state))
        })
        .collect::<Result<BTreeMap<_, _>, RecordError>>()?;
    Ok(TaskState {
        phase: match record.phase {
            TaskPhaseRecord::Pending => TaskPhase::Pending,
            TaskPhaseRecord::Running => TaskPhase::Running,
            TaskPhaseRecord::Dead => TaskPhase::Dead,
        },
        failed: record.failed,
        restarts: record.restarts,
        oom_kills: record.oom_kills,
        last_restart: record.last_restart,
        started_at: record.started_at,
        finished_at: record.finished_at,
        tracker: RestartTracker {
            window_start: record.tracker.window_start,
            attempts_in_window: record.tracker.attempts_in_window,
            consecutive_restarts: record.tracker.consecutive_restarts,
        },
        process: match record.process {
            ProcessRecord::Idle => Process::Idle,
            ProcessRecord::Starting { since } => Process::Starting { since },
            ProcessRecord::Running { since } => Process::Running { since },
        },
        restart_at: record.restart_at,
        kill,
        set_up: record.set_up,
        events,
        checks,
    })
}

/// The record of a driver handle.
pub fn handle_to_record(handle: &TaskHandle) -> TaskHandleRecord {
    TaskHandleRecord {
        driver: handle.driver,
        id: handle.id.clone(),
        pid: handle.pid,
        started_at: handle.started_at,
    }
}

/// A driver handle from its record.
pub fn handle_from_record(record: TaskHandleRecord) -> TaskHandle {
    TaskHandle {
        driver: record.driver,
        id: record.id,
        pid: record.pid,
        started_at: record.started_at,
    }
}

/// The records of an alloc's driver handles, by task name.
pub fn handles_to_record(
    handles: &BTreeMap<Name, TaskHandle>,
) -> BTreeMap<String, TaskHandleRecord> {
    handles
        .iter()
        .map(|(task, handle)| (task.to_string(), handle_to_record(handle)))
        .collect()
}

/// An alloc's driver handles from their records; fails on a task name that is not valid.
pub fn handles_from_record(
    records: BTreeMap<String, TaskHandleRecord>,
) -> Result<BTreeMap<Name, TaskHandle>, RecordError> {
    records
        .into_iter()
        .map(|(task, record)| {
            let name = parse_task_name(&task, || "handles".to_owned())?;
            Ok((name, handle_from_record(record)))
        })
        .collect()
}

/// `task` as a name, or an error saying where in the record it was.
fn parse_task_name(task: &str, field: impl FnOnce() -> String) -> Result<Name, RecordError> {
    task.parse().map_err(|reason| RecordError::InvalidTaskName {
        field: field(),
        task: task.to_owned(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use stead_schemas::spec::DriverKind;

    use super::*;

    fn at(secs: u64) -> stead_schemas::Timestamp {
        stead_schemas::Timestamp::from_since_epoch(Duration::new(1_795_306_200 + secs, 250))
    }

    fn name(s: &str) -> Name {
        s.parse().expect("valid name")
    }

    fn event(event_type: TaskEventType, secs: u64) -> TaskEvent {
        TaskEvent::new(event_type, at(secs), format!("{event_type} happened"))
    }

    /// A task with every optional field set, a kill for `reason`, and `process`.
    fn busy_task(process: Process, reason: KillReason) -> TaskState {
        let mut events: VecDeque<TaskEvent> = TaskEventType::ALL
            .iter()
            .enumerate()
            .map(|(i, t)| event(*t, i as u64))
            .collect();
        events.push_back(TaskEvent {
            exit_code: Some(137),
            signal: Some(9),
            ..event(TaskEventType::Terminated, 30)
        });
        events.push_back(TaskEvent {
            exit_code: Some(0),
            signal: Some(0),
            ..event(TaskEventType::Terminated, 31)
        });
        TaskState {
            phase: TaskPhase::Running,
            failed: true,
            restarts: 7,
            oom_kills: 3,
            last_restart: Some(at(20)),
            started_at: Some(at(21)),
            finished_at: Some(at(22)),
            tracker: RestartTracker {
                window_start: at(3),
                attempts_in_window: 2,
                consecutive_restarts: u32::MAX,
            },
            process,
            restart_at: Some(at(40)),
            kill: Some(KillProgress {
                reason,
                signal_at: at(41),
                signalled_at: Some(at(42)),
                forced_at: Some(at(43)),
                cancel_requested: true,
            }),
            set_up: true,
            events,
            checks: CheckStatus::ALL
                .into_iter()
                .enumerate()
                .map(|(i, status)| {
                    let state = CheckState {
                        status,
                        output: format!("said {status}"),
                        since: (i > 0).then(|| at(50 + i as u64)),
                        consecutive: i as u32,
                        unhealthy_since: (i == 3).then(|| at(60)),
                    };
                    (name(&format!("check-{i}")), state)
                })
                .collect(),
        }
    }

    /// States covering every variant of every enum, and options set and unset.
    fn rich_states() -> Vec<AllocState> {
        let processes = [
            Process::Idle,
            Process::Starting { since: at(10) },
            Process::Running { since: at(11) },
        ];
        let reasons = [
            KillReason::Stop,
            KillReason::UserRestart,
            KillReason::SiblingFailed(name("db")),
            KillReason::LeaderDead,
            KillReason::MainTasksDead,
            KillReason::Unhealthy {
                check: name("alive"),
                jitter: Jitter::from_bits(12345),
            },
        ];
        let mut tasks: BTreeMap<Name, Box<TaskState>> = reasons
            .into_iter()
            .enumerate()
            .map(|(i, reason)| {
                let process = processes[i % processes.len()];
                (
                    name(&format!("task-{i}")),
                    Box::new(busy_task(process, reason)),
                )
            })
            .collect();
        let mut fresh = TaskState::new(at(0));
        fresh.phase = TaskPhase::Dead;
        tasks.insert(name("fresh"), Box::new(fresh));
        let mut pending = TaskState::new(at(1));
        pending.phase = TaskPhase::Pending;
        tasks.insert(name("pending"), Box::new(pending));
        let reasons = [
            None,
            Some(ShutdownReason::Stop),
            Some(ShutdownReason::TaskFailed(name("task-1"))),
            Some(ShutdownReason::LeaderDead),
        ];
        reasons
            .into_iter()
            .enumerate()
            .map(|(i, reason)| AllocState {
                tasks: tasks.clone(),
                shutdown: reason.map(|reason| Shutdown { reason, at: at(50) }),
                main_released: i % 2 == 0,
                poststart_released: i % 2 == 1,
            })
            .collect()
    }

    #[test]
    fn state_round_trips_exactly_through_record_bytes() {
        for state in rich_states() {
            let record = state_to_record(&state);
            let bytes = serde_json::to_vec(&record).expect("serializes");
            let decoded: AllocStateRecord = serde_json::from_slice(&bytes).expect("deserializes");
            assert_eq!(decoded, record);
            assert_eq!(state_from_record(decoded).expect("converts"), state);
        }
    }

    #[test]
    fn handles_round_trip_exactly_with_and_without_pid() {
        let handles = BTreeMap::from([
            (
                name("web"),
                TaskHandle {
                    driver: DriverKind::Exec,
                    id: "web-1".to_owned(),
                    pid: Some(4242),
                    started_at: at(1),
                },
            ),
            (
                name("mock"),
                TaskHandle {
                    driver: DriverKind::Mock,
                    id: "mock-1".to_owned(),
                    pid: None,
                    started_at: at(2),
                },
            ),
        ]);
        let record = handles_to_record(&handles);
        let bytes = serde_json::to_vec(&record).expect("serializes");
        let decoded = serde_json::from_slice(&bytes).expect("deserializes");
        assert_eq!(handles_from_record(decoded).expect("converts"), handles);
    }

    #[test]
    fn state_from_record_names_an_unknown_event_type_and_its_task() {
        let mut record = state_to_record(&rich_states()[0]);
        let task = record.tasks.get_mut("fresh").expect("task exists");
        task.events[0].event_type = "Teleported".to_owned();
        let error = state_from_record(record).expect_err("unknown event type");
        assert_eq!(
            error.to_string(),
            r#"task fresh has an event of unknown type "Teleported""#
        );
    }

    #[test]
    fn state_from_record_names_an_invalid_task_name_and_where_it_is() {
        let mut record = state_to_record(&rich_states()[0]);
        let task = record.tasks.remove("fresh").expect("task exists");
        record.tasks.insert("Bad_Name".to_owned(), task);
        let error = state_from_record(record).expect_err("invalid name");
        assert!(
            matches!(&error, RecordError::InvalidTaskName { field, task, .. }
                if field == "state.tasks" && task == "Bad_Name"),
            "{error:?}"
        );

        let mut record = state_to_record(&rich_states()[0]);
        let kill = record.tasks.get_mut("task-2").and_then(|t| t.kill.as_mut());
        kill.expect("task-2 is being killed").reason = KillReasonRecord::SiblingFailed {
            task: "-db".to_owned(),
        };
        let error = state_from_record(record).expect_err("invalid sibling name");
        assert!(
            matches!(&error, RecordError::InvalidTaskName { field, task, .. }
                if field == "state.tasks.task-2.kill.reason.task" && task == "-db"),
            "{error:?}"
        );
    }

    #[test]
    fn restore_record_revalidates_the_spec_and_returns_state_and_handles() {
        let record = conformance::sample_record("web", 3);
        let restored = restore_record(record.clone()).expect("restores");
        assert_eq!(restored.spec.spec, record.spec);
        assert_eq!(restored.spec.name(), &record.name);
        assert_eq!(state_to_record(&restored.state), record.state);
        assert_eq!(handles_to_record(&restored.handles), record.handles);
        assert_eq!(restored.removed, record.removed);
        let devices: BTreeMap<String, Vec<AssignedDevice>> = restored
            .devices
            .into_iter()
            .map(|(task, devices)| (task.to_string(), devices))
            .collect();
        assert_eq!(devices, record.devices);
    }

    /// A spec an older agent accepted with a `${…}` no variable answers (a shell's
    /// `${HOME}`) is restored, not refused: an upgrade stops nothing. Its task gets the
    /// text as written.
    #[test]
    fn restore_record_keeps_a_spec_stored_before_interpolation_with_an_unknown_reference() {
        let mut record = conformance::sample_record("web", 0);
        record.spec.spec.tasks[0].env = Some(BTreeMap::from([(
            "GREETING".parse().expect("an env name"),
            "${HOME}".to_owned(),
        )]));
        let restored = restore_record(record.clone()).expect("restores");
        assert_eq!(restored.spec.spec, record.spec);
        let yaml = serde_json::to_string(&record.spec).expect("JSON");
        let file = stead_schemas::parse_spec_file(std::path::Path::new("web.yaml"), &yaml);
        assert!(!file.is_valid(), "a spec file with it is refused");
    }

    #[test]
    fn restore_record_refuses_a_state_whose_tasks_are_not_the_specs() {
        let mut record = conformance::sample_record("web", 0);
        let task = record
            .state
            .tasks
            .values()
            .next()
            .cloned()
            .expect("one task");
        record.state.tasks.insert("ghost".to_owned(), task);
        let error = restore_record(record).expect_err("tasks differ");
        assert_eq!(error.name, "web");
        assert!(
            matches!(error.source, RecordError::TasksMismatch { .. }),
            "{error:?}"
        );
    }

    /// Enough records for several threads of a restore's mapping: each result comes back
    /// in its record's place, and a broken record fails only itself.
    #[test]
    fn many_records_restored_over_the_cores_keep_their_order_and_only_the_broken_one_fails() {
        let count = crate::host::MIN_PER_THREAD * 5 + 3;
        let mut records: Vec<AllocRecord> = (0..count)
            .map(|i| conformance::sample_record(&format!("web-{i}"), 0))
            .collect();
        let broken = count / 2;
        let task = records[broken].spec.spec.tasks[0].clone();
        records[broken].spec.spec.tasks.push(task);
        let restored = crate::host::map_on_every_core(records, restore_record);
        assert_eq!(restored.len(), count);
        for (i, result) in restored.iter().enumerate() {
            let expected = format!("web-{i}");
            match result {
                Ok(alloc) => {
                    assert_ne!(i, broken, "the broken record was restored");
                    assert_eq!(alloc.spec.name().as_str(), expected);
                }
                Err(corrupt) => {
                    assert_eq!(i, broken, "{corrupt:?}");
                    assert_eq!(corrupt.name, expected);
                }
            }
        }
    }

    #[test]
    fn restore_record_refuses_a_spec_that_no_longer_validates() {
        let mut record = conformance::sample_record("web", 0);
        let task = record.spec.spec.tasks[0].clone();
        record.spec.spec.tasks.push(task);
        let error = restore_record(record).expect_err("duplicate task");
        assert_eq!(
            error.source.to_string(),
            r#"stored spec is invalid: <stored record of web>:15:17: spec.tasks[1].name: task name "server" is already used by spec.tasks[0]"#
        );
        assert!(
            matches!(&error.source, RecordError::InvalidSpec { diagnostics } if !diagnostics.is_empty()),
            "{error:?}"
        );
    }

    #[test]
    fn dedupe_index_forgets_a_name_whose_write_failed() {
        let index = DedupeIndex::new();
        let record = conformance::sample_record("web", 0);
        index.put(&record, |_| Ok(())).expect("written");
        let failed = index.put(&conformance::sample_record("web", 1), |_| {
            Err(StoreError::Write {
                name: name("web"),
                source: "disk full".into(),
            })
        });
        assert!(failed.is_err());
        // The storage may hold either version now: the next write is not skipped.
        let mut wrote = false;
        index
            .put(&record, |_| {
                wrote = true;
                Ok(())
            })
            .expect("written");
        assert!(wrote);
        assert_eq!(
            index.metrics(),
            StoreMetrics {
                writes: 2,
                skipped_writes: 0,
                deletes: 0,
                bytes_written: 2 * (3 + record.encode().len() as u64),
            }
        );
    }
}
