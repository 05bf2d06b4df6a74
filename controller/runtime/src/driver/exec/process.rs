//! Processes as `/proc` shows them: identity (pid and start time), trees, sessions,
//! signals and resource use. A pid alone never identifies a process: it is reused.

use std::path::Path;

use procfs::process::Process;
use rustix::process::{Pid, Signal};

/// A process identified beyond its pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ProcessId {
    /// The pid.
    pub(crate) pid: u32,
    /// Its start time in clock ticks since boot: a reused pid has another.
    pub(crate) start: u64,
}

fn process(pid: u32) -> Option<Process> {
    Process::new(i32::try_from(pid).ok()?).ok()
}

fn rustix_pid(pid: u32) -> Option<Pid> {
    Pid::from_raw(i32::try_from(pid).ok()?)
}

impl ProcessId {
    /// Whether this very process still exists (a zombie not yet reaped counts). One read
    /// of `/proc/<pid>/stat`, as the supervisor reads it: asked before every signal and
    /// every reattach, the `procfs` crate's way took twice the system calls.
    pub(crate) fn exists(self) -> bool {
        stead_supervisor::proc::start_time(self.pid) == Some(self.start)
    }

    /// Whether it exists and its working directory is `dir` (the same directory, by
    /// device and inode, whatever path leads there).
    pub(crate) fn exists_in(self, dir: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        if !self.exists() {
            return false;
        }
        let cwd = std::fs::metadata(format!("/proc/{}/cwd", self.pid));
        let dir = std::fs::metadata(dir);
        match (cwd, dir) {
            (Ok(cwd), Ok(dir)) => cwd.dev() == dir.dev() && cwd.ino() == dir.ino(),
            _ => false,
        }
    }
}

/// The children of `pid`, over all its threads.
fn children(pid: u32) -> Vec<u32> {
    let Some(process) = process(pid) else {
        return Vec::new();
    };
    let Ok(tasks) = process.tasks() else {
        return Vec::new();
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| task.children().ok())
        .flatten()
        .collect()
}

/// Every process below `pid`, parents first, `pid` excluded.
pub(crate) fn descendants(pid: u32) -> Vec<u32> {
    let mut out = children(pid);
    let mut next = 0;
    while next < out.len() && out.len() < 1 << 16 {
        let below = children(out[next]);
        out.extend(below);
        next += 1;
    }
    out
}

/// Every process of the session `leader` started, leader included.
///
/// A session id stays reserved while any member lives, so the members found are the
/// leader's, unless the leader is gone and its pid was reused for a new session: a
/// live process with the leader's pid but another start time says so, and then nothing
/// is returned.
pub(crate) fn session_members(leader: ProcessId) -> Vec<u32> {
    if start_time(leader.pid).is_some_and(|start| start != leader.start) {
        return Vec::new();
    }
    let Ok(all) = procfs::process::all_processes() else {
        return Vec::new();
    };
    all.filter_map(Result::ok)
        .filter_map(|p| p.stat().ok())
        .filter(|stat| {
            u32::try_from(stat.session).ok() == Some(leader.pid) && stat.starttime >= leader.start
        })
        .filter_map(|stat| u32::try_from(stat.pid).ok())
        .collect()
}

/// When a process that started `ticks` clock ticks after boot started.
pub(crate) fn started_at(ticks: u64) -> Option<stead_schemas::Timestamp> {
    let boot = procfs::boot_time_secs().ok()?;
    let per_second = procfs::ticks_per_second();
    if per_second == 0 {
        return None;
    }
    let since_boot = std::time::Duration::from_millis(ticks.saturating_mul(1000) / per_second);
    Some(stead_schemas::Timestamp::from_since_epoch(
        std::time::Duration::from_secs(boot) + since_boot,
    ))
}

fn start_time(pid: u32) -> Option<u64> {
    process(pid)?.stat().ok().map(|stat| stat.starttime)
}

/// Sends `signal` to process group `pgid`; false when the group is gone.
pub(crate) fn signal_group(pgid: u32, signal: Signal) -> Result<bool, rustix::io::Errno> {
    let Some(pid) = rustix_pid(pgid) else {
        return Ok(false);
    };
    match rustix::process::kill_process_group(pid, signal) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::SRCH) => Ok(false),
        Err(error) => Err(error),
    }
}

/// SIGKILLs each of `pids`; ones already gone are skipped.
pub(crate) fn kill_all(pids: impl IntoIterator<Item = u32>) {
    for pid in pids {
        if let Some(pid) = rustix_pid(pid) {
            let _ = rustix::process::kill_process(pid, Signal::KILL);
        }
    }
}

/// What a set of processes uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Usage {
    /// User plus system time, with reaped children's, in clock ticks.
    pub(crate) ticks: u64,
    /// Resident memory in bytes.
    pub(crate) rss_bytes: u64,
    /// How many of the processes exist (zombies excluded).
    pub(crate) processes: u32,
}

/// Adds up what `pids` use.
pub(crate) fn usage(pids: impl IntoIterator<Item = u32>) -> Usage {
    let page_size = procfs::page_size();
    let mut total = Usage::default();
    for pid in pids {
        let Some(stat) = process(pid).and_then(|p| p.stat().ok()) else {
            continue;
        };
        if stat.state == 'Z' {
            continue;
        }
        let children = u64::try_from(stat.cutime.max(0) + stat.cstime.max(0)).unwrap_or(0);
        total.ticks += stat.utime + stat.stime + children;
        total.rss_bytes += stat.rss * page_size;
        total.processes += 1;
    }
    total
}

/// Clock ticks per second (`USER_HZ`).
pub(crate) fn ticks_per_second() -> u64 {
    procfs::ticks_per_second()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_known_by_pid_and_start_time_together() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .current_dir("/tmp")
            .spawn()
            .expect("sleep runs");
        let pid = child.id();
        let start = start_time(pid).expect("running");
        assert!(ProcessId { pid, start }.exists());
        assert!(ProcessId { pid, start }.exists_in(Path::new("/tmp")));
        assert!(!ProcessId { pid, start }.exists_in(Path::new("/")));
        assert!(
            !ProcessId {
                pid,
                start: start + 1
            }
            .exists()
        );
        assert!(descendants(std::process::id()).contains(&pid));
        assert_eq!(usage([pid]).processes, 1);
        // Resident memory is accounted lazily: a process that just started may show none.
        let mut rss = 0;
        for _ in 0..1_000 {
            rss = usage([pid]).rss_bytes;
            if rss > 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(rss > 0);
        kill_all([pid]);
        child.wait().expect("reaped");
        assert!(!ProcessId { pid, start }.exists());
    }
}
