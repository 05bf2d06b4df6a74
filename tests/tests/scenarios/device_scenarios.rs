//! Devices through the node with the `static` plugin and health files: placement that
//! waits for a free device, health flips under a running holder, a plugin that dies and
//! comes back, assignments across an agent restart over RocksDB, per-group stats and
//! the node's devices through the API, an unknown device, and the ids in a real
//! process's environment.
//!
//! The mock-driver scenarios run under paused time; the exec one uses real processes.

use crate::api_support;
use crate::exec_support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use api_support::Transport;
use stead_controller::api::ApiState;
use stead_controller::clock::Clock;
use stead_controller::devices::{DeviceManager, DevicePlugin, StaticPlugin};
use stead_controller::driver::mock::{MockDriver, MockOp};
use stead_controller::driver::{Driver, Drivers};
use stead_controller::node::{Node, NodeConfig};
use stead_controller::queue::Shutdown;
use stead_controller::store::{RocksDbOptions, RocksDbStore, Store};
use stead_schemas::api::{AllocStats, DeviceGroupStatus, NodeStatus};
use stead_schemas::config::{StaticDeviceGroup, StaticDeviceInstance};
use stead_schemas::status::AllocStatus;
use stead_schemas::{Timestamp, ValidSpec};

/// 2026-11-22T00:00:00Z.
const START: Duration = Duration::from_secs(1_795_305_600);
const DEADLINE: Duration = Duration::from_secs(600);
/// How often the static plugin reads its health files in these tests.
const HEALTH_INTERVAL: Duration = Duration::from_secs(1);

/// `acme/gpu/a1` with instances `ids`, health read from `dir`.
fn gpus(dir: &Path, ids: &[&str]) -> Arc<DeviceManager> {
    let group = StaticDeviceGroup {
        vendor: "acme".to_owned(),
        device_type: "gpu".to_owned(),
        name: "a1".to_owned(),
        health_dir: Some(dir.to_owned()),
        instances: ids
            .iter()
            .map(|id| StaticDeviceInstance {
                id: (*id).to_owned(),
            })
            .collect(),
    };
    let plugin = StaticPlugin::new(vec![group], HEALTH_INTERVAL).expect("a valid config");
    Arc::new(DeviceManager::new(vec![
        Arc::new(plugin) as Arc<dyn DevicePlugin>
    ]))
}

fn node(devices: Arc<DeviceManager>, store: Arc<dyn Store>, mock: &MockDriver) -> Node {
    let drivers = Drivers::new([Arc::new(mock.clone()) as Arc<dyn Driver>]);
    let config = NodeConfig {
        seed: Some(7),
        devices,
        ..NodeConfig::default()
    };
    Node::new(config, drivers, store, clock())
}

fn clock() -> Clock {
    Clock::starting_at(Timestamp::from_since_epoch(START))
}

fn memory() -> Arc<dyn Store> {
    Arc::new(stead_controller::store::MemoryStore::new())
}

fn alloc(name: &str, body: &str) -> ValidSpec {
    exec_support::alloc(name, body)
}

/// An alloc of one mock task `t` asking for `count` × `request`.
fn wants(name: &str, request: &str, count: u32) -> ValidSpec {
    alloc(
        name,
        &format!(
            "  tasks:\n    - name: t\n      driver: mock\n      config: {{}}\n      resources: {{devices: [{{name: {request}, count: {count}}}]}}\n"
        ),
    )
}

fn running(node: &Node, name: &str) -> bool {
    node.status(name)
        .is_some_and(|s| s.tasks.values().all(|t| t.state == "running"))
}

fn status(node: &Node, name: &str) -> Arc<AllocStatus> {
    node.status(name).expect("the alloc is shown")
}

/// The ids `task` of `name` holds.
fn held(node: &Node, name: &str, task: &str) -> Vec<String> {
    status(node, name).tasks[task]
        .devices
        .iter()
        .map(|d| d.id.clone())
        .collect()
}

fn waiting_for_devices(node: &Node, name: &str) -> Option<String> {
    let status = node.status(name)?;
    let task = status.tasks.get("t")?;
    let last = task.events.last()?;
    (task.state == "pending" && last.event_type == "Waiting for devices")
        .then(|| last.message.clone())
}

/// The node's one device group.
fn group(node: &Node) -> DeviceGroupStatus {
    let groups = node.devices().node_devices();
    assert_eq!(groups.len(), 1, "{groups:#?}");
    groups[0].clone()
}

fn starts(mock: &MockDriver) -> usize {
    mock.calls()
        .iter()
        .filter(|c| c.op == MockOp::StartBegan)
        .count()
}

