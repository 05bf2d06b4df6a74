//! The node's registry of allocs: one slot per alloc (its mailbox, its worker, the view
//! it last published), and the node-wide facts workers act on.
//!
//! Readers clone a view's `Arc` out and never wait on a worker; a publish swaps a view
//! whole, so one read never pairs one publish's status with another's task handles.
//! Locks are held for a map operation, never across an `.await`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use indexmap::IndexMap;
use stead_schemas::Timestamp;
use stead_schemas::spec::{DriverKind, Name};
use stead_schemas::status::AllocStatus;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::driver::TaskHandle;
use crate::errors::error_chain;
use crate::queue::Mailbox;
use crate::store::StoreError;

/// Everything the node holds of one alloc: its mailbox, its worker and what it last
/// published. Readers clone the view's `Arc` out and never hold a lock across `.await`.
pub(crate) struct AllocSlot {
    pub(crate) mailbox: Mailbox,
    /// The worker's task; taken by the shutdown, which awaits it while the slot stays
    /// (so the worker can still be woken) until the worker is done.
    pub(crate) join: Option<JoinHandle<()>>,
    /// Its worker left at the node's shutdown (the slot stays, showing its last view).
    pub(crate) worker_done: bool,
    /// What the alloc shows, swapped whole: every read sees one publish.
    pub(crate) view: Mutex<Arc<AllocView>>,
}

impl AllocSlot {
    pub(crate) fn view(&self) -> Arc<AllocView> {
        self.view.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the view with `change` applied to a copy of it.
    fn update(&self, change: impl FnOnce(&mut AllocView)) {
        let mut view = self.view.lock().unwrap_or_else(|e| e.into_inner());
        let mut next = AllocView::clone(&view);
        change(&mut next);
        *view = Arc::new(next);
    }
}

/// One alloc as it was last published, with what the node knows of it besides: a
/// snapshot, so that its status, task handles and facts always belong together.
#[derive(Debug, Clone, Default)]
pub struct AllocView {
    /// The status its worker last published (none before its first publish).
    pub status: Option<Arc<AllocStatus>>,
    /// The driver handles of its started tasks, as of that status.
    pub handles: Arc<BTreeMap<Name, TaskHandle>>,
    /// What garbage collection needs to know of it.
    pub facts: AllocFacts,
    /// The diagnostics of its spec, while that spec is broken.
    pub spec_error: Option<Arc<str>>,
    /// The file (or key) its spec was last read from.
    pub spec_file: Option<Arc<str>>,
    /// Whether its latest state is not yet stored (its writes are being retried).
    pub store_behind: bool,
}

impl AllocView {
    /// The status, with the spec error shown on it.
    pub fn status(&self) -> Option<Arc<AllocStatus>> {
        let status = self.status.as_ref()?;
        Some(match &self.spec_error {
            Some(error) => Arc::new(AllocStatus {
                spec_error: Some(error.to_string()),
                ..AllocStatus::clone(status)
            }),
            None => status.clone(),
        })
    }

    /// The status as one alloc's document shows it: with the spec error and the
    /// spec's file (a copy when there is a file; lists leave the file out).
    pub fn full_status(&self) -> Option<Arc<AllocStatus>> {
        let status = self.status()?;
        let Some(file) = &self.spec_file else {
            return Some(status);
        };
        Some(Arc::new(AllocStatus {
            spec_file: Some(file.to_string()),
            ..AllocStatus::clone(&status)
        }))
    }
}

/// What garbage collection needs to know of an alloc, published with its status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocFacts {
    /// Terminal, nothing in flight, and no spec declares it any more.
    pub collectable: bool,
    /// When its last task finished.
    pub finished_at: Option<Timestamp>,
    /// The `cpu` (MHz) of its running tasks, summed.
    pub reserved_cpu_mhz: u64,
    /// The `memoryMB` of its running tasks, summed.
    pub reserved_memory_mb: u64,
}

