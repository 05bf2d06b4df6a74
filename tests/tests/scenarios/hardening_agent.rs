//! The agent against hostile files and lost state, through the real `stead agent`
//! binary: entries of the specs dir that cannot be read (a FIFO, a link to a device, a
//! dangling link, a link loop) hold nothing up, and a link to a secret outside the specs
//! dir shows nothing of it.

use crate::agent_support;

use std::time::{Duration, Instant};

use agent_support::{Agent, AgentDirs, service_spec, unique_nap, wait_for};

const DEADLINE: Duration = Duration::from_secs(20);

fn mkfifo(path: &std::path::Path) {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        path,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .expect("mkfifo");
}

fn health(agent: &Agent) -> serde_json::Value {
    let (code, body) = agent.try_get("/v1/health").expect("the agent answers");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("a health document")
}

fn running(agent: &Agent, name: &str) -> Result<(), String> {
    match agent.status(name) {
        Some(status) if status.tasks.values().all(|t| t.state == "running") => Ok(()),
        other => Err(format!("{other:?}")),
    }
}

#[test]
fn unreadable_entries_in_the_specs_dir_hold_up_nothing_but_the_allocs_they_declared() {
    let dirs = AgentDirs::new("shutdown: drain\n");
    let marker = unique_nap();
    for name in ["kept", "gone"] {
        dirs.write_spec(name, &service_spec(name, &marker));
    }
    let agent = dirs.start();
    for name in ["kept", "gone"] {
        wait_for(&format!("{name} running"), DEADLINE, || {
            running(&agent, name)
        });
    }

    // The file of `kept` becomes a FIFO; beside it, a link to a device, a dangling link
    // and a link loop.
    let specs = &dirs.specs;
    std::fs::remove_file(specs.join("kept.yaml")).expect("removed");
    mkfifo(&specs.join("kept.yaml"));
    std::os::unix::fs::symlink("/dev/zero", specs.join("device.yaml")).expect("link");
    std::os::unix::fs::symlink(specs.join("nowhere"), specs.join("dangling.yaml")).expect("link");
    std::os::unix::fs::symlink(specs.join("loop.yaml"), specs.join("loop.yaml")).expect("link");

    // Other changes still apply: a new alloc runs, a deleted one goes; the alloc whose
    // file cannot be read is kept, not taken for deleted.
    dirs.write_spec("new", &service_spec("new", &marker));
    wait_for("new running", DEADLINE, || running(&agent, "new"));
    dirs.remove_spec("gone");
    wait_for("gone stopped", DEADLINE, || match agent.status("gone") {
        Some(status) if status.desired_status == "stop" => Ok(()),
        other => Err(format!("{other:?}")),
    });
    let kept = agent.status("kept").expect("kept is shown");
    assert_eq!(kept.desired_status, "run", "{kept:?}");
    running(&agent, "kept").expect("kept still runs");

    // Health names every unreadable entry.
    let health = health(&agent);
    assert_eq!(health["status"], "degraded", "{health}");
    let source = &health["components"]["source"];
    assert_eq!(source["healthy"], false, "{health}");
    let message = source["message"].as_str().expect("a message");
    for entry in ["kept.yaml", "device.yaml", "dangling.yaml", "loop.yaml"] {
        assert!(message.contains(entry), "{entry} not in {message}");
    }

    // Each problem is logged when it appears, not at every pass (a resync is 500 ms;
    // wait for a few).
    let passes_from = Instant::now();
    wait_for("a few more listings", DEADLINE, || {
        match passes_from.elapsed() > Duration::from_secs(2) {
            true => Ok(()),
            false => Err("waiting".to_owned()),
        }
    });
    let log = agent.log_text();
    let fifo_lines = log
        .lines()
        .filter(|l| l.contains("kept.yaml") && l.contains("FIFO"));
    assert_eq!(fifo_lines.count(), 1, "{log}");

    // SIGTERM drains and exits promptly with the FIFO still there.
    let asked = Instant::now();
    let status = agent.terminate();
    assert!(status.success(), "{status}");
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "{:?}",
        asked.elapsed()
    );
}

#[test]
fn a_link_to_a_secret_outside_the_specs_dir_shows_nothing_of_it() {
    let dirs = AgentDirs::new("");
    let secret = dirs.root.path().join("shadow");
    std::fs::write(
        &secret,
        "root:$6$hunter2hash$:19000:0:99999:7:::\nkey: [unclosed\n",
    )
    .expect("secret");
    std::os::unix::fs::symlink(&secret, dirs.specs.join("s.yaml")).expect("link");
    let agent = dirs.start();
    wait_for("the diagnostic logged", DEADLINE, || {
        let log = agent.log_text();
        match log.contains("details withheld") {
            true => Ok(()),
            false => Err(log),
        }
    });
    let log = agent.log_text();
    assert!(!log.contains("hunter2"), "{log}");
    assert!(!log.contains("unclosed"), "{log}");
    assert!(
        log.contains("s.yaml:"),
        "the file and place are named: {log}"
    );
}
