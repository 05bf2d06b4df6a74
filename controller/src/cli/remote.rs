//! The commands that ask a running agent: `stead alloc …`, `stead node status` and
//! `stead node health`.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use stead_schemas::api::{
    AllocListItem, AllocStats, GcResult, HealthStatus, LOG_BACKLOG_HEADER, NodeStatus,
    RestartRequest, SignalRequest,
};
use stead_schemas::status::AllocStatus;

use super::EXIT_OK;
use super::client::{ApiFailure, Client, DEFAULT_ADDRESS, encode, is_local_address};
use super::render::{self, Style, tail_lines};
use super::token::TokenSources;

/// The environment variable naming the agent's address.
const ADDRESS_ENV: &str = "STEAD_ADDR";
/// How often `alloc status --watch` asks again.
const WATCH_INTERVAL: Duration = Duration::from_secs(2);
/// The most `--tail` reads back to find its lines.
const TAIL_LIMIT: u64 = 64 * 1024 * 1024;

/// How to reach the agent; accepted after `alloc` or `node` and after their subcommands.
#[derive(Debug, Clone, Args)]
pub(crate) struct ClientArgs {
    /// The agent's API: HOST:PORT, or a unix socket as unix:/PATH or a path
    /// [env: STEAD_ADDR] [default: 127.0.0.1:4750]
    #[arg(long, global = true, value_name = "ADDR")]
    address: Option<String>,
    /// The bearer token the agent requires [env: STEAD_TOKEN] [default: read from a
    /// token file]
    #[arg(long, global = true, value_name = "TOKEN")]
    token: Option<String>,
    /// A file holding the agent's token [env: STEAD_TOKEN_FILE] [default: <data
    /// dir>/api-token, for an agent on this host, of the data dir of --data-dir, else of
    /// the agent config at STEAD_CONFIG or /etc/stead/agent.yaml, else ./stead-data or
    /// /var/lib/stead]
    #[arg(long, global = true, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// The agent's data dir, whose api-token file holds its token [env: STEAD_DATA_DIR]
    #[arg(long, global = true, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// When to colour the output: auto (on a terminal, unless NO_COLOR is set), always, never
    #[arg(long, global = true, value_enum, default_value_t = ColourChoice::Auto)]
    color: ColourChoice,
}

/// When output is coloured (auto: when stdout is a terminal and NO_COLOR is unset).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ColourChoice {
    Auto,
    Always,
    Never,
}

impl ClientArgs {
    fn client(&self) -> anyhow::Result<Client> {
        let address = self
            .address
            .clone()
            .or_else(|| std::env::var(ADDRESS_ENV).ok().filter(|a| !a.is_empty()))
            .unwrap_or_else(|| DEFAULT_ADDRESS.to_owned());
        let found = TokenSources::from_environment(
            self.token.clone(),
            self.token_file.clone(),
            self.data_dir.clone(),
        )
        .find(is_local_address(&address)?)?;
        Client::new(&address, found.token, found.unauthorized_hint)
    }

    fn style(&self) -> Style {
        let colour = match self.color {
            ColourChoice::Always => true,
            ColourChoice::Never => false,
            ColourChoice::Auto => {
                std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none()
            }
        };
        Style { colour }
    }
}

