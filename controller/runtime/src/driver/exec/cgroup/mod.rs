//! One cgroup per task run: found (v1, v2 or the hybrid of both), made, limited, killed,
//! measured and removed by writing the kernel's few control files directly.
//!
//! Each task run gets `<agent's cgroup>/<parent>/<alloc-id>.<task>.<run>` in every
//! hierarchy it needs. Flat, as Nomad's `<alloc>.<task>.scope`: every task is a sibling
//! of every other, so its CPU weight weighs against the whole node's tasks, and no alloc
//! level is made and removed between runs; the run in the name means removing a run's
//! cgroup never touches its successor's: on cgroup v2 the one unified tree; on v1 the `memory`, `cpu`, `cpuacct` and
//! `pids` hierarchies, plus, on a hybrid host, the v2 tree for its `cgroup.kill`. The
//! supervisor writes the task into them before it `exec`s (`--cgroup`). On v2 the agent
//! first moves itself (and whatever else runs in its cgroup) into a leaf of its own,
//! `stead-agent`: a v2 cgroup that hands controllers to its children may hold no process.
//!
//! The versions differ only in file names and units: `v1.rs` and `v2.rs`.

mod v1;
mod v2;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use stead_schemas::config::AGENT_CGROUP_LEAF;

use crate::driver::CgroupCounters;
use crate::driver::CgroupUsage as Usage;

/// The CPU quota's period, in microseconds (the kernel's default).
pub(crate) const CPU_PERIOD_US: u64 = 100_000;
/// The CPU weight, in MHz, of a task whose spec sets no `cpu` (Nomad's default): every
/// task of the node weighs against the others by its MHz, declared or not.
pub(crate) const DEFAULT_CPU_MHZ: u64 = 100;
/// The smallest quota the kernel takes, in microseconds.
const MIN_CPU_QUOTA_US: u64 = 1_000;
/// How often a removal looks again, 10 ms apart, for the killed processes of a cgroup to
/// have left it (2 s in all).
const REMOVE_ATTEMPTS: u32 = 200;

/// The limits of one task, in the kernel's units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Limits {
    /// The hard memory limit, in bytes.
    pub memory_max: Option<u64>,
    /// The memory the kernel protects from reclaim, in bytes.
    pub memory_low: Option<u64>,
    /// The task's CPU weight, as v1 `cpu.shares` (its MHz).
    pub cpu_shares: Option<u64>,
    /// The CPU time it may use per [`CPU_PERIOD_US`], in microseconds.
    pub cpu_quota_us: Option<u64>,
    /// The most processes and threads.
    pub pids: Option<u64>,
    /// Kill the whole cgroup on an OOM kill.
    pub oom_group: bool,
}

impl Limits {
    /// The limits of a task's `resources`, a core being `mhz_per_core` MHz.
    pub(crate) fn of(resources: &crate::driver::TaskResources, mhz_per_core: u32) -> Limits {
        const MIB: u64 = 1024 * 1024;
        let memory = resources.memory_mb.map(|mb| u64::from(mb) * MIB);
        let memory_max = resources.memory_max_mb.map(|mb| u64::from(mb) * MIB);
        Limits {
            // With a maximum, the memory is the reservation below it.
            memory_max: memory_max.or(memory),
            memory_low: memory_max.and(memory),
            cpu_shares: resources.cpu.map(u64::from),
            cpu_quota_us: resources
                .cpu
                .filter(|_| resources.cpu_hard_limit)
                .map(|mhz| {
                    (u64::from(mhz) * CPU_PERIOD_US / u64::from(mhz_per_core.max(1)))
                        .max(MIN_CPU_QUOTA_US)
                }),
            pids: resources.pids.map(u64::from),
            oom_group: resources.oom_kill_group,
        }
    }

    /// Whether there is anything to enforce.
    pub(crate) fn is_empty(&self) -> bool {
        *self == Limits::default()
    }
}

/// Why tasks' limits cannot be enforced on this node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Unavailable {
    #[error("no cgroup file system is mounted")]
    NotMounted,
    #[error("cannot read {path}: {message}")]
    Unreadable { path: String, message: String },
    #[error("the agent's own {hierarchy} cgroup is not below its mount: {path}")]
    Outside { hierarchy: String, path: String },
    #[error(
        "cannot create {}: {message} (the agent is not root, and its cgroup is not delegated to it)",
        path.display()
    )]
    NotWritable { path: PathBuf, message: String },
    #[error("cannot set up {}: {message}", path.display())]
    Setup { path: PathBuf, message: String },
}

/// The agent's cgroup dirs (`<agent's cgroup>/<parent>`) in each v1 hierarchy, or a
/// task's cgroups there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct V1Dirs {
    pub memory: Option<PathBuf>,
    pub cpu: Option<PathBuf>,
    pub cpuacct: Option<PathBuf>,
    pub pids: Option<PathBuf>,
    /// The hybrid's v2 tree, for `cgroup.kill`.
    pub unified: Option<PathBuf>,
}

impl V1Dirs {
    /// Each dir once: controllers mounted together (`cpu,cpuacct` on most hosts) share
    /// one.
    fn each(&self) -> Vec<&PathBuf> {
        let mut dirs: Vec<&PathBuf> = Vec::with_capacity(5);
        for dir in [
            &self.memory,
            &self.cpu,
            &self.cpuacct,
            &self.pids,
            &self.unified,
        ]
        .into_iter()
        .flatten()
        {
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
        dirs
    }

    fn join(&self, name: &str) -> V1Dirs {
        let join = |dir: &Option<PathBuf>| dir.as_ref().map(|d| d.join(name));
        V1Dirs {
            memory: join(&self.memory),
            cpu: join(&self.cpu),
            cpuacct: join(&self.cpuacct),
            pids: join(&self.pids),
            unified: join(&self.unified),
        }
    }
}

/// The hierarchies tasks' cgroups go in, each at `<agent's cgroup>/<parent>`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Layout {
    V2 {
        /// `<agent's cgroup>/<parent>`.
        root: PathBuf,
        /// The controllers it hands to tasks.
        controllers: Vec<String>,
    },
    V1(V1Dirs),
}

