//! The fleet source: desired allocs from etcd beside the specs dir, status written back,
//! and the node's claim under a lease.
//!
//! Three loops share one etcd client and report into the node's health:
//! - the desired loop lists `desired/` (this node's keys and `_all`'s), then watches from
//!   the listed revision + 1, tracking the next revision from every response (the client
//!   does not resume watches): a dropped stream is watched again from it, with backoff and
//!   jitter; a compacted revision is listed again; a full listing comes every
//!   [`RELIST_PERIOD`] as a safety net. Every change is kept in
//!   `<dataDir>/fleet-desired.json` and handed to the agent's loop, which adds it to the
//!   specs dir's listing for the one `Syncer`;
//! - the status loop writes `status/<node>/<alloc>` when an alloc's status changed (at
//!   most once per alloc per [`STATUS_INTERVAL`]), deletes the keys of allocs gone, and
//!   keeps what it could not write for the next pass: the newest status of each alloc
//!   wins, and nothing is written for an idle node;
//! - the lease loop claims `nodes/<node>` under a [`LEASE_TTL`] lease, created only when
//!   absent (a second agent with the same node name is refused), and keeps it alive.
//!
//! The desired loop reads etcd through one seam, [`DesiredKv`] (a listing at a revision,
//! a watch from one), so that the simulator runs the same loop over an in-memory etcd
//! ([`Fleet::start_desired`]).
//!
//! While etcd is away nothing is stopped: the node keeps the last listing it had (kept
//! across agent restarts), restart policies run as always, and `/v1/health` says
//! `fleet: degraded` with why.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp,
    TxnOpResponse,
};
use stead_schemas::config::FleetConfig;
use stead_schemas::fleet::{DEFAULT_PREFIX, FleetAllocStatus, FleetCheckpoint, FleetNodeStatus};
use stead_schemas::spec::Name;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::node::Node;
pub use stead_runtime::fleet::{FleetDesired, FleetKeys, FleetNode, Target};

mod desired_kv;
pub use desired_kv::{DesiredKv, DesiredWatch, KeyListing, KeyValue, WatchEvent, WatchMessage};

/// The node key's lease: the node shows down this long after its agent stops renewing it.
pub const LEASE_TTL: i64 = 15;
/// How often the lease is renewed.
pub const KEEP_ALIVE: Duration = Duration::from_secs(5);
/// The least time between two status writes of one alloc.
pub const STATUS_INTERVAL: Duration = Duration::from_millis(200);
/// The most status writes one transaction carries (etcd's default limit is 128).
const STATUS_BATCH: usize = 100;
/// How often the desired keys are listed whole, whatever the watch said.
pub const RELIST_PERIOD: Duration = Duration::from_secs(600);
/// How long one request to etcd may take: a write a member cannot commit (its leader
/// just died) is tried again, rather than waited for through the server's own timeout.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(1);
/// How long the loops get to end when the agent stops: the last status pass, the
/// lease's revocation.
const STOP_DEADLINE: Duration = Duration::from_secs(5);
/// How long a listing of the desired keys may take (it may be large).
const LIST_TIMEOUT: Duration = Duration::from_secs(10);
/// The first retry's delay; it doubles up to [`BACKOFF_MAX`], jittered.
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// How long start-up tries to claim the node before it goes on without etcd.
const CLAIM_AT_START: Duration = Duration::from_secs(3);

/// The agent's file holding the last desired listing.
const CHECKPOINT_FILE: &str = "fleet-desired.json";
/// The agent's file holding the lease its node key is under.
const LEASE_FILE: &str = "fleet-lease";

/// Why the fleet source cannot run.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// The `fleet` config is not usable.
    #[error("agent config: fleet: {0}")]
    Config(String),
    /// Another agent holds the node's key.
    #[error(
        "node name {node:?} is claimed by another agent (key {key}, lease {lease:x}); it is freed {ttl}s after that agent stops, or give this agent another fleet.node.name",
        ttl = LEASE_TTL
    )]
    Claimed {
        /// The node name.
        node: String,
        /// Its key.
        key: String,
        /// The other agent's lease.
        lease: i64,
    },
    /// etcd failed or could not be reached.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// The node's key is not under this agent's lease (it ran out, or the key went).
    #[error("{key} is not held under this agent's lease")]
    NotHolder {
        /// The node's key.
        key: String,
    },
    /// A request did not finish in time.
    #[error("etcd: no answer within {0:?}")]
    Timeout(Duration),
}

/// The fleet settings, resolved.
#[derive(Debug, Clone)]
pub struct FleetSettings {
    /// Client URLs.
    pub endpoints: Vec<String>,
    /// Where the keys are.
    pub keys: FleetKeys,
    /// This node.
    pub node: FleetNode,
}