/// `stead alloc …`
#[derive(Debug, Subcommand)]
pub(crate) enum AllocCommand {
    /// List the allocs on the node.
    List {
        /// Print the JSON of `GET /v1/allocs`.
        #[arg(long)]
        json: bool,
    },
    /// Show an alloc: its tasks, their states, restarts and recent events (newest first).
    Status {
        /// The alloc's name.
        name: String,
        /// Print the JSON of `GET /v1/allocs/{name}` (events oldest first).
        #[arg(long)]
        json: bool,
        /// Show it again whenever it changes, until interrupted or the alloc is gone.
        #[arg(long)]
        watch: bool,
    },
    /// Print a task's output.
    Logs {
        /// The alloc's name.
        name: String,
        /// The task's name.
        task: String,
        /// Print stderr instead of stdout.
        #[arg(long)]
        stderr: bool,
        /// Keep printing new output until the task is dead.
        #[arg(short = 'f', long)]
        follow: bool,
        /// Start with the last N lines instead of the whole log.
        #[arg(long, value_name = "N")]
        tail: Option<usize>,
        /// Print the logs of the revision this one replaced (kept until the alloc is
        /// collected, one revision back).
        #[arg(long, conflicts_with = "follow")]
        previous: bool,
    },
    /// Restart a task, or every running task of the alloc.
    Restart {
        /// The alloc's name.
        name: String,
        /// The task's name; every running task when omitted.
        task: Option<String>,
    },
    /// Stop an alloc and keep it stopped, whatever its spec says, until `alloc start`
    /// (kept across agent restarts and spec edits; `alloc status` shows it).
    Stop {
        /// The alloc's name.
        name: String,
    },
    /// Take back `alloc stop`: the alloc runs again as its spec says.
    Start {
        /// The alloc's name.
        name: String,
    },
    /// Destroy now the terminal allocs that no spec declares (their dirs, logs and
    /// records), or only the one named.
    Gc {
        /// The alloc's name; every collectable alloc when omitted.
        name: Option<String>,
        /// Print the JSON of the answer.
        #[arg(long)]
        json: bool,
    },
    /// Show what each running task of an alloc uses: CPU, memory, processes, devices.
    Stats {
        /// The alloc's name.
        name: String,
        /// Print the JSON of `GET /v1/allocs/{name}/stats`.
        #[arg(long)]
        json: bool,
    },
    /// Send a signal to a task.
    Signal {
        /// The alloc's name.
        name: String,
        /// The task's name.
        task: String,
        /// The signal, such as SIGHUP or HUP.
        signal: String,
    },
    /// Run a command in a running task: in its dir, with its env, as its user and in its
    /// cgroup, as its exec checks run.
    ///
    /// Exits with the command's exit code (128 + N when signal N ended it), 127 when the
    /// command is not found, 126 when it cannot be run, and 1 when the agent refuses.
    Exec {
        /// The alloc's name.
        name: String,
        /// The task's name.
        task: String,
        /// Run the command on a pseudo-terminal (the local terminal is put in raw mode
        /// while it runs, with -i).
        #[arg(short = 't', long)]
        tty: bool,
        /// Pass this command's standard input to the command.
        #[arg(short = 'i', long)]
        interactive: bool,
        /// The command and its arguments, best after `--`.
        #[arg(
            required = true,
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "CMD"
        )]
        command: Vec<String>,
    },
}

/// `stead node …`
#[derive(Debug, Subcommand)]
pub(crate) enum NodeCommand {
    /// Show the node: its drivers (health, attributes), devices and alloc counts.
    Status {
        /// Print the JSON of `GET /v1/node`.
        #[arg(long)]
        json: bool,
    },
    /// Ask the agent whether it works (`GET /v1/health`, which needs no token): exits 0
    /// when it answers, `ok` or `degraded`, as a liveness check wants; 1 when it does not.
    Health {
        /// Print the JSON of `GET /v1/health`.
        #[arg(long)]
        json: bool,
    },
}

/// Runs `future` on a runtime of its own: the CLI is synchronous at its edge.
fn block_on<T>(future: impl std::future::Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(future)
}

