//! The node dispatcher: the registry of allocs and their workers.
//!
//! It owns only the registry. Every input for an alloc goes into that alloc's mailbox,
//! which never blocks, so the dispatcher never waits on a worker; readers get published
//! status snapshots and never wait either. Locks here are held for a map operation,
//! never across an `.await`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stead_reconcilers::alloc::Limits;
use stead_reconcilers::gc::GcCandidate;
use stead_schemas::ValidSpec;
use stead_schemas::spec::{Name, Signal};
use stead_schemas::status::AllocStatus;
use tokio::task::JoinHandle;

use crate::alloc::{Start, Worker, WorkerConfig, WorkerContext};
use crate::allocdir::AllocDirs;
use crate::clock::Clock;
use crate::devices::DeviceManager;
use crate::driver::{Drivers, RecordedRuns, TaskHandle};
use crate::metrics::{CLIENT_STATUSES, NodeLevels, TaskLevels};
use crate::queue::{CommandError, ExecTarget, Mailbox, Shutdown, Target, UserCommand, ask};
use crate::registry::{AllocSlot, AllocView, Registry};
use crate::store::{self, Store, StoreError};

/// How the node runs its allocs.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Limits applied to every alloc.
    pub limits: Limits,
    /// The level re-check period of every worker.
    pub tick: Duration,
    /// Seeds restart jitter, for reproducible tests; `None` draws it at random.
    pub seed: Option<u64>,
    /// How often every driver is fingerprinted again.
    pub fingerprint_period: Duration,
    /// The node's devices and their plugins (started with the node).
    pub devices: Arc<DeviceManager>,
    /// Test hook, off but in the simulator's planted-bug test: a new revision starts as
    /// soon as it is declared, without waiting for the old one to be terminal. It breaks
    /// the rule "never two revisions of one alloc running", for the simulator to catch.
    pub plant_start_before_terminal: bool,
    /// Test hook, off but in the simulator's planted-bug test: a stop kills every task at
    /// once, skipping the kill order (leader, other main tasks, sidecars, then poststop).
    pub plant_skip_kill_order: bool,
}

/// The default level re-check period. Every time-based step (kill timeouts, restart
/// delays, store retries) arms its own timer and every observation wakes its alloc, so
/// the tick is a safety net, not the way work gets done: a sweep of every alloc each
/// second cost an idle node of 100 allocs 0.77 % of a core for no decision.
pub const DEFAULT_TICK: Duration = Duration::from_secs(10);

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            limits: Limits::default(),
            tick: DEFAULT_TICK,
            seed: None,
            fingerprint_period: Duration::from_secs(15),
            devices: Arc::default(),
            plant_start_before_terminal: false,
            plant_skip_kill_order: false,
        }
    }
}

/// The state store's health, as `/v1/health` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreHealthReport {
    /// Writes that failed since the agent started.
    pub failures: u64,
    /// Allocs whose latest state is not yet stored (their writes are being retried).
    pub behind: Vec<String>,
    /// What the store was found to have lost since the agent started (a damaged
    /// write-ahead log, runs of tasks no record names), in words.
    pub lost: Vec<String>,
}

impl StoreHealthReport {
    /// Whether every alloc's latest state is stored and nothing was found lost.
    pub fn is_healthy(&self) -> bool {
        self.behind.is_empty() && self.lost.is_empty()
    }
}

/// What the node was told of its surroundings' trouble, for the health report.
#[derive(Debug, Default)]
struct Conditions {
    /// The specs dir's entries that cannot be read, each with why.
    source: Vec<String>,
    /// What the store lost (see [`StoreHealthReport::lost`]).
    store_lost: Vec<String>,
    /// The alloc names the last complete listing of the specs dir declared (valid or
    /// not); `None` before one, or while some entry cannot be read.
    declared: Option<std::collections::BTreeSet<String>>,
    /// The fleet source's state: `None` without one, else why it is degraded, if it is.
    fleet: Option<Option<String>>,
}

/// What the node's methods and its background loops share.
struct Shared {
    config: NodeConfig,
    /// What every worker is given.
    context: Arc<WorkerContext>,
    /// The allocs' slots (also the workers' publisher, in `context`).
    registry: Arc<Registry>,
    /// Trouble outside the allocs, reported by the agent.
    conditions: Mutex<Conditions>,
}

