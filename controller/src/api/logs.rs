//! `GET /v1/allocs/{name}/logs/{task}`: a task's stdout or stderr, read from its rotating
//! files, optionally followed across rotations.
//!
//! The exec driver's log writer keeps `<data-dir>/allocs/<alloc-id>/alloc/logs/` with
//! `<task>.<stdout|stderr>.<N>`: the highest `N` is the file being written, lower ones are
//! older, and the oldest are deleted past `maxFiles`. Files are never renamed, so a
//! position is a file index plus an offset into it. The log as a whole is the files in
//! index order; `offset` and `origin` address bytes of that whole.
//!
//! Following checks the log at every tick of one timer all followed streams share
//! ([`LogTicker`], every [`super::DEFAULT_LOG_POLL`] by default), and checks only what it
//! needs: the size of the file it reads and whether the next one (index + 1, the writer
//! never skips one) exists, two `stat`s; it reads only what was added. When the next file
//! appears the current one is finished (the writer moved on) and is read to its end
//! before the next; when the current file is gone (rotated away unread) the directory is
//! listed again and reading goes on with the oldest newer file. The stream ends when the
//! task is dead (after a last read), when the alloc is gone or replaced by another
//! revision, when the client leaves, or when the API shuts down. At most
//! `api.maxLogStreams` streams are followed at once; more get 503.

use std::io::SeekFrom;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body::Frame;
use stead_schemas::api::{LOG_BACKLOG_HEADER, LogOrigin, LogStream, LogsQuery};
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::{OwnedSemaphorePermit, mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{ApiError, ApiState};
use crate::node::Node;

/// How much is read from a file at once.
const CHUNK: usize = 64 * 1024;

/// The default of `api.maxLogStreams`: log streams followed at once.
pub const DEFAULT_MAX_LOG_STREAMS: usize = 256;

/// The one timer every followed log stream waits on: a stream costs nothing between
/// ticks, and a thousand streams cost one timer, not a thousand. Started by the first
/// stream that follows, on the runtime serving it; it runs until the API shuts down (a
/// stream that finds it stopped, its runtime gone, starts another).
pub(super) struct LogTicker {
    period: Duration,
    ticks: Mutex<Option<watch::Receiver<()>>>,
}

impl LogTicker {
    pub(super) fn new(period: Duration) -> Self {
        LogTicker {
            period,
            ticks: Mutex::new(None),
        }
    }

    /// The ticks, from now on; starts the timer on the current runtime if none runs.
    fn subscribe(&self, shutdown: &CancellationToken) -> watch::Receiver<()> {
        // Every change under the lock is one assignment.
        let mut ticks = self.ticks.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(running) = ticks.as_ref().filter(|t| t.has_changed().is_ok()) {
            let mut subscribed = running.clone();
            subscribed.mark_unchanged();
            return subscribed;
        }
        let (tx, rx) = watch::channel(());
        let (period, shutdown) = (self.period, shutdown.clone());
        tokio::spawn(async move {
            let mut timer = tokio::time::interval(period);
            timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            timer.tick().await;
            loop {
                tokio::select! {
                    _ = timer.tick() => tx.send_replace(()),
                    () = shutdown.cancelled() => return,
                }
            }
        });
        *ticks = Some(rx.clone());
        rx
    }
}

/// The log files of one output of one task.
#[derive(Debug, Clone)]
struct LogFiles {
    dir: PathBuf,
    /// `<task>.<stream>.`
    prefix: String,
}

/// One file of a log.
#[derive(Debug, Clone, Copy)]
struct LogFile {
    index: u64,
    len: u64,
}

/// Where reading continues: a byte of one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cursor {
    index: u64,
    offset: u64,
}

impl LogFiles {
    fn new(data_dir: &Path, alloc_id: &str, task: &str, stream: LogStream) -> Self {
        LogFiles {
            dir: data_dir
                .join("allocs")
                .join(alloc_id)
                .join("alloc")
                .join("logs"),
            prefix: format!("{task}.{}.", stream.as_str()),
        }
    }

