//! The `mock` driver: in-process fake tasks driven by tokio time, with Nomad's mock options.
//!
//! A task is a record plus a tokio task that writes its stdout and ends it after
//! `runFor`; nothing touches the operating system, so tests run under paused time and
//! benchmarks run thousands of tasks. [`MockDriver`] is cheap to clone and its clones
//! share every task, so a second agent in one test can recover what the first started.
//!
//! Options (`stead_schemas::spec::MockConfig`):
//! - `runFor`: unset, the task runs until killed; set, it exits by itself after it, with
//!   `exitCode` (default 0), `exitSignal` (default none) and `exitErrMsg` as its error;
//! - `startError`: start fails with it, recoverable when `startErrorRecoverable` is true;
//! - `startBlockFor`: start takes that long (before `startError` is reported);
//! - `killAfter`: a terminating signal (any but SIGHUP, SIGUSR1, SIGUSR2, SIGWINCH,
//!   SIGCONT and SIGSTOP) ends the task that long later (default at once) with exit
//!   code 128 + n and signal n; SIGKILL and [`Driver::kill`] end it at once (137, 9);
//! - `signalError`: every signal fails with it;
//! - `stdoutString`, `stdoutRepeat`, `stdoutRepeatDuration`: as in Nomad, the string is
//!   written when the task starts and then `stdoutRepeat` more times, that far apart,
//!   while the task runs.
//!
//! The `pub fn`s of [`MockDriver`] beyond the constructors are test hooks. What the driver
//! remembers is bounded: the last [`DEFAULT_HISTORY`] calls (or the number given to
//! [`MockDriver::with_history`]), and the output of as many destroyed tasks, so an agent
//! that runs it for long (benchmarks, tests of churn) does not grow by ~1 KiB per call.

/// How many calls, and destroyed tasks' outputs, a [`MockDriver`] remembers by default.
pub const DEFAULT_HISTORY: usize = 4096;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use stead_reconcilers::exit::ExitResult;
use stead_schemas::spec::{DriverConfig, DriverKind, MockConfig, Name, Signal};
use stead_schemas::{AllocId, Timestamp};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{
    BoxFuture, Driver, DriverError, Fingerprint, Health, RecordedRuns, StartRequest, TaskHandle,
    UnrecordedRun, signal_number,
};
use crate::clock::Clock;

/// Signals a task survives (they do not ask it to stop).
const NON_TERMINATING_SIGNALS: [&str; 6] = [
    "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGWINCH", "SIGCONT", "SIGSTOP",
];

/// How a killed task ends: exit code 137, signal 9.
const KILLED: ExitResult = ExitResult {
    exit_code: 128 + 9,
    signal: Some(9),
    error: None,
    oom_killed: false,
    at: None,
};

/// The in-process fake driver; clones share their tasks.
#[derive(Clone)]
pub struct MockDriver {
    inner: Arc<Inner>,
}

/// One call the driver received, for tests (a test hook).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MockCall {
    /// When the call was received (or, for `StartReturned`, when start returned).
    pub at: Timestamp,
    /// The alloc of the task the call was about.
    pub alloc_id: AllocId,
    /// The task the call was about.
    pub task: Name,
    /// What happened.
    pub op: MockOp,
}

/// What a [`MockCall`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MockOp {
    /// `start` was called.
    StartBegan,
    /// `start` returned; `ok` when it started the task.
    StartReturned {
        /// Whether the task started.
        ok: bool,
    },
    /// The caller dropped `start` before it returned; no task was started.
    StartCancelled,
    /// `signal` was called with this signal name (whether or not it succeeded).
    Signal(String),
    /// `kill` was called.
    Kill,
    /// `recover` was called; `ok` when the task was found.
    Recover {
        /// Whether the task was found.
        ok: bool,
    },
    /// `destroy` was called.
    Destroy,
    /// The task ended (on its own, by a signal or a kill, or destroyed while it ran).
    Exited {
        /// Its exit code.
        exit_code: i32,
    },
}

struct Inner {
    clock: Clock,
    state: Mutex<State>,
}

struct State {
    /// Stamps the calls logged with the state's lock held (exits).
    clock: Clock,
    /// Tasks not yet destroyed, by handle id.
    tasks: BTreeMap<String, MockTask>,
    /// Every task started and not destroyed, and the last `limit` destroyed, by handle
    /// id: its identity and output, which outlive `destroy` as a real task's log files do.
    history: HashMap<String, TaskRecord>,
    /// The destroyed tasks still in `history`, oldest first.
    retired: VecDeque<String>,
    /// The last `limit` calls, oldest first.
    calls: VecDeque<MockCall>,
    /// How many calls and destroyed tasks are remembered; at least 1.
    limit: usize,
    health: Health,
    hang_wait_after_kill: bool,
    /// Numbers the runs, so handle ids are never reused.
    next_run: u64,
}

struct TaskRecord {
    alloc_id: AllocId,
    task: Name,
    stdout: String,
}

struct MockTask {
    handle: TaskHandle,
    config: MockConfig,
    /// `None` while the task runs, then how it ended; every `wait` subscribes to it.
    exit: watch::Sender<Option<Ended>>,
    /// Whether the task was killed or signalled (for `hang_wait_after_kill`).
    interrupted: bool,
    /// Whether a terminating signal has already scheduled the task's exit.
    stopping: bool,
    /// Cancelled when the task ends; stops its stdout and `runFor` timers.
    ended: CancellationToken,
}