/// Into how many slices the tick period is cut: each slot is reached in one of them, so
/// the level re-check of many allocs is spread over the period instead of landing at once.
pub const TICK_SLICES: u32 = 10;

/// Every how many ticks the slow full sweep comes, at the least: then every worker is
/// woken, whether or not anything reached it, so a worker whose wake-up was lost
/// converges within one sweep ([`sweep_every`]). On the other ticks only workers with a
/// new input or a due time are woken: an idle node's tick costs no pass per alloc.
pub const SWEEP_EVERY: u32 = 10;

/// The shortest time between two full sweeps, whatever the tick: the sweep is the net
/// for a wake-up lost whole (a bug), and its cost is a pass of every alloc, so a short
/// tick (which bounds the recovery of a due time or a counted input) does not make the
/// node sweep more often than this. The kubelet re-syncs every pod once a minute.
pub const SWEEP_PERIOD_MIN: Duration = Duration::from_secs(60);

/// Every how many ticks of period `tick` the full sweep comes: [`SWEEP_EVERY`], or more
/// so that sweeps are at least [`SWEEP_PERIOD_MIN`] apart.
pub fn sweep_every(tick: Duration) -> u32 {
    let floor = SWEEP_PERIOD_MIN.as_nanos().div_ceil(tick.as_nanos().max(1));
    u32::try_from(floor).unwrap_or(u32::MAX).max(SWEEP_EVERY)
}

/// The level re-check, until the node is gone: one timer for the node instead of one per
/// alloc, reaching one slice of the allocs every `1 / TICK_SLICES` of the period (see
/// [`sweep_every`] for which workers it wakes). An alloc made or removed meanwhile may
/// shift the slices, so an alloc may be reached twice or not at all in one period; its
/// own wake-ups and due time do not depend on the tick.
async fn tick(shared: std::sync::Weak<Shared>) {
    let Some(period) = shared.upgrade().map(|s| s.config.tick) else {
        return;
    };
    let every = u64::from(sweep_every(period));
    let slices = usize::try_from(TICK_SLICES).expect("a small constant");
    let mut interval = tokio::time::interval((period / TICK_SLICES).max(Duration::from_millis(1)));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval.tick().await;
    for round in 0_u64.. {
        let sweep = round % every == every - 1;
        for slice in 0..slices {
            interval.tick().await;
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let now = shared.context.clock.now();
            shared.registry.tick(slice, slices, now, sweep);
        }
    }
}

/// Fingerprints every driver now and then every `fingerprint_period`, until the node is
/// gone. A change of health is logged and wakes every worker, so tasks held back by an
/// unhealthy driver start as soon as it recovers.
async fn fingerprint_drivers(shared: std::sync::Weak<Shared>) {
    let Some(period) = shared.upgrade().map(|s| s.config.fingerprint_period) else {
        return;
    };
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(drivers) = shared.upgrade().map(|s| s.context.drivers.clone()) else {
            return;
        };
        let mut unavailable = BTreeMap::new();
        for (kind, driver) in drivers.iter() {
            let fingerprint = driver.fingerprint().await;
            if fingerprint.health != crate::driver::Health::Healthy {
                unavailable.insert(
                    kind,
                    format!("{}: {}", fingerprint.health, fingerprint.description),
                );
            }
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let changed = {
            let mut current = shared
                .registry
                .unavailable_drivers
                .write()
                .unwrap_or_else(|e| e.into_inner());
            let changed = *current != unavailable;
            if changed {
                for kind in drivers.iter().map(|(kind, _)| kind) {
                    match (current.get(&kind), unavailable.get(&kind)) {
                        (Some(_), None) => {
                            tracing::info!(driver = kind.as_str(), "driver healthy again")
                        }
                        (_, Some(problem)) if current.get(&kind) != Some(problem) => {
                            tracing::warn!(driver = kind.as_str(), %problem, "driver unhealthy");
                        }
                        _ => {}
                    }
                }
                *current = unavailable;
            }
            changed
        };
        if changed {
            shared.registry.wake_all();
        }
    }
}

/// Wakes every worker whenever the devices change (a fingerprint, a health flip, a plugin
/// failure, an assignment released), so an alloc waiting for devices is placed as soon
/// as they are free and holders' statuses show their devices' health. Runs until the
/// node is gone.
async fn watch_devices(shared: std::sync::Weak<Shared>) {
    let Some(mut changes) = shared.upgrade().map(|s| s.config.devices.subscribe()) else {
        return;
    };
    while changes.changed().await.is_ok() {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        shared.registry.wake_all();
        // The node's devices are part of what it shows: waiters look again.
        shared.registry.changed();
    }
}

