//! The `exec` driver: real processes, each the child of its own supervisor.
//!
//! Starting a task builds its alloc dir ([`crate::allocdir`]), then asks the
//! supervisors' fork server (`stead-supervisor --zygote`, started on first use or by
//! [`ExecDriver::prepare`]) for a supervisor, handing it the task's command line and
//! environment and the write end of a pipe, and reads the supervisor's `started` (or
//! `failed`) line from that pipe. The supervisor starts the task in its own session and
//! process group, in the task dir, copies its output into rotating log files, and
//! outlives the agent; see
//! `stead-supervisor` for its side.
//!
//! Everything a later agent needs to find a run again is in the handle id (module `run`): the
//! supervisor's pid and start time, the run id, and the task's pid and start time.
//! Reattach checks the start times (and that the supervisor still works in the task
//! dir), so a reused pid is never taken for the task; a run whose supervisor has exited
//! is answered from the exit record it left in the task dir.
//!
//! Waiting: for a run this agent started, the supervisor's `exited` line on the pipe
//! (sent before the record is written, so a restart does not wait for the disk); for a
//! reattached one, its pidfd, then the record.
//!
//! Killing: SIGKILL to the task's process group and to every process below the
//! supervisor, a subreaper, so daemonised grandchildren that left the group and the
//! session are found too; after its task exits the supervisor kills whatever is left
//! before it reports the exit. A supervisor that died without a record (it was killed)
//! leaves its task killed by `PR_SET_PDEATHSIG`; destroy then also kills the task's
//! session.

mod cgroup;
mod command;
mod fingerprint;
mod process;
mod pty;
mod run;
mod user;
mod zygote;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use rustix::process::Signal as RawSignal;
use stead_reconcilers::exit::ExitResult;
use stead_schemas::AllocId;
use stead_schemas::spec::{DriverConfig, DriverKind, Name, Signal};
use stead_supervisor::args::SupervisorArgs;
use stead_supervisor::protocol::{self, ExitStatus, ProtocolError, Report, RunRecord};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::unix::pipe;
use tokio::sync::watch;

pub use self::command::SessionProcess;
pub use self::pty::Terminal;

use self::cgroup::{Cgroups, Limits, TaskCgroup, Unavailable};
use self::process::ProcessId;
use self::run::RunId;
use self::user::Account;
use super::{
    BoxFuture, CgroupCounters, Driver, DriverError, ExecOutput, ExecRequest, ExecSession,
    ExecSessionRequest, Fingerprint, Health, RecordedRuns, StartRequest, TaskHandle, TaskResources,
    TaskStats, UnrecordedRun, signal_number,
};
use crate::allocdir::{AllocDir, AllocDirError, AllocDirs, TaskDir};
use crate::clock::Clock;

/// The `PATH` of a task whose spec sets none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// How long a supervisor may take to report whether its task started.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a reattached supervisor is checked when pidfds are not available.
const PID_POLL: Duration = Duration::from_millis(100);

/// How the exec driver runs tasks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecDriverConfig {
    /// The agent's data dir; alloc dirs go below `<data-dir>/allocs`.
    pub data_dir: PathBuf,
    /// Whether tasks may run as root (the agent config's `allowRoot`).
    pub allow_root: bool,
    /// The `stead-supervisor` binary.
    pub supervisor: PathBuf,
    /// The soft limit of open files (`RLIMIT_NOFILE`) supervisors and tasks start with:
    /// the agent's own before it raised it for itself, so a task gets what any process
    /// started on the host gets. `None` leaves them the agent's.
    pub task_open_files: Option<u64>,
    /// The `oom_score_adj` supervisors, tasks and exec checks start with: the agent's own
    /// before it lowered it for itself, so the kernel's OOM killer picks a task before the
    /// agent. `None` leaves them the agent's.
    pub task_oom_score_adj: Option<i16>,
    /// Whether a task whose limits cannot be enforced fails to start (the agent config's
    /// `limits: required`) rather than starting with a `Limits Not Enforced` event.
    pub limits_required: bool,
    /// The cgroup below the agent's own that holds its tasks' cgroups (`cgroupParent`).
    pub cgroup_parent: String,
    /// Open files the agent keeps for everything but its supervised runs (the API's
    /// connections, followed logs and exec sessions, the store): a start that would leave
    /// fewer of its limit is refused with a recoverable error, while reattaching is never
    /// refused. `None` checks nothing.
    pub reserved_open_files: Option<u64>,
}

impl ExecDriverConfig {
    /// Tasks below `data_dir`, never as root, supervised by [`default_supervisor_path`].
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        ExecDriverConfig {
            data_dir: data_dir.into(),
            allow_root: false,
            supervisor: default_supervisor_path(),
            task_open_files: None,
            task_oom_score_adj: None,
            limits_required: false,
            cgroup_parent: stead_schemas::config::DEFAULT_CGROUP_PARENT.to_owned(),
            reserved_open_files: None,
        }
    }
}

/// Where `stead-supervisor` is looked for by default: `$STEAD_SUPERVISOR` when set (for
/// packages that install it elsewhere, such as `/usr/libexec/stead`), else next to the
/// running executable, else one directory up (where cargo puts binaries when tests run
/// from `deps/`).
pub fn default_supervisor_path() -> PathBuf {
    const NAME: &str = "stead-supervisor";
    if let Some(path) = std::env::var_os("STEAD_SUPERVISOR").filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    let Ok(exe) = std::env::current_exe() else {
        return PathBuf::from(NAME);
    };
    let beside = exe.with_file_name(NAME);
    if beside.is_file() {
        return beside;
    }
    exe.parent()
        .and_then(Path::parent)
        .map(|dir| dir.join(NAME))
        .filter(|path| path.is_file())
        .unwrap_or(beside)
}

/// Why the exec driver could not start a task.
#[derive(Debug, thiserror::Error)]
enum ExecError {
    #[error("the exec driver was given options of another driver")]
    WrongDriver,
    #[error("the {what} holds a NUL byte")]
    NulByte { what: String },
    #[error("looking up user {user:?}")]
    Passwd {
        user: String,
        #[source]
        source: user::AccountFileError,
    },
    #[error("user {user:?} does not exist")]
    UnknownUser { user: String },
    #[error(
        "user {user:?} would run with id {id}, which no process can have (it means \"unchanged\" to the kernel)"
    )]
    ImpossibleId { user: String, id: u32 },
    #[error(
        "the {what} is {size} bytes; the kernel takes at most {limit} bytes for one argument or environment variable (MAX_ARG_STRLEN)"
    )]
    ArgumentTooLong {
        what: String,
        size: usize,
        limit: usize,
    },
    #[error(
        "the command, its arguments and environment take {size} bytes; the kernel takes at most {limit} (ARG_MAX: a quarter of the stack limit, at most 6 MiB)"
    )]
    ArgumentsTooLong { size: usize, limit: usize },
    #[error(
        "the start request is {size} bytes, more than the fork server's socket takes; shorten the task's environment or arguments"
    )]
    RequestTooLarge {
        size: usize,
        #[source]
        source: io::Error,
    },
    #[error(
        "the task would run as root, which the agent does not allow (set allowRoot in the agent config)"
    )]
    RootRefused,
    #[error("running as uid {uid} needs an agent running as root; the agent runs as uid {agent}")]
    NeedsRoot { uid: u32, agent: u32 },
    #[error("setting up the task dir")]
    TaskDir(#[source] AllocDirError),
    #[error("asking the fork server ({path} --zygote) for a supervisor")]
    Spawn {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("reading the supervisor's report")]
    Handshake {
        #[source]
        source: io::Error,
    },
    #[error("the supervisor did not report within {HANDSHAKE_TIMEOUT:?}")]
    HandshakeTimeout,
    #[error("the supervisor exited without starting the task")]
    SupervisorVanished,
    #[error("the supervisor broke the protocol")]
    Protocol {
        #[source]
        source: ProtocolError,
    },
    #[error("{message}")]
    TaskFailed { message: String, recoverable: bool },
    #[error(
        "a device plugin wants {} at {} in the task; the exec driver runs tasks in the host's mount namespace, so only a path at its own place can be given",
        host.display(),
        task.display()
    )]
    DevicePathMoved { host: PathBuf, task: PathBuf },
    #[error("a device plugin's {} does not exist", path.display())]
    DevicePathMissing { path: PathBuf },
    #[error(
        "the agent supervises {live} running tasks, one open file each, and keeps {reserved} of its {limit} open files for its API, logs and store: raise its limit of open files (LimitNOFILE) to start more"
    )]
    OpenFilesExhausted {
        live: u64,
        reserved: u64,
        limit: u64,
    },
    #[error("the task's resource limits cannot be enforced (limits: required): {reason}")]
    LimitsUnenforced { reason: String },
    #[error("making the task's cgroup {cgroup}")]
    Cgroup {
        cgroup: String,
        #[source]
        source: io::Error,
    },
}

