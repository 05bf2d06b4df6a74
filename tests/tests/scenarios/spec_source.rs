//! The specs directory as desired state: what one listing pass tells the node.

use std::sync::Arc;
use std::time::Duration;

use stead_controller::clock::Clock;
use stead_controller::driver::mock::MockDriver;
use stead_controller::driver::{Driver, Drivers};
use stead_controller::node::{Node, NodeConfig};
use stead_controller::source::{SyncReport, Syncer, list_specs};
use stead_controller::store::MemoryStore;
use stead_schemas::Timestamp;

const DEADLINE: Duration = Duration::from_secs(600);

fn spec(name: &str, command_marker: &str) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  tasks:\n    - {{name: t, driver: mock, config: {{stdoutString: {command_marker}}}}}\n"
    )
}

fn clock() -> Clock {
    Clock::starting_at(Timestamp::from_since_epoch(Duration::from_secs(
        1_800_000_000,
    )))
}

fn node() -> Node {
    let clock = clock();
    node_over(MemoryStore::default(), MockDriver::new(clock), clock)
}

/// A node over `store` and `mock`, which outlive it (as the store and tasks outlive an
/// agent).
fn node_over(store: MemoryStore, mock: MockDriver, clock: Clock) -> Node {
    let drivers = Drivers::new([Arc::new(mock) as Arc<dyn Driver>]);
    Node::new(NodeConfig::default(), drivers, Arc::new(store), clock)
}

fn collectable(node: &Node, name: &str) -> bool {
    node.gc_candidates()
        .iter()
        .any(|c| c.key.as_str() == name && c.collectable)
}

fn events(node: &Node, name: &str, event_type: &str) -> usize {
    node.status(name).map_or(0, |s| {
        s.tasks
            .values()
            .flat_map(|t| &t.events)
            .filter(|e| e.event_type == event_type)
            .count()
    })
}

/// A node and a syncer that applied the specs of `dir`, once `names` all run.
async fn synced(dir: &std::path::Path, names: &[&str]) -> (Node, Syncer) {
    let node = node();
    let mut syncer = Syncer::new([]);
    syncer.sync(&node, &list_specs(dir));
    assert!(
        node.wait_until(DEADLINE, |n| names.iter().all(|name| running(n, name)))
            .await
    );
    (node, syncer)
}

/// The names a pass removed.
fn removed(report: &SyncReport) -> Vec<&str> {
    report.removed.iter().map(|n| n.as_str()).collect()
}

fn running(node: &Node, name: &str) -> bool {
    node.status(name)
        .is_some_and(|s| s.tasks.values().all(|t| t.state == "running"))
}

