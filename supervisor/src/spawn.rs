//! Starts the task: a `fork` of the supervisor (a small process: few pages to copy), which
//! sets the task's session, ids, descriptors and signal mask and `exec`s it; a
//! close-on-exec pipe tells the supervisor whether the `exec` happened.
//!
//! `posix_spawn` cannot be used: the task needs `PR_SET_PDEATHSIG`, which no spawn
//! attribute sets, and the supervisor links no C library. Everything the child needs
//! (paths, `argv`, `envp`) is built before the fork, so the child only makes system
//! calls: the same code also runs in a multi-threaded test process, where a forked child
//! must not allocate or lock.

use alloc::ffi::CString;
use alloc::vec;
use alloc::vec::Vec;
use core::fmt;

use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::OFlags;
use rustix::io::{Errno, FdFlags};
use rustix::pipe::{PipeFlags, pipe_with};
use rustix::process::{Gid, Pid, Signal, Uid};

use crate::error::OsError;
use crate::file;
use crate::protocol::Environment;
use crate::sys::{self, MaskHow, SignalSet};

/// Where a program without a `/` is looked for when the task's environment has no
/// `PATH` (glibc's `execvp` default).
const DEFAULT_PATH: &[u8] = b"/bin:/usr/bin";

/// What the task is started with.
pub(crate) struct TaskCommand<'a> {
    pub program: &'a [u8],
    pub args: &'a [Vec<u8>],
    pub environment: &'a Environment,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// The supplementary groups set when the task switches user (`uid` set) and the
    /// supervisor is root; empty: none.
    pub groups: &'a [u32],
    /// The `cgroup.procs` files the task joins before it `exec`s.
    pub cgroups: &'a [Vec<u8>],
    /// The write ends of the output pipes, consumed: the supervisor's copies close once
    /// the task has its own, so the pipes reach EOF when the task's are gone.
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// Why the task was not started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SpawnError {
    /// A NUL byte in the program or an argument (the environment cannot hold one: its
    /// entries are split at NUL bytes).
    Nul,
    /// A system call failed (`exec` included).
    Os(OsError),
    /// The task could not join one of its cgroups (the agent made them; a retry may
    /// find them again).
    Cgroup(OsError),
    /// The task could not take its user, group or groups: an id the kernel cannot map
    /// (`EINVAL`, outside the user namespace's map) or a supervisor without the right
    /// (`EPERM`) fails every time.
    Credentials(OsError),
}

impl SpawnError {
    /// Whether trying again will not help: the program is missing or may not be run,
    /// its arguments and environment are over the kernel's limit (`E2BIG`), or its user
    /// cannot be taken.
    pub(crate) fn is_permanent(self) -> bool {
        matches!(
            self,
            SpawnError::Nul
                | SpawnError::Os(OsError(
                    Errno::NOENT | Errno::ACCESS | Errno::PERM | Errno::TOOBIG
                ))
                | SpawnError::Credentials(OsError(Errno::INVAL | Errno::PERM))
        )
    }
}

impl From<Errno> for SpawnError {
    fn from(errno: Errno) -> SpawnError {
        SpawnError::Os(OsError(errno))
    }
}

impl fmt::Display for SpawnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SpawnError::Nul => f.write_str("a NUL byte in the command or an argument"),
            SpawnError::Os(error) => error.fmt(f),
            SpawnError::Cgroup(error) => write!(f, "joining the task's cgroup: {error}"),
            SpawnError::Credentials(error) => {
                write!(f, "switching to the task's user, group and groups: {error}")
            }
        }
    }
}

impl core::error::Error for SpawnError {}

