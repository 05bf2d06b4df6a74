//! Defaults (Nomad's), effective per-task values, the normalized spec and its revision hash.

use std::fmt;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::duration::Duration;
use crate::spec::*;

/// Default kill timeout of a task.
pub const DEFAULT_KILL_TIMEOUT: Duration = Duration::from_secs(5);
/// Default number of log files kept per stream.
pub const DEFAULT_LOG_MAX_FILES: u32 = 10;
/// Default log file size, in megabytes.
pub const DEFAULT_LOG_MAX_FILE_SIZE_MB: u32 = 10;
/// Default ephemeral disk size, in megabytes.
pub const DEFAULT_DISK_SIZE_MB: u64 = 300;
/// The smallest ephemeral disk, in megabytes (Nomad's).
pub const MIN_DISK_SIZE_MB: u64 = 10;
/// The smallest CPU a task may ask for, in MHz (Nomad's).
pub const MIN_CPU: u32 = 1;
/// The smallest memory a task may ask for, in megabytes (Nomad's).
pub const MIN_MEMORY_MB: u32 = 10;
/// The shortest restart interval allowed.
pub const MIN_RESTART_INTERVAL: Duration = Duration::from_secs(5);
/// A check's `interval` when unset.
pub const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(10);
/// A check's `timeout` when unset (or its `interval`, when that is shorter).
pub const DEFAULT_CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// The shortest check `interval` and `timeout`.
pub const MIN_CHECK_PERIOD: Duration = Duration::from_secs(1);
/// A check restart's `grace` when unset (Nomad's).
pub const DEFAULT_CHECK_GRACE: Duration = Duration::from_secs(1);
/// The host of an http or tcp check when unset: the task's own host.
pub const DEFAULT_CHECK_HOST: &str = "127.0.0.1";
/// The path of an http check when unset.
pub const DEFAULT_CHECK_PATH: &str = "/";
/// The method of an http check when unset.
pub const DEFAULT_CHECK_METHOD: &str = "GET";

/// A complete restart policy: the type's defaults, overlaid by the group's, then the task's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RestartPolicy {
    /// Failures allowed within `interval`.
    pub attempts: u32,
    /// The window in which failures are counted.
    pub interval: Duration,
    /// Base delay before a restart.
    pub delay: Duration,
    /// What happens past `attempts`.
    pub mode: RestartMode,
    /// When set, the delay doubles per consecutive restart up to this.
    pub max_delay: Option<Duration>,
}

impl RestartPolicy {
    /// Nomad's defaults for an alloc type.
    pub fn default_for(alloc_type: AllocType) -> Self {
        match alloc_type {
            AllocType::Service => RestartPolicy {
                attempts: 2,
                interval: Duration::from_secs(30 * 60),
                delay: Duration::from_secs(15),
                mode: RestartMode::Fail,
                max_delay: None,
            },
            AllocType::Batch => RestartPolicy {
                attempts: 3,
                interval: Duration::from_secs(24 * 3600),
                delay: Duration::from_secs(15),
                mode: RestartMode::Fail,
                max_delay: None,
            },
        }
    }

    /// This policy with the fields set in `spec` replaced.
    pub fn overlay(self, spec: Option<&RestartSpec>) -> Self {
        let Some(spec) = spec else { return self };
        RestartPolicy {
            attempts: spec.attempts.unwrap_or(self.attempts),
            interval: spec.interval.unwrap_or(self.interval),
            delay: spec.delay.unwrap_or(self.delay),
            mode: spec.mode.unwrap_or(self.mode),
            max_delay: spec.max_delay.or(self.max_delay),
        }
    }

