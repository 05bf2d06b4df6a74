//! The `nvidia` device plugin: NVIDIA GPUs through NVML, with health that recovers.
//!
//! NVML (`libnvidia-ml.so.1`) is loaded when the plugin starts, so the agent builds and
//! runs where there is no GPU: there the plugin reports no devices, with a note saying
//! why, and stays up (a host without a driver is not a failure to retry).
//!
//! Each GPU is an instance named by its UUID (`GPU-…`) in one group per model
//! (`nvidia/gpu/h100-80gb-hbm3`), with its facts as attributes. A monitor thread waits on
//! NVML's events (critical Xids and double-bit ECC errors) one second at a time and
//! queries each GPU once per wait; what it sees goes through
//! `stead_reconcilers::gpu`, which decides health with time as input: unhealthy at once,
//! healthy again after a clean period. A new fingerprint is sent only when it differs.
//!
//! A task holding GPUs gets `CUDA_VISIBLE_DEVICES` and `NVIDIA_VISIBLE_DEVICES` set to
//! their UUIDs (on a bare process only the first isolates anything; the second is for
//! container runtimes), and their device nodes.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::event::EventSet;
use stead_reconcilers::device::{DeviceNode, Reservation};
use stead_reconcilers::gpu::{GpuFault, GpuHealth, GpuHealthPolicy};
use stead_schemas::config::NvidiaDevicesConfig;
use stead_schemas::device::{
    AssignedDevice, DeviceFingerprint, DeviceGroupFingerprint, DeviceInstanceFingerprint,
};
use stead_schemas::spec::Name;
use stead_schemas::time::Timestamp;
use tokio::sync::mpsc;

use super::{DevicePlugin, DeviceStats, PluginError};
use crate::clock::Clock;
use crate::driver::BoxFuture;

/// The library NVML is loaded from unless configured.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// How long the monitor waits for an event before it queries every GPU again.
const POLL_MS: u32 = 1_000;

/// The `nvidia` plugin.
pub struct NvidiaPlugin {
    name: Name,
    library: PathBuf,
    policy: GpuHealthPolicy,
    extra_env: Vec<String>,
    clock: Clock,
    /// NVML once loaded, for stats; each start loads it again.
    nvml: Mutex<Option<Arc<Nvml>>>,
    /// Each reported GPU's device-node minor number, by UUID.
    minors: Mutex<HashMap<String, u32>>,
}

impl std::fmt::Debug for NvidiaPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvidiaPlugin")
            .field("library", &self.library)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// What is known of one GPU from the start: it does not change while NVML is loaded.
#[derive(Debug, Clone)]
struct GpuFacts {
    index: u32,
    uuid: String,
    model: String,
    attributes: BTreeMap<String, String>,
    minor: Option<u32>,
}

impl NvidiaPlugin {
    /// The plugin for `config`, timing health with `clock`.
    pub fn new(config: &NvidiaDevicesConfig, clock: Clock) -> Self {
        NvidiaPlugin {
            name: "nvidia".parse().expect("a valid name"),
            library: config
                .library
                .clone()
                .unwrap_or_else(|| PathBuf::from(DEFAULT_LIBRARY)),
            policy: GpuHealthPolicy::new(
                config.clean_period.map(|d| d.get()),
                &config.ignored_xids,
            ),
            extra_env: config.visible_devices_env.clone(),
            clock,
            nvml: Mutex::new(None),
            minors: Mutex::new(HashMap::new()),
        }
    }

