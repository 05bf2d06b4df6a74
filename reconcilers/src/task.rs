//! One task's state and how it converges: start it, restart it by its policy, or kill it
//! (signal, shutdown delay, force after the kill timeout).
//!
//! The alloc reconciler decides *whether* a task should run or die; this module decides
//! *how* to get there, one step per call, recording each step in the state so that a
//! repeated call with the same state and time repeats nothing.

use std::collections::VecDeque;
use std::time::Duration;

use stead_schemas::spec::{
    AllocBody, AllocType, DriverKind, LifecycleHook, Name, Signal, TaskSpec,
};
use stead_schemas::{RestartPolicy, Timestamp};

use crate::check::{CheckResult, CheckSettings, CheckState, CheckStatus};
use crate::event::{TaskEvent, TaskEventType};
use crate::exit::ExitResult;
use crate::restart::{Jitter, RestartDecision, RestartReason, RestartTracker, RunEnd};

/// How long after SIGKILL a driver may take to confirm the exit before the task is
/// given up as dead anyway: a driver is never trusted to report.
pub const FORCE_KILL_GRACE: Duration = Duration::from_secs(5);

/// Everything the reconcilers need to know about one task, from its validated spec with
/// defaults and agent limits applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskSettings {
    /// The task's name.
    pub name: Name,
    /// `None` for a main task.
    pub hook: Option<LifecycleHook>,
    /// Whether a prestart or poststart task keeps running beside the main tasks.
    pub sidecar: bool,
    /// Whether the task leads the alloc.
    pub leader: bool,
    /// The driver that runs it.
    pub driver: DriverKind,
    /// Time between the kill signal and SIGKILL, already capped by the agent.
    pub kill_timeout: Duration,
    /// The signal sent first on a kill.
    pub kill_signal: Signal,
    /// Wait between deciding to kill the task and sending its signal.
    pub shutdown_delay: Duration,
    /// The effective restart policy.
    pub restart: RestartPolicy,
    /// Whether a successful exit restarts (service main tasks and sidecars).
    pub restart_on_success: bool,
    /// The task's health checks, in spec order.
    pub checks: Vec<CheckSettings>,
}

impl TaskSettings {
    /// The settings of `task` in `alloc`, with `max_kill_timeout` applied.
    pub fn new(task: &TaskSpec, alloc: &AllocBody, max_kill_timeout: Duration) -> Self {
        let hook = task.lifecycle.map(|l| l.hook);
        let sidecar = task.lifecycle.and_then(|l| l.sidecar).unwrap_or(false);
        let kill_timeout = task
            .kill_timeout
            .unwrap_or(stead_schemas::normalize::DEFAULT_KILL_TIMEOUT)
            .get()
            .min(max_kill_timeout);
        let restart_on_success = match hook {
            None => alloc.effective_type() == AllocType::Service,
            Some(LifecycleHook::Prestart | LifecycleHook::Poststart) => sidecar,
            Some(LifecycleHook::Poststop) => false,
        };
        TaskSettings {
            name: task.name.clone(),
            hook,
            sidecar,
            leader: task.leader.unwrap_or(false),
            driver: task.driver,
            kill_timeout,
            kill_signal: task.kill_signal.clone().unwrap_or_else(Signal::sigint),
            shutdown_delay: task.shutdown_delay.map(|d| d.get()).unwrap_or_default(),
            restart: task.restart_policy(alloc),
            restart_on_success,
            checks: task
                .checks
                .iter()
                .flatten()
                .map(CheckSettings::new)
                .collect(),
        }
    }

    /// A main task: no lifecycle hook.
    pub fn is_main(&self) -> bool {
        self.hook.is_none()
    }

    /// A prestart or poststart task that runs beside the main tasks.
    pub fn is_sidecar(&self) -> bool {
        self.sidecar
            && matches!(
                self.hook,
                Some(LifecycleHook::Prestart | LifecycleHook::Poststart)
            )
    }

