//! Metrics: the names, the recording helpers the worker and the queue call, and the
//! OpenMetrics text rendering served at `GET /metrics`.
//!
//! Events (reconciles, task starts, restarts, failures, coalesced updates) are counted
//! where they happen, in process-wide metrics that exist from their first use: nothing
//! is installed, no count is lost before the API serves, and their size is fixed however
//! long nobody scrapes (a histogram is its buckets, not its samples). Levels that the
//! node already knows (queue depth, allocs by client status, the store's counters) are
//! read from it when `/metrics` is rendered, so no hot path pays for them.

use std::fmt;
use std::sync::LazyLock;
use std::time::Duration;

use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use stead_reconcilers::check::CheckStatus;

use crate::store::StoreMetrics;

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
/// Counter: health check results, by `status` (`passing`, `warning`, `critical`).
pub const CHECK_RESULTS: &str = "stead_check_results_total";
/// Counter: tasks restarted because a health check stayed unhealthy.
pub const CHECK_RESTARTS: &str = "stead_check_restarts_total";
/// Counter: task runs in which the kernel's OOM killer killed a process (read from the
/// task's cgroup).
pub const TASK_OOM_KILLS: &str = "stead_task_oom_kills_total";
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

/// Every status a check result has, so each `stead_check_results_total` series exists
/// even at zero.
pub const CHECK_RESULT_STATUSES: [CheckStatus; 3] = [
    CheckStatus::Passing,
    CheckStatus::Warning,
    CheckStatus::Critical,
];

/// Every client status, so each `stead_allocs` series exists even at zero.
pub const CLIENT_STATUSES: [&str; 4] = ["pending", "running", "complete", "failed"];

/// The levels a node knows, read when `/metrics` is rendered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeLevels {
    /// Inputs waiting in alloc mailboxes, over all allocs.
    pub queue_depth: usize,
    /// Allocs by client status, in the order of [`CLIENT_STATUSES`].
    pub allocs_by_status: [i64; CLIENT_STATUSES.len()],
    /// What the store did since it was opened.
    pub store: StoreMetrics,
    /// Store writes that failed.
    pub store_write_errors: u64,
}

/// Bucket bounds of [`RECONCILE_DURATION`], in seconds: a pass is normally well under a
/// millisecond, so the buckets start at 10 µs.
const RECONCILE_BUCKETS: [f64; 12] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05,
    0.25,
];

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A metric family's name: a counter's series carry `_total` after it, and a family with
/// a unit ends with the unit.
fn family<'a>(series: &'a str, suffix: &str) -> &'a str {
    series.strip_suffix(suffix).unwrap_or(series)
}

/// The events counted where they happen, and the registry that renders them.
struct Events {
    reconciles: Counter,
    reconcile_duration: Histogram,
    coalesced_updates: Counter,
    task_starts: Counter,
    task_restarts: Counter,
    task_failures: Counter,
    /// `stead_check_results_total` by status, in the order of [`CHECK_RESULT_STATUSES`].
    check_results: [Counter; CHECK_RESULT_STATUSES.len()],
    check_restarts: Counter,
    task_oom_kills: Counter,
    registry: Registry,
}

impl Events {
    fn new() -> Events {
        let (reconciles, coalesced_updates) = (Counter::default(), Counter::default());
        let (task_starts, task_restarts, task_failures) =
            (Counter::default(), Counter::default(), Counter::default());
        let reconcile_duration = Histogram::new(RECONCILE_BUCKETS);
        let check_restarts = Counter::default();
        let task_oom_kills = Counter::default();
        let check_family = Family::<[(&'static str, &'static str); 1], Counter>::default();
        let check_results = CHECK_RESULT_STATUSES.map(|status| {
            check_family
                .get_or_create(&[("status", status.as_str())])
                .clone()
        });
        let mut registry = Registry::default();
        let counters = [
            (RECONCILES, "Reconcile passes over all allocs", &reconciles),
            (
                COALESCED_UPDATES,
                "Pending spec updates replaced by newer ones before being applied",
                &coalesced_updates,
            ),
            (TASK_STARTS, "Tasks started by a driver", &task_starts),
            (
                TASK_RESTARTS,
                "Task restarts, by policy or by a user",
                &task_restarts,
            ),
            (TASK_FAILURES, "Tasks that ended failed", &task_failures),
            (
                CHECK_RESTARTS,
                "Tasks restarted because a health check stayed unhealthy",
                &check_restarts,
            ),
            (
                TASK_OOM_KILLS,
                "Task runs in which the kernel's OOM killer killed a process",
                &task_oom_kills,
            ),
        ];
        for (series, help, counter) in counters {
            registry.register(family(series, "_total"), help, counter.clone());
        }
        registry.register(
            family(CHECK_RESULTS, "_total"),
            "Health check results, by status",
            check_family,
        );
        registry.register_with_unit(
            family(RECONCILE_DURATION, "_seconds"),
            "How long one reconcile pass took, dispatching its effects included",
            Unit::Seconds,
            reconcile_duration.clone(),
        );
        Events {
            reconciles,
            reconcile_duration,
            coalesced_updates,
            task_starts,
            task_restarts,
            task_failures,
            check_results,
            check_restarts,
            task_oom_kills,
            registry,
        }
    }
}