/// Everything the child reads, built by the parent before the fork.
struct Child {
    candidates: Vec<CString>,
    argv: Vec<*const u8>,
    envp: Vec<*const u8>,
    stdin: OwnedFd,
    stdout: OwnedFd,
    stderr: OwnedFd,
    uid: Option<Uid>,
    gid: Option<Gid>,
    /// The supplementary groups, as the kernel takes them.
    groups: Vec<Gid>,
    parent: Option<Pid>,
    /// The signal mask the task starts with: the supervisor's, `SIGCHLD` unblocked.
    mask: SignalSet,
    /// The files to write `0` (the writer) to, one per cgroup it joins.
    cgroups: Vec<CString>,
    /// Of `cgroups`, the one the child was created in, which it need not join.
    created_in: Option<usize>,
}

/// Which step of the child's set-up failed; sent before its errno.
const FAILED_OTHER: u8 = 0;
const FAILED_CGROUP: u8 = 1;
const FAILED_CREDENTIALS: u8 = 2;

fn c_string(bytes: &[u8]) -> Result<CString, SpawnError> {
    CString::new(bytes).map_err(|_| SpawnError::Nul)
}

/// The paths `program` is tried at, in order, as `execvp` searches them.
fn candidates(program: &[u8], environment: &Environment) -> Result<Vec<CString>, SpawnError> {
    if program.is_empty() {
        return Err(Errno::NOENT.into());
    }
    if program.contains(&b'/') {
        return Ok(vec![c_string(program)?]);
    }
    let path = environment.get(b"PATH").unwrap_or(DEFAULT_PATH);
    path.split(|b| *b == b':')
        .map(|dir| {
            // An empty entry is the current directory.
            let dir = if dir.is_empty() { &b"."[..] } else { dir };
            let mut full = Vec::with_capacity(dir.len() + 1 + program.len());
            full.extend_from_slice(dir);
            full.push(b'/');
            full.extend_from_slice(program);
            c_string(&full)
        })
        .collect()
}

/// Starts the task in its own session, dying with the supervisor, as `uid`/`gid` with
/// `groups`, with `/dev/null` as stdin; returns its pid once it has `exec`ed.
#[allow(unsafe_code)]
pub(crate) fn spawn(command: TaskCommand<'_>) -> Result<Pid, SpawnError> {
    let candidates = candidates(command.program, command.environment)?;
    let args: Vec<CString> = core::iter::once(command.program)
        .chain(command.args.iter().map(Vec::as_slice))
        .map(c_string)
        .collect::<Result<_, _>>()?;
    // The environment's entries are NUL-terminated where they are: `envp` points into
    // its one buffer, no copy.
    let entries = command.environment.as_bytes().as_ptr();
    let envp: Vec<*const u8> = command
        .environment
        .offsets()
        .map(|offset| entries.wrapping_add(offset))
        .chain(core::iter::once(core::ptr::null()))
        .collect();
    let argv: Vec<*const u8> = args
        .iter()
        .map(|s| s.as_ptr().cast::<u8>())
        .chain(core::iter::once(core::ptr::null()))
        .collect();
    // The supervisor blocks `SIGCHLD` to read it from a descriptor; the task starts with
    // it unblocked, as any program expects.
    let mask = sys::sigprocmask(MaskHow::Block, SignalSet::default())?
        .without(linux_raw_sys::general::SIGCHLD);
    let mut child = Child {
        argv,
        envp,
        candidates,
        stdin: file::open(b"/dev/null", OFlags::RDONLY, 0)?,
        stdout: command.stdout,
        stderr: command.stderr,
        uid: command.uid.map(Uid::from_raw),
        gid: command.gid.map(Gid::from_raw),
        groups: command
            .groups
            .iter()
            .map(|&gid| Gid::from_raw(gid))
            .collect(),
        parent: Some(rustix::process::getpid()),
        mask,
        cgroups: command
            .cgroups
            .iter()
            .map(|path| c_string(path))
            .collect::<Result<_, _>>()?,
        created_in: None,
    };
    // Close-on-exec: the read end sees EOF once the child has exec'ed, or the errno of
    // the step that failed.
    let (status_read, status_write) = pipe_with(PipeFlags::CLOEXEC)?;
    // On cgroup v2 the task is created in its cgroup rather than moved into it: a move
    // through `cgroup.procs` takes the kernel's global threadgroup lock, which waits for
    // every fork and exit in flight on the machine. A kernel without `CLONE_INTO_CGROUP`
    // (before 5.7), or one that refuses the cgroup, gets the fork and the move.
    let v2 = cgroup_v2_dir(&child.cgroups);
    // SAFETY: the child makes only system calls on what `child` holds, built above, and
    // leaves through `exec` or `exit`.
    let forked = match &v2 {
        Some((index, dir)) => match unsafe { sys::fork_into_cgroup(dir.as_fd()) } {
            Ok(forked) => {
                child.created_in = Some(*index);
                Ok(forked)
            }
            // SAFETY: as above.
            Err(_) => unsafe { sys::fork() },
        },
        // SAFETY: as above.
        None => unsafe { sys::fork() },
    };
    drop(v2);
    match forked? {
        None => {
            drop(status_read);
            let (step, errno) = prepare_and_exec(&child);
            let mut message = [step, 0, 0, 0, 0];
            message[1..].copy_from_slice(&errno.raw_os_error().to_ne_bytes());
            let _ = rustix::io::write(&status_write, &message);
            sys::exit(127)
        }
        Some(pid) => {
            drop(status_write);
            drop(child);
            let mut message = [0u8; 5];
            let mut got = 0;
            while got < message.len() {
                match rustix::io::read(&status_read, &mut message[got..]) {
                    Ok(0) => break,
                    Ok(n) => got += n,
                    Err(Errno::INTR) => {}
                    Err(_) => break,
                }
            }
            if got == 0 {
                return Ok(pid);
            }
            // The child exited without exec: reap it, so it is no zombie.
            let _ = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty());
            let mut errno = [0u8; 4];
            errno.copy_from_slice(&message[1..]);
            let errno = Errno::from_raw_os_error(i32::from_ne_bytes(errno));
            Err(match message[0] {
                FAILED_CGROUP => SpawnError::Cgroup(OsError(errno)),
                FAILED_CREDENTIALS => SpawnError::Credentials(OsError(errno)),
                _ => errno.into(),
            })
        }
    }
}

