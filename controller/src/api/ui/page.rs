//! The status page's HTML, rendered from documents the API already serves: pure
//! functions of their inputs (no IO, no clock), so the benchmark and the tests render
//! exactly what the agent serves. Every string is interpolated through maud, which
//! escapes it: a spec's, an event's or a log's `<script>` reaches the page as text.

use std::collections::HashMap;
use std::sync::Arc;

use maud::{DOCTYPE, Markup, html};
use stead_schemas::Timestamp;
use stead_schemas::api::{AllocStats, AllocUsage, NodeStatus};
use stead_schemas::status::{AllocStatus, TaskStatus};

use super::super::handlers::last_event;

/// How often the page reloads itself when JavaScript is off, in seconds.
const REFRESH_SECONDS: u32 = 10;

/// At most this many events are listed on an alloc's page, newest first.
pub(super) const EVENTS_SHOWN: usize = 50;

/// The signals the page offers to send.
const SIGNALS: [&str; 7] = [
    "SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGKILL", "SIGUSR1", "SIGUSR2",
];

/// The node view's inputs.
pub(crate) struct NodePage<'a> {
    /// The node's document, as `GET /v1/node` serves it.
    pub(crate) node: &'a NodeStatus,
    /// Every alloc's status.
    pub(crate) allocs: &'a [Arc<AllocStatus>],
    /// What allocs use now, by name, where known.
    pub(crate) usage: &'a HashMap<String, AllocUsage>,
    /// Only allocs whose name contains it are listed (`?q=`).
    pub(crate) filter: &'a str,
}

/// One output of a task's log, as the page shows it.
pub(crate) struct LogTail {
    /// The task.
    pub(crate) task: String,
    /// `stdout` or `stderr`.
    pub(crate) stream: &'static str,
    /// Its last lines.
    pub(crate) text: String,
    /// The whole log's length when read: following goes on from there.
    pub(crate) offset: u64,
}

/// The alloc view's inputs.
pub(crate) struct AllocPage<'a> {
    /// The node's name.
    pub(crate) node_name: &'a str,
    /// The node's time now.
    pub(crate) now: Timestamp,
    /// The alloc's status document, as `GET /v1/allocs/{name}` serves it.
    pub(crate) status: &'a AllocStatus,
    /// What its running tasks use, as `GET /v1/allocs/{name}/stats` serves it.
    pub(crate) stats: Option<&'a AllocStats>,
    /// The end of each task's stdout and stderr.
    pub(crate) logs: &'a [LogTail],
}

/// Where an alloc's status sorts: failing first, then broken specs, then starting, then
/// running, then finished (the page's script ranks the API's list the same way).
pub(crate) fn rank(status: &AllocStatus) -> u8 {
    match status.client_status.as_str() {
        "failed" => 0,
        _ if status.spec_error.is_some() => 1,
        "pending" => 2,
        "running" => 3,
        _ => 4,
    }
}

/// The whole document around `main`.
fn document(
    title: &str,
    view: &str,
    node_name: &str,
    alloc: Option<&AllocStatus>,
    main: Markup,
) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · stead" }
                link rel="stylesheet" href="/ui/static/stead.css";
                // Without JavaScript, the page reloads itself; with it, it polls the API.
                noscript { meta http-equiv="refresh" content=(REFRESH_SECONDS); }
                script src="/ui/static/stead.js" defer {}
            }
            body data-view=(view) data-alloc=[alloc.map(|a| &a.name)] {
                header.top {
                    a.brand href="/ui" { "stead" }
                    span.node { (node_name) }
                    nav {
                        a href="" { "Refresh" }
                        button #forget type="button" hidden { "Forget token" }
                    }
                }
                div #notice role="status" aria-live="polite" {}
                main #main data-revision=[alloc.map(|a| &a.revision)] { (main) }
                dialog #confirm {
                    form method="dialog" {
                        p #confirm-text {}
                        menu {
                            button value="cancel" { "Cancel" }
                            button #confirm-ok value="ok" { "Confirm" }
                        }
                    }
                }
            }
        }
    }
}

