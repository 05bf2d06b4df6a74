//! stead's pure decisions: `fn(desired, observed, now) -> Plan`, with no IO, no async and
//! no clock reads, so every decision is a deterministic function that tests can table.

pub mod restart;
