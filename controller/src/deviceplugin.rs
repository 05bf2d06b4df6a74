//! The `k8s` device plugin kind: the kubelet's side of the Kubernetes device-plugin API
//! (v1beta1), so the device plugins people already run serve stead.
//!
//! One [`K8sPlugin`] stands for every such plugin on the node. Plugins register on
//! `<socketDir>/kubelet.sock` (served with mode 0600 while registration is on), or are
//! dialled at a configured socket without registering. Each endpoint, keyed by the
//! resource it serves as the kubelet keys them (a second registration of a resource
//! replaces the first), runs a loop: dial its socket, ask its options, and follow its
//! `ListAndWatch` stream, whose every message is the full list of devices with their
//! health. When the stream ends (the plugin died), every device of it turns unhealthy at
//! once, saying why, and the socket is dialled again with backoff; holders keep their
//! devices and are flagged, as with every plugin.
//!
//! Resource `vendor.com/type` served at `<endpoint>.sock` is the device group
//! `vendor.com/type/<endpoint>` (or a configured name). A task holding devices of it gets
//! what the plugin's `Allocate` answers (variables, mounts, device nodes; variables named
//! in `envMap` set again under their new name), after `PreStartContainer` when the plugin
//! asks for it. `Allocate` is called when a task starts, never when an agent reattaches to
//! a running task. The plugins' `GetPreferredAllocation` is not asked: stead chooses
//! instances itself (`stead_reconcilers::device::assign`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use stead_reconcilers::device::{DeviceMount, DeviceNode, Reservation};
use stead_runtime::devices::{DevicePlugin, DeviceStats, PluginError};
use stead_runtime::driver::BoxFuture;
use stead_schemas::config::{K8sDevicesConfig, K8sEndpointConfig};
use stead_schemas::device::{
    AssignedDevice, CheckpointedAllocation, CheckpointedPath, DeviceFingerprint,
    DeviceGroupFingerprint, DeviceHealth, DeviceInstanceFingerprint, is_device_name_part,
};
use stead_schemas::spec::Name;
use tokio::net::UnixStream;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

/// The device-plugin API's messages and services, compiled from
/// `proto/deviceplugin_v1beta1.proto` by `build.rs`.
#[allow(
    missing_docs,
    unreachable_pub,
    clippy::all,
    clippy::pedantic,
    rust_2018_idioms
)]
pub mod api {
    tonic::include_proto!("v1beta1");
}

use api::device_plugin_client::DevicePluginClient;
use api::registration_server::{Registration, RegistrationServer};

/// The API version this side speaks, which a registration must name.
pub const API_VERSION: &str = "v1beta1";
/// The registration socket's file name in the socket directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// How a plugin names a healthy device.
pub const HEALTHY: &str = "Healthy";
/// The longest a plugin's `PreStartContainer` may take.
pub const PRE_START_TIMEOUT: Duration = Duration::from_secs(30);
/// The first wait before a plugin's socket is dialled again; it doubles up to
/// [`DIAL_MAX`].
const DIAL_MIN: Duration = Duration::from_millis(200);
const DIAL_MAX: Duration = Duration::from_secs(5);
/// The longest `GetDevicePluginOptions` and `Allocate` may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// A plugin that served this long is dialled again after [`DIAL_MIN`] when it stops.
const SERVED_A_WHILE: Duration = Duration::from_secs(30);

/// A plugin endpoint cannot be used as configured or registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    /// The resource is not `vendor/type` of valid name parts.
    #[error(
        "resource {0:?} is not `vendor.com/type` (each part a letter or digit, then letters, digits, '-', '_' or '.')"
    )]
    Resource(String),
    /// The endpoint is not a socket file name in the directory.
    #[error("endpoint {0:?} is not a file name in the socket directory")]
    Endpoint(String),
    /// The group name is not a valid name part.
    #[error("name {0:?} is not a letter or digit, then letters, digits, '-', '_' or '.'")]
    Name(String),
    /// The plugin speaks another version of the API.
    #[error("version {0:?} is not supported; this side speaks {API_VERSION}")]
    Version(String),
}

/// Where a plugin serves, and the device group it stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
struct EndpointSpec {
    socket: PathBuf,
    resource: String,
    vendor: String,
    device_type: String,
    name: String,
}

