//! `stead-bench ui [ALLOCS] [ROUNDS]`: the status page's server time on a full node.
//!
//! ALLOCS allocs (default 2,000) of two mock tasks run on a node; each round requests
//! the node view (`GET /ui`), one alloc's view (`GET /ui/allocs/{name}`) and, as the
//! baseline measured in the same run, the JSON list the page polls (`GET /v1/allocs`),
//! through the API's router in process (no sockets: server time only). Reported: the
//! median and the slowest of ROUNDS rounds (default 30) of each, the node view's size,
//! and its ratio to the baseline.

use std::time::Duration;

use anyhow::{Context, bail};
use axum::body::Body;
use axum::http::Request;
use stead_controller::api::{self, ApiState};
use tokio::runtime::Runtime;
use tower::ServiceExt;

use crate::measure::median;

pub(crate) fn run(runtime: &Runtime) -> anyhow::Result<()> {
    let mut args = std::env::args().skip(2);
    let mut next = |default: usize| -> anyhow::Result<usize> {
        Ok(args
            .next()
            .map(|a| a.parse())
            .transpose()?
            .unwrap_or(default))
    };
    let allocs = next(2_000)?;
    let rounds = next(30)?.max(1);
    runtime.block_on(bench(allocs, rounds))
}

/// One request through the router: its time and body size.
async fn time(state: &ApiState, path: &str) -> anyhow::Result<(Duration, usize)> {
    let request = Request::get(path).body(Body::empty())?;
    let start = crate::measure::now();
    let response = api::router(state.clone()).oneshot(request).await?;
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX).await?;
    let took = start.elapsed();
    if !status.is_success() {
        bail!("{path} answered {status}");
    }
    Ok((took, body.len()))
}

async fn bench(allocs: usize, rounds: usize) -> anyhow::Result<()> {
    let (_, node, state, data_dir) = crate::api::served_mock_node("ui");
    for i in 0..allocs {
        let yaml = format!(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: alloc-{i}}}\nspec:\n  tasks:\n    - {{name: main, driver: mock, config: {{}}}}\n    - {{name: side, driver: mock, config: {{}}, lifecycle: {{hook: prestart, sidecar: true}}}}\n"
        );
        let file = stead_schemas::parse_spec_file(std::path::Path::new("bench.yaml"), &yaml);
        let spec = file.specs().next().context("a valid bench spec")?.clone();
        node.apply(spec);
    }
    let start = crate::measure::now();
    loop {
        let statuses = node.statuses();
        if statuses.len() == allocs
            && statuses
                .iter()
                .all(|s| s.tasks.values().all(|t| t.state == "running"))
        {
            break;
        }
        if start.elapsed() > Duration::from_secs(120) {
            bail!("the allocs did not all run within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let (mut page, mut one, mut list) = (Vec::new(), Vec::new(), Vec::new());
    let (mut page_bytes, mut list_bytes) = (0, 0);
    for round in 0..rounds {
        let (took, size) = time(&state, "/ui").await?;
        page.push(took);
        page_bytes = size;
        let (took, _) = time(
            &state,
            &format!("/ui/allocs/alloc-{}", round % allocs.max(1)),
        )
        .await?;
        one.push(took);
        let (took, size) = time(&state, "/v1/allocs").await?;
        list.push(took);
        list_bytes = size;
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let report = |what: &str, times: &mut Vec<Duration>| {
        times.sort();
        println!(
            "  {what:<34} median {:>8.2} ms   max {:>8.2} ms",
            ms(median(times)),
            ms(*times.last().unwrap_or(&Duration::ZERO))
        );
    };
    println!(
        "stead-bench ui: {allocs} allocs of two mock tasks, {rounds} rounds, server time in process"
    );
    report("GET /ui (node view)", &mut page);
    report("GET /ui/allocs/{name} (alloc view)", &mut one);
    report("GET /v1/allocs (baseline: JSON)", &mut list);
    println!(
        "  node view {:.0} KiB of HTML (target <= 1024), {:.1}x the JSON list's time ({:.0} KiB); target <= 200 ms",
        page_bytes as f64 / 1024.0,
        ms(median(&page)) / ms(median(&list)).max(1e-9),
        list_bytes as f64 / 1024.0,
    );
    let _ = std::fs::remove_dir_all(&data_dir);
    Ok(())
}