/// Where tasks' cgroups go on this node, and what they can enforce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cgroups {
    layout: Layout,
    /// The kernel has CFS bandwidth control (`cpu.cfs_quota_us`, `cpu.max`).
    quota: bool,
    /// The kernel has `memory.oom.group` (cgroup v2, Linux 4.19).
    oom_group: bool,
}

/// One mount of a cgroup file system, from `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    /// The directory of the hierarchy within it that is mounted.
    root: String,
    /// Where it is mounted.
    point: PathBuf,
    /// v1: its controllers (`name=…` hierarchies left out); v2: none.
    controllers: Vec<String>,
    v2: bool,
}

/// A mount point with its `\040`-style escapes undone.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && let Ok(code) = u8::from_str_radix(&field[i + 1..i + 4], 8)
        {
            out.push(code);
            i += 4;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The cgroup mounts in a `/proc/self/mountinfo` text.
fn mounts(mountinfo: &str) -> Vec<Mount> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let before: Vec<&str> = before.split(' ').collect();
            let mut after = after.split(' ');
            let fstype = after.next()?;
            let superopts = after.nth(1).unwrap_or("");
            let (root, point) = (before.get(3)?, before.get(4)?);
            let v2 = match fstype {
                "cgroup2" => true,
                "cgroup" => false,
                _ => return None,
            };
            let controllers = if v2 {
                Vec::new()
            } else {
                superopts
                    .split(',')
                    .filter(|opt| {
                        matches!(
                            *opt,
                            "memory"
                                | "cpu"
                                | "cpuacct"
                                | "pids"
                                | "cpuset"
                                | "devices"
                                | "freezer"
                                | "blkio"
                                | "net_cls"
                                | "net_prio"
                                | "perf_event"
                                | "hugetlb"
                                | "rdma"
                                | "misc"
                        )
                    })
                    .map(str::to_owned)
                    .collect()
            };
            Some(Mount {
                root: unescape(root),
                point: PathBuf::from(unescape(point)),
                controllers,
                v2,
            })
        })
        .collect()
}

/// The process's cgroup in the hierarchy of `mount`, from `/proc/self/cgroup`, as a
/// directory below the mount point.
fn own_dir(mount: &Mount, self_cgroup: &str) -> Result<PathBuf, Unavailable> {
    let path = self_cgroup
        .lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            let matches = if mount.v2 {
                controllers.is_empty()
            } else {
                let listed: Vec<&str> = controllers.split(',').collect();
                mount
                    .controllers
                    .iter()
                    .all(|c| listed.contains(&c.as_str()))
            };
            matches.then_some(path)
        })
        .next()
        .ok_or_else(|| Unavailable::Outside {
            hierarchy: hierarchy_name(mount),
            path: "(not listed in /proc/self/cgroup)".to_owned(),
        })?;
    let outside = || Unavailable::Outside {
        hierarchy: hierarchy_name(mount),
        path: path.to_owned(),
    };
    let relative = if mount.root == "/" {
        path
    } else {
        let rest = path.strip_prefix(mount.root.as_str()).ok_or_else(outside)?;
        if !(rest.is_empty() || rest.starts_with('/')) {
            return Err(outside());
        }
        rest
    };
    if relative.split('/').any(|part| part == "..") {
        return Err(outside());
    }
    Ok(mount.point.join(relative.trim_start_matches('/')))
}

fn hierarchy_name(mount: &Mount) -> String {
    if mount.v2 {
        "v2".to_owned()
    } else {
        mount.controllers.join(",")
    }
}

/// Makes `dir` (its parent exists); one that exists is fine.
fn make_dir(dir: &Path) -> Result<(), Unavailable> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(error)
            if matches!(
                error.kind(),
                io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem
            ) =>
        {
            Err(Unavailable::NotWritable {
                path: dir.to_owned(),
                message: error.to_string(),
            })
        }
        Err(error) => Err(Unavailable::Setup {
            path: dir.to_owned(),
            message: error.to_string(),
        }),
    }
}

fn setup_error(path: &Path) -> impl FnOnce(io::Error) -> Unavailable + '_ {
    move |error| Unavailable::Setup {
        path: path.to_owned(),
        message: error.to_string(),
    }
}

impl Cgroups {
    /// Finds this process's cgroups and makes `<parent>` below them, moving the agent into
    /// its own leaf on cgroup v2.
    pub(crate) fn set_up(parent: &str) -> Result<Cgroups, Unavailable> {
        let read = |path: &str| {
            std::fs::read_to_string(path).map_err(|error| Unavailable::Unreadable {
                path: path.to_owned(),
                message: error.to_string(),
            })
        };
        let mountinfo = read("/proc/self/mountinfo")?;
        let self_cgroup = read("/proc/self/cgroup")?;
        Cgroups::set_up_from(&mountinfo, &self_cgroup, parent, std::process::id())
    }

