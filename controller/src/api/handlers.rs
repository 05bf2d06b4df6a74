//! The handlers of every endpoint but the logs: parse, ask the node, map the answer.

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use stead_schemas::api::{
    AllocEvent, AllocListItem, AllocStats, AllocsQuery, CgroupStats, ComponentHealth,
    DeviceGroupStats, DeviceStatsEntry, DriverStatus, GcRefusal, GcResult, HealthStatus,
    NodeResources, NodeStatus, RestartRequest, SignalRequest, TaskStats,
};
use stead_schemas::spec::{Name, Signal};
use stead_schemas::status::AllocStatus;

use super::usage::UsageSampler;
use super::{ApiError, ApiState, FINGERPRINT_TIMEOUT, MAX_BODY_BYTES, json_response};
use crate::driver::{Fingerprint, Health};
use crate::metrics::{CLIENT_STATUSES, Format};

/// `GET /v1/allocs`: every alloc, by name; with `?usage=true`, what each uses now.
pub(super) async fn list_allocs(
    State(state): State<ApiState>,
    query: Result<Query<AllocsQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|source| ApiError::InvalidQuery { source })?;
    let statuses = state.node().statuses();
    let mut usage = match query.usage {
        true => UsageSampler::measure(&state, &statuses, true).await,
        false => Default::default(),
    };
    let items: Vec<AllocListItem> = statuses
        .iter()
        .map(|status| {
            let mut item = list_item(status);
            item.usage = usage.remove(&status.name);
            item
        })
        .collect();
    Ok(json_response(StatusCode::OK, &items))
}

/// The newest event of any task of `status`.
pub(super) fn last_event(status: &AllocStatus) -> Option<AllocEvent> {
    status
        .tasks
        .iter()
        .filter_map(|(task, shown)| shown.events.last().map(|event| (task, event)))
        .max_by_key(|(_, event)| event.time)
        .map(|(task, event)| AllocEvent {
            task: task.clone(),
            event_type: event.event_type.clone(),
            time: event.time,
            message: event.message.clone(),
        })
}

pub(super) fn list_item(status: &AllocStatus) -> AllocListItem {
    let count = |pred: &dyn Fn(&stead_schemas::status::TaskStatus) -> bool| {
        u32::try_from(status.tasks.values().filter(|t| pred(t)).count()).unwrap_or(u32::MAX)
    };
    AllocListItem {
        name: status.name.clone(),
        id: status.id.clone(),
        desired_status: status.desired_status.clone(),
        client_status: status.client_status.clone(),
        tasks: count(&|_| true),
        running_tasks: count(&|t| t.state == "running"),
        restarts: status.tasks.values().map(|t| t.restarts).sum(),
        modified_at: status
            .tasks
            .values()
            .filter_map(|t| t.events.last().map(|e| e.time))
            .max(),
        spec_error: status.spec_error.is_some(),
        last_event: last_event(status),
        usage: None,
    }
}

/// `GET /v1/allocs/{name}`: the alloc's status document.
pub(super) async fn alloc_status(
    State(state): State<ApiState>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let status = state
        .node()
        .full_status(&name)
        .ok_or(ApiError::AllocNotFound { name })?;
    Ok(json_response(StatusCode::OK, status.as_ref()))
}

/// `GET /v1/allocs/{name}/stats`: each running task's resource use, measured now by its
/// driver (each within [`FINGERPRINT_TIMEOUT`]). A task that is not running, whose driver
/// does not measure tasks, or whose measurement failed is left out.
pub(super) async fn alloc_stats(
    State(state): State<ApiState>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let stats = measure_stats(&state, &name)
        .await
        .ok_or(ApiError::AllocNotFound { name })?;
    Ok(json_response(StatusCode::OK, &stats))
}

