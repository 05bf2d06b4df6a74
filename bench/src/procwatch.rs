//! The benchmark's process observer: which marked processes run, from the kernel's
//! process events where it may listen to them, else from scans of `/proc`.
//!
//! A scan reads the command line of every process: with a thousand processes (500 tasks
//! and their supervisors) one scan costs several milliseconds of CPU, and polling with
//! it keeps one of two cores busy while the manager under test starts its tasks. The
//! proc connector (netlink, `CN_IDX_PROC`, root only) reports each `fork`, `exec` and
//! `exit` as it happens; the observer then reads the command line of only the processes
//! that just executed something, and wakes when one did, so it neither loads the machine
//! nor adds a polling interval to what it measures. A wait ends at the kernel's time of
//! the event that met it, not when the observer read that event: while a manager starts
//! its tasks on every core, the observer's own wake-up can lag by a scheduler tick. The
//! same observer serves every manager and the bare loop alike.

use std::collections::HashMap;
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// What a process of interest is, from its command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Marked {
    /// `sleep <generation * 1_000_000 + index>`.
    Sleep { index: usize, generation: usize },
    /// A slow-stopping task or a process it forked (its command line carries the marker).
    Stop,
}

/// Classifies a command line (`\0`-separated).
pub(crate) type Classify = fn(&[u8]) -> Option<Marked>;

/// The marked processes, kept current.
pub(crate) struct Observer {
    classify: Classify,
    events: Option<OwnedFd>,
    marked: HashMap<u32, Marked>,
    buffer: Vec<u8>,
}

const NETLINK_CONNECTOR: libc::c_int = 11;
const CN_IDX_PROC: u32 = 1;
const CN_VAL_PROC: u32 = 1;
const PROC_CN_MCAST_LISTEN: u32 = 1;
const PROC_EVENT_FORK: u32 = 1;
const PROC_EVENT_EXEC: u32 = 2;
const PROC_EVENT_EXIT: u32 = 0x8000_0000;
/// `nlmsghdr` (16 bytes), then `cn_msg` (20 bytes), then `proc_event`.
const EVENT_AT: usize = 16 + 20;
/// `proc_event`: `what`, `cpu`, `timestamp_ns`, then the event's own fields.
const FIELDS_AT: usize = EVENT_AT + 4 + 4 + 8;
/// The receive buffer asked for, so a burst of thousands of events is not dropped.
const RECEIVE_BUFFER: libc::c_int = 16 << 20;

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

/// Subscribes to the kernel's process events.
#[allow(unsafe_code)]
fn listen() -> io::Result<OwnedFd> {
    // SAFETY: plain socket calls on a descriptor this function owns; every pointer is to
    // a local of the size given.
    unsafe {
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            NETLINK_CONNECTOR,
        );
        if fd == -1 {
            return Err(io::Error::last_os_error());
        }
        let socket = OwnedFd::from_raw_fd(fd);
        for option in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
            let size = RECEIVE_BUFFER;
            if libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                option,
                (&raw const size).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            ) == 0
            {
                break;
            }
        }
        let mut address: libc::sockaddr_nl = std::mem::zeroed();
        address.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        address.nl_groups = CN_IDX_PROC;
        if libc::bind(
            fd,
            (&raw const address).cast(),
            size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        ) == -1
        {
            return Err(io::Error::last_os_error());
        }
        let mut message = Vec::with_capacity(EVENT_AT + 4);
        let length = (EVENT_AT + 4) as u32;
        message.extend_from_slice(&length.to_ne_bytes());
        message.extend_from_slice(&(libc::NLMSG_DONE as u16).to_ne_bytes());
        message.extend_from_slice(&0u16.to_ne_bytes()); // flags
        message.extend_from_slice(&0u32.to_ne_bytes()); // seq
        message.extend_from_slice(&std::process::id().to_ne_bytes());
        message.extend_from_slice(&CN_IDX_PROC.to_ne_bytes());
        message.extend_from_slice(&CN_VAL_PROC.to_ne_bytes());
        message.extend_from_slice(&0u32.to_ne_bytes()); // seq
        message.extend_from_slice(&0u32.to_ne_bytes()); // ack
        message.extend_from_slice(&4u16.to_ne_bytes()); // len
        message.extend_from_slice(&0u16.to_ne_bytes()); // flags
        message.extend_from_slice(&PROC_CN_MCAST_LISTEN.to_ne_bytes());
        if libc::send(fd, message.as_ptr().cast(), message.len(), 0) == -1 {
            return Err(io::Error::last_os_error());
        }
        Ok(socket)
    }
}

