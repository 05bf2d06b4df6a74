//! GPU health: which faults make a GPU unhealthy, and when it is healthy again.
//!
//! Rules:
//! - a critical Xid makes the GPU unhealthy at once, unless it is an application error
//!   (the GPU is fine; a program faulted: [`APPLICATION_XIDS`]) or configured as ignored;
//! - a double-bit ECC error, a GPU NVML reports lost, or a failed NVML query of the GPU
//!   makes it unhealthy at once;
//! - a GPU is healthy again once it went a whole clean period (default 5 minutes)
//!   without another fault: every fault starts the period over, so a GPU that keeps
//!   faulting stays unhealthy, and one that faulted once is not lost for good;
//! - the reason names the last fault, and stays the same text while it is unhealthy
//!   (so a report changes only when the health does).
//!
//! Time is an input ([`Timestamp`]): the plugin passes its clock's readings.

use std::collections::BTreeSet;
use std::time::Duration;

use stead_schemas::device::DeviceHealth;
use stead_schemas::time::Timestamp;

/// Xids that NVIDIA documents as a program's fault, not the GPU's: they never make a GPU
/// unhealthy (13 graphics engine exception, 31 memory page fault, 43 GPU stopped
/// processing, 45 preemptive cleanup, 68 video processor exception, 109 context switch
/// timeout).
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// How long a GPU must go without a fault before it is healthy again, by default.
pub const DEFAULT_CLEAN_PERIOD: Duration = Duration::from_secs(300);

/// Something NVML reported of a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuFault {
    /// A critical Xid event, with its code.
    Xid(u64),
    /// A double-bit (uncorrectable) ECC error.
    DoubleBitEcc,
    /// NVML cannot reach the GPU: it is lost, or a query of it failed (with NVML's
    /// message).
    Unreachable(String),
}

impl GpuFault {
    fn describe(&self) -> String {
        match self {
            GpuFault::Xid(code) => match xid_meaning(*code) {
                Some(meaning) => format!("critical Xid {code} ({meaning})"),
                None => format!("critical Xid {code}"),
            },
            GpuFault::DoubleBitEcc => "double-bit ECC error".to_owned(),
            GpuFault::Unreachable(message) => format!("NVML cannot reach the GPU: {message}"),
        }
    }
}

/// What the common critical Xids mean, from NVIDIA's Xid catalogue.
fn xid_meaning(code: u64) -> Option<&'static str> {
    Some(match code {
        48 => "double-bit ECC error",
        61 | 62 => "internal micro-controller error",
        63 => "ECC page retirement or row remapping recorded",
        64 => "ECC page retirement or row remapping failed",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        119 | 120 => "GSP error",
        _ => return None,
    })
}

/// Which faults count, and how long a GPU must stay clean.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuHealthPolicy {
    /// How long after its last fault a GPU is healthy again.
    pub clean_period: Duration,
    /// Xids that never make a GPU unhealthy: [`APPLICATION_XIDS`] and the configured
    /// ones.
    pub ignored_xids: BTreeSet<u64>,
}

impl GpuHealthPolicy {
    /// The policy for `clean_period` (default [`DEFAULT_CLEAN_PERIOD`]), ignoring the
    /// application Xids and `ignored`.
    pub fn new(clean_period: Option<Duration>, ignored: &[u64]) -> Self {
        GpuHealthPolicy {
            clean_period: clean_period.unwrap_or(DEFAULT_CLEAN_PERIOD),
            ignored_xids: APPLICATION_XIDS.iter().chain(ignored).copied().collect(),
        }
    }
}

impl Default for GpuHealthPolicy {
    fn default() -> Self {
        GpuHealthPolicy::new(None, &[])
    }
}

/// One GPU's health over time.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuHealth {
    /// The last fault that counted, and when it was seen.
    last_fault: Option<(Timestamp, GpuFault)>,
}

impl GpuHealth {
    /// Takes `fault`, seen at `now`; returns whether it counts (an ignored Xid does
    /// not).
    pub fn observe(&mut self, fault: GpuFault, now: Timestamp, policy: &GpuHealthPolicy) -> bool {
        if let GpuFault::Xid(code) = fault
            && policy.ignored_xids.contains(&code)
        {
            return false;
        }
        self.last_fault = Some((now, fault));
        true
    }

    /// The GPU's health at `now`.
    pub fn health(&self, now: Timestamp, policy: &GpuHealthPolicy) -> DeviceHealth {
        match &self.last_fault {
            Some((at, fault)) if now.saturating_duration_since(*at) < policy.clean_period => {
                DeviceHealth::Unhealthy {
                    reason: Some(format!(
                        "{}; healthy again after {} without a fault",
                        fault.describe(),
                        stead_schemas::duration::Duration::from(policy.clean_period),
                    )),
                }
            }
            _ => DeviceHealth::Healthy,
        }
    }