impl FleetSettings {
    /// The settings `config` describes; `None` when it names no etcd endpoint.
    pub fn resolve(config: Option<&FleetConfig>) -> Result<Option<Self>, FleetError> {
        let Some(config) = config.filter(|c| !c.etcd.is_empty()) else {
            return Ok(None);
        };
        let prefix = config.prefix.as_deref().unwrap_or(DEFAULT_PREFIX);
        if !prefix.starts_with('/') || prefix.trim_end_matches('/').is_empty() {
            return Err(FleetError::Config(format!(
                "prefix {prefix:?} must start with '/' and name something below the root"
            )));
        }
        let node = config.node.clone().unwrap_or_default();
        let name = node.name.unwrap_or_else(crate::host::host_name);
        if let Err(why) = name.parse::<Name>() {
            return Err(FleetError::Config(format!("node.name: {why}")));
        }
        for key in node.labels.keys() {
            if let Err(why) = key.parse::<stead_schemas::spec::LabelKey>() {
                return Err(FleetError::Config(format!("node.labels: {why}")));
            }
        }
        Ok(Some(FleetSettings {
            endpoints: config.etcd.clone(),
            keys: FleetKeys::new(prefix),
            node: FleetNode {
                name,
                labels: node.labels,
            },
        }))
    }
}

/// Connects to `endpoints` (lazily: a cluster that is down fails the first request, not
/// this).
pub async fn connect(
    endpoints: &[String],
    timeout: Option<Duration>,
) -> Result<Client, FleetError> {
    let mut options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
        .with_keep_alive_while_idle(true)
        .with_require_leader(true);
    if let Some(timeout) = timeout {
        options = options.with_timeout(timeout);
    }
    Ok(Client::connect(endpoints, Some(options)).await?)
}

/// One edit of a key: its new value (`None` deletes it) and the modification revision
/// it had when read (0 for a key that did not exist).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyEdit {
    /// The key.
    pub key: String,
    /// Its new value, or `None` to delete it.
    pub value: Option<String>,
    /// Its `mod_revision` as read.
    pub read_at: i64,
}

/// Writes `edits` all or none, and only if no key changed since it was read (a
/// compare-and-swap on each key's modification revision); false when one did.
pub async fn write_edits(client: &Client, edits: &[KeyEdit]) -> Result<bool, FleetError> {
    let compares: Vec<Compare> = edits
        .iter()
        .map(|edit| Compare::mod_revision(edit.key.as_str(), CompareOp::Equal, edit.read_at))
        .collect();
    let ops: Vec<TxnOp> = edits
        .iter()
        .map(|edit| match &edit.value {
            Some(value) => TxnOp::put(edit.key.as_str(), value.as_str(), None),
            None => TxnOp::delete(edit.key.as_str(), None),
        })
        .collect();
    let mut kv = client.kv_client();
    let done = kv.txn(Txn::new().when(compares).and_then(ops)).await?;
    Ok(done.succeeded())
}

/// Runs `request`, failing it after [`REQUEST_TIMEOUT`].
async fn bounded<T>(
    request: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, FleetError> {
    bounded_by(REQUEST_TIMEOUT, request).await
}

/// Runs `request`, failing it after `limit`.
async fn bounded_by<T>(
    limit: Duration,
    request: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, FleetError> {
    match tokio::time::timeout(limit, request).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(FleetError::Timeout(limit)),
    }
}

/// Retry delays: doubling from [`BACKOFF_MIN`] to [`BACKOFF_MAX`], each between half and
/// all of its step.
struct Backoff {
    step: Duration,
    /// Draws the jitter (seeded in the simulator).
    rng: fastrand::Rng,
}

impl Backoff {
    fn new(rng: fastrand::Rng) -> Self {
        Backoff {
            step: BACKOFF_MIN,
            rng,
        }
    }

    /// Starts the delays over; true when a retry had been waited for since the last
    /// start (the failure this success ends).
    fn reset(&mut self) -> bool {
        let failed = self.step != BACKOFF_MIN;
        self.step = BACKOFF_MIN;
        failed
    }

    async fn wait(&mut self) {
        let step = self.step;
        self.step = (step * 2).min(BACKOFF_MAX);
        let half = step / 2;
        let jitter = half.mul_f64(self.rng.f64());
        tokio::time::sleep(half + jitter).await;
    }
}

/// Told when a loop hears from etcd again after failing: the others, waiting out their
/// backoff, retry at once, so that an outage's end costs one backoff rather than a
/// chain of them (the status loop's, then the lease loop's, then the status loop's
/// again, each up to [`BACKOFF_MAX`]).
#[derive(Default)]
struct Answered(tokio::sync::Notify);

impl Answered {
    /// Etcd answered the loop that owns `backoff`: its delays start over and, when it
    /// had been failing, the other loops stop waiting out theirs. Only the end of a
    /// failure wakes them, so a loop refused for another reason (a node claimed by
    /// another agent) retries once per outage's end, never once per answer.
    fn heard(&self, backoff: &mut Backoff) {
        if backoff.reset() {
            self.0.notify_waiters();
        }
    }

    /// Waits out `backoff`'s next delay, or less when another loop hears from etcd again.
    async fn retry_after(&self, backoff: &mut Backoff) {
        tokio::select! {
            biased;
            () = self.0.notified() => {}
            () = backoff.wait() => {}
        }
    }
}

/// How [`Fleet::start_desired`] runs the desired loop: the simulator's knobs, which the
/// agent's config cannot reach ([`Fleet::start`] runs with neither).
#[derive(Debug, Clone, Copy, Default)]
pub struct DesiredLoopOptions {
    /// Seeds the retries' jitter, so that a seed replays one history; `None` draws it at
    /// random.
    pub seed: Option<u64>,
    /// Test hook, off but in the simulator's planted-bug test: a watch's revision is
    /// advanced to its creation's header, which names the store's revision before the
    /// catch-up's events have come. It breaks the rule "what is published is the state at
    /// its revision", for the simulator to catch.
    pub plant_revision_from_creation: bool,
}

/// The parts of the fleet's health, joined into the node's report.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct HealthParts {
    desired: Option<String>,
    lease: Option<String>,
    status: Option<String>,
}

