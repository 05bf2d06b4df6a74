//! The node dispatcher: the registry of allocs and their workers.
//!
//! It owns only the registry. Every input for an alloc goes into that alloc's mailbox,
//! which never blocks, so the dispatcher never waits on a worker; readers get published
//! status snapshots and never wait either. Locks here are held for a map operation,
//! never across an `.await`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use stead_reconcilers::alloc::Limits;
use stead_reconcilers::gc::GcCandidate;
use stead_schemas::spec::{DriverKind, Name, Signal};
use stead_schemas::status::AllocStatus;
use stead_schemas::{Timestamp, ValidSpec};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::alloc::{CommandError, Start, Worker, ask};
use crate::allocdir::AllocDirs;
use crate::clock::Clock;
use crate::devices::DeviceManager;
use crate::driver::{Drivers, RecordedRuns, TaskHandle};
use crate::queue::{Mailbox, Shutdown, Target, UserCommand};
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
        }
    }
}

struct Entry {
    mailbox: Mailbox,
    /// The worker's task; taken by the shutdown, which awaits it while the entry stays
    /// (so the worker can still be woken) until the worker is done.
    join: Option<JoinHandle<()>>,
}

/// What garbage collection needs to know of an alloc, published with its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AllocFacts {
    /// Terminal, nothing in flight, and no spec declares it any more.
    pub(crate) collectable: bool,
    /// When its last task finished.
    pub(crate) finished_at: Option<Timestamp>,
}

/// What workers share with the dispatcher.
pub(crate) struct Shared {
    pub(crate) config: NodeConfig,
    pub(crate) drivers: Drivers,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) clock: Clock,
    /// Where alloc dirs live, when the node has them (sticky disks move between them,
    /// and destroying an alloc removes its own).
    pub(crate) alloc_dirs: Option<AllocDirs>,
    facts: RwLock<HashMap<Name, AllocFacts>>,
    /// The diagnostics of each alloc whose spec is broken now, shown with its status.
    spec_errors: RwLock<HashMap<Name, Arc<str>>>,
    registry: Mutex<HashMap<Name, Entry>>,
    /// Set (under the registry's lock) when the node's shutdown began: no worker is
    /// started or given new input after it, and user commands are refused.
    shutting_down: AtomicBool,
    statuses: RwLock<BTreeMap<Name, Arc<AllocStatus>>>,
    /// The driver handles of each alloc's tasks, published with its status (for stats).
    handles: RwLock<HashMap<Name, Arc<BTreeMap<Name, TaskHandle>>>>,
    version: watch::Sender<u64>,
    store_errors: Mutex<StoreHealth>,
    /// Drivers whose last fingerprint was not healthy, with why.
    unavailable_drivers: RwLock<BTreeMap<DriverKind, String>>,
    /// The first steps of workers and the task starts not yet answered (see
    /// [`Node::settled`]).
    pub(crate) in_flight: InFlight,
}

/// A count of work under way, with a wake-up when it falls to zero: each piece holds an
/// [`InFlightToken`] until it is done (or dropped, whatever the path).
#[derive(Debug, Default)]
pub(crate) struct InFlight(Arc<Counter>);

#[derive(Debug, Default)]
struct Counter {
    held: AtomicUsize,
    idle: tokio::sync::Notify,
}

/// One piece of work counted by an [`InFlight`], until dropped.
#[derive(Debug)]
pub(crate) struct InFlightToken(Arc<Counter>);

impl InFlight {
    /// Counts one more piece of work, until the token is dropped.
    pub(crate) fn token(&self) -> InFlightToken {
        self.0.held.fetch_add(1, Ordering::AcqRel);
        InFlightToken(Arc::clone(&self.0))
    }

    /// Returns once no token is held.
    async fn idle(&self) {
        loop {
            let idle = self.0.idle.notified();
            tokio::pin!(idle);
            // Registered before the count is read, so a drop in between still wakes it.
            idle.as_mut().enable();
            if self.0.held.load(Ordering::Acquire) == 0 {
                return;
            }
            idle.await;
        }
    }
}

