//! What every benchmark measures with: the clock (through the agent's clock module, the
//! only place that reads it), medians, and the process table.

use std::time::Instant;

/// Now.
pub(crate) fn now() -> Instant {
    stead_controller::clock::Clock::system()
        .instant()
        .into_std()
}

/// The kernel's monotonic clock in nanoseconds: `CLOCK_MONOTONIC`, which [`now`] reads
/// too and the kernel stamps its process events with (`ktime_get_ns`).
pub(crate) fn monotonic_ns() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    u64::try_from(now.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(now.tv_nsec).unwrap_or(0)
}

/// The median of `values` (the upper one of an even count).
pub(crate) fn median<T: Copy + PartialOrd>(values: &[T]) -> T {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    sorted[sorted.len() / 2]
}

/// The median (as [`median`]), the least and the greatest of `values`, which are not
/// empty.
pub(crate) fn spread(values: &[f64]) -> (f64, f64, f64) {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (median(values), min, max)
}

/// The CPU time this process has used so far, all its threads (ended ones too) counted.
pub(crate) fn process_cpu() -> std::time::Duration {
    let spent = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    std::time::Duration::new(
        u64::try_from(spent.tv_sec).unwrap_or(0),
        u32::try_from(spent.tv_nsec).unwrap_or(0),
    )
}

/// The fields of `/proc/<pid>/stat` after the command name (which is in parentheses and
/// may contain spaces); `pid` may be `self`.
pub(crate) fn stat_fields(pid: &str) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(
        stat[stat.rfind(')')? + 1..]
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
    )
}

/// The parent of `pid`.
pub(crate) fn parent(pid: u32) -> Option<u32> {
    stat_fields(&pid.to_string())?.get(1)?.parse().ok()
}

/// User plus system CPU time of `pid` (`self` for this process), in clock ticks (10 ms).
pub(crate) fn cpu_ticks(pid: &str) -> Option<u64> {
    let (user, system) = user_system_ticks(pid)?;
    Some(user + system)
}

/// The user and the system CPU time of `pid` (`self` for this process), in clock ticks
/// (10 ms).
pub(crate) fn user_system_ticks(pid: &str) -> Option<(u64, u64)> {
    let fields = stat_fields(pid)?;
    Some((fields.get(11)?.parse().ok()?, fields.get(12)?.parse().ok()?))
}

/// A field of `/proc/<pid>/smaps_rollup` (`Rss`, `Pss`, …), in KiB.
pub(crate) fn smaps_kib(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    text.lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The machine's CPU time so far, all CPUs: (idle, total), in clock ticks, from
/// `/proc/stat` (idle counts `iowait`; steal and guest time count as busy).
fn machine_ticks() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal (guest time is within user).
    let idle = fields.get(3)? + fields.get(4)?;
    let total = fields.iter().take(8).sum();
    Some((idle, total))
}

/// Waits until the machine is quiet: a tenth of a second in which its CPUs were at
/// least 90 % idle. What a phase leaves behind runs on after it in the kernel's workers
/// (a removed cgroup is freed later, by `cgroup_free` and RCU work), and would otherwise
/// be charged to the phase measured next. False when `limit` passed first.
pub(crate) fn settle(limit: std::time::Duration) -> bool {
    const WINDOW: std::time::Duration = std::time::Duration::from_millis(100);
    let start = now();
    let Some(mut before) = machine_ticks() else {
        return false;
    };
    while start.elapsed() < limit {
        std::thread::sleep(WINDOW);
        let Some(after) = machine_ticks() else {
            return false;
        };
        let idle = after.0.saturating_sub(before.0);
        let total = after.1.saturating_sub(before.1);
        if total > 0 && idle * 10 >= total * 9 {
            return true;
        }
        before = after;
    }
    false
}