/// What the desired loop hands the agent's loop: `None` before any listing.
type Published = Option<Arc<FleetDesired>>;

/// The running fleet source: what the agent's loop takes the desired keys from.
pub struct Fleet {
    settings: FleetSettings,
    desired: watch::Receiver<Option<Arc<FleetDesired>>>,
    stop: CancellationToken,
    stop_status: CancellationToken,
    /// The status loop; none when only the desired loop runs.
    status: Option<tokio::task::JoinHandle<()>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// What the three loops share.
struct Shared {
    settings: FleetSettings,
    node: Arc<Node>,
    clock: Clock,
    data_dir: PathBuf,
    health: Mutex<HealthParts>,
    /// The lease the node key is held under, once claimed; the status loop writes only
    /// while there is one.
    lease: watch::Sender<Option<i64>>,
    /// Told by the status loop when a write found the node's key not under the lease.
    lost: tokio::sync::Notify,
    /// Ends the other loops' backoff when one hears from etcd again.
    etcd: Answered,
    /// Ends the desired and lease loops.
    stop: CancellationToken,
    /// Ends the status loop (first, so that its last pass runs under the lease).
    stop_status: CancellationToken,
    /// The simulator's knobs; the default in the agent.
    options: DesiredLoopOptions,
}

impl Shared {
    /// A retry schedule, its jitter seeded by `salt` when the loops run under a seed.
    fn backoff(&self, salt: u64) -> Backoff {
        Backoff::new(match self.options.seed {
            Some(seed) => fastrand::Rng::with_seed(seed ^ salt),
            None => fastrand::Rng::new(),
        })
    }

    fn report(&self, set: impl FnOnce(&mut HealthParts)) {
        let mut parts = self
            .health
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let before = parts.clone();
        set(&mut parts);
        let why: Vec<&str> = [&parts.desired, &parts.lease, &parts.status]
            .into_iter()
            .flatten()
            .map(String::as_str)
            .collect();
        let changed = *parts != before;
        self.node
            .set_fleet_health((!why.is_empty()).then(|| why.join("; ")));
        if changed {
            match why.is_empty() {
                true => tracing::info!("fleet: etcd reached, in step again"),
                false => tracing::warn!(reason = why.join("; "), "fleet degraded"),
            }
        }
    }
}

impl Fleet {
    /// Starts the fleet source for `node`: the last desired listing kept in `data_dir`
    /// is handed over at once; the node's claim is tried for a few seconds (a node name
    /// another agent holds fails the start; a cluster out of reach does not), then the
    /// loops run until [`Fleet::stop`].
    pub async fn start(
        settings: FleetSettings,
        node: Arc<Node>,
        clock: Clock,
        data_dir: &Path,
    ) -> Result<Fleet, FleetError> {
        let (shared, desired_tx, desired_rx) = Self::begin(
            settings.clone(),
            node,
            clock,
            data_dir,
            DesiredLoopOptions::default(),
        );
        let client = connect(&settings.endpoints, None).await?;
        // A refused claim fails the start; etcd out of reach leaves it to the lease loop.
        let claimed = match tokio::time::timeout(CLAIM_AT_START, claim(&shared, &client)).await {
            Ok(Ok(lease)) => Some(lease),
            Ok(Err(error @ FleetError::Claimed { .. })) => return Err(error),
            Ok(Err(error)) => {
                tracing::warn!(%error, "fleet: cannot claim the node yet; running what was last listed");
                None
            }
            Err(_) => {
                tracing::warn!("fleet: etcd does not answer; running what was last listed");
                None
            }
        };
        let status = tokio::spawn(status_loop(shared.clone(), client.clone()));
        let tasks = vec![
            tokio::spawn(lease_loop(shared.clone(), client.clone(), claimed)),
            tokio::spawn(desired_loop(shared.clone(), client, desired_tx)),
        ];
        Ok(Fleet {
            settings,
            desired: desired_rx,
            stop: shared.stop.clone(),
            stop_status: shared.stop_status.clone(),
            status: Some(status),
            tasks,
        })
    }

    /// Starts the desired loop alone over `kv`, as [`Fleet::start`] runs it beside the
    /// lease and status loops: the last desired listing kept in `data_dir` is handed over
    /// at once, and every change after it. The simulator's way in, over its in-memory
    /// etcd; `options` seeds the retries' jitter.
    pub fn start_desired(
        kv: impl DesiredKv,
        settings: FleetSettings,
        node: Arc<Node>,
        clock: Clock,
        data_dir: &Path,
        options: DesiredLoopOptions,
    ) -> Fleet {
        let (shared, desired_tx, desired_rx) =
            Self::begin(settings.clone(), node, clock, data_dir, options);
        Fleet {
            settings,
            desired: desired_rx,
            stop: shared.stop.clone(),
            stop_status: shared.stop_status.clone(),
            status: None,
            tasks: vec![tokio::spawn(desired_loop(shared, kv, desired_tx))],
        }
    }