impl Drop for InFlightToken {
    fn drop(&mut self) {
        if self.0.held.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Failed store writes: how many so far, and the allocs whose records are behind.
#[derive(Debug, Default)]
struct StoreHealth {
    failures: u64,
    behind: BTreeSet<Name>,
}

/// The state store's health, as `/v1/health` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreHealthReport {
    /// Writes that failed since the agent started.
    pub failures: u64,
    /// Allocs whose latest state is not yet stored (their writes are being retried).
    pub behind: Vec<String>,
}

impl StoreHealthReport {
    /// Whether every alloc's latest state is stored.
    pub fn is_healthy(&self) -> bool {
        self.behind.is_empty()
    }
}

impl Shared {
    fn registry(&self) -> MutexGuard<'_, HashMap<Name, Entry>> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes an alloc's status snapshot and its tasks' driver handles.
    pub(crate) fn publish(
        &self,
        name: &Name,
        status: AllocStatus,
        handles: BTreeMap<Name, TaskHandle>,
        facts: AllocFacts,
    ) {
        self.facts
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.clone(), facts);
        self.handles
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.clone(), Arc::new(handles));
        self.statuses
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.clone(), Arc::new(status));
        self.version.send_modify(|v| *v += 1);
    }

    /// Drivers that cannot start tasks now, with why.
    pub(crate) fn unavailable_drivers(&self) -> BTreeMap<DriverKind, String> {
        self.unavailable_drivers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Counts a failed store write; the worker retries it with backoff.
    pub(crate) fn report_store_error(&self, name: &Name, error: &StoreError) {
        tracing::warn!(alloc = %name, error = %crate::alloc::error_chain(error), "store write failed");
        {
            let mut health = self.store_errors.lock().unwrap_or_else(|e| e.into_inner());
            health.failures += 1;
            health.behind.insert(name.clone());
        }
        // Waiters on the node's state (`Node::wait_until`) look again.
        self.version.send_modify(|v| *v += 1);
    }

    /// The alloc's record is stored again after failed writes.
    pub(crate) fn store_recovered(&self, name: &Name) {
        tracing::info!(alloc = %name, "store write succeeded after retries");
        self.no_longer_behind(name);
        self.version.send_modify(|v| *v += 1);
    }

    /// The alloc's state no longer waits for a store write.
    fn no_longer_behind(&self, name: &Name) {
        self.store_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .behind
            .remove(name);
    }

    /// Wakes every worker for a level re-check.
    fn wake_all(&self) {
        for entry in self.registry().values() {
            entry.mailbox.wake();
        }
    }

    /// A destroyed alloc's worker leaves the registry, unless new input arrived for it
    /// meanwhile (then it carries on); true when it left.
    pub(crate) fn retire(&self, name: &Name, mailbox: &Mailbox) -> bool {
        let mut registry = self.registry();
        if mailbox.has_target() {
            return false;
        }
        registry.remove(name);
        self.statuses
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        self.handles
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        self.facts
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        // A destroyed alloc has no state left to store: it no longer holds the store back.
        self.no_longer_behind(name);
        self.version.send_modify(|v| *v += 1);
        true
    }
}

