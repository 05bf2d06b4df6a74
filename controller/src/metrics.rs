//! Metrics: the names, the recording helpers the worker and the queue call, and the
//! Prometheus text rendering served at `GET /metrics`.
//!
//! Events (reconciles, task starts, restarts, failures, coalesced updates) are recorded
//! where they happen through the `metrics` facade, which costs nothing until
//! [`Metrics::install`] sets the process-wide recorder. Levels that the node already
//! knows (queue depth, allocs by client status, the store's counters) are read from it
//! when `/metrics` is rendered, so no hot path pays for them.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use thiserror::Error;

use crate::node::Node;

/// Counter: reconcile passes over all allocs.
pub const RECONCILES: &str = "stead_reconciles_total";
/// Histogram: how long one reconcile pass took (reconcile plus dispatching its effects).
pub const RECONCILE_DURATION: &str = "stead_reconcile_duration_seconds";
/// Gauge: inputs waiting in alloc mailboxes (targets, commands, shutdowns), over all allocs.
pub const QUEUE_DEPTH: &str = "stead_queue_depth";
/// Counter: pending spec updates replaced by newer ones before being applied.
pub const COALESCED_UPDATES: &str = "stead_coalesced_updates_total";
/// Counter: tasks the driver started (reattaching after an agent restart is not a start).
pub const TASK_STARTS: &str = "stead_task_starts_total";
/// Counter: task restarts (by policy or by a user).
pub const TASK_RESTARTS: &str = "stead_task_restarts_total";
/// Counter: tasks that ended failed.
pub const TASK_FAILURES: &str = "stead_task_failures_total";
/// Counter: alloc records written to the store.
pub const STORE_WRITES: &str = "stead_store_writes_total";
/// Counter: store writes skipped because the record was unchanged.
pub const STORE_SKIPPED_WRITES: &str = "stead_store_skipped_writes_total";
/// Counter: bytes of keys and values the store's writes handed to storage.
pub const STORE_BYTES_WRITTEN: &str = "stead_store_bytes_written_total";
/// Counter: store writes that failed.
pub const STORE_WRITE_ERRORS: &str = "stead_store_write_errors_total";
/// Gauge: allocs by `client_status` (`pending`, `running`, `complete`, `failed`).
pub const ALLOCS: &str = "stead_allocs";

/// Every client status, so each `stead_allocs` series exists even at zero.
pub const CLIENT_STATUSES: [&str; 4] = ["pending", "running", "complete", "failed"];

/// Bucket bounds of [`RECONCILE_DURATION`], in seconds: a pass is normally well under a
/// millisecond, so the buckets start at 10 µs.
const RECONCILE_BUCKETS: [f64; 12] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05,
    0.25,
];

/// Why the metrics recorder could not be installed.
#[derive(Debug, Clone, Copy, Error)]
pub enum MetricsError {
    /// The exporter refused the histogram buckets.
    #[error("the prometheus exporter refused the histogram buckets")]
    InvalidBuckets,
    /// Another recorder is already installed in this process.
    #[error("another metrics recorder is already installed")]
    AlreadyInstalled,
}

/// The installed Prometheus recorder; cheap to clone.
#[derive(Clone, Debug)]
pub struct Metrics {
    handle: PrometheusHandle,
}

static INSTALLED: OnceLock<Result<PrometheusHandle, MetricsError>> = OnceLock::new();

impl Metrics {
    /// Installs the process-wide Prometheus recorder, or returns the one this function
    /// installed earlier (tests create many agents in one process).
    pub fn install() -> Result<Metrics, MetricsError> {
        let installed = INSTALLED.get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Full(RECONCILE_DURATION.to_owned()),
                    &RECONCILE_BUCKETS,
                )
                .map_err(|_| MetricsError::InvalidBuckets)?
                .build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).map_err(|_| MetricsError::AlreadyInstalled)?;
            describe();
            Ok(handle)
        });
        installed.clone().map(|handle| Metrics { handle })
    }

    /// The Prometheus text exposition of every metric, with the node's levels read now.
    pub fn render(&self, node: &Node) -> String {
        gauge!(QUEUE_DEPTH).set(node.queue_depth() as f64);
        let mut by_status = [0u32; CLIENT_STATUSES.len()];
        for status in node.statuses() {
            if let Some(i) = CLIENT_STATUSES
                .iter()
                .position(|s| *s == status.client_status)
            {
                by_status[i] += 1;
            }
        }
        for (status, count) in CLIENT_STATUSES.iter().zip(by_status) {
            gauge!(ALLOCS, "client_status" => *status).set(f64::from(count));
        }
        let store = node.store_metrics();
        counter!(STORE_WRITES).absolute(store.writes);
        counter!(STORE_SKIPPED_WRITES).absolute(store.skipped_writes);
        counter!(STORE_BYTES_WRITTEN).absolute(store.bytes_written);
        counter!(STORE_WRITE_ERRORS).absolute(node.store_errors());
        self.handle.run_upkeep();
        self.handle.render()
    }
}

/// Help texts and units, and a zero for every counter so each series exists from the start.
fn describe() {
    describe_counter!(RECONCILES, "Reconcile passes over all allocs.");
    describe_histogram!(
        RECONCILE_DURATION,
        Unit::Seconds,
        "How long one reconcile pass took, dispatching its effects included."
    );
    describe_gauge!(
        QUEUE_DEPTH,
        "Inputs waiting in alloc mailboxes, over all allocs."
    );
    describe_counter!(
        COALESCED_UPDATES,
        "Pending spec updates replaced by newer ones before being applied."
    );
    describe_counter!(TASK_STARTS, "Tasks started by a driver.");
    describe_counter!(TASK_RESTARTS, "Task restarts, by policy or by a user.");
    describe_counter!(TASK_FAILURES, "Tasks that ended failed.");
    describe_counter!(STORE_WRITES, "Alloc records written to the store.");
    describe_counter!(
        STORE_SKIPPED_WRITES,
        "Store writes skipped because the record was unchanged."
    );
    describe_counter!(STORE_WRITE_ERRORS, "Store writes that failed.");
    describe_counter!(
        STORE_BYTES_WRITTEN,
        Unit::Bytes,
        "Bytes of keys and values the store's writes handed to storage."
    );
    describe_gauge!(ALLOCS, "Allocs by client status.");
    for name in [
        RECONCILES,
        COALESCED_UPDATES,
        TASK_STARTS,
        TASK_RESTARTS,
        TASK_FAILURES,
    ] {
        counter!(name).increment(0);
    }
}

/// Records one reconcile pass that took `took`.
pub(crate) fn reconciled(took: Duration) {
    counter!(RECONCILES).increment(1);
    histogram!(RECONCILE_DURATION).record(took.as_secs_f64());
}

/// Records a pending spec update replaced by a newer one.
pub(crate) fn coalesced_update() {
    counter!(COALESCED_UPDATES).increment(1);
}

/// Records a task the driver started.
pub(crate) fn task_started() {
    counter!(TASK_STARTS).increment(1);
}

/// Records `restarts` task restarts and `failures` tasks that ended failed.
pub(crate) fn task_outcomes(restarts: u64, failures: u64) {
    if restarts > 0 {
        counter!(TASK_RESTARTS).increment(restarts);
    }
    if failures > 0 {
        counter!(TASK_FAILURES).increment(failures);
    }
}
