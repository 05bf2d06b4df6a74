//! Health checks: each check's state, and Nomad's `check_restart` arithmetic with time as
//! an input.
//!
//! This follows Nomad's `client/serviceregistration/checks/checkrestart` watcher: a check
//! result during the task's grace period (counted from each (re)start of the task) is
//! shown but never counted; the first non-passing result after it marks the check
//! unhealthy; a result that finds the check still unhealthy `interval × (limit − 1)`
//! later restarts the task (with `limit: 1`, the first failure does); a passing result,
//! or a warning when warnings are ignored, clears it. The shell runs the checks and
//! feeds each result in; nothing here waits or reads a clock.

use std::fmt;
use std::time::Duration;

use stead_schemas::Timestamp;
use stead_schemas::spec::{CheckSpec, Name};

/// Everything the reconcilers need of one check.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CheckSettings {
    /// The check's name, unique in its task.
    pub name: Name,
    /// Time between results.
    pub interval: Duration,
    /// How long one check may take.
    pub timeout: Duration,
    /// When the check restarts its task; `None`: it only reports.
    pub restart: Option<CheckRestart>,
}

impl CheckSettings {
    /// The settings of a validated check, with its defaults.
    pub fn new(spec: &CheckSpec) -> Self {
        CheckSettings {
            name: spec.name.clone(),
            interval: spec.effective_interval().get(),
            timeout: spec.effective_timeout().get(),
            restart: spec.restart.map(|restart| CheckRestart {
                limit: restart.limit,
                grace: restart.effective_grace().get(),
                ignore_warnings: restart.ignore_warnings.unwrap_or(false),
            }),
        }
    }
}

/// Nomad's `check_restart` of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CheckRestart {
    /// How many failing intervals restart the task; at least 1.
    pub limit: u32,
    /// Time after each (re)start of the task during which results are not counted.
    pub grace: Duration,
    /// Whether a warning counts as passing.
    pub ignore_warnings: bool,
}

impl CheckRestart {
    /// How long the check may stay unhealthy before the task restarts:
    /// `interval × (limit − 1)`.
    pub fn time_limit(&self, interval: Duration) -> Duration {
        interval.saturating_mul(self.limit.saturating_sub(1))
    }
}

/// A check's last result, as Nomad's (Consul's) check statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CheckStatus {
    /// No result since the task (re)started.
    Pending,
    /// The check passed.
    Passing,
    /// The check passed with a warning (http 429, exec exit 1).
    Warning,
    /// The check failed, or gave no answer within its timeout.
    Critical,
}

impl CheckStatus {
    /// Every status, in the order they are listed.
    pub const ALL: [CheckStatus; 4] = [
        CheckStatus::Pending,
        CheckStatus::Passing,
        CheckStatus::Warning,
        CheckStatus::Critical,
    ];

    /// `pending`, `passing`, `warning` or `critical`.
    pub fn as_str(self) -> &'static str {
        match self {
            CheckStatus::Pending => "pending",
            CheckStatus::Passing => "passing",
            CheckStatus::Warning => "warning",
            CheckStatus::Critical => "critical",
        }
    }

    /// The status named `text`, as [`CheckStatus::as_str`] writes it.
    pub fn parse(text: &str) -> Option<Self> {
        CheckStatus::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

impl fmt::Display for CheckStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One result of a check, as the shell reports it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CheckResult {
    /// Passing, warning or critical.
    pub status: CheckStatus,
    /// What the check said (capped by the shell).
    pub output: String,
    /// Passing results identical to the last one reported that came before this one and
    /// were only counted (they change nothing else).
    pub repeats: u32,
}

/// One check's state in the task's current run; persisted with the task, so that after
/// an agent restart the check resumes where it was.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CheckState {
    /// The last result's status.
    pub status: CheckStatus,
    /// The last result's output (capped by the shell).
    pub output: String,
    /// When the status took its current value; `None` while pending.
    pub since: Option<Timestamp>,
    /// How many results in a row had this status.
    pub consecutive: u32,
    /// When the check became unhealthy, for its restart; `None` while healthy, during
    /// the grace period, and for checks that do not restart their task.
    pub unhealthy_since: Option<Timestamp>,
}

impl Default for CheckState {
    fn default() -> Self {
        CheckState::pending()
    }
}

