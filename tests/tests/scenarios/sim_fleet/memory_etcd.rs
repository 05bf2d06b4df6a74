//! An in-memory etcd behind the fleet's [`DesiredKv`] seam, for the fleet simulator: one
//! global revision, every version of every key kept (so that the simulator can read the
//! state at any revision), a compaction point, watches that deliver events from their
//! start revision in order with progress notices, and disconnects.
//!
//! What it keeps of etcd's behaviour:
//! - each put, delete (of a present key) or transaction is one revision; a delete's event
//!   carries the deletion's revision as its `mod_revision`;
//! - a listing reads the state at a revision (the newest by default) and names the
//!   store's newest revision in its header; below the compacted revision it fails;
//! - a watch answers its creation first (the header naming the store's revision then),
//!   then the events from its start revision on, a few revisions per message and never
//!   one revision split over two; a progress notice names a revision once every event up
//!   to it has been delivered;
//! - a watch with events still to deliver from at or below the compacted revision is
//!   answered compacted, then ends (etcd answers so below the compacted revision, and at
//!   it may have dropped a deletion's tombstone: the fake asks for the stricter);
//! - a disconnect fails or ends every open watch; while disconnected, every request
//!   fails at once or never answers (the caller's timeout ends it), and so does one whose
//!   connection was cut while it was in flight;
//! - every request and every watch message takes a few milliseconds, so that the
//!   simulator's steps fall between a request and its answer.
//!
//! The watch is pulled: events are taken from the log when the watcher asks, so one that
//! reads late may find its next revision compacted, as a slow watcher does in etcd.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use etcd_client::EventType;
use stead_controller::fleet::{
    DesiredKv, DesiredWatch, KeyListing, KeyValue, WatchEvent, WatchMessage,
};
use tokio::sync::watch;

/// How requests behave while the store is out of reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outage {
    /// They fail at once (connection refused).
    Refuse,
    /// They never answer (a partition).
    Hang,
}

/// How an open watch ends when the simulator ends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    /// The stream fails.
    Fail,
    /// The stream ends.
    End,
    /// etcd cancels the watch.
    Cancel,
}

/// The in-memory etcd; clones share one store.
#[derive(Clone)]
pub(super) struct MemoryEtcd {
    inner: Arc<Inner>,
}

struct Inner {
    state: Mutex<State>,
    /// Bumped at every change, waking the watches.
    changed: watch::Sender<u64>,
}

/// One version of a key: its revision and value (`None`: deleted).
type Version = (i64, Option<Vec<u8>>);

struct State {
    revision: i64,
    compacted: i64,
    versions: BTreeMap<Vec<u8>, Vec<Version>>,
    /// Every change, in revision order.
    log: Vec<WatchEvent>,
    outage: Option<Outage>,
    /// Bumped at every disconnect: a request that began on an older one is lost.
    connection: u64,
    watches: BTreeMap<u64, Slot>,
    next_watch: u64,
    /// Draws how many revisions one watch message carries.
    rng: fastrand::Rng,
}

/// What the store holds for one open watch.
#[derive(Default)]
struct Slot {
    /// How it is to end, at its next read.
    ending: Option<Ending>,
    /// A progress notice owed once every event up to this revision is delivered.
    progress: Option<i64>,
}

