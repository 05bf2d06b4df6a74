//! The in-memory [`Store`]: encoded records in a map, for tests and `--data-dir`-less runs.
//!
//! It stores the same bytes RocksDB would, so encoding, decoding and deduplication are
//! exercised exactly as on disk. Clones share one store, so two agents in one test can
//! hand state over as a restart would.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use stead_schemas::record::AllocRecord;
use stead_schemas::spec::Name;

use super::conformance::PlantRaw;
use super::{CorruptRecord, DedupeIndex, Store, StoreError, StoreMetrics, decode_stored};

/// A [`Store`] in memory; clones share the same records, index and counters.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Encoded records by alloc name.
    records: Mutex<BTreeMap<String, Vec<u8>>>,
    dedupe: DedupeIndex,
    /// Set by [`MemoryStore::fail_writes`]: puts and deletes fail.
    fail_writes: AtomicBool,
}

/// The failure [`MemoryStore::fail_writes`] injects.
#[derive(Debug, thiserror::Error)]
#[error("writes are set to fail")]
pub struct InjectedFailure;

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        MemoryStore::default()
    }

    /// Test support: stores `bytes` as the record of `name`, bypassing encoding, as disk
    /// corruption or another agent version would.
    pub fn corrupt(&self, name: &str, bytes: Vec<u8>) {
        self.records().insert(name.to_owned(), bytes);
        self.inner.dedupe.forget(name);
    }

    /// Test support: while `fail`, every put and delete fails with a [`StoreError`] whose
    /// source is [`InjectedFailure`], and stores nothing.
    pub fn fail_writes(&self, fail: bool) {
        self.inner.fail_writes.store(fail, Ordering::Relaxed);
    }

    fn records(&self) -> MutexGuard<'_, BTreeMap<String, Vec<u8>>> {
        // Every update is one map call, so a panic cannot leave the map half updated.
        self.inner
            .records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn writes_fail(&self) -> bool {
        self.inner.fail_writes.load(Ordering::Relaxed)
    }
}

impl Store for MemoryStore {
    fn put_alloc(&self, record: &AllocRecord) -> Result<(), StoreError> {
        self.inner.dedupe.put(record, |bytes| {
            if self.writes_fail() {
                return Err(StoreError::Write {
                    name: record.name.clone(),
                    source: Box::new(InjectedFailure),
                });
            }
            self.records()
                .insert(record.name.to_string(), bytes.to_vec());
            Ok(())
        })
    }

    fn delete_alloc(&self, name: &Name) -> Result<(), StoreError> {
        self.inner.dedupe.delete(name, || {
            if self.writes_fail() {
                return Err(StoreError::Delete {
                    name: name.clone(),
                    source: Box::new(InjectedFailure),
                });
            }
            self.records().remove(name.as_str());
            Ok(())
        })
    }

    fn load_allocs(&self) -> Result<Vec<Result<AllocRecord, CorruptRecord>>, StoreError> {
        let records: Vec<(String, Vec<u8>)> = self.records().clone().into_iter().collect();
        let decoded = crate::host::map_on_every_core(records, |(key, bytes)| {
            let decoded = decode_stored(&key, &bytes);
            (key, bytes, decoded)
        });
        Ok(decoded
            .into_iter()
            .map(|(key, bytes, decoded)| {
                if decoded.is_ok() {
                    self.inner.dedupe.remember(&key, &bytes);
                }
                decoded
            })
            .collect())
    }

    fn metrics(&self) -> StoreMetrics {
        self.inner.dedupe.metrics()
    }

    fn blocks(&self) -> bool {
        false
    }
}

impl PlantRaw for MemoryStore {
    fn plant_raw(&self, name: &str, bytes: Vec<u8>) {
        self.corrupt(name, bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::conformance::{self, sample_record};

    #[test]
    fn memory_store_passes_the_conformance_suite() {
        conformance::run_all(|| Box::new(MemoryStore::new()));
    }

    #[test]
    fn memory_store_clones_share_records_and_counters() {
        let first = MemoryStore::new();
        let second = first.clone();
        first.put_alloc(&sample_record("web", 0)).expect("written");
        let loaded = second.load_allocs().expect("loads");
        assert_eq!(loaded.len(), 1);
        assert_eq!(second.metrics().writes, 1);
    }

    #[test]
    fn memory_store_fail_writes_fails_puts_and_deletes_until_cleared() {
        let store = MemoryStore::new();
        store.put_alloc(&sample_record("web", 0)).expect("written");
        store.fail_writes(true);
        let error = store
            .put_alloc(&sample_record("web", 1))
            .expect_err("writes fail");
        assert_eq!(error.to_string(), "writing the record of alloc web failed");
        assert!(
            std::error::Error::source(&error).is_some_and(|s| s.is::<InjectedFailure>()),
            "{error:?}"
        );
        let name: Name = "web".parse().expect("valid name");
        assert!(matches!(
            store.delete_alloc(&name),
            Err(StoreError::Delete { .. })
        ));
        let loaded = store.load_allocs().expect("loads");
        let kept = loaded[0].as_ref().expect("the first record is intact");
        assert_eq!(kept, &sample_record("web", 0));

        store.fail_writes(false);
        store.put_alloc(&sample_record("web", 1)).expect("written");
        let loaded = store.load_allocs().expect("loads");
        assert_eq!(
            loaded[0].as_ref().expect("decodes"),
            &sample_record("web", 1)
        );
    }

    #[test]
    fn memory_store_put_after_corrupt_is_written_not_skipped() {
        let store = MemoryStore::new();
        let record = sample_record("web", 0);
        store.put_alloc(&record).expect("written");
        store.corrupt("web", b"garbage".to_vec());
        store.put_alloc(&record).expect("written");
        let loaded = store.load_allocs().expect("loads");
        assert_eq!(loaded[0].as_ref().expect("decodes"), &record);
        assert_eq!(store.metrics().skipped_writes, 0);
    }

    #[test]
    fn memory_store_skips_rewriting_a_record_it_loaded() {
        let store = MemoryStore::new();
        let record = sample_record("web", 0);
        // Planted as another agent would have left it: the index has not seen it.
        store.corrupt("web", record.encode());
        store.load_allocs().expect("loads");
        store.put_alloc(&record).expect("skipped");
        assert_eq!(store.metrics().skipped_writes, 1);
        assert_eq!(store.metrics().writes, 0);
    }
}
