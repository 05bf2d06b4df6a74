//! Deterministic simulation of the real node (issue 32): a seed drives hundreds of random
//! steps (specs applied, edited, broken and deleted; task exits and start errors; user
//! restarts and signals; store write failures; agent crashes; time advanced) on one
//! current-thread runtime under paused time, with every invariant checked after every
//! step and each seed's history reduced to a trace hash that the same seed reproduces.
//!
//! `STEAD_SIM_SEED=n` replays one seed (printing its trace), `STEAD_SIM_SEEDS=n` runs
//! that many (`make soak` runs 10,000), `STEAD_SIM_STEPS=n` sets the steps per seed,
//! `STEAD_SIM_FIRST_SEED=n` where they start, and `STEAD_SIM_VERBOSE` prints each seed
//! and step as it happens (a seed whose runtime thread spins never reaches its bound).
//!
//! Seeds kept as regression tests, each for a product bug the simulator found:
//! - 1084 (100 steps): a worker whose state came back to what its last successful write
//!   stored kept a failed write's retry, due at once on every pass, and spun.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use stead_controller::clock::Clock;
use stead_controller::driver::mock::MockDriver;
use stead_controller::driver::{Driver, Drivers};
use stead_controller::node::{Node, NodeConfig};
use stead_controller::queue::Shutdown;
use stead_controller::store::MemoryStore;
use stead_reconcilers::alloc::Limits;
use stead_reconcilers::exit::ExitResult;
use stead_schemas::spec::Name;
use stead_schemas::{Timestamp, ValidSpec};

/// 2026-11-22T00:00:00Z, as in the other scenarios.
const START: Duration = Duration::from_secs(1_795_305_600);
/// The alloc names a history draws from: few, so edits and deletes hit live allocs.
const NAMES: [&str; 4] = ["a", "b", "c", "d"];
/// Events kept per task: small, so the cap is reached and checked.
const MAX_EVENTS: usize = 12;
/// The restart interval of every generated spec.
const INTERVAL: Duration = Duration::from_secs(60);
/// Once faults stop and every declared alloc is given a runnable spec, all of them run
/// (and nothing else does) within this much simulated time: the longest kill timeout
/// (5 s) plus the longest `killAfter` that outlasts it is forced at the timeout, plus
/// one tick (10 s) and one store retry, with margin.
const CONVERGENCE_BOUND: Duration = Duration::from_secs(30);
/// No step (a crash's shutdown and restore included) takes longer than this much
/// simulated time.
const STEP_BOUND: Duration = Duration::from_secs(600);
/// Steps per seed in `make test`.
const DEFAULT_STEPS: usize = 50;
/// Seeds in `make test`.
const DEFAULT_SEEDS: u64 = 500;

/// One task of a generated spec.
#[derive(Debug, Clone)]
struct TaskShape {
    name: &'static str,
    leader: bool,
    /// `runFor` in ms; `None` runs until killed.
    run_for_ms: Option<u64>,
    exit_code: i32,
    /// `startError`, recoverable or not.
    start_error: Option<bool>,
    kill_after_ms: Option<u64>,
    kill_timeout_s: u64,
}

/// A generated spec's knobs.
#[derive(Debug, Clone)]
struct Shape {
    batch: bool,
    attempts: u32,
    delay_s: u64,
    mode_delay: bool,
    tasks: Vec<TaskShape>,
    /// Bumped by every edit, so each edit is a new revision.
    generation: u32,
}

