//! `stead alloc exec` through the real `stead agent` and the real `stead` CLI (issue 35):
//! the command's output and exit code come back over TCP and the unix socket; it runs
//! in its task's dir, env, user and cgroup; `-i` passes input on and `-t` gives it a
//! terminal; refusals say why; the token is required; `api.maxExecs` bounds how many run;
//! and nothing of a command outlives its client or its own end.

use std::io::Write;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use crate::agent_support::{
    self, Agent, AgentDirs, agent_binary, batch_spec, processes_with, unique_nap, wait_for,
};

/// An exec alloc `name` whose task `main` runs until stopped (its command line carries
/// `marker`), with `GREETING=hello` in its env and `extra` YAML lines added to the task.
fn service(name: &str, marker: &str, extra: &str) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  tasks:\n    - name: main\n      driver: exec\n      killTimeout: 2s\n      env: {{GREETING: hello}}\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"trap 'exit 0' TERM; while :; do sleep 0.2; done\", \"{marker}\"]\n{extra}"
    )
}

/// The pid of the task whose command line carries `marker`, once it runs.
fn task_pid(agent: &Agent, marker: &str) -> u32 {
    wait_for("the task runs", Duration::from_secs(30), || {
        processes_with(marker)
            .first()
            .copied()
            .ok_or_else(|| agent.log_text())
    })
}

/// An agent with config `config` running alloc `web`, whose task's command line carries
/// the returned marker (`stead-exec-<label>-<pid>`), once it runs.
fn running_web(config: &str, label: &str) -> (AgentDirs, Agent, String) {
    let dirs = AgentDirs::new(config);
    let marker = format!("stead-exec-{label}-{}", std::process::id());
    dirs.write_spec("web", &service("web", &marker, ""));
    let agent = dirs.start();
    task_pid(&agent, &marker);
    (dirs, agent, marker)
}

/// `stead alloc exec ARGS…` against the agent at `address`, with its token file and
/// none of the CLI's environment variables.
fn exec_at(agent: &Agent, address: &str, args: &[&str]) -> Command {
    let mut command = Command::new(agent_binary());
    command
        .args(["alloc", "exec", "--color", "never", "--address", address])
        .arg("--token-file")
        .arg(&agent.token_file)
        .args(args)
        .env_remove("STEAD_TOKEN")
        .env_remove("STEAD_TOKEN_FILE")
        .env_remove("STEAD_DATA_DIR")
        .env_remove("STEAD_CONFIG")
        .env_remove("STEAD_ADDR")
        .stdin(Stdio::null());
    command
}

fn exec(agent: &Agent, args: &[&str]) -> Command {
    exec_at(agent, &format!("127.0.0.1:{}", agent.port), args)
}

/// Runs the CLI to its end, within 30 s.
fn output(mut command: Command) -> Output {
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the cli starts");
    finish(child)
}

