//! The alloc worker: one tokio task per alloc that owns that alloc's state.
//!
//! Each turn it takes its inputs (one closed [`Input`] set: target, shutdown, driver
//! reports, user commands), asks the revision lifecycle what to do
//! (`stead_reconcilers::revision`), runs the pure reconciler, carries out the plan by
//! spawning driver operations (so a slow driver call never blocks the worker), persists
//! its record and publishes its view. One worker per alloc means at most one reconcile of
//! an alloc at a time.
//!
//! ```text
//! mailbox ─▶ target, shutdown, commands ─┐
//! op reports ────────────────────────────┼─▶ handle ─▶ revision::decide ─▶ reconcile ─▶ effects
//! wake-up / tick (no input) ─────────────┘                                       │
//!          ▲──────────────────────────────── op reports ◀── spawned driver ops ◀─┘
//! ```
//!
//! By concern: `commands.rs` (user commands), `ops.rs` (driver operations), `devices.rs`, `persist.rs` (record and view),
//! `hand_over.rs` (sticky disk, GC, removal).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use stead_reconcilers::alloc::{AllocDesired, AllocState, CommandRefusal, Limits, Observation};
use stead_reconcilers::device::{AllocDevices, DeviceUnavailable, FlagReason};
use stead_reconcilers::exit::ExitResult;
use stead_reconcilers::restart::Jitter;
use stead_reconcilers::revision::{
    self, AfterReconcile, BrokenRecord, CurrentRevision, RevisionDecision, RevisionInputs,
    TargetRevision,
};
use stead_reconcilers::task::Effect;
use stead_schemas::device::{AssignedDevice, DeviceHealth};
use stead_schemas::record::{ALLOC_RECORD_VERSION, AllocRecord};
use stead_schemas::spec::{
    CheckType, DesiredStatus, DeviceName, DeviceRequest, DriverConfig, DriverKind, Name,
};
use stead_schemas::status::{AllocStatus, TaskDeviceStatus, TaskEventStatus, TaskStatus};
use stead_schemas::{Timestamp, ValidSpec};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::allocdir::{AllocDir, AllocDirError, AllocDirs};
use crate::clock::Clock;
use crate::devices::DeviceManager;
use crate::driver::{
    DeviceAccess, Driver, DriverError, Drivers, ExecRequest, LogLimits, StartRequest, TaskHandle,
    TaskResources,
};
use crate::errors::error_chain;
use crate::queue::{CommandError, Mailbox, Shutdown, Target, UserCommand};
use crate::registry::{AllocFacts, Registry};
use crate::store::{self, Store, StoreError, StoreWrite, StoreWriter};

mod checks;
mod commands;
mod devices;
mod hand_over;
mod ops;
mod persist;

use checks::CheckLoop;
use devices::*;
use ops::*;

pub(crate) use ops::stop_unrecorded;
use persist::*;

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
    /// Runs no record names, which the starts of their tasks reattach.
    pub(crate) unrecorded: crate::unrecorded::Unrecorded,
    registry: Arc<Registry>,
}

