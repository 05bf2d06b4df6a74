//! Restore through the real agent binary on its RocksDB state: tasks survive an agent
//! restart, a damaged record or a missing alloc dir fails only its own alloc with a
//! message naming it, a second agent on the same data dir is refused at once, and a new
//! node's tasks start while its store is still being created, which begins once their
//! starts are answered.

use crate::agent_support;

use std::io::Read;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use agent_support::{
    AgentDirs, agent_binary, kill_all_with, processes_with, service_spec, wait_for,
};
use stead_controller::store::conformance::PlantRaw;
use stead_controller::store::{RocksDbOptions, RocksDbStore};

struct Cleanup(String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        kill_all_with(&self.0);
    }
}

fn running_pid(agent: &agent_support::Agent, name: &str) -> Result<u32, String> {
    let status = agent
        .status(name)
        .ok_or_else(|| format!("{name} not shown"))?;
    let task = &status.tasks["main"];
    task.pid
        .filter(|_| task.state == "running")
        .ok_or_else(|| format!("{name} is {}", task.state))
}

#[test]
fn damaged_records_and_a_missing_alloc_dir_fail_only_their_allocs_and_the_agent_boots() {
    let token = format!("stead-restore-{}", std::process::id());
    let _cleanup = Cleanup(token.clone());
    let dirs = AgentDirs::new("");
    for name in ["garbled", "gone", "healthy", "newer"] {
        dirs.write_spec(name, &service_spec(name, &format!("{token}-{name}.")));
    }
    let agent = dirs.start();
    let pids = wait_for("all running", Duration::from_secs(10), || {
        ["garbled", "gone", "healthy", "newer"]
            .iter()
            .map(|name| running_pid(&agent, name))
            .collect::<Result<Vec<_>, _>>()
    });
    let gone_id = agent.status("gone").expect("shown").id;
    agent.kill9();

    {
        let store = RocksDbStore::open(&dirs.data.join("state"), RocksDbOptions::default())
            .expect("the state opens while the agent is down");
        store.plant_raw("garbled", b"{\"version\": 1, \"name\": ".to_vec());
        let mut newer = stead_controller::store::conformance::sample_record("newer", 0);
        newer.version += 1;
        store.plant_raw("newer", newer.encode());
    }
    std::fs::remove_dir_all(dirs.data.join("allocs").join(&gone_id)).expect("alloc dir removed");

    let agent = dirs.start();
    let healthy = wait_for("healthy resumed", Duration::from_secs(5), || {
        running_pid(&agent, "healthy")
    });
    assert_eq!(healthy, pids[2], "the healthy alloc kept its process");
    for (name, needle) in [
        ("garbled", "malformed"),
        ("newer", "newer than"),
        ("gone", "is missing"),
    ] {
        let status = wait_for(
            &format!("{name} failed"),
            Duration::from_secs(5),
            || match agent.status(name) {
                Some(s) if s.client_status == "failed" => Ok(s),
                other => Err(format!("{other:?}")),
            },
        );
        let text = serde_json::to_string(&status).expect("json");
        assert!(text.contains(name) && text.contains(needle), "{text}");
    }
    // The missing dir's task was stopped rather than left behind.
    wait_for(
        "the gone alloc's process ended",
        Duration::from_secs(5),
        || {
            let left = processes_with(&format!("{token}-gone."));
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{left:?}"))
            }
        },
    );
    let log = agent.log_text();
    assert!(log.contains("garbled") && log.contains("newer"), "{log}");
    agent.terminate();
}

#[test]
fn the_state_dir_is_the_agents_only_and_the_alloc_dirs_are_reachable_by_any_task_user() {
    use std::os::unix::fs::PermissionsExt;
    let token = format!("stead-modes-{}", std::process::id());
    let _cleanup = Cleanup(token.clone());
    let dirs = AgentDirs::new("");
    // An earlier agent's state dir, made with a umask that leaves it readable to all.
    std::fs::create_dir_all(dirs.data.join("state")).expect("made");
    std::fs::set_permissions(
        dirs.data.join("state"),
        std::fs::Permissions::from_mode(0o755),
    )
    .expect("chmod");
    dirs.write_spec("web", &service_spec("web", &format!("{token}-web.")));
    let agent = dirs.start();
    wait_for("web runs", Duration::from_secs(10), || {
        running_pid(&agent, "web")
    });
    let mode = |path: PathBuf| {
        std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .permissions()
            .mode()
            & 0o7777
    };
    assert_eq!(mode(dirs.data.join("state")), 0o700, "the records hold env");
    assert_eq!(
        mode(dirs.data.join("allocs")),
        0o711,
        "traversable by task users, not listable"
    );
    agent.terminate();
}