    /// What the loops share, with the desired channel holding the listing kept in
    /// `data_dir` (none when there is none); the node's health says etcd is not reached
    /// yet.
    fn begin(
        settings: FleetSettings,
        node: Arc<Node>,
        clock: Clock,
        data_dir: &Path,
        options: DesiredLoopOptions,
    ) -> (
        Arc<Shared>,
        watch::Sender<Published>,
        watch::Receiver<Published>,
    ) {
        let kept = read_checkpoint(&data_dir.join(CHECKPOINT_FILE))
            .and_then(|c| FleetDesired::from_checkpoint(&settings.keys, &settings.node.name, &c));
        if let Some(kept) = &kept {
            tracing::info!(
                keys = kept.len(),
                revision = kept.revision,
                "fleet: running the desired keys last listed"
            );
        }
        let (desired_tx, desired_rx) = watch::channel(kept.map(Arc::new));
        let (lease_tx, _) = watch::channel(None);
        let shared = Arc::new(Shared {
            settings,
            node,
            clock,
            data_dir: data_dir.to_owned(),
            health: Mutex::new(HealthParts {
                desired: Some("not connected to etcd yet".to_owned()),
                ..HealthParts::default()
            }),
            lease: lease_tx,
            lost: tokio::sync::Notify::new(),
            etcd: Answered::default(),
            stop: CancellationToken::new(),
            stop_status: CancellationToken::new(),
            options,
        });
        shared.report(|_| {});
        (shared, desired_tx, desired_rx)
    }

    /// The settings it runs with.
    pub fn settings(&self) -> &FleetSettings {
        &self.settings
    }

    /// The desired keys as last listed (`None` before any listing), changed at each
    /// change.
    pub fn desired(&self) -> watch::Receiver<Option<Arc<FleetDesired>>> {
        self.desired.clone()
    }

    /// Stops the loops: the status loop first, after one last pass (a drain's stopped
    /// allocs), then the others, giving the node's key up (its lease revoked) so that the
    /// node shows down at once rather than when the lease runs out.
    pub async fn stop(self) {
        self.stop_status.cancel();
        if let Some(status) = self.status {
            let _ = tokio::time::timeout(STOP_DEADLINE, status).await;
        }
        self.stop.cancel();
        for task in self.tasks {
            let _ = tokio::time::timeout(STOP_DEADLINE, task).await;
        }
    }
}

/// Reads the kept desired listing; a missing or unreadable one is none.
fn read_checkpoint(path: &Path) -> Option<FleetCheckpoint> {
    let text = match std::fs::read(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return None,
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "fleet: cannot read the kept desired listing");
            return None;
        }
    };
    match serde_json::from_slice(&text) {
        Ok(checkpoint) => Some(checkpoint),
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "fleet: ignoring the kept desired listing");
            None
        }
    }
}

/// Hands `desired` to the agent's loop, then keeps it in the data dir (on the blocking
/// pool: the write is synced), so an agent started while etcd is away runs it.
async fn publish(
    shared: &Shared,
    tx: &watch::Sender<Option<Arc<FleetDesired>>>,
    desired: &FleetDesired,
) {
    tx.send_replace(Some(Arc::new(desired.clone())));
    let checkpoint = desired.checkpoint(&shared.settings.keys, &shared.settings.node.name);
    let path = shared.data_dir.join(CHECKPOINT_FILE);
    let written = tokio::task::spawn_blocking(move || {
        let text = serde_json::to_vec(&checkpoint).expect("the checkpoint serializes");
        crate::atomic::write_atomic(&path, &text).map_err(|error| (path, error))
    })
    .await;
    if let Ok(Err((path, error))) = written {
        tracing::warn!(path = %path.display(), %error, "fleet: cannot keep the desired listing");
    }
}

/// Lists the desired keys this node runs: its own and `_all`'s, at one revision.
async fn list_desired(
    shared: &Shared,
    client: &impl DesiredKv,
    before: Option<&FleetDesired>,
) -> Result<FleetDesired, FleetError> {
    let keys = &shared.settings.keys;
    let own = keys.desired_of(&Target::Node(shared.settings.node.name.clone()));
    let first = bounded_by(LIST_TIMEOUT, client.list(&own, None)).await?;
    let revision = first.revision;
    let all = keys.desired_of(&Target::All);
    let second = bounded_by(LIST_TIMEOUT, client.list(&all, Some(revision))).await?;
    // Parses of unchanged values are kept.
    let mut desired = before.cloned().unwrap_or_default();
    let listed: BTreeMap<String, String> = first
        .kvs
        .iter()
        .chain(&second.kvs)
        .filter_map(|kv| {
            // A value that is not UTF-8 is kept, as a broken spec of its key's name.
            Some((
                std::str::from_utf8(&kv.key).ok()?.to_owned(),
                String::from_utf8_lossy(&kv.value).into_owned(),
            ))
        })
        .filter(|(key, _)| keys.parse_desired(key).is_some())
        .collect();
    let gone: Vec<String> = desired
        .entries()
        .map(|(key, _)| key.to_owned())
        .filter(|key| !listed.contains_key(key))
        .collect();
    for key in gone {
        desired.delete(&key);
    }
    for (key, value) in &listed {
        desired.put(keys, key, value);
    }
    desired.revision = revision;
    Ok(desired)
}

