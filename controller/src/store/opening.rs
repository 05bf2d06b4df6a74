//! A store still being created: on a brand-new data dir, the agent starts its first
//! tasks before RocksDB creates its files, instead of after.
//!
//! Creating a RocksDB database costs tens of milliseconds (a dozen files synced, the
//! options written and read back), which an agent on a new node would otherwise spend
//! before its first task starts. The agent begins it once the first listing's task
//! starts are answered (or a second later at most), so that its CPU is not taken from
//! them either. An [`OpeningStore`] is used only when the data dir holds
//! no database yet, so there is nothing to restore: it keeps the latest record (or
//! deletion) of each alloc in memory until the database is open, then writes them through
//! in one go and from then on passes every call straight on.
//!
//! Nothing the agent says outside is at risk: it serves its API and tells systemd it is
//! ready only once the database is open, and a shutdown waits for it. A crash before that
//! moment leaves the first tasks running with no record of them; the next agent finds no
//! records, applies the specs again, and each exec start first stops the run an earlier
//! agent left in the same task dir before it starts a new one. Those tasks therefore start
//! again once, as a start in flight at a crash does. Alloc ids derive from the revision,
//! so this holds for a spec left as it was; one edited before the next agent starts leaves
//! its old run in a dir no record names. Should the database fail to be created, the
//! agent stops the tasks it started and exits.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use stead_schemas::record::AllocRecord;
use stead_schemas::spec::Name;

use super::{CorruptRecord, Store, StoreError, StoreMetrics};

/// Where the database is.
enum Phase<S> {
    /// Being created; the latest write of each alloc: a record, or `None` for a deletion.
    Opening(BTreeMap<Name, Option<AllocRecord>>),
    /// Open: every call goes to it.
    Open(Arc<S>),
    /// Creating it failed, with why; writes fail from now on.
    Failed(String),
}

struct Shared<S> {
    phase: Mutex<Phase<S>>,
    settled: Condvar,
}

/// Receives the outcome of an [`OpeningStore`]'s open.
pub type Opened<E> = tokio::sync::oneshot::Receiver<Result<(), OpeningError<E>>>;

/// A [`Store`] whose database is opened on a thread of its own; see the module docs.
pub struct OpeningStore<S> {
    shared: Arc<Shared<S>>,
}

/// The database of an [`OpeningStore`] could not be opened, or taking the writes made
/// meanwhile failed.
#[derive(Debug, thiserror::Error)]
pub enum OpeningError<E: std::error::Error + 'static> {
    /// Opening failed.
    #[error(transparent)]
    Open(E),
    /// The database opened, but a write held while it opened failed.
    #[error("writing the records held while the store opened")]
    Flush(#[source] StoreError),
}

impl<S: Store> OpeningStore<S> {
    /// Starts `open` on a thread of its own and returns the store at once, with a receiver
    /// of the outcome (sent once the held writes are in the database, or on failure).
    pub fn open_in_background<E>(
        open: impl FnOnce() -> Result<S, E> + Send + 'static,
    ) -> std::io::Result<(Self, Opened<E>)>
    where
        E: std::error::Error + Send + 'static,
    {
        let shared = Arc::new(Shared {
            phase: Mutex::new(Phase::Opening(BTreeMap::new())),
            settled: Condvar::new(),
        });
        let (tx, rx) = tokio::sync::oneshot::channel();
        let opener = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("stead-store-open".to_owned())
            .spawn(move || {
                let outcome = match open() {
                    Ok(store) => opener.take_over(store),
                    Err(error) => {
                        opener.fail(error.to_string());
                        Err(OpeningError::Open(error))
                    }
                };
                // Let go of the store before telling: whoever hears the outcome and drops
                // its own handle has the database closed (its lock released).
                drop(opener);
                let _ = tx.send(outcome);
            })?;
        Ok((OpeningStore { shared }, rx))
    }

