//! The packaging in `deploy/`: the manifests agree with each other and with the agent,
//! the real agent speaks systemd's notification protocol, the unit and the image pass
//! their platforms' own checks where those tools run, and the binary links its C++
//! runtime statically where it can.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use stead_controller::agent::{API_TOKEN_FILE, AgentArgs, ApiAuth, Settings};
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

/// The TCP address `settings` listen on.
fn listen(settings: &Settings) -> &str {
    settings
        .listen
        .as_deref()
        .expect("the config has a tcp listener")
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

/// Every document of the Kubernetes manifest.
fn kubernetes_documents() -> Vec<Value> {
    yaml_documents(&deploy("kubernetes/daemonset.yaml"))
}

/// The document of `kind` among `documents`.
fn of_kind<'a>(documents: &'a [Value], kind: &str) -> &'a Value {
    documents
        .iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("the Kubernetes manifest has no {kind}"))
}

/// The agent config the ConfigMap holds, as written.
fn config_map_config(documents: &[Value]) -> Value {
    let text = of_kind(documents, "ConfigMap")["data"]["agent.yaml"]
        .as_str()
        .expect("the ConfigMap holds agent.yaml");
    serde_saphyr::from_str(text).unwrap_or_else(|e| panic!("the ConfigMap's agent.yaml: {e}"))
}

/// The ConfigMap's agent config through the agent's own loader, its token file (a
/// path in the pod) replaced by a file of this test's.
fn config_map_settings(documents: &[Value]) -> Settings {
    let mut config = config_map_config(documents);
    let dir = tempfile::tempdir().expect("temp dir");
    if config.get("tokenFile").is_some() {
        let token = dir.path().join("token");
        std::fs::write(&token, "a-test-token\n").expect("token written");
        config["tokenFile"] = Value::from(token.display().to_string());
    }
    // JSON is YAML.
    let path = dir.path().join("agent.yaml");
    std::fs::write(&path, config.to_string()).expect("config written");
    Settings::resolve(&args(&path)).expect("the ConfigMap's config loads")
}

/// The volume mounted in `container` at `path`.
fn mount_at(container: &Value, path: &Path) -> Value {
    container["volumeMounts"]
        .as_array()
        .expect("volume mounts")
        .iter()
        .find(|m| m["mountPath"].as_str().map(Path::new) == Some(path))
        .unwrap_or_else(|| panic!("nothing is mounted at {}", path.display()))
        .clone()
}

/// The volume `name` of `pod`.
fn volume(pod: &Value, name: &Value) -> Value {
    pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| &v["name"] == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
        .clone()
}

/// The longest a drain may take with `settings`, with the margin every manifest's
/// grace keeps: three kill stages one after another (the leader, the other main tasks,
/// then sidecars), each up to `maxKillTimeout`, then 30 s for shutdown delays and
/// poststop tasks.
fn drain_grace(settings: &Settings) -> Duration {
    3 * settings.node.limits.max_kill_timeout + Duration::from_secs(30)
}

/// A duration as systemd and compose write them: `120`, `120s`, `2min`, `2m30s`, `1h`.
fn duration(text: &str) -> Duration {
    let mut total = 0;
    let mut rest = text.trim();
    if rest.chars().all(|c| c.is_ascii_digit()) {
        return Duration::from_secs(rest.parse().expect("seconds"));
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let number: u64 = rest[..digits]
            .parse()
            .unwrap_or_else(|_| panic!("{text:?} is not a duration"));
        rest = &rest[digits..];
        let unit = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        total += number
            * match &rest[..unit] {
                "s" | "sec" => 1,
                "m" | "min" => 60,
                "h" => 3600,
                other => panic!("{text:?}: unknown unit {other:?}"),
            };
        rest = &rest[unit..];
    }
    Duration::from_secs(total)
}

