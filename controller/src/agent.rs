//! `stead agent`: configuration, start-up, the specs-directory loop and shutdown.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use stead_reconcilers::alloc::Limits;
use stead_schemas::Timestamp;
use stead_schemas::config::{AgentConfig, ShutdownMode, TokenConfig};
use thiserror::Error;
use tokio::signal::unix::{SignalKind, signal};

use crate::allocdir::AllocDirs;
use crate::api::{
    ApiState, Connections, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_EXECS,
    DEFAULT_MAX_LOG_STREAMS, ServeLimits, bind_tcp, bind_unix, router, serve_tcp, serve_unix,
};
use crate::clock::Clock;
use crate::driver::exec::{ExecDriver, ExecDriverConfig};
use crate::driver::mock::MockDriver;
use crate::driver::{Driver, Drivers};
use crate::gc::GcSettings;
use crate::logging::{LogFormat, init_logging};
use crate::metrics::Metrics;
use crate::node::{DEFAULT_TICK, Node, NodeConfig};
use crate::queue::Shutdown;
use crate::source::{Listing, ListingCache, Syncer, list_specs_cached};
use crate::store::rocks::OpenError;
use crate::store::{RocksDbOptions, RocksDbStore};
use crate::watch::SpecsWatcher;

/// `stead agent` flags; each overrides the config file's key of the same meaning.
#[derive(Debug, Clone, Args)]
pub struct AgentArgs {
    /// The agent config file (YAML).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The directory of alloc specs.
    #[arg(long)]
    pub specs: Option<PathBuf>,
    /// Where state and alloc directories live.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// The API's address.
    #[arg(long)]
    pub listen: Option<String>,
    /// Stop every alloc on exit instead of leaving tasks running.
    #[arg(long)]
    pub drain: bool,
    /// Log format: `text` (the default on a terminal) or `json` (otherwise).
    #[arg(long, value_parser = ["text", "json"])]
    pub log_format: Option<String>,
}

/// The agent's settings after defaults, the config file and flags.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The directory of alloc specs.
    pub specs_dir: PathBuf,
    /// Where state and alloc directories live.
    pub data_dir: PathBuf,
    /// The API's TCP address; `None` (`listen: null`) serves only the unix socket.
    pub listen: Option<String>,
    /// The full re-listing period.
    pub resync: Duration,
    /// Whether file events trigger a listing (besides the resync).
    pub watch: bool,
    /// Garbage collection of terminal allocs.
    pub gc: GcSettings,
    /// Node settings.
    pub node: NodeConfig,
    /// What happens to tasks on exit.
    pub shutdown: Shutdown,
    /// Whether the mock driver runs.
    pub mock_driver: bool,
    /// Whether the exec driver runs.
    pub exec_driver: bool,
    /// Whether exec tasks may run as root.
    pub allow_root: bool,
    /// Whether a task whose limits cannot be enforced fails to start.
    pub limits_required: bool,
    /// The cgroup below the agent's that holds its tasks' cgroups.
    pub cgroup_parent: String,
    /// Also serve the API on this unix socket.
    pub socket: Option<PathBuf>,
    /// What the API requires of a request.
    pub token: ApiAuth,
    /// Log format, when configured.
    pub log_format: Option<stead_schemas::config::LogFormat>,
    /// How the state store is sized and synced.
    pub store: RocksDbOptions,
    /// The API's connection bounds, as configured (the cap is lowered to fit the
    /// descriptor limit at start).
    pub api_limits: ServeLimits,
    /// Log streams the API follows at once.
    pub max_log_streams: usize,
    /// Exec sessions the API runs at once.
    pub max_execs: usize,
    /// The agent's own `oom_score_adj`.
    pub oom_score_adj: i16,
    /// The fleet source, when `fleet.etcd` names a cluster.
    pub fleet: Option<crate::fleet::FleetSettings>,
}

/// What the API requires of a request: a bearer token unless `token: none` says
/// otherwise.
#[derive(Clone, PartialEq, Eq)]
pub enum ApiAuth {
    /// `token` or `tokenFile`: this token. Invariant: not blank.
    Token(String),
    /// Neither: the token in `<dataDir>/api-token`, generated at the first start and
    /// read at every later one ([`API_TOKEN_FILE`]).
    Generated,
    /// `token: none`: nothing, and so only on loopback or the unix socket.
    None,
}

impl ApiAuth {
    /// Which it is, without the secret: `token`, `generated` or `none`.
    pub fn as_str(&self) -> &'static str {
        match self {
            ApiAuth::Token(_) => "token",
            ApiAuth::Generated => "generated",
            ApiAuth::None => "none",
        }
    }
}

/// Never shows the secret.
impl std::fmt::Debug for ApiAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApiAuth::Token(_) => f.write_str("Token(<secret>)"),
            ApiAuth::Generated => f.write_str("Generated"),
            ApiAuth::None => f.write_str("None"),
        }
    }
}

/// The file in the data dir that holds the generated token; the CLI reads it too.
pub const API_TOKEN_FILE: &str = "api-token";

/// The data dir when neither `dataDir` nor `--data-dir` names one.
pub const DEFAULT_DATA_DIR: &str = "./stead-data";

/// The API's address when neither `listen` nor `--listen` names one.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:4750";

