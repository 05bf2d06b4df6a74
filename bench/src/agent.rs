//! The real `stead agent` for the benchmarks that measure it from outside: the release
//! binary beside this one, on a specs directory of mock allocs in a temporary directory,
//! with its API on a free loopback port and no token (`token: none`, which loopback
//! allows); killed and its directory removed when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, bail};

/// A running release agent.
pub(crate) struct ReleaseAgent {
    /// The agent's process.
    pub(crate) child: Child,
    /// Its API's port on 127.0.0.1.
    pub(crate) port: u16,
    root: PathBuf,
}

impl ReleaseAgent {
    /// Starts the agent with only the mock driver on `specs` (file name, YAML text), in a
    /// fresh directory named after `prefix`.
    pub(crate) fn start(
        prefix: &str,
        specs: impl IntoIterator<Item = (String, String)>,
    ) -> anyhow::Result<Self> {
        let stead = std::env::current_exe()?.with_file_name("stead");
        if !stead.is_file() {
            bail!(
                "{} is missing: build it with `scripts/build-release.sh target/dist stead-controller stead-bench`",
                stead.display()
            );
        }
        let root = temp_dir(prefix)?;
        let specs_dir = root.join("specs");
        std::fs::create_dir_all(&specs_dir)?;
        for (name, yaml) in specs {
            std::fs::write(specs_dir.join(name), yaml)?;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let config = root.join("agent.yaml");
        std::fs::write(
            &config,
            format!(
                "specsDir: {}\ndataDir: {}\nlisten: 127.0.0.1:{port}\ntoken: none\ndrivers: {{exec: {{enabled: false}}, mock: {{enabled: true}}}}\n",
                specs_dir.display(),
                root.join("data").display()
            ),
        )?;
        let child = Command::new(&stead)
            .args(["agent", "--config"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        Ok(ReleaseAgent { child, port, root })
    }

    /// A GET on the agent's API; the body.
    pub(crate) fn get(&self, path: &str) -> anyhow::Result<String> {
        http_get(self.port, path)
    }

    /// The value of the series `series` (exact, labels included) in its metrics.
    pub(crate) fn metric(&self, series: &str) -> anyhow::Result<f64> {
        let text = self.get("/metrics")?;
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|value| value.trim().parse().ok())
            .with_context(|| format!("no {series} in /metrics"))
    }

    /// Whether it runs exactly `allocs` allocs, every one of them running.
    pub(crate) fn all_running(&self, allocs: usize) -> bool {
        self.get("/v1/allocs")
            .ok()
            .and_then(|body| serde_json::from_str::<Vec<serde_json::Value>>(&body).ok())
            .is_some_and(|items| {
                items.len() == allocs && items.iter().all(|i| i["clientStatus"] == "running")
            })
    }
}

impl Drop for ReleaseAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// A fresh directory under the system's temporary directory.
pub(crate) fn temp_dir(prefix: &str) -> anyhow::Result<PathBuf> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let suffix = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("{prefix}-{}-{suffix}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// A GET on an agent's loopback API; the body (the agent answers with a length).
pub(crate) fn http_get(port: u16, path: &str) -> anyhow::Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (_, body) = response.split_once("\r\n\r\n").context("no body")?;
    Ok(body.to_owned())
}
