//! What the supervisor tells the agent: lines on its stdout, and record files in its
//! control dir for an agent that was not there to hear.
//!
//! Lines (each ends with `\n`):
//! - `started <task-pid> <task-start> <supervisor-pid> <supervisor-start>`: the task runs
//!   (start times in clock ticks since boot, field 22 of `/proc/<pid>/stat`);
//! - `failed <0|1> <message>`: the task did not start; `1` when a retry may work;
//! - `exited <code> <signal|->`: the task ended and everything it left was killed.
//!
//! Files in the control dir (`<task>/.stead`), named by the run id:
//! - `<run>.run`: `stead-run 1`, `supervisor <pid> <start>`, `task <pid> <start>`; written
//!   when the task started, so an agent that died before it learnt the run can still find
//!   and stop it;
//! - `<run>.exit`: `stead-exit 1`, `code <code>`, `signal <signal|->`; written after
//!   the task ended, atomically (a rename), and synced to the disk (fsync of the file and
//!   the directory) when no agent heard the `exited` line: an agent that heard it keeps
//!   the exit in its own store, and the sync (~12 ms here) stays off the restart path.

use alloc::borrow::ToOwned;
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;

use rustix::fs::OFlags;
use rustix::io::Errno;

use crate::args::{ArgsError, SupervisorArgs};
use crate::file;

/// How a task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExitStatus {
    /// The exit code; by convention 128 + n when signal n killed the task.
    pub code: i32,
    /// The signal that killed the task, if one did.
    pub signal: Option<i32>,
}

/// One line of the supervisor's report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// The task runs.
    Started {
        /// The task's pid (also its process group and session id).
        task_pid: u32,
        /// The task's start time, in clock ticks since boot.
        task_start: u64,
        /// The supervisor's pid.
        supervisor_pid: u32,
        /// The supervisor's start time, in clock ticks since boot.
        supervisor_start: u64,
    },
    /// The task did not start.
    Failed {
        /// Whether trying again may work.
        recoverable: bool,
        /// Why, on one line.
        message: String,
    },
    /// The task ended.
    Exited(ExitStatus),
}

/// A line or file that does not follow the protocol.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("malformed supervisor {what}: {text:?}")]
pub struct ProtocolError {
    /// What was being read (`report line`, `exit record`, `run record`).
    pub what: &'static str,
    /// The offending text (at most 200 bytes of it).
    pub text: String,
}

fn malformed(what: &'static str, text: &str) -> ProtocolError {
    let mut end = text.len().min(200);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    ProtocolError {
        what,
        text: text[..end].to_owned(),
    }
}

fn signal_text(signal: Option<i32>) -> String {
    signal.map_or_else(|| "-".to_owned(), |s| s.to_string())
}

fn parse_signal(text: &str) -> Option<Option<i32>> {
    if text == "-" {
        Some(None)
    } else {
        text.parse().ok().map(Some)
    }
}

impl Report {
    /// The line, with its `\n`.
    pub fn to_line(&self) -> String {
        match self {
            Report::Started {
                task_pid,
                task_start,
                supervisor_pid,
                supervisor_start,
            } => format!("started {task_pid} {task_start} {supervisor_pid} {supervisor_start}\n"),
            Report::Failed {
                recoverable,
                message,
            } => {
                let message = message.replace(['\n', '\r'], " ");
                format!("failed {} {message}\n", u8::from(*recoverable))
            }
            Report::Exited(status) => {
                format!("exited {} {}\n", status.code, signal_text(status.signal))
            }
        }
    }

