//! The `static` device plugin: devices declared in the agent config, with health (and
//! stats) driven from outside through one file per instance.
//!
//! Its fingerprint is the configured groups, each instance's health read from
//! `<healthDir>/<id>` every `healthInterval`; a new fingerprint is sent only when it
//! differs from the last. If a health directory cannot be read the plugin stops, which
//! the manager treats as a dead plugin: its devices turn unhealthy and it is started
//! again with backoff, succeeding once the directory is back.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use stead_reconcilers::device::Reservation;
use stead_schemas::config::StaticDeviceGroup;
use stead_schemas::device::{
    AssignedDevice, DeviceFingerprint, DeviceGroupFingerprint, DeviceHealth,
    DeviceInstanceFingerprint,
};
use stead_schemas::spec::Name;
use tokio::sync::mpsc;

use super::{DevicePlugin, DeviceStats, PluginError};
use crate::driver::BoxFuture;

/// The static plugin's config cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StaticPluginError {
    /// An instance id cannot name a file in the health directory.
    #[error(
        "devices.static[{group}].instances[{instance}].id {id:?} cannot name a health file: it may not contain '/', be '.' or '..', or end in '.stats'"
    )]
    InstanceIdNotAFileName {
        /// The group's position.
        group: usize,
        /// The instance's position.
        instance: usize,
        /// The id.
        id: String,
    },
    /// The declared devices do not form a valid fingerprint (a missing or invalid vendor,
    /// type or name, an invalid or repeated instance id, a group declared twice).
    #[error("devices.static: {0}")]
    Invalid(#[source] stead_reconcilers::device::FingerprintError),
}

/// The `static` plugin.
#[derive(Debug, Clone)]
pub struct StaticPlugin {
    name: Name,
    groups: Vec<StaticDeviceGroup>,
    interval: Duration,
}

impl StaticPlugin {
    /// A plugin for `groups`, reading health files every `interval`. Instance ids that
    /// cannot be file names are refused here; everything else is checked as any
    /// fingerprint is, by the manager.
    pub fn new(
        groups: Vec<StaticDeviceGroup>,
        interval: Duration,
    ) -> Result<Self, StaticPluginError> {
        for (g, group) in groups.iter().enumerate() {
            for (i, instance) in group.instances.iter().enumerate() {
                let id = instance.id.as_str();
                if id.contains('/') || id == "." || id == ".." || id.ends_with(".stats") {
                    return Err(StaticPluginError::InstanceIdNotAFileName {
                        group: g,
                        instance: i,
                        id: id.to_owned(),
                    });
                }
            }
        }
        let plugin = StaticPlugin {
            name: "static".parse().expect("a valid name"),
            groups,
            interval,
        };
        // What it will report, checked now, so a bad config stops the agent at start
        // instead of failing the plugin at every restart.
        let declared = DeviceFingerprint {
            groups: plugin
                .groups
                .iter()
                .map(|g| declared_group(g, |_| DeviceHealth::Healthy))
                .collect(),
            note: None,
        };
        stead_reconcilers::device::validate_fingerprint(&plugin.name, &declared)
            .map_err(StaticPluginError::Invalid)?;
        Ok(plugin)
    }

    /// The health directory of the group `device` belongs to.
    fn health_dir(&self, device: &AssignedDevice) -> Option<&Path> {
        self.groups
            .iter()
            .find(|g| {
                g.vendor == device.group.vendor()
                    && g.device_type == device.group.device_type()
                    && g.name == device.group.name()
            })
            .and_then(|g| g.health_dir.as_deref())
    }
}

/// A configured group as a fingerprint group, each instance's health from `health`.
fn declared_group(
    group: &StaticDeviceGroup,
    health: impl Fn(&str) -> DeviceHealth,
) -> DeviceGroupFingerprint {
    DeviceGroupFingerprint {
        vendor: group.vendor.clone(),
        device_type: group.device_type.clone(),
        name: group.name.clone(),
        attributes: BTreeMap::new(),
        instances: group
            .instances
            .iter()
            .map(|instance| DeviceInstanceFingerprint {
                id: instance.id.clone(),
                health: health(&instance.id),
                attributes: BTreeMap::new(),
            })
            .collect(),
    }
}