#[tokio::test(start_paused = true)]
async fn a_pass_applies_new_specs_and_an_identical_rewrite_changes_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("web.yaml"), spec("web", "a")).expect("write");
    std::fs::write(dir.path().join(".web.yaml.swp"), "garbage: [").expect("write");
    let node = node();
    let mut syncer = Syncer::new([]);
    let report = syncer.sync(&node, &list_specs(dir.path()));
    assert_eq!(report.applied.len(), 1);
    assert!(node.wait_until(DEADLINE, |n| running(n, "web")).await);

    // Same meaning, different bytes: comments and key order.
    let rewritten = "# edited\nkind: Alloc\napiVersion: stead/v1\nmetadata:\n  name: web\nspec:\n  tasks:\n    - config: {stdoutString: a}\n      driver: mock\n      name: t\n";
    std::fs::write(dir.path().join("web.yaml"), rewritten).expect("write");
    let report = syncer.sync(&node, &list_specs(dir.path()));
    assert!(
        report.applied.is_empty() && report.removed.is_empty(),
        "{report:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_invalid_edit_keeps_the_last_valid_revision_shows_its_spec_error_and_a_deleted_file_stops_the_alloc()
 {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("web.yaml");
    std::fs::write(&path, spec("web", "a")).expect("write");
    let (node, mut syncer) = synced(dir.path(), &["web"]).await;
    let id = node.status("web").expect("published").id.clone();

    std::fs::write(
        &path,
        spec("web", "a").replace("stdoutString", "stdoutStrin"),
    )
    .expect("write");
    let listing = list_specs(dir.path());
    assert!(!listing.diagnostics.is_empty());
    let report = syncer.sync(&node, &listing);
    assert!(
        report.applied.is_empty() && report.removed.is_empty(),
        "{report:?}"
    );
    tokio::time::sleep(Duration::from_secs(30)).await;
    let status = node.status("web").expect("still there");
    assert_eq!(status.id, id);
    assert!(running(&node, "web"));
    let error = status
        .spec_error
        .as_deref()
        .expect("the diagnostic is shown");
    assert!(
        error.contains("web.yaml:") && error.contains("stdoutStrin"),
        "{error}"
    );

    // Fixed again: the error clears, and the same revision keeps running.
    std::fs::write(&path, spec("web", "a")).expect("write");
    let report = syncer.sync(&node, &list_specs(dir.path()));
    assert!(report.applied.is_empty(), "{report:?}");
    let status = node.status("web").expect("still there");
    assert_eq!(
        (status.id.as_str(), status.spec_error.as_deref()),
        (id.as_str(), None)
    );

    std::fs::remove_file(&path).expect("remove");
    let report = syncer.sync(&node, &list_specs(dir.path()));
    assert_eq!(report.removed.len(), 1);
    assert!(
        node.wait_until(DEADLINE, |n| n.gc_candidates().iter().any(|c| c
            .key
            .as_str()
            == "web"
            && c.collectable))
            .await
    );
}

#[tokio::test(start_paused = true)]
async fn a_file_that_names_no_alloc_keeps_the_allocs_it_declared_running_with_its_error() {
    // Each way a file can stop naming its allocs: its other allocs are unknown, not gone.
    let oversized = format!(
        "{}# {}\n",
        spec("web", "a"),
        "x".repeat(stead_schemas::MAX_SPEC_FILE_BYTES)
    );
    let breakages: [(&str, Vec<u8>); 5] = [
        (
            "not yaml",
            b"apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: web\n".to_vec(),
        ),
        ("empty", Vec::new()),
        ("not utf-8", b"apiVersion: stead/v1\n\xff\xfe\n".to_vec()),
        ("too large", oversized.into_bytes()),
        (
            "a document without a name",
            format!(
                "{}---\napiVersion: stead/v1\nkind: Alloc\nmetadata: {{}}\n",
                spec("api", "b")
            )
            .into_bytes(),
        ),
    ];
    for (what, content) in breakages {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("web.yaml");
        let both = format!("{}---\n{}", spec("web", "a"), spec("api", "b"));
        std::fs::write(&path, &both).expect("write");
        let (node, mut syncer) = synced(dir.path(), &["web", "api"]).await;
        let id = node.status("web").expect("published").id.clone();

        std::fs::write(&path, content).expect("write");
        let report = syncer.sync(&node, &list_specs(dir.path()));
        assert!(report.removed.is_empty(), "{what}: {report:?}");
        tokio::time::sleep(Duration::from_secs(30)).await;
        let status = node.status("web").expect("still there");
        assert_eq!(status.id, id, "{what}: the same revision runs");
        assert!(running(&node, "web") && running(&node, "api"), "{what}");
        let error = status.spec_error.as_deref().unwrap_or_default();
        assert!(error.contains("web.yaml:"), "{what}: {error:?}");

        // Fixed: the errors clear and nothing restarted.
        std::fs::write(&path, &both).expect("write");
        let report = syncer.sync(&node, &list_specs(dir.path()));
        assert_eq!(report, SyncReport::default(), "{what}");
        let status = node.status("web").expect("still there");
        assert_eq!(
            (status.id.as_str(), status.spec_error.as_deref()),
            (id.as_str(), None),
            "{what}"
        );
        assert_eq!(events(&node, "web", "Started"), 1, "{what}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_file_that_names_no_alloc_does_not_keep_the_allocs_of_a_deleted_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("web.yaml"), spec("web", "a")).expect("write");
    std::fs::write(dir.path().join("api.yaml"), spec("api", "b")).expect("write");
    let (node, mut syncer) = synced(dir.path(), &["web", "api"]).await;

    std::fs::write(dir.path().join("web.yaml"), "kind: [").expect("write");
    std::fs::remove_file(dir.path().join("api.yaml")).expect("remove");
    let report = syncer.sync(&node, &list_specs(dir.path()));
    assert_eq!(
        removed(&report),
        ["api"],
        "api's file is gone; web's file is broken"
    );
    assert!(running(&node, "web"));
}

#[tokio::test(start_paused = true)]
async fn after_a_restart_an_alloc_of_a_file_that_names_no_alloc_keeps_running() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("web.yaml"), spec("web", "a")).expect("write");
    let (clock, store) = (clock(), MemoryStore::default());
    let mock = MockDriver::new(clock);
    let first = node_over(store.clone(), mock.clone(), clock);
    Syncer::new([]).sync(&first, &list_specs(dir.path()));
    assert!(first.wait_until(DEADLINE, |n| running(n, "web")).await);
    first
        .shutdown(stead_controller::queue::Shutdown::Detach)
        .await;

    // While the agent is away, the file is half-written.
    std::fs::write(dir.path().join("web.yaml"), "apiVersion: stead/v1\nkind: [").expect("write");
    let second = node_over(store, mock, clock);
    let restored = second.restore().expect("restored");
    let mut syncer = Syncer::new(restored.allocs);
    let report = syncer.sync(&second, &list_specs(dir.path()));
    assert!(report.removed.is_empty(), "{report:?}");
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(running(&second, "web"));
    assert_eq!(events(&second, "web", "Killing"), 0);
    let error = second.status("web").and_then(|s| s.spec_error.clone());
    assert!(
        error.as_deref().is_some_and(|e| e.contains("web.yaml:")),
        "why it is kept is shown: {error:?}"
    );

    // Fixed: the file names the alloc again, and it is the same revision.
    std::fs::write(dir.path().join("web.yaml"), spec("web", "a")).expect("write");
    let report = syncer.sync(&second, &list_specs(dir.path()));
    assert_eq!(report, SyncReport::default());
    assert_eq!(events(&second, "web", "Started"), 1);
    assert_eq!(
        second.status("web").and_then(|s| s.spec_error.clone()),
        None
    );
}

#[tokio::test(start_paused = true)]
async fn an_alloc_known_before_the_first_listing_is_removed_only_by_a_listing_without_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("kept.yaml"), spec("kept", "a")).expect("write");
    let node = node();
    let mut first = Syncer::new([]);
    first.sync(&node, &list_specs(dir.path()));
    std::fs::write(dir.path().join("orphan.yaml"), spec("orphan", "b")).expect("write");
    first.sync(&node, &list_specs(dir.path()));
    assert!(
        node.wait_until(DEADLINE, |n| running(n, "kept") && running(n, "orphan"))
            .await
    );

    // As after a restart: the node knows both, the directory no longer has one.
    std::fs::remove_file(dir.path().join("orphan.yaml")).expect("remove");
    let known = node
        .statuses()
        .iter()
        .map(|s| {
            (
                s.name.parse().expect("name"),
                Some(stead_schemas::Revision::from_hex(&s.revision).expect("hex")),
            )
        })
        .collect::<Vec<_>>();
    let mut syncer = Syncer::new(known);
    let report = syncer.sync(&node, &list_specs(dir.path()));
    assert_eq!(removed(&report), ["orphan"]);
    assert!(
        report.applied.is_empty(),
        "the kept alloc is untouched: {report:?}"
    );
    assert!(
        node.wait_until(DEADLINE, |n| n.gc_candidates().iter().any(|c| c
            .key
            .as_str()
            == "orphan"
            && c.collectable))
            .await
    );
    assert!(running(&node, "kept"));
}

