//! stead's shell: everything that touches the world (files, processes, the network,
//! the clock) around the pure decisions of `stead-reconcilers`, and the `stead` CLI.

pub mod agent;
pub mod alloc;
pub mod allocdir;
pub mod api;
pub mod cli;
pub mod clock;
pub mod devices;
pub mod driver;
pub mod errors;
pub mod gc;
pub mod logging;
pub mod metrics;
pub mod node;
pub mod queue;
pub mod registry;
pub mod sdnotify;
pub mod source;
pub mod spec_files;
pub mod store;
pub mod watch;

/// Whether this build links the C++ runtime RocksDB needs statically (`build.rs`).
pub const STATIC_CPP_RUNTIME: bool = cfg!(stead_static_libstdcxx);
