//! An alloc's revisions: which one its worker holds, when the next one takes over, and
//! what a broken record, a removal or the agent's leaving does to them.
//!
//! The worker holds at most one revision of an alloc, the *current* one, and reconciles
//! it with [`AllocState::reconcile`]. Around that reconcile it asks this module twice:
//! [`decide`] before it (whether there is a revision to reconcile, and how), then
//! [`after_reconcile`] with what the reconcile left. Rules:
//! - a restored record that cannot be used (*broken*) runs nothing: it waits for the
//!   source, takes the first spec it sees for its own revision when the record did not
//!   name one, is destroyed once the source has been heard without a spec for it, and
//!   is left behind (a fresh revision starts) when a spec shows another revision or a
//!   user restarts it ([`restart_broken`]);
//! - with no current revision, a spec starts one and a missing spec destroys the alloc;
//! - the current revision runs only while a spec declares that same revision to run and
//!   the agent stays ([`should_run`]); a spec of the same revision with another
//!   `desiredStatus` is adopted in place;
//! - a new revision starts only once the old one is terminal with no driver operation
//!   in flight, and only after the old one's sticky disk moved to it: until the move
//!   succeeds the old revision stays, showing why, and every pass tries again;
//! - a removed alloc stays, stopped, until garbage collection asks for it;
//! - when the agent leaves, a detach leaves the tasks running for the next agent, and a
//!   drain stops them but leaves a terminal revision as it is: reconciling it with `run`
//!   off would record a stop, and the next agent would take a completed batch alloc for
//!   one the drain cut short;
//! - a restore resets the starts that were in flight when the agent died
//!   ([`reset_starts_in_flight`]).

use stead_schemas::Revision;
use stead_schemas::spec::Name;

use crate::alloc::{AllocState, CommandRefusal};
use crate::task::Process;

/// How the agent is leaving; a drain outranks a detach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum AgentShutdown {
    /// The tasks go on running for the next agent to reattach.
    Detach,
    /// Every task is stopped before the agent exits.
    Drain,
}

/// What the specs say the alloc should be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetRevision<'a> {
    /// No spec declares the alloc: it was removed, or (after a restore) the source has
    /// not listed it yet.
    Absent,
    /// A spec declares `revision` of the alloc.
    Spec {
        /// The spec's revision.
        revision: &'a Revision,
        /// Whether its `desiredStatus` is `stop`.
        stop: bool,
    },
}

/// A restored record that cannot be used: the alloc shows as failed and runs nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BrokenRecord<'a> {
    /// The revision the record stands for, as its text reads (it may not even be a valid
    /// revision); `None` when it cannot be read.
    pub revision: Option<&'a str>,
    /// Whether the source has said anything of the alloc since the restore: until then
    /// an absent target means "not listed yet", not "removed".
    pub heard: bool,
}

/// The revision the worker holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CurrentRevision<'a> {
    /// Its revision.
    pub revision: &'a Revision,
    /// Whether every task is dead with no process left ([`AllocState::is_terminal`]).
    pub terminal: bool,
    /// Whether any driver operation of it is still in flight.
    pub in_flight: bool,
    /// Whether garbage collection asked to destroy the alloc (asked only while it is
    /// collectable: removed, terminal, nothing in flight).
    pub collect_requested: bool,
    /// Whether the last try to hand its sticky disk over to the next revision failed
    /// (the failure is shown until no other revision waits for it).
    pub hand_over_failed: bool,
}

/// What the worker observes of an alloc's revisions at the start of a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RevisionInputs<'a> {
    /// What the specs say.
    pub target: TargetRevision<'a>,
    /// How the agent is leaving, once it is.
    pub shutdown: Option<AgentShutdown>,
    /// The broken record the alloc was restored from, until it is left behind. (A
    /// worker with a broken record holds no current revision.)
    pub broken: Option<BrokenRecord<'a>>,
    /// The revision the worker holds, if any.
    pub current: Option<CurrentRevision<'a>>,
}

