//! Starts the task the way `posix_spawn` does: `clone(CLONE_VM | CLONE_VFORK)`, so the
//! supervisor's address space is neither copied nor faulted in page by page, and the
//! supervisor sleeps until the task has `exec`ed.
//!
//! `posix_spawn` itself cannot be used: the task needs `PR_SET_PDEATHSIG`, which no spawn
//! attribute sets. `std::process::Command` forks as soon as a `pre_exec` closure is
//! given. Everything the child needs (paths, `argv`, `envp`) is built before the clone,
//! so the child only makes system calls: it shares the supervisor's memory and must not
//! allocate, lock or unwind.

use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::ptr;

use rustix::process::Pid;

/// The child's stack: it runs a handful of system-call wrappers and nothing else.
const CHILD_STACK: usize = 64 * 1024;
/// Where a program without a `/` is looked for when the task's environment has no
/// `PATH` (glibc's `execvp` default).
const DEFAULT_PATH: &[u8] = b"/bin:/usr/bin";

/// What the task is started with.
pub(crate) struct TaskCommand<'a> {
    pub program: &'a OsStr,
    pub args: &'a [OsString],
    pub environment: &'a [(OsString, OsString)],
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// The supplementary groups set when the task switches user (`uid` set) and the
    /// supervisor is root; empty: none.
    pub groups: &'a [u32],
    /// The write ends of the output pipes, consumed: the supervisor's copies close once
    /// the task has its own, so the pipes reach EOF when the task's are gone.
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// Everything the child reads, built by the parent; the child writes only `error`.
struct Child {
    candidates: Vec<CString>,
    argv: Vec<*const libc::c_char>,
    envp: Vec<*const libc::c_char>,
    stdin: RawFd,
    stdout: RawFd,
    stderr: RawFd,
    uid: Option<u32>,
    gid: Option<u32>,
    /// The supplementary groups, as the kernel takes them (built before the clone).
    groups: Vec<libc::gid_t>,
    parent: libc::pid_t,
    /// The signal mask the task starts with: the supervisor's, `SIGCHLD` unblocked.
    mask: libc::sigset_t,
    /// The errno of the step that failed, 0 when the child reached `exec`.
    error: libc::c_int,
}

fn c_string(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "a NUL byte in the command, an argument or the environment",
        )
    })
}

