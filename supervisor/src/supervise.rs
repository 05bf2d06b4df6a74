//! The supervisor's life: start the task, copy its output, reap it, clean up, report.
//!
//! One thread polls the task's stdout and stderr pipes and a `signalfd` for `SIGCHLD`
//! ([`crate::children`]); on the signal it reaps every child that exited: the task and
//! the orphans the supervisor adopts as a subreaper. Nothing wakes the supervisor while
//! its task is quiet, and it runs no second thread.

use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::mem::MaybeUninit;

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::fd::OwnedFd;
use rustix::fs::OFlags;
use rustix::io::Errno;
use rustix::pipe::{PipeFlags, pipe_with};
use rustix::process::{Pid, Signal, WaitOptions, WaitStatus};

use crate::args::{ArgsError, SupervisorArgs};
use crate::children::ChildSignals;
use crate::error::OsError;
use crate::logs::{Rotator, Stream};
use crate::proc;
use crate::protocol::{self, Environment, ExitStatus, Report, RunRecord};
use crate::spawn::{self, SpawnError, TaskCommand};
use crate::sys;

/// The size of the read buffer for the task's output.
const READ_BUFFER: usize = 16 * 1024;
/// How long the supervisor waits for output after everything of the task was killed.
const DRAIN_IDLE_MS: i64 = 100;