/// What to do with the current revision's reconcile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reconcile {
    /// Whether its tasks should run ([`should_run`]).
    pub run: bool,
    /// The target is a spec of the same revision (perhaps with another `desiredStatus`):
    /// it replaces the current revision's spec in place.
    pub adopt_target_spec: bool,
    /// No other revision waits for the current one's sticky disk any more: the failure
    /// of the last hand-over is no longer shown.
    pub clear_hand_over_error: bool,
}

/// What a pass does before (or instead of) reconciling the current revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RevisionDecision {
    /// Nothing runs and the agent leaves: exit without writing anything.
    Exit,
    /// The broken record waits for a new revision, a user restart, or the source's word
    /// on the alloc: nothing is due until an input arrives.
    Wait,
    /// The broken record named no revision: it stands for this one (the first the source
    /// declares) from now on, and waits.
    AdoptBrokenRevision(Revision),
    /// Leave the broken record behind (its record stays as it is until overwritten): the
    /// target's revision starts afresh. Decide again.
    LeaveBroken,
    /// Nothing runs and no spec declares the alloc: remove its record and forget it.
    Destroy,
    /// No revision is held and a spec declares one: start it from a fresh state. Decide
    /// again.
    StartRevision,
    /// The agent leaves and nothing more of the current revision is to be stopped (a
    /// detach, or a drain of a terminal revision): write and publish what it is, stop
    /// watching its tasks, and exit.
    PersistAndExit,
    /// Reconcile the current revision, then ask [`after_reconcile`].
    Reconcile(Reconcile),
}

/// What follows a reconcile of the current revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterReconcile {
    /// Wait for input or the reconcile's wake-up time.
    Wait,
    /// The agent leaves and nothing of the revision runs any more: write and publish
    /// what it is, and exit.
    PersistAndExit,
    /// The removed alloc is terminal and garbage collection asked for it: destroy it.
    Collect,
    /// The old revision is terminal and another waits: write what it is, move its sticky
    /// disk to the new revision and let the new one start. While the move fails, the old
    /// revision stays showing why, and nothing is due until the next tick tries again.
    HandOver,
}

/// Whether the current revision's tasks should run: a spec declares that very revision
/// with `desiredStatus` other than `stop`, and the agent is not leaving.
pub fn should_run(
    target: TargetRevision<'_>,
    shutdown: Option<AgentShutdown>,
    current: &Revision,
) -> bool {
    shutdown.is_none()
        && match target {
            TargetRevision::Spec { revision, stop } => revision == current && !stop,
            TargetRevision::Absent => false,
        }
}

/// What a pass does first, from what the worker observes.
pub fn decide(inputs: &RevisionInputs<'_>) -> RevisionDecision {
    let RevisionInputs {
        target,
        shutdown,
        broken,
        current,
    } = *inputs;
    if let Some(broken) = broken {
        return match (target, shutdown) {
            (_, Some(_)) => RevisionDecision::Exit,
            (TargetRevision::Absent, None) if !broken.heard => RevisionDecision::Wait,
            (TargetRevision::Absent, None) => RevisionDecision::Destroy,
            (TargetRevision::Spec { revision, .. }, None) => match broken.revision {
                None => RevisionDecision::AdoptBrokenRevision(revision.clone()),
                Some(stored) if stored == revision.as_str() => RevisionDecision::Wait,
                Some(_) => RevisionDecision::LeaveBroken,
            },
        };
    }
    let Some(current) = current else {
        return match (target, shutdown) {
            // Nothing runs: nothing to drain, nothing to keep.
            (_, Some(_)) => RevisionDecision::Exit,
            (TargetRevision::Absent, None) => RevisionDecision::Destroy,
            (TargetRevision::Spec { .. }, None) => RevisionDecision::StartRevision,
        };
    };
    match shutdown {
        Some(AgentShutdown::Detach) => return RevisionDecision::PersistAndExit,
        Some(AgentShutdown::Drain) if current.terminal && !current.in_flight => {
            return RevisionDecision::PersistAndExit;
        }
        Some(AgentShutdown::Drain) | None => {}
    }
    let (same, replaced) = match target {
        TargetRevision::Spec { revision, .. } => {
            (revision == current.revision, revision != current.revision)
        }
        TargetRevision::Absent => (false, false),
    };
    RevisionDecision::Reconcile(Reconcile {
        run: should_run(target, shutdown, current.revision),
        adopt_target_spec: same,
        clear_hand_over_error: current.hand_over_failed && !replaced,
    })
}

