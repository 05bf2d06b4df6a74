//! The fork server: `stead-supervisor --zygote`, one per agent.
//!
//! It reads start requests ([`crate::protocol::encode_request`]) from its stdin, a
//! `SOCK_SEQPACKET` socket to the agent, each with the write end of the pipe that run's
//! supervisor reports on. For each it forks once, and the child becomes the supervisor.
//! Forking this small, single-threaded process costs a fraction of executing a new one,
//! and the supervisors share its pages.
//!
//! The server reaps the supervisors that exit while it runs: it blocks `SIGCHLD` and
//! polls a `signalfd` beside the socket ([`crate::children`]), so a start costs it one
//! `fork()` and never a wait. Reaping in this one process, rather than having the kernel reap each
//! supervisor as it exits (`SIGCHLD` ignored), keeps hundreds of exits at once from
//! contending on the kernel's process-table locks on every core (measured: a drain of
//! 500 tasks took 2.5x as long that way). The server exits when the agent closes the
//! socket (the agent left); the supervisors it forked keep running, reparented to the
//! nearest subreaper or init, which reaps them from then on.

use alloc::borrow::ToOwned;
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec;
use alloc::vec::Vec;
use core::mem::MaybeUninit;

use rustix::event::{PollFd, PollFlags, poll};
use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::OFlags;
use rustix::io::{Errno, IoSliceMut};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, recv, recvmsg,
};
use rustix::process::{Pid, WaitOptions};

use crate::args::SupervisorArgs;
use crate::children::ChildSignals;
use crate::protocol::{self, Environment, Report};
use crate::{file, supervise, sys};

/// The largest request accepted; the agent's socket buffer bounds what it can send.
const MAX_REQUEST: usize = 1 << 20;

/// Sets this server's soft limit of open files, which every supervisor and task it
/// starts inherits: the agent raised its own, and tasks get the one it started with.
fn keep_open_files(open_files: u64) {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let hard = getrlimit(Resource::Nofile).maximum;
    let soft = hard.map_or(open_files, |hard| open_files.min(hard));
    let _ = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(soft),
            maximum: hard,
        },
    );
}