fn finish(child: Child) -> Output {
    let (done, wait) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    wait.recv_timeout(Duration::from_secs(30))
        .expect("the cli ends within 30 s")
        .expect("the cli's output")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn show(output: &Output) -> String {
    format!(
        "{}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        stdout(output),
        stderr(output)
    )
}

#[test]
fn exec_passes_the_commands_stdout_stderr_and_exit_code_over_tcp_and_the_unix_socket() {
    let dirs = AgentDirs::new("");
    let socket = dirs.root.path().join("api.sock");
    let config = std::fs::read_to_string(&dirs.config).expect("config");
    std::fs::write(
        &dirs.config,
        format!("{config}socket: {}\n", socket.display()),
    )
    .expect("config written");
    let marker = format!("stead-exec-io-{}", std::process::id());
    dirs.write_spec("web", &service("web", &marker, ""));
    let agent = dirs.start();
    task_pid(&agent, &marker);
    for address in [
        format!("127.0.0.1:{}", agent.port),
        format!("unix:{}", socket.display()),
    ] {
        let ran = output(exec_at(
            &agent,
            &address,
            &[
                "web",
                "main",
                "--",
                "sh",
                "-c",
                "echo out; echo err >&2; exit 3",
            ],
        ));
        assert_eq!(ran.status.code(), Some(3), "{address}: {}", show(&ran));
        assert_eq!(stdout(&ran), "out\n", "{address}");
        assert_eq!(stderr(&ran), "err\n", "{address}");
    }
    // A signal's end reads as a shell says it: 128 + its number.
    let killed = output(exec(
        &agent,
        &["web", "main", "--", "sh", "-c", "kill -9 $$"],
    ));
    assert_eq!(killed.status.code(), Some(137), "{}", show(&killed));
}

#[test]
fn exec_runs_in_the_tasks_dir_with_its_env_and_as_its_user() {
    let dirs = AgentDirs::new("");
    // As root the task runs as nobody, so the command must too; otherwise as the agent.
    let (user, uid) = if agent_support::running_as_root() {
        ("      user: nobody\n", "65534".to_owned())
    } else {
        ("", rustix::process::geteuid().as_raw().to_string())
    };
    let marker = format!("stead-exec-context-{}", std::process::id());
    dirs.write_spec("web", &service("web", &marker, user));
    let agent = dirs.start();
    let pid = task_pid(&agent, &marker);
    let task_dir = std::fs::read_link(format!("/proc/{pid}/cwd")).expect("the task's dir");
    let ran = output(exec(
        &agent,
        &[
            "web",
            "main",
            "--",
            "sh",
            "-c",
            "pwd; printenv GREETING; id -u; echo $STEAD_TASK_NAME",
        ],
    ));
    assert_eq!(ran.status.code(), Some(0), "{}", show(&ran));
    assert_eq!(
        stdout(&ran),
        format!("{}\nhello\n{uid}\nmain\n", task_dir.display())
    );
}

#[test]
fn exec_with_i_passes_stdin_on_and_without_it_the_command_reads_nothing() {
    let (_dirs, agent, _marker) = running_web("", "stdin");

    let mut command = exec(&agent, &["-i", "web", "main", "--", "cat"]);
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the cli starts");
    let mut input = child.stdin.take().expect("stdin");
    input
        .write_all(b"line one\nline two\n")
        .expect("input written");
    drop(input);
    let piped = finish(child);
    assert_eq!(piped.status.code(), Some(0), "{}", show(&piped));
    assert_eq!(stdout(&piped), "line one\nline two\n");

    // Without -i the command's input is empty, whatever the CLI's is.
    let mut command = exec(&agent, &["web", "main", "--", "cat"]);
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the cli starts");
    child
        .stdin
        .as_mut()
        .expect("stdin")
        .write_all(b"not for cat\n")
        .expect("input written");
    let unplugged = finish(child);
    assert_eq!(unplugged.status.code(), Some(0), "{}", show(&unplugged));
    assert_eq!(stdout(&unplugged), "");
}

#[test]
fn exec_with_t_runs_the_command_on_a_terminal_of_its_own() {
    let (_dirs, agent, _marker) = running_web("", "tty");
    let script = "tty; test -t 0 && test -t 1 && test -t 2 && echo all three; stty size";
    let ran = output(exec(
        &agent,
        &["-t", "web", "main", "--", "sh", "-c", script],
    ));
    assert_eq!(ran.status.code(), Some(0), "{}", show(&ran));
    let text = stdout(&ran).replace("\r\n", "\n");
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines.len() == 3 && lines[0].starts_with("/dev/pts/"),
        "{}",
        show(&ran)
    );
    // No terminal here to take the size of: a terminal's default size.
    assert_eq!(lines[1..], ["all three", "24 80"], "{}", show(&ran));
    assert_eq!(stderr(&ran), "", "errors go to the terminal too");

    let piped = output(exec(&agent, &["web", "main", "--", "sh", "-c", "tty"]));
    assert_eq!(piped.status.code(), Some(1), "{}", show(&piped));
    assert_eq!(stdout(&piped), "not a tty\n");
}