/// Of `files` (what the task joins its cgroups through), the first that is a v2
/// `cgroup.procs`, by its index, with its cgroup's directory opened.
fn cgroup_v2_dir(files: &[CString]) -> Option<(usize, OwnedFd)> {
    const PROCS: &[u8] = b"/cgroup.procs";
    files.iter().enumerate().find_map(|(index, file)| {
        let dir = file.as_bytes().strip_suffix(PROCS)?;
        let dir = file::open(dir, OFlags::PATH | OFlags::DIRECTORY, 0).ok()?;
        let magic = rustix::fs::fstatfs(&dir).ok()?.f_type;
        (magic as u64 == u64::from(linux_raw_sys::general::CGROUP2_SUPER_MAGIC))
            .then_some((index, dir))
    })
}

/// Puts `fd` at `target` (0, 1 or 2) without close-on-exec.
fn install(fd: &OwnedFd, target: i32) -> Result<(), Errno> {
    use rustix::fd::AsRawFd;
    if fd.as_raw_fd() == target {
        return rustix::io::fcntl_setfd(fd, FdFlags::empty());
    }
    match target {
        0 => rustix::stdio::dup2_stdin(fd.as_fd()),
        1 => rustix::stdio::dup2_stdout(fd.as_fd()),
        _ => rustix::stdio::dup2_stderr(fd.as_fd()),
    }
}