    fn loaded(&self) -> Option<Arc<Nvml>> {
        self.nvml
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// A GPU model as a device group name: `NVIDIA H100 80GB HBM3` is `h100-80gb-hbm3`.
pub fn model_group_name(model: &str) -> String {
    let model = model.trim();
    let model = model.strip_prefix("NVIDIA ").unwrap_or(model);
    let mut name = String::with_capacity(model.len());
    for c in model.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_alphanumeric() || c == '.' || c == '_' {
            name.push(c);
        } else if !name.is_empty() && !name.ends_with('-') {
            name.push('-');
        }
    }
    let name = name.trim_end_matches('-');
    if name.is_empty() {
        "gpu".to_owned()
    } else {
        name.to_owned()
    }
}

/// CUDA's version as NVML gives it (12040) written as people do (`12.4`).
fn cuda_version(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

/// Why NVML cannot be used.
enum LoadError {
    /// The library is not on this host: there is nothing to retry.
    Absent(String),
    /// It is there but fails: the plugin fails and is started again with backoff.
    Failed(String),
}

/// NVML, loaded from `library`.
fn load(library: &Path) -> Result<Nvml, LoadError> {
    Nvml::builder()
        .lib_path(library.as_os_str())
        .init()
        .map_err(|error| match error {
            NvmlError::LibloadingError(e) => LoadError::Absent(format!(
                "NVML is not available: {} cannot be loaded ({e}); no NVIDIA driver on this host",
                library.display()
            )),
            NvmlError::DriverNotLoaded => LoadError::Failed(
                "NVML is loaded but the NVIDIA kernel driver is not running".to_owned(),
            ),
            other => LoadError::Failed(format!("NVML cannot start: {other}")),
        })
}

/// Where drivers mounted into a container keep NVML (the GPU operator's and the
/// Kubernetes device plugin's layout), tried when the library by name is not found.
const DRIVER_ROOT_LIBRARIES: [&str; 2] = [
    "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
    "/usr/local/nvidia/lib/libnvidia-ml.so.1",
];

/// NVML from `library`; for the default name, also from where drivers are mounted.
fn load_default(library: &Path) -> Result<Nvml, LoadError> {
    match load(library) {
        Err(LoadError::Absent(why)) if library == Path::new(DEFAULT_LIBRARY) => {
            for candidate in DRIVER_ROOT_LIBRARIES.iter().map(Path::new) {
                if candidate.exists() {
                    return load(candidate);
                }
            }
            Err(LoadError::Absent(why))
        }
        other => other,
    }
}

/// Every GPU's facts, and the node-wide ones (driver and CUDA versions).
fn gpu_facts(nvml: &Nvml) -> Result<(Vec<GpuFacts>, BTreeMap<String, String>), String> {
    let count = nvml
        .device_count()
        .map_err(|e| format!("NVML cannot count GPUs: {e}"))?;
    let mut shared = BTreeMap::new();
    if let Ok(driver) = nvml.sys_driver_version() {
        shared.insert("driverVersion".to_owned(), driver);
    }
    if let Ok(cuda) = nvml.sys_cuda_driver_version() {
        shared.insert("cudaVersion".to_owned(), cuda_version(cuda));
    }
    let mut gpus = Vec::new();
    for index in 0..count {
        let device = nvml
            .device_by_index(index)
            .map_err(|e| format!("NVML cannot open GPU {index}: {e}"))?;
        let uuid = device
            .uuid()
            .map_err(|e| format!("NVML cannot read GPU {index}'s UUID: {e}"))?;
        let model = device.name().unwrap_or_else(|_| "gpu".to_owned());
        let mut attributes = BTreeMap::new();
        attributes.insert("index".to_owned(), index.to_string());
        if let Ok(memory) = device.memory_info() {
            attributes.insert(
                "memoryMiB".to_owned(),
                (memory.total / (1024 * 1024)).to_string(),
            );
        }
        if let Ok(pci) = device.pci_info() {
            attributes.insert("pciBusId".to_owned(), pci.bus_id);
        }
        if let Ok(mig) = device.mig_mode() {
            let mode = if mig.current == 1 {
                "enabled"
            } else {
                "disabled"
            };
            attributes.insert("migMode".to_owned(), mode.to_owned());
        }
        let minor = device.minor_number().ok();
        gpus.push(GpuFacts {
            index,
            uuid,
            model,
            attributes,
            minor,
        });
    }
    Ok((gpus, shared))
}

/// The fingerprint of `gpus`, each with its health at `now`.
fn fingerprint(
    gpus: &[GpuFacts],
    shared: &BTreeMap<String, String>,
    health: &[GpuHealth],
    now: Timestamp,
    policy: &GpuHealthPolicy,
    note: Option<&str>,
) -> DeviceFingerprint {
    let mut groups: BTreeMap<String, DeviceGroupFingerprint> = BTreeMap::new();
    for (gpu, health) in gpus.iter().zip(health) {
        let name = model_group_name(&gpu.model);
        let group = groups
            .entry(name.clone())
            .or_insert_with(|| DeviceGroupFingerprint {
                vendor: "nvidia".to_owned(),
                device_type: "gpu".to_owned(),
                name,
                attributes: {
                    let mut attributes = shared.clone();
                    attributes.insert("model".to_owned(), gpu.model.clone());
                    attributes
                },
                instances: Vec::new(),
            });
        group.instances.push(DeviceInstanceFingerprint {
            id: gpu.uuid.clone(),
            health: health.health(now, policy),
            attributes: gpu.attributes.clone(),
        });
    }
    DeviceFingerprint {
        groups: groups.into_values().collect(),
        note: note.map(str::to_owned),
    }
}

/// An event set for critical Xids and double-bit ECC errors on every GPU of `gpus`.
fn event_set<'n>(nvml: &'n Nvml, gpus: &[GpuFacts]) -> Result<EventSet<'n>, String> {
    let wanted = EventTypes::CRITICAL_XID_ERROR | EventTypes::DOUBLE_BIT_ECC_ERROR;
    let mut set = nvml.create_event_set().map_err(|e| e.to_string())?;
    for gpu in gpus {
        let device = nvml.device_by_index(gpu.index).map_err(|e| e.to_string())?;
        let supported = device.supported_event_types().unwrap_or(wanted);
        set = device
            .register_events(wanted & supported, set)
            .map_err(|e| e.error.to_string())?;
    }
    Ok(set)
}

