//! A real `stead agent` process for the tests that crash and restart it: its directories,
//! its config, a minimal blocking HTTP client for its API, and the process table.
//!
//! The config sets no token, so each agent generates one into `<data>/api-token`, as a
//! real node does; the client reads it from there and sends it with every request.

#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use stead_schemas::status::{AllocStatus, TaskEventStatus, TaskStatus};

/// The agent binary cargo built for these tests.
pub fn agent_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_stead-test-agent"))
}

/// The supervisor binary cargo built for these tests.
pub fn supervisor_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_stead-test-supervisor"))
}

#[allow(unused_imports)]
pub use stead_tests::running_as_root;

/// A free loopback port (bound and released; the agent binds it right after), never
/// one this process was given before: the kernel may hand a released port out again at
/// once, and two agents (or an agent and an etcd member) of one test would then share it.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let mut given = GIVEN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// The directories and config of one agent, kept across its restarts.
pub struct AgentDirs {
    pub root: tempfile::TempDir,
    pub specs: PathBuf,
    pub data: PathBuf,
    pub config: PathBuf,
    pub port: u16,
    /// The tasks' parent cgroup (`cgroupParent`), this agent's alone.
    pub cgroup_parent: String,
}

impl Drop for AgentDirs {
    fn drop(&mut self) {
        stead_tests::remove_test_cgroups(&self.cgroup_parent);
    }
}

impl AgentDirs {
    /// Fresh directories and a config with a quick tick and resync, and `extra` YAML
    /// lines appended.
    pub fn new(extra: &str) -> Self {
        Self::with_config(&format!("tick: 200ms\nresync: 500ms\n{extra}"))
    }

    /// Fresh directories and a config of the directories, the port, `allowRoot` and
    /// text logs, with `lines` appended (every other key at its default).
    pub fn with_config(lines: &str) -> Self {
        let root = tempfile::tempdir().expect("temp dir");
        let specs = root.path().join("specs");
        let data = root.path().join("data");
        std::fs::create_dir_all(&specs).expect("specs dir");
        let port = free_port();
        let cgroup_parent = stead_tests::cgroup_parent(root.path());
        let config = root.path().join("agent.yaml");
        let text = format!(
            "specsDir: {}\ndataDir: {}\nlisten: 127.0.0.1:{port}\nallowRoot: {}\nlogFormat: text\ncgroupParent: {}\n{lines}",
            specs.display(),
            data.display(),
            running_as_root(),
            cgroup_parent,
        );
        std::fs::write(&config, text).expect("config written");
        AgentDirs {
            root,
            specs,
            data,
            config,
            port,
            cgroup_parent,
        }
    }

    /// Writes a spec file atomically (temp file, then rename), as editors do.
    pub fn write_spec(&self, name: &str, yaml: &str) {
        let tmp = self.specs.join(format!(".{name}.yaml.tmp"));
        std::fs::write(&tmp, yaml).expect("spec written");
        std::fs::rename(&tmp, self.specs.join(format!("{name}.yaml"))).expect("spec renamed");
    }

    /// Deletes a spec file.
    pub fn remove_spec(&self, name: &str) {
        std::fs::remove_file(self.specs.join(format!("{name}.yaml"))).expect("spec removed");
    }

    /// Starts the agent and waits until its API answers.
    pub fn start(&self) -> Agent {
        self.start_with(Command::new(agent_binary()), &supervisor_binary())
    }

    /// Starts the agent with `supervisor` as its exec driver's supervisor and waits
    /// until its API answers.
    pub fn start_supervised_by(&self, supervisor: &Path) -> Agent {
        self.start_with(Command::new(agent_binary()), supervisor)
    }

    /// Starts the agent with `signals` (shell names: `INT HUP`) ignored, as a script's
    /// background job or `nohup` would, and waits until its API answers.
    pub fn start_ignoring(&self, signals: &str) -> Agent {
        self.start_after(&format!("trap '' {signals}"))
    }

    /// Starts the agent as user `uid` (its group the same number, no other groups) and
    /// waits until its API answers.
    pub fn start_as(&self, uid: u32) -> Agent {
        use std::os::unix::process::CommandExt;
        let mut command = Command::new(agent_binary());
        command.uid(uid).gid(uid);
        self.start_with(command, &supervisor_binary())
    }

    /// Starts the agent from a shell after `prelude` (`ulimit -Sn 512`, say), as a
    /// wrapper script would, and waits until its API answers.
    pub fn start_after(&self, prelude: &str) -> Agent {
        let mut shell = Command::new("/bin/sh");
        shell
            .arg("-c")
            .arg(format!("{prelude}; exec \"$0\" \"$@\""))
            .arg(agent_binary());
        self.start_with(shell, &supervisor_binary())
    }

    /// Starts `program` (another build of `stead`) as the agent and waits until its API
    /// answers.
    pub fn start_program(&self, program: &Path) -> Agent {
        self.start_with(Command::new(program), &supervisor_binary())
    }