/// What alloc `name`'s running tasks use, measured now by their drivers; `None` when
/// there is no such alloc.
pub(super) async fn measure_stats(state: &ApiState, name: &str) -> Option<AllocStats> {
    let (Some(status), Some(handles)) =
        (state.node().status(name), state.node().task_handles(name))
    else {
        return None;
    };
    let mut set = tokio::task::JoinSet::new();
    for (task, handle) in handles.iter() {
        let Some(driver) = state.inner.drivers.get(handle.driver) else {
            continue;
        };
        let (task, handle) = (task.to_string(), handle.clone());
        set.spawn(async move {
            let measured = tokio::time::timeout(FINGERPRINT_TIMEOUT, driver.stats(&handle)).await;
            (task, measured)
        });
    }
    let mut tasks = BTreeMap::new();
    while let Some(joined) = set.join_next().await {
        let Ok((task, measured)) = joined else {
            continue;
        };
        match measured {
            Ok(Ok(Some(stats))) => {
                let cpu_seconds = if stats.ticks_per_second == 0 {
                    0.0
                } else {
                    stats.cpu_ticks as f64 / stats.ticks_per_second as f64
                };
                tasks.insert(
                    task,
                    TaskStats {
                        cpu_percent: stats.cpu_percent,
                        cpu_seconds,
                        rss_bytes: stats.rss_bytes,
                        processes: stats.processes,
                        cgroup: stats.cgroup.map(|c| CgroupStats {
                            memory_bytes: c.memory_bytes,
                            memory_peak_bytes: c.memory_peak_bytes,
                            memory_limit_bytes: c.memory_limit_bytes,
                            cpu_seconds: c.cpu_usec as f64 / 1e6,
                            cpu_throttled_seconds: c.throttled_usec.map(|us| us as f64 / 1e6),
                            pids: c.pids,
                            pids_limit: c.pids_limit,
                            oom_kills: c.oom_kills,
                        }),
                    },
                );
            }
            Ok(Ok(None)) => {}
            Ok(Err(error)) => {
                tracing::debug!(alloc = %name, task = %task, error = %error, "no stats for the task");
            }
            Err(_) => {
                tracing::warn!(alloc = %name, task = %task, "the driver did not report stats in time");
            }
        }
    }
    let (task_devices, device_groups) = device_stats(state, &status.name).await;
    Some(AllocStats {
        name: status.name.clone(),
        id: status.id.clone(),
        time: state.node().clock().now(),
        tasks,
        task_devices,
        device_groups,
    })
}

/// The alloc's device stats, per task and per group, looked up by instance.
async fn device_stats(
    state: &ApiState,
    name: &str,
) -> (
    BTreeMap<String, Vec<DeviceStatsEntry>>,
    Vec<DeviceGroupStats>,
) {
    let Ok(name) = name.parse() else {
        return Default::default();
    };
    let manager = state.node().devices();
    let held = manager.held(&name);
    if held.is_empty() {
        return Default::default();
    }
    let stats = manager.alloc_stats(&held).await;
    let tasks = stats
        .tasks
        .into_iter()
        .map(|(task, instances)| {
            let entries = instances
                .into_iter()
                .map(|i| DeviceStatsEntry {
                    group: i.device.group.to_string(),
                    id: i.device.instance.to_string(),
                    stats: i.stats,
                })
                .collect();
            (task.to_string(), entries)
        })
        .collect();
    let groups = stats
        .groups
        .into_iter()
        .map(|(group, instances)| DeviceGroupStats {
            group: group.to_string(),
            instances: instances
                .into_iter()
                .map(|(id, stats)| DeviceStatsEntry {
                    group: group.to_string(),
                    id: id.to_string(),
                    stats,
                })
                .collect(),
        })
        .collect();
    (tasks, groups)
}

/// Parses a JSON body; an empty body is `T::default()` when `empty` is given.
pub(super) fn parse_body<T: DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    empty: Option<T>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::BodyTooLarge {
                limit: MAX_BODY_BYTES,
            }
        } else {
            ApiError::UnreadableBody { source: rejection }
        }
    })?;
    if bytes.iter().all(u8::is_ascii_whitespace)
        && let Some(value) = empty
    {
        return Ok(value);
    }
    serde_json::from_slice(&bytes).map_err(|source| ApiError::InvalidBody { source })
}

/// `POST /v1/allocs/{name}/restart`, body `{"task": NAME}` or empty for every running
/// task: 202 once the alloc's worker accepted it.
pub(super) async fn restart(
    State(state): State<ApiState>,
    Path(name): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let request: RestartRequest = parse_body(body, Some(RestartRequest::default()))?;
    let task = match &request.task {
        Some(task) => Some(task_name(&name, task)?),
        None => None,
    };
    state
        .node()
        .restart(&name, task)
        .await
        .map_err(|error| ApiError::from_command(error, &name, request.task.as_deref()))?;
    Ok(StatusCode::ACCEPTED)
}

/// `POST /v1/allocs/{name}/stop`: 202; the alloc stops and stays stopped, whatever its
/// spec's revisions, until `POST /v1/allocs/{name}/start`.
pub(super) async fn stop(
    State(state): State<ApiState>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    set_stopped(&state, &name, true).await
}

/// `POST /v1/allocs/{name}/start`: 202; takes a user's stop back, so the alloc runs as
/// its spec says; 409 when the spec itself says stop, or is gone.
pub(super) async fn start(
    State(state): State<ApiState>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    set_stopped(&state, &name, false).await
}