/// Watches the GPUs until `tx` closes: events and one query per GPU each second, each
/// fault into its GPU's health, a fingerprint sent whenever it changes.
fn monitor(
    nvml: &Nvml,
    gpus: &[GpuFacts],
    shared: &BTreeMap<String, String>,
    policy: &GpuHealthPolicy,
    clock: Clock,
    tx: &mpsc::Sender<DeviceFingerprint>,
) {
    let mut health = vec![GpuHealth::default(); gpus.len()];
    let by_uuid: HashMap<&str, usize> = gpus
        .iter()
        .enumerate()
        .map(|(i, gpu)| (gpu.uuid.as_str(), i))
        .collect();
    // Xid and ECC events where NVML offers them; without, the queries still catch a GPU
    // that is lost.
    let (events, note) = match event_set(nvml, gpus) {
        Ok(set) => (Some(set), None),
        Err(error) => (
            None,
            Some(format!(
                "Xid events are not available ({error}); health comes from queries alone"
            )),
        ),
    };
    let mut last: Option<DeviceFingerprint> = None;
    // Health is timed on the monotonic clock: a step of the wall clock neither cuts a
    // clean period short nor stretches it.
    let started = clock.instant();
    let elapsed =
        || Timestamp::from_since_epoch(clock.instant().saturating_duration_since(started));
    loop {
        let now = elapsed();
        for (i, gpu) in gpus.iter().enumerate() {
            let reached = nvml
                .device_by_index(gpu.index)
                .and_then(|device| device.memory_info().map(|_| ()));
            if let Err(error) = reached {
                health[i].observe(GpuFault::Unreachable(error.to_string()), now, policy);
            }
        }
        let report = fingerprint(gpus, shared, &health, now, policy, note.as_deref());
        if last.as_ref() != Some(&report) {
            if tx.blocking_send(report.clone()).is_err() {
                return;
            }
            last = Some(report);
        }
        if tx.is_closed() {
            return;
        }
        match &events {
            Some(set) => match set.wait(POLL_MS) {
                Ok(event) => {
                    let fault = if event.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
                        match event.event_data {
                            Some(XidError::Value(code)) => Some(GpuFault::Xid(code)),
                            // An Xid NVML cannot name is treated as critical.
                            Some(XidError::Unknown) | None => Some(GpuFault::Xid(0)),
                        }
                    } else if event.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
                        Some(GpuFault::DoubleBitEcc)
                    } else {
                        None
                    };
                    let gpu = event
                        .device
                        .uuid()
                        .ok()
                        .and_then(|uuid| by_uuid.get(uuid.as_str()).copied());
                    if let Some(fault) = fault {
                        let now = elapsed();
                        match gpu {
                            Some(i) => {
                                if health[i].observe(fault.clone(), now, policy) {
                                    tracing::warn!(gpu = %gpus[i].uuid, ?fault, "GPU fault");
                                }
                            }
                            // An event NVML cannot place counts against every GPU, as
                            // NVIDIA's own plugin does.
                            None => {
                                for gpu in &mut health {
                                    gpu.observe(fault.clone(), now, policy);
                                }
                            }
                        }
                    }
                }
                Err(NvmlError::Timeout) => {}
                Err(error) => {
                    tracing::warn!(%error, "waiting for NVML events failed");
                    std::thread::sleep(std::time::Duration::from_millis(u64::from(POLL_MS)));
                }
            },
            None => std::thread::sleep(std::time::Duration::from_millis(u64::from(POLL_MS))),
        }
    }
}

