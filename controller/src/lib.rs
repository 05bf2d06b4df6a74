//! stead's shell: everything that touches the world (files, processes, the network,
//! the clock) around the pure decisions of `stead-reconcilers`, and the `stead` CLI.

pub mod cli;
pub mod spec_files;