    /// [`Cgroups::set_up`] with the two proc files given, and the agent's pid: the
    /// seam the tests drive with cgroup trees on a temporary dir.
    fn set_up_from(
        mountinfo: &str,
        self_cgroup: &str,
        parent: &str,
        pid: u32,
    ) -> Result<Cgroups, Unavailable> {
        let mounts = mounts(mountinfo);
        let v1 = |controller: &str| {
            mounts
                .iter()
                .find(|m| !m.v2 && m.controllers.iter().any(|c| c == controller))
        };
        let unified = mounts.iter().find(|m| m.v2);
        if let Some(memory) = v1("memory") {
            // v1, or the hybrid: limits in the v1 hierarchies, kills through the v2 tree.
            let dir = |mount: Option<&Mount>| -> Result<Option<PathBuf>, Unavailable> {
                let Some(mount) = mount else { return Ok(None) };
                let dir = own_dir(mount, self_cgroup)?.join(parent);
                make_dir(&dir)?;
                Ok(Some(dir))
            };
            // Without memory nothing is worth enforcing; a hierarchy missing beside it
            // leaves out only its limits (reported by `unsupported`), or, the v2 tree,
            // `cgroup.kill`.
            let dirs = V1Dirs {
                memory: dir(Some(memory))?,
                cpu: dir(v1("cpu")).ok().flatten(),
                cpuacct: dir(v1("cpuacct")).ok().flatten(),
                pids: dir(v1("pids")).ok().flatten(),
                unified: dir(unified).ok().flatten(),
            };
            let quota = dirs
                .cpu
                .as_ref()
                .is_some_and(|cpu| cpu.join("cpu.cfs_quota_us").exists());
            return Ok(Cgroups {
                layout: Layout::V1(dirs),
                quota,
                oom_group: false,
            });
        }
        let Some(unified) = unified else {
            return Err(Unavailable::NotMounted);
        };
        let mut base = own_dir(unified, self_cgroup)?;
        // The real root cgroup has no `cgroup.type`; a cgroup namespace's root (in a
        // container) has one, and the rule of no internal processes holds there.
        let at_root = !base.join("cgroup.type").exists();
        if base
            .file_name()
            .is_some_and(|name| name == AGENT_CGROUP_LEAF)
        {
            // A restart: the agent is in its leaf already.
            base.pop();
        } else if !at_root {
            // No internal processes: everything in the agent's cgroup moves to a leaf,
            // before the cgroup can hand controllers to its children.
            let leaf = base.join(AGENT_CGROUP_LEAF);
            make_dir(&leaf)?;
            let procs = leaf.join("cgroup.procs");
            let others = std::fs::read_to_string(base.join("cgroup.procs")).unwrap_or_default();
            for other in others.lines().filter(|p| *p != pid.to_string()) {
                // It may have exited meanwhile.
                let _ = write_file(&procs, other);
            }
            write_file(&procs, &pid.to_string()).map_err(setup_error(&procs))?;
        }
        let controllers = v2::available(&base, &v2::CONTROLLERS).map_err(setup_error(&base))?;
        v2::enable(&base, &controllers).map_err(setup_error(&base))?;
        let root = base.join(parent);
        make_dir(&root)?;
        v2::enable(&root, &controllers).map_err(setup_error(&root))?;
        // Files of the parent probe what the kernel has: a task's would be the same.
        Ok(Cgroups {
            quota: root.join("cpu.max").exists(),
            oom_group: root.join("memory.oom.group").exists(),
            layout: Layout::V2 { root, controllers },
        })
    }