impl EndpointSpec {
    fn new(socket: PathBuf, resource: &str, name: Option<&str>) -> Result<Self, EndpointError> {
        let (vendor, device_type) = resource
            .split_once('/')
            .filter(|(v, t)| is_device_name_part(v) && is_device_name_part(t))
            .ok_or_else(|| EndpointError::Resource(resource.to_owned()))?;
        let name = match name {
            Some(name) => name.to_owned(),
            None => {
                let file = socket
                    .file_name()
                    .and_then(|f| f.to_str())
                    .ok_or_else(|| EndpointError::Endpoint(socket.display().to_string()))?;
                file.strip_suffix(".sock").unwrap_or(file).to_owned()
            }
        };
        if !is_device_name_part(&name) {
            return Err(EndpointError::Name(name));
        }
        Ok(EndpointSpec {
            socket,
            resource: resource.to_owned(),
            vendor: vendor.to_owned(),
            device_type: device_type.to_owned(),
            name,
        })
    }
}

/// What the node knows of one endpoint.
struct EndpointState {
    spec: EndpointSpec,
    /// Its client while its `ListAndWatch` stream is open.
    client: Option<DevicePluginClient<Channel>>,
    options: api::DevicePluginOptions,
    /// Its last list: each device's id and health.
    devices: Vec<(String, String)>,
    /// Why it does not serve now; `None` while its stream is open.
    down: Option<String>,
    /// Ends its loop.
    stop: CancellationToken,
}

/// The endpoints, shared by their loops, the registration service and the plugin.
struct Shared {
    endpoints: Mutex<BTreeMap<String, EndpointState>>,
    /// Bumped on every change, for the reporter.
    version: watch::Sender<u64>,
}

impl Shared {
    fn endpoints(&self) -> MutexGuard<'_, BTreeMap<String, EndpointState>> {
        self.endpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// Updates the endpoint of `resource` if it is still the one `stop` belongs to.
    fn update(
        &self,
        resource: &str,
        stop: &CancellationToken,
        change: impl FnOnce(&mut EndpointState),
    ) {
        let changed = {
            let mut endpoints = self.endpoints();
            match endpoints.get_mut(resource) {
                Some(state) if !stop.is_cancelled() => {
                    change(state);
                    true
                }
                _ => false,
            }
        };
        if changed {
            self.bump();
        }
    }

    /// The fingerprint of every endpoint: one group each, its devices unhealthy while it
    /// does not serve.
    fn fingerprint(&self) -> DeviceFingerprint {
        let endpoints = self.endpoints();
        let mut groups = Vec::new();
        let mut notes = Vec::new();
        for state in endpoints.values() {
            let spec = &state.spec;
            if let Some(why) = &state.down {
                notes.push(format!(
                    "{} at {}: not serving ({why})",
                    spec.resource,
                    spec.socket.display()
                ));
            }
            if state.devices.is_empty() {
                continue;
            }
            let instances = state
                .devices
                .iter()
                .map(|(id, health)| DeviceInstanceFingerprint {
                    id: id.clone(),
                    health: match (&state.down, health.as_str()) {
                        (Some(why), _) => DeviceHealth::Unhealthy {
                            reason: Some(format!(
                                "device plugin {} is not serving: {why}",
                                spec.resource
                            )),
                        },
                        (None, HEALTHY) => DeviceHealth::Healthy,
                        (None, other) => DeviceHealth::Unhealthy {
                            reason: Some(format!("its device plugin reports it {other}")),
                        },
                    },
                    attributes: BTreeMap::new(),
                })
                .collect();
            groups.push(DeviceGroupFingerprint {
                vendor: spec.vendor.clone(),
                device_type: spec.device_type.clone(),
                name: spec.name.clone(),
                attributes: BTreeMap::from([
                    ("resource".to_owned(), spec.resource.clone()),
                    ("socket".to_owned(), spec.socket.display().to_string()),
                ]),
                instances,
            });
        }
        DeviceFingerprint {
            groups,
            note: (!notes.is_empty()).then(|| notes.join("; ")),
        }
    }

