//! Snapshots of what `stead alloc status`, `stead alloc list` and `stead node status`
//! print, against an agent on a real TCP socket. Time is paused and the clock starts at
//! a fixed instant, so every time shown is exact; the CLI runs on a blocking thread, which
//! keeps tokio's paused clock from moving while it talks to the agent.

use crate::api_support;

use api_support::{TestAgent, agent, alloc, cli_args, serve_tcp, stead};

/// Runs the CLI against `address`; returns stdout, asserting success.
async fn cli(address: &str, args: &[&str]) -> String {
    let (code, out, err) = stead(cli_args(address, args)).await;
    assert_eq!(code, 0, "stead {args:?} failed: {err}");
    out
}

/// `text` with the alloc's revision and id replaced (by text of the same width, so tables
/// stay aligned), so a change to how revisions are hashed does not rewrite every snapshot.
fn redact(agent: &TestAgent, name: &str, text: &str) -> String {
    let status = agent.node.status(name).expect("alloc is published");
    text.replace(&status.revision, "<revision>")
        .replace(&status.id, &format!("{name}-rrrrrrrr"))
}

#[tokio::test(start_paused = true)]
async fn alloc_status_shows_a_restarting_task_with_its_events_newest_first() {
    let agent = agent();
    agent.node.apply(alloc(
        "web",
        "  restart: {attempts: 3, delay: 15s, interval: 30m, mode: fail}\n  tasks:\n    - {name: server, driver: mock, config: {runFor: 10s, exitCode: 1}}\n    - {name: sidecar, driver: mock, config: {}, lifecycle: {hook: poststart, sidecar: true}}\n",
    ));
    agent
        .until("server waits to restart a second time", |node| {
            node.status("web").is_some_and(|s| {
                let server = &s.tasks["server"];
                server.restarts == 1
                    && server
                        .events
                        .last()
                        .is_some_and(|e| e.event_type == "Restarting")
            })
        })
        .await;
    let served = serve_tcp(&agent.state).await;
    let out = cli(&served.address, &["alloc", "status", "web"]).await;
    insta::assert_snapshot!("alloc_status_restarting_task", redact(&agent, "web", &out));
    served.stop().await;
}

#[tokio::test(start_paused = true)]
async fn alloc_status_shows_each_tasks_checks_and_the_allocs_health() {
    let agent = agent();
    // The mock driver runs no commands, so its exec check is critical, with why; the
    // poststop task does not run yet, so its check stays pending.
    agent.node.apply(alloc(
        "api",
        "  tasks:\n    - name: server\n      driver: mock\n      config: {}\n      checks:\n        - {name: script, type: exec, command: /bin/true, interval: 5s}\n    - name: cleanup\n      driver: mock\n      config: {}\n      lifecycle: {hook: poststop}\n      checks:\n        - {name: later, type: tcp, port: 9}\n",
    ));
    agent
        .until("the exec check reported", |node| {
            node.status("api").is_some_and(|s| {
                s.tasks["server"]
                    .checks
                    .iter()
                    .any(|c| c.name == "script" && c.status == "critical")
            })
        })
        .await;
    let served = serve_tcp(&agent.state).await;
    let out = cli(&served.address, &["alloc", "status", "api"]).await;
    insta::assert_snapshot!("alloc_status_checks", redact(&agent, "api", &out));
    let json = cli(&served.address, &["alloc", "status", "api", "--json"]).await;
    let document: serde_json::Value = serde_json::from_str(&json).expect("a document");
    assert_eq!(document["healthy"], serde_json::json!(false));
    assert_eq!(
        document["tasks"]["cleanup"]["checks"][0]["status"],
        "pending"
    );
    served.stop().await;
}

#[tokio::test(start_paused = true)]
async fn alloc_status_shows_a_killed_task() {
    let agent = agent();
    let run =
        "  tasks:\n    - {name: server, driver: mock, config: {killAfter: 1s}, killTimeout: 5s}\n";
    agent.node.apply(alloc("api", run));
    agent.until_running("api").await;
    tokio::time::sleep(std::time::Duration::from_secs(60)).await;
    agent
        .node
        .apply(alloc("api", &format!("  desiredStatus: stop\n{run}")));
    agent
        .until("the task is dead", |node| {
            node.status("api")
                .is_some_and(|s| s.tasks["server"].state == "dead")
        })
        .await;
    let served = serve_tcp(&agent.state).await;
    let out = cli(&served.address, &["alloc", "status", "api"]).await;
    insta::assert_snapshot!("alloc_status_killed_task", redact(&agent, "api", &out));
    served.stop().await;
}

