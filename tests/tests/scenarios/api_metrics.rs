//! `GET /metrics`: the Prometheus text format that a Prometheus parser accepts (or
//! OpenMetrics when `Accept` asks for it), with every series the agent promises, moved
//! by what the node does.

use crate::api_support;

use std::collections::BTreeSet;

use api_support::{Transport, agent, alloc, forever};
use axum::body::Body;
use axum::http::{Request, StatusCode};
use stead_controller::api;
use stead_controller::metrics::{self, Metrics};
use tower::ServiceExt;

fn parse(text: &str) -> prometheus_parse::Scrape {
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
        .expect("the prometheus parser accepts /metrics")
}

fn value(scrape: &prometheus_parse::Scrape, name: &str, label: Option<(&str, &str)>) -> f64 {
    let sample = scrape
        .samples
        .iter()
        .find(|s| s.metric == name && label.is_none_or(|(k, v)| s.labels.get(k) == Some(v)))
        .unwrap_or_else(|| panic!("no sample {name} {label:?}"));
    match &sample.value {
        prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Untyped(v) => *v,
        prometheus_parse::Value::Histogram(buckets) => buckets.last().map_or(0.0, |b| b.count),
        prometheus_parse::Value::Summary(_) => panic!("{name} is a summary"),
    }
}

#[tokio::test]
async fn metrics_parse_as_prometheus_text_and_name_every_promised_series() {
    let agent = agent();
    let state = agent.state.clone().with_metrics(Metrics::new());
    agent.node.apply(alloc("web", &forever("main")));
    agent.node.apply(alloc(
        "crashy",
        "  restart: {attempts: 1, delay: 10ms, interval: 1m, mode: fail}\n  tasks:\n    - {name: main, driver: mock, config: {runFor: 1ms, exitCode: 1}}\n",
    ));
    agent.until_running("web").await;
    agent
        .until("crashy fails", |node| {
            node.status("crashy")
                .is_some_and(|s| s.client_status == "failed")
        })
        .await;

    let answer = Transport::InProcess(state).get("/metrics", None).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(
        answer.headers["content-type"].to_str().expect("ascii"),
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let text = answer.text();
    assert!(!text.contains("# EOF"), "no OpenMetrics marker: {text}");
    let scrape = parse(&text);
    let names: BTreeSet<&str> = scrape.samples.iter().map(|s| s.metric.as_str()).collect();
    for name in [
        metrics::RECONCILES,
        metrics::RECONCILE_DURATION,
        metrics::QUEUE_DEPTH,
        metrics::COALESCED_UPDATES,
        metrics::TASK_STARTS,
        metrics::TASK_STATE,
        metrics::TASK_RESTARTS,
        metrics::TASK_OOM_KILLS,
        metrics::TASK_FAILURES,
        metrics::CHECK_RESULTS,
        metrics::CHECK_RESTARTS,
        metrics::STORE_WRITES,
        metrics::STORE_SKIPPED_WRITES,
        metrics::STORE_WRITE_ERRORS,
        metrics::ALLOCS,
    ] {
        assert!(names.contains(name), "{name} missing from {names:?}");
    }
    assert!(value(&scrape, metrics::RECONCILES, None) > 0.0);
    assert!(
        value(&scrape, metrics::RECONCILE_DURATION, None) > 0.0,
        "observations counted"
    );
    assert!(
        value(&scrape, metrics::TASK_STARTS, None) >= 3.0,
        "web once, crashy twice"
    );
    let crashy = |name| {
        scrape
            .samples
            .iter()
            .find(|s| {
                s.metric == name
                    && s.labels.get("alloc") == Some("crashy")
                    && s.labels.get("task") == Some("main")
            })
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
                ref other => panic!("{name} is {other:?}"),
            })
    };
    assert_eq!(
        crashy(metrics::TASK_RESTARTS),
        Some(1.0),
        "one restart, then it failed"
    );
    assert_eq!(crashy(metrics::TASK_OOM_KILLS), Some(0.0));
    assert!(value(&scrape, metrics::TASK_FAILURES, None) >= 1.0);
    assert!(value(&scrape, metrics::STORE_WRITES, None) > 0.0);
    assert_eq!(
        value(&scrape, metrics::ALLOCS, Some(("client_status", "running"))),
        1.0
    );
    assert_eq!(
        value(&scrape, metrics::ALLOCS, Some(("client_status", "failed"))),
        1.0
    );
    assert_eq!(
        value(
            &scrape,
            metrics::ALLOCS,
            Some(("client_status", "complete"))
        ),
        0.0
    );
    assert!(
        scrape.docs.contains_key("stead_reconciles_total"),
        "help texts are rendered, by family: {:?}",
        scrape.docs
    );
}

#[tokio::test]
async fn a_scraper_whose_accept_prefers_openmetrics_gets_openmetrics_ending_with_eof() {
    let agent = agent();
    let state = agent.state.clone().with_metrics(Metrics::new());
    agent.node.apply(alloc("web", &forever("main")));
    agent.until_running("web").await;
    let request = Request::get("/metrics")
        .header(
            "accept",
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
        )
        .body(Body::empty())
        .expect("a request");
    let response = api::router(state)
        .oneshot(request)
        .await
        .expect("the router is infallible");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()["content-type"],
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("a body");
    let text = String::from_utf8(body.to_vec()).expect("utf-8");
    assert!(text.ends_with("# EOF\n"), "one complete exposition: {text}");
    assert!(
        text.contains("# TYPE stead_task_restarts counter\n")
            && text.contains("stead_task_restarts_total{alloc=\"web\",task=\"main\"} 0\n"),
        "a counter's family is named without _total: {text}"
    );
}
