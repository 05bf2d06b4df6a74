//! The specs directory as desired state, through the real `stead agent` binary on
//! temporary directories: file events and resync, replacement without overlap, sticky
//! disks, editor saves, broken edits, deletions, multi-document files, a name declared
//! in two files, scale and garbage collection.
//!
//! The tests in this file run one at a time (they measure latencies on a shared machine)
//! and synchronise only by polling what the API and the agent's log show, with deadlines.

use crate::agent_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use agent_support::{AgentDirs, batch_spec, service_spec, show};
use stead_schemas::api::AllocListItem;
use stead_schemas::status::AllocStatus;

const DEADLINE: Duration = Duration::from_secs(30);

/// A `stead agent` process on temporary specs and data directories; dropping it drains
/// it (SIGTERM with `shutdown: drain`), so no task outlives the test.
struct Agent {
    dirs: AgentDirs,
    process: Option<agent_support::Agent>,
    specs: PathBuf,
    data: PathBuf,
    address: String,
}

impl Agent {
    /// Starts an agent with `config` (YAML keys) added to the test's own, on a specs
    /// directory already holding `files`.
    fn start(config: &str, files: &[(String, String)]) -> Agent {
        // The mock driver runs only when turned on.
        let dirs = AgentDirs::with_config(&format!(
            "shutdown: drain\ndrivers: {{mock: {{enabled: true}}}}\n{config}"
        ));
        for (file, text) in files {
            std::fs::write(dirs.specs.join(file), text).expect("spec written");
        }
        if !files.is_empty() {
            // Specs that were there before the agent, as on a real node: an hour old.
            let status = Command::new("touch")
                .args(["-d", "1 hour ago"])
                .args(files.iter().map(|(f, _)| dirs.specs.join(f)))
                .status()
                .expect("touch runs");
            assert!(status.success());
        }
        let process = dirs.start();
        Agent {
            specs: dirs.specs.clone(),
            data: dirs.data.clone(),
            address: format!("127.0.0.1:{}", dirs.port),
            process: Some(process),
            dirs,
        }
    }

    fn process(&self) -> &agent_support::Agent {
        self.process.as_ref().expect("the agent runs")
    }

    /// `GET path`: the status code and body, or `None` when the agent does not answer.
    fn get(&self, path: &str) -> Option<(u16, String)> {
        self.process().try_get(path)
    }

    fn status(&self, name: &str) -> Option<AllocStatus> {
        self.process().status(name)
    }