    /// The problems of this policy (Nomad's rules, plus `maxDelay ≥ delay` and, in mode
    /// `fail`, `attempts × maxDelay ≤ interval`), as `(field, message)` pairs.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        self.problems_with_causes()
            .into_iter()
            .map(|(causes, message)| (causes[0], message))
            .collect()
    }

    /// The problems of this policy, each with the fields that cause it: the field it is
    /// about first, then the others that take part, so that a diagnostic can land on
    /// whichever of them a restart block sets.
    pub(crate) fn problems_with_causes(&self) -> Vec<(&'static [&'static str], String)> {
        let mut problems: Vec<(&'static [&'static str], String)> = Vec::new();
        if self.attempts == 0 && self.mode == RestartMode::Delay {
            problems.push((
                &["mode", "attempts"],
                "restart mode \"delay\" with 0 attempts is ambiguous; use mode \"fail\" or allow attempts"
                    .to_owned(),
            ));
        }
        if self.interval < MIN_RESTART_INTERVAL {
            problems.push((
                &["interval"],
                format!(
                    "interval can not be less than {MIN_RESTART_INTERVAL} (got {})",
                    self.interval
                ),
            ));
        }
        let total = self.delay.get().saturating_mul(self.attempts);
        if total > self.interval.get() {
            problems.push((
                &["delay", "attempts", "interval"],
                format!(
                    "{} attempts with a delay of {} take longer than the interval of {}",
                    self.attempts, self.delay, self.interval
                ),
            ));
        } else if self.mode == RestartMode::Fail
            && let Some(max_delay) = self.max_delay
            && max_delay > self.delay
            && longest_wait(max_delay.get(), self.attempts) >= self.interval.get()
        {
            // The restart tracker doubles the delay per consecutive restart up to
            // `maxDelay`, and brings it back to `delay` only after a run of a whole
            // interval; the attempts are counted in a window that starts over after
            // `interval`. A task that has restarted often enough (say it crashed a few
            // times after long, but not whole-interval, runs) waits `maxDelay` plus a jitter
            // of up to a quarter before every restart, so those waits must end inside the
            // window, which starts over at exactly `interval`: else its count starts over
            // before it passes `attempts`, and it restarts forever instead of failing.
            problems.push((
                &["maxDelay", "attempts", "delay", "interval", "mode"],
                format!(
                    "the delay doubles from {} up to maxDelay {max_delay} and stays there until the task runs for a whole interval, so {} attempts may wait up to {} ({} × {max_delay}, plus a jitter of up to a quarter), not less than the interval of {}, and mode \"fail\" would never be reached; lower maxDelay or attempts, or lengthen the interval",
                    self.delay,
                    self.attempts,
                    Duration::from(longest_wait(max_delay.get(), self.attempts)),
                    self.attempts,
                    self.interval
                ),
            ));
        }
        if let Some(max_delay) = self.max_delay
            && max_delay < self.delay
        {
            problems.push((
                &["maxDelay", "delay"],
                format!(
                    "maxDelay {max_delay} is shorter than the delay {}",
                    self.delay
                ),
            ));
        }
        problems
    }
}

/// The longest `attempts` restarts at a delay of `delay` may wait in all: each waits
/// the delay plus a jitter of up to a quarter of it (the restart tracker's).
fn longest_wait(delay: std::time::Duration, attempts: u32) -> std::time::Duration {
    delay.saturating_mul(attempts).saturating_mul(5) / 4
}

impl AllocBody {
    /// The alloc type, `service` when unset.
    pub fn effective_type(&self) -> AllocType {
        self.alloc_type.unwrap_or(AllocType::Service)
    }

    /// The group's restart policy over the type's defaults.
    pub fn group_restart_policy(&self) -> RestartPolicy {
        RestartPolicy::default_for(self.effective_type()).overlay(self.restart.as_ref())
    }

    /// The ephemeral disk size in megabytes.
    pub fn effective_disk_size_mb(&self) -> u64 {
        self.ephemeral_disk
            .and_then(|d| d.size_mb)
            .unwrap_or(DEFAULT_DISK_SIZE_MB)
    }
}

impl TaskSpec {
    /// The task's restart policy: type defaults, then the group's, then the task's own.
    pub fn restart_policy(&self, alloc: &AllocBody) -> RestartPolicy {
        alloc.group_restart_policy().overlay(self.restart.as_ref())
    }

    /// `(maxFiles, maxFileSizeMB)` with defaults.
    pub fn effective_logs(&self) -> (u32, u32) {
        let logs = self.logs.unwrap_or_default();
        (
            logs.max_files.unwrap_or(DEFAULT_LOG_MAX_FILES),
            logs.max_file_size_mb
                .unwrap_or(DEFAULT_LOG_MAX_FILE_SIZE_MB),
        )
    }

