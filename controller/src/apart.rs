//! Start-up threads that run beside their spawner rather than behind it.
//!
//! A new thread often starts on the core of the thread that spawned it, even with
//! another core idle. When it does not preempt its spawner it waits there, runnable,
//! until the spawner blocks or a load balance moves one of them (at a later scheduler
//! tick, every 4 ms at `HZ=250`); when it does preempt, the spawner waits instead.
//! Measured on a two-core VM: in a test program a new thread ran on its spawner's core
//! in three starts out of four, and in most of the agent's cold starts the main thread
//! (building the runtime, spawning the fork server) and the first listing waited for
//! each other for about a millisecond, the other core idle (ARCHITECTURE.md, the
//! decision "An agent's start puts its first task start first").
//!
//! [`spawn_apart`] keeps a short-lived thread off its spawner's core: the spawner narrows
//! the new thread's cores as soon as it exists (in case it waits behind the spawner), and
//! the thread narrows its own as its first step (in case it ran first). The narrowing
//! lasts the thread's life and is inherited by whatever it spawns, so it is only for
//! threads that end soon and spawn nothing.

use std::io;
use std::thread::JoinHandle;

use rustix::thread::{CpuSet, sched_getaffinity, sched_getcpu, sched_setaffinity};

/// Spawns `work` on a thread named `name` that may run on every core the caller may,
/// except the one the caller runs on now; on all of them when there is no other.
pub(crate) fn spawn_apart<T, F>(name: &str, work: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let cores = other_cores();
    let handle = std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            if let Some(cores) = &cores {
                // Failing leaves the thread where it is: slower, not wrong.
                let _ = sched_setaffinity(None, cores);
            }
            work()
        })?;
    if let Some(cores) = &cores {
        narrow(&handle, cores);
    }
    Ok(handle)
}

/// The cores the calling thread may run on, less the one it runs on now; `None` when
/// that leaves none.
fn other_cores() -> Option<CpuSet> {
    let mut cores = sched_getaffinity(None).ok()?;
    let current = sched_getcpu();
    if cores.count() < 2 || !cores.is_set(current) {
        return None;
    }
    cores.unset(current);
    Some(cores)
}

/// Restricts the thread of `handle` to `cores`. Its thread id is not known without the
/// thread's help, so this goes through its pthread handle.
#[allow(unsafe_code)]
fn narrow<T>(handle: &JoinHandle<T>, cores: &CpuSet) {
    use std::os::unix::thread::JoinHandleExt;
    // SAFETY: `cpu_set_t` is a plain bit array, valid (and empty) zeroed; `CPU_SET` writes within it
    // for every index below `CpuSet::MAX_CPU` (its own size); the pthread handle is the
    // live thread's, as `handle` is neither joined nor detached while borrowed here. A
    // failure (a thread already gone) changes nothing.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for core in (0..CpuSet::MAX_CPU).filter(|core| cores.is_set(*core)) {
            if core < 8 * std::mem::size_of::<libc::cpu_set_t>() {
                libc::CPU_SET(core, &mut set);
            }
        }
        libc::pthread_setaffinity_np(
            handle.as_pthread_t(),
            std::mem::size_of::<libc::cpu_set_t>(),
            &set,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cores the calling thread may run on, as indices.
    fn allowed() -> Vec<usize> {
        let cores = sched_getaffinity(None).expect("affinity");
        (0..CpuSet::MAX_CPU).filter(|c| cores.is_set(*c)).collect()
    }

    /// Runs `check` on a thread of its own restricted to `cores`, so that the test
    /// thread's own cores are left as they were.
    fn on_cores<T: Send + 'static>(
        cores: &[usize],
        check: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        let mut set = CpuSet::new();
        for core in cores {
            set.set(*core);
        }
        std::thread::spawn(move || {
            sched_setaffinity(None, &set).expect("narrowing the test's thread");
            check()
        })
        .join()
        .expect("the test's thread")
    }

    #[test]
    fn a_thread_spawned_apart_may_run_on_every_core_but_its_spawners() {
        let cores = allowed();
        assert!(!cores.is_empty());
        // Two cores, when the machine has them (CI has two): the spawner runs on one,
        // the thread may run only on the other.
        let pair: Vec<usize> = cores.iter().copied().take(2).collect();
        let (spawner_after, thread_cores, thread_ran_on) = on_cores(&pair, || {
            let (go, wait) = std::sync::mpsc::channel::<()>();
            let handle = spawn_apart("apart-test", move || {
                // Past its own narrowing; the spawner's lands before the go.
                wait.recv().expect("go");
                (allowed(), sched_getcpu())
            })
            .expect("spawning");
            go.send(()).expect("the thread waits");
            let (mine, ran_on) = handle.join().expect("joined");
            (allowed(), mine, ran_on)
        });
        assert_eq!(
            spawner_after, pair,
            "the spawner's own cores are left alone"
        );
        if pair.len() == 2 {
            assert_eq!(
                thread_cores.len(),
                1,
                "one of {pair:?} only: {thread_cores:?}"
            );
            assert!(pair.contains(&thread_cores[0]));
            assert_eq!(thread_ran_on, thread_cores[0]);
        } else {
            assert_eq!(thread_cores, pair, "a lone core is kept");
        }
    }

    #[test]
    fn with_one_core_allowed_the_thread_runs_on_it() {
        let core = allowed()[0];
        let thread_cores = on_cores(&[core], || {
            spawn_apart("apart-test", allowed)
                .expect("spawning")
                .join()
                .expect("joined")
        });
        assert_eq!(thread_cores, vec![core]);
    }
}
