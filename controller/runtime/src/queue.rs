//! The per-alloc queue: how inputs reach an alloc's worker without ever blocking the sender.
//!
//! Its rules are the agent's core concurrency guarantee:
//! - the desired spec is a level, not a log: a newer update replaces a pending one
//!   (counted as coalesced), so only the newest is ever applied, and a removal that
//!   arrives after updates preempts them;
//! - user commands (restart, signal) keep their order;
//! - agent shutdown is final and overrides everything else;
//! - pushing never waits: the sender takes a short lock, never across an `.await`, and
//!   the worker is woken through a `Notify` that keeps a permit, so no wake-up is lost.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use stead_reconcilers::alloc::CommandRefusal;
use stead_schemas::spec::{Name, Signal};
use stead_schemas::{AllocId, ValidSpec};
use thiserror::Error;
use tokio::sync::{Notify, oneshot};

use crate::driver::{Driver, DriverError};

/// Why a user command failed.
#[derive(Debug, Error)]
pub enum CommandError {
    /// No alloc has that name.
    #[error("alloc {name:?} not found")]
    UnknownAlloc {
        /// The name asked for.
        name: String,
    },
    /// The alloc refused it (unknown task, task not running).
    #[error(transparent)]
    Refused(#[from] CommandRefusal),
    /// The driver failed to carry it out.
    #[error("signalling task {task:?} failed")]
    Driver {
        /// The task.
        task: String,
        /// The driver's error.
        #[source]
        source: DriverError,
    },
    /// The alloc's worker is gone (the agent is shutting down).
    #[error("alloc {name:?} is shutting down")]
    ShuttingDown {
        /// The alloc.
        name: String,
    },
    /// `stead alloc start` of an alloc whose spec file is gone.
    #[error("alloc {name:?} cannot start: its spec is gone")]
    SpecGone {
        /// The alloc.
        name: String,
    },
    /// `stead alloc start` of an alloc whose spec itself says `desiredStatus: stop`.
    #[error(
        "alloc {name:?} cannot start: its spec says desiredStatus: stop (edit the spec to run it)"
    )]
    SpecStops {
        /// The alloc.
        name: String,
    },
    /// Garbage collection asked for an alloc that is running or still declared.
    #[error("alloc {name:?} is not collectable: it is not terminal or a spec declares it")]
    NotCollectable {
        /// The alloc.
        name: String,
    },
}

/// What the alloc should be, as the specs say.
#[derive(Debug, Clone)]
pub enum Target {
    /// This spec revision should exist (running or stopped per its `desiredStatus`).
    Spec(Arc<ValidSpec>),
    /// The spec is gone: stop the alloc, then destroy it.
    Absent,
}

/// How the agent is leaving (detach, or drain which outranks it).
pub use stead_reconcilers::revision::AgentShutdown as Shutdown;

/// A user's request, answered on its reply channel.
#[derive(Debug)]
pub enum UserCommand {
    /// Restart one task, or every running task.
    Restart {
        /// The task, or `None` for all.
        task: Option<Name>,
        /// The answer.
        reply: oneshot::Sender<Result<(), CommandError>>,
    },
    /// Send a signal to a task.
    Signal {
        /// The task.
        task: Name,
        /// The signal.
        signal: Signal,
        /// The answer.
        reply: oneshot::Sender<Result<(), CommandError>>,
    },
    /// Stop the alloc whatever its spec says (`true`, `stead alloc stop`), or take that
    /// back (`false`, `stead alloc start`). Kept in the alloc's record.
    SetStopped {
        /// Whether the alloc is to stay stopped.
        stopped: bool,
        /// The answer.
        reply: oneshot::Sender<Result<(), CommandError>>,
    },
    /// Garbage collection: destroy the alloc if it is still collectable (terminal, its
    /// spec gone); answered once its directory and record are gone.
    Collect {
        /// The answer.
        reply: oneshot::Sender<Result<(), CommandError>>,
    },
    /// Where a command beside a running task runs (`stead alloc exec`); answered at once,
    /// and the caller starts the command itself.
    Exec {
        /// The task.
        task: Name,
        /// The answer.
        reply: oneshot::Sender<Result<ExecTarget, CommandError>>,
    },
}

/// What starting a command beside a running task takes: its driver and the task's
/// context as the worker knows it.
#[derive(Clone)]
pub struct ExecTarget {
    /// The task's driver.
    pub driver: Arc<dyn Driver>,
    /// The alloc revision the task runs in.
    pub alloc_id: AllocId,
    /// The task.
    pub task: Name,
    /// The task's environment as the agent gives it.
    pub env: BTreeMap<String, String>,
    /// The task's user; `None`: the agent's.
    pub user: Option<String>,
}

impl std::fmt::Debug for ExecTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecTarget")
            .field("driver", &self.driver.kind())
            .field("alloc_id", &self.alloc_id)
            .field("task", &self.task)
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// Everything pending for a worker, taken at once.
#[derive(Debug, Default)]
pub struct Pending {
    /// The newest desired state, if it changed.
    pub target: Option<Target>,
    /// User commands, oldest first.
    pub commands: VecDeque<UserCommand>,
    /// Agent shutdown, if requested.
    pub shutdown: Option<Shutdown>,
}

#[derive(Debug, Default)]
struct Inner {
    pending: Pending,
    coalesced: u64,
}

/// The queue of one alloc; cheap to clone (one `Arc`).
#[derive(Debug, Clone, Default)]
pub struct Mailbox {
    inner: Arc<(Mutex<Inner>, Notify)>,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panicking holder leaves plain data behind; keep going with it.
        self.inner.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the worker without queueing anything (for inputs kept elsewhere).
    pub(crate) fn wake(&self) {
        self.inner.1.notify_one();
    }

