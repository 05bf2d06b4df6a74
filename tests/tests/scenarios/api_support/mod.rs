//! What the API and CLI tests share: an agent in-process (node, mock driver, in-memory
//! store, API state), served on real sockets when a test wants them, and a way to call
//! any endpoint the same way whatever the transport.
#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use stead_controller::api::{self, ApiState};
use stead_controller::clock::Clock;
use stead_controller::driver::mock::MockDriver;
use stead_controller::driver::{Driver, Drivers};
use stead_controller::node::{Node, NodeConfig};
use stead_controller::store::MemoryStore;
use stead_schemas::{Timestamp, ValidSpec};
use tower::ServiceExt;

/// 2026-11-22T00:00:00Z: fixed, so times in snapshots are stable.
pub const START: Duration = Duration::from_secs(1_795_305_600);
/// Far longer than any scenario needs.
pub const DEADLINE: Duration = Duration::from_secs(600);

/// An agent in-process: its node, mock driver, data dir and API state.
pub struct TestAgent {
    pub node: Arc<Node>,
    pub mock: MockDriver,
    pub clock: Clock,
    pub state: ApiState,
    pub data_dir: tempfile::TempDir,
}

/// An agent whose clock starts at [`START`] (under paused time it stays exact).
pub fn agent() -> TestAgent {
    agent_with(Clock::starting_at(Timestamp::from_since_epoch(START)))
}

/// An agent reading time from `clock`.
pub fn agent_with(clock: Clock) -> TestAgent {
    let mock = MockDriver::new(clock);
    let drivers = Drivers::new([Arc::new(mock.clone()) as Arc<dyn Driver>]);
    let config = NodeConfig {
        seed: Some(7),
        ..NodeConfig::default()
    };
    let node = Arc::new(Node::new(
        config,
        drivers.clone(),
        Arc::new(MemoryStore::default()),
        clock,
    ));
    let data_dir = tempfile::tempdir().expect("a temporary data dir");
    let state = ApiState::new(node.clone(), drivers, data_dir.path())
        .with_node_name("test-node")
        .with_log_poll(Duration::from_millis(20));
    TestAgent {
        node,
        mock,
        clock,
        state,
        data_dir,
    }
}

/// A valid spec from YAML (panics with the diagnostics otherwise).
pub fn spec(yaml: &str) -> ValidSpec {
    let file = stead_schemas::parse_spec_file(Path::new("test.yaml"), yaml);
    assert!(file.is_valid(), "{:#?}", file.all_diagnostics());
    file.specs().next().expect("one spec").clone()
}

/// An alloc named `name` whose `spec:` body is `body` (indented by two).
pub fn alloc(name: &str, body: &str) -> ValidSpec {
    spec(&format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n{body}"
    ))
}

/// One mock task `name` that runs until killed.
pub fn forever(task: &str) -> String {
    format!("  tasks:\n    - {{name: {task}, driver: mock, config: {{}}}}\n")
}

impl TestAgent {
    /// Waits until `condition` holds for the node, failing with every status otherwise.
    pub async fn until(&self, what: &str, condition: impl Fn(&Node) -> bool) {
        let held = self.node.wait_until(DEADLINE, condition).await;
        assert!(
            held,
            "timed out waiting until {what}: {:#?}",
            self.node.statuses()
        );
    }

    /// Waits until every task of alloc `name` runs.
    pub async fn until_running(&self, name: &str) {
        self.until(&format!("{name} runs"), |node| {
            node.status(name).is_some_and(|s| {
                s.client_status == "running" && s.tasks.values().all(|t| t.state == "running")
            })
        })
        .await;
    }

    /// The directory of alloc `name`'s log files.
    pub fn log_dir(&self, name: &str) -> PathBuf {
        let id = self
            .node
            .status(name)
            .expect("alloc is published")
            .id
            .clone();
        let dir = self
            .data_dir
            .path()
            .join("allocs")
            .join(id)
            .join("alloc")
            .join("logs");
        std::fs::create_dir_all(&dir).expect("log dir");
        dir
    }
}

/// A running server; dropping it does not stop it, [`Served::stop`] does.
pub struct Served {
    pub address: String,
    state: ApiState,
    join: tokio::task::JoinHandle<()>,
}

impl Served {
    /// Stops accepting, ends followed logs, and waits for the server to finish.
    pub async fn stop(self) {
        self.state.shutdown_token().cancel();
        tokio::time::timeout(Duration::from_secs(10), self.join)
            .await
            .expect("the server stops")
            .expect("the server task did not panic");
    }
}

/// Serves `state` on 127.0.0.1 at a free port.
pub async fn serve_tcp(state: &ApiState) -> Served {
    serve_tcp_within(state, api::Connections::new(api::ServeLimits::default())).await
}

