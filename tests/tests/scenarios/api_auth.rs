//! Only the operator controls the agent by default, through the real `stead agent` and
//! plain HTTP: a fresh agent without a configured token generates one, every endpoint
//! but `/v1/health` wants it, the CLI of the agent's user (or root) finds it, `token:
//! none` is refused off loopback, and `listen: null` serves only the unix socket
//! (issue 34).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use crate::agent_support::{self, AgentDirs, agent_binary, kill_all_with, wait_for};

/// An exec alloc whose task prints a line, then runs until stopped.
fn chatty_spec(name: &str, marker: &str) -> String {
    format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: {name}}}\nspec:\n  tasks:\n    - name: main\n      driver: exec\n      killTimeout: 2s\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"echo hello-from-{name}; trap 'exit 0' TERM; while :; do sleep 0.2; done\", \"{marker}\"]\n"
    )
}

/// The `stead` CLI as a process of its own, with `env` and none of the token's
/// variables but those.
fn cli(args: &[&str], env: &[(&str, &Path)]) -> Command {
    let mut command = Command::new(agent_binary());
    command
        .args(args)
        .args(["--color", "never"])
        .env_remove("STEAD_TOKEN")
        .env_remove("STEAD_TOKEN_FILE")
        .env_remove("STEAD_DATA_DIR")
        .env_remove("STEAD_CONFIG")
        .env_remove("STEAD_ADDR");
    for (name, value) in env {
        command.env(name, value);
    }
    command
}

