//! Serving the router on a socket, within bounds: a deadline for each request's head,
//! the same deadline for a keep-alive connection's wait for its next request, and at
//! most [`ServeLimits::max_connections`] connections at once over every listener of one
//! [`Connections`].
//!
//! At the cap, an idle connection (no request in flight: one still sending its first
//! head, or a keep-alive one between requests) is closed, oldest first, to let the new
//! one in, so connections that send nothing never lock a real client out; with every
//! connection busy, the new one is closed at once. So the API holds at most
//! `max_connections` sockets (one more for a moment) whatever clients do. An accept that
//! fails for want of descriptors (`EMFILE`, `ENFILE`) pauses the accept loop instead of
//! retrying at once; the connection waits in the kernel's backlog.
//!
//! hyper's HTTP/1 connection arms its header timer whenever it waits for a request's
//! head: on a new connection and between keep-alive requests alike, so one timer bounds
//! both; a response being written (a followed log) is not bound by it.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use http_body::Frame;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use super::ServeError;

/// The default of `api.headerTimeout`.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The default of `api.maxConnections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;
/// How long the accept loop pauses when the process is out of descriptors.
const DESCRIPTORS_PAUSE: Duration = Duration::from_millis(100);

/// How the API's connections are bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// How long a connection may take to send a request's head, or wait idle between
    /// requests; at least 1 ms.
    pub header_timeout: Duration,
    /// Connections served at once; at least 1.
    pub max_connections: usize,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// The connections of one API, over all its listeners: the cap is shared. Cheap to
/// clone.
#[derive(Clone)]
pub struct Connections {
    inner: Arc<Shared>,
}

struct Shared {
    limits: ServeLimits,
    /// One permit per connection served; a connection's task holds its permit.
    slots: Arc<Semaphore>,
    /// The connections served, oldest first.
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    next: u64,
    open: BTreeMap<u64, Entry>,
}

struct Entry {
    /// Requests in flight (their responses not yet written to the end).
    busy: Arc<AtomicUsize>,
    /// Cancelled to close the connection.
    evict: CancellationToken,
}

/// A connection's place in the table, removed when dropped.
struct Registered {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.shared.lock().open.remove(&self.id);
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        // Every change to the table is one insertion or removal.
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Connections {
    /// Connections bounded by `limits` (a zero cap or timeout is taken as the least).
    pub fn new(limits: ServeLimits) -> Self {
        let limits = ServeLimits {
            header_timeout: limits.header_timeout.max(Duration::from_millis(1)),
            max_connections: limits.max_connections.max(1),
        };
        Connections {
            inner: Arc::new(Shared {
                limits,
                slots: Arc::new(Semaphore::new(limits.max_connections)),
                table: Mutex::new(Table::default()),
            }),
        }
    }

    /// The bounds in force.
    pub fn limits(&self) -> ServeLimits {
        self.inner.limits
    }

    /// How many connections are served now.
    pub fn open(&self) -> usize {
        self.inner.lock().open.len()
    }

    fn register(&self) -> (Registered, Arc<AtomicUsize>, CancellationToken) {
        let busy = Arc::new(AtomicUsize::new(0));
        let evict = CancellationToken::new();
        let mut table = self.inner.lock();
        let id = table.next;
        table.next += 1;
        table.open.insert(
            id,
            Entry {
                busy: busy.clone(),
                evict: evict.clone(),
            },
        );
        drop(table);
        let registered = Registered {
            shared: self.inner.clone(),
            id,
        };
        (registered, busy, evict)
    }

    /// Closes the oldest connection with no request in flight that is not closing yet;
    /// whether there was one.
    fn evict_oldest_idle(&self) -> bool {
        let table = self.inner.lock();
        let idle = table
            .open
            .values()
            .find(|entry| entry.busy.load(Ordering::Acquire) == 0 && !entry.evict.is_cancelled());
        match idle {
            Some(entry) => {
                entry.evict.cancel();
                true
            }
            None => false,
        }
    }
}

/// A listener the API accepts connections on.
pub(super) trait Accept {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&self) -> impl Future<Output = std::io::Result<Self::Io>> + Send;
}