/// The paths `program` is tried at, in order, as `execvp` searches them.
fn candidates(program: &OsStr, environment: &[(OsString, OsString)]) -> io::Result<Vec<CString>> {
    let program = program.as_bytes();
    if program.is_empty() {
        return Err(io::ErrorKind::NotFound.into());
    }
    if program.contains(&b'/') {
        return Ok(vec![c_string(program)?]);
    }
    let path = environment
        .iter()
        .find(|(key, _)| key == "PATH")
        .map_or(DEFAULT_PATH, |(_, value)| value.as_bytes());
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

/// The child's stack: an anonymous mapping, unmapped on drop.
struct Stack {
    base: *mut libc::c_void,
}

impl Stack {
    #[allow(unsafe_code)]
    fn map() -> io::Result<Stack> {
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let base = unsafe {
            libc::mmap(
                ptr::null_mut(),
                CHILD_STACK,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Stack { base })
    }

    /// The stack's top (it grows down), 16-byte aligned as every ABI wants.
    fn top(&self) -> *mut libc::c_void {
        self.base.wrapping_byte_add(CHILD_STACK)
    }
}

impl Drop for Stack {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // SAFETY: the mapping is ours and no longer used: `CLONE_VFORK` returned only
        // once the child had exec'ed or exited.
        unsafe {
            libc::munmap(self.base, CHILD_STACK);
        }
    }
}

/// Starts the task in its own session, dying with the supervisor, as `uid`/`gid` with
/// `groups`, with
/// `/dev/null` as stdin; returns its pid once it has `exec`ed.
#[allow(unsafe_code)]
pub(crate) fn spawn(command: TaskCommand<'_>) -> io::Result<Pid> {
    let candidates = candidates(command.program, command.environment)?;
    let args: Vec<CString> = std::iter::once(command.program)
        .chain(command.args.iter().map(OsString::as_os_str))
        .map(|arg| c_string(arg.as_bytes()))
        .collect::<io::Result<_>>()?;
    let environment: Vec<CString> = command
        .environment
        .iter()
        .map(|(key, value)| {
            let mut entry = Vec::with_capacity(key.len() + 1 + value.len());
            entry.extend_from_slice(key.as_bytes());
            entry.push(b'=');
            entry.extend_from_slice(value.as_bytes());
            c_string(&entry)
        })
        .collect::<io::Result<_>>()?;
    let null = std::fs::File::open("/dev/null")?;
    let mut child = Child {
        candidates,
        argv: args
            .iter()
            .map(|a| a.as_ptr())
            .chain(std::iter::once(ptr::null()))
            .collect(),
        envp: environment
            .iter()
            .map(|e| e.as_ptr())
            .chain(std::iter::once(ptr::null()))
            .collect(),
        stdin: null.as_raw_fd(),
        stdout: command.stdout.as_raw_fd(),
        stderr: command.stderr.as_raw_fd(),
        uid: command.uid,
        gid: command.gid,
        groups: command
            .groups
            .iter()
            .map(|&gid| libc::gid_t::from(gid))
            .collect(),
        parent: std::process::id().try_into().unwrap_or(0),
        // SAFETY: an all-zero `sigset_t` is a valid (empty) set; it is overwritten below.
        mask: unsafe { std::mem::zeroed() },
        error: 0,
    };
    // Mapped, not allocated: only the pages the child touches (one or two) are ever
    // faulted in, and they are gone again once it has exec'ed, where a heap buffer would
    // stay dirty in every supervisor.
    let stack = Stack::map()?;
    let top = stack.top();
    let pid;
    let clone_error;
    // SAFETY: every signal is blocked around the clone, as `posix_spawn` does, so no
    // handler of the supervisor runs on the child's stack in the shared address space;
    // the child sets the task's mask before `exec`. `child` points to a live `Child` that
    // nothing else touches until the clone returns, and `run_child` only makes system
    // calls and writes its `error`.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        let mut saved: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut saved);
        // The supervisor blocks `SIGCHLD` to read it from a descriptor; the task starts
        // with it unblocked, as any program expects.
        child.mask = saved;
        libc::sigdelset(&mut child.mask, libc::SIGCHLD);
        pid = libc::clone(
            run_child,
            top,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (&raw mut child).cast(),
        );
        clone_error = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &saved, ptr::null_mut());
    }
    drop(null);
    drop(stack);
    if pid == -1 {
        return Err(clone_error);
    }
    // SAFETY: the child is gone from this memory (exec'ed or exited); this thread is the
    // only one that reads the field. Volatile, so the read is not assumed unchanged.
    let error = unsafe { ptr::read_volatile(&raw const child.error) };
    if error != 0 {
        // The child exited without exec: reap it, so it is no zombie.
        let _ = rustix::process::waitpid(Pid::from_raw(pid), rustix::process::WaitOptions::empty());
        return Err(io::Error::from_raw_os_error(error));
    }
    Pid::from_raw(pid).ok_or_else(|| io::Error::other("clone returned pid 0"))
}

/// The child, between the clone and the `exec`: system calls only.
#[allow(unsafe_code)]
extern "C" fn run_child(context: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `context` is the parent's `Child`, alive and unaliased while the parent is
    // suspended by `CLONE_VFORK`.
    let child = unsafe { &mut *context.cast::<Child>() };
    // SAFETY: each call is a thin wrapper of one system call, async-signal-safe, on
    // descriptors and C strings the parent keeps alive.
    let error = unsafe { prepare_and_exec(child) };
    // SAFETY: a volatile write the parent reads after the child is gone; then the child
    // leaves without running any of the parent's exit handlers.
    unsafe {
        ptr::write_volatile(&raw mut child.error, error);
        libc::_exit(127)
    }
}