#[test]
fn a_second_agent_on_the_same_data_dir_is_refused_at_once_naming_the_dir() {
    let dirs = AgentDirs::new("");
    let agent = dirs.start();
    let output = Command::new(agent_binary())
        .args(["agent", "--config"])
        .arg(&dirs.config)
        .args(["--listen", "127.0.0.1:0"])
        .output()
        .expect("second agent ran");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("data dir {} is in use", dirs.data.display())),
        "{stderr}"
    );
    agent.terminate();
}

/// A task that idles until `$STEAD_TASK_DIR/local/exit` appears, then prints a line and
/// exits 7; its command line carries `marker`.
fn exit_on_trigger_spec(name: &str, marker: &str) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  restart: {{attempts: 3, interval: 1h, delay: 1s, mode: fail}}\n  tasks:\n    - name: main\n      driver: exec\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"echo started; while [ ! -e \\\"$STEAD_TASK_DIR/local/exit\\\" ]; do sleep 0.05; done; rm -f \\\"$STEAD_TASK_DIR/local/exit\\\"; echo written-while-the-agent-was-down; exit 7\", \"{marker}\"]\n"
    )
}

#[test]
fn twenty_tasks_survive_an_agent_sigkill_with_their_pids_and_an_exit_while_down_is_reported() {
    let token = format!("stead-survive-{}", std::process::id());
    let _cleanup = Cleanup(token.clone());
    let dirs = AgentDirs::new("");
    let names: Vec<String> = (0..20).map(|i| format!("svc{i}")).collect();
    for name in &names {
        dirs.write_spec(name, &service_spec(name, &format!("{token}-{name}.")));
    }
    dirs.write_spec(
        "exiter",
        &exit_on_trigger_spec("exiter", &format!("{token}-exiter.")),
    );
    let agent = dirs.start();
    let pids = wait_for("all running", Duration::from_secs(20), || {
        names
            .iter()
            .map(|name| running_pid(&agent, name))
            .collect::<Result<Vec<_>, _>>()
    });
    wait_for("exiter running", Duration::from_secs(10), || {
        running_pid(&agent, "exiter")
    });
    let exiter = agent.status("exiter").expect("shown");
    let restarts_before: Vec<u32> = names
        .iter()
        .map(|n| agent.status(n).expect("shown").tasks["main"].restarts)
        .collect();
    agent.kill9();

    // While the agent is down the exiter exits 7 and writes a line.
    let task_dir = dirs.data.join("allocs").join(&exiter.id).join("main");
    std::fs::write(task_dir.join("local").join("exit"), "").expect("trigger written");
    wait_for("the exiter exited", Duration::from_secs(5), || {
        let left = processes_with(&format!("{token}-exiter."));
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{left:?}"))
        }
    });

    let agent = dirs.start();
    let after = wait_for("all resumed", Duration::from_secs(5), || {
        names
            .iter()
            .map(|name| running_pid(&agent, name))
            .collect::<Result<Vec<_>, _>>()
    });
    assert_eq!(after, pids, "the same processes run");
    for (name, before) in names.iter().zip(&restarts_before) {
        let status = agent.status(name).expect("shown");
        let task = &status.tasks["main"];
        assert_eq!(task.restarts, *before, "{name}");
        let starts = task
            .events
            .iter()
            .filter(|e| e.event_type == "Started")
            .count();
        assert_eq!(starts, 1, "{name}: no new Started event");
    }
    let status = wait_for(
        "the exiter restarted by its policy",
        Duration::from_secs(10),
        || {
            let status = agent.status("exiter").ok_or("not shown")?;
            let task = &status.tasks["main"];
            if task.restarts == 1 && task.state == "running" {
                Ok(status)
            } else {
                Err(format!("{task:?}"))
            }
        },
    );
    let terminated = status.tasks["main"]
        .events
        .iter()
        .find(|e| e.event_type == "Terminated")
        .expect("a Terminated event");
    assert_eq!(terminated.exit_code, Some(7), "{terminated:?}");
    let logs = dirs
        .data
        .join("allocs")
        .join(&exiter.id)
        .join("alloc")
        .join("logs");
    let written: String = std::fs::read_dir(&logs)
        .expect("logs dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("main.stdout"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
        .collect();
    assert!(
        written.contains("written-while-the-agent-was-down"),
        "{written}"
    );
    agent.terminate();
}