async fn set_stopped(state: &ApiState, name: &str, stopped: bool) -> Result<StatusCode, ApiError> {
    state
        .node()
        .set_stopped(name, stopped)
        .await
        .map_err(|error| ApiError::from_command(error, name, None))?;
    Ok(StatusCode::ACCEPTED)
}

/// How many allocs a user's garbage collection destroys at once.
const USER_GC_PARALLEL: usize = 4;

/// `POST /v1/gc`: destroys now every terminal alloc that no spec declares; 200 `GcResult`.
pub(super) async fn gc_all(State(state): State<ApiState>) -> Response {
    let report = crate::gc::collect_now(&state.node_arc(), USER_GC_PARALLEL).await;
    json_response(StatusCode::OK, &gc_result(report))
}

/// `POST /v1/allocs/{name}/gc`: destroys alloc `name` now; 200 `GcResult`, or 409 when it
/// runs or a spec declares it.
pub(super) async fn gc_one(
    State(state): State<ApiState>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let alloc: Name = name
        .parse()
        .map_err(|_| ApiError::AllocNotFound { name: name.clone() })?;
    state
        .node()
        .collect(&alloc)
        .await
        .map_err(|error| ApiError::from_command(error, &name, None))?;
    Ok(json_response(
        StatusCode::OK,
        &GcResult {
            collected: vec![name],
            refused: Vec::new(),
        },
    ))
}

fn gc_result(report: crate::gc::GcReport) -> GcResult {
    GcResult {
        collected: report.collected.iter().map(ToString::to_string).collect(),
        refused: report
            .refused
            .iter()
            .map(|(name, error)| GcRefusal {
                name: name.to_string(),
                reason: crate::errors::error_chain(error),
            })
            .collect(),
    }
}

/// `POST /v1/allocs/{name}/signal`, body `{"task": NAME, "signal": "SIGHUP"}`: 204 once
/// the driver sent it.
pub(super) async fn signal(
    State(state): State<ApiState>,
    Path(name): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let request: SignalRequest = parse_body(body, None)?;
    if state.node().status(&name).is_none() {
        return Err(ApiError::AllocNotFound { name });
    }
    let signal: Signal = request
        .signal
        .parse()
        .map_err(|reason| ApiError::InvalidSignal { reason })?;
    let task = task_name(&name, &request.task)?;
    state
        .node()
        .signal(&name, task, signal)
        .await
        .map_err(|error| ApiError::from_command(error, &name, Some(&request.task)))?;
    Ok(StatusCode::NO_CONTENT)
}

/// A task name from a request; a name that is not even valid names no task.
pub(super) fn task_name(alloc: &str, task: &str) -> Result<Name, ApiError> {
    task.parse().map_err(|_| ApiError::TaskNotFound {
        alloc: alloc.to_owned(),
        task: task.to_owned(),
    })
}

/// Every driver's fingerprint, taken concurrently, each within [`FINGERPRINT_TIMEOUT`].
pub(super) async fn fingerprints(state: &ApiState) -> BTreeMap<String, Fingerprint> {
    let mut set = tokio::task::JoinSet::new();
    for (kind, driver) in state.inner.drivers.iter() {
        let driver = driver.clone();
        set.spawn(async move {
            let fingerprint =
                match tokio::time::timeout(FINGERPRINT_TIMEOUT, driver.fingerprint()).await {
                    Ok(fingerprint) => fingerprint,
                    Err(_) => Fingerprint {
                        health: Health::Unhealthy,
                        description: format!(
                            "fingerprint did not answer within {}s",
                            FINGERPRINT_TIMEOUT.as_secs()
                        ),
                        attributes: BTreeMap::new(),
                    },
                };
            (kind.as_str().to_owned(), fingerprint)
        });
    }
    let mut all = BTreeMap::new();
    while let Some(joined) = set.join_next().await {
        // A panicking fingerprint is left out; health then lacks that driver.
        if let Ok((name, fingerprint)) = joined {
            all.insert(name, fingerprint);
        }
    }
    all
}

/// `GET /v1/node`: the node, its drivers and devices, and its allocs by status.
pub(super) async fn node_status(State(state): State<ApiState>) -> Response {
    json_response(StatusCode::OK, &node_document(&state).await)
}

