//! Files through rustix, as the supervisor needs them: whole files read and written,
//! directories listed, paths joined. Paths are bytes, as the kernel takes them.

use alloc::vec::Vec;

use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::fs::{Dir, Mode, OFlags};
use rustix::io::Errno;

/// `dir/name`.
pub(crate) fn join(dir: &[u8], name: &[u8]) -> Vec<u8> {
    let mut path = Vec::with_capacity(dir.len() + 1 + name.len());
    path.extend_from_slice(dir);
    if !dir.is_empty() && !dir.ends_with(b"/") {
        path.push(b'/');
    }
    path.extend_from_slice(name);
    path
}

/// Opens `path` close-on-exec, with `flags` and, when it creates the file, `mode`.
pub(crate) fn open(path: &[u8], flags: OFlags, mode: u32) -> Result<OwnedFd, Errno> {
    rustix::fs::open(path, flags | OFlags::CLOEXEC, Mode::from_raw_mode(mode))
}

/// Writes all of `bytes` to `fd`.
pub(crate) fn write_all(fd: impl AsFd, mut bytes: &[u8]) -> Result<(), Errno> {
    while !bytes.is_empty() {
        match rustix::io::write(&fd, bytes) {
            Ok(0) => return Err(Errno::IO),
            Ok(n) => bytes = &bytes[n..],
            Err(Errno::INTR) => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// Everything `fd` still has to read.
///
/// Read straight into the vector's spare room, no buffer on the stack: every stack page
/// the supervisor ever touches stays part of it for as long as its task runs.
pub(crate) fn read_to_end(fd: impl AsFd) -> Result<Vec<u8>, Errno> {
    let mut out = Vec::with_capacity(512);
    loop {
        if out.len() == out.capacity() {
            out.reserve(out.capacity());
        }
        match rustix::io::read(&fd, rustix::buffer::spare_capacity(&mut out)) {
            Ok(0) => return Ok(out),
            Ok(_) => {}
            Err(Errno::INTR) => {}
            Err(error) => return Err(error),
        }
    }
}

/// The whole of file `path`.
pub(crate) fn read(path: &[u8]) -> Result<Vec<u8>, Errno> {
    read_to_end(open(path, OFlags::RDONLY, 0)?)
}

/// The names in directory `path`, `.` and `..` left out.
pub(crate) fn list(path: &[u8]) -> Result<Vec<Vec<u8>>, Errno> {
    let fd = open(path, OFlags::RDONLY | OFlags::DIRECTORY, 0)?;
    let mut names = Vec::new();
    for entry in Dir::read_from(&fd)? {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(name.to_vec());
        }
    }
    Ok(names)
}

/// Standard input. Never closed by the supervisor (only replaced, by `dup2`).
// rustix's `stdin` is safe only with its `std` feature, which the agent's build turns on.
#[allow(unsafe_code, unused_unsafe)]
pub(crate) fn stdin() -> BorrowedFd<'static> {
    // SAFETY: descriptor 0 stays open for the process's life: the agent starts every
    // supervisor with it, and the supervisor only ever replaces it.
    unsafe { rustix::stdio::stdin() }
}

/// Standard output. Never closed by the supervisor (only replaced, by `dup2`).
#[allow(unsafe_code, unused_unsafe)]
pub(crate) fn stdout() -> BorrowedFd<'static> {
    // SAFETY: descriptor 1 stays open for the process's life: the agent starts every
    // supervisor with it, and the supervisor only ever replaces it.
    unsafe { rustix::stdio::stdout() }
}