/// The fingerprint now: every group with each instance's health from its file.
fn read_fingerprint(groups: &[StaticDeviceGroup]) -> Result<DeviceFingerprint, String> {
    let mut fingerprint = DeviceFingerprint::default();
    for group in groups {
        if let Some(dir) = &group.health_dir {
            std::fs::read_dir(dir).map_err(|error| {
                format!("cannot read health directory {}: {error}", dir.display())
            })?;
        }
        fingerprint.groups.push(declared_group(group, |id| {
            group
                .health_dir
                .as_ref()
                .map_or(DeviceHealth::Healthy, |dir| health_from_file(&dir.join(id)))
        }));
    }
    Ok(fingerprint)
}

/// `unhealthy[: reason]` in the file marks the instance unhealthy; anything else, or no
/// file, is healthy.
fn health_from_file(path: &Path) -> DeviceHealth {
    let Ok(text) = std::fs::read_to_string(path) else {
        return DeviceHealth::Healthy;
    };
    let text = text.trim();
    match text.strip_prefix("unhealthy") {
        Some(rest) => {
            let reason = rest.trim_start_matches([':', ' ']).trim();
            DeviceHealth::Unhealthy {
                reason: (!reason.is_empty()).then(|| reason.to_owned()),
            }
        }
        None => DeviceHealth::Healthy,
    }
}

/// `name value` lines; lines that do not parse are skipped.
fn stats_from_file(path: &Path) -> Option<DeviceStats> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(
        text.lines()
            .filter_map(|line| {
                let (name, value) = line.trim().split_once(char::is_whitespace)?;
                Some((name.to_owned(), value.trim().parse().ok()?))
            })
            .collect(),
    )
}

impl DevicePlugin for StaticPlugin {
    fn name(&self) -> &Name {
        &self.name
    }

    fn start(&self) -> BoxFuture<'_, Result<mpsc::Receiver<DeviceFingerprint>, PluginError>> {
        Box::pin(async move {
            let groups = self.groups.clone();
            let error = |message| PluginError {
                plugin: self.name.clone(),
                message,
            };
            let read = {
                let groups = groups.clone();
                move || read_fingerprint(&groups)
            };
            let first = PluginError::blocking(&self.name, read)
                .await?
                .map_err(error)?;
            let (tx, rx) = mpsc::channel(1);
            let interval = self.interval;
            tokio::spawn(async move {
                let mut last = first;
                if tx.send(last.clone()).await.is_err() {
                    return;
                }
                loop {
                    tokio::select! {
                        biased;
                        () = tx.closed() => return,
                        () = tokio::time::sleep(interval) => {}
                    }
                    let groups = groups.clone();
                    let now = match tokio::task::spawn_blocking(move || read_fingerprint(&groups))
                        .await
                    {
                        Ok(Ok(now)) => now,
                        Ok(Err(why)) => {
                            tracing::warn!(plugin = "static", %why, "device plugin stops");
                            return;
                        }
                        Err(_) => return,
                    };
                    if now != last {
                        if tx.send(now.clone()).await.is_err() {
                            return;
                        }
                        last = now;
                    }
                }
            });
            Ok(rx)
        })
    }

    fn stats(
        &self,
        devices: &[AssignedDevice],
    ) -> BoxFuture<'_, Result<HashMap<AssignedDevice, DeviceStats>, PluginError>> {
        let files: Vec<(AssignedDevice, PathBuf)> = devices
            .iter()
            .filter_map(|device| {
                let dir = self.health_dir(device)?;
                Some((
                    device.clone(),
                    dir.join(format!("{}.stats", device.instance)),
                ))
            })
            .collect();
        Box::pin(async move {
            PluginError::blocking(&self.name, move || {
                files
                    .into_iter()
                    .filter_map(|(device, file)| Some((device, stats_from_file(&file)?)))
                    .collect()
            })
            .await
        })
    }

    fn reserve(
        &self,
        _devices: &[AssignedDevice],
    ) -> BoxFuture<'_, Result<Reservation, PluginError>> {
        // Declared devices need nothing beyond the ids the agent sets.
        Box::pin(async { Ok(Reservation::default()) })
    }
}

