//! The agent's config reports every problem at once, each at its file:line:col, through
//! the real `stead agent --config` (issue 35).

use std::time::Duration;

use crate::agent_support::AgentDirs;

#[test]
fn an_agent_config_with_three_problems_reports_all_three_with_their_locations_and_exits() {
    let dirs = AgentDirs::new("");
    let config = std::fs::read_to_string(&dirs.config).expect("config");
    let lines = config.lines().count();
    // Three problems on three lines, one nested under `gc`.
    std::fs::write(
        &dirs.config,
        format!("{config}maxTaskEvents: many\nlisten_addr: 127.0.0.1:1\ngc:\n  maxAllocs: 5\n  interval: 0s\n"),
    )
    .expect("config written");
    let (status, log) = dirs.launch().until_exit(Duration::from_secs(20));
    assert!(!status.success(), "{log}");
    let path = dirs.config.display();
    for (line, column, message) in [
        (lines + 1, 16, "invalid u32"),
        (lines + 2, 1, "unknown field `listen_addr`"),
        (
            lines + 5,
            13,
            "gc.interval: a period must be longer than 0s",
        ),
    ] {
        let located = format!("{path}:{line}:{column}: {message}");
        assert!(log.contains(&located), "missing {located:?} in:\n{log}");
    }
}
