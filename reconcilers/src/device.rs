//! Devices: fingerprint validation, the node's inventory, assignment of healthy free
//! instances to tasks, health flags on holders, stats per task and per group, and the
//! env a task gets.
//!
//! Rules:
//! - a fingerprint is checked as a whole ([`validate_fingerprint`]): vendor, type and
//!   name valid, instance ids valid and unique in their group, groups unique in the
//!   plugin (and not reported by another plugin); one bad field rejects it all;
//! - an invalid fingerprint or a failed plugin makes all of that plugin's instances
//!   unhealthy at once, and keeps them known so their holders are still shown; the next
//!   valid fingerprint replaces the plugin's groups;
//! - [`assign`] chooses only healthy instances nobody holds, in sorted order, exact
//!   (`vendor/type/name`) requests first; a task that already holds devices keeps them,
//!   whatever their health and even when no plugin reported them yet (restored after a
//!   restart: unknown, but reserved);
//! - an unhealthy or unreported instance never takes an assignment away: [`flags`] names
//!   the holders to flag;
//! - stats are looked up once per held instance ([`alloc_device_stats`]), never by
//!   scanning the host's devices, and grouped so one group is one entry per alloc.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::path::PathBuf;

use stead_schemas::api::{
    DeviceGroupStatus, DeviceHolder, DeviceInstanceStatus, DevicePluginStatus,
};
use stead_schemas::device::{
    AssignedDevice, DeviceFingerprint, DeviceGroupField, DeviceGroupId, DeviceHealth,
    DeviceInstanceId,
};
use stead_schemas::spec::{DeviceName, DeviceRequest, Name};

/// One alloc's devices: each task's instances, by task name.
pub type AllocDevices = BTreeMap<Name, Vec<AssignedDevice>>;

/// Every assignment on the node: each alloc's devices, by alloc name.
pub type Assignments = BTreeMap<Name, AllocDevices>;

/// A fingerprint rejected as a whole; every variant names the plugin and the group.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FingerprintError {
    /// A field is missing or invalid.
    #[error(
        "device plugin {plugin} sent an invalid fingerprint: groups[{index}] ({group}): {field} {problem}"
    )]
    InvalidField {
        /// The plugin.
        plugin: Name,
        /// The group's position in the fingerprint.
        index: usize,
        /// The group as written, `vendor/type/name`.
        group: String,
        /// The field: `vendor`, `type`, `name` or `instances[i].id`.
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// Two groups have the same vendor, type and name.
    #[error(
        "device plugin {plugin} sent an invalid fingerprint: group {group} is reported twice (groups[{first}] and groups[{second}])"
    )]
    DuplicateGroup {
        /// The plugin.
        plugin: Name,
        /// The group.
        group: DeviceGroupId,
        /// Where it appears first.
        first: usize,
        /// Where it appears again.
        second: usize,
    },
    /// Two instances of one group have the same id.
    #[error(
        "device plugin {plugin} sent an invalid fingerprint: group {group}: instances[{second}].id \"{instance}\" is also instances[{first}].id"
    )]
    DuplicateInstance {
        /// The plugin.
        plugin: Name,
        /// The group.
        group: DeviceGroupId,
        /// The id.
        instance: DeviceInstanceId,
        /// Where it appears first.
        first: usize,
        /// Where it appears again.
        second: usize,
    },
    /// Another plugin already reports this group.
    #[error(
        "device plugin {plugin} sent an invalid fingerprint: group {group} is already reported by device plugin {owner}"
    )]
    GroupOfAnotherPlugin {
        /// The plugin.
        plugin: Name,
        /// The group.
        group: DeviceGroupId,
        /// The plugin that reports it.
        owner: Name,
    },
}

/// A group of a validated fingerprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidGroup {
    /// Facts shared by every instance.
    pub attributes: BTreeMap<String, String>,
    /// The instances, by id (unique by construction).
    pub instances: BTreeMap<DeviceInstanceId, ValidInstance>,
}

/// An instance of a validated fingerprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidInstance {
    /// What the plugin says of its health.
    pub health: DeviceHealth,
    /// Facts about this instance.
    pub attributes: BTreeMap<String, String>,
}

/// A fingerprint that passed [`validate_fingerprint`]: groups unique by id, instances
/// unique by id within their group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidFingerprint {
    /// Invariant: built only by [`validate_fingerprint`].
    groups: BTreeMap<DeviceGroupId, ValidGroup>,
}

impl ValidFingerprint {
    /// The groups, by id.
    pub fn groups(&self) -> &BTreeMap<DeviceGroupId, ValidGroup> {
        &self.groups
    }
}

/// Checks `plugin`'s fingerprint as a whole; the first problem rejects it.
pub fn validate_fingerprint(
    plugin: &Name,
    fingerprint: &DeviceFingerprint,
) -> Result<ValidFingerprint, FingerprintError> {
    let mut groups = BTreeMap::new();
    let mut positions: BTreeMap<DeviceGroupId, usize> = BTreeMap::new();
    for (index, group) in fingerprint.groups.iter().enumerate() {
        let written = format!("{}/{}/{}", group.vendor, group.device_type, group.name);
        let invalid = |field: String, value: &str, rule: &str| FingerprintError::InvalidField {
            plugin: plugin.clone(),
            index,
            group: written.clone(),
            problem: if value.is_empty() {
                "is required".to_owned()
            } else {
                format!("{value:?} is invalid; {rule}")
            },
            field,
        };
        let id = DeviceGroupId::new(&group.vendor, &group.device_type, &group.name).map_err(
            |field| {
                let value = match field {
                    DeviceGroupField::Vendor => &group.vendor,
                    DeviceGroupField::Type => &group.device_type,
                    DeviceGroupField::Name => &group.name,
                };
                invalid(
                    field.to_string(),
                    value,
                    "use letters, digits, '-', '_' or '.', starting with a letter or digit",
                )
            },
        )?;
        if let Some(&first) = positions.get(&id) {
            return Err(FingerprintError::DuplicateGroup {
                plugin: plugin.clone(),
                group: id,
                first,
                second: index,
            });
        }
        let mut instances = BTreeMap::new();
        let mut instance_positions: HashMap<DeviceInstanceId, usize> = HashMap::new();
        for (position, instance) in group.instances.iter().enumerate() {
            let instance_id: DeviceInstanceId = instance.id.parse().map_err(|_| {
                invalid(
                    format!("instances[{position}].id"),
                    &instance.id,
                    "it may not contain ',', spaces or control characters",
                )
            })?;
            if let Some(&first) = instance_positions.get(&instance_id) {
                return Err(FingerprintError::DuplicateInstance {
                    plugin: plugin.clone(),
                    group: id,
                    instance: instance_id,
                    first,
                    second: position,
                });
            }
            instance_positions.insert(instance_id.clone(), position);
            instances.insert(
                instance_id,
                ValidInstance {
                    health: instance.health.clone(),
                    attributes: instance.attributes.clone(),
                },
            );
        }
        positions.insert(id.clone(), index);
        groups.insert(
            id,
            ValidGroup {
                attributes: group.attributes.clone(),
                instances,
            },
        );
    }
    Ok(ValidFingerprint { groups })
}