impl ExecError {
    /// Whether the restart policy should try again: not for what a retry cannot change.
    fn recoverable(&self) -> bool {
        match self {
            ExecError::WrongDriver
            | ExecError::NulByte { .. }
            | ExecError::UnknownUser { .. }
            | ExecError::ImpossibleId { .. }
            | ExecError::ArgumentTooLong { .. }
            | ExecError::ArgumentsTooLong { .. }
            | ExecError::RequestTooLarge { .. }
            | ExecError::RootRefused
            | ExecError::NeedsRoot { .. }
            | ExecError::DevicePathMoved { .. }
            | ExecError::LimitsUnenforced { .. } => false,
            ExecError::TaskFailed { recoverable, .. } => *recoverable,
            _ => true,
        }
    }
}

/// What `execve` takes: the longest one argument or environment entry may be
/// (`MAX_ARG_STRLEN`, 32 pages), and the most all of them, with the program's path and a
/// pointer each, may take (`ARG_MAX`: a quarter of the stack's soft limit, which
/// supervisors and tasks inherit from the agent, between 32 pages and 6 MiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ExecSizeLimits {
    per_string: usize,
    total: usize,
}

fn exec_size_limits() -> ExecSizeLimits {
    use rustix::process::{Resource, getrlimit};
    let page = rustix::param::page_size();
    let floor = 32 * page;
    let stack_quarter = getrlimit(Resource::Stack)
        .current
        .map_or(usize::MAX, |stack| {
            usize::try_from(stack / 4).unwrap_or(usize::MAX)
        });
    ExecSizeLimits {
        per_string: 32 * page,
        total: stack_quarter.min(6 << 20).max(floor),
    }
}

/// Refuses, up front and for good, a command, arguments and environment (`env` entries
/// become `NAME=value`) that `execve` would refuse with `E2BIG`, naming what is too long.
fn check_exec_size(
    command: &str,
    args: &[String],
    env: &BTreeMap<String, String>,
    limits: ExecSizeLimits,
) -> Result<(), ExecError> {
    let too_long = |what: String, size: usize| ExecError::ArgumentTooLong {
        what,
        size,
        limit: limits.per_string,
    };
    // Each with its NUL.
    let mut total = command.len() + 1;
    for (index, arg) in std::iter::once(command)
        .chain(args.iter().map(String::as_str))
        .enumerate()
    {
        let size = arg.len() + 1;
        if size > limits.per_string {
            let what = match index {
                0 => "command".to_owned(),
                n => format!("argument {n}"),
            };
            return Err(too_long(what, size));
        }
        total += size + std::mem::size_of::<usize>();
    }
    for (name, value) in env {
        let size = name.len() + 1 + value.len() + 1;
        if size > limits.per_string {
            return Err(too_long(format!("environment variable {name:?}"), size));
        }
        total += size + std::mem::size_of::<usize>();
    }
    if total > limits.total {
        return Err(ExecError::ArgumentsTooLong {
            size: total,
            limit: limits.total,
        });
    }
    Ok(())
}

/// The task runs in the host's mount namespace: a device path is given as it is, where
/// it is, and must exist (a plugin's device node that is gone is worth a retry).
fn check_device_access(access: &crate::driver::DeviceAccess) -> Result<(), ExecError> {
    let paths = access
        .mounts
        .iter()
        .map(|m| (&m.host_path, &m.task_path))
        .chain(
            access
                .device_nodes
                .iter()
                .map(|n| (&n.host_path, &n.task_path)),
        );
    for (host, task) in paths {
        if host != task {
            return Err(ExecError::DevicePathMoved {
                host: host.clone(),
                task: task.clone(),
            });
        }
        if !host.exists() {
            return Err(ExecError::DevicePathMissing { path: host.clone() });
        }
    }
    Ok(())
}

/// A start in flight, counted against the agent's open files until it ends.
struct StartingGuard(Arc<std::sync::atomic::AtomicU64>);

impl Drop for StartingGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// A run that has not ended, counted (in `Inner::live`) until its end is published or
/// it is dropped: the count a start's open-files check reads instead of scanning every
/// run.
struct LiveRun(Arc<std::sync::atomic::AtomicU64>);

impl LiveRun {
    fn new(live: &Arc<std::sync::atomic::AtomicU64>) -> Self {
        live.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        LiveRun(Arc::clone(live))
    }
}

impl Drop for LiveRun {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// What the driver knows of one run.
struct RunState {
    id: RunId,
    /// `None` until the run ended; every `wait` subscribes.
    exit: watch::Sender<Option<ExitResult>>,
    /// The last CPU measurement: ticks, and when.
    cpu: Mutex<Option<(u64, tokio::time::Instant)>>,
    /// The supervisor reported the exit: it had killed what the task left by then.
    reported: AtomicBool,
    /// The run's cgroup, when it has one.
    cgroup: Option<TaskCgroup>,
    /// The run is over and its cgroup being removed: no exec check joins it.
    releasing: AtomicBool,
    /// Counts the run as live until its end is published.
    live: Mutex<Option<LiveRun>>,
}

impl RunState {
    fn new(
        id: RunId,
        cgroup: Option<TaskCgroup>,
        live: &Arc<std::sync::atomic::AtomicU64>,
    ) -> Arc<Self> {
        Arc::new(RunState {
            id,
            exit: watch::Sender::new(None),
            cpu: Mutex::new(None),
            reported: AtomicBool::new(false),
            cgroup,
            releasing: AtomicBool::new(false),
            live: Mutex::new(Some(LiveRun::new(live))),
        })
    }
}

/// The exec driver; clones share their runs.
#[derive(Clone)]
pub struct ExecDriver {
    inner: Arc<Inner>,
}

struct Inner {
    config: ExecDriverConfig,
    dirs: AllocDirs,
    clock: Clock,
    /// Runs started or reattached and not yet destroyed, by handle id.
    runs: Mutex<HashMap<String, Arc<RunState>>>,
    /// Starts between their open-files check and their end (each holds, or is about to
    /// hold, its supervisor's pipe before its run is in `runs`).
    starting: Arc<std::sync::atomic::AtomicU64>,
    /// Runs that have not ended (each a [`LiveRun`]).
    live: Arc<std::sync::atomic::AtomicU64>,
    /// The test hook's health, over the checks.
    health: Mutex<Option<Health>>,
    /// The agent's own user.
    agent: Account,
    /// The supervisors' fork server.
    zygote: zygote::Zygote,
    /// Where tasks' cgroups go, or why they cannot.
    cgroups: Result<Cgroups, Unavailable>,
    /// The MHz of one core, for CPU quotas.
    mhz_per_core: u32,
    /// Cancelled when the driver goes: its runs' watchers end with it, closing their
    /// pipes and pidfds, as they would with the agent's process. A driver made again in
    /// the same process (a restart in a benchmark or a test) then does not hold two
    /// descriptors per task.
    gone: tokio_util::sync::CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.gone.cancel();
    }
}