    /// Parses one line (with or without its `\n`).
    pub fn parse(line: &str) -> Result<Report, ProtocolError> {
        let line = line.strip_suffix('\n').unwrap_or(line);
        let bad = || malformed("report line", line);
        let (kind, rest) = line.split_once(' ').ok_or_else(bad)?;
        match kind {
            "started" => {
                let mut fields = rest.split(' ').map(str::parse::<u64>);
                let mut next = || fields.next().and_then(Result::ok).ok_or_else(bad);
                let task_pid = u32::try_from(next()?).map_err(|_| bad())?;
                let task_start = next()?;
                let supervisor_pid = u32::try_from(next()?).map_err(|_| bad())?;
                let supervisor_start = next()?;
                Ok(Report::Started {
                    task_pid,
                    task_start,
                    supervisor_pid,
                    supervisor_start,
                })
            }
            "failed" => {
                let (recoverable, message) = rest.split_once(' ').unwrap_or((rest, ""));
                let recoverable = match recoverable {
                    "0" => false,
                    "1" => true,
                    _ => return Err(bad()),
                };
                Ok(Report::Failed {
                    recoverable,
                    message: message.to_owned(),
                })
            }
            "exited" => {
                let (code, signal) = rest.split_once(' ').ok_or_else(bad)?;
                Ok(Report::Exited(ExitStatus {
                    code: code.parse().map_err(|_| bad())?,
                    signal: parse_signal(signal).ok_or_else(bad)?,
                }))
            }
            _ => Err(bad()),
        }
    }
}

/// The supervisor of a run and its task, as `<run>.run` records them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunRecord {
    /// The supervisor's pid.
    pub supervisor_pid: u32,
    /// The supervisor's start time, in clock ticks since boot.
    pub supervisor_start: u64,
    /// The task's pid.
    pub task_pid: u32,
    /// The task's start time, in clock ticks since boot.
    pub task_start: u64,
}

/// The file name of the exit record of `run`.
fn exit_record_name(run: &str) -> String {
    format!("{run}.exit")
}

/// The file name of the run record of `run`.
fn run_record_name(run: &str) -> String {
    format!("{run}.run")
}

/// Writes `contents` to `path` through a temporary file and a rename, so readers see the
/// whole file or none; with `durable`, the data and the rename reach the disk first.
fn write_atomically(dir: &[u8], name: &str, contents: &str, durable: bool) -> Result<(), Errno> {
    let path = file::join(dir, name.as_bytes());
    let mut tmp = path.clone();
    tmp.extend_from_slice(b".tmp");
    let out = file::open(&tmp, OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC, 0o666)?;
    file::write_all(&out, contents.as_bytes())?;
    if durable {
        rustix::fs::fdatasync(&out)?;
    }
    drop(out);
    rustix::fs::rename(&tmp, &path)?;
    if durable {
        rustix::fs::fsync(file::open(dir, OFlags::RDONLY | OFlags::DIRECTORY, 0)?)?;
    }
    Ok(())
}

/// Records how run `run` ended; with `durable`, synced to the disk before returning.
pub fn write_exit_record(
    control_dir: &[u8],
    run: &str,
    status: ExitStatus,
    durable: bool,
) -> Result<(), Errno> {
    let text = format!(
        "stead-exit 1\ncode {}\nsignal {}\n",
        status.code,
        signal_text(status.signal)
    );
    write_atomically(control_dir, &exit_record_name(run), &text, durable)
}

/// Records which processes run `run`. Neither synced nor renamed into place: it only
/// matters while the machine is up, and a reader that finds it half-written (a crash
/// within one small `write`) skips it as malformed.
pub fn write_run_record(control_dir: &[u8], run: &str, record: RunRecord) -> Result<(), Errno> {
    let text = format!(
        "stead-run 1\nsupervisor {} {}\ntask {} {}\n",
        record.supervisor_pid, record.supervisor_start, record.task_pid, record.task_start
    );
    let path = file::join(control_dir, run_record_name(run).as_bytes());
    let out = file::open(
        &path,
        OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC,
        0o666,
    )?;
    file::write_all(out, text.as_bytes())
}

/// The lines of a record after its header, as `(key, value)`.
fn record_fields<'a>(
    text: &'a str,
    header: &str,
    what: &'static str,
) -> Result<Vec<(&'a str, &'a str)>, ProtocolError> {
    let mut lines = text.lines();
    if lines.next() != Some(header) {
        return Err(malformed(what, text));
    }
    lines
        .map(|line| line.split_once(' ').ok_or_else(|| malformed(what, text)))
        .collect()
}