impl Shape {
    fn random(rng: &mut fastrand::Rng, generation: u32, runnable: bool) -> Self {
        let attempts = rng.u32(0..=3);
        let count = if rng.u8(0..4) == 0 { 2 } else { 1 };
        let tasks = (0..count)
            .map(|i| TaskShape {
                name: ["t0", "t1"][i],
                leader: i == 0 && count == 2 && rng.bool(),
                run_for_ms: (!runnable && rng.u8(0..3) == 0).then(|| rng.u64(1..=20_000)),
                exit_code: if rng.bool() { 0 } else { 1 },
                start_error: (!runnable && rng.u8(0..8) == 0).then(|| rng.bool()),
                kill_after_ms: (rng.u8(0..3) == 0).then(|| rng.u64(1..=8_000)),
                kill_timeout_s: rng.u64(1..=5),
            })
            .collect();
        Shape {
            batch: !runnable && rng.u8(0..4) == 0,
            attempts,
            delay_s: rng.u64(1..=5),
            mode_delay: attempts > 0 && rng.u8(0..3) == 0,
            tasks,
            generation,
        }
    }

    fn yaml(&self, name: &str) -> String {
        let mut out = format!(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  type: {}\n  restart: {{attempts: {}, interval: {}s, delay: {}s, mode: {}}}\n  tasks:\n",
            if self.batch { "batch" } else { "service" },
            self.attempts,
            INTERVAL.as_secs(),
            self.delay_s,
            if self.mode_delay { "delay" } else { "fail" },
        );
        for task in &self.tasks {
            let mut config = Vec::new();
            if let Some(ms) = task.run_for_ms {
                config.push(format!("runFor: {ms}ms, exitCode: {}", task.exit_code));
            }
            if let Some(recoverable) = task.start_error {
                config.push(format!(
                    "startError: boom, startErrorRecoverable: {recoverable}"
                ));
            }
            if let Some(ms) = task.kill_after_ms {
                config.push(format!("killAfter: {ms}ms"));
            }
            let _ = writeln!(
                out,
                "    - {{name: {}, driver: mock, leader: {}, killTimeout: {}s, env: {{GEN: \"{}\"}}, config: {{{}}}}}",
                task.name,
                task.leader,
                task.kill_timeout_s,
                self.generation,
                config.join(", ")
            );
        }
        out
    }

    fn spec(&self, name: &str) -> ValidSpec {
        let yaml = self.yaml(name);
        let file = stead_schemas::parse_spec_file(std::path::Path::new("sim.yaml"), &yaml);
        assert!(
            file.is_valid(),
            "generated spec is invalid: {yaml}\n{:#?}",
            file.all_diagnostics()
        );
        file.specs().next().expect("one spec").clone()
    }
}

/// What the simulation declared for one name.
struct Declared {
    shape: Shape,
    spec: ValidSpec,
    /// An invalid edit is pending: the node keeps the last valid revision.
    broken: bool,
}

/// One simulated history.
struct Sim {
    rng: fastrand::Rng,
    seed: u64,
    clock: Clock,
    mock: MockDriver,
    store: MemoryStore,
    node: Node,
    declared: BTreeMap<&'static str, Declared>,
    generation: u32,
    store_failing: bool,
    /// The node runs with [`NodeConfig::plant_start_before_terminal`].
    planted_bug: bool,
    trace: String,
    hasher: std::collections::hash_map::DefaultHasher,
}

fn new_node(
    seed: u64,
    clock: Clock,
    mock: &MockDriver,
    store: &MemoryStore,
    planted_bug: bool,
) -> Node {
    let drivers = Drivers::new([Arc::new(mock.clone()) as Arc<dyn Driver>]);
    let config = NodeConfig {
        limits: Limits {
            max_events: MAX_EVENTS,
            ..Limits::default()
        },
        seed: Some(seed),
        plant_start_before_terminal: planted_bug,
        ..NodeConfig::default()
    };
    Node::new(config, drivers, Arc::new(store.clone()), clock)
}

fn name(text: &str) -> Name {
    text.parse().expect("a valid name")
}

/// The alloc name in a mock handle id `<name>-<8 hex>/<task>/<run>`.
fn handle_alloc_id(handle_id: &str) -> &str {
    handle_id.split('/').next().unwrap_or(handle_id)
}

fn alloc_name_of(alloc_id: &str) -> &str {
    alloc_id.rsplit_once('-').map_or(alloc_id, |(name, _)| name)
}