/// What follows a reconcile of the current revision, from what the worker observes once
/// it is done (the same target and shutdown as the [`decide`] that asked for it).
pub fn after_reconcile(inputs: &RevisionInputs<'_>) -> AfterReconcile {
    let Some(current) = inputs.current else {
        return AfterReconcile::Wait;
    };
    let run = should_run(inputs.target, inputs.shutdown, current.revision);
    if run || !current.terminal || current.in_flight {
        return AfterReconcile::Wait;
    }
    match (inputs.shutdown, inputs.target) {
        (Some(_), _) => AfterReconcile::PersistAndExit,
        // The spec is gone and the alloc terminal: it stays (stopped) until garbage
        // collection destroys it.
        (None, TargetRevision::Absent) if current.collect_requested => AfterReconcile::Collect,
        (None, TargetRevision::Absent) => AfterReconcile::Wait,
        (None, TargetRevision::Spec { revision, .. }) if revision != current.revision => {
            AfterReconcile::HandOver
        }
        (None, TargetRevision::Spec { .. }) => AfterReconcile::Wait,
    }
}

/// Whether a user's restart of a broken alloc leaves its record behind (`Ok`: the
/// target's revision starts afresh, the way out of a record that cannot be used), or is
/// refused because no spec declares the alloc.
pub fn restart_broken(target: TargetRevision<'_>) -> Result<(), CommandRefusal> {
    match target {
        TargetRevision::Spec { .. } => Ok(()),
        TargetRevision::Absent => Err(CommandRefusal::TaskNotRunning),
    }
}

