//! `stead alloc logs|restart|signal|list` and the CLI's connection handling, against an
//! agent on real sockets in real time.

use crate::api_support;

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use api_support::{agent_with, alloc, cli_args, forever, serve_tcp, serve_unix, stead};
use stead_controller::clock::Clock;
use stead_schemas::api::AllocListItem;

/// An agent on the system clock with `web` (task `main`) running.
async fn running_agent() -> api_support::TestAgent {
    let agent = agent_with(Clock::system());
    agent.node.apply(alloc("web", &forever("main")));
    agent.until_running("web").await;
    agent
}

fn append(path: &Path, text: &str) {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .expect("log file opens");
    file.write_all(text.as_bytes()).expect("log file written");
}

/// Output that a test can read while the CLI is still writing it.
#[derive(Clone, Default)]
struct LiveOutput(Arc<Mutex<Vec<u8>>>);

impl Write for LiveOutput {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .expect("not poisoned")
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LiveOutput {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().expect("not poisoned").clone()).expect("utf-8")
    }

    /// Waits (in real time) until the output is `expected`.
    async fn until(&self, expected: &str) {
        for _ in 0..500 {
            if self.text() == expected {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            self.text(),
            expected,
            "output never became what was expected"
        );
    }
}

impl LiveOutput {
    /// Waits (in real time) until the output contains `part`.
    async fn until_contains(&self, part: &str) {
        for _ in 0..1_000 {
            if self.text().contains(part) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("output never contained {part:?}: {}", self.text());
    }
}

/// Removes alloc `name`, waits until it has stopped, and garbage-collects it.
async fn remove_and_collect(agent: &api_support::TestAgent, name: &str) {
    let name: stead_schemas::spec::Name = name.parse().expect("a name");
    agent.node.remove(&name);
    let stopped = agent
        .node
        .wait_until(Duration::from_secs(10), |n| {
            n.gc_candidates()
                .iter()
                .any(|c| c.key == name && c.collectable)
        })
        .await;
    assert!(stopped, "the removed alloc stops");
    agent.node.collect(&name).await.expect("collected");
}

/// Starts `stead args…` on a thread of its own, writing into the returned output.
fn spawn_cli(args: Vec<String>) -> (LiveOutput, std::thread::JoinHandle<(u8, String)>) {
    let output = LiveOutput::default();
    let mut out = output.clone();
    let thread = std::thread::spawn(move || {
        let mut err = Vec::new();
        let argv = std::iter::once("stead".to_owned()).chain(args);
        let code = stead_controller::cli::run(argv, &mut out, &mut err);
        (code, String::from_utf8(err).expect("utf-8"))
    });
    (output, thread)
}

async fn join(thread: std::thread::JoinHandle<(u8, String)>) -> (u8, String) {
    tokio::task::spawn_blocking(move || thread.join().expect("the cli did not panic"))
        .await
        .expect("joined")
}

#[tokio::test]
async fn alloc_logs_follow_keeps_following_across_rotations_until_the_task_is_gone() {
    let agent = running_agent().await;
    let dir = agent.log_dir("web");
    append(&dir.join("main.stdout.0"), "line 1\n");
    let served = serve_tcp(&agent.state).await;
    let (output, thread) = spawn_cli(cli_args(
        &served.address,
        &["alloc", "logs", "web", "main", "-f"],
    ));
    output.until("line 1\n").await;

    // The writer finishes file 0 and moves on to file 1.
    append(&dir.join("main.stdout.0"), "line 2\n");
    append(&dir.join("main.stdout.1"), "line 3\n");
    output.until("line 1\nline 2\nline 3\n").await;

    // Another rotation, and the oldest file is deleted (maxFiles: 2).
    append(&dir.join("main.stdout.2"), "line 4\n");
    output.until("line 1\nline 2\nline 3\nline 4\n").await;
    std::fs::remove_file(dir.join("main.stdout.0")).expect("oldest file removed");
    append(&dir.join("main.stdout.2"), "line 5\n");
    output
        .until("line 1\nline 2\nline 3\nline 4\nline 5\n")
        .await;

    // When the alloc is gone the stream ends and the CLI exits cleanly.
    remove_and_collect(&agent, "web").await;
    let (code, err) = join(thread).await;
    assert_eq!((code, err.as_str()), (0, ""));
    assert_eq!(output.text(), "line 1\nline 2\nline 3\nline 4\nline 5\n");
    served.stop().await;
}

#[tokio::test]
async fn alloc_logs_tail_starts_with_the_last_lines_and_follows_from_there() {
    let agent = running_agent().await;
    let dir = agent.log_dir("web");
    append(&dir.join("main.stdout.3"), "a\nb\n");
    append(&dir.join("main.stdout.4"), "c\nd\n");
    append(&dir.join("main.stderr.0"), "warning 1\nwarning 2\n");
    let served = serve_tcp(&agent.state).await;

    let (code, out, _) = stead(cli_args(
        &served.address,
        &["alloc", "logs", "web", "main", "--tail", "3"],
    ))
    .await;
    assert_eq!((code, out.as_str()), (0, "b\nc\nd\n"));
    let (code, out, _) = stead(cli_args(
        &served.address,
        &["alloc", "logs", "web", "main", "--stderr", "--tail", "1"],
    ))
    .await;
    assert_eq!((code, out.as_str()), (0, "warning 2\n"));
    let (code, out, _) = stead(cli_args(&served.address, &["alloc", "logs", "web", "main"])).await;
    assert_eq!((code, out.as_str()), (0, "a\nb\nc\nd\n"));

    let (output, thread) = spawn_cli(cli_args(
        &served.address,
        &["alloc", "logs", "web", "main", "-f", "--tail", "2"],
    ));
    output.until("c\nd\n").await;
    append(&dir.join("main.stdout.4"), "e\n");
    output.until("c\nd\ne\n").await;
    served.stop().await;
    let (code, _) = join(thread).await;
    assert_eq!(code, 0, "the stream ends when the api shuts down");
}

/// Issue 34: `--tail 18446744073709551615` panicked on the overflow of its byte window.
#[tokio::test]
async fn alloc_logs_tail_of_the_largest_count_prints_the_whole_log() {
    let agent = running_agent().await;
    append(&agent.log_dir("web").join("main.stdout.0"), "a\nb\n");
    let served = serve_tcp(&agent.state).await;
    for count in ["18446744073709551615", "115292150460684698"] {
        let (code, out, err) = stead(cli_args(
            &served.address,
            &["alloc", "logs", "web", "main", "--tail", count],
        ))
        .await;
        assert_eq!(
            (code, out.as_str(), err.as_str()),
            (0, "a\nb\n", ""),
            "{count}"
        );
    }
    let (code, _, err) = stead(cli_args(
        &served.address,
        &[
            "alloc",
            "logs",
            "web",
            "main",
            "--tail",
            "18446744073709551616",
        ],
    ))
    .await;
    assert_eq!(code, 2, "{err}");
    served.stop().await;
}

#[tokio::test]
async fn alloc_restart_and_signal_report_what_they_did_and_why_they_could_not() {
    let agent = running_agent().await;
    let served = serve_tcp(&agent.state).await;
    let run = |args: &[&str]| stead(cli_args(&served.address, args));

    let (code, out, err) = run(&["alloc", "signal", "web", "main", "hup"]).await;
    assert_eq!(
        (code, out.as_str(), err.as_str()),
        (0, "sent SIGHUP to task \"main\" of alloc \"web\"\n", "")
    );
    let (code, _, err) = run(&["alloc", "signal", "web", "main", "bogus"]).await;
    assert_eq!(code, 1);
    assert!(
        err.starts_with("error: unknown signal \"SIGBOGUS\"; expected one of"),
        "{err}"
    );
    let (code, out, _) = run(&["alloc", "restart", "web", "main"]).await;
    assert_eq!(
        (code, out.as_str()),
        (0, "restarting task \"main\" of alloc \"web\"\n")
    );
    let (code, _, err) = run(&["alloc", "restart", "nope"]).await;
    assert_eq!(
        (code, err.as_str()),
        (1, "error: alloc \"nope\" not found\n")
    );
    let (code, _, err) = run(&["alloc", "status", "nope"]).await;
    assert_eq!(
        (code, err.as_str()),
        (1, "error: alloc \"nope\" not found\n")
    );

    let (code, out, _) = run(&["alloc", "list", "--json"]).await;
    assert_eq!(code, 0);
    let items: Vec<AllocListItem> = serde_json::from_str(&out).expect("json list");
    assert_eq!(items[0].name, "web");
    served.stop().await;
}

#[tokio::test]
async fn an_unreachable_agent_is_named_in_the_error() {
    let (code, out, err) = stead(cli_args("127.0.0.1:1", &["alloc", "list"])).await;
    assert_eq!((code, out.as_str()), (1, ""));
    assert!(
        err.starts_with("error: cannot reach the stead agent at 127.0.0.1:1: "),
        "{err}"
    );
    let (code, _, err) = stead(cli_args(
        "unix:/nonexistent/stead.sock",
        &["node", "status"],
    ))
    .await;
    assert_eq!(code, 1);
    assert!(
        err.starts_with("error: cannot reach the stead agent at unix:/nonexistent/stead.sock: "),
        "{err}"
    );
}

#[tokio::test]
async fn the_cli_reaches_the_agent_over_a_unix_socket_given_as_a_path_or_a_unix_address() {
    let agent = running_agent().await;
    let socket = agent.data_dir.path().join("api.sock");
    let served = serve_unix(&agent.state, &socket).await;
    for address in [served.address.clone(), socket.display().to_string()] {
        let (code, out, err) = stead(cli_args(&address, &["alloc", "list"])).await;
        assert_eq!(code, 0, "{address}: {err}");
        assert!(out.starts_with("Name"), "{out}");
    }
    served.stop().await;
}

#[tokio::test]
async fn the_cli_sends_the_token_and_says_how_to_pass_a_missing_one() {
    let agent = running_agent().await;
    let state = agent.state.clone().with_token(Some("let-me-in".to_owned()));
    let served = serve_tcp(&state).await;
    // A data dir without a token file: nothing on this host is tried but it.
    let data = tempfile::tempdir().expect("dir");
    let data_dir = data.path().display().to_string();
    let (code, _, err) = stead(cli_args(
        &served.address,
        &["alloc", "list", "--data-dir", &data_dir],
    ))
    .await;
    assert_eq!(
        (code, err),
        (
            1,
            format!(
                "error: missing bearer token (no token file at {data_dir}/api-token; pass its token with --token, STEAD_TOKEN or --token-file, or its data dir with --data-dir or STEAD_DATA_DIR)\n"
            )
        )
    );
    // The agent's data dir holds its token: the CLI reads it there.
    std::fs::write(data.path().join("api-token"), "let-me-in\n").expect("token written");
    let (code, out, err) = stead(cli_args(
        &served.address,
        &["alloc", "list", "--data-dir", &data_dir],
    ))
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("web"));
    let (code, _, err) = stead(cli_args(
        &served.address,
        &["alloc", "list", "--token", "not-it"],
    ))
    .await;
    assert_eq!(
        (code, err.as_str()),
        (
            1,
            "error: invalid bearer token (the token from --token is not this agent's)\n"
        )
    );
    let (code, out, err) = stead(cli_args(
        &served.address,
        &["alloc", "list", "--token", "let-me-in"],
    ))
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("web"));
    served.stop().await;
}

#[tokio::test]
async fn alloc_status_watch_shows_each_change_until_the_alloc_is_gone() {
    let agent = running_agent().await;
    let served = serve_tcp(&agent.state).await;
    let (output, thread) = spawn_cli(cli_args(
        &served.address,
        &["alloc", "status", "web", "--watch"],
    ));
    output.until_contains("Task \"main\" is \"running\"").await;
    remove_and_collect(&agent, "web").await;
    let (code, err) = join(thread).await;
    assert_eq!((code, err.as_str()), (0, ""));
    assert!(
        output.text().ends_with("\nalloc \"web\" is gone\n"),
        "{}",
        output.text()
    );
    served.stop().await;
}
