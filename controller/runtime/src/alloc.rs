//! The alloc worker: one tokio task per alloc that owns that alloc's state.
//!
//! It takes inputs from its [`Mailbox`], runs the pure reconciler, carries out the plan
//! by spawning driver operations (so a slow driver call never blocks the worker), feeds
//! what the operations report back into the state, persists it and publishes a status
//! snapshot. One worker per alloc means at most one reconcile of an alloc at a time.
//!
//! ```text
//! mailbox ─▶ target ─┐
//! op reports ────────┼─▶ AllocState::observe / reconcile ─▶ effects ─▶ spawned driver ops
//! wake-up / tick ────┘                                                    │
//!          ▲───────────────────────────── op reports ◀────────────────────┘
//! ```

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use stead_reconcilers::alloc::{AllocDesired, AllocState, CommandRefusal, Limits, Observation};
use stead_reconcilers::device::{AllocDevices, DeviceUnavailable, FlagReason};
use stead_reconcilers::exit::ExitResult;
use stead_reconcilers::restart::Jitter;
use stead_reconcilers::revision::{
    self, AfterReconcile, AgentShutdown, BrokenRecord, CurrentRevision, RevisionDecision,
    RevisionInputs, TargetRevision,
};
use stead_reconcilers::task::Effect;
use stead_schemas::device::{AssignedDevice, DeviceHealth};
use stead_schemas::record::{ALLOC_RECORD_VERSION, AllocRecord};
use stead_schemas::spec::{
    DesiredStatus, DeviceName, DeviceRequest, DriverConfig, DriverKind, Name,
};
use stead_schemas::status::{AllocStatus, TaskDeviceStatus, TaskEventStatus, TaskStatus};
use stead_schemas::{Timestamp, ValidSpec};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::allocdir::{AllocDirError, AllocDirs};
use crate::clock::Clock;
use crate::devices::DeviceManager;
use crate::driver::{
    DeviceAccess, Driver, DriverError, Drivers, LogLimits, StartRequest, TaskHandle,
};
use crate::errors::error_chain;
use crate::queue::{CommandError, Mailbox, Shutdown, Target, UserCommand};
use crate::registry::{AllocFacts, Registry};
use crate::store::{self, Store, StoreError, StoreWrite, StoreWriter};

/// What a worker is given: the seams it acts through, the limits it applies, and the
/// node's registry only as the publisher of its own alloc. It never sees another alloc's
/// state or the dispatcher's internals.
pub(crate) struct WorkerContext {
    pub(crate) config: WorkerConfig,
    pub(crate) drivers: Drivers,
    /// The node's one writer of its store.
    pub(crate) writer: StoreWriter,
    pub(crate) clock: Clock,
    /// Where alloc dirs live, when the node has them (sticky disks move between them,
    /// and destroying an alloc removes its own).
    pub(crate) alloc_dirs: Option<AllocDirs>,
    registry: Arc<Registry>,
}

/// The node's settings a worker applies.
pub(crate) struct WorkerConfig {
    pub(crate) limits: Limits,
    /// Seeds restart jitter, for reproducible tests; `None` draws it at random.
    pub(crate) seed: Option<u64>,
    /// The node's devices.
    pub(crate) devices: Arc<DeviceManager>,
}

impl WorkerContext {
    /// The context of a node's workers, publishing into `registry`.
    pub(crate) fn new(
        config: WorkerConfig,
        drivers: Drivers,
        store: Arc<dyn Store>,
        clock: Clock,
        alloc_dirs: Option<AllocDirs>,
        registry: Arc<Registry>,
    ) -> Self {
        WorkerContext {
            config,
            drivers,
            writer: StoreWriter::new(store),
            clock,
            alloc_dirs,
            registry,
        }
    }

    /// Shows an alloc's status snapshot, its tasks' driver handles and its facts, together.
    fn publish(
        &self,
        name: &Name,
        status: AllocStatus,
        handles: BTreeMap<Name, TaskHandle>,
        facts: AllocFacts,
    ) {
        self.registry.publish(name, status, handles, facts);
    }

    /// Drivers that cannot start tasks now, with why.
    fn unavailable_drivers(&self) -> BTreeMap<DriverKind, String> {
        self.registry.unavailable_drivers()
    }

    /// Counts a failed store write of alloc `name`, which is behind until it recovers.
    fn report_store_error(&self, name: &Name, error: &StoreError) {
        self.registry.report_store_error(name, error);
    }

    /// Alloc `name`'s record is stored again after failed writes.
    fn store_recovered(&self, name: &Name) {
        self.registry.store_recovered(name);
    }

    /// Alloc `name`'s worker leaves the node, unless new input arrived (see
    /// [`Registry::retire`]).
    fn retire(&self, name: &Name, mailbox: &Mailbox) -> bool {
        self.registry.retire(name, mailbox)
    }
}

/// What a spawned driver operation reports.
#[derive(Debug)]
enum OpReport {
    Started(TaskHandle),
    StartFailed(DriverError),
    StartCancelled,
    Exited(ExitResult),
    RecoverFailed(DriverError),
}

/// The reports of a worker's driver operations: a queue that wakes the worker through
/// its mailbox. (A channel per worker would hold a block of slots for every alloc.)
#[derive(Clone)]
struct Reports {
    queue: Arc<Mutex<VecDeque<Report>>>,
    mailbox: Mailbox,
}

type Report = (Name, u64, OpReport);