    /// Whether the task is a main task (no lifecycle hook).
    pub fn is_main(&self) -> bool {
        self.lifecycle.is_none()
    }
}

impl CheckSpec {
    /// `interval`, or its default.
    pub fn effective_interval(&self) -> Duration {
        self.interval.unwrap_or(DEFAULT_CHECK_INTERVAL)
    }

    /// `timeout`, or its default: 2s, or the interval when that is shorter.
    pub fn effective_timeout(&self) -> Duration {
        self.timeout
            .unwrap_or(DEFAULT_CHECK_TIMEOUT.min(self.effective_interval()))
    }

    /// The host an http or tcp check reaches.
    pub fn effective_host(&self) -> &str {
        self.host
            .as_ref()
            .map_or(DEFAULT_CHECK_HOST, |h| h.as_str())
    }

    /// The path an http check requests.
    pub fn effective_path(&self) -> &str {
        self.path
            .as_ref()
            .map_or(DEFAULT_CHECK_PATH, |p| p.as_str())
    }

    /// The method of an http check.
    pub fn effective_method(&self) -> &str {
        self.method
            .as_ref()
            .map_or(DEFAULT_CHECK_METHOD, |m| m.as_str())
    }
}

impl CheckRestartSpec {
    /// `grace`, or its default.
    pub fn effective_grace(&self) -> Duration {
        self.grace.unwrap_or(DEFAULT_CHECK_GRACE)
    }
}

/// A check with its defaults written out, where they apply to its type.
fn normalize_check(check: &CheckSpec) -> CheckSpec {
    let reaches = matches!(check.check_type, CheckType::Http | CheckType::Tcp);
    let http = check.check_type == CheckType::Http;
    CheckSpec {
        name: check.name.clone(),
        check_type: check.check_type,
        host: if reaches {
            check
                .host
                .clone()
                .or_else(|| DEFAULT_CHECK_HOST.parse().ok())
        } else {
            check.host.clone()
        },
        port: check.port,
        path: if http {
            check
                .path
                .clone()
                .or_else(|| DEFAULT_CHECK_PATH.parse().ok())
        } else {
            check.path.clone()
        },
        method: if http {
            check
                .method
                .clone()
                .or_else(|| DEFAULT_CHECK_METHOD.parse().ok())
        } else {
            check.method.clone()
        },
        command: check.command.clone(),
        args: check.args.clone().filter(|a| !a.is_empty()),
        interval: Some(check.effective_interval()),
        timeout: Some(check.effective_timeout()),
        restart: check.restart.map(|r| CheckRestartSpec {
            limit: r.limit,
            grace: Some(r.effective_grace()),
            ignore_warnings: Some(r.ignore_warnings.unwrap_or(false)),
        }),
    }
}

/// The spec with every default written out and `desiredStatus` left out, the input of
/// the revision hash: two specs that mean the same have the same normalized form.
pub fn normalize(spec: &AllocSpec) -> AllocSpec {
    let body = &spec.spec;
    let alloc_type = body.effective_type();
    let group_policy = body.group_restart_policy();
    let disk = body.ephemeral_disk.unwrap_or_default();
    let labels = spec.metadata.labels.clone().filter(|l| !l.is_empty());
    AllocSpec {
        api_version: spec.api_version.clone(),
        kind: spec.kind.clone(),
        metadata: Metadata {
            name: spec.metadata.name.clone(),
            labels,
            node_selector: None,
        },
        spec: AllocBody {
            alloc_type: Some(alloc_type),
            desired_status: None,
            restart: Some(restart_spec(group_policy)),
            ephemeral_disk: Some(EphemeralDiskSpec {
                size_mb: Some(body.effective_disk_size_mb()),
                sticky: Some(disk.sticky.unwrap_or(false)),
                migrate: Some(disk.migrate.unwrap_or(false)),
            }),
            shutdown_delay: Some(body.shutdown_delay.unwrap_or(Duration::ZERO)),
            tasks: body.tasks.iter().map(|t| normalize_task(t, body)).collect(),
        },
    }
}

