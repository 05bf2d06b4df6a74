//! Fleet mode against a real three-member etcd cluster: specs put in etcd run on their
//! nodes, status comes back, and nothing stops while etcd is away, is cut off, or loses
//! its leader.

use std::time::{Duration, Instant};

use rustix::process::Signal;
use stead_schemas::fleet::FleetAllocStatus;
use stead_schemas::status::AllocStatus;

use crate::agent_support::{Agent, AgentDirs, service_spec, unique_nap, wait_for};
use crate::etcd_support::{EtcdCluster, Proxy};

/// A mock alloc that runs for an hour; `version` lands in its config, so each value is
/// another revision.
fn mock_spec(name: &str, version: u32) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  tasks:\n    - name: main\n      driver: mock\n      config: {{runFor: 1h, stdoutString: \"v{version}\"}}\n"
    )
}

/// The revision of the one spec in `yaml`.
fn revision_of(yaml: &str) -> String {
    let file = stead_schemas::parse_spec_file(std::path::Path::new("spec.yaml"), yaml);
    let spec = file.specs().next().expect("a valid spec");
    spec.revision.as_str().to_owned()
}

/// An agent of node `node` (labels `labels`, `{zone: a}` style) on `urls`, below `prefix`.
fn fleet_agent(urls: &[String], prefix: &str, node: &str, labels: &str) -> AgentDirs {
    AgentDirs::new(&format!(
        "drivers: {{mock: {{enabled: true}}}}\nstore: {{memoryMB: 8}}\nfleet:\n  etcd: [{}]\n  prefix: {prefix}\n  node: {{name: {node}, labels: {labels}}}\n",
        urls.join(", ")
    ))
}

/// The `stead fleet` CLI on `urls`, in-process.
fn fleet(urls: &str, prefix: &str, args: &[&str]) -> (u8, String, String) {
    let mut argv = vec!["fleet", "--etcd", urls, "--prefix", prefix];
    argv.extend_from_slice(args);
    stead_tests::stead(&argv)
}

/// Whether alloc `name` runs on `agent`, and with a task that has not restarted.
fn running(agent: &Agent, name: &str) -> Option<AllocStatus> {
    agent
        .status(name)
        .filter(|s| s.client_status == "running" && s.desired_status == "run")
}

/// The statuses node `node` wrote, by alloc.
fn written(cluster: &EtcdCluster, prefix: &str, node: &str) -> Vec<(String, FleetAllocStatus)> {
    cluster
        .get_prefix(&format!("{prefix}/status/{node}/"))
        .into_iter()
        .map(|(key, value)| {
            let alloc = key.rsplit('/').next().expect("a key").to_owned();
            (
                alloc,
                serde_json::from_str(&value).expect("a status document"),
            )
        })
        .collect()
}

/// Starts the agent of `dirs` (node n1) and puts an exec service `svc` (its command
/// line carrying `marker`) under n1's key; the agent and the task's pid once it runs.
fn start_service(
    cluster: &EtcdCluster,
    prefix: &str,
    dirs: &AgentDirs,
    marker: &str,
) -> (Agent, Option<u32>) {
    let agent = dirs.start();
    cluster.put(
        &format!("{prefix}/desired/n1/svc"),
        &service_spec("svc", marker),
    );
    let task = agent.wait_for_task("svc", "svc runs", Duration::from_secs(15), |t| {
        t.state == "running"
    });
    (agent, task.pid)
}

/// Waits until `svc` runs on `agent` (started again), and returns its task.
fn reattached(agent: &Agent) -> stead_schemas::status::TaskStatus {
    agent.wait_for_task("svc", "svc reattached", Duration::from_secs(15), |t| {
        t.state == "running"
    })
}

/// Waits until node n1's status of `alloc` in etcd says `complete`.
fn wait_for_complete(cluster: &EtcdCluster, prefix: &str, alloc: &str) {
    wait_for(
        &format!("{alloc}'s stop is written"),
        Duration::from_secs(15),
        || {
            written(cluster, prefix, "n1")
                .into_iter()
                .find(|(name, s)| name == alloc && s.status.client_status == "complete")
                .ok_or_else(|| "not yet".to_owned())
        },
    );
}

