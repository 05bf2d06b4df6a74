//! stead's per-task supervisor: a small process that is the parent of one task and
//! outlives the agent.
//!
//! The `exec` driver starts one supervisor per run of a task (conmon's shape; the
//! measured cost is in docs/decisions/0033 and 0037). It forks them from a fork server,
//! `stead-supervisor --zygote`, rather than executing this binary for each:
//! a fork of a small process is cheaper than an exec, and the copies share the server's
//! pages. The supervisor
//!
//! 1. leaves the agent's session and becomes a child subreaper, so every process the task
//!    forks, daemonised grandchildren included, stays below it;
//! 2. reads the task's environment from its stdin (never from its own environment: the
//!    task's `LD_PRELOAD` must not load into a process that may run as root);
//! 3. starts the task in its own session and process group, in its cwd (the task dir), as
//!    the given uid/gid and supplementary groups, with `PR_SET_PDEATHSIG` so the task dies with the supervisor;
//! 4. reports `started` (or `failed`) on its stdout, a pipe to the agent ([`protocol`]);
//! 5. copies the task's stdout and stderr into rotating files ([`logs`]);
//! 6. when the task exits, kills whatever the task left behind, drains the logs, reports
//!    `exited` to the agent if it still listens, records the exit in
//!    `<control>/<run>.exit` (synced to the disk when no agent heard it) and exits.
//!
//! The agent may die and come back at any point: everything it needs to reattach is the
//! supervisor's pid and start time, and the record files.
//!
//! The library holds the formats both sides share (arguments, protocol lines, record
//! files, log file names), so they are defined once, and the supervisor itself. It is
//! `no_std` (`core`, `alloc` and rustix's raw system calls): the shipped binary
//! (`src/main.rs`) runs it without a C library, so each supervisor maps little more than
//! its own code; the `std` feature adds the agent's side, which reads the record files
//! through `std::path`.

#![no_std]

extern crate alloc;
// Under these names in the manifest: the same crates without their `std` features.
extern crate rustix_no_std as rustix;
#[cfg(all(feature = "std", not(test)))]
extern crate std;
extern crate thiserror_no_std as thiserror;
// The tests run on the standard library, with its prelude and macros.
#[cfg(test)]
#[macro_use]
extern crate std;

pub mod args;
pub mod cgroup;
mod children;
pub mod error;
mod file;
pub mod logs;
pub mod oom;
pub mod proc;
pub mod protocol;
mod spawn;
mod supervise;
mod sys;
mod zygote;

pub use supervise::main;
pub use sys::{brk, exit};
