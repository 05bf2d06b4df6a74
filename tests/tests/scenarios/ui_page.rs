//! The status page as the router serves it (in process, mock driver): what each view
//! lists and in which order, the token, the security headers, escaping of everything an
//! alloc carries, and the API additions the page polls. The browser tests
//! (`ui_browser`) drive the same pages through a real Chromium.

use crate::api_support;

use api_support::{Answer, Transport, agent, alloc};
use axum::http::{Method, StatusCode};
use stead_schemas::api::AllocListItem;
use stead_schemas::status::AllocStatus;

const TOKEN: &str = "page-token";
const SCRIPT: &str = "<script>window.pwned=1</script>";

/// An agent with a running alloc `web` (a prestart sidecar beside its main task, and a
/// line of stdout), a failed one `crash` whose start error carries a script, and
/// `done`, a batch that completed.
async fn node() -> api_support::TestAgent {
    let agent = agent();
    agent.node.apply(alloc(
        "web",
        "  tasks:\n    - {name: main, driver: mock, config: {}}\n    - {name: proxy, driver: mock, config: {}, lifecycle: {hook: prestart, sidecar: true}}\n",
    ));
    agent.node.apply(alloc(
        "crash",
        &format!(
            "  tasks:\n    - {{name: main, driver: mock, config: {{startError: {SCRIPT:?}}}}}\n  restart: {{attempts: 0, mode: fail}}\n"
        ),
    ));
    agent.node.apply(alloc(
        "done",
        "  type: batch\n  tasks:\n    - {name: main, driver: mock, config: {runFor: 1ms}}\n",
    ));
    agent.until_running("web").await;
    agent
        .until("crash fails and done completes", |node| {
            node.status("crash")
                .is_some_and(|s| s.client_status == "failed")
                && node
                    .status("done")
                    .is_some_and(|s| s.client_status == "complete")
        })
        .await;
    std::fs::write(
        agent.log_dir("web").join("main.stdout.0"),
        format!("booting\n{SCRIPT}\n"),
    )
    .expect("log file");
    agent
}

fn html(answer: &Answer) -> String {
    assert_eq!(
        answer.headers["content-type"],
        "text/html; charset=utf-8",
        "{}",
        answer.text()
    );
    answer.text()
}

/// Where `needle` is in `text`, which must hold it.
fn at(text: &str, needle: &str) -> usize {
    text.find(needle)
        .unwrap_or_else(|| panic!("{needle:?} not in:\n{text}"))
}

#[tokio::test]
async fn the_node_view_lists_every_alloc_with_its_status_failing_first() {
    let agent = node().await;
    let api = Transport::InProcess(agent.state.clone());
    let page = api.get("/ui", None).await;
    assert_eq!(page.status, StatusCode::OK);
    let page = html(&page);

    let list: Vec<AllocListItem> =
        serde_json::from_slice(&api.get("/v1/allocs", None).await.body).expect("the list");
    for item in &list {
        let row = at(&page, &format!("<tr data-alloc=\"{}\"", item.name));
        let status = format!(
            "<td data-f=\"status\" class=\"status s-{0}\">{0}</td>",
            item.client_status
        );
        assert!(
            page[row..].find(&status) < page[row..].find("</tr>"),
            "{} shows {}:\n{page}",
            item.name,
            item.client_status
        );
    }
    let (crash, web, done) = (
        at(&page, "data-alloc=\"crash\""),
        at(&page, "data-alloc=\"web\""),
        at(&page, "data-alloc=\"done\""),
    );
    assert!(
        crash < web && web < done,
        "failed, running, complete:\n{page}"
    );

    // Counts, drivers, version; the tasks and restarts columns.
    assert!(page.contains("data-count=\"running\">1<"), "{page}");
    assert!(page.contains("data-count=\"failed\">1<"), "{page}");
    assert!(page.contains("<strong>mock</strong>"), "{page}");
    assert!(page.contains(env!("CARGO_PKG_VERSION")), "{page}");
    let web_row = &page[web..];
    assert!(
        web_row.contains("<td data-f=\"tasks\">2/2</td>"),
        "{web_row}"
    );

    // The filter, without JavaScript: a GET form.
    let filtered = html(&api.get("/ui?q=we", None).await);
    assert!(filtered.contains("data-alloc=\"web\""), "{filtered}");
    assert!(!filtered.contains("data-alloc=\"crash\""), "{filtered}");
}