async fn until(node: &Node, what: &str, condition: impl FnMut(&Node) -> bool) {
    let held = node.wait_until(DEADLINE, condition).await;
    assert!(
        held,
        "timed out until {what}: {:#?} {:#?}",
        node.statuses(),
        node.devices().node_devices()
    );
}

#[tokio::test(start_paused = true)]
async fn placement_waits_for_a_free_device_and_proceeds_when_its_holder_stops() {
    let health = tempfile::tempdir().expect("temp dir");
    let mock = MockDriver::new(clock());
    let node = node(gpus(health.path(), &["gpu0"]), memory(), &mock);
    node.apply(wants("first", "acme/gpu", 1));
    until(&node, "first runs", |n| running(n, "first")).await;
    assert_eq!(held(&node, "first", "t"), ["gpu0"]);

    node.apply(wants("second", "acme/gpu", 1));
    until(&node, "second waits", |n| {
        waiting_for_devices(n, "second").is_some()
    })
    .await;
    assert_eq!(
        waiting_for_devices(&node, "second").expect("waiting"),
        "Waiting for devices: 1 × acme/gpu requested, 0 healthy and free"
    );
    tokio::time::sleep(Duration::from_secs(30)).await;
    let second = status(&node, "second");
    let waits = second.tasks["t"]
        .events
        .iter()
        .filter(|e| e.event_type == "Waiting for devices")
        .count();
    assert_eq!(waits, 1, "said once, not once per tick");
    assert_eq!(
        second.spec_error, None,
        "a known device is not a spec error"
    );

    node.remove(&"first".parse().expect("a name"));
    until(&node, "second runs", |n| running(n, "second")).await;
    assert_eq!(held(&node, "second", "t"), ["gpu0"]);
    let instance = &group(&node).instances[0];
    assert_eq!(
        instance.held_by.as_ref().map(|h| h.alloc.as_str()),
        Some("second")
    );
    node.shutdown(Shutdown::Detach).await;
}

