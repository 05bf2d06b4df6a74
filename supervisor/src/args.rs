//! The supervisor's command line, built by the agent and parsed by the supervisor.
//!
//! ```text
//! stead-supervisor --dir DIR --control DIR --run ID --logs DIR --name TASK --max-files N
//!                  --max-file-size BYTES [--uid UID --gid GID [--groups GID,GID...]]
//!                  [--cgroup PROCS-FILE]... -- COMMAND [ARG]...
//! ```
//!
//! The task's environment is not on the command line: it comes on stdin, as
//! `KEY=VALUE` entries each ended by a NUL byte, or in the fork server's request
//! ([`crate::protocol::encode_request`]).

use alloc::borrow::ToOwned;
use alloc::string::{String, ToString};
use alloc::vec::Vec;

/// Everything the supervisor needs besides the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SupervisorArgs {
    /// The task dir: the supervisor's and the task's working directory. Paths are bytes,
    /// as the kernel takes them.
    pub task_dir: Vec<u8>,
    /// The supervisor's private directory (`<task>/.stead`), where it leaves its records.
    pub control_dir: Vec<u8>,
    /// The id of this run; names the record files. Lowercase hex.
    pub run: String,
    /// The directory of the log files (`<alloc>/alloc/logs`).
    pub log_dir: Vec<u8>,
    /// The task's name: the log files are `<name>.stdout.N` and `<name>.stderr.N`.
    pub name: String,
    /// How many files of each stream are kept; at least 1.
    pub max_files: u32,
    /// The size at which a log file is rotated, in bytes; at least 1.
    pub max_file_size: u64,
    /// The user id to run the task as; `None` keeps the supervisor's.
    pub uid: Option<u32>,
    /// The group id to run the task as; `None` keeps the supervisor's.
    pub gid: Option<u32>,
    /// The supplementary groups the task runs with when it switches user (`uid` set and
    /// the supervisor root), the primary group first as `getgrouplist(3)` lists them;
    /// empty: none. Resolved by the agent: the supervisor looks nothing up.
    pub groups: Vec<u32>,
    /// The `cgroup.procs` files the task joins before it `exec`s, so no instant of it
    /// runs outside its limits: one per hierarchy it belongs to (cgroup v2 has one; v1
    /// one per controller). Empty: it stays in the supervisor's cgroups.
    pub cgroups: Vec<Vec<u8>>,
    /// The program: a path (relative to the task dir) or a name looked up in the task's `PATH`.
    pub command: Vec<u8>,
    /// The program's arguments.
    pub args: Vec<Vec<u8>>,
}

/// A command line the supervisor cannot use.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ArgsError {
    /// A flag without its value.
    #[error("flag {flag} needs a value")]
    MissingValue {
        /// The flag.
        flag: String,
    },
    /// A flag that is not one of the supervisor's.
    #[error("unknown flag {flag:?}")]
    UnknownFlag {
        /// The flag as given.
        flag: String,
    },
    /// A flag's value is malformed.
    #[error("flag {flag} has an invalid value {value:?}")]
    InvalidValue {
        /// The flag.
        flag: String,
        /// The value as given.
        value: String,
    },
    /// A required flag is missing.
    #[error("flag {flag} is required")]
    Missing {
        /// The flag.
        flag: &'static str,
    },
    /// Nothing to run after `--`.
    #[error("no command after --")]
    NoCommand,
}

impl SupervisorArgs {
    /// The command line, without the program name.
    pub fn to_args(&self) -> Vec<Vec<u8>> {
        let mut out: Vec<Vec<u8>> = Vec::with_capacity(20 + self.args.len());
        let mut flag = |name: &str, value: Vec<u8>| {
            out.push(name.into());
            out.push(value);
        };
        flag("--dir", self.task_dir.clone());
        flag("--control", self.control_dir.clone());
        flag("--run", self.run.clone().into());
        flag("--logs", self.log_dir.clone());
        flag("--name", self.name.clone().into());
        flag("--max-files", self.max_files.to_string().into());
        flag("--max-file-size", self.max_file_size.to_string().into());
        if let Some(uid) = self.uid {
            flag("--uid", uid.to_string().into());
        }
        if let Some(gid) = self.gid {
            flag("--gid", gid.to_string().into());
        }
        if !self.groups.is_empty() {
            let groups: Vec<String> = self.groups.iter().map(u32::to_string).collect();
            flag("--groups", groups.join(",").into());
        }
        for procs in &self.cgroups {
            flag("--cgroup", procs.clone());
        }
        out.push("--".into());
        out.push(self.command.clone());
        out.extend(self.args.iter().cloned());
        out
    }