/// Whether `key` is one this node runs from.
fn runs_from(settings: &FleetSettings, key: &str) -> bool {
    match settings.keys.parse_desired(key) {
        Some((Target::All, _)) => true,
        Some((Target::Node(node), _)) => node == settings.node.name,
        None => false,
    }
}

/// Lists, then watches, the desired keys, handing every change to `tx`, until stopped.
async fn desired_loop(
    shared: Arc<Shared>,
    client: impl DesiredKv,
    tx: watch::Sender<Option<Arc<FleetDesired>>>,
) {
    // Biased, here and in the watch: a seed replays one history in the simulator.
    tokio::select! {
        biased;
        () = shared.stop.cancelled() => {}
        () = follow_desired(&shared, &client, &tx) => {}
    }
}

/// The desired loop's work: a listing when none was taken, when the last watch's
/// revision was compacted or every [`RELIST_PERIOD`]; a watch from it meanwhile.
async fn follow_desired(
    shared: &Shared,
    client: &impl DesiredKv,
    tx: &watch::Sender<Option<Arc<FleetDesired>>>,
) {
    let mut backoff = shared.backoff(1);
    let mut current: Option<FleetDesired> = tx.borrow().as_deref().cloned();
    let mut listed_at: Option<tokio::time::Instant> = None;
    loop {
        let (desired, listed) = match (current.as_mut(), listed_at) {
            (Some(desired), Some(listed)) => (desired, listed),
            _ => {
                match list_desired(shared, client, current.as_ref()).await {
                    Ok(desired) => {
                        if current
                            .as_ref()
                            .is_none_or(|c| !c.entries().eq(desired.entries()))
                        {
                            tracing::info!(
                                keys = desired.len(),
                                revision = desired.revision,
                                "fleet: desired keys listed"
                            );
                            publish(shared, tx, &desired).await;
                        }
                        current = Some(desired);
                        listed_at = Some(shared.clock.instant());
                        shared.etcd.heard(&mut backoff);
                        shared.report(|h| h.desired = None);
                    }
                    Err(error) => {
                        shared.report(|h| {
                            h.desired = Some(format!("cannot list the desired keys: {error}"))
                        });
                        shared.etcd.retry_after(&mut backoff).await;
                    }
                }
                continue;
            }
        };
        let relist_at = listed + RELIST_PERIOD;
        match watch_desired(shared, client, desired, relist_at, tx, &mut backoff).await {
            WatchEnd::Relist => listed_at = None,
            WatchEnd::Failed(why) => {
                shared.report(|h| h.desired = Some(why));
                shared.etcd.retry_after(&mut backoff).await;
            }
        }
    }
}

/// Why a watch ended.
enum WatchEnd {
    /// Its revision was compacted, or the safety-net listing is due: list again.
    Relist,
    /// The stream failed or ended: watch again from the next revision.
    Failed(String),
}

/// Watches the desired keys from `desired.revision + 1`, applying every event to
/// `desired` and publishing each change, until the stream ends, its revision is
/// compacted or the next full listing is due.
async fn watch_desired(
    shared: &Shared,
    client: &impl DesiredKv,
    desired: &mut FleetDesired,
    relist_at: tokio::time::Instant,
    tx: &watch::Sender<Option<Arc<FleetDesired>>>,
    backoff: &mut Backoff,
) -> WatchEnd {
    let settings = &shared.settings;
    let prefix = settings.keys.desired();
    let mut stream = match bounded(client.watch(&prefix, desired.revision + 1)).await {
        Ok(stream) => stream,
        Err(error) => return WatchEnd::Failed(format!("cannot watch the desired keys: {error}")),
    };
    loop {
        // A listing due wins over a message that came at the same time (the listing
        // holds what it says).
        let message = tokio::select! {
            biased;
            () = tokio::time::sleep_until(relist_at) => return WatchEnd::Relist,
            message = stream.message() => message,
        };
        let message = match message {
            Ok(Some(message)) => message,
            Ok(None) => return WatchEnd::Failed("the watch of the desired keys ended".to_owned()),
            Err(error) => {
                return WatchEnd::Failed(format!("the watch of the desired keys failed: {error}"));
            }
        };
        let events = match message {
            WatchMessage::Compacted { revision } => {
                tracing::info!(
                    from = desired.revision + 1,
                    compacted = revision,
                    "fleet: the watched revision was compacted; listing again"
                );
                return WatchEnd::Relist;
            }
            WatchMessage::Canceled { reason } => {
                return WatchEnd::Failed(format!(
                    "etcd cancelled the watch of the desired keys: {reason}"
                ));
            }
            WatchMessage::Events(events) => events,
            // The header's revision vouches for what was sent only in a progress
            // notification (sent once the watch has caught up): the creation's header
            // names the store's revision before the catch-up's events have come, and a
            // catch-up batch the revision of the store, not of its last event.
            WatchMessage::Progress { revision } => {
                desired.revision = desired.revision.max(revision);
                Vec::new()
            }
            WatchMessage::Created { revision } => {
                if shared.options.plant_revision_from_creation {
                    desired.revision = desired.revision.max(revision);
                }
                Vec::new()
            }
        };
        // Streaming again: etcd is back.
        shared.etcd.heard(backoff);
        shared.report(|h| h.desired = None);
        let mut changed = false;
        for event in events {
            // Every event counts towards the revision, whoever's key it is.
            desired.revision = desired.revision.max(event.mod_revision);
            let Ok(key) = std::str::from_utf8(&event.kv.key) else {
                continue;
            };
            if !runs_from(settings, key) {
                continue;
            }
            changed |= match event.kind {
                EventType::Put => desired.put(
                    &settings.keys,
                    key,
                    &String::from_utf8_lossy(&event.kv.value),
                ),
                EventType::Delete => desired.delete(key),
            };
        }
        if changed {
            publish(shared, tx, desired).await;
        }
    }
}