/// Sets the child up and executes the task; returns the errno of what failed.
#[allow(unsafe_code)]
unsafe fn prepare_and_exec(child: &Child) -> libc::c_int {
    let errno = || {
        io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL)
    };
    // SAFETY: see `run_child`; every pointer is the parent's, alive until exec.
    unsafe {
        // The supervisor ignores SIGPIPE (the Rust runtime does); the task must not
        // inherit that through exec. The child has its own copy of the dispositions.
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        for (fd, target) in [(child.stdin, 0), (child.stdout, 1), (child.stderr, 2)] {
            let done = if fd == target {
                libc::fcntl(fd, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, target)
            };
            if done == -1 {
                return errno();
            }
        }
        if libc::setsid() == -1 {
            return errno();
        }
        // Raw system calls: glibc's wrappers would signal the supervisor's other threads
        // to change their ids too, from a process that only shares their memory. The
        // groups first, while the child may still set them; then the group, then the
        // user, which gives up the right to change either.
        // Switching user from root replaces root's supplementary groups with the user's
        // (`initgroups` does the same); a supervisor that is not root cannot set them,
        // and only runs tasks as its own user.
        if child.uid.is_some()
            && libc::getuid() == 0
            && libc::syscall(
                libc::SYS_setgroups,
                child.groups.len(),
                child.groups.as_ptr(),
            ) == -1
        {
            return errno();
        }
        if let Some(gid) = child.gid
            && libc::syscall(libc::SYS_setgid, libc::c_long::from(gid)) == -1
        {
            return errno();
        }
        if let Some(uid) = child.uid
            && libc::syscall(libc::SYS_setuid, libc::c_long::from(uid)) == -1
        {
            return errno();
        }
        // After the ids: the kernel clears the parent-death signal when the credentials
        // change, so set before them it would be gone for every task that switches user.
        // Any process may set its own.
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) == -1 {
            return errno();
        }
        // The supervisor died before the prctl: nobody would reap or log the task, and
        // no signal will come.
        if libc::getppid() != child.parent {
            return libc::EPIPE;
        }
        libc::pthread_sigmask(libc::SIG_SETMASK, &child.mask, ptr::null_mut());
        // Only stdin, stdout and stderr reach the task: whatever else is open here
        // without close-on-exec (the supervisor's own descriptors have it) is marked so.
        // `CLOSE_RANGE_CLOEXEC` came with Linux 5.11; an older kernel refuses it
        // (`ENOSYS` or `EINVAL`), and listing `/proc/self/fd` instead would allocate, so
        // there the task inherits them as before.
        libc::syscall(
            libc::SYS_close_range,
            libc::c_uint::from(3u8),
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        );
        // `execvp`'s search: a missing or non-directory entry moves on; a forbidden one
        // is remembered, so it is the error when nothing else is found.
        let mut denied = false;
        let mut last = libc::ENOENT;
        for path in &child.candidates {
            libc::execve(path.as_ptr(), child.argv.as_ptr(), child.envp.as_ptr());
            last = errno();
            match last {
                libc::EACCES => denied = true,
                libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT => {}
                _ => return last,
            }
        }
        if denied { libc::EACCES } else { last }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(OsString, OsString)> {
        pairs
            .iter()
            .map(|(k, v)| (OsString::from(k), OsString::from(v)))
            .collect()
    }

    #[test]
    fn a_program_with_a_slash_is_taken_as_it_is_and_others_are_searched_on_the_tasks_path() {
        let found = |program: &str, pairs: &[(&str, &str)]| -> Vec<String> {
            candidates(OsStr::new(program), &env(pairs))
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
        assert!(candidates(OsStr::new(""), &[]).is_err());
        assert!(candidates(OsStr::new("a\0b"), &[]).is_err());
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
    ) -> (io::Result<Pid>, std::fs::File) {
        let (read, write) = pipe();
        let (_err_read, err_write) = pipe();
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        let spawned = spawn(TaskCommand {
            program: OsStr::new(program),
            args: &args,
            environment: &env(environment),
            uid: None,
            gid: None,
            groups: &[],
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
            program: OsStr::new("/bin/sh"),
            args: &args,
            environment: &env(&[("PATH", "/usr/bin:/bin")]),
            uid: Some(65534),
            gid: Some(65534),
            groups: &[65534, 4_000_000_001, 4242],
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
    fn a_missing_program_is_not_found() {
        let (spawned, _stdout) =
            spawn_with("stead-no-such-program", &[], &[("PATH", "/usr/bin:/bin")]);
        let error = spawned.expect_err("nothing to run");
        assert_eq!(error.kind(), io::ErrorKind::NotFound);
    }
}
