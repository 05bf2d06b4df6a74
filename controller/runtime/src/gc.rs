//! The garbage-collection loop: every `interval`, destroy the terminal allocs that the
//! pure policy (`stead_reconcilers::gc`) picks, a few at a time.
//!
//! A pass measures the data dir's filesystem, asks the policy, destroys what it chose
//! (`parallelDestroys` at once; each destroy removes the alloc dir, the store record and
//! the alloc), and, while the disk is still above the threshold, measures and asks again.
//! The worker of each alloc checks again that it is collectable before it goes, so an
//! alloc whose spec came back meanwhile is never destroyed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use stead_reconcilers::gc::{DiskUsage, GcPolicy, GcReason, select_for_collection};
use stead_schemas::spec::Name;
use thiserror::Error;
use tokio::task::JoinSet;

use crate::node::Node;
use crate::queue::CommandError;

/// How garbage collection runs (the agent's `gc` config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcSettings {
    /// Time between passes (default 1m).
    pub interval: Duration,
    /// What a pass collects.
    pub policy: GcPolicy,
}

impl Default for GcSettings {
    fn default() -> Self {
        GcSettings {
            interval: Duration::from_secs(60),
            policy: GcPolicy::default(),
        }
    }
}

/// The data dir's filesystem could not be measured.
#[derive(Debug, Error)]
#[error("cannot measure the filesystem of {}", path.display())]
pub struct DiskUsageError {
    /// The directory measured.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: std::io::Error,
}

/// What one pass did.
#[derive(Debug, Default)]
pub struct GcReport {
    /// Allocs destroyed, in the order they were chosen (oldest first).
    pub collected: Vec<Name>,
    /// Allocs chosen but not destroyed, with why (one whose spec came back, say).
    pub refused: Vec<(Name, CommandError)>,
}

/// The usage of the filesystem holding `path`, as `df` counts it.
pub fn disk_usage(path: &Path) -> Result<DiskUsage, DiskUsageError> {
    let stats = rustix::fs::statvfs(path).map_err(|errno| DiskUsageError {
        path: path.to_owned(),
        source: errno.into(),
    })?;
    let block = stats.f_frsize.max(1);
    Ok(DiskUsage {
        used: stats.f_blocks.saturating_sub(stats.f_bfree) * block,
        available: stats.f_bavail * block,
    })
}

/// One garbage-collection pass over `node`, measuring the filesystem of `data_dir`.
pub async fn collect_once(node: &Arc<Node>, policy: &GcPolicy, data_dir: &Path) -> GcReport {
    let mut report = GcReport::default();
    let mut tried: BTreeSet<Name> = BTreeSet::new();
    loop {
        let dir = data_dir.to_owned();
        let disk = match tokio::task::spawn_blocking(move || disk_usage(&dir)).await {
            Ok(Ok(usage)) => Some(usage),
            Ok(Err(error)) => {
                tracing::warn!(error = %crate::errors::error_chain(&error), "gc measures no disk usage");
                None
            }
            Err(_) => None,
        };
        let candidates: Vec<_> = node
            .gc_candidates()
            .into_iter()
            .filter(|c| !tried.contains(&c.key))
            .collect();
        let chosen = select_for_collection(&candidates, policy, disk);
        if chosen.is_empty() {
            return report;
        }
        let pressure = chosen.iter().any(|(_, r)| *r == GcReason::DiskPressure);
        let names: Vec<Name> = chosen.into_iter().map(|(name, _)| name).collect();
        tried.extend(names.iter().cloned());
        destroy(node, names, policy.parallel_destroys, &mut report).await;
        if !pressure {
            return report;
        }
    }
}

/// Destroys now every alloc that is collectable (terminal, its spec gone), whatever the
/// policy's thresholds: `stead alloc gc`.
pub async fn collect_now(node: &Arc<Node>, parallel: usize) -> GcReport {
    let names = node
        .gc_candidates()
        .into_iter()
        .filter(|c| c.collectable)
        .map(|c| c.key)
        .collect();
    let mut report = GcReport::default();
    destroy(node, names, parallel, &mut report).await;
    report
}

