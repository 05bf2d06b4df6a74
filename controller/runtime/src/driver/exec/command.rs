//! Commands run beside a task, as the task: exec health checks ([`run`]) and
//! `stead alloc exec` ([`spawn_session`]).
//!
//! The command starts in its own process group, in the task's dir, with the task's
//! environment, user and groups, its standard input from `/dev/null` and its output and
//! errors on one pipe, of which the first [`EXEC_OUTPUT_LIMIT`] bytes are kept. When it
//! ends, at its timeout, or when the check is abandoned (its task stopped), the whole
//! group is killed while its leader is not yet reaped (its end is seen through a pidfd,
//! which does not reap), so the group's id cannot belong to anyone else.
//!
//! A session's command gets pipes, or a new terminal that is its controlling terminal
//! (it leads a session of its own, so its group is still its pid); no timeout. When it
//! ends what is left of its group is killed, and dropping its [`SessionProcess`] before
//! then (the client went away) kills the whole group.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Stdio;
use std::time::Duration;

use rustix::process::{Pid, Signal};
use tokio::io::AsyncReadExt;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::net::unix::pipe;
use tokio::process::Child;

use super::user::Account;
use crate::driver::{EXEC_OUTPUT_LIMIT, ExecOutput, ExecSession, WindowSize};

/// The most a command's pipe is drained after it ended (a process that escaped its group
/// may still be writing): enough for anything a pipe buffer held.
const DRAIN_LIMIT: usize = 1 << 20;

/// What a command shares with its task: the user, the cgroups it joins, and the
/// `oom_score_adj` it gets back (`None`: the agent's).
pub(super) struct AsTask<'a> {
    pub(super) account: Option<&'a Account>,
    pub(super) cgroups: &'a [PathBuf],
    pub(super) oom_score_adj: Option<i16>,
}

/// Runs `command` with `args` in `dir`, with exactly `env`, as its task (`as_task`; with
/// no account, as the agent's own user), for at most `timeout`. When it ends, what is
/// left of its process group (children it started in the background) is killed with it.
pub(super) async fn run(
    command: &str,
    args: &[String],
    env: &BTreeMap<String, String>,
    dir: &Path,
    as_task: AsTask<'_>,
    timeout: Duration,
) -> io::Result<ExecOutput> {
    let AsTask {
        account,
        cgroups,
        oom_score_adj,
    } = as_task;
    let (reader, writer) = std::io::pipe()?;
    let mut builder = command_in(command, args, env, dir);
    builder
        .stdin(Stdio::null())
        .stdout(writer.try_clone()?)
        .stderr(writer)
        .process_group(0)
        .kill_on_drop(false);
    let cgroups = c_paths(cgroups)?;
    prepare_child(
        &mut builder,
        account.cloned(),
        cgroups,
        oom_score_adj,
        false,
    );
    let child = builder.spawn()?;
    // Our copies of the write end are gone with `builder`: the pipe ends when the
    // command's processes close it.
    drop(builder);
    let mut group = Group::new(child)?;
    let mut output = pipe::Receiver::from_owned_fd(OwnedFd::from(reader))?;
    let mut kept = Vec::new();
    let ran = tokio::time::timeout(timeout, async {
        let mut buf = [0u8; 1024];
        let mut open = true;
        loop {
            tokio::select! {
                ready = group.exited.readable() => {
                    // Ended, not yet reaped: its group id is still its own.
                    ready?.retain_ready();
                    return Ok::<(), io::Error>(());
                }
                read = output.read(&mut buf), if open => match read {
                    Ok(0) | Err(_) => open = false,
                    Ok(n) => keep(&mut kept, &buf[..n]),
                },
            }
        }
    })
    .await;
    // Whatever way it went, nothing of the group stays: killed while the leader is
    // unreaped, then reaped.
    group.kill();
    let status = group.child.wait().await;
    group.reaped();
    // What it wrote before it ended, without waiting for a process that escaped the
    // group and still holds the pipe.
    let mut buf = [0u8; 4096];
    let mut drained = 0;
    while drained < DRAIN_LIMIT {
        match output.try_read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                drained += n;
                keep(&mut kept, &buf[..n]);
            }
        }
    }
    match ran {
        Ok(exited) => {
            exited?;
            Ok(ExecOutput {
                exit_code: status?.code(),
                timed_out: false,
                output: kept,
            })
        }
        Err(_elapsed) => Ok(ExecOutput {
            exit_code: None,
            timed_out: true,
            output: kept,
        }),
    }
}

