//! Pseudo-terminals for `stead alloc exec -t`: one per command, whose far end is the
//! command's standard input, output, error and controlling terminal, and whose near end
//! the agent reads and writes without blocking.
//!
//! Once every process holding the far end is gone, reading the near end returns what is
//! still buffered, then `EIO`, which reads here as the end of the stream.

use std::io;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use rustix::fs::{Mode, OFlags};
use rustix::pty::OpenptFlags;
use rustix::termios::Winsize;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

use crate::driver::WindowSize;

/// A new terminal's two ends: `near` non-blocking, `far` for the command.
pub(super) struct Pty {
    pub(super) near: OwnedFd,
    pub(super) far: OwnedFd,
}

/// Opens a terminal of `size`.
pub(super) fn open(size: WindowSize) -> io::Result<Pty> {
    let flags = OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC;
    let near = rustix::pty::openpt(flags)?;
    rustix::pty::grantpt(&near)?;
    rustix::pty::unlockpt(&near)?;
    // Straight from the near end where the kernel can (4.13 on); by name elsewhere.
    let far = match rustix::pty::ioctl_tiocgptpeer(&near, flags) {
        Ok(far) => far,
        Err(_) => {
            let name = rustix::pty::ptsname(&near, Vec::new())?;
            rustix::fs::open(
                name.as_c_str(),
                OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC,
                Mode::empty(),
            )?
        }
    };
    resize(&near, size)?;
    rustix::fs::fcntl_setfl(&near, OFlags::NONBLOCK)?;
    Ok(Pty { near, far })
}

fn resize(fd: &OwnedFd, size: WindowSize) -> io::Result<()> {
    let winsize = Winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    rustix::termios::tcsetwinsize(fd, winsize).map_err(io::Error::from)
}

/// A command's terminal, kept to change its size (the command gets `SIGWINCH`).
#[derive(Debug)]
pub struct Terminal {
    near: OwnedFd,
}

impl Terminal {
    pub(super) fn new(near: OwnedFd) -> Self {
        Terminal { near }
    }

    /// Gives the terminal `size`.
    pub fn resize(&self, size: WindowSize) -> io::Result<()> {
        resize(&self.near, size)
    }
}

/// The near end of a terminal, read or written without blocking.
pub(super) struct NearEnd {
    fd: AsyncFd<OwnedFd>,
}

impl NearEnd {
    pub(super) fn new(near: OwnedFd, interest: Interest) -> io::Result<Self> {
        Ok(NearEnd {
            fd: super::zygote::register(near, interest)?,
        })
    }
}

impl AsyncRead for NearEnd {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|fd| {
                rustix::io::read(fd.get_ref(), &mut *unfilled).map_err(io::Error::from)
            }) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                // Nobody holds the far end any more: the stream is over.
                Ok(Err(error))
                    if error.raw_os_error() == Some(rustix::io::Errno::IO.raw_os_error()) =>
                {
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(error)) => return Poll::Ready(Err(error)),
                Err(_would_block) => {}
            }
        }
    }
}

impl AsyncWrite for NearEnd {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            match guard.try_io(|fd| rustix::io::write(fd.get_ref(), buf).map_err(io::Error::from)) {
                Ok(result) => return Poll::Ready(result),
                Err(_would_block) => {}
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