/// What restoring from the store found.
#[derive(Debug, Default)]
pub struct RestoreReport {
    /// Allocs whose workers resumed.
    pub restored: usize,
    /// Every alloc the node now holds from the store, with the revision it stands for
    /// (none for a record too damaged to name one): the source's starting knowledge.
    pub allocs: Vec<(Name, Option<stead_schemas::Revision>)>,
    /// Records that could not be read, with why (each fails only its own alloc).
    pub corrupt: Vec<store::CorruptRecord>,
    /// Records with no task state, deleted.
    pub dropped: usize,
    /// Runs of tasks that no record names, left running for their tasks' starts to
    /// reattach.
    pub unrecorded: usize,
}

/// The node: its allocs, their workers and their published statuses.
pub struct Node {
    shared: Arc<Shared>,
}

impl Node {
    /// A node with no allocs yet; call from within a tokio runtime (it starts the ticker).
    pub fn new(config: NodeConfig, drivers: Drivers, store: Arc<dyn Store>, clock: Clock) -> Self {
        Self::build(config, drivers, store, clock, None)
    }

    /// A node whose allocs have directories below `alloc_dirs`: a replacing revision
    /// receives a sticky disk from them, and destroying an alloc removes its directory.
    pub fn with_alloc_dirs(
        config: NodeConfig,
        drivers: Drivers,
        store: Arc<dyn Store>,
        clock: Clock,
        alloc_dirs: AllocDirs,
    ) -> Self {
        Self::build(config, drivers, store, clock, Some(alloc_dirs))
    }

    fn build(
        config: NodeConfig,
        drivers: Drivers,
        store: Arc<dyn Store>,
        clock: Clock,
        alloc_dirs: Option<AllocDirs>,
    ) -> Self {
        let registry = Arc::new(Registry::new());
        let worker_config = WorkerConfig {
            limits: config.limits,
            seed: config.seed,
            devices: config.devices.clone(),
            plant_start_before_terminal: config.plant_start_before_terminal,
            plant_skip_kill_order: config.plant_skip_kill_order,
        };
        let context = WorkerContext::new(
            worker_config,
            drivers,
            store,
            clock,
            alloc_dirs,
            registry.clone(),
        );
        let node = Node {
            shared: Arc::new(Shared {
                config,
                context: Arc::new(context),
                registry,
                conditions: Mutex::default(),
            }),
        };
        tokio::spawn(tick(Arc::downgrade(&node.shared)));
        tokio::spawn(fingerprint_drivers(Arc::downgrade(&node.shared)));
        tokio::spawn(watch_devices(Arc::downgrade(&node.shared)));
        node.shared
            .config
            .devices
            .start_seeded(node.shared.context.clock, node.shared.config.seed);
        node
    }