#[tokio::test]
async fn the_alloc_view_shows_tasks_events_newest_first_the_revision_file_and_log_tails() {
    let agent = node().await;
    let api = Transport::InProcess(agent.state.clone());
    agent
        .node
        .set_spec_file(&"web".parse().expect("a name"), "/etc/stead/specs/web.yaml");
    let status: AllocStatus =
        serde_json::from_slice(&api.get("/v1/allocs/web", None).await.body).expect("status");
    assert_eq!(
        status.spec_file.as_deref(),
        Some("/etc/stead/specs/web.yaml")
    );
    assert_eq!(
        status.tasks["proxy"].lifecycle.as_deref(),
        Some("prestart sidecar")
    );
    assert_eq!(status.tasks["main"].lifecycle, None);

    let page = html(&api.get("/ui/allocs/web", None).await);
    assert!(
        page.contains(&status.revision),
        "the full revision:\n{page}"
    );
    assert!(page.contains("/etc/stead/specs/web.yaml"), "{page}");
    assert!(page.contains("<td>prestart sidecar</td>"), "{page}");
    assert!(page.contains("<td>main</td>"), "{page}");
    let proxy = at(&page, "<tr data-task=\"proxy\"");
    assert!(page[proxy..].contains("t-running"), "{page}");
    // Events newest first.
    let events = &page[at(&page, "<table id=\"events\"")..at(&page, "<h2>Logs</h2>")];
    assert!(
        events.contains("<td>proxy</td><td>Started</td>"),
        "{events}"
    );
    let times: Vec<&str> = events
        .split("<time datetime=\"")
        .skip(1)
        .map(|rest| &rest[..rest.find('"').expect("a closing quote")])
        .collect();
    assert!(times.len() >= 4, "{events}");
    let parsed: Vec<stead_schemas::Timestamp> = times
        .iter()
        .map(|t| serde_json::from_value(serde_json::json!(t)).expect("a timestamp"))
        .collect();
    assert!(parsed.windows(2).all(|w| w[0] >= w[1]), "{times:?}");
    // The log tail, with the offset following goes on from.
    let offset = "booting\n".len() + SCRIPT.len() + 1;
    let log = at(
        &page,
        &format!("data-task=\"main\" data-stream=\"stdout\" data-offset=\"{offset}\""),
    );
    assert!(page[log..].contains("booting"), "{page}");

    let missing = api.get("/ui/allocs/nope", None).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert!(html(&missing).contains("No alloc is named"));
}

#[tokio::test]
async fn a_spec_error_an_event_and_a_log_line_reach_the_page_as_text() {
    let agent = node().await;
    agent.node.set_spec_error(
        &"web".parse().expect("a name"),
        Some(format!("bad field {SCRIPT}")),
    );
    let api = Transport::InProcess(agent.state.clone());
    let escaped = "&lt;script&gt;window.pwned=1&lt;/script&gt;";
    for path in ["/ui", "/ui/allocs/crash", "/ui/allocs/web"] {
        let page = html(&api.get(path, None).await);
        assert!(
            !page.contains("<script>"),
            "{path} carries a script:\n{page}"
        );
        // Every script of the page is the agent's own file; no inline style either.
        assert_eq!(page.matches("<script").count(), 1, "{page}");
        assert!(
            page.contains("<script src=\"/ui/static/stead.js\" defer>"),
            "{page}"
        );
        assert!(!page.contains(" style="), "{page}");
        if path != "/ui" {
            assert!(
                page.contains(escaped),
                "{path} shows the script as text:\n{page}"
            );
        }
    }
    let crash = html(&api.get("/ui/allocs/crash", None).await);
    assert!(
        crash.contains(&format!("failed: {escaped}</td>")),
        "the event:\n{crash}"
    );
    let web = html(&api.get("/ui/allocs/web", None).await);
    assert!(
        web.contains(&format!("bad field {escaped}")),
        "the spec error:\n{web}"
    );
    assert!(
        web.contains(&format!("booting\n{escaped}")),
        "the log:\n{web}"
    );
}

#[tokio::test]
async fn every_response_of_the_page_allows_only_the_agents_own_files_and_no_framing() {
    let agent = node().await;
    let api = Transport::InProcess(agent.state.clone());
    for (path, content_type) in [
        ("/ui", "text/html; charset=utf-8"),
        ("/ui/allocs/web", "text/html; charset=utf-8"),
        ("/ui/static/stead.css", "text/css; charset=utf-8"),
        ("/ui/static/stead.js", "text/javascript; charset=utf-8"),
    ] {
        let answer = api.get(path, None).await;
        assert_eq!(answer.status, StatusCode::OK, "{path}");
        assert_eq!(answer.headers["content-type"], content_type, "{path}");
        let policy = answer.headers["content-security-policy"]
            .to_str()
            .expect("ascii");
        assert!(
            policy.starts_with("default-src 'self';"),
            "{path}: {policy}"
        );
        assert!(
            policy.contains("frame-ancestors 'none'"),
            "{path}: {policy}"
        );
        assert_eq!(answer.headers["x-frame-options"], "DENY", "{path}");
        assert_eq!(
            answer.headers["x-content-type-options"], "nosniff",
            "{path}"
        );
    }
    let root = api.get("/", None).await;
    assert_eq!(root.status, StatusCode::SEE_OTHER);
    assert_eq!(root.headers["location"], "/ui");
}

