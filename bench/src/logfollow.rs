//! `stead-bench logfollow [STREAMS] [WINDOW_SECONDS]`: what followed log streams cost the
//! agent.
//!
//! The real `stead agent` (the release binary beside this one, with its supervisor) runs
//! one exec task that writes a line a second. The agent's CPU (all its threads, from
//! `/proc/<pid>/stat`) is measured over WINDOW_SECONDS (default 30) twice: with no
//! client, then with STREAMS (default 1,000) clients each following the task's stdout
//! (`GET /v1/allocs/ticker/logs/main?follow=true`, read as it comes). With
//! `STEAD_BENCH_BASELINE=/path/to/stead` (an earlier build, its `stead-supervisor`
//! beside it) the same runs first on that binary, in the same run, for the comparison.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::agent::temp_dir;
use crate::measure::{cpu_ticks, now};

/// One agent run's figures.
struct Figures {
    /// CPU with no client, in percent of one core.
    idle: f64,
    /// CPU with every stream followed, in percent of one core.
    following: f64,
    /// Bytes the clients received during the window.
    received: u64,
}

/// An agent on a fresh directory, killed and its directory removed when dropped.
struct LogAgent {
    child: Child,
    port: u16,
    root: PathBuf,
}

impl Drop for LogAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

impl LogAgent {
    /// Starts `stead` with the exec driver on one task writing a line a second; `limits`
    /// are config lines the binary knows (an earlier one knows no `api` key).
    fn start(stead: &Path, limits: &str) -> anyhow::Result<Self> {
        let root = temp_dir("stead-bench-logfollow")?;
        let specs = root.join("specs");
        std::fs::create_dir_all(&specs)?;
        std::fs::write(
            specs.join("ticker.yaml"),
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: ticker}\nspec:\n  tasks:\n    - name: main\n      driver: exec\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"while :; do echo tick; sleep 1; done\"]\n",
        )?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let config = root.join("agent.yaml");
        let root_user = rustix::process::getuid().is_root();
        std::fs::write(
            &config,
            format!(
                "specsDir: {}\ndataDir: {}\nlisten: 127.0.0.1:{port}\nallowRoot: {root_user}\nlogFormat: json\n{limits}",
                specs.display(),
                root.join("data").display(),
            ),
        )?;
        let child = Command::new(stead)
            .args(["agent", "--config"])
            .arg(&config)
            .env("STEAD_SUPERVISOR", stead.with_file_name("stead-supervisor"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", stead.display()))?;
        let agent = LogAgent { child, port, root };
        let start = now();
        loop {
            let running = crate::agent::http_get(port, "/v1/allocs/ticker")
                .ok()
                .is_some_and(|body| body.contains("\"state\":\"running\""));
            if running {
                return Ok(agent);
            }
            if start.elapsed() > Duration::from_secs(30) {
                bail!("the ticker task did not run within 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The agent's CPU over `window`, in percent of one core.
    fn cpu_over(&self, window: Duration) -> anyhow::Result<f64> {
        let pid = self.child.id().to_string();
        let before = cpu_ticks(&pid).context("reading the agent's CPU")?;
        std::thread::sleep(window);
        let after = cpu_ticks(&pid).context("reading the agent's CPU")?;
        // USER_HZ is 100: a tick is 10 ms.
        Ok((after - before) as f64 * 10.0 / window.as_millis() as f64 * 100.0)
    }
}

/// Follows the ticker's log on `streams` connections; the bytes received so far.
fn follow(
    runtime: &tokio::runtime::Runtime,
    port: u16,
    streams: usize,
) -> anyhow::Result<std::sync::Arc<std::sync::atomic::AtomicU64>> {
    use std::sync::atomic::{AtomicU64, Ordering};
    let received = std::sync::Arc::new(AtomicU64::new(0));
    let (opened, mut all_opened) = tokio::sync::mpsc::channel::<anyhow::Result<()>>(streams);
    for _ in 0..streams {
        let received = received.clone();
        let opened = opened.clone();
        runtime.spawn(async move {
            let connected = async {
                let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
                stream
                    .write_all(b"GET /v1/allocs/ticker/logs/main?follow=true HTTP/1.1\r\nHost: localhost\r\n\r\n")
                    .await?;
                let mut buffer = vec![0u8; 4096];
                let read = stream.read(&mut buffer).await?;
                if !buffer[..read].starts_with(b"HTTP/1.1 200") {
                    bail!("{}", String::from_utf8_lossy(&buffer[..read]));
                }
                anyhow::Ok((stream, buffer))
            }
            .await;
            let (mut stream, mut buffer) = match connected {
                Ok(connected) => {
                    let _ = opened.send(Ok(())).await;
                    connected
                }
                Err(error) => {
                    let _ = opened.send(Err(error)).await;
                    return;
                }
            };
            while let Ok(read) = stream.read(&mut buffer).await {
                if read == 0 {
                    return;
                }
                received.fetch_add(read as u64, Ordering::Relaxed);
            }
        });
    }
    drop(opened);
    runtime.block_on(async {
        for _ in 0..streams {
            match all_opened.recv().await {
                Some(Ok(())) => {}
                Some(Err(error)) => return Err(error.context("following the log")),
                None => bail!("a client ended before it followed"),
            }
        }
        anyhow::Ok(())
    })?;
    Ok(received)
}

fn measure(
    stead: &Path,
    limits: &str,
    streams: usize,
    window: Duration,
) -> anyhow::Result<Figures> {
    let agent = LogAgent::start(stead, limits)?;
    // Let start-up's work settle.
    std::thread::sleep(Duration::from_secs(2));
    let idle = agent.cpu_over(window)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let received = follow(&runtime, agent.port, streams)?;
    std::thread::sleep(Duration::from_secs(2));
    let before = received.load(std::sync::atomic::Ordering::Relaxed);
    let following = agent.cpu_over(window)?;
    let received = received.load(std::sync::atomic::Ordering::Relaxed) - before;
    drop(agent);
    runtime.shutdown_timeout(Duration::from_secs(1));
    Ok(Figures {
        idle,
        following,
        received,
    })
}

fn report(label: &str, streams: usize, window: Duration, figures: &Figures) {
    println!(
        "  {label:<28} idle {:>6.2} %   {streams} followed {:>6.2} % of one core   ({} bytes received in {} s)",
        figures.idle,
        figures.following,
        figures.received,
        window.as_secs()
    );
}

pub(crate) fn run(streams: usize, window: Duration) -> anyhow::Result<()> {
    let stead = std::env::current_exe()?.with_file_name("stead");
    if !stead.is_file() {
        bail!(
            "{} is missing: build it with `scripts/build-release.sh target/dist stead-controller stead-supervisor stead-bench`",
            stead.display()
        );
    }
    println!(
        "stead-bench logfollow: {streams} clients following one exec task's stdout (a line a second), agent CPU over {} s",
        window.as_secs()
    );
    if let Some(baseline) = std::env::var_os("STEAD_BENCH_BASELINE") {
        let baseline = PathBuf::from(baseline);
        let figures = measure(&baseline, "", streams, window)?;
        report("baseline (STEAD_BENCH_BASELINE)", streams, window, &figures);
    }
    let limits = format!(
        "api: {{maxLogStreams: {}, maxConnections: {}}}\n",
        streams + 16,
        streams + 64
    );
    let figures = measure(&stead, &limits, streams, window)?;
    report("this build", streams, window, &figures);
    println!("  (target: {streams} followed streams cost at most 10 % of one core)");
    Ok(())
}
