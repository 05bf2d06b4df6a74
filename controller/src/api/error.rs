//! [`ApiError`]: every way a request fails, each with its status and stable code, and the
//! JSON body ([`ErrorBody`]) it becomes.
//!
//! Client errors (4xx) say what to fix; internal ones (5xx) are also logged, by the
//! middleware in [`super`], which finds their message in the response's extensions.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use stead_schemas::api::ErrorBody;
use thiserror::Error;

use crate::driver::DriverError;
use crate::queue::CommandError;

/// A request that failed.
#[derive(Debug, Error)]
pub enum ApiError {
    /// No alloc has that name.
    #[error("alloc {name:?} not found")]
    AllocNotFound {
        /// The name asked for.
        name: String,
    },
    /// The alloc has no task of that name.
    #[error("task {task:?} not found in alloc {alloc:?}")]
    TaskNotFound {
        /// The alloc.
        alloc: String,
        /// The task asked for.
        task: String,
    },
    /// No logs of a replaced revision are kept for the task.
    #[error(
        "no logs of a previous revision of task {task:?} of alloc {alloc:?}: none was replaced since it was created, or that revision had no such task"
    )]
    NoPreviousLogs {
        /// The alloc.
        alloc: String,
        /// The task.
        task: String,
    },
    /// The command needs a running task (or, for a whole-alloc restart, some running task).
    #[error("{}", match task {
        Some(task) => format!("task {task:?} of alloc {alloc:?} is not running"),
        None => format!("no task of alloc {alloc:?} is running"),
    })]
    TaskNotRunning {
        /// The alloc.
        alloc: String,
        /// The task, unless the command was for every task.
        task: Option<String>,
    },
    /// The alloc's state refuses the command: a start of an alloc whose spec stops it or
    /// is gone, garbage collection of one that runs or is still declared.
    #[error(transparent)]
    Conflict {
        /// What the alloc answered.
        source: CommandError,
    },
    /// The signal name is not one stead knows.
    #[error("{reason}")]
    InvalidSignal {
        /// Why, with the names that are accepted.
        reason: String,
    },
    /// The request body is not the JSON document the endpoint takes.
    #[error("invalid request body")]
    InvalidBody {
        /// What the parser found.
        #[source]
        source: serde_json::Error,
    },
    /// The request body could not be read.
    #[error("cannot read the request body")]
    UnreadableBody {
        /// Why.
        #[source]
        source: axum::extract::rejection::BytesRejection,
    },
    /// The query string does not parse.
    #[error("invalid query")]
    InvalidQuery {
        /// What the parser found.
        #[source]
        source: axum::extract::rejection::QueryRejection,
    },
    /// The request lacks the bearer token the agent requires, or carries another one.
    #[error("{}", if *missing { "missing bearer token" } else { "invalid bearer token" })]
    Unauthorized {
        /// Whether no token was sent at all.
        missing: bool,
    },
    /// A browser sent the request from a page of another origin (its `Origin` header
    /// names another host than `Host`): a page elsewhere must not act on the agent.
    #[error("cross-origin request from {origin} refused")]
    CrossOrigin {
        /// The `Origin` header.
        origin: String,
    },
    /// The request body is larger than the agent accepts.
    #[error("request body larger than {limit} bytes")]
    BodyTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// No endpoint has that path.
    #[error("no endpoint {path}")]
    RouteNotFound {
        /// The path asked for.
        path: String,
    },
    /// The endpoint exists, but not with that method.
    #[error("method {method} not allowed on {path}")]
    MethodNotAllowed {
        /// The method used.
        method: String,
        /// The path.
        path: String,
    },
    /// The agent was started without metrics.
    #[error("metrics are not enabled on this agent")]
    MetricsDisabled,
    /// The metrics were not rendered: the agent is shutting down.
    #[error("the metrics were not rendered: the agent is shutting down")]
    MetricsInterrupted,
    /// The metrics could not be rendered.
    #[error("cannot render the metrics")]
    Metrics {
        /// What the encoder reported.
        #[source]
        source: std::fmt::Error,
    },
    /// The alloc's worker is gone: the agent is shutting down.
    #[error("alloc {name:?} is shutting down")]
    ShuttingDown {
        /// The alloc.
        name: String,
    },
    /// The driver failed to carry out the command.
    #[error("the driver failed on task {task:?} of alloc {alloc:?}")]
    Driver {
        /// The alloc.
        alloc: String,
        /// The task.
        task: String,
        /// What the driver reported.
        #[source]
        source: Box<DriverError>,
    },
    /// As many log streams are followed as the agent allows (`api.maxLogStreams`).
    #[error(
        "the agent follows at most {limit} log streams at once (api.maxLogStreams); try again later"
    )]
    TooManyLogStreams {
        /// The cap.
        limit: usize,
    },
    /// An exec request without `Connection: Upgrade` and `Upgrade: stead-exec`, or on a
    /// connection that cannot be switched.
    #[error(
        "exec needs an HTTP/1.1 connection upgraded to stead-exec (Connection: Upgrade, Upgrade: stead-exec)"
    )]
    UpgradeRequired,
    /// An exec request with no program.
    #[error("the command is empty")]
    EmptyCommand,
    /// As many commands run as the agent allows (`api.maxExecs`).
    #[error("the agent runs at most {limit} exec commands at once (api.maxExecs); try again later")]
    TooManyExecs {
        /// The cap.
        limit: usize,
    },
    /// The task's driver has no context to run a command in (the mock driver).
    #[error(transparent)]
    ExecUnsupported(Box<DriverError>),
    /// The command could not start: it is not found, or not executable.
    #[error(transparent)]
    CommandNotStarted(Box<DriverError>),
    /// Reading the task's log files failed.
    #[error("cannot read the logs of task {task:?} of alloc {alloc:?}")]
    Logs {
        /// The alloc.
        alloc: String,
        /// The task.
        task: String,
        /// What the file system reported.
        #[source]
        source: std::io::Error,
    },
}

