//! The runs of tasks that no record names, found at restore: an earlier agent died
//! between a start and the write of its record, or the store lost the record (a damaged
//! write-ahead log). They are never killed for it: the start of the same task of the
//! same alloc revision reattaches the run instead of starting another. The alloc's
//! worker stops, before anything else it does, the runs of its other revisions (the
//! spec moved on while no agent ran) and, when its spec is gone or says stop, all of
//! them; so does a drain. The runs of allocs no spec or record names are left running
//! and reported until a spec claims them.

use std::sync::{Mutex, MutexGuard, PoisonError};

use stead_schemas::spec::Name;

use crate::driver::{TaskHandle, UnrecordedRun, alloc_name_of as name_of};

/// The unrecorded runs not taken yet.
#[derive(Debug, Default)]
pub(crate) struct Unrecorded {
    runs: Mutex<Vec<UnrecordedRun>>,
}

impl Unrecorded {
    fn runs(&self) -> MutexGuard<'_, Vec<UnrecordedRun>> {
        self.runs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds `runs` for the starts to come.
    pub(crate) fn add(&self, runs: Vec<UnrecordedRun>) {
        self.runs().extend(runs);
    }

    /// The run of `task` of alloc revision `alloc_id`, taken: its start reattaches it.
    pub(crate) fn take(&self, alloc_id: &str, task: &Name) -> Option<TaskHandle> {
        let mut runs = self.runs();
        let at = runs
            .iter()
            .position(|run| run.alloc_id == alloc_id && run.task == *task)?;
        Some(runs.remove(at).handle)
    }

    /// The runs of alloc `name` that no start may take, taken to be stopped: those of
    /// every revision but `keep` (the revision the alloc runs), or all of them when it
    /// runs none (its spec is gone or says stop, or the agent drains).
    pub(crate) fn take_to_stop(&self, name: &str, keep: Option<&str>) -> Vec<TaskHandle> {
        let mut runs = self.runs();
        let (stop, kept): (Vec<_>, Vec<_>) = runs
            .drain(..)
            .partition(|run| name_of(&run.alloc_id) == name && keep != Some(run.alloc_id.as_str()));
        *runs = kept;
        stop.into_iter().map(|run| run.handle).collect()
    }

    /// Every run no start has taken, to be stopped (a drain).
    pub(crate) fn take_all(&self) -> Vec<TaskHandle> {
        self.runs().drain(..).map(|run| run.handle).collect()
    }

    /// Whether a run of `task` of alloc revision `alloc_id` waits for its start to take it.
    pub(crate) fn holds_run(&self, alloc_id: &str, task: &Name) -> bool {
        self.runs()
            .iter()
            .any(|run| run.alloc_id == alloc_id && run.task == *task)
    }

    /// Whether a run no start has taken belongs to alloc revision `alloc_id`.
    pub(crate) fn holds_revision(&self, alloc_id: &str) -> bool {
        self.runs().iter().any(|run| run.alloc_id == alloc_id)
    }

    /// Whether a run no start has taken belongs to an alloc named `name`.
    pub(crate) fn holds_alloc(&self, name: &str) -> bool {
        self.runs().iter().any(|run| name_of(&run.alloc_id) == name)
    }

    /// The runs no start has taken whose process `alive` says still runs, described
    /// (`<alloc-id>/<task> (pid N)`); the others are forgotten.
    pub(crate) fn left(&self, alive: impl Fn(&TaskHandle) -> bool) -> Vec<String> {
        let mut runs = self.runs();
        runs.retain(|run| alive(&run.handle));
        runs.iter()
            .map(|run| match run.handle.pid {
                Some(pid) => format!("{}/{} (pid {pid})", run.alloc_id, run.task),
                None => format!("{}/{}", run.alloc_id, run.task),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stead_schemas::Timestamp;
    use stead_schemas::spec::DriverKind;

    fn run(alloc_id: &str, task: &str, pid: u32) -> UnrecordedRun {
        UnrecordedRun {
            alloc_id: alloc_id.to_owned(),
            task: task.parse().expect("name"),
            handle: TaskHandle {
                driver: DriverKind::Exec,
                id: format!("{alloc_id}/{task}/{pid}"),
                pid: Some(pid),
                started_at: Timestamp::EPOCH,
            },
        }
    }

    #[test]
    fn a_run_is_taken_once_by_its_own_revision_and_the_others_of_its_name_are_taken_to_stop() {
        let unrecorded = Unrecorded::default();
        unrecorded.add(vec![
            run("web-aaaa", "main", 1),
            run("web-aaaa", "side", 2),
            run("web-bbbb", "main", 3),
            run("web-api-cccc", "main", 4),
        ]);
        let main: Name = "main".parse().expect("name");
        assert_eq!(
            unrecorded.take("web-aaaa", &main).and_then(|h| h.pid),
            Some(1)
        );
        assert_eq!(unrecorded.take("web-aaaa", &main), None, "taken once");
        let others: Vec<_> = unrecorded
            .take_to_stop("web", Some("web-aaaa"))
            .iter()
            .filter_map(|h| h.pid)
            .collect();
        assert_eq!(
            others,
            [3],
            "not web-api's, whose name only starts the same"
        );
        let left = unrecorded.left(|handle| handle.pid != Some(2));
        assert_eq!(left, ["web-api-cccc/main (pid 4)"]);
        assert_eq!(
            unrecorded.left(|_| true).len(),
            1,
            "a dead run is forgotten"
        );
    }
}
