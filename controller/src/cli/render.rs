//! How the CLI shows the agent's documents to people: Nomad-style `key = value` blocks
//! and borderless tables, coloured only when asked to (a terminal).
//!
//! Every string of a document is shown with its control characters but newline and tab
//! escaped ([`terminal_safe`]): what the agent reports (event messages, spec errors,
//! check output, file names) may carry a spec's text, and reaches the terminal as text,
//! never as a command.

use std::borrow::Cow;
use std::fmt::Write as _;

use comfy_table::presets::NOTHING;
use comfy_table::{Cell, Color, ContentArrangement, Table};
use stead_schemas::Timestamp;
use stead_schemas::api::{
    AllocListItem, AllocStats, CgroupStats, HealthStatus, NodeStatus, TaskStats,
};
use stead_schemas::status::{AllocStatus, TaskStatus};

/// `text` with its control characters but newline and tab escaped (`\u{1b}`).
pub(crate) fn terminal_text(text: &str) -> Cow<'_, str> {
    let shown = |c: char| !c.is_control() || c == '\n' || c == '\t';
    if text.chars().all(shown) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if shown(c) {
            out.push(c);
        } else {
            let _ = write!(out, "{}", c.escape_default());
        }
    }
    Cow::Owned(out)
}

/// `value` with [`terminal_text`] applied to every string and key; whether anything
/// changed.
fn escape_strings(value: &mut serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::String(text) => match terminal_text(text) {
            Cow::Borrowed(_) => false,
            Cow::Owned(escaped) => {
                *text = escaped;
                true
            }
        },
        Value::Array(items) => items
            .iter_mut()
            .fold(false, |changed, item| escape_strings(item) | changed),
        Value::Object(map) => {
            let mut changed = false;
            let entries = std::mem::take(map);
            for (key, mut item) in entries {
                changed |= escape_strings(&mut item);
                let key = match terminal_text(&key) {
                    Cow::Borrowed(_) => key,
                    Cow::Owned(escaped) => {
                        changed = true;
                        escaped
                    }
                };
                map.insert(key, item);
            }
            changed
        }
        _ => false,
    }
}

/// `document` with [`terminal_text`] applied to all its strings (itself when none needs
/// it).
fn terminal_safe<T: serde::Serialize + serde::de::DeserializeOwned + Clone>(document: &T) -> T {
    let Ok(mut value) = serde_json::to_value(document) else {
        return document.clone();
    };
    if !escape_strings(&mut value) {
        return document.clone();
    }
    serde_json::from_value(value).unwrap_or_else(|_| document.clone())
}

/// How many events of each task `alloc status` shows, newest first.
pub(crate) const RECENT_EVENTS: usize = 10;

/// Whether output is coloured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Style {
    pub(crate) colour: bool,
}

impl Style {
    /// `text` in `colour` (an ANSI SGR code) when colouring.
    fn paint(self, text: &str, colour: Option<Color>) -> String {
        let code = match colour {
            Some(Color::Green) => "32",
            Some(Color::Red) => "31",
            Some(Color::Yellow) => "33",
            Some(Color::Blue) => "34",
            _ => return text.to_owned(),
        };
        if self.colour {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_owned()
        }
    }

    fn table(self) -> Table {
        let mut table = Table::new();
        table
            .load_style(NOTHING)
            .set_content_arrangement(ContentArrangement::Disabled)
            .force_no_tty();
        if self.colour {
            table.enforce_styling();
        }
        table
    }

    /// Renders `table` with two spaces between columns and no trailing blanks.
    fn finish(self, mut table: Table) -> String {
        let columns = table.column_count();
        for (i, column) in table.column_iter_mut().enumerate() {
            column.set_padding((0, if i + 1 == columns { 0 } else { 2 }));
        }
        let mut text = table.trim_fmt();
        text.push('\n');
        text
    }
}

