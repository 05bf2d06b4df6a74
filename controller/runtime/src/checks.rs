//! Health checks' IO: the probes (an HTTP request, a TCP connect, a command in the task)
//! and the one loop per running task that runs its checks on schedule.
//!
//! What a result means for the task (unhealthy, restart) is decided in
//! `stead_reconcilers::check`; this module only produces results. One loop per task holds
//! one timer for all the task's checks and polls their runs itself (no task or thread
//! per check); each run has its own timeout, so a slow check never delays another, and a
//! check still running when it is due again skips that turn rather than overlap itself. Schedules keep their phase: a
//! check due at `t` is next due at `t + interval`, however long it took.
//!
//! The HTTP probe writes its one request line by hand and reads the answer with
//! `httparse` (decision 0062): no pool, no TLS, no redirects, at most 4 KiB of body kept.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use stead_reconcilers::check::CheckStatus;
use stead_schemas::spec::Name;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::clock::Clock;
use crate::driver::{Driver, EXEC_OUTPUT_LIMIT, ExecRequest};
use crate::errors::error_chain;

/// The most body an HTTP check keeps in its output.
pub const HTTP_BODY_LIMIT: usize = 4096;

/// The largest response head an HTTP check reads.
const HTTP_HEAD_LIMIT: usize = 16 * 1024;

/// The most of a response's reason phrase an HTTP check keeps.
const HTTP_REASON_LIMIT: usize = 256;

/// The most headers a response may have.
const HTTP_MAX_HEADERS: usize = 128;

