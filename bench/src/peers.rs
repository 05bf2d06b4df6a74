//! `stead-bench peers [ROUNDS] [IDLE_SECONDS] [RESTARTS]`: stead against supervisord and
//! pm2, same tasks, same machine, same run.
//!
//! Each manager runs as it would in production: the real `stead agent` (exec driver,
//! specs in a directory), `supervisord` with a generated config, and pm2 with an
//! ecosystem file. Every task's command line carries a marker (`sleep 1000017` is task
//! 17, generation 1), so one observer serves all three: a task "runs" when a process
//! with its marker is executing, learnt from the kernel's process events
//! ([`crate::procwatch`]). Measured, ROUNDS times each (default 3): cold start of 10,
//! 100 and 500 `sleep` tasks from launching the manager until all run (its configuration
//! or specs written beforehand, and an earlier run's files removed, outside the time, as
//! the floor has nothing to prepare), against a bare fork/exec loop timed by the same
//! observer; restart after `kill -9` of one task (RESTARTS
//! kills per round, default 10); stop-all of 100 tasks that each take 1 s to exit on
//! SIGTERM; changing one task's command among 100 (time to the new process; the other
//! 99 pids must not change); and, once, the manager's own CPU, RSS and PSS over
//! IDLE_SECONDS (default 60) with 100 tasks, every process of the manager counted
//! (stead: the agent, its fork server and the per-task supervisors).
//!
//! Prints a Markdown report. Needs `stead` and `stead-supervisor` next to `stead-bench`
//! (or `STEAD_BIN`), `supervisord`/`supervisorctl` and `pm2` on the PATH (or `PM2`, or
//! `target/bench-deps/node_modules/.bin/pm2`, where `scripts/install-bench-deps.sh`
//! puts it).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::measure::{cpu_ticks, median, now, parent, smaps_kib, spread};
use crate::procwatch::{Marked, Observer};

/// How long any phase may take before the benchmark gives up.
const LIMIT: Duration = Duration::from_secs(300);
/// How often the process table is read while waiting.
const POLL: Duration = Duration::from_millis(1);
/// Cold-start sizes.
const COLD: [usize; 3] = [10, 100, 500];
/// The size of the pool the other measurements use.
const POOL: usize = 100;
/// A task that takes one second to exit on SIGTERM.
const SLOW_STOP: &str = "trap 'sleep 1; exit 0' TERM; while :; do sleep 0.1; done";
/// The marker of the slow-stopping tasks (their `$0`).
const STOP_MARKER: &str = "bench-stop-";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Stead,
    Supervisord,
    Pm2,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Stead, Kind::Supervisord, Kind::Pm2];

    fn name(self) -> &'static str {
        match self {
            Kind::Stead => "stead",
            Kind::Supervisord => "supervisord",
            Kind::Pm2 => "pm2",
        }
    }
}

/// One task, as every manager runs it.
#[derive(Debug, Clone)]
struct Task {
    name: String,
    command: String,
    args: Vec<String>,
}

/// Where the programs are.
struct Tools {
    stead: PathBuf,
    pm2: PathBuf,
    supervisord: PathBuf,
    sleep: String,
    shell: String,
}

/// The marker argument of sleep task `index` in `generation`.
fn marker(index: usize, generation: usize) -> usize {
    generation * 1_000_000 + index
}

fn sleep_task(tools: &Tools, index: usize, generation: usize) -> Task {
    Task {
        name: format!("t{index}"),
        command: tools.sleep.clone(),
        args: vec![marker(index, generation).to_string()],
    }
}

fn slow_stop_task(tools: &Tools, index: usize) -> Task {
    Task {
        name: format!("t{index}"),
        command: tools.shell.clone(),
        args: vec![
            "-c".to_owned(),
            SLOW_STOP.to_owned(),
            format!("{STOP_MARKER}{index}"),
        ],
    }
}

/// Marks `sleep <marker>` processes and the slow-stopping tasks (with what they fork).
fn classify(cmdline: &[u8]) -> Option<Marked> {
    if cmdline
        .windows(STOP_MARKER.len())
        .any(|w| w == STOP_MARKER.as_bytes())
    {
        return Some(Marked::Stop);
    }
    let mut args = cmdline.split(|b| *b == 0);
    let (Some(program), Some(arg)) = (args.next(), args.next()) else {
        return None;
    };
    if !program.ends_with(b"sleep") {
        return None;
    }
    let n = std::str::from_utf8(arg).ok()?.parse::<usize>().ok()?;
    (1_000_000..10_000_000)
        .contains(&n)
        .then_some(Marked::Sleep {
            index: n % 1_000_000,
            generation: n / 1_000_000,
        })
}