/// The colour of a client status or task state.
fn status_colour(status: &str) -> Option<Color> {
    match status {
        "running" | "healthy" | "passing" | "reporting" => Some(Color::Green),
        "failed" | "unhealthy" | "critical" => Some(Color::Red),
        "pending" | "undetected" | "warning" | "starting" => Some(Color::Yellow),
        "complete" => Some(Color::Blue),
        _ => None,
    }
}

fn status_cell(style: Style, status: &str) -> Cell {
    let cell = Cell::new(status);
    match status_colour(status) {
        Some(colour) if style.colour => cell.fg(colour),
        _ => cell,
    }
}

fn time(at: Option<Timestamp>) -> String {
    at.map_or_else(|| "N/A".to_owned(), |t| t.to_string())
}

/// `key = value` lines with the `=` aligned, as Nomad prints them.
fn key_values(rows: &[(&str, String)]) -> String {
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut text = String::new();
    for (key, value) in rows {
        let _ = writeln!(text, "{key:<width$} = {value}");
    }
    text
}

/// `stead alloc list`.
pub(crate) fn alloc_list(style: Style, allocs: &[AllocListItem]) -> String {
    let allocs = &terminal_safe(&allocs.to_vec());
    if allocs.is_empty() {
        return "No allocs\n".to_owned();
    }
    let mut table = style.table();
    table.set_header([
        "Name", "ID", "Desired", "Status", "Tasks", "Restarts", "Modified",
    ]);
    for alloc in allocs {
        let status = if alloc.spec_error {
            format!("{} (spec error)", alloc.client_status)
        } else {
            alloc.client_status.clone()
        };
        table.add_row(vec![
            Cell::new(&alloc.name),
            Cell::new(&alloc.id),
            Cell::new(&alloc.desired_status),
            status_cell(style, &status),
            Cell::new(format!("{}/{} running", alloc.running_tasks, alloc.tasks)),
            Cell::new(alloc.restarts),
            Cell::new(time(alloc.modified_at)),
        ]);
    }
    style.finish(table)
}

/// `stead alloc status`: the alloc, then each task with what it uses (from `stats`, when
/// the agent measured it) and its recent events, newest first.
pub(crate) fn alloc_status(
    style: Style,
    alloc: &AllocStatus,
    stats: Option<&AllocStats>,
) -> String {
    let alloc = &terminal_safe(alloc);
    let stats = stats.map(terminal_safe);
    let stats = stats.as_ref();
    let mut rows = vec![
        ("ID", alloc.id.clone()),
        ("Name", alloc.name.clone()),
        ("Revision", alloc.revision.clone()),
        (
            "Desired Status",
            if alloc.stopped_by_user {
                format!(
                    "{} (stopped by a user: `stead alloc start {}` runs it again)",
                    alloc.desired_status, alloc.name
                )
            } else {
                alloc.desired_status.clone()
            },
        ),
        (
            "Client Status",
            style.paint(&alloc.client_status, status_colour(&alloc.client_status)),
        ),
    ];
    if let Some(healthy) = alloc.healthy {
        let shown = if healthy { "healthy" } else { "unhealthy" };
        rows.push(("Health", style.paint(shown, status_colour(shown))));
    }
    if let Some(error) = &alloc.spec_error {
        rows.push(("Spec Error", style.paint(error, Some(Color::Red))));
    }
    let mut text = key_values(&rows);
    for (name, task) in &alloc.tasks {
        text.push('\n');
        let usage = stats.and_then(|s| s.tasks.get(name));
        text.push_str(&task_status(style, name, task, usage));
    }
    text
}