/// What the node knows of one plugin.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PluginDevices {
    /// The groups of its last valid fingerprint.
    groups: BTreeMap<DeviceGroupId, ValidGroup>,
    /// Why the plugin is failed (dead, or its last fingerprint was invalid); while set,
    /// every instance of `groups` is unhealthy.
    failure: Option<String>,
    /// The note of its last valid fingerprint.
    note: Option<String>,
    /// Whether a valid fingerprint was ever taken.
    reported: bool,
}

/// The node's devices: per plugin, its last valid fingerprint and whether it failed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceInventory {
    /// Each plugin, by name.
    plugins: BTreeMap<Name, PluginDevices>,
    /// Which plugin reports each group. Invariant: exactly the groups of `plugins`.
    owners: HashMap<DeviceGroupId, Name>,
}

impl DeviceInventory {
    /// Takes `plugin`'s new fingerprint. A valid one replaces the plugin's groups and
    /// ends its failure; an invalid one is rejected as a whole and fails the plugin
    /// (its devices turn unhealthy, its last valid groups stay known).
    pub fn report(
        &mut self,
        plugin: &Name,
        fingerprint: &DeviceFingerprint,
    ) -> Result<(), FingerprintError> {
        let checked = validate_fingerprint(plugin, fingerprint).and_then(|valid| {
            for group in valid.groups.keys() {
                if let Some(owner) = self.owners.get(group).filter(|owner| *owner != plugin) {
                    return Err(FingerprintError::GroupOfAnotherPlugin {
                        plugin: plugin.clone(),
                        group: group.clone(),
                        owner: owner.clone(),
                    });
                }
            }
            Ok(valid)
        });
        match checked {
            Ok(valid) => {
                let entry = self.plugins.entry(plugin.clone()).or_default();
                for old in entry.groups.keys() {
                    self.owners.remove(old);
                }
                for group in valid.groups.keys() {
                    self.owners.insert(group.clone(), plugin.clone());
                }
                *entry = PluginDevices {
                    groups: valid.groups,
                    failure: None,
                    note: fingerprint.note.clone(),
                    reported: true,
                };
                Ok(())
            }
            Err(error) => {
                self.plugin_failed(plugin, error.to_string());
                Err(error)
            }
        }
    }

    /// Marks every instance of `plugin` unhealthy at once, keeping them known.
    pub fn plugin_failed(&mut self, plugin: &Name, reason: impl Into<String>) {
        self.plugins.entry(plugin.clone()).or_default().failure = Some(reason.into());
    }

    /// The instance's health as the node sees it (a failed plugin's instances are
    /// unhealthy), or `None` when no plugin reports it.
    pub fn health(&self, device: &AssignedDevice) -> Option<DeviceHealth> {
        let owner = self.owners.get(&device.group)?;
        let plugin = self.plugins.get(owner)?;
        let instance = plugin
            .groups
            .get(&device.group)?
            .instances
            .get(&device.instance)?;
        Some(match &plugin.failure {
            Some(reason) => DeviceHealth::Unhealthy {
                reason: Some(format!("device plugin {owner} failed: {reason}")),
            },
            None => instance.health.clone(),
        })
    }

    /// Each plugin of `configured` as the node's status shows it: reporting, starting
    /// (nothing taken from it yet) or failed with why.
    pub fn plugin_statuses<'a>(
        &self,
        configured: impl IntoIterator<Item = &'a Name>,
    ) -> Vec<DevicePluginStatus> {
        let mut statuses: Vec<DevicePluginStatus> = configured
            .into_iter()
            .map(|name| {
                let known = self.plugins.get(name);
                let state = match known {
                    Some(PluginDevices {
                        failure: Some(_), ..
                    }) => "failed",
                    Some(PluginDevices { reported: true, .. }) => "reporting",
                    _ => "starting",
                };
                let instances = known.map_or(0, |devices| {
                    devices.groups.values().map(|g| g.instances.len()).sum()
                });
                DevicePluginStatus {
                    name: name.to_string(),
                    state: state.to_owned(),
                    reason: known.and_then(|d| d.failure.clone()),
                    note: known.and_then(|d| d.note.clone()),
                    instances: u32::try_from(instances).unwrap_or(u32::MAX),
                }
            })
            .collect();
        statuses.sort_by(|a, b| a.name.cmp(&b.name));
        statuses
    }

    /// The plugin that reports `group`.
    pub fn owner(&self, group: &DeviceGroupId) -> Option<&Name> {
        self.owners.get(group)
    }

    /// Every known group with its plugin, sorted by group id.
    pub fn groups(&self) -> impl Iterator<Item = (&DeviceGroupId, &Name, &ValidGroup)> {
        let mut groups: Vec<_> = self
            .plugins
            .iter()
            .flat_map(|(plugin, devices)| {
                devices
                    .groups
                    .iter()
                    .map(move |(id, group)| (id, plugin, group))
            })
            .collect();
        groups.sort_by(|a, b| a.0.cmp(b.0));
        groups.into_iter()
    }
}

/// Why a task's devices cannot be assigned now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceUnavailable {
    /// No plugin reports a group the request names (for `vendor/type`: none of that
    /// vendor and type). The caller reports the device as unknown.
    Unknown {
        /// The request.
        request: DeviceName,
    },
    /// Matching groups exist, but too few of their instances are healthy and free. The
    /// task stays pending and is placed when enough are.
    NotNow {
        /// The request.
        request: DeviceName,
        /// Instances requested.
        requested: u32,
        /// Matching instances that are healthy, held by nobody and not already chosen
        /// for another request of the same task.
        healthy_and_free: u32,
    },
}

impl fmt::Display for DeviceUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceUnavailable::Unknown { request } => match request.model() {
                Some(_) => write!(f, "unknown device {request}: no device plugin reports it"),
                None => write!(
                    f,
                    "unknown device {request}: no device plugin reports a {} device of vendor {}",
                    request.device_type(),
                    request.vendor()
                ),
            },
            DeviceUnavailable::NotNow {
                request,
                requested,
                healthy_and_free,
            } => write!(
                f,
                "{requested} × {request} requested, {healthy_and_free} healthy and free"
            ),
        }
    }
}

/// The devices for `task` of `alloc`: what it already holds (kept whatever its health,
/// even unreported), or else instances for every request, chosen only among healthy
/// instances nobody holds, in (group id, instance id) order, exact requests first. The
/// result is sorted. The caller records it in `assignments` and removes it when the
/// task no longer needs it.
pub fn assign(
    inventory: &DeviceInventory,
    assignments: &Assignments,
    alloc: &Name,
    task: &Name,
    requests: &[DeviceRequest],
) -> Result<Vec<AssignedDevice>, DeviceUnavailable> {
    if let Some(held) = assignments.get(alloc).and_then(|tasks| tasks.get(task)) {
        return Ok(held.clone());
    }
    let held = held_devices(assignments);
    choose(inventory, &held, &HashSet::new(), requests)
}