/// Runs `watch` until it ends or the driver is gone.
fn spawn_watcher(
    gone: &tokio_util::sync::CancellationToken,
    watch: impl Future<Output = ()> + Send + 'static,
) {
    let gone = gone.clone();
    tokio::spawn(async move {
        tokio::select! {
            () = gone.cancelled() => {}
            () = watch => {}
        }
    });
}

impl fmt::Debug for ExecDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecDriver")
            .field("config", &self.inner.config)
            .field("runs", &self.inner.runs().len())
            .finish_non_exhaustive()
    }
}

impl ExecDriver {
    /// An exec driver with no runs yet, reading time from `clock`. A relative data dir
    /// is taken from the current directory now.
    pub fn new(mut config: ExecDriverConfig, clock: Clock) -> Self {
        if let Ok(absolute) = std::path::absolute(&config.data_dir) {
            config.data_dir = absolute;
        }
        let dirs = AllocDirs::new(&config.data_dir);
        let cgroups = Cgroups::set_up(&config.cgroup_parent);
        match &cgroups {
            Ok(cgroups) => {
                tracing::debug!(version = cgroups.version(), root = %cgroups.root().display(), "task cgroups set up");
            }
            Err(error) => {
                tracing::warn!(%error, "resource limits cannot be enforced: no cgroup for tasks");
            }
        }
        ExecDriver {
            inner: Arc::new(Inner {
                config,
                dirs,
                clock,
                runs: Mutex::new(HashMap::new()),
                starting: Arc::default(),
                live: Arc::default(),
                health: Mutex::new(None),
                agent: Account {
                    uid: rustix::process::geteuid().as_raw(),
                    gid: rustix::process::getegid().as_raw(),
                    // Never set: a task that runs as the agent keeps the agent's groups.
                    groups: Vec::new(),
                },
                zygote: zygote::Zygote::default(),
                cgroups,
                mhz_per_core: crate::host::HostResources::get().mhz_per_core,
                gone: tokio_util::sync::CancellationToken::new(),
            }),
        }
    }

    /// The alloc dirs this driver builds.
    pub fn alloc_dirs(&self) -> &AllocDirs {
        &self.inner.dirs
    }

    /// Starts the supervisors' fork server now rather than at the first task start, so
    /// that its start overlaps the agent's own, and grows the agent's descriptor table
    /// ([`DESCRIPTOR_SLOTS`]); a server that fails to start is logged and tried again by
    /// that first start. Blocks until the server's exec (and a task start meanwhile, on
    /// the server's lock); needs the runtime's context.
    pub fn prepare(&self) {
        grow_descriptor_table(DESCRIPTOR_SLOTS);
        if let Err(error) = self.inner.zygote.prepare(&self.inner.config) {
            tracing::warn!(error = %error, supervisor = %self.inner.config.supervisor.display(), "cannot start the fork server yet");
        }
    }

    /// The pid of the supervisors' fork server, once it runs; for measuring
    /// what supervision costs.
    pub fn fork_server_pid(&self) -> Option<u32> {
        self.inner.zygote.pid()
    }

    /// Test hook: makes `fingerprint` report `health` whatever its checks find; `None`
    /// returns to the checks.
    pub fn set_health(&self, health: Option<Health>) {
        *self
            .inner
            .health
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = health;
    }

    /// What the task's processes use now. `cpu_percent` covers the time since the
    /// previous call for this run (since the task started, on the first call).
    pub fn stats(&self, handle: &TaskHandle) -> Result<TaskStats, DriverError> {
        self.inner.stats(handle)
    }
}

impl Inner {
    fn runs(&self) -> MutexGuard<'_, HashMap<String, Arc<RunState>>> {
        // Every update is one insert or remove: a panic cannot leave it half-done.
        self.runs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The cgroup of a run, when this node has task cgroups.
    fn cgroup_of(&self, id: &RunId) -> Option<TaskCgroup> {
        let cgroups = self.cgroups.as_ref().ok()?;
        Some(cgroups.task(&id.alloc_id, id.task.as_str(), &id.run))
    }

    /// Why `limits` cannot (all) be enforced here; `None` when they can.
    fn unenforced(&self, limits: &Limits) -> Option<String> {
        if limits.is_empty() {
            return None;
        }
        match &self.cgroups {
            Err(error) => Some(error.to_string()),
            Ok(cgroups) => cgroups.unsupported(limits),
        }
    }

    fn unknown(handle: &TaskHandle) -> DriverError {
        DriverError::UnknownTask {
            id: handle.id.clone(),
        }
    }

    /// The account the task switches to (`None`: it keeps the agent's), after the root
    /// policy.
    fn account_for(&self, user: Option<&str>) -> Result<Option<Account>, ExecError> {
        let account = match user {
            None => None,
            Some(user) => Some(
                user::lookup(Path::new("/etc/passwd"), Path::new("/etc/group"), user)
                    .map_err(|source| ExecError::Passwd {
                        user: user.to_owned(),
                        source,
                    })?
                    .ok_or_else(|| ExecError::UnknownUser {
                        user: user.to_owned(),
                    })?,
            ),
        };
        // -1 asks `setuid`/`setgid` to change nothing: the task would keep the agent's.
        if let Some(account) = &account
            && let Some(id) = [account.uid, account.gid]
                .into_iter()
                .chain(account.groups.iter().copied())
                .find(|id| *id == u32::MAX)
        {
            return Err(ExecError::ImpossibleId {
                user: user.unwrap_or_default().to_owned(),
                id,
            });
        }
        let effective = account.as_ref().unwrap_or(&self.agent);
        if effective.uid == 0 && !self.config.allow_root {
            return Err(ExecError::RootRefused);
        }
        if effective.uid != self.agent.uid && self.agent.uid != 0 {
            return Err(ExecError::NeedsRoot {
                uid: effective.uid,
                agent: self.agent.uid,
            });
        }
        Ok(account)
    }

    /// The task's environment: the agent's (`env`), plus the alloc dir's paths and a
    /// `PATH`.
    fn environment(
        mut env: BTreeMap<String, String>,
        alloc_id: &AllocId,
        alloc_dir: &AllocDir,
        task_dir: &TaskDir,
    ) -> BTreeMap<String, String> {
        let path = |p: &Path| p.display().to_string();
        env.entry("STEAD_ALLOC_ID".to_owned())
            .or_insert_with(|| alloc_id.to_string());
        env.insert("STEAD_ALLOC_DIR".to_owned(), path(&alloc_dir.shared()));
        env.insert("STEAD_TASK_DIR".to_owned(), path(&task_dir.dir));
        env.insert("STEAD_SECRETS_DIR".to_owned(), path(&task_dir.secrets));
        env.entry("PATH".to_owned())
            .or_insert_with(|| DEFAULT_PATH.to_owned());
        env
    }

    /// Kills runs of this task whose supervisors an earlier agent started but never
    /// recorded (it died first), and removes the records of runs no one watches.
    fn clean_stale_runs(&self, task_dir: &TaskDir) {
        let unwatched = |run: &str| !self.watches(run);
        for (run, record) in protocol::read_run_records(&task_dir.control, unwatched) {
            Self::stop_unwatched(task_dir, &run, &record);
        }
    }

    /// Whether this agent started or reattached to `run`.
    fn watches(&self, run: &str) -> bool {
        self.runs().values().any(|state| state.id.run == run)
    }

    /// Stops a run that no one watches, if its supervisor still works in `task_dir`
    /// (the supervisor then records the exit and leaves); otherwise removes its records.
    /// Returns whether anything was running.
    fn stop_unwatched(task_dir: &TaskDir, run: &str, record: &RunRecord) -> bool {
        let supervisor = ProcessId {
            pid: record.supervisor_pid,
            start: record.supervisor_start,
        };
        if supervisor.exists_in(&task_dir.dir) {
            let task = ProcessId {
                pid: record.task_pid,
                start: record.task_start,
            };
            if task.exists() {
                let _ = process::signal_group(task.pid, RawSignal::KILL);
            }
            process::kill_all(process::descendants(supervisor.pid));
            return true;
        }
        Self::remove_run_records(task_dir, run);
        false
    }