/// Serves start requests on stdin until the agent closes it. `--open-files=N` (the
/// agent's soft limit of open files before it raised its own) is the one supervisors
/// and tasks start with; `--oom-score-adj=N` (the agent's before it lowered its own) is
/// theirs too; any other argument is a usage error (exit 2). Returns the exit code.
pub(crate) fn serve(args: impl Iterator<Item = Vec<u8>>) -> u8 {
    for arg in args {
        let Ok(arg) = core::str::from_utf8(&arg) else {
            return 2;
        };
        if let Some(value) = arg.strip_prefix("--open-files=") {
            match value.parse::<u64>() {
                Ok(open_files) => keep_open_files(open_files),
                Err(_) => return 2,
            }
        } else if let Some(value) = arg.strip_prefix("--oom-score-adj=") {
            match value.parse::<i16>() {
                // Raising it back needs no privilege; should the kernel refuse anyway,
                // tasks keep the agent's, which is no reason to start none.
                Ok(adj) => {
                    let _ = crate::oom::set_oom_score_adj(adj);
                }
                Err(_) => return 2,
            }
        } else {
            return 2;
        }
    }
    // Terminal signals aimed at the agent's process group do not stop starting tasks.
    let _ = rustix::process::setsid();
    // Once here, for every supervisor this server forks.
    supervise::default_signal_dispositions();
    let Ok(children) = ChildSignals::new() else {
        return 1;
    };
    loop {
        let (request, exited) = {
            let stdin = crate::file::stdin();
            let mut fds = [
                PollFd::new(&stdin, PollFlags::IN),
                PollFd::new(&children, PollFlags::IN),
            ];
            match poll(&mut fds, None) {
                Ok(_) => (!fds[0].revents().is_empty(), !fds[1].revents().is_empty()),
                Err(Errno::INTR) => continue,
                Err(_) => return 1,
            }
        };
        if exited {
            // Every supervisor that exited, reaped.
            children.clear();
            while let Ok(Some(_)) = rustix::process::wait(WaitOptions::NOHANG) {}
        }
        if !request {
            continue;
        }
        // The request's length first (a peek, which takes nothing off the socket), so the
        // buffer is as large as the request and no larger: every page this server ever
        // touched is copied into the page tables of each supervisor it forks.
        let length = match recv(
            crate::file::stdin(),
            &mut [0u8; 0][..],
            RecvFlags::PEEK | RecvFlags::TRUNC,
        ) {
            Ok((_, length)) => length,
            Err(Errno::INTR) => continue,
            Err(_) => return 1,
        };
        let mut buffer = vec![0u8; length.clamp(1, MAX_REQUEST)];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let received = recvmsg(
            crate::file::stdin(),
            &mut [IoSliceMut::new(&mut buffer)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        );
        let message = match received {
            Ok(message) => message,
            Err(Errno::INTR) => continue,
            Err(_) => return 1,
        };
        let report: Option<OwnedFd> = control.drain().find_map(|message| match message {
            RecvAncillaryMessage::ScmRights(mut fds) => fds.next(),
            _ => None,
        });
        let Some(report) = report else {
            if message.bytes == 0 {
                return 0; // the agent closed the socket
            }
            continue; // a request without a pipe has no one to answer
        };
        if message.flags.contains(ReturnFlags::TRUNC) {
            answer(&report, false, "the start request is too large".to_owned());
            continue;
        }
        let decoded = protocol::decode_request(&buffer[..message.bytes]);
        drop(buffer);
        match decoded {
            Ok((args, environment)) => fork_supervisor(&args, environment, report, &children),
            Err(error) => answer(&report, false, error.to_string()),
        }
    }
}

/// Reports on `report` that the run failed before it started; `recoverable` when the
/// same request may succeed later.
fn answer(report: &OwnedFd, recoverable: bool, message: String) {
    let line = Report::Failed {
        recoverable,
        message,
    }
    .to_line();
    let _ = rustix::io::write(report, line.as_bytes());
}

/// Whether a `fork()` that failed may succeed later: the node, or the agent's pids
/// cgroup (`pids.max`) or user (`RLIMIT_NPROC`), had no process to spare (`EAGAIN`), or
/// there was no memory for one (`ENOMEM`). Nothing in the request makes a fork fail, so
/// these are worth the restart policy's retry, as a failed task spawn is
/// ([`crate::supervise`]).
fn fork_failure_is_recoverable(error: Errno) -> bool {
    matches!(error, Errno::AGAIN | Errno::NOMEM)
}

/// `fork()`: `None` in the child, the child's pid in the parent.
#[allow(unsafe_code)]
fn fork() -> Result<Option<Pid>, Errno> {
    // SAFETY: the fork server is single-threaded (it never starts a thread), so the
    // child is a whole copy: no lock or allocator state is held by a thread that does not
    // exist in the child, and the child may go on running ordinary Rust code.
    unsafe { sys::fork() }
}

/// Forks the supervisor of one run.
fn fork_supervisor(
    args: &SupervisorArgs,
    environment: Environment,
    report: OwnedFd,
    children: &ChildSignals,
) {
    match fork() {
        Err(error) => answer(
            &report,
            fork_failure_is_recoverable(error),
            format!("forking the supervisor: {}", crate::error::OsError(error)),
        ),
        Ok(Some(_)) => {}
        Ok(None) => {
            children.leave();
            become_supervisor(args, environment, report)
        }
    }
}

/// Turns a fresh fork into the supervisor of `args`: stdin (the server's socket) becomes
/// `/dev/null`, stdout the report pipe.
fn become_supervisor(args: &SupervisorArgs, environment: Environment, report: OwnedFd) -> ! {
    match file::open(b"/dev/null", OFlags::RDONLY, 0) {
        Ok(null) => {
            let _ = rustix::stdio::dup2_stdin(null.as_fd());
        }
        Err(_) => sys::exit(1),
    }
    if rustix::stdio::dup2_stdout(&report).is_err() {
        sys::exit(1);
    }
    drop(report);
    sys::exit(supervise::run(args, environment))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::prelude::rust_2024::*;

    #[test]
    fn a_fork_that_failed_for_want_of_processes_or_memory_is_recoverable_and_others_are_not() {
        assert!(
            fork_failure_is_recoverable(Errno::AGAIN),
            "out of processes: pids.max or RLIMIT_NPROC"
        );
        assert!(fork_failure_is_recoverable(Errno::NOMEM), "out of memory");
        assert!(!fork_failure_is_recoverable(Errno::NOSYS));
    }

    #[test]
    fn the_answer_to_a_failed_start_reads_back_as_a_failure_with_its_recoverability() {
        for recoverable in [true, false] {
            let (read, write) = rustix::pipe::pipe().expect("pipe");
            answer(
                &write,
                recoverable,
                "forking the supervisor: busy".to_owned(),
            );
            drop(write);
            let mut line = String::new();
            std::io::Read::read_to_string(&mut std::fs::File::from(read), &mut line).expect("read");
            assert_eq!(
                Report::parse(&line).expect("a report line"),
                Report::Failed {
                    recoverable,
                    message: "forking the supervisor: busy".to_owned(),
                }
            );
        }
    }
}