#[tokio::test(start_paused = true)]
async fn after_a_restart_nothing_stops_before_the_first_listing_and_then_only_the_orphan_stops() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("kept.yaml"), spec("kept", "a")).expect("write");
    std::fs::write(dir.path().join("orphan.yaml"), spec("orphan", "b")).expect("write");
    let (clock, store) = (clock(), MemoryStore::default());
    let mock = MockDriver::new(clock);
    let first = node_over(store.clone(), mock.clone(), clock);
    Syncer::new([]).sync(&first, &list_specs(dir.path()));
    assert!(
        first
            .wait_until(DEADLINE, |n| running(n, "kept") && running(n, "orphan"))
            .await
    );
    first
        .shutdown(stead_controller::queue::Shutdown::Detach)
        .await;

    // While the agent is away, one spec is deleted.
    std::fs::remove_file(dir.path().join("orphan.yaml")).expect("remove");
    let second = node_over(store, mock, clock);
    let restored = second.restore().expect("restored");
    assert_eq!(restored.restored, 2);
    assert!(
        second
            .wait_until(DEADLINE, |n| running(n, "kept") && running(n, "orphan"))
            .await
    );
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(
        running(&second, "orphan") && events(&second, "orphan", "Killing") == 0,
        "nothing is stopped before the first listing"
    );

    // As the agent does: the source starts from what the restore found.
    let report = Syncer::new(restored.allocs).sync(&second, &list_specs(dir.path()));
    assert_eq!(report.removed.len(), 1);
    assert!(report.applied.is_empty(), "{report:?}");
    assert!(
        second
            .wait_until(DEADLINE, |n| collectable(n, "orphan"))
            .await
    );
    assert!(running(&second, "kept"));
    assert_eq!(
        events(&second, "kept", "Started"),
        1,
        "kept was never restarted"
    );
    assert_eq!(events(&second, "kept", "Killing"), 0);
}