    /// Resumes every alloc in the store: running tasks are reattached, not restarted.
    /// Tasks that no record names (an earlier agent started them and stopped before it
    /// wrote their record, or the store lost it) are left running: the start of the same
    /// task of the same revision reattaches them.
    pub fn restore(&self) -> Result<RestoreReport, StoreError> {
        let mut report = RestoreReport::default();
        let mut resumed = Vec::new();
        let mut recorded = RecordedRuns::default();
        // What each stored record comes to, worked out over the host's cores (the specs
        // validated again are most of a restart at thousands of allocs), then acted on in
        // the store's order.
        enum Loaded {
            Corrupt(store::CorruptRecord),
            /// Nothing of it ever ran.
            Empty(Name),
            Restore {
                name: Name,
                revision: String,
                restored: Result<Box<store::RestoredAlloc>, store::CorruptRecord>,
            },
        }
        let entries = self.shared.context.writer.store().load_allocs()?;
        let loaded = crate::host::map_on_every_core(entries, |entry| match entry {
            Err(corrupt) => (Vec::new(), Loaded::Corrupt(corrupt)),
            Ok(record) => {
                let handles: Vec<_> = record
                    .handles
                    .values()
                    .cloned()
                    .map(store::handle_from_record)
                    .collect();
                let loaded = if record.state.tasks.is_empty() {
                    Loaded::Empty(record.name)
                } else {
                    Loaded::Restore {
                        name: record.name.clone(),
                        revision: record.revision.clone(),
                        restored: store::restore_record(record).map(Box::new),
                    }
                };
                (handles, loaded)
            }
        });
        for (handles, entry) in loaded {
            recorded.handles.extend(handles);
            match entry {
                Loaded::Corrupt(corrupt) => {
                    recorded.unreadable.push(corrupt.name.clone());
                    if let Ok(name) = corrupt.name.parse() {
                        report.allocs.push((name, None));
                    }
                    self.restore_broken(&corrupt, None);
                    report.corrupt.push(corrupt);
                }
                Loaded::Empty(name) => {
                    // Forgotten; its spec, if still there, starts it anew.
                    tracing::warn!(alloc = %name, "dropping a stored alloc with no task state");
                    if let Err(error) = self.shared.context.writer.store().delete_alloc(&name) {
                        self.shared.registry.report_store_error(&name, &error);
                    }
                    report.dropped += 1;
                }
                Loaded::Restore {
                    name,
                    restored: Ok(restored),
                    ..
                } => {
                    report
                        .allocs
                        .push((name.clone(), Some(restored.spec.revision.clone())));
                    // Every alloc's devices are reserved before any worker runs, so none
                    // can be given to another alloc before its holder resumes.
                    self.shared
                        .config
                        .devices
                        .restore(&name, restored.devices.clone());
                    resumed.push((name, restored));
                }
                Loaded::Restore {
                    name,
                    revision,
                    restored: Err(corrupt),
                } => {
                    report
                        .allocs
                        .push((name, stead_schemas::Revision::from_hex(&revision)));
                    self.restore_broken(&corrupt, Some(revision));
                    report.corrupt.push(corrupt);
                }
            }
        }
        // Before any worker runs: what runs without a record is reattached by the start
        // of its task, never started twice and never killed for want of a record.
        for (_, driver) in self.shared.context.drivers.iter() {
            let runs = driver.unrecorded_runs(&recorded);
            report.unrecorded += runs.len();
            self.shared.context.unrecorded.add(runs);
        }
        // Every alloc's revisions with a dir, from one listing: those other than the
        // stored one are an agent's leftovers from a hand-over it did not finish.
        let mut revisions: HashMap<String, Vec<String>> = HashMap::new();
        if let Some(dirs) = &self.shared.context.alloc_dirs {
            let ids = dirs.ids().unwrap_or_else(|error| {
                tracing::warn!(dir = %dirs.root().display(), %error, "cannot list the alloc dirs for revisions a hand-over left");
                Vec::new()
            });
            for id in ids {
                let name = crate::driver::alloc_name_of(&id).to_owned();
                revisions.entry(name).or_default().push(id);
            }
        }
        for (name, restored) in resumed {
            let mut others = revisions.remove(name.as_str()).unwrap_or_default();
            others.retain(|id| *id != restored.spec.id.as_str());
            self.spawn(
                &mut self.shared.registry.slots_mut(),
                name,
                Start::Restored(restored, others),
            );
            report.restored += 1;
        }
        Ok(report)
    }

    /// Shows an alloc whose record cannot be used as failed, naming why; it runs nothing
    /// until its spec changes, a user restarts it, or its spec is removed.
    fn restore_broken(&self, corrupt: &store::CorruptRecord, revision: Option<String>) {
        // A key that is not a valid name cannot be shown or acted on; it is only logged.
        let Ok(name) = corrupt.name.parse::<Name>() else {
            return;
        };
        let reason = crate::errors::error_chain(corrupt);
        self.spawn(
            &mut self.shared.registry.slots_mut(),
            name,
            Start::Broken { reason, revision },
        );
    }

    /// Starts a worker for `name`; the caller holds the slots' write lock, so a retiring
    /// worker and a new input cannot cross.
    fn spawn(&self, slots: &mut indexmap::IndexMap<Name, AllocSlot>, name: Name, start: Start) {
        let mailbox = Mailbox::default();
        let worker = Worker::new(
            self.shared.context.clone(),
            name.clone(),
            mailbox.clone(),
            start,
        );
        // A broken record's status is there from the start.
        let view = AllocView {
            status: worker.broken_status().map(Arc::new),
            ..AllocView::default()
        };
        let span = tracing::info_span!("alloc", alloc = %name);
        let join = tokio::spawn(tracing::Instrument::instrument(worker.run(), span));
        slots.insert(
            name,
            AllocSlot {
                mailbox,
                join: Some(join),
                worker_done: false,
                view: Mutex::new(Arc::new(view)),
            },
        );
        self.shared.registry.changed();
    }

