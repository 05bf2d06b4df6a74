//! Just enough of `/proc` for the supervisor: a process's state and start time, and the
//! processes below it. (The agent reads the rest of `/proc` through the `procfs` crate;
//! the supervisor keeps its dependencies, and so its memory, small. The agent asks
//! whether a process still exists here too: it asks before every signal it sends.)

use alloc::format;
use alloc::vec::Vec;

use rustix::io::Errno;

use crate::file;

/// The fields of `/proc/<pid>/stat` the supervisor uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// The state letter (`R`, `S`, `Z`, …).
    pub state: u8,
    /// The parent's pid.
    pub ppid: u32,
    /// The start time, in clock ticks since boot.
    pub start_time: u64,
}

/// Parses the text of `/proc/<pid>/stat`.
pub fn parse_stat(text: &str) -> Option<Stat> {
    // The command name is in parentheses and may itself contain spaces and parentheses.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
    // `rest` starts at field 3 (state); starttime is field 22.
    Some(Stat {
        state: *fields.first()?.as_bytes().first()?,
        ppid: fields.get(1)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

/// The stat of process `pid`.
pub fn stat(pid: u32) -> Result<Stat, Errno> {
    let bytes = file::read(format!("/proc/{pid}/stat").as_bytes())?;
    core::str::from_utf8(&bytes)
        .ok()
        .and_then(parse_stat)
        .ok_or(Errno::INVAL)
}

/// The start time of process `pid`, in clock ticks since boot; `None` when it is gone.
pub fn start_time(pid: u32) -> Option<u64> {
    stat(pid).ok().map(|s| s.start_time)
}

/// The children of `pid`, from `/proc/<pid>/task/*/children` (every thread's).
pub fn children(pid: u32) -> Vec<u32> {
    let tasks = format!("/proc/{pid}/task");
    let Ok(threads) = file::list(tasks.as_bytes()) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for thread in threads {
        let mut path = file::join(tasks.as_bytes(), &thread);
        path.extend_from_slice(b"/children");
        if let Ok(bytes) = file::read(&path)
            && let Ok(text) = core::str::from_utf8(&bytes)
        {
            out.extend(
                text.split_ascii_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
    out
}

/// Every process below `pid` (not `pid` itself), parents before their children.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut out = children(pid);
    let mut next = 0;
    while next < out.len() {
        let below = children(out[next]);
        out.extend(below);
        next += 1;
        if out.len() > 1 << 16 {
            break; // a fork bomb: what was found is killed first
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::prelude::rust_2024::*;

    #[test]
    fn stat_parsing_survives_names_with_spaces_and_parentheses() {
        let text = "4242 (my (odd) name) S 17 4242 4242 0 -1 4194560 120 0 0 0 3 4 0 0 20 0 1 0 987654 5623808 300 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
        assert_eq!(
            parse_stat(text),
            Some(Stat {
                state: b'S',
                ppid: 17,
                start_time: 987_654
            })
        );
        assert_eq!(parse_stat("1 (x) S 0"), None);
    }

    #[test]
    fn this_process_has_a_start_time_and_its_child_is_below_it() {
        let me = std::process::id();
        assert!(start_time(me).is_some());
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep runs");
        assert!(descendants(me).contains(&child.id()));
        child.kill().expect("killed");
        child.wait().expect("reaped");
        assert!(!descendants(me).contains(&child.id()));
    }
}