    /// Adds (or replaces) the endpoint of `spec.resource` and starts its loop under
    /// `parent`.
    fn add(self: &Arc<Self>, spec: EndpointSpec, parent: &CancellationToken) {
        let stop = parent.child_token();
        let resource = spec.resource.clone();
        let socket = spec.socket.clone();
        {
            let mut endpoints = self.endpoints();
            // The devices a replaced endpoint listed stay known (down) until the new one
            // lists, so their holders are still shown.
            let devices = endpoints
                .get(&resource)
                .filter(|old| old.spec.name == spec.name)
                .map(|old| old.devices.clone())
                .unwrap_or_default();
            let replaced = endpoints.insert(
                resource.clone(),
                EndpointState {
                    spec,
                    client: None,
                    options: api::DevicePluginOptions::default(),
                    devices,
                    down: Some("not dialled yet".to_owned()),
                    stop: stop.clone(),
                },
            );
            // Under the lock: the old loop can no longer change the new entry.
            if let Some(old) = replaced {
                old.stop.cancel();
            }
        }
        self.bump();
        tokio::spawn(follow(Arc::clone(self), resource, socket, stop));
    }
}

/// A gRPC channel over the unix socket `socket` (a plugin's, or `kubelet.sock`).
pub async fn connect(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let socket = socket.to_owned();
    // The URI is not used: every connection is the socket's.
    Endpoint::from_static("http://[::1]:1")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await
}

/// Follows the plugin of `resource` at `socket` until `stop`: dial, options, then its
/// device lists; when that ends, its devices turn unhealthy and it is dialled again.
async fn follow(shared: Arc<Shared>, resource: String, socket: PathBuf, stop: CancellationToken) {
    let mut delay = DIAL_MIN;
    loop {
        let began = stead_runtime::clock::Clock::system().instant();
        let why = tokio::select! {
            () = stop.cancelled() => return,
            why = serve_once(&shared, &resource, &socket, &stop) => why,
        };
        tracing::warn!(resource, socket = %socket.display(), reason = %why, "device plugin not serving");
        shared.update(&resource, &stop, |state| {
            state.client = None;
            state.down = Some(why);
        });
        if began.elapsed() >= SERVED_A_WHILE {
            delay = DIAL_MIN;
        }
        let jittered = delay.mul_f64(1.0 + fastrand::f64() * 0.2);
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(jittered) => {}
        }
        delay = (delay * 2).min(DIAL_MAX);
    }
}

/// One connection to a plugin, until its stream ends; returns why it ended.
async fn serve_once(
    shared: &Shared,
    resource: &str,
    socket: &Path,
    stop: &CancellationToken,
) -> String {
    let channel = match connect(socket).await {
        Ok(channel) => channel,
        Err(error) => return format!("cannot connect to {}: {error}", socket.display()),
    };
    let mut client = DevicePluginClient::new(channel);
    let options = match tokio::time::timeout(
        CALL_TIMEOUT,
        client.get_device_plugin_options(api::Empty {}),
    )
    .await
    {
        Ok(Ok(options)) => options.into_inner(),
        Ok(Err(status)) => return format!("GetDevicePluginOptions failed: {}", status.message()),
        Err(_) => return format!("GetDevicePluginOptions took longer than {CALL_TIMEOUT:?}"),
    };
    let mut stream = match client.list_and_watch(api::Empty {}).await {
        Ok(stream) => stream.into_inner(),
        Err(status) => return format!("ListAndWatch failed: {}", status.message()),
    };
    loop {
        match stream.message().await {
            Ok(Some(list)) => {
                let devices: Vec<(String, String)> = list
                    .devices
                    .into_iter()
                    .map(|device| (device.id, device.health))
                    .collect();
                // A bad list fails this endpoint alone, never the others.
                if let Err(why) = check_devices(&devices) {
                    return format!("it listed invalid devices: {why}");
                }
                shared.update(resource, stop, |state| {
                    state.client = Some(client.clone());
                    state.options = options;
                    state.devices = devices;
                    state.down = None;
                });
            }
            Ok(None) => return "its ListAndWatch stream ended".to_owned(),
            Err(status) => {
                return format!("its ListAndWatch stream failed: {}", status.message());
            }
        }
    }
}

/// Refuses a device list with an invalid or repeated id.
fn check_devices(devices: &[(String, String)]) -> Result<(), String> {
    let mut seen = std::collections::BTreeSet::new();
    for (id, _) in devices {
        id.parse::<stead_schemas::device::DeviceInstanceId>()?;
        if !seen.insert(id.as_str()) {
            return Err(format!("device id {id:?} is listed twice"));
        }
    }
    Ok(())
}