/// In the child: sets it up and executes the task; returns which step failed and its
/// errno.
#[allow(unsafe_code)]
fn prepare_and_exec(child: &Child) -> (u8, Errno) {
    // Before anything else, so that no instant of the task runs outside its limits.
    let joins = (child.cgroups.iter().enumerate())
        .filter(|(index, _)| Some(*index) != child.created_in)
        .map(|(_, file)| file);
    if let Err(errno) = crate::cgroup::join(joins) {
        return (FAILED_CGROUP, errno);
    }
    let steps = || -> Result<(), (u8, Errno)> {
        let other = |errno| (FAILED_OTHER, errno);
        // The supervisor ignores SIGPIPE (it writes to an agent that may be gone); the
        // task must not inherit that through exec.
        sys::set_ignored(linux_raw_sys::general::SIGPIPE, false).map_err(other)?;
        install(&child.stdin, 0).map_err(other)?;
        install(&child.stdout, 1).map_err(other)?;
        install(&child.stderr, 2).map_err(other)?;
        rustix::process::setsid().map_err(other)?;
        // Per-thread system calls, as the kernel has them: the process has one thread.
        // The groups first, while the child may still set them; then the group, then
        // the user, which gives up the right to change either. Switching user from root
        // replaces root's supplementary groups with the user's (`initgroups` does the
        // same); a supervisor that is not root cannot set them, and only runs tasks as
        // its own user.
        let credentials = |errno| (FAILED_CREDENTIALS, errno);
        if child.uid.is_some() && rustix::process::getuid().is_root() {
            rustix::thread::set_thread_groups(&child.groups).map_err(credentials)?;
        }
        if let Some(gid) = child.gid {
            rustix::thread::set_thread_gid(gid).map_err(credentials)?;
        }
        if let Some(uid) = child.uid {
            rustix::thread::set_thread_uid(uid).map_err(credentials)?;
        }
        // After the ids: the kernel clears the parent-death signal when the credentials
        // change, so set before them it would be gone for every task that switches user.
        rustix::process::set_parent_process_death_signal(Some(Signal::KILL)).map_err(other)?;
        // The supervisor died before the prctl: nobody would reap or log the task, and
        // no signal will come.
        if rustix::process::getppid() != child.parent {
            return Err(other(Errno::PIPE));
        }
        sys::sigprocmask(MaskHow::Set, child.mask).map_err(other)?;
        // Only stdin, stdout and stderr reach the task: whatever else is open here
        // without close-on-exec (the supervisor's own descriptors have it) is marked so.
        // `CLOSE_RANGE_CLOEXEC` came with Linux 5.11; an older kernel refuses it, and
        // there the task inherits them as before.
        let _ = sys::close_range_from(3, true);
        Ok(())
    };
    if let Err(failed) = steps() {
        return failed;
    }
    // `execvp`'s search: a missing or non-directory entry moves on; a forbidden one is
    // remembered, so it is the error when nothing else is found.
    let mut denied = false;
    let mut last = Errno::NOENT;
    for path in &child.candidates {
        // SAFETY: `argv` and `envp` are null-terminated arrays of pointers to
        // NUL-terminated strings (the arguments' `CString`s, the environment's one
        // buffer) the parent built, alive in this copy of its memory.
        last = unsafe { sys::execve(path, child.argv.as_ptr(), child.envp.as_ptr()) };
        match last {
            Errno::ACCESS => denied = true,
            Errno::NOENT | Errno::NOTDIR | Errno::STALE | Errno::NODEV | Errno::TIMEDOUT => {}
            _ => return (FAILED_OTHER, last),
        }
    }
    (FAILED_OTHER, if denied { Errno::ACCESS } else { last })
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::{String, ToString};
    use std::prelude::rust_2024::*;

    fn env(pairs: &[(&str, &str)]) -> Environment {
        let entries: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        Environment::from_entries(entries.iter().map(String::as_bytes))
    }

    #[test]
    fn a_start_fails_for_good_when_its_program_its_size_or_its_user_cannot_change() {
        for permanent in [
            SpawnError::Nul,
            SpawnError::Os(OsError(Errno::NOENT)),
            SpawnError::Os(OsError(Errno::TOOBIG)),
            SpawnError::Credentials(OsError(Errno::INVAL)),
            SpawnError::Credentials(OsError(Errno::PERM)),
        ] {
            assert!(permanent.is_permanent(), "{permanent:?}");
        }
        for passing in [
            SpawnError::Os(OsError(Errno::NOMEM)),
            SpawnError::Cgroup(OsError(Errno::NOENT)),
            SpawnError::Credentials(OsError(Errno::AGAIN)),
        ] {
            assert!(!passing.is_permanent(), "{passing:?}");
        }
        let shown = SpawnError::Credentials(OsError(Errno::INVAL)).to_string();
        assert!(
            shown.starts_with("switching to the task's user, group and groups: Invalid argument"),
            "{shown}"
        );
    }

    #[test]
    fn a_program_with_a_slash_is_taken_as_it_is_and_others_are_searched_on_the_tasks_path() {
        let found = |program: &str, pairs: &[(&str, &str)]| -> Vec<String> {
            candidates(program.as_bytes(), &env(pairs))
                .expect("candidates")
                .into_iter()
                .map(|c| c.into_string().expect("utf-8"))
                .collect()
        };
        assert_eq!(found("./run.sh", &[("PATH", "/x")]), ["./run.sh"]);
        assert_eq!(
            found("sleep", &[("PATH", "/opt/bin::/usr/bin")]),
            ["/opt/bin/sleep", "./sleep", "/usr/bin/sleep"]
        );
        assert_eq!(found("sleep", &[]), ["/bin/sleep", "/usr/bin/sleep"]);
    }

    #[test]
    fn a_nul_byte_or_an_empty_program_is_refused_before_anything_runs() {
        assert!(candidates(b"", &Environment::default()).is_err());
        assert_eq!(
            candidates(b"a\0b", &Environment::default()),
            Err(SpawnError::Nul)
        );
    }

    fn pipe() -> (OwnedFd, OwnedFd) {
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).expect("pipe")
    }

    fn wait(pid: Pid) -> rustix::process::WaitStatus {
        rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty())
            .expect("waitpid")
            .expect("a status")
            .1
    }

    /// Spawns `program` with `args` and `environment`, no ids; the spawn's result and
    /// the read end of the task's stdout.
    fn spawn_with(
        program: &str,
        args: &[&str],
        environment: &[(&str, &str)],
    ) -> (Result<Pid, SpawnError>, std::fs::File) {
        let (read, write) = pipe();
        let (_err_read, err_write) = pipe();
        let args: Vec<Vec<u8>> = args.iter().map(|arg| arg.as_bytes().to_vec()).collect();
        let spawned = spawn(TaskCommand {
            program: program.as_bytes(),
            args: &args,
            environment: &env(environment),
            uid: None,
            gid: None,
            groups: &[],
            cgroups: &[],
            stdout: write,
            stderr: err_write,
        });
        (spawned, std::fs::File::from(read))
    }

    #[test]
    fn the_task_runs_in_its_own_session_with_exactly_its_environment_and_output() {
        let (spawned, mut stdout) = spawn_with(
            "sh",
            &[
                "-c",
                "echo \"$GREETING $(env | wc -l) $(cut -d\" \" -f6 /proc/$$/stat)\"",
            ],
            &[("PATH", "/usr/bin:/bin"), ("GREETING", "hi")],
        );
        let pid = spawned.expect("spawned");
        assert!(wait(pid).exit_status() == Some(0));
        let mut out = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut out).expect("read");
        let fields: Vec<&str> = out.split_whitespace().collect();
        // sh adds PWD, SHLVL and `_` to the two it was given.
        assert_eq!(fields[0], "hi", "{out}");
        assert!(fields[1].parse::<u32>().expect("a count") <= 5, "{out}");
        assert_eq!(fields[2], pid.as_raw_nonzero().to_string(), "{out}");
    }

    /// The descriptors `pid` holds: number and target.
    fn descriptors(pid: Pid) -> Vec<(u32, std::path::PathBuf)> {
        let mut open: Vec<(u32, std::path::PathBuf)> =
            std::fs::read_dir(format!("/proc/{}/fd", pid.as_raw_nonzero()))
                .expect("the task's descriptors")
                .map(|entry| {
                    let entry = entry.expect("an entry");
                    let fd = entry
                        .file_name()
                        .to_string_lossy()
                        .parse()
                        .expect("a number");
                    (fd, std::fs::read_link(entry.path()).unwrap_or_default())
                })
                .collect();
        open.sort();
        open
    }

    #[test]
    fn a_descriptor_open_without_close_on_exec_in_the_supervisor_does_not_reach_the_task() {
        let leaked = tempfile::NamedTempFile::new().expect("a temporary file");
        rustix::io::fcntl_setfd(leaked.as_file(), rustix::io::FdFlags::empty())
            .expect("close-on-exec cleared");
        let (spawned, _stdout) = spawn_with("sleep", &["1000"], &[("PATH", "/usr/bin:/bin")]);
        let pid = spawned.expect("spawned");
        // The kernel lets the spawn return before `exec` closes the close-on-exec
        // descriptors, and the new program's loader opens its own for a moment: wait
        // until only stdin, stdout and stderr are left, for 10 s at most (counted in
        // polls: only the agent's clock module reads the clock).
        let mut open = descriptors(pid);
        for _ in 0..2_000 {
            if open.iter().all(|(fd, _)| *fd <= 2) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
            open = descriptors(pid);
        }
        rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("killed");
        wait(pid);
        let fds: Vec<u32> = open.iter().map(|(fd, _)| *fd).collect();
        assert_eq!(fds, [0, 1, 2], "{open:?}");
    }

    #[test]
    fn a_task_switching_user_from_root_runs_with_exactly_the_supplementary_groups_given() {
        if !rustix::process::getuid().is_root() {
            eprintln!("skipped: only root can switch a task's user and groups");
            return;
        }
        let (read, write) = pipe();
        let (_err_read, err_write) = pipe();
        let args = ["-c".into(), "grep '^Groups:' /proc/self/status".into()];
        let pid = spawn(TaskCommand {
            program: b"/bin/sh",
            args: &args,
            environment: &env(&[("PATH", "/usr/bin:/bin")]),
            uid: Some(65534),
            gid: Some(65534),
            groups: &[65534, 4_000_000_001, 4242],
            cgroups: &[],
            stdout: write,
            stderr: err_write,
        })
        .expect("spawned");
        assert!(wait(pid).exit_status() == Some(0));
        let mut out = String::new();
        std::io::Read::read_to_string(&mut std::fs::File::from(read), &mut out).expect("read");
        // The kernel lists them sorted.
        assert_eq!(
            out.split_whitespace().collect::<Vec<_>>(),
            ["Groups:", "4242", "65534", "4000000001"],
            "{out}"
        );
    }

    #[test]
    fn the_task_writes_itself_into_each_cgroup_before_it_execs_and_a_join_that_fails_starts_nothing()
     {
        let dir = tempfile::tempdir().expect("a temporary dir");
        let procs: Vec<Vec<u8>> = ["memory", "pids"]
            .iter()
            .map(|name| {
                let path = dir.path().join(name);
                std::fs::write(&path, "").expect("a stand-in procs file");
                path.into_os_string().into_encoded_bytes()
            })
            .collect();
        let start = |cgroups: &[Vec<u8>]| {
            let (_read, write) = pipe();
            let (_err_read, err_write) = pipe();
            spawn(TaskCommand {
                program: b"/bin/true",
                args: &[],
                environment: &env(&[]),
                uid: None,
                gid: None,
                groups: &[],
                cgroups,
                stdout: write,
                stderr: err_write,
            })
        };
        let pid = start(&procs).expect("spawned");
        assert!(wait(pid).exit_status() == Some(0));
        for name in ["memory", "pids"] {
            assert_eq!(
                std::fs::read_to_string(dir.path().join(name)).expect("read"),
                "0"
            );
        }
        let missing = dir.path().join("gone/cgroup.procs");
        let error =
            start(&[missing.into_os_string().into_encoded_bytes()]).expect_err("no cgroup to join");
        assert_eq!(error, SpawnError::Cgroup(OsError(Errno::NOENT)));
        assert!(!error.is_permanent());
        assert_eq!(
            error.to_string(),
            "joining the task's cgroup: No such file or directory (os error 2)"
        );
    }

    #[test]
    fn a_missing_program_is_not_found() {
        let (spawned, _stdout) =
            spawn_with("stead-no-such-program", &[], &[("PATH", "/usr/bin:/bin")]);
        let error = spawned.expect_err("nothing to run");
        assert_eq!(error, SpawnError::Os(OsError(Errno::NOENT)));
        assert!(error.is_permanent());
    }

    /// A cgroup made for one test, removed when dropped (empty by then).
    struct TestCgroup(std::path::PathBuf);

    impl Drop for TestCgroup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir(&self.0);
        }
    }

    /// A fresh cgroup v2 directory below this process's own, made for one test, with its
    /// path as `/proc/<pid>/cgroup` shows it; `None` where there is no v2 tree this
    /// process may make cgroups in (not root, no `cgroup2` mount).
    fn test_cgroup_v2(name: &str) -> Option<(TestCgroup, String)> {
        let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
        let mount = mounts.lines().find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.get(2) == Some(&"cgroup2")).then(|| fields[1].to_owned())
        })?;
        let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let own = own.lines().find_map(|line| line.strip_prefix("0::"))?;
        let shown = format!(
            "{}/{name}-{}",
            own.trim_end_matches('/'),
            std::process::id()
        );
        let dir = std::path::PathBuf::from(format!("{mount}{shown}"));
        std::fs::create_dir(&dir).ok()?;
        Some((TestCgroup(dir), shown))
    }

    #[test]
    fn on_cgroup_v2_the_task_is_created_in_its_cgroup_and_a_stand_in_file_is_joined() {
        let Some((cgroup_dir, shown)) = test_cgroup_v2("stead-spawn-test") else {
            eprintln!("skipped: no cgroup v2 tree to make a cgroup in");
            return;
        };
        let v2 = cgroup_dir
            .0
            .join("cgroup.procs")
            .into_os_string()
            .into_encoded_bytes();
        let stand_in = tempfile::NamedTempFile::new().expect("a stand-in procs file");
        let files = [
            CString::new(stand_in.path().as_os_str().as_encoded_bytes()).expect("a path"),
            CString::new(v2).expect("a path"),
        ];
        // Only the v2 `cgroup.procs` is a directory to be created in.
        let picked = cgroup_v2_dir(&files).map(|(index, _)| index);
        assert_eq!(picked, Some(1));
        assert!(cgroup_v2_dir(&files[..1]).is_none());

        let (_, cgroup) = cgroup_v2_dir(&files).expect("the v2 cgroup");
        let (read, write) = pipe();
        // SAFETY: the child makes one system call and exits.
        #[allow(unsafe_code)]
        let forked = unsafe { sys::fork_into_cgroup(cgroup.as_fd()) };
        let pid = match forked {
            // Until the parent has looked.
            Ok(None) => {
                let _ = rustix::io::read(&read, &mut [0u8; 1]);
                sys::exit(0)
            }
            Ok(Some(pid)) => pid,
            Err(errno @ (Errno::NOSYS | Errno::TOOBIG | Errno::INVAL)) => {
                eprintln!("skipped: this kernel has no CLONE_INTO_CGROUP ({errno})");
                return;
            }
            Err(errno) => std::panic!("clone3: {errno}"),
        };
        let membership = std::fs::read_to_string(format!("/proc/{}/cgroup", pid.as_raw_pid()));
        rustix::io::write(&write, b"x").expect("the child let go");
        assert!(wait(pid).exit_status() == Some(0));
        std::fs::remove_dir(&cgroup_dir.0).expect("the test cgroup, empty again");
        let membership = membership.expect("the child's cgroups");
        assert!(
            membership.lines().any(|line| line == format!("0::{shown}")),
            "{membership}"
        );
    }
}