    /// When the health changes next without another fault: the end of the clean period
    /// while unhealthy; `None` while healthy.
    pub fn next_change(&self, now: Timestamp, policy: &GpuHealthPolicy) -> Option<Timestamp> {
        let (at, _) = self.last_fault.as_ref()?;
        let recovers = *at + policy.clean_period;
        (recovers > now).then_some(recovers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> Timestamp {
        Timestamp::from_since_epoch(Duration::from_secs(secs))
    }

    fn healthy(health: &DeviceHealth) -> bool {
        health.is_healthy()
    }

    #[test]
    fn health_follows_faults_and_the_clean_period() {
        let policy = GpuHealthPolicy::new(Some(Duration::from_secs(300)), &[]);
        struct Case {
            name: &'static str,
            faults: Vec<(u64, GpuFault)>,
            now: u64,
            healthy: bool,
        }
        let cases = [
            Case {
                name: "no fault: healthy",
                faults: vec![],
                now: 1_000,
                healthy: true,
            },
            Case {
                name: "a critical Xid: unhealthy at once",
                faults: vec![(100, GpuFault::Xid(79))],
                now: 100,
                healthy: false,
            },
            Case {
                name: "still unhealthy one second before the clean period ends",
                faults: vec![(100, GpuFault::Xid(79))],
                now: 399,
                healthy: false,
            },
            Case {
                name: "healthy again once the clean period passed",
                faults: vec![(100, GpuFault::Xid(79))],
                now: 400,
                healthy: true,
            },
            Case {
                name: "a second fault starts the period over",
                faults: vec![(100, GpuFault::Xid(79)), (350, GpuFault::Xid(48))],
                now: 500,
                healthy: false,
            },
            Case {
                name: "and it ends a clean period after the second",
                faults: vec![(100, GpuFault::Xid(79)), (350, GpuFault::Xid(48))],
                now: 650,
                healthy: true,
            },
            Case {
                name: "an application Xid is ignored",
                faults: vec![(100, GpuFault::Xid(13)), (101, GpuFault::Xid(31))],
                now: 102,
                healthy: true,
            },
            Case {
                name: "a double-bit ECC error counts",
                faults: vec![(100, GpuFault::DoubleBitEcc)],
                now: 200,
                healthy: false,
            },
            Case {
                name: "an unreachable GPU counts",
                faults: vec![(100, GpuFault::Unreachable("GPU is lost".into()))],
                now: 101,
                healthy: false,
            },
            Case {
                name: "an ignored Xid after a fault does not extend it",
                faults: vec![(100, GpuFault::Xid(79)), (390, GpuFault::Xid(43))],
                now: 400,
                healthy: true,
            },
        ];
        for case in cases {
            let mut gpu = GpuHealth::default();
            for (when, fault) in case.faults {
                gpu.observe(fault, at(when), &policy);
            }
            assert_eq!(
                healthy(&gpu.health(at(case.now), &policy)),
                case.healthy,
                "{}",
                case.name
            );
        }
    }

    #[test]
    fn configured_xids_are_ignored_beside_the_application_ones() {
        let policy = GpuHealthPolicy::new(None, &[94]);
        let mut gpu = GpuHealth::default();
        assert!(!gpu.observe(GpuFault::Xid(94), at(1), &policy));
        assert!(!gpu.observe(GpuFault::Xid(109), at(1), &policy));
        assert!(healthy(&gpu.health(at(2), &policy)));
        assert!(gpu.observe(GpuFault::Xid(95), at(3), &policy));
        assert!(!healthy(&gpu.health(at(4), &policy)));
        assert_eq!(policy.clean_period, DEFAULT_CLEAN_PERIOD);
    }

    #[test]
    fn the_reason_names_the_last_fault_and_does_not_change_while_unhealthy() {
        let policy = GpuHealthPolicy::new(Some(Duration::from_secs(60)), &[]);
        let mut gpu = GpuHealth::default();
        gpu.observe(GpuFault::Xid(79), at(10), &policy);
        let first = gpu.health(at(11), &policy);
        assert_eq!(
            first,
            DeviceHealth::Unhealthy {
                reason: Some(
                    "critical Xid 79 (GPU has fallen off the bus); healthy again after 1m0s \
                     without a fault"
                        .to_owned()
                )
            }
        );
        assert_eq!(gpu.health(at(50), &policy), first, "the same text");
        gpu.observe(GpuFault::DoubleBitEcc, at(55), &policy);
        assert_eq!(
            gpu.health(at(56), &policy),
            DeviceHealth::Unhealthy {
                reason: Some(
                    "double-bit ECC error; healthy again after 1m0s without a fault".into()
                )
            }
        );
    }

    #[test]
    fn the_next_change_is_the_end_of_the_clean_period_and_none_once_healthy() {
        let policy = GpuHealthPolicy::new(Some(Duration::from_secs(60)), &[]);
        let mut gpu = GpuHealth::default();
        assert_eq!(gpu.next_change(at(0), &policy), None);
        gpu.observe(GpuFault::Xid(48), at(10), &policy);
        assert_eq!(gpu.next_change(at(20), &policy), Some(at(70)));
        assert_eq!(gpu.next_change(at(70), &policy), None);
    }
}