/// Why the agent could not start or run.
#[derive(Debug, Error)]
pub enum AgentError {
    /// The config file is unreadable or invalid.
    #[error(transparent)]
    Config(#[from] stead_schemas::config::ConfigError),
    /// The static device plugin's config cannot be used.
    #[error("agent config: {0}")]
    Devices(#[from] crate::devices::StaticPluginError),
    /// A configured Kubernetes device-plugin endpoint cannot be used.
    #[error("agent config: {0}")]
    K8sDevices(#[from] crate::deviceplugin::K8sConfigError),
    /// A directory could not be created.
    #[error("cannot create {}", path.display())]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Another agent holds the data dir.
    #[error("data dir {} is in use by another stead agent", path.display())]
    Locked {
        /// The data dir.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Signal handlers could not be installed.
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    /// The state store could not be opened.
    #[error(transparent)]
    OpenStore(#[from] OpenError),
    /// Reading the store at start-up failed.
    #[error("cannot restore state")]
    Restore(#[source] crate::store::StoreError),
    /// The fleet source cannot run (its config, or a node name another agent holds).
    #[error(transparent)]
    Fleet(#[from] crate::fleet::FleetError),
    /// The API could not be served.
    #[error(transparent)]
    Api(#[from] crate::api::ServeError),
    /// The API's runtime, thread or listeners could not be set up.
    #[error("cannot set up the api's runtime, thread or listeners")]
    Runtime(#[source] std::io::Error),
    /// A token file could not be read.
    #[error("cannot read token file {}", path.display())]
    TokenFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A second SIGTERM or SIGINT ended the shutdown before it was over.
    #[error("a second signal ended the shutdown before it was over")]
    CutShort,
    /// A token file holds no token: the API would require none.
    #[error("token file {} is empty; an agent configured with a token never runs without one", path.display())]
    EmptyTokenFile {
        /// The file.
        path: PathBuf,
    },
    /// `token: none` beside a `tokenFile`: which one is meant is unclear.
    #[error("{}: `token: none` and `tokenFile` contradict each other; remove one", config.display())]
    TokenNoneWithFile {
        /// The config file.
        config: PathBuf,
    },
    /// `listen: null` without a `socket`: the API would be served nowhere.
    #[error("{}: `listen: null` turns the api's tcp listener off, but no `socket` is set, so the api would be served nowhere; set `socket` or a `listen` address", config.display())]
    NoListener {
        /// The config file.
        config: PathBuf,
    },
    /// `token: none` with a TCP listener that is not on loopback.
    #[error(
        "`token: none` serves the api to whoever can connect, so only on loopback or the unix socket, but `listen` is {listen} ({address}); set a loopback `listen` such as 127.0.0.1:4750, `listen: null` to serve only the `socket`, or remove `token: none` to require the token generated in <dataDir>/api-token"
    )]
    OpenApiNotOnLoopback {
        /// The address as configured.
        listen: String,
        /// The address bound.
        address: std::net::SocketAddr,
    },
    /// The generated token's file cannot be created, read or trusted.
    #[error("api token file {}: {problem}", path.display())]
    GeneratedToken {
        /// The file.
        path: PathBuf,
        /// What is wrong and what to do.
        problem: String,
        /// The error behind it, if any.
        #[source]
        source: Option<std::io::Error>,
    },
}

impl Settings {
    /// Defaults, overlaid by the config file, overlaid by flags.
    pub fn resolve(args: &AgentArgs) -> Result<Settings, AgentError> {
        let config = match &args.config {
            Some(path) => AgentConfig::load(path)?,
            None => AgentConfig::default(),
        };
        let defaults = Limits::default();
        let limits = Limits {
            max_kill_timeout: config
                .max_kill_timeout
                .map_or(defaults.max_kill_timeout, |d| d.get()),
            max_events: config
                .max_task_events
                .map_or(defaults.max_events, |n| n as usize),
        };
        let drain = args.drain || config.shutdown == Some(ShutdownMode::Drain);
        let config_path = args.config.clone().unwrap_or_default();
        let token = match (&config.token, &config.token_file) {
            (Some(TokenConfig::None), Some(_)) => {
                return Err(AgentError::TokenNoneWithFile {
                    config: config_path,
                });
            }
            (Some(TokenConfig::None), None) => ApiAuth::None,
            (Some(TokenConfig::Bearer(token)), _) => ApiAuth::Token(token.clone()),
            (None, Some(path)) => {
                let token =
                    std::fs::read_to_string(path).map_err(|source| AgentError::TokenFile {
                        path: path.clone(),
                        source,
                    })?;
                let token = token.trim();
                if token.is_empty() {
                    return Err(AgentError::EmptyTokenFile { path: path.clone() });
                }
                ApiAuth::Token(token.to_owned())
            }
            (None, None) => ApiAuth::Generated,
        };
        // A flag names an address; the key may also be `null`, for no TCP listener.
        let listen = match (&args.listen, &config.listen) {
            (Some(flag), _) => Some(flag.clone()),
            (None, Some(listen)) => listen.clone(),
            (None, None) => Some(DEFAULT_LISTEN.to_owned()),
        };
        if listen.is_none() && config.socket.is_none() {
            return Err(AgentError::NoListener {
                config: config_path,
            });
        }
        // A driver runs unless turned off; the mock driver only when turned on.
        let enabled = |toggle: Option<&stead_schemas::config::DriverToggle>, default| {
            toggle.and_then(|t| t.enabled).unwrap_or(default)
        };
        let drivers = config.drivers.clone().unwrap_or_default();
        let store = config.store.clone().unwrap_or_default();
        let store_defaults = RocksDbOptions::default();
        let store = RocksDbOptions {
            memory_budget: store
                .memory_mb
                .map_or(store_defaults.memory_budget, |mb| (mb as usize) << 20),
            sync: store.sync.unwrap_or(store_defaults.sync),
            dedupe: true,
        };
        let devices = config.devices.clone().unwrap_or_default();
        let mut plugins: Vec<Arc<dyn crate::devices::DevicePlugin>> = Vec::new();
        let declared = devices.static_devices.unwrap_or_default();
        if !declared.is_empty() {
            let interval = devices
                .health_interval
                .map_or(Duration::from_secs(5), |d| d.get());
            plugins.push(Arc::new(crate::devices::StaticPlugin::new(
                declared, interval,
            )?));
        }
        if let Some(k8s) = &devices.k8s {
            let data_dir = args
                .data_dir
                .clone()
                .or_else(|| config.data_dir.clone())
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
            plugins.push(Arc::new(crate::deviceplugin::K8sPlugin::new(
                k8s, &data_dir,
            )?));
        }
        if let Some(nvidia) = &devices.nvidia {
            plugins.push(Arc::new(crate::devices::NvidiaPlugin::new(
                nvidia,
                crate::clock::Clock::system(),
            )));
        }
        let mock_driver = enabled(drivers.mock.as_ref(), false);
        let exec_driver = enabled(drivers.exec.as_ref(), true);
        let api = config.api.clone().unwrap_or_default();
        Ok(Settings {
            specs_dir: args
                .specs
                .clone()
                .or(config.specs_dir)
                .unwrap_or_else(|| PathBuf::from("./specs")),
            data_dir: args
                .data_dir
                .clone()
                .or(config.data_dir)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR)),
            listen,
            resync: config.resync.map_or(Duration::from_secs(20), |d| d.get()),
            watch: config.watch.unwrap_or(true),
            gc: gc_settings(config.gc.as_ref()),
            node: NodeConfig {
                limits,
                tick: config.tick.map_or(DEFAULT_TICK, |d| d.get()),
                seed: None,
                fingerprint_period: Duration::from_secs(15),
                devices: Arc::new(crate::devices::DeviceManager::new(plugins)),
                plant_start_before_terminal: false,
                plant_skip_kill_order: false,
            },
            shutdown: if drain {
                Shutdown::Drain
            } else {
                Shutdown::Detach
            },
            mock_driver,
            exec_driver,
            allow_root: config.allow_root.unwrap_or(false),
            limits_required: config.limits == Some(stead_schemas::config::LimitsMode::Required),
            cgroup_parent: config
                .cgroup_parent
                .unwrap_or_else(|| stead_schemas::config::DEFAULT_CGROUP_PARENT.to_owned()),
            socket: config.socket,
            token,
            log_format: match args.log_format.as_deref() {
                Some("json") => Some(stead_schemas::config::LogFormat::Json),
                Some(_) => Some(stead_schemas::config::LogFormat::Text),
                None => config.log_format,
            },
            store,
            api_limits: ServeLimits {
                header_timeout: api
                    .header_timeout
                    .map_or(DEFAULT_HEADER_TIMEOUT, |d| d.get()),
                max_connections: api
                    .max_connections
                    .map_or(DEFAULT_MAX_CONNECTIONS, |n| (n as usize).max(1)),
            },
            max_log_streams: api
                .max_log_streams
                .map_or(DEFAULT_MAX_LOG_STREAMS, |n| (n as usize).max(1)),
            max_execs: api
                .max_execs
                .map_or(DEFAULT_MAX_EXECS, |n| (n as usize).max(1)),
            oom_score_adj: config.oom_score_adj.unwrap_or(DEFAULT_OOM_SCORE_ADJ),
            fleet: crate::fleet::FleetSettings::resolve(config.fleet.as_ref())?,
        })
    }
}

/// The `gc` keys over Nomad's defaults.
fn gc_settings(config: Option<&stead_schemas::config::GcConfig>) -> GcSettings {
    let defaults = GcSettings::default();
    let Some(config) = config else {
        return defaults;
    };
    GcSettings {
        interval: config.interval.map_or(defaults.interval, |d| d.get()),
        policy: stead_reconcilers::gc::GcPolicy {
            max_allocs: config
                .max_allocs
                .map_or(defaults.policy.max_allocs, |n| n as usize),
            disk_usage_threshold: config
                .disk_usage_threshold
                .map_or(defaults.policy.disk_usage_threshold, |p| p.min(100)),
            parallel_destroys: config
                .parallel_destroys
                .map_or(defaults.policy.parallel_destroys, |n| (n as usize).max(1)),
        },
    }
}

/// Takes the data dir's lock for the life of the process; a second agent is refused.
fn lock_data_dir(data_dir: &Path) -> Result<std::fs::File, AgentError> {
    std::fs::create_dir_all(data_dir).map_err(|source| AgentError::CreateDir {
        path: data_dir.to_owned(),
        source,
    })?;
    let path = data_dir.join("lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|source| AgentError::CreateDir {
            path: path.clone(),
            source,
        })?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(
        |errno| AgentError::Locked {
            path: data_dir.to_owned(),
            source: errno.into(),
        },
    )?;
    Ok(file)
}

/// `stead agent`: resolves the settings, sets up logging and runs the agent until
/// SIGINT or SIGTERM.
pub fn main(args: &AgentArgs) -> anyhow::Result<u8> {
    let settings = Settings::resolve(args)?;
    let format = match settings.log_format {
        Some(stead_schemas::config::LogFormat::Json) => LogFormat::Json,
        Some(stead_schemas::config::LogFormat::Text) => LogFormat::Text,
        None => LogFormat::detect(),
    };
    init_logging(format)?;
    // Held until the process exits, after the runtime's last work (a shutdown cut short
    // gives it a moment): no second agent may take the data dir over before then.
    let _lock = lock_data_dir(&settings.data_dir)?;
    let task_open_files = raise_open_files_limit();
    let mut settings = settings;
    settings.api_limits.max_connections = fit_connections(
        settings.api_limits.max_connections,
        settings.max_log_streams + EXEC_DESCRIPTORS * settings.max_execs,
        rustix::process::getrlimit(rustix::process::Resource::Nofile).current,
    );
    warn_of_a_low_pid_max(
        settings.api_limits.max_connections
            + settings.max_log_streams
            + EXEC_DESCRIPTORS * settings.max_execs,
    );
    let task_oom_score_adj = lower_oom_score_adj(settings.oom_score_adj);
    // Tasks get absolute paths, whatever the agent's working directory.
    let data_dir =
        std::fs::canonicalize(&settings.data_dir).map_err(|source| AgentError::CreateDir {
            path: settings.data_dir.clone(),
            source,
        })?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let outcome = runtime.block_on(async {
        let inherited = Inherited {
            open_files: task_open_files,
            oom_score_adj: task_oom_score_adj,
        };
        let agent = Agent::start(settings, Clock::system(), data_dir, inherited).await?;
        agent.run().await
    });
    match outcome {
        Ok(()) => Ok(0),
        Err(AgentError::CutShort) => {
            // Prompt exit: work still on the runtime's blocking threads (a store write, an
            // alloc dir's removal) gets a moment, not a wait without bound.
            runtime.shutdown_timeout(CUT_SHORT_GRACE);
            Err(AgentError::CutShort.into())
        }
        Err(error) => Err(error.into()),
    }
}

/// How long a shutdown ended by a second signal waits for the API's thread to stop, then
/// for blocking work in flight.
const CUT_SHORT_GRACE: Duration = Duration::from_secs(1);

/// The API's listeners, bound before anything starts so that a taken port or a file in
/// the socket's way fails the agent at once; they are served later ([`start_api`]).
/// At least one is set.
struct ApiListeners {
    tcp: Option<std::net::TcpListener>,
    unix: Option<std::os::unix::net::UnixListener>,
}

/// Binds the API's listeners: TCP unless `listen` is `None`, and the unix socket when
/// configured. With `token: none` ([`ApiAuth::None`]) a TCP address that is not
/// loopback is refused: checked on the address bound, so a host name counts for what
/// it resolved to.
async fn bind_api(
    listen: Option<&str>,
    socket: Option<&Path>,
    auth: &ApiAuth,
) -> Result<ApiListeners, AgentError> {
    let tcp = match listen {
        Some(listen) => {
            let tcp = bind_tcp(listen).await?;
            let address = tcp.local_addr().map_err(AgentError::Runtime)?;
            if *auth == ApiAuth::None && !address.ip().is_loopback() {
                return Err(AgentError::OpenApiNotOnLoopback {
                    listen: listen.to_owned(),
                    address,
                });
            }
            Some(tcp)
        }
        None => None,
    };
    let unix = socket.map(bind_unix).transpose()?;
    // Handed to the API's own runtime, which registers them again.
    Ok(ApiListeners {
        tcp: tcp
            .map(tokio::net::TcpListener::into_std)
            .transpose()
            .map_err(AgentError::Runtime)?,
        unix: unix
            .map(tokio::net::UnixListener::into_std)
            .transpose()
            .map_err(AgentError::Runtime)?,
    })
}

/// The token the API requires: the configured one, none, or the one generated into
/// `<data_dir>/api-token` at the first start and read at every later one.
fn api_token(auth: &ApiAuth, data_dir: &Path) -> Result<Option<String>, AgentError> {
    match auth {
        ApiAuth::Token(token) => Ok(Some(token.clone())),
        ApiAuth::None => Ok(None),
        ApiAuth::Generated => {
            let path = data_dir.join(API_TOKEN_FILE);
            match read_generated_token(&path)? {
                Some(token) => Ok(Some(token)),
                None => {
                    let token = generate_token(&path)?;
                    tracing::info!(path = %path.display(), "api token generated");
                    Ok(Some(token))
                }
            }
        }
    }
}

/// The generated token at `path`, or `None` when there is no file. A file the agent
/// cannot trust (not a regular file, another user's, readable by others) or that holds
/// no token is refused with what to do, never replaced: a client may hold its token.
fn read_generated_token(path: &Path) -> Result<Option<String>, AgentError> {
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    let refuse = |problem: String, source: Option<std::io::Error>| AgentError::GeneratedToken {
        path: path.to_owned(),
        problem,
        source,
    };
    let flags =
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::CLOEXEC;
    let file = match rustix::fs::open(path, flags, rustix::fs::Mode::empty()) {
        Ok(fd) => std::fs::File::from(fd),
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(rustix::io::Errno::LOOP) => {
            return Err(refuse(
                "is a symbolic link; remove it, and the agent makes a new token".to_owned(),
                None,
            ));
        }
        Err(errno) => return Err(refuse("cannot be read".to_owned(), Some(errno.into()))),
    };
    let meta = file
        .metadata()
        .map_err(|source| refuse("cannot be read".to_owned(), Some(source)))?;
    let uid = rustix::process::geteuid().as_raw();
    let mode = meta.permissions().mode() & 0o7777;
    if !meta.is_file() {
        return Err(refuse(
            "is not a regular file; remove it, and the agent makes a new token".to_owned(),
            None,
        ));
    }
    if meta.uid() != uid {
        return Err(refuse(
            format!(
                "belongs to uid {}, not the agent's uid {uid}; remove it for a new token, or `chown` it to keep this one",
                meta.uid()
            ),
            None,
        ));
    }
    if mode & 0o077 != 0 {
        return Err(refuse(
            format!(
                "has mode {mode:04o}, so users other than the agent's may have read the token; remove it for a new token, or `chmod 600` it to keep this one"
            ),
            None,
        ));
    }
    let mut text = String::new();
    file.take(MAX_TOKEN_BYTES)
        .read_to_string(&mut text)
        .map_err(|source| refuse("cannot be read".to_owned(), Some(source)))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(refuse(
            "is empty, and an agent never runs without a token unless `token: none` says so; remove it, and the agent makes a new token".to_owned(),
            None,
        ));
    }
    Ok(Some(token.to_owned()))
}

/// The most of a token file read.
const MAX_TOKEN_BYTES: u64 = 4096;

/// Makes a new token at `path`: 32 bytes from the kernel's random source
/// (`getrandom(2)`), hex-encoded. It is written under a temporary name, created with
/// mode 0600 (the umask only takes bits away), synced, then renamed into place: no one
/// but the agent's user can read it at any moment, and a crash leaves no half-written
/// token. The data dir's lock keeps a second agent from doing the same at once.
fn generate_token(path: &Path) -> Result<String, AgentError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;

    let fail = |source: std::io::Error| AgentError::GeneratedToken {
        path: path.to_owned(),
        problem: "cannot be created".to_owned(),
        source: Some(source),
    };
    let mut bytes = [0u8; 32];
    let mut filled = 0;
    while filled < bytes.len() {
        match rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(read) => filled += read,
            Err(rustix::io::Errno::INTR) => {}
            Err(errno) => return Err(fail(errno.into())),
        }
    }
    let token: String = bytes.iter().map(|byte| format!("{byte:02x}")).collect();
    let temporary = path.with_file_name(format!(".{API_TOKEN_FILE}.{}.tmp", std::process::id()));
    // A leftover of a crashed earlier attempt with our pid; nothing else uses the name.
    let _ = std::fs::remove_file(&temporary);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&temporary)
        .and_then(|mut file| {
            file.write_all(format!("{token}\n").as_bytes())?;
            file.sync_all()
        })
        .and_then(|()| std::fs::rename(&temporary, path));
    if let Err(error) = written {
        let _ = std::fs::remove_file(&temporary);
        return Err(fail(error));
    }
    // The rename itself survives a power loss once the directory is synced.
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|dir| dir.sync_all())
            .map_err(fail)?;
    }
    Ok(token)
}

