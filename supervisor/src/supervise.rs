//! The supervisor's life: start the task, copy its output, reap it, clean up, report.
//!
//! One thread polls the task's stdout and stderr pipes and a `signalfd` for `SIGCHLD`
//! ([`crate::children`]); on the signal it reaps every child that exited: the task and
//! the orphans the supervisor adopts as a subreaper. Nothing wakes the supervisor while
//! its task is quiet, and it runs no second thread.

use std::ffi::OsString;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStringExt;
use std::process::ExitCode;

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::fs::OFlags;
use rustix::io::Errno;
use rustix::pipe::{PipeFlags, pipe_with};
use rustix::process::{Pid, Signal, WaitOptions, WaitStatus};

use crate::args::{ArgsError, SupervisorArgs};
use crate::children::ChildSignals;
use crate::logs::{Rotator, Stream};
use crate::proc;
use crate::protocol::{self, ExitStatus, Report, RunRecord};
use crate::spawn::{self, TaskCommand};

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
    Environment(#[source] io::Error),
    #[error("the agent closed stdin before the end of the task's environment")]
    TruncatedEnvironment,
    #[error("entering the task dir {dir}")]
    TaskDir {
        dir: String,
        #[source]
        source: io::Error,
    },
    #[error("opening the {stream} log of task {task} in {dir}")]
    Logs {
        stream: &'static str,
        task: String,
        dir: String,
        #[source]
        source: io::Error,
    },
    #[error("creating pipes")]
    Pipe(#[source] io::Error),
    #[error("starting {command:?}")]
    Spawn {
        command: String,
        #[source]
        source: io::Error,
    },
    #[error("watching for the task's exit (signalfd)")]
    ChildSignals(#[source] io::Error),
}

impl StartError {
    /// Only a missing or forbidden program, or a malformed request, fail for good.
    fn recoverable(&self) -> bool {
        match self {
            StartError::Args(_) | StartError::TruncatedEnvironment => false,
            StartError::Spawn { source, .. } => !matches!(
                source.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::PermissionDenied
            ),
            _ => true,
        }
    }
}

/// `error: cause: cause`, on one line.
fn error_chain(error: &dyn std::error::Error) -> String {
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
    let line = report.to_line();
    let mut bytes = line.as_bytes();
    while !bytes.is_empty() {
        match rustix::io::write(rustix::stdio::stdout(), bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(Errno::INTR) => {}
            Err(_) => return false,
        }
    }
    true
}

/// Resets every signal the supervisor inherited as ignored to its default, `SIGPIPE`
/// aside (the Rust runtime ignores it here on purpose; the task gets it back at its
/// start). Ignored signals survive `exec`, and a shell started with `SIGINT` ignored
/// cannot trap it: an agent launched in the background of a script (where `SIGINT` and
/// `SIGQUIT` are ignored) or under `nohup` (`SIGHUP`) would pass that on to every task,
/// whose `killSignal` would then do nothing. Tasks start as from a clean init.
///
/// Through the raw system call for every signal: glibc's `posix_spawn`, which started
/// this process, also leaves the signals glibc keeps for itself (32 and 33) ignored, and
/// glibc's `sigaction` refuses to touch those.
#[allow(unsafe_code)]
pub(crate) fn default_signal_dispositions() {
    /// The kernel's `struct sigaction` (x86-64 and aarch64 both have `sa_restorer`);
    /// all zero is `SIG_DFL`.
    #[repr(C)]
    #[derive(Default)]
    struct KernelSigaction {
        handler: usize,
        flags: libc::c_ulong,
        restorer: usize,
        mask: u64,
    }
    /// The kernel's signal numbers run from 1 to 64.
    const SIGNALS: i32 = 64;
    let mask_size = std::mem::size_of::<u64>();
    let default = KernelSigaction::default();
    for signal in 1..=SIGNALS {
        if matches!(signal, libc::SIGKILL | libc::SIGSTOP | libc::SIGPIPE) {
            continue;
        }
        let mut current = KernelSigaction::default();
        // SAFETY: `rt_sigaction` reads and writes the kernel's layout, which
        // `KernelSigaction` is, with an 8-byte signal mask; no handler is installed.
        unsafe {
            if libc::syscall(
                libc::SYS_rt_sigaction,
                signal,
                std::ptr::null::<KernelSigaction>(),
                &raw mut current,
                mask_size,
            ) == 0
                && current.handler == libc::SIG_IGN
            {
                libc::syscall(
                    libc::SYS_rt_sigaction,
                    signal,
                    &raw const default,
                    std::ptr::null_mut::<KernelSigaction>(),
                    mask_size,
                );
            }
        }
    }
}

/// Closes every descriptor above stderr that the process inherited. The agent starts
/// the fork server with stdin, stdout and stderr only, but a descriptor the agent itself
/// inherited without close-on-exec (from a shell, a service manager, a test harness)
/// reaches the server too, and every supervisor it forks would hold it for as long as
/// its task runs. Called first thing, before this process opens anything.
/// `close_range` came with Linux 5.9; on an older kernel they stay open.
#[allow(unsafe_code)]
fn close_inherited_descriptors() {
    let no_flags: libc::c_uint = 0;
    // SAFETY: nothing in this process uses a descriptor above 2 yet: this runs before
    // anything is opened, and the standard library opens nothing at start.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            libc::c_uint::from(3u8),
            libc::c_uint::MAX,
            no_flags,
        );
    }
}