    /// A prestart or poststart task that runs to completion.
    pub fn is_ephemeral_hook(&self) -> bool {
        !self.sidecar
            && matches!(
                self.hook,
                Some(LifecycleHook::Prestart | LifecycleHook::Poststart)
            )
    }
}

/// Why a task's start is held back: the event it shows while it waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    /// `Driver Failure` or `Waiting for devices`.
    pub event_type: TaskEventType,
    /// Why, for the event.
    pub message: String,
}

/// The task's state as shown to users: Nomad's `pending | running | dead`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskPhase {
    /// Not started yet, or waiting to restart.
    Pending,
    /// Its process runs.
    Running,
    /// Finished for good (until the alloc is restarted in place).
    Dead,
}

impl TaskPhase {
    /// `pending`, `running` or `dead`.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskPhase::Pending => "pending",
            TaskPhase::Running => "running",
            TaskPhase::Dead => "dead",
        }
    }
}

/// What the driver is doing for the task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Process {
    /// Nothing runs.
    Idle,
    /// A start call is in flight.
    Starting {
        /// When it was issued.
        since: Timestamp,
    },
    /// The task runs.
    Running {
        /// When it started.
        since: Timestamp,
    },
}

/// Why a task is being killed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KillReason {
    /// The alloc is stopping.
    Stop,
    /// A user asked for a restart: the task starts again once dead.
    UserRestart,
    /// Another task failed.
    SiblingFailed(Name),
    /// The leader died.
    LeaderDead,
    /// Every main task died and this is a sidecar.
    MainTasksDead,
    /// A health check stayed unhealthy: the task restarts, and the restart counts as a
    /// failure against its restart policy.
    Unhealthy {
        /// The check.
        check: Name,
        /// The random draw of the restart's delay, taken when the restart was signalled.
        jitter: Jitter,
    },
}

impl KillReason {
    /// Whether the task starts again once dead: a user's or a check's restart.
    pub fn restarts(&self) -> bool {
        matches!(self, KillReason::UserRestart | KillReason::Unhealthy { .. })
    }
}

/// A kill in progress.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KillProgress {
    /// Why.
    pub reason: KillReason,
    /// When the kill signal is due (after any shutdown delay).
    pub signal_at: Timestamp,
    /// When the kill signal was sent.
    pub signalled_at: Option<Timestamp>,
    /// When SIGKILL was sent.
    pub forced_at: Option<Timestamp>,
    /// Whether an in-flight start was asked to stop.
    pub cancel_requested: bool,
}

/// A side effect the shell carries out for a task.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Effect {
    /// Start the task (its directory, then the driver); report `Started` or `StartFailed`.
    Start {
        /// The task.
        task: Name,
    },
    /// Stop waiting for an in-flight start, and stop the task if it started anyway;
    /// report `StartCancelled` or `Started`.
    CancelStart {
        /// The task.
        task: Name,
    },
    /// Send a signal to the task.
    Signal {
        /// The task.
        task: Name,
        /// The signal.
        signal: Signal,
    },
    /// SIGKILL the task's whole process group.
    ForceKill {
        /// The task.
        task: Name,
    },
    /// The driver never confirmed the task's exit: release its handle and stop waiting.
    Forget {
        /// The task.
        task: Name,
    },
}

/// The state of one task of an alloc; everything in it is persisted.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TaskState {
    /// Pending, running or dead.
    pub phase: TaskPhase,
    /// Whether the task failed (it is then dead).
    pub failed: bool,
    /// How many times the task was restarted.
    pub restarts: u32,
    /// How many of its runs the kernel's OOM killer ended (never reset: a counter).
    pub oom_kills: u32,
    /// When it last restarted.
    pub last_restart: Option<Timestamp>,
    /// When it last started in the alloc's current run (cleared by a run in place).
    pub started_at: Option<Timestamp>,
    /// When it died for good.
    pub finished_at: Option<Timestamp>,
    /// The restart policy's bookkeeping.
    pub tracker: RestartTracker,
    /// What the driver is doing for it.
    pub process: Process,
    /// When a pending restart is due.
    pub restart_at: Option<Timestamp>,
    /// The kill in progress, if any.
    pub kill: Option<KillProgress>,
    /// Whether `Task Setup` was emitted.
    pub set_up: bool,
    /// History, oldest first, capped.
    pub events: VecDeque<TaskEvent>,
    /// The health checks' state in the current run, by check name; a check with no
    /// entry is pending.
    pub checks: std::collections::BTreeMap<Name, CheckState>,
}

