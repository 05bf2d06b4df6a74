//! Deterministic simulation of the fleet's desired loop (issue 32, point 4): a seed drives
//! hundreds of random steps (valid, broken and misnamed specs put under this node's keys,
//! `_all`'s and other nodes'; deletes and transactions; compactions; disconnects that
//! refuse or hang; watches ended or cancelled; progress notices; time advanced, past the
//! relisting period now and then) against an in-memory etcd, while the real desired loop
//! ([`Fleet::start_desired`]) follows it on one current-thread runtime under paused time,
//! and what it publishes is fed, as the agent's loop does, through `Listing::add_fleet` to
//! a `Syncer` and a real node with the mock driver. Every invariant is checked after every
//! step, and each seed's history reduces to a trace hash that the same seed reproduces.
//!
//! The invariants:
//! - the published revision never goes backwards;
//! - what is published is the store's state at its revision: this node's keys and
//!   `_all`'s, each with its value, and no other (nothing lost, stale or foreign);
//! - [`FAULT_FREE_BOUND`] after the last fault (a disconnect, a reconnect, a watch ended,
//!   a compaction, a restart) with the store in reach, what is published holds every write older
//!   than [`PROPAGATION_BOUND`], and the node's health says the fleet is in step; as long
//!   out of reach, it says the fleet is degraded;
//! - at the end, faults stopped and every key given a valid spec, the node runs exactly
//!   the allocs the keys declare (a node's own key over `_all`'s, `_all`'s only where its
//!   selector picks the node), each at its key's revision, within [`NODE_BOUND`].
//!
//! `STEAD_FLEET_SIM_SEED=n` replays one seed (printing its trace), `STEAD_FLEET_SIM_SEEDS=n`
//! runs that many, `STEAD_FLEET_SIM_STEPS=n` sets the steps per seed,
//! `STEAD_FLEET_SIM_FIRST_SEED=n` where they start, and `STEAD_FLEET_SIM_VERBOSE` prints
//! each seed and step as it happens.
//!
//! What the simulator found in the product:
//! - the desired loop's `select!`s were unbiased, so a listing falling due at the instant a
//!   watch message came was taken or not by a coin toss of tokio's, and seed 1 did not
//!   replay (`the_same_fleet_seed_gives_the_same_trace_twice`); they are biased now, the
//!   listing due first. No seed has broken an invariant of the loop's since (seeds kept
//!   as regression tests: none).

mod memory_etcd;

use crate::sim_support::{self, Outcome, env_number};

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stead_controller::clock::Clock;
use stead_controller::driver::mock::MockDriver;
use stead_controller::driver::{Driver, Drivers};
use stead_controller::fleet::{
    DesiredLoopOptions, Fleet, FleetDesired, FleetKeys, FleetNode, FleetSettings, RELIST_PERIOD,
    Target,
};
use stead_controller::node::{Node, NodeConfig};
use stead_controller::queue::Shutdown;
use stead_controller::source::{Listing, Syncer};
use stead_controller::store::MemoryStore;
use stead_schemas::{Timestamp, ValidSpec};
use tokio::sync::watch;

use memory_etcd::{Ending, MemoryEtcd, Outage};

