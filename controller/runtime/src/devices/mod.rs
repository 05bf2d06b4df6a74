//! The device manager: device plugins, their fingerprints and health, the node's
//! assignments of device instances to allocs, reservations and stats.
//!
//! Decisions are `stead_reconcilers::device`'s; this is the shell around them. Each
//! plugin runs under a supervision loop: its fingerprints go through validation into
//! the inventory; an invalid fingerprint or a plugin that stops (its stream ends) turns
//! its devices unhealthy at once, and the plugin is started again with exponential
//! backoff (which starts over once a plugin stayed up a minute). Dropping the manager
//! stops every plugin. Every change bumps a version that the
//! node watches to wake its workers, so an alloc waiting for a device is placed as soon
//! as one is free and healthy.
//!
//! Assignments are made per alloc, all tasks or none, under one lock, so two allocs
//! never get one instance. They are persisted in each alloc's record and seeded back
//! before any worker runs after a restart: an alloc keeps its devices before its plugin
//! reports again, and nobody else gets them meanwhile.

mod nvidia;
mod static_plugin;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use backon::BackoffBuilder;
use stead_reconcilers::device::{
    AllocDeviceStats, AllocDevices, Assignments, DeviceInventory, DeviceUnavailable, Reservation,
    alloc_device_stats, assign_alloc, node_devices, task_reservation,
};
use stead_schemas::api::DeviceGroupStatus;
use stead_schemas::device::{AssignedDevice, DeviceFingerprint, DeviceHealth};
use stead_schemas::spec::{DeviceRequest, Name};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::driver::BoxFuture;

pub use nvidia::{DEFAULT_LIBRARY as NVML_LIBRARY, NvidiaPlugin, model_group_name};
pub use static_plugin::{StaticPlugin, StaticPluginError};

/// One instance's measurements, by name (`utilization`, `memoryUsedBytes`, ...).
pub type DeviceStats = BTreeMap<String, f64>;

/// A device plugin failed an operation.
#[derive(Debug, thiserror::Error)]
#[error("device plugin {plugin}: {message}")]
pub struct PluginError {
    /// The plugin.
    pub plugin: Name,
    /// What failed.
    pub message: String,
}

impl PluginError {
    /// Runs `work` on the blocking pool (file or driver reads); a panic in it is
    /// `plugin`'s error.
    pub async fn blocking<T: Send + 'static>(
        plugin: &Name,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, PluginError> {
        tokio::task::spawn_blocking(work)
            .await
            .map_err(|e| PluginError {
                plugin: plugin.clone(),
                message: e.to_string(),
            })
    }
}

/// A source of devices: what the node has, how healthy it is, and what a task holding
/// some of it gets.
pub trait DevicePlugin: Send + Sync + 'static {
    /// The plugin's name, unique on the node.
    fn name(&self) -> &Name;
    /// Starts the plugin: fingerprints arrive on the receiver, the first at once and then
    /// on every change. The receiver closing means the plugin stopped (died).
    fn start(&self) -> BoxFuture<'_, Result<mpsc::Receiver<DeviceFingerprint>, PluginError>>;
    /// The stats of `devices` (all the plugin's own), by instance; an instance with no
    /// stats is left out.
    fn stats(
        &self,
        devices: &[AssignedDevice],
    ) -> BoxFuture<'_, Result<HashMap<AssignedDevice, DeviceStats>, PluginError>>;
    /// What a task holding `devices` (all the plugin's own) gets: env, mounts, device
    /// nodes.
    fn reserve(
        &self,
        devices: &[AssignedDevice],
    ) -> BoxFuture<'_, Result<Reservation, PluginError>>;
    /// `devices` were freed: nobody holds them any more. They are the plugin's own, or
    /// devices no plugin reports now (which a plugin may recognise as its own).
    fn released(&self, _devices: &[AssignedDevice]) {}
}

/// The first wait before a failed plugin is started again; it doubles up to
/// [`RESTART_MAX`], and starts over once a plugin stayed up [`STABLE_AFTER`].
pub const RESTART_MIN: Duration = Duration::from_millis(500);
/// The longest wait between restarts of a failed plugin.
pub const RESTART_MAX: Duration = Duration::from_secs(30);
/// A plugin that ran this long before it failed is restarted after [`RESTART_MIN`]
/// again.
pub const STABLE_AFTER: Duration = Duration::from_secs(60);

