//! Scenarios of the reconciliation core, driven through the node's public API with the
//! mock driver, the in-memory store and paused tokio time; assertions read only what the
//! node publishes (statuses and events) and what the mock driver saw.

use std::sync::Arc;
use std::time::Duration;

use stead_controller::allocdir::AllocDirs;
use stead_controller::clock::Clock;
use stead_controller::driver::mock::{MockDriver, MockOp};
use stead_controller::driver::{Driver, Drivers, Health};
use stead_controller::node::{Node, NodeConfig, sweep_every};
use stead_controller::queue::Shutdown;
use stead_controller::store::MemoryStore;
use stead_reconcilers::alloc::Limits;
use stead_schemas::status::AllocStatus;
use stead_schemas::{Timestamp, ValidSpec};

/// 2026-11-22T00:00:00Z: fixed, so times in failures are readable.
const START: Duration = Duration::from_secs(1_795_305_600);
/// Far longer than any scenario needs; paused time makes it free.
const DEADLINE: Duration = Duration::from_secs(600);

struct Harness {
    node: Node,
    mock: MockDriver,
    store: MemoryStore,
    clock: Clock,
}

/// Whether garbage collection may destroy alloc `name`: terminal and no longer declared.
fn collectable(node: &Node, name: &str) -> bool {
    node.gc_candidates()
        .iter()
        .any(|c| c.key.as_str() == name && c.collectable)
}

fn harness() -> Harness {
    harness_with(Limits::default(), MemoryStore::default(), None)
}

fn harness_with(limits: Limits, store: MemoryStore, mock: Option<MockDriver>) -> Harness {
    let clock = Clock::starting_at(Timestamp::from_since_epoch(START));
    let mock = mock.unwrap_or_else(|| MockDriver::new(clock));
    let drivers = Drivers::new([Arc::new(mock.clone()) as Arc<dyn Driver>]);
    let config = NodeConfig {
        limits,
        seed: Some(7),
        ..NodeConfig::default()
    };
    let node = Node::new(config, drivers, Arc::new(store.clone()), clock);
    Harness {
        node,
        mock,
        store,
        clock,
    }
}

/// A valid spec from YAML (panics with the diagnostics otherwise).
fn spec(yaml: &str) -> ValidSpec {
    let file = stead_schemas::parse_spec_file(std::path::Path::new("test.yaml"), yaml);
    assert!(file.is_valid(), "{:#?}", file.all_diagnostics());
    file.specs().next().expect("one spec").clone()
}

/// An alloc named `name` whose `spec:` body is `body` (indented by two).
fn alloc(name: &str, body: &str) -> ValidSpec {
    spec(&format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n{body}"
    ))
}

impl Harness {
    fn status(&self, name: &str) -> Arc<AllocStatus> {
        self.node.status(name).expect("alloc is published")
    }

    fn events(&self, name: &str, task: &str) -> Vec<String> {
        self.status(name).tasks[task]
            .events
            .iter()
            .map(|e| e.event_type.clone())
            .collect()
    }

    fn event_messages(&self, name: &str, task: &str, event_type: &str) -> Vec<String> {
        self.status(name).tasks[task]
            .events
            .iter()
            .filter(|e| e.event_type == event_type)
            .map(|e| e.message.clone())
            .collect()
    }

    fn event_times(&self, name: &str, task: &str, event_type: &str) -> Vec<Timestamp> {
        self.status(name).tasks[task]
            .events
            .iter()
            .filter(|e| e.event_type == event_type)
            .map(|e| e.time)
            .collect()
    }

    fn client_status(&self, name: &str) -> Option<String> {
        self.node.status(name).map(|s| s.client_status.clone())
    }

    fn task_state(&self, name: &str, task: &str) -> Option<String> {
        self.node
            .status(name)
            .and_then(|s| s.tasks.get(task).map(|t| t.state.clone()))
    }

    /// Waits until `condition` holds, failing with every status when it never does.
    async fn until(&self, what: &str, condition: impl Fn(&Harness) -> bool) {
        let held = self.node.wait_until(DEADLINE, |_| condition(self)).await;
        assert!(
            held,
            "timed out waiting until {what}: {:#?}",
            self.node.statuses()
        );
    }

    fn starts(&self, task: &str) -> Vec<Timestamp> {
        self.mock
            .calls()
            .into_iter()
            .filter(|c| c.task.as_str() == task && c.op == MockOp::StartBegan)
            .map(|c| c.at)
            .collect()
    }
}