    /// The mailbox of alloc `name` for a user command, refused once the node shuts down
    /// (its workers only stop or leave then).
    fn mailbox(&self, name: &str) -> Result<Mailbox, CommandError> {
        let slots = self.shared.registry.slots();
        if self.shared.registry.shutting_down.load(Ordering::Relaxed) {
            return Err(CommandError::ShuttingDown {
                name: name.to_owned(),
            });
        }
        name.parse::<Name>()
            .ok()
            .and_then(|name| slots.get(&name))
            .map(|slot| slot.mailbox.clone())
            .ok_or_else(|| CommandError::UnknownAlloc {
                name: name.to_owned(),
            })
    }

    /// Declares that `spec` should exist: adds the alloc, or updates it (only the newest
    /// update is ever applied). Never waits. Ignored once the node shuts down.
    pub fn apply(&self, spec: ValidSpec) {
        let name = spec.name().clone();
        let target = Target::Spec(Arc::new(spec));
        let mut slots = self.shared.registry.slots_mut();
        if self.shared.registry.shutting_down.load(Ordering::Relaxed) {
            return;
        }
        match slots.get(&name) {
            Some(slot) => slot.mailbox.set_target(target),
            None => self.spawn(&mut slots, name, Start::Fresh(target)),
        }
    }

    /// Declares that the alloc `name` should no longer exist: it is stopped, then
    /// destroyed. Never waits. Ignored once the node shuts down.
    pub fn remove(&self, name: &Name) {
        let slots = self.shared.registry.slots();
        if self.shared.registry.shutting_down.load(Ordering::Relaxed) {
            return;
        }
        if let Some(slot) = slots.get(name) {
            slot.mailbox.set_target(Target::Absent);
        }
    }

    /// Restarts `task` of alloc `name`, or all its running tasks.
    pub async fn restart(&self, name: &str, task: Option<Name>) -> Result<(), CommandError> {
        let mailbox = self.mailbox(name)?;
        ask(&mailbox, name, |reply| UserCommand::Restart { task, reply }).await
    }

    /// Sends `signal` to `task` of alloc `name`.
    pub async fn signal(&self, name: &str, task: Name, signal: Signal) -> Result<(), CommandError> {
        let mailbox = self.mailbox(name)?;
        ask(&mailbox, name, |reply| UserCommand::Signal {
            task,
            signal,
            reply,
        })
        .await
    }

    /// Stops alloc `name` whatever its spec says (`stopped`), or takes a user's stop back;
    /// kept in its record, so it outlives an agent restart and a new revision.
    pub async fn set_stopped(&self, name: &str, stopped: bool) -> Result<(), CommandError> {
        let mailbox = self.mailbox(name)?;
        ask(&mailbox, name, |reply| UserCommand::SetStopped {
            stopped,
            reply,
        })
        .await
    }

    /// Where a command beside running task `task` of alloc `name` runs
    /// (`stead alloc exec`): refused when the alloc has no such task or it is not running.
    pub async fn exec_target(&self, name: &str, task: Name) -> Result<ExecTarget, CommandError> {
        let mailbox = self.mailbox(name)?;
        ask(&mailbox, name, |reply| UserCommand::Exec { task, reply }).await
    }

    /// Destroys alloc `name` for garbage collection, if it is collectable (terminal and
    /// no longer declared); returns once its directory and record are gone.
    pub async fn collect(&self, name: &Name) -> Result<(), CommandError> {
        let mailbox = self.mailbox(name.as_str())?;
        ask(&mailbox, name.as_str(), |reply| UserCommand::Collect {
            reply,
        })
        .await
    }

    /// Every alloc as garbage collection sees it.
    pub fn gc_candidates(&self) -> Vec<GcCandidate<Name>> {
        self.shared
            .registry
            .slots()
            .iter()
            .map(|(name, slot)| {
                let facts = slot.view().facts;
                GcCandidate {
                    key: name.clone(),
                    collectable: facts.collectable,
                    finished_at: facts.finished_at,
                }
            })
            .collect()
    }

