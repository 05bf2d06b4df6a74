//! The `k8s` device plugin kind through the real `stead agent` and a real device plugin
//! process speaking the Kubernetes device-plugin API over unix sockets
//! (`stead-test-device-plugin`): registration, health flips, a plugin SIGKILLed and back,
//! an agent restarted without a second `Allocate`, the `Allocate` answer seen by the task,
//! and a plugin dialled without registration.

use crate::agent_support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agent_support::{AgentDirs, wait_for};
use stead_schemas::api::{DeviceGroupStatus, NodeStatus};

/// A real device plugin process.
struct Plugin {
    child: Child,
}

impl Plugin {
    /// Starts the plugin for `acme.io/fpga` with devices f0 and f1 at
    /// `socket_dir/fpga.sock` with `flags` (`register`, `prestart`), and waits until it
    /// serves.
    fn start(socket_dir: &Path, state: &Path, flags: &[&str]) -> Plugin {
        let ready = state.join("fpga.sock.ready");
        let _ = std::fs::remove_file(&ready);
        let mut command = Command::new(env!("CARGO_BIN_EXE_stead-test-device-plugin"));
        command
            .arg(socket_dir)
            .args(["fpga.sock", "acme.io/fpga", "f0,f1"])
            .arg(state)
            .args(flags)
            .stdin(Stdio::null());
        let mut child = command.spawn().expect("the plugin starts");
        wait_for("the plugin serves", Duration::from_secs(20), || {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("the plugin exited with {status}");
            }
            ready.exists().then_some(()).ok_or_else(String::new)
        });
        Plugin { child }
    }

    fn kill9(mut self) {
        self.child.kill().expect("killed");
        self.child.wait().expect("reaped");
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn fpga_group(agent: &agent_support::Agent) -> Result<DeviceGroupStatus, String> {
    let (_, body) = agent
        .try_get("/v1/node")
        .ok_or_else(|| "no answer".to_owned())?;
    let node: NodeStatus = serde_json::from_str(&body).map_err(|e| e.to_string())?;
    node.devices
        .into_iter()
        .find(|g| g.vendor == "acme.io" && g.device_type == "fpga" && g.name == "fpga")
        .ok_or(body)
}

/// Waits up to `within` until every instance's health is `healthy` (f0, f1 in order).
fn until_health(agent: &agent_support::Agent, healthy: [bool; 2], within: Duration) -> Duration {
    let began = Instant::now();
    wait_for(&format!("health {healthy:?}"), within, || {
        let group = fpga_group(agent)?;
        let now: Vec<bool> = group.instances.iter().map(|i| i.healthy).collect();
        (now == healthy)
            .then_some(())
            .ok_or_else(|| format!("{group:#?}"))
    });
    began.elapsed()
}

fn allocate_calls(state: &Path) -> Vec<String> {
    std::fs::read_to_string(state.join("fpga.sock.allocs"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn spec(mount: &Path) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: fpga}}\nspec:\n  tasks:\n    - name: main\n      driver: exec\n      config:\n        command: /bin/sh\n        args: [-c, 'echo ids=$FAKE_DEVICE_IDS cuda=$CUDA_VISIBLE_DEVICES; cat {}/marker; exec sleep 1000']\n      resources: {{devices: [{{name: acme.io/fpga}}]}}\n",
        mount.display()
    )
}