#[tokio::test(start_paused = true)]
async fn an_alloc_run_again_in_place_waits_for_its_devices_like_a_new_one() {
    let health = tempfile::tempdir().expect("temp dir");
    let mock = MockDriver::new(clock());
    let node = node(gpus(health.path(), &["gpu0"]), memory(), &mock);
    let first = wants("first", "acme/gpu", 1);
    node.apply(first.clone());
    until(&node, "first runs", |n| running(n, "first")).await;

    // Stopped in place, it lets its device go, and another alloc takes it.
    let stopped = |spec: &ValidSpec, status: &str| {
        let yaml = serde_json::to_string(&spec.spec).expect("json");
        let mut value: serde_json::Value = serde_json::from_str(&yaml).expect("json");
        value["spec"]["desiredStatus"] = status.into();
        exec_support::spec(&value.to_string())
    };
    node.apply(stopped(&first, "stop"));
    until(&node, "first stopped", |n| {
        status(n, "first").client_status == "complete" && held(n, "first", "t").is_empty()
    })
    .await;
    node.apply(wants("second", "acme/gpu", 1));
    until(&node, "second runs on gpu0", |n| {
        running(n, "second") && held(n, "second", "t") == ["gpu0"]
    })
    .await;
    let starts_before = starts(&mock);

    // Asked to run again, it waits for a device, and starts nothing meanwhile.
    node.apply(stopped(&first, "run"));
    until(&node, "first waits for its device", |n| {
        waiting_for_devices(n, "first").is_some()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(
        starts(&mock),
        starts_before,
        "nothing started without its device"
    );
    assert!(held(&node, "second", "t") == ["gpu0"]);

    node.remove(&"second".parse().expect("a name"));
    until(&node, "first runs again, on gpu0", |n| {
        running(n, "first") && held(n, "first", "t") == ["gpu0"]
    })
    .await;
    node.shutdown(Shutdown::Detach).await;
}

#[tokio::test(start_paused = true)]
async fn task_restarts_and_spec_edits_keep_the_devices_from_a_waiting_alloc_until_the_spec_stops_asking()
 {
    let health = tempfile::tempdir().expect("temp dir");
    let mock = MockDriver::new(clock());
    let node = node(gpus(health.path(), &["gpu0"]), memory(), &mock);
    let train = |generation: u32, devices: &str| {
        alloc(
            "train",
            &format!(
                "  restart: {{attempts: 1000, interval: 1h, delay: 1s, mode: delay}}\n  tasks:\n    - name: t\n      driver: mock\n      config: {{runFor: 3s}}\n      env: {{GENERATION: '{generation}'}}\n{devices}"
            ),
        )
    };
    let one_gpu = "      resources: {devices: [{name: acme/gpu}]}\n";
    node.apply(train(1, one_gpu));
    until(&node, "train runs", |n| running(n, "train")).await;
    node.apply(wants("other", "acme/gpu", 1));
    until(&node, "other waits", |n| {
        waiting_for_devices(n, "other").is_some()
    })
    .await;

    until(&node, "train's task restarted twice", |n| {
        running(n, "train") && status(n, "train").tasks["t"].restarts >= 2
    })
    .await;
    assert_eq!(held(&node, "train", "t"), ["gpu0"], "kept across restarts");
    assert!(waiting_for_devices(&node, "other").is_some());

    let first = status(&node, "train").revision.clone();
    node.apply(train(2, one_gpu));
    until(&node, "the new revision runs", |n| {
        running(n, "train") && status(n, "train").revision != first
    })
    .await;
    assert_eq!(
        held(&node, "train", "t"),
        ["gpu0"],
        "handed to the new revision"
    );
    assert!(waiting_for_devices(&node, "other").is_some());

    node.apply(train(3, ""));
    until(&node, "other runs once train no longer asks", |n| {
        running(n, "other")
    })
    .await;
    assert_eq!(held(&node, "other", "t"), ["gpu0"]);
    assert!(status(&node, "train").tasks["t"].devices.is_empty());
    node.shutdown(Shutdown::Detach).await;
}

#[tokio::test(start_paused = true)]
async fn an_unhealthy_device_flags_its_running_holder_which_keeps_running_and_is_never_assigned_again_until_healthy()
 {
    let health = tempfile::tempdir().expect("temp dir");
    let mock = MockDriver::new(clock());
    let node = node(gpus(health.path(), &["gpu0", "gpu1"]), memory(), &mock);
    node.apply(wants("train", "acme/gpu", 1));
    until(&node, "train runs", |n| running(n, "train")).await;
    assert_eq!(held(&node, "train", "t"), ["gpu0"]);

    std::fs::write(health.path().join("gpu0"), "unhealthy: ecc errors\n").expect("written");
    until(&node, "train's device is flagged", |n| {
        status(n, "train").tasks["t"]
            .devices
            .iter()
            .any(|d| !d.healthy)
    })
    .await;
    let train = status(&node, "train");
    let device = &train.tasks["t"].devices[0];
    assert_eq!(device.reason.as_deref(), Some("ecc errors"));
    assert_eq!(train.tasks["t"].state, "running");
    assert_eq!(train.tasks["t"].restarts, 0, "health never kills a task");
    let gpu0 = &group(&node).instances[0];
    assert!(!gpu0.healthy);
    assert_eq!(gpu0.held_by.as_ref().map(|h| h.task.as_str()), Some("t"));

    // The unhealthy instance is not given out: the next alloc gets gpu1, the one after
    // waits even once `train` has stopped, until gpu0 is healthy again.
    node.apply(wants("infer", "acme/gpu", 1));
    until(&node, "infer runs", |n| running(n, "infer")).await;
    assert_eq!(held(&node, "infer", "t"), ["gpu1"]);
    node.remove(&"train".parse().expect("a name"));
    node.apply(wants("eval", "acme/gpu", 1));
    until(&node, "eval waits", |n| {
        waiting_for_devices(n, "eval").is_some()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(waiting_for_devices(&node, "eval").is_some());

    std::fs::write(health.path().join("gpu0"), "ok\n").expect("written");
    until(&node, "eval runs", |n| running(n, "eval")).await;
    assert_eq!(held(&node, "eval", "t"), ["gpu0"]);
    assert!(status(&node, "eval").tasks["t"].devices[0].healthy);
    node.shutdown(Shutdown::Detach).await;
}

#[tokio::test(start_paused = true)]
async fn a_plugin_that_dies_turns_its_devices_unhealthy_at_once_and_they_return_when_it_restarts() {
    let root = tempfile::tempdir().expect("temp dir");
    let health = root.path().join("health");
    std::fs::create_dir(&health).expect("health dir");
    let mock = MockDriver::new(clock());
    let node = node(gpus(&health, &["gpu0", "gpu1"]), memory(), &mock);
    node.apply(wants("train", "acme/gpu", 1));
    until(&node, "train runs", |n| running(n, "train")).await;

    // The static plugin's source of truth goes away: the plugin stops.
    std::fs::remove_dir(&health).expect("removed");
    until(&node, "every instance is unhealthy", |n| {
        group(n).instances.iter().all(|i| !i.healthy)
    })
    .await;
    let reason = group(&node).instances[1].reason.clone().expect("a reason");
    assert!(reason.contains("device plugin static failed"), "{reason}");
    until(&node, "the holder is flagged", |n| {
        !status(n, "train").tasks["t"].devices[0].healthy
    })
    .await;
    assert!(running(&node, "train"), "the holder runs on");
    node.apply(wants("infer", "acme/gpu", 1));
    until(&node, "infer waits", |n| {
        waiting_for_devices(n, "infer").is_some()
    })
    .await;

    // Restarts keep failing while the directory is missing, with growing delays; once it
    // is back the plugin reports again and the devices return.
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert!(group(&node).instances.iter().all(|i| !i.healthy));
    std::fs::create_dir(&health).expect("health dir again");
    until(&node, "infer runs on the recovered device", |n| {
        running(n, "infer")
    })
    .await;
    assert_eq!(held(&node, "infer", "t"), ["gpu1"]);
    assert!(group(&node).instances.iter().all(|i| i.healthy));
    node.shutdown(Shutdown::Detach).await;
}

#[tokio::test(start_paused = true)]
async fn after_an_agent_restart_an_alloc_keeps_its_devices_before_the_plugin_reports_and_nobody_else_gets_them()
 {
    let root = tempfile::tempdir().expect("temp dir");
    let health = root.path().join("health");
    std::fs::create_dir(&health).expect("health dir");
    let state = root.path().join("state");
    let mock = MockDriver::new(clock());
    {
        let store = Arc::new(RocksDbStore::open(&state, RocksDbOptions::default()).expect("opens"));
        let first = node(gpus(&health, &["gpu0"]), store, &mock);
        first.apply(wants("train", "acme/gpu", 1));
        until(&first, "train runs", |n| running(n, "train")).await;
        first.shutdown(Shutdown::Detach).await;
    }
    let started = starts(&mock);
    // The plugin cannot report when the agent comes back.
    std::fs::remove_dir(&health).expect("removed");
    let store = Arc::new(RocksDbStore::open(&state, RocksDbOptions::default()).expect("opens"));
    let second = node(gpus(&health, &["gpu0"]), store, &mock);
    let report = second.restore().expect("restores");
    assert_eq!(report.restored, 1);
    until(&second, "train runs again", |n| running(n, "train")).await;
    assert_eq!(held(&second, "train", "t"), ["gpu0"]);
    let device = status(&second, "train").tasks["t"].devices[0].clone();
    assert_eq!(
        device.reason.as_deref(),
        Some("not reported by any device plugin")
    );
    second.apply(wants("thief", "acme/gpu", 1));
    until(&second, "thief waits", |n| {
        waiting_for_devices(n, "thief").is_some()
    })
    .await;
    assert_eq!(
        status(&second, "thief").spec_error,
        None,
        "not unknown: the plugin has not reported yet"
    );

    std::fs::create_dir(&health).expect("health dir again");
    until(&second, "the plugin reports gpu0 held by train", |n| {
        n.devices()
            .node_devices()
            .first()
            .is_some_and(|g| g.plugin.is_some() && g.instances[0].healthy)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(waiting_for_devices(&second, "thief").is_some());
    assert_eq!(held(&second, "train", "t"), ["gpu0"]);
    assert_eq!(
        starts(&mock),
        started,
        "train was reattached, never restarted"
    );
    second.shutdown(Shutdown::Detach).await;
}

#[tokio::test(start_paused = true)]
async fn the_api_shows_two_tasks_on_instances_of_one_group_as_one_group_entry_and_every_device_with_its_holder()
 {
    let health = tempfile::tempdir().expect("temp dir");
    for (id, utilization) in [("gpu0", 10), ("gpu1", 30), ("gpu2", 99)] {
        std::fs::write(
            health.path().join(format!("{id}.stats")),
            format!("utilization {utilization}\n"),
        )
        .expect("written");
    }
    let mock = MockDriver::new(clock());
    let node = Arc::new(node(
        gpus(health.path(), &["gpu0", "gpu1", "gpu2"]),
        memory(),
        &mock,
    ));
    let task = |name: &str| {
        format!(
            "    - name: {name}\n      driver: mock\n      config: {{}}\n      resources: {{devices: [{{name: acme/gpu/a1}}]}}\n"
        )
    };
    node.apply(alloc(
        "train",
        &format!("  tasks:\n{}{}", task("a"), task("b")),
    ));
    until(&node, "train runs", |n| running(n, "train")).await;
    let drivers = Drivers::new([Arc::new(mock.clone()) as Arc<dyn Driver>]);
    let data = tempfile::tempdir().expect("temp dir");
    let api = Transport::InProcess(ApiState::new(node.clone(), drivers, data.path()));

    let answer = api.get("/v1/allocs/train/stats", None).await;
    let stats: AllocStats = serde_json::from_slice(&answer.body).expect("alloc stats");
    assert_eq!(stats.device_groups.len(), 1, "{stats:#?}");
    let group = &stats.device_groups[0];
    assert_eq!(group.group, "acme/gpu/a1");
    let utilization: Vec<(&str, f64)> = group
        .instances
        .iter()
        .map(|i| {
            (
                i.id.as_str(),
                i.stats.as_ref().expect("stats")["utilization"],
            )
        })
        .collect();
    assert_eq!(utilization, [("gpu0", 10.0), ("gpu1", 30.0)]);
    assert_eq!(stats.task_devices["a"][0].id, "gpu0");
    assert_eq!(stats.task_devices["b"][0].id, "gpu1");

    let answer = api.get("/v1/node", None).await;
    let status: NodeStatus = serde_json::from_slice(&answer.body).expect("node status");
    let holders: Vec<(String, bool, Option<String>)> = status.devices[0]
        .instances
        .iter()
        .map(|i| {
            let holder = i
                .held_by
                .as_ref()
                .map(|h| format!("{}/{}", h.alloc, h.task));
            (i.id.clone(), i.healthy, holder)
        })
        .collect();
    assert_eq!(
        holders,
        [
            ("gpu0".to_owned(), true, Some("train/a".to_owned())),
            ("gpu1".to_owned(), true, Some("train/b".to_owned())),
            ("gpu2".to_owned(), true, None),
        ]
    );
    assert_eq!(status.devices[0].plugin.as_deref(), Some("static"));
    node.shutdown(Shutdown::Detach).await;
}

#[tokio::test(start_paused = true)]
async fn a_request_for_a_device_no_plugin_reports_is_a_spec_error_naming_it_and_runs_nothing() {
    let health = tempfile::tempdir().expect("temp dir");
    let mock = MockDriver::new(clock());
    let node = node(gpus(health.path(), &["gpu0"]), memory(), &mock);
    // Let the plugin report first: then an unknown device is known to be unknown.
    until(&node, "the plugin reported", |n| {
        !n.devices().node_devices().is_empty()
    })
    .await;
    node.apply(alloc(
        "web",
        "  tasks:\n    - {name: t, driver: mock, config: {}}\n    - name: u\n      driver: mock\n      config: {}\n      resources: {devices: [{name: acme/gpu}, {name: acme/tpu, count: 2}]}\n",
    ));
    until(&node, "web shows a spec error", |n| {
        n.status("web").is_some_and(|s| s.spec_error.is_some())
    })
    .await;
    let web = status(&node, "web");
    assert_eq!(
        web.spec_error.as_deref(),
        Some(
            "spec.tasks[1].resources.devices[1].name: unknown device acme/tpu: no device plugin reports a tpu device of vendor acme"
        )
    );
    assert!(web.tasks.values().all(|t| t.state == "pending"));
    assert_eq!(starts(&mock), 0);
    assert!(group(&node).instances[0].held_by.is_none(), "nothing held");
    node.shutdown(Shutdown::Detach).await;
}

/// The file the exec test's task writes its device ids to.
fn ids_file(dir: &Path) -> PathBuf {
    dir.join("ids")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_task_gets_the_ids_of_its_devices_in_its_environment() {
    let health = tempfile::tempdir().expect("temp dir");
    let out = tempfile::tempdir().expect("temp dir");
    let exec = exec_support::ExecNode::with_devices(gpus(health.path(), &["gpu0", "gpu1"]));
    let script = format!(
        "echo \"$STEAD_DEVICE_GPU_IDS\" > {}.tmp && mv {0}.tmp {0} && exec sleep 600",
        ids_file(out.path()).display()
    );
    let spec = exec_support::alloc(
        "train",
        &format!(
            "  tasks:\n    - name: t\n      driver: exec\n      config: {{command: /bin/sh, args: [\"-c\", {}]}}\n      resources: {{devices: [{{name: acme/gpu, count: 2}}]}}\n",
            serde_json::to_string(&script).expect("a string")
        ),
    );
    exec.node.apply(spec);
    exec_support::eventually("the task wrote its ids", || ids_file(out.path()).exists()).await;
    let ids = std::fs::read_to_string(ids_file(out.path())).expect("readable");
    assert_eq!(
        ids.trim(),
        "gpu0,gpu1",
        "the agent's ids win over the spec's env"
    );
    exec.drain().await;
}