impl TaskState {
    /// A task just received: pending, with a `Received` event.
    pub fn new(now: Timestamp) -> Self {
        TaskState {
            phase: TaskPhase::Pending,
            failed: false,
            restarts: 0,
            oom_kills: 0,
            last_restart: None,
            started_at: None,
            finished_at: None,
            tracker: RestartTracker::new(now),
            process: Process::Idle,
            restart_at: None,
            kill: None,
            set_up: false,
            events: VecDeque::from([TaskEvent::received(now)]),
            checks: std::collections::BTreeMap::new(),
        }
    }

    /// Appends an event, dropping the oldest beyond `cap`.
    pub fn push_event(&mut self, event: TaskEvent, cap: usize) {
        self.events.push_back(event);
        while self.events.len() > cap.max(1) {
            self.events.pop_front();
        }
    }

    /// Whether the task is dead.
    pub fn is_dead(&self) -> bool {
        self.phase == TaskPhase::Dead
    }

    /// Whether the driver holds or may hold a process for the task.
    pub fn has_process(&self) -> bool {
        self.process != Process::Idle
    }

    /// Whether the task's process runs.
    pub fn is_running(&self) -> bool {
        matches!(self.process, Process::Running { .. })
    }

    /// Decides that the task must die for `reason`. A task with no process dies at once;
    /// otherwise the kill starts, after `extra_delay` plus the task's own shutdown delay.
    pub fn request_kill(
        &mut self,
        settings: &TaskSettings,
        reason: KillReason,
        now: Timestamp,
        cap: usize,
    ) {
        if self.is_dead() {
            return;
        }
        let announcement = match &reason {
            KillReason::SiblingFailed(failed) => Some(TaskEvent::new(
                TaskEventType::SiblingTaskFailed,
                now,
                format!("Task's sibling {:?} failed", failed.as_str()),
            )),
            KillReason::LeaderDead => Some(TaskEvent::new(
                TaskEventType::LeaderTaskDead,
                now,
                "Leader Task in Group dead",
            )),
            KillReason::MainTasksDead => Some(TaskEvent::new(
                TaskEventType::MainTasksDead,
                now,
                "Main tasks in the group died",
            )),
            KillReason::Stop | KillReason::UserRestart | KillReason::Unhealthy { .. } => None,
        };
        if let Some(kill) = &mut self.kill {
            // A stop overrides a restart in progress: the task must not come back, and
            // the kill now reads as one.
            if kill.reason.restarts() && !reason.restarts() {
                kill.reason = reason;
                let running = self.is_running();
                if let Some(event) = announcement {
                    self.push_event(event, cap);
                }
                if running {
                    self.push_event(TaskEvent::killing(now, settings.kill_timeout), cap);
                }
            }
            return;
        }
        if !self.has_process() {
            // Nothing runs: pending or waiting to restart. It simply does not start.
            self.phase = TaskPhase::Dead;
            self.restart_at = None;
            if self.started_at.is_some() {
                self.finished_at = Some(now);
            }
            return;
        }
        if let Some(event) = announcement {
            self.push_event(event, cap);
        }
        // As Nomad: a user's or a check's restart reads `Restart Signaled`, `Terminated`,
        // `Restarting`; any other kill of a running task `Killing` at once, then the
        // task's shutdown delay, then `Terminated` and `Killed`.
        let delay = if reason.restarts() {
            Duration::ZERO
        } else {
            settings.shutdown_delay
        };
        if !reason.restarts() && self.is_running() {
            self.push_event(TaskEvent::killing(now, settings.kill_timeout), cap);
            if !delay.is_zero() {
                self.push_event(TaskEvent::waiting_shutdown_delay(now, delay), cap);
            }
        }
        self.kill = Some(KillProgress {
            reason,
            signal_at: now + delay,
            signalled_at: None,
            forced_at: None,
            cancel_requested: false,
        });
    }