/// `text` cut to at most `limit` bytes, at a character boundary.
fn capped(mut text: String, limit: usize) -> String {
    if text.len() > limit {
        let mut end = limit;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// One check of a task, ready to run.
pub(crate) struct Probe {
    /// The check's name.
    pub(crate) name: Name,
    /// Time between runs.
    pub(crate) interval: Duration,
    /// How long one run may take.
    pub(crate) timeout: Duration,
    /// What it does.
    pub(crate) kind: ProbeKind,
}

/// What a check does.
pub(crate) enum ProbeKind {
    /// An HTTP request.
    Http {
        host: String,
        port: u16,
        method: String,
        path: String,
    },
    /// A TCP connect.
    Tcp { host: String, port: u16 },
    /// A command in the task's context, through its driver.
    Exec {
        driver: Arc<dyn Driver>,
        request: ExecRequest,
    },
}

/// One result of a check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ProbeResult {
    /// Passing, warning or critical.
    pub(crate) status: CheckStatus,
    /// What the check said.
    pub(crate) output: String,
}

impl ProbeResult {
    fn new(status: CheckStatus, output: impl Into<String>) -> Self {
        ProbeResult {
            status,
            output: output.into(),
        }
    }
}

/// The grid checks are scheduled on: checks due within the same 10 ms run together, so
/// the runtime wakes once for them rather than once each (decision 0062).
pub const SCHEDULE_GRAIN: Duration = Duration::from_millis(10);

/// The longest a check's first run waits: its first runs are spread over this (or its
/// interval, when shorter), so that tasks started together do not check together.
pub const FIRST_RUN_SPREAD: Duration = Duration::from_secs(1);

/// Runs `probes` on their schedules until dropped, handing results to `report`. Each
/// first runs after a random part of [`FIRST_RUN_SPREAD`] (`first_runs` draws it), then
/// every interval. A passing result that says what the last one reported said changes
/// nothing but a count, so it is only counted: the next report carries how many there
/// were (`report`'s third argument), and a steady check costs its worker nothing.
/// Dropping it abandons the probes in flight (a command's process group is killed).
pub(crate) async fn run(
    probes: Vec<Probe>,
    clock: Clock,
    mut first_runs: impl FnMut(Duration) -> Duration + Send,
    report: impl Fn(&Name, ProbeResult, u32) + Send,
) {
    // The last result reported of each check, and the identical ones since.
    let mut reported: Vec<Option<ProbeResult>> = probes.iter().map(|_| None).collect();
    let mut repeats: Vec<u32> = vec![0; probes.len()];
    let start = clock.instant();
    let mut due: Vec<_> = probes
        .iter()
        .map(|probe| {
            let first = start + first_runs(probe.interval.min(FIRST_RUN_SPREAD));
            clock.on_grid(first, SCHEDULE_GRAIN)
        })
        .collect();
    // The run in flight of each check, polled here rather than spawned: one task per
    // task's checks, woken once per result.
    let mut running: Vec<Option<Pin<Box<dyn Future<Output = ProbeResult> + Send + '_>>>> =
        probes.iter().map(|_| None).collect();
    loop {
        let next = due
            .iter()
            .zip(&running)
            .filter(|(_, run)| run.is_none())
            .map(|(at, _)| *at)
            .min();
        let timer = async move {
            match next {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let finished = std::future::poll_fn(|cx| {
            for (i, run) in running.iter_mut().enumerate() {
                if let Some(future) = run
                    && let Poll::Ready(result) = future.as_mut().poll(cx)
                {
                    *run = None;
                    return Poll::Ready((i, result));
                }
            }
            Poll::Pending
        });
        tokio::select! {
            biased;
            () = timer => {
                let now = clock.instant();
                for (i, probe) in probes.iter().enumerate() {
                    if running[i].is_some() || due[i] > now {
                        continue;
                    }
                    while due[i] <= now {
                        due[i] = clock.on_grid(due[i] + probe.interval, SCHEDULE_GRAIN);
                    }
                    running[i] = Some(Box::pin(probe.run()));
                }
            }
            (i, result) = finished => {
                // A run that took until its next turn skips that turn.
                let now = clock.instant();
                while due[i] <= now {
                    due[i] = clock.on_grid(due[i] + probes[i].interval, SCHEDULE_GRAIN);
                }
                crate::metrics::check_result(result.status);
                let steady = result.status == CheckStatus::Passing
                    && reported[i].as_ref() == Some(&result);
                if steady {
                    repeats[i] = repeats[i].saturating_add(1);
                } else {
                    report(&probes[i].name, result.clone(), std::mem::take(&mut repeats[i]));
                    reported[i] = Some(result);
                }
            }
        }
    }
}

impl Probe {
    /// One run of the check.
    pub(crate) async fn run(&self) -> ProbeResult {
        match &self.kind {
            ProbeKind::Http {
                host,
                port,
                method,
                path,
            } => http(host, *port, method, path, self.timeout).await,
            ProbeKind::Tcp { host, port } => tcp(host, *port, self.timeout).await,
            ProbeKind::Exec { driver, request } => exec(driver.as_ref(), request.clone()).await,
        }
    }
}

/// `host:port`, with an IPv6 address in brackets.
fn authority(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A duration as specs write it (`2s`).
fn shown(duration: Duration) -> stead_schemas::Duration {
    stead_schemas::Duration::from(duration)
}

/// The status of an HTTP answer, as Nomad's (Consul's) http checks: 2xx and 3xx pass,
/// 429 warns, anything else is critical.
pub(crate) fn http_status(code: u16) -> CheckStatus {
    match code {
        200..=399 => CheckStatus::Passing,
        429 => CheckStatus::Warning,
        _ => CheckStatus::Critical,
    }
}

/// What an HTTP exchange got before it ended or timed out.
#[derive(Default)]
struct HttpAnswer {
    /// The status code and reason, once the head was read.
    status: Option<(u16, String)>,
    /// The body as received (still chunked, when it is), up to a limit.
    body: Vec<u8>,
    /// Whether the body comes in chunks.
    chunked: bool,
}

async fn http(host: &str, port: u16, method: &str, path: &str, timeout: Duration) -> ProbeResult {
    let authority = authority(host, port);
    let said = |rest: &str| format!("HTTP {method} http://{authority}{path}: {rest}");
    let mut answer = HttpAnswer::default();
    let exchanged = tokio::time::timeout(
        timeout,
        exchange(host, port, &authority, method, path, &mut answer),
    )
    .await;
    // Once the status is in, a body cut short by the timeout or the peer still counts.
    match (answer.status.take(), exchanged) {
        (Some((code, reason)), _) => {
            let body = if answer.chunked {
                dechunk(&answer.body)
            } else {
                answer.body
            };
            let body = &body[..body.len().min(HTTP_BODY_LIMIT)];
            let body = capped(String::from_utf8_lossy(body).into_owned(), HTTP_BODY_LIMIT);
            let reason = capped(reason, HTTP_REASON_LIMIT);
            let output = said(&format!("{code} {reason} Output: {body}"));
            ProbeResult::new(http_status(code), output)
        }
        (None, Ok(Err(error))) => ProbeResult::new(CheckStatus::Critical, said(&error.to_string())),
        (None, Ok(Ok(()))) => ProbeResult::new(
            CheckStatus::Critical,
            said("the connection closed before a response"),
        ),
        (None, Err(_elapsed)) => ProbeResult::new(
            CheckStatus::Critical,
            said(&format!("no response within {}", shown(timeout))),
        ),
    }
}

/// Sends the request and reads the answer into `answer` as it comes.
async fn exchange(
    host: &str,
    port: u16,
    authority: &str,
    method: &str,
    path: &str,
    answer: &mut HttpAnswer,
) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    let mut stream = TcpStream::connect((host, port)).await?;
    let _ = stream.set_nodelay(true);
    let content_length = if matches!(method, "POST" | "PUT" | "PATCH") {
        "Content-Length: 0\r\n"
    } else {
        ""
    };
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: stead-health-check\r\nAccept: text/plain, text/*, */*\r\n{content_length}Connection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await?;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    // Parsed before each read, so an interim answer's follower already read is not missed.
    let mut read_more = true;
    let (head_len, length) = loop {
        if read_more {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Err(Error::new(
                    ErrorKind::UnexpectedEof,
                    "the connection closed in the response's head",
                ));
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        read_more = true;
        let mut headers = [httparse::EMPTY_HEADER; HTTP_MAX_HEADERS];
        let mut response = httparse::Response::new(&mut headers);
        match response.parse(&buf) {
            Ok(httparse::Status::Complete(head_len)) => {
                let code = response.code.unwrap_or(0);
                if (100..200).contains(&code) && code != 101 {
                    // An interim answer (100 Continue, 103 Early Hints): the final one follows.
                    buf.drain(..head_len);
                    read_more = false;
                    continue;
                }
                answer.status = Some((code, response.reason.unwrap_or("").to_owned()));
                let header = |name: &str| {
                    response
                        .headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case(name))
                        .map(|h| String::from_utf8_lossy(h.value).trim().to_ascii_lowercase())
                };
                answer.chunked = header("transfer-encoding").is_some_and(|v| v.contains("chunked"));
                let no_body = method == "HEAD" || code == 204 || code == 304 || code < 200;
                let length = if no_body {
                    Some(0)
                } else if answer.chunked {
                    None
                } else {
                    header("content-length").and_then(|v| v.parse::<usize>().ok())
                };
                break (head_len, length);
            }
            Ok(httparse::Status::Partial) if buf.len() < HTTP_HEAD_LIMIT => {}
            Ok(httparse::Status::Partial) => {
                return Err(Error::new(
                    ErrorKind::InvalidData,
                    "the response's head is larger than 16 KiB",
                ));
            }
            Err(error) => {
                return Err(Error::new(
                    ErrorKind::InvalidData,
                    format!("invalid response: {error}"),
                ));
            }
        }
    };
    // Enough body for the output: up to the limit, the declared length or the last chunk.
    let wanted = length.map_or(HTTP_BODY_LIMIT * 4, |len| len.min(HTTP_BODY_LIMIT));
    answer.body = buf.split_off(head_len);
    while answer.body.len() < wanted && !(answer.chunked && chunked_complete(&answer.body)) {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        answer.body.extend_from_slice(&chunk[..n]);
    }
    answer.body.truncate(wanted);
    Ok(())
}

/// The data of a chunked body, as far as it was received.
fn dechunk(raw: &[u8]) -> Vec<u8> {
    let mut data = Vec::new();
    let mut rest = raw;
    while let Ok(httparse::Status::Complete((start, size))) = httparse::parse_chunk_size(rest) {
        let size = usize::try_from(size).unwrap_or(usize::MAX);
        if size == 0 {
            break;
        }
        let chunk = &rest[start..];
        data.extend_from_slice(&chunk[..chunk.len().min(size)]);
        match chunk.get(size.saturating_add(2)..) {
            Some(next) => rest = next,
            None => break,
        }
    }
    data
}

/// Whether a chunked body's last chunk arrived.
fn chunked_complete(raw: &[u8]) -> bool {
    let mut rest = raw;
    while let Ok(httparse::Status::Complete((start, size))) = httparse::parse_chunk_size(rest) {
        if size == 0 {
            return true;
        }
        let size = usize::try_from(size).unwrap_or(usize::MAX);
        match rest[start..].get(size.saturating_add(2)..) {
            Some(next) => rest = next,
            None => return false,
        }
    }
    false
}

async fn tcp(host: &str, port: u16, timeout: Duration) -> ProbeResult {
    let authority = authority(host, port);
    match tokio::time::timeout(timeout, TcpStream::connect((host, port))).await {
        Ok(Ok(_stream)) => ProbeResult::new(
            CheckStatus::Passing,
            format!("TCP connect {authority}: Success"),
        ),
        Ok(Err(error)) => ProbeResult::new(
            CheckStatus::Critical,
            format!("TCP connect {authority}: {error}"),
        ),
        Err(_elapsed) => ProbeResult::new(
            CheckStatus::Critical,
            format!(
                "TCP connect {authority}: no connection within {}",
                shown(timeout)
            ),
        ),
    }
}

/// The status of a command's exit, as Nomad's script checks: 0 passes, 1 warns, anything
/// else (a signal too) is critical.
pub(crate) fn exit_status(exit_code: Option<i32>) -> CheckStatus {
    match exit_code {
        Some(0) => CheckStatus::Passing,
        Some(1) => CheckStatus::Warning,
        _ => CheckStatus::Critical,
    }
}

async fn exec(driver: &dyn Driver, request: ExecRequest) -> ProbeResult {
    let timeout = request.timeout;
    match driver.exec(request).await {
        Ok(ended) => {
            let output =
                String::from_utf8_lossy(&ended.output[..ended.output.len().min(EXEC_OUTPUT_LIMIT)]);
            if ended.timed_out {
                ProbeResult::new(
                    CheckStatus::Critical,
                    format!(
                        "timed out after {}; its process group was killed. Output: {output}",
                        shown(timeout)
                    ),
                )
            } else {
                ProbeResult::new(exit_status(ended.exit_code), output)
            }
        }
        Err(error) => ProbeResult::new(CheckStatus::Critical, error_chain(&error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_codes_map_to_nomads_statuses() {
        for (code, status) in [
            (200, CheckStatus::Passing),
            (204, CheckStatus::Passing),
            (301, CheckStatus::Passing),
            (399, CheckStatus::Passing),
            (429, CheckStatus::Warning),
            (400, CheckStatus::Critical),
            (500, CheckStatus::Critical),
            (503, CheckStatus::Critical),
            (101, CheckStatus::Critical),
        ] {
            assert_eq!(http_status(code), status, "{code}");
        }
    }

    #[test]
    fn exit_codes_map_to_nomads_statuses() {
        assert_eq!(exit_status(Some(0)), CheckStatus::Passing);
        assert_eq!(exit_status(Some(1)), CheckStatus::Warning);
        assert_eq!(exit_status(Some(2)), CheckStatus::Critical);
        assert_eq!(exit_status(None), CheckStatus::Critical);
    }

    #[test]
    fn a_chunked_body_is_read_back_as_its_data() {
        let raw = b"5\r\nhello\r\n7\r\n, world\r\n0\r\n\r\n";
        assert_eq!(dechunk(raw), b"hello, world");
        assert!(chunked_complete(raw));
        assert_eq!(dechunk(b"5\r\nhel"), b"hel");
        assert!(!chunked_complete(b"5\r\nhello\r\n"));
    }

    /// A listener on a fresh loopback port, and the port.
    async fn listener() -> (tokio::net::TcpListener, u16) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let port = listener.local_addr().expect("an address").port();
        (listener, port)
    }

    /// Serves one connection on a fresh port with `response`, returns the port.
    async fn serve_once(response: &'static [u8]) -> u16 {
        let (listener, port) = listener().await;
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.expect("a connection");
            let mut request = [0u8; 1024];
            let _ = socket.read(&mut request).await;
            let _ = socket.write_all(response).await;
        });
        port
    }

    #[tokio::test]
    async fn an_http_check_keeps_the_status_line_and_the_body() {
        let port =
            serve_once(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 7\r\n\r\nbroken!")
                .await;
        let result = http("127.0.0.1", port, "GET", "/healthz", Duration::from_secs(5)).await;
        assert_eq!(result.status, CheckStatus::Critical);
        assert_eq!(
            result.output,
            format!(
                "HTTP GET http://127.0.0.1:{port}/healthz: 500 Internal Server Error Output: broken!"
            )
        );
    }

    #[tokio::test]
    async fn an_http_check_reads_a_chunked_body_and_caps_a_long_one() {
        let port = serve_once(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nyes\r\n0\r\n\r\n",
        )
        .await;
        let result = http("127.0.0.1", port, "GET", "/", Duration::from_secs(5)).await;
        assert_eq!(result.status, CheckStatus::Passing);
        assert!(
            result.output.ends_with("200 OK Output: yes"),
            "{}",
            result.output
        );

        static LONG: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
            let mut response = b"HTTP/1.1 429 Too Many Requests\r\n\r\n".to_vec();
            response.extend(std::iter::repeat_n(b'x', 3 * HTTP_BODY_LIMIT));
            response
        });
        let port = serve_once(&LONG).await;
        let result = http("127.0.0.1", port, "GET", "/", Duration::from_secs(5)).await;
        assert_eq!(result.status, CheckStatus::Warning);
        let body = result.output.split("Output: ").nth(1).expect("a body");
        assert_eq!(body.len(), HTTP_BODY_LIMIT);
    }

    #[tokio::test]
    async fn an_http_check_reads_past_an_interim_answer_and_caps_a_long_reason() {
        let port =
            serve_once(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n").await;
        let result = http("127.0.0.1", port, "GET", "/", Duration::from_secs(5)).await;
        assert_eq!(result.status, CheckStatus::Passing);
        assert!(
            result.output.ends_with("204 No Content Output: "),
            "{}",
            result.output
        );

        static LONG_REASON: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
            let mut response = b"HTTP/1.1 503 ".to_vec();
            response.extend(std::iter::repeat_n(b'r', 10_000));
            response.extend(b"\r\nContent-Length: 3\r\n\r\n\xff\xfe!");
            response
        });
        let port = serve_once(&LONG_REASON).await;
        let result = http("127.0.0.1", port, "GET", "/", Duration::from_secs(5)).await;
        assert_eq!(result.status, CheckStatus::Critical);
        assert!(result.output.len() < 512, "{}", result.output.len());
        assert!(
            result.output.ends_with("Output: \u{fffd}\u{fffd}!"),
            "{}",
            result.output
        );
    }

    #[tokio::test]
    async fn an_http_check_without_an_answer_is_critical_at_its_timeout() {
        // Accepted by the kernel, never answered.
        let (listener, port) = listener().await;
        let result = http("127.0.0.1", port, "GET", "/", Duration::from_millis(200)).await;
        assert_eq!(result.status, CheckStatus::Critical);
        assert!(
            result.output.ends_with("no response within 200ms"),
            "{}",
            result.output
        );
        drop(listener);
    }

    #[tokio::test]
    async fn a_tcp_check_passes_on_an_open_port_and_fails_on_a_closed_one() {
        let (listener, port) = listener().await;
        let open = tcp("127.0.0.1", port, Duration::from_secs(5)).await;
        assert_eq!(open.status, CheckStatus::Passing);
        drop(listener);
        let closed = tcp("127.0.0.1", port, Duration::from_secs(5)).await;
        assert_eq!(closed.status, CheckStatus::Critical);
        assert!(closed.output.contains("refused"), "{}", closed.output);
    }
}