    /// `v1`, `v2` or `hybrid` (v1 limits, v2 kills).
    pub(crate) fn version(&self) -> &'static str {
        match &self.layout {
            Layout::V2 { .. } => "v2",
            Layout::V1(dirs) if dirs.unified.is_some() => "hybrid",
            Layout::V1(_) => "v1",
        }
    }

    /// Whether a task's final kill goes through `cgroup.kill`.
    pub(crate) fn kills(&self) -> bool {
        let probe = match &self.layout {
            Layout::V2 { root, .. } => Some(root),
            Layout::V1(dirs) => dirs.unified.as_ref(),
        };
        // A cgroup's own file, as the kernel (5.14 and later) gives every non-root one.
        probe.is_some_and(|root| root.join("cgroup.kill").exists())
    }

    /// The tasks' parent cgroup, in its first hierarchy: for messages.
    pub(crate) fn root(&self) -> &Path {
        match &self.layout {
            Layout::V2 { root, .. } => root,
            Layout::V1(dirs) => dirs.memory.as_deref().unwrap_or(Path::new("/")),
        }
    }

    /// Whether tasks' cgroups get `controller` (`memory`, `cpu` or `pids`).
    fn has(&self, controller: &str) -> bool {
        match &self.layout {
            Layout::V2 { controllers, .. } => controllers.iter().any(|c| c == controller),
            Layout::V1(dirs) => match controller {
                "memory" => dirs.memory.is_some(),
                "cpu" => dirs.cpu.is_some(),
                _ => dirs.pids.is_some(),
            },
        }
    }

    /// Why some of `limits` cannot be enforced here; `None` when all can.
    pub(crate) fn unsupported(&self, limits: &Limits) -> Option<String> {
        let missing: Vec<&str> = [
            (limits.memory_max.or(limits.memory_low).is_some(), "memory"),
            (limits.cpu_shares.or(limits.cpu_quota_us).is_some(), "cpu"),
            (limits.pids.is_some(), "pids"),
        ]
        .into_iter()
        .filter(|(needed, controller)| *needed && !self.has(controller))
        .map(|(_, controller)| controller)
        .collect();
        if !missing.is_empty() {
            return Some(format!(
                "the {} controller is not available to the agent's cgroup",
                missing.join(", ")
            ));
        }
        if limits.oom_group && matches!(self.layout, Layout::V1(_)) {
            return Some("oomKillGroup needs cgroup v2 (memory.oom.group)".to_owned());
        }
        if limits.oom_group && !self.oom_group {
            return Some("oomKillGroup needs memory.oom.group (Linux 4.19)".to_owned());
        }
        if limits.cpu_quota_us.is_some() && !self.quota {
            return Some(
                "cpuHardLimit needs the kernel's CFS bandwidth control (cpu.max, cpu.cfs_quota_us)"
                    .to_owned(),
            );
        }
        None
    }

    /// `limits` without what this node cannot enforce (reported by
    /// [`Cgroups::unsupported`]): a best-effort start writes the rest.
    pub(crate) fn enforceable(&self, limits: &Limits) -> Limits {
        let mut enforceable = *limits;
        if !self.has("memory") {
            enforceable.memory_max = None;
            enforceable.memory_low = None;
        }
        if !self.oom_group {
            enforceable.oom_group = false;
        }
        if !self.quota {
            enforceable.cpu_quota_us = None;
        }
        if !self.has("cpu") {
            enforceable.cpu_shares = None;
            enforceable.cpu_quota_us = None;
        }
        if !self.has("pids") {
            enforceable.pids = None;
        }
        enforceable
    }

    /// The cgroup of run `run` of `task` of `alloc_id` (names validated by the caller).
    pub(crate) fn task(&self, alloc_id: &str, task: &str, run: &str) -> TaskCgroup {
        let name = format!("{alloc_id}.{task}.{run}");
        match &self.layout {
            Layout::V2 { root, .. } => TaskCgroup::V2 {
                dir: root.join(name),
            },
            Layout::V1(dirs) => TaskCgroup::V1(dirs.join(&name)),
        }
    }

    /// The runs that have a cgroup here, as `(alloc-id, task, run)`.
    pub(crate) fn runs(&self) -> Vec<(String, String, String)> {
        std::fs::read_dir(self.root())
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .filter(|entry| entry.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|entry| {
                let name = entry.file_name().into_string().ok()?;
                let mut parts = name.split('.');
                let run = (parts.next()?, parts.next()?, parts.next()?);
                parts
                    .next()
                    .is_none()
                    .then(|| (run.0.to_owned(), run.1.to_owned(), run.2.to_owned()))
            })
            .collect()
    }
}

/// One task's cgroups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TaskCgroup {
    V2 { dir: PathBuf },
    V1(V1Dirs),
}

impl TaskCgroup {
    /// Only the hierarchies a run with `limits` joins. Each join is a migration the
    /// kernel makes expensive (about 0.4 ms each on this project's machines; five of
    /// them doubled the start of 500 tasks): v2 has one tree; on v1 a run joins memory
    /// (its OOM kills and memory are counted there, limit or not), cpu (every task
    /// weighs by its MHz: one left in the agent's cgroup would weigh as much as all
    /// tasks together), the v2 tree of the hybrid (`cgroup.kill`, CPU time), `cpuacct`
    /// only without that tree, and `pids` only for its limit.
    pub(crate) fn for_limits(self, limits: &Limits) -> TaskCgroup {
        match self {
            TaskCgroup::V2 { .. } => self,
            TaskCgroup::V1(mut dirs) => {
                if dirs.unified.is_some() {
                    dirs.cpuacct = None;
                }
                if limits.pids.is_none() {
                    dirs.pids = None;
                }
                TaskCgroup::V1(dirs)
            }
        }
    }

    /// Only the hierarchies where it exists: a run's cgroup re-derived after a restart.
    pub(crate) fn existing(self) -> TaskCgroup {
        match self {
            TaskCgroup::V2 { .. } => self,
            TaskCgroup::V1(mut dirs) => {
                for dir in [
                    &mut dirs.memory,
                    &mut dirs.cpu,
                    &mut dirs.cpuacct,
                    &mut dirs.pids,
                    &mut dirs.unified,
                ] {
                    if dir.as_ref().is_some_and(|d| !d.is_dir()) {
                        *dir = None;
                    }
                }
                TaskCgroup::V1(dirs)
            }
        }
    }

    fn dirs(&self) -> Vec<&PathBuf> {
        match self {
            TaskCgroup::V2 { dir } => vec![dir],
            TaskCgroup::V1(dirs) => dirs.each(),
        }
    }