    fn path(&self, index: u64) -> PathBuf {
        self.dir.join(format!("{}{index}", self.prefix))
    }

    /// The files present now, oldest first; none when the directory does not exist yet.
    async fn list(&self) -> std::io::Result<Vec<LogFile>> {
        let mut entries = match tokio::fs::read_dir(&self.dir).await {
            Ok(entries) => entries,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(error) => return Err(error),
        };
        let mut files = Vec::new();
        while let Some(entry) = entries.next_entry().await? {
            let name = entry.file_name();
            let Some(index) = name
                .to_str()
                .and_then(|n| n.strip_prefix(&self.prefix))
                .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|n| n.parse::<u64>().ok())
            else {
                continue;
            };
            match entry.metadata().await {
                Ok(meta) if meta.is_file() => files.push(LogFile {
                    index,
                    len: meta.len(),
                }),
                Ok(_) => {}
                // Deleted by rotation between listing and looking.
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => return Err(error),
            }
        }
        files.sort_by_key(|f| f.index);
        Ok(files)
    }
}

/// The end of one output of a task, as the status page shows it: at most `max` of its
/// last bytes, from the start of a line when cut, and the whole log's length now (where
/// following it goes on from).
pub(super) async fn tail(
    data_dir: &Path,
    alloc_id: &str,
    task: &str,
    stream: LogStream,
    max: u64,
) -> std::io::Result<(Vec<u8>, u64)> {
    let files = LogFiles::new(data_dir, alloc_id, task, stream);
    let listed = files.list().await?;
    let total: u64 = listed.iter().map(|f| f.len).sum();
    let mut parts = Vec::new();
    let mut wanted = max;
    for file in listed.iter().rev() {
        if wanted == 0 {
            break;
        }
        let take = file.len.min(wanted);
        let mut opened = match tokio::fs::File::open(files.path(file.index)).await {
            Ok(opened) => opened,
            // Rotated away since the listing: older output, past what is shown.
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => break,
            Err(error) => return Err(error),
        };
        opened.seek(SeekFrom::Start(file.len - take)).await?;
        let mut part = Vec::new();
        opened.take(take).read_to_end(&mut part).await?;
        wanted -= take;
        parts.push(part);
    }
    let mut bytes: Vec<u8> = parts.into_iter().rev().flatten().collect();
    if (bytes.len() as u64) < total
        && let Some(newline) = bytes.iter().position(|b| *b == b'\n')
    {
        bytes.drain(..=newline);
    }
    Ok((bytes, total))
}

/// Where `offset` from `origin` falls in `files`, and how many bytes follow it now.
fn locate(files: &[LogFile], origin: LogOrigin, offset: u64) -> (Option<Cursor>, u64) {
    let total: u64 = files.iter().map(|f| f.len).sum();
    let start = match origin {
        LogOrigin::Start => offset.min(total),
        LogOrigin::End => total.saturating_sub(offset),
    };
    let mut before = 0;
    for file in files {
        if start < before + file.len {
            let cursor = Cursor {
                index: file.index,
                offset: start - before,
            };
            return (Some(cursor), total - start);
        }
        before += file.len;
    }
    // At the very end: continue after the last byte of the newest file.
    let cursor = files.last().map(|f| Cursor {
        index: f.index,
        offset: f.len,
    });
    (cursor, 0)
}

/// A response body fed by a channel; an `Err` aborts the response.
struct ChannelBody {
    chunks: mpsc::Receiver<std::io::Result<Bytes>>,
}

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.chunks
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| c.map(Frame::data)))
    }
}

/// The client went away; stop reading.
struct Gone;

/// Reads from the log and sends what it reads.
struct Reader {
    files: LogFiles,
    cursor: Option<Cursor>,
    tx: mpsc::Sender<std::io::Result<Bytes>>,
}