/// The message of a 5xx response, kept in its extensions for the logging middleware.
#[derive(Debug, Clone)]
pub(crate) struct InternalErrorMessage(pub(crate) String);

/// A name a request asked for that names nothing, kept in a 404's extensions with the
/// body, for the middleware that suggests the closest name ([`super::suggest_names`]):
/// every endpoint that answers [`ApiError::AllocNotFound`] or [`ApiError::TaskNotFound`]
/// gets the suggestion without knowing the names itself.
#[derive(Debug, Clone)]
pub(crate) struct MissingName {
    /// The alloc asked for, or the alloc whose task was asked for.
    pub(crate) alloc: String,
    /// The task asked for, when it is the task that is missing.
    pub(crate) task: Option<String>,
    /// The body as answered, before a suggestion.
    pub(crate) body: ErrorBody,
}

impl ApiError {
    /// Maps a failed user command on alloc `alloc` (and `task`, when it named one).
    pub(crate) fn from_command(error: CommandError, alloc: &str, task: Option<&str>) -> Self {
        use stead_reconcilers::alloc::CommandRefusal;
        match error {
            CommandError::UnknownAlloc { name } => ApiError::AllocNotFound { name },
            CommandError::Refused(CommandRefusal::UnknownTask(task)) => ApiError::TaskNotFound {
                alloc: alloc.to_owned(),
                task: task.to_string(),
            },
            CommandError::Refused(CommandRefusal::TaskNotRunning) => ApiError::TaskNotRunning {
                alloc: alloc.to_owned(),
                task: task.map(str::to_owned),
            },
            CommandError::Driver { task, source } => ApiError::Driver {
                alloc: alloc.to_owned(),
                task,
                source: Box::new(source),
            },
            CommandError::ShuttingDown { name } => ApiError::ShuttingDown { name },
            error @ (CommandError::NotCollectable { .. }
            | CommandError::SpecGone { .. }
            | CommandError::SpecStops { .. }) => ApiError::Conflict { source: error },
        }
    }