#[derive(Debug, Clone)]
struct Ended {
    result: ExitResult,
    interrupted: bool,
}

impl MockDriver {
    /// A mock driver with no tasks, healthy, reading time from `clock`, remembering the
    /// last [`DEFAULT_HISTORY`] calls.
    pub fn new(clock: Clock) -> Self {
        Self::with_history(clock, DEFAULT_HISTORY)
    }

    /// A mock driver that remembers the last `limit` calls (at least 1), and the output
    /// of the last `limit` tasks it destroyed.
    pub fn with_history(clock: Clock, limit: usize) -> Self {
        MockDriver {
            inner: Arc::new(Inner {
                clock,
                state: Mutex::new(State {
                    clock,
                    tasks: BTreeMap::new(),
                    history: HashMap::new(),
                    retired: VecDeque::new(),
                    calls: VecDeque::new(),
                    limit: limit.max(1),
                    health: Health::Healthy,
                    hang_wait_after_kill: false,
                    next_run: 1,
                }),
            }),
        }
    }

    /// Test hook: the calls received so far about tasks this driver started, in order:
    /// the last [`DEFAULT_HISTORY`] (or `with_history`'s limit).
    pub fn calls(&self) -> Vec<MockCall> {
        self.inner.lock().calls.iter().cloned().collect()
    }

    /// Test hook: takes the calls logged so far (as [`MockDriver::calls`]), leaving none,
    /// so a test that reads them as they come misses none to the limit.
    pub fn take_calls(&self) -> Vec<MockCall> {
        std::mem::take(&mut self.inner.lock().calls).into()
    }

    /// Test hook: the tasks that are alive (started, not yet exited), by id.
    pub fn running(&self) -> Vec<TaskHandle> {
        self.inner
            .lock()
            .tasks
            .values()
            .filter(|task| task.exit.borrow().is_none())
            .map(|task| task.handle.clone())
            .collect()
    }

    /// Test hook: makes `fingerprint` report `health`.
    pub fn set_health(&self, health: Health) {
        self.inner.lock().health = health;
    }

    /// Test hook: everything task `handle_id` has written to stdout (empty when unknown).
    pub fn stdout(&self, handle_id: &str) -> String {
        self.inner
            .lock()
            .history
            .get(handle_id)
            .map(|record| record.stdout.clone())
            .unwrap_or_default()
    }

    /// Test hook: makes running task `handle_id` exit now with `result`, e.g. to simulate
    /// a task that exited while the agent was down. Returns whether a running task ended.
    pub fn exit_task(&self, handle_id: &str, result: ExitResult) -> bool {
        self.inner.lock().finish(handle_id, result)
    }

    /// Test hook: when set, `wait` futures never resolve once their task was killed or
    /// signalled, to check that callers do not trust the driver to close its wait.
    pub fn hang_wait_after_kill(&self, hang: bool) {
        self.inner.lock().hang_wait_after_kill = hang;
    }
}

impl fmt::Debug for MockDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.inner.lock();
        f.debug_struct("MockDriver")
            .field("tasks", &state.tasks.keys().collect::<Vec<_>>())
            .field("health", &state.health)
            .finish_non_exhaustive()
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the state consistent: every update is
        // a single assignment or insertion.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Logs `op` for task `id`; calls about ids this driver never issued are not logged.
    fn record(&self, id: &str, op: MockOp) {
        let at = self.clock.now();
        let mut state = self.lock();
        if let Some(record) = state.history.get(id) {
            let call = MockCall {
                at,
                alloc_id: record.alloc_id.clone(),
                task: record.task.clone(),
                op,
            };
            state.push_call(call);
        }
    }

    fn record_for(&self, alloc_id: &AllocId, task: &Name, op: MockOp) {
        let call = MockCall {
            at: self.clock.now(),
            alloc_id: alloc_id.clone(),
            task: task.clone(),
            op,
        };
        self.lock().push_call(call);
    }

    /// The first half of start: creates the task and writes its first output.
    fn launch(&self, request: &StartRequest, config: MockConfig) -> (TaskHandle, MockTask) {
        let mut state = self.lock();
        let run = state.next_run;
        state.next_run += 1;
        let handle = TaskHandle {
            driver: DriverKind::Mock,
            id: format!("{}/{}/{run}", request.alloc_id, request.task),
            pid: None,
            started_at: self.clock.now(),
        };
        let first_output = config.stdout_string.clone().unwrap_or_default();
        state.history.insert(
            handle.id.clone(),
            TaskRecord {
                alloc_id: request.alloc_id.clone(),
                task: request.task.clone(),
                stdout: first_output,
            },
        );
        let task = MockTask {
            handle: handle.clone(),
            config,
            exit: watch::Sender::new(None),
            interrupted: false,
            stopping: false,
            ended: CancellationToken::new(),
        };
        (handle, task)
    }
}

impl State {
    /// Remembers `call`, forgetting the oldest past the limit.
    fn push_call(&mut self, call: MockCall) {
        if self.calls.len() >= self.limit {
            self.calls.pop_front();
        }
        self.calls.push_back(call);
    }

