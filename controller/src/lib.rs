//! The `stead` binary's library: the agent's wiring (`agent`), its HTTP API (`api`), the
//! command-line interface (`cli`) and logging, over the runtime (`stead-runtime`) and the
//! RocksDB store (`stead-store-rocksdb`), whose modules it re-exports under the names the
//! shell has always used.

pub mod agent;
pub mod api;
mod atomic;
pub mod cli;
pub mod deviceplugin;
pub mod fleet;
pub mod logging;
pub mod sdnotify;

pub use stead_runtime::{
    alloc, allocdir, clock, devices, driver, errors, gc, host, metrics, node, queue, registry,
    source, spec_files, watch,
};

/// Persisted state: the runtime's [`Store`](store::Store) seam and stores, and RocksDB's.
pub mod store {
    pub use stead_runtime::store::*;
    pub use stead_store_rocksdb as rocks;
    pub use stead_store_rocksdb::{RocksDbOptions, RocksDbStore};
}

/// Whether this build links the C++ runtime RocksDB needs statically.
pub const STATIC_CPP_RUNTIME: bool = stead_store_rocksdb::STATIC_CPP_RUNTIME;