impl MemoryEtcd {
    /// An empty store at revision 1 (etcd's first), its message batching seeded.
    pub(super) fn new(seed: u64) -> Self {
        let (changed, _) = watch::channel(0);
        MemoryEtcd {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    revision: 1,
                    compacted: 0,
                    versions: BTreeMap::new(),
                    log: Vec::new(),
                    outage: None,
                    connection: 0,
                    watches: BTreeMap::new(),
                    next_watch: 0,
                    rng: fastrand::Rng::with_seed(seed),
                }),
                changed,
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().expect("the store's lock")
    }

    fn wake(&self) {
        self.inner.changed.send_modify(|n| *n += 1);
    }

    /// Writes every `(key, value)` (`None` deletes) in one transaction; the revision
    /// after it. A transaction that changes nothing (deletes of absent keys) takes no
    /// revision.
    pub(super) fn txn(&self, writes: &[(&str, Option<&[u8]>)]) -> i64 {
        let mut state = self.state();
        let revision = state.revision + 1;
        let mut events = Vec::new();
        for (key, value) in writes {
            let present = state
                .versions
                .get(key.as_bytes())
                .and_then(|versions| versions.last())
                .is_some_and(|(_, value)| value.is_some());
            if value.is_none() && !present {
                continue;
            }
            state
                .versions
                .entry(key.as_bytes().to_vec())
                .or_default()
                .push((revision, value.map(<[u8]>::to_vec)));
            events.push(WatchEvent {
                kind: match value {
                    Some(_) => EventType::Put,
                    None => EventType::Delete,
                },
                kv: KeyValue {
                    key: key.as_bytes().to_vec(),
                    value: value.map(<[u8]>::to_vec).unwrap_or_default(),
                },
                mod_revision: revision,
            });
        }
        if !events.is_empty() {
            state.revision = revision;
            state.log.extend(events);
        }
        let revision = state.revision;
        drop(state);
        self.wake();
        revision
    }

    /// Compacts history up to `revision` (clamped to the newest); the compacted
    /// revision after it.
    pub(super) fn compact(&self, revision: i64) -> i64 {
        let mut state = self.state();
        state.compacted = state.compacted.max(revision.min(state.revision));
        let compacted = state.compacted;
        drop(state);
        self.wake();
        compacted
    }

    /// The newest revision.
    pub(super) fn revision(&self) -> i64 {
        self.state().revision
    }

    /// The compacted revision (0: none).
    pub(super) fn compacted(&self) -> i64 {
        self.state().compacted
    }

    /// Every key present at `revision` with its value, compacted or not (the
    /// simulator's view, not a client's).
    pub(super) fn state_at(&self, revision: i64) -> BTreeMap<Vec<u8>, Vec<u8>> {
        self.state().read_at(revision)
    }

    /// Cuts the store off: every open watch ends as `ending` says (`Fail` or `End`), and
    /// requests behave as `outage` says until [`MemoryEtcd::reconnect`].
    pub(super) fn disconnect(&self, outage: Outage, ending: Ending) {
        let mut state = self.state();
        state.outage = Some(outage);
        state.connection += 1;
        for slot in state.watches.values_mut() {
            slot.ending.get_or_insert(ending);
        }
        drop(state);
        self.wake();
    }

    /// Whether the store is out of reach.
    pub(super) fn outage(&self) -> Option<Outage> {
        self.state().outage
    }

    /// Makes the store reachable again (requests that hang keep hanging).
    pub(super) fn reconnect(&self) {
        self.state().outage = None;
        self.wake();
    }

    /// Ends every open watch as `ending` says; how many there were.
    pub(super) fn end_watches(&self, ending: Ending) -> usize {
        let mut state = self.state();
        for slot in state.watches.values_mut() {
            slot.ending.get_or_insert(ending);
        }
        let open = state.watches.len();
        drop(state);
        self.wake();
        open
    }

    /// Owes every open watch a progress notice at the newest revision, as etcd's
    /// periodic notification does; how many there were.
    pub(super) fn request_progress(&self) -> usize {
        let mut state = self.state();
        let revision = state.revision;
        for slot in state.watches.values_mut() {
            slot.progress.get_or_insert(revision);
        }
        let open = state.watches.len();
        drop(state);
        self.wake();
        open
    }

    /// The request's answer while disconnected: an error, or never.
    async fn reach(&self) -> Result<(), etcd_client::Error> {
        let outage = self.state().outage;
        match outage {
            None => Ok(()),
            Some(Outage::Refuse) => Err(unavailable()),
            Some(Outage::Hang) => std::future::pending().await,
        }
    }

    /// A few milliseconds of the network's, drawn from the store's seed.
    async fn latency(&self) {
        let ms = self.state().rng.u64(0..=3);
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }

    /// Runs `serve` as a request: on a connection, after a delay, its answer delayed
    /// again; lost (failed or never answered, as the outage says) when the connection
    /// was cut meanwhile.
    async fn request<T>(
        &self,
        serve: impl FnOnce(&mut State) -> Result<T, etcd_client::Error>,
    ) -> Result<T, etcd_client::Error> {
        self.reach().await?;
        let connection = self.state().connection;
        self.latency().await;
        let answer = {
            let mut state = self.state();
            match state.connection == connection {
                true => Some(serve(&mut state)),
                false => None,
            }
        };
        self.latency().await;
        let cut = self.state().connection != connection;
        match answer {
            Some(answer) if !cut => answer,
            _ => {
                self.reach().await?;
                Err(unavailable())
            }
        }
    }
}

fn unavailable() -> etcd_client::Error {
    etcd_client::Error::GRpcStatus(tonic::Status::unavailable(
        "the in-memory etcd is disconnected",
    ))
}

impl State {
    fn read_at(&self, revision: i64) -> BTreeMap<Vec<u8>, Vec<u8>> {
        self.versions
            .iter()
            .filter_map(|(key, versions)| {
                let (_, value) = versions.iter().rev().find(|(at, _)| *at <= revision)?;
                Some((key.clone(), value.clone()?))
            })
            .collect()
    }
}