/// Claims the node's key under a new lease (or takes back the one this agent's data dir
/// held it under before a crash); the lease.
async fn claim(shared: &Shared, client: &Client) -> Result<i64, FleetError> {
    let settings = &shared.settings;
    let key = settings.keys.node_key(&settings.node.name);
    let mut kv = client.kv_client();
    let lease_path = shared.data_dir.join(LEASE_FILE);
    // The leases this agent's data dir may hold the key under: the last granted, and
    // the one before it.
    let kept: Vec<i64> = std::fs::read_to_string(&lease_path)
        .map(|text| {
            text.split_whitespace()
                .filter_map(|id| id.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let mut leases = client.lease_client();
    let granted = bounded(leases.grant(LEASE_TTL, None)).await?.id();
    // Kept before the claim is tried: a claim that commits while its caller gave up
    // waiting is recognised as this agent's at the next try.
    let ids = match kept.first() {
        Some(before) => format!("{granted} {before}\n"),
        None => format!("{granted}\n"),
    };
    if let Err(error) = crate::atomic::write_atomic(&lease_path, ids.as_bytes()) {
        tracing::warn!(path = %lease_path.display(), %error, "fleet: cannot keep the node's lease id");
    }
    let record = FleetNodeStatus {
        name: settings.node.name.clone(),
        labels: settings.node.labels.clone(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        hostname: crate::host::host_name(),
        claimed_at: shared.clock.now(),
    };
    let value = serde_json::to_string(&record).expect("the node record serializes");
    // Created only when absent; or over this agent's own key, held under the lease its
    // data dir kept (the agent crashed and came back before the lease ran out).
    let absent = Compare::create_revision(key.as_str(), CompareOp::Equal, 0);
    let put = TxnOp::put(
        key.as_str(),
        value.as_str(),
        Some(PutOptions::new().with_lease(granted)),
    );
    let txn = Txn::new()
        .when(vec![absent])
        .and_then(vec![put.clone()])
        .or_else(vec![TxnOp::get(key.as_str(), None)]);
    let response = bounded(kv.txn(txn)).await?;
    let mut claimed = response.succeeded();
    let mut holder = 0;
    if !claimed {
        holder = response
            .op_responses()
            .into_iter()
            .find_map(|op| match op {
                TxnOpResponse::Get(get) => get.kvs().first().map(|kv| kv.lease()),
                _ => None,
            })
            .unwrap_or(0);
        if holder != 0 && kept.contains(&holder) {
            let ours = Compare::lease(key.as_str(), CompareOp::Equal, holder);
            let retake = Txn::new().when(vec![ours]).and_then(vec![put]);
            claimed = bounded(kv.txn(retake)).await?.succeeded();
            if claimed {
                let _ = bounded(leases.revoke(holder)).await;
            }
        }
    }
    if !claimed {
        let _ = bounded(leases.revoke(granted)).await;
        return Err(FleetError::Claimed {
            node: settings.node.name.clone(),
            key,
            lease: holder,
        });
    }
    tracing::info!(node = %settings.node.name, lease = format!("{granted:x}"), "fleet: node claimed");
    Ok(granted)
}

/// Holds the node's key: claims it (again, after its lease ran out or the key was
/// found not to be under it) and renews the lease every [`KEEP_ALIVE`]; gives it up
/// however the loop ends, so that the node shows down at once.
async fn lease_loop(shared: Arc<Shared>, client: Client, claimed: Option<i64>) {
    let mut lease = claimed;
    tokio::select! {
        () = hold_node(&shared, &client, &mut lease) => {}
        () = shared.stop.cancelled() => {}
    }
    if let Some(id) = lease {
        let mut leases = client.lease_client();
        let _ = bounded(leases.revoke(id)).await;
        let _ = std::fs::remove_file(shared.data_dir.join(LEASE_FILE));
    }
}

/// The lease loop's work, until the agent stops; `lease` is the one held now.
async fn hold_node(shared: &Shared, client: &Client, lease: &mut Option<i64>) {
    let mut backoff = shared.backoff(2);
    loop {
        let id = match *lease {
            Some(id) => id,
            None => match claim(shared, client).await {
                Ok(id) => {
                    shared.etcd.heard(&mut backoff);
                    id
                }
                Err(error) => {
                    shared.report(|h| h.lease = Some(format!("the node is not claimed: {error}")));
                    shared.etcd.retry_after(&mut backoff).await;
                    continue;
                }
            },
        };
        *lease = Some(id);
        shared.lease.send_replace(Some(id));
        shared.report(|h| h.lease = None);
        let ended = tokio::select! {
            kept = keep_alive(shared, client, id, &mut backoff) => kept.map(|()| "the node's lease ran out"),
            () = shared.lost.notified() => Ok("the node's key is not under its lease"),
        };
        match ended {
            // etcd was away longer than the lease's TTL, or the key went: claim anew.
            Ok(why) => {
                tracing::warn!(
                    lease = format!("{id:x}"),
                    "fleet: {why}; claiming the node again"
                );
                let mut leases = client.lease_client();
                let _ = bounded(leases.revoke(id)).await;
                *lease = None;
                shared.lease.send_replace(None);
            }
            Err(error) => {
                shared
                    .report(|h| h.lease = Some(format!("cannot renew the node's lease: {error}")));
                shared.etcd.retry_after(&mut backoff).await;
            }
        }
    }
}

/// Renews lease `id` every [`KEEP_ALIVE`]; returns `Ok` when it ran out, an error when
/// etcd cannot be reached.
async fn keep_alive(
    shared: &Shared,
    client: &Client,
    id: i64,
    backoff: &mut Backoff,
) -> Result<(), FleetError> {
    let mut leases = client.lease_client();
    let (mut keeper, mut stream) = bounded(leases.keep_alive(id)).await?;
    loop {
        bounded(keeper.keep_alive()).await?;
        match bounded(stream.message()).await? {
            Some(answer) if answer.ttl() > 0 => shared.etcd.heard(backoff),
            Some(_) => {
                shared.etcd.heard(backoff);
                return Ok(());
            }
            None => return Err(FleetError::Timeout(REQUEST_TIMEOUT)),
        }
        tokio::time::sleep(KEEP_ALIVE).await;
    }
}

/// Writes each alloc's status to `status/<node>/<alloc>` when it changed, and deletes
/// the keys of allocs gone; what could not be written is written at a later pass. When
/// stopped, one last pass sends what the shutdown changed (a drain's stopped allocs).
async fn status_loop(shared: Arc<Shared>, client: Client) {
    let mut kv = client.kv_client();
    // What etcd holds, as this loop last wrote or read it: `None` until read once.
    let mut written: Option<BTreeMap<String, stead_schemas::status::AllocStatus>> = None;
    tokio::select! {
        () = status_passes(&shared, &mut kv, &mut written) => {}
        () = shared.stop_status.cancelled() => {}
    }
    let lease = *shared.lease.borrow();
    if let Some(lease) = lease
        && let Err(error) = status_pass(&shared, &mut kv, lease, &mut written).await
    {
        tracing::warn!(%error, "fleet: the last status was not written");
    }
}

/// The status loop's passes: one after each change of status, at most one per
/// [`STATUS_INTERVAL`], and only while the node is claimed (an agent refused its name
/// must not write another's status).
async fn status_passes(
    shared: &Shared,
    kv: &mut etcd_client::KvClient,
    written: &mut Option<BTreeMap<String, stead_schemas::status::AllocStatus>>,
) {
    let mut changes = shared.node.status_changes();
    let mut lease = shared.lease.subscribe();
    let mut backoff = shared.backoff(3);
    let mut held: Option<i64> = None;
    loop {
        let Some(id) = *lease.borrow_and_update() else {
            let _ = lease.changed().await;
            continue;
        };
        if held != Some(id) {
            // Claimed anew: what etcd holds is read again (another agent may have
            // written meanwhile).
            *written = None;
            held = Some(id);
        }
        let pass = shared.clock.instant();
        match status_pass(shared, kv, id, written).await {
            Ok(()) => {
                shared.etcd.heard(&mut backoff);
                shared.report(|h| h.status = None);
            }
            Err(FleetError::NotHolder { .. }) => {
                // An answer all the same: etcd is back.
                shared.etcd.heard(&mut backoff);
                // The lease loop claims the node again; writes wait for that.
                shared.report(|h| {
                    h.status = Some("status not written: the node's key is not held".to_owned())
                });
                shared.lost.notify_one();
                let _ = lease.changed().await;
                continue;
            }
            Err(error) => {
                shared.report(|h| h.status = Some(format!("status not written: {error}")));
                shared.etcd.retry_after(&mut backoff).await;
                continue;
            }
        }
        tokio::select! {
            _ = changes.changed() => {}
            _ = lease.changed() => {}
        }
        tokio::time::sleep_until(pass + STATUS_INTERVAL).await;
    }
}

/// One pass of the status loop.
async fn status_pass(
    shared: &Shared,
    kv: &mut etcd_client::KvClient,
    lease: i64,
    written: &mut Option<BTreeMap<String, stead_schemas::status::AllocStatus>>,
) -> Result<(), FleetError> {
    let keys = &shared.settings.keys;
    let node_name = shared.settings.node.name.as_str();
    let node_key = keys.node_key(node_name);
    let written = match written {
        Some(written) => written,
        None => {
            let prefix = keys.status_of(node_name);
            let listed =
                bounded(kv.get(prefix.as_str(), Some(GetOptions::new().with_prefix()))).await?;
            let read = listed
                .kvs()
                .iter()
                .filter_map(|kv| {
                    let (_, alloc) = keys.parse_status(kv.key_str().ok()?)?;
                    let status: FleetAllocStatus = serde_json::from_slice(kv.value()).ok()?;
                    Some((alloc, status.status))
                })
                .collect();
            written.insert(read)
        }
    };
    let now: BTreeMap<String, stead_schemas::status::AllocStatus> = shared
        .node
        .statuses()
        .iter()
        .filter_map(|status| shared.node.full_status(&status.name))
        .map(|status| (status.name.clone(), (*status).clone()))
        .collect();
    // Every change of the pass, in transactions of up to [`STATUS_BATCH`] writes: one
    // round to etcd per node and pass, however many allocs changed.
    let mut ops: Vec<(String, Option<stead_schemas::status::AllocStatus>)> = Vec::new();
    for (alloc, status) in &now {
        if written.get(alloc) != Some(status) {
            ops.push((alloc.clone(), Some(status.clone())));
        }
    }
    for alloc in written.keys().filter(|alloc| !now.contains_key(*alloc)) {
        ops.push((alloc.clone(), None));
    }
    let at = shared.clock.now();
    for batch in ops.chunks(STATUS_BATCH) {
        let txn: Vec<TxnOp> = batch
            .iter()
            .map(|(alloc, status)| {
                let key = keys.status_key(node_name, alloc);
                match status {
                    Some(status) => {
                        let document = FleetAllocStatus {
                            written_at: at,
                            status: status.clone(),
                        };
                        let value = serde_json::to_vec(&document).expect("a status serializes");
                        TxnOp::put(key, value, None)
                    }
                    None => TxnOp::delete(key, None),
                }
            })
            .collect();
        // Only while this agent holds the node: never over another agent's status.
        let held = Compare::lease(node_key.as_str(), CompareOp::Equal, lease);
        let done = bounded(kv.txn(Txn::new().when(vec![held]).and_then(txn))).await?;
        if !done.succeeded() {
            return Err(FleetError::NotHolder { key: node_key });
        }
        for (alloc, status) in batch {
            match status {
                Some(status) => written.insert(alloc.clone(), status.clone()),
                None => written.remove(alloc),
            };
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> FleetConfig {
        serde_json::from_str(json).expect("a fleet config")
    }

    #[test]
    fn no_endpoint_is_no_fleet_and_a_bad_prefix_name_or_label_is_refused() {
        assert!(FleetSettings::resolve(None).expect("fine").is_none());
        assert!(
            FleetSettings::resolve(Some(&config(r#"{"etcd": []}"#)))
                .expect("fine")
                .is_none()
        );
        let settings = FleetSettings::resolve(Some(&config(
            r#"{"etcd": ["http://127.0.0.1:2379"], "node": {"name": "web-1", "labels": {"zone": "a"}}}"#,
        )))
        .expect("valid")
        .expect("a fleet");
        assert_eq!(settings.keys.prefix(), DEFAULT_PREFIX);
        assert_eq!(settings.node.name, "web-1");
        for (json, says) in [
            (r#"{"etcd": ["x"], "prefix": "stead"}"#, "prefix"),
            (r#"{"etcd": ["x"], "prefix": "/"}"#, "prefix"),
            (
                r#"{"etcd": ["x"], "node": {"name": "../etc"}}"#,
                "node.name",
            ),
            (
                r#"{"etcd": ["x"], "node": {"name": "a", "labels": {"bad key!": "x"}}}"#,
                "node.labels",
            ),
        ] {
            let error = FleetSettings::resolve(Some(&config(json))).expect_err(json);
            assert!(error.to_string().contains(says), "{json}: {error}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_loop_hearing_from_etcd_again_ends_the_others_backoff_at_once() {
        let answered = Arc::new(Answered::default());
        let mut waiting = Backoff::new(fastrand::Rng::with_seed(1));
        // Failed long enough that its next delay is at least a second.
        for _ in 0..4 {
            waiting.wait().await;
        }
        let retried = tokio::spawn({
            let answered = Arc::clone(&answered);
            async move { answered.retry_after(&mut waiting).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        // An answer to a loop that had not failed wakes no one.
        answered.heard(&mut Backoff::new(fastrand::Rng::with_seed(2)));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!retried.is_finished(), "woken by a loop that never failed");
        let mut failed = Backoff::new(fastrand::Rng::with_seed(3));
        failed.wait().await;
        answered.heard(&mut failed);
        // Its own delay has at least 600 ms left (paused time runs to the next timer).
        tokio::time::timeout(Duration::from_millis(100), retried)
            .await
            .expect("the retry ends as soon as another loop hears from etcd")
            .expect("the retry");
    }

    #[test]
    fn only_the_nodes_own_keys_and_all_keys_are_run_from() {
        let settings = FleetSettings {
            endpoints: vec![],
            keys: FleetKeys::new("/s"),
            node: FleetNode {
                name: "n1".to_owned(),
                labels: BTreeMap::new(),
            },
        };
        assert!(runs_from(&settings, "/s/desired/n1/web"));
        assert!(runs_from(&settings, "/s/desired/_all/web"));
        assert!(!runs_from(&settings, "/s/desired/n2/web"));
        assert!(!runs_from(&settings, "/s/status/n1/web"));
        assert!(!runs_from(&settings, "/s/desired/n1/Bad"));
    }
}