    /// Keeps destroyed task `id`'s output among the last `limit` destroyed.
    fn retire(&mut self, id: String) {
        if self.retired.len() >= self.limit
            && let Some(oldest) = self.retired.pop_front()
        {
            self.history.remove(&oldest);
        }
        self.retired.push_back(id);
    }

    /// Ends task `id` with `result` unless it has already ended; returns whether it did.
    fn finish(&mut self, id: &str, result: ExitResult) -> bool {
        let Some(task) = self.tasks.get(id) else {
            return false;
        };
        if task.exit.borrow().is_some() {
            return false;
        }
        let exit_code = result.exit_code;
        task.exit.send_replace(Some(Ended {
            result,
            interrupted: task.interrupted,
        }));
        task.ended.cancel();
        if let Some(record) = self.history.get(id) {
            let call = MockCall {
                at: self.clock.now(),
                alloc_id: record.alloc_id.clone(),
                task: record.task.clone(),
                op: MockOp::Exited { exit_code },
            };
            self.push_call(call);
        }
        true
    }
}

/// Whether a task has anything for [`live`] to do: output to repeat or a `runFor` exit.
fn has_timers(config: &MockConfig) -> bool {
    config.run_for.is_some()
        || (config
            .stdout_string
            .as_deref()
            .is_some_and(|s| !s.is_empty())
            && config.stdout_repeat.unwrap_or(0) > 0)
}