    /// Records that the spec of alloc `name` is broken (`Some(diagnostics)`) or fine again
    /// (`None`); the alloc's status shows it as `specError`.
    pub fn set_spec_error(&self, name: &Name, error: Option<String>) {
        self.shared
            .registry
            .update_view(name, |view| view.spec_error = error.map(Arc::from));
    }

    /// Records the file (or key) alloc `name`'s spec was last read from; its status
    /// document shows it as `specFile`.
    pub fn set_spec_file(&self, name: &Name, file: &str) {
        self.shared
            .registry
            .update_view(name, |view| view.spec_file = Some(Arc::from(file)));
    }

    /// The node's devices.
    pub fn devices(&self) -> &Arc<DeviceManager> {
        &self.shared.config.devices
    }

    /// Fault injection, for tests of the level re-check: the next `count` wake-ups of
    /// alloc `name`'s worker are dropped whole, as a bug that forgot one would drop it;
    /// the tick's slow full sweep is what then finds the input they announced. False
    /// when no alloc has that name.
    pub fn lose_wake_ups(&self, name: &str, count: u32) -> bool {
        let slots = self.shared.registry.slots();
        let slot = name.parse::<Name>().ok().and_then(|name| slots.get(&name));
        slot.map(|slot| slot.mailbox.lose_wake_ups(count)).is_some()
    }

    /// Everything alloc `name` shows, as one snapshot.
    pub fn view(&self, name: &str) -> Option<Arc<AllocView>> {
        let name: Name = name.parse().ok()?;
        self.shared.registry.slots().get(&name).map(AllocSlot::view)
    }

    /// The published status of alloc `name`.
    pub fn status(&self, name: &str) -> Option<Arc<AllocStatus>> {
        self.view(name)?.status()
    }

    /// The status document of alloc `name`: its published status with the spec's file.
    pub fn full_status(&self, name: &str) -> Option<Arc<AllocStatus>> {
        self.view(name)?.full_status()
    }

    /// The driver handles of alloc `name`'s started tasks, as last published.
    pub fn task_handles(&self, name: &str) -> Option<Arc<BTreeMap<Name, TaskHandle>>> {
        Some(self.view(name)?.handles.clone())
    }

    /// The `cpu` (MHz) and `memoryMB` that running tasks of every alloc reserve,
    /// summed.
    pub fn reserved(&self) -> (u64, u64) {
        self.shared
            .registry
            .slots()
            .values()
            .map(|slot| slot.view().facts)
            .fold((0, 0), |(cpu, memory), facts| {
                (
                    cpu + facts.reserved_cpu_mhz,
                    memory + facts.reserved_memory_mb,
                )
            })
    }

    /// Every published status, by name.
    pub fn statuses(&self) -> Vec<Arc<AllocStatus>> {
        let mut views: Vec<(Name, Arc<AllocView>)> = self
            .shared
            .registry
            .slots()
            .iter()
            .map(|(name, slot)| (name.clone(), slot.view()))
            .collect();
        views.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        views
            .into_iter()
            .filter_map(|(_, view)| view.status())
            .collect()
    }

    /// How many allocs have a worker.
    pub fn alloc_count(&self) -> usize {
        self.shared
            .registry
            .slots()
            .values()
            .filter(|slot| !slot.worker_done)
            .count()
    }

    /// Pending spec updates replaced by newer ones before being applied, over all allocs.
    pub fn coalesced_updates(&self) -> u64 {
        self.shared
            .registry
            .slots()
            .values()
            .map(|slot| slot.mailbox.coalesced())
            .sum()
    }

    /// Inputs waiting in alloc mailboxes, over all allocs.
    pub fn queue_depth(&self) -> usize {
        self.shared
            .registry
            .slots()
            .values()
            .map(|slot| slot.mailbox.depth())
            .sum()
    }

