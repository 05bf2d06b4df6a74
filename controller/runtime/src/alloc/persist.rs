//! The worker's persistence and publishing: the record written through the node's store
//! writer (retried with backoff), then the status shown, when either changed.

use stead_reconcilers::check::CheckState;
use stead_reconcilers::event::TaskEventType;
use stead_reconcilers::task::{TaskSettings, TaskState};
use stead_schemas::status::{TaskCheckStatus, TaskExitStatus};

use super::*;

/// Retrying a failed store write with exponential backoff.
pub(super) struct StoreRetry {
    pub(super) at: Timestamp,
    pub(super) delays: backon::ExponentialBackoff,
}

/// The record of the current revision.
pub(super) fn record_of(
    name: &Name,
    current: &Current,
    removed: bool,
    stopped_by_user: bool,
) -> AllocRecord {
    AllocRecord {
        version: ALLOC_RECORD_VERSION,
        name: name.clone(),
        spec: current.spec.spec.clone(),
        revision: current.spec.revision.to_string(),
        removed,
        stopped_by_user,
        state: store::state_to_record(&current.state),
        handles: current
            .handles
            .iter()
            .map(|(task, handle)| (task.to_string(), store::handle_to_record(handle)))
            .collect(),
        devices: current
            .devices
            .iter()
            .map(|(task, devices)| (task.to_string(), devices.clone()))
            .collect(),
    }
}

/// The longest wait between retries of a failed store write: short enough that a store
/// that recovers (RocksDB looks for free space again every 5 s after the disk filled) is
/// written within 15 s of the space coming back.
pub(super) const STORE_RETRY_MAX: Duration = Duration::from_secs(10);

/// Retries of a failed store write: 100 ms doubling to 10 s, with jitter, forever (the
/// tasks keep running meanwhile; the record is written as soon as storage takes it).
/// The jitter is drawn from `seed`.
pub(super) fn store_backoff(seed: u64) -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(STORE_RETRY_MAX)
        .with_jitter()
        .with_jitter_seed(seed)
        .without_max_times()
        .build()
}

/// A hash of everything a record holds, computed on every pass to skip unchanged writes
/// (with `FxHasher`: SipHash here was most of an idle pass's cost).
/// Events only ever append (dropping the oldest at the cap), so their count, oldest and
/// newest stand for all of them: hashing whole histories on every tick would cost more
/// than the rest of the pass.
pub(super) fn fingerprint(
    state: &AllocState,
    handles: &BTreeMap<Name, TaskHandle>,
    devices: &AllocDevices,
    removed: bool,
    collectable: bool,
    stopped_by_user: bool,
) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = rustc_hash::FxHasher::default();
    removed.hash(&mut hasher);
    stopped_by_user.hash(&mut hasher);
    devices.hash(&mut hasher);
    collectable.hash(&mut hasher);
    handles.hash(&mut hasher);
    state.shutdown.hash(&mut hasher);
    state.main_released.hash(&mut hasher);
    state.poststart_released.hash(&mut hasher);
    for (name, task) in &state.tasks {
        name.hash(&mut hasher);
        task.phase.hash(&mut hasher);
        task.failed.hash(&mut hasher);
        task.restarts.hash(&mut hasher);
        task.last_restart.hash(&mut hasher);
        task.started_at.hash(&mut hasher);
        task.finished_at.hash(&mut hasher);
        task.tracker.hash(&mut hasher);
        task.process.hash(&mut hasher);
        task.restart_at.hash(&mut hasher);
        task.kill.hash(&mut hasher);
        task.set_up.hash(&mut hasher);
        task.events.len().hash(&mut hasher);
        task.events.front().hash(&mut hasher);
        task.events.back().hash(&mut hasher);
        // A check's changes of status and of health are written at once; its output
        // and count ride along with the next write, so a steady check writes nothing.
        for (check, state) in &task.checks {
            check.hash(&mut hasher);
            state.status.hash(&mut hasher);
            state.since.hash(&mut hasher);
            state.unhealthy_since.hash(&mut hasher);
        }
    }
    hasher.finish()
}

/// A hash of what the checks show beyond what [`fingerprint`] holds: their outputs,
/// published when they change though not written at every change. (Their counts are
/// not shown, so a steady check publishes nothing.)
pub(super) fn checks_shown(state: &AllocState) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = rustc_hash::FxHasher::default();
    for task in state.tasks.values() {
        for check in task.checks.values() {
            check.output.hash(&mut hasher);
        }
    }
    hasher.finish()
}