impl Reports {
    fn send(&self, task: Name, run: u64, report: OpReport) {
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back((task, run, report));
        self.mailbox.wake();
    }

    fn take(&self) -> VecDeque<Report> {
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// The driver operations in flight for one run of a task.
#[derive(Debug)]
struct TaskOps {
    run: u64,
    cancel_start: CancellationToken,
    cancel_wait: CancellationToken,
}

/// The revision the worker runs now.
struct Current {
    spec: Arc<ValidSpec>,
    desired: AllocDesired,
    state: AllocState,
    handles: BTreeMap<Name, TaskHandle>,
    /// A hash of what was last persisted, to skip writing when nothing changed.
    saved: Option<u64>,
    /// A hash of what was last published.
    published: Option<u64>,
    /// Restarts and failed tasks already counted in the metrics.
    counted: (u64, u64),
    /// The device instances each task holds (all tasks' or none, from the node's device
    /// manager; released once the revision is terminal).
    devices: AllocDevices,
    /// Why the devices are not assigned yet, when the devices are unknown: shown as the
    /// alloc's spec error.
    device_error: Option<String>,
    /// Whether any task requests devices.
    needs_devices: bool,
    /// Why the next revision cannot take this one's sticky disk over yet: shown as the
    /// alloc's state error while this (stopped) revision stays.
    hand_over_error: Option<String>,
}

impl Current {
    /// A revision with no handles yet, nothing persisted or published, and the restarts
    /// and failures its state already holds counted.
    fn new(spec: Arc<ValidSpec>, desired: AllocDesired, state: AllocState) -> Self {
        let counted = outcomes(&state);
        let mut current = Current {
            spec,
            desired,
            state,
            handles: BTreeMap::new(),
            saved: None,
            published: None,
            counted,
            needs_devices: false,
            devices: AllocDevices::new(),
            device_error: None,
            hand_over_error: None,
        };
        current.needs_devices = current
            .device_requests()
            .iter()
            .any(|(_, requests)| !requests.is_empty());
        current
    }

    /// Each task's device requests, in spec order (tasks that request none included).
    fn device_requests(&self) -> Vec<(Name, &[DeviceRequest])> {
        self.spec
            .spec
            .spec
            .tasks
            .iter()
            .map(|task| {
                let requests = task
                    .resources
                    .as_ref()
                    .and_then(|r| r.devices.as_deref())
                    .unwrap_or_default();
                (task.name.clone(), requests)
            })
            .collect()
    }
}

/// Where a worker starts from.
pub(crate) enum Start {
    /// A new alloc.
    Fresh(Target),
    /// An alloc restored from the store after an agent restart: the spec it ran, its
    /// state, handles and devices, and whether its spec was removed.
    Restored(Box<store::RestoredAlloc>),
    /// An alloc whose stored record cannot be used: it shows as failed with `reason` and
    /// runs nothing until its spec changes revision, a user restarts it, or it is removed.
    /// Its record is left as it is (a newer agent may still read it).
    Broken {
        /// Why, naming the alloc.
        reason: String,
        /// The revision the record names, when it can be read.
        revision: Option<String>,
    },
}

/// A restored alloc that cannot run until asked.
struct Broken {
    reason: String,
    /// Whether the source has said anything of the alloc since the restore: until then
    /// an absent target means "not listed yet", not "removed".
    heard: bool,
    /// The revision it stands for; the first spec seen is taken as it when unknown.
    revision: Option<String>,
}

/// Retrying a failed store write with exponential backoff.
struct StoreRetry {
    at: Timestamp,
    delays: backon::ExponentialBackoff,
}

/// One alloc's worker.
pub(crate) struct Worker {
    shared: Arc<WorkerContext>,
    name: Name,
    mailbox: Mailbox,
    target: Target,
    current: Option<Current>,
    shutdown: Option<Shutdown>,
    ops: BTreeMap<Name, TaskOps>,
    next_run: u64,
    reports: Reports,
    rng: fastrand::Rng,
    broken: Option<Broken>,
    store_retry: Option<StoreRetry>,
    /// A garbage collection request waiting to be carried out.
    collect: Option<oneshot::Sender<Result<(), CommandError>>>,
    /// The device manager still holds a replaced revision's devices for this alloc, for
    /// the current revision's first ask.
    devices_handed_on: bool,
}

impl Worker {
    pub(crate) fn new(
        shared: Arc<WorkerContext>,
        name: Name,
        mailbox: Mailbox,
        start: Start,
    ) -> Self {
        let reports = Reports {
            queue: Arc::default(),
            mailbox: mailbox.clone(),
        };
        let rng = match shared.config.seed {
            Some(seed) => fastrand::Rng::with_seed(seed ^ hash_name(&name)),
            None => fastrand::Rng::new(),
        };
        let mut worker = Worker {
            shared,
            name,
            mailbox,
            target: Target::Absent,
            current: None,
            shutdown: None,
            ops: BTreeMap::new(),
            next_run: 0,
            reports,
            rng,
            broken: None,
            store_retry: None,
            collect: None,
            devices_handed_on: false,
        };
        match start {
            Start::Fresh(target) => worker.target = target,
            Start::Restored(restored) => worker.restore(*restored),
            Start::Broken { reason, revision } => {
                worker.broken = Some(Broken {
                    reason,
                    heard: false,
                    revision,
                });
            }
        }
        worker
    }

    fn restore(&mut self, restored: store::RestoredAlloc) {
        let store::RestoredAlloc {
            spec,
            mut state,
            handles,
            removed,
            devices,
        } = restored;
        let spec = Arc::new(spec);
        self.target = if removed {
            Target::Absent
        } else {
            Target::Spec(spec.clone())
        };
        let desired = self.desired_for(&spec);
        revision::reset_starts_in_flight(&mut state, |task| handles.contains_key(task));
        if let Some(reason) = self.missing_alloc_dir(&spec, &state) {
            // Whatever still runs of it cannot be resumed without its dir: stop it.
            tracing::error!(alloc = %self.name, %reason, "cannot resume alloc");
            let now = self.shared.clock.now();
            state.fail_restore(&reason, now, self.shared.config.limits.max_events);
            for handle in handles.into_values() {
                if let Some(driver) = self.shared.drivers.get(handle.driver) {
                    tokio::spawn(async move { driver.destroy(&handle).await });
                }
            }
            let mut current = Current::new(spec, desired, state);
            current.devices = devices;
            self.current = Some(current);
            return;
        }
        let mut current = Current::new(spec.clone(), desired, state);
        current.devices = devices;
        for (task, handle) in handles {
            let Some(driver) = self.shared.drivers.get(handle.driver) else {
                continue;
            };
            current.handles.insert(task.clone(), handle.clone());
            let ops = self.new_ops(&task);
            let tx = self.reports.clone();
            let run = ops.run;
            tokio::spawn(async move {
                match driver.recover(&handle).await {
                    Ok(()) => watch_exit(driver, handle, ops.cancel_wait, tx, task, run).await,
                    Err(error) => tx.send(task, run, OpReport::RecoverFailed(error)),
                }
            });
        }
        self.current = Some(current);
    }

    /// Runs until the alloc is destroyed or the agent leaves.
    pub(crate) async fn run(mut self) {
        loop {
            let now = self.shared.clock.now();
            let pending = self.mailbox.take();
            if let Some(target) = pending.target {
                self.target = target;
                if let Some(broken) = &mut self.broken {
                    broken.heard = true;
                }
            }
            if let Some(how) = pending.shutdown {
                self.shutdown = Some(self.shutdown.map_or(how, |s| s.max(how)));
            }
            for (task, run, report) in self.reports.take() {
                self.apply_report(task, run, report, now);
            }
            for command in pending.commands {
                self.handle_command(command, now);
            }
            if self.shutdown == Some(Shutdown::Detach) {
                self.persist_and_publish().await;
                for ops in self.ops.values() {
                    ops.cancel_start.cancel();
                    ops.cancel_wait.cancel();
                }
                return;
            }
            let wake_at = match self.step(now).await {
                Step::Exit => return,
                Step::Again => continue,
                Step::Wait(wake_at) => wake_at,
                Step::Collect(reply) => match self.collect(reply).await {
                    Step::Exit => return,
                    _ => continue,
                },
            };
            self.persist_and_publish().await;
            let wake_at = match (wake_at, self.store_retry.as_ref().map(|r| r.at)) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            // The node's ticker wakes every worker once per tick through its mailbox, so
            // an idle worker holds no timer of its own; a timer is armed only when the
            // reconciler has something due.
            let clock = self.shared.clock;
            let due = async move {
                match wake_at {
                    Some(at) => tokio::time::sleep_until(clock.instant_at(at)).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = self.mailbox.changed() => {}
                () = due => {}
            }
        }
    }

    /// One reconcile of the current revision, and the transitions between revisions:
    /// [`revision::decide`] and [`revision::after_reconcile`] decide, the worker carries
    /// their decisions out.
    async fn step(&mut self, now: Timestamp) -> Step {
        let reconcile = loop {
            match revision::decide(&self.revision_inputs()) {
                RevisionDecision::Exit => return Step::Exit,
                RevisionDecision::Wait => return Step::Wait(None),
                RevisionDecision::AdoptBrokenRevision(revision) => {
                    if let Some(broken) = &mut self.broken {
                        broken.revision = Some(revision.to_string());
                    }
                    return Step::Wait(None);
                }
                RevisionDecision::LeaveBroken => self.broken = None,
                RevisionDecision::Destroy => {
                    self.broken = None;
                    return self.finish_destroy().await;
                }
                RevisionDecision::StartRevision => {
                    if let Target::Spec(spec) = &self.target {
                        let spec = spec.clone();
                        let desired = self.desired_for(&spec);
                        let state = AllocState::new(&desired, now);
                        self.current = Some(Current::new(spec, desired, state));
                    }
                }
                RevisionDecision::PersistAndExit => return self.persist_and_exit().await,
                RevisionDecision::Reconcile(reconcile) => break reconcile,
            }
        };
        let current = self.current.as_mut().expect("a revision to reconcile");
        if reconcile.adopt_target_spec
            && let Target::Spec(spec) = &self.target
        {
            current.spec = spec.clone();
        }
        current.desired.run = reconcile.run;
        if reconcile.clear_hand_over_error {
            current.hand_over_error = None;
        }
        current.desired.unavailable_drivers = self.shared.unavailable_drivers();
        self.place_devices();
        let current = self.current.as_mut().expect("still set");
        let began = self.shared.clock.instant();
        let plan = current.state.reconcile(&current.desired, now);
        tracing::trace!(
            effects = plan.effects.len(),
            wake_at = plan.wake_at.map(tracing::field::display),
            "reconciled"
        );
        self.execute(plan.effects, now);
        crate::metrics::reconciled(began.elapsed());
        self.release_devices();
        match revision::after_reconcile(&self.revision_inputs()) {
            AfterReconcile::Wait => {}
            AfterReconcile::PersistAndExit => return self.persist_and_exit().await,
            AfterReconcile::Collect => {
                if let Some(reply) = self.collect.take() {
                    return Step::Collect(reply);
                }
            }
            AfterReconcile::HandOver => {
                if let Target::Spec(spec) = &self.target {
                    let spec = spec.clone();
                    self.persist_and_publish().await;
                    if let Err(error) = self.hand_over_alloc_dir(&spec) {
                        // The new revision waits, rather than start without the data it
                        // should have: the old alloc dir stays, and every tick tries
                        // the hand-over again.
                        let reason = format!(
                            "revision {} waits for the sticky disk: {}",
                            spec.id,
                            error_chain(&error)
                        );
                        let current = self.current.as_mut().expect("still set");
                        if current.hand_over_error.as_ref() != Some(&reason) {
                            tracing::error!(%reason, "cannot hand the alloc dir over");
                            current.hand_over_error = Some(reason);
                        }
                        self.persist_and_publish().await;
                        return Step::Wait(None);
                    }
                    self.current = None;
                    return Step::Again;
                }
            }
        }
        Step::Wait(plan.wake_at)
    }

    /// What [`revision`] decides from: the target, the agent's leaving, the broken
    /// record and the current revision as this worker holds them.
    fn revision_inputs(&self) -> RevisionInputs<'_> {
        RevisionInputs {
            target: match &self.target {
                Target::Spec(spec) => TargetRevision::Spec {
                    revision: &spec.revision,
                    stop: spec.spec.spec.desired_status == Some(DesiredStatus::Stop),
                },
                Target::Absent => TargetRevision::Absent,
            },
            shutdown: self.shutdown.map(|how| match how {
                Shutdown::Detach => AgentShutdown::Detach,
                Shutdown::Drain => AgentShutdown::Drain,
            }),
            broken: self.broken.as_ref().map(|broken| BrokenRecord {
                revision: broken.revision.as_deref(),
                heard: broken.heard,
            }),
            current: self.current.as_ref().map(|current| CurrentRevision {
                revision: &current.spec.revision,
                terminal: current.state.is_terminal(),
                in_flight: !self.ops.is_empty(),
                collect_requested: self.collect.is_some(),
                hand_over_failed: current.hand_over_error.is_some(),
            }),
        }
    }

    /// The agent leaves: writes and publishes what the current revision is, stops
    /// watching its tasks (they go on running for the next agent) and exits.
    async fn persist_and_exit(&mut self) -> Step {
        self.persist_and_publish().await;
        for ops in self.ops.values() {
            ops.cancel_start.cancel();
            ops.cancel_wait.cancel();
        }
        Step::Exit
    }

    /// Gets the current revision its devices before anything of it starts: all tasks'
    /// or none. While they cannot be had, every start is held back with why (and an
    /// unknown device is also shown as the alloc's spec error, naming the field).
    fn place_devices(&mut self) {
        let Some(current) = self.current.as_mut() else {
            return;
        };
        current.desired.devices_unavailable = None;
        if !current.devices.is_empty() {
            return;
        }
        // `may_start`, not "runs and is not terminal": a stopped alloc asked to run again is
        // terminal until the reconcile that starts it, which must find its devices held.
        let wants = current.needs_devices && current.state.may_start(&current.desired);
        let manager = &self.shared.config.devices;
        if !wants {
            current.device_error = None;
            if self.devices_handed_on {
                // A previous revision's devices that this one will not use.
                manager.release(&self.name);
                self.devices_handed_on = false;
            }
            return;
        }
        let requests = current.device_requests();
        // Whatever the outcome, the manager now holds for this alloc exactly `devices`.
        self.devices_handed_on = false;
        match manager.acquire(&self.name, &requests) {
            Ok(devices) => {
                for (task, held) in &devices {
                    let held: Vec<String> = held.iter().map(ToString::to_string).collect();
                    tracing::info!(task = %task, devices = %held.join(","), "devices assigned");
                }
                current.devices = devices;
                current.device_error = None;
            }
            Err(why) => {
                current.device_error = match &why {
                    DeviceUnavailable::Unknown { request } if manager.all_reported() => {
                        Some(unknown_device_error(&requests, request, &why))
                    }
                    _ => None,
                };
                current.desired.devices_unavailable = Some(why.to_string());
            }
        }
    }

    /// Frees the current revision's devices once it is terminal and nothing of it is in
    /// flight; a revision that runs again asks anew. A revision being replaced hands its
    /// devices on instead: the manager keeps them for the next revision's first ask.
    fn release_devices(&mut self) {
        let Some(current) = self.current.as_mut() else {
            return;
        };
        if current.devices.is_empty() || !current.state.is_terminal() || !self.ops.is_empty() {
            return;
        }
        current.devices.clear();
        let replaced =
            matches!(&self.target, Target::Spec(spec) if spec.revision != current.spec.revision);
        if replaced {
            // The next revision starts now and asks first, with these preferred: no other
            // alloc can take them in between. It frees them if it does not ask.
            self.devices_handed_on = true;
            return;
        }
        self.shared.config.devices.release(&self.name);
        tracing::info!("devices released");
    }

    fn desired_for(&self, spec: &ValidSpec) -> AllocDesired {
        AllocDesired::new(&spec.spec.spec, true, self.shared.config.limits)
    }

    fn new_ops(&mut self, task: &Name) -> TaskOps {
        self.next_run += 1;
        let ops = TaskOps {
            run: self.next_run,
            cancel_start: CancellationToken::new(),
            cancel_wait: CancellationToken::new(),
        };
        if let Some(old) = self.ops.insert(
            task.clone(),
            TaskOps {
                run: ops.run,
                cancel_start: ops.cancel_start.clone(),
                cancel_wait: ops.cancel_wait.clone(),
            },
        ) {
            old.cancel_start.cancel();
            old.cancel_wait.cancel();
        }
        ops
    }

    fn execute(&mut self, effects: Vec<Effect>, now: Timestamp) {
        for effect in effects {
            match effect {
                Effect::Start { task } => self.start_task(task, now),
                Effect::CancelStart { task } => {
                    if let Some(ops) = self.ops.get(&task) {
                        ops.cancel_start.cancel();
                    }
                }
                Effect::Signal { task, signal } => {
                    if let Some((driver, handle)) = self.driver_and_handle(&task) {
                        tokio::spawn(async move {
                            // A failed kill signal is covered by the force kill at the timeout.
                            let _ = driver.signal(&handle, &signal).await;
                        });
                    }
                }
                Effect::ForceKill { task } => {
                    if let Some((driver, handle)) = self.driver_and_handle(&task) {
                        tokio::spawn(async move {
                            let _ = driver.kill(&handle).await;
                        });
                    }
                }
                Effect::Forget { task } => {
                    if let Some(ops) = self.ops.remove(&task) {
                        ops.cancel_wait.cancel();
                    }
                    if let Some((driver, handle)) = self.driver_and_handle(&task) {
                        tokio::spawn(async move { driver.destroy(&handle).await });
                    }
                    if let Some(current) = &mut self.current {
                        current.handles.remove(&task);
                    }
                }
            }
        }
    }

    fn driver_and_handle(&self, task: &Name) -> Option<(Arc<dyn Driver>, TaskHandle)> {
        let handle = self.current.as_ref()?.handles.get(task)?.clone();
        let driver = self.shared.drivers.get(handle.driver)?;
        Some((driver, handle))
    }

    fn start_task(&mut self, task: Name, now: Timestamp) {
        let Some(current) = &self.current else { return };
        let Some(spec) = current.spec.spec.spec.tasks.iter().find(|t| t.name == task) else {
            return;
        };
        let mut env: BTreeMap<String, String> = spec
            .env
            .iter()
            .flatten()
            .map(|(k, v)| (k.as_str().to_owned(), v.clone()))
            .collect();
        let agent_env = [
            ("STEAD_ALLOC_ID", current.spec.id.to_string()),
            ("STEAD_ALLOC_NAME", self.name.to_string()),
            ("STEAD_TASK_NAME", task.to_string()),
        ];
        env.extend(agent_env.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
        let (max_files, max_file_size_mb) = spec.effective_logs();
        let held = current.devices.get(&task).cloned().unwrap_or_default();
        let mut request = StartRequest {
            alloc_id: current.spec.id.clone(),
            task: task.clone(),
            config: spec.config.clone(),
            env,
            user: spec.user.as_ref().map(|u| u.to_string()),
            logs: LogLimits {
                max_files,
                max_file_size_mb,
            },
            devices: DeviceAccess::default(),
        };
        let kind = match &spec.config {
            DriverConfig::Exec(_) => stead_schemas::spec::DriverKind::Exec,
            DriverConfig::Mock(_) => stead_schemas::spec::DriverKind::Mock,
        };
        let ops = self.new_ops(&task);
        let tx = self.reports.clone();
        let run = ops.run;
        let Some(driver) = self.shared.drivers.get(kind) else {
            let message = format!("driver {kind} is not enabled on this agent");
            let current = self.current.as_mut().expect("checked above");
            let jitter = Jitter::from_bits(self.rng.u32(..));
            current.state.observe(
                &current.desired,
                &task,
                Observation::StartFailed {
                    message,
                    recoverable: false,
                },
                jitter,
                now,
            );
            self.ops.remove(&task);
            return;
        };
        let span = tracing::info_span!("task", task = %task, run);
        let devices = self.shared.config.devices.clone();
        let operation = async move {
            if !held.is_empty() {
                match devices.reservation(&held).await {
                    Ok(reservation) => {
                        // Over the spec's env, under the agent's own variables.
                        request.env.extend(reservation.env);
                        request
                            .env
                            .extend(agent_env.map(|(k, v)| (k.to_owned(), v)));
                        request.devices = DeviceAccess {
                            mounts: reservation.mounts,
                            device_nodes: reservation.device_nodes,
                        };
                    }
                    Err(error) => {
                        let error = DriverError::Start {
                            alloc_id: request.alloc_id.clone(),
                            task: task.clone(),
                            message: format!("reserving its devices: {error}"),
                            recoverable: true,
                        };
                        tx.send(task, run, OpReport::StartFailed(error));
                        return;
                    }
                }
            }
            let started = tokio::select! {
                result = driver.start(request) => Some(result),
                () = ops.cancel_start.cancelled() => None,
            };
            match started {
                None => tx.send(task, run, OpReport::StartCancelled),
                Some(Err(error)) => {
                    tx.send(task, run, OpReport::StartFailed(error));
                }
                Some(Ok(handle)) => {
                    let report = OpReport::Started(handle.clone());
                    tx.send(task.clone(), run, report);
                    watch_exit(driver, handle, ops.cancel_wait, tx, task, run).await;
                }
            }
        };
        tokio::spawn(tracing::Instrument::instrument(operation, span));
    }

    fn apply_report(&mut self, task: Name, run: u64, report: OpReport, now: Timestamp) {
        if self.ops.get(&task).is_none_or(|ops| ops.run != run) {
            return; // a report from an abandoned run
        }
        let jitter = Jitter::from_bits(self.rng.u32(..));
        let Some(current) = &mut self.current else {
            return;
        };
        let observation = match report {
            OpReport::Started(handle) => {
                tracing::info!(task = %task, pid = handle.pid, "task started");
                crate::metrics::task_started();
                current.handles.insert(task.clone(), handle);
                Observation::Started
            }
            OpReport::StartFailed(error) => {
                tracing::warn!(task = %task, error = %error_chain(&error), "task failed to start");
                self.ops.remove(&task);
                let recoverable = error.is_recoverable();
                Observation::StartFailed {
                    message: error_chain(&error),
                    recoverable,
                }
            }
            OpReport::StartCancelled => {
                self.ops.remove(&task);
                Observation::StartCancelled
            }
            OpReport::Exited(result) => {
                tracing::info!(
                    task = %task,
                    exit_code = result.exit_code,
                    signal = result.signal,
                    error = result.error.as_deref(),
                    "task exited"
                );
                self.ops.remove(&task);
                if let Some(handle) = current.handles.remove(&task)
                    && let Some(driver) = self.shared.drivers.get(handle.driver)
                {
                    tokio::spawn(async move { driver.destroy(&handle).await });
                }
                Observation::Exited(result)
            }
            OpReport::RecoverFailed(error) => {
                self.ops.remove(&task);
                current.handles.remove(&task);
                Observation::RecoverFailed {
                    message: format!("failed to reattach to the task: {}", error_chain(&error)),
                }
            }
        };
        current
            .state
            .observe(&current.desired, &task, observation, jitter, now);
    }

    /// Whether garbage collection may destroy the alloc now: its spec is gone, and it is
    /// terminal with no driver operation in flight.
    fn collectable(&self) -> bool {
        matches!(self.target, Target::Absent)
            && self.ops.is_empty()
            && self
                .current
                .as_ref()
                .is_some_and(|c| !c.desired.run && c.state.is_terminal())
    }

    fn handle_command(&mut self, command: UserCommand, now: Timestamp) {
        if self.broken.is_some()
            && let UserCommand::Restart { reply, .. } = command
        {
            // Starting afresh is the way out of a record that cannot be used.
            let result = revision::restart_broken(self.revision_inputs().target);
            if result.is_ok() {
                self.broken = None;
            }
            let _ = reply.send(result.map_err(CommandError::Refused));
            return;
        }
        let command = match command {
            UserCommand::Collect { reply } => {
                let refused = if self.collectable() {
                    self.collect.replace(reply)
                } else {
                    Some(reply)
                };
                if let Some(reply) = refused {
                    let _ = reply.send(Err(CommandError::NotCollectable {
                        name: self.name.to_string(),
                    }));
                }
                return;
            }
            command => command,
        };
        let Some(current) = &mut self.current else {
            let error = CommandError::Refused(CommandRefusal::TaskNotRunning);
            match command {
                UserCommand::Restart { reply, .. }
                | UserCommand::Signal { reply, .. }
                | UserCommand::Collect { reply } => {
                    let _ = reply.send(Err(error));
                }
            }
            return;
        };
        match command {
            UserCommand::Collect { reply } => {
                let _ = reply.send(Err(CommandError::NotCollectable {
                    name: self.name.to_string(),
                }));
            }
            UserCommand::Restart { task, reply } => {
                let result = current
                    .state
                    .request_restart(&current.desired, task.as_ref(), now)
                    .map_err(CommandError::from);
                let _ = reply.send(result);
            }
            UserCommand::Signal {
                task,
                signal,
                reply,
            } => {
                let result =
                    current
                        .state
                        .request_signal(&current.desired, &task, signal.clone(), now);
                match result {
                    Err(refusal) => {
                        let _ = reply.send(Err(refusal.into()));
                    }
                    Ok(_) => match self.driver_and_handle(&task) {
                        Some((driver, handle)) => {
                            tokio::spawn(async move {
                                let result =
                                    driver.signal(&handle, &signal).await.map_err(|source| {
                                        CommandError::Driver {
                                            task: task.to_string(),
                                            source,
                                        }
                                    });
                                let _ = reply.send(result);
                            });
                        }
                        None => {
                            let _ = reply.send(Err(CommandRefusal::TaskNotRunning.into()));
                        }
                    },
                }
            }
        }
    }

    /// Garbage collection: removes the alloc dir (off the runtime's threads), then the
    /// record, and leaves; answers `reply` once done.
    async fn collect(&mut self, reply: oneshot::Sender<Result<(), CommandError>>) -> Step {
        let dir = match (&self.shared.alloc_dirs, &self.current) {
            (Some(dirs), Some(current)) => Some(dirs.alloc(&current.spec.id)),
            _ => None,
        };
        if let Some(dir) = dir {
            let removed = tokio::task::spawn_blocking(move || dir.remove()).await;
            if let Ok(Err(error)) = removed {
                tracing::warn!(error = %error_chain(&error), "cannot remove the alloc dir");
            }
        }
        tracing::info!("garbage collected");
        let step = self.destroy().await;
        let _ = reply.send(Ok(()));
        step
    }

    /// The old revision is terminal and `next` takes over: with a sticky (or migrating)
    /// ephemeral disk, the old alloc dir's `alloc/data` and each shared task's `local`
    /// move into the new one before any of its tasks start; then the old alloc dir goes
    /// (nothing refers to it any more: the record now follows the new revision).
    ///
    /// When the sticky disk cannot be moved, the old alloc dir is kept whole and the error
    /// returned: what was moved stays moved, and the next try moves the rest.
    fn hand_over_alloc_dir(&self, next: &ValidSpec) -> Result<(), AllocDirError> {
        let (Some(dirs), Some(current)) = (&self.shared.alloc_dirs, &self.current) else {
            return Ok(());
        };
        if current.spec.id == next.id {
            return Ok(()); // two revisions sharing an id prefix share the directory too
        }
        let old = dirs.alloc(&current.spec.id);
        let new = dirs.alloc(&next.id);
        let disk = next.spec.spec.ephemeral_disk.as_ref();
        let sticky = disk.is_some_and(|d| d.sticky == Some(true) || d.migrate == Some(true));
        if sticky {
            let tasks: Vec<Name> = next
                .spec
                .spec
                .tasks
                .iter()
                .filter(|t| {
                    current
                        .spec
                        .spec
                        .spec
                        .tasks
                        .iter()
                        .any(|o| o.name == t.name)
                })
                .map(|t| t.name.clone())
                .collect();
            // A few renames on one filesystem: done here, before the new revision exists,
            // so no task of it can start first.
            new.migrate_from(&old, &tasks)?;
            tracing::info!(from = %current.spec.id, to = %next.id, "sticky disk migrated");
        }
        tokio::task::spawn_blocking(move || {
            if let Err(error) = old.remove() {
                tracing::warn!(error = %error_chain(&error), "cannot remove the replaced alloc dir");
            }
        });
        Ok(())
    }

    /// The alloc is terminal and its spec is gone: release everything and leave.
    async fn destroy(&mut self) -> Step {
        if let Some(current) = self.current.take() {
            for handle in current.handles.into_values() {
                if let Some(driver) = self.shared.drivers.get(handle.driver) {
                    tokio::spawn(async move { driver.destroy(&handle).await });
                }
            }
        }
        self.finish_destroy().await
    }

    /// Removes the alloc from the store, the status map and the registry, unless a new
    /// spec arrived meanwhile.
    async fn finish_destroy(&mut self) -> Step {
        self.shared.config.devices.release(&self.name);
        let delete = StoreWrite::Delete(self.name.clone());
        if let Err(error) = self.shared.writer.write(delete).await {
            self.shared.report_store_error(&self.name, &error);
        }
        if self.shared.retire(&self.name, &self.mailbox) {
            Step::Exit
        } else {
            Step::Again
        }
    }

    /// Writes the record and publishes the status when either changed.
    async fn persist_and_publish(&mut self) {
        let removed = matches!(self.target, Target::Absent);
        let Some(current) = &mut self.current else {
            return;
        };
        let (restarts, failures) = outcomes(&current.state);
        crate::metrics::task_outcomes(
            restarts.saturating_sub(current.counted.0),
            failures.saturating_sub(current.counted.1),
        );
        current.counted = (restarts, failures);
        let collectable =
            removed && !current.desired.run && current.state.is_terminal() && self.ops.is_empty();
        let fingerprint = fingerprint(
            &current.state,
            &current.handles,
            &current.devices,
            removed,
            collectable,
        );
        if current.saved != Some(fingerprint) {
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
                let record = record_of(&self.name, current, removed);
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
                            delays: store_backoff(),
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
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            fingerprint.hash(&mut hasher);
            current.device_error.hash(&mut hasher);
            current.hand_over_error.hash(&mut hasher);
            health.hash(&mut hasher);
            hasher.finish()
        };
        if current.published == Some(shown) {
            return;
        }
        current.published = Some(shown);
        let status = status_of(&self.name, current, removed, &health);
        let facts = AllocFacts {
            collectable,
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
            desired_status: "run".to_owned(),
            client_status: "failed".to_owned(),
            spec_error: None,
            state_error: Some(broken.reason.clone()),
            tasks: BTreeMap::new(),
        })
    }

    /// Why a restored alloc cannot resume for want of its alloc dir: a task of a driver
    /// that builds one (exec) has started, yet the dir is gone.
    fn missing_alloc_dir(&self, spec: &ValidSpec, state: &AllocState) -> Option<String> {
        let root = self.shared.alloc_dirs.as_ref()?.root();
        let needs_dir = spec.spec.spec.tasks.iter().any(|task| {
            task.driver == stead_schemas::spec::DriverKind::Exec
                && state
                    .tasks
                    .get(&task.name)
                    .is_some_and(|t| t.started_at.is_some())
        });
        let dir = root.join(spec.id.as_str());
        (needs_dir && !dir.is_dir()).then(|| {
            format!(
                "alloc {}: alloc dir {} is missing, so its tasks cannot be resumed",
                self.name,
                dir.display()
            )
        })
    }
}

/// The devices a task holds with their health as the node sees it now (`health`, in the
/// same order): an unhealthy or unreported one is flagged with why, and the task keeps it.
fn task_devices(held: &[AssignedDevice], health: &[Option<DeviceHealth>]) -> Vec<TaskDeviceStatus> {
    held.iter()
        .zip(health.iter().cloned())
        .map(|(device, health)| {
            let (healthy, reason) = match health {
                Some(DeviceHealth::Healthy) => (true, None),
                Some(DeviceHealth::Unhealthy { reason }) => (
                    false,
                    Some(reason.unwrap_or_else(|| "unhealthy".to_owned())),
                ),
                None => (false, Some(FlagReason::NotReported.to_string())),
            };
            TaskDeviceStatus {
                group: device.group.to_string(),
                id: device.instance.to_string(),
                healthy,
                reason,
            }
        })
        .collect()
}

/// The spec error for a request no plugin reports: the field, then why.
fn unknown_device_error(
    requests: &[(Name, &[DeviceRequest])],
    unknown: &DeviceName,
    why: &DeviceUnavailable,
) -> String {
    for (index, (_, task_requests)) in requests.iter().enumerate() {
        if let Some(position) = task_requests.iter().position(|r| &r.name == unknown) {
            return format!("spec.tasks[{index}].resources.devices[{position}].name: {why}");
        }
    }
    why.to_string()
}

/// The record of the current revision.
fn record_of(name: &Name, current: &Current, removed: bool) -> AllocRecord {
    AllocRecord {
        version: ALLOC_RECORD_VERSION,
        name: name.clone(),
        spec: current.spec.spec.clone(),
        revision: current.spec.revision.to_string(),
        removed,
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

/// The longest wait between retries of a failed store write.
const STORE_RETRY_MAX: Duration = Duration::from_secs(30);

/// Retries of a failed store write: 100 ms doubling to 30 s, with jitter, forever (the
/// tasks keep running meanwhile; the record is written as soon as storage takes it).
fn store_backoff() -> backon::ExponentialBackoff {
    use backon::BackoffBuilder;
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(STORE_RETRY_MAX)
        .with_jitter()
        .without_max_times()
        .build()
}

/// What the loop does after a step.
enum Step {
    /// Wait for input, the wake-up time or the tick.
    Wait(Option<Timestamp>),
    /// Step again at once.
    Again,
    /// Leave.
    Exit,
    /// Garbage collection destroys the alloc, then answers.
    Collect(oneshot::Sender<Result<(), CommandError>>),
}

/// A hash of everything a record holds, computed on every pass to skip unchanged writes.
/// Events only ever append (dropping the oldest at the cap), so their count, oldest and
/// newest stand for all of them: hashing whole histories on every tick would cost more
/// than the rest of the pass.
fn fingerprint(
    state: &AllocState,
    handles: &BTreeMap<Name, TaskHandle>,
    devices: &AllocDevices,
    removed: bool,
    collectable: bool,
) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    removed.hash(&mut hasher);
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
    }
    hasher.finish()
}

/// Restarts over all tasks, and how many tasks failed: what the metrics count.
fn outcomes(state: &AllocState) -> (u64, u64) {
    state
        .tasks
        .values()
        .fold((0, 0), |(restarts, failures), task| {
            (
                restarts + u64::from(task.restarts),
                failures + u64::from(task.failed),
            )
        })
}

/// Waits for the task to exit and reports it, unless cancelled first: a driver is never
/// trusted to end its wait after a kill.
async fn watch_exit(
    driver: Arc<dyn Driver>,
    handle: TaskHandle,
    cancel: CancellationToken,
    tx: Reports,
    task: Name,
    run: u64,
) {
    tokio::select! {
        result = driver.wait(handle) => tx.send(task, run, OpReport::Exited(result)),
        () = cancel.cancelled() => {}
    }
}

fn hash_name(name: &Name) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut hasher);
    hasher.finish()
}