/// Serves the API on `listeners`, on a thread and runtime of its own, so requests never
/// queue behind the workers (measured with `stead-bench api`).
fn start_api(
    state: ApiState,
    listeners: ApiListeners,
    connections: Connections,
) -> Result<std::thread::JoinHandle<()>, AgentError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(AgentError::Runtime)?;
    std::thread::Builder::new()
        .name("stead-api".to_owned())
        .spawn(move || {
            runtime.block_on(async move {
                let registered = listeners.tcp.map(tokio::net::TcpListener::from_std).transpose().and_then(|tcp| {
                    let unix = listeners.unix.map(tokio::net::UnixListener::from_std).transpose()?;
                    Ok((tcp, unix))
                });
                let (tcp, unix) = match registered {
                    Ok(listeners) => listeners,
                    Err(error) => {
                        tracing::error!(error = %crate::errors::error_chain(&error), "api not served");
                        return;
                    }
                };
                let app = router(state.clone());
                let stop = state.shutdown_token();
                let tcp_server = async {
                    match tcp {
                        Some(tcp) => {
                            serve_tcp(tcp, app.clone(), connections.clone(), stop.clone().cancelled_owned()).await
                        }
                        None => Ok(()),
                    }
                };
                let unix_server = async {
                    match unix {
                        Some(unix) => {
                            serve_unix(unix, app.clone(), connections.clone(), stop.clone().cancelled_owned()).await
                        }
                        None => Ok(()),
                    }
                };
                let (a, b) = tokio::join!(tcp_server, unix_server);
                for result in [a, b] {
                    if let Err(error) = result {
                        tracing::error!(error = %crate::errors::error_chain(&error), "api stopped");
                    }
                }
            });
        })
        .map_err(AgentError::Runtime)
}

