//! `stead alloc exec`: a command run beside a running task over the agent's exec stream
//! (`POST /v1/allocs/{name}/exec/{task}`, upgraded), its output written as it comes and
//! its exit code returned as the CLI's.
//!
//! With `-i` this process's standard input is read on a thread of its own (a read of a
//! terminal cannot be cancelled; the thread ends with the process) and sent on. With `-t`
//! the command gets a terminal of this one's size, resized when this one is; with `-t
//! -i` on a terminal, this one is in raw mode until the command ends, so keys (`^C`
//! included) reach the command.

use std::io::{IsTerminal, Read, Write};

use anyhow::{Context, bail};
use stead_schemas::api::{EXEC_UPGRADE_PROTOCOL, ExecRequest};
use stead_schemas::exec_stream::{Frame, FrameDecoder};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use super::client::{ApiFailure, Client, encode};

/// Exit code: the command was not found (as a shell and `docker exec` say).
const EXIT_NOT_FOUND: u8 = 127;
/// Exit code: the command was found but cannot be run.
const EXIT_CANNOT_RUN: u8 = 126;
/// The most bytes of input sent in one frame.
const CHUNK: usize = 16 * 1024;

/// How the command's streams are wired.
#[derive(Debug, Clone, Copy)]
pub(super) struct Wiring {
    /// A terminal for the command.
    pub(super) tty: bool,
    /// Pass standard input on.
    pub(super) interactive: bool,
}

/// Runs `command` beside task `task` of alloc `name`; its exit code.
pub(super) async fn exec(
    client: &Client,
    name: &str,
    task: &str,
    command: Vec<String>,
    wiring: Wiring,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> anyhow::Result<u8> {
    let size = wiring.tty.then(window_size).flatten();
    let request = ExecRequest {
        command,
        tty: wiring.tty,
        stdin: wiring.interactive,
        width: size.map(|(cols, _)| cols),
        height: size.map(|(_, rows)| rows),
        term: wiring
            .tty
            .then(|| std::env::var("TERM").ok())
            .flatten()
            .filter(|term| !term.is_empty()),
    };
    let path = format!("/v1/allocs/{}/exec/{}", encode(name), encode(task));
    let upgraded = match client.upgrade(&path, EXEC_UPGRADE_PROTOCOL, &request).await {
        Ok(upgraded) => upgraded,
        Err(error) => {
            let code = match error.downcast_ref::<ApiFailure>() {
                Some(failure) if failure.body.code == "command_not_found" => EXIT_NOT_FOUND,
                Some(failure) if failure.body.code == "command_not_executable" => EXIT_CANNOT_RUN,
                _ => return Err(error),
            };
            writeln!(
                err,
                "error: {}",
                super::render::terminal_text(&format!("{error:#}"))
            )?;
            return Ok(code);
        }
    };
    let _raw = (wiring.tty && wiring.interactive)
        .then(RawMode::enter)
        .flatten();
    let (mut from_agent, mut to_agent) = tokio::io::split(upgraded);
    let mut input = wiring.interactive.then(read_stdin);
    let mut resized = if wiring.tty && size.is_some() {
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change()).ok()
    } else {
        None
    };
    let mut decoder = FrameDecoder::default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        tokio::select! {
            read = from_agent.read(&mut buf) => {
                let n = read.with_context(|| format!("reading from the stead agent at {}", client.address()))?;
                if n == 0 {
                    bail!("the stead agent at {} ended the exec session without an exit code", client.address());
                }
                decoder.push(&buf[..n]);
                while let Some(frame) = decoder.next_frame()? {
                    match frame {
                        Frame::Stdout(bytes) => {
                            out.write_all(&bytes)?;
                            out.flush()?;
                        }
                        Frame::Stderr(bytes) => {
                            err.write_all(&bytes)?;
                            err.flush()?;
                        }
                        Frame::Exit(code) => return Ok(u8::try_from(code).unwrap_or(super::EXIT_INVALID)),
                        Frame::Stdin(_) | Frame::StdinClosed | Frame::Resize { .. } => {
                            bail!("the stead agent at {} sent a frame only clients send", client.address());
                        }
                    }
                }
            }
            chunk = next_input(input.as_mut()), if input.is_some() => {
                let frame = match chunk {
                    Some(bytes) => Frame::Stdin(bytes),
                    None => {
                        input = None;
                        Frame::StdinClosed
                    }
                };
                // An agent that went away shows on the read side, with its reason.
                let _ = to_agent.write_all(&frame.encode()).await;
            }
            Some(()) = next_resize(resized.as_mut()), if resized.is_some() => {
                if let Some((cols, rows)) = window_size() {
                    let _ = to_agent.write_all(&Frame::Resize { cols, rows }.encode()).await;
                }
            }
        }
    }
}

async fn next_input(input: Option<&mut mpsc::Receiver<Vec<u8>>>) -> Option<Vec<u8>> {
    input?.recv().await
}

async fn next_resize(signal: Option<&mut tokio::signal::unix::Signal>) -> Option<()> {
    signal?.recv().await
}

/// This process's standard input, read on a thread of its own; the channel closes at
/// its end.
fn read_stdin() -> mpsc::Receiver<Vec<u8>> {
    let (sender, receiver) = mpsc::channel(4);
    let spawned = std::thread::Builder::new()
        .name("stead-exec-stdin".to_owned())
        .spawn(move || {
            let mut stdin = std::io::stdin().lock();
            let mut buf = vec![0u8; CHUNK];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => {
                        if sender.blocking_send(buf[..n].to_vec()).is_err() {
                            return;
                        }
                    }
                    Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => return,
                }
            }
        });
    // Without the thread the input simply ends at once.
    drop(spawned);
    receiver
}

/// The local terminal's size (columns, rows), when stdout or stdin is one.
fn window_size() -> Option<(u16, u16)> {
    let size = rustix::termios::tcgetwinsize(std::io::stdout())
        .or_else(|_| rustix::termios::tcgetwinsize(std::io::stdin()))
        .ok()?;
    (size.ws_col > 0 && size.ws_row > 0).then_some((size.ws_col, size.ws_row))
}

/// The local terminal in raw mode, restored when dropped.
struct RawMode {
    saved: rustix::termios::Termios,
}

impl RawMode {
    /// Raw mode for standard input, when it is a terminal.
    fn enter() -> Option<RawMode> {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return None;
        }
        let saved = rustix::termios::tcgetattr(&stdin).ok()?;
        let mut raw = saved.clone();
        raw.make_raw();
        rustix::termios::tcsetattr(&stdin, rustix::termios::OptionalActions::Now, &raw).ok()?;
        Some(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = rustix::termios::tcsetattr(
            std::io::stdin(),
            rustix::termios::OptionalActions::Now,
            &self.saved,
        );
    }
}
