//! The node over the RocksDB store, under paused time with the mock driver: idle nodes
//! write nothing, failed writes degrade health and are retried until they succeed, and
//! restore fails only the allocs whose records cannot be used.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use stead_controller::clock::Clock;
use stead_controller::driver::mock::{MockDriver, MockOp};
use stead_controller::driver::{Driver, Drivers};
use stead_controller::node::{Node, NodeConfig};
use stead_controller::queue::Shutdown;
use stead_controller::store::conformance::{PlantRaw, sample_record};
use stead_controller::store::{FaultyStore, RocksDbOptions, RocksDbStore, Store};
use stead_schemas::record::ALLOC_RECORD_VERSION;
use stead_schemas::{Timestamp, ValidSpec};

/// 2026-11-22T00:00:00Z.
const START: Duration = Duration::from_secs(1_795_305_600);
const DEADLINE: Duration = Duration::from_secs(600);

fn open(dir: &Path) -> Arc<RocksDbStore> {
    Arc::new(RocksDbStore::open(dir, RocksDbOptions::default()).expect("store opens"))
}

fn node(store: Arc<dyn Store>, mock: &MockDriver, clock: Clock) -> Node {
    let drivers = Drivers::new([Arc::new(mock.clone()) as Arc<dyn Driver>]);
    let config = NodeConfig {
        seed: Some(7),
        tick: Duration::from_secs(1),
        ..NodeConfig::default()
    };
    Node::new(config, drivers, store, clock)
}

fn clock() -> Clock {
    Clock::starting_at(Timestamp::from_since_epoch(START))
}

fn alloc(name: &str, body: &str) -> ValidSpec {
    let yaml =
        format!("apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n{body}");
    let file = stead_schemas::parse_spec_file(Path::new("test.yaml"), &yaml);
    assert!(file.is_valid(), "{:#?}", file.all_diagnostics());
    file.specs().next().expect("one spec").clone()
}

fn service(name: &str) -> ValidSpec {
    alloc(
        name,
        "  tasks:\n    - {name: t, driver: mock, config: {}}\n",
    )
}

/// A node on a RocksDB store behind a [`FaultyStore`] in a temporary dir, with `web`
/// running; the temporary dir and the mock driver are returned to be kept alive.
async fn web_on_a_faulty_store() -> (
    tempfile::TempDir,
    Arc<RocksDbStore>,
    FaultyStore,
    MockDriver,
    Node,
) {
    let dir = tempfile::tempdir().expect("temp dir");
    let rocks = open(dir.path());
    let faulty = FaultyStore::new(rocks.clone());
    let clock = clock();
    let mock = MockDriver::new(clock);
    let node = node(Arc::new(faulty.clone()), &mock, clock);
    node.apply(service("web"));
    assert!(node.wait_until(DEADLINE, |n| running(n, "web")).await);
    (dir, rocks, faulty, mock, node)
}

fn running(node: &Node, name: &str) -> bool {
    node.status(name)
        .is_some_and(|s| s.tasks.get("t").is_some_and(|t| t.state == "running"))
}

fn starts(mock: &MockDriver, task: &str) -> usize {
    mock.calls()
        .into_iter()
        .filter(|c| c.task.as_str() == task && c.op == MockOp::StartBegan)
        .count()
}

#[tokio::test(start_paused = true)]
async fn an_idle_node_with_100_running_allocs_performs_no_rocksdb_writes_over_10_ticks() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = open(dir.path());
    let clock = clock();
    let mock = MockDriver::new(clock);
    let node = node(store.clone(), &mock, clock);
    for i in 0..100 {
        node.apply(service(&format!("svc{i}")));
    }
    let all_running = node
        .wait_until(DEADLINE, |n| {
            (0..100).all(|i| running(n, &format!("svc{i}")))
        })
        .await;
    assert!(all_running);
    // Let the last transitions settle, then count.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = store.metrics();
    assert!(before.writes >= 100, "{before:?}");
    tokio::time::sleep(Duration::from_secs(10)).await;
    let after = store.metrics();
    assert_eq!(after.writes, before.writes, "{before:?} -> {after:?}");
    assert_eq!(after.bytes_written, before.bytes_written);
    node.shutdown(Shutdown::Detach).await;
}

