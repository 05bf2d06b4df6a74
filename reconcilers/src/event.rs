//! Task events with Nomad's type strings and messages, so operators recognise them.

use std::fmt;
use std::time::Duration;

use stead_schemas::Timestamp;

use crate::restart::RestartReason;

/// The kinds of task event; `as_str` gives Nomad's type string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TaskEventType {
    /// The agent took the task on.
    Received,
    /// The task's directory is being built.
    TaskSetup,
    /// The driver started the task.
    Started,
    /// The task's process ended.
    Terminated,
    /// The kill signal was sent.
    Killing,
    /// The task was killed.
    Killed,
    /// The task will start again after a delay.
    Restarting,
    /// The task will not start again.
    NotRestarting,
    /// A user asked for a restart.
    RestartSignaled,
    /// A signal is being sent to the task on a user's request.
    Signaling,
    /// The driver failed to start the task.
    DriverFailure,
    /// Preparing the task failed.
    SetupFailure,
    /// Another task of the alloc failed, so this one is killed.
    SiblingTaskFailed,
    /// The leader died, so this task is killed.
    LeaderTaskDead,
    /// Every main task died, so this sidecar is killed.
    MainTasksDead,
    /// After an agent restart, the task could not be reattached.
    FailedRestoringTask,
    /// The task waits out its shutdown delay before its kill.
    WaitingShutdownDelay,
    /// The alloc's devices are not free and healthy yet: the task waits for them.
    WaitingForDevices,
    /// The task started without the resource limits its spec sets: the driver cannot
    /// enforce them on this node.
    LimitsNotEnforced,
}

impl TaskEventType {
    /// Nomad's type string.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskEventType::Received => "Received",
            TaskEventType::TaskSetup => "Task Setup",
            TaskEventType::Started => "Started",
            TaskEventType::Terminated => "Terminated",
            TaskEventType::Killing => "Killing",
            TaskEventType::Killed => "Killed",
            TaskEventType::Restarting => "Restarting",
            TaskEventType::NotRestarting => "Not Restarting",
            TaskEventType::RestartSignaled => "Restart Signaled",
            TaskEventType::Signaling => "Signaling",
            TaskEventType::DriverFailure => "Driver Failure",
            TaskEventType::SetupFailure => "Setup Failure",
            TaskEventType::SiblingTaskFailed => "Sibling Task Failed",
            TaskEventType::LeaderTaskDead => "Leader Task Dead",
            TaskEventType::MainTasksDead => "Main Tasks Dead",
            TaskEventType::FailedRestoringTask => "Failed Restoring Task",
            TaskEventType::WaitingShutdownDelay => "Waiting for shutdown delay",
            TaskEventType::WaitingForDevices => "Waiting for devices",
            TaskEventType::LimitsNotEnforced => "Limits Not Enforced",
        }
    }

    /// Every event type, for parsing persisted events back.
    pub const ALL: [TaskEventType; 19] = [
        TaskEventType::Received,
        TaskEventType::TaskSetup,
        TaskEventType::Started,
        TaskEventType::Terminated,
        TaskEventType::Killing,
        TaskEventType::Killed,
        TaskEventType::Restarting,
        TaskEventType::NotRestarting,
        TaskEventType::RestartSignaled,
        TaskEventType::Signaling,
        TaskEventType::DriverFailure,
        TaskEventType::SetupFailure,
        TaskEventType::SiblingTaskFailed,
        TaskEventType::LeaderTaskDead,
        TaskEventType::MainTasksDead,
        TaskEventType::FailedRestoringTask,
        TaskEventType::WaitingShutdownDelay,
        TaskEventType::WaitingForDevices,
        TaskEventType::LimitsNotEnforced,
    ];

    /// The event type whose string is `s`.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

impl fmt::Display for TaskEventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One entry of a task's history.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TaskEvent {
    /// What happened.
    pub event_type: TaskEventType,
    /// When.
    pub time: Timestamp,
    /// Nomad's description of it.
    pub message: String,
    /// For `Terminated`: the exit code.
    pub exit_code: Option<i32>,
    /// For `Terminated`: the signal, when one ended the task.
    pub signal: Option<i32>,
    /// For `Terminated`: the kernel's OOM killer killed a process of the task.
    pub oom_killed: bool,
}