/// The node's settings a worker applies.
pub(crate) struct WorkerConfig {
    pub(crate) limits: Limits,
    /// Seeds restart jitter, for reproducible tests; `None` draws it at random.
    pub(crate) seed: Option<u64>,
    /// The node's devices.
    pub(crate) devices: Arc<DeviceManager>,
    /// See [`crate::node::NodeConfig::plant_start_before_terminal`].
    pub(crate) plant_start_before_terminal: bool,
    /// See [`crate::node::NodeConfig::plant_skip_kill_order`].
    pub(crate) plant_skip_kill_order: bool,
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
            unrecorded: crate::unrecorded::Unrecorded::default(),
            registry,
        }
    }

    /// Shows an alloc's status snapshot, its tasks' driver handles and its facts, together.
    fn publish(
        &self,
        name: &Name,
        status: AllocStatus,
        handles: Arc<BTreeMap<Name, TaskHandle>>,
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

/// The revision the worker runs now.
struct Current {
    spec: Arc<ValidSpec>,
    desired: AllocDesired,
    state: AllocState,
    /// The started tasks' handles, shared with the published view (copied on change).
    handles: Arc<BTreeMap<Name, TaskHandle>>,
    /// A hash of what was last persisted, to skip writing when nothing changed.
    saved: Option<u64>,
    /// A hash of what was last published.
    published: Option<u64>,
    /// Failed tasks already counted in the metrics.
    counted_failures: u64,
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
    /// A revision with no handles yet, nothing persisted or published, and the failures
    /// its state already holds counted.
    fn new(spec: Arc<ValidSpec>, desired: AllocDesired, state: AllocState) -> Self {
        let counted_failures = failures(&state);
        let mut current = Current {
            spec,
            desired,
            state,
            handles: Arc::default(),
            saved: None,
            published: None,
            counted_failures,
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
}

/// Everything that reaches a worker: one closed set, handled in [`Worker::handle`].
enum Input {
    /// What the specs now say of the alloc (only the newest is ever delivered).
    Target(Target),
    /// The agent is leaving.
    Shutdown(Shutdown),
    /// A driver operation of `task`'s run `run` reported.
    Report {
        task: Name,
        run: u64,
        report: OpReport,
    },
    /// A user's command, answered on its reply channel.
    Command(UserCommand),
}

/// Where a worker starts from.
pub(crate) enum Start {
    /// A new alloc.
    Fresh(Target),
    /// An alloc restored from the store after an agent restart: the spec it ran, its
    /// state, handles and devices, and whether its spec was removed; with the ids of its
    /// other revisions that have a dir.
    Restored(Box<store::RestoredAlloc>, Vec<String>),
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

/// One alloc's worker.
pub(crate) struct Worker {
    shared: Arc<WorkerContext>,
    name: Name,
    mailbox: Mailbox,
    target: Target,
    current: Option<Current>,
    shutdown: Option<Shutdown>,
    ops: BTreeMap<Name, TaskOps>,
    /// The check loop of each running task that has checks.
    checks: BTreeMap<Name, CheckLoop>,
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
    /// A user stopped the alloc (`stead alloc stop`): it stays stopped, whatever revision
    /// its spec declares, until a user starts it.
    stopped_by_user: bool,
    /// The ids of this alloc's other revisions that had a dir when it was restored: left
    /// by an agent killed during a hand-over, removed with the next one's.
    other_revisions: Vec<String>,
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
            checks: BTreeMap::new(),
            next_run: 0,
            reports,
            rng,
            broken: None,
            store_retry: None,
            collect: None,
            devices_handed_on: false,
            stopped_by_user: false,
            other_revisions: Vec::new(),
        };
        match start {
            Start::Fresh(target) => worker.target = target,
            Start::Restored(restored, other_revisions) => {
                worker.restore(*restored);
                worker.other_revisions = other_revisions;
            }
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
            stopped_by_user,
        } = restored;
        self.stopped_by_user = stopped_by_user;
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
            Arc::make_mut(&mut current.handles).insert(task.clone(), handle.clone());
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

    /// Runs until the alloc is destroyed or the agent leaves: each turn takes every input
    /// that arrived, then reconciles (a turn with none, a wake-up or the node's tick, is
    /// the level re-check).
    pub(crate) async fn run(mut self) {
        loop {
            let now = self.shared.clock.now();
            self.mailbox.begin_pass();
            for input in self.take_inputs() {
                self.handle(input, now);
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
            // An idle worker holds no timer of its own; one is armed only when something
            // is due, and the node's tick, which reads the due time noted here, wakes the
            // worker too should that timer be lost.
            self.mailbox.set_due(wake_at);
            let clock = self.shared.clock;
            let due = async move {
                match wake_at {
                    Some(at) => tokio::time::sleep_until(clock.instant_at(at)).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                () = self.mailbox.changed() => {}
                () = due => {}
            }
        }
    }

    /// Every input that arrived since the last turn, in the order they are handled: the
    /// newest target, a shutdown, the driver operations' reports, the user's commands.
    fn take_inputs(&mut self) -> Vec<Input> {
        let pending = self.mailbox.take();
        let reports = self.reports.take();
        // A pass with nothing new (the sweep's, a due time's) allocates nothing here.
        let count = usize::from(pending.target.is_some())
            + usize::from(pending.shutdown.is_some())
            + reports.len()
            + pending.commands.len();
        let mut inputs = Vec::with_capacity(count);
        inputs.extend(pending.target.map(Input::Target));
        inputs.extend(pending.shutdown.map(Input::Shutdown));
        inputs.extend(
            reports
                .into_iter()
                .map(|(task, run, report)| Input::Report { task, run, report }),
        );
        inputs.extend(pending.commands.into_iter().map(Input::Command));
        inputs
    }

    /// Takes one input into the worker's state; the turn's reconcile acts on it.
    fn handle(&mut self, input: Input, now: Timestamp) {
        match input {
            Input::Target(target) => {
                self.target = target;
                if let Some(broken) = &mut self.broken {
                    broken.heard = true;
                }
            }
            Input::Shutdown(how) => {
                let draining = how == Shutdown::Drain && self.shutdown != Some(Shutdown::Drain);
                if draining
                    && self
                        .current
                        .as_ref()
                        .is_some_and(|c| !c.state.is_terminal())
                {
                    tracing::info!(alloc = %self.name, reason = "the agent drains", "stopping");
                }
                self.shutdown = Some(self.shutdown.map_or(how, |s| s.max(how)));
            }
            Input::Report { task, run, report } => self.apply_report(task, run, report, now),
            Input::Command(command) => self.handle_command(command, now),
        }
    }

    /// One reconcile of the current revision, and the transitions between revisions:
    /// [`revision::decide`] and [`revision::after_reconcile`] decide, the worker carries
    /// their decisions out.
    async fn step(&mut self, now: Timestamp) -> Step {
        self.stop_unrecorded_runs().await;
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
                        let mut state = AllocState::new(&desired, now);
                        // Its main tasks ran before the record of it was lost (simulator
                        // seeds 8303 and 6786): not its prestart tasks again beside them.
                        if desired.tasks.iter().any(|t| {
                            t.is_main()
                                && self.shared.unrecorded.holds_run(spec.id.as_str(), &t.name)
                        }) {
                            state.prestart_done_before(&desired, now);
                        }
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
        // The target revision's runs that no record names were started after this
        // revision ended (the node never runs two at once): its stale record must not
        // run its poststop tasks again beside them.
        current.desired.successor_ran = !reconcile.run
            && matches!(&self.target, Target::Spec(spec)
                if spec.id != current.spec.id
                    && self.shared.unrecorded.holds_revision(spec.id.as_str()));
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
        self.sync_checks();
        crate::metrics::reconciled(began.elapsed());
        self.release_devices();
        let planted_bug = self.shared.config.plant_start_before_terminal
            && matches!(&self.target, Target::Spec(spec)
                if self.current.as_ref().is_some_and(|current| current.spec.id != spec.id));
        let after = if planted_bug {
            AfterReconcile::HandOver
        } else {
            revision::after_reconcile(&self.revision_inputs())
        };
        match after {
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
                        // should have: the old alloc dir stays, and the hand-over is
                        // tried again every `HAND_OVER_RETRY` (or on any input).
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
                        return Step::Wait(Some(now + HAND_OVER_RETRY));
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
                    stop: self.stops(spec),
                },
                Target::Absent => TargetRevision::Absent,
            },
            shutdown: self.shutdown,
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
        self.checks.clear();
        Step::Exit
    }

    /// Stops, before anything else this turn does (a hand-over, a removal, a start), the
    /// runs of this alloc that no record names and no start of it may take: those of its
    /// other revisions, or all of them when its spec is gone or says stop, or the agent
    /// drains. They end together.
    async fn stop_unrecorded_runs(&mut self) {
        if !self.shared.unrecorded.holds_alloc(self.name.as_str()) {
            return;
        }
        // The stops may take seconds: the alloc is shown (and stored) as it stands
        // meanwhile, never hidden behind them (simulator seeds 346 and 459).
        self.persist_and_publish().await;
        let keep = match (&self.target, self.shutdown) {
            (_, Some(Shutdown::Drain)) => None,
            (Target::Spec(spec), _) if !self.stops(spec) => Some(spec.id.to_string()),
            _ => None,
        };
        let mut stops = tokio::task::JoinSet::new();
        for handle in self
            .shared
            .unrecorded
            .take_to_stop(self.name.as_str(), keep.as_deref())
        {
            match self.shared.drivers.get(handle.driver) {
                Some(driver) => {
                    stops.spawn(stop_unrecorded(driver, handle));
                }
                None => {
                    tracing::warn!(alloc = %self.name, id = %handle.id, driver = %handle.driver, "a run no record names is left running: its driver is not enabled");
                }
            }
        }
        while stops.join_next().await.is_some() {}
    }

    /// Whether the alloc is to be stopped with `spec` as its target: its spec says so, or
    /// a user did.
    fn stops(&self, spec: &ValidSpec) -> bool {
        self.stopped_by_user || spec.spec.spec.desired_status == Some(DesiredStatus::Stop)
    }

    fn desired_for(&self, spec: &ValidSpec) -> AllocDesired {
        AllocDesired {
            plant_skip_kill_order: self.shared.config.plant_skip_kill_order,
            ..AllocDesired::new(&spec.spec.spec, true, self.shared.config.limits)
        }
    }
}

/// How often a hand-over of the alloc dir that failed is tried again: as often as the
/// node's default tick.
const HAND_OVER_RETRY: Duration = Duration::from_secs(10);

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

fn hash_name(name: &Name) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut hasher);
    hasher.finish()
}
