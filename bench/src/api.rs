//! `stead-bench api [ALLOCS] [CLIENTS] [POLL_MS] [ROUNDS] [dedicated|shared]`: the HTTP
//! API under load while the node churns.
//!
//! ALLOCS allocs (default 1,000) of two mock tasks run on a node served on 127.0.0.1.
//! A churn round changes every spec at once (each alloc is replaced by a new revision)
//! and lasts until every alloc runs its new revision. 2 x ROUNDS rounds (default 15
//! each) alternate between no API load and CLIENTS clients (default 100) polling
//! `GET /v1/allocs/{name}`, each pausing POLL_MS (default 100; 0 is back to back, which
//! saturates the machine) between requests; alternating cancels the drift between early
//! and late rounds. Reported, in one run: request latency p50/p99/max and throughput
//! during the loaded rounds, and the median convergence time of a round with and
//! without the load.
//!
//! The API is served on a one-thread runtime of its own (`dedicated`, the default) or on
//! the agent's runtime (`shared`): sharing queues requests behind the churn's thousands
//! of worker wake-ups (p99 ~150 ms instead of ~15 ms). The clients run on a one-thread
//! runtime of their own; everything shares the machine's cores, as local CLIs would.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use stead_controller::api::{self, ApiState};
use stead_controller::clock::Clock;
use stead_controller::driver::mock::MockDriver;
use stead_controller::driver::{Driver, Drivers};
use stead_controller::node::{Node, NodeConfig};
use stead_controller::store::MemoryStore;
use stead_schemas::ValidSpec;
use tokio::runtime::Runtime;

use crate::measure::median;

/// A node on the system clock with the mock driver and an in-memory store, and its API
/// over a data dir named after `bench` (not created).
pub(crate) fn served_mock_node(bench: &str) -> (Clock, Arc<Node>, ApiState, std::path::PathBuf) {
    let clock = Clock::system();
    let mock = MockDriver::new(clock);
    let drivers = Drivers::new([Arc::new(mock) as Arc<dyn Driver>]);
    let node = Arc::new(Node::new(
        NodeConfig::default(),
        drivers.clone(),
        Arc::new(MemoryStore::default()),
        clock,
    ));
    let data_dir = std::env::temp_dir().join(format!("stead-bench-{bench}-{}", std::process::id()));
    let state = ApiState::new(node.clone(), drivers, &data_dir);
    (clock, node, state, data_dir)
}

