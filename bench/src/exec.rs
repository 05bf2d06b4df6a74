//! `stead-bench exec [TASKS] [RESTARTS] [ROUNDS]`: the exec driver against a bare
//! fork/exec loop, with real processes.
//!
//! In one run: the time to start TASKS (default 500) `sleep 3600` tasks until every one
//! shows running, against a loop that spawns the same processes and nothing else (median
//! of ROUNDS rounds each, default 3); the supervision memory per task, the PSS
//! (`/proc/<pid>/smaps_rollup`) of every process stead runs besides the tasks (the
//! supervisors and their fork server; the agent excluded), while all the tasks run; the
//! CPU each start costs the agent (user and system), the fork server, the supervisor and
//! the task, and each stop the agent while draining; an agent restart (a new
//! node and driver over the same store and data dir) until every task is reattached
//! with the same pid; and the latency from `kill -9` of a task with restart delay 0
//! until its new process runs (p50, p90).
//!
//! It needs `stead-supervisor` next to `stead-bench` (`scripts/build-release.sh
//! target/dist stead-supervisor stead-bench`) or its path in `STEAD_SUPERVISOR`. With
//! `STEAD_BENCH_DRAIN_TIMELINE` set, the drain prints where it stands every 100 ms, on
//! stderr: allocs told to stop, allocs shown dead, and of 500 sampled tasks, the tasks and
//! supervisors still running.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use stead_controller::clock::Clock;
use stead_controller::driver::exec::{ExecDriver, ExecDriverConfig, default_supervisor_path};
use stead_controller::driver::{Driver, Drivers};
use stead_controller::node::{Node, NodeConfig};
use stead_controller::queue::Shutdown;
use stead_controller::store::MemoryStore;
use stead_schemas::ValidSpec;
use stead_schemas::status::AllocStatus;
use tokio::runtime::Runtime;

use crate::measure::{median, now, parent, settle, smaps_kib, stat_fields, user_system_ticks};

/// How long any phase may take before the benchmark gives up.
const LIMIT: Duration = Duration::from_secs(300);
/// How long the machine may take to become quiet before a phase, after which the phase
/// runs anyway (and the report says so).
const SETTLE_LIMIT: Duration = Duration::from_secs(20);