fn text(output: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[test]
fn a_fresh_agent_without_a_token_generates_one_and_wants_it_everywhere_but_health() {
    let dirs = AgentDirs::new("shutdown: drain\n");
    let marker = format!("stead-auth-{}", agent_support::unique_nap());
    dirs.write_spec("web", &chatty_spec("web", &marker));
    let agent = dirs.start();
    agent.wait_for_task("web", "web runs", Duration::from_secs(20), |t| {
        t.state == "running"
    });

    // The token: 32 random bytes in hex, in a file only the agent's user reads.
    let token = agent.token().expect("the agent wrote its token").to_owned();
    assert_eq!(token.len(), 64, "{token}");
    assert!(token.bytes().all(|b| b.is_ascii_hexdigit()), "{token}");
    let meta = std::fs::metadata(&agent.token_file).expect("the token file");
    assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
    assert_eq!(meta.uid(), rustix::process::geteuid().as_raw());

    // Without it, a plain client gets 401 everywhere but health.
    let gets = [
        "/v1/allocs",
        "/v1/allocs/web",
        "/v1/allocs/web/stats",
        "/v1/allocs/web/logs/main?type=stdout",
        "/v1/node",
        "/metrics",
    ];
    for path in gets {
        let (code, body) = agent.get_without_token(path).expect("the agent answers");
        assert_eq!(code, 401, "GET {path}: {body}");
    }
    for path in ["/v1/allocs/web/restart", "/v1/allocs/web/signal"] {
        let (code, body) = agent.post_without_token(path).expect("the agent answers");
        assert_eq!(code, 401, "POST {path}: {body}");
    }
    let (code, body) = agent
        .get_without_token("/v1/health")
        .expect("the agent answers");
    assert_eq!(code, 200, "{body}");
    let health: serde_json::Value = serde_json::from_str(&body).expect("health");
    assert_eq!(health["status"], "ok", "{body}");
    assert_eq!(
        health["components"]["store"],
        serde_json::json!({"healthy": true})
    );
    assert!(!body.contains("message"), "{body}");

    // With it, everything, the task's output and health's messages included.
    let logs = wait_for("the task's output", Duration::from_secs(10), || match agent
        .try_get("/v1/allocs/web/logs/main?type=stdout")
    {
        Some((200, body)) if body.contains("hello-from-web") => Ok(body),
        other => Err(format!("{other:?}")),
    });
    assert!(logs.contains("hello-from-web"));
    let (code, body) = agent.try_get("/v1/health").expect("the agent answers");
    assert_eq!(code, 200);
    assert!(body.contains("every write succeeded"), "{body}");

    // The CLI finds the token in the data dir named in the environment: no flag.
    let address = format!("127.0.0.1:{}", dirs.port);
    let env = [
        ("STEAD_ADDR", Path::new(&address)),
        ("STEAD_DATA_DIR", dirs.data.as_path()),
    ];
    let list = cli(&["alloc", "list"], &env)
        .output()
        .expect("the cli runs");
    assert!(list.status.success(), "{}", text(&list));
    assert!(
        String::from_utf8_lossy(&list.stdout).contains("web"),
        "{}",
        text(&list)
    );
    let logs = cli(&["alloc", "logs", "web", "main"], &env)
        .output()
        .expect("the cli runs");
    assert!(
        String::from_utf8_lossy(&logs.stdout).contains("hello-from-web"),
        "{}",
        text(&logs)
    );
    // Without the data dir it looks elsewhere, and says where when the agent refuses.
    let lost = cli(&["alloc", "list"], &env[..1])
        .current_dir(dirs.root.path())
        .output()
        .expect("the cli runs");
    assert!(!lost.status.success());
    assert!(
        String::from_utf8_lossy(&lost.stderr).contains("missing bearer token ("),
        "{}",
        text(&lost)
    );
    if agent_support::running_as_root() {
        // Another user cannot read the token, and is told so.
        use std::os::unix::process::CommandExt;
        let nobody = cli(&["alloc", "list"], &env)
            .uid(65534)
            .gid(65534)
            .current_dir("/")
            .output()
            .expect("the cli runs");
        assert!(!nobody.status.success());
        let err = String::from_utf8_lossy(&nobody.stderr);
        assert!(
            err.contains("missing bearer token")
                && err.contains("permission denied; run as the agent's user or root"),
            "{}",
            text(&nobody)
        );
    }

    // A second start reads the same token.
    assert!(agent.terminate().success());
    kill_all_with(&marker);
    let again = dirs.start();
    assert_eq!(again.token(), Some(token.as_str()));
    let (code, body) = again.try_get("/v1/allocs").expect("the agent answers");
    assert_eq!(code, 200, "{body}");
    assert!(again.terminate().success());
    kill_all_with(&marker);
}

#[test]
fn token_none_on_a_listen_address_off_loopback_refuses_to_start_naming_the_keys() {
    let dirs = AgentDirs::new("token: none\n");
    let config = std::fs::read_to_string(&dirs.config).expect("config");
    let open = config.replace("listen: 127.0.0.1:", "listen: 0.0.0.0:");
    std::fs::write(&dirs.config, open).expect("config written");
    let (status, log) = dirs.launch().until_exit(Duration::from_secs(20));
    assert!(!status.success(), "{log}");
    assert!(
        log.contains(&format!(
            "`token: none` serves the api to whoever can connect, so only on loopback or the unix socket, but `listen` is 0.0.0.0:{}",
            dirs.port
        )),
        "{log}"
    );
    assert!(
        !dirs.data.join("api-token").exists(),
        "no token made for a refused start"
    );

    // On loopback, `token: none` serves everyone on this host without a token.
    let dirs = AgentDirs::new("token: none\n");
    let agent = dirs.start();
    let (code, body) = agent
        .get_without_token("/v1/allocs")
        .expect("the agent answers");
    assert_eq!(code, 200, "{body}");
    assert!(!dirs.data.join("api-token").exists());
    assert!(agent.terminate().success());
}

#[test]
fn listen_null_serves_only_the_unix_socket() {
    let dirs = AgentDirs::new("");
    let socket = dirs.root.path().join("api.sock");
    let config = std::fs::read_to_string(&dirs.config).expect("config");
    let config = config.replace(
        &format!("listen: 127.0.0.1:{}\n", dirs.port),
        &format!("listen: null\nsocket: {}\n", socket.display()),
    );
    std::fs::write(&dirs.config, config).expect("config written");
    let agent = dirs.launch();
    let address = format!("unix:{}", socket.display());
    let env = [
        ("STEAD_ADDR", Path::new(&address)),
        ("STEAD_DATA_DIR", dirs.data.as_path()),
    ];
    let status = wait_for("the api on the socket", Duration::from_secs(20), || {
        let output = cli(&["node", "status"], &env)
            .output()
            .expect("the cli runs");
        if output.status.success() {
            Ok(output)
        } else {
            Err(format!("{}\n{}", text(&output), agent.log_text()))
        }
    });
    assert!(
        String::from_utf8_lossy(&status.stdout).contains("Drivers"),
        "{}",
        text(&status)
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", dirs.port)).is_err(),
        "nothing listens on the tcp port"
    );
    assert!(agent.terminate().success());
}