fn spec(name: &str, generation: u32) -> anyhow::Result<ValidSpec> {
    let yaml = format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  tasks:\n    - {{name: main, driver: mock, config: {{}}, env: {{GENERATION: \"{generation}\"}}}}\n    - {{name: side, driver: mock, config: {{}}}}\n"
    );
    let file = stead_schemas::parse_spec_file(std::path::Path::new("bench.yaml"), &yaml);
    match file.specs().next() {
        Some(spec) => Ok(spec.clone()),
        None => bail!("invalid bench spec: {:?}", file.all_diagnostics()),
    }
}

/// Applies generation `generation` of every alloc; the time until all run it.
async fn churn(
    node: &Node,
    clock: &Clock,
    names: &[String],
    generation: u32,
) -> anyhow::Result<Duration> {
    let specs: Vec<ValidSpec> = names
        .iter()
        .map(|n| spec(n, generation))
        .collect::<anyhow::Result<_>>()?;
    let ids: std::collections::HashSet<String> = specs.iter().map(|s| s.id.to_string()).collect();
    let start = clock.instant();
    for spec in specs {
        node.apply(spec);
    }
    loop {
        let statuses = node.statuses();
        let done = statuses.len() == names.len()
            && statuses
                .iter()
                .all(|s| ids.contains(&s.id) && s.tasks.values().all(|t| t.state == "running"));
        if done {
            return Ok(start.elapsed());
        }
        if start.elapsed() > Duration::from_secs(120) {
            bail!("generation {generation} did not converge within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() as f64) * p).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// One polling client.
struct Poller {
    client: reqwest::Client,
    base: String,
    names: Arc<Vec<String>>,
    /// The index of the first alloc asked for; then every `stride`-th.
    first: usize,
    stride: usize,
    pause: Duration,
    clock: Clock,
    /// Whether to poll now (false between loaded rounds).
    active: Arc<AtomicBool>,
    /// Whether a churn round is under way, so latencies count.
    measuring: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Poller {
    /// Requests until `stop`, returning each latency and the failures.
    async fn run(self) -> (Vec<Duration>, u64) {
        let mut latencies = Vec::new();
        let mut failures = 0;
        let mut i = self.first;
        while !self.stop.load(Ordering::Relaxed) {
            if !self.active.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            let url = format!(
                "{}/v1/allocs/{}",
                self.base,
                self.names[i % self.names.len()]
            );
            i += self.stride;
            let start = self.clock.instant();
            let ok = match self.client.get(&url).send().await {
                Ok(response) => response.status().is_success() && response.bytes().await.is_ok(),
                Err(_) => false,
            };
            if self.measuring.load(Ordering::Relaxed) {
                latencies.push(start.elapsed());
                if !ok {
                    failures += 1;
                }
            }
            if !self.pause.is_zero() {
                tokio::time::sleep(self.pause).await;
            }
        }
        (latencies, failures)
    }
}

/// Runs the benchmark on `runtime` (the agent's) and a one-thread runtime for the clients.
pub(crate) fn run(runtime: &Runtime) -> anyhow::Result<()> {
    let mut args = std::env::args().skip(2);
    let mut next = |default: u64| -> anyhow::Result<u64> {
        Ok(args
            .next()
            .map(|a| a.parse())
            .transpose()?
            .unwrap_or(default))
    };
    let allocs = next(1_000)? as usize;
    let clients = next(100)? as usize;
    let pause = Duration::from_millis(next(100)?);
    let rounds = next(15)?.max(1) as usize;
    let dedicated = match args.next().as_deref() {
        None | Some("dedicated") => true,
        Some("shared") => false,
        Some(other) => bail!("unknown server placement {other:?}; expected dedicated or shared"),
    };
    let client_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let server_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let server = if dedicated {
        server_runtime.handle().clone()
    } else {
        runtime.handle().clone()
    };
    runtime.block_on(bench(
        &client_runtime,
        server,
        dedicated,
        allocs,
        clients,
        pause,
        rounds,
    ))
}

async fn bench(
    client_runtime: &Runtime,
    server_runtime: tokio::runtime::Handle,
    dedicated: bool,
    allocs: usize,
    clients: usize,
    pause: Duration,
    rounds: usize,
) -> anyhow::Result<()> {
    let (clock, node, state, data_dir) = served_mock_node("api");
    let shutdown = state.shutdown_token();
    let (bound, address) = tokio::sync::oneshot::channel();
    let stopped = shutdown.clone().cancelled_owned();
    let server = server_runtime.spawn(async move {
        let listener = api::bind_tcp("127.0.0.1:0").await?;
        let _ = bound.send(listener.local_addr());
        let connections = api::Connections::new(api::ServeLimits::default());
        api::serve_tcp(listener, api::router(state), connections, stopped).await?;
        anyhow::Ok(())
    });
    let base = format!("http://{}", address.await??);
    let placement = if dedicated { "its own" } else { "the agent's" };

    let names: Vec<String> = (0..allocs).map(|i| format!("alloc-{i}")).collect();
    let mut generation = 1;
    churn(&node, &clock, &names, generation)
        .await
        .context("starting the allocs")?;
    let stop = Arc::new(AtomicBool::new(false));
    let active = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(clients)
        .build()?;
    let shared_names = Arc::new(names.clone());
    let pollers: Vec<_> = (0..clients)
        .map(|c| {
            let poller = Poller {
                client: http.clone(),
                base: base.clone(),
                names: shared_names.clone(),
                first: c * 7,
                stride: clients.max(1),
                pause,
                clock,
                active: active.clone(),
                measuring: measuring.clone(),
                stop: stop.clone(),
            };
            client_runtime.spawn(poller.run())
        })
        .collect();
    let mut quiet = Vec::new();
    let mut loaded = Vec::new();
    let mut load_time = Duration::ZERO;
    for _ in 0..rounds {
        generation += 1;
        quiet.push(churn(&node, &clock, &names, generation).await?);
        // Let destroyed tasks and the store settle between rounds.
        tokio::time::sleep(Duration::from_millis(200)).await;
        active.store(true, Ordering::Relaxed);
        // Let every client (re)connect before measuring.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let start = clock.instant();
        generation += 1;
        measuring.store(true, Ordering::Relaxed);
        loaded.push(churn(&node, &clock, &names, generation).await?);
        measuring.store(false, Ordering::Relaxed);
        load_time += start.elapsed();
        active.store(false, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    let mut failures = 0;
    for poller in pollers {
        let (mine, failed) = poller.await?;
        latencies.extend(mine);
        failures += failed;
    }
    latencies.sort();
    shutdown.cancel();
    server.await??;
    let _ = std::fs::remove_dir_all(&data_dir);

    let quiet_median = median(&quiet);
    let loaded_median = median(&loaded);
    let slowdown = (loaded_median.as_secs_f64() / quiet_median.as_secs_f64() - 1.0) * 100.0;
    let ms = |d: Duration| d.as_secs_f64() * 1_000.0;
    println!(
        "stead-bench api: {allocs} allocs x 2 mock tasks, {clients} clients polling GET /v1/allocs/{{name}} {}, {rounds} churn rounds with and without, alternating; api on {} runtime",
        if pause.is_zero() {
            "back to back".to_owned()
        } else {
            format!("every {} ms", pause.as_millis())
        },
        placement
    );
    println!(
        "  requests during loaded churn          {:>9}  ({:.0}/s, {failures} failed)",
        latencies.len(),
        latencies.len() as f64 / load_time.as_secs_f64()
    );
    println!(
        "  latency p50 / p99 / max               {:>9.2} / {:.2} / {:.2} ms",
        ms(percentile(&latencies, 0.50)),
        ms(percentile(&latencies, 0.99)),
        ms(latencies.last().copied().unwrap_or_default())
    );
    let list = |times: &[Duration]| {
        times
            .iter()
            .map(|t| format!("{:.0}", ms(*t)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!(
        "  convergence without load (median)     {:>9.1} ms  (rounds: {} ms)",
        ms(quiet_median),
        list(&quiet)
    );
    println!(
        "  convergence under load (median)       {:>9.1} ms  (rounds: {} ms)",
        ms(loaded_median),
        list(&loaded)
    );
    println!("  slowdown under load                   {slowdown:>9.1} %  (target < 10 %)");
    Ok(())
}
