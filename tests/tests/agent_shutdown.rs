//! The agent's shutdown: a drain that waits on a wake-up from outside its allocs (a
//! driver's recovery), through the node in-process.

use std::sync::Arc;
use std::time::Duration;

use stead_controller::clock::Clock;
use stead_controller::driver::mock::MockDriver;
use stead_controller::driver::{Driver, Drivers, Health};
use stead_controller::node::{Node, NodeConfig};
use stead_controller::queue::Shutdown;
use stead_controller::store::MemoryStore;
use stead_schemas::status::AllocStatus;
use stead_schemas::{Timestamp, ValidSpec};

/// 2026-11-22T00:00:00Z: fixed, so times in failures are readable.
const START: Duration = Duration::from_secs(1_795_305_600);

/// A valid alloc `name` whose `spec:` body is `body` (indented by two).
fn alloc(name: &str, body: &str) -> ValidSpec {
    let yaml =
        format!("apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n{body}");
    let file = stead_schemas::parse_spec_file(std::path::Path::new("test.yaml"), &yaml);
    assert!(file.is_valid(), "{:#?}", file.all_diagnostics());
    file.specs().next().expect("one spec").clone()
}

fn has_event(status: Option<&AllocStatus>, task: &str, event_type: &str) -> bool {
    status
        .and_then(|s| s.tasks.get(task))
        .is_some_and(|t| t.events.iter().any(|e| e.event_type == event_type))
}

#[tokio::test(start_paused = true)]
async fn a_drain_runs_a_poststop_task_held_back_by_an_unhealthy_driver_once_it_recovers() {
    let clock = Clock::starting_at(Timestamp::from_since_epoch(START));
    let mock = MockDriver::new(clock);
    let drivers = Drivers::new([Arc::new(mock.clone()) as Arc<dyn Driver>]);
    let config = NodeConfig {
        seed: Some(7),
        fingerprint_period: Duration::from_secs(5),
        ..NodeConfig::default()
    };
    let node = Arc::new(Node::new(
        config,
        drivers,
        Arc::new(MemoryStore::default()),
        clock,
    ));
    node.apply(alloc(
        "web",
        "  tasks:\n    - {name: t, driver: mock, config: {}}\n    - {name: cleanup, driver: mock, config: {runFor: 1s}, lifecycle: {hook: poststop}}\n",
    ));
    let running = node
        .wait_until(Duration::from_secs(60), |node| {
            node.status("web")
                .is_some_and(|s| s.tasks.get("t").is_some_and(|t| t.state == "running"))
        })
        .await;
    assert!(running, "web never ran: {:#?}", node.statuses());
    mock.set_health(Health::Unhealthy);
    // Paused time: one fingerprint period passes, so the node sees the driver unhealthy.
    tokio::time::sleep(Duration::from_secs(6)).await;

    let draining = node.clone();
    let drain = tokio::spawn(async move { draining.shutdown(Shutdown::Drain).await });
    let held = node
        .wait_until(Duration::from_secs(60), |node| {
            has_event(node.status("web").as_deref(), "cleanup", "Driver Failure")
        })
        .await;
    assert!(
        held,
        "the poststop task was never held back: {:#?}",
        node.statuses()
    );
    mock.set_health(Health::Healthy);
    // The driver's recovery is seen within one fingerprint period, the poststop task then
    // runs for a second: a minute of paused time is ample.
    let drained = tokio::time::timeout(Duration::from_secs(60), drain).await;
    assert!(
        matches!(drained, Ok(Ok(()))),
        "the drain never ended after the driver recovered: {:#?}",
        node.statuses()
    );
    let status = node.status("web").expect("still published");
    assert!(
        has_event(Some(&status), "cleanup", "Started"),
        "{status:#?}"
    );
    assert_eq!(status.tasks["cleanup"].state, "dead", "{status:#?}");
}