    /// Starts the agent without waiting for anything.
    pub fn launch(&self) -> Agent {
        self.launch_with(Command::new(agent_binary()), &supervisor_binary())
    }

    /// Starts the agent through `command` (the binary, or a launcher that executes it,
    /// which then receives the agent's arguments) and waits until its API answers.
    fn start_with(&self, command: Command, supervisor: &Path) -> Agent {
        let mut agent = self.launch_with(command, supervisor);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if agent.try_get("/v1/health").is_some() {
                return agent;
            }
            if let Ok(Some(status)) = agent.child.try_wait() {
                panic!("agent exited with {status}:\n{}", agent.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "agent API not up:\n{}",
                agent.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn launch_with(&self, mut command: Command, supervisor: &Path) -> Agent {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.path().join("agent.log"))
            .expect("agent log");
        let child = command
            .args(["agent", "--config"])
            .arg(&self.config)
            .env("STEAD_SUPERVISOR", supervisor)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .expect("agent spawned");
        Agent {
            child,
            port: self.port,
            log: self.root.path().join("agent.log"),
            token_file: self.data.join("api-token"),
            token: std::sync::OnceLock::new(),
        }
    }
}

/// A duration no other process sleeps (`300.NNNNNNN`), to find a task's or a check's
/// processes by.
pub fn unique_nap() -> String {
    format!("300.{}", fastrand::u32(1_000_000..10_000_000))
}

/// A running agent process.
pub struct Agent {
    pub child: Child,
    pub port: u16,
    pub log: PathBuf,
    /// Where the agent keeps the token it generated.
    pub token_file: PathBuf,
    /// The token, once read from `token_file` (written before the API serves).
    token: std::sync::OnceLock<String>,
}

impl Agent {
    /// SIGKILLs the agent and reaps it; its tasks' supervisors live on.
    pub fn kill9(mut self) {
        self.child.kill().expect("agent killed");
        self.child.wait().expect("agent reaped");
    }

    /// SIGTERMs the agent and waits for it to exit.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).expect("a pid");
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("signalled");
        self.child.wait().expect("agent reaped")
    }

    /// Waits up to `within` for the agent to exit by itself (refusing to start, say);
    /// its exit status and log.
    pub fn until_exit(mut self, within: Duration) -> (std::process::ExitStatus, String) {
        let status = wait_for("the agent exits", within, || {
            self.child
                .try_wait()
                .expect("the agent's state")
                .ok_or_else(|| self.log_text())
        });
        (status, self.log_text())
    }

    /// The agent's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A GET of `path`: status code and body, or `None` when the agent does not answer.
    pub fn try_get(&self, path: &str) -> Option<(u16, String)> {
        self.request("GET", path)
    }

    /// A POST of `path` with an empty JSON body.
    pub fn post(&self, path: &str) -> Option<(u16, String)> {
        self.request("POST", path)
    }

    /// A GET of `path` without the token, as any local user could send it.
    pub fn get_without_token(&self, path: &str) -> Option<(u16, String)> {
        self.send("GET", path, None)
    }

    /// A POST of `path` with an empty JSON body and without the token.
    pub fn post_without_token(&self, path: &str) -> Option<(u16, String)> {
        self.send("POST", path, None)
    }

    /// The token the agent generated, once it has.
    pub fn token(&self) -> Option<&str> {
        if self.token.get().is_none() {
            let text = std::fs::read_to_string(&self.token_file).ok()?;
            let _ = self.token.set(text.trim().to_owned());
        }
        self.token.get().map(String::as_str)
    }

    /// The `stead` CLI as a process of its own against this agent, with its token file:
    /// exit code, stdout and stderr.
    pub fn cli(&self, args: &[&str]) -> (i32, String, String) {
        // The client's flags go right after the subcommand, before any `--` that ends them.
        let (command, rest) = args.split_at(args.len().min(2));
        let output = Command::new(agent_binary())
            .args(command)
            .args(["--color", "never", "--address"])
            .arg(format!("127.0.0.1:{}", self.port))
            .arg("--token-file")
            .arg(&self.token_file)
            .args(rest)
            .env_remove("STEAD_TOKEN")
            .env_remove("STEAD_ADDR")
            .stdin(Stdio::null())
            .output()
            .expect("the CLI runs");
        (
            output.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    }

    fn request(&self, method: &str, path: &str) -> Option<(u16, String)> {
        self.send(method, path, self.token())
    }

    /// A GET of `path` with the token and `Accept: accept`: status code, `Content-Type`
    /// and body.
    pub fn get_accepting(&self, path: &str, accept: &str) -> Option<(u16, String, String)> {
        let accept = format!("Accept: {accept}\r\n");
        let (code, head, body) = self.exchange("GET", path, self.token(), &accept)?;
        let content_type = head.lines().find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-type")
                .then(|| value.trim().to_owned())
        })?;
        Some((code, content_type, body))
    }

    fn send(&self, method: &str, path: &str, token: Option<&str>) -> Option<(u16, String)> {
        let (code, _, body) = self.exchange(method, path, token, "")?;
        Some((code, body))
    }