    /// One step towards running (`want_run`) or towards the kill in progress. Pushes the
    /// effects to carry out and lowers `wake_at` to when the next step is due. While a
    /// start is held back (`hold`: the driver is unavailable, or the alloc's devices are
    /// not free), the task stays pending with one event saying why and starts once the
    /// hold is lifted.
    #[allow(clippy::too_many_arguments)]
    pub fn drive(
        &mut self,
        settings: &TaskSettings,
        want_run: bool,
        hold: Option<&Hold>,
        now: Timestamp,
        cap: usize,
        effects: &mut Vec<Effect>,
        wake_at: &mut Option<Timestamp>,
    ) {
        let mut wake = |at: Timestamp| *wake_at = Some(wake_at.map_or(at, |w| w.min(at)));
        let task = || settings.name.clone();
        if let Some(kill) = &mut self.kill {
            match self.process {
                // Nothing runs, so the kill is over. Only a restore leaves a kill with no
                // process: the start it was cancelling had no handle and is forgotten.
                Process::Idle => self.finish_kill(settings, Duration::ZERO, now, cap),
                Process::Starting { .. } => {
                    if !kill.cancel_requested {
                        kill.cancel_requested = true;
                        effects.push(Effect::CancelStart { task: task() });
                    }
                }
                Process::Running { .. } => match (kill.signalled_at, kill.forced_at) {
                    (None, _) if now < kill.signal_at => wake(kill.signal_at),
                    (None, _) => {
                        kill.signalled_at = Some(now);
                        effects.push(Effect::Signal {
                            task: task(),
                            signal: settings.kill_signal.clone(),
                        });
                        // A task killed while it was starting had no `Killing` yet: its
                        // start completed before it could be cancelled.
                        if kill.cancel_requested {
                            self.push_event(TaskEvent::killing(now, settings.kill_timeout), cap);
                        }
                        wake(now + settings.kill_timeout);
                    }
                    (Some(signalled), None) => {
                        let force_at = signalled + settings.kill_timeout;
                        if now < force_at {
                            wake(force_at);
                        } else {
                            kill.forced_at = Some(now);
                            effects.push(Effect::ForceKill { task: task() });
                            wake(now + FORCE_KILL_GRACE);
                        }
                    }
                    (Some(_), Some(forced)) => {
                        let give_up_at = forced + FORCE_KILL_GRACE;
                        if now < give_up_at {
                            wake(give_up_at);
                        } else {
                            effects.push(Effect::Forget { task: task() });
                            let ran_for = self.ran_for(now);
                            self.process = Process::Idle;
                            self.push_event(
                                TaskEvent::new(
                                    TaskEventType::Killed,
                                    now,
                                    "Task killed; the driver did not confirm its exit",
                                ),
                                cap,
                            );
                            self.finish_kill(settings, ran_for, now, cap);
                        }
                    }
                },
            }
            return;
        }
        if !want_run || self.is_dead() || self.has_process() {
            return;
        }
        match self.restart_at {
            Some(at) if at > now => wake(at),
            _ if let Some(hold) = hold => {
                let said = self.events.back().is_some_and(|event| {
                    event.event_type == hold.event_type && event.message == hold.message
                });
                if !said {
                    self.push_event(
                        TaskEvent::new(hold.event_type, now, hold.message.clone()),
                        cap,
                    );
                }
            }
            _ => {
                self.restart_at = None;
                if !self.set_up {
                    self.set_up = true;
                    self.push_event(TaskEvent::task_setup(now), cap);
                }
                self.process = Process::Starting { since: now };
                effects.push(Effect::Start { task: task() });
            }
        }
    }

