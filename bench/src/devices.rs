//! `stead-bench devices`: device stats lookup for every task of the node, indexed by
//! instance (what the agent does) against a naive scan of the host's devices per task
//! (the cost that grows with tasks × host devices), in the same run.
//!
//! 1,000 tasks (500 allocs of two); with 64 devices on the host, 64 tasks hold one each
//! and the others none; the host's stats come as one list, as a plugin answers. A pass
//! produces every alloc's device stats (per task and per group) with the agent's
//! `alloc_device_stats`; the two ways differ only in how a held instance's stats are
//! found: a probe into an index built once per pass, or a scan of the host's list.
//! Passes alternate between the two ways, and the figures are medians. The host then
//! grows 8× with the same 64 holders, to show which cost follows the host.

use std::collections::{BTreeMap, HashMap};
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use stead_reconcilers::device::{AllocDevices, alloc_device_stats};
use stead_schemas::device::AssignedDevice;
use stead_schemas::spec::Name;

use crate::measure::{median, now};

type Stats = BTreeMap<String, f64>;

fn name(text: &str) -> Name {
    text.parse().expect("a valid name")
}

/// The host's devices (16 per group) with stats, and `tasks` tasks in allocs of two, the
/// first `holders` of them holding one instance each, spread evenly over the host.
fn setup(
    devices: usize,
    tasks: usize,
    holders: usize,
) -> (Vec<(AssignedDevice, Arc<Stats>)>, Vec<AllocDevices>) {
    let host: Vec<(AssignedDevice, Arc<Stats>)> = (0..devices)
        .map(|i| {
            let device = AssignedDevice {
                group: format!("acme/gpu/m{}", i / 16).parse().expect("a group"),
                instance: format!("gpu{i}").parse().expect("an id"),
            };
            let stats = Stats::from([
                ("utilization".to_owned(), (i % 100) as f64),
                ("memoryUsedBytes".to_owned(), (i * 1024) as f64),
            ]);
            (device, Arc::new(stats))
        })
        .collect();
    let allocs = (0..tasks.div_ceil(2))
        .map(|a| {
            let mut alloc = AllocDevices::new();
            for t in 0..2 {
                let task = a * 2 + t;
                // Holders' instances spread evenly over the host's list.
                let held = (task < holders)
                    .then(|| host.get(task * devices / holders))
                    .flatten()
                    .map(|(device, _)| vec![device.clone()])
                    .unwrap_or_default();
                alloc.insert(name(&format!("t{t}")), held);
            }
            alloc
        })
        .collect();
    (host, allocs)
}

/// The host's stats: as a list (what a naive caller scans) and indexed by instance (what
/// a plugin keeps, and what the agent probes).
struct Host {
    list: Vec<(AssignedDevice, Arc<Stats>)>,
    index: HashMap<AssignedDevice, Arc<Stats>>,
}

/// Every alloc's stats, the agent's way: one probe per held instance.
fn indexed(host: &Host, allocs: &[AllocDevices]) -> usize {
    let index = &host.index;
    let mut groups = 0;
    for alloc in allocs {
        let stats = alloc_device_stats(alloc, |d| index.get(d).map(Arc::clone));
        groups += stats.groups.len();
    }
    groups
}

/// Every alloc's stats, naively: each held instance is looked for by scanning the host's
/// devices.
fn naive(host: &Host, allocs: &[AllocDevices]) -> usize {
    let mut groups = 0;
    for alloc in allocs {
        let stats = alloc_device_stats(alloc, |d| {
            host.list
                .iter()
                .find(|(device, _)| device == d)
                .map(|(_, s)| Arc::clone(s))
        });
        groups += stats.groups.len();
    }
    groups
}

/// The lookups alone: every task's held instances' stats, by index probe.
fn lookups_indexed(host: &Host, allocs: &[AllocDevices]) -> usize {
    allocs
        .iter()
        .flat_map(|alloc| alloc.values().flatten())
        .filter_map(|d| host.index.get(d))
        .count()
}

/// The lookups alone, by scanning the host's list for each held instance.
fn lookups_naive(host: &Host, allocs: &[AllocDevices]) -> usize {
    allocs
        .iter()
        .flat_map(|alloc| alloc.values().flatten())
        .filter_map(|d| host.list.iter().find(|(device, _)| device == d))
        .count()
}

type Way = fn(&Host, &[AllocDevices]) -> usize;

/// Medians of `rounds` alternating passes of `fast` and `slow`.
fn race(
    host: &Host,
    allocs: &[AllocDevices],
    rounds: usize,
    fast: Way,
    slow: Way,
) -> anyhow::Result<(Duration, Duration)> {
    anyhow::ensure!(
        fast(host, allocs) == slow(host, allocs),
        "the two ways disagree"
    );
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let start = now();
        black_box(fast(black_box(host), black_box(allocs)));
        a.push(start.elapsed());
        let start = now();
        black_box(slow(black_box(host), black_box(allocs)));
        b.push(start.elapsed());
    }
    Ok((median(&a), median(&b)))
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Runs the benchmark: `tasks` tasks, `devices` host devices (and 8× that), `rounds`
/// passes of each way per size.
pub(crate) fn run(tasks: usize, devices: usize, rounds: usize) -> anyhow::Result<()> {
    println!(
        "device stats for {tasks} tasks, {} of them holding one device; {rounds} passes of each way",
        tasks.min(devices)
    );
    println!(
        "  {:<34} {:>12}  {:>14}  {:>16}  {:>7}",
        "", "host devices", "indexed (µs)", "naive scan (µs)", "ratio"
    );
    let first = devices;
    for devices in [devices, devices * 8] {
        // As many holders at both sizes: only the host grows.
        let (list, allocs) = setup(devices, tasks, tasks.min(first));
        let host = Host {
            index: list.iter().cloned().collect(),
            list,
        };
        let rows: [(&str, Way, Way); 2] = [
            (
                "lookups of every held instance",
                lookups_indexed,
                lookups_naive,
            ),
            ("every alloc's stats (API pass)", indexed, naive),
        ];
        for (what, fast, slow) in rows {
            let (fast, slow) = race(&host, &allocs, rounds, fast, slow)?;
            println!(
                "  {:<34} {:>12}  {:>14.1}  {:>16.1}  {:>6.1}×",
                what,
                devices,
                micros(fast),
                micros(slow),
                slow.as_secs_f64() / fast.as_secs_f64()
            );
        }
    }
    Ok(())
}
