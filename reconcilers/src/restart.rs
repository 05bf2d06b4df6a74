//! The restart tracker: whether and when a task whose run ended starts again, by Nomad's rules.
//!
//! This follows Nomad's `client/allocrunner/taskrunner/restarts/restarts.go`: a window opens
//! when the tracker is created; every automatic restart decision counts one attempt in it
//! (failures, recoverable start errors, and successful exits that restart); a window older than
//! `interval` starts over; within `attempts` the task restarts after `delay` plus a jitter of
//! up to a quarter of it; past `attempts`, mode `fail` fails the task and mode `delay` waits out
//! the rest of the window. User-requested restarts are free and immediate.
//!
//! Beyond Nomad, an optional `maxDelay` makes the delay double per consecutive restart, up to
//! `maxDelay`, until the task runs for `interval` again.
//!
//! The tracker is plain data: time and randomness are inputs, so decisions are deterministic.

use std::fmt;
use std::time::Duration;

use stead_schemas::spec::RestartMode;
use stead_schemas::{RestartPolicy, Timestamp};

/// A uniformly random fraction in `[0, 1)` that sets the jitter of a restart delay.
///
/// It is `bits / 2^32`, so every value is in range and the arithmetic on it is exact; callers
/// draw `bits` from their random source (e.g. `rng.next_u32()`), tests pick it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Jitter(u32);

impl Jitter {
    /// No jitter: the restart waits exactly the delay.
    pub const ZERO: Jitter = Jitter(0);
    /// The largest jitter, just under a quarter of the delay.
    pub const MAX: Jitter = Jitter(u32::MAX);

    /// The fraction `bits / 2^32`.
    pub const fn from_bits(bits: u32) -> Self {
        Jitter(bits)
    }

    /// The `bits` it was made from, to be stored.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Nomad's `delay + rand.Int63n(delay) * 0.25` (truncated), with a zero delay taken as 1ns,
    /// and this jitter in place of `rand.Int63n(delay) / delay`.
    fn apply(self, delay: Duration) -> Duration {
        let delay_nanos = delay.as_nanos().max(1);
        // In [0, delay_nanos): bits < 2^32. No overflow: delay_nanos < 2^94.
        let drawn = (delay_nanos * u128::from(self.0)) >> 32;
        duration_from_nanos(delay_nanos + drawn / 4)
    }
}

/// How the task's last run ended, or why the tracker is asked for a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RunEnd {
    /// The task exited on its own.
    Exited {
        /// Exit code 0, no signal and no driver error (Nomad's `ExitResult.Successful`).
        successful: bool,
        /// How long the task ran before it exited.
        ran_for: Duration,
    },
    /// The driver could not start the task.
    StartFailed {
        /// Whether trying again may succeed (Nomad's `structs.IsRecoverable`).
        recoverable: bool,
    },
    /// A user asked for a restart; the task was stopped for it.
    RestartRequested {
        /// How long the task ran before it was stopped.
        ran_for: Duration,
    },
}

impl RunEnd {
    /// How long the task ran; zero when it never started.
    fn ran_for(self) -> Duration {
        match self {
            RunEnd::Exited { ran_for, .. } | RunEnd::RestartRequested { ran_for } => ran_for,
            RunEnd::StartFailed { .. } => Duration::ZERO,
        }
    }

    fn is_successful_exit(self) -> bool {
        matches!(
            self,
            RunEnd::Exited {
                successful: true,
                ..
            }
        )
    }
}

/// What to do with a task whose run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RestartDecision {
    /// Start the task again once `after` has passed.
    Restart {
        /// How long to wait before starting it; zero only for user-requested restarts.
        after: Duration,
        /// Why, for the `Restarting` event.
        reason: RestartReason,
    },
    /// Leave the task dead.
    DoNotRestart {
        /// Whether the task is failed (Nomad's `Not Restarting` event, which fails the task),
        /// rather than finished (Nomad's `TaskTerminated`).
        failed: bool,
        /// Why, for the `Not Restarting` event.
        reason: NoRestartReason,
    },
}

/// Why a task restarts. `Display` gives Nomad's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RestartReason {
    /// `Restart within policy`.
    WithinPolicy,
    /// `Exceeded allowed attempts, applying a delay`: mode `delay` past `attempts`.
    ExceededAttemptsApplyingDelay,
    /// A user asked for it. Nomad records an empty reason: the `Restart Signaled` event
    /// already says why, so this displays as the empty string.
    Requested,
}

