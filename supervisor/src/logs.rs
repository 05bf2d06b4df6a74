//! Rotating log files: `<dir>/<task>.stdout.<N>` and `<dir>/<task>.stderr.<N>`.
//!
//! The highest `N` is the file being written; at most `max_files` files of a stream are
//! kept, the oldest deleted first. A file is rotated at the last line end before
//! `max_file_size`, so files begin and end on line boundaries. A line that does not fit
//! starts the next file; a line already begun in a file (its start was written before its
//! end arrived) is finished in that file, which may then exceed `max_file_size` by up to
//! [`LINE_SLACK`]. Only a line longer than that is split. A restarted task appends to
//! the newest file.

use alloc::borrow::ToOwned;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use rustix::fd::OwnedFd;
use rustix::fs::OFlags;
use rustix::io::Errno;

use crate::file;

/// How far a file may grow past its limit to finish a line begun in it.
pub const LINE_SLACK: u64 = 64 * 1024;

/// Which output of the task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

impl Stream {
    /// `stdout` or `stderr`, as in the file names.
    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// The name of log file `index` of `task`'s `stream`: `<task>.<stream>.<index>`.
pub fn file_name(task: &str, stream: Stream, index: u64) -> String {
    format!("{task}.{}.{index}", stream.as_str())
}

/// The indices of `task`'s `stream` files in `dir`, ascending; empty when there are none.
pub fn indices(dir: &[u8], task: &str, stream: Stream) -> Result<Vec<u64>, Errno> {
    let prefix = format!("{task}.{}.", stream.as_str());
    let mut found: Vec<u64> = match file::list(dir) {
        Ok(names) => names
            .iter()
            .filter_map(|name| {
                let index = core::str::from_utf8(name).ok()?.strip_prefix(&prefix)?;
                // Only canonical numbers: `01` is not a log file of ours.
                if index.len() > 1 && index.starts_with('0') {
                    return None;
                }
                index.parse().ok()
            })
            .collect(),
        Err(Errno::NOENT) => Vec::new(),
        Err(error) => return Err(error),
    };
    found.sort_unstable();
    Ok(found)
}

/// The writer of one stream's files.
#[derive(Debug)]
pub struct Rotator {
    dir: Vec<u8>,
    task: String,
    stream: Stream,
    max_files: u64,
    max_size: u64,
    index: u64,
    file: OwnedFd,
    size: u64,
    /// Whether the file ends at a line boundary (it is empty or its last byte is `\n`).
    at_line_start: bool,
}

impl Rotator {
    /// Opens the newest file of `task`'s `stream` in `dir` for appending (creating file 0
    /// when there is none), and deletes files beyond `max_files`.
    pub fn open(
        dir: &[u8],
        task: &str,
        stream: Stream,
        max_files: u32,
        max_size: u64,
    ) -> Result<Rotator, Errno> {
        let existing = indices(dir, task, stream)?;
        let index = existing.last().copied().unwrap_or(0);
        let path = file::join(dir, file_name(task, stream, index).as_bytes());
        let file = file::open(&path, OFlags::CREATE | OFlags::RDWR | OFlags::APPEND, 0o640)?;
        let size = rustix::fs::fstat(&file)?.st_size.unsigned_abs();
        let at_line_start = size == 0 || {
            let mut last = [0u8];
            if rustix::io::pread(&file, &mut last, size - 1)? != 1 {
                return Err(Errno::IO);
            }
            last[0] == b'\n'
        };
        let rotator = Rotator {
            dir: dir.to_vec(),
            task: task.to_owned(),
            stream,
            max_files: u64::from(max_files.max(1)),
            max_size: max_size.max(1),
            index,
            file,
            size,
            at_line_start,
        };
        for old in existing {
            if old + rotator.max_files <= index {
                rotator.remove(old);
            }
        }
        Ok(rotator)
    }

    /// The index of the file being written.
    pub fn index(&self) -> u64 {
        self.index
    }

    fn remove(&self, index: u64) {
        // A file already gone (removed by hand) is what we wanted.
        let path = file::join(
            &self.dir,
            file_name(&self.task, self.stream, index).as_bytes(),
        );
        let _ = rustix::fs::unlink(path);
    }

    fn append(&mut self, data: &[u8]) -> Result<(), Errno> {
        file::write_all(&self.file, data)?;
        self.size += data.len() as u64;
        if let Some(last) = data.last() {
            self.at_line_start = *last == b'\n';
        }
        Ok(())
    }

    fn rotate(&mut self) -> Result<(), Errno> {
        let index = self.index + 1;
        let path = file::join(
            &self.dir,
            file_name(&self.task, self.stream, index).as_bytes(),
        );
        self.file = file::open(
            &path,
            OFlags::CREATE | OFlags::WRONLY | OFlags::TRUNC,
            0o640,
        )?;
        self.index = index;
        self.size = 0;
        self.at_line_start = true;
        if let Some(old) = index.checked_sub(self.max_files) {
            self.remove(old);
        }
        Ok(())
    }