/// The `Key=value` directives of a systemd unit, in order (comments and sections left out).
fn unit_directives(unit: &str) -> Vec<(String, String)> {
    unit.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with(['#', ';', '[']))
        .filter_map(|l| l.split_once('='))
        .map(|(key, value)| (key.trim().to_owned(), value.trim().to_owned()))
        .collect()
}

/// The value of the unit's directive `key` (the last, as systemd takes it).
fn unit_directive(unit: &str, key: &str) -> Option<String> {
    unit_directives(unit)
        .into_iter()
        .rev()
        .find(|(k, _)| k == key)
        .map(|(_, value)| value)
}

/// The instructions of a Dockerfile as (name, arguments), continuation lines joined.
fn dockerfile_instructions(dockerfile: &str) -> Vec<(String, String)> {
    let mut instructions = Vec::new();
    let mut current = String::new();
    for line in dockerfile.lines() {
        let trimmed = line.trim();
        if current.is_empty() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(head) => {
                current.push_str(head);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                let (name, arguments) = current.split_once(' ').unwrap_or((&current, ""));
                instructions.push((name.to_uppercase(), arguments.trim().to_owned()));
                current.clear();
            }
        }
    }
    instructions
}

/// The command of the image's HEALTHCHECK, as an exec array (`CMD` dropped).
fn image_healthcheck() -> Vec<String> {
    let instructions = dockerfile_instructions(&read(&deploy("Dockerfile")));
    let healthcheck = instructions
        .iter()
        .rev()
        .find(|(name, _)| name == "HEALTHCHECK")
        .map(|(_, arguments)| arguments.clone())
        .expect("the image has a HEALTHCHECK");
    let (_, command) = healthcheck
        .split_once("CMD ")
        .expect("the HEALTHCHECK runs a command");
    let command: Vec<Value> =
        serde_json::from_str(command.trim()).expect("the HEALTHCHECK command is an exec array");
    command
        .iter()
        .map(|v| v.as_str().expect("a word").to_owned())
        .collect()
}

#[test]
fn example_agent_config_loads_through_the_agents_loader_and_documents_every_key() {
    let path = deploy("agent.yaml");
    let settings = Settings::resolve(&args(&path)).expect("deploy/agent.yaml is a valid config");
    assert_eq!(settings.specs_dir, Path::new("/etc/stead/specs"));
    assert_eq!(settings.data_dir, Path::new("/var/lib/stead"));
    assert_eq!(port_of(listen(&settings)), 4750);
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
    let api = serde_json::to_value(stead_schemas::config::ApiConfig::default()).expect("api");
    for key in keys(&api) {
        assert!(
            written["api"].get(&key).is_some(),
            "deploy/agent.yaml does not document api.{key}"
        );
    }
    assert!(
        !settings.mock_driver,
        "the example leaves the mock driver off"
    );
}