/// The running sleep tasks: (index, generation) → pid.
fn sleep_tasks(marked: &HashMap<u32, Marked>) -> HashMap<(usize, usize), u32> {
    marked
        .iter()
        .filter_map(|(pid, m)| match m {
            Marked::Sleep { index, generation } => Some(((*index, *generation), *pid)),
            Marked::Stop => None,
        })
        .collect()
}

/// How many slow-stopping tasks (or their children) are alive.
fn slow_stop_tasks(marked: &HashMap<u32, Marked>) -> usize {
    marked.values().filter(|m| **m == Marked::Stop).count()
}

/// Polls `condition` until it holds; the time since `start`.
fn until(
    start: Instant,
    what: &str,
    mut condition: impl FnMut() -> bool,
) -> anyhow::Result<Duration> {
    while !condition() {
        if start.elapsed() > LIMIT {
            bail!("{what}: not reached within {LIMIT:?}");
        }
        std::thread::sleep(POLL);
    }
    Ok(start.elapsed())
}

/// The children of `pid`.
fn children(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| parent(*p) == Some(pid))
        .collect()
}

fn kill(pid: u32, signal: rustix::process::Signal) {
    if let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process(pid, signal);
    }
}

/// Runs `command` to completion; fails with its output when it fails.
fn run(command: &mut Command) -> anyhow::Result<()> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {command:?}"))?;
    if !output.status.success() {
        bail!(
            "{command:?}: {}\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

/// The spec stead gets for a task: one `exec` task running `command` with `args`,
/// restarted without delay (also what `stead-bench parse` reads).
pub(crate) fn spec_yaml(name: &str, command: &str, args: &[String]) -> String {
    let args: Vec<String> = args.iter().map(|a| format!("{a:?}")).collect();
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  restart: {{attempts: 100000, interval: 24h, delay: 0s, mode: fail}}\n  tasks:\n    - name: main\n      driver: exec\n      config: {{command: {command:?}, args: [{}]}}\n      killSignal: SIGTERM\n      killTimeout: 5s\n",
        args.join(", ")
    )
}

/// A manager running a set of tasks.
struct Manager<'t> {
    kind: Kind,
    tools: &'t Tools,
    dir: PathBuf,
    tasks: Vec<Task>,
    /// The agent or supervisord; pm2's daemon is not our child.
    child: Option<Child>,
}