/// Runs a `stead alloc` command.
pub(crate) fn alloc(
    args: &ClientArgs,
    command: AllocCommand,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> anyhow::Result<u8> {
    let client = args.client()?;
    let style = args.style();
    block_on(async {
        match command {
            AllocCommand::List { json } => list(&client, json, style, out).await,
            AllocCommand::Status { name, json, watch } => {
                if watch {
                    watch_status(&client, &name, json, style, out).await
                } else {
                    status(&client, &name, json, style, out).await
                }
            }
            AllocCommand::Logs {
                name,
                task,
                stderr,
                follow,
                tail,
                previous,
            } => {
                let source = LogSource {
                    name: &name,
                    task: &task,
                    stderr,
                    previous,
                };
                logs(&client, &source, follow, tail, out).await
            }
            AllocCommand::Restart { name, task } => restart(&client, &name, task, out).await,
            AllocCommand::Signal { name, task, signal } => {
                send_signal(&client, &name, &task, &signal, out).await
            }
            AllocCommand::Stop { name } => set_stopped(&client, &name, true, out).await,
            AllocCommand::Start { name } => set_stopped(&client, &name, false, out).await,
            AllocCommand::Gc { name, json } => gc(&client, name.as_deref(), json, out).await,
            AllocCommand::Stats { name, json } => {
                let stats: AllocStats =
                    client.get(&format!("{}/stats", status_path(&name))).await?;
                if json {
                    print_json(out, &stats)?;
                } else {
                    out.write_all(render::alloc_stats(style, &stats).as_bytes())?;
                }
                Ok(EXIT_OK)
            }
            AllocCommand::Exec {
                name,
                task,
                tty,
                interactive,
                command,
            } => {
                let wiring = super::exec::Wiring { tty, interactive };
                super::exec::exec(&client, &name, &task, command, wiring, out, err).await
            }
        }
    })
}

/// Runs a `stead node` command.
pub(crate) fn node(
    args: &ClientArgs,
    command: NodeCommand,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let client = args.client()?;
    let style = args.style();
    block_on(async {
        match command {
            NodeCommand::Status { json } => {
                let node: NodeStatus = client.get("/v1/node").await?;
                if json {
                    print_json(out, &node)?;
                } else {
                    out.write_all(render::node_status(style, &node).as_bytes())?;
                }
                Ok(EXIT_OK)
            }
            NodeCommand::Health { json } => {
                let health: HealthStatus = client.get("/v1/health").await?;
                if json {
                    print_json(out, &health)?;
                } else {
                    out.write_all(render::health(style, &health).as_bytes())?;
                }
                Ok(EXIT_OK)
            }
        }
    })
}

fn print_json(out: &mut dyn Write, value: &impl serde::Serialize) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    writeln!(out, "{text}")?;
    Ok(())
}

async fn list(
    client: &Client,
    json: bool,
    style: Style,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let allocs: Vec<AllocListItem> = client.get("/v1/allocs").await?;
    if json {
        print_json(out, &allocs)?;
    } else {
        out.write_all(render::alloc_list(style, &allocs).as_bytes())?;
    }
    Ok(EXIT_OK)
}

fn status_path(name: &str) -> String {
    format!("/v1/allocs/{}", encode(name))
}

async fn status(
    client: &Client,
    name: &str,
    json: bool,
    style: Style,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let alloc: AllocStatus = client.get(&status_path(name)).await?;
    // What the tasks use, when the agent measures them; the status shows without it.
    let stats: Option<AllocStats> = if json {
        None
    } else {
        client
            .get(&format!("{}/stats", status_path(name)))
            .await
            .ok()
    };
    show_status(&alloc, stats.as_ref(), json, style, out)?;
    Ok(EXIT_OK)
}

fn show_status(
    alloc: &AllocStatus,
    stats: Option<&AllocStats>,
    json: bool,
    style: Style,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    if json {
        print_json(out, alloc)
    } else {
        out.write_all(render::alloc_status(style, alloc, stats).as_bytes())?;
        Ok(())
    }
}

/// Whether `error` is the agent saying the alloc does not exist.
fn is_not_found(error: &anyhow::Error) -> bool {
    error
        .downcast_ref::<ApiFailure>()
        .is_some_and(|f| f.body.code == "alloc_not_found")
}

