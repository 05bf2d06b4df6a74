//! An alloc's life around its revisions and the agent's restarts, through the real
//! binary: `stead alloc stop|start|gc|stats`, a user's stop outliving an agent restart
//! and a spec edit, garbage collection on demand, what a running task uses, the replaced
//! revision's logs, and an exit that happened while no agent ran.

use std::time::Duration;

use crate::agent_support::{AgentDirs, processes_with, service_spec, unique_nap, wait_for};

const WITHIN: Duration = Duration::from_secs(20);

#[test]
fn a_user_stop_outlives_an_agent_restart_and_a_spec_edit_until_a_start_clears_it() {
    let dirs = AgentDirs::new("");
    let marker = unique_nap();
    dirs.write_spec("web", &service_spec("web", &marker));
    let agent = dirs.start();
    agent.wait_for_task("web", "web running", WITHIN, |t| t.state == "running");

    let (code, out, err) = agent.cli(&["alloc", "stop", "web"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("stays stopped until `stead alloc start web`"),
        "{out}"
    );
    agent.wait_for_task("web", "web stopped", WITHIN, |t| t.state == "dead");
    wait_for("its process gone", WITHIN, || {
        let left = processes_with(&marker);
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{left:?}"))
        }
    });
    let status = agent.status("web").expect("web shown");
    assert_eq!(status.desired_status, "stop");
    assert!(status.stopped_by_user, "{status:#?}");
    let (_, shown, _) = agent.cli(&["alloc", "status", "web"]);
    assert!(
        shown.contains("stop (stopped by a user: `stead alloc start web` runs it again)"),
        "{shown}"
    );
    assert!(
        agent
            .log_text()
            .contains("stopping alloc=web reason=\"a user stopped it\""),
        "{}",
        agent.log_text()
    );

    // The stop is kept in the alloc's record: a new agent leaves it stopped, and so does
    // a new revision of its spec.
    agent.kill9();
    let agent = dirs.start();
    let edited = unique_nap();
    dirs.write_spec("web", &service_spec("web", &edited));
    let before = status.revision.clone();
    let status = wait_for("the edit taken, still stopped", WITHIN, || {
        let status = agent.status("web");
        status
            .clone()
            .filter(|s| {
                s.revision != before && s.tasks.get("main").is_some_and(|t| t.state == "dead")
            })
            .ok_or_else(|| format!("{status:#?}"))
    });
    assert!(status.stopped_by_user, "{status:#?}");
    assert_eq!(status.desired_status, "stop");
    assert!(processes_with(&marker).is_empty() && processes_with(&edited).is_empty());

    let (code, out, err) = agent.cli(&["alloc", "start", "web"]);
    assert_eq!(code, 0, "{out}{err}");
    let task = agent.wait_for_task("web", "web running again", WITHIN, |t| t.state == "running");
    assert_eq!(processes_with(&edited), vec![task.pid.expect("a pid")]);
    let status = agent.status("web").expect("web shown");
    assert!(!status.stopped_by_user, "{status:#?}");
    assert_eq!(status.desired_status, "run");
    assert!(
        agent
            .log_text()
            .contains("starting alloc=web reason=\"a user started it\""),
        "{}",
        agent.log_text()
    );
}

#[test]
fn a_start_cannot_overrule_a_spec_that_says_stop_and_an_unknown_alloc_is_an_error() {
    let dirs = AgentDirs::new("");
    let marker = unique_nap();
    let spec = service_spec("web", &marker).replace("spec:\n", "spec:\n  desiredStatus: stop\n");
    dirs.write_spec("web", &spec);
    let agent = dirs.start();
    wait_for("web shown", WITHIN, || {
        agent.status("web").ok_or(String::new())
    });
    let (code, out, err) = agent.cli(&["alloc", "start", "web"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("its spec says desiredStatus: stop (edit the spec to run it)"),
        "{err}"
    );
    let (code, out, err) = agent.cli(&["alloc", "stop", "nope"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("not found"), "{err}");
}

#[test]
fn gc_destroys_now_a_terminal_alloc_no_spec_declares_and_nothing_else() {
    let dirs = AgentDirs::new("");
    let (web, job) = (unique_nap(), unique_nap());
    dirs.write_spec("web", &service_spec("web", &web));
    dirs.write_spec("job", &service_spec("job", &job));
    let agent = dirs.start();
    agent.wait_for_task("web", "web running", WITHIN, |t| t.state == "running");
    agent.wait_for_task("job", "job running", WITHIN, |t| t.state == "running");
    let id = agent.status("web").expect("web shown").id;
    let alloc_dir = dirs.data.join("allocs").join(&id);
    assert!(alloc_dir.is_dir(), "{}", alloc_dir.display());

    // Declared and running: not collectable, by name or in a sweep.
    let (code, out, err) = agent.cli(&["alloc", "gc", "job"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("is not collectable"), "{err}");

    dirs.remove_spec("web");
    agent.wait_for_task("web", "web stopped", WITHIN, |t| t.state == "dead");
    let (code, out, err) = wait_for("web collectable", WITHIN, || {
        let answer = agent.cli(&["alloc", "gc", "--json"]);
        if answer.1.contains("\"web\"") {
            Ok(answer)
        } else {
            Err(format!("{answer:?}"))
        }
    });
    assert_eq!(code, 0, "{out}{err}");
    let result: stead_schemas::api::GcResult = serde_json::from_str(&out).expect("a GC result");
    assert_eq!(result.collected, ["web"]);
    assert!(agent.status("web").is_none(), "web is gone");
    assert!(!alloc_dir.exists(), "its dir is gone");
    assert_eq!(agent.alloc_names(), ["job"]);
    let (code, out, _) = agent.cli(&["alloc", "gc"]);
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "nothing to collect: no terminal alloc is left without a spec\n"
    );
    assert_eq!(processes_with(&job).len(), 1, "job runs on");
}

#[test]
fn stats_and_status_show_what_a_running_task_uses() {
    let dirs = AgentDirs::new("");
    let marker = unique_nap();
    dirs.write_spec("web", &service_spec("web", &marker));
    let agent = dirs.start();
    agent.wait_for_task("web", "web running", WITHIN, |t| t.state == "running");
    let (code, out, err) = agent.cli(&["alloc", "stats", "web"]);
    assert_eq!(code, 0, "{out}{err}");
    let header = out.lines().nth(1).unwrap_or_default();
    assert!(header.starts_with("Task  CPU"), "{out}");
    let row = out.lines().nth(2).unwrap_or_default();
    assert!(row.starts_with("main") && row.contains("MiB"), "{out}");
    let (code, out, _) = agent.cli(&["alloc", "stats", "web", "--json"]);
    assert_eq!(code, 0);
    let stats: stead_schemas::api::AllocStats = serde_json::from_str(&out).expect("stats");
    assert!(stats.tasks["main"].rss_bytes > 0, "{stats:#?}");
    let (_, shown, _) = agent.cli(&["alloc", "status", "web"]);
    assert!(shown.contains("Resources:       CPU "), "{shown}");
}

/// A service that prints `said` once, then runs until stopped.
fn saying(said: &str) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: web}}\nspec:\n  tasks:\n    - name: main\n      driver: exec\n      killTimeout: 2s\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"echo $0; trap 'exit 0' TERM; while :; do sleep 0.2; done\", \"{said}\"]\n"
    )
}

