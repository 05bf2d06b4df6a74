//! `SIGCHLD` as a descriptor: blocked, and read from a `signalfd`, so a process learns of
//! its children's exits in the same `poll` as its other descriptors: no thread blocked in
//! `wait()`, no signal handler. The fork server and every supervisor wait this way.
//!
//! The mask is per thread and both users are single-threaded, so every `SIGCHLD` of the
//! process reaches the descriptor. Several exits may share one notification (standard
//! signals do not queue): whoever reads it reaps with `WNOHANG` until nothing is left.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// The set holding `SIGCHLD` alone.
#[allow(unsafe_code)]
pub(crate) fn child_signal_set() -> libc::sigset_t {
    // SAFETY: a zeroed `sigset_t` is valid storage, and is initialised by `sigemptyset`.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        set
    }
}

/// `SIGCHLD`, blocked in the calling thread and read from a `signalfd`.
pub(crate) struct ChildSignals {
    fd: OwnedFd,
}

impl ChildSignals {
    /// Blocks `SIGCHLD` and opens the descriptor (non-blocking, close-on-exec). A child
    /// started after this inherits the blocked mask: whoever execs must unblock it first
    /// ([`crate::spawn`] does).
    #[allow(unsafe_code)]
    pub(crate) fn new() -> io::Result<ChildSignals> {
        let set = child_signal_set();
        // SAFETY: a mask call on an initialised set; the descriptor `signalfd` returns
        // is owned from here on.
        unsafe {
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            let fd = libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
            if fd == -1 {
                return Err(io::Error::last_os_error());
            }
            Ok(ChildSignals {
                fd: OwnedFd::from_raw_fd(fd),
            })
        }
    }

    /// Consumes the pending notifications; the caller then reaps with `WNOHANG`.
    pub(crate) fn clear(&self) {
        let mut info = [0u8; 128]; // one `signalfd_siginfo`
        while rustix::io::read(&self.fd, &mut info).is_ok_and(|n| n > 0) {}
    }

    /// In a forked child that does not serve as this process: `SIGCHLD` unblocked again
    /// and the parent's descriptor closed.
    #[allow(unsafe_code)]
    pub(crate) fn leave(&self) {
        let set = child_signal_set();
        // SAFETY: a mask call on an initialised set; the descriptor is the parent's copy
        // in this forked child, which never returns to the parent's loop, so nothing else
        // closes or uses it.
        unsafe {
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            libc::close(self.fd.as_raw_fd());
        }
    }
}

impl AsFd for ChildSignals {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