fn command_line(pid: u32) -> Option<Vec<u8>> {
    std::fs::read(format!("/proc/{pid}/cmdline")).ok()
}

impl Observer {
    /// An observer of the processes `classify` marks; from process events when the
    /// kernel lets this process listen, else from scans.
    pub(crate) fn new(classify: Classify) -> Observer {
        let mut observer = Observer {
            classify,
            events: listen().ok(),
            marked: HashMap::new(),
            buffer: vec![0u8; 64 * 1024],
        };
        observer.scan();
        observer
    }

    /// How it observes, for the report.
    pub(crate) fn method(&self) -> &'static str {
        if self.events.is_some() {
            "the kernel's process events (proc connector)"
        } else {
            "scans of /proc every millisecond (no proc connector: not root?)"
        }
    }

    /// The marked processes by pid.
    pub(crate) fn marked(&self) -> &HashMap<u32, Marked> {
        &self.marked
    }

    /// Rebuilds the table from `/proc`.
    fn scan(&mut self) {
        self.marked.clear();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return;
        };
        for entry in entries.filter_map(Result::ok) {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if let Some(marked) = command_line(pid).and_then(|c| (self.classify)(&c)) {
                self.marked.insert(pid, marked);
            }
        }
    }

    /// Brings the table up to date, waiting up to `timeout` for something to happen.
    fn refresh(&mut self, timeout: Duration) {
        self.refresh_until(timeout, &mut |_| false);
    }

    /// Brings the table up to date as [`Observer::refresh`] does, one event at a time.
    /// When `condition` holds at the end and came to hold during the update, answers
    /// when the event after which it last came to hold happened: the kernel's time of
    /// it, not when this process got to read it (on a loaded machine, up to a scheduler
    /// tick or more later). From scans, the time of the scan.
    fn refresh_until(
        &mut self,
        timeout: Duration,
        condition: &mut impl FnMut(&HashMap<u32, Marked>) -> bool,
    ) -> Option<Instant> {
        let Some(events) = self.events.as_ref().map(AsRawFd::as_raw_fd) else {
            std::thread::sleep(timeout.min(Duration::from_millis(1)));
            let held = condition(&self.marked);
            self.scan();
            return (!held && condition(&self.marked)).then(crate::measure::now);
        };
        let mut poll = libc::pollfd {
            fd: events,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = match libc::c_int::try_from(timeout.as_millis()) {
            Ok(0) if timeout.is_zero() => 0,
            Ok(ms) => ms.max(1),
            Err(_) => libc::c_int::MAX,
        };
        #[allow(unsafe_code)]
        // SAFETY: one valid `pollfd`.
        unsafe {
            libc::poll(&raw mut poll, 1, ms);
        }
        // The events' times are the kernel's monotonic clock, which `Instant` reads too.
        let (clock_now, instant_now) = (crate::measure::monotonic_ns(), crate::measure::now());
        let mut holds = condition(&self.marked);
        let mut came = None;
        loop {
            #[allow(unsafe_code)]
            // SAFETY: the buffer is ours and as long as given.
            let received = unsafe {
                libc::recv(
                    events,
                    self.buffer.as_mut_ptr().cast(),
                    self.buffer.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if received < 0 {
                if io::Error::last_os_error().raw_os_error() == Some(libc::ENOBUFS) {
                    // Events were dropped: start over from the process table.
                    self.scan();
                    let now_holds = condition(&self.marked);
                    if now_holds != holds {
                        came = now_holds.then(crate::measure::now);
                        holds = now_holds;
                    }
                    continue;
                }
                return came.filter(|_| holds);
            }
            let received = received.unsigned_abs();
            let mut at = 0;
            while at + 16 <= received {
                let length = u32_at(&self.buffer, at).unwrap_or(0) as usize;
                if length < 16 || at + length > received {
                    break;
                }
                let message = self.buffer[at..at + length].to_vec();
                self.apply(&message);
                let now_holds = condition(&self.marked);
                if now_holds != holds {
                    came = now_holds.then(|| {
                        u64_at(&message, EVENT_AT + 8)
                            .map(|ns| clock_now.saturating_sub(ns))
                            .and_then(|ago| instant_now.checked_sub(Duration::from_nanos(ago)))
                            .unwrap_or(instant_now)
                    });
                    holds = now_holds;
                }
                at += (length + 3) & !3;
            }
        }
    }

    /// Applies one netlink message of the proc connector.
    fn apply(&mut self, message: &[u8]) {
        let Some(what) = u32_at(message, EVENT_AT) else {
            return;
        };
        let field = |n: usize| u32_at(message, FIELDS_AT + 4 * n);
        match what {
            PROC_EVENT_FORK => {
                // Threads are not processes; a forked child runs its parent's command
                // line until it executes its own.
                if let (Some(parent), Some(child), Some(child_tgid)) =
                    (field(1), field(2), field(3))
                    && child == child_tgid
                    && let Some(marked) = self.marked.get(&parent).copied()
                {
                    self.marked.insert(child, marked);
                }
            }
            PROC_EVENT_EXEC => {
                if let (Some(pid), Some(tgid)) = (field(0), field(1))
                    && pid == tgid
                {
                    match command_line(pid).and_then(|c| (self.classify)(&c)) {
                        Some(marked) => self.marked.insert(pid, marked),
                        None => self.marked.remove(&pid),
                    };
                }
            }
            PROC_EVENT_EXIT => {
                if let (Some(pid), Some(tgid)) = (field(0), field(1))
                    && pid == tgid
                {
                    self.marked.remove(&pid);
                }
            }
            _ => {}
        }
    }

    /// Waits until `condition` holds of the marked processes; the time since `start`.
    pub(crate) fn until(
        &mut self,
        start: Instant,
        limit: Duration,
        what: &str,
        mut condition: impl FnMut(&HashMap<u32, Marked>) -> bool,
    ) -> anyhow::Result<Duration> {
        // What happened before this call (processes that exited since) counts first.
        let mut timeout = Duration::ZERO;
        loop {
            if let Some(happened) = self.refresh_until(timeout, &mut condition) {
                return Ok(happened.saturating_duration_since(start));
            }
            if condition(&self.marked) {
                return Ok(start.elapsed());
            }
            let waited = start.elapsed();
            if waited > limit {
                anyhow::bail!("{what}: not reached within {limit:?}");
            }
            timeout = (limit - waited).min(Duration::from_millis(50));
        }
    }

    /// Brings the table up to date without waiting.
    pub(crate) fn update(&mut self) {
        self.refresh(Duration::ZERO);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Marks `sleep 7<this process's pid>`, so parallel tests never see each other's.
    fn ours(cmdline: &[u8]) -> Option<Marked> {
        let wanted = format!("sleep\07{}\0", std::process::id());
        cmdline
            .ends_with(wanted.as_bytes())
            .then_some(Marked::Sleep {
                index: 0,
                generation: 1,
            })
    }

    #[test]
    fn a_started_process_is_seen_running_and_never_after_it_is_killed() {
        let mut observer = Observer::new(ours);
        let mut child = std::process::Command::new("sleep")
            .arg(format!("7{}", std::process::id()))
            .spawn()
            .expect("sleep starts");
        let limit = Duration::from_secs(10);
        observer
            .until(crate::measure::now(), limit, "seen", |m| {
                m.get(&child.id()).is_some()
            })
            .expect("the observer sees the process");
        let pid = child.id();
        child.kill().expect("killed");
        child.wait().expect("reaped");
        // A process gone before the call is never taken as running by it.
        assert!(
            observer
                .until(crate::measure::now(), Duration::ZERO, "stale", |m| m
                    .contains_key(&pid))
                .is_err()
        );
        observer
            .until(crate::measure::now(), limit, "gone", HashMap::is_empty)
            .expect("the observer sees it gone");
    }

    #[test]
    fn with_process_events_a_wait_is_timed_by_the_event_not_by_its_reading() {
        let mut observer = Observer::new(ours);
        let start = crate::measure::now();
        let mut child = std::process::Command::new("sleep")
            .arg(format!("7{}", std::process::id()))
            .spawn()
            .expect("sleep starts");
        // The observer reads the exec event only after this, as a busy benchmark's
        // observer may.
        std::thread::sleep(Duration::from_millis(300));
        let pid = child.id();
        let took = observer
            .until(start, Duration::from_secs(10), "seen", |m| {
                m.contains_key(&pid)
            })
            .expect("the observer sees the process");
        child.kill().expect("killed");
        child.wait().expect("reaped");
        if observer.events.is_some() {
            assert!(
                took < Duration::from_millis(200),
                "timed by the event: {took:?}"
            );
        } else {
            // Scans see the process when they run.
            assert!(
                took >= Duration::from_millis(300),
                "timed by the scan: {took:?}"
            );
        }
    }
}