/// `bytes` in MiB with one decimal.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// A task's use and limits as its cgroup counts them: one table row.
fn resources(style: Style, cgroup: &CgroupStats) -> String {
    let unlimited = || "unlimited".to_owned();
    let mut table = style.table();
    table.set_header([
        "CPU Time",
        "Throttled",
        "Memory",
        "Memory Peak",
        "Memory Limit",
        "Pids",
        "Pids Limit",
        "OOM Kills",
    ]);
    table.add_row([
        format!("{:.2}s", cgroup.cpu_seconds),
        cgroup
            .cpu_throttled_seconds
            .map_or_else(|| "N/A".to_owned(), |s| format!("{s:.2}s")),
        cgroup.memory_bytes.map_or_else(|| "N/A".to_owned(), mib),
        cgroup
            .memory_peak_bytes
            .map_or_else(|| "N/A".to_owned(), mib),
        cgroup.memory_limit_bytes.map_or_else(unlimited, mib),
        cgroup
            .pids
            .map_or_else(|| "N/A".to_owned(), |p| p.to_string()),
        cgroup.pids_limit.map_or_else(unlimited, |p| p.to_string()),
        cgroup.oom_kills.to_string(),
    ]);
    style.finish(table)
}

/// A task's use in one line: `CPU 12.5% (3.21s), Memory 14.2 MiB, 2 processes`.
fn usage_line(usage: &TaskStats) -> String {
    format!(
        "CPU {:.1}% ({:.2}s), Memory {}, {} {}",
        usage.cpu_percent,
        usage.cpu_seconds,
        mib(usage.rss_bytes),
        usage.processes,
        if usage.processes == 1 {
            "process"
        } else {
            "processes"
        }
    )
}