#[tokio::test(start_paused = true)]
async fn failed_writes_keep_tasks_running_degrade_the_store_and_recover_by_themselves() {
    let (_dir, rocks, faulty, _mock, node) = web_on_a_faulty_store().await;
    assert!(node.store_health().is_healthy());

    faulty.set_failing(true);
    node.restart("web", None).await.expect("restart accepted");
    let degraded = node
        .wait_until(DEADLINE, |n| !n.store_health().is_healthy())
        .await;
    assert!(degraded);
    assert_eq!(node.store_health().behind, vec!["web".to_owned()]);
    // Retries back off: over a minute of failures, far fewer attempts than ticks... and
    // the task keeps running throughout.
    let failures_at_start = node.store_health().failures;
    tokio::time::sleep(Duration::from_secs(60)).await;
    let failures = node.store_health().failures - failures_at_start;
    assert!((3..=15).contains(&failures), "{failures} retries in 60 s");
    assert!(running(&node, "web"));
    assert_eq!(node.status("web").expect("shown").tasks["t"].restarts, 1);

    faulty.set_failing(false);
    let recovered = node
        .wait_until(DEADLINE, |n| n.store_health().is_healthy())
        .await;
    assert!(recovered);
    let stored = rocks.load_allocs().expect("loads");
    let record = stored[0].as_ref().expect("decodes");
    assert_eq!(
        record.state.tasks["t"].restarts, 1,
        "the latest state is stored"
    );
    node.shutdown(Shutdown::Detach).await;
}

#[tokio::test(start_paused = true)]
async fn a_detach_writes_the_latest_state_at_once_even_while_a_retry_backs_off() {
    let (_dir, rocks, faulty, _mock, node) = web_on_a_faulty_store().await;

    faulty.set_failing(true);
    node.restart("web", None).await.expect("restart accepted");
    let restarted = node
        .wait_until(DEADLINE, |n| {
            !n.store_health().is_healthy()
                && running(n, "web")
                && n.status("web").expect("shown").tasks["t"].restarts == 1
        })
        .await;
    assert!(restarted);
    // Long enough for the retries to back off to tens of seconds.
    tokio::time::sleep(Duration::from_secs(60)).await;
    faulty.set_failing(false);
    assert!(
        !node.store_health().is_healthy(),
        "the next retry is not due yet"
    );
    let shown = node.status("web").expect("shown");
    node.shutdown(Shutdown::Detach).await;

    let stored = rocks.load_allocs().expect("loads");
    let record = stored[0].as_ref().expect("decodes");
    assert_eq!(
        record.state.tasks["t"].restarts, 1,
        "the agent left with its latest state written"
    );
    assert_eq!(
        record.handles["t"].pid, shown.tasks["t"].pid,
        "the record names the run that is alive"
    );
}