impl Reader {
    /// Reports `error` to the log and aborts the response.
    async fn fail(&self, error: std::io::Error) {
        tracing::warn!(dir = %self.files.dir.display(), error = %error, "reading logs failed");
        let _ = self.tx.send(Err(error)).await;
    }

    /// Sends what was added since the last read, looking only at the current file and
    /// the next; lists the directory only when the current file is gone.
    async fn catch_up(&mut self) -> Result<std::io::Result<()>, Gone> {
        loop {
            let Some(cursor) = self.cursor else {
                return self.drain().await;
            };
            // Before reading: if the next file exists, the current one is finished.
            let next = match std::fs::symlink_metadata(self.files.path(cursor.index + 1)) {
                Ok(_) => true,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => false,
                Err(error) => return Ok(Err(error)),
            };
            let len = match std::fs::metadata(self.files.path(cursor.index)) {
                Ok(meta) => meta.len(),
                // Rotated away before it was read: find where the log goes on.
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                    return self.drain().await;
                }
                Err(error) => return Ok(Err(error)),
            };
            // A file shorter than the cursor was truncated: start it over.
            let offset = if len < cursor.offset {
                0
            } else {
                cursor.offset
            };
            if len > offset || next {
                match self.read_inline(cursor.index, offset).await? {
                    Ok(end) => {
                        self.cursor = Some(Cursor {
                            index: cursor.index,
                            offset: end,
                        });
                    }
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                        return self.drain().await;
                    }
                    Err(error) => return Ok(Err(error)),
                }
            }
            if !next {
                return Ok(Ok(()));
            }
            self.cursor = Some(Cursor {
                index: cursor.index + 1,
                offset: 0,
            });
        }
    }

    /// Sends file `index` from `offset` to its current end, reading on this thread (a
    /// few pages just written, in the page cache: cheaper than a trip to the blocking
    /// pool per call); returns the end.
    async fn read_inline(&mut self, index: u64, offset: u64) -> Result<std::io::Result<u64>, Gone> {
        use std::os::unix::fs::FileExt;
        let file = match std::fs::File::open(self.files.path(index)) {
            Ok(file) => file,
            Err(error) => return Ok(Err(error)),
        };
        let mut position = offset;
        let mut buffer = vec![0; CHUNK];
        loop {
            let read = match file.read_at(&mut buffer, position) {
                Ok(0) => return Ok(Ok(position)),
                Ok(read) => read,
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(error) => return Ok(Err(error)),
            };
            position += read as u64;
            self.tx
                .send(Ok(Bytes::copy_from_slice(&buffer[..read])))
                .await
                .map_err(|_| Gone)?;
        }
    }

    /// Sends everything from the cursor to the end of the newest file.
    async fn drain(&mut self) -> Result<std::io::Result<()>, Gone> {
        loop {
            let files = match self.files.list().await {
                Ok(files) => files,
                Err(error) => return Ok(Err(error)),
            };
            let cursor = match self.cursor {
                Some(cursor) => cursor,
                None => match files.first() {
                    Some(first) => Cursor {
                        index: first.index,
                        offset: 0,
                    },
                    None => return Ok(Ok(())),
                },
            };
            let newer = files.iter().find(|f| f.index > cursor.index).copied();
            if let Some(file) = files.iter().find(|f| f.index == cursor.index) {
                // A file shorter than the cursor was truncated: start it over.
                let offset = if file.len < cursor.offset {
                    0
                } else {
                    cursor.offset
                };
                match self.read_to_end(cursor.index, offset).await? {
                    Ok(end) => {
                        self.cursor = Some(Cursor {
                            index: cursor.index,
                            offset: end,
                        });
                    }
                    // Rotated away between listing and opening: go on with the next.
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                    Err(error) => return Ok(Err(error)),
                }
            }
            match newer {
                // The writer moved on, so what was just read was the whole file.
                Some(next) => {
                    self.cursor = Some(Cursor {
                        index: next.index,
                        offset: 0,
                    });
                }
                None => return Ok(Ok(())),
            }
        }
    }

    /// Sends file `index` from `offset` to its current end; returns the end.
    async fn read_to_end(&mut self, index: u64, offset: u64) -> Result<std::io::Result<u64>, Gone> {
        let mut file = match tokio::fs::File::open(self.files.path(index)).await {
            Ok(file) => file,
            Err(error) => return Ok(Err(error)),
        };
        if let Err(error) = file.seek(SeekFrom::Start(offset)).await {
            return Ok(Err(error));
        }
        let mut position = offset;
        let mut buffer = vec![0; CHUNK];
        loop {
            let read = match file.read(&mut buffer).await {
                Ok(0) => return Ok(Ok(position)),
                Ok(read) => read,
                Err(error) => return Ok(Err(error)),
            };
            position += read as u64;
            self.tx
                .send(Ok(Bytes::copy_from_slice(&buffer[..read])))
                .await
                .map_err(|_| Gone)?;
        }
    }
}

