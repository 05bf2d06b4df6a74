//! The worker's devices: an alloc is placed on its devices as a whole before anything of
//! it starts, and gives them up (or hands them to its next revision) once terminal.

use super::*;

/// The devices a task holds with their health as the node sees it now (`health`, in the
/// same order): an unhealthy or unreported one is flagged with why, and the task keeps it.
pub(super) fn task_devices(
    held: &[AssignedDevice],
    health: &[Option<DeviceHealth>],
) -> Vec<TaskDeviceStatus> {
    held.iter()
        .zip(health.iter().cloned())
        .map(|(device, health)| {
            let (healthy, reason) = match health {
                Some(DeviceHealth::Healthy) => (true, None),
                Some(DeviceHealth::Unhealthy { reason }) => (
                    false,
                    Some(reason.unwrap_or_else(|| "unhealthy".to_owned())),
                ),
                None => (false, Some(FlagReason::NotReported.to_string())),
            };
            TaskDeviceStatus {
                group: device.group.to_string(),
                id: device.instance.to_string(),
                healthy,
                reason,
            }
        })
        .collect()
}

/// The spec error for a request no plugin reports: the field, then why.
pub(super) fn unknown_device_error(
    requests: &[(Name, &[DeviceRequest])],
    unknown: &DeviceName,
    why: &DeviceUnavailable,
) -> String {
    for (index, (_, task_requests)) in requests.iter().enumerate() {
        if let Some(position) = task_requests.iter().position(|r| &r.name == unknown) {
            return format!("spec.tasks[{index}].resources.devices[{position}].name: {why}");
        }
    }
    why.to_string()
}

impl Worker {
    /// Gets the current revision its devices before anything of it starts: all tasks'
    /// or none. While they cannot be had, every start is held back with why (and an
    /// unknown device is also shown as the alloc's spec error, naming the field).
    pub(super) fn place_devices(&mut self) {
        let Some(current) = self.current.as_mut() else {
            return;
        };
        current.desired.devices_unavailable = None;
        if !current.devices.is_empty() {
            return;
        }
        // `may_start`, not "runs and is not terminal": a stopped alloc asked to run again is
        // terminal until the reconcile that starts it, which must find its devices held.
        let wants = current.needs_devices && current.state.may_start(&current.desired);
        let manager = &self.shared.config.devices;
        if !wants {
            current.device_error = None;
            if self.devices_handed_on {
                // A previous revision's devices that this one will not use.
                manager.release(&self.name);
                self.devices_handed_on = false;
            }
            return;
        }
        let requests = current.device_requests();
        // Whatever the outcome, the manager now holds for this alloc exactly `devices`.
        self.devices_handed_on = false;
        match manager.acquire(&self.name, &requests) {
            Ok(devices) => {
                for (task, held) in &devices {
                    let held: Vec<String> = held.iter().map(ToString::to_string).collect();
                    tracing::info!(task = %task, devices = %held.join(","), "devices assigned");
                }
                current.devices = devices;
                current.device_error = None;
            }
            Err(why) => {
                current.device_error = match &why {
                    DeviceUnavailable::Unknown { request } if manager.all_reported() => {
                        Some(unknown_device_error(&requests, request, &why))
                    }
                    _ => None,
                };
                current.desired.devices_unavailable = Some(why.to_string());
            }
        }
    }

    /// Frees the current revision's devices once it is terminal and nothing of it is in
    /// flight; a revision that runs again asks anew. A revision being replaced hands its
    /// devices on instead: the manager keeps them for the next revision's first ask.
    pub(super) fn release_devices(&mut self) {
        let Some(current) = self.current.as_mut() else {
            return;
        };
        if current.devices.is_empty() || !current.state.is_terminal() || !self.ops.is_empty() {
            return;
        }
        current.devices.clear();
        let replaced =
            matches!(&self.target, Target::Spec(spec) if spec.revision != current.spec.revision);
        if replaced {
            // The next revision starts now and asks first, with these preferred: no other
            // alloc can take them in between. It frees them if it does not ask.
            self.devices_handed_on = true;
            return;
        }
        self.shared.config.devices.release(&self.name);
        tracing::info!("devices released");
    }
}

impl Current {
    /// Each task's device requests, in spec order (tasks that request none included).
    pub(super) fn device_requests(&self) -> Vec<(Name, &[DeviceRequest])> {
        self.spec
            .spec
            .spec
            .tasks
            .iter()
            .map(|task| {
                let requests = task
                    .resources
                    .as_ref()
                    .and_then(|r| r.devices.as_deref())
                    .unwrap_or_default();
                (task.name.clone(), requests)
            })
            .collect()
    }
}
