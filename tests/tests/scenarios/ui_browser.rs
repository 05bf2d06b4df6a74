//! The status page in a real browser: a real agent (`stead agent`, exec tasks, its
//! generated token) and Debian's headless Chromium driven over WebDriver by
//! chromedriver (`scripts/install-deps.sh` installs both). What an operator sees: every
//! alloc with the status the API reports, failing first; a task killed from outside
//! shows its restart within one poll; the restart button acts with the token and
//! changes nothing without it; a spec's, an event's or a log's `<script>` is text.

use crate::agent_support::{Agent, AgentDirs, free_port, processes_with, unique_nap, wait_for};

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};

/// The page polls the API every 2 s; a change shows within one poll, plus the time the
/// browser takes to run it.
const ONE_POLL: Duration = Duration::from_millis(2000 + 1500);

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// A headless Chromium under chromedriver, both ended on drop.
struct Browser {
    client: Option<Client>,
    driver: Child,
    _profile: tempfile::TempDir,
}

impl Browser {
    async fn start() -> Browser {
        let port = free_port();
        use std::os::unix::process::CommandExt;
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            // A group of its own, with the Chromium it starts: ended as one on drop.
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run {CHROMEDRIVER} ({e}): scripts/install-deps.sh installs chromium-driver")
            });
        let profile = tempfile::tempdir().expect("a browser profile dir");
        let capabilities = json!({
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                // As root in a sandbox: no Chromium sandbox, no GPU, and no calls home
                // (the network is closed; each would be refused).
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-quic", "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--window-size=1280,800",
                    format!("--user-data-dir={}", profile.path().display()),
                ],
            }
        });
        let Value::Object(capabilities) = capabilities else {
            unreachable!("an object")
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        let client = loop {
            match ClientBuilder::new(HttpConnector::new())
                .capabilities(capabilities.clone())
                .connect(&format!("http://127.0.0.1:{port}"))
                .await
            {
                Ok(client) => break client,
                Err(error) => {
                    assert!(
                        Instant::now() < deadline,
                        "no browser session within 30 s: {error}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        Browser {
            client: Some(client),
            driver,
            _profile: profile,
        }
    }

    fn client(&self) -> &Client {
        self.client.as_ref().expect("a session")
    }

    /// Evaluates `expression` in the page.
    async fn eval(&self, expression: &str) -> Value {
        self.client()
            .execute(&format!("return ({expression});"), Vec::new())
            .await
            .unwrap_or_else(|e| panic!("{expression}: {e}"))
    }

    /// Waits up to `within` until `expression` is true in the page.
    async fn until(&self, what: &str, within: Duration, expression: &str) {
        let deadline = Instant::now() + within;
        loop {
            if self.eval(expression).await == Value::Bool(true) {
                return;
            }
            if Instant::now() >= deadline {
                let body = self.eval("document.body.innerText").await;
                panic!("the page did not show {what} within {within:?}:\n{body}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The text of the first element that `css` selects.
    async fn text(&self, css: &str) -> String {
        self.client()
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"))
            .text()
            .await
            .expect("its text")
    }

    async fn click(&self, css: &str) {
        self.client()
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"))
            .click()
            .await
            .unwrap_or_else(|e| panic!("click {css}: {e}"));
    }

    /// Opens `path` of `agent` and, as the page asks, enters the agent's token.
    async fn open_with_token(&self, agent: &Agent, path: &str) {
        self.client()
            .goto(&format!("http://127.0.0.1:{}{path}", agent.port))
            .await
            .expect("the page loads");
        assert_eq!(self.eval("document.body.dataset.view").await, "locked");
        let field = self
            .client()
            .find(Locator::Css("#token"))
            .await
            .expect("the token field");
        field
            .send_keys(agent.token().expect("the agent's token"))
            .await
            .expect("typed");
        self.click("#login button[type=submit]").await;
        self.until(
            "the node once the token is entered",
            Duration::from_secs(10),
            "document.body.dataset.view !== 'locked'",
        )
        .await;
    }

    /// Waits until the page's script has ended two more polls of the API than now.
    async fn two_more_polls(&self) {
        let polls = self.eval("Number(document.body.dataset.polls || 0)").await;
        let target = polls.as_u64().expect("a count") + 2;
        self.until(
            "two more polls",
            ONE_POLL * 2,
            &format!("Number(document.body.dataset.polls || 0) >= {target}"),
        )
        .await;
    }

    /// Clicks the button `css`, then Confirm in the dialog it opens.
    async fn click_and_confirm(&self, css: &str) {
        self.click(css).await;
        self.until(
            "the confirmation",
            Duration::from_secs(5),
            "document.getElementById('confirm').open",
        )
        .await;
        self.click("#confirm-ok").await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // chromedriver killed alone leaves its Chromium running, orphaned: the whole
        // process group goes.
        drop(self.client.take());
        if let Some(group) = i32::try_from(self.driver.id())
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// An exec service whose one task runs until stopped, restarting 200 ms after it dies;
/// its command line carries `marker`, and it prints `line` once.
fn service(name: &str, marker: &str, line: &str) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  restart: {{attempts: 100, interval: 1h, delay: 200ms, mode: delay}}\n  tasks:\n    - name: main\n      driver: exec\n      killTimeout: 2s\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"echo '{line}'; trap 'exit 0' TERM; while :; do sleep 0.2; done\", \"{marker}\"]\n"
    )
}

/// An agent running `web` (a service that prints `line`) and `broken`, whose task cannot
/// start (its command does not exist) and which fails at once.
fn agent_with_a_failing_alloc(
    marker: &str,
    broken_command: &str,
    line: &str,
) -> (AgentDirs, Agent) {
    let dirs = AgentDirs::new("");
    dirs.write_spec("web", &service("web", marker, line));
    dirs.write_spec(
        "broken",
        &format!(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: broken}}\nspec:\n  restart: {{attempts: 0, mode: fail}}\n  tasks:\n    - name: main\n      driver: exec\n      config:\n        command: {broken_command:?}\n"
        ),
    );
    let agent = dirs.start();
    agent.wait_for_task("web", "web runs", Duration::from_secs(20), |t| {
        t.state == "running"
    });
    wait_for("broken fails", Duration::from_secs(20), || {
        match agent.status("broken") {
            Some(status) if status.client_status == "failed" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    (dirs, agent)
}

/// Waits until the agent shows web's task restarted once, then until the page's cell
/// `restarts` does, within one poll.
async fn until_restarted_once(agent: &Agent, browser: &Browser, restarts: &str) {
    agent.wait_for_task("web", "web's restart", Duration::from_secs(20), |t| {
        t.restarts == 1 && t.state == "running"
    });
    browser
        .until(
            "web's restart",
            ONE_POLL,
            &format!("document.querySelector('{restarts}').innerText === '1'"),
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_lists_every_alloc_as_the_api_does_failing_first_and_shows_a_restart_within_one_poll()
 {
    let marker = unique_nap();
    let (dirs, agent) =
        agent_with_a_failing_alloc(&marker, "/nonexistent/stead-ui-test", "web is up");
    dirs.write_spec("zeta", &service("zeta", &marker, "zeta is up"));
    agent.wait_for_task("zeta", "zeta runs", Duration::from_secs(20), |t| {
        t.state == "running"
    });
    let browser = Browser::start().await;
    browser.open_with_token(&agent, "/ui").await;

    let rows = browser
        .eval("Array.from(document.querySelectorAll('#allocs tbody tr'), r => [r.dataset.alloc, r.querySelector('[data-f=status]').innerText])")
        .await;
    let listed: Vec<(String, String)> = serde_json::from_value(rows).expect("rows");
    let (_, list) = agent.try_get("/v1/allocs").expect("the list");
    let api: Vec<Value> = serde_json::from_str(&list).expect("json");
    assert_eq!(listed.len(), api.len(), "{listed:?}");
    for item in &api {
        let name = item["name"].as_str().expect("a name");
        let shown = listed.iter().find(|(n, _)| n == name).expect("listed");
        assert_eq!(
            shown.1,
            item["clientStatus"].as_str().expect("a status"),
            "{name}"
        );
    }
    assert_eq!(
        listed[0].0, "broken",
        "the failing alloc sorts first: {listed:?}"
    );
    // The file each alloc was read from, as its page shows it.
    let file = agent.status("web").expect("web").spec_file;
    let expected = dirs.specs.join("web.yaml").display().to_string();
    assert_eq!(file.as_deref(), Some(expected.as_str()));

    // A task killed from outside: the page shows the restart within one poll of the API
    // showing it.
    let before = browser.text("tr[data-alloc=web] [data-f=restarts]").await;
    assert_eq!(before, "0");
    let pid = agent.status("web").expect("web").tasks["main"]
        .pid
        .expect("a pid");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).expect("a pid"),
        rustix::process::Signal::KILL,
    )
    .expect("killed");
    until_restarted_once(&agent, &browser, "tr[data-alloc=web] [data-f=restarts]").await;
    // Still sorted as the API ranks it, and nothing restarted but web.
    assert_eq!(
        browser
            .eval("document.querySelector('#allocs tbody tr').dataset.alloc")
            .await,
        "broken"
    );
    assert!(processes_with(&marker).len() >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_restart_button_restarts_the_task_with_the_token_and_changes_nothing_without_it() {
    let marker = unique_nap();
    let (_dirs, agent) =
        agent_with_a_failing_alloc(&marker, "/nonexistent/stead-ui-test", "web is up");
    let browser = Browser::start().await;
    browser.open_with_token(&agent, "/ui/allocs/web").await;
    let restarts = || agent.status("web").expect("web").tasks["main"].restarts;
    assert_eq!(restarts(), 0);
    // The log, opened: followed from where the page's tail ended.
    browser
        .click("details[data-task=main][data-stream=stdout] summary")
        .await;
    let log = "document.querySelector('details[data-task=main][data-stream=stdout] pre').innerText";
    assert_eq!(browser.eval(log).await, "web is up\n");

    browser
        .click_and_confirm("button[data-action=restart][data-task=main]")
        .await;
    until_restarted_once(&agent, &browser, "tr[data-task=main] [data-f=restarts]").await;
    assert!(
        browser
            .text("#notice")
            .await
            .contains("Restart of task main: accepted")
    );
    // The restarted run's first line arrives in the open log.
    browser
        .until(
            "the new run's line in the followed log",
            Duration::from_secs(5),
            &format!("{log} === 'web is up\\nweb is up\\n'"),
        )
        .await;

    // Without the token (this tab forgot it), the same click is refused and nothing
    // restarts.
    browser
        .eval("(sessionStorage.removeItem('stead-token'), true)")
        .await;
    browser
        .click_and_confirm("button[data-action=restart][data-task=main]")
        .await;
    browser
        .until(
            "the refusal",
            Duration::from_secs(5),
            "document.getElementById('notice').innerText.includes('refused (401)')",
        )
        .await;
    // A cancelled confirmation sends nothing either.
    browser.click("button[data-action=restart]").await;
    browser.click("#confirm button[value=cancel]").await;
    let pid = agent.status("web").expect("web").tasks["main"].pid;
    // Two polls later, anything the page sent has been acted on.
    browser.two_more_polls().await;
    let after = agent.status("web").expect("web");
    assert_eq!(after.tasks["main"].restarts, 1, "{after:?}");
    assert_eq!(after.tasks["main"].pid, pid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_in_a_spec_error_an_event_or_a_log_line_is_shown_as_text() {
    let marker = unique_nap();
    let script = "<script>window.pwned=1</script>";
    let (dirs, agent) =
        agent_with_a_failing_alloc(&marker, &format!("/nonexistent/{script}"), script);
    // A broken edit of web, whose diagnostics quote the bad value; web runs on.
    dirs.write_spec(
        "web",
        &service("web", &marker, script)
            .replace("killTimeout: 2s", &format!("killTimeout: \"{script}\"")),
    );
    wait_for(
        "web's spec error",
        Duration::from_secs(20),
        || match agent.status("web") {
            Some(status)
                if status
                    .spec_error
                    .as_deref()
                    .is_some_and(|e| e.contains("<script>")) =>
            {
                Ok(())
            }
            other => Err(format!("{other:?}")),
        },
    );
    let browser = Browser::start().await;

    browser.open_with_token(&agent, "/ui/allocs/broken").await;
    browser
        .until(
            "the event with the script as text",
            Duration::from_secs(5),
            "document.querySelector('#events').innerText.includes('<script>window.pwned=1</script>')",
        )
        .await;
    assert_eq!(browser.eval("window.pwned === undefined").await, true);

    browser
        .client()
        .goto(&format!("http://127.0.0.1:{}/ui/allocs/web", agent.port))
        .await
        .expect("the page loads");
    // The token is still in this tab's session storage: the page loads it by itself.
    browser
        .until(
            "web's page",
            Duration::from_secs(10),
            "document.body.dataset.view === 'alloc'",
        )
        .await;
    browser
        .click("details[data-task=main][data-stream=stdout] summary")
        .await;
    browser
        .until(
            "the log line and the spec error as text",
            Duration::from_secs(5),
            "document.querySelector('details[data-task=main][data-stream=stdout] pre').innerText.includes('<script>window.pwned=1</script>') && document.querySelector('pre[data-f=spec-error]').innerText.includes('<script>')",
        )
        .await;
    // Two polls later, nothing the page updated in place ran either.
    browser.two_more_polls().await;
    assert_eq!(browser.eval("window.pwned === undefined").await, true);
    assert_eq!(
        browser
            .eval("document.querySelectorAll('main script').length")
            .await,
        0
    );
}