/// Issue 36: an ordinary tick wakes only workers with something new or due, so the slow
/// full sweep is the safety net for a wake-up that never came.
#[tokio::test(start_paused = true)]
async fn a_worker_whose_wake_up_was_lost_converges_within_one_full_sweep() {
    let h = harness();
    let tick = NodeConfig::default().tick;
    let body = |generation: u32| {
        format!(
            "  tasks:\n    - {{name: t, driver: mock, config: {{}}, env: {{GENERATION: '{generation}'}}}}\n"
        )
    };
    h.node.apply(alloc("web", &body(1)));
    h.until("v1 runs", |h| {
        h.task_state("web", "t").as_deref() == Some("running")
    })
    .await;
    let v1 = h.status("web").revision.clone();

    assert!(h.node.lose_wake_ups("web", 1), "the alloc exists");
    let lost_at = h.clock.now();
    let v2 = alloc("web", &body(2));
    h.node.apply(v2.clone());
    tokio::time::sleep(tick * 2).await;
    assert_eq!(
        h.status("web").revision,
        v1,
        "ordinary ticks leave a worker with nothing new to it asleep"
    );

    h.until("v2 runs", |h| {
        let status = h.status("web");
        status.revision == v2.revision.to_string() && status.tasks["t"].state == "running"
    })
    .await;
    let took = h.clock.now().saturating_duration_since(lost_at);
    // One full sweep, plus the old task's stop and the new one's start (instant here).
    assert!(
        took <= tick * sweep_every(tick) + Duration::from_secs(1),
        "converged {took:?} after the lost wake-up; a full sweep is {:?}",
        tick * sweep_every(tick)
    );
}

#[tokio::test(start_paused = true)]
async fn a_brief_batch_task_yields_received_setup_started_terminated_and_completes() {
    let h = harness();
    h.node.apply(alloc(
        "job",
        "  type: batch\n  tasks:\n    - {name: t, driver: mock, config: {runFor: 2ms}}\n",
    ));
    h.until("complete", |h| {
        h.client_status("job").as_deref() == Some("complete")
    })
    .await;
    assert_eq!(
        h.events("job", "t"),
        ["Received", "Task Setup", "Started", "Terminated"]
    );
    let task = &h.status("job").tasks["t"];
    assert_eq!(task.state, "dead");
    assert!(!task.failed);
    assert!(task.finished_at.is_some());
}

#[tokio::test(start_paused = true)]
async fn a_service_task_exiting_zero_restarts_attempts_times_then_fails_with_nomads_reason() {
    let h = harness();
    h.node.apply(alloc(
        "svc",
        "  restart: {attempts: 2, delay: 50ms, interval: 1m, mode: fail}\n  tasks:\n    - {name: t, driver: mock, config: {runFor: 10ms}}\n",
    ));
    h.until("failed", |h| {
        h.client_status("svc").as_deref() == Some("failed")
    })
    .await;
    assert_eq!(h.starts("t").len(), 3);
    assert_eq!(
        h.event_messages("svc", "t", "Not Restarting"),
        ["Exceeded allowed attempts 2 in interval 1m0s and mode is \"fail\""]
    );
    let task = &h.status("svc").tasks["t"];
    assert_eq!(task.restarts, 2);
    assert!(task.failed);
    assert_eq!(task.state, "dead");
}

