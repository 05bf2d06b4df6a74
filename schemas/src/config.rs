//! The agent's configuration file (`stead agent --config FILE`): YAML, every key
//! optional, flags override it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

use crate::duration::Duration;

/// The agent configuration as written; unset keys take the defaults in `stead agent`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentConfig {
    /// The directory of alloc specs (default `./specs`).
    pub specs_dir: Option<PathBuf>,
    /// Where state and alloc directories live (default `./stead-data`).
    pub data_dir: Option<PathBuf>,
    /// The API's TCP address (default `127.0.0.1:4750`): `None` when the key is left
    /// out, `Some(None)` for `listen: null`, which turns the TCP listener off (then
    /// `socket` must be set).
    #[serde(default, deserialize_with = "listen")]
    pub listen: Option<Option<String>>,
    /// Also serve the API on this unix socket, created mode 0600.
    pub socket: Option<PathBuf>,
    /// The bearer token the API requires, or `none` for none (only on loopback or the
    /// unix socket); unset, with no `tokenFile`, the agent generates one into
    /// `<dataDir>/api-token`.
    pub token: Option<TokenConfig>,
    /// A file holding the bearer token (its surrounding whitespace is ignored).
    pub token_file: Option<PathBuf>,
    /// The level re-check period (default 10s): a worker with a lost wake-up or a due
    /// time is woken within one, and every alloc is reconciled every 10 ticks (at least
    /// a minute apart).
    #[serde(default, deserialize_with = "tick")]
    pub tick: Option<Duration>,
    /// The full re-listing period of the specs directory (default 20s).
    #[serde(default, deserialize_with = "resync")]
    pub resync: Option<Duration>,
    /// Watch the specs directory for changes (default true); false relies on resync.
    pub watch: Option<bool>,
    /// The longest kill timeout a task gets (default 30s).
    pub max_kill_timeout: Option<Duration>,
    /// Events kept per task (default 50).
    pub max_task_events: Option<u32>,
    /// What the agent does to tasks when it exits (default detach).
    pub shutdown: Option<ShutdownMode>,
    /// Whether exec tasks may run as root (default false).
    pub allow_root: Option<bool>,
    /// What a task with resource limits does where the exec driver cannot enforce them
    /// (no writable cgroup): `bestEffort` starts it with a `Limits Not Enforced` event
    /// (the default), `required` fails its start with `Driver Failure`.
    pub limits: Option<LimitsMode>,
    /// The cgroup, below the agent's own, that holds a cgroup per task run (default
    /// `stead`); two agents on one host need two names.
    #[serde(default, deserialize_with = "cgroup_parent")]
    pub cgroup_parent: Option<String>,
    /// Garbage collection of terminal allocs.
    pub gc: Option<GcConfig>,
    /// The state store under the data dir.
    pub store: Option<StoreConfig>,
    /// Which drivers run.
    pub drivers: Option<DriversConfig>,
    /// Devices, by plugin.
    pub devices: Option<DevicesConfig>,
    /// Log output format (default text).
    pub log_format: Option<LogFormat>,
    /// How much of the agent's resources the API may take.
    pub api: Option<ApiConfig>,
    /// The agent's own `oom_score_adj`, -1000 to 1000 (default -900: the kernel's OOM
    /// killer picks a task first); its tasks keep the value the agent started with.
    #[serde(default, deserialize_with = "oom_score_adj")]
    pub oom_score_adj: Option<i16>,
    /// The fleet source: desired allocs from etcd, status written back.
    pub fleet: Option<FleetConfig>,
}

/// `fleet`: take desired allocs from an etcd cluster beside the specs dir.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetConfig {
    /// The cluster's client URLs; empty (the default) turns the fleet source off.
    #[serde(default)]
    pub etcd: Vec<String>,
    /// The key prefix (default `/stead/v1`).
    pub prefix: Option<String>,
    /// This node.
    pub node: Option<FleetNodeConfig>,
}

