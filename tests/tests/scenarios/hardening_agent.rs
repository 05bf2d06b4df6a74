//! The agent against hostile files and lost state, through the real `stead agent`
//! binary: entries of the specs dir that cannot be read (a FIFO, a link to a device, a
//! dangling link, a link loop) hold nothing up, a link to a secret outside the specs dir
//! shows nothing of it, and a store that lost its `CURRENT` or part of its write-ahead
//! log kills no task.

use crate::agent_support;

use std::time::{Duration, Instant};

use agent_support::{Agent, AgentDirs, processes_with, service_spec, unique_nap, wait_for};

const DEADLINE: Duration = Duration::from_secs(20);

fn mkfifo(path: &std::path::Path) {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        path,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .expect("mkfifo");
}

fn health(agent: &Agent) -> serde_json::Value {
    let (code, body) = agent.try_get("/v1/health").expect("the agent answers");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("a health document")
}

fn running(agent: &Agent, name: &str) -> Result<(), String> {
    match agent.status(name) {
        Some(status) if status.tasks.values().all(|t| t.state == "running") => Ok(()),
        other => Err(format!("{other:?}")),
    }
}

#[test]
fn unreadable_entries_in_the_specs_dir_hold_up_nothing_but_the_allocs_they_declared() {
    let dirs = AgentDirs::new("shutdown: drain\n");
    let marker = unique_nap();
    for name in ["kept", "gone"] {
        dirs.write_spec(name, &service_spec(name, &marker));
    }
    let agent = dirs.start();
    for name in ["kept", "gone"] {
        wait_for(&format!("{name} running"), DEADLINE, || {
            running(&agent, name)
        });
    }

    // The file of `kept` becomes a FIFO; beside it, a link to a device, a dangling link
    // and a link loop.
    let specs = &dirs.specs;
    std::fs::remove_file(specs.join("kept.yaml")).expect("removed");
    mkfifo(&specs.join("kept.yaml"));
    std::os::unix::fs::symlink("/dev/zero", specs.join("device.yaml")).expect("link");
    std::os::unix::fs::symlink(specs.join("nowhere"), specs.join("dangling.yaml")).expect("link");
    std::os::unix::fs::symlink(specs.join("loop.yaml"), specs.join("loop.yaml")).expect("link");

    // Other changes still apply: a new alloc runs, a deleted one goes; the alloc whose
    // file cannot be read is kept, not taken for deleted.
    dirs.write_spec("new", &service_spec("new", &marker));
    wait_for("new running", DEADLINE, || running(&agent, "new"));
    dirs.remove_spec("gone");
    wait_for("gone stopped", DEADLINE, || match agent.status("gone") {
        Some(status) if status.desired_status == "stop" => Ok(()),
        other => Err(format!("{other:?}")),
    });
    let kept = agent.status("kept").expect("kept is shown");
    assert_eq!(kept.desired_status, "run", "{kept:?}");
    running(&agent, "kept").expect("kept still runs");

    // Health names every unreadable entry.
    let health = health(&agent);
    assert_eq!(health["status"], "degraded", "{health}");
    let source = &health["components"]["source"];
    assert_eq!(source["healthy"], false, "{health}");
    let message = source["message"].as_str().expect("a message");
    for entry in ["kept.yaml", "device.yaml", "dangling.yaml", "loop.yaml"] {
        assert!(message.contains(entry), "{entry} not in {message}");
    }

    // Each problem is logged when it appears, not at every pass: three more passes, each
    // seen by the alloc it applies, leave one line.
    for n in 0..3 {
        let probe = format!("probe{n}");
        dirs.write_spec(&probe, &service_spec(&probe, &marker));
        wait_for(&format!("{probe} applied"), DEADLINE, || {
            agent
                .status(&probe)
                .map(|_| ())
                .ok_or_else(|| "not yet".to_owned())
        });
    }
    let log = agent.log_text();
    let fifo_lines = log
        .lines()
        .filter(|l| l.contains("kept.yaml") && l.contains("FIFO"));
    assert_eq!(fifo_lines.count(), 1, "{log}");

    // SIGTERM drains and exits promptly with the FIFO still there.
    let asked = Instant::now();
    let status = agent.terminate();
    assert!(status.success(), "{status}");
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "{:?}",
        asked.elapsed()
    );
}