/// The devices for every task of `alloc` that requests some, all or none: [`assign`]'s
/// choice for each task in the order given, no instance chosen twice. What `alloc`
/// holds already (an earlier revision's devices, handed on) counts as free for it and is
/// chosen first, so an edited spec keeps its devices where it can. Tasks that request
/// nothing get no entry. The first request that cannot be met fails the whole alloc, so
/// an alloc never sits on part of what it needs while it waits for the rest.
pub fn assign_alloc(
    inventory: &DeviceInventory,
    assignments: &Assignments,
    alloc: &Name,
    tasks: &[(Name, &[DeviceRequest])],
) -> Result<AllocDevices, DeviceUnavailable> {
    let own: HashSet<&AssignedDevice> = assignments
        .get(alloc)
        .map(|held| held.values().flatten().collect())
        .unwrap_or_default();
    let others: HashSet<&AssignedDevice> = assignments
        .iter()
        .filter(|(holder, _)| *holder != alloc)
        .flat_map(|(_, tasks)| tasks.values().flatten())
        .collect();
    let mut choices: Vec<(Name, Vec<AssignedDevice>)> = Vec::new();
    for (task, requests) in tasks {
        if requests.is_empty() {
            continue;
        }
        let chosen = {
            let mut taken = others.clone();
            taken.extend(choices.iter().flat_map(|(_, devices)| devices));
            choose(inventory, &taken, &own, requests)?
        };
        choices.push((task.clone(), chosen));
    }
    Ok(choices.into_iter().collect())
}

/// Every instance some task holds.
fn held_devices(assignments: &Assignments) -> HashSet<&AssignedDevice> {
    assignments
        .values()
        .flat_map(|tasks| tasks.values().flatten())
        .collect()
}

/// Instances for every request among healthy ones not in `held`, those in `prefer`
/// first.
fn choose(
    inventory: &DeviceInventory,
    held: &HashSet<&AssignedDevice>,
    prefer: &HashSet<&AssignedDevice>,
    requests: &[DeviceRequest],
) -> Result<Vec<AssignedDevice>, DeviceUnavailable> {
    // Exact requests first, so `nvidia/gpu` does not take the only `nvidia/gpu/a100`.
    let mut ordered: Vec<&DeviceRequest> = requests.iter().collect();
    ordered.sort_by_key(|request| request.name.model().is_none());
    let mut chosen: BTreeSet<AssignedDevice> = BTreeSet::new();
    for request in ordered {
        let requested = request.count.unwrap_or(1);
        let mut known = false;
        let mut free = Vec::new();
        for (group_id, _, group) in inventory.groups() {
            if !group_id.matches(&request.name) {
                continue;
            }
            known = true;
            for instance in group.instances.keys() {
                let device = AssignedDevice {
                    group: group_id.clone(),
                    instance: instance.clone(),
                };
                let healthy = inventory
                    .health(&device)
                    .is_some_and(|health| health.is_healthy());
                if healthy && !held.contains(&device) && !chosen.contains(&device) {
                    free.push(device);
                }
            }
        }
        if !known {
            return Err(DeviceUnavailable::Unknown {
                request: request.name.clone(),
            });
        }
        // Stable: within each kind, (group id, instance id) order stays.
        free.sort_by_key(|device| !prefer.contains(device));
        let wanted = usize::try_from(requested).expect("a u32 fits in usize");
        if free.len() < wanted {
            return Err(DeviceUnavailable::NotNow {
                request: request.name.clone(),
                requested,
                healthy_and_free: u32::try_from(free.len()).unwrap_or(u32::MAX),
            });
        }
        chosen.extend(free.into_iter().take(wanted));
    }
    Ok(chosen.into_iter().collect())
}

/// Why a held instance is flagged in its holder's status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FlagReason {
    /// The instance (or its plugin) is unhealthy.
    Unhealthy {
        /// Why, when known.
        reason: Option<String>,
    },
    /// No plugin reports the instance (a restored assignment before its plugin reported,
    /// or an instance its plugin no longer lists). It stays reserved.
    NotReported,
}

impl fmt::Display for FlagReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FlagReason::Unhealthy {
                reason: Some(reason),
            } => write!(f, "unhealthy: {reason}"),
            FlagReason::Unhealthy { reason: None } => f.write_str("unhealthy"),
            FlagReason::NotReported => f.write_str("not reported by any device plugin"),
        }
    }
}

/// A held instance that is not healthy, to flag in its holder's status. The holder keeps
/// it: health never takes an assignment away.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFlag {
    /// The holder's alloc.
    pub alloc: Name,
    /// The holder.
    pub task: Name,
    /// The instance.
    pub device: AssignedDevice,
    /// Why.
    pub reason: FlagReason,
}

/// Every held instance that is unhealthy or unreported, sorted by alloc, task, device.
pub fn flags(assignments: &Assignments, inventory: &DeviceInventory) -> Vec<DeviceFlag> {
    let mut flags = Vec::new();
    for (alloc, tasks) in assignments {
        for (task, devices) in tasks {
            for device in devices {
                let reason = match inventory.health(device) {
                    None => FlagReason::NotReported,
                    Some(DeviceHealth::Healthy) => continue,
                    Some(DeviceHealth::Unhealthy { reason }) => FlagReason::Unhealthy { reason },
                };
                flags.push(DeviceFlag {
                    alloc: alloc.clone(),
                    task: task.clone(),
                    device: device.clone(),
                    reason,
                });
            }
        }
    }
    flags
}

/// The node's devices for its status: every group a plugin reports (with each
/// instance's health as the node sees it) and every group an alloc holds an instance of
/// (an unreported instance shows as unhealthy), each instance with its holder.
pub fn node_devices(
    inventory: &DeviceInventory,
    assignments: &Assignments,
) -> Vec<DeviceGroupStatus> {
    let mut holders: BTreeMap<&AssignedDevice, DeviceHolder> = BTreeMap::new();
    for (alloc, tasks) in assignments {
        for (task, devices) in tasks {
            for device in devices {
                holders.insert(
                    device,
                    DeviceHolder {
                        alloc: alloc.to_string(),
                        task: task.to_string(),
                    },
                );
            }
        }
    }
    let mut groups: BTreeMap<&DeviceGroupId, DeviceGroupStatus> = BTreeMap::new();
    let mut instances: BTreeMap<(&DeviceGroupId, &DeviceInstanceId), DeviceInstanceStatus> =
        BTreeMap::new();
    let status_of = |device: &AssignedDevice,
                     health: Option<DeviceHealth>,
                     attributes: BTreeMap<String, String>| {
        let (healthy, reason) = match health {
            Some(DeviceHealth::Healthy) => (true, None),
            Some(DeviceHealth::Unhealthy { reason }) => (false, reason),
            None => (false, Some(FlagReason::NotReported.to_string())),
        };
        DeviceInstanceStatus {
            id: device.instance.to_string(),
            healthy,
            reason,
            attributes,
            held_by: holders.get(device).cloned(),
        }
    };
    let group_status = |id: &DeviceGroupId| DeviceGroupStatus {
        vendor: id.vendor().to_owned(),
        device_type: id.device_type().to_owned(),
        name: id.name().to_owned(),
        plugin: None,
        attributes: BTreeMap::new(),
        instances: Vec::new(),
    };
    for (id, plugin, group) in inventory.groups() {
        groups.insert(
            id,
            DeviceGroupStatus {
                plugin: Some(plugin.to_string()),
                attributes: group.attributes.clone(),
                ..group_status(id)
            },
        );
        for (instance, valid) in &group.instances {
            let device = AssignedDevice {
                group: id.clone(),
                instance: instance.clone(),
            };
            let status = status_of(&device, inventory.health(&device), valid.attributes.clone());
            instances.insert((id, instance), status);
        }
    }
    for device in holders.keys() {
        groups
            .entry(&device.group)
            .or_insert_with(|| group_status(&device.group));
        instances
            .entry((&device.group, &device.instance))
            .or_insert_with(|| status_of(device, None, BTreeMap::new()));
    }
    for ((group, _), status) in instances {
        groups
            .get_mut(group)
            .expect("every instance's group is listed")
            .instances
            .push(status);
    }
    groups.into_values().collect()
}