    /// Parses a command line (without the program name).
    pub fn parse(args: impl IntoIterator<Item = Vec<u8>>) -> Result<Self, ArgsError> {
        let mut args = args.into_iter();
        let mut task_dir = None;
        let mut control_dir = None;
        let mut run = None;
        let mut log_dir = None;
        let mut name = None;
        let mut max_files = None;
        let mut max_file_size = None;
        let mut uid = None;
        let mut gid = None;
        let mut groups = Vec::new();
        let mut cgroups = Vec::new();
        loop {
            let Some(flag) = args.next() else {
                return Err(ArgsError::NoCommand);
            };
            if flag == b"--" {
                break;
            }
            let flag = String::from_utf8_lossy(&flag).into_owned();
            let value = args
                .next()
                .ok_or_else(|| ArgsError::MissingValue { flag: flag.clone() })?;
            match flag.as_str() {
                "--dir" => task_dir = Some(value),
                "--control" => control_dir = Some(value),
                "--run" => run = Some(text(&flag, &value, is_run_id)?),
                "--logs" => log_dir = Some(value),
                "--name" => name = Some(text(&flag, &value, is_log_name)?),
                "--max-files" => max_files = Some(number::<u32>(&flag, &value)?),
                "--max-file-size" => max_file_size = Some(number::<u64>(&flag, &value)?),
                "--uid" => uid = Some(number::<u32>(&flag, &value)?),
                "--gid" => gid = Some(number::<u32>(&flag, &value)?),
                "--groups" => groups = group_list(&flag, &value)?,
                "--cgroup" if value.starts_with(b"/") && !value.contains(&0) => {
                    cgroups.push(value);
                }
                "--cgroup" => return Err(invalid(&flag, &value)),
                _ => return Err(ArgsError::UnknownFlag { flag }),
            }
        }
        let command = args.next().ok_or(ArgsError::NoCommand)?;
        let positive = |flag: &str, value: u64| {
            if value == 0 {
                Err(ArgsError::InvalidValue {
                    flag: flag.to_owned(),
                    value: "0".to_owned(),
                })
            } else {
                Ok(value)
            }
        };
        let max_files = max_files.ok_or(ArgsError::Missing {
            flag: "--max-files",
        })?;
        positive("--max-files", u64::from(max_files))?;
        let max_file_size = max_file_size.ok_or(ArgsError::Missing {
            flag: "--max-file-size",
        })?;
        positive("--max-file-size", max_file_size)?;
        Ok(SupervisorArgs {
            task_dir: task_dir.ok_or(ArgsError::Missing { flag: "--dir" })?,
            control_dir: control_dir.ok_or(ArgsError::Missing { flag: "--control" })?,
            run: run.ok_or(ArgsError::Missing { flag: "--run" })?,
            log_dir: log_dir.ok_or(ArgsError::Missing { flag: "--logs" })?,
            name: name.ok_or(ArgsError::Missing { flag: "--name" })?,
            max_files,
            max_file_size,
            uid,
            gid,
            groups,
            cgroups,
            command,
            args: args.collect(),
        })
    }
}

/// Whether `s` can be a run id: 1 to 64 lowercase hex digits (it names files).
pub fn is_run_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Whether `s` can prefix a log file name: letters, digits, `-`, `_`, not starting with `.`.
fn is_log_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// `value` as text, when it is UTF-8.
fn utf8(value: &[u8]) -> Option<&str> {
    core::str::from_utf8(value).ok()
}

fn invalid(flag: &str, value: &[u8]) -> ArgsError {
    ArgsError::InvalidValue {
        flag: flag.to_owned(),
        value: String::from_utf8_lossy(value).into_owned(),
    }
}

fn text(flag: &str, value: &[u8], valid: fn(&str) -> bool) -> Result<String, ArgsError> {
    match utf8(value) {
        Some(s) if valid(s) => Ok(s.to_owned()),
        _ => Err(invalid(flag, value)),
    }
}

/// At most this many supplementary groups: Linux's `NGROUPS_MAX`.
const MAX_GROUPS: usize = 65_536;

/// A comma-separated list of group ids; empty for an empty value.
fn group_list(flag: &str, value: &[u8]) -> Result<Vec<u32>, ArgsError> {
    let invalid = || invalid(flag, value);
    let text = utf8(value).ok_or_else(invalid)?;
    if text.is_empty() {
        return Ok(Vec::new());
    }
    let groups = text
        .split(',')
        .map(|id| id.parse::<u32>().map_err(|_| invalid()))
        .collect::<Result<Vec<u32>, ArgsError>>()?;
    if groups.len() > MAX_GROUPS {
        return Err(invalid());
    }
    Ok(groups)
}

