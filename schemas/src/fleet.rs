//! The documents a fleet keeps in etcd, and the agent's copy of what it was last told.
//!
//! Keys, below a prefix (default `/stead/v1`):
//! - `desired/<node>/<alloc>` and `desired/_all/<alloc>`: a spec document (YAML text);
//! - `status/<node>/<alloc>`: [`FleetAllocStatus`], JSON;
//! - `nodes/<node>`: [`FleetNodeStatus`], JSON, under the agent's lease.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::status::AllocStatus;
use crate::time::Timestamp;

/// The prefix keys live below unless the agent config says otherwise.
pub const DEFAULT_PREFIX: &str = "/stead/v1";

/// The `desired/` segment that holds the specs every matching node runs.
pub const ALL_NODES: &str = "_all";

/// `nodes/<node>`: who claims the node, written when the agent claims it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FleetNodeStatus {
    /// The node's name.
    pub name: String,
    /// Its labels, which `nodeSelector`s match.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The agent's version.
    pub version: String,
    /// The host the agent runs on.
    pub hostname: String,
    /// When this agent claimed the node.
    pub claimed_at: Timestamp,
}

/// `status/<node>/<alloc>`: the alloc's status document (as `GET /v1/allocs/{name}`)
/// and when the agent wrote it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FleetAllocStatus {
    /// When it was written (only when the status changed).
    pub written_at: Timestamp,
    /// The status.
    pub status: AllocStatus,
}

/// `<dataDir>/fleet-desired.json`: the last desired listing the agent took from etcd,
/// so that an agent started while etcd is away runs what it was last told.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FleetCheckpoint {
    /// The key prefix it was read below.
    pub prefix: String,
    /// The node it was read for.
    pub node: String,
    /// The etcd revision it is the state at.
    pub revision: i64,
    /// Each key this node runs from (its own and `_all`'s), with its value.
    pub entries: BTreeMap<String, String>,
}
