//! Metrics: the names, the recording helpers the worker and the queue call, and the text
//! rendering served at `GET /metrics`, in the Prometheus text format (0.0.4) or in
//! OpenMetrics, whichever the scraper's `Accept` prefers (decision 0067).
//!
//! Events (reconciles, task starts, failures, coalesced updates) are counted where they
//! happen, in process-wide metrics that exist from their first use: nothing is
//! installed, no count is lost before the API serves, and their size is fixed however
//! long nobody scrapes (a histogram is its buckets, not its samples). Levels that the
//! node already knows (queue depth, allocs by client status, the store's counters, and
//! each task's state, restarts, OOM kills, checks and cgroup counters) are read from it
//! when `/metrics` is rendered, so no hot path pays for them and a destroyed alloc's
//! series are gone from the next scrape.

use std::fmt;
use std::sync::LazyLock;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
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
/// Counter: tasks that ended failed.
pub const TASK_FAILURES: &str = "stead_task_failures_total";
/// Counter: health check results, by `status` (`passing`, `warning`, `critical`).
pub const CHECK_RESULTS: &str = "stead_check_results_total";
/// Counter: tasks restarted because a health check stayed unhealthy.
pub const CHECK_RESTARTS: &str = "stead_check_restarts_total";
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
/// Gauge, per `alloc` and `task`: one series per `state` (`pending`, `running`, `dead`),
/// 1 for the task's current state and 0 for the others.
pub const TASK_STATE: &str = "stead_task_state";
/// Counter, per `alloc` and `task`: the task's restarts (by policy or by a user).
pub const TASK_RESTARTS: &str = "stead_task_restarts_total";
/// Counter, per `alloc` and `task`: the task's runs in which the kernel's OOM killer
/// killed a process (read from its cgroup).
pub const TASK_OOM_KILLS: &str = "stead_task_oom_kills_total";
/// Counter, per `alloc` and `task`: CPU time of the task's current run, from its cgroup;
/// only for a task that has one.
pub const TASK_CPU_SECONDS: &str = "stead_task_cpu_seconds_total";
/// Gauge, per `alloc` and `task`: memory the task's cgroup is charged now; only for a
/// task that has one with the memory controller.
pub const TASK_MEMORY_BYTES: &str = "stead_task_memory_bytes";
/// Gauge, per `alloc`, `task` and `check`: one series per `status` (`pending`,
/// `passing`, `warning`, `critical`), 1 for the check's current status.
pub const CHECK_STATUS: &str = "stead_check_status";

/// Every state of a task, so each `stead_task_state` series exists.
pub const TASK_STATES: [&str; 3] = ["pending", "running", "dead"];

/// Every status of a check, so each `stead_check_status` series exists.
pub const CHECK_STATUSES: [&str; 4] = ["pending", "passing", "warning", "critical"];

/// Every status a check result has, so each `stead_check_results_total` series exists
/// even at zero.
pub const CHECK_RESULT_STATUSES: [CheckStatus; 3] = [
    CheckStatus::Passing,
    CheckStatus::Warning,
    CheckStatus::Critical,
];

/// Every client status, so each `stead_allocs` series exists even at zero.
pub const CLIENT_STATUSES: [&str; 4] = ["pending", "running", "complete", "failed"];

/// One task as `/metrics` shows it, read from its alloc's published view.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskLevels {
    /// The alloc's name.
    pub alloc: String,
    /// The task's name.
    pub task: String,
    /// `pending`, `running` or `dead` (one of [`TASK_STATES`]).
    pub state: String,
    /// Restarts so far.
    pub restarts: u32,
    /// Runs the OOM killer ended so far.
    pub oom_kills: u32,
    /// What its cgroup counts now; `None` without one.
    pub cgroup: Option<crate::driver::CgroupCounters>,
    /// Its health checks, in spec order: name and status (one of [`CHECK_STATUSES`]).
    pub checks: Vec<(String, String)>,
}

/// The levels a node knows, read when `/metrics` is rendered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeLevels {
    /// Inputs waiting in alloc mailboxes, over all allocs.
    pub queue_depth: usize,
    /// Allocs by client status, in the order of [`CLIENT_STATUSES`].
    pub allocs_by_status: [i64; CLIENT_STATUSES.len()],
    /// What the store did since it was opened.
    pub store: StoreMetrics,
    /// Store writes that failed.
    pub store_write_errors: u64,
    /// Every task of every alloc the node shows, by alloc and task name.
    pub tasks: Vec<TaskLevels>,
}

