//! Health checks through the real `stead agent` binary and real processes: an http check
//! that restarts its task, an exec check that hangs, a tcp check of a closed port, a
//! restart policy that gives up, and an agent killed while a check fails.

use crate::agent_support;

use std::path::Path;
use std::time::Duration;

use agent_support::{AgentDirs, free_port, processes_with, service_spec, unique_nap, wait_for};
use stead_schemas::status::{TaskCheckStatus, TaskStatus};

/// The test service: 200 on every request, 500 while its flag file exists.
fn health_binary() -> &'static str {
    env!("CARGO_BIN_EXE_stead-test-health")
}

/// An alloc `name` whose task `main` runs the test service on `port` (failing while
/// `flag` exists), with an http check `alive` of `interval` restarting it after `limit`
/// failing intervals and a grace of 1s, under the group restart policy `restart`.
fn served(name: &str, port: u16, flag: &Path, interval: &str, limit: u32, restart: &str) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  restart: {restart}\n  tasks:\n    - name: main\n      driver: exec\n      killSignal: SIGKILL\n      config:\n        command: {}\n        args: [\"{port}\", \"{}\"]\n      checks:\n        - name: alive\n          type: http\n          port: {port}\n          path: /healthz\n          interval: {interval}\n          timeout: 1s\n          restart: {{limit: {limit}, grace: 1s}}\n",
        health_binary(),
        flag.display(),
    )
}

/// The exec alloc `name` of [`service_spec`] (its task runs until stopped and carries
/// `marker`), with `checks` (YAML list items, indented for the task) as its task's checks.
fn service_with_checks(name: &str, marker: &str, checks: &[String]) -> String {
    let mut spec = service_spec(name, marker);
    spec.push_str("      checks:\n");
    for check in checks {
        spec.push_str(&format!("        - {check}\n"));
    }
    spec
}

fn check<'t>(task: &'t TaskStatus, name: &str) -> &'t TaskCheckStatus {
    task.checks
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no check {name} in {task:#?}"))
}

#[test]
fn an_http_check_that_starts_failing_restarts_its_task_with_the_healthcheck_event() {
    let dirs = AgentDirs::new("");
    let port = free_port();
    let flag = dirs.root.path().join("failing");
    dirs.write_spec(
        "web",
        &served(
            "web",
            port,
            &flag,
            "1s",
            2,
            "{attempts: 3, interval: 10m, delay: 1s, mode: fail}",
        ),
    );
    let agent = dirs.start();
    wait_for("the alloc is healthy", Duration::from_secs(30), || {
        let status = agent.status("web");
        match &status {
            Some(s) if s.healthy == Some(true) => Ok(()),
            _ => Err(format!("{status:#?}")),
        }
    });
    let task = agent.status("web").expect("a status").tasks["main"].clone();
    assert!(
        check(&task, "alive").output.contains("200 OK Output: ok"),
        "{task:#?}"
    );
    assert_eq!(task.restarts, 0);
    let (_, metrics) = agent.try_get("/metrics").expect("metrics");
    for series in [
        r#"stead_check_status{alloc="web",task="main",check="alive",status="passing"} 1"#,
        r#"stead_check_status{alloc="web",task="main",check="alive",status="critical"} 0"#,
    ] {
        assert!(metrics.contains(series), "{series} in {metrics}");
    }

    std::fs::write(&flag, "").expect("flag written");
    let signaled = agent.wait_for_event("web", "main", "Restart Signaled", Duration::from_secs(30));
    assert_eq!(signaled.message, "healthcheck: check \"alive\" unhealthy");
    std::fs::remove_file(&flag).expect("flag removed");
    let task = agent.wait_for_task(
        "web",
        "the task restarted and runs again",
        Duration::from_secs(30),
        |t| {
            t.restarts == 1
                && t.state == "running"
                && t.events
                    .iter()
                    .filter(|e| e.event_type == "Started")
                    .count()
                    == 2
        },
    );
    let types: Vec<&str> = task.events.iter().map(|e| e.event_type.as_str()).collect();
    let signaled_at = types
        .iter()
        .position(|t| *t == "Restart Signaled")
        .expect("signaled");
    assert_eq!(
        types[signaled_at..],
        ["Restart Signaled", "Terminated", "Restarting", "Started"],
        "{task:#?}"
    );
    assert!(!task.failed);
    agent.wait_for_task(
        "web",
        "the check passes again",
        Duration::from_secs(30),
        |t| check(t, "alive").status == "passing",
    );
    let (_, metrics) = agent.try_get("/metrics").expect("metrics");
    assert!(
        metrics.contains("stead_check_restarts_total 1"),
        "{metrics}"
    );
    agent.terminate();
}