fn restart_spec(policy: RestartPolicy) -> RestartSpec {
    RestartSpec {
        attempts: Some(policy.attempts),
        interval: Some(policy.interval),
        delay: Some(policy.delay),
        mode: Some(policy.mode),
        max_delay: policy.max_delay,
    }
}

fn normalize_task(task: &TaskSpec, body: &AllocBody) -> TaskSpec {
    let (max_files, max_file_size_mb) = task.effective_logs();
    let config = match &task.config {
        DriverConfig::Exec(exec) => DriverConfig::Exec(ExecConfig {
            command: exec.command.clone(),
            args: exec.args.clone().filter(|a| !a.is_empty()),
        }),
        DriverConfig::Mock(mock) => DriverConfig::Mock(mock.clone()),
    };
    let resources = task.resources.clone().map(|r| ResourcesSpec {
        cpu: r.cpu,
        // Off is the default, left out so that the revision stays.
        cpu_hard_limit: r.cpu_hard_limit.filter(|on| *on),
        memory_mb: r.memory_mb,
        memory_max_mb: r.memory_max_mb,
        pids: r.pids,
        oom_kill_group: r.oom_kill_group.filter(|on| *on),
        devices: r.devices.filter(|d| !d.is_empty()).map(|devices| {
            devices
                .into_iter()
                .map(|d| DeviceRequest {
                    name: d.name,
                    count: Some(d.count.unwrap_or(1)),
                })
                .collect()
        }),
    });
    TaskSpec {
        name: task.name.clone(),
        driver: task.driver,
        config,
        env: task.env.clone().filter(|e| !e.is_empty()),
        user: task.user.clone(),
        leader: Some(task.leader.unwrap_or(false)),
        lifecycle: task.lifecycle.map(|l| LifecycleSpec {
            hook: l.hook,
            sidecar: Some(l.sidecar.unwrap_or(false)),
        }),
        restart: Some(restart_spec(task.restart_policy(body))),
        kill_timeout: Some(task.kill_timeout.unwrap_or(DEFAULT_KILL_TIMEOUT)),
        kill_signal: Some(task.kill_signal.clone().unwrap_or_else(Signal::sigint)),
        shutdown_delay: Some(task.shutdown_delay.unwrap_or(Duration::ZERO)),
        logs: Some(LogsSpec {
            max_files: Some(max_files),
            max_file_size_mb: Some(max_file_size_mb),
        }),
        resources: resources.filter(|r| *r != ResourcesSpec::default()),
        checks: task
            .checks
            .as_ref()
            .filter(|c| !c.is_empty())
            .map(|checks| checks.iter().map(normalize_check).collect()),
    }
}

/// The hash of a normalized spec: same meaning, same revision; any change of meaning
/// (other than `desiredStatus`, which stops and starts an alloc in place) changes it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Revision(String);

impl Revision {
    /// The revision of `spec`.
    pub fn of(spec: &AllocSpec) -> Self {
        let normalized = normalize(spec);
        let canonical = serde_json::to_vec(&normalized)
            .expect("spec types serialize to JSON: string keys, no non-finite floats");
        Revision(hex(&Sha256::digest(&canonical)))
    }

    /// A revision read back from its text (64 lowercase hex digits), as stored or shown.
    pub fn from_hex(text: &str) -> Option<Self> {
        let valid = text.len() == 64
            && text
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        valid.then(|| Revision(text.to_owned()))
    }

    /// The full hash, 64 lowercase hex digits.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first 8 hex digits, as used in alloc ids.
    pub fn short(&self) -> &str {
        &self.0[..8]
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            write!(s, "{b:02x}").expect("writing to a string cannot fail");
            s
        })
}

/// The id of one running instance of a spec revision: `<name>-<first 8 hex of revision>`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct AllocId(String);

impl AllocId {
    /// The id of `revision` of the alloc named `name`.
    pub fn new(name: &Name, revision: &Revision) -> Self {
        AllocId(format!("{name}-{}", revision.short()))
    }

