//! The per-alloc queue: how inputs reach an alloc's worker without ever blocking the sender.
//!
//! Its rules are the agent's core concurrency guarantee:
//! - the desired spec is a level, not a log: a newer update replaces a pending one
//!   (counted as coalesced), so only the newest is ever applied, and a removal that
//!   arrives after updates preempts them;
//! - user commands (restart, signal) keep their order;
//! - agent shutdown is final and overrides everything else;
//! - pushing never waits: the sender takes a short lock, never across an `.await`, and
//!   the worker is woken through a `Notify` that keeps a permit, so no wake-up is lost;
//! - every input counts as one in the mailbox, and the worker notes the count it took at
//!   the start of each pass with its next due time, so the node's tick can tell a worker
//!   with something new or due (woken) from one with nothing to do (left asleep).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use stead_reconcilers::alloc::CommandRefusal;
use stead_schemas::spec::{Name, Signal};
use stead_schemas::{AllocId, Timestamp, ValidSpec};
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
    inner: Arc<Shared>,
}

/// What a mailbox's senders, its worker and the node's tick share.
#[derive(Debug)]
struct Shared {
    pending: Mutex<Inner>,
    notify: Notify,
    /// Inputs pushed so far (wrapping): each wake-up for something new adds one.
    inputs: AtomicU64,
    /// `inputs` as the worker read it at the start of its last pass.
    seen: AtomicU64,
    /// When the worker is next due of its own accord (a restart delay, a kill timeout, a
    /// store retry), as milliseconds since the epoch; `u64::MAX` when never.
    due_ms: AtomicU64,
    /// Wake-ups still to be dropped (fault injection, see [`Mailbox::lose_wake_ups`]).
    lose: AtomicU32,
}

impl Default for Shared {
    fn default() -> Self {
        Shared {
            pending: Mutex::default(),
            notify: Notify::new(),
            inputs: AtomicU64::new(0),
            seen: AtomicU64::new(0),
            due_ms: AtomicU64::new(u64::MAX),
            lose: AtomicU32::new(0),
        }
    }
}

/// Milliseconds since the epoch, rounded down (a due time read a little early only
/// wakes a worker that finds nothing to do yet).
fn millis(at: Timestamp) -> u64 {
    u64::try_from(at.since_epoch().as_millis()).unwrap_or(u64::MAX)
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panicking holder leaves plain data behind; keep going with it.
        self.inner.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes the worker for an input kept elsewhere (a driver report, a change of the
    /// node's drivers or devices): it counts as new since the worker's last pass.
    pub(crate) fn wake(&self) {
        let lost = self
            .inner
            .lose
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        if lost {
            return;
        }
        self.inner.inputs.fetch_add(1, Ordering::Release);
        self.inner.notify.notify_one();
    }

    /// The worker begins a pass: whatever arrives from now on is new to it.
    pub(crate) fn begin_pass(&self) {
        let inputs = self.inner.inputs.load(Ordering::Acquire);
        self.inner.seen.store(inputs, Ordering::Release);
    }

    /// The worker ended a pass and is next due of its own accord at `at` (never: `None`).
    pub(crate) fn set_due(&self, at: Option<Timestamp>) {
        self.inner
            .due_ms
            .store(at.map_or(u64::MAX, millis), Ordering::Release);
    }

    /// The node's tick reaches this mailbox at `now`: wakes the worker when an input
    /// arrived since its last pass (its own wake-up was lost), its due time has come, or
    /// `sweep` (the slow full sweep wakes every worker); true when it woke it. A worker
    /// with nothing new and nothing due is left asleep, so an idle node's tick costs a
    /// few loads per alloc rather than a pass.
    pub(crate) fn tick(&self, now: Timestamp, sweep: bool) -> bool {
        let wake = sweep
            || self.inner.inputs.load(Ordering::Acquire) != self.inner.seen.load(Ordering::Acquire)
            || self.inner.due_ms.load(Ordering::Acquire) <= millis(now);
        if wake {
            self.inner.notify.notify_one();
        }
        wake
    }

    /// Fault injection: the next `count` wake-ups are dropped whole (neither counted nor
    /// delivered), as a bug that forgot to wake the worker would drop them. What they
    /// announced stays pending until the slow full sweep of the node's tick.
    pub(crate) fn lose_wake_ups(&self, count: u32) {
        self.inner.lose.fetch_add(count, Ordering::Relaxed);
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
        self.inner.notify.notified().await;
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
