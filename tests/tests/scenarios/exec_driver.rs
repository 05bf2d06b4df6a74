//! The exec driver on its own, with real processes: the task's environment, session,
//! user and groups; reattach that refuses a reused pid; signals; stats; the fingerprint
//! and its health hook.

use crate::exec_support;

use std::collections::BTreeMap;
use std::time::Duration;

use exec_support::{
    DataDir, alive, eventually, exec_driver, hog, processes_of_alloc, processes_under, read_pid,
    running_as_root, stat_field, status_field,
};
use stead_controller::driver::exec::ExecDriver;
use stead_controller::driver::{
    DeviceAccess, Driver, DriverError, Health, LogLimits, StartRequest, TaskHandle, TaskResources,
};
use stead_schemas::spec::{DriverConfig, DriverKind, ExecConfig, Name};
use stead_schemas::{AllocId, Revision};

fn alloc_id(name: &str) -> AllocId {
    let name: Name = name.parse().expect("a valid name");
    AllocId::new(&name, &Revision::from_hex(&"5e".repeat(32)).expect("hex"))
}

fn request(alloc: &str, command: &str, args: &[&str], user: Option<&str>) -> StartRequest {
    StartRequest {
        alloc_id: alloc_id(alloc),
        task: "t".parse().expect("a valid name"),
        config: DriverConfig::Exec(ExecConfig {
            command: command.to_owned(),
            args: Some(args.iter().map(|a| (*a).to_owned()).collect()),
        }),
        env: BTreeMap::from([("GREETING".to_owned(), "hello".to_owned())]),
        user: user.map(str::to_owned),
        logs: LogLimits {
            max_files: 2,
            max_file_size_mb: 1,
        },
        devices: DeviceAccess::default(),
        resources: TaskResources::default(),
    }
}

fn shell(alloc: &str, script: &str) -> StartRequest {
    request(alloc, "/bin/sh", &["-c", script], None)
}