impl fmt::Display for RestartReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RestartReason::WithinPolicy => "Restart within policy",
            RestartReason::ExceededAttemptsApplyingDelay => {
                "Exceeded allowed attempts, applying a delay"
            }
            RestartReason::Requested => "",
        })
    }
}

/// Why a task does not restart. `Display` gives Nomad's text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NoRestartReason {
    /// `Policy allows no restarts`: `attempts` is 0.
    NoRestartsAllowed,
    /// `Error was unrecoverable`: the driver cannot start the task.
    UnrecoverableError,
    /// `Restart unnecessary as task terminated successfully`.
    TerminatedSuccessfully,
    /// `Exceeded allowed attempts 2 in interval 30m0s and mode is "fail"`.
    ExceededAttempts {
        /// The policy's `attempts`.
        attempts: u32,
        /// The policy's `interval`.
        interval: stead_schemas::Duration,
    },
}

impl fmt::Display for NoRestartReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NoRestartReason::NoRestartsAllowed => f.write_str("Policy allows no restarts"),
            NoRestartReason::UnrecoverableError => f.write_str("Error was unrecoverable"),
            NoRestartReason::TerminatedSuccessfully => {
                f.write_str("Restart unnecessary as task terminated successfully")
            }
            NoRestartReason::ExceededAttempts { attempts, interval } => write!(
                f,
                "Exceeded allowed attempts {attempts} in interval {interval} and mode is \"fail\""
            ),
        }
    }
}

/// One task's restart history: all that restart decisions depend on besides the policy.
///
/// Plain data, persisted with the task so that restart counts survive an agent restart. Any
/// combination of field values is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RestartTracker {
    /// When the current window began: at creation, then at the first decision more than
    /// `interval` later.
    pub window_start: Timestamp,
    /// Automatic restart decisions taken in the current window (Nomad's `count`): failures,
    /// start errors and successful exits; never user-requested restarts.
    pub attempts_in_window: u32,
    /// Restarts the policy granted since the task last ran for at least `interval`; the delay
    /// is `delay × 2^consecutive_restarts`, capped at `maxDelay`, when `maxDelay` is set.
    pub consecutive_restarts: u32,
}

impl RestartTracker {
    /// A tracker whose first window opens at `now`.
    pub fn new(now: Timestamp) -> Self {
        RestartTracker {
            window_start: now,
            attempts_in_window: 0,
            consecutive_restarts: 0,
        }
    }

    /// Decides what follows `run_end` at `now`, and records it.
    ///
    /// `restart_on_success` is Nomad's onSuccess: whether a successful exit restarts (service
    /// main tasks and sidecars) or ends the task (batch, ephemeral lifecycle and poststop
    /// tasks). `jitter` is a fresh random draw.
    pub fn decide(
        &mut self,
        policy: &RestartPolicy,
        restart_on_success: bool,
        run_end: RunEnd,
        jitter: Jitter,
        now: Timestamp,
    ) -> RestartDecision {
        if run_end.ran_for() >= policy.interval.get() {
            self.consecutive_restarts = 0;
        }

        if let RunEnd::RestartRequested { .. } = run_end {
            return RestartDecision::Restart {
                after: Duration::ZERO,
                reason: RestartReason::Requested,
            };
        }

        if policy.attempts == 0 {
            let failed = restart_on_success || !run_end.is_successful_exit();
            return RestartDecision::DoNotRestart {
                failed,
                reason: NoRestartReason::NoRestartsAllowed,
            };
        }

        let interval = policy.interval.get();
        // Half-open windows: the window's last instant belongs to the next one (Nomad: `>`).
        if now.saturating_duration_since(self.window_start) >= interval {
            self.window_start = now;
            self.attempts_in_window = 0;
        }
        self.attempts_in_window = self.attempts_in_window.saturating_add(1);

        match run_end {
            RunEnd::StartFailed { recoverable: false } => {
                return RestartDecision::DoNotRestart {
                    failed: true,
                    reason: NoRestartReason::UnrecoverableError,
                };
            }
            RunEnd::Exited {
                successful: true, ..
            } if !restart_on_success => {
                return RestartDecision::DoNotRestart {
                    failed: false,
                    reason: NoRestartReason::TerminatedSuccessfully,
                };
            }
            _ => {}
        }

        if self.attempts_in_window > policy.attempts {
            match policy.mode {
                RestartMode::Fail => {
                    return RestartDecision::DoNotRestart {
                        failed: true,
                        reason: NoRestartReason::ExceededAttempts {
                            attempts: policy.attempts,
                            interval: policy.interval,
                        },
                    };
                }
                RestartMode::Delay => {
                    let elapsed = now.saturating_duration_since(self.window_start);
                    self.consecutive_restarts = self.consecutive_restarts.saturating_add(1);
                    return RestartDecision::Restart {
                        // Positive: the window would have started over otherwise.
                        after: interval - elapsed,
                        reason: RestartReason::ExceededAttemptsApplyingDelay,
                    };
                }
            }
        }

        let delay = backoff_delay(policy, self.consecutive_restarts);
        self.consecutive_restarts = self.consecutive_restarts.saturating_add(1);
        RestartDecision::Restart {
            after: jitter.apply(delay),
            reason: RestartReason::WithinPolicy,
        }
    }
}