impl Sim {
    fn new(seed: u64, planted_bug: bool) -> Self {
        let clock = Clock::starting_at(Timestamp::from_since_epoch(START));
        let mock = MockDriver::new(clock);
        let store = MemoryStore::new();
        let node = new_node(seed, clock, &mock, &store, planted_bug);
        Sim {
            rng: fastrand::Rng::with_seed(seed),
            seed,
            clock,
            mock,
            store,
            node,
            declared: BTreeMap::new(),
            generation: 0,
            store_failing: false,
            planted_bug,
            trace: String::new(),
            hasher: std::collections::hash_map::DefaultHasher::new(),
        }
    }

    fn apply(&mut self, alloc: &'static str, runnable: bool) {
        self.generation += 1;
        let shape = Shape::random(&mut self.rng, self.generation, runnable);
        let spec = shape.spec(alloc);
        self.node.set_spec_error(&name(alloc), None);
        self.node.apply(spec.clone());
        self.declared.insert(
            alloc,
            Declared {
                shape,
                spec,
                broken: false,
            },
        );
    }

    /// One random step; returns what it did, for the trace.
    async fn step(&mut self) -> String {
        let alloc = NAMES[self.rng.usize(..NAMES.len())];
        let roll = self.rng.u8(0..100);
        match roll {
            0..=19 => {
                self.apply(alloc, false);
                format!("apply {alloc} gen {}", self.generation)
            }
            20..=24 => {
                if self.declared.remove(alloc).is_some() {
                    self.node.remove(&name(alloc));
                }
                format!("delete {alloc}")
            }
            25..=27 => {
                if let Some(declared) = self.declared.get_mut(alloc) {
                    declared.broken = true;
                    self.node
                        .set_spec_error(&name(alloc), Some("sim.yaml:1:1: spec: broken".into()));
                }
                format!("break {alloc}")
            }
            28..=35 => {
                let task = self.random_task(alloc);
                let result = self.node.restart(alloc, task.clone()).await;
                format!("restart {alloc}/{task:?}: {}", result.is_ok())
            }
            36..=41 => {
                let Some(task) = self.random_task(alloc) else {
                    return format!("signal {alloc}: no task");
                };
                let signal = ["SIGUSR1", "SIGTERM", "SIGHUP"][self.rng.usize(..3)];
                let result = self
                    .node
                    .signal(alloc, task.clone(), signal.parse().expect("signal"))
                    .await;
                format!("signal {alloc}/{task} {signal}: {}", result.is_ok())
            }
            42..=49 => {
                let running = self.mock.running();
                if running.is_empty() {
                    return "exit: nothing runs".into();
                }
                let handle = &running[self.rng.usize(..running.len())];
                let code = self.rng.i32(0..=2);
                let exited = self.mock.exit_task(
                    &handle.id,
                    ExitResult {
                        exit_code: code,
                        signal: None,
                        error: None,
                        oom_killed: false,
                        at: None,
                    },
                );
                format!("exit {} code {code}: {exited}", handle.id)
            }
            50..=54 => {
                self.store_failing = !self.store_failing;
                self.store.fail_writes(self.store_failing);
                format!("store failing {}", self.store_failing)
            }
            55..=57 => {
                self.crash().await;
                "crash and restore".into()
            }
            _ => {
                let ms = if self.rng.u8(0..4) == 0 {
                    self.rng.u64(1_000..=60_000)
                } else {
                    self.rng.u64(1..=1_000)
                };
                tokio::time::sleep(Duration::from_millis(ms)).await;
                format!("advance {ms}ms")
            }
        }
    }

    fn random_task(&mut self, alloc: &str) -> Option<Name> {
        let declared = self.declared.get(alloc)?;
        let tasks = &declared.shape.tasks;
        let task = &tasks[self.rng.usize(..tasks.len())];
        self.rng.bool().then(|| name(task.name))
    }

