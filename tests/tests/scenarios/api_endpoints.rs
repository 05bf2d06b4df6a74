//! Every endpoint of the HTTP API and its errors, through each transport: in process with
//! `oneshot`, over TCP on 127.0.0.1 and over a unix socket; plus the socket's mode, the
//! token and the body limit.

use crate::api_support;

use std::os::unix::fs::PermissionsExt;

use api_support::{Transport, agent, alloc, forever, serve_tcp, serve_unix};
use axum::http::{Method, StatusCode};
use serde_json::json;
use stead_controller::api;
use stead_schemas::api::{AllocListItem, AllocStats, HealthStatus, NodeStatus};
use stead_schemas::status::AllocStatus;

const TOKEN: &str = "s3cret-token";

/// An agent with `web` and `other` running forever and `done`, a batch that completed;
/// `web`'s task has a line of stdout.
async fn busy_agent() -> api_support::TestAgent {
    let agent = agent();
    let agent = api_support::TestAgent {
        state: agent.state.clone().with_token(Some(TOKEN.to_owned())),
        ..agent
    };
    agent.node.apply(alloc("web", &forever("main")));
    agent.node.apply(alloc("other", &forever("main")));
    agent.node.apply(alloc(
        "done",
        "  type: batch\n  tasks:\n    - {name: main, driver: mock, config: {runFor: 1ms}}\n",
    ));
    agent.until_running("web").await;
    agent.until_running("other").await;
    agent
        .until("done completes", |node| {
            node.status("done")
                .is_some_and(|s| s.client_status == "complete")
        })
        .await;
    std::fs::write(agent.log_dir("web").join("main.stdout.0"), "hello\n").expect("log file");
    std::fs::write(agent.log_dir("web").join("main.stderr.0"), "oops\n").expect("log file");
    agent
}