/// Destroys `names`, `parallel` at a time, into `report`.
async fn destroy(node: &Arc<Node>, names: Vec<Name>, parallel: usize, report: &mut GcReport) {
    let mut pending = names.into_iter();
    let mut running = JoinSet::new();
    loop {
        while running.len() < parallel.max(1) {
            let Some(name) = pending.next() else { break };
            let node = node.clone();
            running.spawn(async move {
                let result = node.collect(&name).await;
                (name, result)
            });
        }
        let Some(done) = running.join_next().await else {
            break;
        };
        match done {
            Ok((name, Ok(()))) => report.collected.push(name),
            Ok((name, Err(error))) => report.refused.push((name, error)),
            Err(_) => {} // a panicked destroy: its alloc is tried again next pass
        }
    }
}

/// The alloc dirs under `data_dir/allocs` that nothing claims: no alloc of their name is
/// on the node or declared by the specs dir (even invalid), no run of theirs waits to be
/// reattached, and no process works in them. None while the specs dir has not been
/// listed completely (before the first listing, or while an entry cannot be read).
pub fn orphaned_alloc_dirs(node: &Node, data_dir: &Path) -> Vec<PathBuf> {
    let root = data_dir.join("allocs");
    let Ok(entries) = std::fs::read_dir(&root) else {
        return Vec::new();
    };
    let mut candidates = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        if !entry.file_type().is_ok_and(|kind| kind.is_dir()) {
            continue;
        }
        let name = entry.file_name();
        let Some(id) = name.to_str() else { continue };
        match node.claims_alloc_name(crate::driver::alloc_name_of(id)) {
            None => return Vec::new(),
            Some(true) => {}
            Some(false) => candidates.push(entry.path()),
        }
    }
    if candidates.is_empty() {
        return candidates;
    }
    // The working directories the kernel shows are resolved: so is the root.
    let real_root = std::fs::canonicalize(&root).unwrap_or_else(|_| root.clone());
    let busy = working_dirs();
    candidates
        .into_iter()
        .filter(|dir| {
            let real = dir
                .file_name()
                .map_or_else(|| dir.clone(), |name| real_root.join(name));
            !busy.iter().any(|cwd| cwd.starts_with(&real))
        })
        .collect()
}

/// The working directories of every process (a task's supervisor works in its task dir),
/// as the kernel resolves them.
fn working_dirs() -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter(|entry| {
            entry
                .file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter_map(|entry| std::fs::read_link(entry.path().join("cwd")).ok())
        .collect()
}

/// Removes the alloc dirs nothing claims ([`orphaned_alloc_dirs`]), each claimed again
/// just before it goes (a spec may have come back meanwhile); what it removed. Runs no
/// record names whose process is gone are forgotten first.
pub async fn collect_orphaned_dirs(node: &Arc<Node>, data_dir: &Path) -> Vec<PathBuf> {
    let node = node.clone();
    let data_dir = data_dir.to_owned();
    let removal = tokio::task::spawn_blocking(move || {
        node.unrecorded_runs_left();
        let mut removed = Vec::new();
        for dir in orphaned_alloc_dirs(&node, &data_dir) {
            let name = dir
                .file_name()
                .and_then(|n| n.to_str())
                .map(|id| crate::driver::alloc_name_of(id).to_owned());
            if name.is_none_or(|name| node.claims_alloc_name(&name) != Some(false)) {
                continue;
            }
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => removed.push(dir),
                Err(error) => {
                    tracing::warn!(dir = %dir.display(), %error, "cannot remove an alloc dir nothing claims");
                }
            }
        }
        removed
    });
    removal.await.unwrap_or_default()
}

/// Runs a pass every `settings.interval`, forever (the agent aborts it on exit).
pub async fn run(node: Arc<Node>, settings: GcSettings, data_dir: PathBuf) {
    let mut interval = tokio::time::interval(settings.interval);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    interval.tick().await;
    loop {
        interval.tick().await;
        let report = collect_once(&node, &settings.policy, &data_dir).await;
        for dir in collect_orphaned_dirs(&node, &data_dir).await {
            tracing::info!(dir = %dir.display(), "removed an alloc dir no alloc claims");
        }
        if !report.collected.is_empty() || !report.refused.is_empty() {
            tracing::info!(
                collected = report.collected.len(),
                refused = report.refused.len(),
                "garbage collection pass"
            );
        }
    }
}
