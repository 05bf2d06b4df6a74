//! The agent's shutdown: a drain that waits on a wake-up from outside its allocs (a
//! driver's recovery), the API answering while a drain lasts, and a second SIGTERM that
//! ends a drain at once, through the node in-process and through the real agent binary.

use crate::agent_support;

use std::sync::Arc;
use std::time::Duration;

use agent_support::{AgentDirs, kill_all_with, processes_with, wait_for};
use stead_controller::clock::Clock;
use stead_controller::driver::mock::MockDriver;
use stead_controller::driver::{Driver, Drivers, Health};
use stead_controller::node::{Node, NodeConfig};
use stead_controller::queue::Shutdown;
use stead_controller::store::MemoryStore;
use stead_schemas::status::AllocStatus;
use stead_schemas::{Timestamp, ValidSpec};

/// 2026-11-22T00:00:00Z: fixed, so times in failures are readable.
const START: Duration = Duration::from_secs(1_795_305_600);

/// A valid alloc `name` whose `spec:` body is `body` (indented by two).
fn alloc(name: &str, body: &str) -> ValidSpec {
    let yaml =
        format!("apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n{body}");
    let file = stead_schemas::parse_spec_file(std::path::Path::new("test.yaml"), &yaml);
    assert!(file.is_valid(), "{:#?}", file.all_diagnostics());
    file.specs().next().expect("one spec").clone()
}

fn has_event(status: Option<&AllocStatus>, task: &str, event_type: &str) -> bool {
    status
        .and_then(|s| s.tasks.get(task))
        .is_some_and(|t| t.events.iter().any(|e| e.event_type == event_type))
}

#[tokio::test(start_paused = true)]
async fn a_drain_runs_a_poststop_task_held_back_by_an_unhealthy_driver_once_it_recovers() {
    let clock = Clock::starting_at(Timestamp::from_since_epoch(START));
    let mock = MockDriver::new(clock);
    let drivers = Drivers::new([Arc::new(mock.clone()) as Arc<dyn Driver>]);
    let config = NodeConfig {
        seed: Some(7),
        fingerprint_period: Duration::from_secs(5),
        ..NodeConfig::default()
    };
    let node = Arc::new(Node::new(
        config,
        drivers,
        Arc::new(MemoryStore::default()),
        clock,
    ));
    node.apply(alloc(
        "web",
        "  tasks:\n    - {name: t, driver: mock, config: {}}\n    - {name: cleanup, driver: mock, config: {runFor: 1s}, lifecycle: {hook: poststop}}\n",
    ));
    let running = node
        .wait_until(Duration::from_secs(60), |node| {
            node.status("web")
                .is_some_and(|s| s.tasks.get("t").is_some_and(|t| t.state == "running"))
        })
        .await;
    assert!(running, "web never ran: {:#?}", node.statuses());
    mock.set_health(Health::Unhealthy);
    // Paused time: one fingerprint period passes, so the node sees the driver unhealthy.
    tokio::time::sleep(Duration::from_secs(6)).await;

    let draining = node.clone();
    let drain = tokio::spawn(async move { draining.shutdown(Shutdown::Drain).await });
    let held = node
        .wait_until(Duration::from_secs(60), |node| {
            has_event(node.status("web").as_deref(), "cleanup", "Driver Failure")
        })
        .await;
    assert!(
        held,
        "the poststop task was never held back: {:#?}",
        node.statuses()
    );
    mock.set_health(Health::Healthy);
    // The driver's recovery is seen within one fingerprint period, the poststop task then
    // runs for a second: a minute of paused time is ample.
    let drained = tokio::time::timeout(Duration::from_secs(60), drain).await;
    assert!(
        matches!(drained, Ok(Ok(()))),
        "the drain never ended after the driver recovered: {:#?}",
        node.statuses()
    );
    let status = node.status("web").expect("still published");
    assert!(
        has_event(Some(&status), "cleanup", "Started"),
        "{status:#?}"
    );
    assert_eq!(status.tasks["cleanup"].state, "dead", "{status:#?}");
}

/// An exec alloc whose one task ignores SIGINT and SIGTERM, so a drain waits out its
/// kill timeout; its command line carries `marker`.
fn stubborn_spec(name: &str, marker: &str, kill_timeout: &str) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  tasks:\n    - name: main\n      driver: exec\n      killTimeout: {kill_timeout}\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"trap '' INT TERM; while :; do sleep 0.2; done\", \"{marker}\"]\n"
    )
}

/// A marker unique to this test run, for finding its task processes.
fn marker(test: &str) -> String {
    format!(
        "stead-shutdown-{test}-{}-{}",
        std::process::id(),
        fastrand::u64(..)
    )
}

/// Kills the test's task processes when the test ends, however it ends (their supervisors
/// then leave by themselves).
struct KillOnDrop(String);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        kill_all_with(&self.0);
    }
}

/// An agent that drains, running the stubborn alloc `stubborn` with `kill_timeout`;
/// returns once its task runs, with the task's pid.
fn draining_agent(marker: &str, kill_timeout: &str) -> (AgentDirs, agent_support::Agent, u32) {
    let dirs = AgentDirs::new("shutdown: drain\nmaxKillTimeout: 1h\n");
    dirs.write_spec("stubborn", &stubborn_spec("stubborn", marker, kill_timeout));
    let agent = dirs.start();
    let pid = until_running_as(&agent, None);
    (dirs, agent, pid)
}