/// The supervisor's entry point: `--zygote` serves start requests as a fork server,
/// `--version` prints the version; anything else is one supervisor's command line, with
/// the environment on stdin.
pub fn main() -> ExitCode {
    close_inherited_descriptors();
    let mut argv = std::env::args_os().skip(1).peekable();
    if argv.peek().is_some_and(|first| first == "--zygote") {
        let _ = argv.next();
        return crate::zygote::serve(argv);
    }
    if argv.peek().is_some_and(|first| first == "--version") {
        // What a packaging check can run: the binary loads and says which it is.
        println!("stead-supervisor {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    default_signal_dispositions();
    let started = SupervisorArgs::parse(argv)
        .map_err(StartError::Args)
        .and_then(|args| Ok((read_environment()?, args)));
    match started {
        Ok((environment, args)) => ExitCode::from(run(&args, environment)),
        Err(error) => {
            let _ = send(&Report::Failed {
                recoverable: error.recoverable(),
                message: error_chain(&error),
            });
            ExitCode::from(2)
        }
    }
}

/// Runs one supervisor to its end: starts the task, reports on stdout, supervises it,
/// records its exit. Returns the supervisor's exit code.
pub(crate) fn run(args: &SupervisorArgs, environment: Vec<(OsString, OsString)>) -> u8 {
    // Out of the agent's session: the agent's terminal and process group signals (and
    // its death) do not reach the supervisor.
    let _ = rustix::process::setsid();
    let mut running = match start(args, environment) {
        Ok(running) => running,
        Err(error) => {
            let _ = send(&Report::Failed {
                recoverable: error.recoverable(),
                message: error_chain(&error),
            });
            return 1;
        }
    };
    // An agent gone by now finds the run by its run record.
    let _ = send(&Report::Started {
        task_pid: running.task_pid.as_raw_nonzero().get().unsigned_abs(),
        task_start: running.task_start,
        supervisor_pid: std::process::id(),
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
fn read_environment() -> Result<Vec<(OsString, OsString)>, StartError> {
    let mut input = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match rustix::io::read(rustix::stdio::stdin(), &mut chunk) {
            Ok(0) => break,
            Ok(n) => input.extend_from_slice(&chunk[..n]),
            Err(Errno::INTR) => {}
            Err(error) => return Err(StartError::Environment(error.into())),
        }
    }
    // The end marker: an empty entry, so the input ends with "\0\0" (or is just "\0").
    let body = match input.strip_suffix(b"\0") {
        Some(b"") => &b""[..],
        Some(rest) if rest.ends_with(b"\0") => rest,
        _ => return Err(StartError::TruncatedEnvironment),
    };
    Ok(body
        .split(|b| *b == 0)
        .filter(|entry| !entry.is_empty())
        .filter_map(|entry| {
            let eq = entry.iter().position(|b| *b == b'=')?;
            Some((
                OsString::from_vec(entry[..eq].to_vec()),
                OsString::from_vec(entry[eq + 1..].to_vec()),
            ))
        })
        .collect())
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
        dir: args.log_dir.display().to_string(),
        source,
    })
}

fn nonblocking_pipe() -> Result<(OwnedFd, OwnedFd), StartError> {
    let (read, write) = pipe_with(PipeFlags::CLOEXEC).map_err(|e| StartError::Pipe(e.into()))?;
    rustix::fs::fcntl_setfl(&read, OFlags::NONBLOCK).map_err(|e| StartError::Pipe(e.into()))?;
    Ok((read, write))
}

fn start(
    args: &SupervisorArgs,
    environment: Vec<(OsString, OsString)>,
) -> Result<Running, StartError> {
    let me = rustix::process::getpid();
    // Orphans of the task (daemonised grandchildren included) become our children, so
    // they stay visible and killable.
    let _ = rustix::process::set_child_subreaper(Some(me));
    std::env::set_current_dir(&args.task_dir).map_err(|source| StartError::TaskDir {
        dir: args.task_dir.display().to_string(),
        source,
    })?;
    let stdout_log = open_output(args, Stream::Stdout)?;
    let stderr_log = open_output(args, Stream::Stderr)?;
    let (stdout_read, stdout_write) = nonblocking_pipe()?;
    let (stderr_read, stderr_write) = nonblocking_pipe()?;
    // Before the task exists, so that no exit of it goes unseen.
    let children = ChildSignals::new().map_err(StartError::ChildSignals)?;

    let task_pid = spawn::spawn(TaskCommand {
        program: &args.command,
        args: &args.args,
        environment: &environment,
        uid: args.uid,
        gid: args.gid,
        groups: &args.groups,
        stdout: stdout_write,
        stderr: stderr_write,
    })
    .map_err(|source| StartError::Spawn {
        command: args.command.to_string_lossy().into_owned(),
        source,
    })?;
    let task_raw = task_pid.as_raw_nonzero().get().unsigned_abs();
    // Nothing reaps the task before the poll loop, so its stat is there.
    let task_start = proc::start_time(task_raw).unwrap_or(0);
    let supervisor_start = proc::start_time(std::process::id()).unwrap_or(0);
    // Only for an agent that died before it learnt of this run; not fatal.
    let _ = protocol::write_run_record(
        &args.control_dir,
        &args.run,
        RunRecord {
            supervisor_pid: std::process::id(),
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
        buffer: &mut [u8],
        watch_children: bool,
        timeout: Option<&Timespec>,
    ) -> (usize, Option<ExitStatus>) {
        let ready;
        let mut exit = None;
        let mut readable = [false; 3];
        {
            let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(3);
            let mut slots = Vec::with_capacity(3);
            for (slot, output) in self.outputs.iter().enumerate() {
                if let Some(pipe) = &output.pipe {
                    fds.push(PollFd::new(pipe, PollFlags::IN));
                    slots.push(slot);
                }
            }
            if watch_children {
                fds.push(PollFd::new(&self.children, PollFlags::IN));
                slots.push(2);
            }
            if fds.is_empty() && timeout.is_none() {
                return (0, None);
            }
            match poll(&mut fds, timeout) {
                Ok(n) => ready = n,
                Err(_) => return (0, None),
            }
            for (fd, slot) in fds.iter().zip(slots) {
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
        let mut buffer = vec![0u8; READ_BUFFER];
        let status = loop {
            if let (_, Some(status)) = self.poll_once(&mut buffer, true, None) {
                break status;
            }
        };
        // Whatever the task left behind (background children, daemons that reparented
        // to us) dies with it, as with a container's init.
        let me = std::process::id();
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
            self.poll_once(&mut buffer, true, Some(&round));
        }
        reap_exited();
        // Every writer is dead: read to EOF (or until nothing came for a while, if some
        // process outside the tree holds a copy of a pipe).
        let idle = timeout_ms(DRAIN_IDLE_MS);
        while self.outputs.iter().any(|o| o.pipe.is_some()) {
            if self.poll_once(&mut buffer, false, Some(&idle)).0 == 0 {
                break;
            }
        }
        status
    }
}

impl Output {
    /// Reads what is available; closes the pipe at EOF or on error.
    fn drain(&mut self, buffer: &mut [u8]) {
        let Some(pipe) = &self.pipe else { return };
        for _ in 0..64 {
            match rustix::io::read(pipe, &mut *buffer) {
                Ok(0) => {
                    self.pipe = None;
                    return;
                }
                Ok(n) => {
                    // A log that cannot be written (a full disk) loses output; it never
                    // blocks the task.
                    let _ = self.rotator.write(&buffer[..n]);
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

    /// A started task whose stdout and stderr the task has both closed, as after its
    /// exit; its pid is never waited for.
    fn running_with_every_output_closed(log_dir: &std::path::Path) -> Running {
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
        let mut buffer = vec![0u8; 64];
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
            let mut buffer = vec![0u8; 64];
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