/// Why the task did not start.
#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("invalid supervisor command line")]
    Args(#[source] ArgsError),
    #[error("reading the task's environment from stdin")]
    Environment(#[source] OsError),
    #[error("the agent closed stdin before the end of the task's environment")]
    TruncatedEnvironment,
    #[error("entering the task dir {dir}")]
    TaskDir {
        dir: String,
        #[source]
        source: OsError,
    },
    #[error("opening the {stream} log of task {task} in {dir}")]
    Logs {
        stream: &'static str,
        task: String,
        dir: String,
        #[source]
        source: OsError,
    },
    #[error("creating pipes")]
    Pipe(#[source] OsError),
    #[error("starting {command:?}")]
    Spawn {
        command: String,
        #[source]
        source: SpawnError,
    },
    #[error("watching for the task's exit (signalfd)")]
    ChildSignals(#[source] OsError),
}

impl StartError {
    /// Only a missing or forbidden program, or a malformed request, fail for good.
    fn recoverable(&self) -> bool {
        match self {
            StartError::Args(_) | StartError::TruncatedEnvironment => false,
            StartError::Spawn { source, .. } => !source.is_permanent(),
            _ => true,
        }
    }
}

/// A path or command for a message.
fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `error: cause: cause`, on one line.
fn error_chain(error: &dyn core::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Writes `report` to the agent; false when the agent is gone (EPIPE), which is no
/// error.
pub(crate) fn send(report: &Report) -> bool {
    crate::file::write_all(crate::file::stdout(), report.to_line().as_bytes()).is_ok()
}

/// Resets every signal the supervisor inherited as ignored to its default, `SIGPIPE`
/// aside (the supervisor ignores it: it writes to an agent that may be gone; the task
/// gets it back at its start). Ignored signals survive `exec`, and a shell started with
/// `SIGINT` ignored cannot trap it: an agent launched in the background of a script
/// (where `SIGINT` and `SIGQUIT` are ignored) or under `nohup` (`SIGHUP`) would pass that
/// on to every task, whose `killSignal` would then do nothing. Tasks start as from a
/// clean init. Every signal, the C library's own (32 and 33) included.
pub(crate) fn default_signal_dispositions() {
    use linux_raw_sys::general::{SIGKILL, SIGPIPE, SIGSTOP};
    for signal in 1..=sys::SIGNALS {
        if matches!(signal, SIGKILL | SIGSTOP | SIGPIPE) {
            continue;
        }
        if sys::is_ignored(signal) == Some(true) {
            let _ = sys::set_ignored(signal, false);
        }
    }
}

/// The supervisor's entry point, with its whole command line (`args[0]` is the program):
/// `--zygote` serves start requests as a fork server, `--version` prints the version;
/// anything else is one supervisor's command line, with the environment on stdin.
/// Returns the exit code.
pub fn main(args: Vec<Vec<u8>>) -> u8 {
    // Every descriptor above stderr that the process inherited is closed first thing,
    // before it opens anything: the agent starts the fork server with stdin, stdout and
    // stderr only, but a descriptor the agent itself inherited without close-on-exec
    // (from a shell, a service manager, a test harness) reaches the server too, and every
    // supervisor it forks would hold it for as long as its task runs. `close_range` came
    // with Linux 5.9; on an older kernel they stay open.
    let _ = sys::close_range_from(3, false);
    // A report to an agent that is gone must fail with EPIPE, not kill the supervisor.
    let _ = sys::set_ignored(linux_raw_sys::general::SIGPIPE, true);
    let mut argv = args.into_iter().skip(1).peekable();
    if argv.peek().is_some_and(|first| first == b"--zygote") {
        let _ = argv.next();
        return crate::zygote::serve(argv);
    }
    if argv.peek().is_some_and(|first| first == b"--version") {
        // What a packaging check can run: the binary loads and says which it is.
        let line = concat!("stead-supervisor ", env!("CARGO_PKG_VERSION"), "\n");
        return match crate::file::write_all(crate::file::stdout(), line.as_bytes()) {
            Ok(()) => 0,
            Err(_) => 1,
        };
    }
    default_signal_dispositions();
    let started = SupervisorArgs::parse(argv)
        .map_err(StartError::Args)
        .and_then(|args| Ok((read_environment()?, args)));
    match started {
        Ok((environment, args)) => run(&args, environment),
        Err(error) => {
            let _ = send(&Report::Failed {
                recoverable: error.recoverable(),
                message: error_chain(&error),
            });
            2
        }
    }
}

/// This process's pid, as the protocol writes it.
fn my_pid() -> u32 {
    rustix::process::getpid()
        .as_raw_nonzero()
        .get()
        .unsigned_abs()
}

/// Runs one supervisor to its end: starts the task, reports on stdout, supervises it,
/// records its exit. Returns the supervisor's exit code.
pub(crate) fn run(args: &SupervisorArgs, environment: Environment) -> u8 {
    // Out of the agent's session: the agent's terminal and process group signals (and
    // its death) do not reach the supervisor.
    let _ = rustix::process::setsid();
    let mut running = match start(args, &environment) {
        Ok(running) => running,
        Err(error) => {
            let _ = send(&Report::Failed {
                recoverable: error.recoverable(),
                message: error_chain(&error),
            });
            return 1;
        }
    };
    drop(environment);
    // An agent gone by now finds the run by its run record.
    let _ = send(&Report::Started {
        task_pid: running.task_pid.as_raw_nonzero().get().unsigned_abs(),
        task_start: running.task_start,
        supervisor_pid: my_pid(),
        supervisor_start: running.supervisor_start,
    });
    let status = running.supervise();
    drop(running);
    // An agent that heard the exit keeps it in its own store; the record must reach the
    // disk (fsync) only when no agent heard it. Either way it survives the agent.
    let heard = send(&Report::Exited(status));
    match protocol::write_exit_record(&args.control_dir, &args.run, status, !heard) {
        Ok(()) => 0,
        Err(_) => 1,
    }
}

/// One stream of the task's output.
struct Output {
    /// The read end of the pipe; `None` once the pipe is closed.
    pipe: Option<OwnedFd>,
    rotator: Rotator,
}

/// A started task.
struct Running {
    task_pid: Pid,
    task_start: u64,
    supervisor_start: u64,
    outputs: [Output; 2],
    /// Readable when a child exited (the task or an adopted orphan).
    children: ChildSignals,
}

/// Reads the task's environment: `KEY=VALUE\0` entries, ended by an empty entry.
fn read_environment() -> Result<Environment, StartError> {
    let input = crate::file::read_to_end(crate::file::stdin())
        .map_err(|error| StartError::Environment(error.into()))?;
    // The end marker: an empty entry, so the input ends with "\0\0" (or is just "\0").
    let body = match input.strip_suffix(b"\0") {
        Some(b"") => &b""[..],
        Some(rest) if rest.ends_with(b"\0") => rest,
        _ => return Err(StartError::TruncatedEnvironment),
    };
    Ok(Environment::from_entries(
        body.split(|b| *b == 0).filter(|entry| !entry.is_empty()),
    ))
}

fn open_output(args: &SupervisorArgs, stream: Stream) -> Result<Rotator, StartError> {
    Rotator::open(
        &args.log_dir,
        &args.name,
        stream,
        args.max_files,
        args.max_file_size,
    )
    .map_err(|source| StartError::Logs {
        stream: stream.as_str(),
        task: args.name.clone(),
        dir: lossy(&args.log_dir),
        source: source.into(),
    })
}

fn nonblocking_pipe() -> Result<(OwnedFd, OwnedFd), StartError> {
    let pipe_error = |error: Errno| StartError::Pipe(error.into());
    let (read, write) = pipe_with(PipeFlags::CLOEXEC).map_err(pipe_error)?;
    rustix::fs::fcntl_setfl(&read, OFlags::NONBLOCK).map_err(pipe_error)?;
    Ok((read, write))
}

fn start(args: &SupervisorArgs, environment: &Environment) -> Result<Running, StartError> {
    let me = rustix::process::getpid();
    // Orphans of the task (daemonised grandchildren included) become our children, so
    // they stay visible and killable.
    let _ = rustix::process::set_child_subreaper(Some(me));
    rustix::process::chdir(args.task_dir.as_slice()).map_err(|source| StartError::TaskDir {
        dir: lossy(&args.task_dir),
        source: source.into(),
    })?;
    let stdout_log = open_output(args, Stream::Stdout)?;
    let stderr_log = open_output(args, Stream::Stderr)?;
    let (stdout_read, stdout_write) = nonblocking_pipe()?;
    let (stderr_read, stderr_write) = nonblocking_pipe()?;
    // Before the task exists, so that no exit of it goes unseen.
    let children = ChildSignals::new().map_err(|error| StartError::ChildSignals(error.into()))?;

    let task_pid = spawn::spawn(TaskCommand {
        program: &args.command,
        args: &args.args,
        environment,
        uid: args.uid,
        gid: args.gid,
        groups: &args.groups,
        cgroups: &args.cgroups,
        stdout: stdout_write,
        stderr: stderr_write,
    })
    .map_err(|source| StartError::Spawn {
        command: lossy(&args.command),
        source,
    })?;
    let task_raw = task_pid.as_raw_nonzero().get().unsigned_abs();
    // Nothing reaps the task before the poll loop, so its stat is there.
    let task_start = proc::start_time(task_raw).unwrap_or(0);
    let supervisor_start = proc::start_time(my_pid()).unwrap_or(0);
    // Only for an agent that died before it learnt of this run; not fatal.
    let _ = protocol::write_run_record(
        &args.control_dir,
        &args.run,
        RunRecord {
            supervisor_pid: my_pid(),
            supervisor_start,
            task_pid: task_raw,
            task_start,
        },
    );
    Ok(Running {
        task_pid,
        task_start,
        supervisor_start,
        outputs: [
            Output {
                pipe: Some(stdout_read),
                rotator: stdout_log,
            },
            Output {
                pipe: Some(stderr_read),
                rotator: stderr_log,
            },
        ],
        children,
    })
}

/// How a wait status reads as an exit: code 128 + n when killed by signal n.
fn exit_status(status: WaitStatus) -> ExitStatus {
    exit_from(status.exit_status(), status.terminating_signal())
}

fn exit_from(code: Option<i32>, signal: Option<i32>) -> ExitStatus {
    match (code, signal) {
        (_, Some(signal)) => ExitStatus {
            code: 128 + signal,
            signal: Some(signal),
        },
        (Some(code), None) => ExitStatus { code, signal: None },
        (None, None) => ExitStatus {
            code: 0,
            signal: None,
        },
    }
}

/// Reaps children that have exited, without waiting.
fn reap_exited() {
    while let Ok(Some(_)) = rustix::process::wait(WaitOptions::NOHANG) {}
}

fn timeout_ms(ms: i64) -> Timespec {
    Timespec {
        tv_sec: ms / 1000,
        tv_nsec: (ms % 1000) * 1_000_000,
    }
}

impl Running {
    /// Polls the open outputs and, with `watch_children`, the notification of a child's
    /// exit (reaping the children that exited); returns how many descriptors were ready,
    /// and the task's exit status when the task was among the reaped.
    ///
    /// With nothing to poll it still waits out `timeout` (`poll` takes an empty set), so
    /// a caller that polls in rounds sleeps between them; with nothing to poll and no
    /// timeout it returns at once, as nothing could end that wait.
    fn poll_once(
        &mut self,
        buffer: &mut [MaybeUninit<u8>],
        watch_children: bool,
        timeout: Option<&Timespec>,
    ) -> (usize, Option<ExitStatus>) {
        let ready;
        let mut exit = None;
        let mut readable = [false; 3];
        {
            let mut fds: [Option<PollFd<'_>>; 3] = [None, None, None];
            let mut slots = [0usize; 3];
            let mut count = 0;
            for (slot, output) in self.outputs.iter().enumerate() {
                if let Some(pipe) = &output.pipe {
                    fds[count] = Some(PollFd::new(pipe, PollFlags::IN));
                    slots[count] = slot;
                    count += 1;
                }
            }
            if watch_children {
                fds[count] = Some(PollFd::new(&self.children, PollFlags::IN));
                slots[count] = 2;
                count += 1;
            }
            if count == 0 && timeout.is_none() {
                return (0, None);
            }
            let mut polled: [PollFd<'_>; 3] = core::array::from_fn(|i| {
                fds[i].take().unwrap_or_else(|| {
                    PollFd::from_borrowed_fd(crate::file::stdin(), PollFlags::empty())
                })
            });
            match poll(&mut polled[..count], timeout) {
                Ok(n) => ready = n,
                Err(_) => return (0, None),
            }
            for (fd, slot) in polled[..count].iter().zip(slots) {
                if !fd.revents().is_empty() {
                    readable[slot] = true;
                }
            }
        }
        for (slot, output) in self.outputs.iter_mut().enumerate() {
            if readable[slot] {
                output.drain(buffer);
            }
        }
        if readable[2] {
            exit = self.reap_children();
        }
        (ready, exit)
    }

    /// Reaps every child that exited; the task's exit status if it was one of them.
    fn reap_children(&self) -> Option<ExitStatus> {
        self.children.clear();
        let mut exit = None;
        loop {
            match rustix::process::wait(WaitOptions::NOHANG) {
                Ok(Some((pid, status))) if pid == self.task_pid => {
                    exit = Some(exit_status(status));
                }
                Ok(Some(_)) | Err(Errno::INTR) => {}
                // None: children left, none exited; ECHILD: no children at all.
                Ok(None) | Err(_) => return exit,
            }
        }
    }

    /// Runs until the task exits, then kills what it left and drains its output. Every
    /// loop here waits in `poll` between its rounds, also when the task closed its
    /// outputs: the task's exit (or a leftover's) wakes it, a timeout ends it.
    fn supervise(&mut self) -> ExitStatus {
        // Allocated, never zeroed: only the pages output was ever read into cost memory
        // (a quiet task's supervisor never touches it).
        let mut storage: Vec<u8> = Vec::with_capacity(READ_BUFFER);
        let buffer = storage.spare_capacity_mut();
        let status = loop {
            if let (_, Some(status)) = self.poll_once(buffer, true, None) {
                break status;
            }
        };
        // Whatever the task left behind (background children, daemons that reparented
        // to us) dies with it, as with a container's init.
        let me = my_pid();
        let round = timeout_ms(5);
        for _ in 0..2_000 {
            reap_exited();
            let alive: Vec<u32> = proc::descendants(me)
                .into_iter()
                .filter(|pid| proc::stat(*pid).is_ok_and(|s| s.state != b'Z'))
                .collect();
            if alive.is_empty() {
                break;
            }
            for pid in alive {
                if let Some(pid) = Pid::from_raw(i32::try_from(pid).unwrap_or(0)) {
                    let _ = rustix::process::kill_process(pid, Signal::KILL);
                }
            }
            // Until a killed leftover is reaped, or output comes, or the round is over.
            self.poll_once(buffer, true, Some(&round));
        }
        reap_exited();
        // Every writer is dead: read to EOF (or until nothing came for a while, if some
        // process outside the tree holds a copy of a pipe).
        let idle = timeout_ms(DRAIN_IDLE_MS);
        while self.outputs.iter().any(|o| o.pipe.is_some()) {
            if self.poll_once(buffer, false, Some(&idle)).0 == 0 {
                break;
            }
        }
        status
    }
}

impl Output {
    /// Reads what is available; closes the pipe at EOF or on error.
    fn drain(&mut self, buffer: &mut [MaybeUninit<u8>]) {
        let Some(pipe) = &self.pipe else { return };
        for _ in 0..64 {
            match rustix::io::read(pipe, &mut *buffer) {
                Ok(([], _)) => {
                    self.pipe = None;
                    return;
                }
                Ok((read, _)) => {
                    // A log that cannot be written (a full disk) loses output; it never
                    // blocks the task.
                    let _ = self.rotator.write(read);
                }
                Err(Errno::AGAIN) => return,
                Err(Errno::INTR) => {}
                Err(_) => {
                    self.pipe = None;
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;
    use std::prelude::rust_2024::*;

    /// A started task whose stdout and stderr the task has both closed, as after its
    /// exit; its pid is never waited for.
    fn running_with_every_output_closed(log_dir: &std::path::Path) -> Running {
        use std::os::unix::ffi::OsStrExt;
        let log_dir = log_dir.as_os_str().as_bytes();
        let closed = |stream| Output {
            pipe: None,
            rotator: Rotator::open(log_dir, "t", stream, 1, 1024).expect("log opens"),
        };
        Running {
            task_pid: Pid::from_raw(i32::MAX).expect("nonzero"),
            task_start: 0,
            supervisor_start: 0,
            outputs: [closed(Stream::Stdout), closed(Stream::Stderr)],
            children: ChildSignals::new().expect("signalfd opens"),
        }
    }

    /// A kernel timer (`CLOCK_MONOTONIC`, non-blocking) that fires once, `ms` from now:
    /// the reference a wait is measured against, with no clock read here.
    #[allow(unsafe_code)]
    fn timer_firing_in(ms: i64) -> OwnedFd {
        use std::os::fd::FromRawFd;
        // SAFETY: `timerfd_create` returns a new descriptor, owned from here on, and
        // `timerfd_settime` reads an initialised `itimerspec`.
        unsafe {
            let fd = libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            );
            assert!(fd >= 0, "timerfd_create: {}", io::Error::last_os_error());
            let timer = OwnedFd::from_raw_fd(fd);
            let mut spec: libc::itimerspec = std::mem::zeroed();
            spec.it_value.tv_sec = ms / 1000;
            spec.it_value.tv_nsec = (ms % 1000) * 1_000_000;
            let set = libc::timerfd_settime(fd, 0, &spec, std::ptr::null_mut());
            assert_eq!(set, 0, "timerfd_settime: {}", io::Error::last_os_error());
            timer
        }
    }

    fn has_fired(timer: &OwnedFd) -> bool {
        let mut expirations = [0u8; 8];
        rustix::io::read(timer, &mut expirations).is_ok_and(|n| n == 8)
    }

    #[test]
    fn a_poll_with_every_output_closed_still_waits_out_its_timeout() {
        // The cleanup after the task's exit polls in rounds with a timeout; returning at
        // once made that loop spin on a core while a killed leftover was dying.
        let dir = tempfile::tempdir().expect("tempdir");
        let mut running = running_with_every_output_closed(dir.path());
        let mut buffer = [MaybeUninit::uninit(); 64];
        let timer = timer_firing_in(30);
        let (ready, exit) = running.poll_once(&mut buffer, false, Some(&timeout_ms(60)));
        assert_eq!((ready, exit), (0, None));
        assert!(
            has_fired(&timer),
            "poll_once returned before a 30 ms timer fired, though asked to wait 60 ms"
        );
    }

    #[test]
    fn a_poll_with_nothing_to_poll_and_no_timeout_returns_rather_than_waiting_forever() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (done, returned) = std::sync::mpsc::channel();
        let log_dir = dir.path().to_owned();
        std::thread::spawn(move || {
            let mut running = running_with_every_output_closed(&log_dir);
            let mut buffer = [MaybeUninit::uninit(); 64];
            let _ = done.send(running.poll_once(&mut buffer, false, None));
        });
        let outcome = returned.recv_timeout(std::time::Duration::from_secs(30));
        assert_eq!(outcome, Ok((0, None)));
    }

    #[allow(unsafe_code)]
    fn disposition(signal: i32) -> libc::sighandler_t {
        // SAFETY: reads the disposition into a zeroed local.
        unsafe {
            let mut current: libc::sigaction = std::mem::zeroed();
            libc::sigaction(signal, std::ptr::null(), &mut current);
            current.sa_sigaction
        }
    }

    #[test]
    #[allow(unsafe_code)]
    fn ignored_signals_are_reset_to_their_defaults_but_sigpipe_stays_ignored() {
        // SAFETY: no handler function is installed, only the kernel's dispositions. No
        // other test of this crate relies on SIGHUP or SIGQUIT.
        unsafe {
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
            libc::signal(libc::SIGQUIT, libc::SIG_IGN);
        }
        let pipe = disposition(libc::SIGPIPE);
        default_signal_dispositions();
        assert_eq!(disposition(libc::SIGHUP), libc::SIG_DFL);
        assert_eq!(disposition(libc::SIGQUIT), libc::SIG_DFL);
        assert_eq!(disposition(libc::SIGPIPE), pipe);
    }

    #[test]
    fn signalled_exits_read_as_128_plus_the_signal() {
        assert_eq!(
            exit_from(None, Some(9)),
            ExitStatus {
                code: 137,
                signal: Some(9)
            }
        );
        assert_eq!(
            exit_from(Some(3), None),
            ExitStatus {
                code: 3,
                signal: None
            }
        );
    }
}
