//! The alloc reconciler: lifecycle stages, leader and sibling deaths, the kill order, and
//! the alloc's client status.
//!
//! `AllocState::reconcile(&desired, now)` is level-triggered: it looks at the whole state,
//! decides for every task whether it should run or die, lets each task take its next
//! step, and returns the effects for the shell plus when it wants to be woken. What the
//! shell observes comes back through `AllocState::observe`.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use stead_schemas::Timestamp;
use stead_schemas::spec::{AllocBody, DriverKind, LifecycleHook, Name, RestartMode, Signal};

use crate::check::{CheckResult, CheckStatus};
use crate::event::{TaskEvent, TaskEventType};
use crate::exit::ExitResult;
use crate::restart::Jitter;
use crate::task::{Effect, Hold, KillReason, Process, TaskPhase, TaskSettings, TaskState};

/// Limits the agent puts on every alloc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The longest kill timeout any task gets.
    pub max_kill_timeout: Duration,
    /// How many events are kept per task.
    pub max_events: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_kill_timeout: Duration::from_secs(30),
            max_events: 50,
        }
    }
}

/// What the alloc should be: its tasks' settings, and whether it should run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocDesired {
    /// The tasks, in spec order.
    pub tasks: Vec<TaskSettings>,
    /// Run the tasks (`desiredStatus: run`, and the alloc is neither replaced nor removed).
    pub run: bool,
    /// The group's shutdown delay, waited once before a stop kills anything.
    pub shutdown_delay: Duration,
    /// Events kept per task.
    pub max_events: usize,
    /// Drivers that cannot start tasks now, with why: their tasks stay pending.
    pub unavailable_drivers: BTreeMap<DriverKind, String>,
    /// Why the alloc's devices cannot be assigned now, if so: no task starts until they
    /// are (the alloc is placed on the node as a whole, as a scheduler would place it).
    pub devices_unavailable: Option<String>,
    /// Test hook, off but in the simulator's planted-bug test: a stop kills every stage
    /// at once instead of waiting for each to die, breaking the kill order for the
    /// simulator to catch.
    pub plant_skip_kill_order: bool,
    /// A later revision of the alloc has run already (its runs, found at restore, are
    /// named by no record): this revision ended before that one started, whatever its
    /// record (stale: the store failed to take the last writes) says, so none of its
    /// poststop tasks runs again.
    pub successor_ran: bool,
}

impl AllocDesired {
    /// The desired state of `spec`; `run` says whether its tasks should run.
    pub fn new(spec: &AllocBody, run: bool, limits: Limits) -> Self {
        AllocDesired {
            tasks: spec
                .tasks
                .iter()
                .map(|t| TaskSettings::new(t, spec, limits.max_kill_timeout))
                .collect(),
            run,
            shutdown_delay: spec.shutdown_delay.map(|d| d.get()).unwrap_or_default(),
            max_events: limits.max_events,
            unavailable_drivers: BTreeMap::new(),
            devices_unavailable: None,
            plant_skip_kill_order: false,
            successor_ran: false,
        }
    }

    /// The settings of task `name`.
    pub fn task(&self, name: &Name) -> Option<&TaskSettings> {
        self.tasks.iter().find(|t| &t.name == name)
    }
}

/// Why the whole alloc is shutting down.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ShutdownReason {
    /// It was asked to stop.
    Stop,
    /// A task failed.
    TaskFailed(Name),
    /// The leader died.
    LeaderDead,
}

/// A shutdown in progress.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Shutdown {
    /// Why.
    pub reason: ShutdownReason,
    /// When it began.
    pub at: Timestamp,
}

/// The alloc's overall status, Nomad's `clientStatus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClientStatus {
    /// Some task is pending and none runs or failed.
    Pending,
    /// Some task runs and none failed.
    Running,
    /// Every task is dead and none failed.
    Complete,
    /// Some task failed.
    Failed,
}

impl ClientStatus {
    /// `pending`, `running`, `complete` or `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            ClientStatus::Pending => "pending",
            ClientStatus::Running => "running",
            ClientStatus::Complete => "complete",
            ClientStatus::Failed => "failed",
        }
    }
}

impl fmt::Display for ClientStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a reconcile asks of the shell.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// Effects to carry out, in order.
    pub effects: Vec<Effect>,
    /// When to reconcile again at the latest, if anything is due.
    pub wake_at: Option<Timestamp>,
}

/// Something the shell observed about a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    /// The driver started it.
    Started,
    /// The driver could not start it.
    StartFailed {
        /// The driver's error.
        message: String,
        /// Whether trying again may succeed.
        recoverable: bool,
    },
    /// An in-flight start was abandoned.
    StartCancelled,
    /// The driver is starting it without the resource limits its spec sets, for this
    /// reason.
    LimitsNotEnforced {
        /// Why the driver cannot enforce them.
        reason: String,
    },
    /// Its process ended.
    Exited(ExitResult),
    /// After an agent restart, it could not be reattached.
    RecoverFailed {
        /// Why.
        message: String,
    },
    /// One of its health checks gave a result.
    Check {
        /// The check.
        check: Name,
        /// The result.
        status: CheckStatus,
        /// What the check said (capped by the shell).
        output: String,
        /// Results like the last one observed (passing, same output) that came before
        /// this one and were only counted.
        repeats: u32,
    },
}

/// A user command that cannot be carried out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandRefusal {
    /// The alloc has no such task.
    UnknownTask(Name),
    /// The task (or, for a whole-alloc restart, every task) is not running.
    TaskNotRunning,
}

impl fmt::Display for CommandRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommandRefusal::UnknownTask(task) => write!(f, "unknown task {:?}", task.as_str()),
            // Nomad's wording, which operators know.
            CommandRefusal::TaskNotRunning => f.write_str("Task not running"),
        }
    }
}

impl std::error::Error for CommandRefusal {}

/// The state of one alloc revision; everything in it is persisted.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AllocState {
    /// Each task's state, by name; boxed, as a map's node has room for eleven values and
    /// most allocs have a few tasks.
    pub tasks: BTreeMap<Name, Box<TaskState>>,
    /// The shutdown in progress, if any.
    pub shutdown: Option<Shutdown>,
    /// Whether the prestart stage completed, so main tasks may run (latched).
    pub main_released: bool,
    /// Whether every main task has run, so poststart tasks may run (latched).
    pub poststart_released: bool,
}

impl AllocState {
    /// A freshly received alloc: every task pending with a `Received` event.
    pub fn new(desired: &AllocDesired, now: Timestamp) -> Self {
        AllocState {
            tasks: desired
                .tasks
                .iter()
                .map(|t| (t.name.clone(), Box::new(TaskState::new(now))))
                .collect(),
            shutdown: None,
            main_released: false,
            poststart_released: false,
        }
    }

    /// Nomad's client status: failed if any task failed, else running if any runs, else
    /// pending if any is pending, else complete.
    pub fn client_status(&self) -> ClientStatus {
        let tasks = || self.tasks.values();
        if tasks().any(|t| t.failed) {
            ClientStatus::Failed
        } else if tasks().any(|t| t.phase == TaskPhase::Running) {
            ClientStatus::Running
        } else if tasks().any(|t| t.phase == TaskPhase::Pending) {
            ClientStatus::Pending
        } else {
            ClientStatus::Complete
        }
    }

    /// Whether every task is dead and no process is left.
    pub fn is_terminal(&self) -> bool {
        self.tasks.values().all(|t| t.is_dead() && !t.has_process())
    }

    /// Whether the next [`reconcile`](Self::reconcile) with `desired` may start tasks:
    /// the alloc is not terminal and runs, or it was stopped and `desired` runs it again
    /// in place. Answered without changing anything, so the shell can first reserve what
    /// the tasks need (their devices).
    pub fn may_start(&self, desired: &AllocDesired) -> bool {
        if !desired.run {
            return false;
        }
        !self.is_terminal()
            || self
                .shutdown
                .as_ref()
                .is_some_and(|shutdown| shutdown.reason == ShutdownReason::Stop)
    }

