//! The exec driver's acceptance scenarios (issue 4) with real processes, driven through
//! the node's public API with an in-memory store, a temporary data dir and real time.
//! "The agent restarts" is a fresh node and a fresh exec driver over the same store and
//! data dir: what a restarted agent has.

use crate::exec_support;

use std::time::Duration;

use exec_support::{
    ExecNode, alive, alloc, eventually, processes_of_alloc, read_pid, shell_alloc, start_time,
    stat_field,
};
use stead_controller::store::Store;
use stead_schemas::status::TaskEventStatus;

fn of_type<'a>(events: &'a [TaskEventStatus], event_type: &str) -> Vec<&'a TaskEventStatus> {
    events
        .iter()
        .filter(|e| e.event_type == event_type)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_exiting_3_starts_three_times_at_least_a_second_apart_then_fails() {
    let h = ExecNode::new();
    h.node.apply(shell_alloc(
        "three",
        "exit 3",
        "  restart: {attempts: 2, delay: 1s, interval: 1m, mode: fail}\n",
    ));
    h.until("the alloc failed", |h| {
        h.node
            .status("three")
            .is_some_and(|s| s.client_status == "failed")
    })
    .await;
    let events = h.events("three", "t");
    let started = of_type(&events, "Started");
    let terminated = of_type(&events, "Terminated");
    assert_eq!(started.len(), 3, "{events:#?}");
    assert_eq!(terminated.len(), 3, "{events:#?}");
    for exit in &terminated {
        assert_eq!(exit.exit_code, Some(3));
        assert_eq!(exit.message, "Exit Code: 3");
    }
    for (exit, next) in terminated.iter().zip(&started[1..]) {
        let waited = next.time.saturating_duration_since(exit.time);
        assert!(
            waited >= Duration::from_secs(1),
            "restarted after {waited:?}"
        );
    }
    assert_eq!(of_type(&events, "Not Restarting").len(), 1, "{events:#?}");
    let task = &h.status("three").tasks["t"];
    assert!(task.failed);
    assert_eq!(task.state, "dead");
    assert_eq!(task.restarts, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_a_task_that_traps_sigint_yields_killing_terminated_130_and_killed_without_sigkill()
 {
    let h = ExecNode::new();
    let script = "trap 'exit 130' INT; echo ready; while :; do sleep 0.05; done";
    h.node
        .apply(shell_alloc("trap", script, "  type: service\n"));
    h.until("running", |h| {
        h.task_state("trap", "t").as_deref() == Some("running")
    })
    .await;
    eventually("the trap is set", || {
        h.stdout("trap", "t", 0).contains("ready")
    })
    .await;
    let stop = shell_alloc("trap", script, "  type: service\n  desiredStatus: stop\n");
    h.node.apply(stop);
    h.until("dead", |h| {
        h.task_state("trap", "t").as_deref() == Some("dead")
    })
    .await;
    let events = h.events("trap", "t");
    let types: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(
        types,
        [
            "Received",
            "Task Setup",
            "Started",
            "Killing",
            "Terminated",
            "Killed"
        ]
    );
    let terminated = of_type(&events, "Terminated")[0];
    assert_eq!(terminated.exit_code, Some(130), "{events:#?}");
    assert_eq!(terminated.signal, None, "no SIGKILL: {events:#?}");
    let killing = of_type(&events, "Killing")[0];
    assert_eq!(
        killing.message,
        "Sent interrupt. Waiting 5s before force killing"
    );
    assert!(terminated.time.saturating_duration_since(killing.time) < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_ignoring_catchable_signals_is_sigkilled_a_kill_timeout_after_killing_with_its_grandchildren()
 {
    let h = ExecNode::new();
    // The shell ignores every catchable signal it may get, and so do the children and
    // grandchildren it forks (an ignored signal stays ignored across fork and exec).
    let script = "trap '' INT TERM HUP QUIT USR1 USR2; \
                  sh -c 'sleep 1000 & echo $! > local/grandchild; wait' & \
                  echo $! > local/child; \
                  while :; do sleep 1; done";
    let body = |status: &str| {
        format!(
            "  desiredStatus: {status}\n  tasks:\n    - name: t\n      driver: exec\n      killTimeout: 1s\n      config: {{command: /bin/sh, args: [\"-c\", {}]}}\n",
            serde_json::to_string(script).expect("a string")
        )
    };
    h.node.apply(alloc("stubborn", &body("run")));
    h.until("running", |h| {
        h.task_state("stubborn", "t").as_deref() == Some("running")
    })
    .await;
    let local = h.alloc_dir("stubborn").join("t/local");
    eventually("the grandchild is forked", || {
        read_pid(&local.join("grandchild")).is_some() && read_pid(&local.join("child")).is_some()
    })
    .await;
    let forked = [
        read_pid(&local.join("child")).expect("written"),
        read_pid(&local.join("grandchild")).expect("written"),
    ];
    assert!(forked.iter().all(|pid| alive(*pid)));
    h.node.apply(alloc("stubborn", &body("stop")));
    h.until("dead", |h| {
        h.task_state("stubborn", "t").as_deref() == Some("dead")
    })
    .await;
    let events = h.events("stubborn", "t");
    let killing = of_type(&events, "Killing")[0];
    let terminated = of_type(&events, "Terminated")[0];
    assert_eq!(
        killing.message,
        "Sent interrupt. Waiting 1s before force killing"
    );
    assert_eq!(terminated.signal, Some(9), "{events:#?}");
    assert_eq!(terminated.exit_code, Some(137));
    let after = terminated.time.saturating_duration_since(killing.time);
    assert!(
        after >= Duration::from_secs(1) && after < Duration::from_millis(2_500),
        "SIGKILLed {after:?} after Killing"
    );
    assert_eq!(of_type(&events, "Killed").len(), 1);
    eventually("the child and grandchild are gone", || {
        forked.iter().all(|pid| !alive(*pid))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_stopping_an_alloc_no_process_of_it_remains_not_even_a_daemonised_grandchild() {
    let h = ExecNode::new();
    // setsid -f forks; the child leaves the session and execs a shell that records its
    // pid and becomes `sleep`: a daemon whose parent exits at once (double fork + setsid).
    let script = "setsid -f /bin/sh -c 'echo $$ > local/daemon; exec sleep 1000'; exec sleep 1000";
    h.node.apply(shell_alloc("daemon", script, ""));
    h.until("running", |h| {
        h.task_state("daemon", "t").as_deref() == Some("running")
    })
    .await;
    let task_pid = h.pid("daemon", "t").expect("a pid");
    let daemon_file = h.alloc_dir("daemon").join("t/local/daemon");
    eventually("the daemon started", || read_pid(&daemon_file).is_some()).await;
    let daemon = read_pid(&daemon_file).expect("written");
    eventually("the daemon left the task's session", || {
        stat_field(daemon, 6).is_some_and(|sid| sid != task_pid.to_string())
    })
    .await;
    let alloc_id = h.alloc_id("daemon");
    assert!(processes_of_alloc(&alloc_id).contains(&daemon));
    h.node
        .apply(shell_alloc("daemon", script, "  desiredStatus: stop\n"));
    h.until("dead", |h| {
        h.task_state("daemon", "t").as_deref() == Some("dead")
    })
    .await;
    eventually("no process of the alloc remains", || {
        processes_of_alloc(&alloc_id).is_empty()
    })
    .await;
    assert!(!alive(daemon));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_reattaches_to_the_same_pids_without_new_started_events_and_keeps_restart_counts()
 {
    let h = ExecNode::new();
    let names: Vec<String> = (0..20).map(|i| format!("svc-{i}")).collect();
    for name in &names {
        h.node.apply(shell_alloc(name, "exec sleep 1000", ""));
    }
    // One task fails once first, so it has a restart count to keep.
    h.node.apply(shell_alloc(
        "flaky",
        "if [ ! -e local/once ]; then touch local/once; exit 1; fi; exec sleep 1000",
        "  restart: {attempts: 3, delay: 100ms, interval: 1m, mode: fail}\n",
    ));
    let all: Vec<String> = names
        .iter()
        .cloned()
        .chain(std::iter::once("flaky".to_owned()))
        .collect();
    h.until("all run, the flaky one after its restart", |h| {
        all.iter()
            .all(|n| h.task_state(n, "t").as_deref() == Some("running"))
            && h.node
                .status("flaky")
                .is_some_and(|s| s.tasks["t"].restarts == 1)
    })
    .await;
    let before: Vec<(u32, u64, usize, u32)> = all
        .iter()
        .map(|n| {
            let pid = h.pid(n, "t").expect("a pid");
            (
                pid,
                start_time(pid).expect("alive"),
                h.count(n, "t", "Started"),
                h.status(n).tasks["t"].restarts,
            )
        })
        .collect();
    assert_eq!(before.last().map(|b| b.3), Some(1), "flaky restarted once");

    let h = h.detach().await.start_agent();
    h.until("all restored and running", |h| {
        all.iter()
            .all(|n| h.task_state(n, "t").as_deref() == Some("running") && h.pid(n, "t").is_some())
    })
    .await;
    let after: Vec<(u32, u64, usize, u32)> = all
        .iter()
        .map(|n| {
            let pid = h.pid(n, "t").expect("a pid");
            (
                pid,
                start_time(pid).unwrap_or(0),
                h.count(n, "t", "Started"),
                h.status(n).tasks["t"].restarts,
            )
        })
        .collect();
    assert_eq!(after, before);

    // Reattached tasks are stopped like any others: nothing of them survives a drain.
    let ids: Vec<String> = all.iter().map(|n| h.alloc_id(n)).collect();
    h.drain().await;
    for id in ids {
        eventually("no process of a drained alloc remains", || {
            processes_of_alloc(&id).is_empty()
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_no_record_names_is_left_running_and_reattached_when_its_revision_is_applied_again()
{
    let h = ExecNode::new();
    let names = ["kept", "unrecorded", "edited", "unreadable"];
    for name in names {
        h.node.apply(shell_alloc(name, "exec sleep 1000", ""));
    }
    h.until("all run", |h| names.iter().all(|n| h.pid(n, "t").is_some()))
        .await;
    let pid = |name: &str| h.pid(name, "t").expect("a pid");
    let (kept, unrecorded, edited, unreadable) = (
        pid("kept"),
        pid("unrecorded"),
        pid("edited"),
        pid("unreadable"),
    );
    let unrecorded_id = h.alloc_id("unrecorded");
    let edited_id = h.alloc_id("edited");
    let unreadable_id = h.alloc_id("unreadable");

    // The records of "unrecorded" and "edited" are lost while no agent runs (as if the
    // agent died between their starts and their records, or the store lost them); the
    // record of "unreadable" is damaged.
    let down = h.detach().await;
    let name = |n: &str| n.parse().expect("a name");
    for lost in ["unrecorded", "edited"] {
        down.store.delete_alloc(&name(lost)).expect("deleted");
    }
    down.store.corrupt("unreadable", b"not a record".to_vec());
    let (h, report) = down.restore();
    assert_eq!(report.corrupt.len(), 1, "{:?}", report.corrupt);
    assert_eq!(report.unrecorded, 2, "{report:?}");

    h.until("the recorded task is reattached", |h| {
        h.pid("kept", "t") == Some(kept) && h.task_state("kept", "t").as_deref() == Some("running")
    })
    .await;
    for (what, pid) in [
        ("unrecorded", unrecorded),
        ("edited", edited),
        ("unreadable", unreadable),
    ] {
        assert!(
            alive(pid),
            "{what}: a task without a usable record is never killed for it"
        );
    }
    let lost = h.node.store_health().lost;
    assert_eq!(lost.len(), 2, "{lost:?}");
    assert!(lost.iter().any(|l| l.contains(&unrecorded_id)), "{lost:?}");
    assert!(!h.node.store_health().is_healthy());

    // Its spec, applied again at the same revision, reattaches the run: no second start.
    h.node
        .apply(shell_alloc("unrecorded", "exec sleep 1000", ""));
    h.until("the unrecorded run is reattached", |h| {
        h.pid("unrecorded", "t") == Some(unrecorded)
            && h.task_state("unrecorded", "t").as_deref() == Some("running")
    })
    .await;
    assert_eq!(processes_of_alloc(&unrecorded_id), [unrecorded]);
    assert_eq!(h.count("unrecorded", "t", "Started"), 1);

    // An edited spec (the spec moved on while no agent ran) stops the old revision's run
    // before its own starts.
    h.node.apply(shell_alloc("edited", "exec sleep 1001", ""));
    h.until("the new revision runs", |h| {
        h.pid("edited", "t").is_some_and(|pid| pid != edited)
            && h.task_state("edited", "t").as_deref() == Some("running")
    })
    .await;
    eventually("the old revision's run is stopped", || !alive(edited)).await;
    eventually("nothing of the old revision remains", || {
        processes_of_alloc(&edited_id).is_empty()
    })
    .await;
    assert!(
        h.node.store_health().lost.is_empty(),
        "{:?}",
        h.node.store_health()
    );
    assert!(
        alive(unreadable),
        "what runs for an alloc whose record cannot be read is left alone"
    );
    h.drain().await;
    // No agent knows it any more: the test kills it.
    for pid in processes_of_alloc(&unreadable_id) {
        if let Some(pid) = rustix::process::Pid::from_raw(pid.try_into().expect("a pid")) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_in_flight_at_a_crash_is_reattached_not_run_again() {
    let h = ExecNode::new();
    let spec = shell_alloc("inflight", "exec sleep 1000", "");
    h.node.apply(spec.clone());
    h.until("running", |h| h.pid("inflight", "t").is_some())
        .await;
    let old = h.pid("inflight", "t").expect("a pid");
    let alloc_id = h.alloc_id("inflight");

    // As if the agent died between the launch and the write of the task's handle: the
    // record is there, without the handle.
    let down = h.detach().await;
    drop_handles(&down.store, "inflight");

    let h = down.start_agent();
    h.node.apply(spec);
    h.until("the run is reattached", |h| {
        h.pid("inflight", "t") == Some(old)
            && h.task_state("inflight", "t").as_deref() == Some("running")
    })
    .await;
    assert!(alive(old));
    assert_eq!(processes_of_alloc(&alloc_id), [old], "exactly one run");
    h.drain().await;
    eventually("drained", || !alive(old)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_and_exit_code_of_a_task_that_ends_while_no_agent_runs_are_kept_and_it_restarts() {
    let h = ExecNode::new();
    let script = "n=0; while [ ! -e local/go ]; do n=$((n+1)); echo \"line $n\"; sleep 0.02; done; echo last; exit 7";
    h.node.apply(shell_alloc(
        "batch",
        script,
        "  restart: {attempts: 1, delay: 1s, interval: 1m, mode: fail}\n",
    ));
    h.until("running", |h| {
        h.task_state("batch", "t").as_deref() == Some("running")
    })
    .await;
    eventually("it writes", || {
        h.stdout("batch", "t", 0).contains("line 3\n")
    })
    .await;
    let alloc_dir = h.alloc_dir("batch");
    let pid = h.pid("batch", "t").expect("a pid");

    let down = h.detach().await;
    let lines_when_down = std::fs::read_to_string(alloc_dir.join("alloc/logs/t.stdout.0"))
        .expect("a log")
        .lines()
        .count();
    let log = alloc_dir.join("alloc/logs/t.stdout.0");
    eventually("it writes while no agent runs", || {
        std::fs::read_to_string(&log).is_ok_and(|text| text.lines().count() > lines_when_down + 3)
    })
    .await;
    std::fs::write(alloc_dir.join("t/local/go"), "").expect("written");
    eventually("the task exits while no agent runs", || !alive(pid)).await;
    let control = alloc_dir.join("t/.stead");
    eventually("its supervisor records the exit", || {
        std::fs::read_dir(&control).is_ok_and(|entries| {
            entries
                .filter_map(Result::ok)
                .any(|e| e.file_name().to_string_lossy().ends_with(".exit"))
        })
    })
    .await;

    let h = down.start_agent();
    h.until("the exit is reported and the task restarted", |h| {
        h.count("batch", "t", "Started") == 2
    })
    .await;
    let events = h.events("batch", "t");
    let terminated = of_type(&events, "Terminated");
    assert_eq!(terminated[0].exit_code, Some(7), "{events:#?}");
    assert_eq!(terminated[0].message, "Exit Code: 7");
    assert_eq!(h.status("batch").tasks["t"].restarts, 1);

    let log = h.stdout("batch", "t", 0);
    let lines: Vec<&str> = log.lines().collect();
    let numbered: Vec<&str> = lines.iter().copied().filter(|l| *l != "last").collect();
    assert!(
        numbered.len() > lines_when_down,
        "lines were written while down"
    );
    for (i, line) in numbered.iter().take(lines_when_down + 1).enumerate() {
        assert_eq!(*line, format!("line {}", i + 1));
    }
    assert!(lines.contains(&"last"), "{log}");
    h.drain().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_writing_50_mb_with_1_mb_files_leaves_exactly_3_files_of_whole_lines() {
    let h = ExecNode::new();
    // 524,288 lines of 100 bytes: 50 MiB.
    let perl = "for my $i (1..524288) { printf \"%07d %s\\n\", $i, \"x\" x 91 }";
    h.node.apply(alloc(
        "chatty",
        &format!(
            "  type: batch\n  tasks:\n    - name: t\n      driver: exec\n      logs: {{maxFiles: 3, maxFileSizeMB: 1}}\n      config: {{command: perl, args: [\"-e\", {}]}}\n",
            serde_json::to_string(perl).expect("a string")
        ),
    ));
    h.until("complete", |h| {
        h.node
            .status("chatty")
            .is_some_and(|s| s.client_status == "complete")
    })
    .await;
    let logs = h.alloc_dir("chatty").join("alloc/logs");
    let mut files: Vec<(u64, String)> = std::fs::read_dir(&logs)
        .expect("logs")
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let index = name.strip_prefix("t.stdout.")?.parse().ok()?;
            Some((index, std::fs::read_to_string(e.path()).expect("readable")))
        })
        .collect();
    files.sort();
    assert_eq!(
        files.len(),
        3,
        "{:?}",
        files.iter().map(|f| f.0).collect::<Vec<_>>()
    );
    let mut expected_next = None;
    for (index, text) in &files {
        assert!(text.ends_with('\n'), "file {index} ends mid-line");
        assert!(
            text.len() <= (1 << 20) + 64 * 1024,
            "file {index}: {} bytes",
            text.len()
        );
        for line in text.lines() {
            let (number, rest) = line.split_once(' ').expect("a whole line");
            assert_eq!(rest.len(), 91, "line {number} is cut");
            let number: u32 = number.parse().expect("a whole line");
            if let Some(next) = expected_next {
                assert_eq!(number, next, "lines are missing between files");
            }
            expected_next = Some(number + 1);
        }
    }
    assert_eq!(expected_next, Some(524_289), "the last line is kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_takes_the_alloc_dirs_no_alloc_claims_once_no_process_works_in_them() {
    let h = ExecNode::new();
    h.node.apply(shell_alloc("kept", "exec sleep 1000", ""));
    h.until("running", |h| h.pid("kept", "t").is_some()).await;
    let allocs = h.data.path().join("allocs");
    // Left by records lost in a crash: no alloc of their name is on the node. The specs
    // dir declares `broken` (its spec is invalid): its dir is its own. A replaced
    // revision's dir, moved aside to be removed, is no alloc's, `kept`'s neither.
    for orphan in [
        "ghost-0123abcd",
        "busy-0123abcd",
        "broken-0123abcd",
        ".retired-kept-0123abcd",
    ] {
        std::fs::create_dir_all(allocs.join(orphan).join("t")).expect("dir");
    }
    assert!(
        stead_controller::gc::orphaned_alloc_dirs(&h.node, h.data.path()).is_empty(),
        "nothing is collected before the specs dir was listed completely"
    );
    h.node
        .set_declared_allocs(Some(["kept".to_owned(), "broken".to_owned()].into()));
    let mut worker = std::process::Command::new("sleep")
        .arg("1000")
        .current_dir(allocs.join("busy-0123abcd/t"))
        .spawn()
        .expect("spawned");

    let mut orphans = stead_controller::gc::orphaned_alloc_dirs(&h.node, h.data.path());
    orphans.sort();
    assert_eq!(
        orphans,
        [
            allocs.join(".retired-kept-0123abcd"),
            allocs.join("ghost-0123abcd")
        ],
        "a dir a process works in is kept"
    );
    worker.kill().expect("killed");
    worker.wait().expect("reaped");
    let mut orphans = stead_controller::gc::orphaned_alloc_dirs(&h.node, h.data.path());
    orphans.sort();
    assert_eq!(
        orphans,
        [
            allocs.join(".retired-kept-0123abcd"),
            allocs.join("busy-0123abcd"),
            allocs.join("ghost-0123abcd")
        ]
    );
    assert!(allocs.join(h.alloc_id("kept")).is_dir());
    h.node.set_declared_allocs(None);
    assert!(
        stead_controller::gc::orphaned_alloc_dirs(&h.node, h.data.path()).is_empty(),
        "nor while an entry of the specs dir cannot be read"
    );
    h.drain().await;
}

/// An alloc of two exec tasks, `a` and `b`, each running `script`.
fn two_task_alloc(name: &str, script: &str) -> stead_schemas::ValidSpec {
    let script = serde_json::to_string(script).expect("a string");
    exec_support::alloc(
        name,
        &format!(
            "  tasks:\n    - name: a\n      driver: exec\n      config: {{command: /bin/sh, args: [\"-c\", {script}]}}\n    - name: b\n      driver: exec\n      config: {{command: /bin/sh, args: [\"-c\", {script}]}}\n"
        ),
    )
}

/// The record of `name` in `store` with its handles dropped, as an agent that died
/// between its tasks' launches and their records leaves it.
fn drop_handles(store: &stead_controller::store::MemoryStore, name: &str) {
    let mut record = store
        .load_allocs()
        .expect("loads")
        .into_iter()
        .map(|r| r.expect("decodes"))
        .find(|r| r.name.as_str() == name)
        .expect("the record");
    record.handles.clear();
    store.put_alloc(&record).expect("written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_no_record_names_of_a_replaced_revision_are_all_stopped_before_any_task_of_the_new_one_starts()
 {
    let h = ExecNode::new();
    h.node.apply(two_task_alloc("pair", "exec sleep 1000"));
    h.until("both run", |h| {
        h.pid("pair", "a").is_some() && h.pid("pair", "b").is_some()
    })
    .await;
    let old = [
        h.pid("pair", "a").expect("a"),
        h.pid("pair", "b").expect("b"),
    ];
    let old_id = h.alloc_id("pair");
    let down = h.detach().await;
    drop_handles(&down.store, "pair");
    let h = down.start_agent();

    // Each task of the new revision writes down which old process it saw alive.
    let probe = format!(
        "for p in {} {}; do kill -0 $p 2>/dev/null && echo $p; done > \"$STEAD_TASK_DIR/local/overlap\"; exec sleep 1001",
        old[0], old[1]
    );
    h.node.apply(two_task_alloc("pair", &probe));
    h.until("the new revision runs", |h| {
        ["a", "b"].iter().all(|t| {
            h.pid("pair", t).is_some_and(|pid| !old.contains(&pid))
                && h.task_state("pair", t).as_deref() == Some("running")
        })
    })
    .await;
    let new_dir = h.alloc_dir("pair");
    for task in ["a", "b"] {
        let overlap = new_dir.join(task).join("local/overlap");
        eventually("the probe wrote", || overlap.exists()).await;
        assert_eq!(
            std::fs::read_to_string(&overlap).expect("read"),
            "",
            "task {task} of the new revision started while an old run lived"
        );
    }
    assert!(processes_of_alloc(&old_id).is_empty());
    h.drain().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_no_record_names_of_an_alloc_whose_spec_is_removed_is_stopped_with_it() {
    let h = ExecNode::new();
    h.node.apply(shell_alloc("gone", "exec sleep 1000", ""));
    h.until("running", |h| h.pid("gone", "t").is_some()).await;
    let pid = h.pid("gone", "t").expect("a pid");
    let alloc_id = h.alloc_id("gone");
    let down = h.detach().await;
    drop_handles(&down.store, "gone");
    let h = down.start_agent();
    h.node.remove(&"gone".parse().expect("a name"));
    eventually("the run is stopped", || !alive(pid)).await;
    eventually("nothing of the alloc remains", || {
        processes_of_alloc(&alloc_id).is_empty()
    })
    .await;
    h.drain().await;
}
