//! Drivers: the narrow seam between the agent and whatever runs a task.
//!
//! A [`Driver`] starts, signals, kills, waits for, recovers and destroys tasks, and
//! fingerprints itself. Callers never trust a driver to finish a call or to close a
//! wait: every lifecycle call is raced with the caller's own cancellation or timeout.
//! [`Drivers`] is the registry the agent looks drivers up in, by [`DriverKind`].

pub mod exec;
pub mod mock;

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use stead_reconcilers::exit::ExitResult;
use stead_schemas::spec::{DriverConfig, DriverKind, Name, Signal};
use stead_schemas::{AllocId, Timestamp};

/// A boxed future that can move between threads; what [`Driver`] methods return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a driver needs to start one task.
#[derive(Debug, Clone, PartialEq)]
pub struct StartRequest {
    /// The alloc the task belongs to.
    pub alloc_id: AllocId,
    /// The task's name, unique within the alloc.
    pub task: Name,
    /// The task's driver options; a driver rejects options of another driver.
    pub config: DriverConfig,
    /// The task's full environment (spec env plus what the agent sets).
    pub env: BTreeMap<String, String>,
    /// The user to run as; `None` runs as the agent's user.
    pub user: Option<String>,
    /// How much of the task's output to keep (`logs` with its defaults applied).
    pub logs: LogLimits,
    /// Paths the task's device plugins want it to see: mounts and device nodes.
    pub devices: DeviceAccess,
    /// The CPU, memory and process limits the spec sets.
    pub resources: TaskResources,
}

/// The limits a task's `resources` set, for drivers that enforce them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct TaskResources {
    /// CPU in MHz: the task's weight.
    pub cpu: Option<u32>,
    /// Also cap the task at `cpu` MHz.
    pub cpu_hard_limit: bool,
    /// Memory in MiB: the hard limit, or the reservation under `memory_max_mb`.
    pub memory_mb: Option<u32>,
    /// The hard memory limit in MiB.
    pub memory_max_mb: Option<u32>,
    /// The most processes and threads.
    pub pids: Option<u32>,
    /// Kill the whole task on an out-of-memory kill.
    pub oom_kill_group: bool,
}

impl TaskResources {
    /// The limits of a task spec's `resources` (none when it has none).
    pub fn of(resources: Option<&stead_schemas::spec::ResourcesSpec>) -> Self {
        let Some(r) = resources else {
            return TaskResources::default();
        };
        TaskResources {
            cpu: r.cpu,
            cpu_hard_limit: r.cpu_hard_limit.unwrap_or(false),
            memory_mb: r.memory_mb,
            memory_max_mb: r.memory_max_mb,
            pids: r.pids,
            oom_kill_group: r.oom_kill_group.unwrap_or(false),
        }
    }
}

/// What a task's devices need besides env: paths their plugins' reserve returned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceAccess {
    /// Host paths to mount into the task.
    pub mounts: Vec<stead_reconcilers::device::DeviceMount>,
    /// Device nodes to expose to the task.
    pub device_nodes: Vec<stead_reconcilers::device::DeviceNode>,
}

/// How much output a task keeps, per stream: `max_files` files of `max_file_size_mb`
/// MiB each (the task's `logs.maxFiles` and `logs.maxFileSizeMB`, defaults applied).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LogLimits {
    /// How many files of each stream are kept; the newest is written.
    pub max_files: u32,
    /// The size at which a file is rotated, in MiB.
    pub max_file_size_mb: u32,
}

/// A command to run beside a running task, in its context (its dir, environment and
/// user): an exec health check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecRequest {
    /// The alloc of the task.
    pub alloc_id: AllocId,
    /// The task.
    pub task: Name,
    /// The program: an absolute path, or a name looked up in the task's `PATH`.
    pub command: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// The task's environment as the agent gives it (the driver adds its own paths).
    pub env: BTreeMap<String, String>,
    /// The task's user; `None` runs as the agent's user.
    pub user: Option<String>,
    /// How long the command may run before its whole process group is killed.
    pub timeout: std::time::Duration,
}

/// How a command run with [`Driver::exec`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// Its exit code; `None` when a signal ended it.
    pub exit_code: Option<i32>,
    /// It outlived its timeout and its process group was killed.
    pub timed_out: bool,
    /// Its standard output and error, interleaved, capped at [`EXEC_OUTPUT_LIMIT`].
    pub output: Vec<u8>,
}