    /// The id as text; safe as a path component.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for AllocId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(attempts: u32, interval: u64, delay: u64, mode: RestartMode) -> RestartPolicy {
        RestartPolicy {
            attempts,
            interval: Duration::from_secs(interval),
            delay: Duration::from_secs(delay),
            mode,
            max_delay: None,
        }
    }

    #[test]
    fn restart_policy_rules_are_nomads() {
        let fields =
            |p: RestartPolicy| p.problems().into_iter().map(|(f, _)| f).collect::<Vec<_>>();
        assert!(fields(RestartPolicy::default_for(AllocType::Service)).is_empty());
        assert!(fields(RestartPolicy::default_for(AllocType::Batch)).is_empty());
        assert!(fields(policy(0, 60, 1, RestartMode::Fail)).is_empty());
        assert_eq!(fields(policy(0, 60, 1, RestartMode::Delay)), ["mode"]);
        assert_eq!(fields(policy(1, 4, 1, RestartMode::Fail)), ["interval"]);
        assert!(
            fields(policy(5, 10, 2, RestartMode::Fail)).is_empty(),
            "5 × 2s = 10s fits"
        );
        assert_eq!(fields(policy(6, 10, 2, RestartMode::Fail)), ["delay"]);
        let mut capped = policy(1, 60, 10, RestartMode::Fail);
        capped.max_delay = Some(Duration::from_secs(5));
        assert_eq!(fields(capped), ["maxDelay"]);
    }

    #[test]
    fn in_mode_fail_attempts_at_the_grown_delay_must_fit_in_the_interval() {
        let fields =
            |p: RestartPolicy| p.problems().into_iter().map(|(f, _)| f).collect::<Vec<_>>();
        let doubling = |attempts, interval, delay, max_delay, mode| RestartPolicy {
            max_delay: Some(Duration::from_secs(max_delay)),
            ..policy(attempts, interval, delay, mode)
        };
        // Not even a first crash loop fits: 15s, 30s, 1m is 1m45s for 3 attempts in 1m.
        assert_eq!(
            fields(doubling(3, 60, 15, 3600, RestartMode::Fail)),
            ["maxDelay"]
        );
        // A first crash loop fits (5s, 10s, 25s), but once the delay has grown to 25s
        // (after short runs that do not reset it) 3 × 25s does not.
        assert_eq!(
            fields(doubling(3, 60, 5, 25, RestartMode::Fail)),
            ["maxDelay"]
        );
        // 3 × 16s plus a quarter is the 1m window exactly, which starts over at 1m: the
        // count would start over too. 3 × 15s plus a quarter (56.25s) ends inside it.
        assert_eq!(
            fields(doubling(3, 60, 5, 16, RestartMode::Fail)),
            ["maxDelay"]
        );
        assert!(fields(doubling(3, 60, 5, 15, RestartMode::Fail)).is_empty());
        assert_eq!(
            fields(doubling(3, 60, 5, 20, RestartMode::Fail)),
            ["maxDelay"],
            "3 × 20s is the interval, which jitter only lengthens"
        );
        // Mode delay never fails, so it has nothing to reach.
        assert!(fields(doubling(3, 60, 15, 3600, RestartMode::Delay)).is_empty());
        // Past `attempts × delay` only the base rule is reported.
        assert_eq!(
            fields(doubling(5, 60, 15, 3600, RestartMode::Fail)),
            ["delay"]
        );
        // A maxDelay below the delay is reported as such, not as a grown delay.
        assert_eq!(
            fields(doubling(3, 60, 10, 5, RestartMode::Fail)),
            ["maxDelay"]
        );
        // Huge counts saturate.
        assert_eq!(
            fields(doubling(u32::MAX, 3600, 0, 3600, RestartMode::Fail)),
            ["maxDelay"]
        );
    }

    #[test]
    fn task_overrides_apply_field_by_field_over_group_and_type() {
        let group = RestartSpec {
            attempts: Some(5),
            ..RestartSpec::default()
        };
        let task = RestartSpec {
            delay: Some(Duration::from_secs(1)),
            ..RestartSpec::default()
        };
        let effective = RestartPolicy::default_for(AllocType::Batch)
            .overlay(Some(&group))
            .overlay(Some(&task));
        assert_eq!(effective.attempts, 5);
        assert_eq!(effective.delay, Duration::from_secs(1));
        assert_eq!(effective.interval, Duration::from_secs(24 * 3600));
    }
}
