//! The packaging in `deploy/`: the manifests agree with each other and with the agent,
//! the real agent speaks systemd's notification protocol, the unit and the image pass
//! their platforms' own checks where those tools run, and the binary links its C++
//! runtime statically where it can.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use stead_controller::agent::{AgentArgs, Settings};
use stead_schemas::config::AgentConfig;
use stead_tests::workspace_dir;
use tokio::net::UnixDatagram;

/// How long the agent may take to do anything these tests wait for.
const DEADLINE: Duration = Duration::from_secs(30);

fn deploy(path: &str) -> PathBuf {
    workspace_dir().join("deploy").join(path)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every YAML document of the file at `path`, as JSON values.
fn yaml_documents(path: &Path) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(&read(path))
        .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()))
}

fn args(config: &Path) -> AgentArgs {
    AgentArgs {
        config: Some(config.to_owned()),
        specs: None,
        data_dir: None,
        listen: None,
        drain: false,
        log_format: None,
    }
}

/// The port of a `host:port` address.
fn port_of(address: &str) -> u16 {
    address
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or_else(|| panic!("{address:?} has no port"))
}

/// The value following `flag` in `args`.
fn flag<'a>(args: &'a [Value], name: &str) -> Option<&'a str> {
    let at = args.iter().position(|a| a.as_str() == Some(name))?;
    args.get(at + 1)?.as_str()
}

