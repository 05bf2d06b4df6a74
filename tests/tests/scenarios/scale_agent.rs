//! Many real tasks across an agent's SIGKILL: a real `stead agent` runs N exec tasks
//! (200 by default; `STEAD_SCALE_TASKS` raises it, `make soak` runs more), is killed
//! with SIGKILL and started again on the same data dir. Every task is reattached: the
//! same pids, no restart, no second start, and no process more or less.

use crate::agent_support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use agent_support::{Agent, AgentDirs, kill_all_with, processes_with, unique_nap, wait_for};
use stead_schemas::api::AllocListItem;

/// Kills every task process of the test when it ends, passed or not.
struct Cleanup(String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        kill_all_with(&self.0);
    }
}

fn tasks() -> usize {
    std::env::var("STEAD_SCALE_TASKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
}

/// An alloc whose one exec task sleeps, one process under its supervisor.
fn sleeper(name: &str, nap: &str) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  tasks:\n    - name: main\n      driver: exec\n      killTimeout: 1s\n      config:\n        command: /bin/sleep\n        args: [\"{nap}\"]\n"
    )
}

/// Every alloc's task pid and count of starts, once all `count` allocs run, within
/// `within`.
fn all_running(
    agent: &Agent,
    count: usize,
    within: Duration,
) -> BTreeMap<String, (u32, u32, usize)> {
    wait_for("every task to run", within, || {
        let (_, body) = agent.try_get("/v1/allocs").ok_or("no answer")?;
        let list: Vec<AllocListItem> = serde_json::from_str(&body).map_err(|e| e.to_string())?;
        let running = list.iter().filter(|i| i.running_tasks == 1).count();
        if running < count {
            return Err(format!("{running} of {count} run"));
        }
        Ok(())
    });
    (0..count)
        .map(|i| {
            let name = format!("s{i}");
            let status = agent.status(&name).expect("a status");
            let task = &status.tasks["main"];
            let starts = task
                .events
                .iter()
                .filter(|e| e.event_type == "Started")
                .count();
            (name, (task.pid.expect("a pid"), task.restarts, starts))
        })
        .collect()
}

#[test]
fn every_task_of_many_is_reattached_after_an_agent_sigkill_with_its_pid_and_no_restart() {
    let count = tasks();
    let nap = unique_nap();
    let _cleanup = Cleanup(nap.clone());
    let dirs = AgentDirs::new("");
    for i in 0..count {
        dirs.write_spec(&format!("s{i}"), &sleeper(&format!("s{i}"), &nap));
    }
    let agent = dirs.start();
    let before = all_running(&agent, count, Duration::from_secs(120));
    assert_eq!(processes_with(&nap).len(), count, "one sleeper per task");
    assert!(
        before
            .values()
            .all(|(_, restarts, starts)| *restarts == 0 && *starts == 1)
    );

    agent.kill9();
    let restarted = Instant::now();
    let next = dirs.start();
    let after = all_running(&next, count, Duration::from_secs(60));
    let reattached = restarted.elapsed();
    assert_eq!(after, before, "the same pids, no restart, no second start");
    let mut pids: Vec<u32> = before.values().map(|(pid, _, _)| *pid).collect();
    let mut live = processes_with(&nap);
    pids.sort_unstable();
    live.sort_unstable();
    assert_eq!(live, pids, "the same processes, none more, none less");
    eprintln!("{count} tasks reattached {reattached:?} after the agent was started again");
}

/// The pids of the `count` allocs' tasks that run, and the messages of those whose start
/// was refused for want of open files, once `runs` run and `refused` were refused.
fn split(agent: &Agent, count: usize, runs: usize, refused: usize) -> (Vec<u32>, Vec<String>) {
    wait_for(
        "the tasks to run or be refused",
        Duration::from_secs(60),
        || {
            let mut running = Vec::new();
            let mut refusals = Vec::new();
            for i in 0..count {
                let name = format!("s{i}");
                let Some(status) = agent.status(&name) else {
                    continue;
                };
                let task = &status.tasks["main"];
                if task.state == "running" {
                    running.push(task.pid.expect("a pid"));
                } else if let Some(event) = task
                    .events
                    .iter()
                    .find(|e| e.event_type == "Driver Failure" && e.message.contains("open files"))
                {
                    refusals.push(event.message.clone());
                }
            }
            if running.len() == runs && refusals.len() == refused {
                Ok((running, refusals))
            } else {
                Err(format!("{} run, {} refused", running.len(), refusals.len()))
            }
        },
    )
}

#[test]
fn a_start_beyond_the_open_files_the_agent_keeps_is_refused_with_an_event_and_a_reattach_never_is()
{
    let nap = unique_nap();
    let _cleanup = Cleanup(nap.clone());
    // Kept: 256 + 16 connections + 8 followed logs + 4 for the one exec session = 284 of
    // 300, so 16 tasks fit (each holds one), and the 17th start is refused.
    let dirs = AgentDirs::new("api: {maxConnections: 16, maxLogStreams: 8, maxExecs: 1}\n");
    for i in 0..20 {
        dirs.write_spec(&format!("s{i}"), &sleeper(&format!("s{i}"), &nap));
    }
    let agent = dirs.start_after("ulimit -n 300");
    let (mut running, refusals) = split(&agent, 20, 16, 4);
    assert!(
        refusals[0].contains("keeps 284 of its 300 open files")
            && refusals[0].contains("raise its limit of open files (LimitNOFILE)"),
        "{refusals:?}"
    );

    // After a SIGKILL, the next agent under the same limit reattaches all 16: none is
    // refused, and the others still are.
    agent.kill9();
    let next = dirs.start_after("ulimit -n 300");
    let (mut again, _) = split(&next, 20, 16, 4);
    running.sort_unstable();
    again.sort_unstable();
    assert_eq!(again, running, "the same tasks, reattached");

    // Four of the reattached tasks stopped: their descriptors count no more, so four new
    // allocs start (the room is counted as runs start and end, never found by a scan).
    let names: Vec<String> = (0..20)
        .map(|i| format!("s{i}"))
        .filter(|name| {
            next.status(name)
                .is_some_and(|s| s.tasks["main"].state == "running")
        })
        .take(4)
        .collect();
    for name in &names {
        dirs.remove_spec(name);
    }
    for i in 0..4 {
        dirs.write_spec(&format!("n{i}"), &sleeper(&format!("n{i}"), &nap));
    }
    wait_for("16 running again", Duration::from_secs(60), || {
        let running = (0..20)
            .map(|i| format!("s{i}"))
            .chain((0..4).map(|i| format!("n{i}")))
            .filter(|name| {
                next.status(name)
                    .is_some_and(|s| s.tasks["main"].state == "running")
            })
            .count();
        (running == 16)
            .then_some(())
            .ok_or_else(|| format!("{running} running"))
    });
}