/// The whole API, asked through `transport`, answers as documented.
async fn check_every_endpoint(transport: &Transport) {
    let t = Some(TOKEN);

    // Reads.
    let list = transport.get("/v1/allocs", t).await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.text());
    let items: Vec<AllocListItem> = serde_json::from_slice(&list.body).expect("alloc list");
    let names: Vec<&str> = items.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["done", "other", "web"]);
    let web = items.iter().find(|i| i.name == "web").expect("web listed");
    assert_eq!(
        (web.client_status.as_str(), web.tasks, web.running_tasks),
        ("running", 1, 1)
    );

    let status = transport.get("/v1/allocs/web", t).await;
    assert_eq!(status.status, StatusCode::OK);
    let status: AllocStatus = serde_json::from_slice(&status.body).expect("alloc status");
    assert_eq!(status.tasks["main"].state, "running");
    assert_eq!(status.tasks["main"].events[0].event_type, "Received");

    let missing = transport.get("/v1/allocs/nope", t).await;
    assert_eq!(
        (missing.status, missing.code()),
        (StatusCode::NOT_FOUND, "alloc_not_found".to_owned())
    );
    assert_eq!(missing.json()["message"], "alloc \"nope\" not found");

    let stats = transport.get("/v1/allocs/web/stats", t).await;
    assert_eq!(stats.status, StatusCode::OK);
    let stats: AllocStats = serde_json::from_slice(&stats.body).expect("alloc stats");
    assert_eq!(stats.name, "web");
    assert!(
        stats.tasks.is_empty(),
        "the mock driver does not measure its tasks"
    );
    let stats = transport.get("/v1/allocs/nope/stats", t).await;
    assert_eq!(stats.status, StatusCode::NOT_FOUND);

    // Logs.
    let logs = transport.get("/v1/allocs/web/logs/main", t).await;
    assert_eq!(
        (logs.status, logs.text().as_str()),
        (StatusCode::OK, "hello\n")
    );
    let logs = transport
        .get(
            "/v1/allocs/web/logs/main?type=stderr&origin=end&offset=3",
            t,
        )
        .await;
    assert_eq!(
        (logs.status, logs.text().as_str()),
        (StatusCode::OK, "ps\n")
    );
    let logs = transport.get("/v1/allocs/web/logs/nope", t).await;
    assert_eq!(
        (logs.status, logs.code()),
        (StatusCode::NOT_FOUND, "task_not_found".to_owned())
    );
    let logs = transport.get("/v1/allocs/nope/logs/main", t).await;
    assert_eq!(logs.status, StatusCode::NOT_FOUND);
    let logs = transport
        .get("/v1/allocs/web/logs/main?type=stdin", t)
        .await;
    assert_eq!(
        (logs.status, logs.code()),
        (StatusCode::BAD_REQUEST, "invalid_request".to_owned())
    );

    // Signals.
    let signal = |alloc: &str, task: &str, signal: &str| {
        let path = format!("/v1/allocs/{alloc}/signal");
        let body = json!({"task": task, "signal": signal});
        async move { transport.post(&path, t, body).await }
    };
    let bad = signal("web", "main", "SIGBOGUS").await;
    assert_eq!(
        (bad.status, bad.code()),
        (StatusCode::BAD_REQUEST, "invalid_signal".to_owned())
    );
    assert!(
        bad.json()["message"]
            .as_str()
            .expect("message")
            .contains("SIGUSR1")
    );
    let sent = signal("web", "main", "SIGHUP").await;
    assert_eq!(sent.status, StatusCode::NO_CONTENT, "{}", sent.text());
    let missing = signal("nope", "main", "SIGHUP").await;
    assert_eq!(
        (missing.status, missing.code()),
        (StatusCode::NOT_FOUND, "alloc_not_found".to_owned())
    );
    let missing = signal("web", "nope", "SIGHUP").await;
    assert_eq!(
        (missing.status, missing.code()),
        (StatusCode::NOT_FOUND, "task_not_found".to_owned())
    );
    let dead = signal("done", "main", "SIGHUP").await;
    assert_eq!(
        (dead.status, dead.code()),
        (StatusCode::CONFLICT, "task_not_running".to_owned())
    );
    let malformed = transport
        .call(
            Method::POST,
            "/v1/allocs/web/signal",
            t,
            Some(b"{\"task\":".to_vec()),
        )
        .await;
    assert_eq!(
        (malformed.status, malformed.code()),
        (StatusCode::BAD_REQUEST, "invalid_request".to_owned())
    );
    let unknown_field = transport
        .post(
            "/v1/allocs/web/signal",
            t,
            json!({"task": "main", "signal": "SIGHUP", "pid": 1}),
        )
        .await;
    assert_eq!(unknown_field.status, StatusCode::BAD_REQUEST);

    // Restarts.
    let missing = transport
        .post("/v1/allocs/web/restart", t, json!({"task": "nope"}))
        .await;
    assert_eq!(
        (missing.status, missing.code()),
        (StatusCode::NOT_FOUND, "task_not_found".to_owned())
    );
    let missing = transport
        .post("/v1/allocs/nope/restart", t, json!({}))
        .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    let dead = transport
        .post("/v1/allocs/done/restart", t, json!({}))
        .await;
    assert_eq!(
        (dead.status, dead.code()),
        (StatusCode::CONFLICT, "task_not_running".to_owned())
    );
    let restarted = transport
        .post("/v1/allocs/web/restart", t, json!({"task": "main"}))
        .await;
    assert_eq!(
        restarted.status,
        StatusCode::ACCEPTED,
        "{}",
        restarted.text()
    );
    let everything = transport
        .call(Method::POST, "/v1/allocs/other/restart", t, None)
        .await;
    assert_eq!(
        everything.status,
        StatusCode::ACCEPTED,
        "{}",
        everything.text()
    );

    // The node, health and metrics.
    let node = transport.get("/v1/node", t).await;
    assert_eq!(node.status, StatusCode::OK);
    let node: NodeStatus = serde_json::from_slice(&node.body).expect("node status");
    assert_eq!(node.name, "test-node");
    assert_eq!(node.drivers["mock"].health, "healthy");
    assert_eq!(node.drivers["mock"].attributes["driver.mock"], "true");
    assert!(node.devices.is_empty());
    assert_eq!(node.allocs["complete"], 1);

    // Health needs no token, and without it says no more than each part's health.
    for token in [None, Some("wrong")] {
        let health = transport.get("/v1/health", token).await;
        assert_eq!(health.status, StatusCode::OK, "health needs no token");
        assert!(!health.text().contains("message"), "{}", health.text());
        let health: HealthStatus = serde_json::from_slice(&health.body).expect("health");
        assert_eq!(health.status, "ok");
        assert!(health.components["store"].healthy);
        assert!(health.components["driver.mock"].healthy);
        assert!(health.components.values().all(|c| c.message.is_none()));
    }
    let health = transport.get("/v1/health", t).await;
    let health: HealthStatus = serde_json::from_slice(&health.body).expect("health");
    assert_eq!(
        health.components["store"].message.as_deref(),
        Some("every write succeeded"),
        "with the token, the messages"
    );

    let metrics = transport.get("/metrics", t).await;
    assert_eq!(
        (metrics.status, metrics.code()),
        (StatusCode::NOT_FOUND, "metrics_disabled".to_owned())
    );

    // Routing, the token and the body limit.
    let nowhere = transport.get("/v1/nowhere", t).await;
    assert_eq!(
        (nowhere.status, nowhere.code()),
        (StatusCode::NOT_FOUND, "not_found".to_owned())
    );
    let wrong_method = transport.call(Method::DELETE, "/v1/allocs", t, None).await;
    assert_eq!(
        (wrong_method.status, wrong_method.code()),
        (
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed".to_owned()
        )
    );
    for path in [
        "/v1/allocs",
        "/v1/allocs/web",
        "/v1/node",
        "/metrics",
        "/v1/allocs/web/logs/main",
    ] {
        let anonymous = transport.get(path, None).await;
        assert_eq!(
            (anonymous.status, anonymous.code()),
            (StatusCode::UNAUTHORIZED, "unauthorized".to_owned()),
            "{path}"
        );
        assert_eq!(anonymous.json()["message"], "missing bearer token");
        assert_eq!(
            anonymous.headers["www-authenticate"],
            "Bearer realm=\"stead\""
        );
        let wrong = transport.get(path, Some("s3cret-tokem")).await;
        assert_eq!(wrong.status, StatusCode::UNAUTHORIZED, "{path}");
        assert_eq!(wrong.json()["message"], "invalid bearer token");
    }
    let anonymous = transport
        .post(
            "/v1/allocs/web/signal",
            None,
            json!({"task": "main", "signal": "SIGHUP"}),
        )
        .await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);

    let huge = format!(
        "{{\"task\": \"main\", \"signal\": \"SIGHUP\", \"padding\": \"{}\"}}",
        "x".repeat(api::MAX_BODY_BYTES)
    );
    let too_large = transport
        .call(
            Method::POST,
            "/v1/allocs/web/signal",
            t,
            Some(huge.into_bytes()),
        )
        .await;
    assert_eq!(
        (too_large.status, too_large.code()),
        (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large".to_owned())
    );
}

