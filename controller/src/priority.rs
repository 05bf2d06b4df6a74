//! CPU priority of the agent's own background work.

use rustix::process::{getpriority_process, setpriority_process};
use rustix::thread::gettid;

/// How much lower than the agent's a background thread's CPU priority is: a nice value
/// added to its own. At +10 a busy thread gets about a tenth of a core that a thread of
/// the agent's priority also wants, and nothing of its work is starved.
pub const BACKGROUND_NICENESS: i32 = 10;

/// Lowers the calling thread's CPU priority by [`BACKGROUND_NICENESS`], for the rest of
/// its life, for work that should give way to the agent's own: creating a new store
/// while tasks start. What waits for that work waits longer on a saturated
/// node (a new node's API and its readiness to systemd wait for the store: 2-3 ms of CPU
/// become up to ten times that). Threads it starts afterwards inherit the priority. Best
/// effort: a failure leaves the thread as it was.
pub fn lower_current_thread() {
    let thread = Some(gettid());
    let Ok(current) = getpriority_process(thread) else {
        return;
    };
    if let Err(error) = setpriority_process(thread, current + BACKGROUND_NICENESS) {
        tracing::debug!(%error, "cannot lower the thread's priority");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's nice value.
    fn current_thread_niceness() -> Option<i32> {
        getpriority_process(Some(gettid())).ok()
    }

    #[test]
    fn lowering_a_thread_leaves_the_other_threads_as_they_were() {
        let before = current_thread_niceness().expect("reads its nice value");
        let lowered = std::thread::spawn(|| {
            let start = current_thread_niceness().expect("reads its nice value");
            lower_current_thread();
            (
                start,
                current_thread_niceness().expect("reads its nice value"),
            )
        })
        .join()
        .expect("the thread ends");
        assert_eq!(lowered.1, (lowered.0 + BACKGROUND_NICENESS).min(19));
        assert_eq!(current_thread_niceness(), Some(before));
    }
}
