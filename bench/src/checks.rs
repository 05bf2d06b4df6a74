//! `stead-bench checks [TASKS] [WINDOW_SECONDS]`: what health checks cost the agent, and
//! how closely they keep their schedule.
//!
//! The real `stead agent` (the release binary beside this one, RocksDB state) runs TASKS
//! mock tasks (default 1,000), one alloc each, twice in one run: first without checks
//! (the baseline), then with one http check each at `interval: 1s` against a server in
//! this process, at `/t/<index>`. Over a window of WINDOW_SECONDS (default 30) once every
//! check has answered, it reports the agent's CPU (all its threads, from
//! `/proc/<pid>/stat`: the median of 5 s slices and the whole window), the checks'
//! results per second and the store writes they caused; and, from the times the server
//! saw each check's requests, how late each request was against its check's fixed 1 s
//! schedule (p50, p99, max). The floor, measured in the same run: one thread of this
//! process making the same requests at the same rate, each on a new connection read to
//! its end (what a check must do), and nothing else; its CPU time.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::agent::ReleaseAgent;
use crate::measure::{cpu_ticks, median, now};

/// When the server saw each check's requests, by task index.
type Arrivals = Arc<Mutex<HashMap<usize, Vec<Instant>>>>;

/// Serves `200 OK` to every request on a fresh loopback port, recording when each
/// `/t/<index>` request arrived; returns the port.
fn serve(arrivals: Arrivals) -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    // A few threads: the server must never be why a check is late.
    for _ in 0..4 {
        let listener = listener.try_clone()?;
        let arrivals = arrivals.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let at = now();
                let mut request = [0u8; 1024];
                let Ok(n) = stream.read(&mut request) else {
                    continue;
                };
                let text = String::from_utf8_lossy(&request[..n]);
                let index = text
                    .split_whitespace()
                    .nth(1)
                    .and_then(|path| path.strip_prefix("/t/"))
                    .and_then(|i| i.parse::<usize>().ok());
                if let Some(index) = index {
                    arrivals
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .entry(index)
                        .or_default()
                        .push(at);
                }
                let _ = stream.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                );
            }
        });
    }
    Ok(port)
}

/// One agent run's figures.
struct Run {
    /// CPU per 5 s slice, in percent of one core.
    slices: Vec<f64>,
    /// CPU over the whole window, in percent of one core.
    window: f64,
    /// Check results per second.
    results: f64,
    /// Store writes per second.
    writes: f64,
    /// How late each request was against its check's schedule.
    lateness: Vec<Duration>,
}

fn run_agent(tasks: usize, window: Duration, checked: Option<u16>) -> anyhow::Result<Run> {
    let specs = (0..tasks).map(|i| {
        let checks = match checked {
            Some(port) => format!(
                "\n      checks: [{{name: alive, type: http, port: {port}, path: /t/{i}, interval: 1s, timeout: 1s}}]"
            ),
            None => String::new(),
        };
        (
            format!("c{i}.yaml"),
            format!(
                "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: c{i}}}\nspec:\n  tasks:\n    - name: main\n      driver: mock\n      config: {{}}{checks}\n"
            ),
        )
    });
    let agent = ReleaseAgent::start("stead-bench-checks", specs)?;
    measure(tasks, window, checked.is_some(), &agent)
}

