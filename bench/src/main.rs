//! `stead-bench core`: the reconciliation core at scale with the mock driver.
//!
//! Submits N allocs of two tasks each and measures, in one run: time until every task
//! runs; CPU over an idle period (the level re-check on every tick); resident memory per
//! alloc; convergence after every spec changes at once; and a drain of every alloc whose
//! tasks take a second to exit. Real time, release build, the machine's two cores.

mod agent;
mod api;
mod checks;
mod devices;
mod exec;
mod logfollow;
mod measure;
mod parse;
mod peers;
mod procwatch;
mod store;
mod ui;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use stead_controller::clock::Clock;
use stead_controller::driver::mock::MockDriver;
use stead_controller::driver::{Driver, Drivers};
use stead_controller::node::{Node, NodeConfig};
use stead_controller::queue::Shutdown;
use stead_controller::store::{MemoryStore, Store};
use stead_schemas::ValidSpec;

/// The floor for cold start: spawns `tasks` processes, `command(i)` each in its own
/// process group, in a loop and nothing else, then waits for `observed` (the same
/// observation a manager's start is timed by; `Ok` at once when the spawns are the
/// measure); the time that took. Then kills them.
fn bare_spawn_loop(
    tasks: usize,
    mut command: impl FnMut(usize) -> std::process::Command,
    observed: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<Duration> {
    use std::os::unix::process::CommandExt;
    let start = Clock::system().instant();
    let mut children = Vec::with_capacity(tasks);
    for index in 0..tasks {
        children.push(
            command(index)
                .process_group(0)
                .spawn()
                .context("spawning the floor's process")?,
        );
    }
    observed()?;
    let took = start.elapsed();
    for child in &mut children {
        let _ = child.kill();
    }
    for child in &mut children {
        let _ = child.wait();
    }
    Ok(took)
}

/// Resident set size of this process, in KiB.
fn rss_kib() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS in /proc/self/status")?;
    Ok(line
        .split_whitespace()
        .nth(1)
        .context("malformed VmRSS")?
        .parse()?)
}