/// The soft limit of open files raised to the hard one: the agent holds a pipe or a pidfd
/// per task, a socket per API client and the store's files, and a host's default soft
/// limit (1024) is below what a node of a few thousand tasks needs. Returns the soft
/// limit it had, which supervisors and tasks keep; `None` when nothing changed.
fn raise_open_files_limit() -> Option<u64> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let soft = limit.current?;
    if limit.maximum.is_some_and(|hard| hard <= soft) {
        return None;
    }
    let raised = Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => Some(soft),
        Err(error) => {
            tracing::warn!(%error, soft, "cannot raise the limit of open files");
            None
        }
    }
}

/// The agent's own `oom_score_adj` unless configured: low, so the kernel's OOM killer
/// takes a task first (the kubelet and containerd set -999 for themselves), above -1000,
/// which would exempt the agent entirely.
const DEFAULT_OOM_SCORE_ADJ: i16 = -900;

/// Descriptors kept for everything but the API's connections and followed logs: the
/// store (RocksDB keeps at most 64 table files open, plus its log and lock files), the
/// specs dir's listing and watcher, the fork server's socket, device health files.
const DESCRIPTOR_RESERVE: u64 = 256;

/// Descriptors one exec session holds besides its connection: a pipe or terminal for each
/// of its three streams, and its process's pidfd.
const EXEC_DESCRIPTORS: usize = 4;

/// The API's connection cap lowered, if need be, so that connections, followed log
/// streams (and exec sessions' streams, counted with them) and [`DESCRIPTOR_RESERVE`] fit under the soft limit of open files `soft`
/// (`None`: unlimited); never below 16. Says so when it lowers it.
fn fit_connections(configured: usize, log_streams: usize, soft: Option<u64>) -> usize {
    let Some(soft) = soft else {
        return configured;
    };
    let budget = soft
        .saturating_sub(DESCRIPTOR_RESERVE)
        .saturating_sub(log_streams as u64)
        .max(16);
    let fitted = usize::try_from(budget).map_or(configured, |budget| configured.min(budget));
    if fitted < configured {
        tracing::warn!(
            configured,
            fitted,
            open_files = soft,
            "api.maxConnections lowered to fit the limit of open files"
        );
    }
    fitted
}

/// Descriptors the agent holds per supervised task: the pipe from its supervisor (a run
/// this agent started) or the supervisor's pidfd (a run it reattached).
const DESCRIPTORS_PER_TASK: u64 = 1;

/// Processes each supervised task takes: its supervisor and the task itself.
const PROCESSES_PER_TASK: u64 = 2;

/// The tasks the limit of open files `soft` lets the agent supervise, `api` descriptors
/// going to the API's connections, log streams and exec sessions, when the kernel's
/// `pid_max` cannot hold their processes; `None` when it can (or the limit is unknown).
fn tasks_beyond_pid_max(pid_max: u64, soft: Option<u64>, api: u64) -> Option<u64> {
    let tasks = soft?.saturating_sub(DESCRIPTOR_RESERVE).saturating_sub(api) / DESCRIPTORS_PER_TASK;
    (pid_max < PROCESSES_PER_TASK.saturating_mul(tasks)).then_some(tasks)
}

/// Warns when `kernel.pid_max` is below twice the tasks the limit of open files allows:
/// each task is a supervisor and the task, and a full pid space fails starts and forks
/// inside tasks alike. Nothing is changed; the operator raises `kernel.pid_max`.
fn warn_of_a_low_pid_max(api_descriptors: usize) {
    const PATH: &str = "/proc/sys/kernel/pid_max";
    let Some(pid_max) = std::fs::read_to_string(PATH)
        .ok()
        .and_then(|text| text.trim().parse::<u64>().ok())
    else {
        return;
    };
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
    if let Some(tasks) = tasks_beyond_pid_max(pid_max, soft, api_descriptors as u64) {
        tracing::warn!(
            pid_max,
            tasks,
            "kernel.pid_max is below twice the tasks the limit of open files allows (a supervisor and a task each): raise it to run that many"
        );
    }
}