/// `/v1/health`'s fleet component: healthy, and its message.
fn fleet_health(agent: &Agent) -> Option<(bool, String)> {
    let (_, body) = agent.try_get("/v1/health")?;
    let health: serde_json::Value = serde_json::from_str(&body).ok()?;
    let fleet = &health["components"]["fleet"];
    Some((
        fleet["healthy"].as_bool()?,
        fleet["message"].as_str().unwrap_or("").to_owned(),
    ))
}

#[test]
fn fleet_a_spec_put_under_a_nodes_key_runs_on_that_node_within_the_latency_bounds() {
    let cluster = EtcdCluster::start(3);
    let prefix = "/lat";
    let dirs = fleet_agent(&cluster.urls(), prefix, "n1", "{}");
    let agent = dirs.start();
    wait_for("the fleet is healthy", Duration::from_secs(20), || {
        fleet_health(&agent)
            .filter(|(ok, _)| *ok)
            .ok_or_else(|| "not yet".to_owned())
    });
    let mut latencies = Vec::new();
    for i in 0..100 {
        let name = format!("a{i}");
        let put = Instant::now();
        cluster.put(&format!("{prefix}/desired/n1/{name}"), &mock_spec(&name, 1));
        loop {
            if running(&agent, &name).is_some() {
                break;
            }
            assert!(
                put.elapsed() < Duration::from_secs(10),
                "{name} never ran:\n{}",
                agent.log_text()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        latencies.push(put.elapsed());
    }
    latencies.sort();
    let (p50, p99) = (latencies[49], latencies[98]);
    eprintln!("put → running over 100 puts: p50 {p50:?}, p99 {p99:?}");
    assert!(p50 <= Duration::from_millis(100), "p50 {p50:?}");
    assert!(p99 <= Duration::from_millis(500), "p99 {p99:?}");
}

#[test]
fn fleet_an_all_spec_runs_on_every_node_its_selector_matches_and_on_no_other() {
    let cluster = EtcdCluster::start(3);
    let prefix = "/all";
    let urls = cluster.urls();
    let nodes = [
        ("n1", "{zone: a}"),
        ("n2", "{zone: a}"),
        ("n3", "{zone: b}"),
    ];
    let dirs: Vec<AgentDirs> = nodes
        .iter()
        .map(|(node, labels)| fleet_agent(&urls, prefix, node, labels))
        .collect();
    let agents: Vec<Agent> = dirs.iter().map(AgentDirs::start).collect();

    let specs = tempfile::tempdir().expect("dir");
    let zoned = mock_spec("zoned", 1).replace(
        "metadata: {name: zoned}",
        "metadata: {name: zoned, nodeSelector: {zone: a}}",
    );
    std::fs::write(specs.path().join("zoned.yaml"), zoned).expect("spec");
    std::fs::write(specs.path().join("every.yaml"), mock_spec("every", 1)).expect("spec");
    let files = specs.path().to_str().expect("utf-8");
    let (code, out, err) = fleet(
        &cluster.urls_flag(),
        prefix,
        &["apply", "-f", files, "--all"],
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("/all/desired/_all/zoned: created"), "{out}");
    // A key for n3 alone, put after: once it runs there, n3 has seen the `_all` keys.
    cluster.put(
        &format!("{prefix}/desired/n3/marker"),
        &mock_spec("marker", 1),
    );
    for agent in &agents[..2] {
        wait_for("zoned and every run", Duration::from_secs(10), || {
            (running(agent, "zoned").is_some() && running(agent, "every").is_some())
                .then_some(())
                .ok_or_else(|| format!("{:?}", agent.alloc_names()))
        });
    }
    wait_for(
        "n3 runs its own key and every",
        Duration::from_secs(10),
        || {
            (running(&agents[2], "marker").is_some() && running(&agents[2], "every").is_some())
                .then_some(())
                .ok_or_else(|| format!("{:?}", agents[2].alloc_names()))
        },
    );
    assert!(
        !agents[2].alloc_names().contains(&"zoned".to_owned()),
        "n3 is zone b: {:?}",
        agents[2].alloc_names()
    );
    for agent in &agents[..2] {
        assert!(!agent.alloc_names().contains(&"marker".to_owned()));
    }
    // A failing alloc on n3, for `stead fleet status` to show with its last event.
    let failing = mock_spec("broken", 1)
        .replace(
            "spec:\n",
            "spec:\n  type: batch\n  restart: {attempts: 0, mode: fail}\n",
        )
        .replace("runFor: 1h", "runFor: 10ms, exitCode: 1");
    cluster.put(&format!("{prefix}/desired/n3/broken"), &failing);
    // `stead fleet status` shows the three up, with their allocs by client status, the
    // age of their newest status, and n3's failing alloc with its last event.
    let report = wait_for("every status is written", Duration::from_secs(15), || {
        let (code, out, err) = fleet(&cluster.urls_flag(), prefix, &["status", "--json"]);
        assert_eq!(code, 0, "{err}");
        let report: Vec<serde_json::Value> = serde_json::from_str(&out).expect("json");
        (report[2]["allocs"]["failed"] == 1
            && report[0]["allocs"]["running"] == 2
            && report[1]["allocs"]["running"] == 2)
            .then_some(report)
            .ok_or(out)
    });
    let up: Vec<bool> = report
        .iter()
        .map(|n| n["up"].as_bool() == Some(true))
        .collect();
    assert_eq!(up, [true, true, true], "{report:?}");
    assert!(report[0]["lastStatusAgeSeconds"].is_u64(), "{report:?}");
    assert_eq!(report[2]["failing"][0]["alloc"], "broken", "{report:?}");
    let last = report[2]["failing"][0]["lastEvent"].as_str().unwrap_or("");
    assert!(last.contains("Not Restarting"), "{report:?}");
    let (code, table, _) = fleet(&cluster.urls_flag(), prefix, &["status"]);
    assert_eq!(code, 0);
    assert!(
        table.contains("n3\tup\t") && table.contains("broken ("),
        "{table}"
    );
    // `stead fleet nodes`: the three claims, with their labels.
    let (code, out, err) = fleet(&cluster.urls_flag(), prefix, &["nodes", "--json"]);
    assert_eq!(code, 0, "{err}");
    let claims: serde_json::Value = serde_json::from_str(&out).expect("json");
    let zones: Vec<&str> = ["n1", "n2", "n3"]
        .iter()
        .map(|n| claims[n]["labels"]["zone"].as_str().unwrap_or("?"))
        .collect();
    assert_eq!(zones, ["a", "a", "b"], "{out}");
    let (code, table, _) = fleet(&cluster.urls_flag(), prefix, &["nodes"]);
    assert_eq!(code, 0);
    assert!(
        table.contains("n3\t") && table.contains("zone=b"),
        "{table}"
    );
}

#[test]
fn fleet_a_killed_etcd_leader_restarts_no_task_and_status_catches_up() {
    let mut cluster = EtcdCluster::start(3);
    let prefix = "/leader";
    let dirs = fleet_agent(&cluster.urls(), prefix, "n1", "{}");
    let agent = dirs.start();
    for name in ["a", "b"] {
        cluster.put(&format!("{prefix}/desired/n1/{name}"), &mock_spec(name, 1));
    }
    wait_for(
        "both run and their status is written",
        Duration::from_secs(10),
        || {
            let statuses = written(&cluster, prefix, "n1");
            (statuses.len() == 2
                && statuses
                    .iter()
                    .all(|(_, s)| s.status.client_status == "running"))
            .then_some(())
            .ok_or_else(|| format!("{statuses:?}"))
        },
    );
    let before = running(&agent, "a").expect("a runs").tasks["main"].started_at;

    let leader = cluster.leader();
    cluster.kill(leader);
    // A change of status right after: it reaches etcd within 3 s of the kill.
    let killed = Instant::now();
    agent.post("/v1/allocs/b/stop").expect("stopped");
    wait_for_complete(&cluster, prefix, "b");
    let caught_up = killed.elapsed();
    eprintln!("status caught up {caught_up:?} after the leader's SIGKILL");
    assert!(caught_up <= Duration::from_secs(3), "{caught_up:?}");
    let a = running(&agent, "a").expect("a still runs");
    assert_eq!(a.tasks["main"].restarts, 0);
    assert_eq!(a.tasks["main"].started_at, before, "a was not restarted");
    cluster.restart(leader);
}

#[test]
fn fleet_a_minute_without_etcd_stops_nothing_and_status_converges_after() {
    let cluster = EtcdCluster::start(3);
    let prefix = "/outage";
    let dirs = fleet_agent(&cluster.urls(), prefix, "n1", "{}");
    let agent = dirs.start();
    for name in ["a", "b"] {
        cluster.put(&format!("{prefix}/desired/n1/{name}"), &mock_spec(name, 1));
    }
    wait_for("both run and are written", Duration::from_secs(10), || {
        (written(&cluster, prefix, "n1").len() == 2 && running(&agent, "b").is_some())
            .then_some(())
            .ok_or_else(|| "not yet".to_owned())
    });
    let before = running(&agent, "a").expect("a").tasks["main"].started_at;

    cluster.signal_all(Signal::STOP);
    let stopped = Instant::now();
    let (_, why) = wait_for("health says degraded", Duration::from_secs(20), || {
        fleet_health(&agent)
            .filter(|(ok, _)| !ok)
            .ok_or_else(|| "still healthy".to_owned())
    });
    assert!(why.starts_with("degraded: "), "{why}");
    // A change while etcd is away: queued.
    agent
        .post("/v1/allocs/b/stop")
        .expect("the local API serves");
    while stopped.elapsed() < Duration::from_secs(60) {
        assert!(running(&agent, "a").is_some(), "a keeps running");
        std::thread::sleep(Duration::from_millis(500));
    }
    cluster.signal_all(Signal::CONT);
    let resumed = Instant::now();
    wait_for_complete(&cluster, prefix, "b");
    let converged = resumed.elapsed();
    eprintln!("status converged {converged:?} after SIGCONT");
    assert!(converged <= Duration::from_secs(5), "{converged:?}");
    let a = running(&agent, "a").expect("a");
    assert_eq!(a.tasks["main"].restarts, 0);
    assert_eq!(a.tasks["main"].started_at, before);
    wait_for(
        "health is ok again",
        Duration::from_secs(10),
        || match fleet_health(&agent) {
            Some((true, _)) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
}

#[test]
fn fleet_an_agent_cut_off_through_edits_and_a_compaction_converges_on_the_last_revisions() {
    let cluster = EtcdCluster::start(3);
    let prefix = "/cut";
    let proxies: Vec<Proxy> = cluster.ports().into_iter().map(Proxy::to).collect();
    let urls: Vec<String> = proxies.iter().map(Proxy::url).collect();
    let dirs = fleet_agent(&urls, prefix, "n1", "{}");
    let agent = dirs.start();
    let names = ["a", "b", "c", "d", "e"];
    for name in names {
        cluster.put(&format!("{prefix}/desired/n1/{name}"), &mock_spec(name, 0));
    }
    wait_for("all run", Duration::from_secs(10), || {
        names
            .iter()
            .all(|n| running(&agent, n).is_some())
            .then_some(())
            .ok_or_else(|| "not yet".to_owned())
    });
    proxies.iter().for_each(Proxy::cut);
    wait_for("the agent sees etcd gone", Duration::from_secs(20), || {
        fleet_health(&agent)
            .filter(|(ok, _)| !ok)
            .ok_or_else(|| "healthy".to_owned())
    });
    // 100 edits: 20 revisions of each alloc, one deleted and put back, then a compaction
    // of all that history.
    for version in 1..=20 {
        for name in names {
            cluster.put(
                &format!("{prefix}/desired/n1/{name}"),
                &mock_spec(name, version),
            );
        }
    }
    cluster.delete(&format!("{prefix}/desired/n1/e"));
    let last = cluster.put(&format!("{prefix}/desired/n1/e"), &mock_spec("e", 21));
    cluster.compact(last);
    let log_before = agent.log_text().len();
    proxies.iter().for_each(Proxy::mend);

    wait_for(
        "every alloc runs its last revision",
        Duration::from_secs(20),
        || {
            let ok = names.iter().all(|name| {
                let want = if *name == "e" { 21 } else { 20 };
                let revision = revision_of(&mock_spec(name, want));
                agent
                    .status(name)
                    .is_some_and(|s| s.client_status == "running" && s.revision == revision)
            });
            ok.then_some(())
                .ok_or_else(|| agent.log_text()[log_before..].to_owned())
        },
    );
    let log = agent.log_text()[log_before..].to_owned();
    assert!(log.contains("compacted; listing again"), "{log}");
    // Each alloc was applied at most twice after the reconnection (its last revision,
    // and at most one before it), never one revision per edit.
    for name in names {
        let applied = log
            .lines()
            .filter(|l| l.contains("applied") && l.contains(&format!("alloc={name} ")))
            .count();
        assert!(applied <= 2, "{name} applied {applied} times:\n{log}");
    }
}

#[test]
fn fleet_an_agent_restarted_while_etcd_is_down_restarts_no_task() {
    let cluster = EtcdCluster::start(3);
    let prefix = "/down";
    let dirs = AgentDirs::new(&format!(
        "fleet:\n  etcd: [{}]\n  prefix: {prefix}\n  node: {{name: n1}}\n",
        cluster.urls().join(", ")
    ));
    let marker = unique_nap();
    let (agent, pid) = start_service(&cluster, prefix, &dirs, &marker);
    agent.kill9();
    cluster.signal_all(Signal::STOP);
    let agent = dirs.start();
    // The agent came up on the listing it kept: svc is the same process.
    let task = reattached(&agent);
    assert_eq!(task.pid, pid, "{}", agent.log_text());
    assert_eq!(task.restarts, 0);
    // It runs from the listing kept in its data dir, not only from its store: the alloc
    // is declared by its key.
    assert!(
        agent
            .log_text()
            .contains("running the desired keys last listed"),
        "{}",
        agent.log_text()
    );
    let status = wait_for("svc's key is named", Duration::from_secs(10), || {
        agent
            .status("svc")
            .filter(|s| s.spec_file.is_some())
            .ok_or_else(|| "no specFile yet".to_owned())
    });
    assert_eq!(
        status.spec_file.as_deref(),
        Some(format!("etcd:{prefix}/desired/n1/svc").as_str())
    );
    cluster.signal_all(Signal::CONT);
    drop(agent);
    crate::agent_support::kill_all_with(&marker);
}

#[test]
fn fleet_a_killed_agent_shows_down_within_its_lease_and_its_name_cannot_be_taken_meanwhile() {
    let cluster = EtcdCluster::start(3);
    let prefix = "/lease";
    let urls = cluster.urls_flag();
    let config = format!(
        "fleet:\n  etcd: [{}]\n  prefix: {prefix}\n  node: {{name: n1, labels: {{zone: a}}}}\n",
        cluster.urls().join(", ")
    );
    let dirs = AgentDirs::new(&config);
    let marker = unique_nap();
    let (agent, pid) = start_service(&cluster, prefix, &dirs, &marker);
    let node_up = |want: bool| {
        let (code, out, err) = fleet(&urls, prefix, &["status", "--json"]);
        assert_eq!(code, 0, "{err}");
        let report: Vec<serde_json::Value> = serde_json::from_str(&out).expect("json");
        report
            .iter()
            .find(|n| n["node"] == "n1")
            .filter(|n| n["up"].as_bool() == Some(want))
            .map(|_| ())
            .ok_or(out)
    };
    wait_for("n1 is up", Duration::from_secs(10), || node_up(true));

    // Another agent (another data dir) may not claim n1 while it is held.
    let other = AgentDirs::new(&config);
    let (status, log) = other.launch().until_exit(Duration::from_secs(20));
    assert!(!status.success());
    assert!(log.contains("is claimed by another agent"), "{log}");

    // Killed and started again at once: it takes its own claim back.
    agent.kill9();
    let agent = dirs.start();
    let task = reattached(&agent);
    assert_eq!(task.pid, pid);

    // Killed for good: down once the lease runs out.
    agent.kill9();
    let killed = Instant::now();
    wait_for("n1 is down", Duration::from_secs(20), || node_up(false));
    let down = killed.elapsed();
    eprintln!("n1 shown down {down:?} after its agent's SIGKILL");
    assert!(down <= Duration::from_secs(16), "{down:?}");
    let agent = dirs.start();
    wait_for("n1 is up again", Duration::from_secs(10), || node_up(true));
    let task = reattached(&agent);
    assert_eq!(task.pid, pid, "reattached, not restarted");
    assert_eq!(task.restarts, 0);
    drop(agent);
    crate::agent_support::kill_all_with(&marker);
}

/// How many agents and allocs the scale test runs: 5 × 20 in `make test` (five debug
/// agents and three etcd members share two cores there); `make soak` runs the 50 × 20
/// of the fleet's target with `STEAD_FLEET_SCALE=NODES,ALLOCS`, release agents.
fn scale() -> (usize, usize) {
    std::env::var("STEAD_FLEET_SCALE")
        .ok()
        .and_then(|v| {
            let (nodes, allocs) = v.split_once(',')?;
            Some((nodes.parse().ok()?, allocs.parse().ok()?))
        })
        .unwrap_or((5, 20))
}

#[test]
fn fleet_nodes_converge_on_one_apply_within_two_seconds_and_an_idle_fleet_writes_nothing() {
    let (nodes, allocs) = scale();
    let cluster = EtcdCluster::start(3);
    let prefix = "/scale";
    let urls = cluster.urls();
    let dirs: Vec<AgentDirs> = (0..nodes)
        .map(|i| {
            AgentDirs::with_config(&format!(
                "drivers: {{mock: {{enabled: true}}}}\nstore: {{memoryMB: 8}}\nfleet:\n  etcd: [{}]\n  prefix: {prefix}\n  node: {{name: n{i}}}\n",
                urls.join(", ")
            ))
        })
        .collect();
    // `STEAD_FLEET_AGENT` runs another build (the release `stead`) as every agent.
    let program = std::env::var_os("STEAD_FLEET_AGENT").map(std::path::PathBuf::from);
    let agents: Vec<Agent> = dirs
        .iter()
        .map(|dirs| match &program {
            Some(program) => dirs.start_program(program),
            None => dirs.start(),
        })
        .collect();
    let specs = tempfile::tempdir().expect("dir");
    let write_specs = |version: u32| {
        for a in 0..allocs {
            let name = format!("a{a}");
            std::fs::write(
                specs.path().join(format!("{name}.yaml")),
                mock_spec(&name, version),
            )
            .expect("spec");
        }
    };
    let files = specs.path().to_str().expect("utf-8").to_owned();
    // Every node runs `version` of every alloc, as the statuses in etcd say.
    let converged = |version: u32| {
        let revisions: std::collections::BTreeSet<String> = (0..allocs)
            .map(|a| revision_of(&mock_spec(&format!("a{a}"), version)))
            .collect();
        let statuses = cluster.get_prefix(&format!("{prefix}/status/"));
        let mut per_node = vec![0; nodes];
        for (key, value) in &statuses {
            let status: FleetAllocStatus = serde_json::from_str(value).expect("status");
            let node = key.split('/').nth(3).and_then(|n| n.strip_prefix('n'));
            if status.status.client_status == "running"
                && revisions.contains(&status.status.revision)
                && let Some(node) = node.and_then(|n| n.parse::<usize>().ok())
            {
                per_node[node] += 1;
            }
        }
        let behind: Vec<usize> = (0..nodes).filter(|n| per_node[*n] < allocs).collect();
        match behind.first() {
            None => Ok(()),
            Some(first) => Err(format!(
                "nodes {behind:?} have not converged; the log of n{first}:\n{}",
                agents[*first].log_text()
            )),
        }
    };
    write_specs(1);
    let (code, out, err) = fleet(
        &cluster.urls_flag(),
        prefix,
        &["apply", "-f", &files, "--all"],
    );
    assert_eq!(code, 0, "{out}{err}");
    wait_for("the fleet runs version 1", Duration::from_secs(120), || {
        converged(1)
    });

    write_specs(2);
    let applied = Instant::now();
    let (code, out, err) = fleet(
        &cluster.urls_flag(),
        prefix,
        &["apply", "-f", &files, "--all"],
    );
    assert_eq!(code, 0, "{out}{err}");
    loop {
        if converged(2).is_ok() {
            break;
        }
        assert!(
            applied.elapsed() < Duration::from_secs(30),
            "{}",
            converged(2).unwrap_err()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = applied.elapsed();
    eprintln!("{nodes} nodes × {allocs} allocs converged {took:?} after one apply --all");
    assert!(took <= Duration::from_secs(2), "{took:?}");

    // Idle: for a minute nothing is written (lease keep-alives change no revision).
    let settled = cluster.revision();
    std::thread::sleep(Duration::from_secs(60));
    let after = cluster.revision();
    assert_eq!(
        after,
        settled,
        "an idle fleet wrote {} times",
        after - settled
    );
    drop(agents);
}

#[test]
fn fleet_apply_validates_first_shows_and_prunes_changes_and_refuses_a_concurrent_edit() {
    let cluster = EtcdCluster::start(3);
    let prefix = "/cli";
    let urls = cluster.urls_flag();
    let specs = tempfile::tempdir().expect("dir");
    let path = |name: &str| specs.path().join(format!("{name}.yaml"));
    std::fs::write(path("a"), mock_spec("a", 1)).expect("spec");
    // Two documents in one file: each key holds its own document's text.
    std::fs::write(
        path("bc"),
        format!("{}---\n{}", mock_spec("b", 1), mock_spec("c", 1)),
    )
    .expect("spec");
    let dir = specs.path().to_str().expect("utf-8");
    let (code, out, err) = fleet(&urls, prefix, &["apply", "-f", dir, "--node", "n1"]);
    assert_eq!(code, 0, "{out}{err}");
    for name in ["a", "b", "c"] {
        assert!(
            out.contains(&format!("/cli/desired/n1/{name}: created")),
            "{out}"
        );
    }
    let stored = cluster.get_prefix("/cli/desired/n1/c");
    assert_eq!(stored[0].1, mock_spec("c", 1));

    // Nothing to change: diff exits 0; an edit: diff shows it, exits 1, writes nothing.
    let (code, out, _) = fleet(&urls, prefix, &["diff", "-f", dir, "--node", "n1"]);
    assert_eq!(code, 0, "{out}");
    std::fs::write(path("a"), mock_spec("a", 2)).expect("spec");
    let (code, out, _) = fleet(&urls, prefix, &["diff", "-f", dir, "--node", "n1"]);
    assert_eq!(code, 1);
    assert!(
        out.contains("/cli/desired/n1/a: would be configured"),
        "{out}"
    );
    assert!(
        out.contains("--- etcd:/cli/desired/n1/a\n+++ applied\n")
            && out.contains("-      config: {runFor: 1h, stdoutString: \"v1\"}\n")
            && out.contains("+      config: {runFor: 1h, stdoutString: \"v2\"}\n"),
        "{out}"
    );
    assert_eq!(
        cluster.get_prefix("/cli/desired/n1/a")[0].1,
        mock_spec("a", 1)
    );

    // An invalid file: nothing is applied, and the problem is named with its place.
    std::fs::write(path("bad"), mock_spec("bad", 1).replace("runFor", "runFr")).expect("spec");
    let (code, out, _) = fleet(&urls, prefix, &["apply", "-f", dir, "--node", "n1"]);
    assert_eq!(code, 1);
    assert!(
        out.contains("bad.yaml:8:16: spec.tasks[0].config.runFr"),
        "{out}"
    );
    assert_eq!(
        cluster.get_prefix("/cli/desired/n1/a")[0].1,
        mock_spec("a", 1)
    );
    std::fs::remove_file(path("bad")).expect("removed");

    // --prune deletes what the files no longer declare; delete removes one key.
    std::fs::remove_file(path("bc")).expect("removed");
    let (code, out, err) = fleet(
        &urls,
        prefix,
        &["apply", "-f", dir, "--node", "n1", "--prune"],
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("/cli/desired/n1/a: configured"), "{out}");
    assert!(out.contains("/cli/desired/n1/b: pruned"), "{out}");
    let keys: Vec<String> = cluster
        .get_prefix("/cli/desired/")
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(keys, ["/cli/desired/n1/a"]);
    let (code, _, _) = fleet(&urls, prefix, &["delete", "a", "--node", "n1"]);
    assert_eq!(code, 0);
    let (code, _, err) = fleet(&urls, prefix, &["delete", "a", "--node", "n1"]);
    assert_eq!(code, 1);
    assert!(err.contains("does not exist"), "{err}");

    // A key changed between the read and the write: the write is refused whole.
    let key = "/cli/desired/n1/x".to_owned();
    let read_at = cluster.put(&key, &mock_spec("x", 1));
    let fresh_at = cluster.put(&key, &mock_spec("x", 2));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let written = runtime.block_on(async {
        let client = stead_controller::fleet::connect(&cluster.urls(), None)
            .await
            .expect("client");
        let edit = |read_at| stead_controller::fleet::KeyEdit {
            key: key.clone(),
            value: Some(mock_spec("x", 3)),
            read_at,
        };
        let stale = stead_controller::fleet::write_edits(&client, &[edit(read_at)])
            .await
            .expect("answered");
        let fresh = stead_controller::fleet::write_edits(&client, &[edit(fresh_at)])
            .await
            .expect("answered");
        (stale, fresh)
    });
    assert_eq!(written, (false, true));
    assert_eq!(cluster.get_prefix(&key)[0].1, mock_spec("x", 3));
}