/// Waits until the stubborn task runs (as `pid`, when given, started once) and returns
/// its pid.
fn until_running_as(agent: &agent_support::Agent, pid: Option<u32>) -> u32 {
    wait_for("the stubborn task runs", Duration::from_secs(30), || {
        let status = agent.status("stubborn");
        status
            .as_ref()
            .and_then(|s| s.tasks.get("main"))
            .filter(|t| t.state == "running")
            .filter(|t| {
                pid.is_none_or(|pid| {
                    t.pid == Some(pid)
                        && t.events
                            .iter()
                            .filter(|e| e.event_type == "Started")
                            .count()
                            == 1
                })
            })
            .and_then(|t| t.pid)
            .ok_or_else(|| format!("{status:#?}"))
    })
}

fn send(agent: &agent_support::Agent, signal: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(agent.child.id() as i32).expect("a pid");
    rustix::process::kill_process(pid, signal).expect("signalled");
}

/// Waits until the agent's log shows that its shutdown began.
fn until_shutting_down(agent: &agent_support::Agent) {
    wait_for("the shutdown to begin", Duration::from_secs(10), || {
        let log = agent.log_text();
        log.contains("shutting down").then_some(()).ok_or(log)
    });
}

/// Waits until the API shows the stubborn task sent its kill signal, and returns the
/// alloc's status document.
fn until_killing(agent: &mut agent_support::Agent) -> String {
    wait_for(
        "the API to show the task being killed",
        Duration::from_secs(10),
        || match agent.try_get("/v1/allocs/stubborn") {
            Some((200, body)) if body.contains("\"Killing\"") => Ok(body),
            other => Err(format!(
                "{other:?} (the agent has exited: {:?})",
                agent.child.try_wait()
            )),
        },
    )
}

#[test]
fn the_api_answers_while_a_drain_waits_out_a_kill_timeout() {
    let marker = marker("api");
    let _cleanup = KillOnDrop(marker.clone());
    let (_dirs, mut agent, _) = draining_agent(&marker, "1h");
    send(&agent, rustix::process::Signal::TERM);
    until_shutting_down(&agent);
    // The drain waits an hour on the task that ignores its kill signal; meanwhile
    // operators can watch it.
    let killing = until_killing(&mut agent);
    assert!(killing.contains("before force killing"), "{killing}");
    // The log says why the alloc stops.
    let log = agent.log_text();
    assert!(
        log.contains("stopping alloc=stubborn reason=\"the agent drains\""),
        "{log}"
    );
    let (code, body) = agent
        .try_get("/v1/health")
        .expect("the health endpoint answers");
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains("\"status\":\"shutting down\""),
        "the health says the agent is stopping: {body}"
    );
    // The workers only stop by now: a restart is refused, not left unanswered.
    let (code, body) = agent
        .post("/v1/allocs/stubborn/restart")
        .expect("a restart is answered");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("shutting_down"), "{body}");
    assert!(
        agent.child.try_wait().expect("agent state").is_none(),
        "the drain is not over"
    );
    // A second signal ends it.
    send(&agent, rustix::process::Signal::INT);
    let status = wait_for("the agent to exit", Duration::from_secs(10), || {
        agent
            .child
            .try_wait()
            .expect("agent state")
            .ok_or_else(|| "still running".to_owned())
    });
    assert!(!status.success(), "{status}");
}

#[test]
fn a_second_sigterm_ends_a_drain_at_once_and_the_next_agent_finishes_it_then_runs_again() {
    let marker = marker("second");
    let _cleanup = KillOnDrop(marker.clone());
    let (dirs, mut agent, pid) = draining_agent(&marker, "15s");
    send(&agent, rustix::process::Signal::TERM);
    until_shutting_down(&agent);
    until_killing(&mut agent);
    send(&agent, rustix::process::Signal::TERM);
    let status = wait_for(
        "the agent to exit after a second SIGTERM",
        Duration::from_secs(5),
        || {
            agent
                .child
                .try_wait()
                .expect("agent state")
                .ok_or_else(|| format!("still running; log:\n{}", agent.log_text()))
        },
    );
    assert_eq!(status.code(), Some(1), "{status}\n{}", agent.log_text());
    let log = agent.log_text();
    assert!(
        log.contains("second signal"),
        "the log says why the drain ended:\n{log}"
    );
    // The task ignored its kill signal, and its SIGKILL was the agent's to send.
    assert!(
        processes_with(&marker).contains(&pid),
        "the task was left running:\n{log}"
    );
    // The next agent finishes the stop the drain began (the kill timeout counts from the
    // signal), then runs the alloc again, as after any drain: its spec still asks for it.
    let next = dirs.start();
    wait_for(
        "the old run to be killed and a new one to run",
        Duration::from_secs(30),
        || {
            let status = next.status("stubborn");
            let task = status.as_ref().and_then(|s| s.tasks.get("main"));
            let events: Vec<&str> = task
                .map(|t| t.events.iter().map(|e| e.event_type.as_str()).collect())
                .unwrap_or_default();
            let rerun =
                task.is_some_and(|t| t.state == "running" && t.pid.is_some_and(|new| new != pid));
            (rerun && !processes_with(&marker).contains(&pid) && events.contains(&"Killed"))
                .then_some(())
                .ok_or_else(|| format!("{status:#?}"))
        },
    );
}
