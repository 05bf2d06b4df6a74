//! cgroup v1's control files, one hierarchy per controller: limits written, usage and
//! OOM kills read.

use std::io;
use std::path::Path;

use super::{Limits, V1Dirs, read_keyed, read_number, write_file};
use crate::driver::CgroupCounters;

/// The kernel's "no limit" in `memory.limit_in_bytes` (`PAGE_COUNTER_MAX` in bytes) and
/// anything above it reads as none.
const NO_MEMORY_LIMIT: u64 = 1 << 62;

/// Writes `limits` into the task's cgroups.
pub(super) fn write_limits(dirs: &V1Dirs, limits: &Limits) -> io::Result<()> {
    if let Some(memory) = &dirs.memory {
        if let Some(max) = limits.memory_max {
            write_file(&memory.join("memory.limit_in_bytes"), &max.to_string())?;
            // No swap: memory and swap together may not exceed the memory limit, where
            // the kernel accounts swap.
            let memsw = memory.join("memory.memsw.limit_in_bytes");
            if memsw.exists() {
                write_file(&memsw, &max.to_string())?;
            }
        }
        if let Some(low) = limits.memory_low {
            write_file(&memory.join("memory.soft_limit_in_bytes"), &low.to_string())?;
        }
    }
    if let Some(cpu) = &dirs.cpu {
        // Every task weighs by its MHz, the default for one that declares none.
        let shares = limits.cpu_shares.unwrap_or(super::DEFAULT_CPU_MHZ);
        write_file(&cpu.join("cpu.shares"), &shares.max(2).to_string())?;
        if let Some(quota) = limits.cpu_quota_us {
            write_file(
                &cpu.join("cpu.cfs_period_us"),
                &super::CPU_PERIOD_US.to_string(),
            )?;
            write_file(&cpu.join("cpu.cfs_quota_us"), &quota.to_string())?;
        }
    }
    if let (Some(pids), Some(max)) = (&dirs.pids, limits.pids) {
        write_file(&pids.join("pids.max"), &max.to_string())?;
    }
    Ok(())
}

/// How many processes of the memory cgroup `dir` the OOM killer killed (Linux 4.13 and
/// later count them in `memory.oom_control`).
pub(super) fn oom_kills(memory: &Path) -> Option<u64> {
    read_keyed(&memory.join("memory.oom_control"), "oom_kill")
}

/// What the kernel counts for the task's cgroups; `None` when they are gone.
/// CPU time and memory now; `None` when the cgroup is gone.
pub(super) fn counters(dirs: &V1Dirs) -> Option<CgroupCounters> {
    let memory = dirs.memory.as_deref()?;
    let memory_bytes = read_number(&memory.join("memory.usage_in_bytes"))?;
    Some(CgroupCounters {
        cpu_usec: cpu_usec(dirs),
        memory_bytes: Some(memory_bytes),
    })
}

/// CPU time used, from `cpuacct` or else the unified hierarchy's `cpu.stat`.
fn cpu_usec(dirs: &V1Dirs) -> u64 {
    dirs.cpuacct
        .as_ref()
        .and_then(|dir| read_number(&dir.join("cpuacct.usage")))
        .map(|ns| ns / 1_000)
        .or_else(|| {
            let unified = dirs.unified.as_ref()?;
            read_keyed(&unified.join("cpu.stat"), "usage_usec")
        })
        .unwrap_or(0)
}

pub(super) fn usage(dirs: &V1Dirs) -> Option<super::Usage> {
    let memory = dirs.memory.as_deref()?;
    let memory_bytes = read_number(&memory.join("memory.usage_in_bytes"))?;
    let cpu_usec = cpu_usec(dirs);
    let throttled_usec = dirs
        .cpu
        .as_ref()
        .and_then(|dir| read_keyed(&dir.join("cpu.stat"), "throttled_time"))
        .map(|ns| ns / 1_000);
    Some(super::Usage {
        memory_bytes: Some(memory_bytes),
        memory_peak_bytes: read_number(&memory.join("memory.max_usage_in_bytes")),
        memory_limit_bytes: read_number(&memory.join("memory.limit_in_bytes"))
            .filter(|limit| *limit < NO_MEMORY_LIMIT),
        cpu_usec,
        throttled_usec,
        pids: dirs
            .pids
            .as_ref()
            .and_then(|dir| read_number(&dir.join("pids.current"))),
        pids_limit: dirs
            .pids
            .as_ref()
            .and_then(|dir| read_number(&dir.join("pids.max"))),
        oom_kills: oom_kills(memory).unwrap_or(0),
    })
}