/// The JSON array `value` as strings.
fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|items| {
            items
                .iter()
                .filter_map(|i| i.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The keys of `value`, an object.
fn keys(value: &Value) -> Vec<String> {
    value
        .as_object()
        .map(|object| object.keys().cloned().collect())
        .unwrap_or_default()
}

#[test]
fn example_agent_config_loads_through_the_agents_loader_and_documents_every_key() {
    let path = deploy("agent.yaml");
    let settings = Settings::resolve(&args(&path)).expect("deploy/agent.yaml is a valid config");
    assert_eq!(settings.specs_dir, Path::new("/etc/stead/specs"));
    assert_eq!(settings.data_dir, Path::new("/var/lib/stead"));
    assert_eq!(port_of(&settings.listen), 4750);
    assert!(settings.exec_driver, "the example runs exec tasks");

    // Every key the config knows is written out (unset keys serialize as null).
    let written = &yaml_documents(&path)[0];
    let known = serde_json::to_value(AgentConfig::default()).expect("config serializes");
    for key in keys(&known) {
        assert!(
            written.get(&key).is_some(),
            "deploy/agent.yaml does not document {key:?}"
        );
    }
    let gc = serde_json::to_value(stead_schemas::config::GcConfig::default()).expect("gc");
    for key in keys(&gc) {
        assert!(
            written["gc"].get(&key).is_some(),
            "deploy/agent.yaml does not document gc.{key}"
        );
    }
    let store = serde_json::to_value(stead_schemas::config::StoreConfig::default()).expect("store");
    for key in keys(&store) {
        assert!(
            written["store"].get(&key).is_some(),
            "deploy/agent.yaml does not document store.{key}"
        );
    }
    for driver in ["exec", "mock"] {
        assert!(
            written["drivers"][driver].get("enabled").is_some(),
            "deploy/agent.yaml does not document drivers.{driver}.enabled"
        );
    }
}

#[test]
fn daemonset_compose_image_and_agent_config_agree_on_port_paths_and_probe() {
    let documents = yaml_documents(&deploy("kubernetes/daemonset.yaml"));
    let of_kind = |kind: &str| {
        documents
            .iter()
            .find(|d| d["kind"] == kind)
            .unwrap_or_else(|| panic!("the DaemonSet manifest has no {kind}"))
    };
    let namespace = of_kind("Namespace")["metadata"]["name"].clone();
    let config_map = of_kind("ConfigMap");
    let daemon_set = of_kind("DaemonSet");
    assert_eq!(config_map["metadata"]["namespace"], namespace);
    assert_eq!(daemon_set["metadata"]["namespace"], namespace);

    // The ConfigMap's agent config passes the agent's own loader.
    let config_text = config_map["data"]["agent.yaml"]
        .as_str()
        .expect("the ConfigMap holds agent.yaml");
    let dir = tempfile::tempdir().expect("temp dir");
    let config_path = dir.path().join("agent.yaml");
    std::fs::write(&config_path, config_text).expect("config written");
    let k8s = Settings::resolve(&args(&config_path)).expect("the ConfigMap's config loads");

    let pod = &daemon_set["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let container_args = container["args"].as_array().expect("container args");
    let mounted_config = Path::new(flag(container_args, "--config").expect("--config"));

    // The API port: config, containerPort, and both probes on /v1/health.
    let port = &container["ports"][0];
    assert_eq!(port["containerPort"], u64::from(port_of(&k8s.listen)));
    assert!(
        k8s.listen.starts_with("0.0.0.0:"),
        "probes reach the pod's IP"
    );
    for probe in ["livenessProbe", "readinessProbe"] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"], "/v1/health", "{probe}");
        assert!(
            get["port"] == port["name"] || get["port"] == port["containerPort"],
            "{probe} targets the API port"
        );
    }
    for bound in ["requests", "limits"] {
        for resource in ["cpu", "memory"] {
            assert!(
                container["resources"][bound].get(resource).is_some(),
                "resources.{bound}.{resource}"
            );
        }
    }

    // Paths: the mounts put the config, specs (read-only) and state where the config
    // says, the specs and state from the host.
    let mount_at = |path: &Path| {
        container["volumeMounts"]
            .as_array()
            .expect("volume mounts")
            .iter()
            .find(|m| m["mountPath"].as_str().map(Path::new) == Some(path))
            .unwrap_or_else(|| panic!("nothing is mounted at {}", path.display()))
            .clone()
    };
    let volume = |name: &Value| {
        pod["volumes"]
            .as_array()
            .expect("volumes")
            .iter()
            .find(|v| &v["name"] == name)
            .unwrap_or_else(|| panic!("no volume {name}"))
            .clone()
    };
    let config_mount = mount_at(mounted_config.parent().expect("config dir"));
    assert_eq!(
        volume(&config_mount["name"])["configMap"]["name"],
        config_map["metadata"]["name"]
    );
    let specs_mount = mount_at(&k8s.specs_dir);
    assert_eq!(specs_mount["readOnly"], true, "specs are mounted read-only");
    assert!(volume(&specs_mount["name"]).get("hostPath").is_some());
    let state_mount = mount_at(&k8s.data_dir);
    assert_ne!(state_mount["readOnly"], true, "state is writable");
    assert!(volume(&state_mount["name"]).get("hostPath").is_some());
    // The agent drains on SIGTERM: the pod's grace period outlasts the longest kill.
    assert_eq!(k8s.shutdown, stead_controller::queue::Shutdown::Drain);
    let grace = pod["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("grace");
    assert!(Duration::from_secs(grace) > k8s.node.limits.max_kill_timeout);

    // The image: the example config, the same port and paths, and both binaries.
    let example = Settings::resolve(&args(&deploy("agent.yaml"))).expect("example config");
    let dockerfile = read(&deploy("Dockerfile"));
    let instruction = |name: &str| {
        dockerfile
            .lines()
            .filter(|l| l.starts_with(&format!("{name} ")))
            .map(|l| l[name.len() + 1..].trim().to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(instruction("EXPOSE"), [port_of(&k8s.listen).to_string()]);
    assert!(
        instruction("VOLUME")
            .iter()
            .any(|v| v.contains(&example.data_dir.display().to_string())),
        "the state dir is a volume"
    );
    let cmd: Vec<Value> = serde_json::from_str(&instruction("CMD")[0]).expect("CMD is JSON");
    assert_eq!(
        port_of(flag(&cmd, "--listen").expect("the image listens on all interfaces")),
        port_of(&example.listen)
    );
    // The binaries come from the release script, with the supervisor linked static.
    assert!(
        dockerfile.contains("STEAD_REQUIRE_STATIC=1 scripts/build-release.sh /out"),
        "the image builds through scripts/build-release.sh"
    );
    assert!(workspace_dir().join("scripts/build-release.sh").is_file());
    let copied = instruction("COPY").join("\n");
    assert!(copied.contains("/out/stead /out/stead-supervisor /usr/local/bin/"));
    assert!(copied.contains(&format!(
        "deploy/agent.yaml {}",
        flag(&cmd, "--config").expect("--config")
    )));
    assert!(
        workspace_dir().join(".dockerignore").is_file(),
        "the build context has a .dockerignore"
    );

    // Compose: the image's port published, state on a volume, specs read-only.
    let compose = &yaml_documents(&deploy("compose.yaml"))[0];
    let service = &compose["services"]["stead"];
    assert_eq!(service["build"]["dockerfile"], "deploy/Dockerfile");
    let ports = strings(&service["ports"]);
    assert!(
        ports
            .iter()
            .any(|p| p.ends_with(&format!(":{}", port_of(&example.listen)))),
        "compose publishes the API port: {ports:?}"
    );
    let volumes = strings(&service["volumes"]);
    let state = volumes
        .iter()
        .find(|v| v.split(':').nth(1) == Some(&example.data_dir.display().to_string()))
        .expect("compose keeps the state dir on a volume");
    let state_volume = state.split(':').next().expect("volume name");
    assert!(compose["volumes"].get(state_volume).is_some());
    assert!(
        volumes
            .iter()
            .any(|v| v.ends_with(&format!("{}:ro", example.specs_dir.display()))),
        "compose mounts the specs read-only: {volumes:?}"
    );
    let healthcheck = strings(&service["healthcheck"]["test"]).join(" ");
    assert!(healthcheck.contains(&format!("127.0.0.1:{}", port_of(&example.listen))));
}

/// The real agent, started with `NOTIFY_SOCKET` and its stderr in a file.
struct Agent {
    child: tokio::process::Child,
    port: u16,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Agent {
    fn start(notify_socket: &str, env: &[(&str, &str)]) -> Agent {
        let dir = tempfile::tempdir().expect("temp dir");
        let specs = dir.path().join("specs");
        std::fs::create_dir(&specs).expect("specs dir");
        // A free port: bound, then released for the agent.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let log = dir.path().join("agent.log");
        let stderr = std::fs::File::create(&log).expect("log file");
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_stead-test-agent"))
            .arg("agent")
            .arg("--specs")
            .arg(&specs)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--log-format", "json"])
            .env("NOTIFY_SOCKET", notify_socket)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .expect("the agent starts");
        Agent {
            child,
            port,
            log,
            _dir: dir,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id().expect("the agent runs")
    }

    fn log(&self) -> String {
        read(&self.log)
    }

    fn terminate(&self) {
        let status = std::process::Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "SIGTERM sent");
    }
}

/// The next notification on `socket`, within the deadline.
async fn next_message(socket: &UnixDatagram, agent: &Agent) -> String {
    let mut buffer = vec![0u8; 4096];
    match tokio::time::timeout(DEADLINE, socket.recv(&mut buffer)).await {
        Ok(Ok(n)) => String::from_utf8(buffer[..n].to_vec()).expect("utf-8 message"),
        Ok(Err(error)) => panic!("receiving a notification: {error}"),
        Err(_) => panic!(
            "no notification within {DEADLINE:?}; agent log:\n{}",
            agent.log()
        ),
    }
}

/// Waits for the message `wanted`, skipping others (watchdog pings); returns the others.
async fn until_message(socket: &UnixDatagram, agent: &Agent, wanted: &str) -> Vec<String> {
    let mut others = Vec::new();
    loop {
        let message = next_message(socket, agent).await;
        if message.lines().any(|l| l == wanted) {
            return others;
        }
        others.push(message);
    }
}

#[tokio::test]
async fn agent_sends_ready_only_once_restored_and_serving_then_stopping_on_sigterm() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("notify");
    let socket = UnixDatagram::bind(&path).expect("notify socket");
    let mut agent = Agent::start(path.to_str().expect("utf-8 path"), &[]);

    until_message(&socket, &agent, "READY=1").await;
    // The log lines that follow the restore, the creation of a new node's store and the
    // API's bind are written (synchronously) before READY=1 is sent, so they are in the
    // file by now; and the API already answers.
    let log = agent.log();
    let position = |needle: &str| log.lines().position(|l| l.contains(needle));
    assert!(
        position("agent started").is_some(),
        "READY=1 came before the agent restored its state:\n{log}"
    );
    let api = position("api listening")
        .unwrap_or_else(|| panic!("READY=1 came before the API listened:\n{log}"));
    // This data dir is new: its store is created while the first tasks start, and the
    // API waits for it.
    assert!(
        position("state store created").is_some_and(|created| created < api),
        "the API listened before the new store was created:\n{log}"
    );
    let health = reqwest::get(format!("http://127.0.0.1:{}/v1/health", agent.port))
        .await
        .expect("/v1/health answers as soon as READY=1 arrives");
    assert_eq!(health.status(), 200);

    agent.terminate();
    until_message(&socket, &agent, "STOPPING=1").await;
    let status = tokio::time::timeout(DEADLINE, agent.child.wait())
        .await
        .expect("the agent exits after SIGTERM")
        .expect("wait");
    assert!(status.success(), "the agent exits cleanly: {status}");
}

#[tokio::test]
async fn agent_pings_the_watchdog_at_half_the_period_on_an_abstract_socket() {
    let name = format!("stead-packaging-watchdog-{}", std::process::id());
    let address = {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).expect("name")
    };
    let std_socket = std::os::unix::net::UnixDatagram::bind_addr(&address).expect("bind");
    std_socket.set_nonblocking(true).expect("non-blocking");
    let socket = UnixDatagram::from_std(std_socket).expect("tokio socket");
    // A 200 ms watchdog: pings every 100 ms.
    let agent = Agent::start(&format!("@{name}"), &[("WATCHDOG_USEC", "200000")]);
    let before_ready = until_message(&socket, &agent, "READY=1").await;
    assert!(
        before_ready.iter().all(|m| m == "WATCHDOG=1"),
        "{before_ready:?}"
    );
    let began = std::time::Instant::now();
    for _ in 0..3 {
        assert_eq!(next_message(&socket, &agent).await, "WATCHDOG=1");
    }
    // Three pings at 100 ms each take at least ~200 ms (the first may come at once)
    // and far less than the deadline.
    assert!(
        began.elapsed() >= Duration::from_millis(150),
        "{:?}",
        began.elapsed()
    );
}

#[test]
fn systemd_unit_passes_systemd_analyze_verify_where_available() {
    let unit = read(&deploy("systemd/stead.service"));
    for line in [
        "Type=notify",
        "KillMode=process",
        "ExecStart=/usr/local/bin/stead agent --config /etc/stead/agent.yaml",
    ] {
        assert!(unit.lines().any(|l| l == line), "the unit has {line}");
    }
    assert!(unit.lines().any(|l| l.starts_with("WatchdogSec=")));
    // The unit's config path is the example config's install location.
    assert!(unit.contains("StateDirectory=stead") && unit.contains("ConfigurationDirectory=stead"));

    let available = std::process::Command::new("systemd-analyze")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !available {
        println!("skipped systemd-analyze verify: systemd-analyze is not installed");
        return;
    }
    // verify checks that ExecStart exists: point it at the agent these tests built.
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("stead.service");
    let local = unit.replace(
        "/usr/local/bin/stead ",
        &format!("{} ", env!("CARGO_BIN_EXE_stead-test-agent")),
    );
    std::fs::write(&path, local).expect("unit written");
    let output = std::process::Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("systemd-analyze runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && !stderr.contains("stead.service"),
        "systemd-analyze verify: {}\n{stderr}",
        output.status
    );
}

#[test]
fn image_builds_where_a_docker_daemon_runs() {
    let daemon = std::process::Command::new("docker")
        .arg("info")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    match daemon {
        Err(error) => {
            println!("skipped the image build: no docker client ({error})");
            return;
        }
        Ok(status) if !status.success() => {
            println!("skipped the image build: `docker info` failed, no Docker daemon runs");
            return;
        }
        Ok(_) => {}
    }
    let output = std::process::Command::new("docker")
        .args([
            "build",
            "--file",
            "deploy/Dockerfile",
            "--tag",
            "stead:test",
            ".",
        ])
        .current_dir(workspace_dir())
        .output()
        .expect("docker build runs");
    assert!(
        output.status.success(),
        "docker build failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for binary in ["stead", "stead-supervisor"] {
        let found = std::process::Command::new("docker")
            .args(["run", "--rm", "--entrypoint", "test", "stead:test", "-x"])
            .arg(format!("/usr/local/bin/{binary}"))
            .status()
            .expect("docker run runs");
        assert!(found.success(), "the image has {binary}");
    }
}

#[test]
fn the_agent_links_the_cpp_runtime_statically_where_the_compiler_has_the_archive() {
    if !cfg!(all(target_os = "linux", target_env = "gnu")) {
        eprintln!("skipped: the C++ runtime is linked statically on GNU/Linux only");
        return;
    }
    let Ok(output) = std::process::Command::new("readelf")
        .arg("--dynamic")
        .arg(env!("CARGO_BIN_EXE_stead-test-agent"))
        .output()
    else {
        eprintln!("skipped: no readelf to list the agent's shared libraries");
        return;
    };
    let dynamic = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "readelf: {dynamic}");
    let needed: Vec<&str> = dynamic
        .lines()
        .filter(|line| line.contains("(NEEDED)"))
        .collect();
    assert!(
        needed.iter().any(|line| line.contains("libc.so")),
        "the listing is the agent's: {needed:?}"
    );
    // The binary is what the build script decided.
    assert_eq!(
        needed.iter().any(|line| line.contains("libstdc++")),
        !stead_controller::STATIC_CPP_RUNTIME,
        "shared libraries {needed:?}"
    );
    // And where nothing asks otherwise and the compiler has the archive, it decided so.
    let opted_out = std::env::var_os("STEAD_SHARED_LIBSTDCXX").is_some()
        || (std::env::var_os("ROCKSDB_LIB_DIR").is_some()
            && std::env::var_os("ROCKSDB_STATIC").is_none());
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_owned());
    match stead_tests::compiler_file(&compiler, "libstdc++.a") {
        Some(archive) if !opted_out && !stead_controller::STATIC_CPP_RUNTIME => panic!(
            "{} is there, yet the shared C++ runtime is linked",
            archive.display()
        ),
        Some(_) if !opted_out => {}
        _ => eprintln!("{compiler} has no libstdc++.a, or the build was asked for the shared one"),
    }
}
