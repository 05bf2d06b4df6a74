//! The HTTP API: a thin adapter from requests to the node's commands and snapshots.
//!
//! [`router`] builds the whole API from an [`ApiState`] and does no IO, so tests drive it
//! with `tower::ServiceExt::oneshot`; [`serve_tcp`] and [`serve_unix`] put it on a socket
//! ([`bind_unix`] creates the socket file with mode 0600). Handlers parse, ask the node
//! (which never waits on a worker for reads) and map the answer; every failure is an
//! [`ApiError`], which becomes a JSON [`ErrorBody`](stead_schemas::api::ErrorBody).
//!
//! | endpoint | success | errors |
//! |---|---|---|
//! | `GET /v1/allocs` | 200 `[AllocListItem]` | |
//! | `GET /v1/allocs/{name}` | 200 `AllocStatus` | 404 |
//! | `GET /v1/allocs/{name}/stats` | 200 `AllocStats` | 404 |
//! | `GET /v1/allocs/{name}/logs/{task}` | 200 `text/plain` stream | 400, 404 |
//! | `POST /v1/allocs/{name}/restart` | 202 | 400, 404, 409 |
//! | `POST /v1/allocs/{name}/signal` | 204 | 400, 404, 409, 500 |
//! | `POST /v1/allocs/{name}/stop`, `…/start` | 202 | 404, 409 |
//! | `POST /v1/allocs/{name}/gc` | 200 `GcResult` | 404, 409 |
//! | `POST /v1/gc` | 200 `GcResult` | |
//! | `POST /v1/allocs/{name}/exec/{task}` | 101, then exec frames | 400, 404, 409, 426, 500, 503 |
//! | `GET /v1/node` | 200 `NodeStatus` | |
//! | `GET /v1/health` | 200 `HealthStatus` (`ok` or `degraded`) | |
//! | `GET /metrics` | 200 Prometheus text, or OpenMetrics if `Accept` prefers it | 404 when metrics are off |
//! | `GET /ui`, `GET /ui/allocs/{name}` | 200 the status page ([`ui`]) | 401 (a page asking for the token), 404 |
//!
//! `GET /v1/allocs?usage=true` adds what each alloc's running tasks use now. A request
//! that changes something is refused (403) when a browser sends it from a page of
//! another origin.
//!
//! With a token set, every endpoint but `/v1/health` and the page's assets answers 401 without
//! `Authorization: Bearer <token>`, and `/v1/health` without it says only the status and
//! each part's name and health, not the messages (which name allocs); bodies over
//! [`MAX_BODY_BYTES`] get 413.
//!
//! Serve it on a runtime of its own (one thread is plenty): on the agent's runtime a
//! request waits behind the thousands of worker wake-ups of a mass spec change
//! (`stead-bench api`, 1,000 allocs churning: p99 ~150 ms shared, ~15 ms dedicated).
//! Handlers only read published snapshots and push into mailboxes, so they work from
//! any runtime.

mod error;
mod exec;
mod handlers;
mod logs;
mod serve;
mod ui;
mod usage;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use stead_schemas::Timestamp;
use subtle::ConstantTimeEq;
use thiserror::Error;
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tower_http::limit::RequestBodyLimitLayer;

pub use error::ApiError;
pub use exec::DEFAULT_MAX_EXECS;
pub use logs::DEFAULT_MAX_LOG_STREAMS;
pub use serve::{Connections, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS, ServeLimits};

use crate::driver::Drivers;
use crate::metrics::Metrics;
use crate::node::Node;

/// The largest request body accepted; larger ones get 413.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// How often a followed log is checked for new output.
pub const DEFAULT_LOG_POLL: Duration = Duration::from_millis(250);

/// How long a driver may take to fingerprint before it is reported unhealthy.
pub const FINGERPRINT_TIMEOUT: Duration = Duration::from_secs(2);

/// What every handler can reach; cheap to clone (one `Arc`).
#[derive(Clone)]
pub struct ApiState {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    node: Arc<Node>,
    drivers: Drivers,
    data_dir: PathBuf,
    token: Option<Arc<[u8]>>,
    metrics: Option<Metrics>,
    node_name: String,
    started_at: Timestamp,
    /// The one timer every followed log waits on.
    log_ticker: Arc<logs::LogTicker>,
    /// One permit per followed log stream.
    log_streams: Arc<tokio::sync::Semaphore>,
    max_log_streams: usize,
    /// One permit per exec session.
    execs: Arc<tokio::sync::Semaphore>,
    max_execs: usize,
    /// The previous measurement of each alloc's use, for CPU percent.
    usage: Arc<usage::UsageSampler>,
    shutdown: CancellationToken,
}