#[tokio::test]
async fn without_the_token_a_page_asks_for_it_and_shows_nothing_of_the_node() {
    let agent = node().await;
    let state = agent.state.clone().with_token(Some(TOKEN.to_owned()));
    let api = Transport::InProcess(state);
    for path in ["/ui", "/ui/allocs/web"] {
        let locked = api.get(path, None).await;
        assert_eq!(locked.status, StatusCode::UNAUTHORIZED, "{path}");
        let page = html(&locked);
        assert!(page.contains("id=\"login\""), "{page}");
        for name in ["web", "crash", "done", "booting", "Started"] {
            assert!(
                !page.contains(&format!(">{name}<")) && !page.contains(&format!("\"{name}\"")),
                "{path} shows {name}:\n{page}"
            );
        }
        let wrong = api.get(path, Some("not-the-token")).await;
        assert_eq!(wrong.status, StatusCode::UNAUTHORIZED, "{path}");
        let open = api.get(path, Some(TOKEN)).await;
        assert_eq!(open.status, StatusCode::OK, "{path}");
        assert!(html(&open).contains("data-alloc=\"web\""), "{path}");
    }
    // The assets hold nothing of the node: served to anyone.
    let script = api.get("/ui/static/stead.js", None).await;
    assert_eq!(script.status, StatusCode::OK);
}

#[tokio::test]
async fn a_post_from_a_page_of_another_origin_is_refused_and_changes_nothing() {
    let agent = node().await;
    let served = api_support::serve_tcp(&agent.state).await;
    let client = reqwest::Client::new();
    let restart = |origin: &'static str| {
        client
            .post(format!("http://{}/v1/allocs/web/restart", served.address))
            .header("origin", origin)
            .header("content-type", "text/plain")
            .body("{\"task\": \"main\"}")
            .send()
    };
    let refused = restart("http://evil.example").await.expect("an answer");
    assert_eq!(refused.status(), StatusCode::FORBIDDEN);
    let body: serde_json::Value =
        serde_json::from_str(&refused.text().await.expect("a body")).expect("a json error");
    assert_eq!(body["code"], "cross_origin");
    let null = restart("null").await.expect("an answer");
    assert_eq!(null.status(), StatusCode::FORBIDDEN);
    assert_eq!(
        agent.node.status("web").expect("web").tasks["main"].restarts,
        0
    );

    // The page's own origin, and programs that send no Origin, act.
    let own: &'static str = Box::leak(format!("http://{}", served.address).into_boxed_str());
    assert_eq!(
        restart(own).await.expect("an answer").status(),
        StatusCode::ACCEPTED
    );
    agent
        .until("main restarted", |node| {
            node.status("web")
                .is_some_and(|s| s.tasks["main"].restarts == 1)
        })
        .await;
    let api = Transport::InProcess(agent.state.clone());
    let plain = api
        .call(Method::POST, "/v1/allocs/web/restart", None, None)
        .await;
    assert_eq!(plain.status, StatusCode::ACCEPTED, "{}", plain.text());
    served.stop().await;
}

#[tokio::test]
async fn the_list_names_each_allocs_newest_event() {
    let agent = node().await;
    let api = Transport::InProcess(agent.state.clone());
    let list: Vec<AllocListItem> =
        serde_json::from_slice(&api.get("/v1/allocs?usage=true", None).await.body)
            .expect("the list");
    let crash = list.iter().find(|i| i.name == "crash").expect("crash");
    let event = crash.last_event.as_ref().expect("crash has events");
    let status = agent.node.status("crash").expect("crash");
    let newest = status.tasks["main"].events.last().expect("events");
    assert_eq!(
        (
            event.task.as_str(),
            &event.event_type,
            &event.message,
            event.time
        ),
        ("main", &newest.event_type, &newest.message, newest.time)
    );
    // The mock driver has no cgroups: nothing is measured, and nothing is made up.
    assert!(list.iter().all(|i| i.usage.is_none()), "{list:?}");
    let bad = api.get("/v1/allocs?usage=maybe", None).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}