    /// The levels `/metrics` shows, read now, with a series set per task of every alloc
    /// but those removed and over. Blocking: each task with a cgroup has two or three of
    /// its control files read (no process is scanned), so a scrape costs a few small
    /// reads per running task and nothing per event.
    pub fn metrics_levels(&self) -> NodeLevels {
        // Read from the views as they are: no status is cloned for it.
        let mut allocs_by_status = [0; CLIENT_STATUSES.len()];
        let mut tasks = Vec::new();
        for slot in self.shared.registry.slots().values() {
            let view = slot.view();
            let Some(status) = &view.status else { continue };
            if let Some(i) = CLIENT_STATUSES
                .iter()
                .position(|s| *s == status.client_status)
            {
                allocs_by_status[i] += 1;
            }
            // A removed alloc that is over shows no series, though it stays listed
            // until garbage collection destroys it.
            if view.facts.collectable {
                continue;
            }
            for (task, shown) in &status.tasks {
                let cgroup = view
                    .handles
                    .iter()
                    .find(|(name, _)| name.as_str() == task)
                    .and_then(|(_, handle)| {
                        self.shared
                            .context
                            .drivers
                            .get(handle.driver)?
                            .cgroup_counters(handle)
                    });
                tasks.push(TaskLevels {
                    alloc: status.name.clone(),
                    task: task.clone(),
                    state: shown.state.clone(),
                    restarts: shown.restarts,
                    oom_kills: shown.oom_kills,
                    cgroup,
                    checks: shown
                        .checks
                        .iter()
                        .map(|check| (check.name.clone(), check.status.clone()))
                        .collect(),
                });
            }
        }
        tasks.sort_by(|a, b| (&a.alloc, &a.task).cmp(&(&b.alloc, &b.task)));
        NodeLevels {
            queue_depth: self.queue_depth(),
            allocs_by_status,
            store: self.store_metrics(),
            store_write_errors: self.store_errors(),
            tasks,
        }
    }

    /// What the store did since it was opened.
    pub fn store_metrics(&self) -> store::StoreMetrics {
        self.shared.context.writer.store().metrics()
    }

    /// The node's clock.
    pub fn clock(&self) -> Clock {
        self.shared.context.clock
    }

    /// Store writes that failed.
    pub fn store_errors(&self) -> u64 {
        self.shared.registry.store_failures.load(Ordering::Relaxed)
    }