/// The registration service on `kubelet.sock`.
struct Registrar {
    shared: Arc<Shared>,
    socket_dir: PathBuf,
    stop: CancellationToken,
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn register(
        &self,
        request: Request<api::RegisterRequest>,
    ) -> Result<Response<api::Empty>, Status> {
        let request = request.into_inner();
        let spec = registered(&self.socket_dir, &request).map_err(|error| {
            tracing::warn!(resource = request.resource_name, %error, "device plugin registration refused");
            Status::invalid_argument(error.to_string())
        })?;
        tracing::info!(resource = spec.resource, socket = %spec.socket.display(), "device plugin registered");
        self.shared.add(spec, &self.stop);
        Ok(Response::new(api::Empty {}))
    }
}

/// The endpoint a registration names, checked.
fn registered(
    socket_dir: &Path,
    request: &api::RegisterRequest,
) -> Result<EndpointSpec, EndpointError> {
    if request.version != API_VERSION {
        return Err(EndpointError::Version(request.version.clone()));
    }
    let endpoint = request.endpoint.as_str();
    if endpoint.is_empty()
        || endpoint.contains('/')
        || endpoint == "."
        || endpoint == ".."
        || endpoint == KUBELET_SOCKET
    {
        return Err(EndpointError::Endpoint(endpoint.to_owned()));
    }
    EndpointSpec::new(socket_dir.join(endpoint), &request.resource_name, None)
}

/// Refuses a socket directory another user could write to: a plugin registered there
/// decides what tasks get (variables, mounts, device nodes).
fn check_socket_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    let uid = rustix::process::geteuid().as_raw();
    if meta.uid() != uid || meta.mode() & 0o022 != 0 {
        return Err(format!(
            "{} must be owned by the agent's user (uid {uid}) and writable by nobody else (it is uid {}, mode {:o})",
            dir.display(),
            meta.uid(),
            meta.mode() & 0o777
        ));
    }
    Ok(())
}

/// The `k8s` plugin.
pub struct K8sPlugin {
    name: Name,
    socket_dir: PathBuf,
    registration: bool,
    configured: Vec<EndpointSpec>,
    env_map: BTreeMap<String, String>,
    shared: Arc<Shared>,
    /// Where the `Allocate` answers still held are kept, and they.
    checkpoint_path: PathBuf,
    checkpoint: Mutex<Vec<CheckpointedAllocation>>,
}

impl std::fmt::Debug for K8sPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("K8sPlugin")
            .field("socket_dir", &self.socket_dir)
            .field("registration", &self.registration)
            .field("configured", &self.configured)
            .finish_non_exhaustive()
    }
}