/// Parses the text of an exit record.
pub fn parse_exit_record(text: &str) -> Result<ExitStatus, ProtocolError> {
    let what = "exit record";
    let bad = || malformed(what, text);
    let fields = record_fields(text, "stead-exit 1", what)?;
    let field = |key: &str| fields.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
    Ok(ExitStatus {
        code: field("code").and_then(|v| v.parse().ok()).ok_or_else(bad)?,
        signal: field("signal").and_then(parse_signal).ok_or_else(bad)?,
    })
}

/// Parses the text of a run record.
pub fn parse_run_record(text: &str) -> Result<RunRecord, ProtocolError> {
    let what = "run record";
    let bad = || malformed(what, text);
    let fields = record_fields(text, "stead-run 1", what)?;
    let pair = |key: &str| -> Result<(u32, u64), ProtocolError> {
        let value = fields
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
            .ok_or_else(bad)?;
        let (pid, start) = value.split_once(' ').ok_or_else(bad)?;
        Ok((
            pid.parse().map_err(|_| bad())?,
            start.parse().map_err(|_| bad())?,
        ))
    };
    let (supervisor_pid, supervisor_start) = pair("supervisor")?;
    let (task_pid, task_start) = pair("task")?;
    Ok(RunRecord {
        supervisor_pid,
        supervisor_start,
        task_pid,
        task_start,
    })
}

/// The agent's side: the records read through `std::path`.
#[cfg(any(test, feature = "std"))]
mod read {
    use std::fs;
    use std::io;
    use std::path::{Path, PathBuf};

    use alloc::borrow::ToOwned;
    use alloc::string::String;
    use alloc::vec::Vec;

    use super::{ExitStatus, ProtocolError, RunRecord, exit_record_name, parse_exit_record};
    use super::{parse_run_record, run_record_name};

    /// The path of the exit record of `run`.
    pub fn exit_record_path(control_dir: &Path, run: &str) -> PathBuf {
        control_dir.join(exit_record_name(run))
    }

    /// The path of the run record of `run`.
    pub fn run_record_path(control_dir: &Path, run: &str) -> PathBuf {
        control_dir.join(run_record_name(run))
    }

    /// A record file that could not be read.
    #[derive(Debug, thiserror::Error)]
    pub enum RecordError {
        /// Reading the file failed.
        #[error("reading {}", path.display())]
        Read {
            /// The file.
            path: PathBuf,
            /// Why.
            #[source]
            source: io::Error,
        },
        /// The file does not follow the protocol.
        #[error("reading {}", path.display())]
        Malformed {
            /// The file.
            path: PathBuf,
            /// What is wrong.
            #[source]
            source: ProtocolError,
        },
    }

    /// The exit record of `run`; `None` while the run has not ended (or never started).
    pub fn read_exit_record(
        control_dir: &Path,
        run: &str,
    ) -> Result<Option<ExitStatus>, RecordError> {
        let path = exit_record_path(control_dir, run);
        match fs::read_to_string(&path) {
            Ok(text) => parse_exit_record(&text)
                .map(Some)
                .map_err(|source| RecordError::Malformed { path, source }),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(RecordError::Read { path, source }),
        }
    }

    /// The run records in `control_dir` of the runs `wanted` takes, by run id; unreadable
    /// ones are skipped. A run not wanted costs its name only: its file is not read.
    pub fn read_run_records(
        control_dir: &Path,
        wanted: impl Fn(&str) -> bool,
    ) -> Vec<(String, RunRecord)> {
        let Ok(entries) = fs::read_dir(control_dir) else {
            return Vec::new();
        };
        entries
            .filter_map(Result::ok)
            .filter_map(|entry| {
                let name = entry.file_name();
                let run = name.to_str()?.strip_suffix(".run")?;
                if !crate::args::is_run_id(run) || !wanted(run) {
                    return None;
                }
                let text = fs::read_to_string(entry.path()).ok()?;
                Some((run.to_owned(), parse_run_record(&text).ok()?))
            })
            .collect()
    }
}

