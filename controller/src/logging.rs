//! The agent's own log: `tracing` events to stderr, as text for people or JSON lines for
//! machines, filtered by `STEAD_LOG` (or `RUST_LOG`; default `info`).
//!
//! The worker opens a span per alloc (`alloc=<name>`) and per task run (`task=<name>`),
//! so every line about a task names its alloc and task.

use std::io::IsTerminal;

use thiserror::Error;
use tracing_subscriber::EnvFilter;

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
    let builder = tracing_subscriber::fmt()
        .with_env_filter(env_filter)
        .with_writer(std::io::stderr);
    let result = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .try_init(),
    };
    result.map_err(LoggingError::AlreadyInitialised)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_formats_parse_from_their_config_names() {
        assert_eq!("text".parse::<LogFormat>(), Ok(LogFormat::Text));
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert!("yaml".parse::<LogFormat>().is_err());
    }
}