#[test]
fn a_link_to_a_secret_outside_the_specs_dir_shows_nothing_of_it() {
    let dirs = AgentDirs::new("");
    let secret = dirs.root.path().join("shadow");
    // Without the rule, the message would quote the value: `unsupported apiVersion "…"`.
    std::fs::write(
        &secret,
        "apiVersion: root:$6$hunter2hash$:19000\nkind: Alloc\nmetadata: {name: web}\n",
    )
    .expect("secret");
    std::os::unix::fs::symlink(&secret, dirs.specs.join("s.yaml")).expect("link");
    let agent = dirs.start();
    wait_for("the diagnostic logged", DEADLINE, || {
        let log = agent.log_text();
        match log.contains("details withheld") {
            true => Ok(()),
            false => Err(log),
        }
    });
    let log = agent.log_text();
    assert!(!log.contains("hunter2"), "{log}");
    assert!(
        log.contains("s.yaml:"),
        "the file and place are named: {log}"
    );
}

/// The pid of task `main` of `name` once it runs.
fn running_pid(agent: &Agent, name: &str) -> u32 {
    agent
        .wait_for_task(name, &format!("{name} running"), DEADLINE, |task| {
            task.state == "running" && task.pid.is_some()
        })
        .pid
        .expect("a pid")
}

#[test]
fn a_lost_current_file_stops_the_next_agent_before_it_touches_a_task_and_once_back_all_is_reattached()
 {
    let dirs = AgentDirs::new("");
    let marker = unique_nap();
    dirs.write_spec("web", &service_spec("web", &marker));
    let agent = dirs.start();
    let first = running_pid(&agent, "web");
    // One restart, so that the count has something to keep.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(first as i32).expect("a pid"),
        rustix::process::Signal::KILL,
    )
    .expect("killed");
    let task = agent.wait_for_task("web", "restarted", DEADLINE, |task| {
        task.restarts == 1 && task.state == "running" && task.pid.is_some_and(|p| p != first)
    });
    let pid = task.pid.expect("a pid");
    agent.kill9();

    let current = dirs.data.join("state/CURRENT");
    let saved = std::fs::read(&current).expect("CURRENT");
    std::fs::remove_file(&current).expect("removed");
    let mut refused = dirs.launch();
    let status = wait_for("the agent exits", DEADLINE, || {
        refused
            .child
            .try_wait()
            .expect("waits")
            .ok_or_else(|| "still running".to_owned())
    });
    assert!(!status.success(), "{status}");
    let log = refused.log_text();
    assert!(log.contains("no CURRENT file"), "{log}");
    assert!(
        log.contains(&dirs.data.join("state").display().to_string()),
        "{log}"
    );
    assert!(!current.exists(), "no new database made");
    assert_eq!(processes_with(&marker).len(), 1, "the task runs on");
    assert!(
        std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the task is not killed"
    );

    std::fs::write(&current, saved).expect("restored");
    let agent = dirs.start();
    let task = agent.wait_for_task("web", "reattached", DEADLINE, |task| {
        task.state == "running" && task.pid == Some(pid)
    });
    assert_eq!(task.restarts, 1, "counts intact");
    let health = health(&agent);
    assert_eq!(health["status"], "ok", "{health}");
}

#[test]
fn garbage_in_the_write_ahead_log_degrades_the_store_and_kills_no_task() {
    let dirs = AgentDirs::new("");
    let marker = unique_nap();
    let names: Vec<String> = (0..8).map(|n| format!("svc{n}")).collect();
    let agent = dirs.start();
    let mut pids = Vec::new();
    // One at a time, so that their records follow each other through the log.
    for name in &names {
        dirs.write_spec(name, &service_spec(name, &marker));
        pids.push(running_pid(&agent, name));
    }
    agent.kill9();

    let state = dirs.data.join("state");
    let log = std::fs::read_dir(&state)
        .expect("state dir")
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|e| e == "log"))
        .max_by_key(|path| std::fs::metadata(path).map(|m| m.len()).unwrap_or(0))
        .expect("a write-ahead log");
    let mut bytes = std::fs::read(&log).expect("read");
    assert!(bytes.len() > 8192, "{} bytes", bytes.len());
    let middle = bytes.len() / 2;
    bytes[middle..middle + 64].fill(0xa5);
    std::fs::write(&log, bytes).expect("damaged");

    let agent = dirs.start();
    let health = health(&agent);
    assert_eq!(health["status"], "degraded", "{health}");
    let store = &health["components"]["store"];
    assert_eq!(store["healthy"], false, "{health}");
    assert!(
        store["message"]
            .as_str()
            .is_some_and(|m| m.contains("write-ahead log")),
        "{health}"
    );
    for (name, pid) in names.iter().zip(&pids) {
        let task = agent.wait_for_task(name, "the same run", DEADLINE, |task| {
            task.state == "running" && task.pid.is_some()
        });
        assert_eq!(task.pid, Some(*pid), "{name} was not restarted");
    }
    assert_eq!(
        processes_with(&marker).len(),
        names.len(),
        "one run each, none started twice"
    );
    // The records lost with the damage named runs that are found and reattached.
    let log = agent.log_text();
    assert!(log.contains("found a task no record names"), "{log}");
    assert!(
        log.contains("reattached a run of this task that no record named"),
        "{log}"
    );
}

