//! The node's one writer of its store: workers hand it their alloc's newest record (or
//! its removal) and await the outcome, so no store IO runs on the async runtime's threads.
//!
//! A store whose calls block on disk ([`Store::blocks`]) is written by the writer's task:
//! it takes every write queued so far, in arrival order, and carries them out together on
//! the blocking pool (which also holds paused test time still while it works). Each
//! worker awaits its write before it publishes or writes again, so the queue holds at most
//! one write per alloc, always that alloc's newest, and a worker's status is shown only
//! once the record it stands for has been written (or its write has failed, which the
//! store's health then shows). A store that does not block (the in-memory one of
//! paused-time tests) is written inline: the await completes at once.

use std::sync::{Arc, Weak};

use stead_schemas::record::AllocRecord;
use stead_schemas::spec::Name;
use tokio::sync::{mpsc, oneshot};

use super::{Store, StoreError};

/// One write of an alloc's state.
#[derive(Debug)]
pub enum StoreWrite {
    /// Store the record, replacing the alloc's earlier one.
    Put(Box<AllocRecord>),
    /// Remove the alloc's record.
    Delete(Name),
}

impl StoreWrite {
    fn apply(&self, store: &dyn Store) -> Result<(), StoreError> {
        match self {
            StoreWrite::Put(record) => store.put_alloc(record),
            StoreWrite::Delete(name) => store.delete_alloc(name),
        }
    }

    fn name(&self) -> &Name {
        match self {
            StoreWrite::Put(record) => &record.name,
            StoreWrite::Delete(name) => name,
        }
    }
}

/// The node's writer; clones share it.
#[derive(Clone)]
pub struct StoreWriter {
    store: Arc<dyn Store>,
    /// The writer task's queue, for a store that blocks.
    queue: Option<mpsc::UnboundedSender<Job>>,
}

impl std::fmt::Debug for StoreWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreWriter")
            .field("queued", &self.queue.is_some())
            .finish_non_exhaustive()
    }
}

/// Why a write got no answer.
#[derive(Debug, thiserror::Error)]
#[error("the store's writer is gone")]
pub struct WriterGone;

impl StoreWriter {
    /// The writer of `store`; call within a tokio runtime, which runs the writer's task
    /// for a store that blocks until every clone is dropped and the queue is written.
    pub fn new(store: Arc<dyn Store>) -> Self {
        let queue = store.blocks().then(|| {
            let (queue, jobs) = mpsc::unbounded_channel();
            tokio::spawn(write_until_closed(Arc::downgrade(&store), jobs));
            queue
        });
        StoreWriter { store, queue }
    }

    /// The store written to, for reads and counters.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Carries `write` out and returns its outcome: through the writer's task when the
    /// store blocks, at once otherwise.
    pub async fn write(&self, write: StoreWrite) -> Result<(), StoreError> {
        let Some(queue) = &self.queue else {
            return write.apply(self.store.as_ref());
        };
        let name = write.name().clone();
        let (reply, answer) = oneshot::channel();
        let gone = |name| StoreError::Write {
            name,
            source: Box::new(WriterGone),
        };
        if queue.send(Job { write, reply }).is_err() {
            return Err(gone(name));
        }
        answer.await.unwrap_or_else(|_| Err(gone(name)))
    }
}

struct Job {
    write: StoreWrite,
    reply: oneshot::Sender<Result<(), StoreError>>,
}