impl K8sPlugin {
    /// The plugin for `config`, its socket directory defaulting to
    /// `<data_dir>/device-plugins`. A configured endpoint that cannot be used is refused
    /// here, naming its position.
    pub fn new(config: &K8sDevicesConfig, data_dir: &Path) -> Result<Self, K8sConfigError> {
        let configured = config
            .endpoints
            .iter()
            .enumerate()
            .map(|(index, endpoint): (usize, &K8sEndpointConfig)| {
                EndpointSpec::new(
                    endpoint.socket.clone(),
                    &endpoint.resource,
                    endpoint.name.as_deref(),
                )
                .map_err(|source| K8sConfigError { index, source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let (version, _) = watch::channel(0);
        let checkpoint_path = data_dir.join("device-plugins.checkpoint.json");
        Ok(K8sPlugin {
            checkpoint: Mutex::new(read_checkpoint(&checkpoint_path)),
            checkpoint_path,
            name: "k8s".parse().expect("a valid name"),
            socket_dir: config
                .socket_dir
                .clone()
                .unwrap_or_else(|| data_dir.join("device-plugins")),
            registration: config.registration.unwrap_or(true),
            configured,
            env_map: config.env_map.clone(),
            shared: Arc::new(Shared {
                endpoints: Mutex::new(BTreeMap::new()),
                version,
            }),
        })
    }

    /// The registration socket.
    pub fn registration_socket(&self) -> PathBuf {
        self.socket_dir.join(KUBELET_SOCKET)
    }

    /// Serves registration on `kubelet.sock` (mode 0600) until `stop`.
    fn serve_registration(&self, stop: &CancellationToken) -> Result<(), String> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.socket_dir)
            .map_err(|e| format!("cannot create {}: {e}", self.socket_dir.display()))?;
        check_socket_dir(&self.socket_dir)?;
        let path = self.registration_socket();
        // A socket left by an earlier agent; nothing listens on it any more.
        let _ = std::fs::remove_file(&path);
        let listener = tokio::net::UnixListener::bind(&path)
            .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| format!("cannot restrict {}: {e}", path.display()))?;
        let registrar = Registrar {
            shared: Arc::clone(&self.shared),
            socket_dir: self.socket_dir.clone(),
            stop: stop.clone(),
        };
        let stop = stop.clone();
        tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(registrar))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    stop.cancelled(),
                )
                .await;
            if let Err(error) = served {
                tracing::error!(%error, "the device-plugin registration service stopped");
            }
            // The socket file stays: a later start may already have bound a new one at
            // the same path.
        });
        Ok(())
    }

    /// The endpoint of `resource`: its client and options.
    fn endpoint_of(
        &self,
        resource: &str,
    ) -> Option<(
        Option<DevicePluginClient<Channel>>,
        api::DevicePluginOptions,
    )> {
        self.shared
            .endpoints()
            .get(resource)
            .map(|state| (state.client.clone(), state.options))
    }

    /// What a task holding `ids` of `resource` gets: the checkpointed `Allocate` answer,
    /// or a new one (checkpointed); `PreStartContainer` first when the plugin asks.
    async fn reserve_of(
        &self,
        resource: &str,
        mut ids: Vec<String>,
    ) -> Result<Reservation, PluginError> {
        let (client, options) = self
            .endpoint_of(resource)
            .ok_or_else(|| self.error(format!("no device plugin serves {resource}")))?;
        let not_serving = || self.error(format!("the device plugin for {resource} is not serving"));
        ids.sort();
        let held = self
            .checkpoint()
            .iter()
            .find(|a| a.resource == resource && a.devices == ids)
            .cloned();
        let answer = match held {
            // Allocated before (by this agent or the one before it) and not freed since:
            // the same answer, as the kubelet's checkpoint gives.
            Some(answer) => answer,
            None => {
                let request = api::AllocateRequest {
                    container_requests: vec![api::ContainerAllocateRequest {
                        devices_ids: ids.clone(),
                    }],
                };
                let mut client = client.clone().ok_or_else(not_serving)?;
                let answer = tokio::time::timeout(CALL_TIMEOUT, client.allocate(request))
                    .await
                    .map_err(|_| {
                        self.error(format!(
                            "{resource}: Allocate took longer than {CALL_TIMEOUT:?}"
                        ))
                    })?
                    .map_err(|status| {
                        self.error(format!("{resource}: Allocate failed: {}", status.message()))
                    })?
                    .into_inner()
                    .container_responses
                    .into_iter()
                    .next()
                    .unwrap_or_default();
                let answer = checkpointed(resource, ids.clone(), answer);
                self.change_checkpoint(|checkpoint| {
                    checkpoint.retain(|a| {
                        a.resource != resource || !a.devices.iter().any(|d| ids.contains(d))
                    });
                    checkpoint.push(answer.clone());
                    true
                });
                answer
            }
        };
        if options.pre_start_required {
            let mut client = client.ok_or_else(not_serving)?;
            let request = api::PreStartContainerRequest { devices_ids: ids };
            tokio::time::timeout(PRE_START_TIMEOUT, client.pre_start_container(request))
                .await
                .map_err(|_| {
                    self.error(format!(
                        "{resource}: PreStartContainer took longer than {PRE_START_TIMEOUT:?}"
                    ))
                })?
                .map_err(|status| {
                    self.error(format!(
                        "{resource}: PreStartContainer failed: {}",
                        status.message()
                    ))
                })?;
        }
        Ok(reservation(&answer, &self.env_map))
    }

    fn checkpoint(&self) -> MutexGuard<'_, Vec<CheckpointedAllocation>> {
        self.checkpoint
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Changes the checkpoint and writes it when `change` says it changed (a failed
    /// write is logged: the answers stay held in memory, and are asked for again after a
    /// restart).
    fn change_checkpoint(&self, change: impl FnOnce(&mut Vec<CheckpointedAllocation>) -> bool) {
        let mut checkpoint = self.checkpoint();
        if change(&mut checkpoint)
            && let Err(error) = write_checkpoint(&self.checkpoint_path, &checkpoint)
        {
            tracing::warn!(path = %self.checkpoint_path.display(), %error, "cannot write the device-plugin checkpoint");
        }
    }

    fn error(&self, message: String) -> PluginError {
        PluginError {
            plugin: self.name.clone(),
            message,
        }
    }
}