impl<'t> Manager<'t> {
    /// Clears what an earlier run left in `dir` and writes the manager's configuration
    /// for `tasks` there, as a deployment has it in place before the manager starts:
    /// none of it is part of a start's time.
    fn prepare(kind: Kind, tools: &'t Tools, dir: &Path, tasks: Vec<Task>) -> anyhow::Result<Self> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let manager = Manager {
            kind,
            tools,
            dir: dir.to_owned(),
            tasks,
            child: None,
        };
        match kind {
            Kind::Stead => {
                let specs = dir.join("specs");
                std::fs::create_dir_all(&specs)?;
                for task in &manager.tasks {
                    manager.write_spec(task)?;
                }
                if existing_store() {
                    // A node whose store already exists (empty), as after an agent
                    // upgrade or a restart with no allocs: its start opens it, not makes it.
                    let state = dir.join("data/state");
                    std::fs::create_dir_all(&state)?;
                    drop(stead_controller::store::RocksDbStore::open(
                        &state,
                        stead_controller::store::RocksDbOptions::default(),
                    )?);
                }
                let port = std::net::TcpListener::bind("127.0.0.1:0")?
                    .local_addr()?
                    .port();
                // State in RocksDB under the data dir; the specs dir is watched, with
                // the default 20 s resync as the safety net.
                std::fs::write(
                    dir.join("agent.yaml"),
                    format!(
                        "specsDir: {}\ndataDir: {}\nlisten: 127.0.0.1:{port}\nshutdown: drain\nallowRoot: true\ndrivers: {{mock: {{enabled: false}}}}\nlogFormat: json\n",
                        specs.display(),
                        dir.join("data").display()
                    ),
                )?;
            }
            Kind::Supervisord => manager.write_supervisord_config()?,
            Kind::Pm2 => manager.write_ecosystem()?,
        }
        Ok(manager)
    }

    /// Launches the manager on the configuration [`Manager::prepare`] wrote: the start
    /// a cold start is timed from.
    fn launch(mut self) -> anyhow::Result<Self> {
        let dir = self.dir.clone();
        match self.kind {
            Kind::Stead => {
                let log = std::fs::File::create(dir.join("agent.log"))?;
                self.child = Some(
                    Command::new(&self.tools.stead)
                        .arg("agent")
                        .arg("--config")
                        .arg(dir.join("agent.yaml"))
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(log)
                        .spawn()
                        .context("starting stead agent")?,
                );
            }
            Kind::Supervisord => {
                self.child = Some(
                    Command::new("supervisord")
                        .arg("--nodaemon")
                        .arg("--configuration")
                        .arg(dir.join("supervisord.conf"))
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .context("starting supervisord")?,
                );
            }
            Kind::Pm2 => {
                run(self.pm2().arg("start").arg(dir.join("ecosystem.json")))?;
            }
        }
        Ok(self)
    }

    fn write_spec(&self, task: &Task) -> anyhow::Result<()> {
        let yaml = spec_yaml(&task.name, &task.command, &task.args);
        // Written aside and renamed, as an editor or a deploy tool does.
        let path = self.dir.join("specs").join(format!("{}.yaml", task.name));
        let temporary = self
            .dir
            .join("specs")
            .join(format!(".{}.yaml.tmp", task.name));
        std::fs::write(&temporary, yaml)?;
        std::fs::rename(&temporary, &path)?;
        Ok(())
    }

    fn write_supervisord_config(&self) -> anyhow::Result<()> {
        let dir = self.dir.display();
        let logs = self.dir.join("logs");
        std::fs::create_dir_all(&logs)?;
        let mut conf = format!(
            "[unix_http_server]\nfile={dir}/supervisor.sock\n\n[supervisord]\nlogfile={dir}/supervisord.log\npidfile={dir}/supervisord.pid\nchildlogdir={}\nminfds=16384\nloglevel=warn\n\n[rpcinterface:supervisor]\nsupervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface\n\n[supervisorctl]\nserverurl=unix://{dir}/supervisor.sock\n",
            logs.display()
        );
        for task in &self.tasks {
            let args: Vec<String> = task
                .args
                .iter()
                .map(|a| {
                    if a.contains(' ') {
                        format!("\"{a}\"")
                    } else {
                        a.clone()
                    }
                })
                .collect();
            conf.push_str(&format!(
                "\n[program:{}]\ncommand={} {}\nautostart=true\nautorestart=true\nstartsecs=0\nstartretries=100000\nstopsignal=TERM\nstopwaitsecs=5\n",
                task.name,
                task.command,
                args.join(" ")
            ));
        }
        std::fs::write(self.dir.join("supervisord.conf"), conf)?;
        Ok(())
    }

    fn write_ecosystem(&self) -> anyhow::Result<()> {
        let apps: Vec<String> = self
            .tasks
            .iter()
            .map(|task| {
                let args: Vec<String> = task.args.iter().map(|a| format!("{a:?}")).collect();
                format!(
                    "{{\"name\": {:?}, \"script\": {:?}, \"args\": [{}], \"interpreter\": \"none\", \"exec_mode\": \"fork\", \"autorestart\": true, \"restart_delay\": 0, \"kill_timeout\": 5000, \"out_file\": {:?}, \"error_file\": {:?}}}",
                    task.name,
                    task.command,
                    args.join(", "),
                    self.dir.join(format!("logs/{}.out", task.name)).display().to_string(),
                    self.dir.join(format!("logs/{}.err", task.name)).display().to_string(),
                )
            })
            .collect();
        std::fs::write(
            self.dir.join("ecosystem.json"),
            format!("{{\"apps\": [\n{}\n]}}\n", apps.join(",\n")),
        )?;
        Ok(())
    }

    /// A `pm2` command on this manager's home; the daemon sends SIGTERM, like the others.
    fn pm2(&self) -> Command {
        let mut command = Command::new(&self.tools.pm2);
        command
            .env("PM2_HOME", self.dir.join("pm2"))
            .env("PM2_KILL_SIGNAL", "SIGTERM")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        command
    }

    fn supervisorctl(&self) -> Command {
        let mut command = Command::new("supervisorctl");
        command
            .arg("--configuration")
            .arg(self.dir.join("supervisord.conf"));
        command
    }

    /// The manager's main process.
    fn main_pid(&self) -> Option<u32> {
        match self.kind {
            Kind::Stead | Kind::Supervisord => self.child.as_ref().map(Child::id),
            Kind::Pm2 => std::fs::read_to_string(self.dir.join("pm2/pm2.pid"))
                .ok()?
                .trim()
                .parse()
                .ok(),
        }
    }

    /// Every process of the manager besides the tasks: the main one, its other
    /// children (stead's fork server), and the tasks' parents (stead's supervisors).
    fn processes(&self, task_pids: &HashSet<u32>) -> Vec<u32> {
        let mut all: HashSet<u32> = HashSet::new();
        if let Some(main) = self.main_pid() {
            all.insert(main);
            all.extend(
                children(main)
                    .into_iter()
                    .filter(|p| !task_pids.contains(p)),
            );
        }
        all.extend(task_pids.iter().filter_map(|p| parent(*p)));
        let mut all: Vec<u32> = all.into_iter().collect();
        all.sort_unstable();
        all
    }

    /// Replaces task `index`'s command with generation 2's, the way each manager expects.
    fn change(&mut self, index: usize) -> anyhow::Result<()> {
        let task = sleep_task(self.tools, index, 2);
        let at = self
            .tasks
            .iter()
            .position(|t| t.name == task.name)
            .context("the task exists")?;
        self.tasks[at] = task.clone();
        match self.kind {
            // The specs directory is the desired state: writing the file is the change.
            Kind::Stead => self.write_spec(&task),
            Kind::Supervisord => {
                self.write_supervisord_config()?;
                run(self.supervisorctl().arg("update"))
            }
            Kind::Pm2 => {
                // pm2 keeps an app's arguments across restarts: delete, then start anew.
                self.write_ecosystem()?;
                run(self.pm2().args(["delete", &task.name]))?;
                run(self
                    .pm2()
                    .arg("start")
                    .arg(self.dir.join("ecosystem.json"))
                    .args(["--only", &task.name]))
            }
        }
    }

    /// Stops every task the manager's way: stead drains on SIGTERM (every alloc at
    /// once); `supervisorctl stop all`; `pm2 stop all`.
    fn stop_all(&mut self) -> anyhow::Result<()> {
        match self.kind {
            Kind::Stead => {
                if let Some(pid) = self.main_pid() {
                    kill(pid, rustix::process::Signal::TERM);
                }
                Ok(())
            }
            Kind::Supervisord => run(self.supervisorctl().args(["stop", "all"])),
            Kind::Pm2 => run(self.pm2().args(["stop", "all"])),
        }
    }

    /// Stops the manager and every task, and waits until they are gone.
    fn shut_down(mut self, observer: &mut Observer) -> anyhow::Result<()> {
        match self.kind {
            Kind::Stead | Kind::Supervisord => {
                if let Some(pid) = self.main_pid() {
                    kill(pid, rustix::process::Signal::TERM);
                }
            }
            Kind::Pm2 => run(self.pm2().arg("kill"))?,
        }
        if let Some(child) = self.child.as_mut() {
            let start = now();
            until(start, "manager exit", || {
                matches!(child.try_wait(), Ok(Some(_)))
            })?;
        }
        observer.until(now(), LIMIT, "every task gone", |m| m.is_empty())?;
        let _ = std::fs::remove_dir_all(&self.dir);
        Ok(())
    }
}