fn spec(name: &str, generation: u32, kill_after: &str) -> anyhow::Result<ValidSpec> {
    let yaml = format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  tasks:\n    - {{name: main, driver: mock, config: {{killAfter: {kill_after}}}, env: {{GENERATION: \"{generation}\"}}}}\n    - {{name: side, driver: mock, config: {{killAfter: {kill_after}}}}}\n"
    );
    let file = stead_schemas::parse_spec_file(std::path::Path::new("bench.yaml"), &yaml);
    match file.specs().next() {
        Some(spec) => Ok(spec.clone()),
        None => bail!("invalid bench spec: {:?}", file.all_diagnostics()),
    }
}

/// Polls `condition` every 10 ms until it holds; the time it took.
async fn time_until(
    clock: &Clock,
    limit: Duration,
    mut condition: impl FnMut() -> bool,
) -> anyhow::Result<Duration> {
    let start = clock.instant();
    while !condition() {
        if start.elapsed() > limit {
            bail!("not reached within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(start.elapsed())
}

async fn core(allocs: usize, idle: Duration, tick: Duration) -> anyhow::Result<()> {
    let clock = Clock::system();
    let mock = MockDriver::new(clock);
    let store = MemoryStore::default();
    let drivers = Drivers::new([Arc::new(mock.clone()) as Arc<dyn Driver>]);
    let node = Node::new(
        NodeConfig {
            tick,
            ..NodeConfig::default()
        },
        drivers,
        Arc::new(store.clone()),
        clock,
    );
    let names: Vec<String> = (0..allocs).map(|i| format!("alloc-{i}")).collect();
    let first: Vec<ValidSpec> = names
        .iter()
        .map(|n| spec(n, 1, "0s"))
        .collect::<anyhow::Result<_>>()?;
    let second: Vec<ValidSpec> = names
        .iter()
        .map(|n| spec(n, 2, "1s"))
        .collect::<anyhow::Result<_>>()?;
    let tasks = allocs * 2;

    let rss_before = rss_kib()?;
    let start = clock.instant();
    for spec in first {
        node.apply(spec);
    }
    let submitted = start.elapsed();
    let all_running = time_until(&clock, Duration::from_secs(120), || {
        mock.running().len() == tasks
    })
    .await?
        + submitted;
    // Let the last statuses publish and the store settle.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_after = rss_kib()?;

    let writes_before = store.metrics();
    let cpu_ticks = || crate::measure::cpu_ticks("self").context("reading /proc/self/stat");
    let cpu_before = cpu_ticks()?;
    tokio::time::sleep(idle).await;
    // USER_HZ is 100 on Linux: a tick is 10 ms.
    let cpu_idle = Duration::from_millis((cpu_ticks()? - cpu_before) * 10);
    let writes_idle = store.metrics().writes - writes_before.writes;

    let new_ids: std::collections::HashSet<String> =
        second.iter().map(|s| s.id.to_string()).collect();
    let start = clock.instant();
    for spec in second {
        node.apply(spec);
    }
    let submitted = start.elapsed();
    let converged = submitted
        + time_until(&clock, Duration::from_secs(300), || {
            let statuses = node.statuses();
            statuses.len() == allocs
                && statuses.iter().all(|s| {
                    new_ids.contains(&s.id) && s.tasks.values().all(|t| t.state == "running")
                })
        })
        .await?;

    let start_drain = clock.instant();
    node.shutdown(Shutdown::Drain).await;
    let drained = start_drain.elapsed();
    let left = mock.running().len();

    let per_alloc = (rss_after.saturating_sub(rss_before)) as f64 / allocs as f64;
    let idle_share = cpu_idle.as_secs_f64() / idle.as_secs_f64() * 100.0;
    println!(
        "stead-bench core: {allocs} allocs x 2 mock tasks, tick {}ms",
        tick.as_millis()
    );
    println!(
        "  all {tasks} tasks running after submit   {:>9.3} s  (target < 2 s)",
        all_running.as_secs_f64()
    );
    println!(
        "  idle CPU over {:>3} s                   {:>9.2} % of one core  (target < 5 %)",
        idle.as_secs(),
        idle_share
    );
    println!("  store writes while idle               {:>9}", writes_idle);
    println!(
        "  RSS per alloc                         {:>9.1} KiB  (target < 20 KiB; {rss_before} -> {rss_after} KiB)",
        per_alloc
    );
    println!(
        "  converged after changing every spec   {:>9.3} s  (target < 5 s)",
        converged.as_secs_f64()
    );
    println!(
        "  drain, tasks taking 1 s to exit       {:>9.3} s  (target < 3 s; {left} tasks left)",
        drained.as_secs_f64()
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let what = args.next().unwrap_or_else(|| "core".to_owned());
    let allocs: usize = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(10_000);
    let idle = Duration::from_secs(args.next().map(|a| a.parse()).transpose()?.unwrap_or(10));
    let tick = Duration::from_millis(args.next().map(|a| a.parse()).transpose()?.unwrap_or(1_000));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match what.as_str() {
        "core" => runtime.block_on(core(allocs, idle, tick)),
        "api" => api::run(&runtime),
        "ui" => ui::run(&runtime),
        "exec" => exec::run(&runtime),
        "checks" => checks::run(),
        "store" => store::run(&runtime),
        "peers" => peers::run_peers(),
        "parse" => parse::run(
            std::env::args()
                .nth(2)
                .map(|rounds| rounds.parse())
                .transpose()?
                .unwrap_or(20),
        ),
        "devices" => devices::run(allocs, idle.as_secs() as usize, tick.as_millis() as usize),
        "logfollow" => {
            let arg = |n: usize| {
                std::env::args()
                    .nth(n)
                    .map(|a| a.parse::<u64>())
                    .transpose()
            };
            logfollow::run(
                arg(2)?.map_or(1_000, |n| n as usize),
                Duration::from_secs(arg(3)?.unwrap_or(30)),
            )
        }
        other => bail!(
            "unknown benchmark {other:?}; try `core [ALLOCS] [IDLE_SECONDS] [TICK_MS]` or `api [ALLOCS] [CLIENTS] [POLL_MS] [ROUNDS]` or `ui [ALLOCS] [ROUNDS]` or `exec [TASKS] [RESTARTS] [ROUNDS]` or `checks [TASKS] [WINDOW_SECONDS]` or `store [ALLOCS] [WINDOW_SECONDS] [ROUNDS]` or `peers [ROUNDS] [IDLE_SECONDS] [RESTARTS]` or `devices [TASKS] [HOST_DEVICES] [ROUNDS]` or `parse [ROUNDS]` or `logfollow [STREAMS] [WINDOW_SECONDS]`"
        ),
    }
}