/// `stead alloc stats`: what each running task uses, then each device it holds.
pub(crate) fn alloc_stats(style: Style, stats: &AllocStats) -> String {
    let stats = terminal_safe(stats);
    let mut table = style.table();
    table.set_header([
        "Task",
        "CPU",
        "CPU Time",
        "Memory (RSS)",
        "Processes",
        "Memory (cgroup)",
        "Memory Limit",
        "OOM Kills",
    ]);
    let unlimited = || "unlimited".to_owned();
    let none = || "N/A".to_owned();
    for (task, usage) in &stats.tasks {
        let cgroup = usage.cgroup.as_ref();
        table.add_row([
            task.clone(),
            format!("{:.1}%", usage.cpu_percent),
            format!("{:.2}s", usage.cpu_seconds),
            mib(usage.rss_bytes),
            usage.processes.to_string(),
            cgroup.and_then(|c| c.memory_bytes).map_or_else(none, mib),
            cgroup.map_or_else(none, |c| c.memory_limit_bytes.map_or_else(unlimited, mib)),
            cgroup.map_or_else(none, |c| c.oom_kills.to_string()),
        ]);
    }
    let mut text = format!("Alloc {:?} at {}\n", stats.name, stats.time);
    if stats.tasks.is_empty() {
        text.push_str("No running task is measured\n");
    } else {
        text.push_str(&style.finish(table));
    }
    for (task, devices) in &stats.task_devices {
        for device in devices {
            let measured = device.stats.as_ref().map_or_else(none, |values| {
                values
                    .iter()
                    .map(|(key, value)| format!("{key}={value}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            });
            let _ = writeln!(
                text,
                "Device {}/{} of {task:?}: {measured}",
                device.group, device.id
            );
        }
    }
    text
}

fn task_status(style: Style, name: &str, task: &TaskStatus, usage: Option<&TaskStats>) -> String {
    let state = style.paint(&task.state, status_colour(&task.state));
    let mut text = format!("Task {name:?} is \"{state}\"\n");
    text.push_str(&key_values(&[
        ("Started At", time(task.started_at)),
        ("Finished At", time(task.finished_at)),
        ("Total Restarts", task.restarts.to_string()),
        ("Last Restart", time(task.last_restart)),
        (
            "Failed",
            if task.failed {
                style.paint("true", Some(Color::Red))
            } else {
                "false".to_owned()
            },
        ),
        (
            "PID",
            task.pid.map_or_else(|| "N/A".to_owned(), |p| p.to_string()),
        ),
    ]));
    if let Some(exit) = task.last_exit.as_ref().filter(|e| e.oom_killed) {
        let _ = writeln!(
            text,
            "{}",
            style.paint(
                &format!("Last run OOM killed at {}", exit.time),
                Some(Color::Red)
            )
        );
    }
    if let Some(usage) = usage {
        let _ = writeln!(text, "Resources:       {}", usage_line(usage));
        if let Some(cgroup) = &usage.cgroup {
            text.push('\n');
            text.push_str(&resources(style, cgroup));
        }
    }
    if !task.checks.is_empty() {
        text.push_str("\nChecks:\n");
        let mut table = style.table();
        table.set_header(["Name", "Status", "Since", "Output"]);
        for check in &task.checks {
            table.add_row([
                Cell::new(&check.name),
                status_cell(style, &check.status),
                Cell::new(time(check.since)),
                Cell::new(output_line(&check.output)),
            ]);
        }
        text.push_str(&style.finish(table));
    }
    text.push_str("\nRecent Events:\n");
    if task.events.is_empty() {
        text.push_str("No events\n");
        return text;
    }
    let mut table = style.table();
    table.set_header(["Time", "Type", "Description"]);
    for event in task.events.iter().rev().take(RECENT_EVENTS) {
        table.add_row([
            event.time.to_string(),
            event.event_type.clone(),
            event.message.clone(),
        ]);
    }
    text.push_str(&style.finish(table));
    let older = task.events.len().saturating_sub(RECENT_EVENTS);
    if older > 0 {
        let _ = writeln!(
            text,
            "({older} older {}; --json shows every event)",
            if older == 1 { "event" } else { "events" }
        );
    }
    text
}

/// The longest check output a status table shows; `--json` shows all of it.
const CHECK_OUTPUT_SHOWN: usize = 80;

/// A check's output on one line of a table: its first line, cut at
/// [`CHECK_OUTPUT_SHOWN`] characters, control characters (a service's escape sequences)
/// shown as U+FFFD rather than sent to the terminal.
fn output_line(output: &str) -> String {
    let line = output.lines().next().unwrap_or("").trim_end();
    let mut shown: String = line
        .chars()
        .take(CHECK_OUTPUT_SHOWN)
        .map(|c| if c.is_control() { '\u{fffd}' } else { c })
        .collect();
    if shown.len() < line.len() || output.lines().nth(1).is_some() {
        shown.push('…');
    }
    shown
}

/// `stead node health`: the overall status, then each part with whether it works and,
/// when the agent said (to a client with its token), what it knows of it.
pub(crate) fn health(style: Style, health: &HealthStatus) -> String {
    let health = &terminal_safe(health);
    let mut text = key_values(&[("Status", health.status.clone())]);
    let mut table = style.table();
    let messages = health.components.values().any(|c| c.message.is_some());
    if messages {
        table.set_header(["Component", "Health", "Message"]);
    } else {
        table.set_header(["Component", "Health"]);
    }
    for (name, component) in &health.components {
        let state = if component.healthy {
            "healthy"
        } else {
            "unhealthy"
        };
        let mut row = vec![Cell::new(name), status_cell(style, state)];
        if messages {
            row.push(Cell::new(component.message.as_deref().unwrap_or("")));
        }
        table.add_row(row);
    }
    text.push('\n');
    text.push_str(&style.finish(table));
    text
}

/// `stead node status`.
pub(crate) fn node_status(style: Style, node: &NodeStatus) -> String {
    let node = &terminal_safe(node);
    let allocs = ["running", "pending", "complete", "failed"]
        .iter()
        .map(|s| format!("{} {s}", node.allocs.get(*s).copied().unwrap_or(0)))
        .collect::<Vec<_>>()
        .join(", ");
    let mut rows = vec![
        ("Name", node.name.clone()),
        ("Version", node.version.clone()),
        ("Started At", node.started_at.to_string()),
        ("Time", node.time.to_string()),
        ("Allocs", allocs),
    ];
    if let Some(resources) = &node.resources {
        rows.push((
            "CPU",
            format!(
                "{} MHz ({} cores x {} MHz), {} MHz reserved",
                resources.cpu_mhz,
                resources.cpu_cores,
                resources.cpu_mhz_per_core,
                resources.reserved_cpu_mhz
            ),
        ));
        rows.push((
            "Memory",
            format!(
                "{} MiB, {} MiB reserved",
                resources.memory_mb, resources.reserved_memory_mb
            ),
        ));
    }
    let mut text = key_values(&rows);
    text.push_str("\nDrivers\n");
    if node.drivers.is_empty() {
        text.push_str("No drivers\n");
    } else {
        let mut table = style.table();
        table.set_header(["Driver", "Health", "Description"]);
        for (name, driver) in &node.drivers {
            table.add_row(vec![
                Cell::new(name),
                status_cell(style, &driver.health),
                Cell::new(&driver.description),
            ]);
        }
        text.push_str(&style.finish(table));
        let mut attributes = style.table();
        attributes.set_header(["Driver", "Attribute", "Value"]);
        for (name, driver) in &node.drivers {
            for (key, value) in &driver.attributes {
                attributes.add_row([name, key, value]);
            }
        }
        if attributes.row_count() > 0 {
            text.push_str("\nDriver Attributes\n");
            text.push_str(&style.finish(attributes));
        }
    }
    text.push_str("\nDevices\n");
    if node.devices.is_empty() {
        text.push_str("No devices\n");
    } else {
        let mut table = style.table();
        table.set_header(["Device", "Plugin", "Health", "Held By"]);
        let mut attributes = style.table();
        attributes.set_header(["Device", "Attribute", "Value"]);
        for group in &node.devices {
            let id = format!("{}/{}/{}", group.vendor, group.device_type, group.name);
            for (key, value) in &group.attributes {
                attributes.add_row([&id, key, value]);
            }
            for instance in &group.instances {
                let health = match (&instance.reason, instance.healthy) {
                    (_, true) => "healthy".to_owned(),
                    (Some(reason), false) => format!("unhealthy: {reason}"),
                    (None, false) => "unhealthy".to_owned(),
                };
                let holder = instance
                    .held_by
                    .as_ref()
                    .map_or_else(String::new, |h| format!("{}/{}", h.alloc, h.task));
                let device = format!("{id}/{}", instance.id);
                table.add_row(vec![
                    Cell::new(&device),
                    Cell::new(group.plugin.as_deref().unwrap_or("")),
                    status_cell(style, &health),
                    Cell::new(holder),
                ]);
                for (key, value) in &instance.attributes {
                    attributes.add_row([&device, key, value]);
                }
            }
        }
        text.push_str(&style.finish(table));
        if attributes.row_count() > 0 {
            text.push_str("\nDevice Attributes\n");
            text.push_str(&style.finish(attributes));
        }
    }
    if !node.device_plugins.is_empty() {
        text.push_str("\nDevice Plugins\n");
        let mut table = style.table();
        table.set_header(["Plugin", "State", "Instances", "Says"]);
        for plugin in &node.device_plugins {
            let says = [plugin.reason.as_deref(), plugin.note.as_deref()]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join("; ");
            table.add_row(vec![
                Cell::new(&plugin.name),
                status_cell(style, &plugin.state),
                Cell::new(plugin.instances),
                Cell::new(says),
            ]);
        }
        text.push_str(&style.finish(table));
    }
    text
}

/// The last `lines` lines of `bytes` (all of it when it has fewer), and whether it had
/// more than that (so the cut is known to fall on a line start).
pub(crate) fn tail_lines(bytes: &[u8], lines: usize) -> (&[u8], bool) {
    if lines == 0 {
        return (&[], !bytes.is_empty());
    }
    let body = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    let mut seen = 0;
    for (i, byte) in body.iter().enumerate().rev() {
        if *byte == b'\n' {
            seen += 1;
            if seen == lines {
                return (&bytes[i + 1..], true);
            }
        }
    }
    (bytes, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_lines_keeps_the_last_complete_lines() {
        assert_eq!(tail_lines(b"a\nb\nc\n", 2), (&b"b\nc\n"[..], true));
        assert_eq!(tail_lines(b"a\nb\nc", 2), (&b"b\nc"[..], true));
        assert_eq!(tail_lines(b"a\nb\n", 5), (&b"a\nb\n"[..], false));
        assert_eq!(tail_lines(b"a\n", 0), (&b""[..], true));
    }

    #[test]
    fn check_output_shows_one_line_without_control_characters() {
        assert_eq!(output_line("ok"), "ok");
        assert_eq!(output_line("a\nb"), "a…");
        assert_eq!(
            output_line("\u{1b}]0;pwned\u{7}red"),
            "\u{fffd}]0;pwned\u{fffd}red"
        );
        assert_eq!(
            output_line(&"x".repeat(100)).chars().count(),
            CHECK_OUTPUT_SHOWN + 1
        );
    }

    #[test]
    fn a_tasks_cgroup_use_and_limits_show_as_one_row_and_an_oom_kill_as_a_line() {
        let cgroup = CgroupStats {
            memory_bytes: Some(12 * 1024 * 1024),
            memory_peak_bytes: Some(64 * 1024 * 1024),
            memory_limit_bytes: Some(64 * 1024 * 1024),
            cpu_seconds: 1.5,
            cpu_throttled_seconds: Some(0.25),
            pids: Some(3),
            pids_limit: None,
            oom_kills: 1,
        };
        let style = Style { colour: false };
        assert_eq!(
            resources(style, &cgroup),
            "CPU Time  Throttled  Memory    Memory Peak  Memory Limit  Pids  Pids Limit  OOM Kills\n\
             1.50s     0.25s      12.0 MiB  64.0 MiB     64.0 MiB      3     unlimited   1\n"
        );
        let task = TaskStatus {
            state: "dead".to_owned(),
            lifecycle: None,
            failed: true,
            restarts: 0,
            oom_kills: 1,
            last_restart: None,
            started_at: None,
            finished_at: None,
            pid: None,
            last_exit: Some(stead_schemas::status::TaskExitStatus {
                time: Timestamp::EPOCH,
                exit_code: 137,
                signal: Some(9),
                oom_killed: true,
            }),
            devices: Vec::new(),
            checks: Vec::new(),
            events: Vec::new(),
        };
        let usage = TaskStats {
            cpu_percent: 12.5,
            cpu_seconds: 1.5,
            rss_bytes: 10 * 1024 * 1024,
            processes: 2,
            cgroup: Some(cgroup),
        };
        let text = task_status(style, "main", &task, Some(&usage));
        assert!(
            text.contains(
                "Last run OOM killed at 1970-01-01T00:00:00Z\n\
                 Resources:       CPU 12.5% (1.50s), Memory 10.0 MiB, 2 processes\n\nCPU Time"
            ),
            "{text}"
        );
    }

    /// Issue 34: an ESC byte in what the agent reports (a spec's file name in a health
    /// message, a key in a spec error) reached the terminal.
    #[test]
    fn control_characters_of_the_agents_strings_reach_the_terminal_escaped() {
        let status = HealthStatus {
            status: "degraded".to_owned(),
            components: [(
                "source\u{1b}]0;x\u{7}".to_owned(),
                stead_schemas::api::ComponentHealth {
                    healthy: false,
                    message: Some("specs/\u{1b}[2Jx.yaml:\r cannot read\nsecond line".to_owned()),
                },
            )]
            .into(),
        };
        let text = health(Style { colour: false }, &status);
        assert!(
            !text.contains(['\u{1b}', '\u{7}', '\r']),
            "control characters reached the terminal: {text:?}"
        );
        assert!(
            text.contains("specs/\\u{1b}[2Jx.yaml:\\r cannot read"),
            "{text}"
        );
        assert!(text.contains("source\\u{1b}]0;x\\u{7}"), "{text}");
        assert_eq!(terminal_text("two\nlines\tkept"), "two\nlines\tkept");
    }

    #[test]
    fn key_values_align_on_the_equals_sign() {
        let text = key_values(&[("ID", "x".to_owned()), ("Client Status", "y".to_owned())]);
        assert_eq!(text, "ID            = x\nClient Status = y\n");
    }
}
