//! How a task's process ended, as drivers report it.

use std::fmt;

use stead_schemas::Timestamp;

/// The end of one run of a task.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct ExitResult {
    /// The exit code (by convention 128 + n when killed by signal n).
    pub exit_code: i32,
    /// The signal that ended the task, if one did.
    pub signal: Option<i32>,
    /// An error the driver reported with the exit, if any.
    pub error: Option<String>,
    /// The kernel's OOM killer killed a process of the task in this run, as its cgroup
    /// counted (never inferred from the exit code).
    pub oom_killed: bool,
    /// When the run ended, where the driver knows it better than the moment it reports
    /// it: a run that ended while no agent watched it. `None`: as it is reported.
    pub at: Option<Timestamp>,
}

impl ExitResult {
    /// Exit code 0, no signal, no error (Nomad's `ExitResult.Successful`).
    pub fn successful(&self) -> bool {
        self.exit_code == 0 && self.signal.is_none() && self.error.is_none()
    }
}

impl fmt::Display for ExitResult {
    /// Nomad's `Terminated` message: `Exit Code: 130, Signal: 2` (no signal part without one).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Exit Code: {}", self.exit_code)?;
        if let Some(signal) = self.signal.filter(|s| *s != 0) {
            write!(f, ", Signal: {signal}")?;
        }
        if self.oom_killed {
            f.write_str(", OOM Killed")?;
        }
        if let Some(error) = &self.error {
            write!(f, ", Exit Message: {error:?}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn displays_as_nomads_terminated_message() {
        let killed = ExitResult {
            exit_code: 130,
            signal: Some(2),
            error: None,
            oom_killed: false,
            at: None,
        };
        assert_eq!(killed.to_string(), "Exit Code: 130, Signal: 2");
        let oom = ExitResult {
            exit_code: 137,
            signal: Some(9),
            error: None,
            oom_killed: true,
            at: None,
        };
        assert_eq!(oom.to_string(), "Exit Code: 137, Signal: 9, OOM Killed");
        assert!(!oom.successful());
        assert!(!killed.successful());
        assert!(ExitResult::default().successful());
        assert_eq!(ExitResult::default().to_string(), "Exit Code: 0");
    }
}
