//! The worker's health checks: one check loop per running task that has checks, started
//! and stopped level-triggered after each reconcile, its results reported like driver
//! operations (tagged with the task's run, so a result of a run that is over is dropped).

use tokio_util::sync::DropGuard;

use super::*;
use crate::checks::{Probe, ProbeKind};

/// The check loop of one task's run; dropping it stops the loop.
pub(super) struct CheckLoop {
    run: u64,
    _stop: DropGuard,
}

impl Worker {
    /// Starts the check loop of every task that runs, has checks and is not being
    /// killed, and stops every other: a check never runs while its task does not.
    pub(super) fn sync_checks(&mut self) {
        let Some(current) = &self.current else {
            self.checks.clear();
            return;
        };
        let mut wanted: Vec<(Name, u64)> = Vec::new();
        for settings in current
            .desired
            .tasks
            .iter()
            .filter(|s| !s.checks.is_empty())
        {
            let runs = current
                .state
                .tasks
                .get(&settings.name)
                .is_some_and(|task| task.is_running() && task.kill.is_none());
            let run = self.ops.get(&settings.name).map(|ops| ops.run);
            if let (true, Some(run), true) =
                (runs, run, current.handles.contains_key(&settings.name))
            {
                wanted.push((settings.name.clone(), run));
            }
        }
        self.checks
            .retain(|task, running| wanted.contains(&(task.clone(), running.run)));
        for (task, run) in wanted {
            if !self.checks.contains_key(&task) {
                self.start_checks(task, run);
            }
        }
    }

    /// Starts the check loop of `task`'s run `run`.
    fn start_checks(&mut self, task: Name, run: u64) {
        let Some(current) = &self.current else { return };
        let Some(spec) = current.spec.spec.spec.tasks.iter().find(|t| t.name == task) else {
            return;
        };
        let driver = self.shared.drivers.get(spec.driver);
        let agent_env = agent_env(&current.spec.id, &self.name, &task);
        let probes: Vec<Probe> = spec
            .checks
            .iter()
            .flatten()
            .filter_map(|check| {
                let timeout = check.effective_timeout().get();
                let kind = match check.check_type {
                    CheckType::Http => ProbeKind::Http {
                        host: check.effective_host().to_owned(),
                        port: check.port.unwrap_or_default(),
                        method: check.effective_method().to_owned(),
                        path: check.effective_path().to_owned(),
                    },
                    CheckType::Tcp => ProbeKind::Tcp {
                        host: check.effective_host().to_owned(),
                        port: check.port.unwrap_or_default(),
                    },
                    // A task runs only where its driver is enabled.
                    CheckType::Exec => ProbeKind::Exec {
                        driver: driver.clone()?,
                        request: ExecRequest {
                            alloc_id: current.spec.id.clone(),
                            task: task.clone(),
                            command: check.command.clone().unwrap_or_default(),
                            args: check.args.clone().unwrap_or_default(),
                            env: task_env(spec, &agent_env),
                            user: spec.user.as_ref().map(ToString::to_string),
                            timeout,
                        },
                    },
                };
                Some(Probe {
                    name: check.name.clone(),
                    interval: check.effective_interval().get(),
                    timeout,
                    kind,
                })
            })
            .collect();
        let stop = CancellationToken::new();
        let cancelled = stop.clone();
        let reports = self.reports.clone();
        let clock = self.shared.clock;
        let reported = task.clone();
        let mut rng = fastrand::Rng::with_seed(self.rng.u64(..));
        let first_runs = move |spread: Duration| spread.mul_f64(rng.f64());
        let span = tracing::info_span!("checks", task = %task, run);
        let checks = async move {
            let report = move |check: &Name, result, repeats| {
                let report = OpReport::Check {
                    check: check.clone(),
                    result,
                    repeats,
                };
                reports.send(reported.clone(), run, report);
            };
            tokio::select! {
                biased;
                () = crate::checks::run(probes, clock, first_runs, report) => {}
                () = cancelled.cancelled() => {}
            }
        };
        tokio::spawn(tracing::Instrument::instrument(checks, span));
        self.checks.insert(
            task,
            CheckLoop {
                run,
                _stop: stop.drop_guard(),
            },
        );
    }
}