impl DevicePlugin for NvidiaPlugin {
    fn name(&self) -> &Name {
        &self.name
    }

    fn start(&self) -> BoxFuture<'_, Result<mpsc::Receiver<DeviceFingerprint>, PluginError>> {
        Box::pin(async move {
            let error = |message: String| PluginError {
                plugin: self.name.clone(),
                message,
            };
            let library = self.library.clone();
            let loaded = PluginError::blocking(&self.name, move || {
                let nvml = load_default(&library)?;
                let (gpus, shared) = gpu_facts(&nvml).map_err(LoadError::Failed)?;
                Ok((Arc::new(nvml), gpus, shared))
            })
            .await?;
            let (tx, rx) = mpsc::channel(1);
            let (nvml, gpus, shared) = match loaded {
                Ok(loaded) => loaded,
                // No driver: nothing to report and nothing to retry; the note says why.
                Err(LoadError::Absent(why)) => {
                    tracing::info!(reason = %why, "nvidia device plugin: no GPUs");
                    tokio::spawn(async move {
                        let note = DeviceFingerprint {
                            groups: Vec::new(),
                            note: Some(why),
                        };
                        if tx.send(note).await.is_ok() {
                            tx.closed().await;
                        }
                    });
                    return Ok(rx);
                }
                Err(LoadError::Failed(why)) => return Err(error(why)),
            };
            *self.minors.lock().unwrap_or_else(PoisonError::into_inner) = gpus
                .iter()
                .filter_map(|gpu| Some((gpu.uuid.clone(), gpu.minor?)))
                .collect();
            *self.nvml.lock().unwrap_or_else(PoisonError::into_inner) = Some(nvml.clone());
            let policy = self.policy.clone();
            let clock = self.clock;
            std::thread::Builder::new()
                .name("stead-nvidia".to_owned())
                .spawn(move || monitor(&nvml, &gpus, &shared, &policy, clock, &tx))
                .map_err(|e| error(format!("cannot start the monitor thread: {e}")))?;
            Ok(rx)
        })
    }

    fn stats(
        &self,
        devices: &[AssignedDevice],
    ) -> BoxFuture<'_, Result<HashMap<AssignedDevice, DeviceStats>, PluginError>> {
        let devices = devices.to_vec();
        Box::pin(async move {
            let Some(nvml) = self.loaded() else {
                return Ok(HashMap::new());
            };
            PluginError::blocking(&self.name, move || {
                devices
                    .into_iter()
                    .filter_map(|device| {
                        let stats = gpu_stats(&nvml, device.instance.as_str())?;
                        Some((device, stats))
                    })
                    .collect()
            })
            .await
        })
    }

    fn reserve(
        &self,
        devices: &[AssignedDevice],
    ) -> BoxFuture<'_, Result<Reservation, PluginError>> {
        let ids: Vec<String> = devices.iter().map(|d| d.instance.to_string()).collect();
        let minors = self
            .minors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let reservation = reservation(&ids, &minors, &self.extra_env, Path::exists);
        Box::pin(async move { Ok(reservation) })
    }
}

/// What a task holding the GPUs `ids` gets: their UUIDs in `CUDA_VISIBLE_DEVICES`,
/// `NVIDIA_VISIBLE_DEVICES` and each of `extra_env`, and the device nodes that `exists`
/// finds (each GPU's own and the driver's shared ones).
fn reservation(
    ids: &[String],
    minors: &HashMap<String, u32>,
    extra_env: &[String],
    exists: impl Fn(&Path) -> bool,
) -> Reservation {
    let visible = ids.join(",");
    let mut env = BTreeMap::new();
    for name in ["CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"]
        .into_iter()
        .chain(extra_env.iter().map(String::as_str))
    {
        env.insert(name.to_owned(), visible.clone());
    }
    let own = ids
        .iter()
        .filter_map(|id| minors.get(id))
        .map(|minor| format!("/dev/nvidia{minor}"));
    let shared = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
        .into_iter()
        .map(str::to_owned);
    let device_nodes = own
        .chain(shared)
        .map(PathBuf::from)
        .filter(|path| exists(path))
        .map(|path| DeviceNode {
            host_path: path.clone(),
            task_path: path,
            permissions: "rwm".to_owned(),
        })
        .collect();
    Reservation {
        env,
        mounts: Vec::new(),
        device_nodes,
    }
}