#[cfg(any(test, feature = "std"))]
pub use read::{
    RecordError, exit_record_path, read_exit_record, read_run_records, run_record_path,
};

/// The task's environment: its `KEY=VALUE` entries, each ended by a NUL byte, in one
/// buffer, as `execve` takes them. One allocation however many entries: a supervisor
/// gives a large environment back whole once its task started, where an allocation per
/// key and value would leave holes in its heap for as long as the task runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Environment {
    bytes: Vec<u8>,
}

impl Environment {
    /// The entries given, without their NUL bytes; an entry without `=` (or with a NUL
    /// byte in it) is left out.
    ///
    /// The buffer is allocated once, at its final size (the entries are walked twice):
    /// grown by doubling, each of its smaller sizes would be a block of the heap, which
    /// keeps its pages, with the environment's first part in them.
    pub fn from_entries<'a, I>(entries: I) -> Environment
    where
        I: IntoIterator<Item = &'a [u8]>,
        I::IntoIter: Clone,
    {
        let kept = |entry: &&[u8]| entry.contains(&b'=') && !entry.contains(&0);
        let entries = entries.into_iter();
        let size = entries
            .clone()
            .filter(kept)
            .map(|entry| entry.len() + 1)
            .sum();
        let mut bytes = Vec::with_capacity(size);
        for entry in entries.filter(kept) {
            bytes.extend_from_slice(entry);
            bytes.push(0);
        }
        Environment { bytes }
    }

    /// The entries, `KEY=VALUE`, without their NUL bytes.
    pub fn entries(&self) -> impl Iterator<Item = &[u8]> {
        self.bytes
            .split(|b| *b == 0)
            .take_while(|entry| !entry.is_empty())
    }

    /// Where each entry starts in [`Environment::as_bytes`].
    pub(crate) fn offsets(&self) -> impl Iterator<Item = usize> {
        self.entries().scan(0, |at, entry| {
            let start = *at;
            *at += entry.len() + 1;
            Some(start)
        })
    }

    /// The entries, each ended by its NUL byte.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The value of `key`: the first entry's, as `getenv` finds it.
    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.entries().find_map(|entry| {
            entry
                .strip_prefix(key)
                .and_then(|rest| rest.strip_prefix(b"="))
        })
    }
}

/// A request to the fork server that cannot be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestError {
    /// The request does not follow the format.
    #[error("malformed start request")]
    Malformed,
    /// Its command line is not the supervisor's.
    #[error("invalid command line in the start request")]
    Args(#[source] ArgsError),
}

/// A start request for the fork server (`stead-supervisor --zygote`): the number of
/// arguments, the supervisor's arguments, then the task's `KEY=VALUE` environment,
/// each field ended by a NUL byte. (It travels in one `SOCK_SEQPACKET` message, with
/// the write end of the pipe the supervisor reports on.)
pub fn encode_request<'a>(
    args: &SupervisorArgs,
    environment: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Vec<u8> {
    let argv = args.to_args();
    let mut out = Vec::with_capacity(4096);
    out.extend_from_slice(argv.len().to_string().as_bytes());
    out.push(0);
    for arg in &argv {
        out.extend_from_slice(arg);
        out.push(0);
    }
    for (key, value) in environment {
        out.extend_from_slice(key.as_bytes());
        out.push(b'=');
        out.extend_from_slice(value.as_bytes());
        out.push(0);
    }
    out
}