    /// Its `cgroup.procs` files, which list its processes.
    pub(crate) fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs()
            .into_iter()
            .map(|dir| dir.join("cgroup.procs"))
            .collect()
    }

    /// The files a process joins it through, by writing `0` from a single thread (a
    /// child between `fork` and `exec`): a v1 hierarchy's `tasks`, the v2 tree's
    /// `cgroup.procs`. Moving the writer's one thread through `tasks` is moving the
    /// process, without the kernel's global threadgroup lock that a `cgroup.procs`
    /// write takes, which waits for every fork and exit in flight on the machine. v2
    /// moves threads only within a domain, so a process joins it whole (or, from the
    /// supervisor, is created in it).
    pub(crate) fn join_files(&self) -> Vec<PathBuf> {
        match self {
            TaskCgroup::V2 { dir } => vec![dir.join("cgroup.procs")],
            TaskCgroup::V1(dirs) => dirs
                .each()
                .into_iter()
                .map(|dir| {
                    let v2 = dirs.unified.as_ref() == Some(dir);
                    dir.join(if v2 { "cgroup.procs" } else { "tasks" })
                })
                .collect(),
        }
    }

    /// Whether a run made it (a run of an agent without cgroups did not).
    pub(crate) fn exists(&self) -> bool {
        self.dirs().first().is_some_and(|dir| dir.is_dir())
    }

    /// Makes the cgroup (its run's alone: the run id is in its name) with `limits`. On an
    /// error what it made is left for the caller to remove.
    pub(crate) fn create(&self, limits: &Limits) -> io::Result<()> {
        for dir in self.dirs() {
            std::fs::create_dir(dir)?;
        }
        match self {
            TaskCgroup::V2 { dir } => {
                v2::write_limits(dir, limits)?;
                if limits.memory_low.is_some() {
                    self.protect_parent();
                }
                Ok(())
            }
            TaskCgroup::V1(dirs) => v1::write_limits(dirs, limits),
        }
    }

    /// v2: the tasks' parent protects what its children reserve.
    fn protect_parent(&self) {
        if let TaskCgroup::V2 { dir } = self
            && let Some(root) = dir.parent()
            && let Err(error) = v2::protect(root)
        {
            tracing::warn!(root = %root.display(), %error, "cannot protect the tasks' reserved memory");
        }
    }

    /// SIGKILLs every process in it: through `cgroup.kill` where the kernel has it, else
    /// each process listed. True when `cgroup.kill` was used.
    pub(crate) fn kill(&self) -> bool {
        let kill_file = match self {
            TaskCgroup::V2 { dir } => Some(dir.join("cgroup.kill")),
            TaskCgroup::V1(dirs) => dirs.unified.as_ref().map(|dir| dir.join("cgroup.kill")),
        };
        if let Some(file) = kill_file
            && write_file(&file, "1").is_ok()
        {
            return true;
        }
        for procs in self.procs_files() {
            let listed = std::fs::read_to_string(procs).unwrap_or_default();
            super::process::kill_all(listed.lines().filter_map(|pid| pid.parse().ok()));
        }
        false
    }

    /// Removes it, killing what is left in it first: a cgroup still holding a process
    /// is killed, and its removal looked at again every 10 ms, 2 s in all, for the killed
    /// processes to leave. An empty one (a run whose processes have all ended, the usual
    /// case) goes with one `rmdir` per hierarchy and is never written to: writing
    /// `cgroup.kill` takes the kernel's global cgroup lock, as each `rmdir` does. One
    /// that is gone already is fine; every hierarchy is tried, and the first error
    /// returned.
    pub(crate) async fn remove(&self) -> io::Result<()> {
        let reserved = match self {
            TaskCgroup::V2 { dir } => {
                read_number(&dir.join("memory.low")).is_some_and(|low| low > 0)
            }
            TaskCgroup::V1(_) => false,
        };
        let mut first_error = None;
        // The first dir last: it is the one `exists` and `Cgroups::runs` look at, so an
        // agent that dies midway still finds what is left.
        for dir in self.dirs().into_iter().rev() {
            let mut attempts = 0;
            loop {
                match std::fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(error) if error.kind() == io::ErrorKind::NotFound => break,
                    Err(error)
                        if error.raw_os_error() == Some(rustix::io::Errno::BUSY.raw_os_error())
                            && attempts < REMOVE_ATTEMPTS =>
                    {
                        // Something is left in it: killed at once, and again every ten
                        // looks (without `cgroup.kill` a process forked during the last
                        // scan is still there).
                        if attempts % 10 == 0 {
                            self.kill();
                        }
                        attempts += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    Err(error) => {
                        first_error.get_or_insert(error);
                        break;
                    }
                }
            }
        }
        if reserved {
            self.protect_parent();
        }
        first_error.map_or(Ok(()), Err)
    }

    /// How many of its processes the OOM killer killed; `None` without a memory cgroup.
    pub(crate) fn oom_kills(&self) -> Option<u64> {
        match self {
            TaskCgroup::V2 { dir } => v2::oom_kills(dir),
            TaskCgroup::V1(dirs) => v1::oom_kills(dirs.memory.as_deref()?),
        }
    }

    /// Its CPU time and memory now, for `/metrics`: two control files read (three on v1
    /// without `cpuacct`); `None` when it is gone.
    pub(crate) fn counters(&self) -> Option<CgroupCounters> {
        match self {
            TaskCgroup::V2 { dir } => v2::counters(dir),
            TaskCgroup::V1(dirs) => v1::counters(dirs),
        }
    }

    /// What the kernel counts for it; `None` when it is gone.
    pub(crate) fn usage(&self) -> Option<Usage> {
        match self {
            TaskCgroup::V2 { dir } => v2::usage(dir),
            TaskCgroup::V1(dirs) => v1::usage(dirs),
        }
    }
}

impl fmt::Display for TaskCgroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.dirs().first() {
            Some(dir) => write!(f, "{}", dir.display()),
            None => f.write_str("(none)"),
        }
    }
}

/// Writes `text` to the control file `path` in one `write`, as the kernel wants.
pub(crate) fn write_file(path: &Path, text: &str) -> io::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true);
    // The tests' cgroup trees are plain directories, where a control file is created;
    // on a cgroup file system a missing one is an error.
    #[cfg(test)]
    options.create(true).truncate(true);
    options.open(path)?.write_all(text.as_bytes())
}