/// The most output kept of a command run with [`Driver::exec`] (and of a health check).
pub const EXEC_OUTPUT_LIMIT: usize = 4096;

/// A command to run in a running task's context (its dir, environment, user and cgroup)
/// for a person: `stead alloc exec`. Unlike [`ExecRequest`] it has no timeout and its
/// streams are handed back to the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecSessionRequest {
    /// The alloc of the task.
    pub alloc_id: AllocId,
    /// The task.
    pub task: Name,
    /// The program: an absolute path, or a name looked up in the task's `PATH`.
    pub command: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// The task's environment as the agent gives it (the driver adds its own paths).
    pub env: BTreeMap<String, String>,
    /// The task's user; `None` runs as the agent's user.
    pub user: Option<String>,
    /// Run it on a new pseudo-terminal of this size (its stdin, stdout and stderr, and
    /// its controlling terminal); `None`: on pipes.
    pub tty: Option<WindowSize>,
    /// Give the caller its standard input; otherwise it reads `/dev/null` (with a
    /// terminal: the terminal, which nobody writes to).
    pub stdin: bool,
}

/// A terminal's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowSize {
    /// Columns.
    pub cols: u16,
    /// Rows.
    pub rows: u16,
}

impl Default for WindowSize {
    /// 80 by 24, what a terminal that says nothing is taken to be.
    fn default() -> Self {
        WindowSize { cols: 80, rows: 24 }
    }
}

/// A command started with [`Driver::exec_session`]: its streams, its terminal and the
/// process itself. Dropping [`ExecSession::process`] before it ended kills the command's
/// whole process group.
pub struct ExecSession {
    /// Its standard input (the terminal, with one), when the request asked for it.
    pub stdin: Option<Pin<Box<dyn tokio::io::AsyncWrite + Send>>>,
    /// Its standard output (the terminal, with one).
    pub stdout: Pin<Box<dyn tokio::io::AsyncRead + Send>>,
    /// Its standard error; `None` with a terminal, where it goes to `stdout`.
    pub stderr: Option<Pin<Box<dyn tokio::io::AsyncRead + Send>>>,
    /// Its terminal, to resize.
    pub terminal: Option<exec::Terminal>,
    /// The process.
    pub process: exec::SessionProcess,
}

impl fmt::Debug for ExecSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecSession")
            .field("stdin", &self.stdin.is_some())
            .field("stderr", &self.stderr.is_some())
            .field("terminal", &self.terminal.is_some())
            .finish_non_exhaustive()
    }
}

/// What a task's processes use, as a driver measures it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TaskStats {
    /// CPU use since the previous measurement of this task (or, on the first, since it
    /// started), in percent of one core.
    pub cpu_percent: f64,
    /// CPU time used so far by the task's live processes and the children they reaped
    /// (user plus system), in clock ticks.
    pub cpu_ticks: u64,
    /// Clock ticks per second, to turn `cpu_ticks` into time.
    pub ticks_per_second: u64,
    /// Resident memory of the task's processes, in bytes.
    pub rss_bytes: u64,
    /// How many processes the task has.
    pub processes: u32,
    /// What the task's cgroup counts, when it has one.
    pub cgroup: Option<CgroupUsage>,
}

/// One task's use and limits, as its cgroup counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CgroupUsage {
    /// Memory charged now, in bytes; `None` without the memory controller.
    pub memory_bytes: Option<u64>,
    /// The most memory charged at once, in bytes, where the kernel counts it.
    pub memory_peak_bytes: Option<u64>,
    /// The hard memory limit, in bytes; `None`: none.
    pub memory_limit_bytes: Option<u64>,
    /// CPU time used, in microseconds.
    pub cpu_usec: u64,
    /// Time the CPU quota held the task back, in microseconds, where counted.
    pub throttled_usec: Option<u64>,
    /// Processes and threads now, where counted.
    pub pids: Option<u64>,
    /// The most it may have; `None`: no limit.
    pub pids_limit: Option<u64>,
    /// Processes the OOM killer killed in this run.
    pub oom_kills: u64,
}

