//! What allocs use now, for `GET /v1/allocs?usage=true` and the status page: each
//! running task's cgroup counters, summed per alloc, with CPU in percent of one core over
//! the time since the node's previous measurement of the same alloc.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use stead_schemas::api::AllocUsage;
use stead_schemas::status::AllocStatus;

use super::ApiState;
use crate::driver::TaskHandle;

/// The shortest time a CPU percent is measured over: polls closer together than this
/// (two pages open, a poll beside a refresh) get the last percent again instead of a
/// noisy one over a few milliseconds.
const MIN_WINDOW: Duration = Duration::from_secs(1);

/// The previous measurement of each alloc.
#[derive(Debug, Default)]
pub(super) struct UsageSampler {
    last: Mutex<HashMap<String, Sample>>,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    cpu_usec: u64,
    at: Instant,
    percent: Option<f64>,
}

impl UsageSampler {
    /// Measures `allocs` now, by name; an alloc none of whose running tasks has a cgroup
    /// is left out. With `all`, `allocs` are every alloc of the node, and the samples of
    /// the others are dropped.
    pub(super) async fn measure(
        state: &ApiState,
        allocs: &[Arc<AllocStatus>],
        all: bool,
    ) -> HashMap<String, AllocUsage> {
        let running: Vec<(String, Vec<TaskHandle>)> = allocs
            .iter()
            .filter_map(|status| {
                let handles = state.node().task_handles(&status.name)?;
                let running: Vec<TaskHandle> = handles
                    .iter()
                    .filter(|(task, _)| {
                        status
                            .tasks
                            .get(task.as_str())
                            .is_some_and(|t| t.state == "running")
                    })
                    .map(|(_, handle)| handle.clone())
                    .collect();
                (!running.is_empty()).then(|| (status.name.clone(), running))
            })
            .collect();
        let now = state.node().clock().instant();
        let state = state.clone();
        // Each task's counters are two or three small reads of its cgroup's files.
        let measured = tokio::task::spawn_blocking(move || {
            let counted: Vec<(String, u64, Option<u64>)> = running
                .into_iter()
                .filter_map(|(alloc, handles)| {
                    let mut cpu_usec = 0;
                    let mut memory: Option<u64> = None;
                    let mut measured = false;
                    for handle in &handles {
                        let Some(counters) = state
                            .inner
                            .drivers
                            .get(handle.driver)
                            .and_then(|driver| driver.cgroup_counters(handle))
                        else {
                            continue;
                        };
                        measured = true;
                        cpu_usec += counters.cpu_usec;
                        if let Some(bytes) = counters.memory_bytes {
                            memory = Some(memory.unwrap_or(0) + bytes);
                        }
                    }
                    measured.then_some((alloc, cpu_usec, memory))
                })
                .collect();
            state.inner.usage.record(counted, now, all)
        })
        .await;
        measured.unwrap_or_default()
    }

    /// Turns counters read at `now` into usage, against the previous samples.
    fn record(
        &self,
        counted: Vec<(String, u64, Option<u64>)>,
        now: Instant,
        all: bool,
    ) -> HashMap<String, AllocUsage> {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if all {
            let names: std::collections::HashSet<&str> =
                counted.iter().map(|(name, _, _)| name.as_str()).collect();
            last.retain(|name, _| names.contains(name.as_str()));
        }
        counted
            .into_iter()
            .map(|(name, cpu_usec, memory_bytes)| {
                let cpu_percent = match last.get(&name).copied() {
                    Some(before) if now.duration_since(before.at) < MIN_WINDOW => before.percent,
                    Some(before) => {
                        let window = now.duration_since(before.at).as_micros() as f64;
                        let used = cpu_usec.saturating_sub(before.cpu_usec) as f64;
                        let percent = Some(used / window * 100.0);
                        last.insert(
                            name.clone(),
                            Sample {
                                cpu_usec,
                                at: now,
                                percent,
                            },
                        );
                        percent
                    }
                    None => {
                        last.insert(
                            name.clone(),
                            Sample {
                                cpu_usec,
                                at: now,
                                percent: None,
                            },
                        );
                        None
                    }
                };
                (
                    name,
                    AllocUsage {
                        cpu_percent,
                        memory_bytes,
                    },
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_percent_is_measured_over_at_least_a_second_and_repeated_within_it() {
        let sampler = UsageSampler::default();
        let start = crate::clock::Clock::system().instant();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let one = |cpu_usec: u64| vec![("web".to_owned(), cpu_usec, Some(4096))];

        let first = sampler.record(one(1_000_000), at(0), true);
        assert_eq!(
            first["web"].cpu_percent, None,
            "nothing to compare with yet"
        );
        assert_eq!(first["web"].memory_bytes, Some(4096));

        // Half a core over two seconds.
        let second = sampler.record(one(2_000_000), at(2_000), true);
        assert_eq!(second["web"].cpu_percent, Some(50.0));

        // 100 ms later: too short a window, the last percent again.
        let third = sampler.record(one(2_100_000), at(2_100), true);
        assert_eq!(third["web"].cpu_percent, Some(50.0));

        // A full core over the next second, measured from the sample at 2 s.
        let fourth = sampler.record(one(3_000_000), at(3_000), true);
        assert_eq!(fourth["web"].cpu_percent, Some(100.0));
    }

    #[test]
    fn a_measurement_of_every_alloc_forgets_the_allocs_that_are_gone() {
        let sampler = UsageSampler::default();
        let now = crate::clock::Clock::system().instant();
        sampler.record(vec![("old".to_owned(), 5, None)], now, true);
        sampler.record(vec![("web".to_owned(), 5, None)], now, false);
        assert_eq!(sampler.last.lock().unwrap().len(), 2);
        sampler.record(vec![("web".to_owned(), 5, None)], now, true);
        let names: Vec<String> = sampler.last.lock().unwrap().keys().cloned().collect();
        assert_eq!(names, ["web"]);
    }
}
