//! Garbage collection of terminal allocs: which ones to destroy, Nomad's client policy.
//!
//! The shell lists the allocs with what it knows of each and the data dir's disk usage;
//! [`select_for_collection`] returns the allocs to destroy, oldest first. Rules:
//! - only a collectable alloc (terminal: every task dead, nothing in flight; and no spec
//!   declares it any more) is ever chosen, whatever the pressure;
//! - while more than `max_allocs` collectable allocs are kept, the oldest go;
//! - while the data dir's filesystem is fuller than `disk_usage_threshold` percent, the
//!   oldest go too, a batch of `parallel_destroys` at a time (the shell destroys them,
//!   measures again and asks again, as Nomad's client does);
//! - age is the finish time (the latest task finish); an alloc that never finished a task
//!   has nothing worth keeping and sorts first; ties go by key, so the choice is stable.

use stead_schemas::Timestamp;

/// The policy's knobs (the agent's `gc` config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcPolicy {
    /// Collectable allocs kept at most.
    pub max_allocs: usize,
    /// Disk usage, in percent of the data dir's filesystem, above which the oldest go.
    pub disk_usage_threshold: u8,
    /// Allocs destroyed at once; also the batch taken per round under disk pressure.
    pub parallel_destroys: usize,
}

impl Default for GcPolicy {
    /// Nomad's defaults: 50 allocs, 80 %, 2 at once.
    fn default() -> Self {
        GcPolicy {
            max_allocs: 50,
            disk_usage_threshold: 80,
            parallel_destroys: 2,
        }
    }
}

/// One alloc as GC sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GcCandidate<K> {
    /// What the shell destroys it by.
    pub key: K,
    /// Terminal and no longer declared by any spec: the only allocs GC may destroy.
    pub collectable: bool,
    /// When its last task finished.
    pub finished_at: Option<Timestamp>,
}

/// A filesystem's usage, as `df` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskUsage {
    /// Bytes in use.
    pub used: u64,
    /// Bytes available to unprivileged users.
    pub available: u64,
}

impl DiskUsage {
    /// Whether more than `percent` of the space users can have is in use.
    pub fn above(self, percent: u8) -> bool {
        let total = u128::from(self.used) + u128::from(self.available);
        total > 0 && u128::from(self.used) * 100 > u128::from(percent) * total
    }
}

/// Why an alloc was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GcReason {
    /// More than `max_allocs` collectable allocs.
    TooMany,
    /// The disk is fuller than the threshold.
    DiskPressure,
}