async fn watch_status(
    client: &Client,
    name: &str,
    json: bool,
    style: Style,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let mut shown: Option<AllocStatus> = None;
    loop {
        match client.get::<AllocStatus>(&status_path(name)).await {
            Ok(alloc) => {
                if shown.as_ref() != Some(&alloc) {
                    if style.colour && !json {
                        // Redraw in place on a terminal.
                        out.write_all(b"\x1b[H\x1b[2J")?;
                    } else if shown.is_some() {
                        out.write_all(b"\n")?;
                    }
                    show_status(&alloc, None, json, style, out)?;
                    out.flush()?;
                    shown = Some(alloc);
                }
            }
            Err(error) if shown.is_some() && is_not_found(&error) => {
                writeln!(out, "\nalloc {name:?} is gone")?;
                return Ok(EXIT_OK);
            }
            Err(error) => return Err(error),
        }
        tokio::time::sleep(WATCH_INTERVAL).await;
    }
}

/// Which log a `stead alloc logs` reads.
struct LogSource<'a> {
    name: &'a str,
    task: &'a str,
    stderr: bool,
    /// The replaced revision's.
    previous: bool,
}

fn logs_path(source: &LogSource<'_>, follow: bool, origin_end_offset: Option<u64>) -> String {
    let stream = if source.stderr { "stderr" } else { "stdout" };
    let mut path = format!(
        "/v1/allocs/{}/logs/{}?type={stream}&follow={follow}",
        encode(source.name),
        encode(source.task)
    );
    if source.previous {
        path.push_str("&previous=true");
    }
    if let Some(offset) = origin_end_offset {
        path.push_str(&format!("&origin=end&offset={offset}"));
    }
    path
}

/// How many bytes from the end `--tail lines` reads first: 160 a line, at least 4 KiB,
/// at most [`TAIL_LIMIT`] (a count beyond what any log holds asks for the whole log).
fn first_tail_window(lines: usize) -> u64 {
    u64::try_from(lines)
        .unwrap_or(u64::MAX)
        .saturating_mul(160)
        .clamp(4096, TAIL_LIMIT)
}

/// Reads the log back from its end until it holds `lines` lines (or is whole); returns
/// how many bytes from the end that took.
async fn tail_window(
    client: &Client,
    source: &LogSource<'_>,
    lines: usize,
    out: Option<&mut dyn Write>,
) -> anyhow::Result<u64> {
    let mut window = first_tail_window(lines);
    loop {
        let response = client
            .stream(&logs_path(source, false, Some(window)))
            .await?;
        let bytes = response.bytes().await.context("reading the logs")?;
        let (tail, cut) = tail_lines(&bytes, lines);
        let whole = (bytes.len() as u64) < window;
        if cut || whole || window >= TAIL_LIMIT {
            if let Some(out) = out {
                out.write_all(tail)?;
                out.flush()?;
            }
            return Ok(window);
        }
        window = (window * 4).min(TAIL_LIMIT);
    }
}