/// One GPU's measurements now; `None` when NVML cannot find it.
fn gpu_stats(nvml: &Nvml, uuid: &str) -> Option<DeviceStats> {
    let device = nvml.device_by_uuid(uuid).ok()?;
    let mut stats = DeviceStats::new();
    if let Ok(rates) = device.utilization_rates() {
        stats.insert("utilizationPercent".to_owned(), f64::from(rates.gpu));
        stats.insert(
            "memoryUtilizationPercent".to_owned(),
            f64::from(rates.memory),
        );
    }
    if let Ok(memory) = device.memory_info() {
        // Bytes as f64: exact up to 8 PiB.
        #[allow(clippy::cast_precision_loss)]
        {
            stats.insert("memoryUsedBytes".to_owned(), memory.used as f64);
            stats.insert("memoryTotalBytes".to_owned(), memory.total as f64);
        }
    }
    if let Ok(celsius) = device.temperature(TemperatureSensor::Gpu) {
        stats.insert("temperatureC".to_owned(), f64::from(celsius));
    }
    if let Ok(milliwatts) = device.power_usage() {
        stats.insert("powerWatts".to_owned(), f64::from(milliwatts) / 1000.0);
    }
    if let Ok(errors) = device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile) {
        #[allow(clippy::cast_precision_loss)]
        stats.insert("eccUncorrectedErrors".to_owned(), errors as f64);
    }
    if let Ok(errors) = device.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile) {
        #[allow(clippy::cast_precision_loss)]
        stats.insert("eccCorrectedErrors".to_owned(), errors as f64);
    }
    Some(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_becomes_a_group_name() {
        for (model, name) in [
            ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"),
            ("NVIDIA H200", "h200"),
            ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
            ("Tesla V100-SXM2-16GB", "tesla-v100-sxm2-16gb"),
            (
                "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
                "a100-sxm4-40gb-mig-1g.5gb",
            ),
            ("  ", "gpu"),
            ("NVIDIA (R) ", "r"),
        ] {
            assert_eq!(model_group_name(model), name, "{model}");
            assert!(stead_schemas::device::is_device_name_part(
                &model_group_name(model)
            ));
        }
    }

    #[test]
    fn cuda_versions_read_as_people_write_them() {
        assert_eq!(cuda_version(12040), "12.4");
        assert_eq!(cuda_version(13000), "13.0");
    }

    #[test]
    fn a_reservation_names_the_gpus_by_uuid_and_only_device_nodes_that_exist() {
        let ids = vec!["GPU-a".to_owned(), "GPU-b".to_owned()];
        let minors = HashMap::from([("GPU-a".to_owned(), 0), ("GPU-b".to_owned(), 3)]);
        let reservation = reservation(&ids, &minors, &["ROCR_VISIBLE_DEVICES".to_owned()], |p| {
            p != Path::new("/dev/nvidia-uvm-tools")
        });
        assert_eq!(reservation.env["CUDA_VISIBLE_DEVICES"], "GPU-a,GPU-b");
        assert_eq!(reservation.env["NVIDIA_VISIBLE_DEVICES"], "GPU-a,GPU-b");
        assert_eq!(reservation.env["ROCR_VISIBLE_DEVICES"], "GPU-a,GPU-b");
        let nodes: Vec<_> = reservation
            .device_nodes
            .iter()
            .map(|n| n.host_path.display().to_string())
            .collect();
        assert_eq!(
            nodes,
            [
                "/dev/nvidia0",
                "/dev/nvidia3",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm"
            ]
        );
    }

    #[tokio::test]
    async fn without_nvml_the_plugin_reports_no_devices_and_says_why() {
        let config = NvidiaDevicesConfig {
            library: Some(PathBuf::from("/nonexistent/libnvidia-ml.so.1")),
            ..NvidiaDevicesConfig::default()
        };
        let plugin = NvidiaPlugin::new(&config, Clock::system());
        let mut reports = plugin.start().await.expect("no error without a driver");
        let report = reports.recv().await.expect("one report");
        assert!(report.groups.is_empty());
        let note = report.note.expect("a note");
        assert!(
            note.contains("NVML is not available") && note.contains("/nonexistent/libnvidia-ml"),
            "{note}"
        );
        // It stays up: no second report, no end.
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(50), reports.recv())
                .await
                .is_err()
        );
        assert!(plugin.stats(&[]).await.expect("no stats").is_empty());
    }
}