/// The allocs to destroy now, oldest first, each with why. `disk` is `None` when the
/// usage could not be measured (then only the count applies).
pub fn select_for_collection<K: Clone + Ord>(
    candidates: &[GcCandidate<K>],
    policy: &GcPolicy,
    disk: Option<DiskUsage>,
) -> Vec<(K, GcReason)> {
    let mut collectable: Vec<&GcCandidate<K>> =
        candidates.iter().filter(|c| c.collectable).collect();
    collectable.sort_by(|a, b| {
        a.finished_at
            .cmp(&b.finished_at)
            .then_with(|| a.key.cmp(&b.key))
    });
    let excess = collectable.len().saturating_sub(policy.max_allocs);
    let pressure = disk.is_some_and(|d| d.above(policy.disk_usage_threshold));
    let take = if pressure {
        excess.max(policy.parallel_destroys.max(1))
    } else {
        excess
    };
    collectable
        .into_iter()
        .take(take)
        .enumerate()
        .map(|(i, c)| {
            let reason = if i < excess {
                GcReason::TooMany
            } else {
                GcReason::DiskPressure
            };
            (c.key.clone(), reason)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn at(secs: u64) -> Option<Timestamp> {
        Some(Timestamp::from_since_epoch(Duration::from_secs(secs)))
    }

    fn candidate(key: u32, collectable: bool, finished: Option<Timestamp>) -> GcCandidate<u32> {
        GcCandidate {
            key,
            collectable,
            finished_at: finished,
        }
    }

    const ROOMY: Option<DiskUsage> = Some(DiskUsage {
        used: 10,
        available: 90,
    });
    const FULL: Option<DiskUsage> = Some(DiskUsage {
        used: 81,
        available: 19,
    });

    fn keys(selected: &[(u32, GcReason)]) -> Vec<u32> {
        selected.iter().map(|(k, _)| *k).collect()
    }

    #[test]
    fn sixty_terminal_allocs_leave_fifty_and_the_oldest_go_first() {
        // Keys in reverse age order, so sorting by key alone would pick the wrong ones.
        let candidates: Vec<_> = (0..60)
            .map(|i| candidate(1000 - i, true, at(u64::from(i))))
            .collect();
        let selected = select_for_collection(&candidates, &GcPolicy::default(), ROOMY);
        assert_eq!(
            keys(&selected),
            (0..10).map(|i| 1000 - i).collect::<Vec<_>>()
        );
        assert!(selected.iter().all(|(_, r)| *r == GcReason::TooMany));
    }

    #[test]
    fn a_non_collectable_alloc_is_never_chosen_even_under_disk_pressure() {
        let candidates = vec![
            candidate(1, false, at(1)),
            candidate(2, false, None),
            candidate(3, true, at(5)),
        ];
        let policy = GcPolicy {
            max_allocs: 0,
            ..GcPolicy::default()
        };
        assert_eq!(
            keys(&select_for_collection(&candidates, &policy, FULL)),
            [3]
        );
    }

    #[test]
    fn at_or_under_the_limit_and_the_threshold_nothing_is_collected() {
        let candidates: Vec<_> = (0..50).map(|i| candidate(i, true, at(1))).collect();
        assert!(select_for_collection(&candidates, &GcPolicy::default(), ROOMY).is_empty());
        let exactly_at_threshold = Some(DiskUsage {
            used: 80,
            available: 20,
        });
        assert!(
            select_for_collection(&candidates, &GcPolicy::default(), exactly_at_threshold)
                .is_empty()
        );
        assert!(select_for_collection(&candidates, &GcPolicy::default(), None).is_empty());
    }

    #[test]
    fn disk_pressure_takes_a_batch_of_the_oldest_beyond_the_count() {
        let candidates = vec![
            candidate(1, true, at(30)),
            candidate(2, true, at(10)),
            candidate(3, true, at(20)),
        ];
        let selected = select_for_collection(&candidates, &GcPolicy::default(), FULL);
        assert_eq!(
            selected,
            [(2, GcReason::DiskPressure), (3, GcReason::DiskPressure)]
        );
    }

    #[test]
    fn disk_pressure_never_takes_fewer_than_the_count_requires() {
        let candidates: Vec<_> = (0..5)
            .map(|i| candidate(i, true, at(u64::from(i))))
            .collect();
        let policy = GcPolicy {
            max_allocs: 1,
            ..GcPolicy::default()
        };
        let selected = select_for_collection(&candidates, &policy, FULL);
        assert_eq!(keys(&selected), [0, 1, 2, 3]);
    }

    #[test]
    fn an_alloc_that_never_finished_a_task_is_oldest_and_ties_go_by_key() {
        let candidates = vec![
            candidate(9, true, at(1)),
            candidate(8, true, at(1)),
            candidate(7, true, None),
        ];
        let policy = GcPolicy {
            max_allocs: 1,
            ..GcPolicy::default()
        };
        assert_eq!(
            keys(&select_for_collection(&candidates, &policy, None)),
            [7, 8]
        );
    }

    #[test]
    fn usage_is_counted_against_what_users_can_have() {
        assert!(
            DiskUsage {
                used: 81,
                available: 19
            }
            .above(80)
        );
        assert!(
            !DiskUsage {
                used: 0,
                available: 0
            }
            .above(0)
        );
    }
}