    /// Whether the node's shutdown (detach or drain) has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.shared.registry.shutting_down.load(Ordering::Relaxed)
    }

    /// Failed store writes and the allocs whose records are behind.
    pub fn store_health(&self) -> StoreHealthReport {
        let mut behind: Vec<String> = self
            .shared
            .registry
            .slots()
            .iter()
            .filter(|(_, slot)| slot.view().store_behind)
            .map(|(name, _)| name.to_string())
            .collect();
        behind.sort_unstable();
        StoreHealthReport {
            failures: self.store_errors(),
            behind,
            lost: self
                .conditions()
                .store_lost
                .iter()
                .cloned()
                .chain(self.unrecorded_runs_left().into_iter().map(|run| {
                    format!("a task no record names runs, waiting for its task's start to reattach it: {run}")
                }))
                .collect(),
        }
    }

    /// Whether an alloc named `name` is claimed: the node holds one, a run of one that
    /// no record names waits, or the specs dir declares one (even invalid); its alloc
    /// dirs are then the alloc's to remove, not garbage collection's. `None` while that
    /// cannot be told: no complete listing of the specs dir yet, or one of its entries
    /// cannot be read.
    pub fn claims_alloc_name(&self, name: &str) -> Option<bool> {
        let declared = self.conditions().declared.as_ref()?.contains(name);
        let held = name
            .parse::<Name>()
            .is_ok_and(|name| self.shared.registry.slots().contains_key(&name));
        Some(declared || held || self.shared.context.unrecorded.holds_alloc(name))
    }

    /// Sets the alloc names the specs dir declares (valid or not), or `None` when a
    /// listing could not read every entry.
    pub fn set_declared_allocs(&self, names: Option<std::collections::BTreeSet<String>>) {
        self.conditions().declared = names;
    }

    /// Forgets the runs no record names whose process is gone; the ones left, described.
    /// A run without a pid (a driver that names none) cannot be seen gone, so it stays
    /// for its start to take: reading the node's health must not lose it (simulator
    /// seed 22).
    pub fn unrecorded_runs_left(&self) -> Vec<String> {
        self.shared.context.unrecorded.left(|handle| {
            handle
                .pid
                .is_none_or(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
        })
    }

    fn conditions(&self) -> std::sync::MutexGuard<'_, Conditions> {
        self.shared
            .conditions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Says what the store was found to have lost; the store reports degraded from then on.
    pub fn report_store_loss(&self, what: impl Into<String>) {
        self.conditions().store_lost.push(what.into());
    }

    /// Sets the specs dir's entries that cannot be read now (each `<path>: <why>`); the
    /// source reports degraded while there is one.
    pub fn set_source_unreadable(&self, entries: Vec<String>) {
        self.conditions().source = entries;
    }

    /// Sets the fleet source's state (it has one from then on): `Some(why)` while it is
    /// degraded.
    pub fn set_fleet_health(&self, degraded: Option<String>) {
        self.conditions().fleet = Some(degraded);
    }

    /// The fleet source's state: `None` without one, else why it is degraded, if it is.
    pub fn fleet_health(&self) -> Option<Option<String>> {
        self.conditions().fleet.clone()
    }

    /// Changes whenever an alloc publishes a status: to wait on for a change of any.
    pub fn status_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.shared.registry.version.subscribe()
    }

    /// The specs dir's entries that could not be read at the last listing.
    pub fn source_unreadable(&self) -> Vec<String> {
        self.conditions().source.clone()
    }

    /// Waits until `condition` holds for the node, re-checking whenever a status is
    /// published; false when `deadline` passes first.
    pub async fn wait_until(
        &self,
        deadline: Duration,
        mut condition: impl FnMut(&Node) -> bool,
    ) -> bool {
        let mut version = self.shared.registry.version.subscribe();
        let wait = async {
            loop {
                if condition(self) {
                    return;
                }
                if version.changed().await.is_err() {
                    return;
                }
            }
        };
        tokio::time::timeout(deadline, wait).await.is_ok() && condition(self)
    }

    /// Leaves: with `Detach` the tasks keep running for the next agent; with `Drain`
    /// every alloc is stopped, all in parallel. Returns when every worker is done. A
    /// second call made while the first is still awaited returns when the first's
    /// workers are done; its `Drain` reaches only workers that have not left by then
    /// (a detach already taken is not undone). Dropping the first call's future leaves
    /// its workers in the registry, so a later call would wait for ever: the agent only
    /// drops it on its way out.
    ///
    /// Each worker stays in the registry until it is done, so the node's wake-ups (the
    /// ticker, a driver's or a device's change of health) still reach it: a drain may
    /// wait on one, say a poststop task held back by an unhealthy driver. Its slot stays
    /// after that, so the last status it published is still shown.
    pub async fn shutdown(&self, how: Shutdown) {
        let mut version = self.shared.registry.version.subscribe();
        let joins: Vec<(Name, JoinHandle<()>)> = {
            let mut slots = self.shared.registry.slots_mut();
            self.shared
                .registry
                .shutting_down
                .store(true, Ordering::Relaxed);
            let mut joins = Vec::with_capacity(slots.len());
            for (name, slot) in slots.iter_mut() {
                slot.mailbox.shutdown(how);
                if let Some(join) = slot.join.take() {
                    joins.push((name.clone(), join));
                }
            }
            joins
        };
        for (name, join) in joins {
            // A worker that panicked has nothing left to stop.
            let _ = join.await;
            // Its last view stays: the API serves what the shutdown left to the end.
            if let Some(slot) = self.shared.registry.slots_mut().get_mut(&name) {
                slot.worker_done = true;
            }
            self.shared.registry.changed();
        }
        // A drain stops what runs for allocs the node does not hold: runs no record
        // names and no spec claimed.
        if how == Shutdown::Drain {
            let mut stops = tokio::task::JoinSet::new();
            for handle in self.shared.context.unrecorded.take_all() {
                if let Some(driver) = self.shared.context.drivers.get(handle.driver) {
                    stops.spawn(crate::alloc::stop_unrecorded(driver, handle));
                }
            }
            while stops.join_next().await.is_some() {}
        }
        // Workers an earlier call awaits: done when every slot's worker is.
        while self.alloc_count() > 0 {
            if version.changed().await.is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_full_sweep_comes_every_ten_ticks_and_never_less_than_a_minute_apart() {
        for (tick, every) in [
            (Duration::from_secs(10), 10),
            (Duration::from_secs(60), 10),
            (Duration::from_secs(6), 10),
            (Duration::from_secs(5), 12),
            (Duration::from_secs(1), 60),
            (Duration::from_millis(100), 600),
            (Duration::from_millis(7), 8572),
        ] {
            assert_eq!(sweep_every(tick), every, "tick {tick:?}");
            assert!(
                tick * sweep_every(tick) >= SWEEP_PERIOD_MIN,
                "tick {tick:?}"
            );
        }
    }
}