/// `fleet.node`: the name this agent claims and the labels `nodeSelector`s match.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetNodeConfig {
    /// The node's name (default: the host name).
    pub name: Option<String>,
    /// The node's labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// The API's bounds: how long a client may take to send a request's head, and how many
/// connections, followed log streams and exec sessions it may hold.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiConfig {
    /// How long a connection may take to send a request's head, and how long a
    /// keep-alive connection may wait idle for its next request (default 10s).
    #[serde(default, deserialize_with = "header_timeout")]
    pub header_timeout: Option<Duration>,
    /// Connections served at once, over TCP and the unix socket together (default 512).
    pub max_connections: Option<u32>,
    /// Log streams followed at once (`?follow=true`; default 256); more get 503.
    pub max_log_streams: Option<u32>,
    /// Commands run at once by `stead alloc exec` (default 16); more get 503.
    pub max_execs: Option<u32>,
}

/// The `token` key: the API's bearer token, or `none`.
///
/// `none` is the one spelling of "no token", so a token that is literally `none` cannot
/// be configured; `None`, `NONE` and the like are refused rather than taken for a token
/// anyone would guess.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum TokenConfig {
    /// `token: none`: the API requires no token.
    None,
    /// Requests need `Authorization: Bearer <token>`. Invariant: not blank.
    Bearer(String),
}

/// The word that says "no token" in `token`.
pub const NO_TOKEN: &str = "none";

impl TryFrom<String> for TokenConfig {
    type Error = String;

    /// Surrounding whitespace is dropped, as a client's is.
    fn try_from(token: String) -> Result<Self, Self::Error> {
        let token = token.trim();
        if token == NO_TOKEN {
            Ok(TokenConfig::None)
        } else if token.eq_ignore_ascii_case(NO_TOKEN) {
            Err(format!(
                "token: {token:?} is not a token; write `token: {NO_TOKEN}` to serve without one"
            ))
        } else if token.is_empty() {
            Err(format!(
                "token: empty; remove the key for a generated token, or write `token: {NO_TOKEN}` to require none"
            ))
        } else {
            Ok(TokenConfig::Bearer(token.to_owned()))
        }
    }
}

impl From<TokenConfig> for String {
    fn from(token: TokenConfig) -> String {
        match token {
            TokenConfig::None => NO_TOKEN.to_owned(),
            TokenConfig::Bearer(token) => token,
        }
    }
}

/// Never shows the secret.
impl std::fmt::Debug for TokenConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenConfig::None => f.write_str("None"),
            TokenConfig::Bearer(_) => f.write_str("Bearer(<secret>)"),
        }
    }
}

/// What happens to tasks when the agent exits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShutdownMode {
    /// Tasks keep running; the next agent reattaches.
    Detach,
    /// Every alloc is stopped, all in parallel.
    Drain,
}

/// Whether resource limits must be enforced for a task to start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum LimitsMode {
    /// Tasks start even where their limits cannot be enforced, with an event saying so.
    #[default]
    BestEffort,
    /// A task whose limits cannot be enforced does not start.
    Required,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Garbage collection of terminal allocs (Nomad's policy).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GcConfig {
    /// How often GC runs (default 1m).
    #[serde(default, deserialize_with = "gc_interval")]
    pub interval: Option<Duration>,
    /// Terminal allocs kept at most (default 50).
    pub max_allocs: Option<u32>,
    /// Disk usage, in percent of the data dir's filesystem, above which GC collects (default 80).
    pub disk_usage_threshold: Option<u8>,
    /// Allocs destroyed at once (default 2).
    pub parallel_destroys: Option<u32>,
}

/// The RocksDB state store.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StoreConfig {
    /// Memory for RocksDB's write buffers and block cache together, in MiB (default 8).
    #[serde(rename = "memoryMB")]
    pub memory_mb: Option<u32>,
    /// fsync every write, surviving power loss as well as crashes (default false: writes
    /// reach the write-ahead log, which survives the agent's crash).
    pub sync: Option<bool>,
}