    /// The driver started the task: a new run, whose checks start pending.
    pub fn observe_started(&mut self, now: Timestamp, cap: usize) {
        self.process = Process::Running { since: now };
        self.phase = TaskPhase::Running;
        self.started_at = Some(now);
        self.checks.clear();
        self.push_event(TaskEvent::started(now), cap);
    }

    /// How long the current run has run at `now`; zero when nothing runs.
    fn ran_for(&self, now: Timestamp) -> Duration {
        match self.process {
            Process::Running { since } => now.saturating_duration_since(since),
            Process::Idle | Process::Starting { .. } => Duration::ZERO,
        }
    }

    /// A result of check `check` of the running task. Results of a task that does not
    /// run, or is being killed, are dropped: they belong to a run that is over. When
    /// the check has stayed unhealthy for its limit, the task is restarted (`Restart
    /// Signaled`, then its kill signal and timeout), and the restart counts as a failure
    /// against its restart policy. True when it is restarted.
    pub fn observe_check(
        &mut self,
        settings: &TaskSettings,
        check: &Name,
        result: CheckResult,
        jitter: Jitter,
        now: Timestamp,
        cap: usize,
    ) -> bool {
        let Process::Running { since } = self.process else {
            return false;
        };
        let Some(check_settings) = settings.checks.iter().find(|c| &c.name == check) else {
            return false;
        };
        if self.kill.is_some() {
            return false;
        }
        let state = self.checks.entry(check.clone()).or_default();
        if !state.observe(check_settings, result, since, now) {
            return false;
        }
        self.push_event(
            TaskEvent::new(
                TaskEventType::RestartSignaled,
                now,
                format!("healthcheck: check {:?} unhealthy", check.as_str()),
            ),
            cap,
        );
        let reason = KillReason::Unhealthy {
            check: check.clone(),
            jitter,
        };
        self.request_kill(settings, reason, now, cap);
        true
    }

    /// Whether every check of the task passes; `None` when it has none.
    pub fn checks_passing(&self, settings: &TaskSettings) -> Option<bool> {
        if settings.checks.is_empty() {
            return None;
        }
        Some(settings.checks.iter().all(|c| {
            self.checks
                .get(&c.name)
                .is_some_and(|s| s.status == CheckStatus::Passing)
        }))
    }

    /// The driver could not start the task.
    pub fn observe_start_failed(
        &mut self,
        settings: &TaskSettings,
        message: &str,
        recoverable: bool,
        jitter: Jitter,
        now: Timestamp,
        cap: usize,
    ) {
        self.process = Process::Idle;
        self.push_event(
            TaskEvent::new(TaskEventType::DriverFailure, now, message),
            cap,
        );
        if self.kill.is_some() {
            self.finish_kill(settings, Duration::ZERO, now, cap);
        } else {
            self.decide(
                settings,
                RunEnd::StartFailed { recoverable },
                jitter,
                now,
                cap,
            );
        }
    }

    /// An in-flight start was abandoned for a kill.
    pub fn observe_start_cancelled(&mut self, settings: &TaskSettings, now: Timestamp, cap: usize) {
        self.process = Process::Idle;
        if self.kill.is_some() {
            self.finish_kill(settings, Duration::ZERO, now, cap);
        }
    }

    /// The task's process ended.
    pub fn observe_exited(
        &mut self,
        settings: &TaskSettings,
        result: &ExitResult,
        jitter: Jitter,
        now: Timestamp,
        cap: usize,
    ) {
        // A run that ended while no agent watched shows when it ended, not when the next
        // agent found out, and ran only until then.
        let ended = result.at.filter(|at| *at <= now).unwrap_or(now);
        let ran_for = self.ran_for(ended);
        self.process = Process::Idle;
        if result.oom_killed {
            self.oom_kills = self.oom_kills.saturating_add(1);
        }
        self.push_event(TaskEvent::terminated(ended, result), cap);
        if let Some(kill) = &self.kill {
            if !kill.reason.restarts() {
                self.push_event(TaskEvent::killed(now), cap);
            }
            self.finish_kill(settings, ran_for, now, cap);
            return;
        }
        let run_end = RunEnd::Exited {
            successful: result.successful(),
            ran_for,
        };
        self.decide(settings, run_end, jitter, now, cap);
    }

