//! `SIGCHLD` as a descriptor: blocked, and read from a `signalfd`, so a process learns of
//! its children's exits in the same `poll` as its other descriptors: no thread blocked in
//! `wait()`, no signal handler. The fork server and every supervisor wait this way.
//!
//! The mask is per thread and both users are single-threaded, so every `SIGCHLD` of the
//! process reaches the descriptor. Several exits may share one notification (standard
//! signals do not queue): whoever reads it reaps with `WNOHANG` until nothing is left.

use rustix::fd::{AsFd, BorrowedFd, OwnedFd};
use rustix::io::Errno;

use crate::sys::{self, MaskHow, SignalSet};

/// The set holding `SIGCHLD` alone.
pub(crate) const CHILD_SIGNAL: SignalSet = SignalSet::of(linux_raw_sys::general::SIGCHLD);

/// `SIGCHLD`, blocked in the calling thread and read from a `signalfd`.
pub(crate) struct ChildSignals {
    fd: OwnedFd,
}

impl ChildSignals {
    /// Blocks `SIGCHLD` and opens the descriptor (non-blocking, close-on-exec). A child
    /// started after this inherits the blocked mask: whoever execs must unblock it first
    /// ([`crate::spawn`] does).
    pub(crate) fn new() -> Result<ChildSignals, Errno> {
        sys::sigprocmask(MaskHow::Block, CHILD_SIGNAL)?;
        Ok(ChildSignals {
            fd: sys::signalfd(CHILD_SIGNAL)?,
        })
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
        use rustix::fd::AsRawFd;
        let _ = sys::sigprocmask(MaskHow::Unblock, CHILD_SIGNAL);
        // SAFETY: the descriptor is the parent's copy in this forked child, which never
        // returns to the parent's loop, so nothing else closes or uses it.
        unsafe { rustix::io::close(self.fd.as_raw_fd()) };
    }
}

impl AsFd for ChildSignals {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