/// How many tasks failed: what `stead_task_failures_total` counts. (Restarts and OOM
/// kills are per task, read from the published status when `/metrics` is rendered.)
pub(super) fn failures(state: &AllocState) -> u64 {
    state
        .tasks
        .values()
        .map(|task| u64::from(task.failed))
        .sum()
}

/// The API's view of the current revision.
pub(super) fn status_of(
    name: &Name,
    current: &Current,
    removed: bool,
    stopped_by_user: bool,
    health: &BTreeMap<Name, Vec<Option<DeviceHealth>>>,
) -> AllocStatus {
    let desired_status = if removed
        || stopped_by_user
        || current.spec.spec.spec.desired_status == Some(DesiredStatus::Stop)
    {
        "stop"
    } else {
        "run"
    };
    AllocStatus {
        name: name.to_string(),
        id: current.spec.id.to_string(),
        revision: current.spec.revision.to_string(),
        desired_status: desired_status.to_owned(),
        stopped_by_user,
        client_status: current.state.client_status().as_str().to_owned(),
        spec_error: current.device_error.clone(),
        state_error: current.hand_over_error.clone(),
        spec_file: None,
        healthy: current.state.healthy(&current.desired),
        tasks: current
            .state
            .tasks
            .iter()
            .map(|(task, state)| {
                let settings = current.desired.task(task);
                let status = TaskStatus {
                    state: state.phase.as_str().to_owned(),
                    lifecycle: settings.and_then(lifecycle),
                    failed: state.failed,
                    restarts: state.restarts,
                    oom_kills: state.oom_kills,
                    last_restart: state.last_restart,
                    started_at: state.started_at,
                    finished_at: state.finished_at,
                    pid: current.handles.get(task).and_then(|h| h.pid),
                    last_exit: state
                        .events
                        .iter()
                        .rev()
                        .find(|e| e.event_type == TaskEventType::Terminated)
                        .map(|e| TaskExitStatus {
                            time: e.time,
                            exit_code: e.exit_code.unwrap_or(0),
                            signal: e.signal,
                            oom_killed: e.oom_killed,
                        }),
                    devices: current
                        .devices
                        .get(task)
                        .zip(health.get(task))
                        .map(|(held, health)| task_devices(held, health))
                        .unwrap_or_default(),
                    checks: settings
                        .map(|settings| task_checks(settings, state))
                        .unwrap_or_default(),
                    events: state
                        .events
                        .iter()
                        .map(|e| TaskEventStatus {
                            event_type: e.event_type.as_str().to_owned(),
                            time: e.time,
                            message: e.message.clone(),
                            exit_code: e.exit_code,
                            signal: e.signal,
                            oom_killed: e.oom_killed,
                        })
                        .collect(),
                };
                (task.to_string(), Box::new(status))
            })
            .collect(),
    }
}

/// A task's lifecycle stage as shown (`prestart sidecar`, say); `None` for a main task.
fn lifecycle(settings: &TaskSettings) -> Option<String> {
    let hook = settings.hook?.as_str();
    Some(match settings.sidecar {
        true => format!("{hook} sidecar"),
        false => hook.to_owned(),
    })
}

/// The checks of a task as shown: each in spec order, pending until its first result.
fn task_checks(settings: &TaskSettings, state: &TaskState) -> Vec<TaskCheckStatus> {
    settings
        .checks
        .iter()
        .map(|check| {
            let pending = CheckState::pending();
            let shown = state.checks.get(&check.name).unwrap_or(&pending);
            TaskCheckStatus {
                name: check.name.to_string(),
                status: shown.status.as_str().to_owned(),
                output: shown.output.clone(),
                since: shown.since,
            }
        })
        .collect()
}

