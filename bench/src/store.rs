//! `stead-bench store`: the RocksDB store under churn, and the agent's idle memory.
//!
//! 1. N allocs (default 1,000) of three mock tasks each, on a real RocksDB store in a
//!    temporary directory; one task of each alloc exits every second and is restarted,
//!    the other two run steadily. Over a measured window: alloc state changes that reach
//!    the store, batches written per second, and bytes written per state change, with
//!    deduplication on and off, alternating in the same run.
//! 2. Creating a new node's database (`RocksDbStore::open` on an empty directory), which
//!    a new node's first start pays, and opening it again, which every later start pays:
//!    the CPU each takes (all threads) and its wall time.
//! 3. The real `stead agent` (the release binary beside this one) with 100 running mock
//!    allocs: its RSS after an idle period, and the RocksDB writes it made while idle.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use stead_controller::clock::Clock;
use stead_controller::driver::mock::MockDriver;
use stead_controller::driver::{Driver, Drivers};
use stead_controller::node::{Node, NodeConfig};
use stead_controller::queue::Shutdown;
use stead_controller::store::{RocksDbOptions, RocksDbStore, Store};
use stead_schemas::ValidSpec;

use crate::agent::{ReleaseAgent, temp_dir};
use crate::measure::{median, now, process_cpu, spread};

fn churn_spec(name: &str) -> anyhow::Result<ValidSpec> {
    let yaml = format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  restart: {{attempts: 1000, interval: 1h, delay: 1s, mode: delay}}\n  tasks:\n    - {{name: flappy, driver: mock, config: {{runFor: 1s}}}}\n    - {{name: steady, driver: mock, config: {{}}, env: {{A: '1', B: '2'}}}}\n    - {{name: sidecar, driver: mock, config: {{}}, env: {{C: '3'}}}}\n"
    );
    let file = stead_schemas::parse_spec_file(Path::new("bench.yaml"), &yaml);
    match file.specs().next() {
        Some(spec) => Ok(spec.clone()),
        None => bail!("invalid bench spec: {:?}", file.all_diagnostics()),
    }
}

/// One churn round: (state changes stored per second, batches per second, bytes per change).
async fn churn_round(
    allocs: usize,
    window: Duration,
    dedupe: bool,
) -> anyhow::Result<(f64, f64, f64)> {
    let dir = temp_dir("stead-bench-store")?;
    let options = RocksDbOptions {
        dedupe,
        ..RocksDbOptions::default()
    };
    let store = Arc::new(RocksDbStore::open(&dir, options)?);
    let clock = Clock::system();
    let mock = MockDriver::new(clock);
    let drivers = Drivers::new([Arc::new(mock) as Arc<dyn Driver>]);
    let node = Node::new(NodeConfig::default(), drivers, store.clone(), clock);
    for i in 0..allocs {
        node.apply(churn_spec(&format!("churn{i}"))?);
    }
    let up = node
        .wait_until(Duration::from_secs(120), |n| {
            n.statuses().len() == allocs
                && n.statuses()
                    .iter()
                    .all(|s| s.tasks["steady"].state == "running")
        })
        .await;
    if !up {
        bail!("allocs did not start");
    }
    // Warm up past the first restarts, then measure a window.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = store.metrics();
    let started = now();
    tokio::time::sleep(window).await;
    let after = store.metrics();
    let elapsed = started.elapsed().as_secs_f64();
    node.shutdown(Shutdown::Detach).await;
    drop(node);
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    let puts = (after.writes + after.skipped_writes) - (before.writes + before.skipped_writes);
    let writes = after.writes - before.writes;
    let bytes = after.bytes_written - before.bytes_written;
    Ok((
        puts as f64 / elapsed,
        writes as f64 / elapsed,
        bytes as f64 / puts.max(1) as f64,
    ))
}

/// What opening a store took: the CPU this process spent in the open (RocksDB's own
/// threads included) and its wall time.
#[derive(Debug, Clone, Copy)]
struct Opening {
    cpu: Duration,
    wall: Duration,
}

/// Opens the store in `dir` (creating it when missing) and measures it.
fn timed_open(dir: &Path) -> anyhow::Result<(RocksDbStore, Opening)> {
    let (cpu, began) = (process_cpu(), now());
    let store = RocksDbStore::open(dir, RocksDbOptions::default())?;
    let taken = Opening {
        cpu: process_cpu().saturating_sub(cpu),
        wall: began.elapsed(),
    };
    Ok((store, taken))
}

