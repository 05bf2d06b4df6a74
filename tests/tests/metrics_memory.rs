//! An agent that nobody scrapes keeps a flat heap: the reconcile passes of its level
//! re-check are counted in fixed-size metrics, never kept as samples until a scrape. And
//! an idle alloc costs a pass only at the tick's slow full sweep.

#[path = "scenarios/api_support/mod.rs"]
mod api_support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use api_support::{agent, alloc, forever};
use stead_controller::metrics::{self, Format, Metrics};
use stead_controller::node::{NodeConfig, sweep_every};

thread_local! {
    /// Bytes allocated minus bytes freed by this thread.
    static LIVE: Cell<i64> = const { Cell::new(0) };
}

/// The system allocator, counting each thread's live bytes.
struct Counting;

#[allow(unsafe_code)]
// SAFETY: every call is forwarded unchanged to the system allocator; the counting
// touches only a const-initialised thread-local cell, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LIVE.try_with(|live| live.set(live.get() + layout.size() as i64));
        // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let _ = LIVE.try_with(|live| live.set(live.get() - layout.size() as i64));
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live_bytes() -> i64 {
    LIVE.with(Cell::get)
}

fn reconciles(agent: &api_support::TestAgent) -> f64 {
    let text = Metrics::new()
        .render(agent.node.metrics_levels(), Format::Prometheus)
        .expect("renders");
    text.lines()
        .find_map(|line| line.strip_prefix(&format!("{} ", metrics::RECONCILES)))
        .and_then(|value| value.parse().ok())
        .expect("the reconcile counter is rendered")
}

// A current-thread runtime: the node's workers, the ticker and the mock tasks all run
// on this thread, so its count is the node's heap.
#[tokio::test(start_paused = true)]
async fn an_unscraped_agent_keeps_a_flat_heap_over_forty_thousand_reconciles_of_idle_allocs_each_only_at_the_sweep()
 {
    const ALLOCS: usize = 200;
    const TICKS: u32 = 2_000;
    let agent = agent();
    for index in 0..ALLOCS {
        agent
            .node
            .apply(alloc(&format!("web-{index}"), &forever("main")));
    }
    for index in 0..ALLOCS {
        agent.until_running(&format!("web-{index}")).await;
    }
    let tick = NodeConfig::default().tick;
    // Warm: every lazily built structure exists, every alloc has reconciled at rest.
    for _ in 0..50 {
        tokio::time::sleep(tick).await;
    }
    let before = (live_bytes(), reconciles(&agent));
    for _ in 0..TICKS {
        tokio::time::sleep(tick).await;
    }
    let after = (live_bytes(), reconciles(&agent));

    let passes = after.1 - before.1;
    // Issue 36: every alloc is swept once every `sweep_every(tick)` ticks and woken on no
    // other.
    let sweeps = f64::from(TICKS / sweep_every(tick));
    assert!(
        passes >= (sweeps - 1.0) * ALLOCS as f64 && passes <= (sweeps + 1.0) * ALLOCS as f64,
        "an idle alloc reconciles once per sweep, {sweeps} sweeps: {passes} passes"
    );
    // One sample kept per pass would be 16 bytes or more each: 640 KB here.
    let grown = after.0 - before.0;
    assert!(
        grown < 16 * 1024,
        "the heap grew by {grown} bytes over {passes} reconcile passes"
    );
}