    /// Removes the records of `run`, which no supervisor works on any more.
    fn remove_run_records(task_dir: &TaskDir, run: &str) {
        let _ = std::fs::remove_file(protocol::run_record_path(&task_dir.control, run));
        let _ = std::fs::remove_file(protocol::exit_record_path(&task_dir.control, run));
        let _ = std::fs::remove_file(oom_marker_path(&task_dir.control, run));
    }

    /// The runs in the alloc dirs that no record names and whose supervisor still works,
    /// as handles a start of their task reattaches (see [`Driver::unrecorded_runs`]);
    /// the records of runs no one works on any more are removed, and so are the cgroups
    /// of runs no record names that are gone. Allocs whose records could not be read are
    /// left alone.
    fn unrecorded_runs(&self, recorded: &RecordedRuns) -> Vec<UnrecordedRun> {
        let mut known: HashSet<String> = recorded
            .handles
            .iter()
            .filter(|handle| handle.driver == DriverKind::Exec)
            .filter_map(|handle| RunId::parse(&handle.id).map(|id| id.run))
            .collect();
        let live = self.find_unrecorded_runs(&known, recorded);
        known.extend(
            live.iter()
                .filter_map(|run| RunId::parse(&run.handle.id).map(|id| id.run)),
        );
        self.remove_unrecorded_cgroups(&known, recorded);
        live
    }

    /// The runs in the alloc dirs that `known` does not name and whose supervisor still
    /// works; the records of such runs whose supervisor is gone are removed.
    fn find_unrecorded_runs(
        &self,
        known: &HashSet<String>,
        recorded: &RecordedRuns,
    ) -> Vec<UnrecordedRun> {
        let mut alloc_ids = match self.dirs.ids() {
            Ok(alloc_ids) => alloc_ids,
            Err(error) => {
                tracing::warn!(dir = %self.dirs.root().display(), %error, "cannot search the alloc dirs for tasks no record names");
                return Vec::new();
            }
        };
        alloc_ids.retain(|alloc_id| !recorded.unreadable_alloc(alloc_id));
        // Over the host's cores, as the records are: a restart at thousands of allocs
        // waits on this walk.
        crate::host::map_on_every_core(alloc_ids, |alloc_id| {
            self.unrecorded_runs_in(&alloc_id, known)
        })
        .into_iter()
        .flatten()
        .collect()
    }

    /// The runs in alloc dir `alloc_id` that `known` does not name and whose supervisor
    /// still works; the records of such runs whose supervisor is gone are removed.
    fn unrecorded_runs_in(&self, alloc_id: &str, known: &HashSet<String>) -> Vec<UnrecordedRun> {
        let mut live = Vec::new();
        let Ok(alloc) = self.dirs.alloc_by_id(alloc_id) else {
            return live;
        };
        let tasks = match std::fs::read_dir(alloc.path()) {
            Ok(tasks) => tasks,
            Err(error) => {
                tracing::warn!(dir = %alloc.path().display(), %error, "cannot search an alloc dir for tasks no record names");
                return live;
            }
        };
        for task in tasks.filter_map(Result::ok) {
            let Some(Ok(name)) = task.file_name().to_str().map(str::parse::<Name>) else {
                continue;
            };
            let Ok(task_dir) = alloc.task(&name) else {
                continue; // the shared dir
            };
            let unknown = |run: &str| !known.contains(run) && !self.watches(run);
            for (run, record) in protocol::read_run_records(&task_dir.control, unknown) {
                let supervisor = ProcessId {
                    pid: record.supervisor_pid,
                    start: record.supervisor_start,
                };
                if !supervisor.exists_in(&task_dir.dir) {
                    Self::remove_run_records(&task_dir, &run);
                    continue;
                }
                let process = ProcessId {
                    pid: record.task_pid,
                    start: record.task_start,
                };
                let id = RunId {
                    alloc_id: alloc_id.to_owned(),
                    task: name.clone(),
                    run: run.clone(),
                    supervisor,
                    process,
                };
                tracing::warn!(alloc = %alloc_id, task = %name, run = %run, pid = record.task_pid, "found a task no record names; it is left running for its alloc to reattach");
                live.push(UnrecordedRun {
                    alloc_id: alloc_id.to_owned(),
                    task: name.clone(),
                    handle: TaskHandle {
                        driver: DriverKind::Exec,
                        id: id.to_id(),
                        pid: Some(record.task_pid),
                        started_at: process::started_at(process.start)
                            .unwrap_or_else(|| self.clock.now()),
                    },
                });
            }
        }
        live
    }

    /// Empties and removes the cgroups of runs no record names (an agent died between a
    /// task's start and its record, or while removing them), except in allocs whose
    /// records could not be read.
    fn remove_unrecorded_cgroups(&self, known: &HashSet<String>, recorded: &RecordedRuns) {
        let (Ok(cgroups), Ok(runtime)) = (&self.cgroups, tokio::runtime::Handle::try_current())
        else {
            return;
        };
        for (alloc_id, task, run) in cgroups.runs() {
            let valid = self.dirs.alloc_by_id(&alloc_id).is_ok()
                && task.parse::<Name>().is_ok()
                && stead_supervisor::args::is_run_id(&run);
            if !valid
                || known.contains(&run)
                || self.watches(&run)
                || recorded.unreadable_alloc(&alloc_id)
            {
                continue;
            }
            tracing::info!(alloc = %alloc_id, task, run, "removing the cgroup of a run no record names");
            runtime.spawn(release(cgroups.task(&alloc_id, &task, &run)));
        }
    }

    /// Refuses a start that would leave the agent fewer open files than it keeps for
    /// itself: each running task holds one (its supervisor's pipe or pidfd), and so does
    /// each start in flight. The start counts as one until the guard is dropped.
    fn check_open_files(&self) -> Result<StartingGuard, ExecError> {
        use std::sync::atomic::Ordering;
        let guard = || {
            self.starting.fetch_add(1, Ordering::AcqRel);
            StartingGuard(Arc::clone(&self.starting))
        };
        let Some(reserved) = self.config.reserved_open_files else {
            return Ok(guard());
        };
        let Some(limit) = rustix::process::getrlimit(rustix::process::Resource::Nofile).current
        else {
            return Ok(guard());
        };
        // Under the runs' lock, so that two starts never both take the last one. The live
        // runs are counted as they start and end, not scanned: a start on a node of
        // 10,000 tasks reads one number.
        let runs = self.runs();
        let live = self.live.load(Ordering::Acquire) + self.starting.load(Ordering::Acquire);
        if live.saturating_add(reserved).saturating_add(1) > limit {
            return Err(ExecError::OpenFilesExhausted {
                live,
                reserved,
                limit,
            });
        }
        let started = guard();
        drop(runs);
        Ok(started)
    }