/// Sets the agent's own `oom_score_adj` to `adj`, so the kernel's OOM killer picks a
/// task before the agent; returns the value it had, which supervisors, tasks and exec
/// checks get back (`None` when nothing changed). Lowering it needs `CAP_SYS_RESOURCE`:
/// without it the agent says so and goes on.
fn lower_oom_score_adj(adj: i16) -> Option<i16> {
    const PATH: &str = "/proc/self/oom_score_adj";
    let before = std::fs::read_to_string(PATH)
        .ok()
        .and_then(|text| text.trim().parse::<i16>().ok());
    let Some(before) = before else {
        tracing::warn!(
            path = PATH,
            "cannot read the agent's oom_score_adj; leaving it"
        );
        return None;
    };
    if before == adj {
        return None;
    }
    match std::fs::write(PATH, adj.to_string()) {
        Ok(()) => {
            tracing::info!(oom_score_adj = adj, tasks = before, "oom_score_adj set");
            Some(before)
        }
        Err(error) => {
            tracing::warn!(%error, oom_score_adj = adj, "cannot set the agent's oom_score_adj");
            None
        }
    }
}

/// What supervisors and tasks get back from before the agent changed it for itself.
#[derive(Debug, Clone, Copy, Default)]
struct Inherited {
    /// The soft limit of open files.
    open_files: Option<u64>,
    /// The `oom_score_adj`.
    oom_score_adj: Option<i16>,
}

/// What wakes the specs loop for a listing of the specs dir.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trigger {
    /// Start-up's first listing, before the API serves.
    Start,
    /// A file event in the specs dir (or a watcher (re)started, which may have missed one).
    Watch,
    /// The periodic full re-listing.
    Resync,
    /// SIGHUP: `systemctl reload`, a habitual `kill -HUP`.
    Hangup,
    /// A change of the fleet's desired keys in etcd.
    Fleet,
}

impl Trigger {
    /// The name logged with what the listing applied.
    fn as_str(self) -> &'static str {
        match self {
            Trigger::Start => "start",
            Trigger::Watch => "watch",
            Trigger::Resync => "resync",
            Trigger::Hangup => "hangup",
            Trigger::Fleet => "fleet",
        }
    }
}

/// The signals the agent takes: SIGTERM and SIGINT end it, SIGHUP lists the specs dir.
struct Signals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Self, AgentError> {
        let install = |kind| signal(kind).map_err(AgentError::Signals);
        Ok(Signals {
            terminate: install(SignalKind::terminate())?,
            interrupt: install(SignalKind::interrupt())?,
            hangup: install(SignalKind::hangup())?,
        })
    }

    /// The next SIGHUP (true) or SIGTERM or SIGINT (false).
    async fn next_is_hangup(&mut self) -> bool {
        tokio::select! {
            _ = self.hangup.recv() => true,
            _ = self.terminate.recv() => false,
            _ = self.interrupt.recv() => false,
        }
    }

    /// Returns at the next SIGTERM or SIGINT.
    async fn stop(&mut self) {
        tokio::select! {
            _ = self.terminate.recv() => {}
            _ = self.interrupt.recv() => {}
        }
    }
}

/// A started agent: its state restored, its node running what the store held, its API
/// serving.
struct Agent {
    settings: Settings,
    clock: Clock,
    data_dir: PathBuf,
    node: Arc<Node>,
    source: SpecsSource,
    signals: Signals,
    notifier: Option<crate::sdnotify::Notifier>,
    /// The API's thread.
    api: std::thread::JoinHandle<()>,
    stop_api: tokio_util::sync::CancellationToken,
    /// A SIGTERM or SIGINT came during start-up's first listing.
    stop_requested: bool,
    /// The fleet source, when configured.
    fleet: Option<crate::fleet::Fleet>,
}

/// The specs dir as the node's source of desired state: what the node was last told,
/// and the parses of the last listing, reused for files unchanged since.
struct SpecsSource {
    dir: PathBuf,
    clock: Clock,
    syncer: Syncer,
    /// Taken by the pass that runs; lost with a pass that never ends.
    cache: ListingCache,
    /// A pass that overran [`LISTING_DEADLINE`]: waited for again before another starts.
    overdue: Option<tokio::sync::oneshot::Receiver<(Listing, ListingCache)>>,
    /// The diagnostics of the last listing, logged once when they appeared.
    logged: std::collections::BTreeSet<String>,
    /// The fleet's desired keys, added after the specs dir's.
    fleet: Option<FleetFeed>,
}

/// The fleet's desired keys as the specs loop takes them.
struct FleetFeed {
    keys: crate::fleet::FleetKeys,
    node: crate::fleet::FleetNode,
    desired: tokio::sync::watch::Receiver<Option<Arc<crate::fleet::FleetDesired>>>,
}

/// How long the loop waits for one listing of the specs dir (on a thread of its own)
/// before it reports the source degraded and goes on; a pass that overruns is waited
/// for again at the next trigger instead of starting another.
const LISTING_DEADLINE: Duration = Duration::from_secs(30);

impl SpecsSource {
    fn new(dir: PathBuf, clock: Clock, syncer: Syncer) -> Self {
        SpecsSource {
            dir,
            clock,
            syncer,
            cache: ListingCache::default(),
            overdue: None,
            logged: std::collections::BTreeSet::new(),
            fleet: None,
        }
    }

    /// Lists the specs dir once and tells `node` what changed. The listing runs on a
    /// thread of its own, never on the runtime: a read that never returns (a hung
    /// network mount) costs that thread, not the agent, and the caller may drop this
    /// future (at a signal) at any point.
    async fn list(&mut self, node: &Node, trigger: Trigger) {
        let mut pass = match self.overdue.take() {
            Some(pass) => pass,
            None => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let dir = self.dir.clone();
                let now = self.clock.now();
                let taken = std::mem::take(&mut self.cache);
                let spawned = std::thread::Builder::new()
                    .name("stead-specs".to_owned())
                    .spawn(move || {
                        let _ = tx.send(list_pass(&dir, taken, now));
                    });
                if let Err(error) = spawned {
                    tracing::warn!(%error, "cannot start a listing of the specs dir");
                    return;
                }
                rx
            }
        };
        let (listing, kept) = match tokio::time::timeout(LISTING_DEADLINE, &mut pass).await {
            Ok(Ok(done)) => done,
            // A panicked pass loses the cache: the next pass reads everything again.
            Ok(Err(_)) => return,
            Err(_) => {
                let entry = format!(
                    "{}: a listing has not finished after {}s",
                    self.dir.display(),
                    LISTING_DEADLINE.as_secs()
                );
                tracing::warn!("{entry}; applying nothing until it does");
                node.set_source_unreadable(vec![entry]);
                node.set_declared_allocs(None);
                self.overdue = Some(pass);
                return;
            }
        };
        self.cache = kept;
        let mut listing = listing;
        if let Some(fleet) = &self.fleet {
            let desired = fleet.desired.borrow().clone();
            listing.add_fleet(desired.as_deref(), &fleet.keys, &fleet.node);
        }
        node.set_source_unreadable(
            listing
                .unreadable
                .iter()
                .map(|(path, why)| format!("{}: {why}", path.display()))
                .collect(),
        );
        self.log_diagnostics(&listing);
        // What garbage collection must leave alone: every name the dir declares, valid or
        // not; nothing can be told while an entry cannot be read.
        let complete = !listing.incomplete() && listing.unnamed.is_empty();
        node.set_declared_allocs(complete.then(|| {
            listing
                .specs
                .keys()
                .chain(listing.broken.keys())
                .chain(listing.conflicts.keys())
                .map(ToString::to_string)
                .collect()
        }));
        let report = self.syncer.sync(node, &listing);
        let trigger = trigger.as_str();
        for name in &report.applied {
            let revision = listing
                .specs
                .get(name)
                .map(|(_, spec)| spec.revision.short());
            match report.replaced.get(name) {
                Some(before) => {
                    tracing::info!(alloc = %name, trigger, revision, replaces = before.short(), "applied");
                }
                None => tracing::info!(alloc = %name, trigger, revision, "applied"),
            }
        }
        for name in &report.removed {
            tracing::info!(alloc = %name, trigger, reason = "its spec is gone", "removed");
        }
    }

    /// Logs each problem of `listing` once, when it appears (not at every pass), and
    /// says when one is gone.
    fn log_diagnostics(&mut self, listing: &Listing) {
        let now: std::collections::BTreeSet<String> = listing
            .diagnostics
            .iter()
            .map(ToString::to_string)
            .collect();
        for diagnostic in &listing.diagnostics {
            let text = diagnostic.to_string();
            if !self.logged.contains(&text) {
                tracing::warn!("{text}");
            }
        }
        for gone in self.logged.difference(&now) {
            tracing::info!(diagnostic = %gone, "spec problem gone");
        }
        self.logged = now;
    }
}

