//! `stead-bench devices`: device stats lookup for every task of the node, indexed by
//! instance (what the agent does) against a naive scan of the host's devices per task
//! (the cost that grows with tasks × host devices), in the same run.
//!
//! 1,000 tasks (500 allocs of two); with 64 devices on the host, 64 tasks hold one each
//! and the others none; the host's stats come as one list, as a plugin answers. A pass
//! produces every alloc's device stats. Passes alternate between the two ways, and the
//! figures are medians. The host then grows 8× with the same 64 holders, to show which
//! cost follows the host.

use std::collections::{BTreeMap, HashMap};
use std::hint::black_box;
use std::time::{Duration, Instant};

use stead_reconcilers::device::{AllocDevices, alloc_device_stats};
use stead_schemas::device::AssignedDevice;
use stead_schemas::spec::Name;

type Stats = BTreeMap<String, f64>;

/// Now, through the agent's clock module (the only place that reads the clock).
fn now() -> Instant {
    stead_controller::clock::Clock::system()
        .instant()
        .into_std()
}

fn name(text: &str) -> Name {
    text.parse().expect("a valid name")
}

/// The host's devices (16 per group) with stats, and `tasks` tasks in allocs of two, the
/// first `holders` of them holding one instance each.
fn setup(
    devices: usize,
    tasks: usize,
    holders: usize,
) -> (Vec<(AssignedDevice, Stats)>, Vec<AllocDevices>) {
    let host: Vec<(AssignedDevice, Stats)> = (0..devices)
        .map(|i| {
            let device = AssignedDevice {
                group: format!("acme/gpu/m{}", i / 16).parse().expect("a group"),
                instance: format!("gpu{i}").parse().expect("an id"),
            };
            let stats = Stats::from([
                ("utilization".to_owned(), (i % 100) as f64),
                ("memoryUsedBytes".to_owned(), (i * 1024) as f64),
            ]);
            (device, stats)
        })
        .collect();
    let allocs = (0..tasks.div_ceil(2))
        .map(|a| {
            let mut alloc = AllocDevices::new();
            for t in 0..2 {
                let task = a * 2 + t;
                let held = host
                    .get(task)
                    .filter(|_| task < holders)
                    .map(|(device, _)| vec![device.clone()])
                    .unwrap_or_default();
                alloc.insert(name(&format!("t{t}")), held);
            }
            alloc
        })
        .collect();
    (host, allocs)
}

/// Every alloc's stats, the agent's way: the answer indexed by instance once, then one
/// lookup per held instance.
fn indexed(host: &[(AssignedDevice, Stats)], allocs: &[AllocDevices]) -> usize {
    let index: HashMap<&AssignedDevice, &Stats> = host.iter().map(|(d, s)| (d, s)).collect();
    let mut groups = 0;
    for alloc in allocs {
        let stats = alloc_device_stats(alloc, |d| index.get(d).map(|s| (*s).clone()));
        groups += stats.groups.len();
    }
    groups
}

/// Every alloc's stats, naively: each task scans every host device for its own.
fn naive(host: &[(AssignedDevice, Stats)], allocs: &[AllocDevices]) -> usize {
    let mut groups = 0;
    for alloc in allocs {
        let mut per_group: BTreeMap<String, Vec<Stats>> = BTreeMap::new();
        for held in alloc.values() {
            for (device, stats) in host {
                if held.contains(device) {
                    per_group
                        .entry(device.group.to_string())
                        .or_default()
                        .push(stats.clone());
                }
            }
        }
        groups += per_group.len();
    }
    groups
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Runs the benchmark: `tasks` tasks, `devices` host devices (and 8× that), `rounds`
/// passes of each way per size.
pub(crate) fn run(tasks: usize, devices: usize, rounds: usize) -> anyhow::Result<()> {
    println!("device stats lookup: {tasks} tasks, {rounds} passes of each way per host size");
    println!(
        "  {:>12}  {:>16}  {:>16}  {:>8}",
        "host devices", "indexed (µs)", "naive scan (µs)", "ratio"
    );
    let first = devices;
    for devices in [devices, devices * 8] {
        // As many holders at both sizes: only the host grows.
        let (host, allocs) = setup(devices, tasks, tasks.min(first));
        anyhow::ensure!(
            indexed(&host, &allocs) == naive(&host, &allocs),
            "the two ways disagree"
        );
        let (mut fast, mut slow) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let start = now();
            black_box(indexed(black_box(&host), black_box(&allocs)));
            fast.push(start.elapsed());
            let start = now();
            black_box(naive(black_box(&host), black_box(&allocs)));
            slow.push(start.elapsed());
        }
        let (fast, slow) = (median(fast), median(slow));
        println!(
            "  {:>12}  {:>16.1}  {:>16.1}  {:>7.1}×",
            devices,
            micros(fast),
            micros(slow),
            slow.as_secs_f64() / fast.as_secs_f64()
        );
    }
    Ok(())
}