/// One held instance's stats.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceStats<S> {
    /// The instance.
    pub device: AssignedDevice,
    /// Its stats; `None` when the plugin had none for it.
    pub stats: Option<S>,
}

/// An alloc's device stats: per task, and per device group across its tasks.
#[derive(Debug, Clone, PartialEq)]
pub struct AllocDeviceStats<S> {
    /// Each task's instances, by task name.
    pub tasks: BTreeMap<Name, Vec<InstanceStats<S>>>,
    /// Each group the alloc uses, with every instance any of its tasks holds: two tasks
    /// on instances of one group give one entry.
    pub groups: BTreeMap<DeviceGroupId, BTreeMap<DeviceInstanceId, Option<S>>>,
}

/// The stats of one alloc's devices. `lookup` is called once per held instance (the
/// shell passes an index by instance, such as `|d| stats.get(d).cloned()`), so the cost
/// follows what the alloc holds, never the number of devices on the host.
pub fn alloc_device_stats<S: Clone>(
    devices: &AllocDevices,
    mut lookup: impl FnMut(&AssignedDevice) -> Option<S>,
) -> AllocDeviceStats<S> {
    let mut result = AllocDeviceStats {
        tasks: BTreeMap::new(),
        groups: BTreeMap::new(),
    };
    for (task, held) in devices {
        let mut task_stats = Vec::with_capacity(held.len());
        for device in held {
            let stats = lookup(device);
            result
                .groups
                .entry(device.group.clone())
                .or_default()
                .insert(device.instance.clone(), stats.clone());
            task_stats.push(InstanceStats {
                device: device.clone(),
                stats,
            });
        }
        result.tasks.insert(task.clone(), task_stats);
    }
    result
}

/// A path a plugin mounts into the task.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DeviceMount {
    /// On the host.
    pub host_path: PathBuf,
    /// In the task.
    pub task_path: PathBuf,
    /// Whether the task may not write to it.
    pub read_only: bool,
}

/// A device node a plugin exposes to the task.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct DeviceNode {
    /// On the host, such as `/dev/nvidia0`.
    pub host_path: PathBuf,
    /// In the task.
    pub task_path: PathBuf,
    /// cgroup device permissions, such as `rwm`.
    pub permissions: String,
}

/// What a task gets for its devices: what a plugin's reserve returns, and (from
/// [`task_reservation`]) the merge of every plugin's with the agent's env.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reservation {
    /// Environment variables.
    pub env: BTreeMap<String, String>,
    /// Mounts.
    pub mounts: Vec<DeviceMount>,
    /// Device nodes.
    pub device_nodes: Vec<DeviceNode>,
}

/// `STEAD_DEVICE_<TYPE>_IDS` for a device type: upper-cased, every character that is
/// not an ASCII letter or digit written as `_`.
pub fn device_ids_env_name(device_type: &str) -> String {
    let mangled: String = device_type
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("STEAD_DEVICE_{mangled}_IDS")
}