/// The text formats `/metrics` renders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// The Prometheus text format, version 0.0.4: what a scraper gets unless it asks for
    /// OpenMetrics.
    Prometheus,
    /// OpenMetrics 1.0.0, ending with `# EOF`.
    OpenMetrics,
}

impl Format {
    /// The format an `Accept` header prefers: OpenMetrics when the best quality it gives
    /// `application/openmetrics-text` is above zero and at least that of any other type
    /// it accepts; the Prometheus text format otherwise, and without a header.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Prometheus;
        };
        let (mut openmetrics, mut other) = (0.0_f64, 0.0_f64);
        for range in accept.split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
            let quality = parts
                .filter_map(|param| param.split_once('='))
                .find(|(key, _)| key.trim().eq_ignore_ascii_case("q"))
                .map_or(Some(1.0), |(_, q)| q.trim().parse::<f64>().ok())
                .filter(|q| q.is_finite())
                .unwrap_or(0.0);
            if media == "application/openmetrics-text" {
                openmetrics = openmetrics.max(quality);
            } else if !media.is_empty() {
                other = other.max(quality);
            }
        }
        if openmetrics > 0.0 && openmetrics >= other {
            Format::OpenMetrics
        } else {
            Format::Prometheus
        }
    }

    /// The `Content-Type` of a rendering in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Prometheus => PROMETHEUS_CONTENT_TYPE,
            Format::OpenMetrics => OPENMETRICS_CONTENT_TYPE,
        }
    }
}

/// Bucket bounds of [`RECONCILE_DURATION`], in seconds: a pass is normally well under a
/// millisecond, so the buckets start at 10 µs.
const RECONCILE_BUCKETS: [f64; 12] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05,
    0.25,
];

/// The content type of the OpenMetrics rendering.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of the Prometheus text format's rendering.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A metric family's name as `prometheus-client` takes it: a counter's series carry
/// `_total` after it, and the encoder appends a family's unit.
fn family<'a>(series: &'a str, suffix: &str) -> &'a str {
    series.strip_suffix(suffix).unwrap_or(series)
}

/// The events counted where they happen, and the registry that renders them.
struct Events {
    reconciles: Counter,
    reconcile_duration: Histogram,
    coalesced_updates: Counter,
    task_starts: Counter,
    task_failures: Counter,
    /// `stead_check_results_total` by status, in the order of [`CHECK_RESULT_STATUSES`].
    check_results: [Counter; CHECK_RESULT_STATUSES.len()],
    check_restarts: Counter,
    registry: Registry,
}