    /// Blocks until the database is open or failed to.
    #[cfg(test)]
    fn wait_settled(&self) {
        let mut phase = self.shared.lock();
        while matches!(*phase, Phase::Opening(_)) {
            phase = self
                .shared
                .settled
                .wait(phase)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The open store, once it is.
    fn open_store(&self) -> Option<Arc<S>> {
        match &*self.shared.lock() {
            Phase::Open(store) => Some(Arc::clone(store)),
            _ => None,
        }
    }
}

impl<S> Shared<S> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Phase<S>> {
        self.phase.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Writes the held records into `store` and makes it the store. Writes go out in
    /// rounds without the lock, so callers never wait on the disk; a write made during a
    /// round is held for the next, so none overtakes an older write of its alloc. The
    /// store takes over once a round finds nothing held.
    fn take_over<E: std::error::Error + 'static>(&self, store: S) -> Result<(), OpeningError<E>>
    where
        S: Store,
    {
        loop {
            let held = {
                let mut phase = self.lock();
                match &mut *phase {
                    Phase::Opening(held) if held.is_empty() => {
                        *phase = Phase::Open(Arc::new(store));
                        self.settled.notify_all();
                        return Ok(());
                    }
                    Phase::Opening(held) => std::mem::take(held),
                    Phase::Open(_) | Phase::Failed(_) => {
                        unreachable!("only the opener leaves the opening phase")
                    }
                }
            };
            for (name, write) in held {
                let written = match write {
                    Some(record) => store.put_alloc(&record),
                    None => store.delete_alloc(&name),
                };
                if let Err(error) = written {
                    let error = OpeningError::Flush(error);
                    self.fail(crate::alloc::error_chain(&error));
                    return Err(error);
                }
            }
        }
    }

    fn fail(&self, why: String) {
        *self.lock() = Phase::Failed(why);
        self.settled.notify_all();
    }
}

/// Why a write was refused after the database failed to open.
#[derive(Debug, thiserror::Error)]
#[error("the store could not be created: {0}")]
struct NotCreated(String);

impl<S: Store> Store for OpeningStore<S> {
    fn put_alloc(&self, record: &AllocRecord) -> Result<(), StoreError> {
        let store = {
            let mut phase = self.shared.lock();
            match &mut *phase {
                Phase::Opening(held) => {
                    held.insert(record.name.clone(), Some(record.clone()));
                    return Ok(());
                }
                Phase::Open(store) => Arc::clone(store),
                Phase::Failed(why) => {
                    return Err(StoreError::Write {
                        name: record.name.clone(),
                        source: Box::new(NotCreated(why.clone())),
                    });
                }
            }
        };
        store.put_alloc(record)
    }

    fn delete_alloc(&self, name: &Name) -> Result<(), StoreError> {
        let store = {
            let mut phase = self.shared.lock();
            match &mut *phase {
                Phase::Opening(held) => {
                    held.insert(name.clone(), None);
                    return Ok(());
                }
                Phase::Open(store) => Arc::clone(store),
                Phase::Failed(why) => {
                    return Err(StoreError::Delete {
                        name: name.clone(),
                        source: Box::new(NotCreated(why.clone())),
                    });
                }
            }
        };
        store.delete_alloc(name)
    }

    /// While opening, the held records: the database is new, so they are all there is.
    fn load_allocs(&self) -> Result<Vec<Result<AllocRecord, CorruptRecord>>, StoreError> {
        let store = {
            let phase = self.shared.lock();
            match &*phase {
                Phase::Opening(held) => {
                    return Ok(held.values().flatten().cloned().map(Ok).collect());
                }
                Phase::Open(store) => Arc::clone(store),
                Phase::Failed(why) => {
                    return Err(StoreError::Load {
                        source: Box::new(NotCreated(why.clone())),
                    });
                }
            }
        };
        store.load_allocs()
    }

    /// While opening, nothing has been written yet.
    fn metrics(&self) -> StoreMetrics {
        self.open_store()
            .map(|store| store.metrics())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;
    use crate::store::conformance::{self, PlantRaw};
    use crate::store::{MemoryStore, RocksDbOptions, RocksDbStore};

    fn name(text: &str) -> Name {
        text.parse().expect("name")
    }

    /// An opening store over `inner` whose open waits for the returned sender.
    fn gated(
        inner: MemoryStore,
    ) -> (
        OpeningStore<MemoryStore>,
        mpsc::Sender<()>,
        Opened<std::io::Error>,
    ) {
        let (release, gate) = mpsc::channel::<()>();
        let (store, outcome) = OpeningStore::open_in_background(move || {
            gate.recv().map_err(std::io::Error::other)?;
            Ok::<_, std::io::Error>(inner)
        })
        .expect("thread");
        (store, release, outcome)
    }

    #[test]
    fn writes_while_opening_are_held_and_only_the_latest_of_each_alloc_reaches_the_database() {
        let inner = MemoryStore::default();
        let (store, release, outcome) = gated(inner.clone());
        let (a1, a2, b) = (
            conformance::sample_record("a", 1),
            conformance::sample_record("a", 2),
            conformance::sample_record("b", 1),
        );
        store.put_alloc(&a1).expect("held");
        store.put_alloc(&a2).expect("held");
        store.put_alloc(&b).expect("held");
        store.delete_alloc(&name("b")).expect("held");
        store.delete_alloc(&name("never")).expect("held");
        // Nothing reached the database yet, and the store answers from what it holds.
        assert!(inner.load_allocs().expect("loads").is_empty());
        let held = conformance::load_ok(&store, "held");
        assert_eq!(held, std::slice::from_ref(&a2));
        assert_eq!(store.metrics(), StoreMetrics::default());

        release.send(()).expect("released");
        outcome.blocking_recv().expect("sent").expect("opened");
        let stored = conformance::load_ok(&inner, "stored");
        assert_eq!(stored, [a2], "only the latest write of each alloc");
        assert_eq!(inner.metrics().writes, 1);

        // From now on, calls go straight through.
        let a3 = conformance::sample_record("a", 3);
        store.put_alloc(&a3).expect("written");
        store.put_alloc(&b).expect("written");
        store.delete_alloc(&name("a")).expect("deleted");
        let stored = conformance::load_ok(&inner, "stored");
        assert_eq!(stored, [b]);
        assert_eq!(store.metrics(), inner.metrics());
    }

    #[test]
    fn a_failed_open_is_reported_and_fails_every_later_call() {
        let (store, outcome) = OpeningStore::<MemoryStore>::open_in_background(|| {
            Err(std::io::Error::other("disk on fire"))
        })
        .expect("thread");
        let error = outcome.blocking_recv().expect("sent").expect_err("failed");
        assert!(matches!(error, OpeningError::Open(_)), "{error:?}");
        store.wait_settled();
        let refused = store
            .put_alloc(&conformance::sample_record("a", 1))
            .expect_err("refused");
        assert!(
            crate::alloc::error_chain(&refused).contains("disk on fire"),
            "{}",
            crate::alloc::error_chain(&refused)
        );
        assert!(store.delete_alloc(&name("a")).is_err());
        assert!(store.load_allocs().is_err());
    }

    #[test]
    fn a_held_write_that_the_database_refuses_fails_the_open() {
        let inner = MemoryStore::default();
        inner.fail_writes(true);
        let (store, release, outcome) = gated(inner);
        store
            .put_alloc(&conformance::sample_record("a", 1))
            .expect("held");
        release.send(()).expect("released");
        let error = outcome.blocking_recv().expect("sent").expect_err("failed");
        assert!(matches!(error, OpeningError::Flush(_)), "{error:?}");
        assert!(
            store
                .put_alloc(&conformance::sample_record("a", 2))
                .is_err()
        );
    }

    #[test]
    fn a_new_rocksdb_store_opened_in_the_background_keeps_what_was_written_meanwhile() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("state");
        let opened = path.clone();
        let (release, gate) = mpsc::channel::<()>();
        let (store, outcome) = OpeningStore::open_in_background(move || {
            gate.recv().expect("released");
            RocksDbStore::open(&opened, RocksDbOptions::default())
        })
        .expect("thread");
        let record = conformance::sample_record("web", 1);
        store.put_alloc(&record).expect("held");
        assert!(!path.exists(), "the database is not there yet");
        release.send(()).expect("released");
        outcome.blocking_recv().expect("sent").expect("opened");
        drop(store);
        let reopened = RocksDbStore::open(&path, RocksDbOptions::default()).expect("reopens");
        let stored = conformance::load_ok(&reopened, "stored");
        assert_eq!(stored, [record]);
    }

    /// A store whose first write waits for a gate.
    struct SlowFirstWrite {
        inner: MemoryStore,
        gate: Mutex<Option<mpsc::Receiver<()>>>,
        entered: Mutex<Option<mpsc::Sender<()>>>,
    }

    impl Store for SlowFirstWrite {
        fn put_alloc(&self, record: &AllocRecord) -> Result<(), StoreError> {
            if let Some(entered) = self.entered.lock().expect("lock").take() {
                entered.send(()).expect("told");
            }
            if let Some(gate) = self.gate.lock().expect("lock").take() {
                gate.recv().expect("released");
            }
            self.inner.put_alloc(record)
        }
        fn delete_alloc(&self, name: &Name) -> Result<(), StoreError> {
            self.inner.delete_alloc(name)
        }
        fn load_allocs(&self) -> Result<Vec<Result<AllocRecord, CorruptRecord>>, StoreError> {
            self.inner.load_allocs()
        }
        fn metrics(&self) -> StoreMetrics {
            self.inner.metrics()
        }
    }

    #[test]
    fn a_write_made_while_held_records_are_written_waits_for_no_disk_and_lands_after_them() {
        let inner = MemoryStore::default();
        let (release_write, write_gate) = mpsc::channel::<()>();
        let (entered_tx, entered) = mpsc::channel::<()>();
        let slow = SlowFirstWrite {
            inner: inner.clone(),
            gate: Mutex::new(Some(write_gate)),
            entered: Mutex::new(Some(entered_tx)),
        };
        let (release_open, open_gate) = mpsc::channel::<()>();
        let (store, outcome) = OpeningStore::open_in_background(move || {
            open_gate.recv().map_err(std::io::Error::other)?;
            Ok::<_, std::io::Error>(slow)
        })
        .expect("thread");
        store
            .put_alloc(&conformance::sample_record("web", 1))
            .expect("held");
        release_open.send(()).expect("released");
        entered.recv().expect("the held record is being written");

        // The held record's write is stuck on its disk; writes now must not wait for it.
        let (newer, other) = (
            conformance::sample_record("web", 2),
            conformance::sample_record("api", 1),
        );
        let (done_tx, done) = mpsc::channel();
        let writer = OpeningStore {
            shared: Arc::clone(&store.shared),
        };
        let (n, o) = (newer.clone(), other.clone());
        std::thread::spawn(move || {
            let _ = done_tx.send((writer.put_alloc(&n), writer.put_alloc(&o)));
        });
        let (a, b) = done
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("writes made during the flush do not wait for it");
        a.expect("held");
        b.expect("held");
        assert_eq!(
            inner.metrics().writes,
            0,
            "nothing has reached the disk yet"
        );

        release_write.send(()).expect("released");
        outcome.blocking_recv().expect("sent").expect("opened");
        let mut stored = conformance::load_ok(&inner, "stored");
        stored.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(stored, [other, newer], "web's newer write landed last");
    }

    impl<S: PlantRaw> PlantRaw for OpeningStore<S> {
        fn plant_raw(&self, name: &str, bytes: Vec<u8>) {
            self.wait_settled();
            self.open_store().expect("open").plant_raw(name, bytes);
        }
    }

    #[test]
    fn an_opened_store_passes_the_conformance_suite() {
        conformance::run_all(|| {
            let (store, outcome) =
                OpeningStore::open_in_background(
                    || Ok::<_, std::io::Error>(MemoryStore::default()),
                )
                .expect("thread");
            outcome.blocking_recv().expect("sent").expect("opened");
            Box::new(store)
        });
    }
}