/// Which drivers are enabled.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DriversConfig {
    /// The exec driver.
    pub exec: Option<DriverToggle>,
    /// The mock driver.
    pub mock: Option<DriverToggle>,
}

/// A driver's switch.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DriverToggle {
    /// Whether the driver runs (default true).
    pub enabled: Option<bool>,
}

/// Device plugins and their devices.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DevicesConfig {
    /// Devices declared in this file.
    #[serde(rename = "static")]
    pub static_devices: Option<Vec<StaticDeviceGroup>>,
    /// How often the static plugin reads its health files (default 5s).
    #[serde(default, deserialize_with = "health_interval")]
    pub health_interval: Option<Duration>,
    /// The `nvidia` plugin: NVIDIA GPUs through NVML; runs when set.
    pub nvidia: Option<NvidiaDevicesConfig>,
    /// The `k8s` plugin kind: device plugins that speak the Kubernetes device-plugin API
    /// (v1beta1); runs when set.
    pub k8s: Option<K8sDevicesConfig>,
}

/// The Kubernetes device-plugin API's kubelet side.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct K8sDevicesConfig {
    /// Where `kubelet.sock` (the registration socket) is served and registered plugins'
    /// sockets are found (default `<dataDir>/device-plugins`). Never the real kubelet's
    /// directory while a kubelet runs.
    pub socket_dir: Option<PathBuf>,
    /// Whether plugins may register on `kubelet.sock` (default true).
    pub registration: Option<bool>,
    /// Plugins dialled at their socket without registering (some dial the kubelet's
    /// socket in ways it refuses; they run with registration off).
    #[serde(default)]
    pub endpoints: Vec<K8sEndpointConfig>,
    /// Variables of a plugin's `Allocate` answer set again under another name for tasks
    /// run on the host: `{NVIDIA_VISIBLE_DEVICES: CUDA_VISIBLE_DEVICES}`.
    #[serde(default)]
    pub env_map: BTreeMap<String, String>,
}

/// A device plugin dialled without registration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct K8sEndpointConfig {
    /// Its socket.
    pub socket: PathBuf,
    /// The resource it serves, `vendor.com/type`.
    pub resource: String,
    /// The device group's model name (default: the socket's file name without
    /// `.sock`), so the group is `vendor.com/type/<name>`.
    pub name: Option<String>,
}

/// The `nvidia` device plugin's settings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NvidiaDevicesConfig {
    /// The NVML library to load (default `libnvidia-ml.so.1`, found as the dynamic
    /// loader finds libraries). Without it the plugin reports no devices and says why.
    pub library: Option<PathBuf>,
    /// How long a GPU must go without a critical fault before it is healthy again
    /// (default 5m).
    #[serde(default, deserialize_with = "clean_period")]
    pub clean_period: Option<Duration>,
    /// Xid codes that do not make a GPU unhealthy, on top of the application errors
    /// that never do (13, 31, 43, 45, 68, 109).
    #[serde(default)]
    pub ignored_xids: Vec<u64>,
    /// Extra variables, by name, each set to the same GPU ids as `CUDA_VISIBLE_DEVICES`
    /// (which is always set, with `NVIDIA_VISIBLE_DEVICES`).
    #[serde(default)]
    pub visible_devices_env: Vec<String>,
}

/// A group of identical devices declared in the config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StaticDeviceGroup {
    /// The vendor, such as `nvidia`.
    pub vendor: String,
    /// The device type, such as `gpu`.
    #[serde(rename = "type")]
    pub device_type: String,
    /// The model name.
    pub name: String,
    /// A directory with one file per instance, named by its id: a file whose text starts
    /// with `unhealthy` marks the instance unhealthy (the rest of the text says why); a
    /// missing file or any other text means healthy. `<id>.stats` holds the instance's
    /// stats, one `name value` per line. If the directory goes away, the plugin stops
    /// (its devices turn unhealthy) and is restarted with backoff until it is back.
    pub health_dir: Option<PathBuf>,
    /// The instances.
    pub instances: Vec<StaticDeviceInstance>,
}