    async fn start(self: Arc<Self>, request: StartRequest) -> Result<TaskHandle, ExecError> {
        let DriverConfig::Exec(config) = &request.config else {
            return Err(ExecError::WrongDriver);
        };
        let _starting = self.check_open_files()?;
        check_device_access(&request.devices)?;
        let account = self.account_for(request.user.as_deref())?;
        let alloc_dir = self.dirs.alloc(&request.alloc_id);
        let task_dir = alloc_dir
            .build_task(&request.task, account.as_ref().map(|a| (a.uid, a.gid)))
            .map_err(ExecError::TaskDir)?;
        let env = Self::environment(
            request.env.clone(),
            &request.alloc_id,
            &alloc_dir,
            &task_dir,
        );
        let (env, command, args) = stead_schemas::interpolate::task_start(
            &env,
            DEFAULT_PATH,
            &config.command,
            config.args.as_deref().unwrap_or_default(),
        );
        for (what, text) in env
            .iter()
            .flat_map(|(k, v)| [("environment", k), ("environment", v)])
            .chain(std::iter::once(("command", &command)))
            .chain(args.iter().map(|a| ("arguments", a)))
        {
            if text.contains('\0') {
                return Err(ExecError::NulByte {
                    what: what.to_owned(),
                });
            }
        }
        check_exec_size(&command, &args, &env, exec_size_limits())?;
        self.clean_stale_runs(&task_dir);

        let limits = Limits::of(&request.resources, self.mhz_per_core);
        if self.config.limits_required
            && let Some(reason) = self.unenforced(&limits)
        {
            return Err(ExecError::LimitsUnenforced { reason });
        }
        let run = format!("{:016x}", fastrand::u64(..));
        // From here on, a start that fails or is dropped removes the cgroup it made, and
        // stops what it launched first.
        let mut pending = Pending {
            reports: None,
            cgroup: None,
        };
        if let Ok(cgroups) = &self.cgroups {
            let enforceable = cgroups.enforceable(&limits);
            let cgroup = pending.cgroup.insert(
                cgroups
                    .task(request.alloc_id.as_str(), request.task.as_str(), &run)
                    .for_limits(&enforceable),
            );
            cgroup
                .create(&enforceable)
                .map_err(|source| ExecError::Cgroup {
                    cgroup: cgroup.to_string(),
                    source,
                })?;
        }
        let path_bytes = |path: &Path| path.as_os_str().as_bytes().to_vec();
        let supervisor_args = SupervisorArgs {
            task_dir: path_bytes(&task_dir.dir),
            control_dir: path_bytes(&task_dir.control),
            run: run.clone(),
            log_dir: path_bytes(&alloc_dir.logs()),
            name: request.task.to_string(),
            max_files: request.logs.max_files,
            max_file_size: u64::from(request.logs.max_file_size_mb) * 1024 * 1024,
            uid: account.as_ref().map(|a| a.uid),
            gid: account.as_ref().map(|a| a.gid),
            groups: account.map(|a| a.groups).unwrap_or_default(),
            cgroups: pending
                .cgroup
                .iter()
                .flat_map(TaskCgroup::join_files)
                .map(|path| path_bytes(&path))
                .collect(),
            command: command.into_bytes(),
            args: args.iter().map(|arg| arg.clone().into_bytes()).collect(),
        };
        let message = protocol::encode_request(
            &supervisor_args,
            env.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        );
        let reports = self
            .zygote
            .launch(&self.config, &message)
            .await
            .map_err(|source| {
                if source.raw_os_error() == Some(rustix::io::Errno::MSGSIZE.raw_os_error()) {
                    ExecError::RequestTooLarge {
                        size: message.len(),
                        source,
                    }
                } else {
                    ExecError::Spawn {
                        path: self.config.supervisor.clone(),
                        source,
                    }
                }
            })?;
        pending.reports = Some(BufReader::new(reports));
        let mut line = String::new();
        let read = match pending.reports.as_mut() {
            Some(reports) => tokio::time::timeout(HANDSHAKE_TIMEOUT, reports.read_line(&mut line))
                .await
                .map_err(|_| ExecError::HandshakeTimeout)?,
            None => Ok(0),
        };
        match read {
            Ok(0) => {
                pending.reports = None;
                return Err(ExecError::SupervisorVanished);
            }
            Ok(_) => {}
            Err(source) => return Err(ExecError::Handshake { source }),
        }
        let report = Report::parse(&line).map_err(|source| ExecError::Protocol { source })?;
        let (task_pid, task_start, supervisor_pid, supervisor_start) = match report {
            Report::Started {
                task_pid,
                task_start,
                supervisor_pid,
                supervisor_start,
            } => (task_pid, task_start, supervisor_pid, supervisor_start),
            Report::Failed {
                recoverable,
                message,
            } => {
                pending.reports = None;
                return Err(ExecError::TaskFailed {
                    message,
                    recoverable,
                });
            }
            Report::Exited(_) => {
                return Err(ExecError::Protocol {
                    source: ProtocolError {
                        what: "report line",
                        text: line,
                    },
                });
            }
        };
        let id = RunId {
            alloc_id: request.alloc_id.to_string(),
            task: request.task.clone(),
            run: run.clone(),
            supervisor: ProcessId {
                pid: supervisor_pid,
                start: supervisor_start,
            },
            process: ProcessId {
                pid: task_pid,
                start: task_start,
            },
        };
        let handle = TaskHandle {
            driver: DriverKind::Exec,
            id: id.to_id(),
            pid: Some(task_pid),
            started_at: self.clock.now(),
        };
        let supervisor = id.supervisor;
        let state = RunState::new(id, pending.cgroup.take(), &self.live);
        self.runs().insert(handle.id.clone(), state.clone());
        let reports = pending.reports.take();
        spawn_watcher(
            &self.gone,
            watch_run(reports, supervisor, state, task_dir.control, run),
        );
        Ok(handle)
    }

    /// Whether the run's supervisor still runs: its pid, its start time, and its working
    /// directory (the task dir) all match.
    fn supervisor_alive(&self, id: &RunId) -> bool {
        self.task_dir(id)
            .is_some_and(|dir| id.supervisor.exists_in(&dir.dir))
    }

    /// SIGKILLs the task's cgroup (through `cgroup.kill` where the kernel has it: a
    /// grandchild that left the process group and the session dies too), its process
    /// group and every process below its supervisor.
    fn kill_run(&self, id: &RunId) {
        if let Some(cgroup) = self.cgroup_of(id) {
            cgroup.kill();
        }
        if id.process.exists() {
            let _ = process::signal_group(id.process.pid, RawSignal::KILL);
        }
        if self.supervisor_alive(id) {
            process::kill_all(process::descendants(id.supervisor.pid));
        }
    }

    /// The run of `handle`, for a known one.
    fn run_state(&self, handle: &TaskHandle) -> Option<Arc<RunState>> {
        self.runs().get(&handle.id).cloned()
    }

    /// The task dir of a run read back from a handle.
    fn task_dir(&self, id: &RunId) -> Option<TaskDir> {
        self.dirs
            .alloc_by_id(&id.alloc_id)
            .ok()?
            .task(&id.task)
            .ok()
    }

    fn recover(&self, handle: &TaskHandle) -> Result<(), DriverError> {
        if self.runs().contains_key(&handle.id) {
            return Ok(());
        }
        let id = RunId::parse(&handle.id).ok_or_else(|| Self::unknown(handle))?;
        let task_dir = self.task_dir(&id).ok_or_else(|| Self::unknown(handle))?;
        // Re-derived from the run's alloc and task; a run of an agent without cgroups
        // has none.
        let cgroup = self
            .cgroup_of(&id)
            .filter(TaskCgroup::exists)
            .map(TaskCgroup::existing);
        let state = RunState::new(id.clone(), cgroup.clone(), &self.live);
        if self.supervisor_alive(&id) {
            self.runs().insert(handle.id.clone(), state.clone());
            spawn_watcher(
                &self.gone,
                watch_pid(id.supervisor, state, task_dir.control, id.run),
            );
            return Ok(());
        }
        if let Ok(Some(status)) = protocol::read_exit_record(&task_dir.control, &id.run) {
            // Ended while no agent watched: published as a watched run's end is, at the
            // time the supervisor recorded it.
            let result = ExitResult {
                at: recorded_at(&task_dir.control, &id.run),
                ..recorded(&task_dir.control, &id.run, status)
            };
            self.runs().insert(handle.id.clone(), state.clone());
            tokio::spawn(async move {
                publish_exit(&state, result, &task_dir.control, &id.run).await;
            });
            return Ok(());
        }
        // Its supervisor is gone and left no record: nothing can tell how the run
        // ended, and whatever is left of it goes, its cgroup too.
        self.kill_run(&id);
        if let Some(cgroup) = cgroup {
            tokio::spawn(release(cgroup));
        }
        process::kill_all(process::session_members(id.process));
        Err(Self::unknown(handle))
    }

