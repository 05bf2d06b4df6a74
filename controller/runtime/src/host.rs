//! The node's CPU and memory, as its fingerprint reports them: the cores the agent may
//! use, the MHz of one (what `cpuHardLimit` divides a task's `cpu` by) and the memory;
//! and work spread over those cores (a restart's, at thousands of allocs).

use std::sync::OnceLock;

/// The MHz a core is taken for where the kernel tells nothing (a virtual machine
/// without `cpufreq`, and no `cpu MHz` line): Nomad's habit of a nominal figure.
const FALLBACK_MHZ: u32 = 1_000;

/// The node's CPU and memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostResources {
    /// Cores the agent may use (its CPU affinity and cgroup quota).
    pub cores: u32,
    /// The MHz of one core.
    pub mhz_per_core: u32,
    /// The node's memory, in MiB.
    pub memory_mb: u64,
}

impl HostResources {
    /// The node's resources, read once.
    pub fn get() -> HostResources {
        static HOST: OnceLock<HostResources> = OnceLock::new();
        *HOST.get_or_init(|| HostResources {
            cores: std::thread::available_parallelism()
                .map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX)),
            mhz_per_core: mhz_per_core(
                std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
                    .ok()
                    .as_deref(),
                std::fs::read_to_string("/proc/cpuinfo").ok().as_deref(),
            ),
            memory_mb: std::fs::read_to_string("/proc/meminfo")
                .ok()
                .and_then(|text| memory_mb(&text))
                .unwrap_or(0),
        })
    }

    /// Cores times the MHz of one.
    pub fn total_mhz(&self) -> u64 {
        u64::from(self.cores) * u64::from(self.mhz_per_core)
    }
}

/// The MHz of one core: its maximum frequency (`cpufreq`, in kHz), else the first
/// `cpu MHz` of `/proc/cpuinfo`, else [`FALLBACK_MHZ`].
fn mhz_per_core(max_freq_khz: Option<&str>, cpuinfo: Option<&str>) -> u32 {
    if let Some(khz) = max_freq_khz.and_then(|text| text.trim().parse::<u64>().ok())
        && khz >= 1_000
    {
        return u32::try_from(khz / 1_000).unwrap_or(u32::MAX);
    }
    cpuinfo
        .and_then(|text| {
            text.lines().find_map(|line| {
                let (key, value) = line.split_once(':')?;
                (key.trim() == "cpu MHz")
                    .then(|| value.trim().parse::<f64>().ok())
                    .flatten()
            })
        })
        .filter(|mhz| *mhz >= 1.0)
        .map_or(FALLBACK_MHZ, |mhz| mhz.round() as u32)
}

/// `MemTotal` of `/proc/meminfo`, in MiB.
fn memory_mb(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let rest = line.strip_prefix("MemTotal:")?;
        let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kib / 1024)
    })
}

/// The host name from `/proc`, or `localhost` when it cannot be read.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_owned())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// The fewest items a thread of [`map_on_every_core`] takes: below that, starting it
/// costs more than it saves.
pub const MIN_PER_THREAD: usize = 64;

/// `f` of each item, in the items' order, on up to as many scoped threads as the host has
/// cores, each taking a run of at least [`MIN_PER_THREAD`] items (fewer items stay on
/// this thread). A panic in `f` is raised again here.
pub fn map_on_every_core<T: Send, U: Send>(items: Vec<T>, f: impl Fn(T) -> U + Sync) -> Vec<U> {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let threads = cores.min(items.len() / MIN_PER_THREAD).max(1);
    if threads == 1 {
        return items.into_iter().map(f).collect();
    }
    let per_thread = items.len().div_ceil(threads);
    let mut items = items.into_iter();
    let parts: Vec<Vec<T>> = std::iter::from_fn(|| {
        let part: Vec<T> = items.by_ref().take(per_thread).collect();
        (!part.is_empty()).then_some(part)
    })
    .collect();
    let f = &f;
    std::thread::scope(|scope| {
        let threads: Vec<_> = parts
            .into_iter()
            .map(|part| scope.spawn(move || part.into_iter().map(f).collect::<Vec<U>>()))
            .collect();
        threads
            .into_iter()
            .flat_map(|thread| {
                thread
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_core_is_its_maximum_frequency_else_what_cpuinfo_says_else_a_nominal_figure() {
        let cpuinfo = "processor\t: 0\nmodel name\t: x\ncpu MHz\t\t: 2445.404\n";
        assert_eq!(mhz_per_core(Some("3500000\n"), Some(cpuinfo)), 3_500);
        assert_eq!(mhz_per_core(None, Some(cpuinfo)), 2_445);
        assert_eq!(mhz_per_core(Some("garbage"), Some(cpuinfo)), 2_445);
        assert_eq!(mhz_per_core(None, Some("processor : 0\n")), FALLBACK_MHZ);
        assert_eq!(mhz_per_core(None, None), FALLBACK_MHZ);
    }

    #[test]
    fn memory_is_memtotal_in_mib() {
        assert_eq!(
            memory_mb("MemTotal:       24634448 kB\nMemFree: 1 kB\n"),
            Some(24_057)
        );
        assert_eq!(memory_mb("MemFree: 1 kB\n"), None);
    }

    #[test]
    fn the_host_has_a_core_and_memory() {
        let host = HostResources::get();
        assert!(host.cores >= 1 && host.mhz_per_core >= 1 && host.memory_mb > 0);
        assert_eq!(
            host.total_mhz(),
            u64::from(host.cores) * u64::from(host.mhz_per_core)
        );
    }
}