#[test]
fn a_spec_deleted_while_the_agent_was_down_stops_only_that_alloc_after_the_first_listing() {
    let token = format!("stead-orphan-{}", std::process::id());
    let _cleanup = Cleanup(token.clone());
    let dirs = AgentDirs::new("shutdown: detach\n");
    for name in ["kept", "other", "orphan"] {
        dirs.write_spec(name, &service_spec(name, &format!("{token}-{name}.")));
    }
    let agent = dirs.start();
    let pids = wait_for("all running", Duration::from_secs(10), || {
        ["kept", "other", "orphan"]
            .iter()
            .map(|name| running_pid(&agent, name))
            .collect::<Result<Vec<_>, _>>()
    });
    assert!(
        agent.terminate().success(),
        "a detaching agent exits cleanly"
    );
    assert_eq!(
        processes_with(&format!("{token}-orphan.")),
        vec![pids[2]],
        "detached tasks outlive the agent"
    );
    dirs.remove_spec("orphan");
    let first_run = std::fs::read_to_string(dirs.root.path().join("agent.log"))
        .expect("the first run's log")
        .len();

    let agent = dirs.start();
    wait_for("the orphan stopped", Duration::from_secs(5), || {
        let left = processes_with(&format!("{token}-orphan."));
        let status = agent.status("orphan");
        match (&left[..], status) {
            ([], Some(status)) if status.desired_status == "stop" => Ok(()),
            ([], None) => Ok(()),
            (left, status) => Err(format!("{left:?} {status:?}")),
        }
    });
    for (name, pid) in [("kept", pids[0]), ("other", pids[1])] {
        assert_eq!(running_pid(&agent, name), Ok(pid), "{name} untouched");
        let status = agent.status(name).expect("shown");
        let events: Vec<&str> = status.tasks["main"]
            .events
            .iter()
            .map(|e| e.event_type.as_str())
            .collect();
        assert!(!events.contains(&"Killing"), "{name}: {events:?}");
    }
    // Nothing was stopped before the listing: in the second run's log (restore
    // included), no task exits before the listing removed the orphan, and then only the
    // orphan's does.
    let second_run = wait_for("the orphan's exit logged", Duration::from_secs(5), || {
        let run = agent.log_text().split_off(first_run);
        if run
            .lines()
            .any(|l| l.contains("alloc{alloc=orphan}") && l.contains("task exited"))
        {
            Ok(run)
        } else {
            Err(run)
        }
    });
    let removed = second_run
        .find("removed alloc=orphan")
        .expect("the orphan was removed by a listing");
    assert!(
        !second_run[..removed].contains("task exited"),
        "a task was stopped before the listing: {second_run}"
    );
    let exits: Vec<&str> = second_run
        .lines()
        .filter(|l| l.contains("task exited"))
        .collect();
    assert!(
        exits.len() == 1 && exits[0].contains("alloc{alloc=orphan}"),
        "only the orphan's task exits: {second_run}"
    );
    agent.terminate();
}

/// A new node whose database creation is held: `names` (service specs marked
/// `<token>-<name>.`) are declared, and the agent is launched with `config`; returns the
/// gate that holds the creation.
fn new_node_with_store_held(
    token: &str,
    names: &[&str],
    config: &str,
) -> (AgentDirs, PathBuf, agent_support::Agent) {
    let dirs = AgentDirs::new(config);
    for name in names {
        dirs.write_spec(name, &service_spec(name, &format!("{token}-{name}.")));
    }
    // Hold the creation of the database: RocksDB writes a new database's identity
    // through `000000.dbtmp` before anything else is durable, and a FIFO there blocks
    // that write until someone opens it for reading. (A RocksDB that named its first
    // file otherwise would not be held, and the callers' checks that nothing runs yet
    // would fail.)
    let state = dirs.data.join("state");
    std::fs::create_dir_all(&state).expect("state dir");
    let gate = state.join("000000.dbtmp");
    let made = Command::new("mkfifo")
        .arg(&gate)
        .status()
        .expect("mkfifo runs");
    assert!(made.success(), "mkfifo {}", gate.display());
    let agent = dirs.launch();
    (dirs, gate, agent)
}