impl Agent {
    /// Start-up (the caller holds the data dir's lock): signals, the API's listeners,
    /// the drivers, the store (opened, or created, before anything starts), the node
    /// restored from it, and the API served. `data_dir` is the data dir's absolute path.
    async fn start(
        settings: Settings,
        clock: Clock,
        data_dir: PathBuf,
        inherited: Inherited,
    ) -> Result<Agent, AgentError> {
        // systemd's notification socket; the watchdog pings start now, readiness comes
        // once the agent serves.
        let notifier = crate::sdnotify::start();
        // Before any task can start: from then on SIGTERM and SIGINT must reach the
        // shutdown, and a taken port must fail the agent before there is anything to stop.
        let mut signals = Signals::install()?;
        let listeners = bind_api(
            settings.listen.as_deref(),
            settings.socket.as_deref(),
            &settings.token,
        )
        .await?;
        let token = api_token(&settings.token, &data_dir)?;
        let mut drivers: Vec<Arc<dyn Driver>> = Vec::new();
        if settings.mock_driver {
            drivers.push(Arc::new(MockDriver::new(clock)));
        }
        if settings.exec_driver {
            let config = ExecDriverConfig {
                allow_root: settings.allow_root,
                task_open_files: inherited.open_files,
                task_oom_score_adj: inherited.oom_score_adj,
                limits_required: settings.limits_required,
                cgroup_parent: settings.cgroup_parent.clone(),
                reserved_open_files: Some(
                    DESCRIPTOR_RESERVE
                        + (settings.api_limits.max_connections
                            + settings.max_log_streams
                            + EXEC_DESCRIPTORS * settings.max_execs)
                            as u64,
                ),
                ..ExecDriverConfig::new(&data_dir)
            };
            let exec = Arc::new(ExecDriver::new(config, clock));
            exec.prepare();
            drivers.push(exec);
        }
        let drivers = Drivers::new(drivers);
        let state_dir = data_dir.join("state");
        make_private_dir(&state_dir);
        let store = RocksDbStore::open(&state_dir, settings.store)?;
        let recovered = store.recovered().map(str::to_owned);
        tracing::info!(dir = %state_dir.display(), "state store opened");
        let node = Arc::new(Node::with_alloc_dirs(
            settings.node.clone(),
            drivers.clone(),
            Arc::new(store),
            clock,
            AllocDirs::new(&data_dir),
        ));
        if let Some(lost) = recovered {
            node.report_store_loss(lost);
        }
        let restored = node.restore().map_err(AgentError::Restore)?;
        for corrupt in &restored.corrupt {
            tracing::error!(alloc = %corrupt.name, error = %crate::errors::error_chain(corrupt), "cannot restore alloc");
        }
        let mut source = SpecsSource::new(
            settings.specs_dir.clone(),
            clock,
            Syncer::new(restored.allocs),
        );
        // The fleet's last listing (kept in the data dir) joins the first pass; a node
        // name another agent holds fails the start here, before anything is applied.
        let fleet = match settings.fleet.clone() {
            Some(fleet_settings) => {
                let fleet = match crate::fleet::Fleet::start(
                    fleet_settings,
                    node.clone(),
                    clock,
                    &data_dir,
                )
                .await
                {
                    Ok(fleet) => fleet,
                    Err(error) => {
                        node.shutdown(Shutdown::Detach).await;
                        return Err(error.into());
                    }
                };
                source.fleet = Some(FleetFeed {
                    keys: fleet.settings().keys.clone(),
                    node: fleet.settings().node.clone(),
                    desired: fleet.desired(),
                });
                Some(fleet)
            }
            None => None,
        };
        // Nothing is removed before this first full listing.
        // A SIGTERM or SIGINT meanwhile ends the agent as soon as it has started.
        let stop_requested = tokio::select! {
            () = source.list(&node, Trigger::Start) => false,
            () = signals.stop() => true,
        };
        let state = ApiState::new(node.clone(), drivers, data_dir.clone())
            .with_token(token)
            .with_metrics(Metrics::new())
            .with_max_log_streams(settings.max_log_streams)
            .with_max_execs(settings.max_execs);
        let stop_api = state.shutdown_token();
        let connections = Connections::new(settings.api_limits);
        let api = match start_api(state, listeners, connections) {
            Ok(api) => api,
            Err(error) => {
                // What the listing started is recorded and left running for the next
                // agent, as at any detach.
                node.shutdown(Shutdown::Detach).await;
                return Err(error);
            }
        };
        tracing::info!(
            listen = settings.listen.as_deref().unwrap_or("off"),
            socket = settings.socket.as_ref().map(|s| s.display().to_string()),
            token = settings.token.as_str(),
            "api listening"
        );
        tracing::info!(specs = %settings.specs_dir.display(), data = %settings.data_dir.display(), watch = settings.watch, "agent started");
        // Ready for systemd (`Type=notify`): state restored, the specs taken up, the API
        // serving.
        crate::sdnotify::notify(notifier.as_ref(), crate::sdnotify::READY);
        Ok(Agent {
            settings,
            clock,
            data_dir,
            node,
            source,
            signals,
            notifier,
            api,
            stop_api,
            stop_requested,
            fleet,
        })
    }

    /// Runs the specs loop until SIGINT or SIGTERM, then shuts down (detach or drain); a
    /// second SIGINT or SIGTERM during the shutdown ends it at once with
    /// [`AgentError::CutShort`].
    async fn run(mut self) -> Result<(), AgentError> {
        if !self.stop_requested {
            self.specs_loop().await;
        }
        self.shutdown().await
    }

