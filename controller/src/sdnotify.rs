//! The systemd notification protocol (`sd_notify(3)`): readiness, stopping and watchdog
//! pings sent as datagrams to the socket named by `NOTIFY_SOCKET`.
//!
//! The protocol is one `KEY=VALUE` line per datagram on a unix datagram socket; a name
//! starting with `@` is in the abstract namespace. Without `NOTIFY_SOCKET` (not run by
//! systemd as `Type=notify`) every call is a no-op. The watchdog interval is half of
//! `WATCHDOG_USEC`, as `sd_watchdog_enabled(3)` advises, and only when `WATCHDOG_PID`
//! is unset or names this process. Tasks never see these variables: the exec driver
//! builds their environment from the spec alone.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::path::PathBuf;
use std::time::Duration;

/// The readiness message: state restored, API serving.
pub const READY: &str = "READY=1";
/// The message sent when shutdown begins.
pub const STOPPING: &str = "STOPPING=1";
/// The watchdog keep-alive.
pub const WATCHDOG: &str = "WATCHDOG=1";

/// Why a notification could not be sent.
#[derive(Debug, thiserror::Error)]
pub enum SdNotifyError {
    /// `NOTIFY_SOCKET` names no usable socket address.
    #[error("NOTIFY_SOCKET {socket:?} is not a unix socket path or abstract name")]
    Address {
        /// The variable's value.
        socket: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The datagram could not be sent.
    #[error("cannot notify {socket:?}")]
    Send {
        /// The variable's value.
        socket: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// A connection to the service manager's notification socket.
#[derive(Debug)]
pub struct Notifier {
    /// `NOTIFY_SOCKET` as given, for messages.
    socket: String,
    address: SocketAddr,
    /// An unbound datagram socket messages are sent from.
    sender: UnixDatagram,
}

impl Notifier {
    /// The notifier `NOTIFY_SOCKET` asks for; `None` when it is unset or empty.
    pub fn from_env() -> Result<Option<Notifier>, SdNotifyError> {
        match std::env::var("NOTIFY_SOCKET") {
            Ok(socket) if !socket.is_empty() => Notifier::new(&socket).map(Some),
            _ => Ok(None),
        }
    }

    /// A notifier for `socket`: a path, or an abstract name when it starts with `@`.
    pub fn new(socket: &str) -> Result<Notifier, SdNotifyError> {
        let address = match socket.strip_prefix('@') {
            Some(name) => SocketAddr::from_abstract_name(name.as_bytes()),
            None => SocketAddr::from_pathname(PathBuf::from(socket)),
        }
        .map_err(|source| SdNotifyError::Address {
            socket: socket.to_owned(),
            source,
        })?;
        let sender = UnixDatagram::unbound().map_err(|source| SdNotifyError::Send {
            socket: socket.to_owned(),
            source,
        })?;
        Ok(Notifier {
            socket: socket.to_owned(),
            address,
            sender,
        })
    }

    /// Sends `state` (such as [`READY`]) in one datagram.
    pub fn notify(&self, state: &str) -> Result<(), SdNotifyError> {
        self.sender
            .send_to_addr(state.as_bytes(), &self.address)
            .map(|_| ())
            .map_err(|source| SdNotifyError::Send {
                socket: self.socket.clone(),
                source,
            })
    }
}

/// How often to ping the watchdog: half of `WATCHDOG_USEC`, when it is set, positive,
/// and meant for this process.
pub fn watchdog_interval_from_env() -> Option<Duration> {
    watchdog_interval(
        std::env::var("WATCHDOG_USEC").ok().as_deref(),
        std::env::var("WATCHDOG_PID").ok().as_deref(),
        std::process::id(),
    )
}

/// Half of `usec` microseconds, when `usec` is a positive number and `pid` is unset or
/// names `own_pid`.
pub fn watchdog_interval(usec: Option<&str>, pid: Option<&str>, own_pid: u32) -> Option<Duration> {
    if let Some(pid) = pid.filter(|p| !p.is_empty())
        && pid.trim().parse::<u32>().ok()? != own_pid
    {
        return None;
    }
    let usec: u64 = usec?.trim().parse().ok().filter(|u| *u > 0)?;
    Some(Duration::from_micros(usec) / 2)
}

/// Notifies the service manager, when there is one, and logs a failure: a lost message
/// must not stop the agent.
pub fn notify(notifier: Option<&Notifier>, state: &str) {
    if let Some(notifier) = notifier
        && let Err(error) = notifier.notify(state)
    {
        tracing::warn!(error = %crate::errors::error_chain(&error), "sd_notify failed");
    }
}

/// Reads `NOTIFY_SOCKET` and, when the watchdog is on, pings it every half period on the
/// current runtime until the agent exits. `None` when not run as `Type=notify`.
pub fn start() -> Option<Notifier> {
    let notifier = match Notifier::from_env() {
        Ok(notifier) => notifier?,
        Err(error) => {
            tracing::warn!(error = %crate::errors::error_chain(&error), "sd_notify disabled");
            return None;
        }
    };
    if let Some(period) = watchdog_interval_from_env() {
        match Notifier::new(&notifier.socket) {
            Ok(pinger) => {
                tokio::spawn(async move {
                    let mut ticks = tokio::time::interval(period);
                    // A stalled runtime must not make up for lost pings in a burst.
                    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    loop {
                        ticks.tick().await;
                        notify(Some(&pinger), WATCHDOG);
                    }
                });
            }
            Err(error) => {
                tracing::warn!(error = %crate::errors::error_chain(&error), "watchdog disabled");
            }
        }
    }
    Some(notifier)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_interval_is_half_the_period_for_this_process_only() {
        let half = Some(Duration::from_millis(500));
        assert_eq!(watchdog_interval(Some("1000000"), None, 7), half);
        assert_eq!(watchdog_interval(Some("1000000"), Some("7"), 7), half);
        assert_eq!(watchdog_interval(Some("1000000"), Some(""), 7), half);
        assert_eq!(watchdog_interval(Some("1000000"), Some("8"), 7), None);
        assert_eq!(watchdog_interval(Some("0"), None, 7), None);
        assert_eq!(watchdog_interval(Some("soon"), None, 7), None);
        assert_eq!(watchdog_interval(None, Some("7"), 7), None);
    }

    #[test]
    fn messages_reach_a_path_socket_and_an_abstract_one() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("notify");
        let receiver = UnixDatagram::bind(&path).expect("bind path socket");
        Notifier::new(path.to_str().expect("utf-8 path"))
            .expect("notifier")
            .notify(READY)
            .expect("sent");
        let mut buffer = [0u8; 64];
        let n = receiver.recv(&mut buffer).expect("received");
        assert_eq!(&buffer[..n], READY.as_bytes());

        let name = format!("stead-sdnotify-test-{}", std::process::id());
        let address = SocketAddr::from_abstract_name(name.as_bytes()).expect("abstract name");
        let receiver = UnixDatagram::bind_addr(&address).expect("bind abstract socket");
        Notifier::new(&format!("@{name}"))
            .expect("notifier")
            .notify(STOPPING)
            .expect("sent");
        let n = receiver.recv(&mut buffer).expect("received");
        assert_eq!(&buffer[..n], STOPPING.as_bytes());
    }

    #[test]
    fn a_missing_socket_is_a_send_error_naming_it() {
        let error = Notifier::new("/nonexistent/stead-notify")
            .expect("an address")
            .notify(READY)
            .expect_err("nobody listens");
        assert_eq!(
            error.to_string(),
            "cannot notify \"/nonexistent/stead-notify\""
        );
    }
}