/// The page an agent with a token shows a request without it: no data, a form for the
/// token (kept in the browser's session storage by the page's script).
pub(crate) fn locked(node_name: &str) -> Markup {
    let main = html! {
        section.locked {
            h1 { "This agent requires its API token" }
            p {
                "The token is in " code { "<dataDir>/api-token" } " on the node (or "
                code { "api.token" } " in the agent's config). It is kept in this tab's "
                "session storage only, and sent with each request the page makes."
            }
            form #login {
                label for="token" { "Token" }
                input #token type="password" name="token" autocomplete="off" required;
                button type="submit" { "Show the node" }
            }
            noscript { p.error { "Showing the node with a token needs JavaScript: a browser cannot send a bearer token otherwise." } }
        }
    };
    document("Token required", "locked", node_name, None, main)
}

/// A page saying what is not there.
pub(crate) fn not_found(node_name: &str, what: &str) -> Markup {
    let main = html! {
        section.missing {
            h1 { "Not found" }
            p { (what) }
            p { a href="/ui" { "Back to the node" } }
        }
    };
    document("Not found", "missing", node_name, None, main)
}

/// The node view: the node, its drivers and devices, and every alloc, failing first.
pub(crate) fn node(page: &NodePage<'_>) -> Markup {
    let node = page.node;
    let now = node.time;
    let mut allocs: Vec<&Arc<AllocStatus>> = page
        .allocs
        .iter()
        .filter(|status| status.name.contains(page.filter))
        .collect();
    allocs.sort_by(|a, b| (rank(a), &a.name).cmp(&(rank(b), &b.name)));
    let main = html! {
        section.summary {
            h1 { "Node " (node.name) }
            dl.facts {
                dt { "Version" } dd { (node.version) }
                dt { "Up" } dd { (duration(now.saturating_duration_since(node.started_at))) " (since " (node.started_at) ")" }
                dt { "Allocs" }
                dd {
                    @for (status, count) in &node.allocs {
                        span class=(format!("count s-{status}")) data-count=(status) { (count) } " " (status) " "
                    }
                }
                @if let Some(resources) = &node.resources {
                    dt { "Reserved" }
                    dd { (resources.reserved_cpu_mhz) " of " (resources.cpu_mhz) " MHz CPU, " (resources.reserved_memory_mb) " of " (resources.memory_mb) " MiB memory" }
                }
            }
            div.columns {
                div {
                    h2 { "Drivers" }
                    ul.drivers {
                        @for (name, driver) in &node.drivers {
                            li {
                                span class=(format!("health h-{}", driver.health)) { (driver.health) }
                                " " strong { (name) } ": " (driver.description)
                            }
                        }
                    }
                }
                div {
                    h2 { "Devices" }
                    @if node.devices.is_empty() {
                        p.muted { "No device plugin reports a device." }
                    } @else {
                        table.devices {
                            thead { tr { th { "Group" } th { "Instance" } th { "Health" } th { "Held by" } } }
                            tbody {
                                @for group in &node.devices {
                                    @for instance in &group.instances {
                                        tr {
                                            td { (group.vendor) "/" (group.device_type) "/" (group.name) }
                                            td { (instance.id) }
                                            td {
                                                @if instance.healthy { span.health.h-healthy { "healthy" } }
                                                @else { span.health.h-unhealthy { "unhealthy" } " " (instance.reason.as_deref().unwrap_or("")) }
                                            }
                                            td {
                                                @match &instance.held_by {
                                                    Some(holder) => { a href=(alloc_href(&holder.alloc)) { (holder.alloc) } " / " (holder.task) }
                                                    None => { span.muted { "free" } }
                                                }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                    @for plugin in &node.device_plugins {
                        p.muted {
                            "Plugin " strong { (plugin.name) } ": " (plugin.state)
                            @if let Some(reason) = &plugin.reason { ", " (reason) }
                            @if let Some(note) = &plugin.note { "; " (note) }
                        }
                    }
                }
            }
        }
        section {
            h2 { "Allocs" }
            form.filter method="get" action="/ui" {
                input #filter type="search" name="q" value=(page.filter) placeholder="Filter by name" aria-label="Filter by name";
                button type="submit" { "Filter" }
            }
            table #allocs {
                thead {
                    tr { th { "Name" } th { "Status" } th { "Tasks" } th { "Restarts" } th { "Last event" } th.num { "CPU" } th.num { "Memory" } }
                }
                tbody {
                    @for status in &allocs {
                        (alloc_row(status, page.usage.get(&status.name), now))
                    }
                }
            }
            @if allocs.is_empty() {
                p.muted #no-allocs { @if page.filter.is_empty() { "No allocs." } @else { "No alloc's name contains " q { (page.filter) } "." } }
            }
        }
    };
    document(
        &format!("Node {}", node.name),
        "node",
        &node.name,
        None,
        main,
    )
}

/// One row of the allocs table; the page's script updates the `data-f` cells in place.
fn alloc_row(status: &AllocStatus, usage: Option<&AllocUsage>, now: Timestamp) -> Markup {
    let running = status
        .tasks
        .values()
        .filter(|t| t.state == "running")
        .count();
    let restarts: u32 = status.tasks.values().map(|t| t.restarts).sum();
    let event = last_event(status);
    html! {
        tr data-alloc=(status.name) data-rank=(rank(status)) {
            td {
                a href=(alloc_href(&status.name)) { (status.name) }
                @if let Some(error) = &status.spec_error {
                    " " span.badge.b-error data-f="spec-error" title=(error.lines().next().unwrap_or_default()) { "spec error" }
                }
                @if status.stopped_by_user { " " span.badge { "stopped by a user" } }
            }
            // Rows are kept small: 2,000 of them stay under a megabyte.
            td data-f="status" class=(format!("status s-{}", status.client_status)) { (status.client_status) }
            td data-f="tasks" { (running) "/" (status.tasks.len()) }
            td data-f="restarts" { (restarts) }
            td data-f="event" {
                @if let Some(event) = &event {
                    b { (event.task) ": " (event.event_type) } " " (event.message) " " (age(event.time, now))
                }
            }
            td.num data-f="cpu" { (usage.and_then(|u| u.cpu_percent).map(percent).unwrap_or_default()) }
            td.num data-f="memory" { (usage.and_then(|u| u.memory_bytes).map(bytes).unwrap_or_default()) }
        }
    }
}

/// The alloc view: its facts, tasks, recent events and logs, with the actions.
pub(crate) fn alloc(page: &AllocPage<'_>) -> Markup {
    let status = page.status;
    let now = page.now;
    // Newest first; of a task's events at the same time, the later one first.
    let mut events: Vec<(&str, &stead_schemas::status::TaskEventStatus)> = status
        .tasks
        .iter()
        .flat_map(|(task, shown)| shown.events.iter().rev().map(move |e| (task.as_str(), e)))
        .collect();
    events.sort_by_key(|e| std::cmp::Reverse(e.1.time));
    events.truncate(EVENTS_SHOWN);
    let main = html! {
        p.crumbs { a href="/ui" { "Node " (page.node_name) } " / " (status.name) }
        h1 { (status.name) " " span data-f="status" { (client_status(&status.client_status)) } }
        dl.facts {
            dt { "ID" } dd { code { (status.id) } }
            dt { "Revision" } dd { code { (status.revision) } }
            dt { "Spec file" } dd { (status.spec_file.as_deref().unwrap_or("not read since the agent started")) }
            dt { "Desired" } dd data-f="desired" {
                (status.desired_status)
                @if status.stopped_by_user { " (stopped by a user: " code { "stead alloc start " (status.name) } " runs it again)" }
            }
            @if let Some(healthy) = status.healthy {
                dt { "Checks" } dd data-f="healthy" { @if healthy { span.health.h-healthy { "healthy" } } @else { span.health.h-unhealthy { "unhealthy" } } }
            }
        }
        @if let Some(error) = &status.spec_error {
            div.error { h2 { "Spec error" } pre data-f="spec-error" { (error) } }
        }
        @if let Some(error) = &status.state_error {
            div.error { h2 { "State error" } pre { (error) } }
        }
        div.actions {
            button type="button" data-action="restart" { "Restart alloc" }
        }
        h2 { "Tasks" }
        table #tasks {
            thead {
                tr {
                    th { "Task" } th { "Lifecycle" } th { "State" } th { "Restarts" } th { "Last event" }
                    th { "Started" } th { "Finished" } th.num { "PID" } th { "Checks" } th.num { "CPU" } th.num { "Memory" } th { "Actions" }
                }
            }
            tbody {
                @for (name, task) in &status.tasks {
                    (task_row(name, task, page.stats.and_then(|s| s.tasks.get(name)), now))
                }
            }
        }
        h2 { "Recent events" }
        table #events {
            thead { tr { th { "Time" } th { "Task" } th { "Type" } th { "Description" } } }
            tbody {
                @for (task, event) in &events {
                    tr {
                        td { (age(event.time, now)) }
                        td { (task) }
                        td { (event.event_type) }
                        td { (event.message) }
                    }
                }
            }
        }
        h2 { "Logs" }
        @for tail in page.logs {
            details.log data-task=(tail.task) data-stream=(tail.stream) data-offset=(tail.offset) {
                summary { (tail.task) " · " (tail.stream) }
                pre { (tail.text) }
            }
        }
    };
    document(&status.name, "alloc", page.node_name, Some(status), main)
}

/// One row of the tasks table; the page's script updates the `data-f` cells in place.
fn task_row(
    name: &str,
    task: &TaskStatus,
    stats: Option<&stead_schemas::api::TaskStats>,
    now: Timestamp,
) -> Markup {
    let oom = task.oom_kills > 0 || task.last_exit.as_ref().is_some_and(|e| e.oom_killed);
    html! {
        tr data-task=(name) {
            td { strong { (name) } }
            td { (task.lifecycle.as_deref().unwrap_or("main")) }
            td data-f="state" {
                span class=(format!("state t-{}{}", task.state, if task.failed { " t-failed" } else { "" })) {
                    (task.state) @if task.failed { " (failed)" }
                }
                @if oom { " " span.badge.b-error title="The kernel's OOM killer ended a run of this task" { "OOM killed" } }
            }
            td data-f="restarts" { (task.restarts) }
            td data-f="event" {
                @if let Some(event) = task.events.last() {
                    span.event-type { (event.event_type) } " " span.event-message { (event.message) }
                }
            }
            td data-f="started" { @if let Some(at) = task.started_at { (age(at, now)) } }
            td data-f="finished" { @if let Some(at) = task.finished_at { (age(at, now)) } }
            td.num data-f="pid" { @if let Some(pid) = task.pid { (pid) } }
            td data-f="checks" {
                @for check in &task.checks {
                    span class=(format!("check c-{}", check.status)) title=(check.output) { (check.name) ": " (check.status) } " "
                }
            }
            td.num { @if let Some(stats) = stats { (percent(stats.cpu_percent)) } }
            td.num { @if let Some(stats) = stats { (bytes(stats.cgroup.as_ref().and_then(|c| c.memory_bytes).unwrap_or(stats.rss_bytes))) } }
            td.actions {
                button type="button" data-action="restart" data-task=(name) { "Restart" }
                " "
                select data-signal-for=(name) aria-label=(format!("Signal for {name}")) {
                    @for signal in SIGNALS { option { (signal) } }
                }
                button type="button" data-action="signal" data-task=(name) { "Signal" }
            }
        }
    }
}

fn alloc_href(name: &str) -> String {
    // Alloc names are DNS labels: nothing in them needs encoding in a path.
    format!("/ui/allocs/{name}")
}

/// A client status as coloured text.
fn client_status(status: &str) -> Markup {
    html! { span class=(format!("status s-{status}")) { (status) } }
}

/// When `at` was, as an age on the node's clock, with the time itself for the page's
/// script to age further.
fn age(at: Timestamp, now: Timestamp) -> Markup {
    html! {
        time datetime=(at) { (duration(now.saturating_duration_since(at))) " ago" }
    }
}

/// `3s`, `4m 5s`, `2h 3m`, `5d 2h`.
pub(crate) fn duration(elapsed: std::time::Duration) -> String {
    let secs = elapsed.as_secs();
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m {}s", secs / 60, secs % 60),
        3600..86_400 => format!("{}h {}m", secs / 3600, secs / 60 % 60),
        _ => format!("{}d {}h", secs / 86_400, secs / 3600 % 24),
    }
}

fn percent(value: f64) -> String {
    format!("{value:.1}%")
}

/// Bytes in KiB, MiB or GiB, one decimal.
pub(crate) fn bytes(value: u64) -> String {
    const KIB: f64 = 1024.0;
    let value = value as f64;
    if value < KIB * KIB {
        format!("{:.1} KiB", value / KIB)
    } else if value < KIB * KIB * KIB {
        format!("{:.1} MiB", value / KIB / KIB)
    } else {
        format!("{:.1} GiB", value / KIB / KIB / KIB)
    }
}
