//! A system call's error as people read it: the C library's wording and the number,
//! `No such file or directory (os error 2)`, as the agent's own messages say it.
//!
//! rustix without the standard library prints only the number, and the supervisor has
//! no C library to ask: the wording of the errors a start or a log can meet is here.

use core::fmt;

use rustix::io::Errno;

/// An errno with the C library's wording.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OsError(pub Errno);

impl From<Errno> for OsError {
    fn from(errno: Errno) -> OsError {
        OsError(errno)
    }
}

impl OsError {
    /// glibc's `strerror` text, for the errors the supervisor's calls return.
    fn description(self) -> Option<&'static str> {
        Some(match self.0 {
            Errno::PERM => "Operation not permitted",
            Errno::NOENT => "No such file or directory",
            Errno::SRCH => "No such process",
            Errno::INTR => "Interrupted system call",
            Errno::IO => "Input/output error",
            Errno::NXIO => "No such device or address",
            Errno::TOOBIG => "Argument list too long",
            Errno::NOEXEC => "Exec format error",
            Errno::BADF => "Bad file descriptor",
            Errno::CHILD => "No child processes",
            Errno::AGAIN => "Resource temporarily unavailable",
            Errno::NOMEM => "Cannot allocate memory",
            Errno::ACCESS => "Permission denied",
            Errno::FAULT => "Bad address",
            Errno::BUSY => "Device or resource busy",
            Errno::EXIST => "File exists",
            Errno::XDEV => "Invalid cross-device link",
            Errno::NODEV => "No such device",
            Errno::NOTDIR => "Not a directory",
            Errno::ISDIR => "Is a directory",
            Errno::INVAL => "Invalid argument",
            Errno::NFILE => "Too many open files in system",
            Errno::MFILE => "Too many open files",
            Errno::TXTBSY => "Text file busy",
            Errno::FBIG => "File too large",
            Errno::NOSPC => "No space left on device",
            Errno::SPIPE => "Illegal seek",
            Errno::ROFS => "Read-only file system",
            Errno::MLINK => "Too many links",
            Errno::PIPE => "Broken pipe",
            Errno::NAMETOOLONG => "File name too long",
            Errno::NOSYS => "Function not implemented",
            Errno::LOOP => "Too many levels of symbolic links",
            Errno::STALE => "Stale file handle",
            Errno::DQUOT => "Disk quota exceeded",
            Errno::TIMEDOUT => "Connection timed out",
            Errno::LIBBAD => "Accessing a corrupted shared library",
            Errno::OVERFLOW => "Value too large for defined data type",
            Errno::NOTEMPTY => "Directory not empty",
            Errno::NOTCONN => "Transport endpoint is not connected",
            Errno::NOLINK => "Link has been severed",
            Errno::NOMEDIUM => "No medium found",
            Errno::KEYREJECTED => "Key was rejected by service",
            Errno::NOKEY => "Required key not available",
            Errno::CONNREFUSED => "Connection refused",
            Errno::HOSTDOWN => "Host is down",
            _ => return None,
        })
    }
}

impl fmt::Display for OsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let number = self.0.raw_os_error();
        match self.description() {
            Some(text) => write!(f, "{text} (os error {number})"),
            None => write!(f, "os error {number}"),
        }
    }
}

impl core::error::Error for OsError {}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;
    use std::prelude::rust_2024::*;

    #[test]
    fn an_error_reads_as_the_standard_library_says_it() {
        for errno in [
            Errno::NOENT,
            Errno::ACCESS,
            Errno::NOEXEC,
            Errno::NOSPC,
            Errno::NOTCONN,
            Errno::NOKEY,
        ] {
            assert_eq!(
                OsError(errno).to_string(),
                std::io::Error::from_raw_os_error(errno.raw_os_error()).to_string()
            );
        }
        assert_eq!(
            OsError(Errno::from_raw_os_error(4000)).to_string(),
            "os error 4000"
        );
    }
}
