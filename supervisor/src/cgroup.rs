//! Joining a task's cgroups from a forked child, before it `exec`s: the supervisor's task
//! and the agent's exec checks do it the same way.

use core::ffi::CStr;

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;

/// Moves the calling process into each cgroup whose `cgroup.procs` (or, on v1, `tasks`)
/// file is in `procs`, by writing `0` (the writer, as both cgroup versions read it; through
/// `tasks`, the writer's thread, which is the whole process between `fork` and `exec`).
/// Only system calls: safe between `fork` and `exec` in a multi-threaded parent.
pub fn join<P: AsRef<CStr>>(procs: impl IntoIterator<Item = P>) -> Result<(), Errno> {
    for file in procs {
        let fd = rustix::fs::open(
            file.as_ref(),
            OFlags::WRONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        if rustix::io::write(&fd, b"0")? != 1 {
            return Err(Errno::IO);
        }
    }
    Ok(())
}
