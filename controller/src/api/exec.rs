//! `POST /v1/allocs/{name}/exec/{task}` (`stead alloc exec`): a command started beside a
//! running task by its driver, its streams carried over the same HTTP/1.1 connection
//! once upgraded (`Upgrade: stead-exec`), as [`stead_schemas::exec_stream`] frames.
//!
//! Every refusal (token, unknown alloc or task, task not running, too many execs, a
//! command that cannot start) is an ordinary JSON error before the upgrade; a `101`
//! means the command runs. The agent sends its output, then one `Exit` frame, then
//! closes. The client going away (its connection's end), a frame that cannot be read,
//! or the API's shutdown kills the command's whole process group; so does the command's
//! own end, for what it left behind. At most [`DEFAULT_MAX_EXECS`] (`api.maxExecs`) run
//! at once.

use std::pin::Pin;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use stead_schemas::api::{EXEC_UPGRADE_PROTOCOL, ExecRequest};
use stead_schemas::exec_stream::{Frame, FrameDecoder};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;

use super::handlers::{parse_body, task_name};
use super::{ApiError, ApiState};
use crate::driver::{
    DriverError, ExecSession, ExecSessionRequest, WindowSize, exec::SessionProcess, exec::Terminal,
};

/// The default of `api.maxExecs`: commands run at once; more get 503.
pub const DEFAULT_MAX_EXECS: usize = 16;

/// How long a driver may take to start a command.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long output is still read after the command ended (its group is killed by then;
/// only a process that left the group can hold a stream open longer).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);
/// The most bytes read from a stream into one frame.
const CHUNK: usize = 16 * 1024;
/// What a terminal takes for the end of input: `^D`.
const END_OF_INPUT: u8 = 0x04;

type Writer = Pin<Box<dyn AsyncWrite + Send>>;
type Reader = Pin<Box<dyn AsyncRead + Send>>;

/// Whether the request asks to switch to the exec stream.
fn wants_exec_stream(headers: &HeaderMap) -> bool {
    let has = |name: header::HeaderName, token: &str| {
        headers.get_all(name).iter().any(|value| {
            value
                .to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
        })
    };
    has(header::CONNECTION, "upgrade") && has(header::UPGRADE, EXEC_UPGRADE_PROTOCOL)
}

/// `POST /v1/allocs/{name}/exec/{task}` with an [`ExecRequest`] body and
/// `Connection: Upgrade`, `Upgrade: stead-exec`: `101` once the command runs.
pub(super) async fn alloc_exec(
    State(state): State<ApiState>,
    Path((name, task)): Path<(String, String)>,
    request: Request,
) -> Result<Response, ApiError> {
    if !wants_exec_stream(request.headers()) {
        return Err(ApiError::UpgradeRequired);
    }
    let (mut parts, body) = request.into_parts();
    let on_upgrade = parts.extensions.remove::<OnUpgrade>();
    let body = Bytes::from_request(Request::from_parts(parts, body), &()).await;
    let exec: ExecRequest = parse_body(body, None)?;
    let Some((program, args)) = exec.command.split_first() else {
        return Err(ApiError::EmptyCommand);
    };
    let task_name = task_name(&name, &task)?;
    let permit =
        state
            .inner
            .execs
            .clone()
            .try_acquire_owned()
            .map_err(|_| ApiError::TooManyExecs {
                limit: state.inner.max_execs,
            })?;
    let target = state
        .node()
        .exec_target(&name, task_name)
        .await
        .map_err(|error| ApiError::from_command(error, &name, Some(&task)))?;
    // Only a connection served by hyper can be switched (not a test's `oneshot`).
    let on_upgrade = on_upgrade.ok_or(ApiError::UpgradeRequired)?;
    let tty = exec.tty.then(|| {
        let default = WindowSize::default();
        WindowSize {
            cols: exec.width.filter(|w| *w > 0).unwrap_or(default.cols),
            rows: exec.height.filter(|h| *h > 0).unwrap_or(default.rows),
        }
    });
    let mut env = target.env;
    if let (Some(_), Some(term)) = (tty, &exec.term) {
        env.entry("TERM".to_owned()).or_insert_with(|| term.clone());
    }
    let request = ExecSessionRequest {
        alloc_id: target.alloc_id.clone(),
        task: target.task.clone(),
        command: program.clone(),
        args: args.to_vec(),
        env,
        user: target.user,
        tty,
        stdin: exec.stdin,
    };
    let started = tokio::time::timeout(START_TIMEOUT, target.driver.exec_session(request))
        .await
        .unwrap_or_else(|_| {
            Err(DriverError::Exec {
                alloc_id: target.alloc_id.clone(),
                task: target.task.clone(),
                command: program.clone(),
                message: format!("the driver did not start it within {START_TIMEOUT:?}"),
            })
        });
    let session = started.map_err(|error| ApiError::from_exec(error, &name, &task))?;
    tracing::info!(alloc = %name, task = %task, command = %program, tty = exec.tty, stdin = exec.stdin, "exec started");
    let stop = state.shutdown_token();
    tokio::spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => {
                serve_session(TokioIo::new(upgraded), session, exec.tty, stop, permit).await;
            }
            // The client left before the switch: the command dies with `session`.
            Err(error) => tracing::debug!(%error, "exec connection not upgraded"),
        }
        tracing::info!(alloc = %name, task = %task, "exec ended");
    });
    Ok(Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, HeaderValue::from_static("upgrade"))
        .header(
            header::UPGRADE,
            HeaderValue::from_static(EXEC_UPGRADE_PROTOCOL),
        )
        .body(Body::empty())
        .expect("a static response is valid"))
}