impl Events {
    fn new() -> Events {
        let (reconciles, coalesced_updates) = (Counter::default(), Counter::default());
        let (task_starts, task_failures) = (Counter::default(), Counter::default());
        let reconcile_duration = Histogram::new(RECONCILE_BUCKETS);
        let check_restarts = Counter::default();
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
            (TASK_FAILURES, "Tasks that ended failed", &task_failures),
            (
                CHECK_RESTARTS,
                "Tasks restarted because a health check stayed unhealthy",
                &check_restarts,
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
            task_failures,
            check_results,
            check_restarts,
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

    /// The text exposition of every metric in `format`, with the node's levels as `node`
    /// read them just now.
    pub fn render(&self, node: NodeLevels, format: Format) -> Result<String, fmt::Error> {
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
        levels.register_collector(Box::new(TaskFamilies { tasks: node.tasks }));
        let mut text = String::new();
        encode_registry(&mut text, &EVENTS.registry)?;
        encode_registry(&mut text, &levels)?;
        encode_eof(&mut text)?;
        Ok(match format {
            Format::OpenMetrics => text,
            Format::Prometheus => prometheus_text(&text),
        })
    }
}

/// The per-task families, encoded in the order of the node's tasks (by alloc, then task)
/// so that a rendering is stable.
#[derive(Debug)]
struct TaskFamilies {
    tasks: Vec<TaskLevels>,
}

impl TaskFamilies {
    /// Encodes one family: `help` ends with a period, as the registry's do.
    fn encode_family<M: EncodeMetric, L: prometheus_client::encoding::EncodeLabelSet>(
        encoder: &mut DescriptorEncoder<'_>,
        (name, unit): (&str, Option<&Unit>),
        help: &str,
        series: impl Iterator<Item = (L, M)>,
        metric_type: prometheus_client::metrics::MetricType,
    ) -> Result<(), fmt::Error> {
        let mut family = encoder.encode_descriptor(name, help, unit, metric_type)?;
        for (labels, metric) in series {
            metric.encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

impl Collector for TaskFamilies {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), fmt::Error> {
        use prometheus_client::metrics::MetricType;
        let tasks = &self.tasks;
        let ids = |t: &'_ TaskLevels| [("alloc", t.alloc.clone()), ("task", t.task.clone())];
        Self::encode_family(
            &mut encoder,
            (TASK_STATE, None),
            "The task's state: 1 for the current one.",
            tasks.iter().flat_map(|t| {
                TASK_STATES.iter().map(move |state| {
                    let [alloc, task] = ids(t);
                    (
                        [alloc, task, ("state", (*state).to_owned())],
                        ConstGauge::new(i64::from(t.state == *state)),
                    )
                })
            }),
            MetricType::Gauge,
        )?;
        Self::encode_family(
            &mut encoder,
            (family(TASK_RESTARTS, "_total"), None),
            "The task's restarts, by policy or by a user.",
            tasks
                .iter()
                .map(|t| (ids(t), ConstCounter::new(u64::from(t.restarts)))),
            MetricType::Counter,
        )?;
        Self::encode_family(
            &mut encoder,
            (family(TASK_OOM_KILLS, "_total"), None),
            "The task's runs in which the kernel's OOM killer killed a process.",
            tasks
                .iter()
                .map(|t| (ids(t), ConstCounter::new(u64::from(t.oom_kills)))),
            MetricType::Counter,
        )?;
        Self::encode_family(
            &mut encoder,
            (
                family(TASK_CPU_SECONDS, "_seconds_total"),
                Some(&Unit::Seconds),
            ),
            "CPU time of the task's current run, from its cgroup.",
            tasks.iter().filter_map(|t| {
                let cgroup = t.cgroup?;
                Some((ids(t), ConstCounter::new(cgroup.cpu_usec as f64 / 1e6)))
            }),
            MetricType::Counter,
        )?;
        Self::encode_family(
            &mut encoder,
            (family(TASK_MEMORY_BYTES, "_bytes"), Some(&Unit::Bytes)),
            "Memory the task's cgroup is charged now.",
            tasks.iter().filter_map(|t| {
                let bytes = t.cgroup?.memory_bytes?;
                Some((
                    ids(t),
                    ConstGauge::new(i64::try_from(bytes).unwrap_or(i64::MAX)),
                ))
            }),
            MetricType::Gauge,
        )?;
        Self::encode_family(
            &mut encoder,
            (CHECK_STATUS, None),
            "A health check's status: 1 for the current one.",
            tasks.iter().flat_map(|t| {
                t.checks.iter().flat_map(move |(check, current)| {
                    CHECK_STATUSES.iter().map(move |status| {
                        let [alloc, task] = ids(t);
                        (
                            [
                                alloc,
                                task,
                                ("check", check.clone()),
                                ("status", (*status).to_owned()),
                            ],
                            ConstGauge::new(i64::from(current == status)),
                        )
                    })
                })
            }),
            MetricType::Gauge,
        )
    }
}

/// The Prometheus text format (0.0.4) of `openmetrics`, an OpenMetrics rendering of
/// counters, gauges and histograms without exemplars or `_created` series (what
/// [`Metrics::render`] makes). The two formats differ there only in that a counter's
/// family is named after its series (with `_total`), and that 0.0.4 has no `# UNIT` and
/// no `# EOF`; samples are written alike.
fn prometheus_text(openmetrics: &str) -> String {
    let mut text = String::with_capacity(openmetrics.len());
    let mut help: Option<&str> = None;
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = Some(rest);
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let (suffix, kind) = match kind {
                "counter" => ("_total", "counter"),
                "unknown" => ("", "untyped"),
                other => ("", other),
            };
            if let Some((_, help)) = help.take().and_then(|h| h.split_once(' ')) {
                text.push_str(&format!("# HELP {name}{suffix} {help}\n"));
            }
            text.push_str(&format!("# TYPE {name}{suffix} {kind}\n"));
        } else if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        } else {
            text.push_str(line);
            text.push('\n');
        }
    }
    text
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

/// Records `failures` tasks that ended failed.
pub(crate) fn task_failures(failures: u64) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::CgroupCounters;

    /// The node of the rendering tests: `web` with a measured, checked task `server` and
    /// an unmeasured `sidecar`.
    fn node() -> NodeLevels {
        NodeLevels {
            tasks: vec![
                TaskLevels {
                    alloc: "web".to_owned(),
                    task: "server".to_owned(),
                    state: "running".to_owned(),
                    restarts: 2,
                    oom_kills: 1,
                    cgroup: Some(CgroupCounters {
                        cpu_usec: 1_500_000,
                        memory_bytes: Some(4096),
                    }),
                    checks: vec![("alive".to_owned(), "passing".to_owned())],
                },
                TaskLevels {
                    alloc: "web".to_owned(),
                    task: "sidecar".to_owned(),
                    state: "pending".to_owned(),
                    ..TaskLevels::default()
                },
            ],
            ..NodeLevels::default()
        }
    }

    /// The per-task families of a rendering: they come last, and only they do not depend
    /// on what other tests of this process counted.
    fn task_families(text: &str) -> &str {
        let start = text
            .find("# HELP stead_task_state ")
            .expect("task families");
        &text[start..]
    }

    #[test]
    fn format_negotiation_gives_prometheus_text_unless_accept_ranks_openmetrics_highest() {
        let cases = [
            (None, Format::Prometheus),
            (Some(""), Format::Prometheus),
            (Some("*/*"), Format::Prometheus),
            (Some("text/plain"), Format::Prometheus),
            (Some("text/plain;version=0.0.4"), Format::Prometheus),
            (Some("application/openmetrics-text"), Format::OpenMetrics),
            (
                Some("APPLICATION/OpenMetrics-Text; version=1.0.0; charset=utf-8"),
                Format::OpenMetrics,
            ),
            // What Prometheus 2.42 sends.
            (
                Some(
                    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                ),
                Format::OpenMetrics,
            ),
            (
                Some("text/plain;version=0.0.4, application/openmetrics-text;q=0.5"),
                Format::Prometheus,
            ),
            (
                Some("application/openmetrics-text;q=0.5, text/plain;q=0.5"),
                Format::OpenMetrics,
            ),
            (Some("application/openmetrics-text;q=0"), Format::Prometheus),
            (
                Some("application/openmetrics-text;q=nope"),
                Format::Prometheus,
            ),
        ];
        for (accept, expected) in cases {
            assert_eq!(Format::negotiate(accept), expected, "Accept: {accept:?}");
        }
        assert_eq!(
            Format::Prometheus.content_type(),
            "text/plain; version=0.0.4; charset=utf-8"
        );
    }

    #[test]
    fn task_families_render_per_task_in_openmetrics_with_units_and_eof() {
        let text = Metrics::new()
            .render(node(), Format::OpenMetrics)
            .expect("renders");
        assert_eq!(
            task_families(&text),
            r#"# HELP stead_task_state The task's state: 1 for the current one.
# TYPE stead_task_state gauge
stead_task_state{alloc="web",task="server",state="pending"} 0
stead_task_state{alloc="web",task="server",state="running"} 1
stead_task_state{alloc="web",task="server",state="dead"} 0
stead_task_state{alloc="web",task="sidecar",state="pending"} 1
stead_task_state{alloc="web",task="sidecar",state="running"} 0
stead_task_state{alloc="web",task="sidecar",state="dead"} 0
# HELP stead_task_restarts The task's restarts, by policy or by a user.
# TYPE stead_task_restarts counter
stead_task_restarts_total{alloc="web",task="server"} 2
stead_task_restarts_total{alloc="web",task="sidecar"} 0
# HELP stead_task_oom_kills The task's runs in which the kernel's OOM killer killed a process.
# TYPE stead_task_oom_kills counter
stead_task_oom_kills_total{alloc="web",task="server"} 1
stead_task_oom_kills_total{alloc="web",task="sidecar"} 0
# HELP stead_task_cpu_seconds CPU time of the task's current run, from its cgroup.
# TYPE stead_task_cpu_seconds counter
# UNIT stead_task_cpu_seconds seconds
stead_task_cpu_seconds_total{alloc="web",task="server"} 1.5
# HELP stead_task_memory_bytes Memory the task's cgroup is charged now.
# TYPE stead_task_memory_bytes gauge
# UNIT stead_task_memory_bytes bytes
stead_task_memory_bytes{alloc="web",task="server"} 4096
# HELP stead_check_status A health check's status: 1 for the current one.
# TYPE stead_check_status gauge
stead_check_status{alloc="web",task="server",check="alive",status="pending"} 0
stead_check_status{alloc="web",task="server",check="alive",status="passing"} 1
stead_check_status{alloc="web",task="server",check="alive",status="warning"} 0
stead_check_status{alloc="web",task="server",check="alive",status="critical"} 0
# EOF
"#
        );
    }

    #[test]
    fn task_families_render_in_prometheus_text_with_counters_named_by_their_series() {
        let text = Metrics::new()
            .render(node(), Format::Prometheus)
            .expect("renders");
        assert_eq!(
            task_families(&text),
            r#"# HELP stead_task_state The task's state: 1 for the current one.
# TYPE stead_task_state gauge
stead_task_state{alloc="web",task="server",state="pending"} 0
stead_task_state{alloc="web",task="server",state="running"} 1
stead_task_state{alloc="web",task="server",state="dead"} 0
stead_task_state{alloc="web",task="sidecar",state="pending"} 1
stead_task_state{alloc="web",task="sidecar",state="running"} 0
stead_task_state{alloc="web",task="sidecar",state="dead"} 0
# HELP stead_task_restarts_total The task's restarts, by policy or by a user.
# TYPE stead_task_restarts_total counter
stead_task_restarts_total{alloc="web",task="server"} 2
stead_task_restarts_total{alloc="web",task="sidecar"} 0
# HELP stead_task_oom_kills_total The task's runs in which the kernel's OOM killer killed a process.
# TYPE stead_task_oom_kills_total counter
stead_task_oom_kills_total{alloc="web",task="server"} 1
stead_task_oom_kills_total{alloc="web",task="sidecar"} 0
# HELP stead_task_cpu_seconds_total CPU time of the task's current run, from its cgroup.
# TYPE stead_task_cpu_seconds_total counter
stead_task_cpu_seconds_total{alloc="web",task="server"} 1.5
# HELP stead_task_memory_bytes Memory the task's cgroup is charged now.
# TYPE stead_task_memory_bytes gauge
stead_task_memory_bytes{alloc="web",task="server"} 4096
# HELP stead_check_status A health check's status: 1 for the current one.
# TYPE stead_check_status gauge
stead_check_status{alloc="web",task="server",check="alive",status="pending"} 0
stead_check_status{alloc="web",task="server",check="alive",status="passing"} 1
stead_check_status{alloc="web",task="server",check="alive",status="warning"} 0
stead_check_status{alloc="web",task="server",check="alive",status="critical"} 0
"#
        );
    }

    #[test]
    fn every_series_of_the_prometheus_text_follows_the_help_and_type_of_its_own_name() {
        let text = Metrics::new()
            .render(node(), Format::Prometheus)
            .expect("renders");
        let (mut helped, mut typed) = (None::<String>, None::<(String, String)>);
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').expect("a help text");
                assert!(
                    help.ends_with('.') && !help.contains(['\\', '"']),
                    "{line}: a sentence with nothing to escape"
                );
                helped = Some(name.to_owned());
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("a type");
                assert_eq!(helped.as_deref(), Some(name), "{line}: HELP before TYPE");
                if kind == "counter" {
                    assert!(name.ends_with("_total"), "{line}: a counter's family");
                }
                typed = Some((name.to_owned(), kind.to_owned()));
            } else {
                assert!(!line.starts_with('#'), "{line}: not in the 0.0.4 format");
                let series = line.split(['{', ' ']).next().expect("a name");
                let (family, kind) = typed.as_ref().expect("a TYPE first");
                let own = match kind.as_str() {
                    "histogram" => ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|suffix| series.strip_suffix(suffix) == Some(family)),
                    _ => series == family,
                };
                assert!(own, "{line}: outside its family {family}");
            }
        }
    }
}
