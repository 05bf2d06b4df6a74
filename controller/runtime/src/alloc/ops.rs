//! The worker's driver operations: each start, wait, signal, kill and destroy is spawned,
//! never awaited by the worker, and reports back through its mailbox.

use super::*;

/// What a spawned driver operation reports.
#[derive(Debug)]
pub(super) enum OpReport {
    Started(TaskHandle),
    StartFailed(DriverError),
    StartCancelled,
    Exited(ExitResult),
    RecoverFailed(DriverError),
    Check {
        check: Name,
        result: crate::checks::ProbeResult,
        /// Passing results like the last reported, not reported, before this one.
        repeats: u32,
    },
}

/// The reports of a worker's driver operations: a queue that wakes the worker through
/// its mailbox. (A channel per worker would hold a block of slots for every alloc.)
#[derive(Clone)]
pub(super) struct Reports {
    pub(super) queue: Arc<Mutex<VecDeque<Report>>>,
    pub(super) mailbox: Mailbox,
}

pub(super) type Report = (Name, u64, OpReport);

impl Reports {
    pub(super) fn send(&self, task: Name, run: u64, report: OpReport) {
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back((task, run, report));
        self.mailbox.wake();
    }

    pub(super) fn take(&self) -> VecDeque<Report> {
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// The driver operations in flight for one run of a task.
#[derive(Debug)]
pub(super) struct TaskOps {
    pub(super) run: u64,
    pub(super) cancel_start: CancellationToken,
    pub(super) cancel_wait: CancellationToken,
}

/// The variables the agent sets in every task's environment.
pub(super) fn agent_env(
    alloc_id: &stead_schemas::AllocId,
    alloc: &Name,
    task: &Name,
) -> [(String, String); 3] {
    [
        ("STEAD_ALLOC_ID".to_owned(), alloc_id.to_string()),
        ("STEAD_ALLOC_NAME".to_owned(), alloc.to_string()),
        ("STEAD_TASK_NAME".to_owned(), task.to_string()),
    ]
}

/// A task's environment as the agent gives it: the spec's, under the agent's own.
pub(super) fn task_env(
    spec: &stead_schemas::spec::TaskSpec,
    agent_env: &[(String, String)],
) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = spec
        .env
        .iter()
        .flatten()
        .map(|(k, v)| (k.as_str().to_owned(), v.clone()))
        .collect();
    env.extend(agent_env.iter().cloned());
    env
}

/// How long a run that no record named has to stop after `SIGTERM`, and again after
/// `SIGKILL`, before the worker goes on.
const UNRECORDED_KILL_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Stops a run that no record named and no start may take (another revision's, or one
/// of an alloc whose spec is gone or says stop): `SIGTERM`, up to 5 s, `SIGKILL`, up to
/// 5 s more, released. Its spec (and so its kill signal and timeout) is not known.
pub(crate) async fn stop_unrecorded(driver: Arc<dyn Driver>, handle: TaskHandle) {
    if driver.recover(&handle).await.is_err() {
        return; // gone already
    }
    tracing::warn!(id = %handle.id, pid = handle.pid, "stopping a run that no record named, which no spec runs now");
    let exited = driver.wait(handle.clone());
    tokio::pin!(exited);
    let terminate = "SIGTERM".parse::<stead_schemas::spec::Signal>().ok();
    let ended = match terminate {
        Some(signal) if driver.signal(&handle, &signal).await.is_ok() => {
            tokio::time::timeout(UNRECORDED_KILL_WAIT, &mut exited)
                .await
                .is_ok()
        }
        _ => false,
    };
    if !ended && driver.kill(&handle).await.is_ok() {
        let _ = tokio::time::timeout(UNRECORDED_KILL_WAIT, &mut exited).await;
    }
    driver.destroy(&handle).await;
}

/// Waits for the task to exit and reports it, unless cancelled first: a driver is never
/// trusted to end its wait after a kill.
pub(super) async fn watch_exit(
    driver: Arc<dyn Driver>,
    handle: TaskHandle,
    cancel: CancellationToken,
    tx: Reports,
    task: Name,
    run: u64,
) {
    tokio::select! {
        biased;
        result = driver.wait(handle) => tx.send(task, run, OpReport::Exited(result)),
        () = cancel.cancelled() => {}
    }
}

impl Worker {
    pub(super) fn new_ops(&mut self, task: &Name) -> TaskOps {
        self.next_run += 1;
        let ops = TaskOps {
            run: self.next_run,
            cancel_start: CancellationToken::new(),
            cancel_wait: CancellationToken::new(),
        };
        if let Some(old) = self.ops.insert(
            task.clone(),
            TaskOps {
                run: ops.run,
                cancel_start: ops.cancel_start.clone(),
                cancel_wait: ops.cancel_wait.clone(),
            },
        ) {
            old.cancel_start.cancel();
            old.cancel_wait.cancel();
        }
        ops
    }

    pub(super) fn execute(&mut self, effects: Vec<Effect>, now: Timestamp) {
        for effect in effects {
            match effect {
                Effect::Start { task } => self.start_task(task, now),
                Effect::CancelStart { task } => {
                    if let Some(ops) = self.ops.get(&task) {
                        ops.cancel_start.cancel();
                    }
                }
                Effect::Signal { task, signal } => {
                    if let Some((driver, handle)) = self.driver_and_handle(&task) {
                        tokio::spawn(async move {
                            // A failed kill signal is covered by the force kill at the timeout.
                            let _ = driver.signal(&handle, &signal).await;
                        });
                    }
                }
                Effect::ForceKill { task } => {
                    if let Some((driver, handle)) = self.driver_and_handle(&task) {
                        tokio::spawn(async move {
                            let _ = driver.kill(&handle).await;
                        });
                    }
                }
                Effect::Forget { task } => {
                    if let Some(ops) = self.ops.remove(&task) {
                        ops.cancel_wait.cancel();
                    }
                    if let Some((driver, handle)) = self.driver_and_handle(&task) {
                        tokio::spawn(async move { driver.destroy(&handle).await });
                    }
                    if let Some(current) = &mut self.current {
                        Arc::make_mut(&mut current.handles).remove(&task);
                    }
                }
            }
        }
    }

    /// Where a command beside `task` runs: its driver and its context, while it has a
    /// handle.
    pub(super) fn exec_target(&self, task: &Name) -> Option<crate::queue::ExecTarget> {
        let current = self.current.as_ref()?;
        let (driver, _) = self.driver_and_handle(task)?;
        let spec = current
            .spec
            .spec
            .spec
            .tasks
            .iter()
            .find(|t| t.name == *task)?;
        let agent_env = agent_env(&current.spec.id, &self.name, task);
        Some(crate::queue::ExecTarget {
            driver,
            alloc_id: current.spec.id.clone(),
            task: task.clone(),
            env: task_env(spec, &agent_env),
            user: spec.user.as_ref().map(ToString::to_string),
        })
    }

    pub(super) fn driver_and_handle(&self, task: &Name) -> Option<(Arc<dyn Driver>, TaskHandle)> {
        let handle = self.current.as_ref()?.handles.get(task)?.clone();
        let driver = self.shared.drivers.get(handle.driver)?;
        Some((driver, handle))
    }

    pub(super) fn start_task(&mut self, task: Name, now: Timestamp) {
        let Some(current) = &self.current else { return };
        let Some(spec) = current.spec.spec.spec.tasks.iter().find(|t| t.name == task) else {
            return;
        };
        let agent_env = agent_env(&current.spec.id, &self.name, &task);
        let env = task_env(spec, &agent_env);
        let (max_files, max_file_size_mb) = spec.effective_logs();
        let held = current.devices.get(&task).cloned().unwrap_or_default();
        let mut request = StartRequest {
            alloc_id: current.spec.id.clone(),
            task: task.clone(),
            config: spec.config.clone(),
            env,
            user: spec.user.as_ref().map(|u| u.to_string()),
            logs: LogLimits {
                max_files,
                max_file_size_mb,
            },
            devices: DeviceAccess::default(),
            resources: TaskResources::of(spec.resources.as_ref()),
        };
        let kind = match &spec.config {
            DriverConfig::Exec(_) => stead_schemas::spec::DriverKind::Exec,
            DriverConfig::Mock(_) => stead_schemas::spec::DriverKind::Mock,
        };
        let ops = self.new_ops(&task);
        let tx = self.reports.clone();
        let run = ops.run;
        let Some(driver) = self.shared.drivers.get(kind) else {
            let message = format!("driver {kind} is not enabled on this agent");
            let current = self.current.as_mut().expect("checked above");
            let jitter = Jitter::from_bits(self.rng.u32(..));
            current.state.observe(
                &current.desired,
                &task,
                Observation::StartFailed {
                    message,
                    recoverable: false,
                },
                jitter,
                now,
            );
            self.ops.remove(&task);
            return;
        };
        if let Some(reason) = driver.unenforced_limits(&request.resources) {
            tracing::warn!(task = %task, %reason, "task starts without its resource limits");
            let current = self.current.as_mut().expect("checked above");
            let jitter = Jitter::from_bits(self.rng.u32(..));
            current.state.observe(
                &current.desired,
                &task,
                Observation::LimitsNotEnforced { reason },
                jitter,
                now,
            );
        }
        let span = tracing::info_span!("task", task = %task, run);
        let devices = self.shared.config.devices.clone();
        let alloc_id = request.alloc_id.to_string();
        let adopted = self.shared.unrecorded.take(&alloc_id, &task);
        let holds_devices = !held.is_empty();
        let watch = (driver.clone(), tx.clone(), task.clone(), ops.cancel_wait);
        let cancel_start = ops.cancel_start;
        // The start, boxed apart from the watch that follows it: its request and the
        // futures it awaits are freed once it is over, so a running task's operation
        // holds only what waiting for its exit takes.
        let start = Box::pin(async move {
            // A run holds the devices it was given, which the lost record named: with a
            // new assignment, one instance could have two holders. Such a run is stopped
            // and its task started anew on the devices it is assigned now.
            let adopted = match adopted {
                Some(handle) if holds_devices => {
                    tracing::warn!(
                        pid = handle.pid,
                        "a run of this task that no record named holds devices no record names: stopping it to start the task on the devices assigned now"
                    );
                    stop_unrecorded(driver.clone(), handle).await;
                    None
                }
                other => other,
            };
            if let Some(handle) = adopted {
                match driver.recover(&handle).await {
                    Ok(()) => {
                        tracing::warn!(
                            pid = handle.pid,
                            "reattached a run of this task that no record named, instead of starting another"
                        );
                        tx.send(task, run, OpReport::Started(handle.clone()));
                        return Some(handle);
                    }
                    Err(error) => {
                        tracing::info!(error = %error_chain(&error), "the run of this task that no record named is gone; starting anew");
                    }
                }
            }
            if !held.is_empty() {
                match devices.reservation(&held).await {
                    Ok(reservation) => {
                        // Over the spec's env, under the agent's own variables.
                        request.env.extend(reservation.env);
                        request.env.extend(agent_env);
                        request.devices = DeviceAccess {
                            mounts: reservation.mounts,
                            device_nodes: reservation.device_nodes,
                        };
                    }
                    Err(error) => {
                        let error = DriverError::Start {
                            alloc_id: request.alloc_id.clone(),
                            task: task.clone(),
                            message: format!("reserving its devices: {error}"),
                            recoverable: true,
                        };
                        tx.send(task, run, OpReport::StartFailed(error));
                        return None;
                    }
                }
            }
            // A start cancelled meanwhile (a stop, the agent leaving) is never begun: the
            // stop of a run no record named can outlast the worker that asked for it
            // (simulator seed 107).
            let started = tokio::select! {
                biased;
                () = cancel_start.cancelled() => None,
                result = driver.start(request) => Some(result),
            };
            match started {
                None => {
                    tx.send(task, run, OpReport::StartCancelled);
                    None
                }
                Some(Err(error)) => {
                    tx.send(task, run, OpReport::StartFailed(error));
                    None
                }
                Some(Ok(handle)) => {
                    tx.send(task, run, OpReport::Started(handle.clone()));
                    Some(handle)
                }
            }
        });
        let operation = async move {
            if let Some(handle) = start.await {
                let (driver, tx, task, cancel_wait) = watch;
                watch_exit(driver, handle, cancel_wait, tx, task, run).await;
            }
        };
        tokio::spawn(tracing::Instrument::instrument(operation, span));
    }

    pub(super) fn apply_report(&mut self, task: Name, run: u64, report: OpReport, now: Timestamp) {
        if self.ops.get(&task).is_none_or(|ops| ops.run != run) {
            return; // a report from an abandoned run
        }
        let jitter = Jitter::from_bits(self.rng.u32(..));
        let Some(current) = &mut self.current else {
            return;
        };
        let observation = match report {
            OpReport::Started(handle) => {
                tracing::info!(task = %task, pid = handle.pid, "task started");
                crate::metrics::task_started();
                Arc::make_mut(&mut current.handles).insert(task.clone(), handle);
                Observation::Started
            }
            OpReport::StartFailed(error) => {
                tracing::warn!(task = %task, error = %error_chain(&error), "task failed to start");
                self.ops.remove(&task);
                let recoverable = error.is_recoverable();
                Observation::StartFailed {
                    message: error_chain(&error),
                    recoverable,
                }
            }
            OpReport::StartCancelled => {
                self.ops.remove(&task);
                Observation::StartCancelled
            }
            OpReport::Exited(result) => {
                tracing::info!(
                    task = %task,
                    exit_code = result.exit_code,
                    signal = result.signal,
                    error = result.error.as_deref(),
                    oom_killed = result.oom_killed,
                    "task exited"
                );
                self.ops.remove(&task);
                if let Some(handle) = Arc::make_mut(&mut current.handles).remove(&task)
                    && let Some(driver) = self.shared.drivers.get(handle.driver)
                {
                    tokio::spawn(async move { driver.destroy(&handle).await });
                }
                Observation::Exited(result)
            }
            OpReport::RecoverFailed(error) => {
                self.ops.remove(&task);
                Arc::make_mut(&mut current.handles).remove(&task);
                Observation::RecoverFailed {
                    message: format!("failed to reattach to the task: {}", error_chain(&error)),
                }
            }
            OpReport::Check {
                check,
                result,
                repeats,
            } => Observation::Check {
                check,
                status: result.status,
                output: result.output,
                repeats,
            },
        };
        let restarted = current
            .state
            .observe(&current.desired, &task, observation, jitter, now);
        if restarted {
            tracing::warn!(task = %task, "a health check stayed unhealthy: restarting the task");
            crate::metrics::check_restart();
        }
    }
}