/// `command` with `args`, to run in `dir` with exactly `env`.
fn command_in(
    command: &str,
    args: &[String],
    env: &BTreeMap<String, String>,
    dir: &Path,
) -> tokio::process::Command {
    let mut builder = tokio::process::Command::new(command);
    builder.args(args).env_clear().envs(env).current_dir(dir);
    builder
}

/// The cgroups' `cgroup.procs` paths as C strings, for the child to open.
fn c_paths(cgroups: &[PathBuf]) -> io::Result<Vec<std::ffi::CString>> {
    cgroups
        .iter()
        .map(|path| std::ffi::CString::new(path.as_os_str().as_encoded_bytes()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in a cgroup path"))
}

/// Starts `command` with `args` in `dir`, with exactly `env`, as its task (`as_task`),
/// on a new terminal of size `tty` or on pipes, its standard input handed back when
/// `stdin` (else `/dev/null`, or with a terminal the terminal nobody writes to).
pub(super) fn spawn_session(
    command: &str,
    args: &[String],
    env: &BTreeMap<String, String>,
    dir: &Path,
    as_task: AsTask<'_>,
    tty: Option<WindowSize>,
    stdin: bool,
) -> io::Result<ExecSession> {
    let AsTask {
        account,
        cgroups,
        oom_score_adj,
    } = as_task;
    let mut builder = command_in(command, args, env, dir);
    builder.kill_on_drop(false);
    let terminal = match tty {
        Some(size) => {
            let pty = super::pty::open(size)?;
            if let Some(account) = account.filter(|_| rustix::process::geteuid().is_root()) {
                // Its own terminal, as a login's is, so it may change its modes.
                rustix::fs::fchown(
                    &pty.far,
                    Some(rustix::process::Uid::from_raw(account.uid)),
                    None,
                )?;
            }
            builder
                .stdin(pty.far.try_clone()?)
                .stdout(pty.far.try_clone()?)
                .stderr(pty.far);
            Some(pty.near)
        }
        None => {
            builder
                .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0);
            None
        }
    };
    prepare_child(
        &mut builder,
        account.cloned(),
        c_paths(cgroups)?,
        oom_score_adj,
        terminal.is_some(),
    );
    let mut child = builder.spawn()?;
    // Our copies of the terminal's far end are gone with `builder`.
    drop(builder);
    let session = match terminal {
        Some(near) => {
            let reader = super::pty::NearEnd::new(near.try_clone()?, Interest::READABLE)?;
            let writer = if stdin {
                let writer: Pin<Box<dyn tokio::io::AsyncWrite + Send>> = Box::pin(
                    super::pty::NearEnd::new(near.try_clone()?, Interest::WRITABLE)?,
                );
                Some(writer)
            } else {
                None
            };
            ExecSession {
                stdin: writer,
                stdout: Box::pin(reader),
                stderr: None,
                terminal: Some(super::pty::Terminal::new(near)),
                process: SessionProcess {
                    group: Group::new(child)?,
                },
            }
        }
        None => {
            let stdout = child
                .stdout
                .take()
                .ok_or_else(|| io::Error::other("no stdout pipe"))?;
            let stderr = child
                .stderr
                .take()
                .ok_or_else(|| io::Error::other("no stderr pipe"))?;
            let stdin = child.stdin.take().map(|stdin| {
                let stdin: Pin<Box<dyn tokio::io::AsyncWrite + Send>> = Box::pin(stdin);
                stdin
            });
            ExecSession {
                stdin,
                stdout: Box::pin(stdout),
                stderr: Some(Box::pin(stderr)),
                terminal: None,
                process: SessionProcess {
                    group: Group::new(child)?,
                },
            }
        }
    };
    Ok(session)
}

/// The process of a session's command. Dropped before it ended, it kills the command's
/// whole process group.
pub struct SessionProcess {
    group: Group,
}

impl std::fmt::Debug for SessionProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionProcess")
            .field("leader", &self.group.leader)
            .finish_non_exhaustive()
    }
}