#[test]
fn a_task_whose_supervisor_is_sigkilled_leaves_none_of_its_200_setsid_children_once_stopped() {
    let dirs = AgentDirs::new("");
    let nap = unique_nap();
    let spec = format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: escapes}}\nspec:\n  tasks:\n    - name: main\n      driver: exec\n      killTimeout: 2s\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"i=0; while [ $i -lt 200 ]; do setsid sleep {nap} & i=$((i+1)); done; exec sleep {nap}\"]\n"
    );
    dirs.write_spec("escapes", &spec);
    let agent = dirs.start();
    let pid = running_pid(&agent, "escapes");
    wait_for(
        "200 setsid children and the task",
        DEADLINE,
        || match processes_with(&nap).len() {
            201 => Ok(()),
            n => Err(format!("{n} processes")),
        },
    );
    let supervisor = agent_support::parent_of(pid).expect("the task's parent");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(supervisor as i32).expect("a pid"),
        rustix::process::Signal::KILL,
    )
    .expect("supervisor killed");

    dirs.remove_spec("escapes");
    wait_for(
        "nothing of the alloc left",
        DEADLINE,
        || match processes_with(&nap).len() {
            0 => Ok(()),
            n => Err(format!("{n} processes left")),
        },
    );
}

/// A tmpfs of `size` mounted on `dir` for the life of the value.
struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    fn mount(dir: &std::path::Path, size: &str) -> SmallDisk {
        std::fs::create_dir_all(dir).expect("mount point");
        let status = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0755"),
                "tmpfs",
            ])
            .arg(dir)
            .status()
            .expect("mount runs");
        assert!(status.success(), "mount {}", dir.display());
        SmallDisk(dir.to_owned())
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

#[test]
fn after_the_data_disk_filled_the_store_is_healthy_again_within_30s_of_10_mib_freed() {
    if !agent_support::running_as_root() {
        return; // mounting a small disk takes root
    }
    // A small store: its write-ahead log is preallocated by its write buffer's size.
    let dirs = AgentDirs::new("store:\n  memoryMB: 1\n");
    let _disk = SmallDisk::mount(&dirs.data, "48m");
    let marker = unique_nap();
    dirs.write_spec("before", &service_spec("before", &marker));
    let agent = dirs.start();
    running_pid(&agent, "before");

    // Fill the disk, then ask for a write: a new alloc's record.
    let filler = dirs.data.join("filler");
    {
        use std::io::Write;
        let mut file = std::fs::File::create(&filler).expect("filler");
        let chunk = vec![0x5a_u8; 1 << 20];
        while file.write_all(&chunk).is_ok() {}
        let _ = file.sync_all();
    }
    // A task that exits at once and restarts every 100 ms: a stream of writes.
    dirs.write_spec(
        "churn",
        &format!(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: churn}}\nspec:\n  restart: {{attempts: 10000, delay: 100ms, interval: 1h, mode: delay}}\n  tasks:\n    - name: main\n      driver: exec\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"exit 1\", \"{marker}\"]\n"
        ),
    );
    wait_for("the store to fail its writes", DEADLINE, || {
        let health = health(&agent);
        match health["components"]["store"]["healthy"] == false {
            true => Ok(()),
            false => Err(health.to_string()),
        }
    });

    let full = std::fs::metadata(&filler).expect("filler").len();
    std::fs::File::options()
        .write(true)
        .open(&filler)
        .expect("filler")
        .set_len(full.saturating_sub(10 << 20))
        .expect("10 MiB freed");
    let freed = Instant::now();
    wait_for("the store healthy again", Duration::from_secs(30), || {
        let health = health(&agent);
        match health["components"]["store"]["healthy"] == true {
            true => Ok(()),
            false => Err(health.to_string()),
        }
    });
    eprintln!(
        "store healthy {:?} after 10 MiB were freed",
        freed.elapsed()
    );
    running_pid(&agent, "before");
    drop(agent);
    std::fs::remove_file(&filler).expect("filler removed");
}
