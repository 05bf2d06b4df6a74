//! The API's bounds on real sockets (an agent in-process, real time): the deadline of a
//! request's head and of an idle keep-alive connection, the connection cap, and the cap
//! on followed log streams.

use crate::api_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use api_support::{agent_with, alloc, forever, serve_tcp_within};
use axum::body::Body;
use axum::http::{Request, StatusCode};
use stead_controller::api::{self, Connections, ServeLimits};
use stead_controller::clock::Clock;
use tower::ServiceExt;

/// Far longer than any wait here should take.
const WITHIN: Duration = Duration::from_secs(10);

async fn running_agent() -> api_support::TestAgent {
    let agent = agent_with(Clock::system());
    agent.node.apply(alloc("web", &forever("main")));
    agent.until_running("web").await;
    agent
}

fn connect(address: &str) -> TcpStream {
    let stream = TcpStream::connect(address).expect("connected");
    stream
        .set_read_timeout(Some(WITHIN))
        .expect("read timeout set");
    stream
}

/// Reads `stream` until the server closes it; what it sent. Panics if it does not close
/// within [`WITHIN`].
fn read_until_closed(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => return String::from_utf8_lossy(&received).into_owned(),
            Ok(n) => received.extend_from_slice(&buffer[..n]),
            Err(error) if error.kind() == std::io::ErrorKind::ConnectionReset => {
                return String::from_utf8_lossy(&received).into_owned();
            }
            Err(error) => panic!(
                "the server kept the connection ({error}); received {:?}",
                String::from_utf8_lossy(&received)
            ),
        }
    }
}

/// Reads one response to a `GET /v1/health` (whose body is JSON ending in `}`).
fn read_health_response(stream: &mut TcpStream) -> String {
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    while !received.ends_with(b"}") {
        let n = stream.read(&mut buffer).expect("a response");
        assert!(n > 0, "closed before the response");
        received.extend_from_slice(&buffer[..n]);
    }
    String::from_utf8_lossy(&received).into_owned()
}

async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(work).await.expect("joined")
}

#[tokio::test]
async fn a_connection_without_a_whole_request_head_or_idle_after_its_response_is_closed_at_the_header_timeout()
 {
    let agent = running_agent().await;
    let connections = Connections::new(ServeLimits {
        header_timeout: Duration::from_millis(300),
        ..ServeLimits::default()
    });
    let served = serve_tcp_within(&agent.state, connections.clone()).await;
    let address = served.address.clone();
    blocking(move || {
        let mut silent = connect(&address);
        let mut partial = connect(&address);
        partial
            .write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")
            .expect("half a head sent");
        let mut idle = connect(&address);
        idle.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
            .expect("a request sent");
        assert!(read_health_response(&mut idle).starts_with("HTTP/1.1 200"));
        read_until_closed(&mut silent);
        read_until_closed(&mut partial);
        // Kept alive after its response, then let go when no next request came.
        read_until_closed(&mut idle);
    })
    .await;
    served.stop().await;
}

#[tokio::test]
async fn at_the_connection_cap_a_new_client_closes_the_oldest_idle_connection_and_is_answered() {
    let agent = running_agent().await;
    let connections = Connections::new(ServeLimits {
        header_timeout: Duration::from_secs(600),
        max_connections: 2,
    });
    let served = serve_tcp_within(&agent.state, connections.clone()).await;
    let address = served.address.clone();
    let mut oldest = connect(&address);
    let _newer = connect(&address);
    let open = connections.clone();
    wait(|| open.open() == 2).await;
    blocking(move || {
        let mut client = connect(&address);
        client
            .write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .expect("a request sent");
        assert!(read_until_closed(&mut client).starts_with("HTTP/1.1 200"));
        assert_eq!(
            read_until_closed(&mut oldest),
            "",
            "the oldest idle one closed"
        );
    })
    .await;
    assert!(connections.open() <= 2);
    served.stop().await;
}

#[tokio::test]
async fn with_every_connection_busy_a_new_one_is_closed_and_the_busy_stream_goes_on() {
    let agent = running_agent().await;
    let log = agent.log_dir("web").join("main.stdout.0");
    std::fs::write(&log, "one\n").expect("log written");
    let connections = Connections::new(ServeLimits {
        header_timeout: Duration::from_secs(600),
        max_connections: 1,
    });
    let served = serve_tcp_within(&agent.state, connections.clone()).await;
    let address = served.address.clone();
    blocking(move || {
        let mut follower = connect(&address);
        follower
            .write_all(b"GET /v1/allocs/web/logs/main?follow=true HTTP/1.1\r\nHost: x\r\n\r\n")
            .expect("a request sent");
        let mut seen = Vec::new();
        let mut buffer = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains("one\n") {
            let n = follower.read(&mut buffer).expect("the log");
            seen.extend_from_slice(&buffer[..n]);
        }
        let mut refused = connect(&address);
        assert_eq!(read_until_closed(&mut refused), "", "closed unanswered");
        std::fs::write(&log, "one\ntwo\n").expect("log appended");
        while !String::from_utf8_lossy(&seen).contains("two\n") {
            let n = follower.read(&mut buffer).expect("the log");
            assert!(n > 0, "the followed stream ended");
            seen.extend_from_slice(&buffer[..n]);
        }
    })
    .await;
    served.stop().await;
}

async fn wait(mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + WITHIN;
    while !condition() {
        assert!(Instant::now() < deadline, "condition not reached");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn follow_request() -> Request<Body> {
    Request::get("/v1/allocs/web/logs/main?follow=true")
        .body(Body::empty())
        .expect("a request")
}

#[tokio::test]
async fn followed_logs_over_the_cap_get_503_with_a_json_error_until_a_place_is_free() {
    let agent = running_agent().await;
    std::fs::write(agent.log_dir("web").join("main.stdout.0"), "x\n").expect("log");
    let state = agent.state.clone().with_max_log_streams(1);
    let router = api::router(state.clone());
    let first = router
        .clone()
        .oneshot(follow_request())
        .await
        .expect("answered");
    assert_eq!(first.status(), StatusCode::OK);

    let over = router
        .clone()
        .oneshot(follow_request())
        .await
        .expect("answered");
    assert_eq!(over.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body = axum::body::to_bytes(over.into_body(), 1 << 16)
        .await
        .expect("a body");
    let error: serde_json::Value = serde_json::from_slice(&body).expect("a JSON error");
    assert_eq!(error["code"], "too_many_log_streams");
    assert_eq!(
        error["message"],
        "the agent follows at most 1 log streams at once (api.maxLogStreams); try again later"
    );
    // Reading the whole log (not following) is not capped.
    let whole = router
        .clone()
        .oneshot(
            Request::get("/v1/allocs/web/logs/main")
                .body(Body::empty())
                .expect("a request"),
        )
        .await
        .expect("answered");
    assert_eq!(whole.status(), StatusCode::OK);

    // The first client leaves: its place is free again once its stream notices.
    drop(first);
    let deadline = Instant::now() + WITHIN;
    loop {
        let again = router
            .clone()
            .oneshot(follow_request())
            .await
            .expect("answered");
        if again.status() == StatusCode::OK {
            break;
        }
        assert!(Instant::now() < deadline, "the place was never freed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    state.shutdown_token().cancel();
}