impl Drop for Manager<'_> {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut()
            && matches!(child.try_wait(), Ok(None))
        {
            let _ = child.kill();
            let _ = child.wait();
        }
        if self.kind == Kind::Pm2 && self.dir.join("pm2").exists() {
            let _ = self.pm2().arg("kill").output();
        }
    }
}

/// Measurements by row, then by manager ("floor" for the bare loop).
#[derive(Default)]
struct Results {
    rows: BTreeMap<String, BTreeMap<String, Vec<f64>>>,
    notes: Vec<String>,
}

impl Results {
    fn add(&mut self, row: &str, who: &str, value: f64) {
        self.rows
            .entry(row.to_owned())
            .or_default()
            .entry(who.to_owned())
            .or_default()
            .push(value);
    }
}

fn all_running(count: usize) -> impl FnMut(&HashMap<u32, Marked>) -> bool {
    move |marked| {
        let tasks = sleep_tasks(marked);
        (0..count).all(|i| tasks.contains_key(&(i, 1)))
    }
}

/// Whether stead's cold start finds its store already made (`STEAD_BENCH_EXISTING_STORE`
/// set): an existing node's start, rather than a new node's.
fn existing_store() -> bool {
    std::env::var_os("STEAD_BENCH_EXISTING_STORE").is_some()
}