/// What a task's cgroup counts that `/metrics` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CgroupCounters {
    /// CPU time used, in microseconds.
    pub cpu_usec: u64,
    /// Memory charged now, in bytes; `None` without the memory controller.
    pub memory_bytes: Option<u64>,
}

/// A started task, as the driver identifies it; persisted so a later agent can recover it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TaskHandle {
    /// The driver that started the task.
    pub driver: DriverKind,
    /// The driver's id of this run of the task; unique per run, never reused.
    pub id: String,
    /// The process id, for drivers that run processes.
    pub pid: Option<u32>,
    /// When the driver started the task.
    pub started_at: Timestamp,
}

/// Whether a driver can run tasks, as its fingerprint says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Health {
    /// The driver works.
    Healthy,
    /// The driver is present but broken.
    Unhealthy,
    /// The driver is not available on this node.
    Undetected,
}

impl Health {
    /// The lowercase name shown to users: `healthy`, `unhealthy` or `undetected`.
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Healthy => "healthy",
            Health::Unhealthy => "unhealthy",
            Health::Undetected => "undetected",
        }
    }
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a driver reports about itself; re-taken periodically so health changes reach the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// Whether the driver can run tasks.
    pub health: Health,
    /// Why it has that health, for operators.
    pub description: String,
    /// Facts about the driver (versions, capabilities), shown by `stead node status`.
    pub attributes: BTreeMap<String, String>,
}

/// A driver call that failed.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// Starting failed; `recoverable` says whether trying again may work.
    #[error("starting task {task} of alloc {alloc_id} failed: {message}")]
    Start {
        /// The alloc of the task.
        alloc_id: AllocId,
        /// The task that did not start.
        task: Name,
        /// What went wrong.
        message: String,
        /// Whether a later attempt may succeed (the restart policy retries only these).
        recoverable: bool,
    },
    /// The handle names no task this driver knows (e.g. after a restart the process is gone).
    #[error("task {id} is unknown to the driver")]
    UnknownTask {
        /// The handle's id.
        id: String,
    },
    /// Sending a signal failed.
    #[error("sending {signal} to task {id} failed: {message}")]
    Signal {
        /// The handle's id.
        id: String,
        /// The signal's name.
        signal: String,
        /// What went wrong.
        message: String,
    },
    /// Killing the task failed.
    #[error("killing task {id} failed: {message}")]
    Kill {
        /// The handle's id.
        id: String,
        /// What went wrong.
        message: String,
    },
    /// A command could not be started in the task's context: `source` says why (not
    /// found, not executable, ...).
    #[error("cannot start {command:?} in task {task} of alloc {alloc_id}")]
    ExecStart {
        /// The alloc of the task.
        alloc_id: AllocId,
        /// The task.
        task: Name,
        /// The command.
        command: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The driver's tasks have no context to run a command in.
    #[error("the {driver} driver cannot run commands in its tasks")]
    ExecUnsupported {
        /// The driver.
        driver: DriverKind,
    },
    /// A command could not be run in the task's context.
    #[error("running {command:?} in task {task} of alloc {alloc_id}: {message}")]
    Exec {
        /// The alloc of the task.
        alloc_id: AllocId,
        /// The task.
        task: Name,
        /// The command.
        command: String,
        /// What went wrong.
        message: String,
    },
}

impl DriverError {
    /// Whether trying the same call again may succeed: only recoverable start errors.
    pub fn is_recoverable(&self) -> bool {
        matches!(
            self,
            DriverError::Start {
                recoverable: true,
                ..
            }
        )
    }
}

/// What the stored records say about the tasks earlier agents started, for
/// [`Driver::unrecorded_runs`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordedRuns {
    /// Every driver handle a readable record names, whatever its driver.
    pub handles: Vec<TaskHandle>,
    /// The names of allocs whose records could not be read: what runs in their alloc
    /// dirs is unknown, so it is left alone.
    pub unreadable: Vec<String>,
}

impl RecordedRuns {
    /// Whether the alloc of id `alloc_id` (`<name>-<revision>`) is one whose record could
    /// not be read: what runs of it is left alone.
    pub fn unreadable_alloc(&self, alloc_id: &str) -> bool {
        let name = alloc_name_of(alloc_id);
        self.unreadable.iter().any(|unreadable| unreadable == name)
    }
}

