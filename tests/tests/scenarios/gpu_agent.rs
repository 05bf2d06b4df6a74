//! The `nvidia` device plugin through the real `stead agent`: on a host without NVML the
//! agent starts, reports no GPUs and says why in the node's status (API and CLI), and a
//! task asking for a GPU waits with the reason instead of failing.

use crate::agent_support;

use std::time::Duration;

use agent_support::{AgentDirs, wait_for};
use stead_schemas::api::NodeStatus;

const NO_NVML: &str = "/nonexistent/libnvidia-ml.so.1";

#[test]
fn without_nvml_the_nvidia_plugin_reports_no_devices_says_why_and_a_gpu_task_waits() {
    let dirs = AgentDirs::new(&format!(
        "drivers: {{mock: {{enabled: true}}}}\ndevices:\n  nvidia: {{library: {NO_NVML}}}\n"
    ));
    dirs.write_spec(
        "train",
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: train}\nspec:\n  tasks:\n    - name: main\n      driver: mock\n      config: {}\n      resources: {devices: [{name: nvidia/gpu}]}\n",
    );
    let agent = dirs.start();
    let node = wait_for(
        "the nvidia plugin's report",
        Duration::from_secs(10),
        || {
            let (code, body) = agent
                .try_get("/v1/node")
                .ok_or_else(|| "no answer".to_owned())?;
            let node: NodeStatus =
                serde_json::from_str(&body).map_err(|e| format!("{code} {e}"))?;
            match node.device_plugins.first() {
                Some(plugin) if plugin.state == "reporting" => Ok(node),
                _ => Err(body),
            }
        },
    );
    assert!(node.devices.is_empty(), "{node:#?}");
    let plugin = &node.device_plugins[0];
    assert_eq!((plugin.name.as_str(), plugin.instances), ("nvidia", 0));
    assert_eq!(plugin.reason, None, "not a failure: {plugin:?}");
    let note = plugin.note.as_deref().expect("why there are no GPUs");
    assert!(
        note.contains("NVML is not available") && note.contains(NO_NVML),
        "{note}"
    );

    let (code, text, stderr) = agent.cli(&["node", "status"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(text.contains("No devices"), "{text}");
    let plugins = text
        .split("Device Plugins\n")
        .nth(1)
        .unwrap_or_else(|| panic!("a device plugins table:\n{text}"));
    assert!(
        plugins.contains("nvidia")
            && plugins.contains("reporting")
            && plugins.contains("NVML is not available"),
        "{plugins}"
    );

    let task = agent.wait_for_task("train", "waiting for a GPU", Duration::from_secs(10), |t| {
        t.events
            .last()
            .is_some_and(|e| e.event_type == "Waiting for devices")
    });
    assert_eq!(task.state, "pending");
    let waiting = task.events.last().expect("an event");
    assert!(
        waiting.message.contains("nvidia/gpu"),
        "{}",
        waiting.message
    );
    let log = agent.log_text();
    assert!(!log.contains("ERROR"), "nothing failed:\n{log}");
}
