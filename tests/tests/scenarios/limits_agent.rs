//! Resource limits through the real `stead agent` binary, real processes and the real
//! cgroups of this machine: an OOM kill reported as such (and a `kill -9` not), a pids
//! limit a fork hits, a CPU quota a busy loop is held to, a daemonised grandchild gone
//! after the kill timeout, limits and stats kept across an agent's SIGKILL, nothing left
//! after a drain, and an agent without a writable cgroup.
//!
//! Limits need the agent to be root (or delegated a cgroup); as another user these tests
//! say so and check nothing.

use crate::agent_support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agent_support::{Agent, AgentDirs, processes_with, wait_for};
use stead_schemas::api::{AllocStats, CgroupStats, NodeStatus};
use stead_schemas::status::TaskStatus;
use stead_tests::running_as_root;

const MIB: u64 = 1024 * 1024;

fn hog() -> &'static str {
    env!("CARGO_BIN_EXE_stead-test-hog")
}

/// An alloc `name` of one exec task `main` running `command` with `args`, with
/// `resources` (a YAML flow mapping) and no restarts.
fn limited(name: &str, resources: &str, command: &str, args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  restart: {{attempts: 0, mode: fail}}\n  tasks:\n    - name: main\n      driver: exec\n      killTimeout: 2s\n      config:\n        command: {command}\n        args: [{}]\n      resources: {resources}\n",
        args.join(", ")
    )
}

/// Whether limits can be tested here; prints why not.
fn can_limit() -> bool {
    if !running_as_root() {
        eprintln!("skipped: only root has cgroups to put tasks in");
        return false;
    }
    true
}

fn task(agent: &Agent, name: &str, what: &str, check: impl Fn(&TaskStatus) -> bool) -> TaskStatus {
    agent.wait_for_task(name, what, Duration::from_secs(30), check)
}

fn node(agent: &Agent) -> NodeStatus {
    let (code, body) = agent.try_get("/v1/node").expect("the agent answers");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("a node document")
}

/// What the cgroup of task `main` of `name` counts now.
fn cgroup_stats(agent: &Agent, name: &str) -> CgroupStats {
    wait_for("the task's cgroup stats", Duration::from_secs(10), || {
        let (code, body) = agent
            .try_get(&format!("/v1/allocs/{name}/stats"))
            .ok_or_else(|| "no answer".to_owned())?;
        if code != 200 {
            return Err(body);
        }
        let stats: AllocStats = serde_json::from_str(&body).expect("a stats document");
        stats
            .tasks
            .get("main")
            .and_then(|t| t.cgroup)
            .ok_or_else(|| body.clone())
    })
}

/// The dir holding the agent's task cgroups (its first hierarchy's), from its
/// fingerprint.
fn cgroup_root(agent: &Agent) -> PathBuf {
    let node = node(agent);
    let exec = &node.drivers["exec"];
    assert_eq!(exec.attributes["cgroup.limits"], "true", "{exec:#?}");
    PathBuf::from(&exec.attributes["cgroup.root"])
}

/// The task cgroups left below the agent's parent, in every hierarchy.
fn left(dirs: &AgentDirs) -> Vec<PathBuf> {
    let parents = stead_tests::test_cgroups(&dirs.cgroup_parent);
    assert!(
        !parents.is_empty(),
        "no cgroup named {}",
        dirs.cgroup_parent
    );
    parents
        .iter()
        .flat_map(|p| stead_tests::subdirs(p))
        .collect()
}