fn measure(
    tasks: usize,
    window: Duration,
    checked: bool,
    agent: &ReleaseAgent,
) -> anyhow::Result<Run> {
    let deadline = now() + Duration::from_secs(180);
    let results_series = "stead_check_results_total{status=\"passing\"}";
    loop {
        let ready = if checked {
            // Every check answered at least twice.
            agent
                .metric(results_series)
                .is_ok_and(|n| n >= 2.0 * tasks as f64)
        } else {
            agent.all_running(tasks)
        };
        if ready {
            break;
        }
        if now() > deadline {
            bail!("the agent's tasks did not all run (and answer their checks) within 180 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(3));
    let pid = agent.child.id().to_string();
    let ticks = || cpu_ticks(&pid).context("reading the agent's /proc/<pid>/stat");
    let results_before = if checked {
        agent.metric(results_series)?
    } else {
        0.0
    };
    let writes_before = agent.metric("stead_store_writes_total")?;
    let started = now();
    let first = ticks()?;
    let mut slices = Vec::new();
    let slice = Duration::from_secs(5);
    let mut last = first;
    while now() < started + window {
        std::thread::sleep(slice.min(started + window - now()));
        let spent = ticks()?;
        // USER_HZ is 100 on Linux: a tick is 10 ms, 1 % of a core for one second.
        slices.push((spent - last) as f64 / slice.as_secs_f64());
        last = spent;
    }
    let elapsed = started.elapsed();
    let window_share = (last - first) as f64 / elapsed.as_secs_f64();
    let results = if checked {
        (agent.metric(results_series)? - results_before) / elapsed.as_secs_f64()
    } else {
        0.0
    };
    let writes =
        (agent.metric("stead_store_writes_total")? - writes_before) / elapsed.as_secs_f64();
    Ok(Run {
        slices,
        window: window_share,
        results,
        writes,
        lateness: Vec::new(),
    })
}

/// How late each arrival was against its check's 1 s grid, anchored at the earliest
/// phase its arrivals show; only arrivals in `[from, to)` count.
fn lateness(arrivals: &HashMap<usize, Vec<Instant>>, from: Instant, to: Instant) -> Vec<Duration> {
    let interval = Duration::from_secs(1);
    let mut late = Vec::new();
    for times in arrivals.values() {
        let Some(&first) = times.first() else {
            continue;
        };
        // Each arrival's offset from the grid through the first, in beats.
        let offsets: Vec<(Instant, f64)> = times
            .iter()
            .map(|t| {
                let since = t.duration_since(first).as_secs_f64();
                let beat = (since / interval.as_secs_f64()).round();
                (*t, since - beat * interval.as_secs_f64())
            })
            .collect();
        let anchor = offsets
            .iter()
            .map(|(_, offset)| *offset)
            .fold(f64::INFINITY, f64::min);
        late.extend(
            offsets
                .iter()
                .filter(|(t, _)| *t >= from && *t < to)
                .map(|(_, offset)| Duration::from_secs_f64((offset - anchor).max(0.0))),
        );
    }
    late.sort_unstable();
    late
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// The CPU one thread spends making `rate` requests per second to `port` for `window`,
/// each on a new connection, in percent of one core.
fn floor(port: u16, rate: usize, window: Duration) -> anyhow::Result<f64> {
    let thread_cpu = || {
        let spent = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
        Duration::new(
            u64::try_from(spent.tv_sec).unwrap_or(0),
            u32::try_from(spent.tv_nsec).unwrap_or(0),
        )
    };
    let started = now();
    let cpu_before = thread_cpu();
    let gap = Duration::from_secs(1) / u32::try_from(rate.max(1)).unwrap_or(u32::MAX);
    let mut next = started;
    let mut response = Vec::with_capacity(256);
    while now() < started + window {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
        stream.write_all(
            b"GET /floor HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: stead-health-check\r\nConnection: close\r\n\r\n",
        )?;
        response.clear();
        stream.read_to_end(&mut response)?;
        drop(stream);
        next += gap;
        if let Some(wait) = next.checked_duration_since(now()) {
            std::thread::sleep(wait);
        }
    }
    let spent = thread_cpu() - cpu_before;
    Ok(spent.as_secs_f64() / started.elapsed().as_secs_f64() * 100.0)
}

/// `checks [TASKS] [WINDOW_SECONDS]`.
pub(crate) fn run() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(2);
    let tasks: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1_000);
    let window = Duration::from_secs(args.next().map(|a| a.parse()).transpose()?.unwrap_or(30));
    println!(
        "checks: the release agent with {tasks} running mock tasks, without checks, then with one http check each at interval 1s; {}s windows",
        window.as_secs()
    );
    let baseline = run_agent(tasks, window, None)?;
    let arrivals: Arrivals = Arc::default();
    let port = serve(arrivals.clone())?;
    let floor = floor(port, tasks, window)?;
    let window_start = now();
    let mut checked = run_agent(tasks, window, Some(port))?;
    let seen = arrivals
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    // The measured window is the last `window` before the agent stopped.
    let end = seen
        .values()
        .filter_map(|times| times.last().copied())
        .max()
        .unwrap_or(window_start);
    let from = end
        .checked_sub(window)
        .unwrap_or(window_start)
        .max(window_start);
    checked.lateness = lateness(&seen, from, end);
    for (what, run) in [("without checks", &baseline), ("with checks", &checked)] {
        println!(
            "  agent CPU {what:<15} median of 5 s slices {:>6.2} % of one core  (window {:.2} %; slices {:?}); store writes {:.1}/s",
            median(&run.slices),
            run.window,
            run.slices,
            run.writes
        );
    }
    println!(
        "  floor: one thread making the same {tasks} requests/s, a connection each: {floor:.2} % of one core"
    );
    let late = &checked.lateness;
    println!(
        "  check results {:.0}/s; cost of the checks {:.2} % of one core (target <= 5 %)",
        checked.results,
        median(&checked.slices) - median(&baseline.slices)
    );
    println!(
        "  lateness against the schedule over {} requests: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (target p99 <= 100 ms)",
        late.len(),
        percentile(late, 0.5).as_secs_f64() * 1e3,
        percentile(late, 0.99).as_secs_f64() * 1e3,
        percentile(late, 1.0).as_secs_f64() * 1e3
    );
    Ok(())
}
