//! The byte stream of `stead alloc exec` once its HTTP connection is upgraded: frames of
//! one kind byte, the payload's length as a big-endian `u32`, and the payload.
//!
//! The client sends [`Frame::Stdin`], [`Frame::StdinClosed`] and [`Frame::Resize`]; the
//! agent sends [`Frame::Stdout`], [`Frame::Stderr`] and, last, [`Frame::Exit`]. The kind
//! numbers of the three streams are Docker's (0 stdin, 1 stdout, 2 stderr). A frame whose
//! kind is unknown or whose payload is over [`MAX_PAYLOAD`] ends the session.

use thiserror::Error;

/// The bytes before each payload: its kind and its length.
pub const HEADER_LEN: usize = 5;
/// The largest payload either side sends or accepts.
pub const MAX_PAYLOAD: usize = 64 * 1024;

const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const EXIT: u8 = 3;
const STDIN_CLOSED: u8 = 4;
const RESIZE: u8 = 5;

/// One frame of an exec session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Bytes for the command's standard input.
    Stdin(Vec<u8>),
    /// Bytes the command wrote to its standard output (or its terminal).
    Stdout(Vec<u8>),
    /// Bytes the command wrote to its standard error (never with a terminal).
    Stderr(Vec<u8>),
    /// The command ended with this exit code (128 + the signal's number when a signal
    /// ended it); the last frame the agent sends.
    Exit(i32),
    /// The client's input ended: the command's standard input is closed (with a
    /// terminal, the terminal's end-of-file character is typed).
    StdinClosed,
    /// The client's terminal changed size.
    Resize {
        /// Columns.
        cols: u16,
        /// Rows.
        rows: u16,
    },
}

/// A frame that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FrameError {
    /// The kind byte is none of [`Frame`]'s.
    #[error("unknown exec frame kind {kind}")]
    UnknownKind {
        /// The kind byte.
        kind: u8,
    },
    /// The payload is longer than [`MAX_PAYLOAD`].
    #[error("exec frame of {len} bytes is over the {MAX_PAYLOAD} byte limit")]
    TooLong {
        /// The announced length.
        len: usize,
    },
    /// A fixed-size payload (exit code, window size) has the wrong length.
    #[error("exec frame of kind {kind} has {len} bytes")]
    BadLength {
        /// The kind byte.
        kind: u8,
        /// The payload's length.
        len: usize,
    },
}

impl Frame {
    /// The frame as it goes on the wire. Invariant: a data payload is at most
    /// [`MAX_PAYLOAD`] bytes (senders split larger writes).
    pub fn encode(&self) -> Vec<u8> {
        let (kind, payload): (u8, std::borrow::Cow<'_, [u8]>) = match self {
            Frame::Stdin(bytes) => (STDIN, bytes.into()),
            Frame::Stdout(bytes) => (STDOUT, bytes.into()),
            Frame::Stderr(bytes) => (STDERR, bytes.into()),
            Frame::Exit(code) => (EXIT, code.to_be_bytes().to_vec().into()),
            Frame::StdinClosed => (STDIN_CLOSED, Vec::new().into()),
            Frame::Resize { cols, rows } => {
                let mut payload = cols.to_be_bytes().to_vec();
                payload.extend_from_slice(&rows.to_be_bytes());
                (RESIZE, payload.into())
            }
        };
        let len = u32::try_from(payload.len()).expect("payloads are at most MAX_PAYLOAD");
        let mut bytes = Vec::with_capacity(HEADER_LEN + payload.len());
        bytes.push(kind);
        bytes.extend_from_slice(&len.to_be_bytes());
        bytes.extend_from_slice(&payload);
        bytes
    }