#[cfg(test)]
mod tests {
    use stead_schemas::config::StaticDeviceInstance;

    use super::*;

    fn group(dir: Option<&Path>, ids: &[&str]) -> StaticDeviceGroup {
        StaticDeviceGroup {
            vendor: "acme".to_owned(),
            device_type: "gpu".to_owned(),
            name: "a1".to_owned(),
            health_dir: dir.map(Path::to_owned),
            instances: ids
                .iter()
                .map(|id| StaticDeviceInstance {
                    id: (*id).to_owned(),
                })
                .collect(),
        }
    }

    #[test]
    fn health_files_mark_instances_unhealthy_with_their_reason() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("gpu1"), "unhealthy: fan failed\n").expect("written");
        std::fs::write(dir.path().join("gpu2"), "ok\n").expect("written");
        std::fs::write(dir.path().join("gpu3"), "unhealthy").expect("written");
        let fingerprint =
            read_fingerprint(&[group(Some(dir.path()), &["gpu0", "gpu1", "gpu2", "gpu3"])])
                .expect("readable");
        let health: Vec<DeviceHealth> = fingerprint.groups[0]
            .instances
            .iter()
            .map(|i| i.health.clone())
            .collect();
        assert_eq!(
            health,
            [
                DeviceHealth::Healthy,
                DeviceHealth::Unhealthy {
                    reason: Some("fan failed".to_owned())
                },
                DeviceHealth::Healthy,
                DeviceHealth::Unhealthy { reason: None },
            ]
        );
    }

    #[test]
    fn a_missing_health_directory_is_an_error_naming_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        let gone = dir.path().join("gone");
        let error = read_fingerprint(&[group(Some(&gone), &["gpu0"])]).unwrap_err();
        assert!(error.contains(&gone.display().to_string()), "{error}");
    }

    #[test]
    fn a_config_that_is_no_valid_fingerprint_is_refused_naming_the_field() {
        let error = StaticPlugin::new(vec![group(None, &["gpu0", "gpu0"])], Duration::from_secs(1))
            .unwrap_err();
        assert!(error.to_string().contains("instances[1].id"), "{error}");
        let mut unnamed = group(None, &["gpu0"]);
        unnamed.vendor = String::new();
        let error = StaticPlugin::new(vec![unnamed], Duration::from_secs(1)).unwrap_err();
        assert!(error.to_string().contains("vendor is required"), "{error}");
    }

    #[test]
    fn an_instance_id_that_is_not_a_file_name_is_refused() {
        for bad in ["../x", ".", "..", "a/b", "gpu0.stats"] {
            let error = StaticPlugin::new(vec![group(None, &["ok", bad])], Duration::from_secs(1))
                .unwrap_err();
            assert!(error.to_string().contains("instances[1].id"), "{error}");
        }
    }

    #[test]
    fn stats_files_give_name_value_pairs_and_skip_the_rest() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("gpu0.stats");
        std::fs::write(&file, "utilization 42.5\nmemoryUsedBytes 1024\ngarbage\n")
            .expect("written");
        let stats = stats_from_file(&file).expect("stats");
        assert_eq!(
            stats,
            DeviceStats::from([
                ("memoryUsedBytes".to_owned(), 1024.0),
                ("utilization".to_owned(), 42.5)
            ])
        );
    }
}