/// A configured endpoint cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("devices.k8s.endpoints[{index}]: {source}")]
pub struct K8sConfigError {
    index: usize,
    #[source]
    source: EndpointError,
}

/// The resource a device of a `k8s` group belongs to: its group's `vendor/type`.
fn resource_of(device: &AssignedDevice) -> String {
    format!("{}/{}", device.group.vendor(), device.group.device_type())
}

/// One plugin's `Allocate` answer for `devices` of `resource`, as it is checkpointed.
fn checkpointed(
    resource: &str,
    devices: Vec<String>,
    answer: api::ContainerAllocateResponse,
) -> CheckpointedAllocation {
    if !answer.cdi_devices.is_empty() || !answer.annotations.is_empty() {
        tracing::warn!(
            resource,
            "the device plugin's Allocate answer has CDI devices or annotations, which only a container runtime uses; a task on the host does not get them"
        );
    }
    CheckpointedAllocation {
        resource: resource.to_owned(),
        devices,
        env: answer.envs.into_iter().collect(),
        mounts: answer
            .mounts
            .into_iter()
            .map(|m| CheckpointedPath {
                host_path: m.host_path,
                task_path: m.container_path,
                read_only: m.read_only,
                permissions: String::new(),
            })
            .collect(),
        device_nodes: answer
            .devices
            .into_iter()
            .map(|d| CheckpointedPath {
                host_path: d.host_path,
                task_path: d.container_path,
                read_only: false,
                permissions: d.permissions,
            })
            .collect(),
    }
}

/// What a task gets from one plugin's `Allocate` answer, `env_map` applied.
fn reservation(answer: &CheckpointedAllocation, env_map: &BTreeMap<String, String>) -> Reservation {
    let mut env = answer.env.clone();
    for (from, to) in env_map {
        if let Some(value) = env.get(from).cloned() {
            env.insert(to.clone(), value);
        }
    }
    Reservation {
        env,
        mounts: answer
            .mounts
            .iter()
            .map(|m| DeviceMount {
                host_path: PathBuf::from(&m.host_path),
                task_path: PathBuf::from(&m.task_path),
                read_only: m.read_only,
            })
            .collect(),
        device_nodes: answer
            .device_nodes
            .iter()
            .map(|d| DeviceNode {
                host_path: PathBuf::from(&d.host_path),
                task_path: PathBuf::from(&d.task_path),
                permissions: d.permissions.clone(),
            })
            .collect(),
    }
}

/// The checkpoint at `path`; an unreadable or unknown one is logged and treated as
/// empty (its plugins are asked again).
fn read_checkpoint(path: &Path) -> Vec<CheckpointedAllocation> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "cannot read the device-plugin checkpoint");
            return Vec::new();
        }
    };
    match stead_schemas::device::parse_device_plugin_checkpoint(&text) {
        Ok(checkpoint) => checkpoint.allocations,
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "ignoring the device-plugin checkpoint");
            Vec::new()
        }
    }
}

/// Writes `allocations` to `path` atomically (a temporary file, then a rename).
fn write_checkpoint(path: &Path, allocations: &[CheckpointedAllocation]) -> std::io::Result<()> {
    let text = stead_schemas::device::device_plugin_checkpoint_json(allocations);
    crate::atomic::write_atomic(path, text.as_bytes())
}

impl DevicePlugin for K8sPlugin {
    fn name(&self) -> &Name {
        &self.name
    }

    fn released(&self, devices: &[AssignedDevice]) {
        // The resource is the group's `vendor/type`, known whether or not its plugin
        // is registered now (an alloc removed while the agent was down, say).
        let freed: Vec<(String, String)> = devices
            .iter()
            .map(|device| (resource_of(device), device.instance.to_string()))
            .collect();
        self.change_checkpoint(|checkpoint| {
            let before = checkpoint.len();
            checkpoint.retain(|a| {
                !freed
                    .iter()
                    .any(|(resource, id)| *resource == a.resource && a.devices.contains(id))
            });
            checkpoint.len() != before
        });
    }

