//! stead's shell: everything that touches the world (files, processes, the network,
//! the clock) around the pure decisions of `stead-reconcilers`, and the `stead` CLI.

pub mod alloc;
pub mod cli;
pub mod clock;
pub mod driver;
pub mod node;
pub mod queue;
pub mod spec_files;
pub mod store;