#[test]
fn exec_runs_in_the_tasks_cgroup_when_the_task_has_limits() {
    if !agent_support::running_as_root() {
        eprintln!("skipped: only root has cgroups to put tasks in");
        return;
    }
    let dirs = AgentDirs::new("");
    let marker = format!("stead-exec-cgroup-{}", std::process::id());
    dirs.write_spec(
        "web",
        &service(
            "web",
            &marker,
            "      resources: {memoryMB: 64, pids: 20}\n",
        ),
    );
    let agent = dirs.start();
    let pid = task_pid(&agent, &marker);
    let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("the task's cgroups");
    let id = agent.status("web").expect("a status").id;
    assert!(
        own.contains(&format!("/{}/{id}.main.", dirs.cgroup_parent)),
        "the task is in its run's cgroup: {own}"
    );
    let ran = output(exec(
        &agent,
        &["web", "main", "--", "cat", "/proc/self/cgroup"],
    ));
    assert_eq!(ran.status.code(), Some(0), "{}", show(&ran));
    assert_eq!(stdout(&ran), own, "the command shares its task's cgroups");
}

#[test]
fn exec_beside_a_stopped_mock_or_unknown_task_or_of_a_missing_command_says_why() {
    let dirs = AgentDirs::new("drivers: {mock: {enabled: true}}\n");
    let marker = format!("stead-exec-refused-{}", std::process::id());
    dirs.write_spec("web", &service("web", &marker, ""));
    dirs.write_spec("done", &batch_spec("done", &format!("{marker}-batch")));
    dirs.write_spec(
        "fake",
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: fake}\nspec:\n  tasks:\n    - {name: main, driver: mock, config: {}}\n",
    );
    let agent = dirs.start();
    task_pid(&agent, &marker);
    agent.wait_for_task(
        "done",
        "the batch task ended",
        Duration::from_secs(30),
        |t| t.state == "dead",
    );
    agent.wait_for_task("fake", "the mock task runs", Duration::from_secs(30), |t| {
        t.state == "running"
    });
    let refused = |args: &[&str], code: i32, message: &str| {
        let ran = output(exec(&agent, args));
        assert_eq!(ran.status.code(), Some(code), "{args:?}: {}", show(&ran));
        assert!(stderr(&ran).contains(message), "{args:?}: {}", show(&ran));
        assert_eq!(stdout(&ran), "", "{args:?}");
    };
    refused(
        &["done", "main", "--", "true"],
        1,
        "error: task \"main\" of alloc \"done\" is not running",
    );
    refused(
        &["web", "nope", "--", "true"],
        1,
        "error: task \"nope\" not found in alloc \"web\"",
    );
    refused(
        &["ghost", "main", "--", "true"],
        1,
        "error: alloc \"ghost\" not found",
    );
    refused(
        &["fake", "main", "--", "true"],
        1,
        "error: the mock driver cannot run commands in its tasks",
    );
    refused(
        &["web", "main", "--", "no-such-command-here"],
        127,
        "error: cannot start \"no-such-command-here\" in task main of alloc web-",
    );
    refused(
        &["web", "main", "--", "/etc/passwd"],
        126,
        "Permission denied",
    );
}

#[test]
fn exec_without_the_token_is_refused_with_401_and_without_an_upgrade_with_426() {
    let (_dirs, agent, _marker) = running_web("", "token");
    let (code, body) = agent
        .post_without_token("/v1/allocs/web/exec/main")
        .expect("the agent answers");
    assert_eq!(code, 401, "{body}");
    let (code, body) = agent
        .post("/v1/allocs/web/exec/main")
        .expect("the agent answers");
    assert_eq!(code, 426, "{body}");
    assert!(body.contains("\"code\":\"upgrade_required\""), "{body}");

    let ran = output(exec(
        &agent,
        &["--token", "wrong", "web", "main", "--", "true"],
    ));
    assert_eq!(ran.status.code(), Some(1), "{}", show(&ran));
    assert!(
        stderr(&ran).contains("error: invalid bearer token"),
        "{}",
        show(&ran)
    );
}

/// The `sleep` processes sleeping `nap` (not the CLI, whose arguments name it too).
fn sleeps(nap: &str) -> Vec<u32> {
    processes_with(nap)
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmdline| cmdline.starts_with(b"sleep\0"))
        })
        .collect()
}