/// The node's status document, with its drivers' fingerprints taken now.
pub(super) async fn node_document(state: &ApiState) -> NodeStatus {
    let mut allocs: BTreeMap<String, u32> = CLIENT_STATUSES
        .iter()
        .map(|s| ((*s).to_owned(), 0))
        .collect();
    for status in state.node().statuses() {
        *allocs.entry(status.client_status.clone()).or_default() += 1;
    }
    let drivers = fingerprints(state)
        .await
        .into_iter()
        .map(|(name, fingerprint)| {
            let status = DriverStatus {
                health: fingerprint.health.as_str().to_owned(),
                description: fingerprint.description,
                attributes: fingerprint.attributes,
            };
            (name, status)
        })
        .collect();
    NodeStatus {
        name: state.inner.node_name.clone(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        started_at: state.inner.started_at,
        time: state.node().clock().now(),
        allocs,
        drivers,
        devices: state.node().devices().node_devices(),
        device_plugins: state.node().devices().plugin_statuses(),
        resources: Some({
            let host = crate::host::HostResources::get();
            let (reserved_cpu_mhz, reserved_memory_mb) = state.node().reserved();
            NodeResources {
                cpu_cores: host.cores,
                cpu_mhz_per_core: host.mhz_per_core,
                cpu_mhz: host.total_mhz(),
                memory_mb: host.memory_mb,
                reserved_cpu_mhz,
                reserved_memory_mb,
            }
        }),
    }
}

/// `GET /v1/health`: which parts work. Always 200 while the API answers: the body says
/// `degraded` and which part, so a liveness probe does not restart an agent whose tasks
/// run fine because one driver is broken. Without the API's token (when one is set) it
/// leaves out the parts' messages, which name allocs: a probe needs no secret, and
/// learns nothing but the status.
pub(super) async fn health(State(state): State<ApiState>, headers: HeaderMap) -> Response {
    let mut components = BTreeMap::new();
    let store = state.node().store_health();
    let message = match (store.behind.len(), store.failures) {
        _ if !store.lost.is_empty() => format!("degraded: {}", store.lost.join("; ")),
        (0, 0) => "every write succeeded".to_owned(),
        (0, failures) => {
            format!("writes succeed; {failures} failed since the agent started and were retried")
        }
        (behind, failures) => format!(
            "degraded: the state of {behind} alloc(s) is not stored yet ({}), retrying with backoff; {failures} writes failed",
            store.behind.join(", ")
        ),
    };
    components.insert(
        "store".to_owned(),
        ComponentHealth {
            healthy: store.is_healthy(),
            message: Some(message),
        },
    );
    let unreadable = state.node().source_unreadable();
    components.insert(
        "source".to_owned(),
        ComponentHealth {
            healthy: unreadable.is_empty(),
            message: Some(match unreadable.is_empty() {
                true => "every entry of the specs dir is read".to_owned(),
                false => format!("degraded: cannot read {}", unreadable.join("; ")),
            }),
        },
    );
    if let Some(fleet) = state.node().fleet_health() {
        components.insert(
            "fleet".to_owned(),
            ComponentHealth {
                healthy: fleet.is_none(),
                message: Some(match fleet {
                    None => "etcd is reached; desired state and status are in step".to_owned(),
                    Some(why) => format!("degraded: {why}"),
                }),
            },
        );
    }
    for (name, fingerprint) in fingerprints(&state).await {
        components.insert(
            format!("driver.{name}"),
            ComponentHealth {
                healthy: fingerprint.health == Health::Healthy,
                message: Some(format!(
                    "{}: {}",
                    fingerprint.health, fingerprint.description
                )),
            },
        );
    }
    let healthy = components.values().all(|c| c.healthy);
    // Still 200: a liveness probe must not kill an agent that is stopping its tasks.
    let status = if state.node().is_shutting_down() {
        "shutting down"
    } else if healthy {
        "ok"
    } else {
        "degraded"
    };
    if state.authorize(&headers).is_err() {
        for component in components.values_mut() {
            component.message = None;
        }
    }
    let body = HealthStatus {
        status: status.to_owned(),
        components,
    };
    json_response(StatusCode::OK, &body)
}

/// `GET /metrics`: the Prometheus text format (0.0.4), or OpenMetrics when `Accept`
/// prefers it. Rendered on the blocking pool: it reads each running task's cgroup counters.
pub(super) async fn metrics(
    State(state): State<ApiState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let metrics = *state
        .inner
        .metrics
        .as_ref()
        .ok_or(ApiError::MetricsDisabled)?;
    let format = Format::negotiate(
        headers
            .get(header::ACCEPT)
            .and_then(|accept| accept.to_str().ok()),
    );
    let node = state.node_arc();
    let rendered =
        tokio::task::spawn_blocking(move || metrics.render(node.metrics_levels(), format))
            .await
            .map_err(|joined| match joined.try_into_panic() {
                Ok(panic) => std::panic::resume_unwind(panic),
                Err(_) => ApiError::MetricsInterrupted,
            })?;
    let text = rendered.map_err(|source| ApiError::Metrics { source })?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(format.content_type()),
        )],
        text,
    )
        .into_response())
}