#[tokio::test(start_paused = true)]
async fn restore_fails_only_the_corrupt_and_newer_records_naming_them_and_runs_them_on_a_new_revision()
 {
    let dir = tempfile::tempdir().expect("temp dir");
    let clock = clock();
    let mock = MockDriver::new(clock);
    {
        let store = open(dir.path());
        let first = node(store.clone(), &mock, clock);
        for name in ["api", "web", "zoo"] {
            first.apply(service(name));
        }
        let up = first
            .wait_until(DEADLINE, |n| {
                ["api", "web", "zoo"].iter().all(|a| running(n, a))
            })
            .await;
        assert!(up);
        first.shutdown(Shutdown::Detach).await;
        store.plant_raw("api", b"\x00\xffgarbage".to_vec());
        let mut newer = sample_record("zoo", 0);
        newer.version = ALLOC_RECORD_VERSION + 1;
        store.plant_raw("zoo", newer.encode());
    }
    let starts_before = starts(&mock, "t");
    let store = open(dir.path());
    let second = node(store.clone(), &mock, clock);
    let report = second.restore().expect("the agent boots");
    assert_eq!(report.restored, 1);
    assert_eq!(report.corrupt.len(), 2);
    assert!(second.wait_until(DEADLINE, |n| running(n, "web")).await);

    let api = second.status("api").expect("api is shown");
    assert_eq!(api.client_status, "failed");
    let reason = api.state_error.clone().expect("a reason");
    assert!(
        reason.contains("alloc \"api\"") && reason.contains("malformed"),
        "{reason}"
    );
    let zoo = second.status("zoo").expect("zoo is shown");
    assert_eq!(zoo.client_status, "failed");
    let reason = zoo.state_error.clone().expect("a reason");
    assert!(
        reason.contains("zoo") && reason.contains("newer"),
        "{reason}"
    );

    // The unchanged spec does not run them again; the broken records stay as they were.
    second.apply(service("api"));
    second.apply(service("zoo"));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(starts(&mock, "t"), starts_before, "nothing started");
    assert_eq!(second.status("zoo").expect("shown").client_status, "failed");

    // A new revision starts afresh.
    second.apply(alloc(
        "api",
        "  tasks:\n    - {name: t, driver: mock, config: {}, env: {V: '2'}}\n",
    ));
    assert!(second.wait_until(DEADLINE, |n| running(n, "api")).await);
    assert_eq!(second.status("api").expect("shown").state_error, None);
    second.shutdown(Shutdown::Detach).await;
}

#[tokio::test(start_paused = true)]
async fn a_completed_batch_alloc_is_never_run_again_after_a_restart() {
    let dir = tempfile::tempdir().expect("temp dir");
    let clock = clock();
    let mock = MockDriver::new(clock);
    let batch = alloc(
        "job",
        "  type: batch\n  tasks:\n    - {name: t, driver: mock, config: {runFor: 1s}}\n",
    );
    {
        let store = open(dir.path());
        let first = node(store, &mock, clock);
        first.apply(batch.clone());
        let done = first
            .wait_until(DEADLINE, |n| {
                n.status("job")
                    .is_some_and(|s| s.client_status == "complete")
            })
            .await;
        assert!(done);
        first.shutdown(Shutdown::Detach).await;
    }
    let store = open(dir.path());
    let second = node(store, &mock, clock);
    assert_eq!(second.restore().expect("restores").restored, 1);
    second.apply(batch);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        second.status("job").expect("shown").client_status,
        "complete"
    );
    assert_eq!(starts(&mock, "t"), 1, "never started again");
    second.shutdown(Shutdown::Detach).await;
}

#[tokio::test(start_paused = true)]
async fn a_stored_alloc_with_no_task_state_is_dropped_and_its_record_deleted() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = open(dir.path());
    let mut empty = sample_record("ghost", 0);
    empty.state.tasks.clear();
    empty.handles.clear();
    store.put_alloc(&empty).expect("written");
    store.put_alloc(&sample_record("kept", 0)).expect("written");
    let clock = clock();
    let mock = MockDriver::new(clock);
    let node = node(store.clone(), &mock, clock);
    let report = node.restore().expect("restores");
    assert_eq!((report.restored, report.dropped), (1, 1));
    assert!(node.status("ghost").is_none());
    let names: Vec<String> = store
        .load_allocs()
        .expect("loads")
        .into_iter()
        .map(|r| r.expect("decodes").name.to_string())
        .collect();
    assert_eq!(names, vec!["kept".to_owned()]);
    node.shutdown(Shutdown::Detach).await;
}