#[test]
fn a_registered_plugin_serves_tasks_its_health_flips_and_an_agent_restart_allocates_nothing_again()
{
    let sockets = tempfile::tempdir().expect("socket dir");
    let state = tempfile::tempdir().expect("state dir");
    let dirs = AgentDirs::new(&format!(
        "devices:\n  k8s: {{socketDir: {}, envMap: {{NVIDIA_VISIBLE_DEVICES: CUDA_VISIBLE_DEVICES}}}}\n",
        sockets.path().display()
    ));
    let agent = dirs.start();
    let kubelet = sockets.path().join("kubelet.sock");
    wait_for("kubelet.sock", Duration::from_secs(10), || {
        kubelet.exists().then_some(()).ok_or_else(String::new)
    });
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&kubelet)
        .expect("the socket")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "only the agent's user may register");

    // Registered: its devices appear within a second.
    let plugin = Plugin::start(sockets.path(), state.path(), &["register"]);
    until_health(&agent, [true, true], Duration::from_secs(1));
    let group = fpga_group(&agent).expect("the group");
    assert_eq!(group.plugin.as_deref(), Some("k8s"));
    assert_eq!(group.attributes["resource"], "acme.io/fpga");

    // A task gets what Allocate answered.
    let mount: PathBuf = state.path().join("fpga.sock.mnt");
    std::fs::write(mount.join("marker"), "mounted\n").expect("marker");
    dirs.write_spec("fpga", &spec(&mount));
    let task = agent.wait_for_task("fpga", "running", Duration::from_secs(20), |t| {
        t.state == "running" && t.pid.is_some()
    });
    let pid = task.pid;
    wait_for("the task's output", Duration::from_secs(10), || {
        let (_, text, _) = agent.cli(&["alloc", "logs", "fpga", "main"]);
        (text.contains("ids=f0 cuda=f0") && text.contains("mounted"))
            .then_some(())
            .ok_or(text)
    });
    assert_eq!(allocate_calls(state.path()), ["f0"]);

    // A health flip of the free device shows within a second.
    std::fs::write(state.path().join("fpga.sock.health"), "f1\n").expect("flip");
    until_health(&agent, [true, false], Duration::from_secs(1));
    std::fs::write(state.path().join("fpga.sock.health"), "").expect("flip back");
    until_health(&agent, [true, true], Duration::from_secs(1));

    // The plugin SIGKILLed: all its devices unhealthy within a second; the holder runs
    // on, flagged.
    plugin.kill9();
    until_health(&agent, [false, false], Duration::from_secs(1));
    let task = agent.wait_for_task("fpga", "flagged", Duration::from_secs(5), |t| {
        t.devices.iter().any(|d| !d.healthy)
    });
    assert_eq!((task.state.as_str(), task.pid), ("running", pid));
    assert!(
        task.devices[0]
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("not serving")),
        "{task:#?}"
    );

    // Back: registered again, healthy.
    let plugin = Plugin::start(sockets.path(), state.path(), &["register"]);
    until_health(&agent, [true, true], Duration::from_secs(5));

    // The agent restarted: the task reattached, not restarted, and no second Allocate
    // (the plugin registers again, as plugins do when the kubelet's socket is new).
    agent.kill9();
    drop(plugin);
    let dead = std::os::unix::net::UnixStream::connect(&kubelet);
    assert!(dead.is_err(), "the killed agent's socket answers nothing");
    let agent = dirs.start();
    wait_for(
        "a kubelet.sock that answers",
        Duration::from_secs(10),
        || {
            std::os::unix::net::UnixStream::connect(&kubelet)
                .map(drop)
                .map_err(|e| e.to_string())
        },
    );
    let _plugin = Plugin::start(sockets.path(), state.path(), &["register"]);
    until_health(&agent, [true, true], Duration::from_secs(5));
    let task = agent.wait_for_task("fpga", "reattached", Duration::from_secs(10), |t| {
        t.state == "running" && t.devices.iter().all(|d| d.healthy)
    });
    assert_eq!(task.pid, pid, "the same process");
    assert_eq!(task.restarts, 0);
    assert_eq!(allocate_calls(state.path()), ["f0"], "no second Allocate");

    // Restarted by its user, the task gets the checkpointed answer again: still one
    // Allocate, as the kubelet's checkpoint makes it.
    let (code, body) = agent.post("/v1/allocs/fpga/restart").expect("an answer");
    assert_eq!(code, 202, "{body}");
    let restarted = agent.wait_for_task("fpga", "restarted", Duration::from_secs(20), |t| {
        t.state == "running" && t.pid.is_some() && t.pid != pid
    });
    assert_eq!(
        allocate_calls(state.path()),
        ["f0"],
        "the answer was reused"
    );

    // Freed, then held by a new alloc: that one is allocated anew.
    dirs.remove_spec("fpga");
    agent.wait_for_task("fpga", "stopped", Duration::from_secs(20), |t| {
        t.state == "dead"
    });
    wait_for("the device freed", Duration::from_secs(20), || {
        let group = fpga_group(&agent)?;
        group
            .instances
            .iter()
            .all(|i| i.held_by.is_none())
            .then_some(())
            .ok_or_else(|| format!("{group:#?}"))
    });
    dirs.write_spec("fpga", &spec(&mount));
    agent.wait_for_task("fpga", "running again", Duration::from_secs(20), |t| {
        t.state == "running" && t.pid.is_some() && t.pid != restarted.pid
    });
    let log: Vec<String> = agent
        .log_text()
        .lines()
        .filter(|l| l.contains("devices") || l.contains("Allocate") || l.contains("alloc"))
        .map(str::to_owned)
        .collect();
    assert_eq!(
        allocate_calls(state.path()),
        ["f0", "f0"],
        "{}",
        log.join("\n")
    );
}

#[test]
fn a_plugin_dialled_without_registration_serves_through_its_configured_endpoint_and_is_asked_to_prestart()
 {
    let sockets = tempfile::tempdir().expect("socket dir");
    let state = tempfile::tempdir().expect("state dir");
    let dirs = AgentDirs::new(&format!(
        "drivers: {{mock: {{enabled: true}}}}\ndevices:\n  k8s:\n    registration: false\n    socketDir: {dir}\n    endpoints: [{{socket: {dir}/fpga.sock, resource: acme.io/fpga}}]\n",
        dir = sockets.path().display()
    ));
    let agent = dirs.start();
    // Not up yet: nothing known, and the plugin says why in the node's status.
    wait_for("a note on the dial", Duration::from_secs(10), || {
        let (_, body) = agent.try_get("/v1/node").ok_or_else(String::new)?;
        body.contains("acme.io/fpga at").then_some(()).ok_or(body)
    });
    let _plugin = Plugin::start(sockets.path(), state.path(), &["prestart"]);
    until_health(&agent, [true, true], Duration::from_secs(10));
    assert!(
        !sockets.path().join("kubelet.sock").exists(),
        "no registration socket"
    );
    dirs.write_spec(
        "fpga",
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: fpga}\nspec:\n  tasks:\n    - name: main\n      driver: mock\n      config: {}\n      resources: {devices: [{name: acme.io/fpga/fpga, count: 2}]}\n",
    );
    agent.wait_for_task("fpga", "running", Duration::from_secs(10), |t| {
        t.state == "running"
    });
    assert_eq!(allocate_calls(state.path()), ["f0,f1"]);
    // It asked for PreStartContainer in its options: called before the task's start.
    let prestarts =
        std::fs::read_to_string(state.path().join("fpga.sock.prestarts")).unwrap_or_default();
    assert_eq!(prestarts, "f0,f1\n");
}
