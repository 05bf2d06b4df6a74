//! The status page: `GET /ui` (the node and its allocs) and `GET /ui/allocs/{name}` (one
//! alloc's tasks, events and logs), server-rendered HTML ([`page`]) with a stylesheet
//! and a script served from the binary: nothing external, no build step.
//!
//! Without JavaScript the page reloads itself every 10 s. With it, the script polls the
//! JSON API every 2 s (one request in flight at most) and updates the page in place,
//! follows the logs a reader opens, and sends the actions (restart, signal) as POSTs to
//! the API after a confirmation.
//!
//! With a token set, a request without it gets a page that asks for the token and shows
//! nothing of the node; the script keeps the token in the tab's session storage and
//! sends it as a bearer token with every request, the page's own included. Every page
//! carries `Content-Security-Policy: default-src 'self'` (hence no inline script or
//! style) and may not be framed.

pub(crate) mod page;

use axum::Router;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use maud::Markup;
use stead_schemas::api::{LogStream, UiQuery};

use super::ApiState;
use super::handlers::{measure_stats, node_document};
use super::usage::UsageSampler;

/// How much of the end of each task's stdout and stderr an alloc's page shows.
const LOG_TAIL_BYTES: u64 = 8 * 1024;

const STYLESHEET: &str = include_str!("stead.css");
const SCRIPT: &str = include_str!("stead.js");

/// What every page's response carries: nothing but the agent's own files may load, the
/// page may not be framed (its buttons act on the node), and nothing is cached (it
/// shows the node's state, and with a token, what only the token's holder may see).
const CONTENT_SECURITY_POLICY: &str =
    "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// The page's routes, outside the token guard: each page checks the token itself.
pub(super) fn routes() -> Router<ApiState> {
    Router::new()
        .route("/", get(|| async { Redirect::to("/ui") }))
        .route("/ui", get(node_page))
        .route("/ui/", get(|| async { Redirect::to("/ui") }))
        .route("/ui/allocs/{name}", get(alloc_page))
        .route("/ui/static/stead.css", get(stylesheet))
        .route("/ui/static/stead.js", get(script))
}

/// `GET /ui`: the node view.
async fn node_page(
    State(state): State<ApiState>,
    headers: HeaderMap,
    query: Result<Query<UiQuery>, QueryRejection>,
) -> Response {
    if state.authorize(&headers).is_err() {
        return locked(&state);
    }
    // A query that does not parse filters nothing.
    let query = query.map(|Query(query)| query).unwrap_or_default();
    let node = node_document(&state).await;
    let allocs = state.node().statuses();
    let usage = UsageSampler::measure(&state, &allocs, true).await;
    html(
        StatusCode::OK,
        page::node(&page::NodePage {
            node: &node,
            allocs: &allocs,
            usage: &usage,
            filter: query.q.trim(),
        }),
    )
}

/// `GET /ui/allocs/{name}`: one alloc's view.
async fn alloc_page(
    State(state): State<ApiState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    if state.authorize(&headers).is_err() {
        return locked(&state);
    }
    let Some(status) = state.node().full_status(&name) else {
        return html(
            StatusCode::NOT_FOUND,
            page::not_found(
                &state.inner.node_name,
                &format!("No alloc is named {name:?} on this node."),
            ),
        );
    };
    let stats = measure_stats(&state, &name).await;
    let mut logs = Vec::new();
    for task in status.tasks.keys() {
        for stream in [LogStream::Stdout, LogStream::Stderr] {
            let (text, offset) = match super::logs::tail(
                &state.inner.data_dir,
                &status.id,
                task,
                stream,
                LOG_TAIL_BYTES,
            )
            .await
            {
                Ok((bytes, offset)) => (String::from_utf8_lossy(&bytes).into_owned(), offset),
                Err(error) => (format!("(cannot read this log: {error})"), 0),
            };
            logs.push(page::LogTail {
                task: task.clone(),
                stream: stream.as_str(),
                text,
                offset,
            });
        }
    }
    html(
        StatusCode::OK,
        page::alloc(&page::AllocPage {
            node_name: &state.inner.node_name,
            now: state.node().clock().now(),
            status: &status,
            stats: stats.as_ref(),
            logs: &logs,
        }),
    )
}

/// 401 with the page that asks for the token (no `WWW-Authenticate`: a browser would
/// not know the bearer scheme; the page asks instead).
fn locked(state: &ApiState) -> Response {
    html(
        StatusCode::UNAUTHORIZED,
        page::locked(&state.inner.node_name),
    )
}

/// A page's response, with the headers every page carries.
fn html(status: StatusCode, markup: Markup) -> Response {
    let mut response = (status, markup.into_string()).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    secure(headers);
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// The security headers of every response of the page, assets included.
fn secure(headers: &mut HeaderMap) {
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // Revalidated each time: a new agent's page never runs an old script.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    secure(headers);
    response
}

async fn stylesheet() -> Response {
    asset("text/css; charset=utf-8", STYLESHEET)
}

async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}