impl SessionProcess {
    /// Waits for the command to end, kills what is left of its process group, and
    /// returns its exit code (128 + the signal's number when a signal ended it).
    pub async fn wait(&mut self) -> io::Result<i32> {
        use std::os::unix::process::ExitStatusExt;
        if self.group.leader.is_some() {
            // Ended, not yet reaped: its group id is still its own.
            self.group.exited.readable().await?.retain_ready();
            self.group.kill();
        }
        let status = self.group.child.wait().await;
        self.group.reaped();
        let status = status?;
        Ok(status
            .code()
            .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
    }
}

/// Appends what fits under the output limit; the rest is read and dropped, so the
/// command never blocks on a full pipe.
fn keep(kept: &mut Vec<u8>, bytes: &[u8]) {
    let room = EXEC_OUTPUT_LIMIT.saturating_sub(kept.len());
    kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
}

/// The command's process group, killed when dropped before its leader was reaped: a
/// check abandoned mid-run leaves nothing behind.
struct Group {
    child: Child,
    /// Readable once the leader has ended (before it is reaped).
    exited: AsyncFd<OwnedFd>,
    leader: Option<Pid>,
}

impl Group {
    fn new(child: Child) -> io::Result<Self> {
        let leader = child
            .id()
            .and_then(|pid| i32::try_from(pid).ok())
            .and_then(Pid::from_raw)
            .ok_or_else(|| io::Error::other("the command has no process id"))?;
        let exited = rustix::process::pidfd_open(leader, rustix::process::PidfdFlags::empty())?;
        Ok(Group {
            child,
            exited: super::zygote::register(exited, Interest::READABLE)?,
            leader: Some(leader),
        })
    }

    /// SIGKILL to every process of the group.
    fn kill(&self) {
        if let Some(leader) = self.leader {
            let _ = rustix::process::kill_process_group(leader, Signal::KILL);
        }
    }