    /// Lists the specs dir at every trigger and brings the node in line, until SIGINT or
    /// SIGTERM; the watcher and GC end with it.
    async fn specs_loop(&mut self) {
        let changed = Arc::new(tokio::sync::Notify::new());
        // The first listing was start-up's: the next resync is a period away.
        let period = self.settings.resync;
        let mut resync = tokio::time::interval_at(self.clock.instant() + period, period);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut watcher: Option<SpecsWatcher> = None;
        let mut fleet_changes = self.source.fleet.as_ref().map(|f| f.desired.clone());
        // Garbage collection starts after the first full listing: an alloc restored as
        // removed whose file came back while the agent was away is declared again first.
        let gc = tokio::spawn(crate::gc::run(
            self.node.clone(),
            self.settings.gc,
            self.data_dir.clone(),
        ));
        loop {
            let settings = &self.settings;
            // (Re)start the watcher before listing, so no change falls between the two:
            // when there is none (a directory that cannot be watched yet is tried again at
            // the next resync), and when the directory at the path is not the one watched
            // (replaced). What was listed before this watcher may have missed a change:
            // it asks for one more listing, under it.
            if settings.watch
                && watcher
                    .as_ref()
                    .is_none_or(|w| !w.watches(&settings.specs_dir))
            {
                let replaced = watcher.take().is_some();
                watcher = start_watcher(&settings.specs_dir, &changed);
                if replaced || watcher.is_some() {
                    changed.notify_one();
                }
            }
            let trigger = tokio::select! {
                _ = resync.tick() => Trigger::Resync,
                () = changed.notified() => Trigger::Watch,
                () = fleet_changed(&mut fleet_changes) => Trigger::Fleet,
                hangup = self.signals.next_is_hangup() => match hangup {
                    true => Trigger::Hangup,
                    false => break,
                },
            };
            if trigger == Trigger::Watch {
                // Let the burst settle (an editor's save is several events), then list
                // once: the listing below comes after every event of the burst, so their
                // wake-ups are spent; an event during the listing wakes the loop again.
                tokio::time::sleep(crate::watch::DEBOUNCE).await;
                let _ = tokio::time::timeout(Duration::ZERO, changed.notified()).await;
            }
            // A listing never holds up SIGTERM or SIGINT.
            tokio::select! {
                () = self.source.list(&self.node, trigger) => {}
                () = self.signals.stop() => break,
            }
        }
        gc.abort();
    }

    /// Shuts the node down as configured while the API keeps serving (operators can
    /// watch a drain), then stops the API.
    async fn shutdown(mut self) -> Result<(), AgentError> {
        let mode = self.settings.shutdown;
        tracing::info!(?mode, "shutting down");
        crate::sdnotify::notify(self.notifier.as_ref(), crate::sdnotify::STOPPING);
        // A second SIGTERM or SIGINT ends the shutdown at once, as it ends Nomad's agent:
        // what the drain has not stopped yet is left as it is (every step of a worker is
        // stored as it happens), and the next agent reattaches it.
        let cut_short = tokio::select! {
            () = self.node.shutdown(mode) => false,
            () = self.signals.stop() => true,
        };
        if let Some(fleet) = self.fleet.take() {
            fleet.stop().await;
        }
        self.stop_api.cancel();
        if cut_short {
            tracing::warn!(
                ?mode,
                "a second signal ended the shutdown; tasks it had not stopped are left as they are for the next agent"
            );
        }
        // The API's thread holds the node, and so the store, which must be closed before
        // the process exits (RocksDB's threads must not outlive its static state).
        let api = self.api;
        let joined = tokio::task::spawn_blocking(move || api.join());
        if cut_short {
            if tokio::time::timeout(CUT_SHORT_GRACE, joined).await.is_err() {
                tracing::warn!(grace = ?CUT_SHORT_GRACE, "the API did not stop in time; exiting without waiting for it");
            }
            return Err(AgentError::CutShort);
        }
        let _ = joined.await;
        Ok(())
    }
}

/// Returns when the fleet's desired keys changed; never without a fleet (or once its
/// source is gone).
async fn fleet_changed(
    changes: &mut Option<tokio::sync::watch::Receiver<Option<Arc<crate::fleet::FleetDesired>>>>,
) {
    if let Some(receiver) = changes
        && receiver.changed().await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// Makes `dir` with the agent's access alone when it is missing (the records hold the
/// specs, their environments included); one that cannot be made is left to the store's
/// open to report.
fn make_private_dir(dir: &Path) {
    use std::os::unix::fs::DirBuilderExt;
    let _ = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir);
    keep_private(dir);
}

/// Takes group and other access away from `dir` (one an earlier agent made with the
/// umask's mode), saying so; a dir that cannot be read or changed is left to the store's
/// open to report.
fn keep_private(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(metadata) = std::fs::metadata(dir) else {
        return;
    };
    let mode = metadata.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        match std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & 0o700)) {
            Ok(()) => {
                tracing::info!(dir = %dir.display(), from = format!("{mode:o}"), "made the state dir private")
            }
            Err(error) => {
                tracing::warn!(dir = %dir.display(), %error, "cannot make the state dir private")
            }
        }
    }
}

/// One listing of the specs dir with `cache`; the listing and the cache for the next.
fn list_pass(dir: &Path, mut cache: ListingCache, now: Timestamp) -> (Listing, ListingCache) {
    let listing = list_specs_cached(dir, &mut cache, now);
    (listing, cache)
}

