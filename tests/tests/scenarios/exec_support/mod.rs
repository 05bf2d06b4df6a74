//! What the exec tests share: a node with the exec driver over a temporary data dir and
//! an in-memory store, real time, and waits on conditions with deadlines.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use stead_controller::clock::Clock;
use stead_controller::devices::DeviceManager;
use stead_controller::driver::exec::{ExecDriver, ExecDriverConfig};
use stead_controller::driver::{Driver, Drivers};
use stead_controller::node::{Node, NodeConfig, RestoreReport};
use stead_controller::queue::Shutdown;
use stead_controller::store::MemoryStore;
use stead_schemas::ValidSpec;
use stead_schemas::status::{AllocStatus, TaskEventStatus};
use tempfile::TempDir;

/// Long enough for anything these tests wait for on a loaded two-core machine.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// The supervisor binary cargo built for these tests.
pub fn supervisor() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_stead-test-supervisor"))
}

/// The memory hog cargo built for these tests.
pub fn hog() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_stead-test-hog"))
}

#[allow(unused_imports)]
pub use stead_tests::running_as_root;

/// An exec driver over `data_dir` with the tests' supervisor.
pub fn exec_driver(data_dir: &Path, allow_root: bool) -> ExecDriver {
    let config = ExecDriverConfig {
        allow_root,
        supervisor: supervisor(),
        cgroup_parent: stead_tests::cgroup_parent(data_dir),
        ..ExecDriverConfig::new(data_dir)
    };
    ExecDriver::new(config, Clock::system())
}

/// A node running the exec driver on a temporary data dir.
pub struct ExecNode {
    pub data: Arc<DataDir>,
    pub store: MemoryStore,
    pub driver: ExecDriver,
    pub node: Node,
}

impl ExecNode {
    /// A fresh node (tasks may run as root: the tests run as root in CI).
    pub fn new() -> Self {
        Self::over(
            Arc::new(DataDir::new()),
            MemoryStore::default(),
            Arc::default(),
        )
    }

    /// A fresh node with `devices`.
    pub fn with_devices(devices: Arc<DeviceManager>) -> Self {
        Self::over(Arc::new(DataDir::new()), MemoryStore::default(), devices)
    }

    fn over(data: Arc<DataDir>, store: MemoryStore, devices: Arc<DeviceManager>) -> Self {
        let driver = exec_driver(data.path(), true);
        let drivers = Drivers::new([Arc::new(driver.clone()) as Arc<dyn Driver>]);
        let config = NodeConfig {
            tick: Duration::from_millis(200),
            devices,
            ..NodeConfig::default()
        };
        let node = Node::new(config, drivers, Arc::new(store.clone()), Clock::system());
        ExecNode {
            data,
            store,
            driver,
            node,
        }
    }

    /// The agent leaves; tasks keep running. Returns what a later agent needs.
    pub async fn detach(self) -> Detached {
        self.node.shutdown(Shutdown::Detach).await;
        Detached {
            data: self.data,
            store: self.store,
        }
    }

    /// Every alloc is stopped, as `--drain` does.
    pub async fn drain(self) {
        self.node.shutdown(Shutdown::Drain).await;
    }

    pub fn status(&self, name: &str) -> Arc<AllocStatus> {
        self.node.status(name).expect("the alloc is published")
    }

    pub fn task_state(&self, name: &str, task: &str) -> Option<String> {
        self.node
            .status(name)
            .and_then(|s| s.tasks.get(task).map(|t| t.state.clone()))
    }

    pub fn pid(&self, name: &str, task: &str) -> Option<u32> {
        self.node
            .status(name)
            .and_then(|s| s.tasks.get(task).and_then(|t| t.pid))
    }

    pub fn events(&self, name: &str, task: &str) -> Vec<TaskEventStatus> {
        self.status(name).tasks[task].events.clone()
    }

    pub fn event_types(&self, name: &str, task: &str) -> Vec<String> {
        self.events(name, task)
            .into_iter()
            .map(|e| e.event_type)
            .collect()
    }

    pub fn count(&self, name: &str, task: &str, event_type: &str) -> usize {
        self.node.status(name).map_or(0, |s| {
            s.tasks.get(task).map_or(0, |t| {
                t.events
                    .iter()
                    .filter(|e| e.event_type == event_type)
                    .count()
            })
        })
    }

    /// Waits until `condition` holds, re-checking on every published status.
    pub async fn until(&self, what: &str, condition: impl Fn(&ExecNode) -> bool) {
        let held = self.node.wait_until(DEADLINE, |_| condition(self)).await;
        assert!(
            held,
            "timed out waiting until {what}: {:#?}",
            self.node.statuses()
        );
    }