    /// One level-triggered pass: decide what every task should do and let it act.
    pub fn reconcile(&mut self, desired: &AllocDesired, now: Timestamp) -> Plan {
        let mut plan = Plan::default();
        // A round can end a task (a kill with nothing left to wait for: no process, or a
        // driver that never confirmed the exit), which may let the next kill stage go on
        // at this same instant: rounds repeat until one ends no task, so that no stop
        // waits for a later wake-up (simulator seed 92).
        for _ in 0..=desired.tasks.len() {
            let dead = self.tasks.values().filter(|t| t.is_dead()).count();
            self.reconcile_round(desired, now, &mut plan);
            if self.tasks.values().filter(|t| t.is_dead()).count() == dead {
                break;
            }
        }
        plan
    }

    /// One round of [`AllocState::reconcile`].
    fn reconcile_round(&mut self, desired: &AllocDesired, now: Timestamp, plan: &mut Plan) {
        self.update_shutdown(desired, now);
        let want_run = match self.shutdown.clone() {
            None => self.run_stages(desired, now),
            Some(shutdown) => self.stop_stages(desired, &shutdown, now, &mut plan.wake_at),
        };
        for (settings, run) in desired.tasks.iter().zip(want_run) {
            let Some(task) = self.tasks.get_mut(&settings.name) else {
                continue;
            };
            let hold = match desired.unavailable_drivers.get(&settings.driver) {
                Some(problem) => Some(Hold {
                    event_type: TaskEventType::DriverFailure,
                    message: format!(
                        "Driver {} is unhealthy: {problem}; the task starts when it recovers",
                        settings.driver.as_str()
                    ),
                }),
                None => desired.devices_unavailable.as_ref().map(|why| Hold {
                    event_type: TaskEventType::WaitingForDevices,
                    message: format!("Waiting for devices: {why}"),
                }),
            };
            task.drive(
                settings,
                run,
                hold.as_ref(),
                now,
                desired.max_events,
                &mut plan.effects,
                &mut plan.wake_at,
            );
        }
    }

    /// Starts a shutdown when the alloc should stop, a task failed or the leader died;
    /// turns a finished shutdown into a stop when the alloc should stop; ends a stop once
    /// everything is dead and the alloc should run again.
    fn update_shutdown(&mut self, desired: &AllocDesired, now: Timestamp) {
        let terminal = self.is_terminal();
        if let Some(shutdown) = &mut self.shutdown {
            if !desired.run && terminal {
                // Failed or with its leader dead, and now stopped: asked to run again, it
                // runs in place, as a stopped alloc does. Its tasks keep their history.
                shutdown.reason = ShutdownReason::Stop;
            }
            if shutdown.reason == ShutdownReason::Stop && desired.run && terminal {
                // Stopped, then asked to run again: run in place.
                for task in self.tasks.values_mut() {
                    task.reset_for_rerun(now);
                }
                self.shutdown = None;
                self.main_released = false;
                self.poststart_released = false;
            }
            return;
        }
        let reason = if !desired.run {
            Some(ShutdownReason::Stop)
        } else if let Some((name, _)) = self.tasks.iter().find(|(_, t)| t.failed) {
            Some(ShutdownReason::TaskFailed(name.clone()))
        } else if desired
            .tasks
            .iter()
            .filter(|s| s.leader)
            .any(|s| self.tasks.get(&s.name).is_some_and(|t| t.is_dead()))
        {
            Some(ShutdownReason::LeaderDead)
        } else {
            None
        };
        self.shutdown = reason.map(|reason| Shutdown { reason, at: now });
    }

    /// Which tasks should run while the alloc runs, by lifecycle stage, in task order.
    fn run_stages(&mut self, desired: &AllocDesired, now: Timestamp) -> Vec<bool> {
        let state = |name: &Name| self.tasks.get(name);
        let prestart_done = desired
            .tasks
            .iter()
            .filter(|s| s.hook == Some(LifecycleHook::Prestart))
            .all(|s| match state(&s.name) {
                Some(t) if s.sidecar => t.is_running(),
                Some(t) => t.is_dead() && !t.failed,
                None => true,
            });
        if prestart_done {
            self.main_released = true;
        }
        let mains = || desired.tasks.iter().filter(|s| s.is_main());
        if self.main_released
            && mains().all(|s| {
                self.tasks
                    .get(&s.name)
                    .is_some_and(|t| t.started_at.is_some())
            })
        {
            self.poststart_released = true;
        }
        let all_mains_dead = mains().all(|s| self.tasks.get(&s.name).is_none_or(|t| t.is_dead()));
        let cap = desired.max_events;

        if all_mains_dead {
            // Only helpers are left: sidecars go, ephemeral hooks that never ran never will.
            for settings in &desired.tasks {
                let Some(task) = self.tasks.get_mut(&settings.name) else {
                    continue;
                };
                if settings.is_sidecar() {
                    task.request_kill(settings, KillReason::MainTasksDead, now, cap);
                } else if settings.is_ephemeral_hook() && !task.has_process() {
                    // Never ran, or waits to run again (a restart, a reattach that
                    // failed): with the main tasks gone, it will not.
                    task.request_kill(settings, KillReason::Stop, now, cap);
                }
            }
        }
        let others_dead = desired
            .tasks
            .iter()
            .filter(|s| s.hook != Some(LifecycleHook::Poststop))
            .all(|s| self.tasks.get(&s.name).is_none_or(|t| t.is_dead()));
        if others_dead && !self.run_started(desired) {
            self.give_up_poststop(desired, now);
        }
        desired
            .tasks
            .iter()
            .map(|s| match s.hook {
                Some(LifecycleHook::Prestart) => true,
                None => self.main_released,
                Some(LifecycleHook::Poststart) => self.poststart_released && !all_mains_dead,
                Some(LifecycleHook::Poststop) => others_dead,
            })
            .collect()
    }

    /// Whether a task other than a poststop one started in this run. Poststop tasks clean
    /// up after a run: where nothing started there is nothing to clean up, and waiting
    /// for them could wait for ever (a driver that never came up holds them back too).
    fn run_started(&self, desired: &AllocDesired) -> bool {
        desired
            .tasks
            .iter()
            .filter(|s| s.hook != Some(LifecycleHook::Poststop))
            .any(|s| {
                self.tasks
                    .get(&s.name)
                    .is_some_and(|t| t.started_at.is_some())
            })
    }

    /// Every poststop task that has not started ends without running.
    fn give_up_poststop(&mut self, desired: &AllocDesired, now: Timestamp) {
        for settings in desired
            .tasks
            .iter()
            .filter(|s| s.hook == Some(LifecycleHook::Poststop))
        {
            if let Some(task) = self.tasks.get_mut(&settings.name)
                && !task.has_process()
            {
                task.request_kill(settings, KillReason::Stop, now, desired.max_events);
            }
        }
    }