/// The level re-check: wakes every worker once per tick, until the node is gone. One
/// timer for the node instead of one per alloc keeps an idle node cheap.
async fn tick(shared: std::sync::Weak<Shared>) {
    let Some(period) = shared.upgrade().map(|s| s.config.tick) else {
        return;
    };
    let mut interval = tokio::time::interval(period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval.tick().await;
    loop {
        interval.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        shared.wake_all();
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
        let Some(drivers) = shared.upgrade().map(|s| s.drivers.clone()) else {
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
            shared.wake_all();
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
        shared.wake_all();
        // The node's devices are part of what it shows: waiters look again.
        shared.version.send_modify(|v| *v += 1);
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
        let (version, _) = watch::channel(0);
        let node = Node {
            shared: Arc::new(Shared {
                config,
                drivers,
                store,
                clock,
                alloc_dirs,
                facts: RwLock::new(HashMap::new()),
                spec_errors: RwLock::new(HashMap::new()),
                registry: Mutex::new(HashMap::new()),
                in_flight: InFlight::default(),
                shutting_down: AtomicBool::new(false),
                statuses: RwLock::new(BTreeMap::new()),
                handles: RwLock::new(HashMap::new()),
                version,
                store_errors: Mutex::new(StoreHealth::default()),
                unavailable_drivers: RwLock::new(BTreeMap::new()),
            }),
        };
        tokio::spawn(tick(Arc::downgrade(&node.shared)));
        tokio::spawn(fingerprint_drivers(Arc::downgrade(&node.shared)));
        tokio::spawn(watch_devices(Arc::downgrade(&node.shared)));
        node.shared.config.devices.start(node.shared.clock);
        node
    }

    /// Resumes every alloc in the store: running tasks are reattached, not restarted.
    /// Tasks that no record names (an earlier agent started them and stopped before it
    /// wrote their record) are stopped first, whether or not a spec still declares them.
    pub fn restore(&self) -> Result<RestoreReport, StoreError> {
        let mut report = RestoreReport::default();
        let mut resumed = Vec::new();
        let mut recorded = RecordedRuns::default();
        for loaded in self.shared.store.load_allocs()? {
            let record = match loaded {
                Ok(record) => record,
                Err(corrupt) => {
                    recorded.unreadable.push(corrupt.name.clone());
                    if let Ok(name) = corrupt.name.parse() {
                        report.allocs.push((name, None));
                    }
                    self.restore_broken(&corrupt, None);
                    report.corrupt.push(corrupt);
                    continue;
                }
            };
            recorded.handles.extend(
                record
                    .handles
                    .values()
                    .cloned()
                    .map(store::handle_from_record),
            );
            let name = record.name.clone();
            if record.state.tasks.is_empty() {
                // Nothing of it ever ran: forget it; its spec, if still there, starts it anew.
                tracing::warn!(alloc = %name, "dropping a stored alloc with no task state");
                if let Err(error) = self.shared.store.delete_alloc(&name) {
                    self.shared.report_store_error(&name, &error);
                }
                report.dropped += 1;
                continue;
            }
            let revision = record.revision.clone();
            match store::restore_record(record) {
                Ok(restored) => {
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
                Err(corrupt) => {
                    report
                        .allocs
                        .push((name.clone(), stead_schemas::Revision::from_hex(&revision)));
                    self.restore_broken(&corrupt, Some(revision));
                    report.corrupt.push(corrupt);
                }
            }
        }
        // Before any worker runs, so that no start of this agent can be taken for one the
        // last agent made and never recorded.
        for (_, driver) in self.shared.drivers.iter() {
            driver.stop_unrecorded(&recorded);
        }
        for (name, restored) in resumed {
            self.spawn(
                &mut self.shared.registry(),
                name,
                Start::Restored(Box::new(restored)),
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
        let reason = crate::alloc::error_chain(corrupt);
        self.spawn(
            &mut self.shared.registry(),
            name,
            Start::Broken { reason, revision },
        );
    }

    /// Starts a worker for `name`; the caller holds the registry lock, so a retiring
    /// worker and a new input cannot cross.
    fn spawn(&self, registry: &mut HashMap<Name, Entry>, name: Name, start: Start) {
        let mailbox = Mailbox::default();
        let worker = Worker::new(self.shared.clone(), name.clone(), mailbox.clone(), start);
        let span = tracing::info_span!("alloc", alloc = %name);
        let join = tokio::spawn(tracing::Instrument::instrument(worker.run(), span));
        registry.insert(
            name,
            Entry {
                mailbox,
                join: Some(join),
            },
        );
    }

    /// The mailbox of alloc `name` for a user command, refused once the node shuts down
    /// (its workers only stop or leave then).
    fn mailbox(&self, name: &str) -> Result<Mailbox, CommandError> {
        let registry = self.shared.registry();
        if self.shared.shutting_down.load(Ordering::Relaxed) {
            return Err(CommandError::ShuttingDown {
                name: name.to_owned(),
            });
        }
        name.parse::<Name>()
            .ok()
            .and_then(|name| registry.get(&name))
            .map(|e| e.mailbox.clone())
            .ok_or_else(|| CommandError::UnknownAlloc {
                name: name.to_owned(),
            })
    }

    /// Declares that `spec` should exist: adds the alloc, or updates it (only the newest
    /// update is ever applied). Never waits. Ignored once the node shuts down.
    pub fn apply(&self, spec: ValidSpec) {
        let name = spec.name().clone();
        let target = Target::Spec(Arc::new(spec));
        let mut registry = self.shared.registry();
        if self.shared.shutting_down.load(Ordering::Relaxed) {
            return;
        }
        match registry.get(&name) {
            Some(entry) => entry.mailbox.set_target(target),
            None => self.spawn(&mut registry, name, Start::Fresh(target)),
        }
    }

    /// Returns once every alloc has taken its first step and every task start has been
    /// answered by its driver and the answer published: at once on a node with nothing
    /// to start. A start made later (a restart, a new spec, a task after its prestart
    /// tasks) counts from when it is made. The agent creates a new node's store only
    /// then, so that the creation does not take the CPU from the first task starts.
    pub async fn settled(&self) {
        self.shared.in_flight.idle().await;
    }

    /// Declares that the alloc `name` should no longer exist: it is stopped, then
    /// destroyed. Never waits. Ignored once the node shuts down.
    pub fn remove(&self, name: &Name) {
        let registry = self.shared.registry();
        if self.shared.shutting_down.load(Ordering::Relaxed) {
            return;
        }
        if let Some(entry) = registry.get(name) {
            entry.mailbox.set_target(Target::Absent);
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
            .facts
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(name, facts)| GcCandidate {
                key: name.clone(),
                collectable: facts.collectable,
                finished_at: facts.finished_at,
            })
            .collect()
    }

    /// Records that the spec of alloc `name` is broken (`Some(diagnostics)`) or fine again
    /// (`None`); the alloc's status shows it as `specError`.
    pub fn set_spec_error(&self, name: &Name, error: Option<String>) {
        {
            let mut errors = self
                .shared
                .spec_errors
                .write()
                .unwrap_or_else(|e| e.into_inner());
            match error {
                Some(error) => errors.insert(name.clone(), error.into()),
                None => errors.remove(name),
            };
        }
        self.shared.version.send_modify(|v| *v += 1);
    }

    /// `status` with the alloc's current spec error, if any.
    fn with_spec_error(&self, name: &Name, status: Arc<AllocStatus>) -> Arc<AllocStatus> {
        let errors = self
            .shared
            .spec_errors
            .read()
            .unwrap_or_else(|e| e.into_inner());
        match errors.get(name) {
            Some(error) => Arc::new(AllocStatus {
                spec_error: Some(error.to_string()),
                ..(*status).clone()
            }),
            None => status,
        }
    }

    /// The node's devices.
    pub fn devices(&self) -> &Arc<DeviceManager> {
        &self.shared.config.devices
    }

    /// The published status of alloc `name`.
    pub fn status(&self, name: &str) -> Option<Arc<AllocStatus>> {
        let name: Name = name.parse().ok()?;
        let status = self
            .shared
            .statuses
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&name)
            .cloned()?;
        Some(self.with_spec_error(&name, status))
    }

    /// The driver handles of alloc `name`'s started tasks, as last published.
    pub fn task_handles(&self, name: &str) -> Option<Arc<BTreeMap<Name, TaskHandle>>> {
        let name: Name = name.parse().ok()?;
        self.shared
            .handles
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&name)
            .cloned()
    }

    /// Every published status, by name.
    pub fn statuses(&self) -> Vec<Arc<AllocStatus>> {
        let statuses: Vec<(Name, Arc<AllocStatus>)> = self
            .shared
            .statuses
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(name, status)| (name.clone(), status.clone()))
            .collect();
        statuses
            .into_iter()
            .map(|(name, status)| self.with_spec_error(&name, status))
            .collect()
    }

    /// How many allocs have a worker.
    pub fn alloc_count(&self) -> usize {
        self.shared.registry().len()
    }

    /// Pending spec updates replaced by newer ones before being applied, over all allocs.
    pub fn coalesced_updates(&self) -> u64 {
        self.shared
            .registry()
            .values()
            .map(|e| e.mailbox.coalesced())
            .sum()
    }

    /// Inputs waiting in alloc mailboxes, over all allocs.
    pub fn queue_depth(&self) -> usize {
        self.shared
            .registry()
            .values()
            .map(|e| e.mailbox.depth())
            .sum()
    }

    /// What the store did since it was opened.
    pub fn store_metrics(&self) -> store::StoreMetrics {
        self.shared.store.metrics()
    }

    /// The node's clock.
    pub fn clock(&self) -> Clock {
        self.shared.clock
    }

    /// Store writes that failed.
    pub fn store_errors(&self) -> u64 {
        self.store_health().failures
    }

    /// Whether the node's shutdown (detach or drain) has begun.
    pub fn is_shutting_down(&self) -> bool {
        self.shared.shutting_down.load(Ordering::Relaxed)
    }

    /// Failed store writes and the allocs whose records are behind.
    pub fn store_health(&self) -> StoreHealthReport {
        let health = self
            .shared
            .store_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        StoreHealthReport {
            failures: health.failures,
            behind: health.behind.iter().map(ToString::to_string).collect(),
        }
    }

    /// Waits until `condition` holds for the node, re-checking whenever a status is
    /// published; false when `deadline` passes first.
    pub async fn wait_until(
        &self,
        deadline: Duration,
        mut condition: impl FnMut(&Node) -> bool,
    ) -> bool {
        let mut version = self.shared.version.subscribe();
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
    /// wait on one, say a poststop task held back by an unhealthy driver.
    pub async fn shutdown(&self, how: Shutdown) {
        let mut version = self.shared.version.subscribe();
        let joins: Vec<(Name, JoinHandle<()>)> = {
            let mut registry = self.shared.registry();
            self.shared.shutting_down.store(true, Ordering::Relaxed);
            let mut joins = Vec::with_capacity(registry.len());
            for (name, entry) in registry.iter_mut() {
                entry.mailbox.shutdown(how);
                if let Some(join) = entry.join.take() {
                    joins.push((name.clone(), join));
                }
            }
            joins
        };
        for (name, join) in joins {
            // A worker that panicked has nothing left to stop.
            let _ = join.await;
            self.shared.registry().remove(&name);
            self.shared.version.send_modify(|v| *v += 1);
        }
        // Workers an earlier call awaits: done when they have left the registry.
        while self.alloc_count() > 0 {
            if version.changed().await.is_err() {
                return;
            }
        }
    }
}