#[tokio::test(start_paused = true)]
async fn each_restart_waits_between_the_delay_and_five_quarters_of_it_after_the_exit() {
    let h = harness();
    h.node.apply(alloc(
        "svc",
        "  restart: {attempts: 5, delay: 1s, interval: 1h, mode: fail}\n  tasks:\n    - {name: t, driver: mock, config: {runFor: 100ms, exitCode: 1}}\n",
    ));
    h.until("failed", |h| {
        h.client_status("svc").as_deref() == Some("failed")
    })
    .await;
    let exits = h.event_times("svc", "t", "Terminated");
    let starts = h.starts("t");
    assert_eq!(starts.len(), 6);
    for (exit, next_start) in exits.iter().zip(&starts[1..]) {
        let waited = next_start.saturating_duration_since(*exit);
        assert!(
            waited >= Duration::from_secs(1) && waited < Duration::from_millis(1_250),
            "waited {waited:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_recoverable_start_error_is_retried_by_the_policy() {
    let h = harness();
    h.node.apply(alloc(
        "flaky",
        "  restart: {attempts: 2, delay: 1s, interval: 1m, mode: fail}\n  tasks:\n    - {name: t, driver: mock, config: {startError: boom, startErrorRecoverable: true}}\n",
    ));
    h.until("failed", |h| {
        h.client_status("flaky").as_deref() == Some("failed")
    })
    .await;
    assert_eq!(h.starts("t").len(), 3, "one start and two retries");
    assert_eq!(h.event_messages("flaky", "t", "Driver Failure").len(), 3);
}

#[tokio::test(start_paused = true)]
async fn an_unrecoverable_start_error_fails_at_once_and_kills_the_running_sibling() {
    let h = harness();
    h.node.apply(alloc(
        "pair",
        "  tasks:\n    - {name: good, driver: mock, config: {}}\n    - {name: bad, driver: mock, config: {startError: boom, startBlockFor: 100ms}}\n",
    ));
    h.until("failed and terminal", |h| {
        h.client_status("pair").as_deref() == Some("failed")
            && h.task_state("pair", "good").as_deref() == Some("dead")
    })
    .await;
    assert_eq!(h.starts("bad").len(), 1, "no retry");
    assert_eq!(
        h.event_messages("pair", "bad", "Not Restarting"),
        ["Error was unrecoverable"]
    );
    let good = h.events("pair", "good");
    assert_eq!(
        good[good.len() - 4..],
        ["Sibling Task Failed", "Killing", "Terminated", "Killed"]
    );
    assert!(!h.status("pair").tasks["good"].failed);
}

#[tokio::test(start_paused = true)]
async fn mode_delay_waits_out_the_rest_of_the_interval_and_never_fails() {
    let h = harness();
    h.node.apply(alloc(
        "patient",
        "  restart: {attempts: 1, delay: 1s, interval: 10s, mode: delay}\n  tasks:\n    - {name: t, driver: mock, config: {runFor: 100ms, exitCode: 1}}\n",
    ));
    h.until("four starts", |h| h.starts("t").len() >= 4).await;
    let starts = h.starts("t");
    // Start, one restart within policy, then a wait until the 10 s window ends.
    assert!(starts[2].saturating_duration_since(starts[0]) >= Duration::from_secs(10));
    let status = h.status("patient");
    assert!(!status.tasks["t"].failed);
    assert_ne!(status.client_status, "failed");
    assert!(
        h.event_messages("patient", "t", "Not Restarting")
            .is_empty()
    );
}

#[tokio::test(start_paused = true)]
async fn a_user_restart_is_signaled_and_does_not_count_against_attempts() {
    let h = harness();
    h.node.apply(alloc(
        "svc",
        "  restart: {attempts: 0, mode: fail}\n  tasks:\n    - {name: t, driver: mock, config: {}}\n",
    ));
    h.until("running", |h| {
        h.task_state("svc", "t").as_deref() == Some("running")
    })
    .await;
    for round in 1..=3 {
        h.node
            .restart("svc", Some("t".parse().expect("name")))
            .await
            .expect("restart accepted");
        h.until("restarted", |h| h.starts("t").len() == round + 1)
            .await;
        h.until("running again", |h| {
            h.task_state("svc", "t").as_deref() == Some("running")
        })
        .await;
    }
    let status = h.status("svc");
    assert_eq!(status.tasks["t"].restarts, 3);
    assert!(!status.tasks["t"].failed, "attempts: 0 and still running");
    assert_eq!(
        h.event_messages("svc", "t", "Restart Signaled"),
        ["User requested restart"; 3]
    );
}

#[tokio::test(start_paused = true)]
async fn restarting_or_signalling_a_task_that_is_not_running_is_refused() {
    let h = harness();
    h.node.apply(alloc(
        "job",
        "  type: batch\n  tasks:\n    - {name: t, driver: mock, config: {runFor: 1ms}}\n",
    ));
    h.until("complete", |h| {
        h.client_status("job").as_deref() == Some("complete")
    })
    .await;
    let task = || "t".parse().expect("name");
    let restart = h.node.restart("job", Some(task())).await;
    assert_eq!(
        restart.expect_err("refused").to_string(),
        "Task not running"
    );
    let signal = h
        .node
        .signal("job", task(), "SIGHUP".parse().expect("signal"))
        .await;
    assert_eq!(signal.expect_err("refused").to_string(), "Task not running");
    let unknown = h.node.restart("nope", None).await;
    assert_eq!(
        unknown.expect_err("refused").to_string(),
        "alloc \"nope\" not found"
    );
}

#[tokio::test(start_paused = true)]
async fn stopping_a_running_task_yields_killing_terminated_killed_without_failure() {
    let h = harness();
    let running = "  tasks:\n    - {name: t, driver: mock, config: {}}\n";
    h.node.apply(alloc("svc", running));
    h.until("running", |h| {
        h.task_state("svc", "t").as_deref() == Some("running")
    })
    .await;
    h.node
        .apply(alloc("svc", &format!("  desiredStatus: stop\n{running}")));
    h.until("dead", |h| {
        h.task_state("svc", "t").as_deref() == Some("dead")
    })
    .await;
    let events = h.events("svc", "t");
    assert_eq!(
        events[events.len() - 3..],
        ["Killing", "Terminated", "Killed"]
    );
    assert_eq!(
        h.event_messages("svc", "t", "Killing"),
        ["Sent interrupt. Waiting 5s before force killing"]
    );
    assert!(!h.status("svc").tasks["t"].failed);
    assert_eq!(h.client_status("svc").as_deref(), Some("complete"));
    assert!(
        !h.mock.calls().iter().any(|c| c.op == MockOp::Kill),
        "no SIGKILL was needed"
    );
}

#[tokio::test(start_paused = true)]
async fn a_task_slower_than_its_kill_timeout_is_force_killed_at_the_timeout() {
    let h = harness();
    let body =
        "  tasks:\n    - {name: t, driver: mock, config: {killAfter: 10s}, killTimeout: 2s}\n";
    h.node.apply(alloc("slow", body));
    h.until("running", |h| {
        h.task_state("slow", "t").as_deref() == Some("running")
    })
    .await;
    h.node.remove(&"slow".parse().expect("name"));
    h.until("forced", |h| {
        h.mock.calls().iter().any(|c| c.op == MockOp::Kill)
    })
    .await;
    let calls = h.mock.calls();
    let signalled = calls
        .iter()
        .find(|c| matches!(c.op, MockOp::Signal(_)))
        .expect("signalled")
        .at;
    let forced = calls
        .iter()
        .find(|c| c.op == MockOp::Kill)
        .expect("forced")
        .at;
    assert_eq!(
        forced.saturating_duration_since(signalled),
        Duration::from_secs(2)
    );
    h.until("stopped, kept for garbage collection", |h| {
        collectable(&h.node, "slow")
    })
    .await;
    let name = "slow".parse().expect("name");
    h.node.collect(&name).await.expect("collected");
    assert!(h.node.status("slow").is_none(), "destroyed");
    assert!(h.mock.running().is_empty());
}

#[tokio::test(start_paused = true)]
async fn when_the_leader_exits_the_follower_is_killed_and_the_alloc_completes() {
    let h = harness();
    h.node.apply(alloc(
        "duo",
        "  type: batch\n  tasks:\n    - {name: leader, driver: mock, config: {runFor: 1s}, leader: true}\n    - {name: follower, driver: mock, config: {}}\n",
    ));
    h.until("complete", |h| {
        h.client_status("duo").as_deref() == Some("complete")
    })
    .await;
    let follower = h.events("duo", "follower");
    assert_eq!(
        follower[follower.len() - 4..],
        ["Leader Task Dead", "Killing", "Terminated", "Killed"]
    );
}

#[tokio::test(start_paused = true)]
async fn stopping_an_alloc_finishes_the_leader_before_its_followers() {
    let h = harness();
    h.node.apply(alloc(
        "duo",
        "  tasks:\n    - {name: follower, driver: mock, config: {killAfter: 1s}}\n    - {name: leader, driver: mock, config: {killAfter: 1s}, leader: true}\n",
    ));
    h.until("running", |h| {
        h.client_status("duo").as_deref() == Some("running")
    })
    .await;
    h.node.remove(&"duo".parse().expect("name"));
    h.until("stopped, kept for garbage collection", |h| {
        collectable(&h.node, "duo")
    })
    .await;
    let name = "duo".parse().expect("name");
    h.node.collect(&name).await.expect("collected");
    assert!(h.node.status("duo").is_none(), "destroyed");
    let signals: Vec<(String, Timestamp)> = h
        .mock
        .calls()
        .into_iter()
        .filter(|c| matches!(c.op, MockOp::Signal(_)))
        .map(|c| (c.task.to_string(), c.at))
        .collect();
    assert_eq!(signals[0].0, "leader");
    assert_eq!(signals[1].0, "follower");
    assert!(signals[1].1.saturating_duration_since(signals[0].1) >= Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn lifecycle_main_waits_for_prestart_and_poststop_runs_last_while_the_alloc_runs() {
    let h = harness();
    h.node.apply(alloc(
        "web",
        "  type: batch\n  tasks:\n    - {name: init, driver: mock, config: {runFor: 1s}, lifecycle: {hook: prestart}}\n    - {name: proxy, driver: mock, config: {}, lifecycle: {hook: prestart, sidecar: true}}\n    - {name: main, driver: mock, config: {runFor: 2s}}\n    - {name: cleanup, driver: mock, config: {runFor: 5s}, lifecycle: {hook: poststop}}\n",
    ));
    h.until("poststop runs", |h| {
        h.task_state("web", "cleanup").as_deref() == Some("running")
    })
    .await;
    assert_eq!(h.client_status("web").as_deref(), Some("running"));
    for task in ["init", "proxy", "main"] {
        assert_eq!(h.task_state("web", task).as_deref(), Some("dead"), "{task}");
    }
    let init_done = h.event_times("web", "init", "Terminated")[0];
    let main_started = h.starts("main")[0];
    assert!(
        main_started >= init_done,
        "main started before init finished"
    );
    let main_done = h.event_times("web", "main", "Terminated")[0];
    let proxy_killed = h.event_times("web", "proxy", "Main Tasks Dead")[0];
    assert!(proxy_killed >= main_done);
    let proxy_dead = h.event_times("web", "proxy", "Killed")[0];
    assert!(
        h.starts("cleanup")[0] >= proxy_dead,
        "poststop before the sidecar died"
    );
    h.until("complete", |h| {
        h.client_status("web").as_deref() == Some("complete")
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn main_waits_for_a_prestart_sidecar_to_run() {
    let h = harness();
    h.node.apply(alloc(
        "web",
        "  tasks:\n    - {name: proxy, driver: mock, config: {startBlockFor: 3s}, lifecycle: {hook: prestart, sidecar: true}}\n    - {name: main, driver: mock, config: {}}\n",
    ));
    h.until("main runs", |h| {
        h.task_state("web", "main").as_deref() == Some("running")
    })
    .await;
    let proxy_started = h.event_times("web", "proxy", "Started")[0];
    assert!(h.starts("main")[0] >= proxy_started);
}

#[tokio::test(start_paused = true)]
async fn a_shutdown_delay_is_announced_after_killing_and_waited_before_the_signal() {
    let h = harness();
    let body = "  tasks:\n    - {name: t, driver: mock, config: {}, shutdownDelay: 5s}\n";
    h.node.apply(alloc("web", body));
    h.until("running", |h| {
        h.task_state("web", "t").as_deref() == Some("running")
    })
    .await;
    h.node
        .apply(alloc("web", &format!("  desiredStatus: stop\n{body}")));
    h.until("announced", |h| {
        !h.event_times("web", "t", "Waiting for shutdown delay")
            .is_empty()
    })
    .await;
    let announced = h.event_times("web", "t", "Waiting for shutdown delay")[0];
    assert_eq!(h.event_times("web", "t", "Killing"), [announced]);
    let events = h.events("web", "t");
    let position = |event: &str| events.iter().position(|e| e == event);
    assert!(
        position("Killing") < position("Waiting for shutdown delay"),
        "{events:?}"
    );
    assert_eq!(
        h.event_messages("web", "t", "Waiting for shutdown delay"),
        ["Waiting for shutdown_delay of 5s before killing the task."]
    );
    // The mock task exits at its kill signal, which only comes after the delay.
    h.until("terminated", |h| {
        !h.event_times("web", "t", "Terminated").is_empty()
    })
    .await;
    let terminated = h.event_times("web", "t", "Terminated")[0];
    assert_eq!(
        terminated.saturating_duration_since(announced),
        Duration::from_secs(5)
    );
}

#[tokio::test(start_paused = true)]
async fn updates_during_a_blocked_start_coalesce_so_only_the_newest_revision_ever_starts() {
    let h = harness();
    let revision = |n: u32| {
        alloc(
            "web",
            &format!(
                "  tasks:\n    - {{name: t, driver: mock, config: {{startBlockFor: 5s, exitCode: {n}}}}}\n"
            ),
        )
    };
    h.node.apply(revision(0));
    h.until("starting", |h| h.starts("t").len() == 1).await;
    for n in 1..=100 {
        h.node.apply(revision(n));
    }
    let newest = revision(100).id.to_string();
    h.until("newest runs", |h| {
        h.node.status("web").is_some_and(|s| s.id == newest)
            && h.task_state("web", "t").as_deref() == Some("running")
    })
    .await;
    let started_allocs: Vec<String> = h
        .mock
        .calls()
        .into_iter()
        .filter(|c| c.op == MockOp::StartBegan)
        .map(|c| c.alloc_id.to_string())
        .collect();
    assert_eq!(started_allocs, [revision(0).id.to_string(), newest]);
    // The 100 updates arrive while the worker waits on the start: 99 are replaced unseen.
    assert_eq!(h.node.coalesced_updates(), 99);
}

#[tokio::test(start_paused = true)]
async fn a_stop_preempts_a_queued_update_and_cancels_the_start_in_flight() {
    let h = harness();
    let revision = |n: u32| {
        alloc(
            "web",
            &format!(
                "  tasks:\n    - {{name: t, driver: mock, config: {{startBlockFor: 30s, exitCode: {n}}}}}\n"
            ),
        )
    };
    h.node.apply(revision(1));
    h.until("start in flight", |h| h.starts("t").len() == 1)
        .await;
    h.node.apply(revision(2));
    h.node.remove(&"web".parse().expect("name"));
    h.until("stopped, kept for garbage collection", |h| {
        collectable(&h.node, "web")
    })
    .await;
    let name = "web".parse().expect("name");
    h.node.collect(&name).await.expect("collected");
    assert!(h.node.status("web").is_none(), "destroyed");
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(h.starts("t").len(), 1, "nothing started after the stop");
    assert!(h.mock.running().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_blocked_alloc_does_not_hold_up_another_and_never_reconciles_concurrently() {
    let h = harness();
    h.node.apply(alloc(
        "a",
        "  tasks:\n    - {name: t, driver: mock, config: {startBlockFor: 60s}}\n",
    ));
    h.until("a starting", |h| h.starts("t").len() == 1).await;
    h.node.apply(alloc(
        "b",
        "  tasks:\n    - {name: u, driver: mock, config: {}}\n",
    ));
    h.until("b running", |h| {
        h.task_state("b", "u").as_deref() == Some("running")
    })
    .await;
    assert_eq!(h.task_state("a", "t").as_deref(), Some("pending"));
    let b_started = h.event_times("b", "u", "Started")[0];
    assert!(
        b_started.saturating_duration_since(Timestamp::from_since_epoch(START))
            < Duration::from_secs(1)
    );
    h.until("a running", |h| {
        h.task_state("a", "t").as_deref() == Some("running")
    })
    .await;
    // Per alloc, starts and their returns alternate: never two in flight at once.
    let mut in_flight = 0;
    for call in h
        .mock
        .calls()
        .iter()
        .filter(|c| c.alloc_id.as_str().starts_with("a-"))
    {
        match call.op {
            MockOp::StartBegan => in_flight += 1,
            MockOp::StartReturned { .. } | MockOp::StartCancelled => in_flight -= 1,
            _ => {}
        }
        assert!(in_flight <= 1, "two starts of alloc a overlapped");
    }
}

#[tokio::test(start_paused = true)]
async fn drain_stops_a_hundred_allocs_in_parallel_within_two_seconds() {
    let h = harness();
    for i in 0..100 {
        h.node.apply(alloc(
            &format!("a{i}"),
            "  tasks:\n    - {name: t, driver: mock, config: {killAfter: 1s}}\n",
        ));
    }
    h.until("all running", |h| h.mock.running().len() == 100)
        .await;
    let before = h.clock.now();
    let Harness {
        node, mock, clock, ..
    } = h;
    node.shutdown(Shutdown::Drain).await;
    let took = clock.now().saturating_duration_since(before);
    assert!(mock.running().is_empty());
    assert!(took < Duration::from_secs(2), "drain took {took:?}");
}

#[tokio::test(start_paused = true)]
async fn detach_leaves_every_task_running_in_the_driver() {
    let h = harness();
    for i in 0..10 {
        h.node.apply(alloc(
            &format!("a{i}"),
            "  tasks:\n    - {name: t, driver: mock, config: {}}\n",
        ));
    }
    h.until("all running", |h| h.mock.running().len() == 10)
        .await;
    let Harness { node, mock, .. } = h;
    node.shutdown(Shutdown::Detach).await;
    assert_eq!(mock.running().len(), 10);
    assert!(
        !mock
            .calls()
            .iter()
            .any(|c| matches!(c.op, MockOp::Signal(_) | MockOp::Kill))
    );
}

#[tokio::test(start_paused = true)]
async fn a_driver_whose_wait_never_returns_hangs_neither_a_kill_nor_a_shutdown() {
    let h = harness();
    h.mock.hang_wait_after_kill(true);
    h.node.apply(alloc(
        "stuck",
        "  tasks:\n    - {name: t, driver: mock, config: {}, killTimeout: 1s}\n",
    ));
    h.until("running", |h| {
        h.task_state("stuck", "t").as_deref() == Some("running")
    })
    .await;
    h.node.apply(alloc(
        "stuck",
        "  desiredStatus: stop\n  tasks:\n    - {name: t, driver: mock, config: {}, killTimeout: 1s}\n",
    ));
    h.until("dead anyway", |h| {
        h.task_state("stuck", "t").as_deref() == Some("dead")
    })
    .await;
    let Harness { node, clock, .. } = h;
    let before = clock.now();
    node.shutdown(Shutdown::Drain).await;
    assert!(clock.now().saturating_duration_since(before) < Duration::from_secs(10));
}

#[tokio::test(start_paused = true)]
async fn events_are_capped_per_task_dropping_the_oldest() {
    let limits = Limits {
        max_events: 5,
        ..Limits::default()
    };
    let h = harness_with(limits, MemoryStore::default(), None);
    h.node.apply(alloc(
        "svc",
        "  restart: {attempts: 10, delay: 1s, interval: 1h, mode: fail}\n  tasks:\n    - {name: t, driver: mock, config: {runFor: 1s, exitCode: 1}}\n",
    ));
    h.until("failed", |h| {
        h.client_status("svc").as_deref() == Some("failed")
    })
    .await;
    let events = h.events("svc", "t");
    assert_eq!(events.len(), 5);
    assert_eq!(events.last().map(String::as_str), Some("Not Restarting"));
    assert!(
        !events.contains(&"Received".to_owned()),
        "the oldest went first"
    );
}

#[tokio::test(start_paused = true)]
async fn a_fresh_node_over_the_same_store_reattaches_without_a_new_start_and_keeps_restarts() {
    let h = harness();
    h.node.apply(alloc(
        "svc",
        "  restart: {attempts: 3, delay: 1s, interval: 1h, mode: fail}\n  tasks:\n    - {name: t, driver: mock, config: {}}\n",
    ));
    h.until("running", |h| {
        h.task_state("svc", "t").as_deref() == Some("running")
    })
    .await;
    h.node.restart("svc", None).await.expect("restart");
    h.until("restarted and running", |h| {
        h.starts("t").len() == 2 && h.task_state("svc", "t").as_deref() == Some("running")
    })
    .await;
    let Harness {
        node, mock, store, ..
    } = h;
    node.shutdown(Shutdown::Detach).await;

    let h = harness_with(Limits::default(), store, Some(mock));
    let report = h.node.restore().expect("restore");
    assert_eq!(report.restored, 1);
    h.until("published", |h| h.node.status("svc").is_some())
        .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let status = h.status("svc");
    assert_eq!(status.tasks["t"].state, "running");
    assert_eq!(status.tasks["t"].restarts, 1);
    assert_eq!(h.starts("t").len(), 2, "no new start");
    assert_eq!(
        h.event_times("svc", "t", "Started").len(),
        2,
        "no new Started event"
    );
}

#[tokio::test(start_paused = true)]
async fn a_drain_leaves_finished_allocs_as_they_are_so_the_next_agent_runs_none_again() {
    let h = harness();
    let job = alloc(
        "job",
        "  type: batch\n  tasks:\n    - {name: t, driver: mock, config: {runFor: 2ms}}\n",
    );
    let failed = alloc(
        "failed",
        "  restart: {attempts: 0}\n  tasks:\n    - {name: f, driver: mock, config: {runFor: 2ms, exitCode: 1}}\n",
    );
    h.node.apply(job.clone());
    h.node.apply(failed.clone());
    h.until("complete and failed", |h| {
        h.client_status("job").as_deref() == Some("complete")
            && h.client_status("failed").as_deref() == Some("failed")
    })
    .await;
    let Harness {
        node, mock, store, ..
    } = h;
    node.shutdown(Shutdown::Drain).await;

    // The next agent: its listing declares both again.
    let h = harness_with(Limits::default(), store, Some(mock));
    h.node.restore().expect("restore");
    h.node.apply(job);
    h.node.apply(failed);
    h.until("published", |h| {
        h.node.status("job").is_some() && h.node.status("failed").is_some()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(h.client_status("job").as_deref(), Some("complete"));
    assert_eq!(h.client_status("failed").as_deref(), Some("failed"));
    assert_eq!(h.starts("t").len(), 1, "the batch job ran once");
    assert_eq!(h.starts("f").len(), 1, "the failed alloc was not run again");
}

/// A node with alloc dirs under `data` running sticky-disk alloc `db` at revision 1, with
/// `rows` in its data dir and a file in the way of revision 2's alloc dir, then asked
/// for revision 2; returns once revision 1 stopped and its status shows why 2 waits,
/// with both revisions and both alloc dirs.
async fn sticky_hand_over_blocked(
    data: &std::path::Path,
) -> (Harness, [ValidSpec; 2], [std::path::PathBuf; 2]) {
    let clock = Clock::starting_at(Timestamp::from_since_epoch(START));
    let mock = MockDriver::new(clock);
    let store = MemoryStore::default();
    let node = Node::with_alloc_dirs(
        NodeConfig {
            seed: Some(7),
            ..NodeConfig::default()
        },
        Drivers::new([Arc::new(mock.clone()) as Arc<dyn Driver>]),
        Arc::new(store.clone()),
        clock,
        AllocDirs::new(data),
    );
    let h = Harness {
        node,
        mock,
        store,
        clock,
    };
    let body = |generation: &str| {
        format!(
            "  ephemeralDisk: {{sticky: true}}\n  tasks:\n    - {{name: t, driver: mock, config: {{}}, env: {{GENERATION: '{generation}'}}}}\n"
        )
    };
    let (v1, v2) = (alloc("db", &body("1")), alloc("db", &body("2")));
    h.node.apply(v1.clone());
    h.until("v1 runs", |h| {
        h.task_state("db", "t").as_deref() == Some("running")
    })
    .await;
    let allocs = data.join("allocs");
    let (old, new) = (allocs.join(v1.id.as_str()), allocs.join(v2.id.as_str()));
    std::fs::create_dir_all(old.join("alloc/data")).expect("made");
    std::fs::write(old.join("alloc/data/rows"), "42").expect("written");
    // Something in the way of the new revision's alloc dir.
    std::fs::write(&new, "in the way").expect("written");

    h.node.apply(v2.clone());
    h.until("v1 stopped, and why v2 waits shown", |h| {
        let status = h.status("db");
        status.revision == v1.revision.to_string()
            && status.tasks["t"].state == "dead"
            && status
                .state_error
                .as_deref()
                .is_some_and(|e| e.contains(v2.id.as_str()) && e.contains("sticky disk"))
    })
    .await;
    (h, [v1, v2], [old, new])
}

#[tokio::test(start_paused = true)]
async fn a_sticky_disk_that_cannot_be_handed_over_keeps_the_old_dir_and_holds_the_new_revision() {
    let data = tempfile::tempdir().expect("temp dir");
    let (h, [_, v2], [old, new]) = sticky_hand_over_blocked(data.path()).await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(h.starts("t").len(), 1, "v2 never started without its data");
    assert_eq!(
        std::fs::read_to_string(old.join("alloc/data/rows")).expect("the old data is kept"),
        "42"
    );

    std::fs::remove_file(&new).expect("removed");
    h.until("v2 runs once the hand-over succeeds", |h| {
        let status = h.status("db");
        status.revision == v2.revision.to_string()
            && status.tasks["t"].state == "running"
            && status.state_error.is_none()
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(new.join("alloc/data/rows")).expect("the data moved"),
        "42"
    );
}

#[tokio::test(start_paused = true)]
async fn reverting_to_the_old_revision_while_the_hand_over_waits_runs_it_again_and_clears_why() {
    let data = tempfile::tempdir().expect("temp dir");
    let (h, [v1, _], [old, _]) = sticky_hand_over_blocked(data.path()).await;
    h.node.apply(v1.clone());
    h.until("v1 runs again in place, with nothing to wait for", |h| {
        let status = h.status("db");
        status.revision == v1.revision.to_string()
            && status.tasks["t"].state == "running"
            && status.state_error.is_none()
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(old.join("alloc/data/rows")).expect("its data is still there"),
        "42"
    );
}

#[tokio::test(start_paused = true)]
async fn a_task_whose_driver_is_unhealthy_stays_pending_with_driver_failure_and_starts_on_recovery()
{
    let clock = Clock::starting_at(Timestamp::from_since_epoch(START));
    let mock = MockDriver::new(clock);
    mock.set_health(Health::Unhealthy);
    let drivers = Drivers::new([Arc::new(mock.clone()) as Arc<dyn Driver>]);
    let config = NodeConfig {
        seed: Some(7),
        fingerprint_period: Duration::from_secs(5),
        ..NodeConfig::default()
    };
    let store = MemoryStore::default();
    let h = Harness {
        node: Node::new(config, drivers, Arc::new(store.clone()), clock),
        mock,
        store,
        clock,
    };
    tokio::time::sleep(Duration::from_millis(1)).await;
    h.node.apply(alloc(
        "web",
        "  tasks:\n    - {name: t, driver: mock, config: {}}\n",
    ));
    h.until("driver failure reported", |h| {
        h.node.status("web").is_some_and(|s| {
            s.tasks["t"]
                .events
                .iter()
                .any(|e| e.event_type == "Driver Failure")
        })
    })
    .await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(h.task_state("web", "t").as_deref(), Some("pending"));
    assert_eq!(h.client_status("web").as_deref(), Some("pending"));
    assert!(h.starts("t").is_empty());
    assert_eq!(
        h.event_messages("web", "t", "Driver Failure"),
        ["Driver mock is unhealthy: unhealthy: unhealthy; the task starts when it recovers"]
    );

    h.mock.set_health(Health::Healthy);
    let recovered_at = h.clock.now();
    h.until("running", |h| {
        h.task_state("web", "t").as_deref() == Some("running")
    })
    .await;
    assert_eq!(h.starts("t").len(), 1);
    assert!(h.starts("t")[0] <= recovered_at + Duration::from_secs(5));
}