    fn start(&self) -> BoxFuture<'_, Result<mpsc::Receiver<DeviceFingerprint>, PluginError>> {
        Box::pin(async move {
            // Entries of an earlier start are gone with it: their loops were stopped.
            {
                let mut endpoints = self.shared.endpoints();
                for state in endpoints.values() {
                    state.stop.cancel();
                }
                endpoints.clear();
            }
            let stop = CancellationToken::new();
            if self.registration {
                self.serve_registration(&stop).map_err(|e| self.error(e))?;
            }
            for spec in &self.configured {
                self.shared.add(spec.clone(), &stop);
            }
            let (tx, rx) = mpsc::channel(1);
            let shared = Arc::clone(&self.shared);
            let mut changes = shared.version.subscribe();
            tokio::spawn(async move {
                // Everything this start began ends with the manager's receiver.
                let _stop = stop.drop_guard();
                let mut last = None;
                loop {
                    changes.borrow_and_update();
                    let report = shared.fingerprint();
                    if last.as_ref() != Some(&report) {
                        if tx.send(report.clone()).await.is_err() {
                            return;
                        }
                        last = Some(report);
                    }
                    tokio::select! {
                        changed = changes.changed() => if changed.is_err() { return },
                        () = tx.closed() => return,
                    }
                }
            });
            Ok(rx)
        })
    }

    fn stats(
        &self,
        _devices: &[AssignedDevice],
    ) -> BoxFuture<'_, Result<std::collections::HashMap<AssignedDevice, DeviceStats>, PluginError>>
    {
        // The device-plugin API has no stats.
        Box::pin(async { Ok(std::collections::HashMap::new()) })
    }

    fn reserve(
        &self,
        devices: &[AssignedDevice],
    ) -> BoxFuture<'_, Result<Reservation, PluginError>> {
        let mut by_resource: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for device in devices {
            by_resource
                .entry(resource_of(device))
                .or_default()
                .push(device.instance.to_string());
        }
        Box::pin(async move {
            // One `Allocate` per plugin the task holds devices of, merged.
            let mut merged = Reservation::default();
            for (resource, ids) in by_resource {
                let one = self.reserve_of(&resource, ids).await?;
                merged.env.extend(one.env);
                merged.mounts.extend(one.mounts);
                merged.device_nodes.extend(one.device_nodes);
            }
            Ok(merged)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resource_and_its_socket_name_the_group() {
        let spec = EndpointSpec::new(
            PathBuf::from("/run/dp/nvidia-gpu.sock"),
            "nvidia.com/gpu",
            None,
        )
        .expect("valid");
        assert_eq!(
            (
                spec.vendor.as_str(),
                spec.device_type.as_str(),
                spec.name.as_str()
            ),
            ("nvidia.com", "gpu", "nvidia-gpu")
        );
        let named = EndpointSpec::new(PathBuf::from("/x/a.sock"), "acme.io/fpga", Some("f1"))
            .expect("valid");
        assert_eq!(named.name, "f1");
        for bad in ["gpu", "a/b/c", "/gpu", "acme.io/"] {
            assert_eq!(
                EndpointSpec::new(PathBuf::from("/x/a.sock"), bad, None),
                Err(EndpointError::Resource(bad.to_owned())),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_registration_must_speak_v1beta1_and_name_a_file_in_the_directory() {
        let request = |version: &str, endpoint: &str| api::RegisterRequest {
            version: version.to_owned(),
            endpoint: endpoint.to_owned(),
            resource_name: "acme.io/fpga".to_owned(),
            options: None,
        };
        let dir = Path::new("/run/dp");
        assert_eq!(
            registered(dir, &request("v1beta1", "fpga.sock")).map(|s| s.socket),
            Ok(PathBuf::from("/run/dp/fpga.sock"))
        );
        assert_eq!(
            registered(dir, &request("v1alpha", "fpga.sock")),
            Err(EndpointError::Version("v1alpha".to_owned()))
        );
        for endpoint in ["", "../x.sock", "a/b.sock", "..", KUBELET_SOCKET] {
            assert_eq!(
                registered(dir, &request("v1beta1", endpoint)),
                Err(EndpointError::Endpoint(endpoint.to_owned())),
                "{endpoint:?}"
            );
        }
    }

    #[test]
    fn a_device_list_with_a_repeated_or_invalid_id_is_refused() {
        let list = |ids: &[&str]| -> Vec<(String, String)> {
            ids.iter()
                .map(|id| ((*id).to_owned(), HEALTHY.to_owned()))
                .collect()
        };
        assert_eq!(check_devices(&list(&["f0", "f1"])), Ok(()));
        assert!(check_devices(&list(&["f0", "f0"])).is_err_and(|e| e.contains("twice")));
        assert!(check_devices(&list(&["a,b"])).is_err());
        assert!(check_devices(&list(&[""])).is_err());
    }

    #[test]
    fn a_socket_directory_others_may_write_to_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("a dir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).expect("mode");
        assert_eq!(check_socket_dir(dir.path()), Ok(()));
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("mode");
        let refused = check_socket_dir(dir.path()).expect_err("world-writable");
        assert!(refused.contains("writable by nobody else"), "{refused}");
    }

    #[test]
    fn an_allocate_answer_becomes_the_reservation_with_the_env_map_applied() {
        let answer = api::ContainerAllocateResponse {
            envs: [("NVIDIA_VISIBLE_DEVICES".to_owned(), "GPU-1".to_owned())]
                .into_iter()
                .collect(),
            mounts: vec![api::Mount {
                container_path: "/opt/drv".to_owned(),
                host_path: "/opt/drv".to_owned(),
                read_only: true,
            }],
            devices: vec![api::DeviceSpec {
                container_path: "/dev/fpga0".to_owned(),
                host_path: "/dev/fpga0".to_owned(),
                permissions: "rw".to_owned(),
            }],
            ..Default::default()
        };
        let map = BTreeMap::from([(
            "NVIDIA_VISIBLE_DEVICES".to_owned(),
            "CUDA_VISIBLE_DEVICES".to_owned(),
        )]);
        let answer = checkpointed("acme.io/fpga", vec!["f0".to_owned()], answer);
        let reservation = reservation(&answer, &map);
        assert_eq!(reservation.env["CUDA_VISIBLE_DEVICES"], "GPU-1");
        assert_eq!(reservation.env["NVIDIA_VISIBLE_DEVICES"], "GPU-1");
        assert!(reservation.mounts[0].read_only);
        assert_eq!(reservation.device_nodes[0].permissions, "rw");
    }

    #[test]
    fn an_endpoint_not_serving_turns_its_devices_unhealthy_saying_why() {
        let (version, _) = watch::channel(0);
        let shared = Shared {
            endpoints: Mutex::new(BTreeMap::new()),
            version,
        };
        let spec =
            EndpointSpec::new(PathBuf::from("/x/fpga.sock"), "acme.io/fpga", None).expect("ok");
        let stop = CancellationToken::new();
        shared.endpoints().insert(
            spec.resource.clone(),
            EndpointState {
                spec,
                client: None,
                options: api::DevicePluginOptions::default(),
                devices: vec![
                    ("f0".to_owned(), HEALTHY.to_owned()),
                    ("f1".to_owned(), "Unhealthy".to_owned()),
                ],
                down: None,
                stop: stop.clone(),
            },
        );
        let health = |shared: &Shared| -> Vec<bool> {
            shared.fingerprint().groups[0]
                .instances
                .iter()
                .map(|i| i.health.is_healthy())
                .collect()
        };
        assert_eq!(health(&shared), [true, false]);
        shared.update("acme.io/fpga", &stop, |state| {
            state.down = Some("its ListAndWatch stream ended".to_owned());
        });
        assert_eq!(health(&shared), [false, false]);
        let report = shared.fingerprint();
        assert!(
            report
                .note
                .as_deref()
                .is_some_and(|n| n.contains("not serving (its ListAndWatch stream ended)")),
            "{report:?}"
        );
        // A replaced endpoint's loop no longer changes anything.
        stop.cancel();
        shared.update("acme.io/fpga", &stop, |state| state.down = None);
        assert_eq!(health(&shared), [false, false]);
    }
}