#[tokio::test(start_paused = true)]
async fn alloc_status_shows_a_failed_alloc_and_why_it_stopped_restarting() {
    let agent = agent();
    agent.node.apply(alloc(
        "nightly",
        "  type: batch\n  restart: {attempts: 1, delay: 5s, interval: 1m, mode: fail}\n  tasks:\n    - {name: main, driver: mock, config: {runFor: 2s, exitCode: 3}}\n    - {name: uploader, driver: mock, config: {}}\n",
    ));
    agent
        .until("the alloc failed and its tasks are dead", |node| {
            node.status("nightly").is_some_and(|s| {
                s.client_status == "failed" && s.tasks.values().all(|t| t.state == "dead")
            })
        })
        .await;
    let served = serve_tcp(&agent.state).await;
    let out = cli(&served.address, &["alloc", "status", "nightly"]).await;
    insta::assert_snapshot!("alloc_status_failed_alloc", redact(&agent, "nightly", &out));

    let json = cli(&served.address, &["alloc", "status", "nightly", "--json"]).await;
    let document: stead_schemas::status::AllocStatus =
        serde_json::from_str(&json).expect("--json prints the status document");
    assert_eq!(
        &document,
        agent.node.status("nightly").expect("published").as_ref(),
        "--json is the document of GET /v1/allocs/{{name}}"
    );
    served.stop().await;
}

#[tokio::test(start_paused = true)]
async fn alloc_list_and_node_status_summarise_the_node() {
    let agent = agent();
    agent.node.apply(alloc(
        "web",
        "  tasks:\n    - {name: server, driver: mock, config: {}}\n    - {name: worker, driver: mock, config: {}}\n",
    ));
    agent.node.apply(alloc(
        "once",
        "  type: batch\n  tasks:\n    - {name: main, driver: mock, config: {runFor: 3s}}\n",
    ));
    agent.until_running("web").await;
    agent
        .until("once completes", |node| {
            node.status("once")
                .is_some_and(|s| s.client_status == "complete")
        })
        .await;
    let served = serve_tcp(&agent.state).await;

    let list = cli(&served.address, &["alloc", "list"]).await;
    let list = redact(&agent, "web", &redact(&agent, "once", &list));
    insta::assert_snapshot!("alloc_list", list);

    let node = cli(&served.address, &["node", "status"]).await;
    let host = stead_controller::host::HostResources::get();
    let node = node
        .replace(env!("CARGO_PKG_VERSION"), "<version>")
        .replace(
            &format!(
                "{} MHz ({} cores x {} MHz)",
                host.total_mhz(),
                host.cores,
                host.mhz_per_core
            ),
            "<total> MHz (<cores> cores x <mhz> MHz)",
        )
        .replace(&format!("{} MiB,", host.memory_mb), "<memory> MiB,");
    insta::assert_snapshot!("node_status", node);
    served.stop().await;
}

#[tokio::test(start_paused = true)]
async fn node_health_answers_without_the_token_and_exits_1_when_no_agent_answers() {
    let mut agent = agent();
    agent.state = agent.state.clone().with_token(Some("s3cret".to_owned()));
    let served = serve_tcp(&agent.state).await;
    // Without the token: each part's health, not what the agent knows of it.
    let health = cli(&served.address, &["node", "health"]).await;
    insta::assert_snapshot!("node_health", health);
    let with_token = cli(&served.address, &["node", "health", "--token", "s3cret"]).await;
    assert!(
        with_token.contains("Message") && with_token.contains("every write succeeded"),
        "{with_token}"
    );
    // The token guards everything else.
    let (code, _, err) = stead(cli_args(&served.address, &["node", "status"])).await;
    assert_eq!(code, 1, "{err}");
    let address = served.address.clone();
    served.stop().await;

    let (code, _, err) = stead(cli_args(&address, &["node", "health"])).await;
    assert_eq!(code, 1, "no agent answers: {err}");
    assert!(err.contains("cannot reach the stead agent"), "{err}");
}
