//! cgroup v2's control files: limits written, usage and OOM kills read, controllers
//! enabled for children.

use std::io;
use std::path::Path;

use super::{CgroupCounters, Limits, Usage, read_keyed, read_number, write_file};

/// The controllers a task's limits need, as `cgroup.controllers` names them.
pub(super) const CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];

/// Of `wanted`, the controllers `dir` has (`cgroup.controllers`): a controller its
/// parent does not give it is left out, and the limits that need it are reported as not
/// enforced.
pub(super) fn available(dir: &Path, wanted: &[&str]) -> io::Result<Vec<String>> {
    let listed = std::fs::read_to_string(dir.join("cgroup.controllers"))?;
    Ok(wanted
        .iter()
        .filter(|c| listed.split_whitespace().any(|l| l == **c))
        .map(|c| (*c).to_owned())
        .collect())
}

/// Hands `controllers` (which `dir` has) to `dir`'s children, in one write.
pub(super) fn enable(dir: &Path, controllers: &[String]) -> io::Result<()> {
    if controllers.is_empty() {
        return Ok(());
    }
    let line: Vec<String> = controllers.iter().map(|c| format!("+{c}")).collect();
    write_file(&dir.join("cgroup.subtree_control"), &line.join(" "))
}

/// cgroup v1's `cpu.shares` (a task's MHz) as v2's `cpu.weight`, by the conversion runc
/// and the kubelet use: shares 2 to 262,144 onto weights 1 to 10,000.
pub(super) fn weight(shares: u64) -> u64 {
    let shares = shares.clamp(2, 262_144);
    1 + ((shares - 2) * 9_999) / 262_142
}

/// Writes `limits` into the task's cgroup `dir`.
pub(super) fn write_limits(dir: &Path, limits: &Limits) -> io::Result<()> {
    if let Some(low) = limits.memory_low {
        write_file(&dir.join("memory.low"), &low.to_string())?;
    }
    if let Some(max) = limits.memory_max {
        write_file(&dir.join("memory.max"), &max.to_string())?;
        // No swap for a task with a memory limit, where the kernel has swap accounting.
        if dir.join("memory.swap.max").exists() {
            write_file(&dir.join("memory.swap.max"), "0")?;
        }
    }
    if limits.oom_group {
        write_file(&dir.join("memory.oom.group"), "1")?;
    }
    // Every task weighs by its MHz, the default for one that declares none, where the
    // cpu controller reaches it.
    match limits.cpu_shares {
        Some(shares) => write_file(&dir.join("cpu.weight"), &weight(shares).to_string())?,
        None if dir.join("cpu.weight").exists() => write_file(
            &dir.join("cpu.weight"),
            &weight(super::DEFAULT_CPU_MHZ).to_string(),
        )?,
        None => {}
    }
    if let Some(quota) = limits.cpu_quota_us {
        write_file(
            &dir.join("cpu.max"),
            &format!("{quota} {}", super::CPU_PERIOD_US),
        )?;
    }
    if let Some(pids) = limits.pids {
        write_file(&dir.join("pids.max"), &pids.to_string())?;
    }
    Ok(())
}

/// How many processes of the cgroup `dir` the OOM killer killed.
pub(super) fn oom_kills(dir: &Path) -> Option<u64> {
    read_keyed(&dir.join("memory.events"), "oom_kill")
}

/// `max` (no limit) as `None`, else the number.
fn limit(path: &Path) -> Option<u64> {
    read_number(path)
}

/// What the kernel counts for the cgroup `dir`; `None` when it is gone.
/// CPU time and memory now; `None` when the cgroup is gone.
pub(super) fn counters(dir: &Path) -> Option<CgroupCounters> {
    Some(CgroupCounters {
        cpu_usec: read_keyed(&dir.join("cpu.stat"), "usage_usec")?,
        memory_bytes: read_number(&dir.join("memory.current")),
    })
}

pub(super) fn usage(dir: &Path) -> Option<Usage> {
    let cpu_stat = dir.join("cpu.stat");
    // `cpu.stat` exists in every v2 cgroup, with or without the cpu controller.
    let cpu_usec = read_keyed(&cpu_stat, "usage_usec")?;
    Some(Usage {
        memory_bytes: read_number(&dir.join("memory.current")),
        memory_peak_bytes: read_number(&dir.join("memory.peak")),
        memory_limit_bytes: limit(&dir.join("memory.max")),
        cpu_usec,
        throttled_usec: read_keyed(&cpu_stat, "throttled_usec"),
        pids: read_number(&dir.join("pids.current")),
        pids_limit: limit(&dir.join("pids.max")),
        oom_kills: oom_kills(dir).unwrap_or(0),
    })
}

/// Sets the tasks' parent's `memory.low` to the sum of its children's: a child's
/// protection reaches no further than its parent's. Above the parent it is the
/// operator's (systemd's `MemoryLow=` on the agent's unit).
pub(super) fn protect(root: &Path) -> io::Result<()> {
    let total: u64 = std::fs::read_dir(root)?
        .filter_map(Result::ok)
        .filter(|entry| entry.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|entry| read_number(&entry.path().join("memory.low")))
        .sum();
    write_file(&root.join("memory.low"), &total.to_string())
}