static EVENTS: LazyLock<Events> = LazyLock::new(Events::new);

/// The `/metrics` renderer; cheap to copy. Every agent of a process shares the event
/// counts, as they share the process.
#[derive(Clone, Copy, Debug, Default)]
pub struct Metrics {
    _private: (),
}

impl Metrics {
    /// The renderer of the process's metrics.
    pub fn new() -> Metrics {
        Metrics::default()
    }

    /// The OpenMetrics text exposition ([`CONTENT_TYPE`]) of every metric, with the
    /// node's levels as `node` read them just now.
    pub fn render(&self, node: &NodeLevels) -> Result<String, fmt::Error> {
        let mut levels = Registry::default();
        levels.register(
            QUEUE_DEPTH,
            "Inputs waiting in alloc mailboxes, over all allocs",
            ConstGauge::new(i64::try_from(node.queue_depth).unwrap_or(i64::MAX)),
        );
        let allocs = Family::<[(&'static str, &'static str); 1], Gauge>::default();
        for (status, count) in CLIENT_STATUSES.iter().zip(node.allocs_by_status) {
            allocs
                .get_or_create(&[("client_status", status)])
                .set(count);
        }
        levels.register(ALLOCS, "Allocs by client status", allocs);
        let store = node.store;
        let store_counters = [
            (
                STORE_WRITES,
                "Alloc records written to the store",
                store.writes,
            ),
            (
                STORE_SKIPPED_WRITES,
                "Store writes skipped because the record was unchanged",
                store.skipped_writes,
            ),
            (
                STORE_BYTES_WRITTEN,
                "Bytes of keys and values the store's writes handed to storage",
                store.bytes_written,
            ),
            (
                STORE_WRITE_ERRORS,
                "Store writes that failed",
                node.store_write_errors,
            ),
        ];
        for (series, help, value) in store_counters {
            levels.register(family(series, "_total"), help, ConstCounter::new(value));
        }
        let mut text = String::new();
        encode_registry(&mut text, &EVENTS.registry)?;
        encode_registry(&mut text, &levels)?;
        encode_eof(&mut text)?;
        Ok(text)
    }
}

/// Records one reconcile pass that took `took`.
pub(crate) fn reconciled(took: Duration) {
    EVENTS.reconciles.inc();
    EVENTS.reconcile_duration.observe(took.as_secs_f64());
}

/// Records a pending spec update replaced by a newer one.
pub(crate) fn coalesced_update() {
    EVENTS.coalesced_updates.inc();
}

/// Records a task the driver started.
pub(crate) fn task_started() {
    EVENTS.task_starts.inc();
}

/// Records `restarts` task restarts and `failures` tasks that ended failed.
pub(crate) fn task_outcomes(restarts: u64, failures: u64) {
    if restarts > 0 {
        EVENTS.task_restarts.inc_by(restarts);
    }
    if failures > 0 {
        EVENTS.task_failures.inc_by(failures);
    }
}

/// Records a health check result.
pub(crate) fn check_result(status: CheckStatus) {
    if let Some(i) = CHECK_RESULT_STATUSES.iter().position(|s| *s == status) {
        EVENTS.check_results[i].inc();
    }
}

/// Records a task restarted for a failing health check.
pub(crate) fn check_restart() {
    EVENTS.check_restarts.inc();
}

/// Counts a task run ended by the OOM killer.
pub(crate) fn task_oom_killed() {
    EVENTS.task_oom_kills.inc();
}
