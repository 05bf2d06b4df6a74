//! The agent's end of the supervisors' fork server (`stead-supervisor --zygote`).
//!
//! The server is started on the first task start, or earlier when asked
//! ([`Zygote::prepare`]; the agent asks as it starts), and lives as long as the driver:
//! it exits when the driver drops its end of the socket. A start request is one `SOCK_SEQPACKET` message
//! carrying the supervisor's arguments, the task's environment and the write end of a
//! fresh pipe, on which the forked supervisor reports.

use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};

use rustix::net::{
    AddressFamily, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
    sendmsg, socketpair,
};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::net::unix::pipe;
use tokio::process::Child;

use super::ExecDriverConfig;

/// A running fork server.
struct Server {
    socket: AsyncFd<OwnedFd>,
    pid: Option<u32>,
    /// Held so tokio reaps the server when it exits, and to say how it ended.
    child: Mutex<Child>,
}

/// The fork server, started when first needed and again if it died.
#[derive(Default)]
pub(super) struct Zygote {
    server: Mutex<Option<Arc<Server>>>,
}

/// Registers `fd` with tokio's reactor for `interest`.
#[allow(unsafe_code)]
pub(super) fn register(fd: OwnedFd, interest: Interest) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: the `AsyncFd` takes ownership of the `OwnedFd`, which keeps the descriptor
    // open, unchanged and returned by every `as_raw_fd` until the `AsyncFd` drops it.
    unsafe { AsyncFd::register_with_interest(fd, interest) }.map_err(io::Error::from)
}

impl Server {
    fn spawn(config: &ExecDriverConfig) -> io::Result<Server> {
        let (ours, theirs) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?;
        // The server blocks on its end; only ours is non-blocking.
        rustix::fs::fcntl_setfl(&theirs, rustix::fs::OFlags::empty())?;
        let mut command = tokio::process::Command::new(&config.supervisor);
        command.arg("--zygote");
        if let Some(open_files) = config.task_open_files {
            command.arg(format!("--open-files={open_files}"));
        }
        if let Some(adj) = config.task_oom_score_adj {
            command.arg(format!("--oom-score-adj={adj}"));
        }
        let child = command
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .env_clear()
            .current_dir("/")
            .kill_on_drop(false)
            .spawn()?;
        Ok(Server {
            socket: register(ours, Interest::WRITABLE)?,
            pid: child.id(),
            child: Mutex::new(child),
        })
    }
}

/// Sends one request on `socket` with `report` attached.
async fn send(socket: &AsyncFd<OwnedFd>, request: &[u8], report: &OwnedFd) -> io::Result<()> {
    // Tried at once first: the socket is writable but for a full buffer, and its
    // readiness is only known once the reactor has polled, which a worker busy with
    // other starts does after all of them (a start's request would wait for the rest).
    match send_request(socket.get_ref(), request, report) {
        Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
        sent => return sent,
    }
    loop {
        let mut ready = socket.writable().await?;
        match ready.try_io(|socket| send_request(socket.get_ref(), request, report)) {
            Ok(sent) => return sent,
            Err(_would_block) => continue,
        }
    }
}

/// One request on `socket` (non-blocking) with `report` attached.
fn send_request(socket: &OwnedFd, request: &[u8], report: &OwnedFd) -> io::Result<()> {
    let fds = [report.as_fd()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    control.push(SendAncillaryMessage::ScmRights(&fds));
    sendmsg(
        socket,
        &[IoSlice::new(request)],
        &mut control,
        SendFlags::NOSIGNAL,
    )
    .map(drop)
    .map_err(io::Error::from)
}

impl Zygote {
    fn server(&self, config: &ExecDriverConfig) -> io::Result<Arc<Server>> {
        let mut slot = self.server.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(server) = &*slot {
            return Ok(Arc::clone(server));
        }
        let server = Arc::new(Server::spawn(config)?);
        *slot = Some(Arc::clone(&server));
        Ok(server)
    }

    /// Starts the server unless it runs.
    pub(super) fn prepare(&self, config: &ExecDriverConfig) -> io::Result<()> {
        self.server(config).map(drop)
    }

    /// Forgets `dead` (unless another start already replaced it), saying how it ended: a
    /// server that exits at once, start after start, is one that refuses its command
    /// line (a supervisor binary of another version, say).
    fn forget(&self, dead: &Arc<Server>) {
        let status = dead
            .child
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .try_wait();
        match status {
            Ok(Some(status)) => {
                tracing::warn!(pid = dead.pid, %status, "the supervisors' fork server exited; starting another")
            }
            _ => {
                tracing::warn!(
                    pid = dead.pid,
                    "the supervisors' fork server is gone; starting another"
                )
            }
        }
        let mut slot = self.server.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.as_ref().is_some_and(|s| Arc::ptr_eq(s, dead)) {
            *slot = None;
        }
    }

    /// The fork server's pid, once it runs.
    pub(super) fn pid(&self) -> Option<u32> {
        self.server
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(|s| s.pid)
    }

    /// Asks the fork server for a supervisor running `request`; returns the pipe it
    /// reports on. A server that died is started again, once.
    pub(super) async fn launch(
        &self,
        config: &ExecDriverConfig,
        request: &[u8],
    ) -> io::Result<pipe::Receiver> {
        let (read, write) = std::io::pipe()?;
        let receiver = pipe::Receiver::from_owned_fd(OwnedFd::from(read))?;
        let write = OwnedFd::from(write);
        let mut retried = false;
        loop {
            let server = self.server(config)?;
            match send(&server.socket, request, &write).await {
                Ok(()) => return Ok(receiver),
                Err(error) if !retried && is_gone(&error) => {
                    self.forget(&server);
                    retried = true;
                }
                Err(error) => return Err(error),
            }
        }
    }
}

/// Whether a send failed because the server is gone.
fn is_gone(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset | io::ErrorKind::NotConnected
    )
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    use rustix::net::{RecvAncillaryBuffer, RecvFlags, recvmsg};

    use super::*;

    #[test]
    fn a_request_is_sent_before_the_reactor_has_reported_the_socket_writable() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("runtime");
        let _context = runtime.enter();
        let (ours, theirs) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )
        .expect("socketpair");
        let socket = register(ours, Interest::WRITABLE).expect("registered");
        let (_read, write) = std::io::pipe().expect("pipe");
        let write = OwnedFd::from(write);
        // One poll, and the reactor never runs: the send must not wait for it.
        let mut sending = pin!(send(&socket, b"start", &write));
        let polled = sending
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()));
        assert!(matches!(polled, Poll::Ready(Ok(()))), "{polled:?}");
        let mut buffer = [0u8; 16];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let received = recvmsg(
            &theirs,
            &mut [io::IoSliceMut::new(&mut buffer)],
            &mut control,
            RecvFlags::empty(),
        )
        .expect("received");
        assert_eq!(&buffer[..received.bytes], b"start");
        assert_eq!(
            control.drain().count(),
            1,
            "the report's descriptor came along"
        );
    }
}