/// 2026-11-22T00:00:00Z, as in the other scenarios.
const START: Duration = Duration::from_secs(1_795_305_600);
/// The fleet's prefix.
const PREFIX: &str = "/sim";
/// This node.
const NODE: &str = "n1";
/// The alloc names the keys draw from: few, so edits and deletes hit live keys.
const NAMES: [&str; 3] = ["a", "b", "c"];
/// Keys the node must never run from: another node's (one whose name starts with this
/// node's), a name that is not valid, a deeper path, a status key.
const FOREIGN: [&str; 5] = [
    "/sim/desired/n2/a",
    "/sim/desired/n10/b",
    "/sim/desired/n1/Bad",
    "/sim/desired/n1/a/deep",
    "/sim/status/n1/a",
];
/// How long after the last fault, with the store in reach, what is published is the
/// store's newest state: a listing that hangs is given up after the loop's listing
/// timeout (10 s), then the retry waits at most the backoff's ceiling (2 s); with margin.
const FAULT_FREE_BOUND: Duration = Duration::from_secs(15);
/// A write reaches what is published within this much simulated time while the watch
/// streams: a few milliseconds of the in-memory etcd's latency, with margin.
const PROPAGATION_BOUND: Duration = Duration::from_millis(100);
/// Once the published keys are the store's newest, the node runs exactly what they
/// declare within this much simulated time: the longest kill timeout (1 s) plus one tick
/// (10 s), with margin.
const NODE_BOUND: Duration = Duration::from_secs(30);
/// No step takes longer than this much simulated time (the longest advances 700 s).
const STEP_BOUND: Duration = Duration::from_secs(900);
/// Steps per seed in `make test`.
const DEFAULT_STEPS: usize = 80;
/// Seeds in `make test`.
const DEFAULT_SEEDS: u64 = 200;