/// Reads a request written by [`encode_request`].
pub fn decode_request(bytes: &[u8]) -> Result<(SupervisorArgs, Environment), RequestError> {
    let body = bytes.strip_suffix(b"\0").ok_or(RequestError::Malformed)?;
    let mut fields = body.split(|b| *b == 0);
    let count: usize = fields
        .next()
        .and_then(|f| core::str::from_utf8(f).ok()?.parse().ok())
        .ok_or(RequestError::Malformed)?;
    let mut argv = Vec::with_capacity(count);
    for _ in 0..count {
        let arg = fields.next().ok_or(RequestError::Malformed)?;
        argv.push(arg.to_vec());
    }
    let args = SupervisorArgs::parse(argv).map_err(RequestError::Args)?;
    Ok((args, Environment::from_entries(fields)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::ffi::OsStrExt;
    use std::prelude::rust_2024::*;

    #[test]
    fn report_lines_round_trip() {
        for report in [
            Report::Started {
                task_pid: 4242,
                task_start: 123_456,
                supervisor_pid: 4241,
                supervisor_start: 123_455,
            },
            Report::Failed {
                recoverable: false,
                message: "no such file: /bin/nope".to_owned(),
            },
            Report::Exited(ExitStatus {
                code: 137,
                signal: Some(9),
            }),
            Report::Exited(ExitStatus {
                code: 3,
                signal: None,
            }),
        ] {
            assert_eq!(Report::parse(&report.to_line()), Ok(report));
        }
        assert_eq!(
            Report::Failed {
                recoverable: true,
                message: "two\nlines".to_owned()
            }
            .to_line(),
            "failed 1 two lines\n"
        );
        assert!(Report::parse("started 1 2 3").is_err());
        assert!(Report::parse("bogus 1").is_err());
    }

    #[test]
    fn records_round_trip_through_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(read_exit_record(dir.path(), "ab").expect("readable"), None);
        let status = ExitStatus {
            code: 130,
            signal: None,
        };
        write_exit_record(dir.path().as_os_str().as_bytes(), "ab", status, true).expect("written");
        assert_eq!(
            read_exit_record(dir.path(), "ab").expect("readable"),
            Some(status)
        );
        let run = RunRecord {
            supervisor_pid: 10,
            supervisor_start: 20,
            task_pid: 11,
            task_start: 21,
        };
        write_run_record(dir.path().as_os_str().as_bytes(), "cd", run).expect("written");
        fs::write(dir.path().join("zz.run"), "garbage").expect("written");
        write_run_record(dir.path().as_os_str().as_bytes(), "ce", run).expect("written");
        assert_eq!(
            read_run_records(dir.path(), |run| run != "ce"),
            [("cd".to_owned(), run)]
        );
        assert_eq!(read_run_records(dir.path(), |_| true).len(), 2);
        fs::write(exit_record_path(dir.path(), "ef"), "stead-exit 1\ncode x\n").expect("written");
        assert!(matches!(
            read_exit_record(dir.path(), "ef"),
            Err(RecordError::Malformed { .. })
        ));
    }

    #[test]
    fn start_requests_round_trip_with_ids_groups_empty_arguments_and_environment_values() {
        let args = SupervisorArgs {
            task_dir: "/d/t".into(),
            control_dir: "/d/t/.stead".into(),
            run: "ab".to_owned(),
            log_dir: "/d/alloc/logs".into(),
            name: "t".to_owned(),
            max_files: 2,
            max_file_size: 10,
            uid: Some(1000),
            gid: Some(100),
            groups: vec![100, 27, 4_000_000_000],
            cgroups: vec!["/sys/fs/cgroup/stead/a/t/cgroup.procs".into()],
            command: "echo".into(),
            args: vec!["".into(), "x=y".into()],
        };
        let bytes = encode_request(&args, [("A", "1"), ("EMPTY", ""), ("B", "x=y")]);
        let (decoded, environment) = decode_request(&bytes).expect("decodes");
        assert_eq!(decoded, args);
        let entries: Vec<&[u8]> = environment.entries().collect();
        assert_eq!(entries, [&b"A=1"[..], b"EMPTY=", b"B=x=y"]);
        assert_eq!(environment.get(b"B"), Some(&b"x=y"[..]));
        assert_eq!(environment.get(b"EMPTY"), Some(&b""[..]));
        assert_eq!(environment.get(b"C"), None);
        assert_eq!(environment.as_bytes(), b"A=1\0EMPTY=\0B=x=y\0");
        assert_eq!(environment.offsets().collect::<Vec<_>>(), [0, 4, 11]);
        assert_eq!(decode_request(b"3\0a\0"), Err(RequestError::Malformed));
        assert_eq!(decode_request(b""), Err(RequestError::Malformed));
    }
}