/// One device instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StaticDeviceInstance {
    /// Its id, unique in its group.
    pub id: String,
}

/// The period of a loop, `key`: longer than zero, which would make the loop spin (or,
/// for a timer, not start at all).
fn period<'de, D: Deserializer<'de>>(
    deserializer: D,
    key: &str,
) -> Result<Option<Duration>, D::Error> {
    let period = Option::<Duration>::deserialize(deserializer)?;
    if period.is_some_and(|p| p.get().is_zero()) {
        return Err(serde::de::Error::custom(format!(
            "{key}: a period must be longer than 0s"
        )));
    }
    Ok(period)
}

fn tick<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
    period(deserializer, "tick")
}

fn resync<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
    period(deserializer, "resync")
}

fn gc_interval<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
    period(deserializer, "gc.interval")
}

fn health_interval<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Duration>, D::Error> {
    period(deserializer, "devices.healthInterval")
}

fn clean_period<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Duration>, D::Error> {
    period(deserializer, "devices.nvidia.cleanPeriod")
}

fn header_timeout<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Duration>, D::Error> {
    period(deserializer, "api.headerTimeout")
}

/// An `oom_score_adj` the kernel takes: -1000 to 1000.
fn oom_score_adj<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<i16>, D::Error> {
    let value = Option::<i64>::deserialize(deserializer)?;
    match value {
        None => Ok(None),
        Some(value) if (-1000..=1000).contains(&value) => Ok(Some(value as i16)),
        Some(value) => Err(serde::de::Error::custom(format!(
            "oomScoreAdj: {value} is outside -1000 to 1000"
        ))),
    }
}

/// The name of the cgroup below the agent's that holds its tasks' cgroups.
pub const DEFAULT_CGROUP_PARENT: &str = "stead";
/// The leaf cgroup a cgroup v2 agent moves itself into, beside its tasks' parent.
pub const AGENT_CGROUP_LEAF: &str = "stead-agent";

/// Whether `name` can name the tasks' parent cgroup: letters, digits, `-` and `_`, at
/// most 64 bytes; no `.` (control files are named `<controller>.<file>`), not v1's
/// `tasks`, not the agent's own leaf.
pub fn is_cgroup_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name != "tasks"
        && name != AGENT_CGROUP_LEAF
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
}

fn cgroup_parent<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<String>, D::Error> {
    let name = Option::<String>::deserialize(deserializer)?;
    if let Some(name) = &name
        && !is_cgroup_name(name)
    {
        return Err(serde::de::Error::custom(format!(
            "cgroupParent: {name:?} is not a cgroup name (letters, digits, '-' and '_', at most 64, not \"tasks\" or {AGENT_CGROUP_LEAF:?})"
        )));
    }
    Ok(name)
}

/// `listen`, present: an address, or `null` for no TCP listener.
fn listen<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(deserializer).map(Some)
}

/// One problem of a config file, at its line and column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    /// Where, from 1.
    pub line: u64,
    /// Where, from 1.
    pub column: u64,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: {}", self.line, self.column, self.message)
    }
}

/// A config file that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read agent config {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid agent config: every problem, one per line, in file order.
    #[error("{}", problems.iter().map(|p| format!("{}:{p}", path.display())).collect::<Vec<_>>().join("\n"))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every problem found. Invariant: not empty.
        problems: Vec<ConfigProblem>,
    },
}