/// `delay`, or with `maxDelay` set, `delay × 2^consecutive_restarts` capped at `maxDelay`
/// (a `maxDelay` below `delay` counts as `delay`).
fn backoff_delay(policy: &RestartPolicy, consecutive_restarts: u32) -> Duration {
    let delay = policy.delay.get();
    let Some(max_delay) = policy.max_delay else {
        return delay;
    };
    let cap = max_delay.get().max(delay).as_nanos();
    let factor = 1u128.checked_shl(consecutive_restarts).unwrap_or(u128::MAX);
    duration_from_nanos(delay.as_nanos().saturating_mul(factor).min(cap))
}

/// `nanos` as a duration, saturating at `Duration::MAX`.
fn duration_from_nanos(nanos: u128) -> Duration {
    let secs = u64::try_from(nanos / 1_000_000_000).unwrap_or(u64::MAX);
    let subsec = u32::try_from(nanos % 1_000_000_000).expect("below one second");
    Duration::new(secs, subsec)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: u64 = 60;

    fn at(secs: u64) -> Timestamp {
        Timestamp::from_since_epoch(Duration::from_secs(secs))
    }

    fn secs(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    fn policy(
        attempts: u32,
        interval_secs: u64,
        delay_secs: u64,
        mode: RestartMode,
    ) -> RestartPolicy {
        RestartPolicy {
            attempts,
            interval: stead_schemas::Duration::from_secs(interval_secs),
            delay: stead_schemas::Duration::from_secs(delay_secs),
            mode,
            max_delay: None,
        }
    }

    fn with_max_delay(policy: RestartPolicy, max_delay_secs: u64) -> RestartPolicy {
        RestartPolicy {
            max_delay: Some(stead_schemas::Duration::from_secs(max_delay_secs)),
            ..policy
        }
    }

    /// Nomad's service default: 2 attempts in 30m, 15s delay, mode fail.
    fn service() -> RestartPolicy {
        RestartPolicy::default_for(stead_schemas::spec::AllocType::Service)
    }

    fn crashed() -> RunEnd {
        RunEnd::Exited {
            successful: false,
            ran_for: secs(1),
        }
    }

    fn crashed_after(ran_for: Duration) -> RunEnd {
        RunEnd::Exited {
            successful: false,
            ran_for,
        }
    }

    fn exited_zero() -> RunEnd {
        RunEnd::Exited {
            successful: true,
            ran_for: secs(1),
        }
    }

    fn user_restart() -> RunEnd {
        RunEnd::RestartRequested { ran_for: secs(1) }
    }

    fn restart(after: Duration) -> RestartDecision {
        RestartDecision::Restart {
            after,
            reason: RestartReason::WithinPolicy,
        }
    }

    fn restart_after_window(after: Duration) -> RestartDecision {
        RestartDecision::Restart {
            after,
            reason: RestartReason::ExceededAttemptsApplyingDelay,
        }
    }

    fn requested() -> RestartDecision {
        RestartDecision::Restart {
            after: Duration::ZERO,
            reason: RestartReason::Requested,
        }
    }

    fn fail(reason: NoRestartReason) -> RestartDecision {
        RestartDecision::DoNotRestart {
            failed: true,
            reason,
        }
    }

    fn finish(reason: NoRestartReason) -> RestartDecision {
        RestartDecision::DoNotRestart {
            failed: false,
            reason,
        }
    }

    fn exceeded(policy: &RestartPolicy) -> RestartDecision {
        fail(NoRestartReason::ExceededAttempts {
            attempts: policy.attempts,
            interval: policy.interval,
        })
    }

    /// Runs `steps` of `(now in seconds, run end, expected decision)` through one tracker
    /// created at `created_at`, with no jitter, and returns the tracker.
    fn check(
        policy: &RestartPolicy,
        restart_on_success: bool,
        created_at: u64,
        steps: &[(u64, RunEnd, RestartDecision)],
    ) -> RestartTracker {
        let mut tracker = RestartTracker::new(at(created_at));
        for (step, (now, run_end, expected)) in steps.iter().enumerate() {
            let decision =
                tracker.decide(policy, restart_on_success, *run_end, Jitter::ZERO, at(*now));
            assert_eq!(
                decision, *expected,
                "step {step}: {run_end:?} at {now}s, tracker {tracker:?}"
            );
        }
        tracker
    }

    #[test]
    fn failures_within_attempts_restart_after_the_delay() {
        let tracker = check(
            &service(),
            true,
            0,
            &[
                (10, crashed(), restart(secs(15))),
                (40, crashed(), restart(secs(15))),
            ],
        );
        assert_eq!(
            tracker,
            RestartTracker {
                window_start: at(0),
                attempts_in_window: 2,
                consecutive_restarts: 2,
            }
        );
    }

    #[test]
    fn failure_beyond_attempts_in_fail_mode_fails_with_nomads_message() {
        let policy = service();
        check(
            &policy,
            true,
            0,
            &[
                (10, crashed(), restart(secs(15))),
                (40, crashed(), restart(secs(15))),
                (70, crashed(), exceeded(&policy)),
            ],
        );
        let reason = NoRestartReason::ExceededAttempts {
            attempts: 2,
            interval: stead_schemas::Duration::from_secs(30 * MINUTE),
        };
        assert_eq!(exceeded(&policy), fail(reason));
        assert_eq!(
            reason.to_string(),
            r#"Exceeded allowed attempts 2 in interval 30m0s and mode is "fail""#
        );
    }

    #[test]
    fn window_resets_after_interval() {
        let policy = policy(1, 10 * MINUTE, 15, RestartMode::Fail);
        let tracker = check(
            &policy,
            true,
            0,
            &[
                (60, crashed(), restart(secs(15))),
                // Past the window that opened at 0: a new one opens at 11m.
                (11 * MINUTE, crashed(), restart(secs(15))),
                (21 * MINUTE - 1, crashed(), exceeded(&policy)),
            ],
        );
        assert_eq!(tracker.window_start, at(11 * MINUTE));
        assert_eq!(tracker.attempts_in_window, 2);
    }

    #[test]
    fn window_is_half_open_so_its_last_instant_opens_the_next() {
        let policy = policy(1, 10 * MINUTE, 15, RestartMode::Fail);
        // One nanosecond before the end still counts in the first window.
        let mut tracker = RestartTracker::new(at(0));
        tracker.decide(&policy, true, crashed(), Jitter::ZERO, at(60));
        let just_before = Timestamp::from_since_epoch(secs(10 * MINUTE) - Duration::from_nanos(1));
        assert_eq!(
            tracker.decide(&policy, true, crashed(), Jitter::ZERO, just_before),
            exceeded(&policy)
        );
        // Exactly at the end a new window opens.
        let tracker = check(
            &policy,
            true,
            0,
            &[
                (60, crashed(), restart(secs(15))),
                (10 * MINUTE, crashed(), restart(secs(15))),
            ],
        );
        assert_eq!(tracker.window_start, at(10 * MINUTE));
        assert_eq!(tracker.attempts_in_window, 1);
    }

    #[test]
    fn mode_delay_waits_out_the_rest_of_the_window() {
        let policy = policy(2, 10 * MINUTE, 15, RestartMode::Delay);
        let tracker = check(
            &policy,
            true,
            100,
            &[
                (110, crashed(), restart(secs(15))),
                (140, crashed(), restart(secs(15))),
                // The window opened at 100s and ends at 700s.
                (170, crashed(), restart_after_window(secs(530))),
                (200, crashed(), restart_after_window(secs(500))),
                (699, crashed(), restart_after_window(secs(1))),
                // Restarted at the window's end and crashed at once: a fresh window, so the
                // decision moves time forward even when the driver takes none (paused time).
                (700, crashed(), restart(secs(15))),
            ],
        );
        assert_eq!(tracker.window_start, at(700));
        assert_eq!(tracker.attempts_in_window, 1);
    }

    #[test]
    fn mode_delay_never_fails_a_task() {
        let policy = policy(1, 60, 5, RestartMode::Delay);
        let mut tracker = RestartTracker::new(at(0));
        let mut now = at(0);
        for _ in 0..50 {
            let decision = tracker.decide(&policy, true, crashed(), Jitter::MAX, now);
            let RestartDecision::Restart { after, .. } = decision else {
                panic!("mode delay stopped restarting: {decision:?}");
            };
            assert!(after > Duration::ZERO, "{decision:?} at {now:?}");
            now = now + after;
        }
    }

    #[test]
    fn delay_is_within_delay_and_five_quarters_of_delay() {
        let nanos = Duration::from_nanos;
        // (delay, jitter, restart after)
        let table = [
            (secs(15), Jitter::ZERO, secs(15)),
            (secs(16), Jitter::from_bits(1 << 31), secs(18)),
            (secs(16), Jitter::from_bits(1 << 30), secs(17)),
            (secs(16), Jitter::MAX, secs(20) - nanos(1)),
            (nanos(4), Jitter::MAX, nanos(4)),
            (nanos(5), Jitter::MAX, nanos(6)),
            // Nomad takes a zero delay as 1ns.
            (Duration::ZERO, Jitter::ZERO, nanos(1)),
            (Duration::ZERO, Jitter::MAX, nanos(1)),
        ];
        for (delay, jitter, expected) in table {
            let policy = RestartPolicy {
                delay: delay.into(),
                ..service()
            };
            let mut tracker = RestartTracker::new(at(0));
            let decision = tracker.decide(&policy, true, crashed(), jitter, at(1));
            assert_eq!(decision, restart(expected), "delay {delay:?}, {jitter:?}");
        }
        for bits in [0, 1, 12_345, 1 << 20, u32::MAX / 3, u32::MAX - 1, u32::MAX] {
            let mut tracker = RestartTracker::new(at(0));
            let decision =
                tracker.decide(&service(), true, crashed(), Jitter::from_bits(bits), at(1));
            let RestartDecision::Restart { after, .. } = decision else {
                panic!("{decision:?}");
            };
            assert!(
                after >= secs(15) && after < secs(15) * 5 / 4,
                "{bits}: {after:?}"
            );
        }
    }

    #[test]
    fn user_restart_does_not_count() {
        let policy = service();
        let tracker = check(
            &policy,
            true,
            0,
            &[
                (10, user_restart(), requested()),
                (20, crashed(), restart(secs(15))),
                (40, user_restart(), requested()),
                (50, user_restart(), requested()),
                (60, crashed(), restart(secs(15))),
                (70, user_restart(), requested()),
                (80, crashed(), exceeded(&policy)),
            ],
        );
        assert_eq!(tracker.attempts_in_window, 3);
        assert_eq!(tracker.consecutive_restarts, 2);
    }

    #[test]
    fn user_restart_is_immediate_even_past_attempts_or_with_none_allowed() {
        check(
            &policy(0, 60, 15, RestartMode::Fail),
            true,
            0,
            &[(10, user_restart(), requested())],
        );
        let policy = policy(1, 60, 15, RestartMode::Delay);
        check(
            &policy,
            true,
            0,
            &[
                (1, crashed(), restart(secs(15))),
                (20, crashed(), restart_after_window(secs(40))),
                (30, user_restart(), requested()),
            ],
        );
    }

    #[test]
    fn attempts_zero_never_restarts_and_fails_unless_a_success_ends_the_task() {
        let no_restarts = NoRestartReason::NoRestartsAllowed;
        // (restart on success, run end, decision)
        let table = [
            (true, crashed(), fail(no_restarts)),
            (false, crashed(), fail(no_restarts)),
            // Nomad: a task meant to restart on success cannot, so it fails.
            (true, exited_zero(), fail(no_restarts)),
            (false, exited_zero(), finish(no_restarts)),
            (
                true,
                RunEnd::StartFailed { recoverable: true },
                fail(no_restarts),
            ),
            (
                true,
                RunEnd::StartFailed { recoverable: false },
                fail(no_restarts),
            ),
        ];
        for mode in [RestartMode::Fail, RestartMode::Delay] {
            let policy = policy(0, 60, 15, mode);
            for (restart_on_success, run_end, expected) in table {
                let mut tracker = RestartTracker::new(at(0));
                let decision =
                    tracker.decide(&policy, restart_on_success, run_end, Jitter::ZERO, at(10));
                assert_eq!(
                    decision, expected,
                    "{mode:?}, {restart_on_success}, {run_end:?}"
                );
                assert_eq!(tracker, RestartTracker::new(at(0)), "nothing is counted");
            }
        }
    }

    #[test]
    fn successful_exit_restarts_only_when_on_success_holds() {
        let terminated = finish(NoRestartReason::TerminatedSuccessfully);
        // (restart on success, run end, decision)
        let table = [
            (true, exited_zero(), restart(secs(15))),
            (false, exited_zero(), terminated),
            (true, crashed(), restart(secs(15))),
            (false, crashed(), restart(secs(15))),
        ];
        for (restart_on_success, run_end, expected) in table {
            let mut tracker = RestartTracker::new(at(0));
            let decision = tracker.decide(
                &service(),
                restart_on_success,
                run_end,
                Jitter::ZERO,
                at(10),
            );
            assert_eq!(decision, expected, "{restart_on_success}, {run_end:?}");
        }
        // Even past attempts, a success that does not restart ends the task unfailed.
        check(
            &service(),
            false,
            0,
            &[
                (10, crashed(), restart(secs(15))),
                (40, crashed(), restart(secs(15))),
                (70, exited_zero(), terminated),
            ],
        );
    }

    #[test]
    fn successful_exits_that_restart_count_toward_attempts() {
        let policy = service();
        check(
            &policy,
            true,
            0,
            &[
                (10, exited_zero(), restart(secs(15))),
                (40, exited_zero(), restart(secs(15))),
                (70, exited_zero(), exceeded(&policy)),
            ],
        );
    }

    #[test]
    fn unrecoverable_start_error_fails_at_once() {
        let unrecoverable = RunEnd::StartFailed { recoverable: false };
        let tracker = check(
            &service(),
            true,
            0,
            &[(10, unrecoverable, fail(NoRestartReason::UnrecoverableError))],
        );
        assert_eq!(tracker.attempts_in_window, 1, "counted, as in Nomad");
        // Also when attempts are used up: unrecoverable wins over the mode.
        check(
            &policy(1, 60, 5, RestartMode::Delay),
            true,
            0,
            &[
                (1, crashed(), restart(secs(5))),
                (10, unrecoverable, fail(NoRestartReason::UnrecoverableError)),
            ],
        );
    }

    #[test]
    fn recoverable_start_error_counts_like_a_failure() {
        let recoverable = RunEnd::StartFailed { recoverable: true };
        let policy = service();
        check(
            &policy,
            true,
            0,
            &[
                (10, recoverable, restart(secs(15))),
                (30, crashed(), restart(secs(15))),
                (50, recoverable, exceeded(&policy)),
            ],
        );
    }

    #[test]
    fn max_delay_doubles_and_caps_then_resets_after_a_long_run() {
        let policy = with_max_delay(policy(100, 60 * MINUTE, 10, RestartMode::Fail), 75);
        let tracker = check(
            &policy,
            true,
            0,
            &[
                (1, crashed(), restart(secs(10))),
                (20, crashed(), restart(secs(20))),
                (50, crashed(), restart(secs(40))),
                (100, crashed(), restart(secs(75))),
                (200, crashed(), restart(secs(75))),
                // A user restart neither grows nor resets the backoff after a short run.
                (300, user_restart(), requested()),
                (400, crashed(), restart(secs(75))),
                // Ran for the whole interval: back to the base delay.
                (7200, crashed_after(secs(60 * MINUTE)), restart(secs(10))),
                (7300, crashed(), restart(secs(20))),
            ],
        );
        assert_eq!(tracker.consecutive_restarts, 2);
    }

    #[test]
    fn backoff_resets_only_after_a_run_of_at_least_interval() {
        let policy = with_max_delay(policy(100, 60 * MINUTE, 10, RestartMode::Fail), 1000);
        let nearly = secs(60 * MINUTE) - Duration::from_nanos(1);
        check(
            &policy,
            true,
            0,
            &[
                (1, crashed(), restart(secs(10))),
                (20, crashed_after(nearly), restart(secs(20))),
                (40, crashed_after(secs(60 * MINUTE)), restart(secs(10))),
                (60, crashed(), restart(secs(20))),
                (
                    80,
                    RunEnd::RestartRequested {
                        ran_for: secs(60 * MINUTE),
                    },
                    requested(),
                ),
                (100, crashed(), restart(secs(10))),
            ],
        );
    }

    #[test]
    fn max_delay_jitter_adds_up_to_a_quarter_of_the_capped_delay() {
        let policy = with_max_delay(policy(100, 60 * MINUTE, 16, RestartMode::Fail), 40);
        let mut tracker = RestartTracker {
            consecutive_restarts: 5,
            ..RestartTracker::new(at(0))
        };
        let decision = tracker.decide(&policy, true, crashed(), Jitter::from_bits(1 << 31), at(1));
        assert_eq!(decision, restart(secs(45)));
    }

    #[test]
    fn mode_delay_restarts_also_grow_the_backoff() {
        let policy = with_max_delay(policy(1, 60, 5, RestartMode::Delay), 1000);
        check(
            &policy,
            true,
            0,
            &[
                (1, crashed(), restart(secs(5))),
                (10, crashed(), restart_after_window(secs(50))),
                (60, crashed(), restart(secs(20))),
            ],
        );
    }

    #[test]
    fn without_max_delay_the_delay_never_grows() {
        let policy = policy(100, 60 * MINUTE, 10, RestartMode::Fail);
        let steps: Vec<_> = (1..=20)
            .map(|i| (i * 30, crashed(), restart(secs(10))))
            .collect();
        let tracker = check(&policy, true, 0, &steps);
        assert_eq!(tracker.consecutive_restarts, 20);
    }

    #[test]
    fn max_delay_below_delay_counts_as_delay() {
        let policy = with_max_delay(policy(100, 60 * MINUTE, 10, RestartMode::Fail), 5);
        check(
            &policy,
            true,
            0,
            &[
                (1, crashed(), restart(secs(10))),
                (20, crashed(), restart(secs(10))),
            ],
        );
    }

    #[test]
    fn huge_counters_saturate_instead_of_overflowing() {
        let policy = with_max_delay(policy(u32::MAX, 60 * MINUTE, 10, RestartMode::Fail), 300);
        let mut tracker = RestartTracker {
            window_start: at(0),
            attempts_in_window: u32::MAX,
            consecutive_restarts: u32::MAX,
        };
        let decision = tracker.decide(&policy, true, crashed(), Jitter::ZERO, at(1));
        assert_eq!(decision, restart(secs(300)));
        assert_eq!(tracker.attempts_in_window, u32::MAX);
        assert_eq!(tracker.consecutive_restarts, u32::MAX);
    }

    #[test]
    fn now_before_the_window_start_counts_as_its_start() {
        let policy = policy(1, 60, 5, RestartMode::Delay);
        check(
            &policy,
            true,
            100,
            &[
                (90, crashed(), restart(secs(5))),
                (95, crashed(), restart_after_window(secs(60))),
            ],
        );
    }

    #[test]
    fn reasons_read_as_nomads() {
        let table: [(String, &str); 7] = [
            (
                RestartReason::WithinPolicy.to_string(),
                "Restart within policy",
            ),
            (
                RestartReason::ExceededAttemptsApplyingDelay.to_string(),
                "Exceeded allowed attempts, applying a delay",
            ),
            (RestartReason::Requested.to_string(), ""),
            (
                NoRestartReason::NoRestartsAllowed.to_string(),
                "Policy allows no restarts",
            ),
            (
                NoRestartReason::UnrecoverableError.to_string(),
                "Error was unrecoverable",
            ),
            (
                NoRestartReason::TerminatedSuccessfully.to_string(),
                "Restart unnecessary as task terminated successfully",
            ),
            (
                NoRestartReason::ExceededAttempts {
                    attempts: 3,
                    interval: stead_schemas::Duration::from_secs(24 * 3600),
                }
                .to_string(),
                r#"Exceeded allowed attempts 3 in interval 24h0m0s and mode is "fail""#,
            ),
        ];
        for (actual, expected) in table {
            assert_eq!(actual, expected);
        }
    }

    #[test]
    fn timestamps_add_and_subtract_offsets() {
        let start = at(10);
        assert_eq!(start + secs(5), at(15));
        assert_eq!(at(15).saturating_duration_since(start), secs(5));
        assert_eq!(start.saturating_duration_since(at(15)), Duration::ZERO);
        assert_eq!(Timestamp::EPOCH.since_epoch(), Duration::ZERO);
    }
}