/// Runs task `id`'s timers: its repeated stdout and its `runFor` exit.
async fn live(inner: Weak<Inner>, id: String, config: MockConfig, ended: CancellationToken) {
    let write_output = async {
        let Some(output) = config.stdout_string.as_deref().filter(|s| !s.is_empty()) else {
            return;
        };
        let pause = config
            .stdout_repeat_duration
            .map_or(Duration::ZERO, |d| d.get());
        for _ in 0..config.stdout_repeat.unwrap_or(0) {
            tokio::time::sleep(pause).await;
            let Some(inner) = inner.upgrade() else { return };
            if let Some(record) = inner.lock().history.get_mut(&id) {
                record.stdout.push_str(output);
            }
        }
    };
    let run_out = async {
        match config.run_for {
            Some(run_for) => tokio::time::sleep(run_for.get()).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        biased;
        () = ended.cancelled() => {}
        () = async { write_output.await; std::future::pending::<()>().await } => {}
        () = run_out => {
            if let Some(inner) = inner.upgrade() {
                inner.lock().finish(&id, ExitResult {
                    exit_code: config.exit_code.unwrap_or(0),
                    signal: config.exit_signal,
                    error: config.exit_err_msg.clone(),
                    oom_killed: false,
                    at: None,
                });
            }
        }
    }
}

/// Records `StartCancelled` when a start future is dropped before it returns.
struct StartGuard {
    inner: Arc<Inner>,
    alloc_id: AllocId,
    task: Name,
    returned: bool,
}

impl StartGuard {
    fn returned(mut self, ok: bool) {
        self.returned = true;
        self.inner
            .record_for(&self.alloc_id, &self.task, MockOp::StartReturned { ok });
    }
}

impl Drop for StartGuard {
    fn drop(&mut self) {
        if !self.returned {
            self.inner
                .record_for(&self.alloc_id, &self.task, MockOp::StartCancelled);
        }
    }
}

impl Driver for MockDriver {
    fn kind(&self) -> DriverKind {
        DriverKind::Mock
    }

    fn fingerprint(&self) -> BoxFuture<'_, Fingerprint> {
        let health = self.inner.lock().health;
        Box::pin(async move {
            Fingerprint {
                health,
                description: health.to_string(),
                attributes: BTreeMap::from([("driver.mock".to_owned(), "true".to_owned())]),
            }
        })
    }

    fn start(&self, request: StartRequest) -> BoxFuture<'_, Result<TaskHandle, DriverError>> {
        let inner = Arc::clone(&self.inner);
        inner.record_for(&request.alloc_id, &request.task, MockOp::StartBegan);
        let guard = StartGuard {
            inner: Arc::clone(&inner),
            alloc_id: request.alloc_id.clone(),
            task: request.task.clone(),
            returned: false,
        };
        Box::pin(async move {
            let fail = |message: String, recoverable: bool| DriverError::Start {
                alloc_id: request.alloc_id.clone(),
                task: request.task.clone(),
                message,
                recoverable,
            };
            let config = match &request.config {
                DriverConfig::Mock(config) => config.clone(),
                DriverConfig::Exec(_) => {
                    guard.returned(false);
                    return Err(fail(
                        "the mock driver was given exec options".to_owned(),
                        false,
                    ));
                }
            };
            if let Some(block) = config.start_block_for {
                tokio::time::sleep(block.get()).await;
            }
            if let Some(message) = &config.start_error {
                guard.returned(false);
                let recoverable = config.start_error_recoverable.unwrap_or(false);
                return Err(fail(message.clone(), recoverable));
            }
            let (handle, task) = inner.launch(&request, config.clone());
            let ended = task.ended.clone();
            inner.lock().tasks.insert(handle.id.clone(), task);
            // A task with nothing timed holds no timer task: at thousands of tasks, each
            // idle timer's future was most of the driver's memory per task.
            if has_timers(&config) {
                tokio::spawn(live(
                    Arc::downgrade(&inner),
                    handle.id.clone(),
                    config,
                    ended,
                ));
            }
            guard.returned(true);
            Ok(handle)
        })
    }

    fn wait(&self, handle: TaskHandle) -> BoxFuture<'static, ExitResult> {
        let inner = Arc::clone(&self.inner);
        let exit = inner
            .lock()
            .tasks
            .get(&handle.id)
            .map(|task| task.exit.subscribe());
        Box::pin(async move {
            let Some(mut exit) = exit else {
                return ExitResult {
                    exit_code: 0,
                    signal: None,
                    error: Some(format!("task {} is unknown to the mock driver", handle.id)),
                    oom_killed: false,
                    at: None,
                };
            };
            let ended = match exit.wait_for(Option::is_some).await {
                Ok(ended) => ended.clone(),
                // The task was destroyed without an exit; destroy always sets one first.
                Err(_) => None,
            };
            let Some(ended) = ended else {
                return ExitResult {
                    exit_code: 0,
                    signal: None,
                    error: Some(format!("task {} was destroyed", handle.id)),
                    oom_killed: false,
                    at: None,
                };
            };
            if ended.interrupted && inner.lock().hang_wait_after_kill {
                std::future::pending::<()>().await;
            }
            ended.result
        })
    }

    fn signal(
        &self,
        handle: &TaskHandle,
        signal: &Signal,
    ) -> BoxFuture<'_, Result<(), DriverError>> {
        let id = handle.id.clone();
        let signal = signal.clone();
        Box::pin(async move {
            self.inner
                .record(&id, MockOp::Signal(signal.as_str().to_owned()));
            let number = signal_number(&signal);
            let mut state = self.inner.lock();
            let Some(task) = state.tasks.get_mut(&id) else {
                return Err(DriverError::UnknownTask { id });
            };
            if let Some(message) = &task.config.signal_error {
                return Err(DriverError::Signal {
                    id,
                    signal: signal.to_string(),
                    message: message.clone(),
                });
            }
            if task.exit.borrow().is_some() {
                return Ok(());
            }
            task.interrupted = true;
            if number == 9 {
                state.finish(&id, KILLED);
                return Ok(());
            }
            if NON_TERMINATING_SIGNALS.contains(&signal.as_str()) || task.stopping {
                return Ok(());
            }
            task.stopping = true;
            let result = ExitResult {
                exit_code: 128 + number,
                signal: Some(number),
                error: None,
                oom_killed: false,
                at: None,
            };
            match task.config.kill_after.map(|d| d.get()) {
                Some(delay) if !delay.is_zero() => {
                    let inner = Arc::downgrade(&self.inner);
                    let ended = task.ended.clone();
                    tokio::spawn(async move {
                        tokio::select! {
                            biased;
                            () = ended.cancelled() => {}
                            () = tokio::time::sleep(delay) => {
                                if let Some(inner) = inner.upgrade() {
                                    inner.lock().finish(&id, result);
                                }
                            }
                        }
                    });
                }
                _ => {
                    state.finish(&id, result);
                }
            }
            Ok(())
        })
    }

    fn kill(&self, handle: &TaskHandle) -> BoxFuture<'_, Result<(), DriverError>> {
        let id = handle.id.clone();
        Box::pin(async move {
            self.inner.record(&id, MockOp::Kill);
            let mut state = self.inner.lock();
            let Some(task) = state.tasks.get_mut(&id) else {
                return Err(DriverError::UnknownTask { id });
            };
            if task.exit.borrow().is_none() {
                task.interrupted = true;
                state.finish(&id, KILLED);
            }
            Ok(())
        })
    }

    fn recover(&self, handle: &TaskHandle) -> BoxFuture<'_, Result<(), DriverError>> {
        let handle = handle.clone();
        Box::pin(async move {
            // Like a pid check that also compares the start time: a handle whose
            // details differ names another run.
            let found = self
                .inner
                .lock()
                .tasks
                .get(&handle.id)
                .is_some_and(|task| task.handle == handle);
            self.inner.record(&handle.id, MockOp::Recover { ok: found });
            if found {
                Ok(())
            } else {
                Err(DriverError::UnknownTask { id: handle.id })
            }
        })
    }

    /// The mock's tasks outlive the agent (clones share them), so a new agent finds the
    /// live ones no record names, as the exec driver finds them in the alloc dirs.
    fn unrecorded_runs(&self, recorded: &RecordedRuns) -> Vec<UnrecordedRun> {
        let known: std::collections::BTreeSet<&str> = recorded
            .handles
            .iter()
            .filter(|handle| handle.driver == DriverKind::Mock)
            .map(|handle| handle.id.as_str())
            .collect();
        let state = self.inner.lock();
        state
            .tasks
            .values()
            .filter(|task| task.exit.borrow().is_none() && !known.contains(task.handle.id.as_str()))
            .filter_map(|task| {
                let record = state.history.get(&task.handle.id)?;
                let alloc_id = record.alloc_id.to_string();
                (!recorded.unreadable_alloc(&alloc_id)).then(|| UnrecordedRun {
                    alloc_id,
                    task: record.task.clone(),
                    handle: task.handle.clone(),
                })
            })
            .collect()
    }

    fn destroy(&self, handle: &TaskHandle) -> BoxFuture<'_, ()> {
        let id = handle.id.clone();
        Box::pin(async move {
            self.inner.record(&id, MockOp::Destroy);
            let mut state = self.inner.lock();
            // A task destroyed while it runs is killed first, so its waits resolve.
            if let Some(task) = state.tasks.get_mut(&id)
                && task.exit.borrow().is_none()
            {
                task.interrupted = true;
                state.finish(&id, KILLED);
            }
            if state.tasks.remove(&id).is_some() {
                state.retire(id);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use stead_schemas::parse_spec_file;

    use super::*;

    const T0: Timestamp = Timestamp::from_since_epoch(Duration::from_secs(1_000_000));

    fn driver() -> MockDriver {
        MockDriver::new(Clock::starting_at(T0))
    }

    fn at(secs: u64) -> Timestamp {
        T0 + Duration::from_secs(secs)
    }

    fn alloc_id(name: &str) -> AllocId {
        let yaml = format!(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata:\n  name: {name}\nspec:\n  tasks:\n    - name: main\n      driver: mock\n      config: {{}}\n"
        );
        let file = parse_spec_file(Path::new("test.yaml"), &yaml);
        file.documents[0]
            .spec
            .as_ref()
            .expect("the test spec is valid")
            .id
            .clone()
    }

    fn request(alloc: &str, config: MockConfig) -> StartRequest {
        StartRequest {
            alloc_id: alloc_id(alloc),
            task: "main".parse().expect("a valid name"),
            config: DriverConfig::Mock(config),
            env: BTreeMap::new(),
            user: None,
            logs: crate::driver::LogLimits {
                max_files: 10,
                max_file_size_mb: 10,
            },
            devices: crate::driver::DeviceAccess::default(),
            resources: crate::driver::TaskResources::default(),
        }
    }

    fn secs(n: u64) -> Option<stead_schemas::Duration> {
        Some(stead_schemas::Duration::from_secs(n))
    }

    fn sig(name: &str) -> Signal {
        name.parse().expect("a known signal")
    }

    fn exit(exit_code: i32, signal: Option<i32>) -> ExitResult {
        ExitResult {
            exit_code,
            signal,
            ..ExitResult::default()
        }
    }

    async fn start(driver: &MockDriver, alloc: &str, config: MockConfig) -> TaskHandle {
        driver
            .start(request(alloc, config))
            .await
            .expect("the task starts")
    }

    /// Whether `wait` resolves within `within` of paused time.
    async fn exits_within(driver: &MockDriver, handle: &TaskHandle, within: Duration) -> bool {
        tokio::time::timeout(within, driver.wait(handle.clone()))
            .await
            .is_ok()
    }

    fn ops(driver: &MockDriver) -> Vec<(Timestamp, String, MockOp)> {
        driver
            .calls()
            .into_iter()
            .map(|call| (call.at, call.alloc_id.as_str()[..1].to_owned(), call.op))
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn run_for_exits_with_exit_code_after_the_duration() {
        let driver = driver();
        let config = MockConfig {
            run_for: secs(10),
            exit_code: Some(3),
            exit_signal: Some(6),
            exit_err_msg: Some("boom".to_owned()),
            ..MockConfig::default()
        };
        let handle = start(&driver, "a", config).await;
        assert_eq!(handle.started_at, T0);
        assert!(!exits_within(&driver, &handle, Duration::from_secs(9)).await);
        assert_eq!(driver.running(), std::slice::from_ref(&handle));
        let result = driver.wait(handle).await;
        assert_eq!(driver.inner.clock.now(), at(10));
        assert_eq!(
            result,
            ExitResult {
                exit_code: 3,
                signal: Some(6),
                error: Some("boom".to_owned()),
                oom_killed: false,
                at: None,
            }
        );
        assert!(driver.running().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn without_run_for_the_task_runs_until_killed() {
        let driver = driver();
        let handle = start(&driver, "a", MockConfig::default()).await;
        assert!(!exits_within(&driver, &handle, Duration::from_secs(3600)).await);
        driver.kill(&handle).await.expect("the task is known");
        assert_eq!(driver.wait(handle).await, exit(137, Some(9)));
    }

    #[tokio::test(start_paused = true)]
    async fn start_error_is_recoverable_only_when_asked() {
        let driver = driver();
        for (asked, recoverable) in [(None, false), (Some(false), false), (Some(true), true)] {
            let config = MockConfig {
                start_error: Some("no luck".to_owned()),
                start_error_recoverable: asked,
                ..MockConfig::default()
            };
            let error = driver
                .start(request("a", config))
                .await
                .expect_err("start fails");
            let DriverError::Start {
                message,
                recoverable: got,
                ..
            } = &error
            else {
                panic!("not a start error: {error:?}");
            };
            assert_eq!((message.as_str(), *got), ("no luck", recoverable));
            assert!(
                error
                    .to_string()
                    .starts_with("starting task main of alloc a-")
            );
        }
        assert!(driver.running().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn start_with_exec_options_fails_unrecoverably() {
        let driver = driver();
        let mut request = request("a", MockConfig::default());
        request.config = DriverConfig::Exec(stead_schemas::spec::ExecConfig {
            command: "/bin/true".to_owned(),
            args: None,
        });
        let error = driver.start(request).await.expect_err("start fails");
        assert!(matches!(
            error,
            DriverError::Start {
                recoverable: false,
                ..
            }
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn start_blocks_for_start_block_for() {
        let driver = driver();
        let config = MockConfig {
            start_block_for: secs(5),
            ..MockConfig::default()
        };
        let handle = start(&driver, "a", config).await;
        assert_eq!(handle.started_at, at(5));
        assert_eq!(
            ops(&driver),
            [
                (at(0), "a".to_owned(), MockOp::StartBegan),
                (at(5), "a".to_owned(), MockOp::StartReturned { ok: true }),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn another_alloc_starts_while_one_start_is_blocked() {
        let driver = driver();
        let blocked = MockConfig {
            start_block_for: secs(60),
            ..MockConfig::default()
        };
        let slow = tokio::spawn({
            let driver = driver.clone();
            async move { start(&driver, "a", blocked).await }
        });
        // Let the spawned start begin, then start b.
        while driver.calls().is_empty() {
            tokio::task::yield_now().await;
        }
        let b = start(&driver, "b", MockConfig::default()).await;
        assert_eq!(b.started_at, at(0));
        let a = slow.await.expect("the start task does not panic");
        assert_eq!(a.started_at, at(60));
        assert_eq!(
            ops(&driver),
            [
                (at(0), "a".to_owned(), MockOp::StartBegan),
                (at(0), "b".to_owned(), MockOp::StartBegan),
                (at(0), "b".to_owned(), MockOp::StartReturned { ok: true }),
                (at(60), "a".to_owned(), MockOp::StartReturned { ok: true }),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_start_dropped_while_blocked_is_logged_as_cancelled_and_starts_nothing() {
        let driver = driver();
        let config = MockConfig {
            start_block_for: secs(60),
            ..MockConfig::default()
        };
        let timed_out = tokio::time::timeout(Duration::from_secs(5), start(&driver, "a", config))
            .await
            .is_err();
        assert!(timed_out);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(driver.running().is_empty());
        assert_eq!(
            ops(&driver),
            [
                (at(0), "a".to_owned(), MockOp::StartBegan),
                (at(5), "a".to_owned(), MockOp::StartCancelled),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn task_ids_are_unique_per_run() {
        let driver = driver();
        let first = start(&driver, "a", MockConfig::default()).await;
        let second = start(&driver, "a", MockConfig::default()).await;
        assert_ne!(first.id, second.id);
        assert!(first.id.starts_with(&format!("{}/main/", alloc_id("a"))));
        assert_eq!((first.driver, first.pid), (DriverKind::Mock, None));
        assert_eq!(driver.running().len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn kill_after_delays_the_exit_after_a_signal() {
        let driver = driver();
        let config = MockConfig {
            kill_after: secs(5),
            ..MockConfig::default()
        };
        let handle = start(&driver, "a", config).await;
        driver
            .signal(&handle, &Signal::sigint())
            .await
            .expect("signal is delivered");
        // A second signal does not postpone the exit.
        tokio::time::sleep(Duration::from_secs(2)).await;
        driver
            .signal(&handle, &sig("SIGTERM"))
            .await
            .expect("signal is delivered");
        assert_eq!(driver.running(), std::slice::from_ref(&handle));
        assert_eq!(driver.wait(handle).await, exit(130, Some(2)));
        assert_eq!(driver.inner.clock.now(), at(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_terminating_signal_without_kill_after_ends_the_task_at_once() {
        let driver = driver();
        let handle = start(&driver, "a", MockConfig::default()).await;
        driver
            .signal(&handle, &sig("SIGTERM"))
            .await
            .expect("signal is delivered");
        assert!(driver.running().is_empty());
        assert_eq!(driver.wait(handle).await, exit(143, Some(15)));
    }

    #[tokio::test(start_paused = true)]
    async fn sigkill_ends_the_task_at_once_despite_kill_after() {
        let driver = driver();
        let config = MockConfig {
            kill_after: secs(5),
            ..MockConfig::default()
        };
        let handle = start(&driver, "a", config).await;
        driver
            .signal(&handle, &sig("SIGKILL"))
            .await
            .expect("signal is delivered");
        assert_eq!(driver.wait(handle).await, exit(137, Some(9)));
        assert_eq!(driver.inner.clock.now(), at(0));
    }

    #[tokio::test(start_paused = true)]
    async fn non_terminating_signals_leave_the_task_running() {
        let driver = driver();
        let handle = start(&driver, "a", MockConfig::default()).await;
        for name in NON_TERMINATING_SIGNALS {
            driver
                .signal(&handle, &sig(name))
                .await
                .expect("signal is delivered");
        }
        assert!(!exits_within(&driver, &handle, Duration::from_secs(3600)).await);
        assert_eq!(driver.running(), [handle]);
    }

    #[tokio::test(start_paused = true)]
    async fn kill_ends_the_task_at_once_even_during_kill_after() {
        let driver = driver();
        let config = MockConfig {
            kill_after: secs(30),
            ..MockConfig::default()
        };
        let handle = start(&driver, "a", config).await;
        driver
            .signal(&handle, &Signal::sigint())
            .await
            .expect("signal is delivered");
        tokio::time::sleep(Duration::from_secs(1)).await;
        driver.kill(&handle).await.expect("the task is known");
        assert!(driver.running().is_empty());
        assert_eq!(driver.wait(handle.clone()).await, exit(137, Some(9)));
        // The pending kill_after exit does not replace the kill's.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(driver.wait(handle).await, exit(137, Some(9)));
    }

    #[tokio::test(start_paused = true)]
    async fn signal_error_fails_signal() {
        let driver = driver();
        let config = MockConfig {
            signal_error: Some("deaf".to_owned()),
            ..MockConfig::default()
        };
        let handle = start(&driver, "a", config).await;
        let error = driver
            .signal(&handle, &Signal::sigint())
            .await
            .expect_err("signal fails");
        assert!(matches!(
            &error,
            DriverError::Signal { id, signal, message }
                if *id == handle.id && signal == "SIGINT" && message == "deaf"
        ));
        assert_eq!(
            error.to_string(),
            format!("sending SIGINT to task {} failed: deaf", handle.id)
        );
        assert_eq!(driver.running(), [handle]);
    }

    #[tokio::test(start_paused = true)]
    async fn signalling_or_killing_an_unknown_task_fails() {
        let driver = driver();
        let handle = TaskHandle {
            driver: DriverKind::Mock,
            id: "nobody".to_owned(),
            pid: None,
            started_at: T0,
        };
        let signalled = driver.signal(&handle, &Signal::sigint()).await;
        assert!(matches!(signalled, Err(DriverError::UnknownTask { id }) if id == "nobody"));
        let killed = driver.kill(&handle).await;
        assert!(matches!(killed, Err(DriverError::UnknownTask { .. })));
        assert!(
            driver.calls().is_empty(),
            "calls about unknown ids are not logged"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn stdout_repeats() {
        let driver = driver();
        let config = MockConfig {
            stdout_string: Some("hi\n".to_owned()),
            stdout_repeat: Some(2),
            stdout_repeat_duration: secs(1),
            ..MockConfig::default()
        };
        let handle = start(&driver, "a", config).await;
        assert_eq!(driver.stdout(&handle.id), "hi\n");
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert_eq!(driver.stdout(&handle.id), "hi\nhi\n");
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(driver.stdout(&handle.id), "hi\nhi\nhi\n");
        assert_eq!(driver.running(), std::slice::from_ref(&handle));
        // The output outlives the task, as log files do.
        driver.kill(&handle).await.expect("the task is known");
        driver.destroy(&handle).await;
        assert_eq!(driver.stdout(&handle.id), "hi\nhi\nhi\n");
    }

    #[tokio::test(start_paused = true)]
    async fn stdout_stops_when_the_task_ends() {
        let driver = driver();
        let config = MockConfig {
            run_for: secs(2),
            stdout_string: Some("x".to_owned()),
            stdout_repeat: Some(100),
            stdout_repeat_duration: secs(1),
            ..MockConfig::default()
        };
        let handle = start(&driver, "a", config).await;
        driver.wait(handle.clone()).await;
        tokio::time::sleep(Duration::from_secs(60)).await;
        let written = driver.stdout(&handle.id).len();
        assert!((2..=3).contains(&written), "{written} writes");
    }

    #[tokio::test(start_paused = true)]
    async fn recover_finds_a_task_started_by_another_handle_holder() {
        let first_agent = driver();
        let handle = start(&first_agent, "a", MockConfig::default()).await;
        let second_agent = first_agent.clone();
        second_agent
            .recover(&handle)
            .await
            .expect("the task is still running");
        assert_eq!(second_agent.running(), std::slice::from_ref(&handle));
        let waiting = tokio::spawn(second_agent.wait(handle.clone()));
        second_agent.kill(&handle).await.expect("the task is known");
        let result = waiting.await.expect("the wait does not panic");
        assert_eq!(result, exit(137, Some(9)));
    }

    #[tokio::test(start_paused = true)]
    async fn recover_of_a_task_that_exited_while_the_agent_was_down_yields_its_exit() {
        let driver = driver();
        let handle = start(&driver, "a", MockConfig::default()).await;
        assert!(driver.exit_task(&handle.id, exit(1, None)));
        assert!(
            !driver.exit_task(&handle.id, exit(2, None)),
            "it ended already"
        );
        driver.recover(&handle).await.expect("the task is known");
        assert_eq!(driver.wait(handle).await, exit(1, None));
    }

    #[tokio::test(start_paused = true)]
    async fn recover_of_an_unknown_task_fails() {
        let driver = driver();
        let made_up = TaskHandle {
            driver: DriverKind::Mock,
            id: "a-12345678/main/99".to_owned(),
            pid: None,
            started_at: T0,
        };
        let error = driver
            .recover(&made_up)
            .await
            .expect_err("nothing to recover");
        assert!(matches!(&error, DriverError::UnknownTask { id } if *id == made_up.id));
        assert_eq!(
            error.to_string(),
            "task a-12345678/main/99 is unknown to the driver"
        );

        let handle = start(&driver, "a", MockConfig::default()).await;
        let other_run = TaskHandle {
            started_at: at(1),
            ..handle.clone()
        };
        assert!(
            driver.recover(&other_run).await.is_err(),
            "start time differs"
        );
        driver.kill(&handle).await.expect("the task is known");
        driver.destroy(&handle).await;
        assert!(driver.recover(&handle).await.is_err(), "destroyed");
    }

    #[tokio::test(start_paused = true)]
    async fn destroy_kills_a_running_task_and_forgets_it() {
        let driver = driver();
        let handle = start(&driver, "a", MockConfig::default()).await;
        let waiting = driver.wait(handle.clone());
        driver.destroy(&handle).await;
        assert!(driver.running().is_empty());
        assert_eq!(waiting.await, exit(137, Some(9)));
        let late = driver.wait(handle).await;
        assert!(late.error.is_some_and(|e| e.contains("unknown")));
    }

    #[tokio::test(start_paused = true)]
    async fn wait_resolves_for_every_caller() {
        let driver = driver();
        let config = MockConfig {
            run_for: secs(10),
            exit_code: Some(4),
            ..MockConfig::default()
        };
        let handle = start(&driver, "a", config).await;
        let early: Vec<_> = (0..3)
            .map(|_| tokio::spawn(driver.wait(handle.clone())))
            .collect();
        for waiting in early {
            let result = waiting.await.expect("the wait does not panic");
            assert_eq!(result, exit(4, None));
        }
        assert_eq!(driver.inner.clock.now(), at(10));
        // After the exit, a wait resolves at once with the same result.
        assert_eq!(driver.wait(handle).await, exit(4, None));
        assert_eq!(driver.inner.clock.now(), at(10));
    }

    #[tokio::test(start_paused = true)]
    async fn hang_wait_after_kill_never_resolves() {
        let driver = driver();
        driver.hang_wait_after_kill(true);
        let killed = start(&driver, "a", MockConfig::default()).await;
        let signalled = start(&driver, "b", MockConfig::default()).await;
        let exited = start(
            &driver,
            "c",
            MockConfig {
                run_for: secs(1),
                ..MockConfig::default()
            },
        )
        .await;
        driver.kill(&killed).await.expect("the task is known");
        driver
            .signal(&signalled, &sig("SIGTERM"))
            .await
            .expect("signal is delivered");
        assert!(driver.running().iter().all(|h| h.id == exited.id));
        let hour = Duration::from_secs(3600);
        assert!(!exits_within(&driver, &killed, hour).await);
        assert!(!exits_within(&driver, &signalled, hour).await);
        assert!(exits_within(&driver, &exited, hour).await, "not killed");
        driver.hang_wait_after_kill(false);
        assert_eq!(driver.wait(killed).await, exit(137, Some(9)));
    }

    #[tokio::test(start_paused = true)]
    async fn fingerprint_reports_the_health_set() {
        let driver = driver();
        assert_eq!(driver.kind(), DriverKind::Mock);
        assert_eq!(driver.fingerprint().await.health, Health::Healthy);
        driver.set_health(Health::Unhealthy);
        let fingerprint = driver.fingerprint().await;
        assert_eq!(fingerprint.health, Health::Unhealthy);
        assert_eq!(fingerprint.description, "unhealthy");
        assert_eq!(fingerprint.attributes["driver.mock"], "true");
    }

    #[tokio::test(start_paused = true)]
    async fn call_log_records_every_operation_in_order() {
        let driver = driver();
        let handle = start(&driver, "a", MockConfig::default()).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        driver
            .signal(&handle, &sig("SIGHUP"))
            .await
            .expect("signal is delivered");
        driver.kill(&handle).await.expect("the task is known");
        driver.recover(&handle).await.expect("the task is known");
        tokio::time::sleep(Duration::from_secs(1)).await;
        driver.destroy(&handle).await;
        let _ = driver.recover(&handle).await;
        assert_eq!(
            ops(&driver),
            [
                (at(0), "a".to_owned(), MockOp::StartBegan),
                (at(0), "a".to_owned(), MockOp::StartReturned { ok: true }),
                (at(1), "a".to_owned(), MockOp::Signal("SIGHUP".to_owned())),
                (at(1), "a".to_owned(), MockOp::Kill),
                (at(1), "a".to_owned(), MockOp::Exited { exit_code: 137 }),
                (at(1), "a".to_owned(), MockOp::Recover { ok: true }),
                (at(2), "a".to_owned(), MockOp::Destroy),
                (at(2), "a".to_owned(), MockOp::Recover { ok: false }),
            ]
        );
        assert_eq!(driver.calls()[0].task.as_str(), "main");
    }

    #[tokio::test(start_paused = true)]
    async fn only_the_last_calls_and_destroyed_tasks_are_remembered() {
        let driver = MockDriver::with_history(Clock::starting_at(T0), 3);
        let mut handles = Vec::new();
        for _ in 0..3 {
            let handle = start(
                &driver,
                "a",
                MockConfig {
                    stdout_string: Some("out".to_owned()),
                    ..MockConfig::default()
                },
            )
            .await;
            driver.destroy(&handle).await;
            handles.push(handle);
        }
        // Twelve calls made (start began, start returned, destroy and the exit it caused,
        // three times): the last three are kept, oldest first.
        assert_eq!(
            ops(&driver)
                .into_iter()
                .map(|(_, _, op)| op)
                .collect::<Vec<_>>(),
            [
                MockOp::StartReturned { ok: true },
                MockOp::Destroy,
                MockOp::Exited { exit_code: 137 }
            ]
        );
        // The three destroyed tasks' output is still there; a fourth pushes out the first.
        assert!(handles.iter().all(|h| driver.stdout(&h.id) == "out"));
        let fourth = start(&driver, "a", MockConfig::default()).await;
        driver.destroy(&fourth).await;
        assert_eq!(driver.stdout(&handles[0].id), "");
        assert_eq!(driver.stdout(&handles[1].id), "out");
        let state = driver.inner.lock();
        assert_eq!((state.calls.len(), state.history.len()), (3, 3));
    }
}