#[test]
fn a_hung_exec_check_is_killed_at_its_timeout_and_a_closed_port_fails_a_tcp_check() {
    let dirs = AgentDirs::new("");
    let closed = free_port();
    let nap = unique_nap();
    let marker = format!("stead-check-task-{}", std::process::id());
    dirs.write_spec(
        "hung",
        &service_with_checks(
            "hung",
            &marker,
            &[
                format!("{{name: script, type: exec, command: /bin/sh, args: [\"-c\", \"echo started; sleep {nap}; exit 0\"], interval: 30s, timeout: 1s}}"),
                format!("{{name: port, type: tcp, port: {closed}, interval: 30s, timeout: 1s}}"),
            ],
        ),
    );
    let agent = dirs.start();
    let task = agent.wait_for_task(
        "hung",
        "both checks are critical",
        Duration::from_secs(30),
        |t| t.checks.iter().all(|c| c.status == "critical"),
    );
    let script = check(&task, "script");
    assert!(
        script
            .output
            .starts_with("timed out after 1s; its process group was killed. Output: started"),
        "{script:#?}"
    );
    let port = check(&task, "port");
    assert!(
        port.output
            .starts_with(&format!("TCP connect 127.0.0.1:{closed}: "))
            && port.output.contains("refused"),
        "{port:#?}"
    );
    // The next run is 30s away: nothing of the first may be left.
    wait_for(
        "no process of the hung check is left",
        Duration::from_secs(5),
        || {
            let left = processes_with(&nap);
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{left:?}"))
            }
        },
    );
    let status = agent.status("hung").expect("a status");
    assert_eq!(status.healthy, Some(false));
    assert_eq!(
        status.tasks["main"].restarts, 0,
        "checks without restart only report"
    );
    let (_, metrics) = agent.try_get("/metrics").expect("metrics");
    assert!(
        metrics.lines().any(
            |l| l.starts_with("stead_check_results_total{status=\"critical\"}")
                && !l.ends_with(" 0")
        ),
        "{metrics}"
    );
    agent.terminate();
    agent_support::kill_all_with(&marker);
}

#[test]
fn a_task_that_keeps_failing_its_check_under_attempts_1_mode_fail_ends_failed() {
    let dirs = AgentDirs::new("");
    let port = free_port();
    let flag = dirs.root.path().join("failing");
    std::fs::write(&flag, "").expect("flag written");
    dirs.write_spec(
        "doomed",
        &served(
            "doomed",
            port,
            &flag,
            "1s",
            1,
            "{attempts: 1, interval: 10m, delay: 1s, mode: fail}",
        ),
    );
    let agent = dirs.start();
    let task = agent.wait_for_task("doomed", "the task failed", Duration::from_secs(60), |t| {
        t.state == "dead"
    });
    assert!(task.failed, "{task:#?}");
    assert_eq!(task.restarts, 1, "{task:#?}");
    let last = task.events.last().expect("events");
    assert_eq!(last.event_type, "Not Restarting", "{task:#?}");
    let status = agent.status("doomed").expect("a status");
    assert_eq!(status.client_status, "failed");
    agent.terminate();
}

#[test]
fn an_agent_killed_while_a_check_fails_restarts_the_task_at_the_same_deadline() {
    let _turn = stead_tests::real_time_turn();
    let dirs = AgentDirs::new("");
    let port = free_port();
    let flag = dirs.root.path().join("failing");
    // Unhealthy for interval × (limit − 1) = 8s restarts it.
    dirs.write_spec(
        "web",
        &served(
            "web",
            port,
            &flag,
            "2s",
            5,
            "{attempts: 3, interval: 10m, delay: 1s, mode: fail}",
        ),
    );
    let agent = dirs.start();
    agent.wait_for_task("web", "the check passes", Duration::from_secs(30), |t| {
        check(t, "alive").status == "passing"
    });
    std::fs::write(&flag, "").expect("flag written");
    let task = agent.wait_for_task("web", "the check fails", Duration::from_secs(30), |t| {
        check(t, "alive").status == "critical"
    });
    let unhealthy_since = check(&task, "alive").since.expect("a since");
    // Two more failing results, then the agent dies: 4s of the 8s are behind it.
    wait_for("4s of failure", Duration::from_secs(30), || {
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after the epoch");
        let now = stead_schemas::Timestamp::from_since_epoch(since_epoch);
        if now.saturating_duration_since(unhealthy_since) >= Duration::from_millis(4_300) {
            Ok(())
        } else {
            Err(format!("{now}"))
        }
    });
    agent.kill9();
    let agent = dirs.start();
    // The restarted agent shows the check as it was: no pending, no flap to healthy.
    let resumed = agent.status("web").expect("a status");
    let alive = check(&resumed.tasks["main"], "alive");
    assert_eq!(
        (alive.status.as_str(), alive.since),
        ("critical", Some(unhealthy_since)),
        "{resumed:#?}"
    );
    assert_eq!(resumed.healthy, Some(false));
    let signaled = agent.wait_for_event("web", "main", "Restart Signaled", Duration::from_secs(30));
    let after = signaled.time.saturating_duration_since(unhealthy_since);
    // Due 8s after the first failure; results come every 2s, so at most one interval late.
    assert!(
        after >= Duration::from_secs(8) && after <= Duration::from_millis(10_500),
        "restarted {after:?} after the check became unhealthy; a fresh grace and count would take about 5s more"
    );
    let status = agent.status("web").expect("a status");
    let started = status.tasks["main"]
        .events
        .iter()
        .filter(|e| e.event_type == "Started")
        .count();
    assert!(
        started <= 2,
        "the agent's restart did not restart the task: {status:#?}"
    );
    std::fs::remove_file(&flag).expect("flag removed");
    agent.terminate();
}