/// A valid spec of alloc `name`; `zone` sets a `nodeSelector` (this node is in zone a).
fn spec_yaml(name: &str, generation: u32, zone: Option<&str>) -> String {
    let selector = zone.map_or(String::new(), |zone| {
        format!(", nodeSelector: {{zone: {zone}}}")
    });
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}{selector}}}\nspec:\n  tasks:\n    - {{name: t, driver: mock, killTimeout: 1s, env: {{GEN: \"{generation}\"}}, config: {{}}}}\n"
    )
}

/// The spec `value` at `key` declares, when it is one valid spec of the key's alloc.
fn valid_spec(key: &str, value: &[u8]) -> Option<ValidSpec> {
    let text = std::str::from_utf8(value).ok()?;
    let file = stead_schemas::parse_spec_file(&FleetKeys::path_of(key), text);
    if !file.is_valid() || file.documents.len() != 1 {
        return None;
    }
    let spec = file.specs().next()?;
    let name = key.rsplit('/').next()?;
    (spec.spec.metadata.name.as_str() == name).then(|| spec.clone())
}

/// One simulated history.
struct Sim {
    rng: fastrand::Rng,
    clock: Clock,
    etcd: MemoryEtcd,
    keys: FleetKeys,
    settings: FleetSettings,
    fleet: Option<Fleet>,
    desired: watch::Receiver<Option<Arc<FleetDesired>>>,
    /// Every value published since the last check, in order (taken by a task of its
    /// own as each is published: the loop yields at every publish, writing its
    /// checkpoint).
    publishes: Arc<Mutex<Vec<Arc<FleetDesired>>>>,
    node: Arc<Node>,
    mock: MockDriver,
    syncer: Syncer,
    /// The agent's data dir (the desired checkpoint).
    data_dir: tempfile::TempDir,
    options: DesiredLoopOptions,
    /// The revision last published.
    published: i64,
    /// When the last fault happened.
    last_fault: tokio::time::Instant,
    generation: u32,
    /// The store's revision after each step, with when.
    history: Vec<(tokio::time::Instant, i64)>,
    trace: String,
    hasher: std::collections::hash_map::DefaultHasher,
}

impl Sim {
    fn new(seed: u64, planted_bug: bool) -> Self {
        let clock = Clock::starting_at(Timestamp::from_since_epoch(START));
        let mock = MockDriver::new(clock);
        let drivers = Drivers::new([Arc::new(mock.clone()) as Arc<dyn Driver>]);
        let config = NodeConfig {
            seed: Some(seed),
            ..NodeConfig::default()
        };
        let node = Arc::new(Node::new(
            config,
            drivers,
            Arc::new(MemoryStore::new()),
            clock,
        ));
        let keys = FleetKeys::new(PREFIX);
        let settings = FleetSettings {
            endpoints: Vec::new(),
            keys: keys.clone(),
            node: FleetNode {
                name: NODE.to_owned(),
                labels: BTreeMap::from([("zone".to_owned(), "a".to_owned())]),
            },
        };
        let etcd = MemoryEtcd::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let data_dir = tempfile::tempdir().expect("a data dir");
        let options = DesiredLoopOptions {
            seed: Some(seed),
            plant_revision_from_creation: planted_bug,
        };
        let fleet = Fleet::start_desired(
            etcd.clone(),
            settings.clone(),
            node.clone(),
            clock,
            data_dir.path(),
            options,
        );
        Sim {
            rng: fastrand::Rng::with_seed(seed),
            clock,
            etcd,
            keys,
            settings,
            desired: fleet.desired(),
            publishes: record_publishes(fleet.desired(), Arc::default()),
            fleet: Some(fleet),
            node,
            mock,
            syncer: Syncer::new(std::iter::empty()),
            data_dir,
            options,
            published: 0,
            last_fault: clock.instant(),
            generation: 0,
            history: Vec::new(),
            trace: String::new(),
            hasher: std::collections::hash_map::DefaultHasher::new(),
        }
    }

    /// A key this node runs from: its own or `_all`'s.
    fn random_key(&mut self) -> String {
        let name = NAMES[self.rng.usize(..NAMES.len())];
        let target = match self.rng.bool() {
            true => Target::Node(NODE.to_owned()),
            false => Target::All,
        };
        self.keys
            .desired_key(&target, &name.parse().expect("a valid name"))
    }

    /// A valid spec for `key`, with a selector now and then (zone a picks this node).
    fn valid_value(&mut self, key: &str) -> Vec<u8> {
        self.generation += 1;
        let name = key.rsplit('/').next().expect("a key names its alloc");
        let zone = match self.rng.u8(0..6) {
            0 => Some("a"),
            1 => Some("b"),
            _ => None,
        };
        spec_yaml(name, self.generation, zone).into_bytes()
    }

    /// A value that is no valid spec of `key`'s alloc.
    fn broken_value(&mut self, key: &str) -> Vec<u8> {
        self.generation += 1;
        let name = key.rsplit('/').next().expect("a key names its alloc");
        match self.rng.u8(0..5) {
            0 => b"metadata: [\n".to_vec(),
            1 => Vec::new(),
            2 => vec![0xff, 0xfe, b'\n'],
            3 => spec_yaml("zz", self.generation, None).into_bytes(),
            _ => format!(
                "{}---\n{}",
                spec_yaml(name, self.generation, None),
                spec_yaml(name, self.generation, None)
            )
            .into_bytes(),
        }
    }

    fn fault(&mut self) {
        self.last_fault = self.clock.instant();
    }

    /// One random step; returns what it did, for the trace.
    async fn step(&mut self) -> String {
        let roll = self.rng.u8(0..100);
        match roll {
            0..=24 => {
                let key = self.random_key();
                let value = self.valid_value(&key);
                let at = self.etcd.txn(&[(&key, Some(&value))]);
                format!("put {key} @{at}")
            }
            25..=31 => {
                let key = self.random_key();
                let value = self.broken_value(&key);
                let at = self.etcd.txn(&[(&key, Some(&value))]);
                format!("put broken {key} @{at}")
            }
            32..=41 => {
                let key = self.random_key();
                let at = self.etcd.txn(&[(&key, None)]);
                format!("delete {key} @{at}")
            }
            42..=45 => {
                let count = self.rng.usize(2..=3);
                let mut writes: Vec<(String, Option<Vec<u8>>)> = Vec::new();
                for _ in 0..count {
                    let key = self.random_key();
                    let value = match self.rng.u8(0..4) {
                        0 => None,
                        1 => Some(self.broken_value(&key)),
                        _ => Some(self.valid_value(&key)),
                    };
                    writes.push((key, value));
                }
                let borrowed: Vec<(&str, Option<&[u8]>)> = writes
                    .iter()
                    .map(|(key, value)| (key.as_str(), value.as_deref()))
                    .collect();
                let at = self.etcd.txn(&borrowed);
                let keys: Vec<&str> = writes.iter().map(|(key, _)| key.as_str()).collect();
                format!("txn {keys:?} @{at}")
            }
            46..=49 => {
                let key = FOREIGN[self.rng.usize(..FOREIGN.len())];
                self.generation += 1;
                let value = match self.rng.bool() {
                    true => Some(spec_yaml("a", self.generation, None).into_bytes()),
                    false => None,
                };
                let at = self.etcd.txn(&[(key, value.as_deref())]);
                format!("foreign {key} @{at}")
            }
            50..=54 => {
                let (low, high) = (self.etcd.compacted(), self.etcd.revision());
                let at = match self.rng.bool() {
                    true => high,
                    false => self.rng.i64(low..=high),
                };
                let compacted = self.etcd.compact(at);
                self.fault();
                format!("compact at {compacted}")
            }
            55..=59 => {
                self.fault();
                match self.etcd.outage() {
                    Some(_) => {
                        self.etcd.reconnect();
                        "reconnect".to_owned()
                    }
                    None => {
                        let outage = match self.rng.bool() {
                            true => Outage::Refuse,
                            false => Outage::Hang,
                        };
                        let ending = match self.rng.bool() {
                            true => Ending::Fail,
                            false => Ending::End,
                        };
                        self.etcd.disconnect(outage, ending);
                        format!("disconnect {outage:?}, watches {ending:?}")
                    }
                }
            }
            60..=62 => {
                self.fault();
                let ending = [Ending::Fail, Ending::End, Ending::Cancel][self.rng.usize(..3)];
                let open = self.etcd.end_watches(ending);
                format!("end {open} watches {ending:?}")
            }
            63..=66 => {
                let open = self.etcd.request_progress();
                format!("progress to {open} watches")
            }
            67 => {
                self.fault();
                self.restart().await;
                "restart the desired loop".to_owned()
            }
            _ => {
                let ms = match self.rng.u8(0..20) {
                    0 => RELIST_PERIOD.as_millis() as u64 + self.rng.u64(0..=100_000),
                    1..=5 => self.rng.u64(1_000..=15_000),
                    _ => self.rng.u64(1..=1_000),
                };
                tokio::time::sleep(Duration::from_millis(ms)).await;
                format!("advance {ms}ms")
            }
        }
    }

    /// The agent restarts its fleet source: the loop stops, wherever it was, and a new
    /// one starts from the checkpoint in the data dir.
    async fn restart(&mut self) {
        if let Some(fleet) = self.fleet.take() {
            fleet.stop().await;
        }
        // A checkpoint being written when the loop stopped lands first: paused time
        // does not advance while the blocking pool works.
        tokio::time::sleep(Duration::from_millis(1)).await;
        let fleet = Fleet::start_desired(
            self.etcd.clone(),
            self.settings.clone(),
            self.node.clone(),
            self.clock,
            self.data_dir.path(),
            self.options,
        );
        self.desired = fleet.desired();
        self.desired.mark_changed();
        // What the new source starts with (the checkpoint) is published too.
        if let Some(kept) = self.desired.borrow().clone() {
            self.publishes.lock().expect("the publishes").push(kept);
        }
        record_publishes(fleet.desired(), self.publishes.clone());
        self.fleet = Some(fleet);
    }

    /// Hands what was published to the node, as the agent's loop does at each change:
    /// the (empty) specs dir's listing with the fleet's keys added after it.
    fn feed_node(&mut self) {
        if !self.desired.has_changed().unwrap_or(false) {
            return;
        }
        let desired = self.desired.borrow_and_update().clone();
        let mut listing = Listing::default();
        listing.add_fleet(desired.as_deref(), &self.keys, &self.settings.node);
        self.syncer.sync(&self.node, &listing);
    }

    /// The keys this node runs from in `state`, each value as the loop reads it.
    fn runs_from(&self, state: &BTreeMap<Vec<u8>, Vec<u8>>) -> BTreeMap<String, String> {
        state
            .iter()
            .filter_map(|(key, value)| {
                let key = std::str::from_utf8(key).ok()?;
                match self.keys.parse_desired(key)? {
                    (Target::All, _) => {}
                    (Target::Node(node), _) if node == NODE => {}
                    (Target::Node(_), _) => return None,
                }
                Some((key.to_owned(), String::from_utf8_lossy(value).into_owned()))
            })
            .collect()
    }

    /// What is published now: its revision and entries; `None` before any listing.
    fn published(&self) -> Option<(i64, BTreeMap<String, String>)> {
        let desired = self.desired.borrow().clone()?;
        Some((
            desired.revision,
            desired
                .entries()
                .map(|(key, value)| (key.to_owned(), value.to_owned()))
                .collect(),
        ))
    }

    /// Every invariant that must hold after any step.
    fn check(&mut self) -> Result<(), String> {
        let publishes = std::mem::take(&mut *self.publishes.lock().expect("the publishes"));
        let newest = self.etcd.revision();
        for published in publishes {
            let revision = published.revision;
            if revision < self.published {
                return Err(format!(
                    "the published revision went back from {} to {revision}",
                    self.published
                ));
            }
            self.published = revision;
            if revision > newest {
                return Err(format!(
                    "published revision {revision} is past the store's {newest}"
                ));
            }
            let entries: BTreeMap<String, String> = published
                .entries()
                .map(|(key, value)| (key.to_owned(), value.to_owned()))
                .collect();
            let at = self.runs_from(&self.etcd.state_at(revision));
            if entries != at {
                return Err(format!(
                    "what is published at revision {revision} is not the store's state then: {}",
                    difference(&entries, &at)
                ));
            }
        }
        let quiet = self.clock.instant().duration_since(self.last_fault);
        let health = self.node.fleet_health().flatten();
        match (self.etcd.outage(), &health) {
            (None, Some(why)) if quiet >= FAULT_FREE_BOUND => {
                return Err(format!(
                    "{quiet:?} after the last fault, the fleet still shows degraded: {why}"
                ));
            }
            (Some(_), None) if quiet >= FAULT_FREE_BOUND => {
                return Err(format!(
                    "{quiet:?} out of etcd's reach, the fleet does not show degraded"
                ));
            }
            _ => {}
        }
        let Some((revision, entries)) = self.published() else {
            return Ok(());
        };
        // Every write older than the propagation bound is in what is published (whose
        // revision lags when only other nodes' keys changed since).
        let due = self.clock.instant() - PROPAGATION_BOUND;
        let written = self
            .history
            .iter()
            .take_while(|(at, _)| *at <= due)
            .last()
            .map_or(0, |(_, revision)| *revision);
        if self.etcd.outage().is_none()
            && quiet >= FAULT_FREE_BOUND
            && !(written.max(revision)..=newest)
                .any(|r| self.runs_from(&self.etcd.state_at(r)) == entries)
        {
            let now = self.runs_from(&self.etcd.state_at(newest));
            return Err(format!(
                "{quiet:?} after the last fault, what is published (revision {revision}) is not the store's state at or after revision {written}, written {PROPAGATION_BOUND:?} ago: {}",
                difference(&entries, &now)
            ));
        }
        Ok(())
    }

    /// Faults stop and every key this node runs from gets a valid spec: within the
    /// bounds, what is published is the store's newest state, and the node runs exactly
    /// what it declares.
    async fn converge(&mut self) -> Result<(), String> {
        if self.etcd.outage().is_some() {
            self.etcd.reconnect();
            self.fault();
        }
        let newest = self.etcd.state_at(self.etcd.revision());
        let mut writes: Vec<(String, Vec<u8>)> = Vec::new();
        for (key, value) in self.runs_from(&newest) {
            if valid_spec(&key, value.as_bytes()).is_none() {
                let value = self.valid_value(&key);
                writes.push((key, value));
            }
        }
        for (key, value) in &writes {
            self.etcd.txn(&[(key, Some(value))]);
        }
        let newest = self.etcd.state_at(self.etcd.revision());
        let wanted = self.runs_from(&newest);
        let deadline = self.clock.instant() + FAULT_FREE_BOUND;
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            self.feed_node();
            self.check()?;
            if self
                .published()
                .is_some_and(|(_, entries)| entries == wanted)
            {
                break;
            }
            if self.clock.instant() >= deadline {
                let have = self.published().map(|(_, entries)| entries);
                return Err(format!(
                    "faults stopped, yet what is published is not the store's newest state within {FAULT_FREE_BOUND:?}: {}",
                    difference(&have.unwrap_or_default(), &wanted)
                ));
            }
        }
        // A node's own key over `_all`'s; `_all`'s only where its selector picks the node.
        let mut expected: BTreeSet<String> = BTreeSet::new();
        for name in NAMES {
            let own = self.keys.desired_key(
                &Target::Node(NODE.to_owned()),
                &name.parse().expect("a name"),
            );
            let all = self
                .keys
                .desired_key(&Target::All, &name.parse().expect("a name"));
            let spec = |key: &str| {
                let value = wanted.get(key)?;
                Some(valid_spec(key, value.as_bytes()).expect("a valid spec"))
            };
            let labels = &self.settings.node.labels;
            let runs =
                spec(&own).or_else(|| spec(&all).filter(|spec| spec.spec.metadata.selects(labels)));
            if let Some(spec) = runs {
                expected.insert(spec.id.to_string());
            }
        }
        let mock = self.mock.clone();
        let converged = |node: &Node| {
            let running: BTreeSet<String> = mock
                .running()
                .iter()
                .map(|handle| handle.id.split('/').next().unwrap_or_default().to_owned())
                .collect();
            // A removed alloc's status stays, terminal, until it is collected.
            running == expected
                && node.statuses().iter().all(|status| {
                    let terminal = ["complete", "failed"].contains(&&*status.client_status);
                    match expected.contains(&status.id) {
                        true => status.client_status == "running",
                        false => terminal,
                    }
                })
                && expected
                    .iter()
                    .all(|id| node.statuses().iter().any(|s| &s.id == id))
        };
        if self.node.wait_until(NODE_BOUND, converged).await {
            Ok(())
        } else {
            Err(format!(
                "the node does not run what the keys declare within {NODE_BOUND:?}: want {expected:?}, have {}",
                self.observe("converge")
            ))
        }
    }

    /// The observable outcome of a step: the store, what is published, the node.
    fn observe(&self, what: &str) -> String {
        let mut line = format!(
            "{} {what} | store @{} compacted {} {:?} |",
            self.clock.now(),
            self.etcd.revision(),
            self.etcd.compacted(),
            self.etcd.outage()
        );
        match self.published() {
            Some((revision, entries)) => {
                let _ = write!(line, " published @{revision} {:?} |", entries.keys());
            }
            None => line.push_str(" nothing published |"),
        }
        for status in self.node.statuses() {
            let _ = write!(line, " {}={}", status.id, status.client_status);
        }
        line
    }

    fn record(&mut self, line: String) {
        if std::env::var("STEAD_FLEET_SIM_VERBOSE").is_ok() {
            println!("{line}");
        }
        line.hash(&mut self.hasher);
        self.trace.push_str(&line);
        self.trace.push('\n');
    }
}

/// Collects every value `desired` takes, in order, from a task of its own.
fn record_publishes(
    mut desired: watch::Receiver<Option<Arc<FleetDesired>>>,
    publishes: Arc<Mutex<Vec<Arc<FleetDesired>>>>,
) -> Arc<Mutex<Vec<Arc<FleetDesired>>>> {
    let record = publishes.clone();
    tokio::spawn(async move {
        while desired.changed().await.is_ok() {
            let value = desired.borrow_and_update().clone();
            if let Some(value) = value {
                record.lock().expect("the publishes").push(value);
            }
        }
    });
    publishes
}

/// How two key sets differ: keys only in `have`, only in `want`, and with other values.
fn difference(have: &BTreeMap<String, String>, want: &BTreeMap<String, String>) -> String {
    let extra: Vec<&String> = have.keys().filter(|k| !want.contains_key(*k)).collect();
    let missing: Vec<&String> = want.keys().filter(|k| !have.contains_key(*k)).collect();
    let stale: Vec<&String> = have
        .iter()
        .filter(|(k, v)| want.get(*k).is_some_and(|w| w != *v))
        .map(|(k, _)| k)
        .collect();
    format!("extra {extra:?}, missing {missing:?}, stale {stale:?}")
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
            sim.history.push((sim.clock.instant(), sim.etcd.revision()));
            // Let the loop take what the step changed before looking.
            tokio::time::sleep(Duration::from_millis(1)).await;
            sim.feed_node();
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
        if let Some(fleet) = sim.fleet.take() {
            fleet.stop().await;
        }
        sim.node.shutdown(Shutdown::Detach).await;
        Outcome {
            hash: sim.hasher.finish(),
            trace: sim.trace,
            failure,
        }
    })
}