    fn signal(&self, handle: &TaskHandle, signal: &Signal) -> Result<(), DriverError> {
        let id = RunId::parse(&handle.id).ok_or_else(|| Self::unknown(handle))?;
        if !id.process.exists() {
            return Err(Self::unknown(handle));
        }
        let raw = RawSignal::from_named_raw(signal_number(signal))
            .expect("signal_number returns Linux signal numbers");
        let failed = |error: rustix::io::Errno| DriverError::Signal {
            id: handle.id.clone(),
            signal: signal.to_string(),
            message: error.to_string(),
        };
        match process::signal_group(id.process.pid, raw) {
            Ok(true) => Ok(()),
            // The task left its group: signal the task itself.
            Ok(false) => {
                match rustix::process::Pid::from_raw(i32::try_from(id.process.pid).unwrap_or(0)) {
                    Some(pid) => rustix::process::kill_process(pid, raw).map_err(failed),
                    None => Err(Self::unknown(handle)),
                }
            }
            Err(error) => Err(failed(error)),
        }
    }

    fn destroy(&self, handle: &TaskHandle) {
        let Some(id) = RunId::parse(&handle.id) else {
            return;
        };
        let state = self.run_state(handle);
        let reported = state
            .as_ref()
            .is_some_and(|state| state.reported.load(Ordering::Acquire));
        // A run whose end this driver published with its cgroup removed, or as its
        // supervisor reported it, left nothing to kill: its cgroup was emptied, or its
        // supervisor killed what the task left before it reported. (A cgroup that could
        // not be removed is released again by the caller.)
        let ended_clean = state.as_ref().is_some_and(|state| {
            state.exit.borrow().is_some() && (state.cgroup.is_some() || reported)
        });
        if !ended_clean {
            self.kill_run(&id);
            // A supervisor that reported the exit, or recorded it, cleaned up before;
            // only one that died without either leaves the task's session to search (a
            // scan of every process).
            let recorded = reported
                || self
                    .task_dir(&id)
                    .and_then(|dir| protocol::read_exit_record(&dir.control, &id.run).ok())
                    .flatten()
                    .is_some();
            if !recorded && !self.supervisor_alive(&id) {
                // The supervisor died without cleaning up (it was killed): what is left
                // of the task's session goes.
                process::kill_all(process::session_members(id.process));
            }
        }
        self.runs().remove(&handle.id);
    }

    fn stats(&self, handle: &TaskHandle) -> Result<TaskStats, DriverError> {
        let id = RunId::parse(&handle.id).ok_or_else(|| Self::unknown(handle))?;
        let pids = if self.supervisor_alive(&id) {
            process::descendants(id.supervisor.pid)
        } else if id.process.exists() {
            process::session_members(id.process)
        } else {
            return Err(Self::unknown(handle));
        };
        let usage = process::usage(pids);
        let cgroup = self
            .run_state(handle)
            .and_then(|state| state.cgroup.as_ref().and_then(TaskCgroup::usage));
        let ticks_per_second = process::ticks_per_second().max(1);
        let now = self.clock.instant();
        let previous = self.run_state(handle).and_then(|state| {
            state
                .cpu
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .replace((usage.ticks, now))
        });
        let (ticks, seconds) = match previous {
            Some((ticks, at)) if now > at => (
                usage.ticks.saturating_sub(ticks),
                now.duration_since(at).as_secs_f64(),
            ),
            _ => (
                usage.ticks,
                self.clock
                    .now()
                    .saturating_duration_since(handle.started_at)
                    .as_secs_f64(),
            ),
        };
        let cpu_percent = if seconds > 0.0 {
            ticks as f64 / ticks_per_second as f64 / seconds * 100.0
        } else {
            0.0
        };
        Ok(TaskStats {
            cpu_percent,
            cpu_ticks: usage.ticks,
            ticks_per_second,
            rss_bytes: usage.rss_bytes,
            processes: usage.processes,
            cgroup,
        })
    }

    fn fingerprint(&self) -> Fingerprint {
        let mut attributes = fingerprint::attributes(&self.config.supervisor);
        match &self.cgroups {
            Ok(cgroups) => {
                attributes.insert("cgroup.limits".to_owned(), "true".to_owned());
                attributes.insert("cgroup.version".to_owned(), cgroups.version().to_owned());
                attributes.insert(
                    "cgroup.root".to_owned(),
                    cgroups.root().display().to_string(),
                );
                attributes.insert("cgroup.kill".to_owned(), cgroups.kills().to_string());
            }
            Err(error) => {
                attributes.insert("cgroup.limits".to_owned(), "false".to_owned());
                attributes.insert("cgroup.reason".to_owned(), error.to_string());
            }
        }
        let forced = *self.health.lock().unwrap_or_else(PoisonError::into_inner);
        let (health, description) = match (forced, fingerprint::check(&self.config.supervisor)) {
            (Some(health), _) => (health, format!("{health} (set by a test hook)")),
            (None, Ok(())) => (Health::Healthy, "healthy".to_owned()),
            (None, Err(problem)) => (Health::Unhealthy, problem),
        };
        Fingerprint {
            health,
            description,
            attributes,
        }
    }
}

/// How a recorded exit reads to the reconcilers.
fn exit_result(status: ExitStatus) -> ExitResult {
    ExitResult {
        exit_code: status.code,
        signal: status.signal,
        ..ExitResult::default()
    }
}

/// Where the driver notes that the OOM killer killed a process of `run`, before it
/// removes the run's cgroup (and its counter): an agent that dies before it stored the
/// exit finds it there.
fn oom_marker_path(control: &Path, run: &str) -> PathBuf {
    control.join(format!("{run}.oom"))
}

/// The exit `status` a supervisor recorded for `run`, with the OOM marker the driver left.
fn recorded(control: &Path, run: &str, status: ExitStatus) -> ExitResult {
    ExitResult {
        oom_killed: oom_marker_path(control, run).exists(),
        ..exit_result(status)
    }
}

/// When the supervisor recorded the exit of `run`: its record's modification time, which
/// it wrote once, as the task ended.
fn recorded_at(control: &Path, run: &str) -> Option<stead_schemas::Timestamp> {
    let modified = std::fs::metadata(protocol::exit_record_path(control, run))
        .and_then(|meta| meta.modified())
        .ok()?;
    let since_epoch = modified.duration_since(std::time::UNIX_EPOCH).ok()?;
    Some(stead_schemas::Timestamp::from_since_epoch(since_epoch))
}

/// The exit a supervisor recorded for `run` (with the OOM marker the driver left), or an
/// error result when it left none.
fn recorded_exit(control: &Path, run: &str) -> ExitResult {
    match protocol::read_exit_record(control, run) {
        Ok(Some(status)) => recorded(control, run, status),
        Ok(None) => ExitResult {
            error: Some("the task's supervisor exited without recording its exit".to_owned()),
            ..ExitResult::default()
        },
        Err(error) => ExitResult {
            error: Some(crate::errors::error_chain(&error)),
            ..ExitResult::default()
        },
    }
}

/// Watches a run this agent started: its supervisor's `exited` line, or its end.
async fn watch_run(
    reports: Option<BufReader<pipe::Receiver>>,
    supervisor: ProcessId,
    state: Arc<RunState>,
    control: PathBuf,
    run: String,
) {
    let mut reported = None;
    if let Some(mut reports) = reports {
        let mut line = String::new();
        if let Ok(n) = reports.read_line(&mut line).await
            && n > 0
            && let Ok(Report::Exited(status)) = Report::parse(&line)
        {
            state.reported.store(true, Ordering::Release);
            reported = Some(exit_result(status));
        }
    }
    let result = match reported {
        Some(result) => result,
        None => {
            // The pipe closed without a report: the supervisor died; its record (if it
            // wrote one) says how the task ended.
            wait_for_exit(supervisor).await;
            recorded_exit(&control, &run)
        }
    };
    publish_exit(&state, result, &control, &run).await;
}