impl DesiredKv for MemoryEtcd {
    type Watch = MemoryWatch;

    async fn list(
        &self,
        prefix: &str,
        revision: Option<i64>,
    ) -> Result<KeyListing, etcd_client::Error> {
        self.request(|state| {
            let at = revision.filter(|r| *r > 0).unwrap_or(state.revision);
            if at < state.compacted {
                return Err(etcd_client::Error::GRpcStatus(tonic::Status::out_of_range(
                    "etcdserver: mvcc: required revision has been compacted",
                )));
            }
            if at > state.revision {
                return Err(etcd_client::Error::GRpcStatus(tonic::Status::out_of_range(
                    "etcdserver: mvcc: required revision is a future revision",
                )));
            }
            let kvs = state
                .read_at(at)
                .into_iter()
                .filter(|(key, _)| key.starts_with(prefix.as_bytes()))
                .map(|(key, value)| KeyValue { key, value })
                .collect();
            Ok(KeyListing {
                revision: state.revision,
                kvs,
            })
        })
        .await
    }

    async fn watch(
        &self,
        prefix: &str,
        start_revision: i64,
    ) -> Result<MemoryWatch, etcd_client::Error> {
        let changes = self.inner.changed.subscribe();
        self.request(|state| {
            let id = state.next_watch;
            state.next_watch += 1;
            state.watches.insert(id, Slot::default());
            let created = state.revision;
            Ok(MemoryWatch {
                etcd: self.clone(),
                id,
                prefix: prefix.as_bytes().to_vec(),
                cursor: match start_revision {
                    0 => created + 1,
                    start => start,
                },
                created: Some(created),
                changes,
                done: false,
            })
        })
        .await
    }
}

/// One open watch of the in-memory etcd.
pub(super) struct MemoryWatch {
    etcd: MemoryEtcd,
    id: u64,
    prefix: Vec<u8>,
    /// The next revision to deliver.
    cursor: i64,
    /// The creation's answer, until delivered.
    created: Option<i64>,
    changes: watch::Receiver<u64>,
    /// Ended: every read answers the end.
    done: bool,
}

impl MemoryWatch {
    /// The next answer, if there is one now.
    fn poll_once(&mut self) -> Option<Result<Option<WatchMessage>, etcd_client::Error>> {
        if self.done {
            return Some(Ok(None));
        }
        let etcd = self.etcd.clone();
        let mut state = etcd.state();
        let state = &mut *state;
        let slot = state.watches.get_mut(&self.id)?;
        if let Some(ending) = slot.ending.take() {
            self.done = true;
            return Some(match ending {
                Ending::Fail => Err(unavailable()),
                Ending::End => Ok(None),
                Ending::Cancel => Ok(Some(WatchMessage::Canceled {
                    reason: "the in-memory etcd dropped the watch".to_owned(),
                })),
            });
        }
        if let Some(revision) = self.created.take() {
            return Some(Ok(Some(WatchMessage::Created { revision })));
        }
        if self.cursor <= state.revision && self.cursor <= state.compacted {
            self.done = true;
            return Some(Ok(Some(WatchMessage::Compacted {
                revision: state.compacted,
            })));
        }
        loop {
            // Events up to a progress notice owed come before it.
            let limit = slot.progress.unwrap_or(state.revision);
            if self.cursor > limit {
                return slot
                    .progress
                    .take()
                    .map(|revision| Ok(Some(WatchMessage::Progress { revision })));
            }
            let revisions = state.rng.i64(1..=3);
            let last = (self.cursor + revisions - 1).min(limit);
            let from = state.log.partition_point(|e| e.mod_revision < self.cursor);
            let events: Vec<WatchEvent> = state.log[from..]
                .iter()
                .take_while(|e| e.mod_revision <= last)
                .filter(|e| e.kv.key.starts_with(&self.prefix))
                .cloned()
                .collect();
            self.cursor = last + 1;
            if !events.is_empty() {
                return Some(Ok(Some(WatchMessage::Events(events))));
            }
        }
    }
}

impl DesiredWatch for MemoryWatch {
    async fn message(&mut self) -> Result<Option<WatchMessage>, etcd_client::Error> {
        loop {
            self.changes.borrow_and_update();
            if let Some(answer) = self.poll_once() {
                return answer;
            }
            if self.changes.changed().await.is_err() {
                return Ok(None);
            }
            self.etcd.latency().await;
        }
    }
}

impl Drop for MemoryWatch {
    fn drop(&mut self) {
        self.etcd.state().watches.remove(&self.id);
    }
}