impl AgentConfig {
    /// Reads and checks the config file at `path`.
    pub fn load(path: &Path) -> Result<AgentConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        AgentConfig::parse(path, &text)
    }

    /// Checks `text` as the config file `path`; an empty file is an empty config. Every
    /// problem is reported at once: each top-level key, and each key of a mapping under
    /// one, is also checked on its own (see [`entry_problems`]).
    pub fn parse(path: &Path, text: &str) -> Result<AgentConfig, ConfigError> {
        if text.trim().is_empty() {
            return Ok(AgentConfig::default());
        }
        let invalid = |mut problems: Vec<ConfigProblem>| {
            problems.sort_by_key(|p| (p.line, p.column));
            problems.dedup();
            ConfigError::Invalid {
                path: path.to_owned(),
                problems,
            }
        };
        let whole = serde_saphyr::from_str::<AgentConfig>(text).map_err(|e| problem(&e, 0));
        let mut problems = entry_problems(text);
        match whole {
            Ok(config) if problems.is_empty() => Ok(config),
            Ok(_) => Err(invalid(problems)),
            Err(first) => {
                // The whole file's first problem is one of the entries' problems, unless
                // checking the entries apart could not find it.
                if !problems.iter().any(|p| p.line == first.line) {
                    problems.push(first);
                }
                Err(invalid(problems))
            }
        }
    }
}

/// A problem from the YAML parser, its line moved down by `line_offset`.
fn problem(error: &serde_saphyr::Error, line_offset: u64) -> ConfigProblem {
    let (line, column) = error.location().map_or((1, 1), |l| (l.line(), l.column()));
    let message = error.without_snippet().to_string();
    let message = message.lines().next().unwrap_or("invalid config");
    // The location leads the message already.
    let message = message
        .rsplit_once(" at line ")
        .filter(|(_, at)| at.contains(", column "))
        .map_or(message, |(message, _)| message)
        .to_owned();
    ConfigProblem {
        line: line + line_offset,
        column,
        message,
    }
}

/// The problems of each entry of the config's top-level mapping, each checked on its own,
/// and of each entry of a block mapping under one: the parser stops at a document's first
/// problem, so each entry is parsed alone, cut from the text by its lines (the entries
/// of a block mapping each start a line). Keys repeated at the top level are problems
/// too. Empty when the text is not a block mapping whose entries have lines of their own;
/// the whole file's parse then reports its first problem.
fn entry_problems(text: &str) -> Vec<ConfigProblem> {
    use crate::yaml::{Value, parse_documents};
    let Ok(documents) = parse_documents(text) else {
        return Vec::new();
    };
    let [document] = &documents[..] else {
        return Vec::new();
    };
    let Value::Mapping(entries) = &document.value else {
        return Vec::new();
    };
    let lines: Vec<&str> = text.lines().collect();
    let mut problems = Vec::new();
    let mut first_at: std::collections::HashMap<String, crate::Location> =
        std::collections::HashMap::new();
    for (key, _) in entries {
        let name = key.value.key_text();
        match first_at.get(&name) {
            Some(first) => problems.push(ConfigProblem {
                line: u64::from(key.location.line),
                column: u64::from(key.location.column),
                message: format!("duplicate key {name:?} (first at {first})"),
            }),
            None => {
                first_at.insert(name, key.location);
            }
        }
    }
    let Some(spans) = line_spans(entries.iter().map(|(k, _)| k), lines.len()) else {
        return problems;
    };
    for ((_, value), (start, end)) in entries.iter().zip(spans) {
        let entry = lines[start..end].join(
            "
",
        );
        let Err(error) = serde_saphyr::from_str::<AgentConfig>(&entry) else {
            continue;
        };
        // A mapping under the key: its own entries, each under the key alone.
        let nested = match &value.value {
            Value::Mapping(inner) if !inner.is_empty() => {
                line_spans(inner.iter().map(|(k, _)| k), end)
                    .filter(|spans| spans.first().is_some_and(|(first, _)| *first > start))
            }
            _ => None,
        };
        let Some(nested) = nested else {
            problems.push(problem(&error, start as u64));
            continue;
        };
        for (inner_start, inner_end) in nested {
            let inner = format!(
                "{}\n{}",
                lines[start],
                lines[inner_start..inner_end].join("\n")
            );
            if let Err(error) = serde_saphyr::from_str::<AgentConfig>(&inner) {
                let mut found = problem(&error, (inner_start as u64).saturating_sub(1));
                if found.line == inner_start as u64 {
                    // On the key's line, which sits elsewhere in the file.
                    found.line = start as u64 + 1;
                }
                problems.push(found);
            }
        }
    }
    problems
}

