//! The id of one run of a task: everything a later agent needs to find the run again,
//! in the handle's `id` so the store holds it.
//!
//! `<alloc-id>/<task>/<run>.<supervisor-pid>.<supervisor-start>.<task-pid>.<task-start>`,
//! where `run` is 16 random hex digits (it names the supervisor's record files) and the
//! start times are clock ticks since boot. The text is opaque to everything but this
//! driver.

use stead_schemas::spec::Name;

use super::process::ProcessId;

/// One run of a task, parsed from (or rendered into) a handle id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct RunId {
    /// The alloc's id, as text (validated again before it reaches a path).
    pub(crate) alloc_id: String,
    /// The task.
    pub(crate) task: Name,
    /// The run's random id: lowercase hex.
    pub(crate) run: String,
    /// The run's supervisor.
    pub(crate) supervisor: ProcessId,
    /// The task's process (its pid is also its process group and session id).
    pub(crate) process: ProcessId,
}

impl RunId {
    /// The handle id.
    pub(crate) fn to_id(&self) -> String {
        format!(
            "{}/{}/{}.{}.{}.{}.{}",
            self.alloc_id,
            self.task,
            self.run,
            self.supervisor.pid,
            self.supervisor.start,
            self.process.pid,
            self.process.start
        )
    }

    /// Parses a handle id; `None` for anything this driver did not write.
    pub(crate) fn parse(id: &str) -> Option<RunId> {
        let mut parts = id.split('/');
        let alloc_id = parts.next()?;
        let task: Name = parts.next()?.parse().ok()?;
        let rest = parts.next()?;
        if parts.next().is_some() {
            return None;
        }
        let mut fields = rest.split('.');
        let run = fields.next()?;
        if !stead_supervisor::args::is_run_id(run) {
            return None;
        }
        let mut number = || fields.next()?.parse::<u64>().ok();
        let supervisor = ProcessId {
            pid: u32::try_from(number()?).ok()?,
            start: number()?,
        };
        let process = ProcessId {
            pid: u32::try_from(number()?).ok()?,
            start: number()?,
        };
        if fields.next().is_some() {
            return None;
        }
        Some(RunId {
            alloc_id: alloc_id.to_owned(),
            task,
            run: run.to_owned(),
            supervisor,
            process,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_round_trip_and_foreign_ids_are_refused() {
        let id = RunId {
            alloc_id: "web-1234abcd".to_owned(),
            task: "server".parse().expect("valid"),
            run: "00aa11bb22cc33dd".to_owned(),
            supervisor: ProcessId {
                pid: 100,
                start: 5_000,
            },
            process: ProcessId {
                pid: 101,
                start: 5_001,
            },
        };
        let text = id.to_id();
        assert_eq!(
            text,
            "web-1234abcd/server/00aa11bb22cc33dd.100.5000.101.5001"
        );
        assert_eq!(RunId::parse(&text), Some(id));
        for foreign in [
            "web-1234abcd/server/1",
            "web-1234abcd/server/xyz.1.2.3.4",
            "web-1234abcd/Server/00.1.2.3.4",
            "web-1234abcd/server/00.1.2.3.4.5",
            "a/b/c/00.1.2.3.4",
        ] {
            assert_eq!(RunId::parse(foreign), None, "{foreign}");
        }
    }
}