#[test]
fn daemonset_compose_image_and_agent_config_agree_on_port_paths_and_probe() {
    let documents = kubernetes_documents();
    let namespace = of_kind(&documents, "Namespace")["metadata"]["name"].clone();
    for document in documents.iter().filter(|d| d["kind"] != "Namespace") {
        assert_eq!(
            document["metadata"]["namespace"], namespace,
            "{} {}",
            document["kind"], document["metadata"]["name"]
        );
    }
    let config_map = of_kind(&documents, "ConfigMap");
    let daemon_set = of_kind(&documents, "DaemonSet");

    // The ConfigMap's agent config passes the agent's own loader.
    let k8s = config_map_settings(&documents);

    let pod = &daemon_set["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let container_args = container["args"].as_array().expect("container args");
    let mounted_config = Path::new(flag(container_args, "--config").expect("--config"));

    // The API port: config, containerPort, and both probes on /v1/health.
    let port = &container["ports"][0];
    assert_eq!(port["containerPort"], u64::from(port_of(listen(&k8s))));
    assert!(
        listen(&k8s).starts_with("0.0.0.0:"),
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
    let config_mount = mount_at(container, mounted_config.parent().expect("config dir"));
    assert_eq!(
        volume(pod, &config_mount["name"])["configMap"]["name"],
        config_map["metadata"]["name"]
    );
    let specs_mount = mount_at(container, &k8s.specs_dir);
    assert_eq!(specs_mount["readOnly"], true, "specs are mounted read-only");
    assert!(volume(pod, &specs_mount["name"]).get("hostPath").is_some());
    let state_mount = mount_at(container, &k8s.data_dir);
    assert_ne!(state_mount["readOnly"], true, "state is writable");
    assert!(volume(pod, &state_mount["name"]).get("hostPath").is_some());

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
    assert_eq!(instruction("EXPOSE"), [port_of(listen(&k8s)).to_string()]);
    assert!(
        instruction("VOLUME")
            .iter()
            .any(|v| v.contains(&example.data_dir.display().to_string())),
        "the state dir is a volume"
    );
    let cmd: Vec<Value> = serde_json::from_str(&instruction("CMD")[0]).expect("CMD is JSON");
    assert_eq!(
        port_of(flag(&cmd, "--listen").expect("the image listens on all interfaces")),
        port_of(listen(&example))
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
            .any(|p| p.ends_with(&format!(":{}", port_of(listen(&example))))),
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
    assert!(healthcheck.contains(&format!("127.0.0.1:{}", port_of(listen(&example)))));
}

#[test]
fn drain_graces_cover_three_kill_timeouts_and_a_margin_for_the_config_each_manifest_runs() {
    // Kubernetes: the pod's grace against the ConfigMap's config.
    let documents = kubernetes_documents();
    let k8s = config_map_settings(&documents);
    assert_eq!(k8s.shutdown, stead_controller::queue::Shutdown::Drain);
    let pod = &of_kind(&documents, "DaemonSet")["spec"]["template"]["spec"];
    let grace = Duration::from_secs(
        pod["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("terminationGracePeriodSeconds"),
    );
    assert!(
        grace >= drain_grace(&k8s),
        "terminationGracePeriodSeconds {grace:?} < {:?}",
        drain_grace(&k8s)
    );

    // Compose runs the image, which drains with deploy/agent.yaml.
    let example = Settings::resolve(&args(&deploy("agent.yaml"))).expect("example config");
    let dockerfile = dockerfile_instructions(&read(&deploy("Dockerfile")));
    let (_, cmd) = dockerfile
        .iter()
        .rev()
        .find(|(name, _)| name == "CMD")
        .expect("the image has a CMD");
    let cmd: Vec<Value> = serde_json::from_str(cmd).expect("CMD is JSON");
    assert!(cmd.iter().any(|a| a == "--drain"), "the image drains");
    assert_eq!(flag(&cmd, "--config"), Some("/etc/stead/agent.yaml"));
    let compose = &yaml_documents(&deploy("compose.yaml"))[0];
    let stop = compose["services"]["stead"]["stop_grace_period"]
        .as_str()
        .expect("compose sets stop_grace_period");
    assert!(
        duration(stop) >= drain_grace(&example),
        "stop_grace_period {stop} < {:?}",
        drain_grace(&example)
    );

    // systemd runs deploy/agent.yaml, installed as /etc/stead/agent.yaml; it drains
    // there when the config says `shutdown: drain`.
    let unit = read(&deploy("systemd/stead.service"));
    let stop = unit_directive(&unit, "TimeoutStopSec").expect("the unit sets TimeoutStopSec");
    assert!(
        duration(&stop) >= drain_grace(&example),
        "TimeoutStopSec={stop} < {:?}",
        drain_grace(&example)
    );
}

#[test]
fn daemonset_api_requires_the_token_of_a_secret_mounted_read_only() {
    let documents = kubernetes_documents();
    let config = config_map_config(&documents);
    let token_file = Path::new(
        config["tokenFile"]
            .as_str()
            .expect("the ConfigMap's config sets tokenFile"),
    );
    let pod = &of_kind(&documents, "DaemonSet")["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let mount = mount_at(container, token_file.parent().expect("token dir"));
    assert_eq!(mount["readOnly"], true, "the token is mounted read-only");
    let volume = volume(pod, &mount["name"]);
    // The Secret is made apart from this file (its header says how), so applying the
    // file again never resets the token; the pods wait for it rather than run without.
    assert!(
        documents.iter().all(|d| d["kind"] != "Secret"),
        "a Secret in the manifest is reset by every apply"
    );
    assert_eq!(volume["secret"]["secretName"], "stead-token");
    assert_ne!(volume["secret"]["optional"], true, "the pods wait for it");
    assert!(
        volume["secret"].get("items").is_none(),
        "every key is a file"
    );
    let key = token_file
        .file_name()
        .and_then(|name| name.to_str())
        .expect("a file name");
    let header = read(&deploy("kubernetes/daemonset.yaml"));
    assert!(
        header.contains("create secret generic stead-token")
            && header.contains(&format!("--from-literal={key}=")),
        "the manifest says how to make the Secret with the key {key}"
    );
    // The agent's user reads the file: as another user, or through the pod's fsGroup.
    let mode = volume["secret"]["defaultMode"].as_u64().unwrap_or(0o644);
    let context = &pod["securityContext"];
    assert!(
        mode & 0o004 != 0 || (mode & 0o040 != 0 && context["fsGroup"] == context["runAsGroup"]),
        "the agent's user cannot read the token file (mode {mode:o})"
    );

    // The probes stay on the one endpoint that needs no token.
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(container[probe]["httpGet"]["path"], "/v1/health", "{probe}");
    }
}

#[test]
fn daemonset_network_policy_admits_no_pod_to_the_api_port() {
    let documents = kubernetes_documents();
    let api_port = port_of(listen(&config_map_settings(&documents)));
    let daemon_set = of_kind(&documents, "DaemonSet");
    let labels = &daemon_set["spec"]["template"]["metadata"]["labels"];
    let policy = of_kind(&documents, "NetworkPolicy");
    for (key, value) in policy["spec"]["podSelector"]["matchLabels"]
        .as_object()
        .expect("the policy selects by labels")
    {
        assert_eq!(&labels[key], value, "the policy selects the agent's pods");
    }
    assert!(strings(&policy["spec"]["policyTypes"]).contains(&"Ingress".to_owned()));
    let port_name = &daemon_set["spec"]["template"]["spec"]["containers"][0]["ports"][0]["name"];
    for rule in policy["spec"]["ingress"].as_array().into_iter().flatten() {
        let ports = rule["ports"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        assert!(
            !ports.is_empty(),
            "a rule without ports admits the API: {rule}"
        );
        for port in ports {
            let tcp = port.get("protocol").is_none_or(|p| p == "TCP");
            let first = port["port"].as_u64();
            let last = port["endPort"].as_u64().or(first);
            let admits = tcp
                && (port.get("port").is_none()
                    || &port["port"] == port_name
                    || first.zip(last).is_some_and(|(first, last)| {
                        (first..=last).contains(&u64::from(api_port))
                    }));
            assert!(!admits, "{port} admits the API port {api_port}");
        }
    }
}

#[test]
fn daemonset_rolls_one_pinned_image_out_node_by_node_and_is_evicted_last() {
    let documents = kubernetes_documents();
    let daemon_set = of_kind(&documents, "DaemonSet");
    let strategy = &daemon_set["spec"]["updateStrategy"];
    assert_eq!(strategy["type"], "RollingUpdate");
    // Two agents on one data dir: the second is refused by the lock.
    let surge = &strategy["rollingUpdate"]["maxSurge"];
    assert!(surge == 0 || surge == "0", "maxSurge is 0, not {surge}");

    let pod = &daemon_set["spec"]["template"]["spec"];
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    assert!(
        pod["tolerations"]
            .as_array()
            .expect("tolerations")
            .iter()
            .any(|t| t["operator"] == "Exists"
                && t.get("key").is_none()
                && t.get("effect").is_none()),
        "the pod tolerates every taint"
    );
    let containers: Vec<&Value> = ["initContainers", "containers"]
        .iter()
        .flat_map(|list| pod[list].as_array().into_iter().flatten())
        .collect();
    for container in &containers {
        let name = &container["name"];
        // Guaranteed: requests equal limits, for every container.
        let resources = &container["resources"];
        for resource in ["cpu", "memory"] {
            assert!(
                resources["requests"].get(resource).is_some(),
                "{name}: requests.{resource}"
            );
            assert_eq!(
                resources["requests"][resource], resources["limits"][resource],
                "{name}: {resource} requests equal limits"
            );
        }
        // A versioned tag, the workspace's version, never latest.
        let image = container["image"].as_str().expect("an image");
        let tag = image
            .rsplit_once('/')
            .map_or(image, |(_, last)| last)
            .split_once(':')
            .map(|(_, tag)| tag);
        assert_eq!(
            tag,
            Some(env!("CARGO_PKG_VERSION")),
            "{name}: image {image}"
        );
    }

    // The level re-check stays at the agent's default.
    assert!(
        config_map_config(&documents).get("tick").is_none(),
        "the ConfigMap keeps the default tick"
    );
    let compose = &yaml_documents(&deploy("compose.yaml"))[0];
    let image = compose["services"]["stead"]["image"]
        .as_str()
        .expect("image");
    assert!(
        image.ends_with(&format!(":{}", env!("CARGO_PKG_VERSION"))),
        "compose tags {image}"
    );
}

#[test]
fn image_carries_python3_and_checks_health_without_a_token() {
    let dockerfile = dockerfile_instructions(&read(&deploy("Dockerfile")));
    let runtime = dockerfile
        .iter()
        .rposition(|(name, _)| name == "FROM")
        .expect("a FROM");
    let installed: Vec<&str> = dockerfile[runtime..]
        .iter()
        .filter(|(name, arguments)| name == "RUN" && arguments.contains("apt-get install"))
        .flat_map(|(_, arguments)| arguments.split_whitespace())
        .collect();
    // python3-minimal has no http.server, which the web example runs.
    assert!(
        installed.contains(&"python3"),
        "the runtime image installs python3: {installed:?}"
    );

    let example = Settings::resolve(&args(&deploy("agent.yaml"))).expect("example config");
    let address = format!("127.0.0.1:{}", port_of(listen(&example)));
    let image = image_healthcheck();
    assert_eq!(
        image,
        [
            "/usr/local/bin/stead",
            "node",
            "health",
            "--address",
            address.as_str()
        ],
        "the image asks /v1/health, which needs no token (`node status` would)"
    );
    let compose = &yaml_documents(&deploy("compose.yaml"))[0];
    let test = strings(&compose["services"]["stead"]["healthcheck"]["test"]);
    assert_eq!(test.first().map(String::as_str), Some("CMD"));
    assert_eq!(test[1..], image[..], "compose checks as the image does");
}

#[test]
fn every_shipped_config_guards_the_api_with_a_token_its_users_are_told_how_to_find() {
    // Host and image: the token the agent generates, in the data dir the CLI looks in
    // (the config's, at /etc/stead/agent.yaml, or /var/lib/stead).
    let example = Settings::resolve(&args(&deploy("agent.yaml"))).expect("example config");
    assert_eq!(example.token, ApiAuth::Generated);
    assert_eq!(example.data_dir, Path::new("/var/lib/stead"));
    let cmd: Vec<Value> = serde_json::from_str(
        &dockerfile_instructions(&read(&deploy("Dockerfile")))
            .iter()
            .rfind(|(name, _)| name == "CMD")
            .expect("a CMD")
            .1,
    )
    .expect("CMD is JSON");
    assert_eq!(flag(&cmd, "--config"), Some("/etc/stead/agent.yaml"));
    // `make run`: the CLI's first fallback, from the repository root.
    let dev = Settings::resolve(&args(&deploy("dev-agent.yaml"))).expect("dev config");
    assert_eq!(dev.token, ApiAuth::Generated);
    assert_eq!(dev.data_dir, Path::new("./stead-data"));
    // Kubernetes: a token of the operator's, from a Secret.
    let k8s = config_map_settings(&kubernetes_documents());
    assert!(matches!(k8s.token, ApiAuth::Token(_)), "{:?}", k8s.token);
    // Compose publishes the port, and says how to read the generated token.
    for file in ["compose.yaml", "Dockerfile"] {
        let text = read(&deploy(file));
        assert!(
            text.contains(&format!("/var/lib/stead/{API_TOKEN_FILE}")),
            "{file} says where the token is"
        );
    }
}

#[test]
fn systemd_unit_lets_tasks_of_other_users_reach_their_alloc_dirs() {
    let unit = read(&deploy("systemd/stead.service"));
    let mode = unit_directive(&unit, "StateDirectoryMode").expect("StateDirectoryMode");
    let mode = u32::from_str_radix(&mode, 8).expect("an octal mode");
    assert!(
        mode & 0o001 != 0,
        "StateDirectoryMode={mode:o}: other users cannot traverse the data dir"
    );
    if let Some(umask) = unit_directive(&unit, "UMask") {
        let umask = u32::from_str_radix(&umask, 8).expect("an octal umask");
        assert_eq!(
            umask & !0o022,
            0,
            "UMask={umask:o}: tasks inherit it, and it takes more than 0022"
        );
    }
}

#[test]
fn systemd_unit_delegates_its_cgroup_to_the_agent_and_kills_only_the_agent() {
    let unit = read(&deploy("systemd/stead.service"));
    // Without delegation systemd may rewrite the cgroups the agent made for its tasks.
    assert_eq!(unit_directive(&unit, "Delegate").as_deref(), Some("yes"));
    // A restarted agent starts in its leaf: the service's cgroup hands controllers down
    // and may hold no process (cgroup v2).
    assert_eq!(
        unit_directive(&unit, "DelegateSubgroup").as_deref(),
        Some(stead_schemas::config::AGENT_CGROUP_LEAF)
    );
    // Tasks in their own cgroups below the service outlive an agent restart.
    assert_eq!(
        unit_directive(&unit, "KillMode").as_deref(),
        Some("process")
    );
    assert_ne!(
        unit_directive(&unit, "ProtectControlGroups").as_deref(),
        Some("yes")
    );
}

#[test]
fn systemd_unit_keeps_no_hardening_that_tasks_inherit_to_their_cost() {
    let unit = read(&deploy("systemd/stead.service"));
    let directives = unit_directives(&unit);
    for breaking in [
        // A device allow-list on older systemd (no GPU, /dev/fuse or tun); read-only
        // adjtimex blocked.
        "ProtectClock",
        "DeviceAllow",
        "DevicePolicy",
        "PrivateDevices",
        // Namespaces: a task's view of the host would differ from the host's.
        "ProtectHostname",
        "ProtectKernelLogs",
        "ProtectSystem",
        "ProtectHome",
        "PrivateTmp",
        "PrivateMounts",
        // Ordinary programs: setuid helpers, realtime scheduling, module loading.
        "NoNewPrivileges",
        "RestrictSUIDSGID",
        "RestrictRealtime",
        "ProtectKernelModules",
        "User",
    ] {
        assert!(
            directives.iter().all(|(key, _)| key != breaking),
            "the unit sets {breaking}, which every task inherits"
        );
    }
    // Tasks start with the soft limit, which the agent keeps for them while it raises its
    // own: enough for servers that check it (65535 and more), not a million.
    let nofile = unit_directive(&unit, "LimitNOFILE").expect("LimitNOFILE");
    let (soft, hard) = nofile.split_once(':').expect("LimitNOFILE=SOFT:HARD");
    let soft: u64 = soft.parse().expect("a number");
    assert!(
        (65535..=65536).contains(&soft),
        "LimitNOFILE={nofile}: tasks start with {soft}"
    );
    assert!(hard.parse::<u64>().expect("a number") > soft);
}

#[test]
fn systemd_unit_restarts_the_agent_however_it_ended() {
    // systemd counts death by SIGTERM or SIGHUP as clean: on-failure would leave tasks
    // running unsupervised. `systemctl stop` stops it whatever Restart= says.
    let unit = read(&deploy("systemd/stead.service"));
    assert_eq!(unit_directive(&unit, "Restart").as_deref(), Some("always"));
}

#[test]
fn make_recipes_fail_when_a_command_piped_into_tee_fails() {
    let makefile = read(&workspace_dir().join("Makefile"));
    assert!(
        makefile.contains("| tee "),
        "the bench recipe pipes its report into tee"
    );
    let probe = |recipe: &str| {
        std::process::Command::new("make")
            .args(["--no-print-directory", "--file", "Makefile", "--eval"])
            .arg(format!("pipefail-probe: ; {recipe}"))
            .arg("pipefail-probe")
            .current_dir(workspace_dir())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
    };
    // The control: the same recipe with a command that succeeds passes, so a failure
    // below is the pipe's, not make's.
    match probe("true | tee /dev/null") {
        Ok(status) => assert!(status.success(), "the control recipe fails: {status}"),
        Err(error) => {
            println!("skipped the recipe check: no make ({error})");
            return;
        }
    }
    let failing = probe("false | tee /dev/null").expect("make runs");
    assert!(
        !failing.success(),
        "a recipe whose piped command fails passes: the Makefile's shell lacks pipefail"
    );
}

#[test]
fn install_deps_installs_the_kill_program_the_tests_run() {
    let script = read(&workspace_dir().join("scripts/install-deps.sh"));
    let packages = script
        .lines()
        .find_map(|l| l.trim().strip_prefix("packages=("))
        .and_then(|l| l.strip_suffix(')'))
        .expect("install-deps.sh lists its packages");
    assert!(
        packages.split_whitespace().any(|p| p == "procps"),
        "procps (kill) is missing from {packages}"
    );
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
        // The mock driver is off unless turned on.
        let config = dir.path().join("agent.yaml");
        std::fs::write(&config, "drivers: {mock: {enabled: true}}\n").expect("config written");
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_stead-test-agent"))
            .arg("agent")
            .arg("--config")
            .arg(&config)
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
    // The log lines that follow the store's open, the restore and the API's bind are
    // written (synchronously) before READY=1 is sent, so they are in the file by now; and
    // the API already answers.
    let log = agent.log();
    let position = |needle: &str| log.lines().position(|l| l.contains(needle));
    assert!(
        position("agent started").is_some(),
        "READY=1 came before the agent restored its state:\n{log}"
    );
    let api = position("api listening")
        .unwrap_or_else(|| panic!("READY=1 came before the API listened:\n{log}"));
    // This data dir is new: its store is created before anything starts, the API
    // included.
    assert!(
        position("state store opened").is_some_and(|opened| opened < api),
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

/// The local systemd's version (`systemd 252 (252.38-1~deb12u1)` is 252).
fn systemd_version() -> Option<u32> {
    let output = std::process::Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .ok()?;
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
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
    // `DelegateSubgroup=` came with systemd 254; an older one ignores it, and the agent
    // then moves itself into its leaf (the unit says so). Nothing else may be unknown.
    let newer = systemd_version().is_some_and(|version| version >= 254);
    let complaints: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains("stead.service"))
        .filter(|line| newer || !line.contains("Unknown key 'DelegateSubgroup'"))
        .collect();
    assert!(
        output.status.success() && complaints.is_empty(),
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
    let run = |entrypoint: &str, args: &[&str]| {
        std::process::Command::new("docker")
            .args(["run", "--rm", "--entrypoint", entrypoint, "stead:test"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("docker run runs")
    };
    // Both binaries run in the image (the entrypoint is tini, then stead).
    let version = std::process::Command::new("docker")
        .args(["run", "--rm", "stead:test", "--version"])
        .output()
        .expect("docker run runs");
    let printed = String::from_utf8_lossy(&version.stdout);
    assert!(
        version.status.success() && printed.starts_with("stead "),
        "stead --version in the image: {}\n{printed}{}",
        version.status,
        String::from_utf8_lossy(&version.stderr)
    );
    let supervisor = run("/usr/local/bin/stead-supervisor", &["--version"]);
    let reported = String::from_utf8_lossy(&supervisor.stdout);
    assert!(
        supervisor.status.success() && reported.starts_with("stead-supervisor "),
        "stead-supervisor in the image: {}\n{reported}{}",
        supervisor.status,
        String::from_utf8_lossy(&supervisor.stderr)
    );
    // The examples' tools.
    let python = run("python3", &["-c", "import http.server, urllib.request"]);
    assert!(
        python.status.success(),
        "python3 in the image cannot run the examples: {}",
        String::from_utf8_lossy(&python.stderr)
    );

    // The image's own health check passes against a running agent.
    let name = format!("stead-packaging-{}", std::process::id());
    let started = std::process::Command::new("docker")
        .args(["run", "--detach", "--name", &name, "stead:test"])
        .output()
        .expect("docker run runs");
    assert!(
        started.status.success(),
        "the image starts: {}",
        String::from_utf8_lossy(&started.stderr)
    );
    /// Removes the container when the test ends, whatever happened.
    struct Removed(String);
    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = std::process::Command::new("docker")
                .args(["rm", "--force", "--volumes", &self.0])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
    let _container = Removed(name.clone());
    let check = image_healthcheck();
    let began = std::time::Instant::now();
    loop {
        let passed = std::process::Command::new("docker")
            .args(["exec", &name])
            .args(&check)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if passed {
            break;
        }
        assert!(
            began.elapsed() < DEADLINE,
            "the image's health check {check:?} did not pass within {DEADLINE:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
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

#[test]
fn the_supervisor_says_its_version_so_a_package_can_be_checked() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_stead-test-supervisor"))
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .expect("the supervisor runs");
    assert!(output.status.success(), "{}", output.status);
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        format!("stead-supervisor {}\n", env!("CARGO_PKG_VERSION"))
    );
}

/// The JSON log's events named `message`, as their `fields` objects.
fn logged(log: &str, message: &str) -> Vec<serde_json::Map<String, Value>> {
    log.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter_map(|event| match event.get("fields") {
            Some(Value::Object(fields)) if fields.get("message") == Some(&Value::from(message)) => {
                Some(fields.clone())
            }
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn json_log_fields_carry_values_and_leave_out_the_unset_ones() {
    let agent = Agent::start("", &[]);
    std::fs::write(
        agent._dir.path().join("specs/signalled.yaml"),
        r#"apiVersion: stead/v1
kind: Alloc
metadata: {name: signalled}
spec:
  type: batch
  restart: {attempts: 0, mode: fail}
  tasks:
    - {name: main, driver: mock, config: {runFor: 10ms, exitSignal: 2}}
"#,
    )
    .expect("spec written");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let exited = loop {
        let exited = logged(&agent.log(), "task exited");
        if let Some(fields) = exited.into_iter().next() {
            break fields;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no `task exited` event within {DEADLINE:?}:\n{}",
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // A value is the value itself, not its Debug form in a string.
    assert_eq!(exited.get("signal"), Some(&Value::from(2)), "{exited:?}");
    // Unset is absent, not "None".
    assert!(!exited.contains_key("error"), "{exited:?}");
    let started = logged(&agent.log(), "task started");
    let started = started.first().expect("the start is logged");
    // A mock task has no pid.
    assert!(!started.contains_key("pid"), "{started:?}");
    let log = agent.log();
    assert!(
        !log.contains("Some(") && !log.contains("\"None\""),
        "a field shows an Option's Debug form:\n{log}"
    );
}