    /// After an agent restart the task could not be reattached: its process is gone, ended
    /// by the host rather than by the task. As Nomad's client does, it starts again at
    /// once, without asking its restart policy: no attempt is counted and its restart
    /// count stays. A kill in progress is over.
    pub fn observe_recover_failed(
        &mut self,
        settings: &TaskSettings,
        message: &str,
        now: Timestamp,
        cap: usize,
    ) {
        self.process = Process::Idle;
        self.push_event(
            TaskEvent::new(TaskEventType::FailedRestoringTask, now, message),
            cap,
        );
        if self.kill.is_some() {
            self.finish_kill(settings, Duration::ZERO, now, cap);
        } else {
            self.phase = TaskPhase::Pending;
            self.restart_at = None;
        }
    }

    /// The kill in progress is over: the task is dead, restarts at once for a user (free:
    /// its restart policy is not asked), or, killed for a failing check after running
    /// `ran_for`, restarts as its restart policy says of a failure.
    fn finish_kill(
        &mut self,
        settings: &TaskSettings,
        ran_for: Duration,
        now: Timestamp,
        cap: usize,
    ) {
        let Some(kill) = self.kill.take() else { return };
        if let KillReason::Unhealthy { jitter, .. } = kill.reason {
            let run_end = RunEnd::Exited {
                successful: false,
                ran_for,
            };
            self.decide(settings, run_end, jitter, now, cap);
        } else if kill.reason == KillReason::UserRestart {
            self.restarts = self.restarts.saturating_add(1);
            self.last_restart = Some(now);
            self.phase = TaskPhase::Pending;
            self.restart_at = Some(now);
            self.push_event(
                TaskEvent::restarting(now, Duration::ZERO, RestartReason::Requested),
                cap,
            );
        } else {
            self.phase = TaskPhase::Dead;
            self.finished_at = Some(now);
        }
    }

    /// The restart policy's verdict on a run that ended by itself.
    fn decide(
        &mut self,
        settings: &TaskSettings,
        run_end: RunEnd,
        jitter: Jitter,
        now: Timestamp,
        cap: usize,
    ) {
        let decision = self.tracker.decide(
            &settings.restart,
            settings.restart_on_success,
            run_end,
            jitter,
            now,
        );
        match decision {
            RestartDecision::Restart { after, reason } => {
                self.restarts = self.restarts.saturating_add(1);
                self.last_restart = Some(now);
                self.phase = TaskPhase::Pending;
                self.restart_at = Some(now + after);
                self.push_event(TaskEvent::restarting(now, after, reason), cap);
            }
            RestartDecision::DoNotRestart { failed, reason } => {
                self.phase = TaskPhase::Dead;
                self.failed = failed;
                self.finished_at = Some(now);
                if failed {
                    self.push_event(
                        TaskEvent::new(TaskEventType::NotRestarting, now, reason.to_string()),
                        cap,
                    );
                }
            }
        }
    }

    /// Back to pending for a run in place (`desiredStatus` stop, then run): history and
    /// restart count stay, the policy's window starts over, and the task has not started
    /// in this run, so the lifecycle stages wait for it as on a first run.
    pub fn reset_for_rerun(&mut self, now: Timestamp) {
        self.phase = TaskPhase::Pending;
        self.failed = false;
        self.started_at = None;
        self.finished_at = None;
        self.tracker = RestartTracker::new(now);
        self.process = Process::Idle;
        self.restart_at = None;
        self.kill = None;
    }
}