    fn list(&self) -> Vec<AllocListItem> {
        let (code, body) = self.get("/v1/allocs").expect("the agent answers");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).expect("an alloc list")
    }

    /// The value of counter `name` at `/metrics`.
    fn counter(&self, name: &str) -> f64 {
        let (_, body) = self.get("/metrics").expect("the agent answers");
        body.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Polls `probe` (every millisecond or so) until it yields, failing after `deadline`.
    fn until<T>(
        &self,
        what: &str,
        deadline: Duration,
        mut probe: impl FnMut(&Agent) -> Option<T>,
    ) -> T {
        let start = Instant::now();
        loop {
            if let Some(value) = probe(self) {
                return value;
            }
            assert!(
                start.elapsed() < deadline,
                "timed out after {deadline:?} waiting until {what}; agent log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits until alloc `name` runs revision `revision` with every task running.
    fn until_running(&self, name: &str, revision: &str, deadline: Duration) -> AllocStatus {
        self.until(&format!("{name} runs {revision}"), deadline, |a| {
            a.status(name)
                .filter(|s| s.revision == revision && all_tasks(s, "running"))
        })
    }

    fn write(&self, file: &str, text: &str) {
        std::fs::write(self.dirs.specs.join(file), text).expect("spec written");
    }

    fn log(&self) -> String {
        self.process().log_text()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(process) = self.process.take() {
            let _ = process.terminate();
        }
    }
}

fn all_tasks(status: &AllocStatus, state: &str) -> bool {
    !status.tasks.is_empty() && status.tasks.values().all(|t| t.state == state)
}

/// A service alloc with one mock task that runs until stopped; `marker` makes revisions.
fn mock_spec(name: &str, marker: &str) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  tasks:\n    - {{name: t, driver: mock, config: {{stdoutString: \"{marker}\"}}}}\n"
    )
}

/// The revision the agent computes for `text`.
fn revision_of(text: &str) -> String {
    let file = stead_schemas::parse_spec_file(Path::new("spec.yaml"), text);
    file.specs()
        .next()
        .expect("a valid spec")
        .revision
        .to_string()
}

fn median(values: &mut [Duration]) -> Duration {
    values.sort();
    values[values.len() / 2]
}

#[test]
fn a_new_spec_file_runs_within_100ms_of_the_write_with_the_watcher() {
    let _turn = stead_tests::real_time_turn();
    // A resync of an hour: only file events can be that quick.
    let agent = Agent::start("watch: true\nresync: 1h\n", &[]);
    let warm = mock_spec("warm", "w");
    agent.write("warm.yaml", &warm);
    agent.until_running("warm", &revision_of(&warm), DEADLINE);

    let mut latencies = Vec::new();
    for i in 0..7 {
        let name = format!("new-{i}");
        let text = mock_spec(&name, "a");
        agent.write(&format!("{name}.yaml"), &text);
        let written = Instant::now();
        agent.until_running(&name, &revision_of(&text), DEADLINE);
        latencies.push(written.elapsed());
    }
    println!("write to running, watcher on: {latencies:?}");
    let best = *latencies.iter().min().expect("measured");
    let median = median(&mut latencies);
    println!("best {best:?}, median {median:?}");
    // The watcher path makes 100 ms; a machine shared with other builds may slow some
    // samples, but not every one (a resync would take an hour here).
    assert!(best <= Duration::from_millis(100), "best {best:?}");
    assert!(median <= Duration::from_millis(250), "median {median:?}");
}

#[test]
fn a_replaced_specs_directory_is_watched_again_and_its_new_files_run_without_a_resync() {
    let _turn = stead_tests::real_time_turn();
    // A resync of an hour: only file events can start the new files.
    let agent = Agent::start("watch: true\nresync: 1h\n", &[]);
    let web = mock_spec("web", "w");
    agent.write("web.yaml", &web);
    agent.until_running("web", &revision_of(&web), DEADLINE);

    // As a deploy tool does: the old directory moved aside, a new one in its place.
    let old = agent.specs.with_extension("old");
    std::fs::rename(&agent.specs, &old).expect("moved aside");
    std::fs::create_dir(&agent.specs).expect("made again");
    std::fs::copy(old.join("web.yaml"), agent.specs.join("web.yaml")).expect("copied");
    let api = mock_spec("api", "a");
    agent.write("api.yaml", &api);
    agent.until_running("api", &revision_of(&api), DEADLINE);

    // And the new directory is the one watched from then on.
    let worker = mock_spec("worker", "k");
    agent.write("worker.yaml", &worker);
    agent.until_running("worker", &revision_of(&worker), DEADLINE);
    assert!(
        agent
            .status("web")
            .is_some_and(|s| s.client_status == "running")
    );
}

#[test]
fn without_the_watcher_a_new_spec_file_runs_within_one_resync_period() {
    let _turn = stead_tests::real_time_turn();
    let agent = Agent::start("watch: false\nresync: 1s\n", &[]);
    let text = mock_spec("web", "a");
    agent.write("web.yaml", &text);
    let written = Instant::now();
    agent.until_running("web", &revision_of(&text), Duration::from_secs(5));
    let latency = written.elapsed();
    println!("write to running, watcher off, resync 1s: {latency:?}");
    // One period (1 s), plus room for a busy machine; far from the 20 s default.
    assert!(latency <= Duration::from_secs(2), "{latency:?}");
}

#[test]
fn a_sighup_lists_the_specs_directory_at_once_and_the_agent_keeps_running() {
    let _turn = stead_tests::real_time_turn();
    let agent = Agent::start("watch: false\nresync: 1h\n", &[]);
    let text = mock_spec("web", "a");
    agent.write("web.yaml", &text);
    let process = agent.process.as_ref().expect("running");
    let pid = rustix::process::Pid::from_raw(process.child.id() as i32).expect("a pid");
    rustix::process::kill_process(pid, rustix::process::Signal::HUP).expect("signalled");
    // Without the watcher and an hour from the next resync, only the SIGHUP lists it.
    agent.until_running("web", &revision_of(&text), Duration::from_secs(5));
    assert!(
        process.log_text().contains("hangup"),
        "the log says what listed it:\n{}",
        process.log_text()
    );
}

#[test]
fn a_thousand_rapid_writes_end_with_the_last_revision_running_after_few_intermediate_starts() {
    let _turn = stead_tests::real_time_turn();
    let agent = Agent::start("", &[]);
    let first = mock_spec("web", "v0");
    agent.write("web.yaml", &first);
    agent.until_running("web", &revision_of(&first), DEADLINE);
    let before = agent.counter("stead_task_starts_total");

    let began = Instant::now();
    let mut last = String::new();
    for i in 1..=1_000 {
        last = mock_spec("web", &format!("v{i}"));
        agent.write("web.yaml", &last);
    }
    let wrote = began.elapsed();
    agent.until_running("web", &revision_of(&last), DEADLINE);
    let converged = began.elapsed();
    let started = agent.counter("stead_task_starts_total") - before;
    println!(
        "1000 writes in {wrote:?}; last revision running after {converged:?}; revisions started: {started}"
    );
    assert!(started >= 1.0, "the last revision started");
    // Passes coalesce every write that lands while one runs: unloaded, one to three of
    // the thousand revisions start. A machine busy with other builds stretches the writes
    // over more passes, so the bound, a handful with room (2 % of the writes), still
    // fails long before writes are applied one by one.
    assert!(started <= 20.0, "{started} revisions started");
}

/// A task that records its life in the sticky disk: when it starts (and whether the
/// previous revision's process is still alive then), what it found from the previous
/// revision, and when it stops.
const STICKY_SCRIPT: &str = r#"d="$STEAD_ALLOC_DIR/data"
if [ -f "$d/pid" ] && kill -0 "$(cat "$d/pid")" 2>/dev/null; then echo "$REV" >> "$d/overlap"; fi
if [ -f "$d/from-1" ]; then echo yes > "$d/data-seen-by-$REV"; fi
if [ -f "$STEAD_TASK_DIR/local/note" ]; then echo yes > "$d/local-seen-by-$REV"; fi
echo "$REV" > "$d/from-$REV"
echo "$REV" > "$STEAD_TASK_DIR/local/note"
echo "start $REV $$ $(date +%s%N)" >> "$d/timeline"
echo $$ > "$d/pid"
trap 'echo "stop $REV $$ $(date +%s%N)" >> "$d/timeline"; exit 0' INT TERM
while :; do sleep 0.05; done
"#;

/// The `store` alloc at `revision`, its ephemeral disk kept by `disk` (`sticky: true` or
/// `migrate: true`).
fn sticky_spec(revision: u32, disk: &str) -> String {
    let script = STICKY_SCRIPT
        .lines()
        .map(|l| format!("            {l}\n"))
        .collect::<String>();
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: store}}\nspec:\n  ephemeralDisk: {{{disk}}}\n  tasks:\n    - name: db\n      driver: exec\n      env: {{REV: \"{revision}\"}}\n      config:\n        command: /bin/sh\n        args:\n          - -c\n          - |\n{script}"
    )
}

#[test]
fn a_sticky_disk_reaches_the_new_revision_which_starts_only_after_the_old_one_stopped() {
    disk_reaches_the_new_revision_after_the_old_one_stopped("sticky: true");
}

#[test]
fn a_migrating_disk_reaches_the_new_revision_the_same_way_on_one_node() {
    disk_reaches_the_new_revision_after_the_old_one_stopped("migrate: true");
}

fn disk_reaches_the_new_revision_after_the_old_one_stopped(disk: &str) {
    let _turn = stead_tests::real_time_turn();
    let agent = Agent::start("", &[]);
    let (v1, v2) = (sticky_spec(1, disk), sticky_spec(2, disk));
    agent.write("store.yaml", &v1);
    let old = agent.until_running("store", &revision_of(&v1), DEADLINE);
    let old_dir = agent.data.join("allocs").join(&old.id);
    agent.until("revision 1 wrote its files", DEADLINE, |_| {
        std::fs::read_to_string(old_dir.join("alloc/data/timeline"))
            .ok()
            .filter(|t| t.contains("start 1"))
    });

    agent.write("store.yaml", &v2);
    let new = agent.until_running("store", &revision_of(&v2), DEADLINE);
    assert_ne!(new.id, old.id);
    let data = agent.data.join("allocs").join(&new.id).join("alloc/data");
    let timeline = agent.until("revision 2 recorded its start", DEADLINE, |_| {
        std::fs::read_to_string(data.join("timeline"))
            .ok()
            .filter(|t| t.contains("start 2"))
    });
    println!("timeline:\n{timeline}");
    let at = |what: &str| -> (u32, u128) {
        let line = timeline
            .lines()
            .find(|l| l.starts_with(what))
            .unwrap_or_else(|| panic!("no {what:?} in {timeline}"));
        let fields: Vec<&str> = line.split(' ').collect();
        (
            fields[2].parse().expect("a pid"),
            fields[3].parse().expect("nanoseconds"),
        )
    };
    let (old_pid, old_start) = at("start 1");
    let (stopped_pid, old_stop) = at("stop 1");
    let (new_pid, new_start) = at("start 2");
    assert_eq!(stopped_pid, old_pid);
    assert_ne!(new_pid, old_pid);
    assert!(
        old_start < old_stop && old_stop <= new_start,
        "the revisions overlapped: {timeline}"
    );
    assert_eq!(
        new.tasks["db"].pid,
        Some(new_pid),
        "the status shows the new process"
    );
    assert!(
        !data.join("overlap").exists(),
        "revision 2 found revision 1's process alive when it started"
    );
    assert!(
        data.join("data-seen-by-2").exists(),
        "alloc/data written by revision 1 was there when revision 2 started"
    );
    assert!(
        data.join("local-seen-by-2").exists(),
        "<task>/local of revision 1 was there when revision 2 started"
    );
    // Moved aside first, then removed by the hand-over itself (garbage collection's first
    // pass comes a minute after the start).
    let retired = agent
        .data
        .join("allocs")
        .join(format!(".retired-{}", old.id));
    agent.until("the replaced alloc dir is removed", DEADLINE, |_| {
        (!old_dir.exists() && !retired.exists()).then_some(())
    });
}

#[test]
fn an_editor_save_by_rename_applies_once_and_temporaries_and_dotfiles_are_ignored() {
    let _turn = stead_tests::real_time_turn();
    let agent = Agent::start("resync: 1h\n", &[]);
    let v1 = mock_spec("web", "v1");
    agent.write("web.yaml", &v1);
    agent.until_running("web", &revision_of(&v1), DEADLINE);
    let before = agent.counter("stead_task_starts_total");

    // vim: a swap file while editing, then write a temporary and rename it over.
    agent.write(".web.yaml.swp", "\u{0}\u{1}binary swap");
    agent.write(".notes.yaml", "kind: [garbage");
    agent.write("web.yaml~", "not: a spec");
    let v2 = mock_spec("web", "v2");
    agent.write("web.yaml.tmp", &v2);
    std::fs::rename(
        agent.specs.join("web.yaml.tmp"),
        agent.specs.join("web.yaml"),
    )
    .expect("renamed over");
    let written = Instant::now();
    agent.until_running("web", &revision_of(&v2), DEADLINE);
    println!("rename over to running: {:?}", written.elapsed());
    assert_eq!(agent.counter("stead_task_starts_total") - before, 1.0);

    // A later spec is applied too, so every event above has been looked at by now.
    let other = mock_spec("other", "o");
    agent.write("other.yaml", &other);
    agent.until_running("other", &revision_of(&other), DEADLINE);
    let names: Vec<String> = agent.list().into_iter().map(|a| a.name).collect();
    assert_eq!(names, ["other", "web"]);
    let log = agent.log();
    for ignored in [".web.yaml.swp", ".notes.yaml", "web.yaml~", "web.yaml.tmp"] {
        assert!(!log.contains(ignored), "{ignored} was looked at:\n{log}");
    }
}

#[test]
fn an_invalid_edit_keeps_the_old_revision_running_and_shows_a_spec_error_until_fixed() {
    let _turn = stead_tests::real_time_turn();
    let agent = Agent::start("resync: 1h\n", &[]);
    let good = mock_spec("web", "v1");
    agent.write("web.yaml", &good);
    let running = agent.until_running("web", &revision_of(&good), DEADLINE);
    let started_at = running.tasks["t"].started_at;

    agent.write("web.yaml", &good.replace("stdoutString", "stdoutStrng"));
    let broken = agent.until("the spec error shows", DEADLINE, |a| {
        a.status("web").filter(|s| s.spec_error.is_some())
    });
    let error = broken.spec_error.clone().expect("shown");
    assert!(
        error.contains("web.yaml:") && error.contains("stdoutStrng"),
        "{error}"
    );
    assert_eq!(
        broken.id, running.id,
        "the last valid revision keeps running"
    );
    assert!(all_tasks(&broken, "running"));
    assert_eq!(broken.tasks["t"].started_at, started_at, "not restarted");
    assert!(agent.list()[0].spec_error);
    let (code, out, err) = stead_tests::stead(&[
        "alloc",
        "status",
        "web",
        "--address",
        &agent.address,
        "--data-dir",
        &agent.data.display().to_string(),
        "--color",
        "never",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("Spec Error") && out.contains("stdoutStrng"),
        "{out}"
    );

    agent.write("web.yaml", &good);
    let fixed = agent.until("the spec error clears", DEADLINE, |a| {
        a.status("web").filter(|s| s.spec_error.is_none())
    });
    assert_eq!(fixed.id, running.id);
    assert_eq!(fixed.tasks["t"].started_at, started_at, "not restarted");
}

#[test]
fn a_deleted_file_stops_its_alloc_and_recreating_it_runs_the_alloc_again() {
    let _turn = stead_tests::real_time_turn();
    let agent = Agent::start("resync: 1h\n", &[]);
    let text = mock_spec("web", "v1");
    let revision = revision_of(&text);
    agent.write("web.yaml", &text);
    let first = agent.until_running("web", &revision, DEADLINE);

    std::fs::remove_file(agent.specs.join("web.yaml")).expect("deleted");
    let stopped = agent.until("web stops", DEADLINE, |a| {
        a.status("web")
            .filter(|s| s.desired_status == "stop" && all_tasks(s, "dead"))
    });
    assert_eq!(stopped.client_status, "complete");
    assert_eq!(
        stopped.id, first.id,
        "kept, stopped, until garbage collection"
    );

    agent.write("web.yaml", &text);
    let again = agent.until_running("web", &revision, DEADLINE);
    assert_eq!(again.desired_status, "run");
    assert!(again.tasks["t"].started_at > first.tasks["t"].started_at);
}

#[test]
fn desired_status_stop_and_run_act_in_place() {
    let _turn = stead_tests::real_time_turn();
    let agent = Agent::start("resync: 1h\n", &[]);
    let run = mock_spec("web", "v1");
    agent.write("web.yaml", &run);
    let first = agent.until_running("web", &revision_of(&run), DEADLINE);

    let stop = run.replace("spec:\n", "spec:\n  desiredStatus: stop\n");
    agent.write("web.yaml", &stop);
    let stopped = agent.until("web stops in place", DEADLINE, |a| {
        a.status("web")
            .filter(|s| s.desired_status == "stop" && all_tasks(s, "dead"))
    });
    assert_eq!(
        stopped.id, first.id,
        "desiredStatus is not part of the revision"
    );

    agent.write("web.yaml", &run);
    let again = agent.until_running("web", &revision_of(&run), DEADLINE);
    assert_eq!(again.id, first.id);
    assert_eq!(again.desired_status, "run");
}

/// An exec service alloc whose task appends its pid to `witness` when it starts, so the
/// file lists every process this content ever ran, then runs until stopped.
fn witnessed_spec(name: &str, witness: &Path) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  tasks:\n    - name: main\n      driver: exec\n      killTimeout: 2s\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"echo $$ >> $0; trap 'exit 0' TERM; while :; do sleep 0.2; done\", \"{}\"]\n",
        witness.display()
    )
}

/// The pids a [`witnessed_spec`] task wrote to `witness`, in start order (none when the
/// content never ran).
fn witnessed_pids(witness: &Path) -> Vec<u32> {
    std::fs::read_to_string(witness)
        .unwrap_or_default()
        .lines()
        .map(|l| l.parse().expect("a pid"))
        .collect()
}

/// Waits until `witness` lists exactly `pids`: a task shows as running once started,
/// which may be before its shell wrote its pid.
fn until_witnessed(agent: &Agent, witness: &Path, pids: &[u32]) {
    agent.until(
        &format!("{} lists {pids:?}", witness.display()),
        DEADLINE,
        |_| (witnessed_pids(witness) == pids).then_some(()),
    );
}

fn pid(status: &AllocStatus) -> u32 {
    status.tasks["main"].pid.expect("an exec task has a pid")
}

/// The log lines that say alloc `name` was applied (or removed, with `what`).
fn sync_lines(log: &str, what: &str, name: &str) -> usize {
    log.lines()
        .filter(|l| l.contains(&format!(" {what} alloc={name} ")))
        .count()
}

/// Asserts that `now` is the run `before` showed: same alloc id, same process, never
/// restarted, still running.
fn assert_same_run(now: &AllocStatus, before: &AllocStatus) {
    assert_eq!(now.id, before.id);
    assert!(all_tasks(now, "running"), "{now:?}");
    assert_eq!(now.tasks["main"].pid, before.tasks["main"].pid);
    assert_eq!(
        now.tasks["main"].started_at,
        before.tasks["main"].started_at
    );
    assert_eq!(now.tasks["main"].restarts, 0);
}

#[test]
fn a_multi_document_file_is_one_alloc_per_document_and_changing_one_spares_the_others() {
    let _turn = stead_tests::real_time_turn();
    let agent = Agent::start("resync: 200ms\n", &[]);
    let witness = |name: &str| agent.dirs.root.path().join(format!("{name}.pids"));
    let one = witnessed_spec("one", &witness("one"));
    let two = witnessed_spec("two", &witness("two-v1"));
    // Written whole by a rename, so that no pass reads a half-written file.
    agent.dirs.write_spec("pair", &format!("{one}---\n{two}"));
    let one_first = agent.until_running("one", &revision_of(&one), DEADLINE);
    let two_first = agent.until_running("two", &revision_of(&two), DEADLINE);
    until_witnessed(&agent, &witness("one"), &[pid(&one_first)]);
    until_witnessed(&agent, &witness("two-v1"), &[pid(&two_first)]);

    // An edit of the second document replaces only `two`.
    let two_edited = witnessed_spec("two", &witness("two-v2"));
    agent
        .dirs
        .write_spec("pair", &format!("{one}---\n{two_edited}"));
    let two_second = agent.until_running("two", &revision_of(&two_edited), DEADLINE);
    assert_ne!(two_second.id, two_first.id);
    until_witnessed(&agent, &witness("two-v2"), &[pid(&two_second)]);
    assert_eq!(witnessed_pids(&witness("two-v1")), [pid(&two_first)]);
    let log = agent.until("the log says two was applied again", DEADLINE, |a| {
        let log = a.log();
        (sync_lines(&log, "applied", "two") == 2).then_some(log)
    });
    assert_eq!(
        sync_lines(&log, "applied", "one"),
        1,
        "the unchanged document was not applied again:\n{log}"
    );
    assert_same_run(&agent.status("one").expect("one is there"), &one_first);
    assert_eq!(witnessed_pids(&witness("one")), [pid(&one_first)]);

    // Dropping the second document from the file stops only `two`.
    agent.dirs.write_spec("pair", &one);
    let two_stopped = agent.until("two stops", DEADLINE, |a| {
        a.status("two")
            .filter(|s| s.desired_status == "stop" && all_tasks(s, "dead"))
    });
    assert_eq!(two_stopped.id, two_second.id);
    assert!(
        agent_support::processes_with(&show(&witness("two-v2"))).is_empty(),
        "two's process is gone"
    );
    let log = agent.until("the log says two was removed", DEADLINE, |a| {
        let log = a.log();
        (sync_lines(&log, "removed", "two") == 1).then_some(log)
    });
    assert_eq!(sync_lines(&log, "removed", "one"), 0, "{log}");
    assert_eq!(sync_lines(&log, "applied", "one"), 1, "{log}");
    assert_same_run(&agent.status("one").expect("one is there"), &one_first);
    assert_eq!(witnessed_pids(&witness("one")), [pid(&one_first)]);
    assert_eq!(
        agent_support::processes_with(&show(&witness("one"))),
        [pid(&one_first)]
    );
}

#[test]
fn a_name_declared_in_two_files_is_reported_with_both_paths_and_the_path_that_sorts_first_runs() {
    let _turn = stead_tests::real_time_turn();
    let witnesses = tempfile::tempdir().expect("temp dir");
    let (a_witness, b_witness) = (
        witnesses.path().join("a.pids"),
        witnesses.path().join("b.pids"),
    );
    let (a, b) = (
        witnessed_spec("web", &a_witness),
        witnessed_spec("web", &b_witness),
    );
    // `b.yaml` is created first: the path decides, not the order of creation.
    let agent = Agent::start(
        "resync: 200ms\n",
        &[("b.yaml".into(), b.clone()), ("a.yaml".into(), a.clone())],
    );
    let (a_path, b_path) = (agent.specs.join("a.yaml"), agent.specs.join("b.yaml"));
    let first = agent.until_running("web", &revision_of(&a), DEADLINE);
    until_witnessed(&agent, &a_witness, &[pid(&first)]);

    // The agent's log reports the name twice, once (not at every pass): the file that
    // lost, with the place of its declaration, and the file that won. Three more passes,
    // each seen by the alloc it applies, do not repeat it.
    let duplicate = |line: &&str| line.contains("is also declared in");
    for n in 0..3 {
        let probe = format!("probe{n}");
        agent.write(&format!("{probe}.yaml"), &mock_spec(&probe, "p"));
        agent.until(&format!("{probe} applied"), DEADLINE, |a| a.status(&probe));
    }
    let log = agent.log();
    let reports: Vec<String> = log.lines().filter(duplicate).map(str::to_owned).collect();
    assert_eq!(reports.len(), 1, "{log}");
    println!("reported as: {}", reports[0]);
    let expected = format!(
        "{}:1:1: metadata.name: alloc \"web\" is also declared in {}, which takes precedence",
        b_path.display(),
        a_path.display()
    );
    for line in &reports {
        assert!(line.contains(" WARN "), "{line}");
        assert!(line.ends_with(&expected), "{line}");
    }
    // The loser's content never ran; the status shows only the winner, and the duplicate
    // as its spec error, so `stead alloc status` shows it too.
    assert_eq!(witnessed_pids(&b_witness), Vec::<u32>::new());
    let list = agent.list();
    let names: Vec<&str> = list
        .iter()
        .map(|i| i.name.as_str())
        .filter(|name| !name.starts_with("probe"))
        .collect();
    assert_eq!(names, ["web"]);
    let now = agent.status("web").expect("web is there");
    assert_same_run(&now, &first);
    assert_eq!(now.spec_error.as_deref(), Some(expected.as_str()));
    assert!(list.iter().any(|i| i.name == "web" && i.spec_error));

    // Without the winner, the other declaration takes over: a new revision, a new process,
    // and nothing left to report.
    std::fs::remove_file(&a_path).expect("deleted");
    let second = agent.until_running("web", &revision_of(&b), DEADLINE);
    assert_ne!(second.id, first.id);
    let second = agent.until("the duplicate is no longer shown", DEADLINE, |a| {
        a.status("web").filter(|s| s.spec_error.is_none())
    });
    until_witnessed(&agent, &b_witness, &[pid(&second)]);
    assert!(
        agent_support::processes_with(&show(&a_witness)).is_empty(),
        "the winner's process is gone"
    );

    // The rule is the path, not who ran first: `a.yaml` back takes the name back.
    agent.dirs.write_spec("a", &a);
    let third = agent.until_running("web", &revision_of(&a), DEADLINE);
    let a_pids = agent.until("a.yaml's second process is witnessed", DEADLINE, |_| {
        let pids = witnessed_pids(&a_witness);
        (pids.len() >= 2).then_some(pids)
    });
    assert_eq!(a_pids.len(), 2, "{a_pids:?}");
    assert_eq!(a_pids[1], pid(&third));
    assert_eq!(witnessed_pids(&b_witness), [pid(&second)]);
    agent.until("the duplicate is shown again", DEADLINE, |a| {
        a.status("web")
            .filter(|s| s.spec_error.as_deref() == Some(expected.as_str()))
    });
}

#[test]
fn a_directory_of_two_thousand_specs_all_run() {
    let _turn = stead_tests::real_time_turn();
    let files: Vec<(String, String)> = (0..2_000)
        .map(|i| {
            (
                format!("a-{i:04}.yaml"),
                mock_spec(&format!("a-{i:04}"), "x"),
            )
        })
        .collect();
    let began = Instant::now();
    let agent = Agent::start("", &files);
    agent.until("2000 allocs run", Duration::from_secs(120), |a| {
        let list = a.list();
        (list.len() == 2_000 && list.iter().all(|i| i.client_status == "running")).then_some(())
    });
    let all_running = began.elapsed();

    // One more file among the 2000: the watcher still makes it quick.
    let text = mock_spec("late", "l");
    agent.write("late.yaml", &text);
    let written = Instant::now();
    agent.until_running("late", &revision_of(&text), DEADLINE);
    let late = written.elapsed();
    println!(
        "2000 specs: agent start to all running {all_running:?}; one more file among them running after {late:?}"
    );
}

#[test]
fn garbage_collection_destroys_a_removed_alloc_later_and_never_a_running_one() {
    let _turn = stead_tests::real_time_turn();
    let agent = Agent::start("resync: 1h\ngc: {interval: 1s, maxAllocs: 0}\n", &[]);
    let exec = |name: &str| {
        format!(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  tasks:\n    - {{name: t, driver: exec, config: {{command: /bin/sleep, args: [\"3600\"]}}}}\n"
        )
    };
    let (kept, gone) = (exec("kept"), exec("gone"));
    agent.write("kept.yaml", &kept);
    agent.write("gone.yaml", &gone);
    let kept_status = agent.until_running("kept", &revision_of(&kept), DEADLINE);
    let gone_status = agent.until_running("gone", &revision_of(&gone), DEADLINE);
    let gone_dir = agent.data.join("allocs").join(&gone_status.id);
    assert!(gone_dir.is_dir());

    std::fs::remove_file(agent.specs.join("gone.yaml")).expect("deleted");
    // It stops first (GC may already have taken it by the time we look).
    agent.until("gone stops", DEADLINE, |a| match a.status("gone") {
        Some(s) => all_tasks(&s, "dead").then_some(()),
        None => Some(()),
    });
    agent.until("gc destroys gone", DEADLINE, |a| {
        (a.get("/v1/allocs/gone").map(|(code, _)| code) == Some(404)).then_some(())
    });
    assert!(!gone_dir.exists(), "the alloc dir is removed");
    // maxAllocs 0 and a GC every second: the running alloc still stays.
    let kept_now = agent.status("kept").expect("kept is never collected");
    assert!(all_tasks(&kept_now, "running"));
    assert_eq!(kept_now.id, kept_status.id);
    assert!(agent.data.join("allocs").join(&kept_status.id).is_dir());
}

#[test]
fn a_disk_over_the_threshold_makes_garbage_collection_destroy_what_max_allocs_would_keep() {
    let _turn = stead_tests::real_time_turn();
    // Any filesystem in use is over 0 %: only disk pressure can collect, since 50 allocs
    // may be kept by count.
    let agent = Agent::start(
        "resync: 1h\ngc: {interval: 1s, maxAllocs: 50, diskUsageThreshold: 0}\n",
        &[],
    );
    // `gone` runs on the exec driver, which makes an alloc dir for destroy to remove.
    let (kept, gone) = (mock_spec("kept", "k"), service_spec("gone", "g"));
    agent.write("kept.yaml", &kept);
    agent.write("gone.yaml", &gone);
    let kept_status = agent.until_running("kept", &revision_of(&kept), DEADLINE);
    let gone_status = agent.until_running("gone", &revision_of(&gone), DEADLINE);
    let gone_dir = agent.data.join("allocs").join(&gone_status.id);
    assert!(gone_dir.is_dir());

    std::fs::remove_file(agent.specs.join("gone.yaml")).expect("deleted");
    agent.until("gc destroys gone under disk pressure", DEADLINE, |a| {
        (a.get("/v1/allocs/gone").map(|(code, _)| code) == Some(404)).then_some(())
    });
    assert!(!gone_dir.exists(), "the alloc dir is removed");
    let kept_now = agent
        .status("kept")
        .expect("a running alloc is never collected");
    assert!(all_tasks(&kept_now, "running"));
    assert_eq!(kept_now.id, kept_status.id);
}

/// The names of the allocs the agent's log says garbage collection destroyed, in order.
fn collected_in_log(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.ends_with("garbage collected"))
        .filter_map(|l| {
            Some(
                l.split_once("alloc{alloc=")?
                    .1
                    .split_once('}')?
                    .0
                    .to_owned(),
            )
        })
        .collect()
}

#[test]
fn one_gc_pass_over_sixty_terminal_allocs_leaves_the_fifty_newest_and_never_a_running_one() {
    let _turn = stead_tests::real_time_turn();
    // `maxAllocs` and `parallelDestroys` at their defaults (Nomad's 50 and 2); no
    // filesystem is over 100 %, so only the count collects.
    let agent = Agent::start(
        "resync: 1h\ngc: {interval: 200ms, diskUsageThreshold: 100}\n",
        &[],
    );
    let web = service_spec("web", "gc");
    agent.write("web.yaml", &web);
    let web_status = agent.until_running("web", &revision_of(&web), DEADLINE);

    // Finished one after another: each is written once the one before is complete. The
    // names are scattered over age (37 is prime to 60), so the ten oldest are neither
    // the first nor the last ten by name and only age explains a choice; `web`, which
    // never finished a task, would sort before them all.
    let names: Vec<String> = (0..60).map(|i| format!("b-{:02}", i * 37 % 60)).collect();
    let mut dirs = Vec::new();
    let mut finished = Vec::new();
    for name in &names {
        agent.write(&format!("{name}.yaml"), &batch_spec(name, "gc"));
        let done = agent.until(&format!("{name} completes"), DEADLINE, |a| {
            a.status(name).filter(|s| s.client_status == "complete")
        });
        let dir = agent.data.join("allocs").join(&done.id);
        assert!(dir.is_dir(), "{name} has an alloc dir");
        dirs.push(dir);
        finished.push(done.tasks["main"].finished_at.expect("finished"));
    }
    assert!(
        finished.windows(2).all(|w| w[0] < w[1]),
        "finish times follow the write order: {finished:?}"
    );
    assert!(
        collected_in_log(&agent.log()).is_empty(),
        "nothing is collected while every spec is there"
    );

    // Collectable only once their specs are gone; oldest first. Whatever the pass
    // boundaries, a pass destroys an alloc only while 50 newer ones are collectable,
    // so of these 60 only the 10 oldest can ever go.
    for name in &names {
        std::fs::remove_file(agent.specs.join(format!("{name}.yaml"))).expect("deleted");
    }
    let batch_left = |a: &Agent| -> Vec<String> {
        a.list()
            .into_iter()
            .map(|i| i.name)
            .filter(|n| n.starts_with("b-"))
            .collect()
    };
    let left = agent.until("gc keeps 50 of the 60", DEADLINE, |a| {
        Some(batch_left(a)).filter(|left| left.len() <= 50)
    });
    let mut newest: Vec<String> = names[10..].to_vec();
    newest.sort();
    assert_eq!(left, newest, "the fifty that finished last remain");
    for (name, dir) in names[..10].iter().zip(&dirs) {
        assert_eq!(
            agent
                .get(&format!("/v1/allocs/{name}"))
                .map(|(code, _)| code),
            Some(404),
            "{name} is destroyed"
        );
        assert!(!dir.exists(), "{name}'s alloc dir is removed");
    }
    for (name, dir) in names[10..].iter().zip(&dirs[10..]) {
        let status = agent.status(name).expect("kept");
        assert_eq!(status.desired_status, "stop", "{name}");
        assert!(dir.is_dir(), "{name}'s alloc dir is kept");
    }
    let log_order = collected_in_log(&agent.log());
    println!("collected, in the log's order: {log_order:?}");
    let mut oldest = names[..10].to_vec();
    oldest.sort();
    let mut logged = log_order.clone();
    logged.sort();
    assert_eq!(logged, oldest);

    // A later pass still keeps 50: one more alloc finishes and loses its spec, and the
    // pass that follows destroys the oldest left, not the newcomer, whose name sorts
    // first.
    let late = "a-late";
    agent.write(&format!("{late}.yaml"), &batch_spec(late, "gc"));
    agent.until("a-late completes", DEADLINE, |a| {
        a.status(late).filter(|s| s.client_status == "complete")
    });
    std::fs::remove_file(agent.specs.join(format!("{late}.yaml"))).expect("deleted");
    let eleventh = &names[10];
    agent.until(&format!("gc destroys {eleventh}"), DEADLINE, |a| {
        (a.get(&format!("/v1/allocs/{eleventh}"))
            .map(|(code, _)| code)
            == Some(404))
        .then_some(())
    });
    let mut kept = names[11..].to_vec();
    kept.sort();
    assert_eq!(batch_left(&agent), kept, "only {eleventh} went");
    assert!(!dirs[10].exists(), "{eleventh}'s alloc dir is removed");
    assert_eq!(
        agent
            .status(late)
            .expect("the newest is kept")
            .desired_status,
        "stop"
    );

    // A pass every 200 ms the whole time: the running alloc is still there, untouched.
    let web_now = agent
        .status("web")
        .expect("a running alloc is never collected");
    assert!(all_tasks(&web_now, "running"));
    assert_eq!(web_now.id, web_status.id);
    assert_eq!(
        web_now.tasks["main"].started_at,
        web_status.tasks["main"].started_at
    );
    assert!(agent.data.join("allocs").join(&web_status.id).is_dir());
    let log = agent.log();
    assert_eq!(collected_in_log(&log).len(), 11);
    let passes: Vec<&str> = log
        .lines()
        .filter_map(|l| Some(l.split_once("garbage collection pass ")?.1))
        .collect();
    println!("gc passes that collected: {passes:?}");
}