    /// Maps a failed start of a command beside task `task` of alloc `alloc`.
    pub(crate) fn from_exec(error: DriverError, alloc: &str, task: &str) -> Self {
        match &error {
            DriverError::ExecUnsupported { .. } => ApiError::ExecUnsupported(Box::new(error)),
            DriverError::ExecStart { source, .. }
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
                ) =>
            {
                ApiError::CommandNotStarted(Box::new(error))
            }
            _ => ApiError::Driver {
                alloc: alloc.to_owned(),
                task: task.to_owned(),
                source: Box::new(error),
            },
        }
    }

    /// The response status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::AllocNotFound { .. }
            | ApiError::TaskNotFound { .. }
            | ApiError::NoPreviousLogs { .. }
            | ApiError::RouteNotFound { .. }
            | ApiError::MetricsDisabled => StatusCode::NOT_FOUND,
            ApiError::TaskNotRunning { .. } | ApiError::Conflict { .. } => StatusCode::CONFLICT,
            ApiError::InvalidSignal { .. }
            | ApiError::EmptyCommand
            | ApiError::ExecUnsupported(_)
            | ApiError::CommandNotStarted(_)
            | ApiError::InvalidBody { .. }
            | ApiError::UnreadableBody { .. }
            | ApiError::InvalidQuery { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            ApiError::CrossOrigin { .. } => StatusCode::FORBIDDEN,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::UpgradeRequired => StatusCode::UPGRADE_REQUIRED,
            ApiError::ShuttingDown { .. }
            | ApiError::MetricsInterrupted
            | ApiError::TooManyLogStreams { .. }
            | ApiError::TooManyExecs { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Driver { .. } | ApiError::Logs { .. } | ApiError::Metrics { .. } => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// The stable machine-readable code of [`ErrorBody::code`].
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::AllocNotFound { .. } => "alloc_not_found",
            ApiError::TaskNotFound { .. } => "task_not_found",
            ApiError::NoPreviousLogs { .. } => "no_previous_logs",
            ApiError::TaskNotRunning { .. } => "task_not_running",
            ApiError::Conflict { source } => match source {
                CommandError::SpecGone { .. } => "spec_gone",
                CommandError::SpecStops { .. } => "spec_stops",
                _ => "not_collectable",
            },
            ApiError::InvalidSignal { .. } => "invalid_signal",
            ApiError::InvalidBody { .. }
            | ApiError::UnreadableBody { .. }
            | ApiError::InvalidQuery { .. }
            | ApiError::EmptyCommand => "invalid_request",
            ApiError::UpgradeRequired => "upgrade_required",
            ApiError::TooManyExecs { .. } => "too_many_execs",
            ApiError::ExecUnsupported(_) => "exec_unsupported",
            ApiError::CommandNotStarted(error) => match error.as_ref() {
                DriverError::ExecStart { source, .. }
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    "command_not_found"
                }
                _ => "command_not_executable",
            },
            ApiError::Unauthorized { .. } => "unauthorized",
            ApiError::CrossOrigin { .. } => "cross_origin",
            ApiError::BodyTooLarge { .. } => "body_too_large",
            ApiError::RouteNotFound { .. } => "not_found",
            ApiError::MethodNotAllowed { .. } => "method_not_allowed",
            ApiError::MetricsDisabled => "metrics_disabled",
            ApiError::ShuttingDown { .. } | ApiError::MetricsInterrupted => "shutting_down",
            ApiError::TooManyLogStreams { .. } => "too_many_log_streams",
            ApiError::Driver { .. } => "driver_error",
            ApiError::Logs { .. } | ApiError::Metrics { .. } => "internal",
        }
    }

    /// The JSON body: the code and the whole chain of causes, `outer: inner`.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            code: self.code().to_owned(),
            message: crate::errors::error_chain(self),
            details: Vec::new(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = self.body();
        let mut response = super::json_response(status, &body);
        if status.is_server_error() {
            response
                .extensions_mut()
                .insert(InternalErrorMessage(body.message.clone()));
        }
        match &self {
            ApiError::AllocNotFound { name } => {
                response.extensions_mut().insert(MissingName {
                    alloc: name.clone(),
                    task: None,
                    body,
                });
            }
            ApiError::TaskNotFound { alloc, task } => {
                response.extensions_mut().insert(MissingName {
                    alloc: alloc.clone(),
                    task: Some(task.clone()),
                    body,
                });
            }
            _ => {}
        }
        if let ApiError::Unauthorized { .. } = self {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"stead\""),
            );
        }
        response
    }
}