/// The alloc name of alloc id `<name>-<revision>` (the revision part has no `-`).
pub fn alloc_name_of(alloc_id: &str) -> &str {
    alloc_id.rsplit_once('-').map_or(alloc_id, |(name, _)| name)
}

/// A run of a task that no record names, found by [`Driver::unrecorded_runs`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnrecordedRun {
    /// The id of the alloc revision it belongs to (`<name>-<revision>`).
    pub alloc_id: String,
    /// The task.
    pub task: Name,
    /// The handle that reattaches it.
    pub handle: TaskHandle,
}

/// Runs tasks. One value per driver kind, shared by every alloc's worker.
///
/// Methods borrow `self` only while they run; callers race every call with their own
/// cancellation, so a driver that hangs hurts only the alloc that called it.
pub trait Driver: Send + Sync + 'static {
    /// Which driver this is.
    fn kind(&self) -> DriverKind;

    /// Reports the driver's health and attributes.
    fn fingerprint(&self) -> BoxFuture<'_, Fingerprint>;

    /// Starts the task; may take long (or forever for a broken driver): callers race it
    /// with their own cancellation.
    fn start(&self, request: StartRequest) -> BoxFuture<'_, Result<TaskHandle, DriverError>>;

    /// Resolves when the task exits, with how it ended. Callers never trust it to resolve
    /// after a kill: they also wait on their own cancellation or timeout.
    fn wait(&self, handle: TaskHandle) -> BoxFuture<'static, ExitResult>;

    /// Sends `signal` to the task (its whole process group for real processes).
    fn signal(
        &self,
        handle: &TaskHandle,
        signal: &Signal,
    ) -> BoxFuture<'_, Result<(), DriverError>>;

    /// Kills the task at once (SIGKILL to the whole group).
    fn kill(&self, handle: &TaskHandle) -> BoxFuture<'_, Result<(), DriverError>>;

    /// Reattaches to a task started by an earlier agent; `UnknownTask` when it is gone.
    fn recover(&self, handle: &TaskHandle) -> BoxFuture<'_, Result<(), DriverError>>;

    /// Releases everything held for the task; the task is dead.
    fn destroy(&self, handle: &TaskHandle) -> BoxFuture<'_, ()>;

    /// Called once by the restore, before any alloc's worker runs: the tasks an earlier
    /// agent started that no record names (it died between the start and the write of
    /// the record, or the store lost the record), except in allocs whose records could
    /// not be read. They are left running: the start of their task reattaches them. A
    /// driver whose tasks die with the agent finds none (the default). Blocking: it may
    /// read the data dir.
    fn unrecorded_runs(&self, recorded: &RecordedRuns) -> Vec<UnrecordedRun> {
        let _ = recorded;
        Vec::new()
    }

    /// Runs a command in a running task's context (its dir, environment and user) and
    /// returns how it ended, killing its whole process group at the request's timeout:
    /// an exec health check. A driver whose tasks have no such context refuses (the
    /// default).
    fn exec(&self, request: ExecRequest) -> BoxFuture<'_, Result<ExecOutput, DriverError>> {
        let kind = self.kind();
        Box::pin(async move {
            Err(DriverError::Exec {
                message: format!("the {kind} driver cannot run commands in its tasks"),
                alloc_id: request.alloc_id,
                task: request.task,
                command: request.command,
            })
        })
    }

    /// Starts a command in a running task's context (its dir, environment, user and
    /// cgroup, as [`Driver::exec`] does) and hands its streams to the caller, with no
    /// timeout: `stead alloc exec`. A driver whose tasks have no such context refuses
    /// with [`DriverError::ExecUnsupported`] (the default).
    fn exec_session(
        &self,
        request: ExecSessionRequest,
    ) -> BoxFuture<'_, Result<ExecSession, DriverError>> {
        let _ = request;
        let driver = self.kind();
        Box::pin(async move { Err(DriverError::ExecUnsupported { driver }) })
    }

    /// Why this driver would start a task with `resources` without enforcing them; `None`
    /// when it enforces them, when there are none, or when it refuses such a start
    /// instead (its `start` then fails). A driver that enforces nothing and says so
    /// returns `None` (the default: the mock driver simulates tasks).
    fn unenforced_limits(&self, resources: &TaskResources) -> Option<String> {
        let _ = resources;
        None
    }

    /// Measures what the task's processes use; `None` for a driver that does not measure
    /// its tasks (the default).
    fn stats(&self, handle: &TaskHandle) -> BoxFuture<'_, Result<Option<TaskStats>, DriverError>> {
        let _ = handle;
        Box::pin(async { Ok(None) })
    }

    /// What the task's cgroup counts now, for `/metrics`. Blocking, and cheap on purpose:
    /// two or three small control files read, no scan of processes. `None` for a task
    /// without a cgroup, one that is gone, or a driver without cgroups (the default).
    fn cgroup_counters(&self, handle: &TaskHandle) -> Option<CgroupCounters> {
        let _ = handle;
        None
    }
}