/// After a restore, sets back to [`Process::Idle`] every task that has a process yet no
/// handle to reattach to (`has_handle`): a start in flight when the agent died, whose
/// outcome is unknown, so the task starts again. Returns those tasks, in name order.
pub fn reset_starts_in_flight(
    state: &mut AllocState,
    has_handle: impl Fn(&Name) -> bool,
) -> Vec<Name> {
    let mut reset = Vec::new();
    for (task, task_state) in &mut state.tasks {
        if task_state.process != Process::Idle && !has_handle(task) {
            task_state.process = Process::Idle;
            reset.push(task.clone());
        }
    }
    reset
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::time::Duration;

    use stead_schemas::Timestamp;

    use super::*;
    use crate::task::TaskState;

    fn revision(digit: char) -> Revision {
        Revision::from_hex(&digit.to_string().repeat(64)).expect("64 hex digits")
    }

    fn runs(revision: &Revision) -> TargetRevision<'_> {
        TargetRevision::Spec {
            revision,
            stop: false,
        }
    }

    fn stops(revision: &Revision) -> TargetRevision<'_> {
        TargetRevision::Spec {
            revision,
            stop: true,
        }
    }

    /// A current revision whose tasks run.
    fn running(revision: &Revision) -> CurrentRevision<'_> {
        CurrentRevision {
            revision,
            terminal: false,
            in_flight: false,
            collect_requested: false,
            hand_over_failed: false,
        }
    }

    /// A current revision with every task dead and nothing in flight.
    fn terminal(revision: &Revision) -> CurrentRevision<'_> {
        CurrentRevision {
            terminal: true,
            ..running(revision)
        }
    }

    fn given(target: TargetRevision<'_>) -> RevisionInputs<'_> {
        RevisionInputs {
            target,
            shutdown: None,
            broken: None,
            current: None,
        }
    }

    fn holding<'a>(target: TargetRevision<'a>, current: CurrentRevision<'a>) -> RevisionInputs<'a> {
        RevisionInputs {
            current: Some(current),
            ..given(target)
        }
    }

    fn broken<'a>(
        target: TargetRevision<'a>,
        revision: Option<&'a str>,
        heard: bool,
    ) -> RevisionInputs<'a> {
        RevisionInputs {
            broken: Some(BrokenRecord { revision, heard }),
            ..given(target)
        }
    }

    fn leaving(how: AgentShutdown, inputs: RevisionInputs<'_>) -> RevisionInputs<'_> {
        RevisionInputs {
            shutdown: Some(how),
            ..inputs
        }
    }

    fn reconcile(
        run: bool,
        adopt_target_spec: bool,
        clear_hand_over_error: bool,
    ) -> RevisionDecision {
        RevisionDecision::Reconcile(Reconcile {
            run,
            adopt_target_spec,
            clear_hand_over_error,
        })
    }

    /// Each row as the worker asks: [`decide`], and [`after_reconcile`] only when it
    /// reconciles (here with the state the reconcile found: the rows are passes that
    /// change nothing).
    fn check(
        rows: &[(
            &str,
            RevisionInputs<'_>,
            RevisionDecision,
            Option<AfterReconcile>,
        )],
    ) {
        for (case, inputs, decision, after) in rows {
            let decided = decide(inputs);
            assert_eq!(decided, *decision, "{case}: {inputs:?}");
            let then =
                matches!(decided, RevisionDecision::Reconcile(_)).then(|| after_reconcile(inputs));
            assert_eq!(then, *after, "{case}, after the reconcile: {inputs:?}");
        }
    }

    #[test]
    fn restored_broken_record_should_wait_until_the_source_is_heard() {
        let a = revision('a');
        check(&[
            (
                "not listed yet",
                broken(TargetRevision::Absent, Some(a.as_str()), false),
                RevisionDecision::Wait,
                None,
            ),
            (
                "its own revision declared",
                broken(runs(&a), Some(a.as_str()), true),
                RevisionDecision::Wait,
                None,
            ),
            (
                "its own revision declared stopped",
                broken(stops(&a), Some(a.as_str()), true),
                RevisionDecision::Wait,
                None,
            ),
        ]);
    }

    #[test]
    fn broken_record_without_a_revision_should_take_the_first_declared_one() {
        let a = revision('a');
        check(&[(
            "the record named none",
            broken(runs(&a), None, true),
            RevisionDecision::AdoptBrokenRevision(a.clone()),
            None,
        )]);
    }

    #[test]
    fn broken_record_whose_spec_shows_a_new_revision_should_start_afresh() {
        let (a, b) = (revision('a'), revision('b'));
        check(&[
            (
                "a new revision",
                broken(runs(&b), Some(a.as_str()), true),
                RevisionDecision::LeaveBroken,
                None,
            ),
            (
                "a record whose revision cannot be one",
                broken(runs(&b), Some("not a revision"), true),
                RevisionDecision::LeaveBroken,
                None,
            ),
            (
                "then, left behind",
                given(runs(&b)),
                RevisionDecision::StartRevision,
                None,
            ),
        ]);
    }

    #[test]
    fn absent_target_after_being_heard_should_destroy_a_broken_alloc() {
        let a = revision('a');
        check(&[
            (
                "heard, then removed",
                broken(TargetRevision::Absent, Some(a.as_str()), true),
                RevisionDecision::Destroy,
                None,
            ),
            (
                "heard, never named",
                broken(TargetRevision::Absent, None, true),
                RevisionDecision::Destroy,
                None,
            ),
        ]);
    }

    #[test]
    fn user_restart_should_leave_a_broken_record_only_while_a_spec_declares_the_alloc() {
        let a = revision('a');
        assert_eq!(restart_broken(runs(&a)), Ok(()));
        assert_eq!(restart_broken(stops(&a)), Ok(()));
        assert_eq!(
            restart_broken(TargetRevision::Absent),
            Err(CommandRefusal::TaskNotRunning)
        );
    }

    #[test]
    fn alloc_without_a_revision_should_start_the_declared_one_or_be_destroyed() {
        let a = revision('a');
        check(&[
            (
                "declared",
                given(runs(&a)),
                RevisionDecision::StartRevision,
                None,
            ),
            (
                "declared stopped",
                given(stops(&a)),
                RevisionDecision::StartRevision,
                None,
            ),
            (
                "removed",
                given(TargetRevision::Absent),
                RevisionDecision::Destroy,
                None,
            ),
        ]);
    }

    #[test]
    fn detach_should_exit_and_leave_the_tasks_running() {
        let a = revision('a');
        check(&[
            (
                "a broken record",
                leaving(
                    AgentShutdown::Detach,
                    broken(TargetRevision::Absent, None, false),
                ),
                RevisionDecision::Exit,
                None,
            ),
            (
                "no revision held",
                leaving(AgentShutdown::Detach, given(runs(&a))),
                RevisionDecision::Exit,
                None,
            ),
            (
                "a running revision",
                leaving(AgentShutdown::Detach, holding(runs(&a), running(&a))),
                RevisionDecision::PersistAndExit,
                None,
            ),
            (
                "a running revision with a start in flight",
                leaving(
                    AgentShutdown::Detach,
                    holding(
                        runs(&a),
                        CurrentRevision {
                            in_flight: true,
                            ..running(&a)
                        },
                    ),
                ),
                RevisionDecision::PersistAndExit,
                None,
            ),
        ]);
    }

    #[test]
    fn drain_should_leave_a_terminal_alloc_alone() {
        let (a, b) = (revision('a'), revision('b'));
        check(&[
            (
                "terminal",
                leaving(AgentShutdown::Drain, holding(runs(&a), terminal(&a))),
                RevisionDecision::PersistAndExit,
                None,
            ),
            (
                "terminal, a new revision waiting",
                leaving(AgentShutdown::Drain, holding(runs(&b), terminal(&a))),
                RevisionDecision::PersistAndExit,
                None,
            ),
            (
                "a broken record",
                leaving(AgentShutdown::Drain, broken(runs(&a), None, true)),
                RevisionDecision::Exit,
                None,
            ),
            (
                "no revision held",
                leaving(AgentShutdown::Drain, given(TargetRevision::Absent)),
                RevisionDecision::Exit,
                None,
            ),
        ]);
    }

    #[test]
    fn drain_should_stop_a_running_alloc_and_exit_once_it_is_terminal() {
        let a = revision('a');
        check(&[
            (
                "running",
                leaving(AgentShutdown::Drain, holding(runs(&a), running(&a))),
                reconcile(false, true, false),
                Some(AfterReconcile::Wait),
            ),
            (
                "terminal, a kill still in flight",
                leaving(
                    AgentShutdown::Drain,
                    holding(
                        runs(&a),
                        CurrentRevision {
                            in_flight: true,
                            ..terminal(&a)
                        },
                    ),
                ),
                reconcile(false, true, false),
                Some(AfterReconcile::Wait),
            ),
        ]);
        // The reconcile that leaves it terminal is its last.
        let drained = leaving(AgentShutdown::Drain, holding(runs(&a), terminal(&a)));
        assert_eq!(after_reconcile(&drained), AfterReconcile::PersistAndExit);
    }

    #[test]
    fn same_revision_with_another_desired_status_should_be_adopted_in_place() {
        let a = revision('a');
        check(&[
            (
                "asked to stop",
                holding(stops(&a), running(&a)),
                reconcile(false, true, false),
                Some(AfterReconcile::Wait),
            ),
            (
                "stopped, and it stays",
                holding(stops(&a), terminal(&a)),
                reconcile(false, true, false),
                Some(AfterReconcile::Wait),
            ),
            (
                "asked to run again",
                holding(runs(&a), terminal(&a)),
                reconcile(true, true, false),
                Some(AfterReconcile::Wait),
            ),
        ]);
    }

    #[test]
    fn new_revision_should_start_only_once_the_old_one_is_terminal() {
        let (a, b) = (revision('a'), revision('b'));
        check(&[
            (
                "the old one runs",
                holding(runs(&b), running(&a)),
                reconcile(false, false, false),
                Some(AfterReconcile::Wait),
            ),
            (
                "the old one is dead with a driver operation in flight",
                holding(
                    runs(&b),
                    CurrentRevision {
                        in_flight: true,
                        ..terminal(&a)
                    },
                ),
                reconcile(false, false, false),
                Some(AfterReconcile::Wait),
            ),
            (
                "the old one is terminal",
                holding(runs(&b), terminal(&a)),
                reconcile(false, false, false),
                Some(AfterReconcile::HandOver),
            ),
            (
                "a stopped new revision takes over too",
                holding(stops(&b), terminal(&a)),
                reconcile(false, false, false),
                Some(AfterReconcile::HandOver),
            ),
            (
                "handed over",
                given(runs(&b)),
                RevisionDecision::StartRevision,
                None,
            ),
        ]);
    }

    #[test]
    fn new_revision_should_wait_while_the_sticky_disk_hand_over_fails() {
        let (a, b) = (revision('a'), revision('b'));
        let failed = CurrentRevision {
            hand_over_failed: true,
            ..terminal(&a)
        };
        check(&[(
            "the old revision stays, showing why, and the hand-over is tried again",
            holding(runs(&b), failed),
            reconcile(false, false, false),
            Some(AfterReconcile::HandOver),
        )]);
    }

    #[test]
    fn hand_over_error_should_clear_once_no_other_revision_waits() {
        let a = revision('a');
        let failed = CurrentRevision {
            hand_over_failed: true,
            ..terminal(&a)
        };
        check(&[
            (
                "back to the old revision",
                holding(runs(&a), failed),
                reconcile(true, true, true),
                Some(AfterReconcile::Wait),
            ),
            (
                "removed",
                holding(TargetRevision::Absent, failed),
                reconcile(false, false, true),
                Some(AfterReconcile::Wait),
            ),
        ]);
    }

    #[test]
    fn removed_terminal_alloc_should_wait_for_gc_and_collect_when_asked() {
        let a = revision('a');
        check(&[
            (
                "removed while it runs",
                holding(TargetRevision::Absent, running(&a)),
                reconcile(false, false, false),
                Some(AfterReconcile::Wait),
            ),
            (
                "removed and terminal",
                holding(TargetRevision::Absent, terminal(&a)),
                reconcile(false, false, false),
                Some(AfterReconcile::Wait),
            ),
            (
                "garbage collection asks",
                holding(
                    TargetRevision::Absent,
                    CurrentRevision {
                        collect_requested: true,
                        ..terminal(&a)
                    },
                ),
                reconcile(false, false, false),
                Some(AfterReconcile::Collect),
            ),
        ]);
    }

    #[test]
    fn tasks_should_run_only_for_the_declared_revision_while_the_agent_stays() {
        let (a, b) = (revision('a'), revision('b'));
        for (target, shutdown, expected) in [
            (runs(&a), None, true),
            (stops(&a), None, false),
            (runs(&b), None, false),
            (TargetRevision::Absent, None, false),
            (runs(&a), Some(AgentShutdown::Detach), false),
            (runs(&a), Some(AgentShutdown::Drain), false),
        ] {
            assert_eq!(
                should_run(target, shutdown, &a),
                expected,
                "{target:?}, {shutdown:?}"
            );
        }
    }

    #[test]
    fn restore_should_reset_starts_that_were_in_flight() {
        let at = |secs| Timestamp::from_since_epoch(Duration::from_secs(secs));
        let name = |s: &str| -> Name { s.parse().expect("valid name") };
        let task = |process| {
            Box::new(TaskState {
                process,
                ..TaskState::new(at(0))
            })
        };
        let mut state = AllocState {
            tasks: BTreeMap::from([
                (name("idle"), task(Process::Idle)),
                (name("reattached"), task(Process::Running { since: at(1) })),
                (name("starting"), task(Process::Starting { since: at(2) })),
                (name("unrecorded"), task(Process::Running { since: at(3) })),
                (name("handed"), task(Process::Starting { since: at(4) })),
            ]),
            shutdown: None,
            main_released: false,
            poststart_released: false,
        };
        let handles = BTreeSet::from([name("reattached"), name("handed")]);
        let reset = reset_starts_in_flight(&mut state, |task| handles.contains(task));
        assert_eq!(reset, [name("starting"), name("unrecorded")]);
        let processes: Vec<(&str, Process)> = state
            .tasks
            .iter()
            .map(|(task, state)| (task.as_str(), state.process))
            .collect();
        assert_eq!(
            processes,
            [
                ("handed", Process::Starting { since: at(4) }),
                ("idle", Process::Idle),
                ("reattached", Process::Running { since: at(1) }),
                ("starting", Process::Idle),
                ("unrecorded", Process::Idle),
            ]
        );
    }
}