/// The API's view of the current revision.
fn status_of(
    name: &Name,
    current: &Current,
    removed: bool,
    health: &BTreeMap<Name, Vec<Option<DeviceHealth>>>,
) -> AllocStatus {
    let desired_status =
        if removed || current.spec.spec.spec.desired_status == Some(DesiredStatus::Stop) {
            "stop"
        } else {
            "run"
        };
    AllocStatus {
        name: name.to_string(),
        id: current.spec.id.to_string(),
        revision: current.spec.revision.to_string(),
        desired_status: desired_status.to_owned(),
        client_status: current.state.client_status().as_str().to_owned(),
        spec_error: current.device_error.clone(),
        state_error: current.hand_over_error.clone(),
        tasks: current
            .state
            .tasks
            .iter()
            .map(|(task, state)| {
                let status = TaskStatus {
                    state: state.phase.as_str().to_owned(),
                    failed: state.failed,
                    restarts: state.restarts,
                    last_restart: state.last_restart,
                    started_at: state.started_at,
                    finished_at: state.finished_at,
                    pid: current.handles.get(task).and_then(|h| h.pid),
                    devices: current
                        .devices
                        .get(task)
                        .zip(health.get(task))
                        .map(|(held, health)| task_devices(held, health))
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
                        })
                        .collect(),
                };
                (task.to_string(), status)
            })
            .collect(),
    }
}