#[tokio::test(start_paused = true)]
async fn a_collected_alloc_whose_record_delete_fails_stays_shown_and_behind_until_it_is_gone() {
    let dir = tempfile::tempdir().expect("temp dir");
    let rocks = open(dir.path());
    let faulty = FaultyStore::new(rocks);
    let clock = clock();
    let mock = MockDriver::new(clock);
    let node = node(Arc::new(faulty.clone()), &mock, clock);
    node.apply(service("web"));
    assert!(node.wait_until(DEADLINE, |n| running(n, "web")).await);
    faulty.set_failing(true);
    node.restart("web", None).await.expect("restart accepted");
    assert!(
        node.wait_until(DEADLINE, |n| !n.store_health().is_healthy())
            .await
    );
    let name = "web".parse().expect("a name");
    node.remove(&name);
    let stopped = node
        .wait_until(DEADLINE, |n| {
            n.gc_candidates()
                .iter()
                .any(|c| c.key.as_str() == "web" && c.collectable)
        })
        .await;
    assert!(stopped);
    assert!(!node.store_health().is_healthy(), "behind while it exists");
    // Garbage collection destroys it; its record's delete fails too and is retried: the
    // alloc stays shown, and the store behind, until the record is gone.
    node.collect(&name).await.expect("collected");
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(
        node.status("web").is_some(),
        "hidden while its record remains"
    );
    assert_eq!(node.store_health().behind, ["web"]);
    faulty.set_failing(false);
    assert!(
        node.wait_until(DEADLINE, |n| n.status("web").is_none())
            .await
    );
    assert!(
        node.store_health().is_healthy(),
        "{:?}",
        node.store_health()
    );
    assert!(
        faulty.load_allocs().expect("readable").is_empty(),
        "the record outlived its alloc"
    );
    node.shutdown(Shutdown::Detach).await;
}

/// A store that blocks, as RocksDB does (so the node writes it through its writer, off the
/// runtime), and holds every put until its gate opens.
struct GatedStore {
    inner: stead_controller::store::MemoryStore,
    open: std::sync::Mutex<bool>,
    opened: std::sync::Condvar,
    /// Told when a put begins, while the gate holds it.
    put_begun: tokio::sync::Notify,
}

impl GatedStore {
    fn open_gate(&self) {
        *self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        self.opened.notify_all();
    }
}

/// Opens the gate when dropped, so a failing test never leaves a put held (the runtime's
/// end would wait for it for ever).
struct OpenOnDrop(Arc<GatedStore>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open_gate();
    }
}

impl Store for GatedStore {
    fn put_alloc(
        &self,
        record: &stead_schemas::record::AllocRecord,
    ) -> Result<(), stead_controller::store::StoreError> {
        self.put_begun.notify_one();
        let mut open = self.open.lock().expect("not poisoned");
        while !*open {
            open = self.opened.wait(open).expect("not poisoned");
        }
        self.inner.put_alloc(record)
    }
    fn delete_alloc(
        &self,
        name: &stead_schemas::spec::Name,
    ) -> Result<(), stead_controller::store::StoreError> {
        self.inner.delete_alloc(name)
    }
    fn load_allocs(
        &self,
    ) -> Result<
        Vec<Result<stead_schemas::record::AllocRecord, stead_controller::store::CorruptRecord>>,
        stead_controller::store::StoreError,
    > {
        self.inner.load_allocs()
    }
    fn metrics(&self) -> stead_controller::store::StoreMetrics {
        self.inner.metrics()
    }
}

#[tokio::test]
async fn a_worker_publishes_nothing_before_the_store_writer_has_written_its_record() {
    let store = Arc::new(GatedStore {
        inner: stead_controller::store::MemoryStore::new(),
        open: std::sync::Mutex::new(false),
        opened: std::sync::Condvar::new(),
        put_begun: tokio::sync::Notify::new(),
    });
    let _gate = OpenOnDrop(store.clone());
    let mock = MockDriver::new(Clock::system());
    let node = node(store.clone(), &mock, Clock::system());
    node.apply(service("web"));
    tokio::time::timeout(Duration::from_secs(30), store.put_begun.notified())
        .await
        .expect("the first record's write begins");
    // The write is held: the alloc's worker waits for it, and shows nothing meanwhile.
    assert!(
        node.status("web").is_none(),
        "published before its record was written: {:?}",
        node.status("web")
    );
    store.open_gate();
    assert!(
        node.wait_until(Duration::from_secs(30), |n| n.status("web").is_some())
            .await,
        "never published once written"
    );
    let stored = store.inner.load_allocs().expect("loads");
    assert_eq!(stored.len(), 1, "the record is written");
    node.shutdown(Shutdown::Detach).await;
}