#[test]
fn a_task_over_its_memory_limit_is_oom_killed_and_says_so_and_one_killed_from_outside_does_not() {
    if !can_limit() {
        return;
    }
    let dirs = AgentDirs::new("");
    dirs.write_spec(
        "greedy",
        &limited("greedy", "{memoryMB: 64}", hog(), &["512"]),
    );
    dirs.write_spec(
        "modest",
        &limited("modest", "{memoryMB: 64}", hog(), &["8"]),
    );
    let agent = dirs.start();

    let greedy = task(&agent, "greedy", "the greedy task died", |t| {
        t.state == "dead"
    });
    let started = greedy
        .events
        .iter()
        .find(|e| e.event_type == "Started")
        .expect("a Started event");
    let terminated = greedy
        .events
        .iter()
        .find(|e| e.event_type == "Terminated")
        .expect("a Terminated event");
    assert_eq!(
        terminated.message, "Exit Code: 137, Signal: 9, OOM Killed",
        "{greedy:#?}"
    );
    assert!(terminated.oom_killed);
    let took = terminated.time.saturating_duration_since(started.time);
    assert!(
        took < Duration::from_secs(1),
        "died {took:?} after its start"
    );
    let last = greedy.last_exit.as_ref().expect("a last exit");
    assert!(last.oom_killed && last.exit_code == 137 && last.signal == Some(9));
    let (_, metrics) = agent.try_get("/metrics").expect("metrics");
    assert!(
        metrics.contains(r#"stead_task_oom_kills_total{alloc="greedy",task="main"} 1"#),
        "{metrics}"
    );

    let modest = task(&agent, "modest", "the modest task runs", |t| {
        t.state == "running" && t.pid.is_some()
    });
    let (_, metrics) = agent.try_get("/metrics").expect("metrics");
    for series in [
        r#"stead_task_oom_kills_total{alloc="modest",task="main"} 0"#,
        r#"stead_task_cpu_seconds_total{alloc="modest",task="main"} "#,
        r#"stead_task_memory_bytes{alloc="modest",task="main"} "#,
    ] {
        assert!(metrics.contains(series), "{series} in {metrics}");
    }
    let pid = rustix::process::Pid::from_raw(modest.pid.expect("a pid") as i32).expect("a pid");
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("killed");
    let modest = task(&agent, "modest", "the modest task died", |t| {
        t.state == "dead"
    });
    let last = modest.last_exit.as_ref().expect("a last exit");
    assert_eq!(
        (last.exit_code, last.signal, last.oom_killed),
        (137, Some(9), false)
    );
    let terminated = modest
        .events
        .iter()
        .find(|e| e.event_type == "Terminated")
        .expect("a Terminated event");
    assert_eq!(terminated.message, "Exit Code: 137, Signal: 9");
}

#[test]
fn a_task_limited_to_five_pids_cannot_fork_a_sixth_process_and_sees_why() {
    if !can_limit() {
        return;
    }
    let dirs = AgentDirs::new("");
    let script =
        "for i in 1 2 3 4; do sleep 301 & done; echo forked four; sleep 301 & echo forked a sixth";
    dirs.write_spec(
        "forks",
        &limited("forks", "{pids: 5}", "/bin/sh", &["-c", script]),
    );
    let agent = dirs.start();
    let forks = task(&agent, "forks", "the task ended", |t| t.state == "dead");
    let status = agent.status("forks").expect("a status");
    let logs = dirs.data.join("allocs").join(&status.id).join("alloc/logs");
    let read = |name: &str| std::fs::read_to_string(logs.join(name)).unwrap_or_default();
    assert_eq!(read("main.stdout.0"), "forked four\n", "{forks:#?}");
    assert!(
        read("main.stderr.0").contains("Cannot fork"),
        "{}",
        read("main.stderr.0")
    );
    assert_eq!(forks.last_exit.as_ref().map(|e| e.exit_code), Some(2));
}

#[test]
fn a_hard_cpu_limit_of_a_quarter_core_holds_a_busy_loop_to_a_quarter_of_a_core() {
    if !can_limit() {
        return;
    }
    let _turn = stead_tests::real_time_turn();
    let dirs = AgentDirs::new("");
    let agent = dirs.start();
    let resources = node(&agent).resources.expect("the node's resources");
    let quarter = resources.cpu_mhz_per_core / 4;
    dirs.write_spec(
        "spin",
        &limited(
            "spin",
            &format!("{{cpu: {quarter}, cpuHardLimit: true}}"),
            "/bin/sh",
            &["-c", "while :; do :; done"],
        ),
    );
    task(&agent, "spin", "the busy loop runs", |t| {
        t.state == "running"
    });
    let (first, from) = (cgroup_stats(&agent, "spin"), Instant::now());
    std::thread::sleep(Duration::from_secs(5));
    let (last, to) = (cgroup_stats(&agent, "spin"), Instant::now());
    let share = (last.cpu_seconds - first.cpu_seconds) / (to - from).as_secs_f64();
    assert!(
        (0.20..=0.30).contains(&share),
        "the loop used {:.1} % of a core",
        share * 100.0
    );
    assert!(
        last.cpu_throttled_seconds.is_some_and(|s| s > 0.0),
        "{last:?}"
    );
    let reserved = node(&agent).resources.expect("resources");
    assert_eq!(reserved.reserved_cpu_mhz, u64::from(quarter));
}

#[test]
fn a_grandchild_that_called_setsid_and_ignores_sigterm_is_gone_after_the_kill_timeout() {
    if !can_limit() {
        return;
    }
    let dirs = AgentDirs::new("");
    let nap = agent_support::unique_nap();
    let script = format!(
        "setsid sh -c 'trap \"\" TERM; sleep {nap}; :' & trap 'exit 0' TERM; while :; do sleep 0.2; done"
    );
    dirs.write_spec(
        "daemon",
        &limited("daemon", "{memoryMB: 64}", "/bin/sh", &["-c", &script]),
    );
    let agent = dirs.start();
    task(&agent, "daemon", "the task runs", |t| t.state == "running");
    assert!(!left(&dirs).is_empty(), "the run has its cgroups");
    wait_for("the grandchild runs", Duration::from_secs(10), || {
        (!processes_with(&nap).is_empty())
            .then_some(())
            .ok_or_else(|| "not yet".to_owned())
    });
    dirs.remove_spec("daemon");
    task(&agent, "daemon", "the task was stopped", |t| {
        t.state == "dead"
    });
    assert!(
        processes_with(&nap).is_empty(),
        "the grandchild outlived its task"
    );
    wait_for(
        "the run's cgroups are removed",
        Duration::from_secs(5),
        || {
            let left = left(&dirs);
            left.is_empty().then_some(()).ok_or(format!("{left:?}"))
        },
    );
}

#[test]
fn an_agent_killed_and_restarted_keeps_the_limits_and_stats_and_a_drain_leaves_no_cgroup() {
    if !can_limit() {
        return;
    }
    let dirs = AgentDirs::new("shutdown: drain\n");
    dirs.write_spec(
        "kept",
        &limited("kept", "{memoryMB: 64, pids: 20, cpu: 100}", hog(), &["8"]),
    );
    let agent = dirs.start();
    let before = task(&agent, "kept", "the task runs", |t| {
        t.state == "running" && t.pid.is_some()
    });
    cgroup_root(&agent);
    let stats = cgroup_stats(&agent, "kept");
    assert_eq!(stats.memory_limit_bytes, Some(64 * MIB), "{stats:?}");
    assert_eq!(stats.pids_limit, Some(20), "{stats:?}");
    // The hog touches its 8 MiB after it starts: the cgroup counts them once it has.
    wait_for(
        "the task's memory is counted",
        Duration::from_secs(10),
        || {
            let stats = cgroup_stats(&agent, "kept");
            stats
                .memory_bytes
                .filter(|m| *m >= 8 * MIB)
                .map(|_| ())
                .ok_or_else(|| format!("{stats:?}"))
        },
    );
    agent.kill9();

    let agent = dirs.start();
    let after = task(&agent, "kept", "the task was reattached", |t| {
        t.state == "running"
    });
    assert_eq!(after.pid, before.pid, "the task ran on");
    assert_eq!(after.restarts, 0);
    let stats = cgroup_stats(&agent, "kept");
    assert_eq!(stats.memory_limit_bytes, Some(64 * MIB), "{stats:?}");
    assert_eq!(stats.pids_limit, Some(20), "{stats:?}");
    let pid = before.pid.expect("a pid");
    let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("the task's cgroups");
    let id = agent.status("kept").expect("a status").id;
    assert!(
        own.contains(&format!("/{}/{id}.main.", dirs.cgroup_parent)),
        "{own}"
    );

    assert!(!left(&dirs).is_empty());
    assert!(agent.terminate().success());
    assert!(left(&dirs).is_empty(), "left: {:?}", left(&dirs));
}

#[test]
fn without_a_writable_cgroup_limits_are_not_enforced_and_with_limits_required_the_start_fails() {
    if !can_limit() {
        return;
    }
    const NOBODY: u32 = 65_534;
    for (extra, event_type) in [
        ("", "Limits Not Enforced"),
        ("limits: required\n", "Driver Failure"),
    ] {
        let dirs = AgentDirs::new(extra);
        for entry in walk(dirs.root.path()) {
            std::os::unix::fs::lchown(&entry, Some(NOBODY), Some(NOBODY)).expect("chowned");
        }
        dirs.write_spec(
            "capped",
            &limited("capped", "{memoryMB: 64}", "/bin/sleep", &["300"]),
        );
        std::os::unix::fs::lchown(dirs.specs.join("capped.yaml"), Some(NOBODY), Some(NOBODY))
            .expect("chowned");
        let agent = dirs.start_as(NOBODY);
        let exec = node(&agent).drivers["exec"].clone();
        assert_eq!(exec.attributes["cgroup.limits"], "false", "{exec:#?}");
        let event = agent.wait_for_event("capped", "main", event_type, Duration::from_secs(30));
        assert!(
            event.message.contains("not root") && event.message.contains("cannot create"),
            "{event:#?}"
        );
        if event_type == "Driver Failure" {
            assert!(event.message.contains("limits: required"), "{event:#?}");
            let capped = task(&agent, "capped", "the task failed", |t| t.state == "dead");
            assert!(capped.failed);
        } else {
            task(&agent, "capped", "the task runs all the same", |t| {
                t.state == "running"
            });
        }
    }
}

/// `root` and everything below it.
fn walk(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![root.to_owned()];
    let mut i = 0;
    while i < out.len() {
        if out[i].is_dir() && !out[i].is_symlink() {
            let children: Vec<PathBuf> = std::fs::read_dir(&out[i])
                .map(|entries| entries.filter_map(Result::ok).map(|e| e.path()).collect())
                .unwrap_or_default();
            out.extend(children);
        }
        i += 1;
    }
    out
}

#[test]
fn an_exec_check_runs_in_its_tasks_cgroup_and_counts_against_its_limits() {
    if !can_limit() {
        return;
    }
    let dirs = AgentDirs::new("");
    let mut spec = limited("probed", "{memoryMB: 64, pids: 20}", "/bin/sleep", &["300"]);
    spec.push_str(
        "      checks:\n        - {name: where, type: exec, command: /bin/cat, args: [/proc/self/cgroup], interval: 1s}\n",
    );
    dirs.write_spec("probed", &spec);
    let agent = dirs.start();
    let probed = task(&agent, "probed", "the check passed", |t| {
        t.checks.iter().any(|c| c.status == "passing")
    });
    let id = agent.status("probed").expect("a status").id;
    let output = &probed.checks[0].output;
    let pids_line = output
        .lines()
        .find(|line| line.contains(":pids:") || line.starts_with("0::"))
        .unwrap_or_else(|| panic!("no pids or v2 line in {output}"));
    assert!(
        pids_line.contains(&format!("/{}/{id}.main.", dirs.cgroup_parent)),
        "{output}"
    );
}

#[test]
fn a_group_oom_kill_is_enforced_on_cgroup_v2_and_reported_as_not_enforced_elsewhere() {
    if !can_limit() {
        return;
    }
    let dirs = AgentDirs::new("");
    dirs.write_spec(
        "grouped",
        &limited(
            "grouped",
            "{memoryMB: 64, oomKillGroup: true}",
            "/bin/sleep",
            &["300"],
        ),
    );
    let agent = dirs.start();
    let version = node(&agent).drivers["exec"].attributes["cgroup.version"].clone();
    let grouped = task(&agent, "grouped", "the task runs", |t| t.state == "running");
    let warned = grouped
        .events
        .iter()
        .find(|e| e.event_type == "Limits Not Enforced");
    if version == "v2" {
        assert!(warned.is_none(), "{grouped:#?}");
        let id = agent.status("grouped").expect("a status").id;
        let group = left(&dirs)
            .into_iter()
            .find(|dir| dir.to_string_lossy().contains(&format!("{id}.main.")))
            .expect("the run's cgroup");
        assert_eq!(
            std::fs::read_to_string(group.join("memory.oom.group")).expect("read"),
            "1\n"
        );
    } else {
        let warned = warned.unwrap_or_else(|| panic!("no warning on {version}: {grouped:#?}"));
        assert_eq!(
            warned.message,
            "Task started without its resource limits: oomKillGroup needs cgroup v2 (memory.oom.group)"
        );
    }
}

#[test]
fn a_setsid_grandchild_dies_with_its_run_even_when_its_supervisor_was_killed_first() {
    if !can_limit() {
        return;
    }
    let dirs = AgentDirs::new("");
    let nap = agent_support::unique_nap();
    // The grandchild leaves the task's process group and session; once the supervisor
    // (the subreaper that would kill it) is gone, only the run's cgroup still holds it.
    let script =
        format!("setsid sh -c 'trap \"\" TERM; sleep {nap}; :' & while :; do sleep 0.2; done");
    dirs.write_spec(
        "orphan",
        &limited("orphan", "{memoryMB: 64}", "/bin/sh", &["-c", &script]),
    );
    let agent = dirs.start();
    let running = task(&agent, "orphan", "the task runs", |t| {
        t.state == "running" && t.pid.is_some()
    });
    wait_for("the grandchild runs", Duration::from_secs(10), || {
        (!processes_with(&nap).is_empty())
            .then_some(())
            .ok_or_else(|| "not yet".to_owned())
    });
    let supervisor =
        agent_support::parent_of(running.pid.expect("a pid")).expect("the task's supervisor");
    let pid = rustix::process::Pid::from_raw(supervisor as i32).expect("a pid");
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("killed");
    task(&agent, "orphan", "the run ended", |t| t.state == "dead");
    wait_for("nothing of the run is left", Duration::from_secs(5), || {
        let (grandchild, left) = (processes_with(&nap), left(&dirs));
        (grandchild.is_empty() && left.is_empty())
            .then_some(())
            .ok_or_else(|| format!("{grandchild:?} {left:?}"))
    });
}