impl ApiState {
    /// The API of `node`, whose drivers are `drivers` and whose alloc directories are
    /// under `data_dir/allocs`; no token, no metrics, named after the host.
    pub fn new(node: Arc<Node>, drivers: Drivers, data_dir: impl Into<PathBuf>) -> Self {
        let started_at = node.clock().now();
        ApiState {
            inner: Arc::new(Inner {
                node,
                drivers,
                data_dir: data_dir.into(),
                token: None,
                metrics: None,
                node_name: crate::host::host_name(),
                started_at,
                log_ticker: Arc::new(logs::LogTicker::new(DEFAULT_LOG_POLL)),
                log_streams: Arc::new(tokio::sync::Semaphore::new(DEFAULT_MAX_LOG_STREAMS)),
                max_log_streams: DEFAULT_MAX_LOG_STREAMS,
                execs: Arc::new(tokio::sync::Semaphore::new(DEFAULT_MAX_EXECS)),
                max_execs: DEFAULT_MAX_EXECS,
                usage: Arc::default(),
                shutdown: CancellationToken::new(),
            }),
        }
    }

    fn edit(mut self, change: impl FnOnce(&mut Inner)) -> Self {
        change(Arc::make_mut(&mut self.inner));
        self
    }

    /// Requires `Authorization: Bearer <token>` on every endpoint but `/v1/health`;
    /// `None` (or an empty token) requires nothing.
    pub fn with_token(self, token: Option<String>) -> Self {
        self.edit(|inner| {
            inner.token = token
                .filter(|t| !t.is_empty())
                .map(|t| Arc::from(t.into_bytes()));
        })
    }

    /// Serves `/metrics` from `metrics`.
    pub fn with_metrics(self, metrics: Metrics) -> Self {
        self.edit(|inner| inner.metrics = Some(metrics))
    }

    /// Names the node `name` in `GET /v1/node` (instead of the host name).
    pub fn with_node_name(self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.edit(|inner| inner.node_name = name)
    }

    /// Checks followed logs for new output every `period` (default [`DEFAULT_LOG_POLL`]),
    /// all on one timer.
    pub fn with_log_poll(self, period: Duration) -> Self {
        self.edit(|inner| inner.log_ticker = Arc::new(logs::LogTicker::new(period)))
    }

    /// Follows at most `limit` log streams at once (default [`DEFAULT_MAX_LOG_STREAMS`];
    /// at least 1); more get 503.
    pub fn with_max_log_streams(self, limit: usize) -> Self {
        let limit = limit.max(1);
        self.edit(|inner| {
            inner.max_log_streams = limit;
            inner.log_streams = Arc::new(tokio::sync::Semaphore::new(limit));
        })
    }

    /// Runs at most `limit` exec sessions at once (default [`DEFAULT_MAX_EXECS`]; at
    /// least 1); more get 503.
    pub fn with_max_execs(self, limit: usize) -> Self {
        let limit = limit.max(1);
        self.edit(|inner| {
            inner.max_execs = limit;
            inner.execs = Arc::new(tokio::sync::Semaphore::new(limit));
        })
    }

    /// Cancelled to end the API: followed log streams finish, exec sessions' commands are
    /// killed, so a graceful shutdown of
    /// the server does not wait on them. Pass `token.cancelled_owned()` as the shutdown
    /// future of [`serve_tcp`] and [`serve_unix`], then cancel it to stop.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.inner.shutdown.clone()
    }

    pub(crate) fn node(&self) -> &Node {
        &self.inner.node
    }

    pub(crate) fn node_arc(&self) -> Arc<Node> {
        Arc::clone(&self.inner.node)
    }
}

