//! The node's one writer of its store: workers hand it their alloc's newest record (or
//! its removal) and await the outcome, so no store IO runs on the async runtime's threads.
//!
//! A store whose calls block on disk ([`Store::blocks`]) is written on a thread of its
//! own, in the order the writes arrive. Each worker awaits its write before it publishes
//! or writes again, so the writer holds at most one write per alloc, always that alloc's
//! newest, and a worker's status is shown only once the record it stands for has been
//! written (or its write has failed, which the store's health then shows). A store that
//! does not block (the in-memory one of paused-time tests) is written inline: the await
//! completes at once and the worker's steps are exactly as they were.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use stead_schemas::record::AllocRecord;
use stead_schemas::spec::Name;
use tokio::sync::oneshot;

use super::{Store, StoreError};

/// One write of an alloc's state.
#[derive(Debug)]
pub enum StoreWrite {
    /// Store the record, replacing the alloc's earlier one.
    Put(AllocRecord),
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
    thread: Option<Arc<WriterThread>>,
}

impl std::fmt::Debug for StoreWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreWriter")
            .field("threaded", &self.thread.is_some())
            .finish_non_exhaustive()
    }
}

/// Why a write got no answer.
#[derive(Debug, thiserror::Error)]
#[error("the store's writer thread is gone")]
pub struct WriterGone;

impl StoreWriter {
    /// The writer of `store`: on a thread of its own when the store blocks.
    pub fn new(store: Arc<dyn Store>) -> Result<Self, std::io::Error> {
        let thread = if store.blocks() {
            Some(Arc::new(WriterThread::start(store.clone())?))
        } else {
            None
        };
        Ok(StoreWriter { store, thread })
    }

    /// The store written to, for reads and counters.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Carries `write` out and returns its outcome: on the writer's thread when there is
    /// one, at once otherwise.
    pub async fn write(&self, write: StoreWrite) -> Result<(), StoreError> {
        let Some(thread) = &self.thread else {
            return write.apply(self.store.as_ref());
        };
        let name = write.name().clone();
        let (reply, answer) = oneshot::channel();
        thread.push(Job { write, reply });
        answer.await.unwrap_or_else(|_| {
            Err(StoreError::Write {
                name,
                source: Box::new(WriterGone),
            })
        })
    }

    /// Writes waiting for the writer's thread (none without one).
    pub fn queued(&self) -> usize {
        self.thread.as_ref().map_or(0, |thread| thread.queued())
    }
}

struct Job {
    write: StoreWrite,
    reply: oneshot::Sender<Result<(), StoreError>>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// The thread that writes a blocking store, and its queue.
struct WriterThread {
    shared: Arc<(Mutex<Queue>, Condvar)>,
    handle: Option<JoinHandle<()>>,
}

impl WriterThread {
    fn start(store: Arc<dyn Store>) -> Result<Self, std::io::Error> {
        let shared = Arc::new((Mutex::new(Queue::default()), Condvar::new()));
        let queue = shared.clone();
        let handle = std::thread::Builder::new()
            .name("stead-store".to_owned())
            .spawn(move || write_until_closed(store.as_ref(), &queue))?;
        Ok(WriterThread {
            shared,
            handle: Some(handle),
        })
    }

    fn push(&self, job: Job) {
        let (queue, ready) = &*self.shared;
        queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .jobs
            .push_back(job);
        ready.notify_one();
    }

    fn queued(&self) -> usize {
        self.shared
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .jobs
            .len()
    }
}

impl Drop for WriterThread {
    /// Writes what is queued, then lets the thread end and waits for it: the store is
    /// closed by the thread's last reference before the agent exits.
    fn drop(&mut self) {
        let (queue, ready) = &*self.shared;
        queue.lock().unwrap_or_else(PoisonError::into_inner).closed = true;
        ready.notify_one();
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// The writer thread's loop: each queued write in turn, until the queue is closed and
/// empty.
fn write_until_closed(store: &dyn Store, shared: &(Mutex<Queue>, Condvar)) {
    let (queue, ready) = shared;
    loop {
        let job = {
            let mut queue = queue.lock().unwrap_or_else(PoisonError::into_inner);
            loop {
                if let Some(job) = queue.jobs.pop_front() {
                    break job;
                }
                if queue.closed {
                    return;
                }
                queue = ready.wait(queue).unwrap_or_else(PoisonError::into_inner);
            }
        };
        // A worker that left without waiting no longer needs the answer.
        let _ = job.reply.send(job.write.apply(store));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use crate::store::conformance::sample_record;

    /// A memory store that says it blocks, and counts the threads that wrote it.
    struct Blocking {
        inner: MemoryStore,
        writers: Mutex<Vec<Option<String>>>,
    }

    impl Store for Blocking {
        fn put_alloc(&self, record: &AllocRecord) -> Result<(), StoreError> {
            let thread = std::thread::current().name().map(str::to_owned);
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
    async fn a_blocking_store_is_written_on_the_writer_thread_not_the_runtime() {
        let store = Arc::new(Blocking {
            inner: MemoryStore::new(),
            writers: Mutex::default(),
        });
        let writer = StoreWriter::new(store.clone()).expect("writer starts");
        writer
            .write(StoreWrite::Put(sample_record("web", 1)))
            .await
            .expect("written");
        writer
            .write(StoreWrite::Put(sample_record("api", 1)))
            .await
            .expect("written");
        assert_eq!(loaded_names(store.as_ref()), ["api", "web"]);
        writer
            .write(StoreWrite::Delete("web".parse().expect("name")))
            .await
            .expect("deleted");
        assert_eq!(loaded_names(store.as_ref()), ["api"]);
        let writers = store
            .writers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        assert_eq!(
            writers,
            [
                Some("stead-store".to_owned()),
                Some("stead-store".to_owned())
            ]
        );
        assert_eq!(writer.queued(), 0);
    }

    #[tokio::test]
    async fn a_store_that_does_not_block_is_written_inline() {
        let store = Arc::new(MemoryStore::new());
        let writer = StoreWriter::new(store.clone()).expect("writer");
        assert!(writer.thread.is_none());
        writer
            .write(StoreWrite::Put(sample_record("web", 1)))
            .await
            .expect("written");
        assert_eq!(loaded_names(store.as_ref()), ["web"]);
    }

    #[test]
    fn dropping_the_writer_writes_what_is_queued_first() {
        let store = Arc::new(Blocking {
            inner: MemoryStore::new(),
            writers: Mutex::default(),
        });
        let writer = StoreWriter::new(store.clone()).expect("writer starts");
        let thread = writer.thread.clone().expect("a thread");
        let mut answers = Vec::new();
        for name in ["a", "b", "c"] {
            let (reply, answer) = oneshot::channel();
            thread.push(Job {
                write: StoreWrite::Put(sample_record(name, 1)),
                reply,
            });
            answers.push(answer);
        }
        drop(thread);
        drop(writer);
        assert_eq!(loaded_names(store.as_ref()), ["a", "b", "c"]);
        for answer in answers {
            answer.blocking_recv().expect("answered").expect("written");
        }
    }
}
