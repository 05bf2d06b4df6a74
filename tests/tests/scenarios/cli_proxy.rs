//! The CLI talks to its agent directly: a proxy set in the environment never sees its
//! requests, and so never its bearer token.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::mpsc;

/// Accepts one connection on `listener` and reports the request's head; answers `answer`.
fn serve_once(listener: TcpListener, answer: &'static str) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let Ok((stream, _)) = listener.accept() else {
            return;
        };
        let mut reader = BufReader::new(stream.try_clone().expect("clone"));
        let mut head = String::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                break;
            }
            head.push_str(&line);
        }
        let _ = tx.send(head);
        let _ = (&stream).write_all(answer.as_bytes());
    });
    rx
}

#[test]
fn the_cli_bypasses_proxies_from_the_environment_and_never_hands_them_its_token() {
    let agent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let proxy = TcpListener::bind("127.0.0.1:0").expect("bind");
    let (agent_port, proxy_url) = (
        agent.local_addr().expect("addr").port(),
        format!("http://{}", proxy.local_addr().expect("addr")),
    );
    let at_agent = serve_once(
        agent,
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n[]",
    );
    let at_proxy = serve_once(
        proxy,
        "HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
    );

    let output = std::process::Command::new(env!("CARGO_BIN_EXE_stead-test-agent"))
        .args(["alloc", "list", "--address"])
        .arg(format!("127.0.0.1:{agent_port}"))
        .args(["--token", "s3cret"])
        .env("http_proxy", &proxy_url)
        .env("HTTP_PROXY", &proxy_url)
        .env("all_proxy", &proxy_url)
        .env("ALL_PROXY", &proxy_url)
        .env_remove("no_proxy")
        .env_remove("NO_PROXY")
        .output()
        .expect("the cli runs");

    // Each listener reports a request before it answers, so by the time the CLI is done
    // the report of whichever it asked is there.
    assert_eq!(at_proxy.try_recv().ok(), None, "the proxy saw a request");
    let head = at_agent.try_recv().expect("the agent got the request");
    assert!(
        head.starts_with("GET /v1/allocs") && head.contains("Bearer s3cret"),
        "{head}"
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