    /// The agent leaves (its tasks keep running, whatever the store failed to write is
    /// lost), and a new one restores over the surviving store; then the specs dir is
    /// listed again, as the agent's source does.
    async fn crash(&mut self) {
        self.node.shutdown(Shutdown::Detach).await;
        self.node = new_node(
            self.seed,
            self.clock,
            &self.mock,
            &self.store,
            self.planted_bug,
        );
        let report = self.node.restore().expect("restore reads the store");
        for (restored, _) in &report.allocs {
            if !self.declared.contains_key(restored.as_str()) {
                self.node.remove(restored);
            }
        }
        for (alloc, declared) in &self.declared {
            self.node.apply(declared.spec.clone());
            if declared.broken {
                self.node
                    .set_spec_error(&name(alloc), Some("sim.yaml:1:1: spec: broken".into()));
            }
        }
    }

    /// The observable outcome of a step: every status with its times, and what runs.
    fn observe(&self, what: &str) -> String {
        let mut line = format!("{} {what} |", self.clock.now());
        for status in self.node.statuses() {
            let _ = write!(line, " {}={}", status.id, status.client_status);
            for (task, t) in &status.tasks {
                let _ = write!(
                    line,
                    " {task}:{}:{}:{}:{:?}",
                    t.state,
                    t.restarts,
                    t.failed,
                    t.events.last().map(|e| (e.event_type.as_str(), e.time))
                );
            }
        }
        let mut running: Vec<String> = self.mock.running().into_iter().map(|h| h.id).collect();
        running.sort();
        let _ = write!(line, " | running {running:?}");
        line
    }

