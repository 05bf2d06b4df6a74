//! Device formats: what a device plugin reports (fingerprints), the ids that name a
//! device group and an instance, and the assignment record the agent persists per alloc.
//!
//! A fingerprint arrives as plain strings ([`DeviceFingerprint`]) because it comes from a
//! plugin, and a plugin can be wrong; `stead_reconcilers::device` checks it and builds
//! the validated ids ([`DeviceGroupId`], [`DeviceInstanceId`]) that everything after it
//! uses. Ids are written as text: a group as `vendor/type/name`, an instance as its id.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::spec::DeviceName;

/// The version of [`DeviceAssignmentRecord`] this agent writes, and the newest it reads.
pub const DEVICE_ASSIGNMENT_RECORD_VERSION: u32 = 1;

/// Everything one plugin reports about its devices at one time. A new fingerprint
/// replaces the plugin's previous one as a whole.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceFingerprint {
    /// The plugin's device groups.
    pub groups: Vec<DeviceGroupFingerprint>,
    /// What an operator should know of this report: why it holds no devices (no driver
    /// on the host), or what the plugin could not read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A group of identical devices as a plugin reports it (unchecked).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceGroupFingerprint {
    /// The vendor, such as `nvidia`.
    pub vendor: String,
    /// The type, such as `gpu`.
    #[serde(rename = "type")]
    pub device_type: String,
    /// The model name, such as `a100`.
    pub name: String,
    /// Facts shared by every instance (memory, driver version).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, String>,
    /// The instances.
    pub instances: Vec<DeviceInstanceFingerprint>,
}

/// One device instance as a plugin reports it (unchecked).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceInstanceFingerprint {
    /// Its id, unique in its group.
    pub id: String,
    /// Whether it can be used.
    pub health: DeviceHealth,
    /// Facts about this instance alone (bus id, serial).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, String>,
}

/// Whether a device instance can be used.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "status")]
pub enum DeviceHealth {
    /// It can be assigned.
    Healthy,
    /// It is never assigned again until healthy; holders keep it and are flagged.
    Unhealthy {
        /// Why, when the plugin (or the agent) knows.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
}

impl DeviceHealth {
    /// Whether the instance can be assigned.
    pub fn is_healthy(&self) -> bool {
        matches!(self, DeviceHealth::Healthy)
    }
}

/// Whether `part` is a valid vendor, type or model name: the rule of each part of a
/// spec's [`DeviceName`] (a letter or digit, then letters, digits, `-`, `_` or `.`).
pub fn is_device_name_part(part: &str) -> bool {
    !part.is_empty()
        && part.as_bytes()[0].is_ascii_alphanumeric()
        && part
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// A device group's identity on a node: `vendor/type/name`, each part checked by
/// [`is_device_name_part`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceGroupId(
    /// Invariant: three valid name parts joined by `/` (one string, so ids stay small).
    String,
);

/// Which part of a [`DeviceGroupId`] is wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceGroupField {
    /// The vendor.
    Vendor,
    /// The type.
    Type,
    /// The model name.
    Name,
}

impl fmt::Display for DeviceGroupField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceGroupField::Vendor => "vendor",
            DeviceGroupField::Type => "type",
            DeviceGroupField::Name => "name",
        })
    }
}

impl DeviceGroupId {
    /// The id of the group `vendor/device_type/name`, or the first part that is not a
    /// valid name part.
    pub fn new(vendor: &str, device_type: &str, name: &str) -> Result<Self, DeviceGroupField> {
        for (part, field) in [
            (vendor, DeviceGroupField::Vendor),
            (device_type, DeviceGroupField::Type),
            (name, DeviceGroupField::Name),
        ] {
            if !is_device_name_part(part) {
                return Err(field);
            }
        }
        Ok(DeviceGroupId(format!("{vendor}/{device_type}/{name}")))
    }

    fn part(&self, index: usize) -> &str {
        self.0.split('/').nth(index).expect("checked: three parts")
    }

    /// The vendor.
    pub fn vendor(&self) -> &str {
        self.part(0)
    }