async fn logs(
    client: &Client,
    source: &LogSource<'_>,
    follow: bool,
    tail: Option<usize>,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    if !follow {
        match tail {
            Some(lines) => {
                tail_window(client, source, lines, Some(out)).await?;
            }
            None => {
                let mut response = client.stream(&logs_path(source, false, None)).await?;
                while let Some(chunk) = response.chunk().await.context("reading the logs")? {
                    out.write_all(&chunk)?;
                }
                out.flush()?;
            }
        }
        return Ok(EXIT_OK);
    }
    // Following: the agent first sends what already exists (its size is in a header),
    // then new output as it is written.
    let window = match tail {
        Some(lines) => Some(tail_window(client, source, lines, None).await?),
        None => None,
    };
    let mut response = client.stream(&logs_path(source, true, window)).await?;
    let mut backlog: u64 = response
        .headers()
        .get(LOG_BACKLOG_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut held = Vec::new();
    let release = |held: &mut Vec<u8>, out: &mut dyn Write| -> std::io::Result<()> {
        let shown = match tail {
            Some(lines) => tail_lines(held, lines).0,
            None => held.as_slice(),
        };
        out.write_all(shown)?;
        held.clear();
        out.flush()
    };
    while let Some(chunk) = response.chunk().await.with_context(|| {
        format!(
            "following the logs from the stead agent at {}",
            client.address()
        )
    })? {
        if backlog > 0 {
            let take = (chunk.len() as u64).min(backlog) as usize;
            held.extend_from_slice(&chunk[..take]);
            backlog -= take as u64;
            if backlog == 0 {
                release(&mut held, out)?;
                out.write_all(&chunk[take..])?;
                out.flush()?;
            }
            continue;
        }
        out.write_all(&chunk)?;
        out.flush()?;
    }
    if !held.is_empty() {
        release(&mut held, out)?;
    }
    Ok(EXIT_OK)
}

async fn restart(
    client: &Client,
    name: &str,
    task: Option<String>,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let request = RestartRequest { task: task.clone() };
    client
        .post(&format!("/v1/allocs/{}/restart", encode(name)), &request)
        .await?;
    match task {
        Some(task) => writeln!(out, "restarting task {task:?} of alloc {name:?}")?,
        None => writeln!(out, "restarting the running tasks of alloc {name:?}")?,
    }
    Ok(EXIT_OK)
}

async fn set_stopped(
    client: &Client,
    name: &str,
    stopped: bool,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let verb = if stopped { "stop" } else { "start" };
    client
        .post(&format!("{}/{verb}", status_path(name)), &())
        .await?;
    if stopped {
        writeln!(
            out,
            "stopping alloc {name:?}; it stays stopped until `stead alloc start {name}`"
        )?;
    } else {
        writeln!(out, "starting alloc {name:?} as its spec says")?;
    }
    Ok(EXIT_OK)
}

async fn gc(
    client: &Client,
    name: Option<&str>,
    json: bool,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let path = match name {
        Some(name) => format!("{}/gc", status_path(name)),
        None => "/v1/gc".to_owned(),
    };
    let result: GcResult = client.post_for(&path).await?;
    if json {
        print_json(out, &result)?;
        return Ok(EXIT_OK);
    }
    if result.collected.is_empty() && result.refused.is_empty() {
        writeln!(
            out,
            "nothing to collect: no terminal alloc is left without a spec"
        )?;
    }
    for collected in &result.collected {
        writeln!(out, "collected alloc {collected:?}")?;
    }
    for refused in &result.refused {
        writeln!(out, "left alloc {:?}: {}", refused.name, refused.reason)?;
    }
    Ok(EXIT_OK)
}

/// `HUP`, `hup` and `SIGHUP` all mean `SIGHUP`.
fn signal_name(signal: &str) -> String {
    let upper = signal.to_ascii_uppercase();
    if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    }
}

async fn send_signal(
    client: &Client,
    name: &str,
    task: &str,
    signal: &str,
    out: &mut dyn Write,
) -> anyhow::Result<u8> {
    let request = SignalRequest {
        task: task.to_owned(),
        signal: signal_name(signal),
    };
    client
        .post(&format!("/v1/allocs/{}/signal", encode(name)), &request)
        .await?;
    writeln!(
        out,
        "sent {} to task {task:?} of alloc {name:?}",
        request.signal
    )?;
    Ok(EXIT_OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_may_be_given_without_the_sig_prefix_in_any_case() {
        assert_eq!(signal_name("hup"), "SIGHUP");
        assert_eq!(signal_name("SIGTERM"), "SIGTERM");
        assert_eq!(signal_name("sigusr1"), "SIGUSR1");
    }

    #[test]
    fn the_first_tail_window_never_overflows_and_stays_within_its_bounds() {
        assert_eq!(first_tail_window(0), 4096);
        assert_eq!(first_tail_window(100), 16_000);
        assert_eq!(first_tail_window(usize::MAX), TAIL_LIMIT);
        assert_eq!(first_tail_window(usize::MAX / 160 + 1), TAIL_LIMIT);
    }
}
