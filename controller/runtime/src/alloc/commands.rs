//! The worker's user commands: restart, signal, exec, and garbage collection's request.

use super::*;

impl Worker {
    /// Whether garbage collection may destroy the alloc now: its spec is gone, and it is
    /// terminal with no driver operation in flight.
    pub(super) fn collectable(&self) -> bool {
        matches!(self.target, Target::Absent)
            && self.ops.is_empty()
            && self
                .current
                .as_ref()
                .is_some_and(|c| !c.desired.run && c.state.is_terminal())
    }

    pub(super) fn handle_command(&mut self, command: UserCommand, now: Timestamp) {
        if let UserCommand::SetStopped { stopped, reply } = command {
            let _ = reply.send(self.set_stopped(stopped));
            return;
        }
        if self.broken.is_some()
            && let UserCommand::Restart { reply, .. } = command
        {
            // Starting afresh is the way out of a record that cannot be used.
            let result = revision::restart_broken(self.revision_inputs().target);
            if result.is_ok() {
                self.broken = None;
            }
            let _ = reply.send(result.map_err(CommandError::Refused));
            return;
        }
        let command = match command {
            UserCommand::Collect { reply } => {
                let refused = if self.collectable() {
                    self.collect.replace(reply)
                } else {
                    Some(reply)
                };
                if let Some(reply) = refused {
                    let _ = reply.send(Err(CommandError::NotCollectable {
                        name: self.name.to_string(),
                    }));
                }
                return;
            }
            command => command,
        };
        let Some(current) = &mut self.current else {
            let error = CommandError::Refused(CommandRefusal::TaskNotRunning);
            match command {
                UserCommand::Restart { reply, .. }
                | UserCommand::Signal { reply, .. }
                | UserCommand::Collect { reply } => {
                    let _ = reply.send(Err(error));
                }
                // Answered above.
                UserCommand::SetStopped { .. } => {}
                UserCommand::Exec { reply, .. } => {
                    let _ = reply.send(Err(error));
                }
            }
            return;
        };
        match command {
            UserCommand::Collect { reply } => {
                let _ = reply.send(Err(CommandError::NotCollectable {
                    name: self.name.to_string(),
                }));
            }
            // Answered above.
            UserCommand::SetStopped { .. } => {}
            UserCommand::Exec { task, reply } => {
                let result = current
                    .state
                    .may_exec(&current.desired, &task)
                    .map_err(CommandError::from)
                    .and_then(|()| {
                        self.exec_target(&task)
                            .ok_or(CommandError::Refused(CommandRefusal::TaskNotRunning))
                    });
                let _ = reply.send(result);
            }
            UserCommand::Restart { task, reply } => {
                let result = current
                    .state
                    .request_restart(&current.desired, task.as_ref(), now)
                    .map_err(CommandError::from);
                let _ = reply.send(result);
            }
            UserCommand::Signal {
                task,
                signal,
                reply,
            } => {
                let result =
                    current
                        .state
                        .request_signal(&current.desired, &task, signal.clone(), now);
                match result {
                    Err(refusal) => {
                        let _ = reply.send(Err(refusal.into()));
                    }
                    Ok(_) => match self.driver_and_handle(&task) {
                        Some((driver, handle)) => {
                            tokio::spawn(async move {
                                let result =
                                    driver.signal(&handle, &signal).await.map_err(|source| {
                                        CommandError::Driver {
                                            task: task.to_string(),
                                            source,
                                        }
                                    });
                                let _ = reply.send(result);
                            });
                        }
                        None => {
                            let _ = reply.send(Err(CommandRefusal::TaskNotRunning.into()));
                        }
                    },
                }
            }
        }
    }

    /// A user's stop (`stopped`) or start: kept until the other, whatever the spec's
    /// revisions. A start cannot overrule the spec itself: only an edit runs an alloc
    /// whose spec says stop, or one whose spec is gone.
    fn set_stopped(&mut self, stopped: bool) -> Result<(), CommandError> {
        let name = self.name.to_string();
        if !stopped {
            match &self.target {
                Target::Absent => return Err(CommandError::SpecGone { name }),
                Target::Spec(spec)
                    if spec.spec.spec.desired_status == Some(DesiredStatus::Stop) =>
                {
                    return Err(CommandError::SpecStops { name });
                }
                Target::Spec(_) => {}
            }
        }
        if self.stopped_by_user != stopped {
            self.stopped_by_user = stopped;
            if stopped {
                tracing::info!(alloc = %self.name, reason = "a user stopped it", "stopping");
            } else {
                tracing::info!(alloc = %self.name, reason = "a user started it", "starting");
            }
        }
        Ok(())
    }
}