#[test]
fn a_new_node_creates_its_store_before_it_starts_or_serves_anything_and_its_tasks_then_survive_a_crash()
 {
    let token = format!("stead-new-{}", std::process::id());
    let _cleanup = Cleanup(token.clone());
    let names = ["a", "b", "c"];
    let marker = |name: &str| format!("{token}-{name}.");
    let (dirs, gate, agent) = new_node_with_store_held(&token, &names, "shutdown: detach\n");
    let state = dirs.data.join("state");
    // Held at the store's creation, the agent has started nothing: one of its threads
    // waits in the FIFO's open (the database's identity written through it, the kernel's
    // `wait_for_partner`), and no task exists.
    wait_for(
        "the agent waits on the held creation",
        Duration::from_secs(10),
        || {
            let waiting = std::fs::read_dir(format!("/proc/{}/task", agent.child.id()))
                .map_err(|e| e.to_string())?
                .filter_map(Result::ok)
                .any(|task| {
                    std::fs::read_to_string(task.path().join("wchan"))
                        .is_ok_and(|wchan| wchan.trim() == "wait_for_partner")
                });
            if waiting {
                Ok(())
            } else {
                Err("not waiting in the FIFO's open yet".to_owned())
            }
        },
    );
    for name in names {
        assert_eq!(
            processes_with(&marker(name)),
            Vec::<u32>::new(),
            "{name} started before the store exists:\n{}",
            agent.log_text()
        );
    }
    assert!(!state.join("CURRENT").exists(), "the database was held");
    agent.kill9();

    // The next agent creates it, then runs each task once.
    std::fs::remove_file(&gate).expect("gate removed");
    let agent = dirs.start();
    let first: Vec<u32> = wait_for("each task runs once", Duration::from_secs(10), || {
        names
            .iter()
            .map(|name| {
                match (
                    &processes_with(&marker(name))[..],
                    running_pid(&agent, name),
                ) {
                    ([pid], Ok(shown)) if *pid == shown => Ok(*pid),
                    (pids, shown) => Err(format!("{name}: {pids:?} shown {shown:?}")),
                }
            })
            .collect::<Result<Vec<_>, _>>()
    });
    assert!(state.join("CURRENT").exists(), "the store exists now");

    // And from now on the tasks survive a crash: the store has them.
    agent.kill9();
    let agent = dirs.start();
    for (name, pid) in names.iter().zip(&first) {
        let pid = *pid;
        wait_for(
            &format!("{name} reattached"),
            Duration::from_secs(10),
            || match running_pid(&agent, name) {
                Ok(shown) if shown == pid => Ok(()),
                other => Err(format!("{other:?}")),
            },
        );
        assert_eq!(
            processes_with(&marker(name)),
            [pid],
            "{name} was not restarted"
        );
    }
    agent.terminate();
}

#[test]
fn a_new_node_whose_store_cannot_be_created_exits_with_why_before_starting_anything() {
    let token = format!("stead-nostore-{}", std::process::id());
    let _cleanup = Cleanup(token.clone());
    let names = ["a", "b"];
    let (_dirs, gate, mut agent) = new_node_with_store_held(&token, &names, "shutdown: detach\n");
    // Opening the FIFO lets RocksDB write into it, and its sync of a pipe fails.
    let reader = std::thread::spawn(move || {
        let mut fifo = std::fs::File::open(&gate).expect("fifo opened");
        let mut sink = Vec::new();
        let _ = fifo.read_to_end(&mut sink);
    });
    let status = wait_for("the agent exits", Duration::from_secs(20), || {
        match agent.child.try_wait().expect("wait") {
            Some(status) => Ok(status),
            None => Err("still running".to_owned()),
        }
    });
    reader.join().expect("reader");
    let log = agent.log_text();
    assert!(!status.success(), "{status}:\n{log}");
    assert!(log.contains("cannot open the state database"), "{log}");
    for name in names {
        assert_eq!(
            processes_with(&format!("{token}-{name}.")),
            Vec::<u32>::new(),
            "{name} never started:\n{log}"
        );
    }
}

/// The soft and hard limits of open files of `pid`, from `/proc/<pid>/limits`.
fn open_files_limits(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a Max open files line");
    let fields: Vec<&str> = line.split_whitespace().collect();
    (fields[3].to_owned(), fields[4].to_owned())
}

#[test]
fn the_agent_raises_its_own_limit_of_open_files_and_its_tasks_keep_the_one_it_started_with() {
    let token = format!("stead-nofile-{}", std::process::id());
    let _cleanup = Cleanup(token.clone());
    let dirs = AgentDirs::new("");
    dirs.write_spec("web", &service_spec("web", &format!("{token}-web.")));
    // A soft limit below the hard one, whatever this machine's hard limit is.
    let (_, ours) = open_files_limits(std::process::id());
    let started_with = ours.parse::<u64>().map_or(512, |hard| (hard / 2).min(512));
    let agent = dirs.start_after(&format!("ulimit -Sn {started_with}"));
    let task = wait_for("web runs", Duration::from_secs(10), || {
        running_pid(&agent, "web")
    });
    let (soft, hard) = open_files_limits(agent.child.id());
    assert_eq!(soft, hard, "the agent's soft limit is its hard one");
    assert_ne!(soft, started_with.to_string());
    assert_eq!(
        open_files_limits(task),
        (started_with.to_string(), hard),
        "the task starts as a process started beside the agent would"
    );
    agent.terminate();
}