/// Whether only cold start is measured (`STEAD_BENCH_COLD_ONLY` set): many quick
/// rounds of the row that varies most, to compare two builds.
fn cold_start_only() -> bool {
    std::env::var_os("STEAD_BENCH_COLD_ONLY").is_some()
}

/// The cold start sizes measured: all of [`COLD`], or in cold-only mode those named by
/// `STEAD_BENCH_COLD_SIZES` (comma-separated, say `10` to iterate on the smallest).
fn cold_sizes() -> anyhow::Result<Vec<usize>> {
    match std::env::var("STEAD_BENCH_COLD_SIZES") {
        Ok(list) if cold_start_only() => list
            .split(',')
            .map(|size| match size.trim().parse() {
                Ok(count) if count > 0 => Ok(count),
                _ => bail!("STEAD_BENCH_COLD_SIZES: not a task count: {size:?}"),
            })
            .collect(),
        _ => Ok(COLD.to_vec()),
    }
}

/// One round of every measurement for one manager.
fn round(
    kind: Kind,
    tools: &Tools,
    base: &Path,
    restarts: usize,
    idle: Option<Duration>,
    observer: &mut Observer,
    results: &mut Results,
) -> anyhow::Result<()> {
    let dir = base.join(kind.name());
    let who = kind.name();
    for n in cold_sizes()? {
        // Nothing of the floor's or an earlier manager's may count for this one.
        observer.until(now(), LIMIT, "earlier tasks gone", HashMap::is_empty)?;
        let tasks = (0..n).map(|i| sleep_task(tools, i, 1)).collect();
        let manager = Manager::prepare(kind, tools, &dir, tasks)?;
        warm(&program_files(kind, tools));
        let start = now();
        let manager = manager.launch()?;
        let took = observer.until(start, LIMIT, "cold start", all_running(n))?;
        results.add(
            &format!("cold start, {n} tasks (s)"),
            who,
            took.as_secs_f64(),
        );
        if n != POOL || cold_start_only() {
            manager.shut_down(observer)?;
            continue;
        }
        let mut manager = manager;

        // Restart after kill -9 of task 0.
        for _ in 0..restarts {
            observer.update();
            let old = *sleep_tasks(observer.marked())
                .get(&(0, 1))
                .context("task 0 runs")?;
            let start = now();
            kill(old, rustix::process::Signal::KILL);
            let took = observer.until(start, LIMIT, "restart after kill -9", |m| {
                sleep_tasks(m).get(&(0, 1)).is_some_and(|pid| *pid != old)
            })?;
            results.add("restart after kill -9 (ms)", who, took.as_secs_f64() * 1e3);
        }

        if let Some(idle) = idle {
            // Let restarts and start-up work settle first.
            std::thread::sleep(Duration::from_secs(2));
            observer.update();
            let task_pids: HashSet<u32> =
                sleep_tasks(observer.marked()).values().copied().collect();
            let processes = manager.processes(&task_pids);
            let before: u64 = processes
                .iter()
                .map(|p| cpu_ticks(&p.to_string()).unwrap_or(0))
                .sum();
            std::thread::sleep(idle);
            let after: u64 = processes
                .iter()
                .map(|p| cpu_ticks(&p.to_string()).unwrap_or(0))
                .sum();
            let ticks_per_second = 100.0;
            let cpu = (after.saturating_sub(before)) as f64 / ticks_per_second / idle.as_secs_f64()
                * 100.0;
            let rss: u64 = processes
                .iter()
                .map(|p| smaps_kib(*p, "Rss").unwrap_or(0))
                .sum();
            let pss: u64 = processes
                .iter()
                .map(|p| smaps_kib(*p, "Pss").unwrap_or(0))
                .sum();
            results.add(
                &format!(
                    "idle CPU, {POOL} tasks, {} s (% of one core)",
                    idle.as_secs()
                ),
                who,
                cpu,
            );
            results.add(
                &format!("manager RSS, {POOL} tasks (MiB)"),
                who,
                rss as f64 / 1024.0,
            );
            results.add(
                &format!("manager PSS, {POOL} tasks (MiB)"),
                who,
                pss as f64 / 1024.0,
            );
            results.notes.push(format!(
                "{who}: {} manager processes measured while idle",
                processes.len()
            ));
        }

        // Change one task's command among 100.
        let changed = POOL / 2;
        observer.update();
        let before = sleep_tasks(observer.marked());
        let start = now();
        manager.change(changed)?;
        let took = observer.until(start, LIMIT, "changed command", |m| {
            sleep_tasks(m).contains_key(&(changed, 2))
        })?;
        results.add(
            "change one command of 100 (ms)",
            who,
            took.as_secs_f64() * 1e3,
        );
        observer.update();
        let after = sleep_tasks(observer.marked());
        let moved = (0..POOL)
            .filter(|i| *i != changed)
            .filter(|i| before.get(&(*i, 1)) != after.get(&(*i, 1)))
            .count();
        results.add(
            "other pids changed by the change (of 99)",
            who,
            moved as f64,
        );
        manager.shut_down(observer)?;
    }

    if cold_start_only() {
        return Ok(());
    }

    // Stop all of 100 tasks that take 1 s to exit.
    let tasks = (0..POOL).map(|i| slow_stop_task(tools, i)).collect();
    let manager = Manager::prepare(kind, tools, &dir, tasks)?;
    let start = now();
    let mut manager = manager.launch()?;
    observer.until(start, LIMIT, "slow-stop tasks running", |m| {
        slow_stop_tasks(m) >= POOL
    })?;
    // Let each shell reach its loop and install its trap.
    std::thread::sleep(Duration::from_millis(500));
    let start = now();
    manager.stop_all()?;
    let took = observer.until(start, LIMIT, "stop all", |m| slow_stop_tasks(m) == 0)?;
    results.add(
        &format!("stop all {POOL}, 1 s to exit each (s)"),
        who,
        took.as_secs_f64(),
    );
    manager.shut_down(observer)?;
    Ok(())
}