fn number<T: core::str::FromStr>(flag: &str, value: &[u8]) -> Result<T, ArgsError> {
    utf8(value)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| invalid(flag, value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;
    use std::prelude::rust_2024::*;

    fn sample() -> SupervisorArgs {
        SupervisorArgs {
            task_dir: "/data/allocs/web-1234abcd/server".into(),
            control_dir: "/data/allocs/web-1234abcd/server/.stead".into(),
            run: "00ff".to_owned(),
            log_dir: "/data/allocs/web-1234abcd/alloc/logs".into(),
            name: "server".to_owned(),
            max_files: 3,
            max_file_size: 1 << 20,
            uid: Some(65534),
            gid: Some(65534),
            groups: vec![65534, 44, 109],
            cgroups: vec![
                "/sys/fs/cgroup/memory/stead/web-1234abcd/server/cgroup.procs".into(),
                "/sys/fs/cgroup/pids/stead/web-1234abcd/server/cgroup.procs".into(),
            ],
            command: "/bin/sh".into(),
            args: vec!["-c".into(), "echo --run".into()],
        }
    }

    #[test]
    fn a_command_line_round_trips() {
        let args = sample();
        assert_eq!(SupervisorArgs::parse(args.to_args()), Ok(args.clone()));
        let without_user = SupervisorArgs {
            uid: None,
            gid: None,
            groups: Vec::new(),
            cgroups: Vec::new(),
            ..args
        };
        assert_eq!(
            SupervisorArgs::parse(without_user.to_args()),
            Ok(without_user)
        );
    }

    #[test]
    fn supplementary_groups_are_a_comma_separated_list_of_ids() {
        let line = sample().to_args();
        let at = line
            .iter()
            .position(|arg| arg == b"--groups")
            .expect("a --groups flag");
        assert_eq!(line[at + 1], b"65534,44,109");
        let parse = |groups: &str| {
            SupervisorArgs::parse(
                [
                    "--groups",
                    groups,
                    "--max-files",
                    "1",
                    "--max-file-size",
                    "1",
                ]
                .into_iter()
                .chain(["--dir", "/t", "--control", "/t/.stead", "--run", "ab"])
                .chain(["--logs", "/l", "--name", "t", "--", "true"])
                .map(|arg| arg.as_bytes().to_vec()),
            )
            .map(|args| args.groups)
        };
        assert_eq!(parse("7"), Ok(vec![7]));
        assert_eq!(parse(""), Ok(vec![]));
        for bad in ["1,,2", "1,", "x", "-1", "1 2", "4294967296"] {
            assert_eq!(
                parse(bad),
                Err(ArgsError::InvalidValue {
                    flag: "--groups".into(),
                    value: bad.into()
                }),
                "{bad}"
            );
        }
        let too_many = vec!["0"; MAX_GROUPS + 1].join(",");
        assert!(matches!(
            parse(&too_many),
            Err(ArgsError::InvalidValue { .. })
        ));
    }

    #[test]
    fn malformed_command_lines_are_refused_with_the_flag() {
        let parse =
            |args: &[&str]| SupervisorArgs::parse(args.iter().map(|arg| arg.as_bytes().to_vec()));
        assert_eq!(
            parse(&["--run"]),
            Err(ArgsError::MissingValue {
                flag: "--run".into()
            })
        );
        assert_eq!(
            parse(&["--run", "../x", "--", "true"]),
            Err(ArgsError::InvalidValue {
                flag: "--run".into(),
                value: "../x".into()
            })
        );
        assert_eq!(
            parse(&["--bogus", "1", "--", "true"]),
            Err(ArgsError::UnknownFlag {
                flag: "--bogus".into()
            })
        );
        assert_eq!(
            parse(&["--cgroup", "stead/web/cgroup.procs", "--", "true"]),
            Err(ArgsError::InvalidValue {
                flag: "--cgroup".into(),
                value: "stead/web/cgroup.procs".into()
            })
        );
        let mut line = sample().to_args();
        line.truncate(line.len() - 3);
        assert_eq!(SupervisorArgs::parse(line), Err(ArgsError::NoCommand));
        let mut zero = sample();
        zero.max_files = 0;
        assert!(matches!(
            SupervisorArgs::parse(zero.to_args()),
            Err(ArgsError::InvalidValue { .. })
        ));
    }
}
