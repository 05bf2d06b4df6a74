//! `/metrics` through the real `stead agent` binary and real processes: a task that exits
//! and restarts is counted per task, every scrape taken while it restarts passes
//! `promtool check metrics` (the Prometheus text format) and the reference OpenMetrics
//! parser (OpenMetrics, which promtool does not read), and deleting an alloc's spec
//! removes its series.
//!
//! The linters come from `scripts/install-deps.sh` (Debian's `prometheus` and
//! `python3-prometheus-client`); without them these tests say so and check nothing,
//! except under `CI=true`, where they fail.

use crate::agent_support;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use agent_support::{Agent, AgentDirs, wait_for};

/// What a scraper of the Prometheus text format asks for.
const PROMETHEUS_ACCEPT: &str = "text/plain;version=0.0.4;q=1,*/*;q=0.1";
/// What Prometheus 2.42 asks for.
const OPENMETRICS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// The interpreter that has Debian's `python3-prometheus-client`.
const PYTHON: &str = "/usr/bin/python3";
/// Parses standard input with the reference OpenMetrics parser, which refuses anything
/// the format does not allow (a missing `# EOF`, a counter sample without `_total`, a
/// clash of names).
const OPENMETRICS_CHECK: &str = "import sys\nfrom prometheus_client.openmetrics.parser import text_string_to_metric_families as parse\nfor family in parse(sys.stdin.read()):\n    assert family.documentation, family.name + ' has no help'\n";

/// Whether `promtool` and the OpenMetrics parser run here; under `CI=true`, a missing one
/// fails the test.
fn linters_available() -> bool {
    let runs = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
    };
    let mut missing = Vec::new();
    if !runs("promtool", &["--version"]) {
        missing.push("promtool (Debian's prometheus)");
    }
    if !runs(
        PYTHON,
        &["-c", "import prometheus_client.openmetrics.parser"],
    ) {
        missing.push("Python's prometheus_client (Debian's python3-prometheus-client)");
    }
    if missing.is_empty() {
        return true;
    }
    let message = format!(
        "{} not found: install with scripts/install-deps.sh",
        missing.join(" and ")
    );
    assert!(std::env::var("CI").as_deref() != Ok("true"), "{message}");
    eprintln!("skipped: {message}");
    false
}

/// Runs `program` with `args` on `text` as standard input: what it said when it failed.
fn lint(program: &str, args: &[&str], text: &str) -> Result<(), String> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|error| panic!("{program} starts: {error}"));
    child
        .stdin
        .take()
        .expect("a stdin")
        .write_all(text.as_bytes())
        .expect("the scrape written");
    let output = child.wait_with_output().expect("the linter ends");
    if output.status.success() {
        return Ok(());
    }
    Err(format!(
        "{program}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    ))
}

/// A scrape in the Prometheus text format, checked by promtool.
fn scrape_prometheus(agent: &Agent) -> String {
    let (code, content_type, text) = agent
        .get_accepting("/metrics", PROMETHEUS_ACCEPT)
        .expect("the agent answers");
    assert_eq!(code, 200, "{text}");
    assert_eq!(content_type, "text/plain; version=0.0.4; charset=utf-8");
    if let Err(said) = lint("promtool", &["check", "metrics"], &text) {
        panic!("{said}\nof the scrape:\n{text}");
    }
    text
}

/// A scrape in OpenMetrics, checked by the reference parser.
fn scrape_openmetrics(agent: &Agent) -> String {
    let (code, content_type, text) = agent
        .get_accepting("/metrics", OPENMETRICS_ACCEPT)
        .expect("the agent answers");
    assert_eq!(code, 200, "{text}");
    assert_eq!(
        content_type,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    if let Err(said) = lint(PYTHON, &["-c", OPENMETRICS_CHECK], &text) {
        panic!("{said}\nof the scrape:\n{text}");
    }
    text
}

/// The value of the series `series` (name and labels, exactly as rendered).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map(|value| value.parse().expect("a number"))
}

/// Alloc `web`, whose task `server` exits 1 after 200 ms and is restarted 100 ms later.
fn restarting_web() -> String {
    "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web}\nspec:\n  restart: {attempts: 1000, interval: 10m, delay: 100ms, mode: fail}\n  tasks:\n    - name: server\n      driver: exec\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"sleep 0.2; exit 1\"]\n".to_owned()
}

#[test]
fn scrapes_taken_while_a_task_restarts_pass_both_linters_and_count_its_restarts() {
    if !linters_available() {
        return;
    }
    let dirs = AgentDirs::new("");
    dirs.write_spec("web", &restarting_web());
    let agent = dirs.start();
    let restarts_series = r#"stead_task_restarts_total{alloc="web",task="server"}"#;
    let mut scrapes = 0;
    wait_for(
        "three restarts, scraped all along",
        Duration::from_secs(30),
        || {
            let before = agent
                .status("web")
                .map_or(0, |s| s.tasks["server"].restarts);
            let text = scrape_prometheus(&agent);
            let openmetrics = scrape_openmetrics(&agent);
            let after = agent
                .status("web")
                .map_or(0, |s| s.tasks["server"].restarts);
            scrapes += 1;
            let Some(counted) = value(&text, restarts_series) else {
                return Err(format!("no {restarts_series} yet in:\n{text}"));
            };
            assert!(
                f64::from(before) <= counted && counted <= f64::from(after),
                "{counted} restarts scraped between statuses with {before} and {after}"
            );
            assert!(
                value(&openmetrics, restarts_series).is_some(),
                "the same series in OpenMetrics:\n{openmetrics}"
            );
            let states: f64 = ["pending", "running", "dead"]
                .iter()
                .map(|state| {
                    value(
                        &text,
                        &format!(
                            r#"stead_task_state{{alloc="web",task="server",state="{state}"}}"#
                        ),
                    )
                    .expect("every state has a series")
                })
                .sum();
            assert_eq!(states, 1.0, "one current state:\n{text}");
            if counted >= 3.0 {
                Ok(())
            } else {
                Err(format!("{counted} restarts after {scrapes} scrapes"))
            }
        },
    );
    assert!(scrapes >= 2, "scraped while it restarted, not only after");
}

#[test]
fn deleting_an_allocs_spec_removes_its_series_from_the_next_scrapes() {
    if !linters_available() {
        return;
    }
    let dirs = AgentDirs::new("");
    dirs.write_spec("web", &restarting_web());
    let agent = dirs.start();
    wait_for("web's series", Duration::from_secs(30), || {
        let text = scrape_prometheus(&agent);
        if text.contains(r#"alloc="web""#) {
            Ok(())
        } else {
            Err(text)
        }
    });

    dirs.remove_spec("web");
    wait_for("no series of web", Duration::from_secs(30), || {
        let text = scrape_prometheus(&agent);
        if text.contains(r#"alloc="web""#) {
            Err(text)
        } else {
            Ok(())
        }
    });
    let openmetrics = scrape_openmetrics(&agent);
    assert!(!openmetrics.contains(r#"alloc="web""#), "{openmetrics}");
    assert!(
        agent
            .status("web")
            .is_some_and(|s| s.desired_status == "stop"),
        "the alloc stays listed, stopped, until garbage collection"
    );
}