/// Watches a supervisor an earlier agent started, until it exits.
async fn watch_pid(supervisor: ProcessId, state: Arc<RunState>, control: PathBuf, run: String) {
    wait_for_exit(supervisor).await;
    // Reattached: the run may have ended before this agent watched it (its supervisor
    // still finishing up), so it says when it did.
    let result = ExitResult {
        at: recorded_at(&control, &run),
        ..recorded_exit(&control, &run)
    };
    publish_exit(&state, result, &control, &run).await;
}

/// Tells the run's waiters how it ended, with whether the OOM killer killed a process of
/// it (its cgroup's counter, read before anything else), once its cgroup is emptied and
/// removed: an alloc that is over leaves no cgroup behind.
async fn publish_exit(state: &RunState, mut result: ExitResult, control: &Path, run: &str) {
    state.releasing.store(true, Ordering::Release);
    if let Some(cgroup) = &state.cgroup {
        result.oom_killed |= cgroup.oom_kills().unwrap_or(0) > 0;
        if result.oom_killed
            && let Err(error) = std::fs::write(oom_marker_path(control, run), "")
        {
            tracing::warn!(%error, run, "cannot note an OOM kill beside the run's exit record");
        }
        release(cgroup.clone()).await;
    }
    drop(
        state
            .live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(),
    );
    state.exit.send_replace(Some(result));
}

/// The descriptor slots [`ExecDriver::prepare`] grows the agent's table to (at most its
/// open-files limit), room for 10,000 tasks' descriptors: the kernel otherwise grows the
/// table by doubling as tasks start, and each growth in a process of many threads waits
/// for an RCU grace period while every thread that opens a descriptor waits with it. In a
/// start of 10,000 tasks on 16 cores, a quarter of the agent's threads' waits in the
/// kernel were those (decision 0081). 16,384 slots hold 128 KiB of kernel memory.
pub const DESCRIPTOR_SLOTS: u64 = 16_384;

/// Grows this process's descriptor table to hold `slots` descriptors, or its open-files
/// limit if lower; a table that is already as large stays as it is (the kernel never
/// shrinks one).
fn grow_descriptor_table(slots: u64) {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
    let slots = limit.map_or(slots, |limit| limit.min(slots));
    let Some(highest) = slots.checked_sub(1).and_then(|n| i32::try_from(n).ok()) else {
        return;
    };
    let null = match rustix::fs::open(
        "/dev/null",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    ) {
        Ok(null) => null,
        Err(error) => {
            tracing::debug!(%error, "cannot open /dev/null to grow the descriptor table");
            return;
        }
    };
    // `F_DUPFD` takes the lowest free descriptor at or above `highest`: the kernel grows
    // the table to hold it, and closing it leaves the table that size.
    if let Err(error) = rustix::io::fcntl_dupfd_cloexec(&null, highest) {
        tracing::debug!(%error, slots, "cannot grow the descriptor table");
    }
}

/// Kills what is left in a run's cgroup and removes it.
async fn release(cgroup: TaskCgroup) {
    if let Err(error) = cgroup.remove().await {
        tracing::warn!(cgroup = %cgroup, %error, "cannot remove a task's cgroup");
    }
}

/// Resolves once `process` has exited (a zombie counts as exited).
async fn wait_for_exit(process: ProcessId) {
    let pidfd =
        rustix::process::Pid::from_raw(i32::try_from(process.pid).unwrap_or(0)).and_then(|pid| {
            rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
        });
    if let Some(pidfd) = pidfd {
        // Opened before the check: if the process is still ours now, the pidfd is too.
        if !process.exists() {
            return;
        }
        if let Ok(fd) = zygote::register(pidfd, tokio::io::Interest::READABLE) {
            let _ = fd.readable().await;
            return;
        }
    }
    while process.exists() && !is_zombie(process.pid) {
        tokio::time::sleep(PID_POLL).await;
    }
}

fn is_zombie(pid: u32) -> bool {
    stead_supervisor::proc::stat(pid).is_ok_and(|stat| stat.state == b'Z')
}

/// A run launched by a start that has not returned yet: if the start is dropped
/// (cancelled), the run is stopped in the background rather than leaked, and a run that
/// did not start has its cgroup removed.
struct Pending {
    /// The supervisor's report pipe; `None` once the start returned or the run is known
    /// not to have started.
    reports: Option<BufReader<pipe::Receiver>>,
    /// The run's cgroup, until a run takes it.
    cgroup: Option<TaskCgroup>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let cgroup = self.cgroup.take();
        // Outside a runtime nothing can wait for the report; the supervisor then runs
        // its task until the next start of the task finds its run record.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        match self.reports.take() {
            Some(reports) => {
                runtime.spawn(async move {
                    abandon(reports).await;
                    if let Some(cgroup) = cgroup {
                        release(cgroup).await;
                    }
                });
            }
            None => {
                if let Some(cgroup) = cgroup {
                    runtime.spawn(release(cgroup));
                }
            }
        }
    }
}

/// Stops a run whose start was cancelled: waits for the supervisor's report, then kills
/// the task and everything below the supervisor.
async fn abandon(mut reports: BufReader<pipe::Receiver>) {
    let mut line = String::new();
    let read = tokio::time::timeout(HANDSHAKE_TIMEOUT, reports.read_line(&mut line)).await;
    if let Ok(Ok(n)) = read
        && n > 0
        && let Ok(Report::Started {
            task_pid,
            supervisor_pid,
            ..
        }) = Report::parse(&line)
    {
        let _ = process::signal_group(task_pid, RawSignal::KILL);
        process::kill_all(process::descendants(supervisor_pid));
    }
}

impl Driver for ExecDriver {
    fn kind(&self) -> DriverKind {
        DriverKind::Exec
    }