fn stdout(driver: &ExecDriver, alloc: &str) -> String {
    let path = driver
        .alloc_dirs()
        .alloc(&alloc_id(alloc))
        .logs()
        .join("t.stdout.0");
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The supervisor of the task whose process is `pid`: its parent.
fn supervisor_of(pid: u32) -> u32 {
    stat_field(pid, 4)
        .and_then(|ppid| ppid.parse().ok())
        .expect("a parent")
}

async fn stop(driver: &ExecDriver, handle: &TaskHandle) {
    driver.kill(handle).await.expect("killed");
    let exit = tokio::time::timeout(Duration::from_secs(10), driver.wait(handle.clone()))
        .await
        .expect("the task ends after a kill");
    assert_eq!(exit.signal, Some(9));
    driver.destroy(handle).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_paths_are_given_where_they_are_and_a_moved_or_missing_one_fails_the_start() {
    use stead_reconcilers::device::DeviceNode;
    let data = DataDir::new();
    let driver = exec_driver(data.path(), true);
    let node = |host: &str, task: &str| DeviceNode {
        host_path: host.into(),
        task_path: task.into(),
        permissions: "rw".to_owned(),
    };
    let with = |alloc: &str, nodes: Vec<DeviceNode>| StartRequest {
        devices: DeviceAccess {
            mounts: Vec::new(),
            device_nodes: nodes,
        },
        ..shell(alloc, "exec sleep 1000")
    };
    let handle = driver
        .start(with("in-place", vec![node("/dev/null", "/dev/null")]))
        .await
        .expect("a device node at its own place is given as it is");
    stop(&driver, &handle).await;

    let moved = driver
        .start(with("moved", vec![node("/dev/null", "/dev/gpu0")]))
        .await
        .expect_err("the exec driver cannot move a path");
    assert!(!moved.is_recoverable());
    let text = moved.to_string();
    assert!(
        text.contains("/dev/null") && text.contains("/dev/gpu0"),
        "{text}"
    );

    let missing = driver
        .start(with(
            "missing",
            vec![node("/dev/stead-no-such", "/dev/stead-no-such")],
        ))
        .await
        .expect_err("a missing device node fails the start");
    assert!(missing.is_recoverable(), "the plugin may bring it back");
    assert!(
        missing.to_string().contains("/dev/stead-no-such"),
        "{missing}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_runs_in_its_own_session_in_its_task_dir_with_the_alloc_dir_environment() {
    let data = DataDir::new();
    let driver = exec_driver(data.path(), true);
    let script = "pwd; echo \"alloc=$STEAD_ALLOC_ID\"; echo \"allocdir=$STEAD_ALLOC_DIR\"; \
                  echo \"taskdir=$STEAD_TASK_DIR\"; echo \"secrets=$STEAD_SECRETS_DIR\"; \
                  echo \"greeting=$GREETING\"; echo done; exec sleep 1000";
    let handle = driver.start(shell("env", script)).await.expect("started");
    let pid = handle.pid.expect("a pid");
    assert_eq!(handle.driver, DriverKind::Exec);
    // Its own session and process group: sid and pgid are its pid.
    assert_eq!(stat_field(pid, 5), Some(pid.to_string()), "process group");
    assert_eq!(stat_field(pid, 6), Some(pid.to_string()), "session");
    eventually("the task wrote its environment", || {
        stdout(&driver, "env").contains("done")
    })
    .await;
    let alloc = driver.alloc_dirs().alloc(&alloc_id("env"));
    let task_dir = alloc.path().join("t");
    let expected = format!(
        "{task}\nalloc={id}\nallocdir={shared}\ntaskdir={task}\nsecrets={task}/secrets\ngreeting=hello\ndone\n",
        task = task_dir.display(),
        id = alloc_id("env"),
        shared = alloc.shared().display(),
    );
    assert_eq!(stdout(&driver, "env"), expected);
    let secrets = std::fs::metadata(task_dir.join("secrets")).expect("secrets");
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&secrets.permissions()) & 0o777,
        0o700
    );
    stop(&driver, &handle).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_is_refused_unless_allowed_and_a_task_runs_as_the_user_it_names() {
    if !running_as_root() {
        return; // without root there is neither root to refuse nor a user to switch to
    }
    let data = DataDir::new();
    let strict = exec_driver(data.path(), false);
    let refused = strict
        .start(shell("rooted", "id -u"))
        .await
        .expect_err("root is refused");
    match &refused {
        DriverError::Start {
            message,
            recoverable,
            ..
        } => {
            assert!(!recoverable);
            assert!(message.contains("allowRoot"), "{message}");
        }
        other => panic!("unexpected {other:?}"),
    }
    let refused = strict
        .start(request("named", "/bin/sh", &["-c", "id -u"], Some("root")))
        .await
        .expect_err("root by name is refused too");
    assert!(!refused.is_recoverable());

    let handle = strict
        .start(request(
            "nobody",
            "/bin/sh",
            &[
                "-c",
                "id -u; touch local/mine && echo wrote; exec sleep 1000",
            ],
            Some("nobody"),
        ))
        .await
        .expect("runs as nobody");
    eventually("it reports its uid", || {
        stdout(&strict, "nobody").contains("wrote")
    })
    .await;
    assert_eq!(stdout(&strict, "nobody"), "65534\nwrote\n");
    stop(&strict, &handle).await;

    let unknown = strict
        .start(request("ghost", "/bin/true", &[], Some("no-such-user")))
        .await
        .expect_err("an unknown user");
    assert!(!unknown.is_recoverable());
}

/// Issue 34: an impossible `user` and an environment over the kernel's limits were
/// retried for ever, with messages that did not say why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impossible_user_or_an_environment_over_the_kernels_limits_fails_for_good_saying_why() {
    let data = DataDir::new();
    let driver = exec_driver(data.path(), true);
    let failure = |error: DriverError| match error {
        DriverError::Start {
            message,
            recoverable,
            ..
        } => (message, recoverable),
        other => panic!("unexpected {other:?}"),
    };

    let error = driver
        .start(request("minus", "/bin/true", &[], Some("4294967295")))
        .await
        .expect_err("uid -1");
    let (message, recoverable) = failure(error);
    assert!(!recoverable, "{message}");
    assert!(message.contains("id 4294967295"), "{message}");

    let mut huge = request("huge", "/bin/true", &[], None);
    huge.env.insert("HUGE".to_owned(), "x".repeat(900 * 1024));
    let (message, recoverable) = failure(driver.start(huge).await.expect_err("E2BIG"));
    assert!(!recoverable, "{message}");
    assert!(
        message.contains("environment variable \"HUGE\" is 921606 bytes")
            && message.contains("MAX_ARG_STRLEN"),
        "{message}"
    );

    let mut many = request("many", "/bin/true", &[], None);
    for i in 0..80 {
        many.env.insert(format!("V{i}"), "x".repeat(100 * 1024));
    }
    let (message, recoverable) = failure(driver.start(many).await.expect_err("over ARG_MAX"));
    assert!(!recoverable, "{message}");
    assert!(message.contains("ARG_MAX"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_command_fails_to_start_for_good() {
    let data = DataDir::new();
    let driver = exec_driver(data.path(), true);
    let error = driver
        .start(request("missing", "/nonexistent/program", &[], None))
        .await
        .expect_err("no such program");
    assert!(!error.is_recoverable(), "{error:?}");
    assert!(
        error.to_string().contains("/nonexistent/program"),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reattach_refuses_a_reused_pid_and_leaves_that_process_alone() {
    let data = DataDir::new();
    let driver = exec_driver(data.path(), true);
    let handle = driver
        .start(shell("reuse", "exec sleep 1000"))
        .await
        .expect("started");
    // An unrelated process, as if the pids of an earlier run of the task (its record
    // stale) had been reused by it.
    let mut stranger = std::process::Command::new("sleep")
        .arg("1000")
        .spawn()
        .expect("sleep runs");
    let stranger_pid = stranger.id();
    let mut parts: Vec<String> = handle.id.split('.').map(str::to_owned).collect();
    assert_eq!(parts.len(), 5, "{}", handle.id);
    let (task, _run) = parts[0].rsplit_once('/').expect("alloc/task/run");
    parts[0] = format!("{task}/{:016x}", 1);
    parts[1] = stranger_pid.to_string();
    parts[3] = stranger_pid.to_string();
    let forged = TaskHandle {
        id: parts.join("."),
        pid: Some(stranger_pid),
        ..handle.clone()
    };
    let fresh = exec_driver(data.path(), true);
    let refused = fresh.recover(&forged).await.expect_err("not the task");
    assert!(
        matches!(refused, DriverError::UnknownTask { .. }),
        "{refused:?}"
    );
    fresh
        .kill(&forged)
        .await
        .expect("a kill of nothing succeeds");
    fresh.destroy(&forged).await;
    assert!(alive(stranger_pid), "the stranger was not touched");
    stranger.kill().expect("killed");
    stranger.wait().expect("reaped");

    // The real handle reattaches, and the task is the same process.
    fresh.recover(&handle).await.expect("reattached");
    let pid = handle.pid.expect("a pid");
    assert!(alive(pid));
    stop(&fresh, &handle).await;
    assert!(!alive(pid));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_reach_the_tasks_process_group() {
    let data = DataDir::new();
    let driver = exec_driver(data.path(), true);
    let script = "trap 'echo got usr1' USR1; echo ready; while :; do sleep 0.05; done";
    let handle = driver.start(shell("sig", script)).await.expect("started");
    eventually("the trap is set", || {
        stdout(&driver, "sig").contains("ready")
    })
    .await;
    driver
        .signal(&handle, &"SIGUSR1".parse().expect("a signal"))
        .await
        .expect("signalled");
    eventually("the task got it", || {
        stdout(&driver, "sig").contains("got usr1")
    })
    .await;
    stop(&driver, &handle).await;
    let gone = driver
        .signal(&handle, &"SIGUSR1".parse().expect("a signal"))
        .await;
    assert!(gone.is_err(), "a dead task cannot be signalled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_touching_50_mb_reports_an_rss_within_10_percent_and_its_cpu_use() {
    let data = DataDir::new();
    let driver = exec_driver(data.path(), true);
    let hog_path = hog();
    let handle = driver
        .start(request(
            "hog",
            hog_path.to_str().expect("utf-8"),
            &["50"],
            None,
        ))
        .await
        .expect("started");
    eventually("the memory is touched", || {
        stdout(&driver, "hog").contains("touched 50 MiB")
    })
    .await;
    let stats = driver.stats(&handle).expect("measured");
    let expected = 50.0 * 1024.0 * 1024.0;
    let off = (stats.rss_bytes as f64 - expected).abs() / expected;
    assert!(
        off <= 0.10,
        "RSS {} bytes is {:.1}% off",
        stats.rss_bytes,
        off * 100.0
    );
    assert_eq!(stats.processes, 1);
    assert!(stats.ticks_per_second > 0);
    stop(&driver, &handle).await;

    // CPU: a busy shell and its busy child, measured twice.
    let busy = driver
        .start(shell("busy", "(while :; do :; done) & while :; do :; done"))
        .await
        .expect("started");
    let first = driver.stats(&busy).expect("measured");
    // Each measurement covers the time since the previous one.
    eventually("CPU time accrues and shows as a percentage", || {
        driver.stats(&busy).is_ok_and(|s| {
            s.cpu_ticks >= first.cpu_ticks + 20 && s.cpu_percent > 0.0 && s.processes == 2
        })
    })
    .await;
    stop(&driver, &busy).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_health_hook_flips_the_fingerprint_and_back_and_attributes_name_kernel_os_and_cgroups()
{
    let data = DataDir::new();
    let driver = exec_driver(data.path(), true);
    let healthy = driver.fingerprint().await;
    assert_eq!(healthy.health, Health::Healthy, "{}", healthy.description);
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("readable");
    assert_eq!(healthy.attributes["kernel.version"], release.trim());
    assert_eq!(healthy.attributes["kernel.name"], "linux");
    match healthy.attributes["cgroup.limits"].as_str() {
        "true" => {
            assert!(["v1", "v2", "hybrid"].contains(&healthy.attributes["cgroup.version"].as_str()))
        }
        _ => assert!(healthy.attributes.contains_key("cgroup.reason")),
    }
    assert!(healthy.attributes.contains_key("os.name"));

    driver.set_health(Some(Health::Unhealthy));
    assert_eq!(driver.fingerprint().await.health, Health::Unhealthy);
    driver.set_health(None);
    assert_eq!(driver.fingerprint().await.health, Health::Healthy);

    let broken = stead_controller::driver::exec::ExecDriver::new(
        stead_controller::driver::exec::ExecDriverConfig {
            supervisor: "/nonexistent/stead-supervisor".into(),
            ..stead_controller::driver::exec::ExecDriverConfig::new(data.path())
        },
        stead_controller::clock::Clock::system(),
    );
    let fingerprint = broken.fingerprint().await;
    assert_eq!(fingerprint.health, Health::Unhealthy);
    assert!(
        fingerprint.description.contains("supervisor"),
        "{}",
        fingerprint.description
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_start_cancelled_midway_leaves_no_process_behind() {
    let data = DataDir::new();
    let driver = exec_driver(data.path(), true);
    // A first start runs the fork server, so the next one sends its request at once.
    let warm = driver
        .start(shell("warm", "exec sleep 1000"))
        .await
        .expect("started");
    stop(&driver, &warm).await;
    // One poll sends the request (the socket is known writable) and then waits for the
    // supervisor's report; dropping the start there is what a worker does when the
    // task's start is cancelled.
    let mut start = driver.start(shell("cancel", "exec sleep 1000"));
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    assert!(start.as_mut().poll(&mut context).is_pending());
    drop(start);
    let id = alloc_id("cancel").to_string();
    let alloc_dir = driver
        .alloc_dirs()
        .alloc(&alloc_id("cancel"))
        .path()
        .to_owned();
    let control = alloc_dir.join("t/.stead");
    eventually("the supervisor started the task", || {
        std::fs::read_dir(&control).is_ok_and(|entries| {
            entries
                .filter_map(Result::ok)
                .any(|e| e.file_name().to_string_lossy().ends_with(".run"))
        })
    })
    .await;
    eventually("neither the supervisor nor the task is left", || {
        processes_under(&alloc_dir).is_empty() && processes_of_alloc(&id).is_empty()
    })
    .await;
    let attributes = driver.fingerprint().await.attributes;
    if attributes["cgroup.limits"] == "true" {
        let root = std::path::PathBuf::from(&attributes["cgroup.root"]);
        eventually("the cancelled run's cgroup is removed", || {
            stead_tests::subdirs(&root).is_empty()
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oom_kill_is_still_reported_by_an_agent_that_finds_the_run_over_after_a_restart() {
    if !running_as_root() {
        eprintln!("skipped: only root has cgroups to put tasks in");
        return;
    }
    let data = DataDir::new();
    let driver = exec_driver(data.path(), true);
    let hog = hog();
    let greedy = |alloc: &str, script: &str| StartRequest {
        resources: TaskResources {
            memory_mb: Some(32),
            ..TaskResources::default()
        },
        ..request(alloc, "/bin/sh", &["-c", script], None)
    };
    let handle = driver
        .start(greedy("greedy", &format!("exec {} 256", hog.display())))
        .await
        .expect("started");
    let exit = tokio::time::timeout(Duration::from_secs(10), driver.wait(handle.clone()))
        .await
        .expect("the task ends");
    assert!(exit.oom_killed, "{exit:?}");
    // The run's cgroup, and its counter, are gone with the run: a restarted agent that
    // had not stored the exit yet learns it from what the driver noted beside the
    // supervisor's exit record.
    let restarted = exec_driver(data.path(), true);
    restarted
        .recover(&handle)
        .await
        .expect("the run's record is found");
    let again = restarted.wait(handle.clone()).await;
    // Found ended, it also says when it ended: when the supervisor recorded it.
    assert!(again.at.is_some(), "{again:?}");
    assert_eq!(
        stead_reconcilers::exit::ExitResult {
            at: None,
            ..again.clone()
        },
        exit
    );
    restarted.destroy(&handle).await;

    // A run reattached by a restarted agent is read from its cgroup, re-derived: it
    // waits for a file, then overruns its limit.
    let handle = driver
        .start(greedy(
            "later",
            &format!(
                "while [ ! -e go ]; do sleep 0.05; done; exec {} 256",
                hog.display()
            ),
        ))
        .await
        .expect("started");
    let restarted = exec_driver(data.path(), true);
    restarted.recover(&handle).await.expect("reattached");
    let task_dir = driver
        .alloc_dirs()
        .alloc(&alloc_id("later"))
        .path()
        .join("t");
    std::fs::write(task_dir.join("go"), "").expect("go written");
    let exit = tokio::time::timeout(Duration::from_secs(10), restarted.wait(handle.clone()))
        .await
        .expect("the task ends");
    assert!(exit.oom_killed, "{exit:?}");
    restarted.destroy(&handle).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supervisor_is_one_thread_that_reaps_the_orphans_it_adopts_and_its_task_starts_with_no_signal_blocked()
 {
    let data = DataDir::new();
    let driver = exec_driver(data.path(), true);
    // The inner shell leaves a short sleep behind and exits: the sleep is orphaned, the
    // supervisor (a subreaper) adopts it, and it exits while the task still runs.
    let script = "sh -c 'sleep 0.3 & echo $! > local/orphan'; exec sleep 1000";
    let handle = driver.start(shell("reaps", script)).await.expect("started");
    let pid = handle.pid.expect("a pid");
    let supervisor = supervisor_of(pid);
    assert_eq!(
        status_field(supervisor, "Threads").as_deref(),
        Some("1"),
        "the supervisor waits for its children without a second thread"
    );
    // Read once the shell has become `sleep`: a shell blocks signals of its own while it
    // starts and waits for a child.
    eventually("the task has exec'ed sleep", || {
        std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep")
    })
    .await;
    assert_eq!(
        status_field(pid, "SigBlk").as_deref(),
        Some("0000000000000000"),
        "the task inherits no blocked signal from its supervisor"
    );
    let orphan_file = driver
        .alloc_dirs()
        .alloc(&alloc_id("reaps"))
        .path()
        .join("t/local/orphan");
    eventually("the orphan's pid is written", || {
        read_pid(&orphan_file).is_some()
    })
    .await;
    let orphan = read_pid(&orphan_file).expect("written");
    // Reaped, not left a zombie: its /proc entry goes away while the task runs on.
    eventually("the exited orphan is reaped", || {
        !std::path::Path::new(&format!("/proc/{orphan}")).exists()
    })
    .await;
    assert!(alive(pid), "the task runs on");
    assert!(alive(supervisor), "the supervisor runs on");
    stop(&driver, &handle).await;
}

/// Kills the supervisor of the task `handle` with SIGKILL: the wait reports an exit it
/// could not learn, and the task dies with its supervisor.
async fn kill_its_supervisor_and_see_it_die(driver: &ExecDriver, handle: TaskHandle) {
    let pid = handle.pid.expect("a pid");
    let supervisor = supervisor_of(pid);
    std::process::Command::new("kill")
        .args(["-9", &supervisor.to_string()])
        .status()
        .expect("kill runs");
    let exit = tokio::time::timeout(Duration::from_secs(10), driver.wait(handle.clone()))
        .await
        .expect("the wait ends");
    assert!(exit.error.is_some(), "{exit:?}");
    eventually("the task died with its supervisor", || !alive(pid)).await;
    driver.destroy(&handle).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_dies_with_its_supervisor_and_the_wait_reports_the_lost_exit() {
    let data = DataDir::new();
    let driver = exec_driver(data.path(), true);
    let handle = driver
        .start(shell("orphan", "exec sleep 1000"))
        .await
        .expect("started");
    kill_its_supervisor_and_see_it_die(&driver, handle).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_running_as_another_user_dies_with_its_supervisor_too() {
    if !running_as_root() {
        eprintln!("skipped: only root can start a task as another user");
        return;
    }
    let data = DataDir::new();
    let driver = exec_driver(data.path(), false);
    let handle = driver
        .start(request("orphan", "/bin/sleep", &["1000"], Some("nobody")))
        .await
        .expect("started");
    let pid = handle.pid.expect("a pid");
    let uid = status_field(pid, "Uid").expect("a uid line");
    assert!(uid.starts_with("65534\t"), "the task runs as nobody: {uid}");
    kill_its_supervisor_and_see_it_die(&driver, handle).await;
}

/// A user of `/etc/passwd` other than root that `/etc/group` lists as a member of a group
/// other than its primary one: the user's name, its primary gid and that group's gid.
fn member_of_a_supplementary_group() -> Option<(String, u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    let group = std::fs::read_to_string("/etc/group").ok()?;
    let primary = |user: &str| {
        passwd.lines().find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            let (uid, gid) = (
                fields.get(2)?.parse::<u32>().ok()?,
                fields.get(3)?.parse().ok()?,
            );
            (fields[0] == user && uid != 0).then_some(gid)
        })
    };
    group.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        let gid: u32 = fields.get(2)?.parse().ok()?;
        fields.get(3)?.split(',').find_map(|user| {
            let primary = primary(user).filter(|primary| *primary != gid)?;
            Some((user.to_owned(), primary, gid))
        })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_running_as_another_user_has_that_users_supplementary_groups_and_not_roots() {
    if !running_as_root() {
        eprintln!("skipped: only root can start a task as another user");
        return;
    }
    let Some((user, primary, member_of)) = member_of_a_supplementary_group() else {
        eprintln!(
            "skipped: /etc/group names no user of /etc/passwd but root as a member of a group other than its primary one"
        );
        return;
    };
    let data = DataDir::new();
    let driver = exec_driver(data.path(), false);
    let handle = driver
        .start(request("grouped", "/bin/sleep", &["1000"], Some(&user)))
        .await
        .expect("started");
    let pid = handle.pid.expect("a pid");
    let groups = status_field(pid, "Groups").expect("a groups line");
    let groups: Vec<u32> = groups
        .split_whitespace()
        .map(|gid| gid.parse().expect("a gid"))
        .collect();
    assert!(
        groups.contains(&member_of) && groups.contains(&primary),
        "{user} is in groups {primary} and {member_of}, the task in {groups:?}"
    );
    assert!(
        !groups.contains(&0),
        "root's group stays behind: {groups:?}"
    );
    stop(&driver, &handle).await;
}

/// The descriptors `pid` holds: number and target, by number.
fn descriptors(pid: u32) -> Vec<(u32, std::path::PathBuf)> {
    let Ok(entries) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let mut open: Vec<(u32, std::path::PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let fd = entry.file_name().to_str()?.parse().ok()?;
            Some((fd, std::fs::read_link(entry.path()).unwrap_or_default()))
        })
        .collect();
    open.sort();
    open
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_descriptor_the_agent_leaks_reaches_neither_the_fork_server_nor_a_supervisor_nor_a_task()
{
    let data = DataDir::new();
    let leaked_path = data
        .path()
        .canonicalize()
        .expect("the data dir")
        .join("leaked");
    let leaked = std::fs::File::create(&leaked_path).expect("created");
    // As a descriptor the agent inherited from whoever started it would be.
    rustix::io::fcntl_setfd(&leaked, rustix::io::FdFlags::empty()).expect("close-on-exec cleared");
    let driver = exec_driver(data.path(), true);
    let handle = driver
        .start(request("leak", "/bin/sleep", &["1000"], None))
        .await
        .expect("started");
    let pid = handle.pid.expect("a pid");
    let supervisor = supervisor_of(pid);
    let server = driver.fork_server_pid().expect("the fork server runs");
    for (who, holder) in [("fork server", server), ("supervisor", supervisor)] {
        let open = descriptors(holder);
        assert!(
            !open.iter().any(|(_, target)| *target == leaked_path),
            "the {who} holds the leaked file: {open:?}"
        );
    }
    // The kernel lets the supervisor go on before `exec` has closed the close-on-exec
    // descriptors, and the program's loader opens files of its own for a moment: wait
    // until only stdin, stdout and stderr are left.
    eventually("the task holds only stdin, stdout and stderr", || {
        descriptors(pid).iter().map(|(fd, _)| *fd).eq([0, 1, 2])
    })
    .await;
    stop(&driver, &handle).await;
    drop(leaked);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_the_fork_server_has_no_process_to_fork_for_fails_recoverably() {
    if !running_as_root() {
        eprintln!("skipped: only root can start the fork server as another user");
        return;
    }
    let tool = |name: &str| {
        ["/usr/bin", "/bin", "/usr/sbin", "/sbin"]
            .iter()
            .map(|dir| std::path::Path::new(dir).join(name))
            .find(|path| path.exists())
    };
    let (Some(prlimit), Some(setpriv)) = (tool("prlimit"), tool("setpriv")) else {
        eprintln!("skipped: prlimit and setpriv (util-linux) are not both installed");
        return;
    };
    let data = DataDir::new();
    // The fork server runs as a user of its own with `RLIMIT_NPROC` 1: it runs, and
    // its first fork fails with EAGAIN, as in a full pids cgroup. Its ids are set
    // before the limit counts (a process over it may not `exec`), and the uid is
    // one no other process has.
    let uid = 3_735_928_559_u32;
    let wrapper = data.path().join("supervisor");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec {} --nproc=1:1 {} --reuid={uid} --regid={uid} --clear-groups {} \"$@\"\n",
            prlimit.display(),
            setpriv.display(),
            exec_support::supervisor().display(),
        ),
    )
    .expect("written");
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("made executable");
    let driver = ExecDriver::new(
        stead_controller::driver::exec::ExecDriverConfig {
            data_dir: data.path().to_owned(),
            allow_root: true,
            supervisor: wrapper,
            cgroup_parent: stead_tests::cgroup_parent(data.path()),
            ..stead_controller::driver::exec::ExecDriverConfig::new(data.path())
        },
        stead_controller::clock::Clock::system(),
    );
    let failed = driver
        .start(request("busy", "/bin/sleep", &["1000"], None))
        .await
        .expect_err("no process to fork");
    match &failed {
        DriverError::Start {
            message,
            recoverable,
            ..
        } => {
            assert!(message.contains("forking the supervisor"), "{message}");
            assert!(recoverable, "a retry may find a process free: {message}");
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_no_agent_learnt_of_is_stopped_when_its_task_starts_again() {
    let data = DataDir::new();
    // An agent starts the task and dies before it records the handle.
    let first = exec_driver(data.path(), true);
    let lost = first
        .start(shell("lost", "exec sleep 1000"))
        .await
        .expect("started");
    let lost_pid = lost.pid.expect("a pid");
    drop(first);
    // The next agent starts the task again: the lost run must not keep running beside it.
    let next = exec_driver(data.path(), true);
    let handle = next
        .start(shell("lost", "exec sleep 1000"))
        .await
        .expect("started");
    eventually("the lost run is stopped", || !alive(lost_pid)).await;
    assert!(alive(handle.pid.expect("a pid")));
    stop(&next, &handle).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_driver_has_its_fork_server_running_before_any_start_and_starts_through_it() {
    let data = DataDir::new();
    let driver = exec_driver(data.path(), true);
    assert_eq!(driver.fork_server_pid(), None, "started lazily by default");
    driver.prepare();
    let server = driver.fork_server_pid().expect("prepared");
    assert!(alive(server), "the fork server runs before any task start");
    driver.prepare();
    assert_eq!(driver.fork_server_pid(), Some(server), "prepared once");

    let handle = driver
        .start(request("prepared", "/bin/sleep", &["1000"], None))
        .await
        .expect("started");
    assert_eq!(
        driver.fork_server_pid(),
        Some(server),
        "the first start used the prepared server"
    );
    stop(&driver, &handle).await;
}

/// The report pipe between this process and `supervisor`: the pipes the supervisor holds
/// that this process holds too.
fn shared_pipes(supervisor: u32) -> Vec<std::path::PathBuf> {
    let ours = descriptors(std::process::id());
    descriptors(supervisor)
        .into_iter()
        .map(|(_, target)| target)
        .filter(|target| target.to_string_lossy().starts_with("pipe:"))
        .filter(|target| ours.iter().any(|(_, mine)| mine == target))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_driver_closes_its_runs_pipes_so_a_driver_made_again_holds_one_descriptor_per_task()
 {
    let data = DataDir::new();
    let driver = exec_driver(data.path(), true);
    let handle = driver
        .start(shell("dropped", "exec sleep 1000"))
        .await
        .expect("started");
    let pid = handle.pid.expect("a pid");
    let supervisor = supervisor_of(pid);
    assert_eq!(
        shared_pipes(supervisor).len(),
        1,
        "the report pipe is watched"
    );
    drop(driver);
    eventually("the old driver's pipe to the supervisor closed", || {
        shared_pipes(supervisor).is_empty()
    })
    .await;
    assert!(alive(pid), "the task runs on, as after an agent's exit");
    // A new driver reattaches (with a pidfd) and can still stop it.
    let driver = exec_driver(data.path(), true);
    driver.recover(&handle).await.expect("reattached");
    stop(&driver, &handle).await;
}
