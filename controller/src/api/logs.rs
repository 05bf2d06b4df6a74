//! `GET /v1/allocs/{name}/logs/{task}`: a task's stdout or stderr, read from its rotating
//! files, optionally followed across rotations.
//!
//! The exec driver's log writer keeps `<data-dir>/allocs/<alloc-id>/alloc/logs/` with
//! `<task>.<stdout|stderr>.<N>`: the highest `N` is the file being written, lower ones are
//! older, and the oldest are deleted past `maxFiles`. Files are never renamed, so a
//! position is a file index plus an offset into it. The log as a whole is the files in
//! index order; `offset` and `origin` address bytes of that whole.
//!
//! Following polls the directory (every [`super::DEFAULT_LOG_POLL`] by default): when a
//! newer file appears the current one is finished (the writer moved on) and is read to
//! its end before the newer one; a file deleted before it was read is skipped. The stream
//! ends when the task is dead (after a last read), when the alloc is gone or replaced by
//! another revision, when the client leaves, or when the API shuts down.

use std::io::SeekFrom;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body::Frame;
use stead_schemas::api::{LOG_BACKLOG_HEADER, LogOrigin, LogStream, LogsQuery};
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{ApiError, ApiState};
use crate::node::Node;

/// How much is read from a file at once.
const CHUNK: usize = 64 * 1024;

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

/// Reads the log, then (when following) keeps reading new output until it ends.
async fn produce(
    mut reader: Reader,
    follow: Option<FollowUntil>,
    poll: std::time::Duration,
    shutdown: CancellationToken,
) {
    loop {
        let ended = follow.as_ref().is_none_or(FollowUntil::ended);
        match reader.drain().await {
            Err(Gone) => return,
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::warn!(dir = %reader.files.dir.display(), error = %error, "reading logs failed");
                let _ = reader.tx.send(Err(error)).await;
                return;
            }
        }
        if ended {
            return;
        }
        tokio::select! {
            () = tokio::time::sleep(poll) => {}
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
    // Only names of the alloc's tasks reach the path: they are validated names.
    if !status.tasks.contains_key(&task) {
        return Err(ApiError::TaskNotFound { alloc: name, task });
    }
    let files = LogFiles::new(&state.inner.data_dir, &status.id, &task, query.stream);
    let listed = files.list().await.map_err(|source| ApiError::Logs {
        alloc: name.clone(),
        task: task.clone(),
        source,
    })?;
    let (cursor, backlog) = locate(&listed, query.origin, query.offset);
    let follow = query.follow.then(|| FollowUntil {
        node: state.node_arc(),
        alloc: name.clone(),
        alloc_id: status.id.clone(),
        task: task.clone(),
    });
    let (tx, chunks) = mpsc::channel(4);
    let reader = Reader { files, cursor, tx };
    let span = tracing::debug_span!("logs", alloc = %name, task = %task, follow = query.follow);
    tokio::spawn(tracing::Instrument::instrument(
        produce(
            reader,
            follow,
            state.inner.log_poll,
            state.inner.shutdown.clone(),
        ),
        span,
    ));
    Ok((
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
        .into_response())
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
