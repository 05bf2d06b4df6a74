//! The agent's own log: `tracing` events to stderr, as text for people or JSON lines for
//! machines, filtered by `STEAD_LOG` (or `RUST_LOG`; default `info`).
//!
//! The worker opens a span per alloc (`alloc=<name>`) and per task run (`task=<name>`),
//! so every line about a task names its alloc and task.
//!
//! One event is one line in either format: JSON escapes its strings, and text lines pass
//! through [`EscapedLines`], which shows a newline, carriage return or other control
//! character inside an event (user text: a YAML key, a file name) escaped, so no spec
//! can forge a log line or send a terminal a command.

use std::borrow::Cow;
use std::io::{IsTerminal, Write};

use thiserror::Error;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

/// The environment variable holding the log filter (`tracing` directives such as
/// `info,stead_controller::alloc=debug`); `RUST_LOG` is read when it is unset.
pub const LOG_FILTER_ENV: &str = "STEAD_LOG";

/// How log lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Human-readable lines; coloured when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line, with the span fields, for log collectors.
    Json,
}

impl LogFormat {
    /// `text` on a terminal, `json` otherwise: what an unconfigured agent uses.
    pub fn detect() -> Self {
        if std::io::stderr().is_terminal() {
            LogFormat::Text
        } else {
            LogFormat::Json
        }
    }
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!(
                "unknown log format {other:?}; expected text or json"
            )),
        }
    }
}

/// Why logging could not be set up.
#[derive(Debug, Error)]
pub enum LoggingError {
    /// The filter in `STEAD_LOG` or `RUST_LOG` does not parse.
    #[error("invalid log filter {filter:?}")]
    Filter {
        /// The filter as given.
        filter: String,
        /// Why it does not parse.
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    /// A global subscriber is already set in this process.
    #[error("logging is already initialised")]
    AlreadyInitialised(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Sends the agent's `tracing` events to stderr in `format`; call once, early.
pub fn init_logging(format: LogFormat) -> Result<(), LoggingError> {
    let filter = std::env::var(LOG_FILTER_ENV)
        .or_else(|_| std::env::var(EnvFilter::DEFAULT_ENV))
        .unwrap_or_else(|_| "info".to_owned());
    let env_filter = EnvFilter::try_new(&filter).map_err(|source| LoggingError::Filter {
        filter: filter.clone(),
        source,
    })?;
    let result = match format {
        LogFormat::Text => {
            let ansi = std::io::stderr().is_terminal();
            tracing_subscriber::fmt()
                .with_env_filter(env_filter)
                .with_writer(EscapedLines::new(std::io::stderr, ansi))
                .with_ansi(ansi)
                .try_init()
        }
        LogFormat::Json => tracing_subscriber::fmt()
            .with_env_filter(env_filter)
            .with_writer(std::io::stderr)
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .try_init(),
    };
    result.map_err(LoggingError::AlreadyInitialised)
}

/// A writer of text log lines that escapes the control characters inside each: the
/// formatter writes an event as one buffer ending in its newline, and only that last
/// newline goes through as it is. ESC goes through only where the formatter colours
/// (`ansi`), and there the formatter escapes it in field values itself.
#[derive(Debug, Clone, Copy)]
pub struct EscapedLines<M> {
    inner: M,
    ansi: bool,
}

impl<M> EscapedLines<M> {
    /// Lines to `inner`, coloured when `ansi`.
    pub fn new(inner: M, ansi: bool) -> Self {
        EscapedLines { inner, ansi }
    }
}

impl<'a, M: MakeWriter<'a>> MakeWriter<'a> for EscapedLines<M> {
    type Writer = EscapingWriter<M::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        EscapingWriter {
            inner: self.inner.make_writer(),
            ansi: self.ansi,
        }
    }
}

/// The writer [`EscapedLines`] makes for one event.
#[derive(Debug)]
pub struct EscapingWriter<W> {
    inner: W,
    ansi: bool,
}

impl<W: Write> Write for EscapingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.write_all(&escape_line(buf, self.ansi))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// `line` with every control character but its final newline, a tab and (when `ansi`)
/// ESC written as `\n`, `\r` or `\xNN`.
fn escape_line(line: &[u8], ansi: bool) -> Cow<'_, [u8]> {
    let (body, end) = match line.strip_suffix(b"\n") {
        Some(body) => (body, &b"\n"[..]),
        None => (line, &b""[..]),
    };
    let escaped = |b: u8| (b < 0x20 && b != b'\t' && !(ansi && b == 0x1b)) || b == 0x7f;
    if !body.iter().copied().any(escaped) {
        return Cow::Borrowed(line);
    }
    let mut out = Vec::with_capacity(line.len() + 16);
    for &b in body {
        match b {
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b if escaped(b) => out.extend_from_slice(format!("\\x{b:02x}").as_bytes()),
            b => out.push(b),
        }
    }
    out.extend_from_slice(end);
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer the subscriber writes to and the test reads.
    #[derive(Clone, Default)]
    struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Issue 34: a newline in a YAML key forged a line of the text log, and an ESC byte
    /// reached the terminal.
    #[test]
    fn a_text_log_event_is_one_line_whatever_its_message_and_fields_hold() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(EscapedLines::new(move || writer.clone(), false))
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(
                file = "x\ry.yaml",
                "specs/x.yaml:9:7: a\nb\u{1b}[31mRED\n2026-01-01T00:00:00Z  INFO forged"
            );
        });
        let text = String::from_utf8(captured.0.lock().expect("lock").clone()).expect("utf-8");
        assert_eq!(text.matches('\n').count(), 1, "{text:?}");
        assert!(text.ends_with('\n'));
        assert!(!text.contains('\u{1b}') && !text.contains('\r'), "{text:?}");
        assert!(text.contains("a\\nb"), "{text:?}");
    }

    #[test]
    fn only_the_final_newline_and_colour_codes_where_asked_pass_unescaped() {
        assert_eq!(&*escape_line(b"plain\ttext\n", false), b"plain\ttext\n");
        assert_eq!(&*escape_line(b"a\nb\r\x07\n", false), b"a\\nb\\r\\x07\n");
        assert_eq!(&*escape_line(b"\x1b[31mred\n", true), b"\x1b[31mred\n");
        assert_eq!(&*escape_line(b"\x1b[31mred\n", false), b"\\x1b[31mred\n");
    }

    #[test]
    fn log_formats_parse_from_their_config_names() {
        assert_eq!("text".parse::<LogFormat>(), Ok(LogFormat::Text));
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert!("yaml".parse::<LogFormat>().is_err());
    }
}
