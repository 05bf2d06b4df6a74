//! The exec driver through the real `stead agent` binary: when its fork server starts,
//! and what a task inherits from the way the agent was launched.

mod agent_support;

use std::time::Duration;

use agent_support::{AgentDirs, kill_all_with, parent_of, processes_with, wait_for};

/// The `SigIgn` mask of `pid`, from `/proc/<pid>/status`.
fn ignored_signals(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let mask = status.lines().find_map(|l| l.strip_prefix("SigIgn:"))?;
    u64::from_str_radix(mask.trim(), 16).ok()
}

#[test]
fn a_task_of_an_agent_launched_with_sigint_and_sighup_ignored_ignores_nothing_and_stops_on_sigint()
{
    let dirs = AgentDirs::new("");
    let marker = format!("stead-signals-{}", std::process::id());
    // A task that leaves on SIGINT (the default kill signal) at once; only a SIGKILL,
    // 30 s later, would end it if SIGINT stayed ignored.
    dirs.write_spec(
        "trap",
        &format!(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: trap}}\nspec:\n  tasks:\n    - name: main\n      driver: exec\n      killTimeout: 30s\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"trap 'exit 130' INT; while :; do sleep 0.1; done\", \"{marker}\"]\n"
        ),
    );
    let agent = dirs.start_ignoring("INT QUIT HUP");
    let task = wait_for("the task runs", Duration::from_secs(20), || {
        processes_with(&marker)
            .first()
            .copied()
            .ok_or_else(|| agent.log_text())
    });
    assert_eq!(ignored_signals(task), Some(0), "the task ignores signals");

    dirs.remove_spec("trap");
    wait_for(
        "the task stopped on SIGINT",
        Duration::from_secs(10),
        || {
            if processes_with(&marker).is_empty() {
                Ok(())
            } else {
                Err(format!("{:?}", agent.status("trap")))
            }
        },
    );
    // The process is gone before the agent has read its supervisor's exit report.
    let terminated = wait_for("the task's exit recorded", Duration::from_secs(10), || {
        let status = agent.status("trap");
        status
            .as_ref()
            .and_then(|s| s.tasks.get("main"))
            .and_then(|t| t.events.iter().find(|e| e.event_type == "Terminated"))
            .cloned()
            .ok_or_else(|| format!("{status:#?}"))
    });
    assert_eq!(terminated.exit_code, Some(130), "{terminated:#?}");
    agent.terminate();
    kill_all_with(&marker);
}

/// The agent's children whose command line is the fork server's.
fn fork_servers_of(agent: u32) -> Vec<u32> {
    processes_with("--zygote")
        .into_iter()
        .filter(|pid| parent_of(*pid) == Some(agent))
        .collect()
}

#[test]
fn the_agent_starts_its_fork_server_before_any_spec_is_read_and_none_without_the_exec_driver() {
    // No spec at all: the server starts with the agent, not with the first exec task.
    let dirs = AgentDirs::new("");
    let agent = dirs.start();
    wait_for(
        "the fork server runs",
        Duration::from_secs(20),
        || match fork_servers_of(agent.child.id()).as_slice() {
            [_] => Ok(()),
            other => Err(format!("fork servers {other:?}:\n{}", agent.log_text())),
        },
    );
    assert!(agent.alloc_names().is_empty(), "nothing was declared");
    let status = agent.terminate();
    assert!(status.success(), "{status}");

    let dirs = AgentDirs::new("drivers: {exec: {enabled: false}, mock: {enabled: true}}\n");
    let agent = dirs.start();
    assert_eq!(
        fork_servers_of(agent.child.id()),
        Vec::<u32>::new(),
        "no exec driver, no fork server:\n{}",
        agent.log_text()
    );
    let status = agent.terminate();
    assert!(status.success(), "{status}");
}