impl Worker {
    /// Writes the record and publishes the status when either changed.
    pub(super) async fn persist_and_publish(&mut self) {
        let removed = matches!(self.target, Target::Absent);
        let Some(current) = &mut self.current else {
            // Nothing to store: a retry of what an earlier revision was is moot, but not
            // the retry of the delete of a destroyed alloc's record.
            if !removed && self.store_retry.take().is_some() {
                self.shared.store_recovered(&self.name);
            }
            return;
        };
        let failures = failures(&current.state);
        crate::metrics::task_failures(failures.saturating_sub(current.counted_failures));
        current.counted_failures = failures;
        let collectable =
            removed && !current.desired.run && current.state.is_terminal() && self.ops.is_empty();
        let fingerprint = fingerprint(
            &current.state,
            &current.handles,
            &current.devices,
            removed,
            collectable,
            self.stopped_by_user,
        );
        if current.saved == Some(fingerprint) {
            // The store holds what the worker holds (its state came back to what was last
            // written): nothing is left to retry. A retry kept here would be due at once
            // on every pass, and the worker would spin (simulator seed 1084).
            if self.store_retry.take().is_some() {
                self.shared.store_recovered(&self.name);
            }
        } else {
            let now = self.shared.clock.now();
            // While the agent leaves, every write is tried at once: the worker may not be
            // there when a retry would fall due, and a record left behind names runs that
            // are gone (the next agent would count a failure) and not the live one (which
            // it would stop as no record's).
            let due = self.shutdown.is_some()
                || self
                    .store_retry
                    .as_ref()
                    .is_none_or(|retry| now >= retry.at);
            if due {
                let record = record_of(&self.name, current, removed, self.stopped_by_user);
                match self
                    .shared
                    .writer
                    .write(StoreWrite::Put(Box::new(record)))
                    .await
                {
                    Ok(()) => {
                        current.saved = Some(fingerprint);
                        if self.store_retry.take().is_some() {
                            self.shared.store_recovered(&self.name);
                        }
                    }
                    Err(error) => {
                        self.shared.report_store_error(&self.name, &error);
                        let retry = self.store_retry.get_or_insert_with(|| StoreRetry {
                            at: now,
                            delays: store_backoff(self.rng.u64(..)),
                        });
                        let delay = retry.delays.next().unwrap_or(STORE_RETRY_MAX);
                        retry.at = now + delay;
                    }
                }
            }
        }
        // What is shown also follows the held devices' health, which the node's device
        // manager changes without this worker's state changing.
        let health: BTreeMap<Name, Vec<Option<DeviceHealth>>> = current
            .devices
            .iter()
            .map(|(task, held)| (task.clone(), self.shared.config.devices.health(held)))
            .collect();
        let shown = {
            use std::hash::{Hash, Hasher};
            let mut hasher = rustc_hash::FxHasher::default();
            fingerprint.hash(&mut hasher);
            current.device_error.hash(&mut hasher);
            current.hand_over_error.hash(&mut hasher);
            health.hash(&mut hasher);
            checks_shown(&current.state).hash(&mut hasher);
            hasher.finish()
        };
        if current.published == Some(shown) {
            return;
        }
        current.published = Some(shown);
        let status = status_of(&self.name, current, removed, self.stopped_by_user, &health);
        let running = current.spec.spec.spec.tasks.iter().filter(|task| {
            current
                .state
                .tasks
                .get(&task.name)
                .is_some_and(|state| state.phase == stead_reconcilers::task::TaskPhase::Running)
        });
        let (mut reserved_cpu_mhz, mut reserved_memory_mb) = (0, 0);
        for task in running {
            let resources = task.resources.as_ref();
            reserved_cpu_mhz += u64::from(resources.and_then(|r| r.cpu).unwrap_or(0));
            reserved_memory_mb += u64::from(resources.and_then(|r| r.memory_mb).unwrap_or(0));
        }
        let facts = AllocFacts {
            collectable,
            reserved_cpu_mhz,
            reserved_memory_mb,
            finished_at: current
                .state
                .tasks
                .values()
                .filter_map(|t| t.finished_at)
                .max(),
        };
        self.shared
            .publish(&self.name, status, current.handles.clone(), facts);
    }

    /// The status of a broken alloc: failed, with why; none when it is not broken. The
    /// node shows it from the moment the worker's slot exists.
    pub(crate) fn broken_status(&self) -> Option<AllocStatus> {
        let broken = self.broken.as_ref()?;
        Some(AllocStatus {
            name: self.name.to_string(),
            id: String::new(),
            revision: broken.revision.clone().unwrap_or_default(),
            desired_status: if self.stopped_by_user { "stop" } else { "run" }.to_owned(),
            stopped_by_user: self.stopped_by_user,
            client_status: "failed".to_owned(),
            spec_error: None,
            state_error: Some(broken.reason.clone()),
            spec_file: None,
            healthy: None,
            tasks: BTreeMap::new(),
        })
    }
}