    /// Sends one request with `headers` (whole lines) added: status code, head and body.
    fn exchange(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        headers: &str,
    ) -> Option<(u16, String, String)> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .ok()?;
        let body = if method == "POST" { "{}" } else { "" };
        let authorization =
            token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{authorization}{headers}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .ok()?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).ok()?;
        let text = String::from_utf8(response).ok()?;
        let (head, body) = text.split_once("\r\n\r\n")?;
        let code = head.split_whitespace().nth(1)?.parse().ok()?;
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)
        } else {
            body.to_owned()
        };
        Some((code, head.to_owned(), body))
    }

    /// Task `main` of alloc `name`, once `condition` holds of it, within `within`.
    pub fn wait_for_task(
        &self,
        name: &str,
        what: &str,
        within: Duration,
        condition: impl Fn(&TaskStatus) -> bool,
    ) -> TaskStatus {
        wait_for(what, within, || {
            let status = self.status(name);
            status
                .as_ref()
                .and_then(|s| s.tasks.get("main"))
                .filter(|task| condition(task))
                .map(|task| TaskStatus::clone(task))
                .ok_or_else(|| format!("{status:#?}"))
        })
    }

    /// The alloc's status, when the agent knows it.
    pub fn status(&self, name: &str) -> Option<AllocStatus> {
        match self.try_get(&format!("/v1/allocs/{name}"))? {
            (200, body) => Some(serde_json::from_str(&body).expect("a status document")),
            _ => None,
        }
    }

    /// Waits up to `within` for the first event of `event_type` (say `Terminated`) of
    /// task `task` of alloc `alloc`, and returns it.
    pub fn wait_for_event(
        &self,
        alloc: &str,
        task: &str,
        event_type: &str,
        within: Duration,
    ) -> TaskEventStatus {
        wait_for(
            &format!("a {event_type} event of {alloc}/{task}"),
            within,
            || {
                let status = self.status(alloc);
                status
                    .as_ref()
                    .and_then(|s| s.tasks.get(task))
                    .and_then(|t| t.events.iter().find(|e| e.event_type == event_type))
                    .cloned()
                    .ok_or_else(|| format!("{status:#?}"))
            },
        )
    }

    /// The names of every alloc the agent shows.
    pub fn alloc_names(&self) -> Vec<String> {
        let (_, body) = self.try_get("/v1/allocs").expect("the agent answers");
        let items: Vec<serde_json::Value> = serde_json::from_str(&body).expect("a list");
        items
            .iter()
            .filter_map(|item| item["name"].as_str().map(str::to_owned))
            .collect()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || tail.len() < size {
            break;
        }
        out.push_str(&tail[..size]);
        rest = tail[size..].trim_start_matches("\r\n");
    }
    out
}

/// Polls `condition` until it holds; panics with `what` and the last observation when
/// `deadline` passes first.
pub fn wait_for<T>(
    what: &str,
    deadline: Duration,
    mut condition: impl FnMut() -> Result<T, String>,
) -> T {
    let end = Instant::now() + deadline;
    loop {
        match condition() {
            Ok(value) => return value,
            Err(last) => {
                assert!(Instant::now() < end, "timed out waiting for {what}: {last}");
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The pids of live processes whose command line contains `marker`.
pub fn processes_with(marker: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if cmdline.is_empty() || is_zombie(pid) {
            continue;
        }
        if String::from_utf8_lossy(&cmdline).contains(marker) {
            pids.push(pid);
        }
    }
    pids.sort_unstable();
    pids
}

/// Field `n` (1-based, as in proc(5), from 3 on) of `/proc/<pid>/stat`.
fn stat_field(pid: u32, n: usize) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(") ")?;
    rest.split_whitespace()
        .nth(n.checked_sub(3)?)
        .map(str::to_owned)
}

fn is_zombie(pid: u32) -> bool {
    stat_field(pid, 3).as_deref() == Some("Z")
}

/// The parent of process `pid`, while it exists.
pub fn parent_of(pid: u32) -> Option<u32> {
    stat_field(pid, 4)?.parse().ok()
}

/// Kills every process whose command line contains `marker` (test clean-up).
pub fn kill_all_with(marker: &str) {
    for pid in processes_with(marker) {
        if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

/// An exec alloc whose one task runs until stopped; its command line carries `marker`.
pub fn service_spec(name: &str, marker: &str) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  tasks:\n    - name: main\n      driver: exec\n      killTimeout: 2s\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"trap 'exit 0' TERM; while :; do sleep 0.2; done\", \"{marker}\"]\n"
    )
}

/// An exec batch alloc whose one task exits 0 at once.
pub fn batch_spec(name: &str, marker: &str) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  type: batch\n  tasks:\n    - name: main\n      driver: exec\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"exit 0\", \"{marker}\"]\n"
    )
}

/// The workspace's path to `dir` as the config writes it.
pub fn show(path: &Path) -> String {
    path.display().to_string()
}
