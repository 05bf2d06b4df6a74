//! stead's runtime: the node and its per-alloc workers around the pure decisions of
//! `stead-reconcilers`, the drivers, the specs source, devices, GC and the store seam.
//! No RocksDB, web framework, argument parser or HTTP client: those live in the crates
//! that use it (`stead-store-rocksdb`, and `stead-controller` with the `stead` binary).

pub mod alloc;
pub mod allocdir;
pub mod checks;
pub mod clock;
pub mod devices;
pub mod driver;
pub mod errors;
pub mod fleet;
pub mod gc;
pub mod host;
pub mod metrics;
pub mod node;
pub mod queue;
pub mod registry;
pub mod source;
pub mod spec_files;
pub mod store;
mod unrecorded;
pub mod watch;