/// The first number in file `path`; `None` when it is missing or reads `max`.
fn read_number(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The value of `key` in a file of `key value` lines.
fn read_keyed(path: &Path, key: &str) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .lines()
        .find_map(|line| {
            let (k, v) = line.split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok()).flatten()
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::TaskResources;

    const MIB: u64 = 1024 * 1024;

    fn read(path: &Path) -> String {
        std::fs::read_to_string(path).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
    }

    #[test]
    fn limits_follow_nomads_meaning_of_memory_memory_max_and_cpu_mhz() {
        let of = |resources: TaskResources| Limits::of(&resources, 2_000);
        assert!(of(TaskResources::default()).is_empty());
        let hard = of(TaskResources {
            memory_mb: Some(64),
            ..TaskResources::default()
        });
        assert_eq!((hard.memory_max, hard.memory_low), (Some(64 * MIB), None));
        let reserved = of(TaskResources {
            memory_mb: Some(64),
            memory_max_mb: Some(256),
            ..TaskResources::default()
        });
        assert_eq!(
            (reserved.memory_max, reserved.memory_low),
            (Some(256 * MIB), Some(64 * MIB))
        );
        let weighted = of(TaskResources {
            cpu: Some(500),
            ..TaskResources::default()
        });
        assert_eq!(
            (weighted.cpu_shares, weighted.cpu_quota_us),
            (Some(500), None)
        );
        let capped = of(TaskResources {
            cpu: Some(500),
            cpu_hard_limit: true,
            ..TaskResources::default()
        });
        // A quarter of a 2,000 MHz core: a quarter of each period.
        assert_eq!(capped.cpu_quota_us, Some(CPU_PERIOD_US / 4));
        let tiny = of(TaskResources {
            cpu: Some(1),
            cpu_hard_limit: true,
            ..TaskResources::default()
        });
        assert_eq!(tiny.cpu_quota_us, Some(MIN_CPU_QUOTA_US));
    }

    #[test]
    fn cpu_shares_map_onto_v2_weights_as_runc_maps_them() {
        assert_eq!(v2::weight(2), 1);
        assert_eq!(v2::weight(1024), 39);
        assert_eq!(v2::weight(262_144), 10_000);
        assert_eq!(v2::weight(1), 1);
        assert_eq!(v2::weight(u64::MAX), 10_000);
    }

    /// This machine's kind of host: v1 controllers, and the v2 tree of the hybrid.
    const HYBRID_MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / {root}/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / {root}/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / {root}/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / {root}/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / {root}/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / {root}/unified rw,relatime - cgroup2 cgroup2 rw
";
    const HYBRID_CGROUP: &str = "\
9:name=systemd:/
8:pids:/
4:memory:/process_api/abc
2:cpuacct:/
1:cpu:/
0::/
";

    fn tree() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("a temporary dir");
        let root = dir.path().to_owned();
        (dir, root)
    }

    #[test]
    fn on_a_hybrid_host_limits_go_to_the_v1_hierarchies_and_kills_through_the_v2_tree() {
        let (_dir, root) = tree();
        for hierarchy in [
            "cpu",
            "cpuacct",
            "memory/process_api/abc",
            "pids",
            "unified",
        ] {
            std::fs::create_dir_all(root.join(hierarchy)).expect("a hierarchy");
        }
        // The kernel has CFS bandwidth control: the parent shows its quota file.
        std::fs::create_dir_all(root.join("cpu/stead")).expect("the parent");
        std::fs::write(root.join("cpu/stead/cpu.cfs_quota_us"), "-1\n").expect("written");
        let mountinfo = HYBRID_MOUNTINFO.replace("{root}", &root.display().to_string());
        let cgroups =
            Cgroups::set_up_from(&mountinfo, HYBRID_CGROUP, "stead", 4242).expect("set up");
        assert_eq!(cgroups.version(), "hybrid");
        assert_eq!(cgroups.root(), root.join("memory/process_api/abc/stead"));
        let limits = Limits {
            memory_max: Some(64 * MIB),
            memory_low: None,
            cpu_shares: Some(500),
            cpu_quota_us: Some(25_000),
            pids: Some(5),
            oom_group: false,
        };
        assert_eq!(cgroups.unsupported(&limits), None);
        assert_eq!(
            cgroups
                .unsupported(&Limits {
                    oom_group: true,
                    ..limits
                })
                .as_deref(),
            Some("oomKillGroup needs cgroup v2 (memory.oom.group)")
        );
        let task = cgroups.task("web-1234abcd", "main", "00ff");
        task.create(&limits).expect("created");
        let run = "web-1234abcd.main.00ff";
        let memory = root.join("memory/process_api/abc/stead").join(run);
        assert_eq!(
            read(&memory.join("memory.limit_in_bytes")),
            (64 * MIB).to_string()
        );
        let cpu = root.join("cpu/stead").join(run);
        assert_eq!(read(&cpu.join("cpu.shares")), "500");
        assert_eq!(read(&cpu.join("cpu.cfs_quota_us")), "25000");
        assert_eq!(read(&cpu.join("cpu.cfs_period_us")), "100000");
        assert_eq!(
            read(&root.join("pids/stead").join(run).join("pids.max")),
            "5"
        );
        let procs: Vec<PathBuf> = task.procs_files();
        assert_eq!(
            procs,
            [
                "memory/process_api/abc",
                "cpu",
                "cpuacct",
                "pids",
                "unified"
            ]
            .iter()
            .map(|h| root.join(h).join("stead").join(run).join("cgroup.procs"))
            .collect::<Vec<_>>()
        );
        assert_eq!(
            cgroups.runs(),
            [(
                "web-1234abcd".to_owned(),
                "main".to_owned(),
                "00ff".to_owned()
            )]
        );
        // A run joins only what it needs: memory and cpu always, the v2 tree for kills
        // and CPU time (so not cpuacct), pids for its limit. It joins the v1
        // hierarchies through their thread files, the v2 tree as a whole process.
        let joins = |limits: &Limits| -> Vec<PathBuf> {
            cgroups
                .task("web-1234abcd", "other", "01")
                .for_limits(limits)
                .join_files()
        };
        let at = |hierarchies: &[&str]| -> Vec<PathBuf> {
            hierarchies
                .iter()
                .map(|h| {
                    let file = if *h == "unified" {
                        "cgroup.procs"
                    } else {
                        "tasks"
                    };
                    root.join(h).join("stead/web-1234abcd.other.01").join(file)
                })
                .collect()
        };
        assert_eq!(
            joins(&Limits::default()),
            at(&["memory/process_api/abc", "cpu", "unified"])
        );
        assert_eq!(
            joins(&limits),
            at(&["memory/process_api/abc", "cpu", "pids", "unified"])
        );
        // A run without limits weighs by the default MHz, and after a restart its cgroup
        // is what exists of it; its CPU time comes from the v2 tree.
        let other = cgroups
            .task("web-1234abcd", "other", "01")
            .for_limits(&Limits::default());
        other.create(&Limits::default()).expect("created");
        let other_dir = |h: &str| root.join(h).join("stead/web-1234abcd.other.01");
        assert_eq!(read(&other_dir("cpu").join("cpu.shares")), "100");
        assert_eq!(
            cgroups.task("web-1234abcd", "other", "01").existing(),
            other
        );
        std::fs::write(
            other_dir("memory/process_api/abc").join("memory.usage_in_bytes"),
            "4096\n",
        )
        .expect("written");
        std::fs::write(
            other_dir("unified").join("cpu.stat"),
            "usage_usec 7000\nuser_usec 5000\nsystem_usec 2000\n",
        )
        .expect("written");
        let usage = other.usage().expect("usage");
        assert_eq!((usage.memory_bytes, usage.cpu_usec), (Some(4096), 7_000));
        assert_eq!((usage.pids, usage.throttled_usec), (None, None));
        assert!(task.kill(), "through cgroup.kill");
        assert_eq!(
            read(&root.join("unified/stead").join(run).join("cgroup.kill")),
            "1"
        );

        std::fs::write(memory.join("memory.usage_in_bytes"), "8388608\n").expect("written");
        std::fs::write(memory.join("memory.max_usage_in_bytes"), "9437184\n").expect("written");
        std::fs::write(
            memory.join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
        )
        .expect("written");
        std::fs::write(
            root.join("cpuacct/stead").join(run).join("cpuacct.usage"),
            "2500000000\n",
        )
        .expect("written");
        std::fs::write(
            cpu.join("cpu.stat"),
            "nr_periods 10\nnr_throttled 4\nthrottled_time 750000000\n",
        )
        .expect("written");
        std::fs::write(
            root.join("pids/stead").join(run).join("pids.current"),
            "3\n",
        )
        .expect("written");
        let usage = task.usage().expect("usage");
        assert_eq!(
            usage,
            Usage {
                memory_bytes: Some(8 * MIB),
                memory_peak_bytes: Some(9 * MIB),
                memory_limit_bytes: Some(64 * MIB),
                cpu_usec: 2_500_000,
                throttled_usec: Some(750_000),
                pids: Some(3),
                pids_limit: Some(5),
                oom_kills: 1,
            }
        );
        assert_eq!(task.oom_kills(), Some(1));
    }

    #[test]
    fn controllers_mounted_together_share_one_dir_that_a_task_makes_and_joins_once() {
        let (_dir, root) = tree();
        for hierarchy in ["cpu,cpuacct", "memory"] {
            std::fs::create_dir_all(root.join(hierarchy)).expect("a hierarchy");
        }
        let mountinfo = format!(
            "32 31 0:29 / {0}/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n35 31 0:32 / {0}/memory rw - cgroup cgroup rw,memory\n",
            root.display()
        );
        let cgroups = Cgroups::set_up_from(&mountinfo, "4:memory:/\n2:cpu,cpuacct:/\n", "stead", 1)
            .expect("set up");
        assert_eq!(cgroups.version(), "v1");
        assert_eq!(
            cgroups
                .unsupported(&Limits {
                    pids: Some(3),
                    ..Limits::default()
                })
                .as_deref(),
            Some("the pids controller is not available to the agent's cgroup")
        );
        let task = cgroups.task("web-1234abcd", "main", "00ff");
        task.create(&Limits {
            cpu_shares: Some(100),
            ..Limits::default()
        })
        .expect("created once, though two controllers share it");
        assert_eq!(
            task.procs_files(),
            ["memory", "cpu,cpuacct"]
                .iter()
                .map(|h| root
                    .join(h)
                    .join("stead/web-1234abcd.main.00ff/cgroup.procs"))
                .collect::<Vec<_>>()
        );
        assert_eq!(
            task.join_files(),
            ["memory", "cpu,cpuacct"]
                .iter()
                .map(|h| root.join(h).join("stead/web-1234abcd.main.00ff/tasks"))
                .collect::<Vec<_>>()
        );
        assert_eq!(
            read(&root.join("cpu,cpuacct/stead/web-1234abcd.main.00ff/cpu.shares")),
            "100"
        );
    }

    #[test]
    fn on_cgroup_v2_the_agent_moves_into_its_leaf_hands_controllers_down_and_a_task_gets_its_limits()
     {
        let (_dir, root) = tree();
        let service = root.join("system.slice/stead.service");
        std::fs::create_dir_all(&service).expect("the service's cgroup");
        std::fs::write(
            service.join("cgroup.controllers"),
            "cpuset cpu io memory pids\n",
        )
        .expect("written");
        std::fs::write(service.join("cgroup.procs"), "4242\n").expect("written");
        // Not the root cgroup, which has no type.
        std::fs::write(service.join("cgroup.type"), "domain\n").expect("written");
        // The parent shows what the kernel has: CFS bandwidth and group OOM kills.
        std::fs::create_dir_all(service.join("stead")).expect("the parent");
        for file in ["cpu.max", "memory.oom.group"] {
            std::fs::write(service.join("stead").join(file), "").expect("written");
        }
        let mountinfo = format!(
            "30 23 0:26 / {} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
            root.display()
        );
        let self_cgroup = "0::/system.slice/stead.service\n";
        let cgroups = Cgroups::set_up_from(&mountinfo, self_cgroup, "stead", 4242).expect("set up");
        assert_eq!(cgroups.version(), "v2");
        assert_eq!(read(&service.join("stead-agent/cgroup.procs")), "4242");
        assert_eq!(
            read(&service.join("cgroup.subtree_control")),
            "+cpu +memory +pids"
        );
        assert_eq!(
            read(&service.join("stead/cgroup.subtree_control")),
            "+cpu +memory +pids"
        );
        // After a restart the agent is in its leaf: it moves nothing.
        let again = Cgroups::set_up_from(
            &mountinfo,
            "0::/system.slice/stead.service/stead-agent\n",
            "stead",
            4343,
        )
        .expect("set up again");
        assert_eq!(again, cgroups);
        assert_eq!(read(&service.join("stead-agent/cgroup.procs")), "4242");

        let limits = Limits {
            memory_max: Some(256 * MIB),
            memory_low: Some(64 * MIB),
            cpu_shares: Some(1024),
            cpu_quota_us: Some(50_000),
            pids: Some(100),
            oom_group: true,
        };
        assert_eq!(cgroups.unsupported(&limits), None);
        let task = cgroups.task("web-1234abcd", "main", "00ff");
        task.create(&limits).expect("created");
        let dir = service.join("stead/web-1234abcd.main.00ff");
        for (file, value) in [
            ("memory.max", (256 * MIB).to_string()),
            ("memory.low", (64 * MIB).to_string()),
            ("memory.oom.group", "1".to_owned()),
            ("cpu.weight", "39".to_owned()),
            ("cpu.max", "50000 100000".to_owned()),
            ("pids.max", "100".to_owned()),
        ] {
            assert_eq!(read(&dir.join(file)), value, "{file}");
        }
        assert_eq!(task.procs_files(), [dir.join("cgroup.procs")]);
        assert_eq!(task.join_files(), [dir.join("cgroup.procs")]);
        assert_eq!(
            read(&service.join("stead/memory.low")),
            (64 * MIB).to_string(),
            "the parent protects what its children reserve"
        );

        for (file, text) in [
            ("memory.current", "1048576\n"),
            ("memory.peak", "2097152\n"),
            (
                "memory.events",
                "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 1\n",
            ),
            (
                "cpu.stat",
                "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\nnr_periods 3\nnr_throttled 1\nthrottled_usec 20000\n",
            ),
            ("pids.current", "2\n"),
            ("pids.max", "max\n"),
        ] {
            std::fs::write(dir.join(file), text).expect("written");
        }
        assert_eq!(
            task.usage(),
            Some(Usage {
                memory_bytes: Some(MIB),
                memory_peak_bytes: Some(2 * MIB),
                memory_limit_bytes: Some(256 * MIB),
                cpu_usec: 1_500_000,
                throttled_usec: Some(20_000),
                pids: Some(2),
                pids_limit: None,
                oom_kills: 1,
            })
        );
    }

    #[test]
    fn a_v2_controller_the_agents_cgroup_lacks_is_reported_and_left_out_of_the_limits() {
        let (_dir, root) = tree();
        std::fs::write(root.join("cgroup.controllers"), "cpu memory\n").expect("written");
        let mountinfo = format!("30 23 0:26 / {} rw - cgroup2 cgroup2 rw\n", root.display());
        // At the root no leaf is needed: the root cgroup may hold processes.
        let cgroups = Cgroups::set_up_from(&mountinfo, "0::/\n", "stead", 1).expect("set up");
        assert!(!root.join("stead-agent").exists());
        let limits = Limits {
            pids: Some(5),
            memory_max: Some(MIB * 10),
            ..Limits::default()
        };
        assert_eq!(
            cgroups.unsupported(&limits).as_deref(),
            Some("the pids controller is not available to the agent's cgroup")
        );
        assert_eq!(
            cgroups
                .unsupported(&Limits {
                    cpu_shares: Some(500),
                    cpu_quota_us: Some(50_000),
                    ..Limits::default()
                })
                .as_deref(),
            Some(
                "cpuHardLimit needs the kernel's CFS bandwidth control (cpu.max, cpu.cfs_quota_us)"
            ),
            "the parent shows no cpu.max"
        );
        assert_eq!(
            cgroups.enforceable(&limits),
            Limits {
                memory_max: Some(MIB * 10),
                ..Limits::default()
            }
        );
    }

    #[test]
    fn without_a_cgroup_mount_or_outside_its_mount_nothing_is_set_up() {
        assert_eq!(
            Cgroups::set_up_from(
                "22 1 0:21 / /proc rw - proc proc rw\n",
                "0::/\n",
                "stead",
                1
            ),
            Err(Unavailable::NotMounted)
        );
        let mountinfo = "30 23 0:26 /kubepods /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert!(matches!(
            Cgroups::set_up_from(mountinfo, "0::/system.slice\n", "stead", 1),
            Err(Unavailable::Outside { .. })
        ));
        assert_eq!(unescape(r"/mnt/with\040space"), "/mnt/with space");
    }
}