    fn decode(kind: u8, payload: Vec<u8>) -> Result<Frame, FrameError> {
        let bad = |len| FrameError::BadLength { kind, len };
        Ok(match kind {
            STDIN => Frame::Stdin(payload),
            STDOUT => Frame::Stdout(payload),
            STDERR => Frame::Stderr(payload),
            EXIT => {
                let code: [u8; 4] = payload
                    .as_slice()
                    .try_into()
                    .map_err(|_| bad(payload.len()))?;
                Frame::Exit(i32::from_be_bytes(code))
            }
            STDIN_CLOSED if payload.is_empty() => Frame::StdinClosed,
            STDIN_CLOSED => return Err(bad(payload.len())),
            RESIZE => {
                let [c0, c1, r0, r1] = payload[..] else {
                    return Err(bad(payload.len()));
                };
                Frame::Resize {
                    cols: u16::from_be_bytes([c0, c1]),
                    rows: u16::from_be_bytes([r0, r1]),
                }
            }
            kind => return Err(FrameError::UnknownKind { kind }),
        })
    }
}

/// Collects bytes as they arrive and hands out whole frames (no IO of its own).
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buffered: Vec<u8>,
}

impl FrameDecoder {
    /// Adds bytes read from the connection.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buffered.extend_from_slice(bytes);
    }

    /// The next whole frame, if one has arrived.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        let Some(header) = self.buffered.get(..HEADER_LEN) else {
            return Ok(None);
        };
        let kind = header[0];
        let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        if len > MAX_PAYLOAD {
            return Err(FrameError::TooLong { len });
        }
        if self.buffered.len() < HEADER_LEN + len {
            return Ok(None);
        }
        let payload = self.buffered[HEADER_LEN..HEADER_LEN + len].to_vec();
        self.buffered.drain(..HEADER_LEN + len);
        Frame::decode(kind, payload).map(Some)
    }

    /// Whether part of a frame is still waiting for the rest of it.
    pub fn is_partial(&self) -> bool {
        !self.buffered.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_frame_survives_encoding_and_decoding_even_a_byte_at_a_time() {
        let frames = [
            Frame::Stdin(b"input".to_vec()),
            Frame::Stdout(Vec::new()),
            Frame::Stderr(vec![0xff; 300]),
            Frame::Exit(-1),
            Frame::Exit(137),
            Frame::StdinClosed,
            Frame::Resize { cols: 80, rows: 24 },
        ];
        let wire: Vec<u8> = frames.iter().flat_map(Frame::encode).collect();
        let mut decoder = FrameDecoder::default();
        let mut decoded = Vec::new();
        for byte in wire {
            decoder.push(&[byte]);
            while let Some(frame) = decoder.next_frame().expect("valid frames") {
                decoded.push(frame);
            }
        }
        assert_eq!(decoded, frames);
        assert!(!decoder.is_partial());
    }

    #[test]
    fn the_stream_kinds_are_dockers_and_the_header_is_five_bytes() {
        assert_eq!(
            Frame::Stdout(b"hi".to_vec()).encode(),
            [1, 0, 0, 0, 2, b'h', b'i']
        );
        assert_eq!(Frame::Stderr(Vec::new()).encode(), [2, 0, 0, 0, 0]);
        assert_eq!(Frame::Exit(3).encode(), [3, 0, 0, 0, 4, 0, 0, 0, 3]);
    }

    #[test]
    fn an_unknown_kind_an_oversized_or_a_malformed_frame_is_an_error() {
        let mut decoder = FrameDecoder::default();
        decoder.push(&[9, 0, 0, 0, 0]);
        assert_eq!(
            decoder.next_frame(),
            Err(FrameError::UnknownKind { kind: 9 })
        );
        let mut decoder = FrameDecoder::default();
        decoder.push(&[0, 0, 1, 0, 1]);
        assert_eq!(
            decoder.next_frame(),
            Err(FrameError::TooLong { len: 65_537 })
        );
        let mut decoder = FrameDecoder::default();
        decoder.push(&[3, 0, 0, 0, 2, 0, 1]);
        assert_eq!(
            decoder.next_frame(),
            Err(FrameError::BadLength { kind: 3, len: 2 })
        );
    }
}