/// Watches `dir`, or logs why it cannot (the resync still lists it).
fn start_watcher(dir: &Path, changed: &Arc<tokio::sync::Notify>) -> Option<SpecsWatcher> {
    match SpecsWatcher::start(dir, changed.clone()) {
        Ok(watcher) => Some(watcher),
        Err(error) => {
            tracing::warn!(error = %crate::errors::error_chain(&error), "specs dir not watched; relying on resync");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(config: Option<PathBuf>) -> AgentArgs {
        AgentArgs {
            config,
            specs: None,
            data_dir: None,
            listen: None,
            drain: false,
            log_format: None,
        }
    }

    #[test]
    fn a_pid_max_below_twice_the_tasks_the_open_files_allow_is_reported_with_that_count() {
        // 20,000 open files, 1,256 for the reserve and the API: 18,744 tasks, 37,488 pids.
        assert_eq!(
            tasks_beyond_pid_max(32_768, Some(20_000), 1_000),
            Some(18_744)
        );
        assert_eq!(tasks_beyond_pid_max(37_488, Some(20_000), 1_000), None);
        assert_eq!(
            tasks_beyond_pid_max(4_194_304, Some(1_048_576), 1_000),
            None
        );
        assert_eq!(tasks_beyond_pid_max(32_768, None, 1_000), None, "unlimited");
        assert_eq!(
            tasks_beyond_pid_max(300, Some(1_024), 1_000),
            None,
            "none fit"
        );
    }

    #[test]
    fn flags_override_the_config_file_which_overrides_defaults() {
        let dir = std::env::temp_dir().join(format!("stead-agent-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let config = dir.join("agent.yaml");
        std::fs::write(
            &config,
            "listen: 127.0.0.1:9999\nresync: 3s\nshutdown: drain\nmaxTaskEvents: 7\n",
        )
        .expect("write");
        let defaults = Settings::resolve(&args(None)).expect("defaults");
        assert_eq!(defaults.listen.as_deref(), Some("127.0.0.1:4750"));
        assert_eq!(defaults.token, ApiAuth::Generated);
        assert_eq!(defaults.shutdown, Shutdown::Detach);
        let from_file = Settings::resolve(&args(Some(config.clone()))).expect("config");
        assert_eq!(from_file.listen.as_deref(), Some("127.0.0.1:9999"));
        assert_eq!(from_file.resync, Duration::from_secs(3));
        assert_eq!(from_file.shutdown, Shutdown::Drain);
        assert_eq!(from_file.node.limits.max_events, 7);
        let flagged = Settings::resolve(&AgentArgs {
            listen: Some("127.0.0.1:1".to_owned()),
            ..args(Some(config))
        })
        .expect("flags");
        assert_eq!(flagged.listen.as_deref(), Some("127.0.0.1:1"));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn the_mock_driver_runs_only_when_the_config_turns_it_on() {
        let dir = tempfile::tempdir().expect("dir");
        let config = dir.path().join("agent.yaml");
        let defaults = Settings::resolve(&args(None)).expect("defaults");
        assert!(!defaults.mock_driver && defaults.exec_driver);
        std::fs::write(&config, "drivers: {mock: {enabled: true}}\n").expect("write");
        let settings = Settings::resolve(&args(Some(config))).expect("config");
        assert!(settings.mock_driver && settings.exec_driver);
    }

    #[test]
    fn the_connection_cap_leaves_room_for_log_streams_and_the_reserve_under_the_open_files_limit() {
        // (configured cap, log streams, soft limit) -> cap
        let table = [
            (512, 256, Some(1 << 20), 512),
            (512, 256, None, 512),
            (512, 256, Some(1024), 512),
            (512, 256, Some(800), 800 - 256 - 256),
            (512, 256, Some(100), 16),
        ];
        for (configured, streams, soft, expected) in table {
            assert_eq!(
                fit_connections(configured, streams, soft),
                expected,
                "{configured} {streams} {soft:?}"
            );
        }
    }

    #[test]
    fn an_empty_token_file_refuses_to_start_rather_than_serve_without_a_token() {
        let dir = tempfile::tempdir().expect("dir");
        let (config, token) = (dir.path().join("agent.yaml"), dir.path().join("token"));
        std::fs::write(&config, format!("tokenFile: {}\n", token.display())).expect("write");
        std::fs::write(&token, " \n").expect("write");
        let error = Settings::resolve(&args(Some(config.clone()))).expect_err("refused");
        assert_eq!(
            error.to_string(),
            format!(
                "token file {} is empty; an agent configured with a token never runs without one",
                token.display()
            )
        );
        std::fs::write(&token, "s3cret\n").expect("write");
        let settings = Settings::resolve(&args(Some(config))).expect("a token");
        assert_eq!(settings.token, ApiAuth::Token("s3cret".to_owned()));
    }

    #[test]
    fn listen_null_serves_only_the_socket_and_without_a_socket_refuses_to_start() {
        let dir = tempfile::tempdir().expect("dir");
        let config = dir.path().join("agent.yaml");
        std::fs::write(&config, "listen: null\n").expect("write");
        let error = Settings::resolve(&args(Some(config.clone()))).expect_err("refused");
        assert_eq!(
            error.to_string(),
            format!(
                "{}: `listen: null` turns the api's tcp listener off, but no `socket` is set, so the api would be served nowhere; set `socket` or a `listen` address",
                config.display()
            )
        );
        std::fs::write(&config, "listen: null\nsocket: /run/stead.sock\n").expect("write");
        let settings = Settings::resolve(&args(Some(config.clone()))).expect("socket only");
        assert_eq!(settings.listen, None);
        // The flag still names an address.
        let flagged = Settings::resolve(&AgentArgs {
            listen: Some("127.0.0.1:1".to_owned()),
            ..args(Some(config))
        })
        .expect("flag");
        assert_eq!(flagged.listen.as_deref(), Some("127.0.0.1:1"));
    }

    #[test]
    fn token_none_is_said_explicitly_and_never_beside_a_token_file() {
        let dir = tempfile::tempdir().expect("dir");
        let config = dir.path().join("agent.yaml");
        std::fs::write(&config, "token: none\n").expect("write");
        let settings = Settings::resolve(&args(Some(config.clone()))).expect("none");
        assert_eq!(settings.token, ApiAuth::None);
        std::fs::write(&config, "token: none\ntokenFile: /etc/stead/token\n").expect("write");
        let error = Settings::resolve(&args(Some(config.clone()))).expect_err("refused");
        assert_eq!(
            error.to_string(),
            format!(
                "{}: `token: none` and `tokenFile` contradict each other; remove one",
                config.display()
            )
        );
    }

    #[tokio::test]
    async fn token_none_on_an_address_that_is_not_loopback_refuses_to_start_naming_the_keys() {
        let error = bind_api(Some("0.0.0.0:0"), None, &ApiAuth::None)
            .await
            .err()
            .expect("refused");
        let text = error.to_string();
        assert!(
            text.starts_with("`token: none` serves the api to whoever can connect, so only on loopback or the unix socket, but `listen` is 0.0.0.0:0 (0.0.0.0:"),
            "{text}"
        );
        assert!(text.contains("`listen: null`"), "{text}");
        for auth in [ApiAuth::Generated, ApiAuth::Token("t".to_owned())] {
            let listeners = bind_api(Some("0.0.0.0:0"), None, &auth)
                .await
                .expect("a token guards it");
            assert!(listeners.tcp.is_some());
        }
        let loopback = bind_api(Some("127.0.0.1:0"), None, &ApiAuth::None)
            .await
            .expect("loopback needs no token");
        assert!(loopback.tcp.is_some() && loopback.unix.is_none());
    }

    #[test]
    fn a_generated_token_is_64_hex_digits_in_a_0600_file_made_once_and_read_again() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join(API_TOKEN_FILE);
        let first = api_token(&ApiAuth::Generated, dir.path())
            .expect("generated")
            .expect("a token");
        assert_eq!(first.len(), 64, "{first}");
        assert!(first.bytes().all(|b| b.is_ascii_hexdigit()), "{first}");
        let meta = std::fs::metadata(&path).expect("the file");
        assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
        assert_eq!(
            std::fs::read_dir(dir.path()).expect("dir").count(),
            1,
            "no temporary file left"
        );
        let again = api_token(&ApiAuth::Generated, dir.path()).expect("read");
        assert_eq!(again.as_deref(), Some(first.as_str()));
        let other = tempfile::tempdir().expect("dir");
        let second = api_token(&ApiAuth::Generated, other.path()).expect("generated");
        assert_ne!(second.as_deref(), Some(first.as_str()), "each is random");
        // A configured token or none never touches the data dir.
        let empty = tempfile::tempdir().expect("dir");
        assert_eq!(api_token(&ApiAuth::None, empty.path()).expect("none"), None);
        assert_eq!(
            api_token(&ApiAuth::Token("t".to_owned()), empty.path()).expect("token"),
            Some("t".to_owned())
        );
        assert_eq!(std::fs::read_dir(empty.path()).expect("dir").count(), 0);
    }

    #[test]
    fn a_token_file_that_is_empty_readable_by_others_or_a_link_is_refused_and_kept() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join(API_TOKEN_FILE);
        let refused = |expected: &str| {
            let error = api_token(&ApiAuth::Generated, dir.path()).expect_err(expected);
            assert_eq!(
                error.to_string(),
                format!("api token file {}: {expected}", path.display())
            );
        };
        std::fs::write(&path, "s3cret\n").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        refused(
            "has mode 0644, so users other than the agent's may have read the token; remove it for a new token, or `chmod 600` it to keep this one",
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(
            api_token(&ApiAuth::Generated, dir.path()).expect("kept"),
            Some("s3cret".to_owned())
        );
        std::fs::write(&path, " \n").expect("write");
        refused(
            "is empty, and an agent never runs without a token unless `token: none` says so; remove it, and the agent makes a new token",
        );
        std::fs::remove_file(&path).expect("remove");
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, "s3cret\n").expect("write");
        std::os::unix::fs::symlink(&target, &path).expect("link");
        refused("is a symbolic link; remove it, and the agent makes a new token");
    }

    #[test]
    fn a_second_agent_on_the_same_data_dir_is_refused_naming_the_dir() {
        let dir = std::env::temp_dir().join(format!("stead-agent-lock-{}", std::process::id()));
        let _first = lock_data_dir(&dir).expect("first agent locks");
        let second = lock_data_dir(&dir).expect_err("second agent refused");
        assert_eq!(
            second.to_string(),
            format!(
                "data dir {} is in use by another stead agent",
                dir.display()
            )
        );
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