/// The whole API over `state`; no IO until it is served.
pub fn router(state: ApiState) -> Router {
    let guarded = Router::new()
        .route("/v1/allocs", get(handlers::list_allocs))
        .route("/v1/allocs/{name}", get(handlers::alloc_status))
        .route("/v1/allocs/{name}/stats", get(handlers::alloc_stats))
        .route("/v1/allocs/{name}/logs/{task}", get(logs::alloc_logs))
        .route("/v1/allocs/{name}/restart", post(handlers::restart))
        .route("/v1/allocs/{name}/signal", post(handlers::signal))
        .route("/v1/allocs/{name}/stop", post(handlers::stop))
        .route("/v1/allocs/{name}/start", post(handlers::start))
        .route("/v1/allocs/{name}/gc", post(handlers::gc_one))
        .route("/v1/gc", post(handlers::gc_all))
        .route("/v1/allocs/{name}/exec/{task}", post(exec::alloc_exec))
        .route("/v1/node", get(handlers::node_status))
        .route("/metrics", get(handlers::metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    Router::new()
        .merge(guarded)
        .merge(ui::routes())
        .route("/v1/health", get(handlers::health))
        .fallback(route_not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(RequestBodyLimitLayer::new(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(state.clone(), suggest_names))
        .layer(middleware::from_fn(same_origin))
        .layer(middleware::from_fn(json_errors))
        .with_state(state)
}

/// Refuses (403) a request that changes something when a browser sent it from a page of
/// another origin: with no token set, any web page the operator visits could otherwise
/// post to the agent on loopback. Browsers send `Origin` on every such request; the CLI
/// and other programs send none, and are not affected.
async fn same_origin(request: Request, next: Next) -> Result<Response, ApiError> {
    use axum::http::Method;
    if matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    ) {
        return Ok(next.run(request).await);
    }
    let headers = request.headers();
    if let Some(origin) = headers.get(header::ORIGIN) {
        let host = headers
            .get(header::HOST)
            .and_then(|host| host.to_str().ok());
        let authority = origin
            .to_str()
            .ok()
            .and_then(|origin| origin.split_once("://"))
            .map(|(_, authority)| authority);
        if host.is_none() || authority != host {
            return Err(ApiError::CrossOrigin {
                origin: String::from_utf8_lossy(origin.as_bytes()).into_owned(),
            });
        }
    }
    Ok(next.run(request).await)
}

/// A JSON response with `status`.
pub(crate) fn json_response(status: StatusCode, body: &impl Serialize) -> Response {
    match serde_json::to_vec(body) {
        Ok(bytes) => (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            bytes,
        )
            .into_response(),
        // Our DTOs have string keys and no fallible fields; this is a bug, not a request.
        Err(error) => {
            tracing::error!(error = %error, "cannot serialize a response");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}

async fn route_not_found(request: Request) -> ApiError {
    ApiError::RouteNotFound {
        path: request.uri().path().to_owned(),
    }
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::MethodNotAllowed {
        method: request.method().to_string(),
        path: request.uri().path().to_owned(),
    }
}

/// 401 unless the request carries the configured bearer token.
async fn require_token(
    State(state): State<ApiState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    state.authorize(request.headers())?;
    Ok(next.run(request).await)
}

impl ApiState {
    /// Whether `headers` carry the configured bearer token (always, when none is
    /// configured); compares in constant time.
    pub(crate) fn authorize(&self, headers: &axum::http::HeaderMap) -> Result<(), ApiError> {
        let Some(expected) = &self.inner.token else {
            return Ok(());
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| {
                let (scheme, token) = value.split_once(' ')?;
                scheme
                    .eq_ignore_ascii_case("bearer")
                    .then(|| token.trim().as_bytes())
            });
        match given {
            None => Err(ApiError::Unauthorized { missing: true }),
            Some(token) if bool::from(token.ct_eq(expected)) => Ok(()),
            Some(_) => Err(ApiError::Unauthorized { missing: false }),
        }
    }
}

/// Gives responses made outside our handlers (the body limit's 413) the JSON error
/// shape, and logs every 5xx with its message but 503: the agent declining by design
/// (shutting down, or over a cap) is no failure, and a client repeating such requests
/// must not flood the log.
async fn json_errors(request: Request, next: Next) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    let status = response.status();
    if status.is_server_error() && status != StatusCode::SERVICE_UNAVAILABLE {
        let message = response
            .extensions()
            .get::<error::InternalErrorMessage>()
            .map_or("", |m| m.0.as_str());
        tracing::error!(%method, %path, status = status.as_u16(), message, "request failed");
    }
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if status == StatusCode::PAYLOAD_TOO_LARGE && !is_json {
        return ApiError::BodyTooLarge {
            limit: MAX_BODY_BYTES,
        }
        .into_response();
    }
    response
}

/// Adds "did you mean" to a 404 for an alloc or a task that does not exist, naming the
/// closest existing name (`stead_schemas::diagnostic::closest`), so that every endpoint
/// and every client command gets it.
async fn suggest_names(State(state): State<ApiState>, request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let Some(missing) = response.extensions_mut().remove::<error::MissingName>() else {
        return response;
    };
    let suggestion = match &missing.task {
        None => {
            let statuses = state.node().statuses();
            let names: Vec<&str> = statuses.iter().map(|s| s.name.as_str()).collect();
            stead_schemas::diagnostic::closest(&missing.alloc, names).map(str::to_owned)
        }
        Some(task) => state.node().status(&missing.alloc).and_then(|status| {
            stead_schemas::diagnostic::closest(task, status.tasks.keys().map(String::as_str))
                .map(str::to_owned)
        }),
    };
    let Some(suggestion) = suggestion else {
        return response;
    };
    let mut body = missing.body;
    body.message = format!("{}; did you mean {suggestion:?}?", body.message);
    json_response(response.status(), &body)
}

/// Why the API could not be put on a socket.
#[derive(Debug, Error)]
pub enum ServeError {
    /// Binding the TCP address failed.
    #[error("cannot listen on {addr}")]
    BindTcp {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Creating the unix socket failed.
    #[error("cannot listen on unix socket {}", path.display())]
    BindUnix {
        /// The socket's path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Something that is not a socket is in the way of the unix socket.
    #[error("{} exists and is not a socket", path.display())]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// Serving stopped on an IO error.
    #[error("serving the api failed")]
    Serve(#[source] std::io::Error),
}

/// Listens on TCP address `addr` (`127.0.0.1:4750`; port 0 picks a free port).
pub async fn bind_tcp(addr: &str) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::BindTcp {
            addr: addr.to_owned(),
            source,
        })
}

/// Listens on a unix socket at `path`, created with mode 0600 (only the agent's user may
/// connect). A stale socket left by an earlier agent is replaced; any other file is not.
/// Call from within a tokio runtime.
///
/// The socket is bound under a temporary name, restricted, then renamed into place, so
/// it is never reachable with wider permissions.
pub fn bind_unix(path: &Path) -> Result<UnixListener, ServeError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};

    let bind_error = |source| ServeError::BindUnix {
        path: path.to_owned(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            std::fs::remove_file(path).map_err(bind_error)?;
        }
        Ok(_) => {
            return Err(ServeError::NotASocket {
                path: path.to_owned(),
            });
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(bind_error(error)),
    }
    let file_name = path
        .file_name()
        .ok_or_else(|| bind_error(std::io::ErrorKind::InvalidInput.into()))?;
    let mut temporary_name = std::ffi::OsString::from(".");
    temporary_name.push(file_name);
    temporary_name.push(format!(".{}.tmp", std::process::id()));
    let temporary = path.with_file_name(temporary_name);
    // A leftover of a crashed earlier attempt with our pid; nothing else uses the name.
    let _ = std::fs::remove_file(&temporary);
    let listener = std::os::unix::net::UnixListener::bind(&temporary).map_err(bind_error)?;
    let placed = std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&temporary, path))
        .and_then(|()| listener.set_nonblocking(true));
    if let Err(error) = placed {
        let _ = std::fs::remove_file(&temporary);
        return Err(bind_error(error));
    }
    UnixListener::from_std(listener).map_err(bind_error)
}

/// Serves `router` on `listener` within `connections`' bounds until `shutdown` resolves,
/// then finishes the requests in flight.
pub async fn serve_tcp(
    listener: TcpListener,
    router: Router,
    connections: Connections,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    serve::serve(listener, router, connections, shutdown).await
}

/// Serves `router` on the unix socket `listener` within `connections`' bounds (shared
/// with the TCP listener's when both take the same) until `shutdown` resolves, then
/// finishes the requests in flight.
pub async fn serve_unix(
    listener: UnixListener,
    router: Router,
    connections: Connections,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    serve::serve(listener, router, connections, shutdown).await
}