#[tokio::test]
async fn every_not_found_answer_names_the_closest_alloc_or_task_whatever_the_endpoint() {
    let agent = busy_agent().await;
    let transport = Transport::InProcess(agent.state.clone());
    let t = Some(TOKEN);
    for (method, path, body, message) in [
        (
            Method::GET,
            "/v1/allocs/wbe",
            None,
            r#"alloc "wbe" not found; did you mean "web"?"#,
        ),
        (
            Method::GET,
            "/v1/allocs/wbe/stats",
            None,
            r#"alloc "wbe" not found; did you mean "web"?"#,
        ),
        (
            Method::GET,
            "/v1/allocs/othre/logs/main",
            None,
            r#"alloc "othre" not found; did you mean "other"?"#,
        ),
        (
            Method::GET,
            "/v1/allocs/web/logs/mian",
            None,
            r#"task "mian" not found in alloc "web"; did you mean "main"?"#,
        ),
        (
            Method::POST,
            "/v1/allocs/wbe/restart",
            Some(json!({})),
            r#"alloc "wbe" not found; did you mean "web"?"#,
        ),
        (
            Method::POST,
            "/v1/allocs/web/restart",
            Some(json!({"task": "mai"})),
            r#"task "mai" not found in alloc "web"; did you mean "main"?"#,
        ),
        (
            Method::POST,
            "/v1/allocs/web/signal",
            Some(json!({"task": "Main", "signal": "SIGHUP"})),
            r#"task "Main" not found in alloc "web"; did you mean "main"?"#,
        ),
        (
            Method::GET,
            "/v1/allocs/queue",
            None,
            r#"alloc "queue" not found"#,
        ),
    ] {
        let answer = match method {
            Method::POST => transport.post(path, t, body.expect("a body")).await,
            _ => transport.get(path, t).await,
        };
        assert_eq!(
            answer.status,
            StatusCode::NOT_FOUND,
            "{path}: {}",
            answer.text()
        );
        assert_eq!(answer.json()["message"], message, "{path}");
    }
}

