//! The crash test: a real agent on a persistent data dir, specs churned (adds, edits,
//! deletes, user restarts), SIGKILLed at a random moment and started again, fifty times.
//! After each restart, within 5 s, every desired task runs exactly once (checked against
//! the process table), terminal allocs stay terminal, restart counts never go down, and
//! no event the API showed before the crash is lost or duplicated.
//!
//! `STEAD_CRASH_ITERATIONS` and `STEAD_CRASH_SEED` override the defaults (`make soak`
//! runs many more iterations).

use crate::agent_support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use agent_support::{AgentDirs, batch_spec, kill_all_with, processes_with, service_spec, wait_for};
use stead_schemas::status::{AllocStatus, TaskEventStatus};

/// Kills every task process of the test when it ends, passed or not.
struct Cleanup(String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        kill_all_with(&self.0);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Service,
    Batch,
}

/// What the specs directory declares.
#[derive(Debug, Default)]
struct Desired {
    /// Alloc name → kind and generation (each edit bumps it and changes the revision).
    allocs: BTreeMap<String, (Kind, u32)>,
    next_name: u32,
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn marker(token: &str, name: &str, generation: u32) -> String {
    // The trailing dot keeps generation 1 from matching generation 10.
    format!("{token}-{name}-g{generation}.")
}

fn write(dirs: &AgentDirs, token: &str, name: &str, kind: Kind, generation: u32) {
    let marker = marker(token, name, generation);
    let yaml = match kind {
        Kind::Service => service_spec(name, &marker),
        Kind::Batch => batch_spec(name, &marker),
    };
    dirs.write_spec(name, &yaml);
}

fn event_key(event: &TaskEventStatus) -> (String, String, String) {
    (
        event.event_type.clone(),
        event.time.to_string(),
        event.message.clone(),
    )
}

/// Checks one restart against what was desired and what the API showed before the crash.
fn converged(
    agent: &agent_support::Agent,
    token: &str,
    desired: &Desired,
    removed: &BTreeSet<String>,
    before: &BTreeMap<String, AllocStatus>,
) -> Result<(), String> {
    for (name, (kind, generation)) in &desired.allocs {
        let status = agent
            .status(name)
            .ok_or_else(|| format!("{name} is not shown"))?;
        let task = status
            .tasks
            .get("main")
            .ok_or_else(|| format!("{name} has no task main"))?;
        let current = marker(token, name, *generation);
        let all = processes_with(&format!("{token}-{name}-g"));
        match kind {
            Kind::Service => {
                let pid = task
                    .pid
                    .filter(|_| task.state == "running")
                    .ok_or_else(|| format!("{name} is not running: {}", task.state))?;
                let mine = processes_with(&current);
                if mine != vec![pid] || all != mine {
                    return Err(format!(
                        "{name}: want exactly pid {pid} with {current}, found {mine:?} (all generations {all:?})"
                    ));
                }
            }
            Kind::Batch => {
                if status.client_status != "complete" {
                    return Err(format!("{name} is {}", status.client_status));
                }
                let starts = task
                    .events
                    .iter()
                    .filter(|e| e.event_type == "Started")
                    .count();
                if starts != 1 {
                    return Err(format!("batch {name} started {starts} times"));
                }
                if !all.is_empty() {
                    return Err(format!("batch {name} has processes {all:?}"));
                }
            }
        }
        if let Some(old) = before.get(name)
            && old.revision == status.revision
        {
            let old_task = &old.tasks["main"];
            if task.restarts < old_task.restarts {
                return Err(format!(
                    "{name}: restarts went down from {} to {}",
                    old_task.restarts, task.restarts
                ));
            }
            let after: Vec<_> = task.events.iter().map(event_key).collect();
            let unique: BTreeSet<_> = after.iter().collect();
            if unique.len() != after.len() {
                return Err(format!("{name}: duplicated events {after:?}"));
            }
            // Events older than the oldest kept may have been dropped by the cap.
            let oldest = task.events.first().map(|e| e.time);
            for event in &old_task.events {
                if oldest.is_some_and(|oldest| event.time < oldest) {
                    continue;
                }
                if !unique.contains(&event_key(event)) {
                    return Err(format!("{name}: lost event {event:?}; now {after:?}"));
                }
            }
        }
    }
    for name in removed {
        let left = processes_with(&format!("{token}-{name}-g"));
        if !left.is_empty() {
            let log: Vec<String> = agent
                .log_text()
                .lines()
                .filter(|line| line.contains(name.as_str()))
                .map(str::to_owned)
                .collect();
            return Err(format!(
                "removed {name} still has processes {left:?}; its log lines:\n{}",
                log.join("\n")
            ));
        }
    }
    Ok(())
}

#[test]
fn an_agent_killed_at_random_moments_resumes_every_task_exactly_once() {
    let _turn = stead_tests::real_time_turn();
    let iterations = env_number("STEAD_CRASH_ITERATIONS", 50);
    let seed = env_number("STEAD_CRASH_SEED", 20_261_122);
    let mut rng = fastrand::Rng::with_seed(seed);
    let token = format!("stead-crash-{}", std::process::id());
    let _cleanup = Cleanup(token.clone());
    // Garbage collection passes often, so that each crash's leftovers meet one.
    let dirs = AgentDirs::new("maxTaskEvents: 20\ngc:\n  interval: 2s\n");
    let mut desired = Desired::default();
    let mut removed = BTreeSet::new();
    for _ in 0..4 {
        let name = format!("svc{}", desired.next_name);
        desired.next_name += 1;
        write(&dirs, &token, &name, Kind::Service, 1);
        desired.allocs.insert(name, (Kind::Service, 1));
    }
    write(&dirs, &token, "batch", Kind::Batch, 1);
    desired.allocs.insert("batch".to_owned(), (Kind::Batch, 1));

    let mut agent = dirs.start();
    wait_for("the first convergence", Duration::from_secs(10), || {
        converged(&agent, &token, &desired, &removed, &BTreeMap::new())
    });
    for iteration in 0..iterations {
        for _ in 0..rng.usize(1..=4) {
            let services: Vec<String> = desired
                .allocs
                .iter()
                .filter(|(_, (kind, _))| *kind == Kind::Service)
                .map(|(name, _)| name.clone())
                .collect();
            match rng.u8(0..4) {
                0 if services.len() < 8 => {
                    let name = format!("svc{}", desired.next_name);
                    desired.next_name += 1;
                    write(&dirs, &token, &name, Kind::Service, 1);
                    desired.allocs.insert(name, (Kind::Service, 1));
                }
                1 if !services.is_empty() => {
                    let name = &services[rng.usize(..services.len())];
                    let entry = desired.allocs.get_mut(name).expect("desired");
                    entry.1 += 1;
                    write(&dirs, &token, name, Kind::Service, entry.1);
                }
                2 if services.len() > 1 => {
                    let name = services[rng.usize(..services.len())].clone();
                    dirs.remove_spec(&name);
                    desired.allocs.remove(&name);
                    removed.insert(name);
                }
                _ if !services.is_empty() => {
                    let name = &services[rng.usize(..services.len())];
                    // The alloc may not have been picked up yet: a 404 is fine.
                    let _ = agent.post(&format!("/v1/allocs/{name}/restart"));
                }
                _ => {}
            }
        }
        // The crash comes at a random moment of the churn's aftermath.
        std::thread::sleep(Duration::from_millis(rng.u64(0..600)));
        let before: BTreeMap<String, AllocStatus> = agent
            .alloc_names()
            .into_iter()
            .filter_map(|name| agent.status(&name).map(|s| (name, s)))
            .collect();
        agent.kill9();
        agent = dirs.start();
        wait_for(
            &format!("convergence after crash {iteration} (seed {seed})"),
            Duration::from_secs(5),
            || converged(&agent, &token, &desired, &removed, &before),
        );
    }
    // The crashes leave no alloc dir behind once a pass has run: every dir is the one of
    // an alloc revision the agent shows.
    wait_for(
        &format!("no orphaned alloc dir (seed {seed})"),
        Duration::from_secs(10),
        || {
            let ids: Vec<String> = agent
                .alloc_names()
                .iter()
                .filter_map(|name| agent.status(name).map(|status| status.id))
                .collect();
            let orphans: Vec<String> = std::fs::read_dir(dirs.data.join("allocs"))
                .map(|entries| {
                    entries
                        .filter_map(Result::ok)
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .filter(|id| !ids.contains(id))
                        .collect()
                })
                .unwrap_or_default();
            match orphans.is_empty() {
                true => Ok(()),
                false => Err(format!("{orphans:?} are none of {ids:?}")),
            }
        },
    );
    agent.terminate();
}

#[test]
fn a_revisions_dir_left_by_a_hand_over_a_killed_agent_did_not_finish_goes_with_the_next() {
    let _turn = stead_tests::real_time_turn();
    let token = format!("stead-leftover-{}", std::process::id());
    let _cleanup = Cleanup(token.clone());
    let dirs = AgentDirs::new("");
    write(&dirs, &token, "web", Kind::Service, 1);
    let agent = dirs.start();
    let running_id = |agent: &agent_support::Agent| -> Result<String, String> {
        let status = agent.status("web").ok_or("no status yet")?;
        match status.tasks.get("main") {
            Some(task) if task.state == "running" => Ok(status.id),
            _ => Err(format!("not running: {status:?}")),
        }
    };
    let first = wait_for("the first revision runs", Duration::from_secs(10), || {
        running_id(&agent)
    });
    agent.kill9();
    // What an agent killed during a hand-over leaves: the dir of a revision it built
    // (the logs kept from the one before) but never stored, the spec moving on since.
    let allocs = dirs.data.join("allocs");
    let leftover = allocs.join("web-0123abcd");
    std::fs::create_dir_all(leftover.join("alloc/logs/previous")).expect("dir");
    write(&dirs, &token, "web", Kind::Service, 2);

    let agent = dirs.start();
    wait_for(
        "the next revision runs, and no other revision's dir is left",
        Duration::from_secs(10),
        || {
            let id = running_id(&agent)?;
            if id == first {
                return Err("the first revision still runs".to_owned());
            }
            let mut left: Vec<String> = std::fs::read_dir(&allocs)
                .map_err(|error| error.to_string())?
                .filter_map(Result::ok)
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .collect();
            left.sort();
            match left == [id.clone()] {
                true => Ok(()),
                false => Err(format!("{left:?} besides {id}")),
            }
        },
    );
    agent.terminate();
}