/// The task's reservation: `STEAD_DEVICE_<TYPE>_IDS` per type (the ids of every group of
/// that type, comma-separated, in the order of `assigned`), merged with what the plugins
/// returned, in the order given. The agent's variables win over a plugin's, and an
/// earlier plugin's over a later one's; repeated mounts and device nodes appear once.
pub fn task_reservation(assigned: &[AssignedDevice], plugins: &[Reservation]) -> Reservation {
    let mut ids: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for device in assigned {
        ids.entry(device_ids_env_name(device.group.device_type()))
            .or_default()
            .push(device.instance.as_str());
    }
    let mut merged = Reservation {
        env: ids
            .into_iter()
            .map(|(name, ids)| (name, ids.join(",")))
            .collect(),
        ..Reservation::default()
    };
    for plugin in plugins {
        for (name, value) in &plugin.env {
            merged
                .env
                .entry(name.clone())
                .or_insert_with(|| value.clone());
        }
        for mount in &plugin.mounts {
            if !merged.mounts.contains(mount) {
                merged.mounts.push(mount.clone());
            }
        }
        for node in &plugin.device_nodes {
            if !merged.device_nodes.contains(node) {
                merged.device_nodes.push(node.clone());
            }
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use stead_schemas::device::{DeviceGroupFingerprint, DeviceInstanceFingerprint};

    use super::*;

    fn name(text: &str) -> Name {
        text.parse().unwrap()
    }

    fn dev(group: &str, instance: &str) -> AssignedDevice {
        AssignedDevice {
            group: group.parse().unwrap(),
            instance: instance.parse().unwrap(),
        }
    }

    fn unhealthy(reason: &str) -> DeviceHealth {
        DeviceHealth::Unhealthy {
            reason: Some(reason.to_owned()),
        }
    }

    /// A group `vendor/type/name` with instances `(id, health)`.
    fn group(id: &str, instances: &[(&str, DeviceHealth)]) -> DeviceGroupFingerprint {
        let parts: Vec<&str> = id.split('/').collect();
        DeviceGroupFingerprint {
            vendor: parts[0].to_owned(),
            device_type: parts[1].to_owned(),
            name: parts[2].to_owned(),
            attributes: BTreeMap::new(),
            instances: instances
                .iter()
                .map(|(id, health)| DeviceInstanceFingerprint {
                    id: (*id).to_owned(),
                    health: health.clone(),
                    attributes: BTreeMap::new(),
                })
                .collect(),
        }
    }

    fn healthy(ids: &[&'static str]) -> Vec<(&'static str, DeviceHealth)> {
        ids.iter().map(|id| (*id, DeviceHealth::Healthy)).collect()
    }

    fn fingerprint(groups: Vec<DeviceGroupFingerprint>) -> DeviceFingerprint {
        DeviceFingerprint { groups, note: None }
    }

    fn inventory(groups: Vec<DeviceGroupFingerprint>) -> DeviceInventory {
        let mut inventory = DeviceInventory::default();
        inventory
            .report(&name("static"), &fingerprint(groups))
            .unwrap();
        inventory
    }

    fn request(text: &str, count: Option<u32>) -> DeviceRequest {
        DeviceRequest {
            name: text.parse().unwrap(),
            count,
        }
    }

    /// One holder: `(alloc, task, [(group, instance)])`.
    type Holder<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)]);

    /// `alloc → task → devices` from its holders.
    fn held(rows: &[Holder<'_>]) -> Assignments {
        let mut assignments = Assignments::new();
        for (alloc, task, devices) in rows {
            assignments
                .entry(name(alloc))
                .or_default()
                .insert(name(task), devices.iter().map(|(g, i)| dev(g, i)).collect());
        }
        assignments
    }

    // Fingerprint validation.

    #[test]
    fn every_invalid_field_rejects_the_fingerprint_naming_plugin_group_and_field() {
        let mut no_vendor = group("x/gpu/a100", &healthy(&["gpu0"]));
        no_vendor.vendor = String::new();
        let mut bad_type = group("nvidia/x/a100", &healthy(&["gpu0"]));
        bad_type.device_type = "g pu".to_owned();
        let mut no_name = group("nvidia/gpu/x", &healthy(&["gpu0"]));
        no_name.name = String::new();
        let cases: Vec<(&str, DeviceGroupFingerprint, &str)> = vec![
            (
                "missing vendor",
                no_vendor,
                "device plugin static sent an invalid fingerprint: groups[1] (/gpu/a100): vendor is required",
            ),
            (
                "invalid type",
                bad_type,
                "device plugin static sent an invalid fingerprint: groups[1] (nvidia/g pu/a100): type \"g pu\" is invalid; use letters, digits, '-', '_' or '.', starting with a letter or digit",
            ),
            (
                "missing name",
                no_name,
                "device plugin static sent an invalid fingerprint: groups[1] (nvidia/gpu/): name is required",
            ),
            (
                "empty instance id",
                group("nvidia/gpu/a100", &healthy(&["gpu0", ""])),
                "device plugin static sent an invalid fingerprint: groups[1] (nvidia/gpu/a100): instances[1].id is required",
            ),
            (
                "instance id with a comma",
                group("nvidia/gpu/a100", &healthy(&["gpu0,gpu1"])),
                "device plugin static sent an invalid fingerprint: groups[1] (nvidia/gpu/a100): instances[0].id \"gpu0,gpu1\" is invalid; it may not contain ',', spaces or control characters",
            ),
            (
                "instance id twice in a group",
                group("nvidia/gpu/a100", &healthy(&["gpu0", "gpu1", "gpu0"])),
                "device plugin static sent an invalid fingerprint: group nvidia/gpu/a100: instances[2].id \"gpu0\" is also instances[0].id",
            ),
            (
                "group twice in a plugin",
                group("acme/fpga/f1", &healthy(&["x"])),
                "device plugin static sent an invalid fingerprint: group acme/fpga/f1 is reported twice (groups[0] and groups[1])",
            ),
        ];
        for (case, bad, expected) in cases {
            let fp = fingerprint(vec![group("acme/fpga/f1", &healthy(&["f0"])), bad]);
            let error = validate_fingerprint(&name("static"), &fp).unwrap_err();
            assert_eq!(error.to_string(), expected, "{case}");
        }
    }

    #[test]
    fn an_invalid_field_error_carries_its_parts_for_callers_to_match() {
        let fp = fingerprint(vec![group("nvidia/gpu/a100", &healthy(&[""]))]);
        assert_eq!(
            validate_fingerprint(&name("static"), &fp),
            Err(FingerprintError::InvalidField {
                plugin: name("static"),
                index: 0,
                group: "nvidia/gpu/a100".to_owned(),
                field: "instances[0].id".to_owned(),
                problem: "is required".to_owned(),
            })
        );
    }

    #[test]
    fn one_instance_id_may_appear_in_two_groups() {
        let fp = fingerprint(vec![
            group("nvidia/gpu/a100", &healthy(&["0"])),
            group("nvidia/gpu/h100", &healthy(&["0"])),
        ]);
        let valid = validate_fingerprint(&name("static"), &fp).unwrap();
        assert_eq!(valid.groups().len(), 2);
    }

    // The inventory.

    #[test]
    fn an_invalid_fingerprint_keeps_the_last_valid_devices_known_but_unhealthy() {
        let mut inventory = inventory(vec![group("nvidia/gpu/a100", &healthy(&["gpu0"]))]);
        let bad = fingerprint(vec![group("nvidia/gpu/a100", &healthy(&["gpu0", "gpu0"]))]);
        let error = inventory.report(&name("static"), &bad).unwrap_err();
        assert!(matches!(error, FingerprintError::DuplicateInstance { .. }));
        let Some(DeviceHealth::Unhealthy {
            reason: Some(reason),
        }) = inventory.health(&dev("nvidia/gpu/a100", "gpu0"))
        else {
            panic!("gpu0 should be known and unhealthy");
        };
        assert!(
            reason.starts_with(
                "device plugin static failed: device plugin static sent an invalid fingerprint"
            ),
            "{reason}"
        );
    }

    #[test]
    fn a_failed_plugin_makes_all_its_instances_unhealthy_at_once_and_others_stay_healthy() {
        let mut inventory = inventory(vec![
            group("nvidia/gpu/a100", &healthy(&["gpu0", "gpu1"])),
            group("nvidia/gpu/h100", &healthy(&["gpu2"])),
        ]);
        inventory
            .report(
                &name("other"),
                &fingerprint(vec![group("acme/fpga/f1", &healthy(&["f0"]))]),
            )
            .unwrap();
        inventory.plugin_failed(&name("static"), "exited with status 1");
        let expected = Some(DeviceHealth::Unhealthy {
            reason: Some("device plugin static failed: exited with status 1".to_owned()),
        });
        for device in [
            dev("nvidia/gpu/a100", "gpu0"),
            dev("nvidia/gpu/a100", "gpu1"),
            dev("nvidia/gpu/h100", "gpu2"),
        ] {
            assert_eq!(inventory.health(&device), expected, "{device}");
        }
        assert_eq!(
            inventory.health(&dev("acme/fpga/f1", "f0")),
            Some(DeviceHealth::Healthy)
        );
    }

    #[test]
    fn a_valid_fingerprint_after_a_failure_replaces_the_groups_and_heals_the_plugin() {
        let mut inventory = inventory(vec![group("nvidia/gpu/a100", &healthy(&["gpu0", "gpu1"]))]);
        inventory.plugin_failed(&name("static"), "crashed");
        inventory
            .report(
                &name("static"),
                &fingerprint(vec![group("nvidia/gpu/a100", &healthy(&["gpu1", "gpu2"]))]),
            )
            .unwrap();
        assert_eq!(inventory.health(&dev("nvidia/gpu/a100", "gpu0")), None);
        assert_eq!(
            inventory.health(&dev("nvidia/gpu/a100", "gpu1")),
            Some(DeviceHealth::Healthy)
        );
        assert_eq!(
            inventory.health(&dev("nvidia/gpu/a100", "gpu2")),
            Some(DeviceHealth::Healthy)
        );
    }

    #[test]
    fn a_group_another_plugin_reports_is_rejected_and_the_owner_keeps_it() {
        let mut inventory = inventory(vec![group("nvidia/gpu/a100", &healthy(&["gpu0"]))]);
        let error = inventory
            .report(
                &name("rogue"),
                &fingerprint(vec![group("nvidia/gpu/a100", &healthy(&["gpu0"]))]),
            )
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "device plugin rogue sent an invalid fingerprint: group nvidia/gpu/a100 is already reported by device plugin static"
        );
        assert_eq!(
            inventory.health(&dev("nvidia/gpu/a100", "gpu0")),
            Some(DeviceHealth::Healthy)
        );
    }

    #[test]
    fn a_group_a_plugin_stops_reporting_can_be_taken_by_another() {
        let mut inventory = inventory(vec![group("nvidia/gpu/a100", &healthy(&["gpu0"]))]);
        inventory
            .report(&name("static"), &fingerprint(vec![]))
            .unwrap();
        inventory
            .report(
                &name("other"),
                &fingerprint(vec![group("nvidia/gpu/a100", &healthy(&["gpu0"]))]),
            )
            .unwrap();
        let owners: Vec<_> = inventory
            .groups()
            .map(|(id, plugin, _)| (id.to_string(), plugin.to_string()))
            .collect();
        assert_eq!(owners, [("nvidia/gpu/a100".to_owned(), "other".to_owned())]);
    }

    // Assignment.

    #[test]
    fn assignment_follows_the_request_rules() {
        let node = vec![
            group(
                "nvidia/gpu/a100",
                &[
                    ("gpu1", DeviceHealth::Healthy),
                    ("gpu0", DeviceHealth::Healthy),
                    ("gpu2", unhealthy("xid 79")),
                ],
            ),
            group("nvidia/gpu/h100", &healthy(&["h0"])),
            group("acme/fpga/f1", &healthy(&["f0"])),
        ];
        let others = held(&[("other", "t", &[("nvidia/gpu/a100", "gpu0")])]);
        let none = Assignments::new();
        type Case<'a> = (
            &'a str,
            &'a Assignments,
            Vec<DeviceRequest>,
            Result<Vec<AssignedDevice>, &'a str>,
        );
        let cases: Vec<Case<'_>> = vec![
            (
                "count defaults to one and the lowest sorted id is taken",
                &none,
                vec![request("nvidia/gpu/a100", None)],
                Ok(vec![dev("nvidia/gpu/a100", "gpu0")]),
            ),
            (
                "vendor/type matches every group of that vendor and type, in sorted order",
                &none,
                vec![request("nvidia/gpu", Some(3))],
                Ok(vec![
                    dev("nvidia/gpu/a100", "gpu0"),
                    dev("nvidia/gpu/a100", "gpu1"),
                    dev("nvidia/gpu/h100", "h0"),
                ]),
            ),
            (
                "vendor/type/name matches only that group",
                &none,
                vec![request("nvidia/gpu/h100", Some(2))],
                Err("2 × nvidia/gpu/h100 requested, 1 healthy and free"),
            ),
            (
                "an unhealthy instance is never chosen",
                &none,
                vec![request("nvidia/gpu/a100", Some(3))],
                Err("3 × nvidia/gpu/a100 requested, 2 healthy and free"),
            ),
            (
                "an instance another task holds is never chosen",
                &others,
                vec![request("nvidia/gpu", Some(2))],
                Ok(vec![
                    dev("nvidia/gpu/a100", "gpu1"),
                    dev("nvidia/gpu/h100", "h0"),
                ]),
            ),
            (
                "not enough free names what is missing",
                &others,
                vec![request("nvidia/gpu", Some(3))],
                Err("3 × nvidia/gpu requested, 2 healthy and free"),
            ),
            (
                "exact requests go first so a general one does not take their only match",
                &others,
                vec![
                    request("nvidia/gpu", None),
                    request("nvidia/gpu/h100", None),
                ],
                Ok(vec![
                    dev("nvidia/gpu/a100", "gpu1"),
                    dev("nvidia/gpu/h100", "h0"),
                ]),
            ),
            (
                "two requests never get the same instance",
                &none,
                vec![request("acme/fpga", None), request("acme/fpga/f1", None)],
                Err("1 × acme/fpga requested, 0 healthy and free"),
            ),
            (
                "a type no plugin reports is unknown",
                &none,
                vec![request("nvidia/tpu", None)],
                Err(
                    "unknown device nvidia/tpu: no device plugin reports a tpu device of vendor nvidia",
                ),
            ),
            (
                "a model no plugin reports is unknown",
                &none,
                vec![request("nvidia/gpu/b200", None)],
                Err("unknown device nvidia/gpu/b200: no device plugin reports it"),
            ),
            ("no requests assign nothing", &none, vec![], Ok(vec![])),
        ];
        let inventory = inventory(node);
        for (case, assignments, requests, expected) in cases {
            let result = assign(
                &inventory,
                assignments,
                &name("web"),
                &name("train"),
                &requests,
            )
            .map_err(|why| why.to_string());
            assert_eq!(result, expected.map_err(str::to_owned), "{case}");
        }
    }

    #[test]
    fn the_devices_of_a_failed_plugin_are_known_but_not_free() {
        let mut inventory = inventory(vec![group("nvidia/gpu/a100", &healthy(&["gpu0"]))]);
        inventory.plugin_failed(&name("static"), "crashed");
        assert_eq!(
            assign(
                &inventory,
                &Assignments::new(),
                &name("web"),
                &name("train"),
                &[request("nvidia/gpu", None)]
            ),
            Err(DeviceUnavailable::NotNow {
                request: "nvidia/gpu".parse().unwrap(),
                requested: 1,
                healthy_and_free: 0
            })
        );
    }

    #[test]
    fn an_instance_that_turns_healthy_again_is_assigned_again() {
        let mut inventory = inventory(vec![group(
            "nvidia/gpu/a100",
            &[("gpu0", unhealthy("hot"))],
        )]);
        let requests = [request("nvidia/gpu", None)];
        let none = Assignments::new();
        assert!(assign(&inventory, &none, &name("web"), &name("train"), &requests).is_err());
        inventory
            .report(
                &name("static"),
                &fingerprint(vec![group("nvidia/gpu/a100", &healthy(&["gpu0"]))]),
            )
            .unwrap();
        assert_eq!(
            assign(&inventory, &none, &name("web"), &name("train"), &requests),
            Ok(vec![dev("nvidia/gpu/a100", "gpu0")])
        );
    }

    #[test]
    fn placement_waits_for_a_free_device_and_proceeds_once_its_holder_releases_it() {
        let inventory = inventory(vec![group("nvidia/gpu/a100", &healthy(&["gpu0"]))]);
        let mut assignments = held(&[("first", "train", &[("nvidia/gpu/a100", "gpu0")])]);
        let requests = [request("nvidia/gpu", None)];
        assert_eq!(
            assign(
                &inventory,
                &assignments,
                &name("second"),
                &name("train"),
                &requests
            )
            .map_err(|why| why.to_string()),
            Err("1 × nvidia/gpu requested, 0 healthy and free".to_owned())
        );
        assignments.remove(&name("first"));
        assert_eq!(
            assign(
                &inventory,
                &assignments,
                &name("second"),
                &name("train"),
                &requests
            ),
            Ok(vec![dev("nvidia/gpu/a100", "gpu0")])
        );
    }

    #[test]
    fn an_alloc_gets_devices_for_all_its_tasks_or_none() {
        let inventory = inventory(vec![group("nvidia/gpu/a100", &healthy(&["gpu0", "gpu1"]))]);
        let one = [request("nvidia/gpu", None)];
        let two = [request("nvidia/gpu", Some(2))];
        let none: [DeviceRequest; 0] = [];
        struct Case<'a> {
            what: &'a str,
            held: Assignments,
            tasks: Vec<(&'a str, &'a [DeviceRequest])>,
            expected: Result<Vec<(&'a str, Vec<AssignedDevice>)>, &'a str>,
        }
        let cases = [
            Case {
                what: "two tasks never share an instance",
                held: Assignments::new(),
                tasks: vec![("a", &one), ("web", &none), ("b", &one)],
                expected: Ok(vec![
                    ("a", vec![dev("nvidia/gpu/a100", "gpu0")]),
                    ("b", vec![dev("nvidia/gpu/a100", "gpu1")]),
                ]),
            },
            Case {
                what: "the second task's shortfall fails the alloc as a whole",
                held: Assignments::new(),
                tasks: vec![("a", &one), ("b", &two)],
                expected: Err("2 × nvidia/gpu requested, 1 healthy and free"),
            },
            Case {
                what: "instances other allocs hold are not free",
                held: held(&[("other", "x", &[("nvidia/gpu/a100", "gpu0")])]),
                tasks: vec![("a", &two)],
                expected: Err("2 × nvidia/gpu requested, 1 healthy and free"),
            },
            Case {
                what: "what the alloc holds already is chosen first",
                held: held(&[("web", "a", &[("nvidia/gpu/a100", "gpu1")])]),
                tasks: vec![("a", &one)],
                expected: Ok(vec![("a", vec![dev("nvidia/gpu/a100", "gpu1")])]),
            },
            Case {
                what: "an edited alloc asking for more keeps what it held and adds to it",
                held: held(&[("web", "old", &[("nvidia/gpu/a100", "gpu1")])]),
                tasks: vec![("a", &two)],
                expected: Ok(vec![(
                    "a",
                    vec![
                        dev("nvidia/gpu/a100", "gpu0"),
                        dev("nvidia/gpu/a100", "gpu1"),
                    ],
                )]),
            },
            Case {
                what: "an edited alloc asking for fewer keeps one of the instances it held",
                held: held(&[(
                    "web",
                    "a",
                    &[("nvidia/gpu/a100", "gpu1"), ("nvidia/gpu/a100", "gpu0")],
                )]),
                tasks: vec![("a", &one)],
                expected: Ok(vec![("a", vec![dev("nvidia/gpu/a100", "gpu0")])]),
            },
            Case {
                what: "an alloc that requests nothing gets nothing",
                held: Assignments::new(),
                tasks: vec![("web", &none)],
                expected: Ok(vec![]),
            },
        ];
        for case in cases {
            let tasks: Vec<(Name, &[DeviceRequest])> = case
                .tasks
                .iter()
                .map(|(task, requests)| (name(task), *requests))
                .collect();
            let got = assign_alloc(&inventory, &case.held, &name("web"), &tasks)
                .map_err(|why| why.to_string());
            let expected = case
                .expected
                .map(|rows| {
                    rows.into_iter()
                        .map(|(task, devices)| (name(task), devices))
                        .collect::<AllocDevices>()
                })
                .map_err(str::to_owned);
            assert_eq!(got, expected, "{}", case.what);
        }
    }

    #[test]
    fn a_task_keeps_what_it_holds_even_when_unhealthy() {
        let inventory = inventory(vec![group(
            "nvidia/gpu/a100",
            &[
                ("gpu0", unhealthy("xid 79")),
                ("gpu1", DeviceHealth::Healthy),
            ],
        )]);
        let assignments = held(&[("web", "train", &[("nvidia/gpu/a100", "gpu0")])]);
        assert_eq!(
            assign(
                &inventory,
                &assignments,
                &name("web"),
                &name("train"),
                &[request("nvidia/gpu", None)]
            ),
            Ok(vec![dev("nvidia/gpu/a100", "gpu0")])
        );
    }

    #[test]
    fn a_restored_assignment_is_honoured_and_reserved_before_its_plugin_reports() {
        let mut inventory = DeviceInventory::default();
        let assignments = held(&[("web", "train", &[("nvidia/gpu/a100", "gpu0")])]);
        let requests = [request("nvidia/gpu", None)];
        // Before any plugin reports: the holder keeps it, a newcomer finds nothing.
        assert_eq!(
            assign(
                &inventory,
                &assignments,
                &name("web"),
                &name("train"),
                &requests
            ),
            Ok(vec![dev("nvidia/gpu/a100", "gpu0")])
        );
        assert!(matches!(
            assign(
                &inventory,
                &assignments,
                &name("other"),
                &name("train"),
                &requests
            ),
            Err(DeviceUnavailable::Unknown { .. })
        ));
        // Once the plugin reports it, it is still not free.
        inventory
            .report(
                &name("static"),
                &fingerprint(vec![group("nvidia/gpu/a100", &healthy(&["gpu0"]))]),
            )
            .unwrap();
        assert!(matches!(
            assign(
                &inventory,
                &assignments,
                &name("other"),
                &name("train"),
                &requests
            ),
            Err(DeviceUnavailable::NotNow {
                healthy_and_free: 0,
                ..
            })
        ));
    }

    // Flags.

    #[test]
    fn flags_name_every_holder_of_an_unhealthy_or_unreported_instance() {
        let mut inventory = inventory(vec![group(
            "nvidia/gpu/a100",
            &[
                ("gpu0", unhealthy("xid 79")),
                ("gpu1", DeviceHealth::Healthy),
            ],
        )]);
        inventory
            .report(
                &name("fpgas"),
                &fingerprint(vec![group("acme/fpga/f1", &healthy(&["f0"]))]),
            )
            .unwrap();
        inventory.plugin_failed(&name("fpgas"), "crashed");
        let assignments = held(&[
            (
                "web",
                "train",
                &[("nvidia/gpu/a100", "gpu0"), ("nvidia/gpu/a100", "gpu1")],
            ),
            ("web", "serve", &[("acme/fpga/f1", "f0")]),
            ("batch", "job", &[("nvidia/gpu/h100", "h0")]),
        ]);
        let shown: Vec<String> = flags(&assignments, &inventory)
            .into_iter()
            .map(|flag| {
                format!(
                    "{}/{} {}: {}",
                    flag.alloc, flag.task, flag.device, flag.reason
                )
            })
            .collect();
        assert_eq!(
            shown,
            [
                "batch/job nvidia/gpu/h100[h0]: not reported by any device plugin",
                "web/serve acme/fpga/f1[f0]: unhealthy: device plugin fpgas failed: crashed",
                "web/train nvidia/gpu/a100[gpu0]: unhealthy: xid 79",
            ]
        );
    }

    #[test]
    fn healthy_holders_are_not_flagged() {
        let inventory = inventory(vec![group("nvidia/gpu/a100", &healthy(&["gpu0"]))]);
        let assignments = held(&[("web", "train", &[("nvidia/gpu/a100", "gpu0")])]);
        assert_eq!(flags(&assignments, &inventory), []);
    }

    // Node status.

    #[test]
    fn node_status_shows_every_instance_with_its_health_and_holder() {
        let inventory = inventory(vec![group(
            "nvidia/gpu/a100",
            &[
                ("gpu0", unhealthy("xid 79")),
                ("gpu1", DeviceHealth::Healthy),
            ],
        )]);
        let assignments = held(&[
            ("web", "train", &[("nvidia/gpu/a100", "gpu0")]),
            ("batch", "job", &[("acme/fpga/f1", "f0")]),
        ]);
        let shown: Vec<String> = node_devices(&inventory, &assignments)
            .iter()
            .flat_map(|group| {
                group.instances.iter().map(move |instance| {
                    format!(
                        "{}/{}/{} ({}) {} healthy={} reason={:?} held_by={:?}",
                        group.vendor,
                        group.device_type,
                        group.name,
                        group.plugin.as_deref().unwrap_or("-"),
                        instance.id,
                        instance.healthy,
                        instance.reason,
                        instance
                            .held_by
                            .as_ref()
                            .map(|h| format!("{}/{}", h.alloc, h.task)),
                    )
                })
            })
            .collect();
        assert_eq!(
            shown,
            [
                "acme/fpga/f1 (-) f0 healthy=false reason=Some(\"not reported by any device plugin\") held_by=Some(\"batch/job\")",
                "nvidia/gpu/a100 (static) gpu0 healthy=false reason=Some(\"xid 79\") held_by=Some(\"web/train\")",
                "nvidia/gpu/a100 (static) gpu1 healthy=true reason=None held_by=None",
            ]
        );
    }

    // Stats.

    #[test]
    fn instances_of_one_group_used_by_two_tasks_are_one_group_entry() {
        let assignments = held(&[
            ("web", "a", &[("nvidia/gpu/a100", "gpu0")]),
            (
                "web",
                "b",
                &[("nvidia/gpu/a100", "gpu1"), ("acme/fpga/f1", "f0")],
            ),
        ]);
        let stats: HashMap<AssignedDevice, u32> = HashMap::from([
            (dev("nvidia/gpu/a100", "gpu0"), 10),
            (dev("nvidia/gpu/a100", "gpu1"), 11),
        ]);
        let result = alloc_device_stats(&assignments[&name("web")], |d| stats.get(d).copied());
        type GroupRow = (String, Vec<(String, Option<u32>)>);
        let groups: Vec<GroupRow> = result
            .groups
            .iter()
            .map(|(group, instances)| {
                (
                    group.to_string(),
                    instances
                        .iter()
                        .map(|(id, s)| (id.to_string(), *s))
                        .collect(),
                )
            })
            .collect();
        assert_eq!(
            groups,
            [
                ("acme/fpga/f1".to_owned(), vec![("f0".to_owned(), None)]),
                (
                    "nvidia/gpu/a100".to_owned(),
                    vec![("gpu0".to_owned(), Some(10)), ("gpu1".to_owned(), Some(11))]
                ),
            ]
        );
        assert_eq!(
            result.tasks[&name("b")],
            [
                InstanceStats {
                    device: dev("nvidia/gpu/a100", "gpu1"),
                    stats: Some(11)
                },
                InstanceStats {
                    device: dev("acme/fpga/f1", "f0"),
                    stats: None
                },
            ]
        );
    }

    #[test]
    fn stats_are_looked_up_once_per_held_instance_whatever_the_host_has() {
        let host: HashMap<AssignedDevice, u32> = (0..64)
            .map(|i| (dev("nvidia/gpu/a100", &format!("gpu{i}")), i))
            .collect();
        let assignments = held(&[
            ("web", "a", &[("nvidia/gpu/a100", "gpu7")]),
            ("web", "b", &[("nvidia/gpu/a100", "gpu9")]),
        ]);
        let lookups = Cell::new(0);
        let result = alloc_device_stats(&assignments[&name("web")], |d| {
            lookups.set(lookups.get() + 1);
            host.get(d).copied()
        });
        assert_eq!(lookups.get(), 2);
        assert_eq!(result.tasks[&name("a")][0].stats, Some(7));
        assert_eq!(result.tasks[&name("b")][0].stats, Some(9));
    }

    // Env.

    #[test]
    fn the_ids_env_name_upper_cases_the_type_and_replaces_the_rest() {
        for (device_type, expected) in [
            ("gpu", "STEAD_DEVICE_GPU_IDS"),
            ("tpu-v4", "STEAD_DEVICE_TPU_V4_IDS"),
            ("nic.100g", "STEAD_DEVICE_NIC_100G_IDS"),
            ("a_b", "STEAD_DEVICE_A_B_IDS"),
        ] {
            assert_eq!(device_ids_env_name(device_type), expected, "{device_type}");
        }
    }

    #[test]
    fn a_task_gets_its_ids_per_type_merged_with_what_the_plugins_return() {
        let assigned = [
            dev("nvidia/gpu/a100", "gpu0"),
            dev("nvidia/gpu/h100", "h0"),
            dev("acme/fpga/f1", "f0"),
        ];
        let node = |path: &str| DeviceNode {
            host_path: path.into(),
            task_path: path.into(),
            permissions: "rwm".to_owned(),
        };
        let nvidia = Reservation {
            env: BTreeMap::from([
                ("NVIDIA_VISIBLE_DEVICES".to_owned(), "gpu0,h0".to_owned()),
                ("STEAD_DEVICE_GPU_IDS".to_owned(), "spoofed".to_owned()),
            ]),
            mounts: vec![],
            device_nodes: vec![node("/dev/nvidiactl"), node("/dev/nvidia0")],
        };
        let acme = Reservation {
            env: BTreeMap::from([("NVIDIA_VISIBLE_DEVICES".to_owned(), "later".to_owned())]),
            mounts: vec![DeviceMount {
                host_path: "/opt/acme".into(),
                task_path: "/opt/acme".into(),
                read_only: true,
            }],
            device_nodes: vec![node("/dev/nvidiactl")],
        };
        let merged = task_reservation(&assigned, &[nvidia, acme]);
        assert_eq!(
            merged.env,
            BTreeMap::from([
                ("NVIDIA_VISIBLE_DEVICES".to_owned(), "gpu0,h0".to_owned()),
                ("STEAD_DEVICE_FPGA_IDS".to_owned(), "f0".to_owned()),
                ("STEAD_DEVICE_GPU_IDS".to_owned(), "gpu0,h0".to_owned()),
            ])
        );
        assert_eq!(
            merged.device_nodes,
            [node("/dev/nvidiactl"), node("/dev/nvidia0")]
        );
        assert_eq!(merged.mounts.len(), 1);
    }

    #[test]
    fn a_task_without_devices_gets_no_device_env() {
        assert_eq!(task_reservation(&[], &[]), Reservation::default());
    }
}