    /// Writes `data`, rotating as the module documentation describes.
    pub fn write(&mut self, mut data: &[u8]) -> Result<(), Errno> {
        while !data.is_empty() {
            let room =
                usize::try_from(self.max_size.saturating_sub(self.size)).unwrap_or(usize::MAX);
            if data.len() <= room {
                return self.append(data);
            }
            if let Some(end) = data[..room].iter().rposition(|b| *b == b'\n') {
                self.append(&data[..=end])?;
                data = &data[end + 1..];
                self.rotate()?;
                continue;
            }
            if self.at_line_start && self.size > 0 {
                // The next line does not fit: it starts the next file.
                self.rotate()?;
                continue;
            }
            // A line begun in this file (or longer than a whole file): finish it here if
            // it ends within the slack, split it at the slack otherwise.
            let limit = usize::try_from((self.max_size + LINE_SLACK).saturating_sub(self.size))
                .unwrap_or(usize::MAX);
            let window = &data[..data.len().min(limit)];
            match window.iter().position(|b| *b == b'\n') {
                Some(end) => {
                    self.append(&data[..=end])?;
                    data = &data[end + 1..];
                    self.rotate()?;
                }
                None if data.len() <= limit => return self.append(data),
                None => {
                    self.append(window)?;
                    data = &data[window.len()..];
                    self.rotate()?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;
    use std::prelude::rust_2024::*;

    fn bytes(dir: &Path) -> &[u8] {
        dir.as_os_str().as_bytes()
    }

    fn files(dir: &Path) -> Vec<(u64, String)> {
        indices(bytes(dir), "t", Stream::Stdout)
            .expect("listable")
            .into_iter()
            .map(|i| {
                let text = fs::read_to_string(dir.join(file_name("t", Stream::Stdout, i)))
                    .expect("readable");
                (i, text)
            })
            .collect()
    }

    #[test]
    fn files_rotate_at_line_ends_and_only_the_newest_are_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut rotator =
            Rotator::open(bytes(dir.path()), "t", Stream::Stdout, 3, 10).expect("opens");
        // Ten lines of four bytes, written in odd chunks.
        let text: String = (0..10).map(|i| format!("ab{i}\n")).collect();
        for chunk in text.as_bytes().chunks(3) {
            rotator.write(chunk).expect("written");
        }
        let kept = files(dir.path());
        assert_eq!(kept.len(), 3, "{kept:?}");
        for (_, content) in &kept {
            assert!(content.ends_with('\n'), "{kept:?}");
            assert!(content.len() as u64 <= 10 + LINE_SLACK);
        }
        let joined: String = kept.iter().map(|(_, c)| c.as_str()).collect();
        assert!(text.ends_with(&joined), "{joined:?}");
        assert_eq!(kept.last().map(|(i, _)| *i), Some(rotator.index()));
    }

    #[test]
    fn a_line_that_does_not_fit_starts_the_next_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut rotator =
            Rotator::open(bytes(dir.path()), "t", Stream::Stdout, 5, 10).expect("opens");
        rotator.write(b"1234567\n").expect("written");
        rotator.write(b"abcdef\n").expect("written");
        assert_eq!(
            files(dir.path()),
            [(0, "1234567\n".to_owned()), (1, "abcdef\n".to_owned())]
        );
    }

    #[test]
    fn a_line_begun_in_a_file_is_finished_there_and_only_overlong_lines_split() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut rotator =
            Rotator::open(bytes(dir.path()), "t", Stream::Stdout, 5, 10).expect("opens");
        rotator.write(b"12345678").expect("written");
        rotator.write(b"9abc\nxy\n").expect("written");
        assert_eq!(
            files(dir.path()),
            [(0, "123456789abc\n".to_owned()), (1, "xy\n".to_owned())]
        );
        let long = vec![b'z'; (10 + LINE_SLACK + 5) as usize];
        rotator.write(&long).expect("written");
        let sizes: Vec<usize> = files(dir.path()).iter().map(|(_, c)| c.len()).collect();
        assert_eq!(sizes, [13, 3, 10 + LINE_SLACK as usize, 5]);
    }

    #[test]
    fn a_restarted_writer_appends_to_the_newest_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut first =
            Rotator::open(bytes(dir.path()), "t", Stream::Stdout, 2, 100).expect("opens");
        first.write(b"one\n").expect("written");
        drop(first);
        let mut second =
            Rotator::open(bytes(dir.path()), "t", Stream::Stdout, 2, 100).expect("opens");
        second.write(b"two\n").expect("written");
        assert_eq!(files(dir.path()), [(0, "one\ntwo\n".to_owned())]);
        assert_eq!(
            indices(bytes(dir.path()), "t", Stream::Stderr).expect("listable"),
            Vec::<u64>::new()
        );
    }
}