/// The lines (0-based, end exclusive) of each entry whose keys are `keys`, in order: from
/// its key's line to the next key's, the last one to `end`. `None` when two keys share a
/// line (a flow mapping), or a key is not at the start of its line's text.
fn line_spans<'n>(
    keys: impl Iterator<Item = &'n crate::yaml::Node>,
    end: usize,
) -> Option<Vec<(usize, usize)>> {
    let starts: Vec<usize> = keys
        .map(|k| (k.location.line as usize).saturating_sub(1))
        .collect();
    if starts.windows(2).any(|w| w[0] >= w[1]) || starts.last().is_some_and(|l| *l >= end) {
        return None;
    }
    Some(
        starts
            .iter()
            .enumerate()
            .map(|(i, start)| (*start, starts.get(i + 1).copied().unwrap_or(end)))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_documented_key_parses() {
        let text = r#"
specsDir: ./specs
dataDir: ./stead-data
listen: 127.0.0.1:4750
socket: /run/stead.sock
token: secret
tick: 1s
resync: 20s
watch: true
maxKillTimeout: 30s
maxTaskEvents: 50
shutdown: drain
allowRoot: false
limits: required
cgroupParent: stead
gc: {interval: 1m, maxAllocs: 50, diskUsageThreshold: 80, parallelDestroys: 2}
store: {memoryMB: 8, sync: true}
drivers: {exec: {enabled: true}, mock: {enabled: false}}
devices:
  static:
    - {vendor: acme, type: gpu, name: a1, healthDir: null, instances: [{id: gpu0}, {id: gpu1}]}
logFormat: json
api: {headerTimeout: 10s, maxConnections: 512, maxLogStreams: 256, maxExecs: 16}
oomScoreAdj: -900
"#;
        let config = AgentConfig::parse(Path::new("agent.yaml"), text).unwrap();
        assert_eq!(config.shutdown, Some(ShutdownMode::Drain));
        assert_eq!(config.tick, Some(Duration::from_secs(1)));
        assert_eq!(config.limits, Some(LimitsMode::Required));
        assert_eq!(config.cgroup_parent.as_deref(), Some("stead"));
        assert_eq!(config.oom_score_adj, Some(-900));
        assert_eq!(
            config.api,
            Some(ApiConfig {
                header_timeout: Some(Duration::from_secs(10)),
                max_connections: Some(512),
                max_log_streams: Some(256),
                max_execs: Some(16),
            })
        );
        assert_eq!(
            config.store,
            Some(StoreConfig {
                memory_mb: Some(8),
                sync: Some(true)
            })
        );
        assert_eq!(
            config.devices.unwrap().static_devices.unwrap()[0]
                .instances
                .len(),
            2
        );
    }

    #[test]
    fn a_zero_period_or_a_blank_token_is_an_error_naming_its_key_and_location() {
        let table = [
            (
                "listen: x\ntick: 0s\n",
                "agent.yaml:2:7: tick: a period must be longer than 0s",
            ),
            (
                "resync: 0\n",
                "agent.yaml:1:9: resync: a period must be longer than 0s",
            ),
            (
                "gc:\n  interval: 0ms\n",
                "agent.yaml:2:13: gc.interval: a period must be longer than 0s",
            ),
            (
                "devices: {healthInterval: 0s}\n",
                "agent.yaml:1:27: devices.healthInterval: a period must be longer than 0s",
            ),
            (
                "cgroupParent: ../x\n",
                "agent.yaml:1:15: cgroupParent: \"../x\" is not a cgroup name (letters, digits, '-' and '_', at most 64, not \"tasks\" or \"stead-agent\")",
            ),
            (
                "api: {headerTimeout: 0s}\n",
                "agent.yaml:1:22: api.headerTimeout: a period must be longer than 0s",
            ),
            (
                "oomScoreAdj: -1001\n",
                "agent.yaml:1:14: oomScoreAdj: -1001 is outside -1000 to 1000",
            ),
            (
                "token: \"\"\n",
                "agent.yaml:1:8: token: empty; remove the key for a generated token, or write `token: none` to require none",
            ),
            (
                "token: \"  \"\n",
                "agent.yaml:1:8: token: empty; remove the key for a generated token, or write `token: none` to require none",
            ),
            (
                "token: None\n",
                "agent.yaml:1:8: token: \"None\" is not a token; write `token: none` to serve without one",
            ),
        ];
        for (text, expected) in table {
            let error = AgentConfig::parse(Path::new("agent.yaml"), text).expect_err(text);
            assert_eq!(error.to_string(), expected, "{text:?}");
        }
        let config = AgentConfig::parse(Path::new("agent.yaml"), "tick: 1ms\nmaxKillTimeout: 0s\n")
            .expect("a short period, and a kill timeout of zero, are fine");
        assert_eq!(config.tick, Some(Duration::from_millis(1)));
    }

    #[test]
    fn listen_null_differs_from_listen_left_out_and_token_none_from_a_token() {
        let parse = |text| AgentConfig::parse(Path::new("agent.yaml"), text).expect(text);
        assert_eq!(parse("socket: /run/s.sock\n").listen, None);
        assert_eq!(parse("listen: null\n").listen, Some(None));
        assert_eq!(parse("listen: ~\n").listen, Some(None));
        assert_eq!(
            parse("listen: 0.0.0.0:4750\n").listen,
            Some(Some("0.0.0.0:4750".to_owned()))
        );
        assert_eq!(parse("tick: 1s\n").token, None);
        assert_eq!(parse("token: null\n").token, None);
        assert_eq!(parse("token: none\n").token, Some(TokenConfig::None));
        assert_eq!(parse("token: \" none \"\n").token, Some(TokenConfig::None));
        assert_eq!(
            parse("token: \" s3cret\"\n").token,
            Some(TokenConfig::Bearer("s3cret".to_owned()))
        );
        let token = parse("token: s3cret\n").token.expect("a token");
        assert_eq!(format!("{token:?}"), "Bearer(<secret>)");
        assert_eq!(String::from(token), "s3cret");
    }

    #[test]
    fn every_problem_of_a_config_is_reported_at_once_each_at_its_line_and_column() {
        let text = "tick: 0s\nlisten_addr: x\ngc:\n  interval: 0s\n  maxAllocs: 5\n  parallelDestroys: many\nwatch: true\ntick: 1s\n";
        let error = AgentConfig::parse(Path::new("agent.yaml"), text).unwrap_err();
        expect_test::expect![[r#"
            agent.yaml:1:7: tick: a period must be longer than 0s
            agent.yaml:2:1: unknown field `listen_addr`, expected one of specsDir, dataDir, listen, socket, token, tokenFile, tick, resync, watch, maxKillTimeout, maxTaskEvents, shutdown, allowRoot, limits, cgroupParent, gc, store, drivers, devices, logFormat, api, oomScoreAdj, fleet
            agent.yaml:4:13: gc.interval: a period must be longer than 0s
            agent.yaml:6:21: invalid u32
            agent.yaml:8:1: duplicate key "tick" (first at 1:1)"#]].assert_eq(&error.to_string());
        // A flow mapping's entries share a line: its first problem only.
        let error =
            AgentConfig::parse(Path::new("agent.yaml"), "{tick: 0s, resync: 0s}\n").unwrap_err();
        expect_test::expect!["agent.yaml:1:8: tick: a period must be longer than 0s"]
            .assert_eq(&error.to_string());
    }

    #[test]
    fn an_unknown_key_is_an_error_with_its_location() {
        let error =
            AgentConfig::parse(Path::new("agent.yaml"), "listen: x\nlisten_addr: y\n").unwrap_err();
        let text = error.to_string();
        assert!(text.starts_with("agent.yaml:2:"), "{text}");
        assert!(text.contains("listen_addr"), "{text}");
    }
}