/// The Linux number of `signal` (`SIGINT` is 2, `SIGKILL` 9).
pub fn signal_number(signal: &Signal) -> i32 {
    match signal.as_str() {
        "SIGHUP" => 1,
        "SIGINT" => 2,
        "SIGQUIT" => 3,
        "SIGABRT" => 6,
        "SIGKILL" => 9,
        "SIGUSR1" => 10,
        "SIGUSR2" => 12,
        "SIGALRM" => 14,
        "SIGTERM" => 15,
        "SIGCONT" => 18,
        "SIGSTOP" => 19,
        "SIGWINCH" => 28,
        "SIGPWR" => 30,
        other => unreachable!("Signal holds only names in SIGNAL_NAMES, not {other:?}"),
    }
}

/// The drivers the agent runs, by kind.
#[derive(Clone, Default)]
pub struct Drivers {
    by_kind: BTreeMap<DriverKind, Arc<dyn Driver>>,
}

impl Drivers {
    /// A registry of `drivers`, keyed by their [`Driver::kind`]; of two drivers of one
    /// kind, the later one is kept.
    pub fn new(drivers: impl IntoIterator<Item = Arc<dyn Driver>>) -> Self {
        Drivers {
            by_kind: drivers
                .into_iter()
                .map(|driver| (driver.kind(), driver))
                .collect(),
        }
    }

    /// The driver of `kind`, when it is enabled.
    pub fn get(&self, kind: DriverKind) -> Option<Arc<dyn Driver>> {
        self.by_kind.get(&kind).cloned()
    }

    /// Every driver, in [`DriverKind`] order.
    pub fn iter(&self) -> impl Iterator<Item = (DriverKind, &Arc<dyn Driver>)> + '_ {
        self.by_kind.iter().map(|(kind, driver)| (*kind, driver))
    }
}

impl fmt::Debug for Drivers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.by_kind.keys()).finish()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use stead_schemas::spec::SIGNAL_NAMES;

    use super::*;
    use crate::clock::Clock;

    #[test]
    fn signal_numbers_are_distinct_linux_numbers_for_every_signal_name() {
        let numbers: BTreeSet<i32> = SIGNAL_NAMES
            .iter()
            .map(|name| signal_number(&name.parse().expect("a known signal name")))
            .collect();
        assert_eq!(numbers.len(), SIGNAL_NAMES.len());
        assert_eq!(signal_number(&Signal::sigint()), 2);
        assert_eq!(signal_number(&"SIGTERM".parse().expect("known")), 15);
    }

    #[test]
    fn health_displays_lowercase() {
        let shown: Vec<String> = [Health::Healthy, Health::Unhealthy, Health::Undetected]
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(shown, ["healthy", "unhealthy", "undetected"]);
    }

    #[tokio::test(start_paused = true)]
    async fn drivers_are_found_by_kind() {
        let mock: Arc<dyn Driver> =
            Arc::new(mock::MockDriver::new(Clock::starting_at(Timestamp::EPOCH)));
        let drivers = Drivers::new([mock]);
        assert!(drivers.get(DriverKind::Exec).is_none());
        let found = drivers
            .get(DriverKind::Mock)
            .expect("the mock is registered");
        assert_eq!(found.kind(), DriverKind::Mock);
        assert_eq!(
            drivers.iter().map(|(kind, _)| kind).collect::<Vec<_>>(),
            [DriverKind::Mock]
        );
        assert_eq!(format!("{drivers:?}"), "{Mock}");
    }
}
