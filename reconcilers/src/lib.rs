//! stead's pure decisions: `fn(desired, observed, now) -> Plan`, with no IO, no async and
//! no clock reads, so every decision is a deterministic function that tests can table.
//!
//! - [`restart`]: the restart tracker (Nomad's rules, plus `maxDelay`).
//! - [`check`]: health checks' state and Nomad's `check_restart` arithmetic.
//! - [`task`]: one task's state and its steps towards running or dead.
//! - [`alloc`]: lifecycle stages, leader and sibling deaths, kill order, client status.
//! - [`revision`]: an alloc's revisions: broken records, take-overs, removal, leaving.
//! - [`event`]: task events with Nomad's type strings and messages.
//! - [`device`]: fingerprints, the node's inventory, device assignment, flags, stats, env.
//! - [`gc`]: which terminal allocs garbage collection destroys (Nomad's policy).

pub mod alloc;
pub mod check;
pub mod device;
pub mod event;
pub mod exit;
pub mod gc;
pub mod gpu;
pub mod restart;
pub mod revision;
pub mod task;

pub use stead_schemas::Timestamp;