    /// The alloc's id, as the alloc dir is named.
    pub fn alloc_id(&self, name: &str) -> String {
        self.status(name).id.clone()
    }

    /// `<data>/allocs/<id>`.
    pub fn alloc_dir(&self, name: &str) -> PathBuf {
        self.data.path().join("allocs").join(self.alloc_id(name))
    }

    /// The text of `task`'s stdout log file `index`.
    pub fn stdout(&self, name: &str, task: &str, index: u64) -> String {
        let path = self
            .alloc_dir(name)
            .join("alloc/logs")
            .join(format!("{task}.stdout.{index}"));
        std::fs::read_to_string(path).unwrap_or_default()
    }
}

/// What is left of a node that detached.
pub struct Detached {
    pub data: Arc<DataDir>,
    pub store: MemoryStore,
}

impl Detached {
    /// A new agent (node and driver) over the same store and data dir, restored.
    pub fn start_agent(self) -> ExecNode {
        let (next, report) = self.restore();
        assert!(report.corrupt.is_empty(), "{:?}", report.corrupt);
        next
    }

    /// A new agent over the same store and data dir, restored whatever its records hold.
    pub fn restore(self) -> (ExecNode, RestoreReport) {
        let next = ExecNode::over(self.data, self.store, Arc::default());
        let report = next.node.restore().expect("the store restores");
        (next, report)
    }
}

/// Polls `condition` (for state outside the node: files, processes) until it holds.
pub async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A valid spec from YAML (panics with the diagnostics otherwise).
pub fn spec(yaml: &str) -> ValidSpec {
    let file = stead_schemas::parse_spec_file(Path::new("test.yaml"), yaml);
    assert!(file.is_valid(), "{:#?}", file.all_diagnostics());
    file.specs().next().expect("one spec").clone()
}

/// An alloc named `name` whose `spec:` body is `body` (indented by two).
pub fn alloc(name: &str, body: &str) -> ValidSpec {
    spec(&format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n{body}"
    ))
}

/// An alloc of one exec task `t` running `sh -c script`, with `extra` spec lines.
pub fn shell_alloc(name: &str, script: &str, extra: &str) -> ValidSpec {
    let script = serde_json::to_string(script).expect("a string");
    alloc(
        name,
        &format!(
            "{extra}  tasks:\n    - name: t\n      driver: exec\n      config: {{command: /bin/sh, args: [\"-c\", {script}]}}\n"
        ),
    )
}

/// The start time of process `pid` (clock ticks since boot), if it exists.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Field `n` (1-based, as in proc(5)) of `/proc/<pid>/stat`.
pub fn stat_field(pid: u32, n: usize) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(n - 3).map(str::to_owned)
}

/// A field of `/proc/<pid>/status`, such as `Threads` or `SigBlk`, trimmed.
pub fn status_field(pid: u32, key: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        (name == key).then(|| value.trim().to_owned())
    })
}

/// The pid a task wrote to `path`, once it has.
pub fn read_pid(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether `pid` is a live process (not a zombie).
pub fn alive(pid: u32) -> bool {
    stat_field(pid, 3).is_some_and(|state| state != "Z")
}

/// Every live process whose environment has `STEAD_ALLOC_ID=<alloc_id>`.
pub fn processes_of_alloc(alloc_id: &str) -> Vec<u32> {
    let needle = format!("STEAD_ALLOC_ID={alloc_id}");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| alive(*pid))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
                env.split(|b| *b == 0)
                    .any(|entry| entry == needle.as_bytes())
            })
        })
        .collect()
}

/// Every live process working below `dir` or with `dir` in its environment: the
/// supervisors and tasks of a data dir (or of one alloc dir).
pub fn processes_under(dir: &Path) -> Vec<u32> {
    let needle = dir.to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != std::process::id() && alive(*pid))
        .filter(|pid| {
            let cwd = std::fs::read_link(format!("/proc/{pid}/cwd"));
            cwd.is_ok_and(|cwd| cwd.starts_with(dir))
                || std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|env| String::from_utf8_lossy(&env).contains(&needle))
        })
        .collect()
}

/// A temporary data dir that, when dropped, SIGKILLs every process still working in it,
/// so a failing test leaves no task running.
pub struct DataDir {
    dir: TempDir,
}

impl DataDir {
    pub fn new() -> Self {
        DataDir {
            dir: tempfile::tempdir().expect("a temporary data dir"),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        stead_tests::remove_test_cgroups(&stead_tests::cgroup_parent(self.dir.path()));
        for _ in 0..3 {
            let left = processes_under(self.dir.path());
            if left.is_empty() {
                return;
            }
            let mut kill = std::process::Command::new("kill");
            kill.arg("-9").args(left.iter().map(u32::to_string));
            let _ = kill.status();
        }
    }
}