/// When a followed log has ended: its task is dead, or its alloc is gone or replaced.
struct FollowUntil {
    node: Arc<Node>,
    alloc: String,
    alloc_id: String,
    task: String,
}

impl FollowUntil {
    fn ended(&self) -> bool {
        self.node.status(&self.alloc).is_none_or(|status| {
            status.id != self.alloc_id
                || status
                    .tasks
                    .get(&self.task)
                    .is_none_or(|task| task.state == "dead")
        })
    }
}

/// What a followed stream needs: when it ends, the ticks it waits on, and its place
/// under the cap.
struct Follow {
    until: FollowUntil,
    ticks: watch::Receiver<()>,
    _permit: OwnedSemaphorePermit,
}

/// Reads the log, then (when following) keeps reading new output until it ends.
async fn produce(mut reader: Reader, follow: Option<Follow>, shutdown: CancellationToken) {
    let Some(mut follow) = follow else {
        if let Err(error) = reader.drain().await.unwrap_or(Ok(())) {
            reader.fail(error).await;
        }
        return;
    };
    let mut listed = false;
    loop {
        let ended = follow.until.ended();
        // The first pass lists the directory; later ones look only at two files.
        let read = if listed {
            reader.catch_up().await
        } else {
            listed = true;
            reader.drain().await
        };
        match read {
            Err(Gone) => return,
            Ok(Ok(())) => {}
            Ok(Err(error)) => return reader.fail(error).await,
        }
        if ended {
            return;
        }
        tokio::select! {
            ticked = follow.ticks.changed() => if ticked.is_err() { return },
            () = shutdown.cancelled() => return,
            () = reader.tx.closed() => return,
        }
    }
}

/// `GET /v1/allocs/{name}/logs/{task}?type=stdout|stderr&follow=true&offset=N&origin=start|end`.
pub(super) async fn alloc_logs(
    State(state): State<ApiState>,
    UrlPath((name, task)): UrlPath<(String, String)>,
    query: Result<Query<LogsQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|source| ApiError::InvalidQuery { source })?;
    let status = state
        .node()
        .status(&name)
        .ok_or_else(|| ApiError::AllocNotFound { name: name.clone() })?;
    if query.previous {
        return previous_logs(&state, &status.id, name, task, &query).await;
    }
    // Only names of the alloc's tasks reach the path: they are validated names.
    if !status.tasks.contains_key(&task) {
        return Err(ApiError::TaskNotFound { alloc: name, task });
    }
    // Taken before any file is touched: a stream over the cap costs nothing.
    let permit = match query.follow {
        true => Some(
            state
                .inner
                .log_streams
                .clone()
                .try_acquire_owned()
                .map_err(|_| ApiError::TooManyLogStreams {
                    limit: state.inner.max_log_streams,
                })?,
        ),
        false => None,
    };
    let files = LogFiles::new(&state.inner.data_dir, &status.id, &task, query.stream);
    let listed = files.list().await.map_err(|source| ApiError::Logs {
        alloc: name.clone(),
        task: task.clone(),
        source,
    })?;
    let (cursor, backlog) = locate(&listed, query.origin, query.offset);
    let follow = permit.map(|permit| Follow {
        until: FollowUntil {
            node: state.node_arc(),
            alloc: name.clone(),
            alloc_id: status.id.clone(),
            task: task.clone(),
        },
        ticks: state.inner.log_ticker.subscribe(&state.inner.shutdown),
        _permit: permit,
    });
    let (tx, chunks) = mpsc::channel(4);
    let reader = Reader { files, cursor, tx };
    let span = tracing::debug_span!("logs", alloc = %name, task = %task, follow = query.follow);
    tokio::spawn(tracing::Instrument::instrument(
        produce(reader, follow, state.inner.shutdown.clone()),
        span,
    ));
    Ok(streamed(backlog, chunks))
}

