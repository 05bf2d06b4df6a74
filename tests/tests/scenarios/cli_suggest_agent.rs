//! A mistyped alloc or task name gets the closest existing one, through the real binary
//! (issue 35): the API adds "did you mean" to every not-found answer, and the CLI
//! prints it and fails.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use crate::agent_support::{AgentDirs, agent_binary, service_spec, unique_nap};

/// `stead ARGS` against the agent of `dirs`, which finds the token in its data dir.
fn cli(dirs: &AgentDirs, args: &[&str]) -> Output {
    let address = format!("127.0.0.1:{}", dirs.port);
    Command::new(agent_binary())
        .args(args)
        .args(["--color", "never"])
        .env_remove("STEAD_TOKEN")
        .env_remove("STEAD_TOKEN_FILE")
        .env_remove("STEAD_CONFIG")
        .env("STEAD_ADDR", Path::new(&address))
        .env("STEAD_DATA_DIR", &dirs.data)
        .output()
        .expect("the cli runs")
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[test]
fn a_mistyped_alloc_or_task_name_gets_the_closest_one_and_a_failing_exit() {
    let dirs = AgentDirs::new("shutdown: drain\n");
    let marker = format!("stead-suggest-{}", unique_nap());
    dirs.write_spec("web", &service_spec("web", &marker));
    dirs.write_spec("worker", &service_spec("worker", &marker));
    let agent = dirs.start();
    agent.wait_for_task("web", "web runs", Duration::from_secs(20), |t| {
        t.state == "running"
    });
    agent.wait_for_task("worker", "worker runs", Duration::from_secs(20), |t| {
        t.state == "running"
    });

    let status = cli(&dirs, &["alloc", "status", "wbe"]);
    assert!(!status.status.success(), "{}", text(&status));
    assert!(
        text(&status).contains(r#"alloc "wbe" not found; did you mean "web"?"#),
        "{}",
        text(&status)
    );

    let logs = cli(&dirs, &["alloc", "logs", "web", "mian"]);
    assert!(!logs.status.success(), "{}", text(&logs));
    assert!(
        text(&logs).contains(r#"task "mian" not found in alloc "web"; did you mean "main"?"#),
        "{}",
        text(&logs)
    );

    // Nothing close: no guess.
    let far = cli(&dirs, &["alloc", "status", "queue"]);
    assert!(!far.status.success(), "{}", text(&far));
    assert!(
        text(&far).contains(r#"alloc "queue" not found"#),
        "{}",
        text(&far)
    );
    assert!(!text(&far).contains("did you mean"), "{}", text(&far));

    assert!(agent.terminate().success());
}