/// The writer's task: every write queued so far, in order, on the blocking pool, until
/// every sender is gone and the queue is empty. It holds the store only while it writes:
/// the store closes when the node that owns it is dropped, not when this task next runs.
async fn write_until_closed(store: Weak<dyn Store>, mut jobs: mpsc::UnboundedReceiver<Job>) {
    let mut batch = Vec::new();
    while jobs.recv_many(&mut batch, usize::MAX).await > 0 {
        let taken = std::mem::take(&mut batch);
        // Writes queued by a writer whose store is gone get no answer: they see it gone.
        let Some(store) = store.upgrade() else {
            continue;
        };
        let written = tokio::task::spawn_blocking(move || {
            taken
                .into_iter()
                .map(|job| (job.write.apply(store.as_ref()), job.reply))
                .collect::<Vec<_>>()
        })
        .await;
        // A panicked batch drops its replies: those writers see the writer gone.
        for (outcome, reply) in written.into_iter().flatten() {
            // A worker that left without waiting no longer needs the answer.
            let _ = reply.send(outcome);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Mutex, PoisonError};

    use super::*;
    use crate::store::MemoryStore;
    use crate::store::conformance::sample_record;

    /// A memory store that says it blocks, and records the threads that wrote it.
    struct Blocking {
        inner: MemoryStore,
        writers: Mutex<Vec<std::thread::ThreadId>>,
    }

    impl Store for Blocking {
        fn put_alloc(&self, record: &AllocRecord) -> Result<(), StoreError> {
            let thread = std::thread::current().id();
            self.writers
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(thread);
            self.inner.put_alloc(record)
        }
        fn delete_alloc(&self, name: &Name) -> Result<(), StoreError> {
            self.inner.delete_alloc(name)
        }
        fn load_allocs(
            &self,
        ) -> Result<Vec<Result<AllocRecord, crate::store::CorruptRecord>>, StoreError> {
            self.inner.load_allocs()
        }
        fn metrics(&self) -> crate::store::StoreMetrics {
            self.inner.metrics()
        }
    }

    fn loaded_names(store: &dyn Store) -> Vec<String> {
        store
            .load_allocs()
            .expect("loads")
            .into_iter()
            .map(|record| record.expect("readable").name.to_string())
            .collect()
    }

    #[tokio::test]
    async fn a_blocking_store_is_written_on_the_blocking_pool_not_the_runtime() {
        let store = Arc::new(Blocking {
            inner: MemoryStore::new(),
            writers: Mutex::default(),
        });
        let writer = StoreWriter::new(store.clone());
        writer
            .write(StoreWrite::Put(Box::new(sample_record("web", 1))))
            .await
            .expect("written");
        writer
            .write(StoreWrite::Put(Box::new(sample_record("api", 1))))
            .await
            .expect("written");
        assert_eq!(loaded_names(store.as_ref()), ["api", "web"]);
        writer
            .write(StoreWrite::Delete("web".parse().expect("name")))
            .await
            .expect("deleted");
        assert_eq!(loaded_names(store.as_ref()), ["api"]);
        let runtime = std::thread::current().id();
        let writers = store
            .writers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        assert_eq!(writers.len(), 2);
        assert!(
            writers.iter().all(|thread| *thread != runtime),
            "a write ran on the runtime's thread"
        );
    }

    #[tokio::test]
    async fn a_store_that_does_not_block_is_written_inline() {
        let store = Arc::new(MemoryStore::new());
        let writer = StoreWriter::new(store.clone());
        assert!(writer.queue.is_none());
        writer
            .write(StoreWrite::Put(Box::new(sample_record("web", 1))))
            .await
            .expect("written");
        assert_eq!(loaded_names(store.as_ref()), ["web"]);
    }

    #[tokio::test(start_paused = true)]
    async fn paused_time_stands_still_while_a_blocking_store_is_written() {
        let store = Arc::new(Blocking {
            inner: MemoryStore::new(),
            writers: Mutex::default(),
        });
        let writer = StoreWriter::new(store.clone());
        let write = writer.write(StoreWrite::Put(Box::new(sample_record("web", 1))));
        // A timer that auto-advanced time would fire while the write is on the pool.
        tokio::select! {
            written = write => written.expect("written"),
            () = tokio::time::sleep(std::time::Duration::from_secs(3600)) => {
                panic!("time advanced past a write in flight")
            }
        }
        assert_eq!(loaded_names(store.as_ref()), ["web"]);
    }
}