/// The answer that streams `chunks`, `backlog` bytes of which existed when it was asked.
fn streamed(backlog: u64, chunks: mpsc::Receiver<std::io::Result<Bytes>>) -> Response {
    (
        StatusCode::OK,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            ),
            (
                HeaderName::from_static(LOG_BACKLOG_HEADER),
                HeaderValue::from(backlog),
            ),
        ],
        Body::new(ChannelBody { chunks }),
    )
        .into_response()
}

/// The logs of task `task` of the revision that alloc `alloc_id` replaced, from `offset`
/// and `origin` as a current log is read, never followed; 404
/// when there are none (a first revision, or a task it did not have).
async fn previous_logs(
    state: &ApiState,
    alloc_id: &str,
    name: String,
    task: String,
    query: &LogsQuery,
) -> Result<Response, ApiError> {
    // A task of the old revision need not be one of the current's; only a valid name
    // reaches the path.
    if task.parse::<stead_schemas::spec::Name>().is_err() {
        return Err(ApiError::TaskNotFound { alloc: name, task });
    }
    let mut files = LogFiles::new(&state.inner.data_dir, alloc_id, &task, query.stream);
    files.dir = files.dir.join(crate::allocdir::PREVIOUS_LOGS);
    let listed = files.list().await.map_err(|source| ApiError::Logs {
        alloc: name.clone(),
        task: task.clone(),
        source,
    })?;
    if listed.is_empty() {
        return Err(ApiError::NoPreviousLogs { alloc: name, task });
    }
    let (cursor, backlog) = locate(&listed, query.origin, query.offset);
    let (tx, chunks) = mpsc::channel(4);
    let reader = Reader { files, cursor, tx };
    tokio::spawn(produce(reader, None, state.inner.shutdown.clone()));
    Ok(streamed(backlog, chunks))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(lens: &[(u64, u64)]) -> Vec<LogFile> {
        lens.iter()
            .map(|&(index, len)| LogFile { index, len })
            .collect()
    }

    #[test]
    fn offsets_address_the_files_in_index_order_as_one_log() {
        let files = files(&[(3, 10), (4, 5)]);
        assert_eq!(
            locate(&files, LogOrigin::Start, 0),
            (
                Some(Cursor {
                    index: 3,
                    offset: 0
                }),
                15
            )
        );
        assert_eq!(
            locate(&files, LogOrigin::Start, 12),
            (
                Some(Cursor {
                    index: 4,
                    offset: 2
                }),
                3
            )
        );
        assert_eq!(
            locate(&files, LogOrigin::End, 6),
            (
                Some(Cursor {
                    index: 3,
                    offset: 9
                }),
                6
            )
        );
    }

    #[test]
    fn offsets_past_either_end_stop_at_that_end() {
        let files = files(&[(0, 4)]);
        assert_eq!(
            locate(&files, LogOrigin::Start, 100),
            (
                Some(Cursor {
                    index: 0,
                    offset: 4
                }),
                0
            )
        );
        assert_eq!(
            locate(&files, LogOrigin::End, 100),
            (
                Some(Cursor {
                    index: 0,
                    offset: 0
                }),
                4
            )
        );
        assert_eq!(locate(&[], LogOrigin::End, 5), (None, 0));
    }
}