    fn fingerprint(&self) -> BoxFuture<'_, Fingerprint> {
        Box::pin(async move { self.inner.fingerprint() })
    }

    fn start(&self, request: StartRequest) -> BoxFuture<'_, Result<TaskHandle, DriverError>> {
        let inner = Arc::clone(&self.inner);
        Box::pin(async move {
            let alloc_id = request.alloc_id.clone();
            let task: Name = request.task.clone();
            inner
                .start(request)
                .await
                .map_err(|error| DriverError::Start {
                    alloc_id,
                    task,
                    message: crate::errors::error_chain(&error),
                    recoverable: error.recoverable(),
                })
        })
    }

    fn wait(&self, handle: TaskHandle) -> BoxFuture<'static, ExitResult> {
        let inner = Arc::clone(&self.inner);
        Box::pin(async move {
            if let Some(state) = inner.run_state(&handle) {
                let mut exit = state.exit.subscribe();
                if let Ok(result) = exit.wait_for(Option::is_some).await
                    && let Some(result) = result.clone()
                {
                    return result;
                }
            }
            // Not (or no longer) watched: the record answers, if there is one.
            match RunId::parse(&handle.id).and_then(|id| Some((inner.task_dir(&id)?, id))) {
                Some((dir, id)) => recorded_exit(&dir.control, &id.run),
                None => ExitResult {
                    error: Some(format!("task {} is unknown to the exec driver", handle.id)),
                    ..ExitResult::default()
                },
            }
        })
    }

    fn signal(
        &self,
        handle: &TaskHandle,
        signal: &Signal,
    ) -> BoxFuture<'_, Result<(), DriverError>> {
        let (handle, signal) = (handle.clone(), signal.clone());
        Box::pin(async move { self.inner.signal(&handle, &signal) })
    }

    fn kill(&self, handle: &TaskHandle) -> BoxFuture<'_, Result<(), DriverError>> {
        let handle = handle.clone();
        Box::pin(async move {
            let id = RunId::parse(&handle.id).ok_or_else(|| Inner::unknown(&handle))?;
            self.inner.kill_run(&id);
            Ok(())
        })
    }

    fn recover(&self, handle: &TaskHandle) -> BoxFuture<'_, Result<(), DriverError>> {
        let handle = handle.clone();
        Box::pin(async move { self.inner.recover(&handle) })
    }

    fn destroy(&self, handle: &TaskHandle) -> BoxFuture<'_, ()> {
        let handle = handle.clone();
        Box::pin(async move {
            let cgroup = RunId::parse(&handle.id).and_then(|id| self.inner.cgroup_of(&id));
            self.inner.destroy(&handle);
            if let Some(cgroup) = cgroup.filter(TaskCgroup::exists) {
                release(cgroup).await;
            }
        })
    }

    fn unenforced_limits(&self, resources: &TaskResources) -> Option<String> {
        if self.inner.config.limits_required {
            return None; // the start fails instead
        }
        self.inner
            .unenforced(&Limits::of(resources, self.inner.mhz_per_core))
    }

    fn unrecorded_runs(&self, recorded: &RecordedRuns) -> Vec<UnrecordedRun> {
        self.inner.unrecorded_runs(recorded)
    }

    fn stats(&self, handle: &TaskHandle) -> BoxFuture<'_, Result<Option<TaskStats>, DriverError>> {
        let handle = handle.clone();
        Box::pin(async move { self.inner.stats(&handle).map(Some) })
    }

    fn cgroup_counters(&self, handle: &TaskHandle) -> Option<CgroupCounters> {
        self.inner.run_state(handle)?.cgroup.as_ref()?.counters()
    }

    fn exec(&self, request: ExecRequest) -> BoxFuture<'_, Result<ExecOutput, DriverError>> {
        Box::pin(async move {
            let failed = exec_failed(&request.alloc_id, &request.task, &request.command);
            let context = self
                .inner
                .command_context(
                    &request.alloc_id,
                    &request.task,
                    request.user.as_deref(),
                    request.env.clone(),
                )
                .map_err(&failed)?;
            // A check's command is the spec's: its references are substituted.
            let (command, args) = stead_schemas::interpolate::command_line(
                &context.env,
                &request.command,
                &request.args,
            );
            command::run(
                &command,
                &args,
                &context.env,
                &context.dir,
                context.as_task(self.inner.config.task_oom_score_adj),
                request.timeout,
            )
            .await
            .map_err(|error| failed(error.to_string()))
        })
    }

    fn exec_session(
        &self,
        request: ExecSessionRequest,
    ) -> BoxFuture<'_, Result<ExecSession, DriverError>> {
        Box::pin(async move {
            let context = self
                .inner
                .command_context(
                    &request.alloc_id,
                    &request.task,
                    request.user.as_deref(),
                    request.env.clone(),
                )
                .map_err(exec_failed(
                    &request.alloc_id,
                    &request.task,
                    &request.command,
                ))?;
            // A session's command is as typed.
            command::spawn_session(
                &request.command,
                &request.args,
                &context.env,
                &context.dir,
                context.as_task(self.inner.config.task_oom_score_adj),
                request.tty,
                request.stdin,
            )
            .map_err(|source| DriverError::ExecStart {
                alloc_id: request.alloc_id.clone(),
                task: request.task.clone(),
                command: request.command.clone(),
                source,
            })
        })
    }
}

/// Where and as whom a command beside a task runs: what its exec checks and
/// `stead alloc exec` share.
struct CommandContext {
    account: Option<Account>,
    dir: PathBuf,
    env: BTreeMap<String, String>,
    /// The `cgroup.procs` files of the running run's cgroups, which the command joins.
    cgroups: Vec<PathBuf>,
}

impl CommandContext {
    fn as_task(&self, oom_score_adj: Option<i16>) -> command::AsTask<'_> {
        command::AsTask {
            account: self.account.as_ref(),
            cgroups: &self.cgroups,
            oom_score_adj,
        }
    }
}

/// How a command beside task `task` of `alloc_id` failed to run, from why, for people.
fn exec_failed<'a>(
    alloc_id: &'a AllocId,
    task: &'a Name,
    command: &'a str,
) -> impl Fn(String) -> DriverError + 'a {
    move |message| DriverError::Exec {
        alloc_id: alloc_id.clone(),
        task: task.clone(),
        command: command.to_owned(),
        message,
    }
}

impl Inner {
    /// The context of a command beside task `task` of `alloc_id` run as `user` with the
    /// task's `env` (as the task has it: references substituted); why not, for people.
    fn command_context(
        &self,
        alloc_id: &AllocId,
        task: &Name,
        user: Option<&str>,
        env: BTreeMap<String, String>,
    ) -> Result<CommandContext, String> {
        let account = self
            .account_for(user)
            .map_err(|error| crate::errors::error_chain(&error))?;
        let alloc_dir = self.dirs.alloc(alloc_id);
        let task_dir = alloc_dir
            .task(task)
            .map_err(|error| crate::errors::error_chain(&error))?;
        let env = stead_schemas::interpolate::task_env(
            &Inner::environment(env, alloc_id, &alloc_dir, &task_dir),
            DEFAULT_PATH,
        );
        let cgroups: Vec<PathBuf> = self
            .runs()
            .values()
            .filter(|state| {
                state.id.alloc_id == alloc_id.as_str()
                    && state.id.task == *task
                    && state.exit.borrow().is_none()
                    && !state.releasing.load(Ordering::Acquire)
            })
            .find_map(|state| state.cgroup.as_ref().map(TaskCgroup::join_files))
            .unwrap_or_default();
        Ok(CommandContext {
            account,
            dir: task_dir.dir,
            env,
            cgroups,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of this process's descriptor table (`FDSize` in its status).
    fn descriptor_table_size() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").expect("own status");
        status
            .lines()
            .find_map(|line| line.strip_prefix("FDSize:"))
            .and_then(|size| size.trim().parse().ok())
            .expect("an FDSize line")
    }

    #[test]
    fn the_descriptor_table_is_grown_at_once_to_the_slots_asked_for_within_the_limit() {
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        let wanted = DESCRIPTOR_SLOTS.min(limit);
        grow_descriptor_table(DESCRIPTOR_SLOTS);
        let size = descriptor_table_size();
        assert!(size >= wanted, "table of {size} slots, {wanted} asked for");
        // Never past the open-files limit, and never shrunk.
        grow_descriptor_table(64);
        assert_eq!(descriptor_table_size(), size);
        assert!(
            size <= limit
                .max(64)
                .checked_next_power_of_two()
                .unwrap_or(u64::MAX)
        );
    }

    #[test]
    fn a_command_arguments_and_environment_over_execs_limits_are_refused_naming_what() {
        let limits = ExecSizeLimits {
            per_string: 16,
            total: 64,
        };
        let check = |command: &str, args: &[&str], env: &[(&str, &str)]| {
            let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
            let env: BTreeMap<String, String> = env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            check_exec_size(command, &args, &env, limits)
                .err()
                .map(|error| error.to_string())
        };
        assert_eq!(check("/bin/true", &["a"], &[("K", "v")]), None);
        let too_long = |what: &str, size: usize| {
            Some(format!(
                "the {what} is {size} bytes; the kernel takes at most 16 bytes for one argument or environment variable (MAX_ARG_STRLEN)"
            ))
        };
        assert_eq!(
            check("/a/very/long/command", &[], &[]),
            too_long("command", 21)
        );
        assert_eq!(
            check("sh", &["-c", "seventeen bytes!!"], &[]),
            too_long("argument 2", 18)
        );
        assert_eq!(
            check("sh", &[], &[("KEY", "twelve bytes")]),
            too_long("environment variable \"KEY\"", 17)
        );
        // Each entry fits; with their pointers and the program's path they do not.
        let total = check(
            "sh",
            &[],
            &[("A", "1234567"), ("B", "1234567"), ("C", "1234567890")],
        );
        assert!(
            total
                .as_deref()
                .is_some_and(|t| t.contains("take 71 bytes") && t.contains("ARG_MAX")),
            "{total:?}"
        );
    }

    #[test]
    fn execs_limits_are_32_pages_for_one_string_and_a_quarter_of_the_stack_for_all() {
        let limits = exec_size_limits();
        let page = rustix::param::page_size();
        assert_eq!(limits.per_string, 32 * page);
        assert!(
            limits.total >= 32 * page && limits.total <= 6 << 20,
            "{limits:?}"
        );
    }
}