    /// The leader was reaped: its id may now be anyone's.
    fn reaped(&mut self) {
        self.leader = None;
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.kill();
        // tokio reaps the leader in the background once it is gone.
    }
}

/// Between fork and exec, where only the forking thread exists: with
/// `controlling_terminal`, leads a new session whose controlling terminal is its
/// standard input; joins the task's cgroups (`cgroup.procs` files: the command counts against the task's limits, as a
/// probe inside a container does), asks for SIGKILL when the agent's thread that started
/// it ends (the agent died), and switches to `account` (groups, then group, then user)
/// when the agent may, that is when it runs as root (a non-root agent only ever runs
/// tasks as itself).
#[allow(unsafe_code)]
fn prepare_child(
    builder: &mut tokio::process::Command,
    account: Option<Account>,
    cgroups: Vec<std::ffi::CString>,
    oom_score_adj: Option<i16>,
    controlling_terminal: bool,
) {
    use rustix::process::{Gid, Uid};
    let switch = account
        .filter(|_| rustix::process::geteuid().is_root())
        .map(|account| {
            let groups: Vec<Gid> = account.groups.iter().map(|g| Gid::from_raw(*g)).collect();
            (
                groups,
                Gid::from_raw(account.gid),
                Uid::from_raw(account.uid),
            )
        });
    // SAFETY: the closure runs in the child between fork and exec. It only makes raw
    // system calls (rustix's: no allocation, no lock, nothing another thread of the
    // parent could have held at the fork) on data moved in before the fork.
    unsafe {
        builder.pre_exec(move || {
            if controlling_terminal {
                rustix::process::setsid()?;
                // SAFETY: descriptor 0 is the terminal, set up before this runs.
                let terminal = std::os::fd::BorrowedFd::borrow_raw(0);
                rustix::process::ioctl_tiocsctty(terminal)?;
            }
            stead_supervisor::cgroup::join(&cgroups)?;
            // While still the agent's user: raising it back needs no privilege, but
            // writing the file after the switch may need access the user lacks.
            if let Some(adj) = oom_score_adj {
                stead_supervisor::oom::set_oom_score_adj(adj)?;
            }
            rustix::process::set_parent_process_death_signal(Some(Signal::KILL))?;
            if let Some((groups, gid, uid)) = &switch {
                rustix::thread::set_thread_groups(groups)?;
                rustix::thread::set_thread_res_gid(*gid, *gid, *gid)?;
                rustix::thread::set_thread_res_uid(*uid, *uid, *uid)?;
            }
            Ok(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str, timeout: Duration) -> ExecOutput {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let env = BTreeMap::from([("PATH".to_owned(), "/usr/bin:/bin".to_owned())]);
        runtime
            .block_on(run(
                "/bin/sh",
                &["-c".to_owned(), script.to_owned()],
                &env,
                Path::new("/"),
                AsTask {
                    account: None,
                    cgroups: &[],
                    oom_score_adj: None,
                },
                timeout,
            ))
            .expect("the command runs")
    }

    #[test]
    fn a_command_reports_its_exit_code_and_interleaved_output() {
        let ended = sh("echo out; echo err >&2; exit 3", Duration::from_secs(10));
        assert_eq!(ended.exit_code, Some(3));
        assert!(!ended.timed_out);
        assert_eq!(String::from_utf8_lossy(&ended.output), "out\nerr\n");
    }

    #[test]
    fn output_is_capped_and_a_chatty_command_still_finishes() {
        let ended = sh("head -c 100000 /dev/zero; exit 0", Duration::from_secs(10));
        assert_eq!(ended.exit_code, Some(0));
        assert_eq!(ended.output.len(), EXEC_OUTPUT_LIMIT);
    }

    #[test]
    fn a_command_that_leaves_a_chatty_child_behind_ends_with_it_killed() {
        let nap = unique_nap();
        // `yes` floods the pipe and `sleep` idles; both outlive the shell unless killed.
        let ended = sh(
            &format!("yes & sleep {nap} & echo done; exit 4"),
            Duration::from_secs(10),
        );
        assert_eq!(ended.exit_code, Some(4));
        assert!(!ended.timed_out);
        assert!(ended.output.len() <= EXEC_OUTPUT_LIMIT);
        assert!(
            wait_until_gone(&nap),
            "the check's background child is left"
        );
    }

    /// A duration no other process sleeps (`300.NNNNNNN`), to find a command's processes by.
    fn unique_nap() -> String {
        format!("300.{}", fastrand::u32(1_000_000..10_000_000))
    }

    /// Whether every process whose argument is `arg` is gone within 10 s.
    fn wait_until_gone(arg: &str) -> bool {
        let left = || {
            procfs::process::all_processes()
                .expect("/proc")
                .flatten()
                .filter(|p| p.stat().is_ok_and(|s| s.state != 'Z'))
                .any(|p| p.cmdline().is_ok_and(|args| args.iter().any(|a| a == arg)))
        };
        for _ in 0..1_000 {
            if !left() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        !left()
    }

    #[test]
    fn a_command_past_its_timeout_is_killed_with_its_whole_group() {
        let nap = unique_nap();
        let ended = sh(
            &format!("sleep {nap} & sleep {nap}"),
            Duration::from_millis(300),
        );
        assert!(ended.timed_out);
        assert_eq!(ended.exit_code, None);
        assert!(wait_until_gone(&nap), "processes of the check remain");
    }
}