#[tokio::test(start_paused = true)]
async fn one_gc_pass_over_sixty_removed_allocs_leaves_the_fifty_newest_and_the_running_one() {
    let node = Arc::new(node());
    let batch = |name: &str| {
        let yaml = format!(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  type: batch\n  tasks:\n    - {{name: t, driver: mock, config: {{runFor: 1s}}}}\n"
        );
        let file = stead_schemas::parse_spec_file(std::path::Path::new("b.yaml"), &yaml);
        file.specs().next().expect("valid").clone()
    };
    let complete = |node: &Node, name: &str| {
        node.status(name)
            .is_some_and(|s| s.client_status == "complete")
    };
    // Finished one after another; names run against age, so age alone decides.
    let names: Vec<String> = (0..60).map(|i| format!("b-{:02}", 59 - i)).collect();
    for name in &names {
        node.apply(batch(name));
        assert!(node.wait_until(DEADLINE, |n| complete(n, name)).await);
    }
    let web = spec("web", "w");
    let file = stead_schemas::parse_spec_file(std::path::Path::new("web.yaml"), &web);
    node.apply(file.specs().next().expect("valid").clone());
    assert!(node.wait_until(DEADLINE, |n| running(n, "web")).await);
    for name in &names {
        node.remove(&name.parse().expect("name"));
    }
    assert!(
        node.wait_until(DEADLINE, |n| names.iter().all(|name| collectable(n, name)))
            .await
    );

    let data = tempfile::tempdir().expect("temp dir");
    // A threshold of 100 % is never exceeded: only the count applies here.
    let policy = stead_reconcilers::gc::GcPolicy {
        disk_usage_threshold: 100,
        ..stead_reconcilers::gc::GcPolicy::default()
    };
    let report = stead_controller::gc::collect_once(&node, &policy, data.path()).await;
    assert!(report.refused.is_empty(), "{:?}", report.refused);
    let mut collected: Vec<String> = report.collected.iter().map(|n| n.to_string()).collect();
    collected.sort();
    let mut oldest: Vec<String> = names[..10].to_vec();
    oldest.sort();
    assert_eq!(collected, oldest, "the ten that finished first went");
    assert_eq!(node.statuses().len(), 51);
    for name in &names[10..] {
        assert!(node.status(name).is_some(), "{name} is kept");
    }
    assert!(running(&node, "web"), "a running alloc is never collected");

    // A second pass finds nothing more to do.
    let again = stead_controller::gc::collect_once(&node, &policy, data.path()).await;
    assert!(again.collected.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_pass_says_which_revision_an_edit_replaced_and_a_new_alloc_replaces_none() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::write(dir.path().join("web.yaml"), spec("web", "a")).expect("write");
    let (node, mut syncer) = synced(dir.path(), &["web"]).await;
    let before = node.status("web").expect("web").revision.clone();

    std::fs::write(dir.path().join("web.yaml"), spec("web", "b")).expect("write");
    std::fs::write(dir.path().join("api.yaml"), spec("api", "a")).expect("write");
    let report = syncer.sync(&node, &list_specs(dir.path()));
    let applied: Vec<&str> = report.applied.iter().map(|n| n.as_str()).collect();
    assert_eq!(applied, ["api", "web"]);
    let replaced: Vec<(&str, String)> = report
        .replaced
        .iter()
        .map(|(name, revision)| (name.as_str(), revision.to_string()))
        .collect();
    assert_eq!(replaced, [("web", before)]);
}