#[tokio::test]
async fn every_endpoint_answers_as_documented_in_process() {
    let agent = busy_agent().await;
    check_every_endpoint(&Transport::InProcess(agent.state.clone())).await;
}

#[tokio::test]
async fn every_endpoint_answers_as_documented_over_tcp() {
    let agent = busy_agent().await;
    let served = serve_tcp(&agent.state).await;
    let addr = served.address.parse().expect("socket address");
    check_every_endpoint(&Transport::Tcp(addr)).await;
    served.stop().await;
}

#[tokio::test]
async fn every_endpoint_answers_as_documented_over_a_unix_socket() {
    let agent = busy_agent().await;
    let socket = agent.data_dir.path().join("api.sock");
    let served = serve_unix(&agent.state, &socket).await;
    check_every_endpoint(&Transport::Unix(socket.clone())).await;
    served.stop().await;
}

#[tokio::test]
async fn the_unix_socket_is_created_readable_and_writable_by_its_owner_only() {
    let agent = agent();
    let socket = agent.data_dir.path().join("api.sock");
    let served = serve_unix(&agent.state, &socket).await;
    let mode = std::fs::metadata(&socket)
        .expect("socket exists")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "mode {mode:o}");
    served.stop().await;
    let leftovers: Vec<_> = std::fs::read_dir(agent.data_dir.path())
        .expect("data dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(
        leftovers,
        ["api.sock"],
        "no temporary socket is left behind"
    );
}

#[tokio::test]
async fn a_stale_socket_is_replaced_but_a_regular_file_is_never_removed() {
    let agent = agent();
    let socket = agent.data_dir.path().join("api.sock");
    let earlier = api_support::agent();
    let first = serve_unix(&earlier.state, &socket).await;
    first.stop().await;
    // The first server's socket file remains, as after a crash: the next agent takes over.
    assert!(socket.exists());
    let second = serve_unix(&agent.state, &socket).await;
    let answer = Transport::Unix(socket.clone())
        .get("/v1/health", None)
        .await;
    assert_eq!(answer.status, StatusCode::OK);
    second.stop().await;

    let file = agent.data_dir.path().join("not-a-socket");
    std::fs::write(&file, "keep me").expect("file");
    let error = api::bind_unix(&file).expect_err("a regular file is in the way");
    assert_eq!(
        error.to_string(),
        format!("{} exists and is not a socket", file.display())
    );
    assert_eq!(
        std::fs::read_to_string(&file).expect("still there"),
        "keep me"
    );
}

#[tokio::test]
async fn an_oversized_body_without_a_content_length_is_refused_with_413() {
    let agent = agent();
    agent.node.apply(alloc("web", &forever("main")));
    agent.until_running("web").await;
    let huge = vec![b' '; api::MAX_BODY_BYTES + 1];
    let stream = futures_free_stream(huge);
    let request = axum::http::Request::post("/v1/allocs/web/restart")
        .body(stream)
        .expect("request");
    let response = tower::ServiceExt::oneshot(api::router(agent.state.clone()), request)
        .await
        .expect("infallible");
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("body");
    let body: serde_json::Value = serde_json::from_slice(&body).expect("json error");
    assert_eq!(body["code"], "body_too_large");
}

/// A body of unknown length (no `content-length`), as a chunked upload has.
fn futures_free_stream(bytes: Vec<u8>) -> axum::body::Body {
    struct Unsized(Option<axum::body::Bytes>);
    impl axum::body::HttpBody for Unsized {
        type Data = axum::body::Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
            std::task::Poll::Ready(self.0.take().map(|b| Ok(http_body::Frame::data(b))))
        }
    }
    axum::body::Body::new(Unsized(Some(bytes.into())))
}

#[tokio::test]
async fn health_names_the_degraded_part() {
    let agent = agent();
    agent
        .mock
        .set_health(stead_controller::driver::Health::Unhealthy);
    let answer = Transport::InProcess(agent.state.clone())
        .get("/v1/health", None)
        .await;
    assert_eq!(answer.status, StatusCode::OK);
    let health: HealthStatus = serde_json::from_slice(&answer.body).expect("health");
    assert_eq!(health.status, "degraded");
    assert!(!health.components["driver.mock"].healthy);
    assert_eq!(
        health.components["driver.mock"].message.as_deref(),
        Some("unhealthy: unhealthy")
    );
    assert!(health.components["store"].healthy);
}