    /// Which tasks should run while the alloc shuts down, and which kills to start: the
    /// leader first, then the other main tasks and ephemeral hooks, then sidecars, then
    /// poststop tasks run.
    fn stop_stages(
        &mut self,
        desired: &AllocDesired,
        shutdown: &Shutdown,
        now: Timestamp,
        wake_at: &mut Option<Timestamp>,
    ) -> Vec<bool> {
        let cap = desired.max_events;
        let reason = match &shutdown.reason {
            ShutdownReason::Stop => KillReason::Stop,
            ShutdownReason::TaskFailed(task) => KillReason::SiblingFailed(task.clone()),
            ShutdownReason::LeaderDead => KillReason::LeaderDead,
        };
        let mut want_run = vec![false; desired.tasks.len()];

        // Tasks with no process do not start any more.
        for settings in desired
            .tasks
            .iter()
            .filter(|s| s.hook != Some(LifecycleHook::Poststop))
        {
            if let Some(task) = self.tasks.get_mut(&settings.name)
                && !task.has_process()
            {
                task.request_kill(settings, reason.clone(), now, cap);
            }
        }

        // The group's shutdown delay comes before any kill of a stop.
        if shutdown.reason == ShutdownReason::Stop && !desired.shutdown_delay.is_zero() {
            let until = shutdown.at + desired.shutdown_delay;
            if now < until {
                *wake_at = Some(wake_at.map_or(until, |w| w.min(until)));
                if shutdown.at == now {
                    let event = TaskEvent::waiting_shutdown_delay(now, desired.shutdown_delay);
                    for task in self.tasks.values_mut().filter(|t| t.is_running()) {
                        task.push_event(event.clone(), cap);
                    }
                }
                return want_run;
            }
        }

        let live = |tasks: &BTreeMap<Name, Box<TaskState>>, s: &TaskSettings| {
            tasks.get(&s.name).is_some_and(|t| !t.is_dead())
        };
        let stages: [&dyn Fn(&TaskSettings) -> bool; 3] = [
            &|s| s.leader,
            &|s| s.is_main() || s.is_ephemeral_hook(),
            &|s| s.is_sidecar(),
        ];
        for in_stage in stages {
            let members: Vec<&TaskSettings> =
                desired.tasks.iter().filter(|s| in_stage(s)).collect();
            for settings in &members {
                if let Some(task) = self.tasks.get_mut(&settings.name) {
                    task.request_kill(settings, reason.clone(), now, cap);
                }
            }
            if members.iter().any(|s| live(&self.tasks, s)) && !desired.plant_skip_kill_order {
                return want_run;
            }
        }

        // Everything else is dead: poststop tasks run, whatever stage the alloc reached
        // (as Nomad's lifecycle coordinator: after a prestart failure too), once something
        // of this run started.
        if !self.run_started(desired) || desired.successor_ran {
            self.give_up_poststop(desired, now);
            return want_run;
        }
        for (run, settings) in want_run.iter_mut().zip(&desired.tasks) {
            *run = settings.hook == Some(LifecycleHook::Poststop);
        }
        want_run
    }

    /// A fresh state for a revision whose main tasks run already (their runs, found at
    /// restore, are named by no record: the store failed before they were written): its
    /// prestart stage is over, so its prestart tasks do not run again, and its main tasks
    /// start at once, their starts reattaching those runs.
    pub fn prestart_done_before(&mut self, desired: &AllocDesired, now: Timestamp) {
        self.main_released = true;
        for settings in desired
            .tasks
            .iter()
            .filter(|s| s.is_ephemeral_hook() && s.hook == Some(LifecycleHook::Prestart))
        {
            if let Some(task) = self.tasks.get_mut(&settings.name)
                && !task.has_process()
            {
                task.phase = TaskPhase::Dead;
                task.finished_at = Some(now);
            }
        }
    }

    /// Records what the shell observed about `task`; true when a health check's result
    /// restarts it.
    pub fn observe(
        &mut self,
        desired: &AllocDesired,
        task: &Name,
        observation: Observation,
        jitter: Jitter,
        now: Timestamp,
    ) -> bool {
        let (Some(settings), Some(state)) = (desired.task(task), self.tasks.get_mut(task)) else {
            return false;
        };
        // While the alloc stops, mode `delay` fails a task past its attempts as mode
        // `fail` does: a poststop task that keeps failing ends the stop rather than hold
        // it (and the next revision) forever.
        let stopping_settings;
        let settings = if (!desired.run || self.shutdown.is_some())
            && settings.restart.mode == RestartMode::Delay
        {
            let mut fails = settings.clone();
            fails.restart.mode = RestartMode::Fail;
            stopping_settings = fails;
            &stopping_settings
        } else {
            settings
        };
        let cap = desired.max_events;
        let mut restarted = false;
        match observation {
            Observation::Started => state.observe_started(now, cap),
            Observation::StartFailed {
                message,
                recoverable,
            } => state.observe_start_failed(settings, &message, recoverable, jitter, now, cap),
            Observation::StartCancelled => state.observe_start_cancelled(settings, now, cap),
            Observation::LimitsNotEnforced { reason } => {
                state.push_event(TaskEvent::limits_not_enforced(now, &reason), cap);
            }
            Observation::Exited(result) => {
                state.observe_exited(settings, &result, jitter, now, cap)
            }
            Observation::RecoverFailed { message } => {
                state.observe_recover_failed(settings, &message, now, cap);
            }
            Observation::Check {
                check,
                status,
                output,
                repeats,
            } => {
                let result = CheckResult {
                    status,
                    output,
                    repeats,
                };
                restarted = state.observe_check(settings, &check, result, jitter, now, cap);
            }
        }
        restarted
    }

    /// Whether the alloc is healthy: every task with checks that is not dead runs and
    /// passes all of them (poststop tasks aside: they run only once the rest is over).
    /// `None` when no task has checks.
    pub fn healthy(&self, desired: &AllocDesired) -> Option<bool> {
        let mut any = false;
        let mut healthy = true;
        for settings in desired
            .tasks
            .iter()
            .filter(|s| !s.checks.is_empty() && s.hook != Some(LifecycleHook::Poststop))
        {
            any = true;
            let Some(task) = self.tasks.get(&settings.name) else {
                healthy = false;
                continue;
            };
            if task.is_dead() {
                continue;
            }
            healthy &= task.is_running() && task.checks_passing(settings) == Some(true);
        }
        any.then_some(healthy)
    }

    /// The alloc cannot be resumed after an agent restart (its dir is gone, say): every
    /// task that is not yet dead fails with a `Failed Restoring Task` event carrying
    /// `reason`, and no process is expected any more. It runs again only when asked
    /// (a restart or a new revision).
    pub fn fail_restore(&mut self, reason: &str, now: Timestamp, cap: usize) {
        for task in self.tasks.values_mut() {
            if task.is_dead() && !task.has_process() {
                continue;
            }
            task.phase = TaskPhase::Dead;
            task.failed = true;
            task.process = Process::Idle;
            task.kill = None;
            task.restart_at = None;
            task.finished_at = Some(now);
            task.push_event(
                TaskEvent::new(TaskEventType::FailedRestoringTask, now, reason),
                cap,
            );
        }
    }

    /// A user asks to restart `task`, or every running task when `None`. Restarts are
    /// free: they do not count against the restart policy.
    pub fn request_restart(
        &mut self,
        desired: &AllocDesired,
        task: Option<&Name>,
        now: Timestamp,
    ) -> Result<(), CommandRefusal> {
        let targets: Vec<&TaskSettings> = match task {
            Some(name) => {
                let settings = desired
                    .task(name)
                    .ok_or_else(|| CommandRefusal::UnknownTask(name.clone()))?;
                vec![settings]
            }
            None => desired.tasks.iter().collect(),
        };
        let running: Vec<&TaskSettings> = targets
            .into_iter()
            .filter(|s| {
                self.tasks
                    .get(&s.name)
                    .is_some_and(|t| t.is_running() && t.kill.is_none())
            })
            .collect();
        if running.is_empty() || self.shutdown.is_some() {
            return Err(CommandRefusal::TaskNotRunning);
        }
        for settings in running {
            let state = self
                .tasks
                .get_mut(&settings.name)
                .expect("filtered on presence");
            state.push_event(
                TaskEvent::new(
                    TaskEventType::RestartSignaled,
                    now,
                    "User requested restart",
                ),
                desired.max_events,
            );
            state.request_kill(settings, KillReason::UserRestart, now, desired.max_events);
        }
        Ok(())
    }

    /// Whether a person may run a command beside `task` (`stead alloc exec`): the alloc
    /// has the task and it runs, is not being killed, and the alloc is not shutting down.
    /// Changes nothing: a command beside a task is no event of the task.
    pub fn may_exec(&self, desired: &AllocDesired, task: &Name) -> Result<(), CommandRefusal> {
        if desired.task(task).is_none() {
            return Err(CommandRefusal::UnknownTask(task.clone()));
        }
        let running = self
            .tasks
            .get(task)
            .is_some_and(|t| t.is_running() && t.kill.is_none());
        if !running || self.shutdown.is_some() {
            return Err(CommandRefusal::TaskNotRunning);
        }
        Ok(())
    }