/// Carries one command's streams over `io` until it ended and its exit code was sent,
/// the client went away or sent something unreadable, or `stop`; then nothing of the
/// command is left.
async fn serve_session<Io: AsyncRead + AsyncWrite + Send>(
    io: Io,
    session: ExecSession,
    tty: bool,
    stop: CancellationToken,
    _permit: OwnedSemaphorePermit,
) {
    let (mut from_client, mut to_client) = tokio::io::split(io);
    let ExecSession {
        stdin,
        stdout,
        stderr,
        terminal,
        mut process,
    } = session;
    let input = forward_input(&mut from_client, stdin, terminal.as_ref(), tty);
    let output = forward_output(&mut to_client, stdout, stderr, &mut process);
    tokio::select! {
        () = input => tracing::debug!("exec client gone"),
        result = output => {
            if let Err(error) = result {
                tracing::debug!(%error, "exec output not delivered");
            }
        }
        () = stop.cancelled() => {}
    }
    // `process`, if its command still runs, kills the whole group as it is dropped.
}

/// Writes the client's input into the command until the client goes away or sends a
/// frame that cannot be read.
async fn forward_input<R: AsyncRead + Unpin>(
    from_client: &mut R,
    mut stdin: Option<Writer>,
    terminal: Option<&Terminal>,
    tty: bool,
) {
    let mut decoder = FrameDecoder::default();
    let mut buf = vec![0u8; CHUNK];
    loop {
        let read = match from_client.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        decoder.push(&buf[..read]);
        loop {
            let frame = match decoder.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(error) => {
                    tracing::debug!(%error, "exec client sent an unreadable frame");
                    return;
                }
            };
            match frame {
                Frame::Stdin(bytes) => {
                    if let Some(writer) = stdin.as_mut()
                        && writer.write_all(&bytes).await.is_err()
                    {
                        // The command closed its input: what follows has no reader.
                        stdin = None;
                    }
                }
                Frame::StdinClosed if tty => {
                    if let Some(writer) = stdin.as_mut() {
                        let _ = writer.write_all(&[END_OF_INPUT]).await;
                    }
                }
                Frame::StdinClosed => stdin = None,
                Frame::Resize { cols, rows } => {
                    if let Some(terminal) = terminal {
                        let _ = terminal.resize(WindowSize { cols, rows });
                    }
                }
                Frame::Stdout(_) | Frame::Stderr(_) | Frame::Exit(_) => {
                    tracing::debug!("exec client sent a frame only the agent sends");
                    return;
                }
            }
        }
    }
}

/// Sends the command's output until it ended and its streams are drained (within
/// [`DRAIN_TIMEOUT`] of its end), then its exit code.
async fn forward_output<W: AsyncWrite + Unpin>(
    to_client: &mut W,
    mut stdout: Reader,
    mut stderr: Option<Reader>,
    process: &mut SessionProcess,
) -> std::io::Result<()> {
    let mut out_buf = vec![0u8; CHUNK];
    let mut err_buf = vec![0u8; CHUNK];
    let (mut out_open, mut err_open) = (true, stderr.is_some());
    let exit = process.wait();
    tokio::pin!(exit);
    let mut code = None;
    // Armed once the command ended.
    let mut drained: Option<Pin<Box<tokio::time::Sleep>>> = None;
    while code.is_none() || out_open || err_open {
        tokio::select! {
            ended = &mut exit, if code.is_none() => {
                code = Some(ended?);
                drained = Some(Box::pin(tokio::time::sleep(DRAIN_TIMEOUT)));
            }
            read = stdout.read(&mut out_buf), if out_open => match read {
                Ok(0) | Err(_) => out_open = false,
                Ok(n) => send(to_client, &Frame::Stdout(out_buf[..n].to_vec())).await?,
            },
            read = read_some(stderr.as_mut(), &mut err_buf), if err_open => match read {
                Ok(0) | Err(_) => err_open = false,
                Ok(n) => send(to_client, &Frame::Stderr(err_buf[..n].to_vec())).await?,
            },
            () = until(drained.as_mut()), if drained.is_some() => break,
        }
    }
    let code = code.expect("the loop ends only after the command did");
    send(to_client, &Frame::Exit(code)).await?;
    to_client.shutdown().await
}

async fn until(deadline: Option<&mut Pin<Box<tokio::time::Sleep>>>) {
    match deadline {
        Some(deadline) => deadline.await,
        None => std::future::pending().await,
    }
}

async fn read_some(reader: Option<&mut Reader>, buf: &mut [u8]) -> std::io::Result<usize> {
    match reader {
        Some(reader) => reader.read(buf).await,
        None => Ok(0),
    }
}

async fn send<W: AsyncWrite + Unpin>(to_client: &mut W, frame: &Frame) -> std::io::Result<()> {
    to_client.write_all(&frame.encode()).await?;
    to_client.flush().await
}
