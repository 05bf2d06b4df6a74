//! Fault injection at the [`Store`] seam: a wrapper whose writes fail on demand, as a
//! full disk or an I/O error would make them, in front of any real store.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use stead_schemas::record::AllocRecord;
use stead_schemas::spec::Name;

use super::{CorruptRecord, Store, StoreError, StoreMetrics};

/// The error a [`FaultyStore`] injects.
#[derive(Debug, thiserror::Error)]
#[error("injected I/O error: no space left on device")]
pub struct InjectedIoError;

/// A [`Store`] whose puts and deletes fail while [`FaultyStore::set_failing`] is on; reads
/// and everything else go to the store inside. Clones share the switch.
#[derive(Clone)]
pub struct FaultyStore {
    inner: Arc<dyn Store>,
    failing: Arc<AtomicBool>,
}

impl FaultyStore {
    /// Wraps `inner`, not failing yet.
    pub fn new(inner: Arc<dyn Store>) -> Self {
        FaultyStore {
            inner,
            failing: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Turns the failures on or off.
    pub fn set_failing(&self, failing: bool) {
        self.failing.store(failing, Ordering::Relaxed);
    }

    fn failing(&self) -> bool {
        self.failing.load(Ordering::Relaxed)
    }
}

impl Store for FaultyStore {
    fn put_alloc(&self, record: &AllocRecord) -> Result<(), StoreError> {
        if self.failing() {
            return Err(StoreError::Write {
                name: record.name.clone(),
                source: Box::new(InjectedIoError),
            });
        }
        self.inner.put_alloc(record)
    }

    fn delete_alloc(&self, name: &Name) -> Result<(), StoreError> {
        if self.failing() {
            return Err(StoreError::Delete {
                name: name.clone(),
                source: Box::new(InjectedIoError),
            });
        }
        self.inner.delete_alloc(name)
    }

    fn load_allocs(&self) -> Result<Vec<Result<AllocRecord, CorruptRecord>>, StoreError> {
        self.inner.load_allocs()
    }

    fn metrics(&self) -> StoreMetrics {
        self.inner.metrics()
    }

    fn blocks(&self) -> bool {
        self.inner.blocks()
    }
}