fn spec(name: &str, restart: &str) -> anyhow::Result<ValidSpec> {
    let yaml = format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n{restart}  tasks:\n    - {{name: main, driver: exec, config: {{command: sleep, args: [\"3600\"]}}}}\n"
    );
    let file = stead_schemas::parse_spec_file(std::path::Path::new("bench.yaml"), &yaml);
    match file.specs().next() {
        Some(spec) => Ok(spec.clone()),
        None => bail!("invalid bench spec: {:?}", file.all_diagnostics()),
    }
}

fn percentile(values: &mut [Duration], p: f64) -> Duration {
    values.sort();
    let index = ((values.len() as f64 - 1.0) * p).round() as usize;
    values[index.min(values.len() - 1)]
}

/// CPU time of every thread of `pid`, from `schedstat` (nanoseconds: exact where clock
/// ticks would round a short-lived process down to nothing).
fn cpu_nanos(pid: u32) -> u64 {
    let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    threads
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|text| text.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Whether alloc `status`'s task runs, with a pid.
fn runs(status: &AllocStatus) -> bool {
    status
        .tasks
        .values()
        .all(|t| t.state == "running" && t.pid.is_some())
}

/// How long the wait for every alloc lets pass between two looks: looking on every
/// status the node publishes (one or more per task start) kept a core of the bench busy
/// at 2,000 tasks, the time charged to the agent and taken from the tasks' starts. A
/// figure is late by at most this much.
const LOOK_EVERY: Duration = Duration::from_millis(5);

/// Waits until `done` holds for the status of every alloc in `names`: looks again after
/// a status is published, at most every [`LOOK_EVERY`]. Each look goes through the allocs
/// not yet done in order and stops at the first that still is not: the allocs start
/// about in the order they were applied, so a look reads a few statuses rather than all
/// those pending. Reading every pending one each look made the bench's reads grow with
/// the square of the tasks: about a quarter of the user CPU charged to the agent per start
/// at 2,000 and 4,000 tasks. One done out of order is taken when a look reaches it.
/// False when `limit` passes first.
async fn wait_for_all(
    node: &Node,
    names: &[String],
    limit: Duration,
    done: impl Fn(&str, &AllocStatus) -> bool,
) -> bool {
    let mut pending: VecDeque<&str> = names.iter().map(String::as_str).collect();
    let mut changes = node.status_changes();
    let wait = async {
        loop {
            changes.mark_unchanged();
            while let Some(name) = pending.front()
                && node.status(name).is_some_and(|s| done(name, &s))
            {
                pending.pop_front();
            }
            if pending.is_empty() || pending.iter().all(|name| given_up(node, name)) {
                return;
            }
            if changes.changed().await.is_err() {
                return;
            }
            tokio::time::sleep(LOOK_EVERY).await;
        }
    };
    if tokio::time::timeout(limit, wait).await.is_ok() && pending.is_empty() {
        return true;
    }
    // Why: what the first few allocs not done show, the first with its events.
    eprintln!("{} allocs not done, among them:", pending.len());
    for (i, name) in pending.iter().take(5).enumerate() {
        let Some(status) = node.status(name) else {
            eprintln!("  {name}: no status");
            continue;
        };
        for (task, shown) in &status.tasks {
            eprintln!(
                "  {name}/{task}: {} (restarts {})",
                shown.state, shown.restarts
            );
            let events = if i == 0 { shown.events.len() } else { 1 };
            for event in shown.events.iter().rev().take(events).rev() {
                eprintln!("    {}: {}", event.event_type, event.message);
            }
        }
    }
    false
}

/// Set, the drain prints where it stands every [`TIMELINE_EVERY`].
const DRAIN_TIMELINE: &str = "STEAD_BENCH_DRAIN_TIMELINE";
const TIMELINE_EVERY: Duration = Duration::from_millis(100);
/// The tasks whose processes the drain's timeline looks at.
const TIMELINE_SAMPLE: usize = 500;

/// Whether process `pid` runs (exists, and is no zombie).
fn alive(pid: u32) -> bool {
    stat_fields(&pid.to_string())
        .is_some_and(|fields| fields.first().is_some_and(|state| *state != "Z"))
}

/// One line of the drain's timeline: allocs told to stop (a `Killing` event) and shown
/// dead, and of the sampled tasks, tasks and supervisors still running.
fn drain_moment(node: &Node, pids: &[(u32, Option<u32>)], at: Duration) -> String {
    let statuses = node.statuses();
    let killing = statuses
        .iter()
        .filter(|s| {
            s.tasks
                .values()
                .any(|t| t.events.iter().any(|e| e.event_type == "Killing"))
        })
        .count();
    let dead = statuses
        .iter()
        .filter(|s| s.tasks.values().all(|t| t.state == "dead"))
        .count();
    let tasks = pids.iter().filter(|(task, _)| alive(*task)).count();
    let supervisors = pids
        .iter()
        .filter(|(_, supervisor)| supervisor.is_some_and(alive))
        .count();
    format!(
        "  drain {:>6.2} s: killing {killing}, dead {dead}; of {} sampled, tasks {tasks}, supervisors {supervisors} running",
        at.as_secs_f64(),
        pids.len()
    )
}

/// Whether every task of alloc `name` is dead, not to be restarted.
fn given_up(node: &Node, name: &str) -> bool {
    node.status(name)
        .is_some_and(|s| !s.tasks.is_empty() && s.tasks.values().all(|t| t.state == "dead"))
}

/// The agent's (this process's) user and system CPU time so far, in clock ticks.
fn agent_cpu() -> (u64, u64) {
    user_system_ticks("self").unwrap_or_default()
}

/// The agent's user and system CPU time since `before` ([`agent_cpu`]), in clock ticks.
fn agent_cpu_since(before: (u64, u64)) -> (u64, u64) {
    let now = agent_cpu();
    (
        now.0.saturating_sub(before.0),
        now.1.saturating_sub(before.1),
    )
}

struct Round {
    /// The round's data dir, removed after the last round: mass deletions slow the file
    /// creations of the next round on some file systems (journal-less ext4 scans
    /// recently deleted inodes).
    data: PathBuf,
    all_running: Duration,
    /// CPU while starting: the agent's user and system time in clock ticks, the
    /// supervisors' and the tasks' in nanoseconds (totals; divided by the task count when
    /// printed).
    cpu: ((u64, u64), u64, u64),
    /// The fork server's CPU while starting, in nanoseconds.
    fork_server_cpu: u64,
    pss_kib: Option<(u64, u64, u64, usize)>,
    /// The agent's restart: until `restore` returned, and until every task was
    /// reattached (same pids, running).
    restart: (Duration, Duration),
    restarts: Vec<Duration>,
    drained: Duration,
    /// The agent's user and system CPU time while draining, in clock ticks.
    drain_cpu: (u64, u64),
}

async fn stead_round(
    round: usize,
    clock: Clock,
    supervisor: PathBuf,
    tasks: usize,
    restarts: usize,
    measure: bool,
) -> anyhow::Result<Round> {
    let data =
        std::env::temp_dir().join(format!("stead-bench-exec-{}-{round}", std::process::id()));
    std::fs::create_dir_all(&data).with_context(|| format!("creating {}", data.display()))?;
    let config = ExecDriverConfig {
        allow_root: true,
        supervisor,
        ..ExecDriverConfig::new(data.clone())
    };
    let store = MemoryStore::default();
    let start_agent = |config: ExecDriverConfig| {
        let driver = ExecDriver::new(config, clock);
        let drivers = Drivers::new([Arc::new(driver.clone()) as Arc<dyn Driver>]);
        let node = Node::new(
            NodeConfig::default(),
            drivers,
            Arc::new(store.clone()),
            clock,
        );
        (driver, node)
    };
    let (first_driver, node) = start_agent(config.clone());
    // As the agent does before its first start.
    first_driver.prepare();
    let names: Vec<String> = (0..tasks).map(|i| format!("sleep-{i}")).collect();
    let specs: Vec<ValidSpec> = names
        .iter()
        .map(|name| spec(name, ""))
        .collect::<anyhow::Result<_>>()?;

    let agent_before = agent_cpu();
    let start = clock.instant();
    for spec in specs {
        node.apply(spec);
    }
    if !wait_for_all(&node, &names, LIMIT, |_, status| runs(status)).await {
        bail!("not all {tasks} tasks ran within {LIMIT:?}");
    }
    let all_running = start.elapsed();
    let agent = agent_cpu_since(agent_before);
    let node_pids: HashMap<String, u32> = node
        .statuses()
        .iter()
        .filter_map(|s| Some((s.name.clone(), s.tasks.get("main")?.pid?)))
        .collect();
    let task_pids: Vec<u32> = node_pids.values().copied().collect();
    let supervisors_cpu: u64 = task_pids
        .iter()
        .filter_map(|pid| parent(*pid))
        .map(cpu_nanos)
        .sum();
    let tasks_cpu: u64 = task_pids.iter().copied().map(cpu_nanos).sum();
    // Started with the first task: all it did so far was fork the supervisors.
    let fork_server_cpu = first_driver.fork_server_pid().map_or(0, cpu_nanos);

    // The agent restarts: it detaches, and a new node and driver over the same store and
    // data dir restore (records read, runs no record names stopped, a worker per alloc)
    // and reattach to every task.
    node.shutdown(Shutdown::Detach).await;
    // Gone before the next one starts, as a restarted agent's process is: the old
    // driver's descriptors (a pipe per task it started) would otherwise stay open beside
    // the new driver's pidfds, two per task, which a node of 10,000 tasks does not have.
    drop(node);
    drop(first_driver);
    let began = clock.instant();
    let (driver, node) = start_agent(config);
    driver.prepare();
    node.restore().context("restoring")?;
    let restored = began.elapsed();
    // Every alloc's task running again with the pid it had.
    let reattached = |name: &str, status: &AllocStatus| {
        runs(status) && status.tasks.get("main").and_then(|t| t.pid) == node_pids.get(name).copied()
    };
    if !wait_for_all(&node, &names, LIMIT, reattached).await {
        bail!("not all {tasks} tasks were reattached within {LIMIT:?}");
    }
    let restart = (restored, began.elapsed());

    let mut pss_kib = None;
    let mut latencies = Vec::new();
    if measure {
        // Let the supervisors settle (their log files opened, their pipes idle).
        tokio::time::sleep(Duration::from_secs(1)).await;
        // Every process stead runs besides the tasks: their supervisors and the fork
        // server they come from.
        let supervisors: Vec<u32> = node
            .statuses()
            .iter()
            .filter_map(|s| s.tasks.get("main")?.pid)
            .filter_map(parent)
            .chain(driver.fork_server_pid())
            .collect();
        let sum = |field: &str| -> u64 {
            supervisors
                .iter()
                .filter_map(|pid| smaps_kib(*pid, field))
                .sum()
        };
        pss_kib = Some((sum("Pss"), sum("Rss"), sum("Private_Dirty"), tasks));

        node.apply(spec(
            "restarter",
            "  restart: {attempts: 100000, delay: 0s, interval: 24h, mode: fail}\n",
        )?);
        let pid_of = |node: &Node| {
            node.status("restarter")
                .and_then(|s| s.tasks.get("main").filter(|t| t.state == "running")?.pid)
        };
        if !node.wait_until(LIMIT, |node| pid_of(node).is_some()).await {
            bail!("the restarter never ran");
        }
        for _ in 0..restarts {
            let old = pid_of(&node).context("the restarter runs")?;
            let pid =
                rustix::process::Pid::from_raw(i32::try_from(old)?).context("a positive pid")?;
            let began = clock.instant();
            rustix::process::kill_process(pid, rustix::process::Signal::KILL).context("kill -9")?;
            let restarted = node
                .wait_until(LIMIT, |node| pid_of(node).is_some_and(|pid| pid != old))
                .await;
            if !restarted {
                bail!("the restarter did not come back");
            }
            latencies.push(began.elapsed());
        }
    }

    let agent_before = agent_cpu();
    let began = clock.instant();
    if std::env::var_os(DRAIN_TIMELINE).is_some() {
        let pids: Vec<(u32, Option<u32>)> = node_pids
            .values()
            .take(TIMELINE_SAMPLE)
            .map(|pid| (*pid, parent(*pid)))
            .collect();
        let shutdown = node.shutdown(Shutdown::Drain);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                () = tokio::time::sleep(TIMELINE_EVERY) => {
                    eprintln!("{}", drain_moment(&node, &pids, began.elapsed()));
                }
            }
        }
    } else {
        node.shutdown(Shutdown::Drain).await;
    }
    let drained = began.elapsed();
    let drain_cpu = agent_cpu_since(agent_before);
    Ok(Round {
        data,
        all_running,
        cpu: (agent, supervisors_cpu, tasks_cpu),
        fork_server_cpu,
        pss_kib,
        restart,
        restarts: latencies,
        drained,
        drain_cpu,
    })
}

/// What the kernel's cgroup work costs a start and a stop, measured apart from stead: the
/// bare loop with each process moved into a cgroup of its own, made just before it in
/// `root` (where the exec driver makes its tasks' cgroups, so with the same controllers);
/// then every process killed and reaped, and every cgroup removed. Returns the three
/// times. On a v1 host `root` is the memory hierarchy's alone: the driver also makes one
/// in `cpu` (and, on a hybrid, in the v2 tree for `cgroup.kill`), so there it is a part.
fn cgroup_spawn_loop(root: &Path, tasks: usize) -> anyhow::Result<(Duration, Duration, Duration)> {
    use std::os::unix::process::CommandExt;
    let dir = |i: usize| root.join(format!("stead-bench-floor-{i}"));
    let start = now();
    let mut children = Vec::with_capacity(tasks);
    for i in 0..tasks {
        let cgroup = dir(i);
        std::fs::create_dir(&cgroup).with_context(|| format!("creating {}", cgroup.display()))?;
        let child = std::process::Command::new("sleep")
            .arg("3600")
            .process_group(0)
            .spawn()
            .context("spawning the floor's process")?;
        std::fs::write(cgroup.join("cgroup.procs"), child.id().to_string())
            .with_context(|| format!("moving a process into {}", cgroup.display()))?;
        children.push(child);
    }
    let spawned = start.elapsed();
    let start = now();
    for child in &mut children {
        let _ = child.kill();
    }
    for child in &mut children {
        let _ = child.wait();
    }
    let reaped = start.elapsed();
    let start = now();
    for i in 0..tasks {
        let cgroup = dir(i);
        // A reaped process may leave its cgroup a moment later.
        let mut attempts = 0;
        while let Err(error) = std::fs::remove_dir(&cgroup) {
            attempts += 1;
            if attempts > 1000 || error.kind() == std::io::ErrorKind::NotFound {
                break;
            }
            std::thread::yield_now();
        }
    }
    Ok((spawned, reaped, start.elapsed()))
}

/// Runs the benchmark: `exec [TASKS] [RESTARTS] [ROUNDS]`.
pub(crate) fn run(runtime: &Runtime) -> anyhow::Result<()> {
    let mut args = std::env::args().skip(2);
    let tasks: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(500);
    let restarts: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(50);
    let rounds: usize = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(3)
        .max(1);
    // Absolute: the fork server starts in `/`.
    let supervisor = std::env::var_os("STEAD_SUPERVISOR")
        .map(PathBuf::from)
        .unwrap_or_else(default_supervisor_path);
    let supervisor = std::path::absolute(&supervisor).unwrap_or(supervisor);
    if !supervisor.is_file() {
        bail!(
            "no supervisor at {}; build it (`scripts/build-release.sh target/dist stead-supervisor stead-bench`) or set STEAD_SUPERVISOR",
            supervisor.display()
        );
    }
    let clock = runtime.block_on(async { Clock::system() });
    // Where the exec driver makes its tasks' cgroups, if it can.
    let cgroup_root = runtime.block_on(async {
        let driver = ExecDriver::new(ExecDriverConfig::new(std::env::temp_dir()), clock);
        let fingerprint = driver.fingerprint().await;
        fingerprint.attributes.get("cgroup.root").map(PathBuf::from)
    });

    let mut bare = Vec::new();
    let mut floor_cgroups = Vec::new();
    let mut stead = Vec::new();
    let mut agent_restarts = Vec::new();
    let mut measured = None;
    let mut data_dirs = Vec::new();
    // Each phase starts on a quiet machine: not on the cgroups the one before removed.
    let mut unsettled = 0;
    let mut quiet = || {
        if !settle(SETTLE_LIMIT) {
            unsettled += 1;
        }
    };
    for round in 0..rounds {
        quiet();
        bare.push(crate::bare_spawn_loop(
            tasks,
            |_| {
                let mut sleep = std::process::Command::new("sleep");
                sleep.arg("3600");
                sleep
            },
            // `spawn` returns once the child has executed, as stead's start report does.
            || Ok(()),
        )?);
        if let Some(root) = &cgroup_root {
            quiet();
            floor_cgroups.push(cgroup_spawn_loop(root, tasks)?);
        }
        quiet();
        let last = round + 1 == rounds;
        let result = runtime.block_on(stead_round(
            round,
            clock,
            supervisor.clone(),
            tasks,
            restarts,
            last,
        ))?;
        stead.push(result.all_running);
        agent_restarts.push(result.restart);
        data_dirs.push(result.data.clone());
        if last {
            measured = Some(result);
        }
    }
    for dir in data_dirs {
        let _ = std::fs::remove_dir_all(dir);
    }
    let measured = measured.context("at least one round")?;
    let bare_median = median(&bare);
    let stead_median = median(&stead);
    println!(
        "stead-bench exec: {tasks} `sleep 3600` tasks, {rounds} rounds, supervisor {}",
        supervisor.display()
    );
    if unsettled > 0 {
        println!(
            "  (the machine was still busy after {}s before {unsettled} of its phases)",
            SETTLE_LIMIT.as_secs()
        );
    }
    println!(
        "  bare fork/exec loop, all spawned        {:>9.3} s  (median)",
        bare_median.as_secs_f64()
    );
    println!(
        "  stead, all running after submit        {:>9.3} s  (median; {:.2}x the loop, target <= 1.2x)",
        stead_median.as_secs_f64(),
        stead_median.as_secs_f64() / bare_median.as_secs_f64()
    );
    if let Some(root) = &cgroup_root {
        let spawned = median(&floor_cgroups.iter().map(|f| f.0).collect::<Vec<_>>());
        let reaped = median(&floor_cgroups.iter().map(|f| f.1).collect::<Vec<_>>());
        let removed = median(&floor_cgroups.iter().map(|f| f.2).collect::<Vec<_>>());
        println!(
            "  the loop, a cgroup made per process    {:>9.3} s  (median; in {}; stead {:.2}x this)",
            spawned.as_secs_f64(),
            root.display(),
            stead_median.as_secs_f64() / spawned.as_secs_f64()
        );
        println!(
            "  its processes killed and reaped        {:>9.3} s  (median), then their cgroups removed {:.3} s",
            reaped.as_secs_f64(),
            removed.as_secs_f64()
        );
    }
    let ((user, system), supervisors, started) = measured.cpu;
    let per_task_ms = |nanos: u64| nanos as f64 / 1e6 / tasks as f64;
    let tick_nanos = 10_000_000;
    println!(
        "  CPU per start (last round)             {:>9.2} ms agent ({:.2} user, {:.2} system), {:.2} ms fork server, {:.2} ms supervisor, {:.2} ms task",
        per_task_ms((user + system) * tick_nanos),
        per_task_ms(user * tick_nanos),
        per_task_ms(system * tick_nanos),
        per_task_ms(measured.fork_server_cpu),
        per_task_ms(supervisors),
        per_task_ms(started)
    );
    if let Some((pss, rss, dirty, count)) = measured.pss_kib {
        let per = |kib: u64| kib as f64 / count.max(1) as f64;
        println!(
            "  supervision PSS per task               {:>9.1} KiB  (target <= 256 KiB; {count} supervisors and the fork server; RSS {:.0} KiB, private dirty {:.0} KiB per task)",
            per(pss),
            per(rss),
            per(dirty)
        );
    }
    if !measured.restarts.is_empty() {
        let mut latencies = measured.restarts.clone();
        println!(
            "  restart after kill -9, delay 0          {:>9.2} ms p50  ({:.2} ms p90, {} restarts; target p50 <= 5 ms)",
            percentile(&mut latencies, 0.5).as_secs_f64() * 1000.0,
            percentile(&mut latencies, 0.9).as_secs_f64() * 1000.0,
            latencies.len()
        );
    }
    let restored = median(&agent_restarts.iter().map(|r| r.0).collect::<Vec<_>>());
    let reattached = median(&agent_restarts.iter().map(|r| r.1).collect::<Vec<_>>());
    println!(
        "  agent restart, every task reattached   {:>9.3} s  (median; restore itself {:.1} ms; target <= 2 s)",
        reattached.as_secs_f64(),
        restored.as_secs_f64() * 1000.0
    );
    println!(
        "  drain of every task                    {:>9.3} s  (target <= 2 s; agent CPU {:.2} ms per task: {:.2} user, {:.2} system)",
        measured.drained.as_secs_f64(),
        per_task_ms((measured.drain_cpu.0 + measured.drain_cpu.1) * tick_nanos),
        per_task_ms(measured.drain_cpu.0 * tick_nanos),
        per_task_ms(measured.drain_cpu.1 * tick_nanos)
    );
    Ok(())
}