fn version(program: &Path, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// pm2's version, from its `package.json`: `pm2 --version` would spawn a daemon.
fn pm2_version(pm2: &Path) -> String {
    std::fs::canonicalize(pm2)
        .ok()
        .and_then(|bin| {
            let package = bin.parent()?.parent()?.join("package.json");
            let text = std::fs::read_to_string(package).ok()?;
            let json: serde_json::Value = serde_json::from_str(&text).ok()?;
            Some(json.get("version")?.as_str()?.to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

/// The files a manager's start runs: its executables, and the interpreter a script names
/// on its `#!` line.
fn program_files(kind: Kind, tools: &Tools) -> Vec<PathBuf> {
    let mut files = match kind {
        Kind::Stead => vec![
            tools.stead.clone(),
            tools.stead.with_file_name("stead-supervisor"),
        ],
        Kind::Supervisord => vec![tools.supervisord.clone()],
        Kind::Pm2 => vec![tools.pm2.clone()],
    };
    let interpreters: Vec<PathBuf> = files.iter().filter_map(|f| interpreter(f)).collect();
    files.extend(interpreters);
    files
}

/// The interpreter of a script (`#!/usr/bin/python3`, `#!/usr/bin/env node`).
fn interpreter(script: &Path) -> Option<PathBuf> {
    use std::io::Read;
    let mut head = [0_u8; 256];
    let read = std::fs::File::open(script).ok()?.read(&mut head).ok()?;
    let line = std::str::from_utf8(head[..read].strip_prefix(b"#!")?)
        .ok()?
        .lines()
        .next()?;
    let mut words = line.split_whitespace();
    let program = words.next()?;
    if program.ends_with("/env") {
        which(words.next()?)
    } else {
        Some(PathBuf::from(program))
    }
}

/// Reads `files` whole, so that a start finds them in the page cache, as the floor finds
/// `sleep` (which every round runs hundreds of times). A host's proactive reclaim
/// otherwise evicts what went unused for a while: this machine's (DAMON's `pageout` of
/// memory idle for 60 s) evicted the agent's binary between rounds, and a 10-task start
/// then read it from disk, 30 ms instead of 10-13 ms.
fn warm(files: &[PathBuf]) {
    for file in files {
        // Only the page cache matters, not the bytes (node's binary is 94 MB): a missing
        // file fails the start itself, later.
        if let Ok(mut opened) = std::fs::File::open(file) {
            let _ = std::io::copy(&mut opened, &mut std::io::sink());
        }
    }
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|dir| Path::new(dir).join(program))
        .find(|path| path.is_file())
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|k| k.trim().to_owned())
        .unwrap_or_default();
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kib| kib / 1024 / 1024);
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    format!("{cpu}, {cores} cores, {memory} GiB, Linux {kernel}; load average at the end {load}")
}

/// Runs the benchmark: `peers [ROUNDS] [IDLE_SECONDS] [RESTARTS]`.
pub(crate) fn run_peers() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(2);
    let rounds: usize = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(3)
        .max(1);
    let idle = Duration::from_secs(args.next().map(|a| a.parse()).transpose()?.unwrap_or(60));
    let restarts: usize = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(10)
        .max(1);

    let exe = std::env::current_exe()?;
    let stead = std::env::var_os("STEAD_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| exe.with_file_name("stead"));
    // The agent's exec driver finds its supervisor next to the agent.
    if !stead.is_file() || !stead.with_file_name("stead-supervisor").is_file() {
        bail!(
            "no stead and stead-supervisor at {}; `scripts/build-release.sh target/dist stead-controller stead-supervisor stead-bench`, or set STEAD_BIN",
            stead.display()
        );
    }
    let pm2 = std::env::var_os("PM2")
        .map(PathBuf::from)
        .or_else(|| which("pm2"))
        .or_else(|| {
            Some(PathBuf::from("target/bench-deps/node_modules/.bin/pm2")).filter(|p| p.is_file())
        })
        .context("no pm2: run scripts/install-bench-deps.sh, or set PM2")?;
    let supervisord =
        which("supervisord").context("no supervisord: run scripts/install-bench-deps.sh")?;
    let tools = Tools {
        stead,
        pm2,
        supervisord: supervisord.clone(),
        sleep: which("sleep").context("no sleep")?.display().to_string(),
        shell: which("sh").context("no sh")?.display().to_string(),
    };
    // `STEAD_BENCH_MANAGERS=stead` (a comma-separated list) measures only some managers,
    // against the same floor: quick to iterate on one of them.
    let managers: Vec<Kind> = match std::env::var("STEAD_BENCH_MANAGERS") {
        Ok(list) => list
            .split(',')
            .map(|name| {
                Kind::ALL
                    .into_iter()
                    .find(|kind| kind.name() == name.trim())
                    .with_context(|| format!("STEAD_BENCH_MANAGERS: unknown manager {name:?}"))
            })
            .collect::<anyhow::Result<_>>()?,
        Err(_) => Kind::ALL.to_vec(),
    };
    let mut observer = Observer::new(classify);
    if !observer.marked().is_empty() {
        bail!("benchmark tasks from an earlier run still run; stop them first");
    }
    let base = std::env::temp_dir().join(format!("stead-bench-peers-{}", std::process::id()));

    let mut results = Results::default();
    for round_index in 0..rounds {
        for n in cold_sizes()? {
            observer.until(now(), LIMIT, "earlier tasks gone", HashMap::is_empty)?;
            warm(&[PathBuf::from(&tools.sleep)]);
            let took = crate::bare_spawn_loop(
                n,
                |index| {
                    let mut sleep = Command::new(&tools.sleep);
                    sleep.arg(marker(index, 1).to_string());
                    sleep
                },
                || {
                    observer
                        .until(now(), LIMIT, "floor", all_running(n))
                        .map(drop)
                },
            )?;
            results.add(
                &format!("cold start, {n} tasks (s)"),
                "floor",
                took.as_secs_f64(),
            );
        }
        let measure_idle = (round_index + 1 == rounds).then_some(idle);
        for &kind in &managers {
            eprintln!("peers: round {}/{rounds}: {}", round_index + 1, kind.name());
            round(
                kind,
                &tools,
                &base,
                restarts,
                measure_idle,
                &mut observer,
                &mut results,
            )
            .with_context(|| format!("{} round {}", kind.name(), round_index + 1))?;
        }
    }
    let _ = std::fs::remove_dir_all(&base);

    println!("## Results\n");
    println!("Machine: {}  ", machine());
    println!(
        "Versions: stead {} ({}), supervisord {}, pm2 {} (node {})  ",
        env!("CARGO_PKG_VERSION"),
        version(&tools.stead, &["--version"]),
        version(&supervisord, &["--version"]),
        pm2_version(&tools.pm2),
        version(Path::new("node"), &["--version"])
    );
    println!(
        "stead's store: {}  ",
        if existing_store() {
            "already made before each cold start (an existing node)"
        } else {
            "made by each cold start (a new node)"
        }
    );
    if cold_start_only() {
        println!(
            "Run: `STEAD_BENCH_COLD_ONLY=1 stead-bench peers {rounds} {} {restarts}`: {rounds} rounds of cold start only, of {:?} tasks  ",
            idle.as_secs(),
            cold_sizes()?
        );
    } else {
        println!(
            "Run: `stead-bench peers {rounds} {} {restarts}`: {rounds} rounds, {restarts} kills per round, idle {} s once  ",
            idle.as_secs(),
            idle.as_secs()
        );
    }
    println!(
        "Observed by {}, the same for every manager and the floor\n",
        observer.method()
    );
    println!(
        "| measurement | stead median (min-max) | supervisord median (min-max) | pm2 median (min-max) | floor | stead / supervisord | stead / pm2 |"
    );
    println!("|---|---|---|---|---|---|---|");
    let cell = |values: Option<&Vec<f64>>| match values {
        Some(v) if !v.is_empty() => {
            let (median, min, max) = spread(v);
            format!("{} ({}-{})", fmt(median), fmt(min), fmt(max))
        }
        _ => "-".to_owned(),
    };
    let ratio = |a: Option<&Vec<f64>>, b: Option<&Vec<f64>>| match (a, b) {
        (Some(a), Some(b)) if median(b) > 0.0 => format!("{:.2}", median(a) / median(b)),
        _ => "-".to_owned(),
    };
    for (row, by) in &results.rows {
        println!(
            "| {row} | {} | {} | {} | {} | {} | {} |",
            cell(by.get("stead")),
            cell(by.get("supervisord")),
            cell(by.get("pm2")),
            by.get("floor").map_or("-".to_owned(), |v| fmt(median(v))),
            ratio(by.get("stead"), by.get("supervisord")),
            ratio(by.get("stead"), by.get("pm2")),
        );
    }
    // Each round's stead time over the floor measured in the same round (before any
    // manager): steadier than the ratio of medians when the machine's speed drifts.
    let per_round: Vec<String> = results
        .rows
        .iter()
        .filter_map(|(row, by)| {
            let ratios: Vec<f64> = by
                .get("stead")?
                .iter()
                .zip(by.get("floor")?)
                .filter(|(_, floor)| **floor > 0.0)
                .map(|(stead, floor)| stead / floor)
                .collect();
            (!ratios.is_empty()).then(|| format!("| {row} | {} |", cell(Some(&ratios))))
        })
        .collect();
    if !per_round.is_empty() {
        println!("\n| stead / floor, round by round | median (min-max) |\n|---|---|");
        for line in per_round {
            println!("{line}");
        }
    }
    println!();
    for note in &results.notes {
        println!("- {note}");
    }
    Ok(())
}

/// Three significant figures, without exponent.
fn fmt(value: f64) -> String {
    if value == 0.0 {
        "0".to_owned()
    } else if value.abs() >= 100.0 {
        format!("{value:.0}")
    } else if value.abs() >= 10.0 {
        format!("{value:.1}")
    } else if value.abs() >= 1.0 {
        format!("{value:.2}")
    } else {
        // Three significant digits below 1 too: a 10 ms cold start reads 0.0103 s, not
        // 0.010 s, which would hide a tenth of it.
        let decimals = 2 - value.abs().log10().floor() as i32;
        format!("{value:.*}", usize::try_from(decimals).unwrap_or(3))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_keep_three_significant_digits() {
        assert_eq!(fmt(0.0), "0");
        assert_eq!(fmt(0.010_34), "0.0103");
        assert_eq!(fmt(0.005_12), "0.00512");
        assert_eq!(fmt(0.512), "0.512");
        assert_eq!(fmt(1.234), "1.23");
        assert_eq!(fmt(12.34), "12.3");
        assert_eq!(fmt(123.4), "123");
    }

    fn script(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("writes the script");
        path
    }

    #[test]
    fn a_scripts_interpreter_is_its_shebang_program_or_the_one_env_finds() {
        let dir = std::env::temp_dir().join(format!("stead-bench-shebang-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("makes the dir");
        let direct = script(&dir, "direct", "#!/usr/bin/python3 -u\nprint(1)\n");
        assert_eq!(
            interpreter(&direct),
            Some(PathBuf::from("/usr/bin/python3"))
        );
        let env = script(&dir, "env", "#!/usr/bin/env sh\necho 1\n");
        assert_eq!(interpreter(&env), which("sh"));
        let binary = script(&dir, "binary", "\u{7f}ELF");
        assert_eq!(interpreter(&binary), None);
        std::fs::remove_dir_all(&dir).expect("removes the dir");
    }
}