impl Accept for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&self) -> std::io::Result<Self::Io> {
        let (stream, _) = tokio::net::TcpListener::accept(self).await?;
        // Responses are small and written whole: no reason to wait for more to send.
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }
}

impl Accept for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept(&self) -> std::io::Result<Self::Io> {
        tokio::net::UnixListener::accept(self)
            .await
            .map(|(stream, _)| stream)
    }
}

/// Whether an accept failed for want of descriptors, the process's or the system's.
fn out_of_descriptors(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(code) if code == rustix::io::Errno::MFILE.raw_os_error()
            || code == rustix::io::Errno::NFILE.raw_os_error()
    )
}

/// Serves `router` on `listener` within `connections`' bounds until `shutdown` resolves,
/// then finishes the requests in flight (idle connections close at once).
pub(super) async fn serve<L: Accept>(
    listener: L,
    router: Router,
    connections: Connections,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let closing = CancellationToken::new();
    let (done, mut all_done) = mpsc::channel::<Infallible>(1);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut starved = false;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let io = match accepted {
            Ok(io) => {
                starved = false;
                io
            }
            Err(error) if out_of_descriptors(&error) => {
                if !starved {
                    tracing::warn!(%error, open = connections.open(), "out of descriptors; the api accepts again in a moment");
                    starved = true;
                }
                tokio::select! {
                    () = tokio::time::sleep(DESCRIPTORS_PAUSE) => continue,
                    () = &mut shutdown => break,
                }
            }
            // The connection went before it was accepted; others are unaffected.
            Err(error) => {
                tracing::debug!(%error, "accept failed");
                continue;
            }
        };
        let slots = connections.inner.slots.clone();
        let permit = match slots.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                if !connections.evict_oldest_idle() {
                    tracing::debug!(
                        max = connections.limits().max_connections,
                        "every api connection is busy; closing a new one"
                    );
                    continue;
                }
                // The evicted connection gives its slot back as soon as its task sees it.
                tokio::select! {
                    permit = slots.acquire_owned() => permit.expect("the semaphore is never closed"),
                    () = &mut shutdown => break,
                }
            }
        };
        let (registered, busy, evict) = connections.register();
        let router = router.clone();
        let closing = closing.clone();
        let done = done.clone();
        let header_timeout = connections.limits().header_timeout;
        tokio::spawn(async move {
            serve_connection(io, router, header_timeout, busy, evict, closing).await;
            drop((registered, permit, done));
        });
    }
    closing.cancel();
    drop(done);
    // Every connection's task holds a sender: none is left once all have ended.
    let _ = all_done.recv().await;
    Ok(())
}

/// One connection, until the client or the server ends it, `evict` closes it or
/// `closing` asks it to finish what is in flight.
async fn serve_connection<I: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: I,
    router: Router,
    header_timeout: Duration,
    busy: Arc<AtomicUsize>,
    evict: CancellationToken,
    closing: CancellationToken,
) {
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let router = router.clone();
        let guard = BusyGuard::new(busy.clone());
        async move {
            let response = router
                .oneshot(request.map(Body::new))
                .await
                .unwrap_or_else(|never| match never {});
            Ok::<_, Infallible>(response.map(|body| {
                Body::new(Tracked {
                    body,
                    _guard: guard,
                })
            }))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(true);
    // An upgraded connection (an exec session) leaves this loop and the connection cap;
    // `api.maxExecs` bounds those.
    let connection = builder
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    let mut connection = std::pin::pin!(connection);
    let mut finishing = false;
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%error, "api connection ended");
                }
                return;
            }
            () = evict.cancelled() => return,
            () = closing.cancelled(), if !finishing => {
                finishing = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Counts a request in flight from its head to the end of its response.
struct BusyGuard(Arc<AtomicUsize>);

impl BusyGuard {
    fn new(busy: Arc<AtomicUsize>) -> Self {
        busy.fetch_add(1, Ordering::AcqRel);
        BusyGuard(busy)
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted until it is written (or dropped).
struct Tracked {
    body: Body,
    _guard: BusyGuard,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