/// Serves `state` on a loopback port within `connections`' bounds.
pub async fn serve_tcp_within(state: &ApiState, connections: api::Connections) -> Served {
    let listener = api::bind_tcp("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("bound address").to_string();
    let shutdown = state.shutdown_token().cancelled_owned();
    let router = api::router(state.clone());
    let join = tokio::spawn(async move {
        api::serve_tcp(listener, router, connections, shutdown)
            .await
            .expect("serving");
    });
    Served {
        address,
        state: state.clone(),
        join,
    }
}

/// Serves `state` on a unix socket at `path`; the address is `unix:<path>`.
pub async fn serve_unix(state: &ApiState, path: &Path) -> Served {
    let listener = api::bind_unix(path).expect("bind");
    let shutdown = state.shutdown_token().cancelled_owned();
    let router = api::router(state.clone());
    let join = tokio::spawn(async move {
        api::serve_unix(
            listener,
            router,
            api::Connections::new(Default::default()),
            shutdown,
        )
        .await
        .expect("serving");
    });
    Served {
        address: format!("unix:{}", path.display()),
        state: state.clone(),
        join,
    }
}

/// How a test reaches the API.
pub enum Transport {
    /// `tower::ServiceExt::oneshot` on the router: no sockets.
    InProcess(ApiState),
    /// HTTP over TCP.
    Tcp(SocketAddr),
    /// HTTP over a unix socket.
    Unix(PathBuf),
}

/// An answer, whatever the transport.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Answer {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not json ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8(self.body.clone()).expect("utf-8 body")
    }

    /// The `code` of an error body.
    pub fn code(&self) -> String {
        self.json()["code"]
            .as_str()
            .expect("an error body has a code")
            .to_owned()
    }
}

impl Transport {
    /// Sends `method path` with `body` (JSON text, or nothing) and `token` as bearer.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: Option<Vec<u8>>,
    ) -> Answer {
        match self {
            Transport::InProcess(state) => {
                let mut request = Request::builder().method(method).uri(path);
                if let Some(token) = token {
                    request = request.header("authorization", format!("Bearer {token}"));
                }
                let request = match body {
                    Some(body) => request
                        .header("content-type", "application/json")
                        .header("content-length", body.len())
                        .body(Body::from(body)),
                    None => request.body(Body::empty()),
                }
                .expect("a valid request");
                let response = api::router(state.clone())
                    .oneshot(request)
                    .await
                    .expect("the router is infallible");
                let status = response.status();
                let headers = response.headers().clone();
                let body = axum::body::to_bytes(response.into_body(), usize::MAX)
                    .await
                    .expect("a complete body")
                    .to_vec();
                Answer {
                    status,
                    headers,
                    body,
                }
            }
            Transport::Tcp(addr) => {
                let client = reqwest::Client::new();
                send(
                    &client,
                    &format!("http://{addr}{path}"),
                    method,
                    token,
                    body,
                )
                .await
            }
            Transport::Unix(socket) => {
                let client = reqwest::Client::builder()
                    .unix_socket(socket.as_path())
                    .build()
                    .expect("client");
                send(
                    &client,
                    &format!("http://localhost{path}"),
                    method,
                    token,
                    body,
                )
                .await
            }
        }
    }

    /// `GET path` with `token`.
    pub async fn get(&self, path: &str, token: Option<&str>) -> Answer {
        self.call(Method::GET, path, token, None).await
    }

    /// `POST path` with a JSON `body` and `token`.
    pub async fn post(&self, path: &str, token: Option<&str>, body: serde_json::Value) -> Answer {
        let body = serde_json::to_vec(&body).expect("json");
        self.call(Method::POST, path, token, Some(body)).await
    }
}

async fn send(
    client: &reqwest::Client,
    url: &str,
    method: Method,
    token: Option<&str>,
    body: Option<Vec<u8>>,
) -> Answer {
    let method = reqwest::Method::from_bytes(method.as_str().as_bytes()).expect("method");
    let mut request = client.request(method, url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body);
    }
    let response = request.send().await.expect("the server answers");
    let status = StatusCode::from_u16(response.status().as_u16()).expect("status");
    let mut headers = HeaderMap::new();
    for (name, value) in response.headers() {
        if let (Ok(name), Ok(value)) = (
            axum::http::HeaderName::from_bytes(name.as_str().as_bytes()),
            axum::http::HeaderValue::from_bytes(value.as_bytes()),
        ) {
            headers.append(name, value);
        }
    }
    let body = response.bytes().await.expect("a complete body").to_vec();
    Answer {
        status,
        headers,
        body,
    }
}

/// Runs the `stead` CLI in-process on a blocking thread (it runs its own runtime); under
/// paused time this also keeps the clock still while the CLI runs.
pub async fn stead(args: Vec<String>) -> (u8, String, String) {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        stead_tests::stead(&args)
    })
    .await
    .expect("the cli did not panic")
}

/// `args` as owned strings, with `--address address --color never` after them.
pub fn cli_args(address: &str, args: &[&str]) -> Vec<String> {
    args.iter()
        .map(|a| (*a).to_owned())
        .chain(["--address", address, "--color", "never"].map(str::to_owned))
        .collect()
}