    /// Sets the desired state; a pending one is replaced (and counted as coalesced).
    pub fn set_target(&self, target: Target) {
        let coalesced = {
            let mut inner = self.lock();
            let coalesced = inner.pending.target.replace(target).is_some();
            inner.coalesced += u64::from(coalesced);
            coalesced
        };
        if coalesced {
            crate::metrics::coalesced_update();
        }
        self.wake();
    }

    /// Queues a user command behind earlier ones.
    pub fn push_command(&self, command: UserCommand) {
        self.lock().pending.commands.push_back(command);
        self.wake();
    }

    /// Asks the worker to leave; drain wins over detach.
    pub fn shutdown(&self, how: Shutdown) {
        {
            let mut inner = self.lock();
            let how = inner
                .pending
                .shutdown
                .map_or(how, |earlier| earlier.max(how));
            inner.pending.shutdown = Some(how);
        }
        self.wake();
    }

    /// Takes everything pending.
    pub fn take(&self) -> Pending {
        std::mem::take(&mut self.lock().pending)
    }

    /// Waits until something was pushed since the last wait (at once if it already was).
    pub async fn changed(&self) {
        self.inner.1.notified().await;
    }

    /// Whether a new desired state is waiting to be taken.
    pub fn has_target(&self) -> bool {
        self.lock().pending.target.is_some()
    }

    /// How many inputs wait to be taken: a target, user commands, a shutdown.
    pub fn depth(&self) -> usize {
        let inner = self.lock();
        usize::from(inner.pending.target.is_some())
            + inner.pending.commands.len()
            + usize::from(inner.pending.shutdown.is_some())
    }

    /// How many pending spec updates were replaced by newer ones before being applied.
    pub fn coalesced(&self) -> u64 {
        self.lock().coalesced
    }
}

/// How long a user command may wait for its alloc's worker.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Sends `command` built around a reply channel and waits for the answer.
pub(crate) async fn ask<T>(
    mailbox: &Mailbox,
    name: &str,
    build: impl FnOnce(oneshot::Sender<Result<T, CommandError>>) -> UserCommand,
) -> Result<T, CommandError> {
    let (reply, answer) = oneshot::channel();
    mailbox.push_command(build(reply));
    let gone = || CommandError::ShuttingDown {
        name: name.to_owned(),
    };
    match tokio::time::timeout(COMMAND_TIMEOUT, answer).await {
        Ok(Ok(result)) => result,
        Ok(Err(_)) | Err(_) => Err(gone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(command: &str) -> Arc<ValidSpec> {
        let yaml = format!(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: web}}\nspec:\n  tasks:\n    - {{name: t, driver: exec, config: {{command: {command}}}}}\n"
        );
        let file = stead_schemas::parse_spec_file(std::path::Path::new("web.yaml"), &yaml);
        Arc::new(file.specs().next().expect("valid").clone())
    }

    fn command_of(target: &Option<Target>) -> Option<String> {
        match target {
            Some(Target::Spec(spec)) => match &spec.spec.spec.tasks[0].config {
                stead_schemas::spec::DriverConfig::Exec(exec) => Some(exec.command.clone()),
                stead_schemas::spec::DriverConfig::Mock(_) => None,
            },
            Some(Target::Absent) => Some("absent".to_owned()),
            None => None,
        }
    }

    #[test]
    fn newer_updates_replace_pending_ones_and_are_counted() {
        let mailbox = Mailbox::default();
        for i in 0..100 {
            mailbox.set_target(Target::Spec(spec(&format!("/bin/v{i}"))));
        }
        assert_eq!(
            command_of(&mailbox.take().target).as_deref(),
            Some("/bin/v99")
        );
        assert_eq!(mailbox.coalesced(), 99);
        assert!(mailbox.take().target.is_none(), "taken once");
    }

    #[test]
    fn a_removal_preempts_pending_updates() {
        let mailbox = Mailbox::default();
        mailbox.set_target(Target::Spec(spec("/bin/a")));
        mailbox.set_target(Target::Absent);
        assert_eq!(
            command_of(&mailbox.take().target).as_deref(),
            Some("absent")
        );
    }

    #[test]
    fn user_commands_keep_their_order() {
        let mailbox = Mailbox::default();
        let names = ["a", "b", "c"];
        for name in names {
            let (reply, _) = oneshot::channel();
            mailbox.push_command(UserCommand::Restart {
                task: Some(name.parse().expect("valid name")),
                reply,
            });
        }
        let order: Vec<String> = mailbox
            .take()
            .commands
            .into_iter()
            .map(|c| match c {
                UserCommand::Restart { task, .. } => task.expect("named").to_string(),
                UserCommand::Signal { task, .. } => task.to_string(),
                UserCommand::SetStopped { stopped, .. } => format!("stopped={stopped}"),
                UserCommand::Collect { .. } => "collect".to_owned(),
                UserCommand::Exec { task, .. } => task.to_string(),
            })
            .collect();
        assert_eq!(order, names);
    }

    #[test]
    fn drain_wins_over_detach() {
        let mailbox = Mailbox::default();
        mailbox.shutdown(Shutdown::Drain);
        mailbox.shutdown(Shutdown::Detach);
        assert_eq!(mailbox.take().shutdown, Some(Shutdown::Drain));
    }

    #[tokio::test(start_paused = true)]
    async fn a_push_before_the_wait_is_not_lost() {
        let mailbox = Mailbox::default();
        mailbox.set_target(Target::Absent);
        tokio::time::timeout(Duration::from_secs(1), mailbox.changed())
            .await
            .expect("the stored permit wakes the waiter at once");
    }
}