impl CheckState {
    /// A check with no result yet.
    pub fn pending() -> Self {
        CheckState {
            status: CheckStatus::Pending,
            output: String::new(),
            since: None,
            consecutive: 0,
            unhealthy_since: None,
        }
    }

    /// Records a result at `now` for the run of the task that started at `started`;
    /// true when the task must restart for it.
    pub fn observe(
        &mut self,
        settings: &CheckSettings,
        result: CheckResult,
        started: Timestamp,
        now: Timestamp,
    ) -> bool {
        let CheckResult {
            status,
            output,
            repeats,
        } = result;
        // The results only counted repeated the last status.
        self.consecutive = self.consecutive.saturating_add(repeats);
        if status == self.status {
            self.consecutive = self.consecutive.saturating_add(1);
        } else {
            self.status = status;
            self.since = Some(now);
            self.consecutive = 1;
        }
        self.output = output;
        let Some(restart) = settings.restart else {
            self.unhealthy_since = None;
            return false;
        };
        let healthy = match status {
            CheckStatus::Pending | CheckStatus::Passing => true,
            CheckStatus::Warning => restart.ignore_warnings,
            CheckStatus::Critical => false,
        };
        if healthy {
            self.unhealthy_since = None;
            return false;
        }
        if now < started + restart.grace {
            return false;
        }
        let since = *self.unhealthy_since.get_or_insert(now);
        if now < since + restart.time_limit(settings.interval) {
            return false;
        }
        self.unhealthy_since = None;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at_ms(ms: u64) -> Timestamp {
        Timestamp::from_since_epoch(Duration::from_millis(ms))
    }

    fn settings(interval_ms: u64, restart: Option<(u32, u64, bool)>) -> CheckSettings {
        CheckSettings {
            name: "alive".parse().expect("valid name"),
            interval: Duration::from_millis(interval_ms),
            timeout: Duration::from_millis(interval_ms / 2),
            restart: restart.map(|(limit, grace_ms, ignore_warnings)| CheckRestart {
                limit,
                grace: Duration::from_millis(grace_ms),
                ignore_warnings,
            }),
        }
    }

    use CheckStatus::{Critical, Passing, Warning};

    fn result(status: CheckStatus, output: &str) -> CheckResult {
        CheckResult {
            status,
            output: output.to_owned(),
            repeats: 0,
        }
    }

    /// Feeds `results` (ms since the task started at 0, status) and returns the times
    /// at which the task is restarted. A restart starts the task again at once, as the
    /// worker's next run would: grace counts from there.
    fn restarts(settings: &CheckSettings, results: &[(u64, CheckStatus)]) -> Vec<u64> {
        let mut state = CheckState::pending();
        let mut started = at_ms(0);
        let mut restarted = Vec::new();
        for &(ms, status) in results {
            if state.observe(settings, result(status, ""), started, at_ms(ms)) {
                restarted.push(ms);
                started = at_ms(ms);
                state = CheckState::pending();
            }
        }
        restarted
    }

    /// Results every `every_ms` from `from_ms` to `to_ms` inclusive.
    fn every(
        from_ms: u64,
        to_ms: u64,
        every_ms: u64,
        status: CheckStatus,
    ) -> Vec<(u64, CheckStatus)> {
        (from_ms..=to_ms)
            .step_by(usize::try_from(every_ms).expect("small"))
            .map(|ms| (ms, status))
            .collect()
    }

    #[test]
    fn the_restart_arithmetic_follows_nomads_check_restart() {
        struct Case {
            name: &'static str,
            settings: CheckSettings,
            results: Vec<(u64, CheckStatus)>,
            restarts: Vec<u64>,
        }
        let failing_from_5s = |limit, grace| {
            let mut results = every(1_000, 4_000, 1_000, Passing);
            results.extend(every(5_000, 20_000, 1_000, Critical));
            (settings(1_000, Some((limit, grace, false))), results)
        };
        let (limit_3, limit_3_results) = failing_from_5s(3, 0);
        let (limit_1, limit_1_results) = failing_from_5s(1, 0);
        let cases = vec![
            Case {
                // First failure at 5 s; interval × (limit − 1) = 2 s later, exactly.
                name: "limit 3, interval 1s: restart 2s after the first failure",
                settings: limit_3,
                results: limit_3_results[..7].to_vec(),
                restarts: vec![7_000],
            },
            Case {
                name: "limit 1: restart at the first failure",
                settings: limit_1,
                results: limit_1_results[..5].to_vec(),
                restarts: vec![5_000],
            },
            Case {
                name: "grace 10s: failures before it count for nothing",
                settings: settings(1_000, Some((1, 10_000, false))),
                results: every(1_000, 10_000, 1_000, Critical),
                restarts: vec![10_000],
            },
            Case {
                name: "grace 10s with limit 3: the count starts at the end of grace",
                settings: settings(1_000, Some((3, 10_000, false))),
                results: every(1_000, 12_000, 1_000, Critical),
                restarts: vec![12_000],
            },
            Case {
                name: "warnings with ignoreWarnings never restart",
                settings: settings(1_000, Some((1, 0, true))),
                results: every(1_000, 60_000, 1_000, Warning),
                restarts: vec![],
            },
            Case {
                name: "warnings without ignoreWarnings restart as failures do",
                settings: settings(1_000, Some((2, 0, false))),
                results: every(1_000, 3_000, 1_000, Warning),
                restarts: vec![2_000],
            },
            Case {
                name: "a passing result in between resets the count",
                settings: settings(1_000, Some((3, 0, false))),
                results: vec![
                    (1_000, Critical),
                    (2_000, Critical),
                    (3_000, Passing),
                    (4_000, Critical),
                    (5_000, Critical),
                    (6_000, Critical),
                ],
                restarts: vec![6_000],
            },
            Case {
                name: "a check without restart only reports",
                settings: settings(1_000, None),
                results: every(1_000, 60_000, 1_000, Critical),
                restarts: vec![],
            },
            Case {
                name: "grace counts again from each restart",
                settings: settings(1_000, Some((1, 3_000, false))),
                results: every(1_000, 10_000, 1_000, Critical),
                // 3 s: grace ends; restart. Then grace runs to 6 s, and again to 9 s.
                restarts: vec![3_000, 6_000, 9_000],
            },
            Case {
                name: "late results restart at the first one past the deadline",
                settings: settings(1_000, Some((3, 0, false))),
                results: vec![(1_000, Critical), (2_500, Critical), (3_100, Critical)],
                restarts: vec![3_100],
            },
        ];
        for case in cases {
            assert_eq!(
                restarts(&case.settings, &case.results),
                case.restarts,
                "{}",
                case.name
            );
        }
    }

    #[test]
    fn status_since_and_consecutive_follow_the_results() {
        let settings = settings(1_000, None);
        let mut state = CheckState::pending();
        let started = at_ms(0);
        for (ms, status) in [(1_000, Passing), (2_000, Passing), (3_000, Critical)] {
            state.observe(
                &settings,
                result(status, &format!("at {ms}")),
                started,
                at_ms(ms),
            );
        }
        assert_eq!(state.status, Critical);
        assert_eq!(state.since, Some(at_ms(3_000)));
        assert_eq!(state.consecutive, 1);
        assert_eq!(state.output, "at 3000");
        state.observe(&settings, result(Critical, ""), started, at_ms(4_000));
        assert_eq!((state.since, state.consecutive), (Some(at_ms(3_000)), 2));
        // Results only counted in between repeated the status they followed.
        state.observe(&settings, result(Passing, ""), started, at_ms(5_000));
        let counted = CheckResult {
            repeats: 3,
            ..result(Passing, "")
        };
        state.observe(&settings, counted, started, at_ms(9_000));
        assert_eq!((state.since, state.consecutive), (Some(at_ms(5_000)), 5));
    }

    #[test]
    fn an_unhealthy_check_remembers_when_it_became_unhealthy_until_it_passes() {
        let settings = settings(1_000, Some((3, 0, false)));
        let mut state = CheckState::pending();
        state.observe(&settings, result(Critical, ""), at_ms(0), at_ms(5_000));
        state.observe(&settings, result(Critical, ""), at_ms(0), at_ms(6_000));
        assert_eq!(state.unhealthy_since, Some(at_ms(5_000)));
        state.observe(&settings, result(Passing, ""), at_ms(0), at_ms(6_500));
        assert_eq!(state.unhealthy_since, None);
    }

    #[test]
    fn statuses_read_back_from_their_names() {
        for status in CheckStatus::ALL {
            assert_eq!(CheckStatus::parse(status.as_str()), Some(status));
        }
        assert_eq!(CheckStatus::parse("ok"), None);
    }
}
