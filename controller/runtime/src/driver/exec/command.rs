//! Commands run beside a task, as the task: exec health checks.
//!
//! The command starts in its own process group, in the task's dir, with the task's
//! environment, user and groups, its standard input from `/dev/null` and its output and
//! errors on one pipe, of which the first [`EXEC_OUTPUT_LIMIT`] bytes are kept. At its
//! timeout, or when the check is abandoned (its task stopped), the whole group is killed
//! while its leader is not yet reaped, so the group's id cannot belong to anyone else.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use rustix::process::{Pid, Signal};
use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::process::Child;

use super::user::Account;
use crate::driver::{EXEC_OUTPUT_LIMIT, ExecOutput};

/// Runs `command` with `args` in `dir`, with exactly `env`, as `account` (or the
/// agent's own user), for at most `timeout`.
pub(super) async fn run(
    command: &str,
    args: &[String],
    env: &BTreeMap<String, String>,
    dir: &Path,
    account: Option<&Account>,
    timeout: Duration,
) -> io::Result<ExecOutput> {
    let (reader, writer) = std::io::pipe()?;
    let mut builder = tokio::process::Command::new(command);
    builder
        .args(args)
        .env_clear()
        .envs(env)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(writer.try_clone()?)
        .stderr(writer)
        .process_group(0)
        .kill_on_drop(false);
    if let Some(account) = account {
        become_account(&mut builder, account.clone());
    }
    let child = builder.spawn()?;
    // Our copies of the write end are gone with `builder`: the pipe ends when the
    // command's processes close it.
    drop(builder);
    let mut group = Group::new(child);
    let mut output = pipe::Receiver::from_owned_fd(OwnedFd::from(reader))?;
    let mut kept = Vec::new();
    let ran = tokio::time::timeout(timeout, async {
        let mut buf = [0u8; 1024];
        let mut open = true;
        let status = loop {
            tokio::select! {
                status = group.child.wait() => break status,
                read = output.read(&mut buf), if open => match read {
                    Ok(0) | Err(_) => open = false,
                    Ok(n) => keep(&mut kept, &buf[..n]),
                },
            }
        };
        // What it wrote before it exited; a child it left behind holding the pipe is
        // not waited for.
        while open {
            match output.try_read(&mut buf) {
                Ok(0) | Err(_) => open = false,
                Ok(n) => keep(&mut kept, &buf[..n]),
            }
        }
        status
    })
    .await;
    match ran {
        Ok(status) => {
            group.reaped();
            let status = status?;
            Ok(ExecOutput {
                exit_code: status.code(),
                timed_out: false,
                output: kept,
            })
        }
        Err(_elapsed) => {
            group.kill();
            let _ = group.child.wait().await;
            group.reaped();
            Ok(ExecOutput {
                exit_code: None,
                timed_out: true,
                output: kept,
            })
        }
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
    leader: Option<Pid>,
}

impl Group {
    fn new(child: Child) -> Self {
        let leader = child
            .id()
            .and_then(|pid| i32::try_from(pid).ok())
            .and_then(Pid::from_raw);
        Group { child, leader }
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

/// Switches the child to `account` (groups, then group, then user) between fork and
/// exec, where only the forking thread exists.
#[allow(unsafe_code)]
fn become_account(builder: &mut tokio::process::Command, account: Account) {
    use rustix::process::{Gid, Uid};
    let groups: Vec<Gid> = account.groups.iter().map(|g| Gid::from_raw(*g)).collect();
    let gid = Gid::from_raw(account.gid);
    let uid = Uid::from_raw(account.uid);
    // SAFETY: the closure runs in the child between fork and exec. It only makes three
    // raw system calls (rustix's thread functions: no allocation, no lock, nothing that
    // another thread of the parent could have held at the fork) on data moved in
    // before the fork.
    unsafe {
        builder.pre_exec(move || {
            rustix::thread::set_thread_groups(&groups)?;
            rustix::thread::set_thread_res_gid(gid, gid, gid)?;
            rustix::thread::set_thread_res_uid(uid, uid, uid)?;
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
                None,
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
    fn a_command_past_its_timeout_is_killed_with_its_whole_group() {
        // A duration no other process sleeps, to find the check's processes by.
        let nap = format!("300.{}", fastrand::u32(1_000_000..10_000_000));
        let ended = sh(
            &format!("sleep {nap} & sleep {nap}"),
            Duration::from_millis(300),
        );
        assert!(ended.timed_out);
        assert_eq!(ended.exit_code, None);
        let left = || -> Vec<i32> {
            procfs::process::all_processes()
                .expect("/proc")
                .flatten()
                .filter(|p| p.cmdline().is_ok_and(|args| args.iter().any(|a| a == &nap)))
                .map(|p| p.pid)
                .collect()
        };
        // SIGKILL was sent to the group; each of its processes is gone once the kernel
        // has delivered it.
        for _ in 0..1_000 {
            if left().is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(left(), Vec::<i32>::new(), "processes of the check remain");
    }
}