/// Every file named `name` under `dir`.
fn files_named(dir: &Path, name: &str) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(files_named(&path, name));
        } else if entry.file_name() == name {
            found.push(path);
        }
    }
    found
}

#[test]
fn an_exec_check_runs_as_its_task_in_its_dir_and_env_and_only_while_the_task_runs() {
    let dirs = AgentDirs::new("");
    // As root the task runs as nobody, so the check must too; otherwise as the agent.
    let (user, uid) = if agent_support::running_as_root() {
        ("\n      user: nobody", "65534".to_owned())
    } else {
        ("", rustix::process::geteuid().as_raw().to_string())
    };
    dirs.write_spec(
        "once",
        &format!(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: once}}\nspec:\n  type: batch\n  tasks:\n    - name: main\n      driver: exec{user}\n      env: {{GREETING: hello}}\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"sleep 3\"]\n      checks:\n        - name: script\n          type: exec\n          command: /bin/sh\n          args: [\"-c\", \"echo $(id -u) $STEAD_TASK_NAME $GREETING $(pwd) >> local/seen\"]\n          interval: 1s\n          timeout: 1s\n"
        ),
    );
    let agent = dirs.start();
    let task = agent.wait_for_task(
        "once",
        "the task ran and completed",
        Duration::from_secs(30),
        |t| t.state == "dead",
    );
    assert!(!task.failed, "{task:#?}");
    let seen = files_named(&dirs.data, "seen");
    let [seen] = seen.as_slice() else {
        panic!("one file written by the check: {seen:?}");
    };
    let lines = || {
        std::fs::read_to_string(seen)
            .expect("readable")
            .lines()
            .count()
    };
    let text = std::fs::read_to_string(seen).expect("readable");
    let task_dir = seen.parent().and_then(Path::parent).expect("the task dir");
    let first = text
        .lines()
        .next()
        .expect("the check ran while the task ran");
    assert_eq!(
        first,
        format!("{uid} main hello {}", task_dir.display()),
        "the check's user, env and dir"
    );
    // The task is dead: its check never runs again (three of its intervals go by).
    let ran = lines();
    for _ in 0..30 {
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(lines(), ran, "the check ran after its task died");
    }
    agent.terminate();
}

#[test]
fn an_exec_check_running_when_the_agent_is_sigkilled_dies_with_it() {
    let dirs = AgentDirs::new("");
    let nap = unique_nap();
    let marker = format!("stead-check-orphan-{}", std::process::id());
    dirs.write_spec(
        "hangs",
        &service_with_checks(
            "hangs",
            &marker,
            &[format!("{{name: slow, type: exec, command: /bin/sleep, args: [\"{nap}\"], interval: 1m, timeout: 1m}}")],
        ),
    );
    let agent = dirs.start();
    wait_for("the check runs", Duration::from_secs(30), || {
        let running = processes_with(&nap);
        if running.is_empty() {
            Err(format!("{:?}", agent.status("hangs")))
        } else {
            Ok(())
        }
    });
    agent.kill9();
    // Its parent-death signal ends it with the agent; the task itself lives on.
    wait_for(
        "the check died with the agent",
        Duration::from_secs(5),
        || {
            let left = processes_with(&nap);
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{left:?}"))
            }
        },
    );
    assert!(
        !processes_with(&marker).is_empty(),
        "the task outlives the agent"
    );
    agent_support::kill_all_with(&marker);
}