    /// A user asks to send `signal` to `task`; the effect to carry out.
    pub fn request_signal(
        &mut self,
        desired: &AllocDesired,
        task: &Name,
        signal: Signal,
        now: Timestamp,
    ) -> Result<Effect, CommandRefusal> {
        if desired.task(task).is_none() {
            return Err(CommandRefusal::UnknownTask(task.clone()));
        }
        let state = self
            .tasks
            .get_mut(task)
            .filter(|t| t.is_running())
            .ok_or(CommandRefusal::TaskNotRunning)?;
        state.push_event(
            TaskEvent::new(
                TaskEventType::Signaling,
                now,
                format!("Task being sent signal {signal}"),
            ),
            desired.max_events,
        );
        Ok(Effect::Signal {
            task: task.clone(),
            signal,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn at(millis: u64) -> Timestamp {
        Timestamp::from_since_epoch(Duration::from_millis(millis))
    }

    fn name(s: &str) -> Name {
        s.parse().expect("valid name")
    }

    fn desired(yaml: &str) -> AllocDesired {
        let file = stead_schemas::parse_spec_file(Path::new("t.yaml"), yaml);
        assert!(file.is_valid(), "{:?}", file.all_diagnostics());
        let spec = file.specs().next().expect("one spec").clone();
        AllocDesired::new(&spec.spec.spec, true, Limits::default())
    }

    /// A node that carries out effects at once, as an ideal driver would, and records them.
    struct Sim {
        desired: AllocDesired,
        state: AllocState,
        now: Timestamp,
        log: Vec<String>,
    }

    impl Sim {
        fn new(yaml: &str) -> Self {
            let desired = desired(yaml);
            let state = AllocState::new(&desired, at(0));
            Sim {
                desired,
                state,
                now: at(0),
                log: Vec::new(),
            }
        }

        /// Reconciles; starts succeed and kill signals end tasks at once.
        fn step(&mut self) -> Option<Timestamp> {
            let plan = self.state.reconcile(&self.desired, self.now);
            for effect in plan.effects.clone() {
                match effect {
                    Effect::Start { task } => {
                        self.log.push(format!("start {task}"));
                        self.observe(&task, Observation::Started);
                    }
                    Effect::Signal { task, signal } => {
                        self.log.push(format!("signal {task} {signal}"));
                        self.observe(
                            &task,
                            Observation::Exited(ExitResult {
                                exit_code: 130,
                                signal: Some(2),
                                ..ExitResult::default()
                            }),
                        );
                    }
                    other => self.log.push(format!("{other:?}")),
                }
            }
            plan.wake_at
        }

        fn settle(&mut self) {
            for _ in 0..20 {
                self.step();
            }
        }

        fn observe(&mut self, task: &Name, observation: Observation) {
            self.state
                .observe(&self.desired, task, observation, Jitter::ZERO, self.now);
        }

        fn exit(&mut self, task: &str, code: i32) {
            self.log.push(format!("exit {task} {code}"));
            self.observe(
                &name(task),
                Observation::Exited(ExitResult {
                    exit_code: code,
                    ..ExitResult::default()
                }),
            );
        }

        fn events(&self, task: &str) -> Vec<&'static str> {
            self.state.tasks[&name(task)]
                .events
                .iter()
                .map(|e| e.event_type.as_str())
                .collect()
        }

        /// The type and message of `task`'s events from the `from`th on.
        fn messages(&self, task: &str, from: usize) -> Vec<(&'static str, &str)> {
            self.state.tasks[&name(task)]
                .events
                .iter()
                .skip(from)
                .map(|e| (e.event_type.as_str(), e.message.as_str()))
                .collect()
        }
    }

    const LIFECYCLE: &str = "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  tasks:\n    - {name: init, driver: mock, config: {}, lifecycle: {hook: prestart}}\n    - {name: proxy, driver: mock, config: {}, lifecycle: {hook: prestart, sidecar: true}}\n    - {name: main, driver: mock, config: {}, leader: true}\n    - {name: other, driver: mock, config: {}}\n    - {name: after, driver: mock, config: {}, lifecycle: {hook: poststart}}\n    - {name: cleanup, driver: mock, config: {}, lifecycle: {hook: poststop}}\n";

    #[test]
    fn main_tasks_start_only_after_prestart_succeeded_and_poststart_after_main_runs() {
        let mut sim = Sim::new(LIFECYCLE);
        sim.step();
        assert_eq!(sim.log, ["start init", "start proxy"]);
        sim.settle();
        assert_eq!(sim.log.len(), 2, "main waits for init: {:?}", sim.log);
        sim.exit("init", 0);
        sim.step();
        sim.step();
        assert_eq!(sim.log[3..], ["start main", "start other", "start after"]);
        assert_eq!(sim.state.client_status(), ClientStatus::Running);
    }

    #[test]
    fn stopping_kills_the_leader_first_then_main_tasks_then_sidecars_then_runs_poststop() {
        let mut sim = Sim::new(LIFECYCLE);
        sim.step();
        sim.exit("init", 0);
        sim.settle();
        sim.exit("after", 0);
        sim.settle();
        sim.log.clear();
        sim.desired.run = false;
        sim.settle();
        assert_eq!(
            sim.log,
            [
                "signal main SIGINT",
                "signal other SIGINT",
                "signal proxy SIGINT",
                "start cleanup"
            ]
        );
        assert_eq!(
            sim.state.client_status(),
            ClientStatus::Running,
            "poststop runs"
        );
        sim.exit("cleanup", 0);
        sim.settle();
        assert!(sim.state.is_terminal());
        assert_eq!(sim.state.client_status(), ClientStatus::Complete);
    }

    #[test]
    fn a_revision_whose_successor_ran_runs_no_poststop_task_when_it_stops() {
        let mut sim = Sim::new(LIFECYCLE);
        sim.step();
        sim.exit("init", 0);
        sim.settle();
        sim.log.clear();
        sim.desired.run = false;
        sim.desired.successor_ran = true;
        sim.settle();
        assert!(
            !sim.log.iter().any(|l| l == "start cleanup"),
            "{:?}",
            sim.log
        );
        assert!(sim.state.is_terminal());
        assert_eq!(sim.state.tasks[&name("cleanup")].phase, TaskPhase::Dead);
    }

    #[test]
    fn a_poststop_task_failing_under_restart_mode_delay_fails_past_its_attempts_in_a_stop() {
        let yaml = LIFECYCLE.replace(
            "spec:\n",
            "spec:\n  restart: {attempts: 1, interval: 1h, delay: 1s, mode: delay}\n",
        );
        let mut sim = Sim::new(&yaml);
        sim.step();
        sim.exit("init", 0);
        sim.settle();
        sim.desired.run = false;
        sim.settle();
        assert_eq!(sim.log.last().map(String::as_str), Some("start cleanup"));
        // One attempt, then the task fails rather than wait out the hour.
        sim.exit("cleanup", 1);
        sim.now = at(2_000);
        sim.settle();
        assert_eq!(sim.log.last().map(String::as_str), Some("start cleanup"));
        sim.exit("cleanup", 1);
        sim.settle();
        let cleanup = &sim.state.tasks[&name("cleanup")];
        assert_eq!(cleanup.phase, TaskPhase::Dead);
        assert!(cleanup.failed);
        assert!(sim.state.is_terminal());
    }

    #[test]
    fn a_main_task_whose_exit_is_never_confirmed_lets_the_sidecars_kill_go_on_at_once() {
        let yaml = "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  tasks:\n    - {name: proxy, driver: mock, config: {}, lifecycle: {hook: prestart, sidecar: true}, killTimeout: 1s}\n    - {name: main, driver: mock, config: {}, killTimeout: 1s}\n";
        let mut desired = desired(yaml);
        let mut state = AllocState::new(&desired, at(0));
        for _ in 0..2 {
            let plan = state.reconcile(&desired, at(0));
            for effect in plan.effects {
                if let Effect::Start { task } = effect {
                    state.observe(&desired, &task, Observation::Started, Jitter::ZERO, at(0));
                }
            }
        }
        desired.run = false;
        let signal = |task: &str| Effect::Signal {
            task: name(task),
            signal: Signal::sigint(),
        };
        assert_eq!(state.reconcile(&desired, at(10)).effects, [signal("main")]);
        let forced = state.reconcile(&desired, at(1_010));
        assert_eq!(forced.effects, [Effect::ForceKill { task: name("main") }]);
        // The driver never confirms: main is given up for dead after the grace, and the
        // sidecar's kill comes in the same pass, not at some later wake-up.
        let give_up = at(1_010) + crate::task::FORCE_KILL_GRACE;
        let plan = state.reconcile(&desired, give_up);
        assert_eq!(
            plan.effects,
            [Effect::Forget { task: name("main") }, signal("proxy")]
        );
    }

    #[test]
    fn a_revision_whose_main_tasks_ran_before_its_record_was_lost_does_not_run_prestart_again() {
        let mut sim = Sim::new(LIFECYCLE);
        sim.state.prestart_done_before(&sim.desired, sim.now);
        sim.step();
        assert!(!sim.log.iter().any(|l| l == "start init"), "{:?}", sim.log);
        for task in ["proxy", "main", "other"] {
            assert!(
                sim.log.iter().any(|l| *l == format!("start {task}")),
                "{task}: {:?}",
                sim.log
            );
        }
        assert_eq!(sim.state.tasks[&name("init")].phase, TaskPhase::Dead);
        assert!(!sim.state.tasks[&name("init")].failed);
    }

    #[test]
    fn a_failed_prestart_task_fails_the_alloc_without_starting_main() {
        let mut sim = Sim::new(&LIFECYCLE.replace("spec:\n", "spec:\n  restart: {attempts: 0}\n"));
        sim.step();
        sim.exit("init", 1);
        sim.settle();
        assert!(!sim.log.iter().any(|l| l == "start main"), "{:?}", sim.log);
        assert_eq!(sim.log.last().map(String::as_str), Some("start cleanup"));
        sim.exit("cleanup", 0);
        sim.settle();
        assert_eq!(
            sim.events("proxy"),
            [
                "Received",
                "Task Setup",
                "Started",
                "Sibling Task Failed",
                "Killing",
                "Terminated",
                "Killed"
            ]
        );
        assert_eq!(sim.state.client_status(), ClientStatus::Failed);
        assert!(sim.state.is_terminal());
    }

    #[test]
    fn reconcile_is_idempotent_at_one_instant() {
        let mut sim = Sim::new(LIFECYCLE);
        sim.step();
        let before = sim.state.clone();
        let plan = sim.state.reconcile(&sim.desired, sim.now);
        assert!(plan.effects.is_empty(), "{:?}", plan.effects);
        assert_eq!(sim.state, before);
    }

    #[test]
    fn a_kill_waits_out_the_timeout_before_forcing() {
        let yaml = "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  tasks:\n    - {name: main, driver: mock, config: {}, killTimeout: 3s}\n";
        let desired = desired(yaml);
        let mut state = AllocState::new(&desired, at(0));
        let plan = state.reconcile(&desired, at(0));
        assert_eq!(plan.effects, [Effect::Start { task: name("main") }]);
        state.observe(
            &desired,
            &name("main"),
            Observation::Started,
            Jitter::ZERO,
            at(1),
        );
        let stopping = AllocDesired {
            run: false,
            ..desired
        };
        let plan = state.reconcile(&stopping, at(10));
        assert_eq!(
            plan.effects,
            [Effect::Signal {
                task: name("main"),
                signal: Signal::sigint()
            }]
        );
        assert_eq!(plan.wake_at, Some(at(3_010)));
        assert!(state.reconcile(&stopping, at(3_009)).effects.is_empty());
        let plan = state.reconcile(&stopping, at(3_010));
        assert_eq!(plan.effects, [Effect::ForceKill { task: name("main") }]);
    }

    #[test]
    fn a_failed_restore_fails_every_live_task_and_starts_nothing() {
        let mut sim = Sim::new(LIFECYCLE);
        for _ in 0..10 {
            sim.step();
        }
        assert_eq!(sim.state.client_status(), ClientStatus::Running);
        sim.log.clear();
        sim.state
            .fail_restore("alloc dir /data/allocs/web-1 is missing", sim.now, 50);
        for _ in 0..3 {
            sim.step();
        }
        assert!(
            !sim.log.iter().any(|line| line.starts_with("start")),
            "{:?}",
            sim.log
        );
        assert_eq!(sim.state.client_status(), ClientStatus::Failed);
        assert!(sim.state.is_terminal());
        let init = &sim.state.tasks[&name("init")];
        assert!(init.failed && init.is_dead());
        let last = init.events.back().expect("an event");
        assert_eq!(last.event_type, TaskEventType::FailedRestoringTask);
        assert_eq!(last.message, "alloc dir /data/allocs/web-1 is missing");
    }

    #[test]
    fn a_task_whose_driver_is_unhealthy_stays_pending_with_one_driver_failure_then_starts() {
        let mut sim = Sim::new(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  tasks:\n    - {name: main, driver: exec, config: {command: /bin/true}}\n",
        );
        sim.desired
            .unavailable_drivers
            .insert(DriverKind::Exec, "supervisor not found".to_owned());
        for _ in 0..5 {
            sim.step();
            sim.now = sim.now + Duration::from_secs(1);
        }
        assert!(sim.log.is_empty(), "{:?}", sim.log);
        let main = &sim.state.tasks[&name("main")];
        assert_eq!(main.phase, TaskPhase::Pending);
        assert!(!main.failed);
        let failures: Vec<_> = main
            .events
            .iter()
            .filter(|e| e.event_type == TaskEventType::DriverFailure)
            .collect();
        assert_eq!(failures.len(), 1, "said once: {failures:?}");
        assert_eq!(
            failures[0].message,
            "Driver exec is unhealthy: supervisor not found; the task starts when it recovers"
        );
        assert_eq!(sim.state.client_status(), ClientStatus::Pending);

        sim.desired.unavailable_drivers.clear();
        sim.step();
        assert_eq!(sim.log, ["start main"]);
        assert_eq!(sim.state.tasks[&name("main")].phase, TaskPhase::Running);
    }

    #[test]
    fn an_alloc_without_its_devices_keeps_every_task_pending_with_one_event_then_starts() {
        let mut sim = Sim::new(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  tasks:\n    - {name: main, driver: exec, config: {command: /bin/true}}\n    - {name: side, driver: exec, config: {command: /bin/true}}\n",
        );
        sim.desired.devices_unavailable =
            Some("1 × acme/gpu requested, 0 healthy and free".to_owned());
        for _ in 0..4 {
            sim.step();
            sim.now = sim.now + Duration::from_secs(1);
        }
        assert!(sim.log.is_empty(), "{:?}", sim.log);
        for task in ["main", "side"] {
            let state = &sim.state.tasks[&name(task)];
            assert_eq!(state.phase, TaskPhase::Pending);
            let waits: Vec<_> = state
                .events
                .iter()
                .filter(|e| e.event_type == TaskEventType::WaitingForDevices)
                .collect();
            assert_eq!(waits.len(), 1, "{task}: said once: {waits:?}");
            assert_eq!(
                waits[0].message,
                "Waiting for devices: 1 × acme/gpu requested, 0 healthy and free"
            );
        }
        // An unhealthy driver is named first: it is the first thing to fix.
        sim.desired
            .unavailable_drivers
            .insert(DriverKind::Exec, "supervisor not found".to_owned());
        sim.step();
        let last = sim.state.tasks[&name("main")].events.back().cloned();
        assert_eq!(
            last.map(|e| e.event_type),
            Some(TaskEventType::DriverFailure)
        );

        sim.desired.unavailable_drivers.clear();
        sim.desired.devices_unavailable = None;
        sim.step();
        assert_eq!(sim.log, ["start main", "start side"]);
    }

    const ONE_TASK: &str = "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  tasks:\n    - {name: main, driver: mock, config: {}}\n";

    /// The start effects of one pass, with nothing observed.
    fn starts_of_one_pass(sim: &mut Sim) -> Vec<String> {
        sim.state
            .reconcile(&sim.desired, sim.now)
            .effects
            .into_iter()
            .filter_map(|effect| match effect {
                Effect::Start { task } => Some(task.to_string()),
                _ => None,
            })
            .collect()
    }

    /// One task whose start is in flight when the alloc is stopped: the stop cancels it.
    fn stopped_while_starting() -> Sim {
        let mut sim = Sim::new(ONE_TASK);
        assert_eq!(starts_of_one_pass(&mut sim), ["main"]);
        sim.desired.run = false;
        sim.now = at(100);
        let plan = sim.state.reconcile(&sim.desired, sim.now);
        assert_eq!(plan.effects, [Effect::CancelStart { task: name("main") }]);
        sim
    }

    #[test]
    fn a_stop_restored_without_the_start_it_cancelled_finishes_and_the_alloc_is_terminal() {
        let mut sim = stopped_while_starting();
        // The agent left before the start was answered; the next one restores the task
        // with no handle, so with no process, as the controller's restore leaves it.
        sim.state
            .tasks
            .get_mut(&name("main"))
            .expect("a task")
            .process = Process::Idle;
        sim.now = at(10_000);
        let plan = sim.state.reconcile(&sim.desired, sim.now);
        assert_eq!(plan, Plan::default());
        let main = &sim.state.tasks[&name("main")];
        assert!(main.is_dead() && main.kill.is_none(), "{main:?}");
        assert!(sim.state.is_terminal());
        assert_eq!(sim.state.client_status(), ClientStatus::Complete);

        sim.desired.run = true;
        sim.step();
        assert_eq!(sim.log, ["start main"], "runs again in place");
    }

    #[test]
    fn a_terminal_alloc_runs_again_in_place_after_stop_then_run_keeping_its_history() {
        let failed = "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  restart: {attempts: 0}\n  tasks:\n    - {name: main, driver: mock, config: {}}\n    - {name: side, driver: mock, config: {}}\n";
        let leader_dead = "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  type: batch\n  tasks:\n    - {name: main, driver: mock, config: {}, leader: true}\n    - {name: side, driver: mock, config: {}}\n";
        for (case, yaml, exit_code, status) in [
            ("failed", failed, 1, ClientStatus::Failed),
            ("leader dead", leader_dead, 0, ClientStatus::Complete),
        ] {
            let mut sim = Sim::new(yaml);
            sim.settle();
            sim.now = at(1_000);
            sim.exit("main", exit_code);
            sim.settle();
            assert!(sim.state.is_terminal(), "{case}");
            assert_eq!(sim.state.client_status(), status, "{case}");

            sim.desired.run = false;
            sim.now = at(2_000);
            sim.settle();
            assert_eq!(
                sim.state.client_status(),
                status,
                "{case}: stopped as it was"
            );
            let history = sim.state.tasks[&name("side")].events.len();

            sim.desired.run = true;
            sim.now = at(3_000);
            sim.log.clear();
            sim.settle();
            assert_eq!(sim.log, ["start main", "start side"], "{case}");
            assert_eq!(sim.state.client_status(), ClientStatus::Running, "{case}");
            let side = &sim.state.tasks[&name("side")];
            assert_eq!(side.events.len(), history + 1, "{case}: history kept");
        }
    }

    #[test]
    fn may_start_says_whether_the_next_pass_can_start_tasks_without_changing_anything() {
        let yaml = "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  restart: {attempts: 0}\n  tasks:\n    - {name: main, driver: mock, config: {}}\n";
        let mut sim = Sim::new(yaml);
        let runs = |sim: &Sim, run: bool| {
            let mut desired = sim.desired.clone();
            desired.run = run;
            sim.state.may_start(&desired)
        };
        assert!(runs(&sim, true), "a new alloc");
        assert!(!runs(&sim, false), "a new alloc asked to stop");
        sim.settle();
        assert!(runs(&sim, true), "a running alloc");
        sim.now = at(1_000);
        sim.exit("main", 1);
        sim.settle();
        assert!(sim.state.is_terminal());
        let before = sim.state.clone();
        assert!(!runs(&sim, true), "failed: it does not run again by itself");
        assert_eq!(sim.state, before, "asking changes nothing");
        sim.desired.run = false;
        sim.now = at(2_000);
        sim.settle();
        assert!(!runs(&sim, false), "stopped");
        assert!(
            runs(&sim, true),
            "stopped, then asked to run: it runs again in place"
        );
        sim.desired.run = true;
        sim.log.clear();
        sim.settle();
        assert_eq!(sim.log, ["start main"], "the pass did start it");
    }

    #[test]
    fn poststop_runs_after_a_prestart_failure() {
        let mut sim = Sim::new(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  type: batch\n  restart: {attempts: 0}\n  tasks:\n    - {name: init, driver: mock, config: {}, lifecycle: {hook: prestart}}\n    - {name: main, driver: mock, config: {}}\n    - {name: cleanup, driver: mock, config: {}, lifecycle: {hook: poststop}}\n",
        );
        sim.settle();
        sim.exit("init", 1);
        sim.settle();
        assert_eq!(sim.log, ["start init", "exit init 1", "start cleanup"]);
        sim.exit("cleanup", 0);
        sim.settle();
        assert!(sim.state.is_terminal());
        assert_eq!(sim.state.client_status(), ClientStatus::Failed);
    }

    #[test]
    fn poststop_runs_when_stopped_during_prestart() {
        let mut sim = Sim::new(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  tasks:\n    - {name: init, driver: mock, config: {}, lifecycle: {hook: prestart}}\n    - {name: main, driver: mock, config: {}}\n    - {name: cleanup, driver: mock, config: {}, lifecycle: {hook: poststop}}\n",
        );
        sim.settle();
        sim.desired.run = false;
        sim.settle();
        assert_eq!(
            sim.log,
            ["start init", "signal init SIGINT", "start cleanup"]
        );
    }

    #[test]
    fn an_alloc_stopped_before_anything_of_it_started_ends_without_its_poststop_tasks() {
        let mut sim = Sim::new(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  tasks:\n    - {name: main, driver: exec, config: {command: /bin/true}}\n    - {name: cleanup, driver: exec, config: {command: /bin/true}, lifecycle: {hook: poststop}}\n",
        );
        sim.desired
            .unavailable_drivers
            .insert(DriverKind::Exec, "supervisor not found".to_owned());
        sim.settle();
        sim.desired.run = false;
        sim.settle();
        assert!(sim.log.is_empty(), "nothing started: {:?}", sim.log);
        assert!(
            sim.state.is_terminal(),
            "a poststop task held back by its driver would keep the alloc from ending"
        );
        // Its driver coming back starts nothing either.
        sim.desired.unavailable_drivers.clear();
        sim.settle();
        assert!(sim.log.is_empty(), "{:?}", sim.log);
    }

    #[test]
    fn a_poststart_task_not_reattached_after_its_main_tasks_died_is_given_up() {
        let mut sim = Sim::new(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  type: batch\n  tasks:\n    - {name: main, driver: mock, config: {}}\n    - {name: after, driver: mock, config: {}, lifecycle: {hook: poststart}}\n    - {name: cleanup, driver: mock, config: {}, lifecycle: {hook: poststop}}\n",
        );
        sim.settle();
        assert_eq!(sim.log, ["start main", "start after"]);
        // The agent restarts after main exited and cannot reattach to `after`.
        sim.now = at(1_000);
        sim.exit("main", 0);
        sim.observe(
            &name("after"),
            Observation::RecoverFailed {
                message: "no such process".to_owned(),
            },
        );
        sim.log.clear();
        sim.settle();
        assert_eq!(sim.log, ["start cleanup"], "after is not started again");
        sim.exit("cleanup", 0);
        sim.settle();
        assert!(sim.state.is_terminal());
        assert_eq!(sim.state.client_status(), ClientStatus::Complete);
    }

    #[test]
    fn a_task_not_recovered_after_an_agent_restart_starts_again_at_once_without_charging_its_policy()
     {
        let mut sim = Sim::new(&ONE_TASK.replace("spec:\n", "spec:\n  restart: {attempts: 0}\n"));
        sim.settle();
        let tracker = sim.state.tasks[&name("main")].tracker;
        sim.log.clear();
        sim.now = at(5_000);
        sim.observe(
            &name("main"),
            Observation::RecoverFailed {
                message: "no such process".to_owned(),
            },
        );
        sim.step();
        assert_eq!(sim.log, ["start main"]);
        let main = &sim.state.tasks[&name("main")];
        assert!(!main.failed);
        assert_eq!(main.restarts, 0);
        assert_eq!(main.tracker, tracker, "no attempt consumed");
        assert_eq!(
            sim.events("main")[3..],
            ["Failed Restoring Task", "Started"]
        );
        let restore_failed = &main.events[3];
        assert_eq!(restore_failed.message, "no such process");
        assert_eq!(sim.state.client_status(), ClientStatus::Running);
    }

    #[test]
    fn an_oom_kill_reads_as_such_and_is_a_failure_the_restart_policy_takes() {
        let mut sim = Sim::new(ONE_TASK);
        sim.step();
        sim.observe(&name("main"), Observation::Started);
        sim.observe(
            &name("main"),
            Observation::Exited(ExitResult {
                exit_code: 137,
                signal: Some(9),
                error: None,
                oom_killed: true,
                at: None,
            }),
        );
        let main = &sim.state.tasks[&name("main")];
        let terminated = main
            .events
            .iter()
            .find(|e| e.event_type == TaskEventType::Terminated)
            .expect("a Terminated event");
        assert_eq!(terminated.message, "Exit Code: 137, Signal: 9, OOM Killed");
        assert!(terminated.oom_killed);
        assert_eq!(main.oom_kills, 1, "the run is counted");
        assert_eq!(
            main.events.back().map(|e| e.event_type),
            Some(TaskEventType::Restarting)
        );
    }

    #[test]
    fn a_sigkill_that_is_not_an_oom_kill_is_not_counted_as_one() {
        let mut sim = Sim::new(ONE_TASK);
        sim.step();
        sim.observe(&name("main"), Observation::Started);
        sim.observe(
            &name("main"),
            Observation::Exited(ExitResult {
                exit_code: 137,
                signal: Some(9),
                error: None,
                oom_killed: false,
                at: None,
            }),
        );
        assert_eq!(sim.state.tasks[&name("main")].oom_kills, 0);
    }

    #[test]
    fn limits_that_are_not_enforced_are_one_event_before_the_start() {
        let mut sim = Sim::new(ONE_TASK);
        sim.step();
        sim.observe(
            &name("main"),
            Observation::LimitsNotEnforced {
                reason: "no writable cgroup".to_owned(),
            },
        );
        sim.observe(&name("main"), Observation::Started);
        let events = sim.messages("main", 0);
        assert_eq!(
            events[events.len() - 2..],
            [
                (
                    "Limits Not Enforced",
                    "Task started without its resource limits: no writable cgroup"
                ),
                ("Started", "Task started by client")
            ]
        );
    }

    #[test]
    fn on_a_rerun_poststart_waits_for_main_to_start() {
        let mut sim = Sim::new(&LIFECYCLE.replace(
            "    - {name: init, driver: mock, config: {}, lifecycle: {hook: prestart}}\n    - {name: proxy, driver: mock, config: {}, lifecycle: {hook: prestart, sidecar: true}}\n",
            "",
        ));
        assert_eq!(starts_of_one_pass(&mut sim), ["main", "other"], "first run");
        sim.observe(&name("main"), Observation::Started);
        sim.observe(&name("other"), Observation::Started);
        sim.settle();
        sim.exit("after", 0);
        sim.desired.run = false;
        sim.now = at(1_000);
        sim.settle();
        sim.exit("cleanup", 0);
        sim.settle();
        assert!(sim.state.is_terminal());

        sim.desired.run = true;
        sim.now = at(2_000);
        assert_eq!(starts_of_one_pass(&mut sim), ["main", "other"], "rerun");
    }

    #[test]
    fn on_a_rerun_a_poststart_task_that_never_ran_ends_when_main_ends_first() {
        let mut sim = Sim::new(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: job}\nspec:\n  type: batch\n  tasks:\n    - {name: main, driver: mock, config: {}}\n    - {name: after, driver: mock, config: {}, lifecycle: {hook: poststart}}\n",
        );
        let run_once = |sim: &mut Sim| {
            sim.step();
            sim.exit("main", 0);
            sim.settle();
            assert!(sim.state.is_terminal(), "{:?}", sim.state);
            assert_eq!(sim.state.client_status(), ClientStatus::Complete);
        };
        run_once(&mut sim);
        assert_eq!(sim.log, ["start main", "exit main 0"], "first run");
        sim.desired.run = false;
        sim.now = at(1_000);
        sim.settle();
        sim.desired.run = true;
        sim.now = at(2_000);
        sim.log.clear();
        run_once(&mut sim);
        assert_eq!(sim.log, ["start main", "exit main 0"], "rerun");
    }

    #[test]
    fn a_user_restart_reads_restart_signaled_terminated_restarting_started() {
        let mut sim = Sim::new(ONE_TASK);
        sim.settle();
        sim.now = at(1_000);
        sim.state
            .request_restart(&sim.desired, None, sim.now)
            .expect("running");
        sim.settle();
        assert_eq!(
            sim.events("main"),
            [
                "Received",
                "Task Setup",
                "Started",
                "Restart Signaled",
                "Terminated",
                "Restarting",
                "Started"
            ]
        );
        let main = &sim.state.tasks[&name("main")];
        assert_eq!(main.events[3].message, "User requested restart");
        assert_eq!(main.events[5].message, "Task restarting in 0s");
        assert_eq!(main.restarts, 1);
    }

    #[test]
    fn a_command_may_run_beside_a_running_task_only_and_never_beside_an_unknown_one() {
        let mut sim = Sim::new(ONE_TASK);
        let main = name("main");
        assert_eq!(
            sim.state.may_exec(&sim.desired, &main),
            Err(CommandRefusal::TaskNotRunning),
            "not started yet"
        );
        sim.settle();
        let before = sim.state.clone();
        assert_eq!(sim.state.may_exec(&sim.desired, &main), Ok(()));
        assert_eq!(sim.state, before, "asking changes nothing");
        assert_eq!(
            sim.state.may_exec(&sim.desired, &name("other")),
            Err(CommandRefusal::UnknownTask(name("other")))
        );
        sim.exit("main", 0);
        assert_eq!(
            sim.state.may_exec(&sim.desired, &main),
            Err(CommandRefusal::TaskNotRunning),
            "exited"
        );
    }

    /// One service task with an http check that restarts it after `limit` failing
    /// intervals of 1s, no grace, under `restart`.
    fn checked(limit: u32, restart: &str) -> String {
        format!(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: web}}\nspec:\n  restart: {restart}\n  tasks:\n    - name: main\n      driver: mock\n      config: {{}}\n      checks:\n        - {{name: alive, type: http, port: 8080, interval: 1s, timeout: 1s, restart: {{limit: {limit}, grace: 0s}}}}\n"
        )
    }

    fn check_result(sim: &mut Sim, status: CheckStatus) -> bool {
        let observation = Observation::Check {
            check: name("alive"),
            status,
            output: format!("said {status}"),
            repeats: 0,
        };
        sim.state.observe(
            &sim.desired,
            &name("main"),
            observation,
            Jitter::ZERO,
            sim.now,
        )
    }

    #[test]
    fn a_check_restart_reads_restart_signaled_terminated_restarting_and_counts_as_a_failure() {
        let mut sim = Sim::new(&checked(
            3,
            "{attempts: 2, interval: 10m, delay: 5s, mode: fail}",
        ));
        sim.settle();
        for (ms, status, restarts) in [
            (1_000, CheckStatus::Passing, false),
            (2_000, CheckStatus::Critical, false),
            (3_000, CheckStatus::Critical, false),
            (4_000, CheckStatus::Critical, true),
        ] {
            sim.now = at(ms);
            assert_eq!(check_result(&mut sim, status), restarts, "at {ms} ms");
        }
        sim.settle();
        assert_eq!(
            sim.messages("main", 3),
            [
                ("Restart Signaled", "healthcheck: check \"alive\" unhealthy"),
                ("Terminated", "Exit Code: 130, Signal: 2"),
                ("Restarting", "Task restarting in 5s"),
            ]
        );
        let main = &sim.state.tasks[&name("main")];
        assert_eq!(main.restarts, 1);
        assert_eq!(
            main.tracker.attempts_in_window, 1,
            "counted against the policy"
        );
        assert_eq!(main.restart_at, Some(at(9_000)));
        // The restarted run's checks start pending.
        sim.now = at(9_000);
        sim.settle();
        assert!(sim.state.tasks[&name("main")].checks.is_empty());
        assert_eq!(sim.state.healthy(&sim.desired), Some(false));
    }

    #[test]
    fn a_check_that_keeps_failing_ends_a_task_with_attempts_1_mode_fail_as_failed() {
        let mut sim = Sim::new(&checked(
            1,
            "{attempts: 1, interval: 10m, delay: 5s, mode: fail}",
        ));
        sim.settle();
        for round in 0..2u64 {
            sim.now = at(round * 10_000 + 1_000);
            assert!(
                check_result(&mut sim, CheckStatus::Critical),
                "round {round}"
            );
            sim.settle();
            sim.now = at(round * 10_000 + 9_000);
            sim.settle();
        }
        let main = &sim.state.tasks[&name("main")];
        assert!(main.failed);
        assert!(main.is_dead());
        assert_eq!(
            main.events.back().map(|e| e.message.as_str()),
            Some("Exceeded allowed attempts 1 in interval 10m0s and mode is \"fail\"")
        );
        assert_eq!(sim.state.client_status().as_str(), "failed");
    }

    #[test]
    fn check_results_of_a_task_that_does_not_run_or_is_being_killed_are_dropped() {
        let mut sim = Sim::new(&checked(
            1,
            "{attempts: 2, interval: 10m, delay: 5s, mode: fail}",
        ));
        assert!(
            !check_result(&mut sim, CheckStatus::Critical),
            "not started"
        );
        assert!(sim.state.tasks[&name("main")].checks.is_empty());
        sim.settle();
        sim.state
            .request_restart(&sim.desired, None, sim.now)
            .expect("running");
        assert!(
            !check_result(&mut sim, CheckStatus::Critical),
            "being killed"
        );
        assert!(sim.state.tasks[&name("main")].checks.is_empty());
    }

    #[test]
    fn an_alloc_is_healthy_when_every_task_with_checks_runs_and_passes_them() {
        let mut sim = Sim::new(ONE_TASK);
        sim.settle();
        assert_eq!(sim.state.healthy(&sim.desired), None, "no checks");
        let mut sim = Sim::new(&checked(
            3,
            "{attempts: 2, interval: 10m, delay: 5s, mode: fail}",
        ));
        assert_eq!(sim.state.healthy(&sim.desired), Some(false), "not running");
        sim.settle();
        assert_eq!(sim.state.healthy(&sim.desired), Some(false), "pending");
        check_result(&mut sim, CheckStatus::Passing);
        assert_eq!(sim.state.healthy(&sim.desired), Some(true));
        check_result(&mut sim, CheckStatus::Warning);
        assert_eq!(sim.state.healthy(&sim.desired), Some(false), "warning");
        // A poststop task's checks wait for it: they do not make the alloc unhealthy.
        let mut sim = Sim::new(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  tasks:\n    - {name: main, driver: mock, config: {}}\n    - {name: after, driver: mock, config: {}, lifecycle: {hook: poststop}, checks: [{name: alive, type: tcp, port: 1}]}\n",
        );
        sim.settle();
        assert_eq!(sim.state.healthy(&sim.desired), None);
    }

    #[test]
    fn a_stop_during_a_user_restart_reads_killing_and_killed() {
        let mut sim = Sim::new(ONE_TASK);
        sim.settle();
        sim.state
            .request_restart(&sim.desired, None, sim.now)
            .expect("running");
        let plan = sim.state.reconcile(&sim.desired, sim.now);
        assert!(matches!(plan.effects[..], [Effect::Signal { .. }]));
        sim.desired.run = false;
        sim.step();
        sim.exit("main", 130);
        sim.settle();
        assert_eq!(
            sim.events("main")[3..],
            ["Restart Signaled", "Killing", "Terminated", "Killed"]
        );
        assert!(sim.state.is_terminal());
    }

    #[test]
    fn a_task_shutdown_delay_is_announced_after_killing_and_waited_before_the_signal() {
        let mut sim = Sim::new(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  tasks:\n    - {name: main, driver: mock, config: {}, shutdownDelay: 5s}\n",
        );
        sim.settle();
        sim.log.clear();
        sim.desired.run = false;
        sim.now = at(1_000);
        assert_eq!(sim.step(), Some(at(6_000)));
        assert!(sim.log.is_empty(), "{:?}", sim.log);
        assert_eq!(
            sim.messages("main", 3),
            [
                ("Killing", "Sent interrupt. Waiting 5s before force killing"),
                (
                    "Waiting for shutdown delay",
                    "Waiting for shutdown_delay of 5s before killing the task."
                )
            ]
        );
        sim.now = at(6_000);
        sim.settle();
        assert_eq!(sim.log, ["signal main SIGINT"]);
        assert_eq!(
            sim.events("main")[3..],
            [
                "Killing",
                "Waiting for shutdown delay",
                "Terminated",
                "Killed"
            ]
        );
    }

    #[test]
    fn a_group_shutdown_delay_is_announced_in_nomads_words_before_killing() {
        let mut sim = Sim::new(&ONE_TASK.replace("spec:\n", "spec:\n  shutdownDelay: 2s\n"));
        sim.settle();
        sim.desired.run = false;
        sim.now = at(1_000);
        assert_eq!(sim.step(), Some(at(3_000)));
        sim.now = at(3_000);
        sim.settle();
        assert_eq!(
            sim.messages("main", 3),
            [
                (
                    "Waiting for shutdown delay",
                    "Waiting for shutdown_delay of 2s before killing the task."
                ),
                ("Killing", "Sent interrupt. Waiting 5s before force killing"),
                ("Terminated", "Exit Code: 130, Signal: 2"),
                ("Killed", "Task successfully killed")
            ]
        );
    }

    #[test]
    fn a_restart_delayed_past_its_attempts_says_why_in_its_restarting_event() {
        let mut sim = Sim::new(&ONE_TASK.replace(
            "spec:\n",
            "spec:\n  restart: {attempts: 1, interval: 10m, delay: 15s, mode: delay}\n",
        ));
        sim.settle();
        sim.exit("main", 1);
        sim.now = at(15_000);
        sim.settle();
        sim.now = at(20_000);
        sim.exit("main", 1);
        let messages: Vec<&str> = sim.state.tasks[&name("main")]
            .events
            .iter()
            .filter(|e| e.event_type == TaskEventType::Restarting)
            .map(|e| e.message.as_str())
            .collect();
        assert_eq!(
            messages,
            [
                "Task restarting in 15s",
                "Exceeded allowed attempts, applying a delay - Task restarting in 9m40s"
            ]
        );
    }

    #[test]
    fn a_stop_that_a_start_outran_reads_killing_when_the_signal_is_sent() {
        let mut sim = stopped_while_starting();
        // The driver answered before the cancellation reached it.
        sim.observe(&name("main"), Observation::Started);
        sim.settle();
        assert_eq!(sim.log, ["signal main SIGINT"]);
        assert_eq!(
            sim.events("main"),
            [
                "Received",
                "Task Setup",
                "Started",
                "Killing",
                "Terminated",
                "Killed"
            ]
        );
        assert!(sim.state.is_terminal());
    }
}