#[test]
fn the_replaced_revisions_logs_are_kept_one_revision_back_until_the_alloc_is_collected() {
    let dirs = AgentDirs::new("");
    let (first, second, third) = (unique_nap(), unique_nap(), unique_nap());
    dirs.write_spec("web", &saying(&first));
    let agent = dirs.start();
    let logs = |extra: &[&str]| {
        let mut args = vec!["alloc", "logs", "web", "main"];
        args.extend_from_slice(extra);
        agent.cli(&args)
    };
    wait_for("the first line", WITHIN, || {
        let (_, out, err) = logs(&[]);
        if out == format!("{first}\n") {
            Ok(())
        } else {
            Err(format!("{out}{err}"))
        }
    });
    let (code, _, err) = logs(&["--previous"]);
    assert_eq!(code, 1, "a first revision has no previous logs");
    assert!(err.contains("no logs of a previous revision"), "{err}");

    for (said, before) in [(&second, &first), (&third, &second)] {
        dirs.write_spec("web", &saying(said));
        wait_for("the new revision's line", WITHIN, || {
            let (_, out, err) = logs(&[]);
            if out == format!("{said}\n") {
                Ok(())
            } else {
                Err(format!("{out}{err}"))
            }
        });
        let (code, out, err) = logs(&["--previous"]);
        assert_eq!((code, out), (0, format!("{before}\n")), "{err}");
    }
    let (code, _, err) = logs(&["--previous", "-f"]);
    assert_eq!(
        code, 2,
        "a replaced revision's logs are not followed: {err}"
    );

    let id = agent.status("web").expect("web shown").id;
    let previous = dirs.data.join(format!("allocs/{id}/alloc/logs/previous"));
    assert!(previous.is_dir(), "{}", previous.display());
    dirs.remove_spec("web");
    agent.wait_for_task("web", "web stopped", WITHIN, |t| t.state == "dead");
    wait_for("web collected", WITHIN, || {
        let answer = agent.cli(&["alloc", "gc", "web"]);
        if answer.0 == 0 {
            Ok(())
        } else {
            Err(format!("{answer:?}"))
        }
    });
    assert!(!previous.exists(), "collected with the alloc");
}

#[test]
fn an_exit_while_the_agent_was_down_shows_when_it_happened_not_when_it_was_found() {
    let dirs = AgentDirs::new("");
    let marker = unique_nap();
    dirs.write_spec("web", &service_spec("web", &marker));
    let agent = dirs.start();
    let task = agent.wait_for_task("web", "web running", WITHIN, |t| t.state == "running");
    agent.kill9();
    let pid = rustix::process::Pid::from_raw(task.pid.expect("a pid") as i32).expect("a pid");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("signalled");
    wait_for("the task gone", WITHIN, || {
        let left = processes_with(&marker);
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{left:?}"))
        }
    });
    let gone = stead_schemas::Timestamp::from_since_epoch(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970"),
    );
    let agent = dirs.start();
    let terminated = agent.wait_for_event("web", "main", "Terminated", WITHIN);
    let (_, node) = agent.try_get("/v1/node").expect("the agent answers");
    let node: stead_schemas::api::NodeStatus = serde_json::from_str(&node).expect("a node");
    assert!(
        terminated.time <= gone && terminated.time < node.started_at,
        "Terminated at {}, the task was gone by {gone}, the agent started at {}",
        terminated.time,
        node.started_at
    );
    assert_eq!(terminated.exit_code, Some(0), "{terminated:?}");
}