impl TaskEvent {
    /// An event with a message and no exit details.
    pub fn new(event_type: TaskEventType, time: Timestamp, message: impl Into<String>) -> Self {
        TaskEvent {
            event_type,
            time,
            message: message.into(),
            exit_code: None,
            signal: None,
            oom_killed: false,
        }
    }

    /// `Received`: "Task received by client".
    pub fn received(time: Timestamp) -> Self {
        Self::new(TaskEventType::Received, time, "Task received by client")
    }

    /// `Task Setup`: "Building Task Directory".
    pub fn task_setup(time: Timestamp) -> Self {
        Self::new(TaskEventType::TaskSetup, time, "Building Task Directory")
    }

    /// `Started`: "Task started by client".
    pub fn started(time: Timestamp) -> Self {
        Self::new(TaskEventType::Started, time, "Task started by client")
    }

    /// `Terminated`: "Exit Code: 130, Signal: 2", or after an OOM kill "Exit Code: 137,
    /// Signal: 9, OOM Killed".
    pub fn terminated(time: Timestamp, result: &crate::exit::ExitResult) -> Self {
        TaskEvent {
            exit_code: Some(result.exit_code),
            signal: result.signal,
            oom_killed: result.oom_killed,
            ..Self::new(TaskEventType::Terminated, time, result.to_string())
        }
    }

    /// `Killing`: "Sent interrupt. Waiting 5s before force killing".
    pub fn killing(time: Timestamp, kill_timeout: Duration) -> Self {
        Self::new(
            TaskEventType::Killing,
            time,
            format!(
                "Sent interrupt. Waiting {} before force killing",
                stead_schemas::Duration::from(kill_timeout).for_people()
            ),
        )
    }

    /// `Limits Not Enforced`: why the driver starts the task without its limits.
    pub fn limits_not_enforced(time: Timestamp, reason: &str) -> Self {
        Self::new(
            TaskEventType::LimitsNotEnforced,
            time,
            format!("Task started without its resource limits: {reason}"),
        )
    }

    /// `Killed`: "Task successfully killed".
    pub fn killed(time: Timestamp) -> Self {
        Self::new(TaskEventType::Killed, time, "Task successfully killed")
    }

    /// `Restarting`: "Task restarting in 15.24s" (rounded for people), after the reason unless the restart is
    /// within policy or requested: "Exceeded allowed attempts, applying a delay - Task
    /// restarting in 29m45s".
    pub fn restarting(time: Timestamp, after: Duration, reason: RestartReason) -> Self {
        let restarting_in = format!(
            "Task restarting in {}",
            stead_schemas::Duration::from(after).for_people()
        );
        let message = match reason {
            RestartReason::WithinPolicy | RestartReason::Requested => restarting_in,
            RestartReason::ExceededAttemptsApplyingDelay => format!("{reason} - {restarting_in}"),
        };
        Self::new(TaskEventType::Restarting, time, message)
    }

    /// `Waiting for shutdown delay`: "Waiting for shutdown_delay of 5s before killing the
    /// task." (Nomad's words, underscore and period included).
    pub fn waiting_shutdown_delay(time: Timestamp, delay: Duration) -> Self {
        Self::new(
            TaskEventType::WaitingShutdownDelay,
            time,
            format!(
                "Waiting for shutdown_delay of {} before killing the task.",
                stead_schemas::Duration::from(delay).for_people()
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jittered_restart_delay_and_timeouts_read_rounded() {
        let at = Timestamp::EPOCH;
        let restarting = TaskEvent::restarting(
            at,
            Duration::from_nanos(5_242_921_168),
            RestartReason::WithinPolicy,
        );
        assert_eq!(restarting.message, "Task restarting in 5.24s");
        let delayed = TaskEvent::restarting(
            at,
            Duration::from_nanos(1_784_712_345_678),
            RestartReason::ExceededAttemptsApplyingDelay,
        );
        assert_eq!(
            delayed.message,
            "Exceeded allowed attempts, applying a delay - Task restarting in 29m45s"
        );
        let waiting = TaskEvent::waiting_shutdown_delay(at, Duration::from_nanos(1));
        assert_eq!(
            waiting.message,
            "Waiting for shutdown_delay of 1ns before killing the task."
        );
    }
}