/// The node's allocs, one slot each, and the node-wide facts their workers act on.
pub(crate) struct Registry {
    /// One slot per alloc. Adding and removing a slot takes the write lock; a publish
    /// takes the read lock and its slot's own, so workers publish side by side. Kept in
    /// an order the tick can slice by position (a removal moves the last slot into the
    /// gap).
    slots: RwLock<IndexMap<Name, AllocSlot>>,
    /// Set (under the slots' write lock) when the node's shutdown began: no worker is
    /// started or given new input after it, and user commands are refused.
    pub(crate) shutting_down: AtomicBool,
    /// Bumped whenever anything shown changes, for waiters on the node's state.
    pub(crate) version: watch::Sender<u64>,
    /// Store writes that failed since the agent started.
    pub(crate) store_failures: AtomicU64,
    /// Drivers whose last fingerprint was not healthy, with why.
    pub(crate) unavailable_drivers: RwLock<BTreeMap<DriverKind, String>>,
}

impl Registry {
    /// A registry without allocs.
    pub(crate) fn new() -> Self {
        let (version, _) = watch::channel(0);
        Registry {
            slots: RwLock::new(IndexMap::new()),
            shutting_down: AtomicBool::new(false),
            version,
            store_failures: AtomicU64::new(0),
            unavailable_drivers: RwLock::new(BTreeMap::new()),
        }
    }

    /// Tells waiters on the node's state to look again.
    pub(crate) fn changed(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    pub(crate) fn slots(&self) -> RwLockReadGuard<'_, IndexMap<Name, AllocSlot>> {
        self.slots.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn slots_mut(&self) -> RwLockWriteGuard<'_, IndexMap<Name, AllocSlot>> {
        self.slots.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes alloc `name`'s view, when it has a slot, and tells waiters.
    pub(crate) fn update_view(&self, name: &Name, change: impl FnOnce(&mut AllocView)) {
        if let Some(slot) = self.slots().get(name) {
            slot.update(change);
        }
        self.changed();
    }

    /// Publishes an alloc's status snapshot, its tasks' driver handles and its facts,
    /// together.
    pub(crate) fn publish(
        &self,
        name: &Name,
        status: AllocStatus,
        handles: Arc<BTreeMap<Name, TaskHandle>>,
        facts: AllocFacts,
    ) {
        self.update_view(name, |view| {
            view.status = Some(Arc::new(status));
            view.handles = handles;
            view.facts = facts;
        });
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
        tracing::warn!(alloc = %name, error = %error_chain(error), "store write failed");
        self.store_failures.fetch_add(1, Ordering::Relaxed);
        // Waiters on the node's state (`Node::wait_until`) look again.
        self.update_view(name, |view| view.store_behind = true);
    }

    /// The alloc's record is stored again after failed writes.
    pub(crate) fn store_recovered(&self, name: &Name) {
        tracing::info!(alloc = %name, "store write succeeded after retries");
        self.update_view(name, |view| view.store_behind = false);
    }

    /// Wakes every worker: something every alloc reads changed (a driver's or a
    /// device's health).
    pub(crate) fn wake_all(&self) {
        for slot in self.slots().values() {
            slot.mailbox.wake();
        }
    }

    /// One of `slices` slices of the level re-check: the mailboxes of that share of the
    /// slots each learn of the tick (see [`Mailbox::tick`]). The slots' read lock is held
    /// for a few loads per slot of the slice; the others are not touched, so a whole
    /// period reads each slot once.
    pub(crate) fn tick(&self, slice: usize, slices: usize, now: Timestamp, sweep: bool) {
        let slots = self.slots();
        let chunk = slots.len().div_ceil(slices.max(1));
        let start = (slice * chunk).min(slots.len());
        let end = (start + chunk).min(slots.len());
        for (_, slot) in slots.get_range(start..end).into_iter().flatten() {
            slot.mailbox.tick(now, sweep);
        }
    }

    /// A destroyed alloc's worker leaves the registry, unless new input arrived for it
    /// meanwhile (then it carries on); true when it left. Its view goes with it: a
    /// destroyed alloc has no state left to store or show.
    pub(crate) fn retire(&self, name: &Name, mailbox: &Mailbox) -> bool {
        let mut slots = self.slots_mut();
        if mailbox.has_target() {
            return false;
        }
        slots.swap_remove(name);
        drop(slots);
        self.changed();
        true
    }
}