    /// The type.
    pub fn device_type(&self) -> &str {
        self.part(1)
    }

    /// The model name.
    pub fn name(&self) -> &str {
        self.part(2)
    }

    /// The text, `vendor/type/name`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether a spec's request names this group: `vendor/type` matches every group of
    /// that vendor and type, `vendor/type/name` only that group.
    pub fn matches(&self, request: &DeviceName) -> bool {
        self.vendor() == request.vendor()
            && self.device_type() == request.device_type()
            && request.model().is_none_or(|model| model == self.name())
    }
}

impl fmt::Display for DeviceGroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for DeviceGroupId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let invalid = || format!("device group {s:?} is invalid; use vendor/type/name");
        let mut parts = s.split('/');
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(vendor), Some(device_type), Some(name), None) => {
                DeviceGroupId::new(vendor, device_type, name).map_err(|_| invalid())
            }
            _ => Err(invalid()),
        }
    }
}

impl Serialize for DeviceGroupId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceGroupId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = Cow::<'de, str>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// A device instance's id within its group: non-empty, printable, with no whitespace
/// and no `,` (ids are joined with commas in `STEAD_DEVICE_<TYPE>_IDS`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceInstanceId(String);

impl DeviceInstanceId {
    /// The text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for DeviceInstanceId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.is_empty() {
            return Err("instance id is empty".to_owned());
        }
        if s.chars()
            .any(|c| c == ',' || c.is_whitespace() || c.is_control())
        {
            return Err(format!(
                "instance id {s:?} is invalid; it may not contain ',', spaces or control characters"
            ));
        }
        Ok(DeviceInstanceId(s.to_owned()))
    }
}

impl fmt::Display for DeviceInstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for DeviceInstanceId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for DeviceInstanceId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = Cow::<'de, str>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// One device instance assigned to a task: its group and its id in the group. Instance
/// ids are unique only within a group, so this pair is what names an instance on a node
/// (and what stats are looked up by).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AssignedDevice {
    /// The group.
    pub group: DeviceGroupId,
    /// The instance.
    pub instance: DeviceInstanceId,
}

impl fmt::Display for AssignedDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[{}]", self.group, self.instance)
    }
}

/// The devices assigned to one alloc's tasks, stored under the alloc's name (the store's
/// `devices` column). Restored after an agent restart, before any plugin reports, so the
/// alloc keeps its devices and nobody else gets them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceAssignmentRecord {
    /// The record format's version; [`DEVICE_ASSIGNMENT_RECORD_VERSION`] when written by
    /// this agent.
    pub version: u32,
    /// Each task's instances, by task name; a task without devices is absent.
    pub tasks: BTreeMap<String, Vec<AssignedDevice>>,
}

/// The version of [`DevicePluginCheckpoint`] this agent writes, and the newest it reads.
pub const DEVICE_PLUGIN_CHECKPOINT_VERSION: u32 = 1;

/// The `k8s` device plugin's checkpoint: every `Allocate` answer still held, so a task
/// started again (after an agent restart too) gets the same answer without a second
/// `Allocate`, as the kubelet's checkpoint does. An answer is dropped when its devices
/// are freed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DevicePluginCheckpoint {
    /// The format's version.
    pub version: u32,
    /// The answers.
    pub allocations: Vec<CheckpointedAllocation>,
}

/// Reads a [`DevicePluginCheckpoint`]; one of a newer version is refused.
pub fn parse_device_plugin_checkpoint(text: &str) -> Result<DevicePluginCheckpoint, String> {
    let checkpoint: DevicePluginCheckpoint =
        serde_json::from_str(text).map_err(|e| e.to_string())?;
    if checkpoint.version > DEVICE_PLUGIN_CHECKPOINT_VERSION {
        return Err(format!(
            "version {} is newer than this agent's {DEVICE_PLUGIN_CHECKPOINT_VERSION}",
            checkpoint.version
        ));
    }
    Ok(checkpoint)
}