    /// Every invariant that must hold after any step.
    fn check(&self) -> Result<(), String> {
        // Never two revisions of one alloc with live tasks (read from the driver's world).
        let mut live: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        let running = self.mock.running();
        for handle in &running {
            let id = handle_alloc_id(&handle.id);
            live.entry(alloc_name_of(id)).or_default().insert(id);
        }
        // No task runs twice: one live run per task of a revision.
        let mut runs: BTreeSet<&str> = BTreeSet::new();
        for handle in &running {
            let task = handle
                .id
                .rsplit_once('/')
                .map_or(handle.id.as_str(), |(task, _)| task);
            if !runs.insert(task) {
                return Err(format!("{task} has two live runs"));
            }
        }
        for (alloc, ids) in &live {
            if ids.len() > 1 {
                return Err(format!("two revisions of {alloc} run at once: {ids:?}"));
            }
        }
        for status in self.node.statuses() {
            let shape = self.declared.get(status.name.as_str()).map(|d| &d.shape);
            for (task, t) in &status.tasks {
                if t.events.len() > MAX_EVENTS {
                    return Err(format!(
                        "{}/{task} keeps {} events, over the cap of {MAX_EVENTS}",
                        status.id,
                        t.events.len()
                    ));
                }
                // Restart delays and counts within the policy, for the declared revision.
                let Some(shape) = shape.filter(|_| {
                    self.declared
                        .get(status.name.as_str())
                        .map(|d| d.spec.id.to_string())
                        == Some(status.id.clone())
                }) else {
                    continue;
                };
                if shape.mode_delay {
                    continue;
                }
                let delay = Duration::from_secs(shape.delay_s);
                let mut policy_restarts = Vec::new();
                for event in t.events.iter().filter(|e| e.event_type == "Restarting") {
                    let Some(after) = event.message.strip_prefix("Task restarting in ") else {
                        continue;
                    };
                    let after: Duration = after
                        .parse::<stead_schemas::Duration>()
                        .map_err(|e| format!("unreadable restart delay {after}: {e}"))?
                        .into();
                    if after.is_zero() {
                        continue; // a user's restart
                    }
                    let most = delay + delay / 4 + Duration::from_millis(10);
                    if after < delay || after > most {
                        return Err(format!(
                            "{}/{task} restarts in {after:?}, outside [{delay:?}, {most:?}]",
                            status.id
                        ));
                    }
                    policy_restarts.push(event.time);
                }
                // The window resets once per interval, so any interval holds at most two
                // windows' worth of restarts.
                let most = 2 * shape.attempts as usize;
                for (i, first) in policy_restarts.iter().enumerate() {
                    let within = policy_restarts[i..]
                        .iter()
                        .filter(|t| t.saturating_duration_since(*first) < INTERVAL)
                        .count();
                    if within > most {
                        return Err(format!(
                            "{}/{task} restarted {within} times within {INTERVAL:?}, attempts {}",
                            status.id, shape.attempts
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Faults stop and every declared alloc gets a runnable spec: within the bound, each
    /// runs its declared revision's every task, and nothing else runs.
    async fn converge(&mut self) -> Result<(), String> {
        self.store_failing = false;
        self.store.fail_writes(false);
        for alloc in NAMES {
            if self.declared.contains_key(alloc) {
                self.apply(alloc, true);
            }
        }
        let expected: BTreeMap<String, (String, usize)> = self
            .declared
            .iter()
            .map(|(alloc, d)| {
                (
                    (*alloc).to_owned(),
                    (d.spec.id.to_string(), d.shape.tasks.len()),
                )
            })
            .collect();
        let mock = self.mock.clone();
        let converged = |node: &Node| {
            let mut running: BTreeMap<String, usize> = BTreeMap::new();
            for handle in mock.running() {
                *running
                    .entry(handle_alloc_id(&handle.id).to_owned())
                    .or_default() += 1;
            }
            let wanted: BTreeMap<String, usize> = expected.values().cloned().collect();
            running == wanted
                && expected.iter().all(|(alloc, (id, _))| {
                    node.status(alloc).is_some_and(|s| {
                        &s.id == id
                            && s.client_status == "running"
                            && s.tasks.values().all(|t| t.state == "running")
                    })
                })
        };
        if self.node.wait_until(CONVERGENCE_BOUND, converged).await {
            Ok(())
        } else {
            Err(format!(
                "not converged within {CONVERGENCE_BOUND:?}: want {expected:?}, have {}",
                self.observe("converge")
            ))
        }
    }

    fn record(&mut self, line: String) {
        if std::env::var("STEAD_SIM_VERBOSE").is_ok() {
            println!("{line}");
        }
        line.hash(&mut self.hasher);
        self.trace.push_str(&line);
        self.trace.push('\n');
    }
}

/// The outcome of one seed: its trace hash, or the failure with the trace up to it.
struct Outcome {
    hash: u64,
    trace: String,
    failure: Option<String>,
}

fn run_seed(seed: u64, steps: usize) -> Outcome {
    run_seed_with(seed, steps, false)
}

fn run_seed_with(seed: u64, steps: usize, planted_bug: bool) -> Outcome {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let mut sim = Sim::new(seed, planted_bug);
        let mut failure = None;
        for i in 0..steps {
            let Ok(what) = tokio::time::timeout(STEP_BOUND, sim.step()).await else {
                failure = Some(format!(
                    "step {i} did not finish within {STEP_BOUND:?} of simulated time"
                ));
                break;
            };
            // Let every woken worker run before looking.
            tokio::time::sleep(Duration::from_millis(1)).await;
            let line = format!("{i} {}", sim.observe(&what));
            sim.record(line);
            if let Err(why) = sim.check() {
                failure = Some(format!("step {i}: {why}"));
                break;
            }
        }
        if failure.is_none() {
            failure = sim.converge().await.err();
            let line = sim.observe("converged");
            sim.record(line);
        }
        sim.node.shutdown(Shutdown::Detach).await;
        Outcome {
            hash: sim.hasher.finish(),
            trace: sim.trace,
            failure,
        }
    })
}

fn env_number(key: &str) -> Option<u64> {
    let value = std::env::var(key).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|e| panic!("{key}={value}: {e}")),
    )
}

fn steps() -> usize {
    env_number("STEAD_SIM_STEPS").map_or(DEFAULT_STEPS, |n| n as usize)
}

/// Runs `seed`, panicking with the one line that replays it when an invariant breaks
/// (or the node panics).
fn check_seed(seed: u64, steps: usize) -> u64 {
    let outcome = std::panic::catch_unwind(|| run_seed(seed, steps));
    let replay = format!(
        "replay: STEAD_SIM_SEED={seed} STEAD_SIM_STEPS={steps} cargo test -p stead-tests --test scenarios -- sim::"
    );
    match outcome {
        Ok(Outcome {
            hash,
            failure: None,
            ..
        }) => hash,
        Ok(Outcome {
            trace,
            failure: Some(why),
            ..
        }) => {
            let tail: Vec<&str> = trace.lines().rev().take(8).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!(
                "seed {seed}: {why}\nlast steps:\n{}\n{replay}",
                tail.join("\n")
            )
        }
        Err(_) => panic!("seed {seed} panicked (message above)\n{replay}"),
    }
}

#[test]
fn every_seeded_history_keeps_the_invariants_and_converges_once_faults_stop() {
    let steps = steps();
    if let Some(seed) = env_number("STEAD_SIM_SEED") {
        let outcome = run_seed(seed, steps);
        println!("{}", outcome.trace);
        check_seed(seed, steps);
        return;
    }
    let seeds = env_number("STEAD_SIM_SEEDS").unwrap_or(DEFAULT_SEEDS);
    let first = env_number("STEAD_SIM_FIRST_SEED").unwrap_or(0);
    let started = std::time::Instant::now();
    // Seeds are independent, each on its own single-threaded runtime: they are shared
    // out over the cores (a seed's own history stays on one thread).
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    std::thread::scope(|scope| {
        for thread in 0..threads {
            scope.spawn(move || {
                for seed in (first..first + seeds).filter(|seed| seed % threads == thread) {
                    if std::env::var("STEAD_SIM_VERBOSE").is_ok() {
                        println!("sim: seed {seed}");
                    }
                    check_seed(seed, steps);
                }
            });
        }
    });
    let elapsed = started.elapsed();
    println!(
        "sim: {seeds} seeds of {steps} steps in {elapsed:.1?} ({:.0} seeds/s)",
        seeds as f64 / elapsed.as_secs_f64()
    );
}

#[test]
fn the_same_seed_gives_the_same_trace_twice() {
    let steps = steps();
    for seed in [1, 2, 3, 42] {
        let first = run_seed(seed, steps);
        let second = run_seed(seed, steps);
        if first.hash != second.hash {
            let diverged = first
                .trace
                .lines()
                .zip(second.trace.lines())
                .find(|(a, b)| a != b);
            panic!("seed {seed} is not deterministic; first divergence: {diverged:#?}");
        }
    }
}

#[test]
fn a_planted_bug_starting_a_new_revision_before_the_old_is_terminal_is_caught_within_100_seeds() {
    let caught = (0..100).find_map(|seed| {
        let outcome = run_seed_with(seed, DEFAULT_STEPS, true);
        outcome.failure.map(|why| (seed, why))
    });
    let (seed, why) = caught.expect("the planted bug escapes 100 seeds");
    println!("the planted bug is caught by seed {seed}: {why}");
    assert!(why.contains("two revisions"), "seed {seed}: {why}");
}

/// Runs `seed` on a thread of its own and fails when it does not finish within a minute
/// of real time: a worker that spins keeps paused time from advancing, so the seed's own
/// bounds never fire.
fn check_seed_within_a_minute(seed: u64, steps: usize) {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(std::panic::catch_unwind(|| check_seed(seed, steps)));
    });
    match finished.recv_timeout(Duration::from_secs(60)) {
        Ok(Ok(_)) => {}
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("seed {seed} did not finish within a minute: a worker spins"),
    }
}

#[test]
fn a_worker_whose_state_came_back_to_what_is_stored_drops_its_retry_and_does_not_spin() {
    check_seed_within_a_minute(1084, 100);
}