/// Waits until no process whose command line carries `marker` is left.
/// A CLI running `stead alloc exec` of a shell that sleeps `nap` in the background and
/// in the foreground, once both sleeps run; its stderr goes to `stderr`.
fn sleeping(agent: &Agent, nap: &str, stderr: Stdio) -> Child {
    let script = format!("sleep {nap} & sleep {nap}");
    let cli = exec(agent, &["web", "main", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("the cli starts");
    wait_for("both sleeps run", Duration::from_secs(10), || {
        let running = sleeps(nap);
        if running.len() == 2 {
            Ok(())
        } else {
            Err(format!("{running:?}"))
        }
    });
    cli
}

fn until_gone(marker: &str, what: &str) {
    wait_for(what, Duration::from_secs(10), || {
        let left = processes_with(marker);
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{left:?}"))
        }
    });
}

#[test]
fn a_command_dies_with_its_whole_group_when_its_client_goes_away_or_it_ends() {
    let (_dirs, agent, marker) = running_web("", "gone");

    let nap = unique_nap();
    let mut cli = sleeping(&agent, &nap, Stdio::null());
    cli.kill().expect("the cli killed");
    cli.wait().expect("the cli reaped");
    until_gone(
        &nap,
        "the command and its background child die with the client",
    );

    // A command that ends leaves nothing it started behind either.
    let nap = unique_nap();
    let ran = output(exec(
        &agent,
        &[
            "web",
            "main",
            "--",
            "sh",
            "-c",
            &format!("sleep {nap} & echo started"),
        ],
    ));
    assert_eq!(ran.status.code(), Some(0), "{}", show(&ran));
    assert_eq!(stdout(&ran), "started\n");
    until_gone(&nap, "the background child of an ended command");
    assert!(!processes_with(&marker).is_empty(), "the task runs on");
}

#[test]
fn an_agent_that_stops_takes_the_commands_it_runs_with_it() {
    let (_dirs, agent, marker) = running_web("", "stop");
    let nap = unique_nap();
    // A background child too: the task's death signal reaches only the direct child,
    // so only the agent's own clean-up ends the other.
    let mut cli = sleeping(&agent, &nap, Stdio::piped());
    // Detached: the task runs on, the command does not.
    assert!(agent.terminate().success());
    until_gone(&nap, "the command of a stopped agent");
    let status = cli.wait().expect("the cli ends");
    assert_eq!(
        status.code(),
        Some(1),
        "the cli says the session ended early"
    );
    assert!(!processes_with(&marker).is_empty(), "the task runs on");
    agent_support::kill_all_with(&marker);
}

#[test]
fn execs_beyond_api_max_execs_are_refused_until_one_ends() {
    let (_dirs, agent, _marker) = running_web("api: {maxExecs: 1}\n", "cap");

    let nap = unique_nap();
    let mut first = sleeping(&agent, &nap, Stdio::null());
    let second = output(exec(&agent, &["web", "main", "--", "true"]));
    assert_eq!(second.status.code(), Some(1), "{}", show(&second));
    assert!(
        stderr(&second).contains(
            "error: the agent runs at most 1 exec commands at once (api.maxExecs); try again later"
        ),
        "{}",
        show(&second)
    );
    first.kill().expect("the first cli killed");
    first.wait().expect("reaped");
    until_gone(&nap, "the first command");
    wait_for("a third command runs", Duration::from_secs(10), || {
        let third = output(exec(&agent, &["web", "main", "--", "echo", "third"]));
        (third.status.code() == Some(0) && stdout(&third) == "third\n")
            .then_some(())
            .ok_or_else(|| show(&third))
    });
}

#[test]
fn exec_help_names_the_flags_and_the_exit_codes() {
    let ran = output({
        let mut command = Command::new(agent_binary());
        command.args(["alloc", "exec", "--help"]);
        command
    });
    assert_eq!(ran.status.code(), Some(0), "{}", show(&ran));
    let help = stdout(&ran);
    for part in ["--tty", "--interactive", "127", "126"] {
        assert!(help.contains(part), "{part} in:\n{help}");
    }
}