/// `allocations` as a [`DevicePluginCheckpoint`] of this agent's version, in JSON.
pub fn device_plugin_checkpoint_json(allocations: &[CheckpointedAllocation]) -> String {
    serde_json::to_string(&DevicePluginCheckpoint {
        version: DEVICE_PLUGIN_CHECKPOINT_VERSION,
        allocations: allocations.to_vec(),
    })
    .expect("a checkpoint serializes")
}

/// One `Allocate` answer and what it was for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointedAllocation {
    /// The plugin's resource.
    pub resource: String,
    /// The device ids asked for, sorted.
    pub devices: Vec<String>,
    /// The variables it set.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Its mounts.
    #[serde(default)]
    pub mounts: Vec<CheckpointedPath>,
    /// Its device nodes.
    #[serde(default)]
    pub device_nodes: Vec<CheckpointedPath>,
}

/// A mount or device node of an `Allocate` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointedPath {
    /// On the host.
    pub host_path: String,
    /// In the task.
    pub task_path: String,
    /// A mount's read-only flag.
    #[serde(default)]
    pub read_only: bool,
    /// A device node's cgroup permissions.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub permissions: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_ids_follow_the_device_name_part_rule() {
        assert!(DeviceGroupId::new("nvidia", "gpu", "a100").is_ok());
        assert_eq!(
            DeviceGroupId::new("", "gpu", "a100"),
            Err(DeviceGroupField::Vendor)
        );
        assert_eq!(
            DeviceGroupId::new("nvidia", "g/pu", "a100"),
            Err(DeviceGroupField::Type)
        );
        assert_eq!(
            DeviceGroupId::new("nvidia", "gpu", "-a"),
            Err(DeviceGroupField::Name)
        );
        for bad in ["nvidia/gpu", "a/b/c/d", "a//c", ""] {
            assert!(bad.parse::<DeviceGroupId>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_request_without_a_model_matches_every_group_of_its_vendor_and_type() {
        let a100 = DeviceGroupId::new("nvidia", "gpu", "a100").unwrap();
        let cases = [
            ("nvidia/gpu", true),
            ("nvidia/gpu/a100", true),
            ("nvidia/gpu/h100", false),
            ("nvidia/fpga", false),
            ("amd/gpu", false),
        ];
        for (request, expected) in cases {
            let request: DeviceName = request.parse().unwrap();
            assert_eq!(a100.matches(&request), expected, "{request}");
        }
    }

    #[test]
    fn instance_ids_refuse_what_would_break_the_env_list() {
        for ok in ["gpu0", "GPU-1b2c", "0000:3b:00.0"] {
            assert!(ok.parse::<DeviceInstanceId>().is_ok(), "{ok}");
        }
        for bad in ["", "a,b", "a b", "a\n"] {
            assert!(bad.parse::<DeviceInstanceId>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn assignment_records_round_trip_with_ids_as_text() {
        let record = DeviceAssignmentRecord {
            version: DEVICE_ASSIGNMENT_RECORD_VERSION,
            tasks: BTreeMap::from([(
                "train".to_owned(),
                vec![AssignedDevice {
                    group: "nvidia/gpu/a100".parse().unwrap(),
                    instance: "gpu0".parse().unwrap(),
                }],
            )]),
        };
        let json = serde_json::to_string(&record).unwrap();
        assert_eq!(
            json,
            r#"{"version":1,"tasks":{"train":[{"group":"nvidia/gpu/a100","instance":"gpu0"}]}}"#
        );
        assert_eq!(
            serde_json::from_str::<DeviceAssignmentRecord>(&json).unwrap(),
            record
        );
    }

    #[test]
    fn health_is_tagged_and_the_reason_optional() {
        let unhealthy = DeviceHealth::Unhealthy {
            reason: Some("xid 79".to_owned()),
        };
        assert_eq!(
            serde_json::to_string(&unhealthy).unwrap(),
            r#"{"status":"unhealthy","reason":"xid 79"}"#
        );
        assert_eq!(
            serde_json::from_str::<DeviceHealth>(r#"{"status":"healthy"}"#).unwrap(),
            DeviceHealth::Healthy
        );
    }
}