struct Inner {
    inventory: DeviceInventory,
    assignments: Assignments,
    /// Plugins that reported a valid fingerprint at least once.
    reported: BTreeSet<Name>,
}

/// The node's devices. Cheap to share; locks are held for one decision, never across an
/// `.await`.
pub struct DeviceManager {
    plugins: BTreeMap<Name, Arc<dyn DevicePlugin>>,
    inner: Mutex<Inner>,
    version: watch::Sender<u64>,
    started: AtomicBool,
    /// Stops the plugins' supervision loops (and so the plugins) when the manager goes.
    stop: CancellationToken,
}

impl Drop for DeviceManager {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl std::fmt::Debug for DeviceManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceManager")
            .field("plugins", &self.plugins.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Default for DeviceManager {
    fn default() -> Self {
        DeviceManager::new(Vec::new())
    }
}

impl DeviceManager {
    /// A manager for `plugins`; nothing runs until [`DeviceManager::start`].
    pub fn new(plugins: Vec<Arc<dyn DevicePlugin>>) -> Self {
        let (version, _) = watch::channel(0);
        DeviceManager {
            plugins: plugins
                .into_iter()
                .map(|plugin| (plugin.name().clone(), plugin))
                .collect(),
            inner: Mutex::new(Inner {
                inventory: DeviceInventory::default(),
                assignments: Assignments::new(),
                reported: BTreeSet::new(),
            }),
            version,
            started: AtomicBool::new(false),
            stop: CancellationToken::new(),
        }
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        // Every update is a few map operations decided before any of them is made.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn bump(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// A receiver that sees a new version after every change of devices or assignments.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    /// Starts every plugin under its supervision loop (once; later calls do nothing),
    /// timing restarts with `clock`. Call from within a tokio runtime.
    pub fn start(self: &Arc<Self>, clock: Clock) {
        self.start_seeded(clock, None);
    }

    /// [`DeviceManager::start`], with the restart delays' jitter drawn from `seed` (for
    /// reproducible runs) rather than at random.
    pub fn start_seeded(self: &Arc<Self>, clock: Clock, seed: Option<u64>) {
        if self.started.swap(true, Ordering::SeqCst) {
            return;
        }
        for plugin in self.plugins.values() {
            let rng = match seed {
                Some(seed) => {
                    use std::hash::{Hash, Hasher};
                    let mut hasher = std::collections::hash_map::DefaultHasher::new();
                    plugin.name().hash(&mut hasher);
                    fastrand::Rng::with_seed(seed ^ hasher.finish())
                }
                None => fastrand::Rng::new(),
            };
            tokio::spawn(supervise(
                Arc::downgrade(self),
                plugin.clone(),
                clock,
                rng,
                self.stop.child_token(),
            ));
        }
    }

    /// Seeds the assignments restored from the store; call before any worker runs.
    pub fn restore(&self, alloc: &Name, devices: AllocDevices) {
        if devices.is_empty() {
            return;
        }
        self.inner().assignments.insert(alloc.clone(), devices);
        self.bump();
    }

    /// The devices for `tasks` of `alloc`, all or none, among healthy instances nobody
    /// else holds, recorded before the lock is let go. What the alloc holds already (its
    /// previous revision's, handed on) is preferred; when the new choice cannot be made,
    /// that is freed too, so a waiting alloc sits on nothing.
    pub fn acquire(
        &self,
        alloc: &Name,
        tasks: &[(Name, &[DeviceRequest])],
    ) -> Result<AllocDevices, DeviceUnavailable> {
        let mut inner = self.inner();
        let result = assign_alloc(&inner.inventory, &inner.assignments, alloc, tasks);
        let before = inner.assignments.get(alloc).cloned();
        let after = result.as_ref().ok().filter(|d| !d.is_empty()).cloned();
        if before == after {
            return result;
        }
        match &after {
            Some(devices) => inner.assignments.insert(alloc.clone(), devices.clone()),
            None => inner.assignments.remove(alloc),
        };
        let kept: BTreeSet<&AssignedDevice> =
            after.iter().flat_map(|d| d.values().flatten()).collect();
        let freed: Vec<AssignedDevice> = before
            .iter()
            .flat_map(|d| d.values().flatten())
            .filter(|device| !kept.contains(device))
            .cloned()
            .collect();
        self.tell_released(&inner, &freed);
        drop(inner);
        self.bump();
        result
    }

    /// Frees everything `alloc` holds; waiting allocs are woken to try again.
    pub fn release(&self, alloc: &Name) {
        let mut inner = self.inner();
        if let Some(freed) = inner.assignments.remove(alloc) {
            let freed: Vec<AssignedDevice> = freed.into_values().flatten().collect();
            self.tell_released(&inner, &freed);
            drop(inner);
            self.bump();
        }
    }

    /// Tells each owning plugin which of its devices nobody holds any more, under the
    /// lock that freed them, so no other alloc takes them before their plugin knows.
    /// (`released` takes only the plugin's own locks.)
    fn tell_released(&self, inner: &Inner, freed: &[AssignedDevice]) {
        let mut owned: BTreeMap<&Name, Vec<AssignedDevice>> = BTreeMap::new();
        let mut unowned = Vec::new();
        for device in freed {
            match inner.inventory.owner(&device.group) {
                Some(owner) => owned.entry(owner).or_default().push(device.clone()),
                None => unowned.push(device.clone()),
            }
        }
        for (owner, devices) in owned {
            if let Some(plugin) = self.plugins.get(owner) {
                plugin.released(&devices);
            }
        }
        // Devices no plugin reports now (its plugin not back since a restart): every
        // plugin hears of them, and each minds its own.
        if !unowned.is_empty() {
            for plugin in self.plugins.values() {
                plugin.released(&unowned);
            }
        }
    }

    /// What `alloc` holds.
    pub fn held(&self, alloc: &Name) -> AllocDevices {
        self.inner()
            .assignments
            .get(alloc)
            .cloned()
            .unwrap_or_default()
    }

    /// Whether every plugin reported at least once, so that a device no plugin reports
    /// is unknown rather than not reported yet.
    pub fn all_reported(&self) -> bool {
        let inner = self.inner();
        self.plugins
            .keys()
            .all(|name| inner.reported.contains(name))
    }

    /// Each device's health as the node sees it (`None`: no plugin reports it).
    pub fn health(&self, devices: &[AssignedDevice]) -> Vec<Option<DeviceHealth>> {
        let inner = self.inner();
        devices.iter().map(|d| inner.inventory.health(d)).collect()
    }

    /// Each plugin with its state and note, for the node's status.
    pub fn plugin_statuses(&self) -> Vec<stead_schemas::api::DevicePluginStatus> {
        self.inner().inventory.plugin_statuses(self.plugins.keys())
    }

    /// Every device with its health and holder, for the node's status.
    pub fn node_devices(&self) -> Vec<DeviceGroupStatus> {
        let inner = self.inner();
        node_devices(&inner.inventory, &inner.assignments)
    }

    /// What a task holding `devices` gets: `STEAD_DEVICE_<TYPE>_IDS` and each owning
    /// plugin's reservation.
    pub async fn reservation(
        &self,
        devices: &[AssignedDevice],
    ) -> Result<Reservation, PluginError> {
        let mut reservations = Vec::new();
        for (plugin, owned) in self.by_plugin(devices) {
            reservations.push(plugin.reserve(&owned).await?);
        }
        Ok(task_reservation(devices, &reservations))
    }

    /// The stats of `alloc`'s devices: each plugin is asked once for the instances it
    /// owns, and the answers are indexed by instance, so the cost follows what the alloc
    /// holds, never what the host has.
    pub async fn alloc_stats(&self, devices: &AllocDevices) -> AllocDeviceStats<DeviceStats> {
        let held: Vec<AssignedDevice> = devices.values().flatten().cloned().collect();
        let mut index: HashMap<AssignedDevice, DeviceStats> = HashMap::new();
        for (plugin, owned) in self.by_plugin(&held) {
            match plugin.stats(&owned).await {
                Ok(stats) => index.extend(stats),
                Err(error) => tracing::debug!(error = %error, "no device stats"),
            }
        }
        alloc_device_stats(devices, |device| index.get(device).cloned())
    }

    /// `devices` grouped by the plugin that reports each (unreported ones are left out).
    fn by_plugin(
        &self,
        devices: &[AssignedDevice],
    ) -> Vec<(Arc<dyn DevicePlugin>, Vec<AssignedDevice>)> {
        let owners: Vec<Option<Name>> = {
            let inner = self.inner();
            devices
                .iter()
                .map(|d| inner.inventory.owner(&d.group).cloned())
                .collect()
        };
        let mut grouped: BTreeMap<Name, Vec<AssignedDevice>> = BTreeMap::new();
        for (device, owner) in devices.iter().zip(owners) {
            if let Some(owner) = owner {
                grouped.entry(owner).or_default().push(device.clone());
            }
        }
        grouped
            .into_iter()
            .filter_map(|(name, owned)| Some((self.plugins.get(&name)?.clone(), owned)))
            .collect()
    }

    /// Takes a fingerprint from `plugin`; an invalid one is refused with why (the
    /// plugin's devices turn unhealthy).
    fn report(&self, plugin: &Name, fingerprint: &DeviceFingerprint) -> Result<(), String> {
        let result = {
            let mut inner = self.inner();
            let result = inner.inventory.report(plugin, fingerprint);
            if result.is_ok() {
                inner.reported.insert(plugin.clone());
            }
            result
        };
        self.bump();
        result.map_err(|error| {
            tracing::error!(plugin = %plugin, error = %error, "invalid device fingerprint");
            error.to_string()
        })
    }

    fn plugin_failed(&self, plugin: &Name, reason: &str) {
        tracing::warn!(plugin = %plugin, reason, "device plugin failed; its devices are unhealthy");
        self.inner().inventory.plugin_failed(plugin, reason);
        self.bump();
    }
}

/// Runs `plugin` until the manager is gone: starts it, feeds its fingerprints to the
/// inventory, and when it stops or sends an invalid fingerprint, fails its devices and
/// starts it again after a backoff.
async fn supervise(
    manager: Weak<DeviceManager>,
    plugin: Arc<dyn DevicePlugin>,
    clock: Clock,
    mut rng: fastrand::Rng,
    stop: CancellationToken,
) {
    let name = plugin.name().clone();
    let mut backoff = || {
        backon::ExponentialBuilder::default()
            .with_min_delay(RESTART_MIN)
            .with_max_delay(RESTART_MAX)
            .with_jitter()
            .with_jitter_seed(rng.u64(..))
            .without_max_times()
            .build()
    };
    let mut delays = backoff();
    loop {
        let started = clock.instant();
        let run = async {
            match plugin.start().await {
                Ok(mut fingerprints) => loop {
                    let Some(fingerprint) = fingerprints.recv().await else {
                        break "it stopped reporting".to_owned();
                    };
                    let Some(manager) = manager.upgrade() else {
                        break "the node is gone".to_owned();
                    };
                    if let Err(invalid) = manager.report(&name, &fingerprint) {
                        break invalid;
                    }
                },
                Err(error) => error.message,
            }
        };
        let why = tokio::select! {
            biased;
            () = stop.cancelled() => return,
            why = run => why,
        };
        let Some(manager) = manager.upgrade() else {
            return;
        };
        manager.plugin_failed(&name, &why);
        drop(manager);
        // A plugin that stayed up a while starts over from the shortest delay; one that
        // keeps dying right after reporting backs off further each time.
        if started.elapsed() >= STABLE_AFTER {
            delays = backoff();
        }
        let delay = delays.next().unwrap_or(RESTART_MAX);
        tokio::select! {
            biased;
            () = stop.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use stead_schemas::config::{StaticDeviceGroup, StaticDeviceInstance};

    use super::*;

    fn plugin(ids: &[&str]) -> Arc<dyn DevicePlugin> {
        let group = StaticDeviceGroup {
            vendor: "acme".to_owned(),
            device_type: "gpu".to_owned(),
            name: "a1".to_owned(),
            health_dir: None,
            instances: ids
                .iter()
                .map(|id| StaticDeviceInstance {
                    id: (*id).to_owned(),
                })
                .collect(),
        };
        Arc::new(StaticPlugin::new(vec![group], Duration::from_secs(1)).expect("valid config"))
    }

    /// A plugin that reports one fixed fingerprint on every start, then stays quiet.
    struct Fixed {
        name: Name,
        fingerprint: DeviceFingerprint,
    }

    impl DevicePlugin for Fixed {
        fn name(&self) -> &Name {
            &self.name
        }
        fn start(&self) -> BoxFuture<'_, Result<mpsc::Receiver<DeviceFingerprint>, PluginError>> {
            let fingerprint = self.fingerprint.clone();
            Box::pin(async move {
                let (tx, rx) = mpsc::channel(1);
                tokio::spawn(async move {
                    let _ = tx.send(fingerprint).await;
                    tx.closed().await;
                });
                Ok(rx)
            })
        }
        fn stats(
            &self,
            _: &[AssignedDevice],
        ) -> BoxFuture<'_, Result<HashMap<AssignedDevice, DeviceStats>, PluginError>> {
            Box::pin(async { Ok(HashMap::new()) })
        }
        fn reserve(&self, _: &[AssignedDevice]) -> BoxFuture<'_, Result<Reservation, PluginError>> {
            Box::pin(async { Ok(Reservation::default()) })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_invalid_fingerprint_is_refused_and_the_plugin_restarted_with_growing_delays() {
        let instance = |id: &str| stead_schemas::device::DeviceInstanceFingerprint {
            id: id.to_owned(),
            health: DeviceHealth::Healthy,
            attributes: BTreeMap::new(),
        };
        let duplicate_ids = DeviceFingerprint {
            groups: vec![stead_schemas::device::DeviceGroupFingerprint {
                vendor: "acme".to_owned(),
                device_type: "gpu".to_owned(),
                name: "a1".to_owned(),
                attributes: BTreeMap::new(),
                instances: vec![instance("gpu0"), instance("gpu0")],
            }],
            note: None,
        };
        let plugin = Fixed {
            name: "fixed".parse().expect("a name"),
            fingerprint: duplicate_ids,
        };
        let manager = Arc::new(DeviceManager::new(vec![Arc::new(plugin)]));
        let changes = manager.subscribe();
        manager.start(Clock::system());
        tokio::time::sleep(Duration::from_secs(60)).await;
        // Each attempt is one refused report and one failure: two changes.
        let attempts = *changes.borrow() / 2;
        // 0.5 s doubling, jittered, capped at 30 s: a handful in a minute, not one per
        // poll.
        assert!((4..=9).contains(&attempts), "{attempts} attempts in 60 s");
        assert!(!manager.all_reported());
        assert!(manager.node_devices().is_empty(), "nothing of it is known");
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_the_manager_stops_its_plugins() {
        let manager = Arc::new(DeviceManager::new(vec![plugin(&["gpu0"])]));
        let mut changes = manager.subscribe();
        manager.start(Clock::system());
        changes.changed().await.expect("a report");
        let stop = manager.stop.clone();
        drop(manager);
        assert!(stop.is_cancelled());
        // The supervision loop and the static plugin's poller end: nothing is left to
        // run, so the runtime goes idle at once.
        tokio::time::timeout(Duration::from_secs(1), async {
            while tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks()
                > 0
            {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("every plugin task ended");
    }

    #[tokio::test(start_paused = true)]
    async fn a_valid_plugin_reports_once_and_its_devices_can_be_acquired_and_released() {
        let manager = Arc::new(DeviceManager::new(vec![plugin(&["gpu0"])]));
        let mut changes = manager.subscribe();
        manager.start(Clock::system());
        changes.changed().await.expect("a report");
        assert!(manager.all_reported());
        let alloc: Name = "web".parse().expect("a name");
        let request = [DeviceRequest {
            name: "acme/gpu".parse().expect("a device name"),
            count: None,
        }];
        let tasks = [("t".parse().expect("a name"), &request[..])];
        let held = manager.acquire(&alloc, &tasks).expect("free");
        assert_eq!(manager.held(&alloc), held);
        let other: Name = "other".parse().expect("a name");
        assert!(manager.acquire(&other, &tasks).is_err(), "taken");
        manager.release(&alloc);
        assert!(manager.acquire(&other, &tasks).is_ok(), "free again");
    }
}