fn steps() -> usize {
    env_number("STEAD_FLEET_SIM_STEPS").map_or(DEFAULT_STEPS, |n| n as usize)
}

/// Runs `seed`, panicking with the one line that replays it when an invariant breaks
/// (or the loop panics).
fn check_seed(seed: u64, steps: usize) -> u64 {
    let outcome = std::panic::catch_unwind(|| run_seed(seed, steps));
    let replay = format!(
        "replay: STEAD_FLEET_SIM_SEED={seed} STEAD_FLEET_SIM_STEPS={steps} cargo test -p stead-tests --test scenarios -- sim_fleet::"
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
fn every_seeded_fleet_history_publishes_the_stores_state_and_converges_once_faults_stop() {
    let steps = steps();
    if let Some(seed) = env_number("STEAD_FLEET_SIM_SEED") {
        let outcome = run_seed(seed, steps);
        println!("{}", outcome.trace);
        check_seed(seed, steps);
        return;
    }
    let seeds = env_number("STEAD_FLEET_SIM_SEEDS").unwrap_or(DEFAULT_SEEDS);
    let first = env_number("STEAD_FLEET_SIM_FIRST_SEED").unwrap_or(0);
    sim_support::run_seeds(
        &format!("sim_fleet: {steps} steps a seed"),
        first,
        seeds,
        "STEAD_FLEET_SIM_VERBOSE",
        |seed| {
            std::panic::catch_unwind(|| check_seed(seed, steps)).map_err(|panic| {
                panic
                    .downcast_ref::<String>()
                    .cloned()
                    .unwrap_or_else(|| format!("seed {seed} panicked"))
            })
        },
    );
}

#[test]
fn the_same_fleet_seed_gives_the_same_trace_twice() {
    let steps = steps();
    sim_support::assert_each_seed_replays(&[1, 2, 3, 42], |seed| {
        let outcome = run_seed(seed, steps);
        assert!(
            outcome.failure.is_none(),
            "seed {seed}: {:?}",
            outcome.failure
        );
        outcome
    });
}

#[test]
fn a_planted_bug_taking_the_watch_revision_from_its_creation_is_caught_within_100_seeds() {
    let caught = (0..100).find_map(|seed| {
        let outcome = run_seed_with(seed, DEFAULT_STEPS, true);
        outcome.failure.map(|why| (seed, why))
    });
    let (seed, why) = caught.expect("the planted bug escapes 100 seeds");
    println!("the planted bug is caught by seed {seed}: {why}");
    assert!(
        why.contains("is not the store's state then"),
        "seed {seed}: {why}"
    );
}