/// Creates a new store `count` times, each in an empty directory, closes it and opens it
/// again (as a restarted agent does): what each creation and each reopening took.
fn openings(count: usize) -> anyhow::Result<(Vec<Opening>, Vec<Opening>)> {
    let root = temp_dir("stead-bench-create")?;
    let measured = (|| {
        let (mut created, mut reopened) = (Vec::new(), Vec::new());
        for i in 0..count {
            let dir = root.join(i.to_string());
            let (store, taken) = timed_open(&dir)?;
            created.push(taken);
            drop(store);
            let (store, taken) = timed_open(&dir)?;
            reopened.push(taken);
            drop(store);
        }
        Ok((created, reopened))
    })();
    let _ = std::fs::remove_dir_all(&root);
    measured
}

/// `median (min-max)` of the CPU and of the wall times of `openings`, in milliseconds.
fn opening_summary(openings: &[Opening]) -> String {
    let range = |values: Vec<f64>| {
        let (median, min, max) = spread(&values);
        format!("{median:.2} ms ({min:.2}-{max:.2})")
    };
    let cpu = openings.iter().map(|o| o.cpu.as_secs_f64() * 1e3).collect();
    let wall = openings
        .iter()
        .map(|o| o.wall.as_secs_f64() * 1e3)
        .collect();
    format!("CPU {}, wall {}", range(cpu), range(wall))
}

/// The agent's RSS with 100 idle allocs, and its store writes while idle.
fn agent_idle(allocs: usize, idle: Duration) -> anyhow::Result<(u64, u64, u64)> {
    let agent = ReleaseAgent::start(
        "stead-bench-agent",
        (0..allocs).map(|i| {
            (
                format!("idle{i}.yaml"),
                format!(
                    "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: idle{i}}}\nspec:\n  tasks:\n    - {{name: main, driver: mock, config: {{}}}}\n"
                ),
            )
        }),
    )?;
    let deadline = now() + Duration::from_secs(60);
    while !agent.all_running(allocs) {
        if now() > deadline {
            bail!("the agent's allocs did not all run");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(2));
    let writes = || agent.metric("stead_store_writes_total").map(|v| v as u64);
    let before = writes()?;
    std::thread::sleep(idle);
    let after = writes()?;
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.child.id()))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .context("no such field")?
            .parse()
            .context("a number")
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?, after - before))
}

/// `store [ALLOCS] [WINDOW_SECONDS] [ROUNDS]`.
pub(crate) fn run(runtime: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    let mut args = std::env::args().skip(2);
    let allocs: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1_000);
    let window = Duration::from_secs(args.next().map(|a| a.parse()).transpose()?.unwrap_or(10));
    let rounds: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(3);
    println!(
        "store: {allocs} allocs of 3 mock tasks, one restarting every ~2 s; {window:?} windows, {rounds} rounds each, alternating"
    );
    let mut on = (Vec::new(), Vec::new(), Vec::new());
    let mut off = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        for dedupe in [true, false] {
            let (changes, writes, bytes) = runtime.block_on(churn_round(allocs, window, dedupe))?;
            println!(
                "  round {round} dedupe {dedupe:5}: {changes:8.0} changes/s  {writes:8.0} batches/s  {bytes:8.0} bytes/change"
            );
            let target = if dedupe { &mut on } else { &mut off };
            target.0.push(changes);
            target.1.push(writes);
            target.2.push(bytes);
        }
    }
    let (on_bytes, off_bytes) = (median(&on.2), median(&off.2));
    println!(
        "store medians: dedupe on {:.0} changes/s, {:.0} batches/s, {on_bytes:.0} bytes/change; dedupe off {:.0} changes/s, {:.0} batches/s, {off_bytes:.0} bytes/change; bytes ratio off/on {:.2}",
        median(&on.0),
        median(&on.1),
        median(&off.0),
        median(&off.1),
        off_bytes / on_bytes.max(1.0)
    );
    let (created, reopened) = openings(40)?;
    println!(
        "new store created in an empty dir, {} times: {}",
        created.len(),
        opening_summary(&created)
    );
    println!("the same stores reopened: {}", opening_summary(&reopened));
    let (rss, hwm, idle_writes) = agent_idle(100, Duration::from_secs(10))?;
    println!(
        "agent idle with 100 running allocs: RSS {:.1} MiB (peak {:.1} MiB), {idle_writes} store writes over 10 s",
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0
    );
    Ok(())
}
