//! The end of a revision or an alloc: the sticky disk handed to the next revision, garbage
//! collection, and removal from the store and the node.

use super::*;

impl Worker {
    /// Garbage collection: removes the alloc dir (off the runtime's threads), then the
    /// record, and leaves; answers `reply` once done.
    pub(super) async fn collect(
        &mut self,
        reply: oneshot::Sender<Result<(), CommandError>>,
    ) -> Step {
        let dir = match (&self.shared.alloc_dirs, &self.current) {
            (Some(dirs), Some(current)) => Some(dirs.alloc(&current.spec.id)),
            _ => None,
        };
        if let Some(dir) = dir {
            let removed = tokio::task::spawn_blocking(move || dir.remove()).await;
            if let Ok(Err(error)) = removed {
                tracing::warn!(error = %error_chain(&error), "cannot remove the alloc dir");
            }
        }
        tracing::info!("garbage collected");
        let step = self.destroy().await;
        let _ = reply.send(Ok(()));
        step
    }

    /// The old revision is terminal and `next` takes over: with a sticky (or migrating)
    /// ephemeral disk, the old alloc dir's `alloc/data` and each shared task's `local`
    /// move into the new one before any of its tasks start; then the old alloc dir goes
    /// (nothing refers to it any more: the record now follows the new revision).
    ///
    /// When the sticky disk cannot be moved, the old alloc dir is kept whole and the error
    /// returned: what was moved stays moved, and the next try moves the rest.
    pub(super) fn hand_over_alloc_dir(&self, next: &ValidSpec) -> Result<(), AllocDirError> {
        let (Some(dirs), Some(current)) = (&self.shared.alloc_dirs, &self.current) else {
            return Ok(());
        };
        if current.spec.id == next.id {
            return Ok(()); // two revisions sharing an id prefix share the directory too
        }
        let old = dirs.alloc(&current.spec.id);
        let new = dirs.alloc(&next.id);
        let disk = next.spec.spec.ephemeral_disk.as_ref();
        let sticky = disk.is_some_and(|d| d.sticky == Some(true) || d.migrate == Some(true));
        if sticky {
            let tasks: Vec<Name> = next
                .spec
                .spec
                .tasks
                .iter()
                .filter(|t| {
                    current
                        .spec
                        .spec
                        .spec
                        .tasks
                        .iter()
                        .any(|o| o.name == t.name)
                })
                .map(|t| t.name.clone())
                .collect();
            // A few renames on one filesystem: done here, before the new revision exists,
            // so no task of it can start first.
            new.migrate_from(&old, &tasks)?;
            tracing::info!(from = %current.spec.id, to = %next.id, "sticky disk migrated");
        }
        // The replaced revision's logs stay readable (`alloc logs --previous`) until the
        // alloc is collected; without them the new revision still starts.
        match new.keep_logs_of(&old) {
            Ok(()) => {
                tracing::info!(from = %current.spec.id, to = %next.id, "logs of the replaced revision kept")
            }
            Err(error) => {
                tracing::warn!(error = %error_chain(&error), "cannot keep the logs of the replaced revision")
            }
        }
        // Moved out of the alloc's ids at once, then removed off the worker: its
        // supervisors may still be writing their exit records, and an agent killed before
        // the removal ends leaves a dir that garbage collection's orphan pass removes.
        // With it go the dirs of this alloc's other revisions that an agent killed during
        // a hand-over left (found at the restore): built for a revision that the spec
        // moved on from before it was stored. Their runs were stopped before any
        // hand-over, as every run no record names is. Not with a sticky disk: a migration
        // cut short may have left its data in one of them. The list is kept: at any
        // hand-over the only dirs in use are the current revision's and the next one's,
        // and retiring a dir already gone does nothing.
        let mut leftovers = vec![current.spec.id.to_string()];
        if !sticky {
            leftovers.extend(
                self.other_revisions
                    .iter()
                    .filter(|id| **id != next.id.as_str())
                    .cloned(),
            );
        }
        let retired: Vec<AllocDir> = leftovers.iter().filter_map(|id| dirs.retire(id)).collect();
        if !retired.is_empty() {
            tokio::task::spawn_blocking(move || {
                for dir in retired {
                    if let Err(error) = dir.remove() {
                        tracing::warn!(error = %error_chain(&error), "cannot remove a replaced alloc dir");
                    }
                }
            });
        }
        Ok(())
    }

    /// The alloc is terminal and its spec is gone: release everything and leave.
    pub(super) async fn destroy(&mut self) -> Step {
        if let Some(current) = self.current.take() {
            for handle in Arc::unwrap_or_clone(current.handles).into_values() {
                if let Some(driver) = self.shared.drivers.get(handle.driver) {
                    tokio::spawn(async move { driver.destroy(&handle).await });
                }
            }
        }
        self.finish_destroy().await
    }

    /// Removes the alloc from the store, the status map and the registry, unless a new
    /// spec arrived meanwhile.
    ///
    /// A delete the store refuses is retried with the writes' backoff, the alloc shown
    /// (as stopped) and the store behind meanwhile: the node never reads healthy, nor
    /// shows the alloc gone, while its record remains (to bring it back at the next
    /// restore). An agent that leaves gives up; the next one removes the record again.
    pub(super) async fn finish_destroy(&mut self) -> Step {
        self.shared.config.devices.release(&self.name);
        let now = self.shared.clock.now();
        if self.shutdown.is_none()
            && let Some(retry) = &self.store_retry
            && now < retry.at
        {
            return Step::Wait(Some(retry.at));
        }
        let delete = StoreWrite::Delete(self.name.clone());
        match self.shared.writer.write(delete).await {
            Ok(()) => {
                if self.store_retry.take().is_some() {
                    self.shared.store_recovered(&self.name);
                }
            }
            Err(error) => {
                self.shared.report_store_error(&self.name, &error);
                if self.shutdown.is_none() {
                    let retry = self.store_retry.get_or_insert_with(|| StoreRetry {
                        at: now,
                        delays: store_backoff(self.rng.u64(..)),
                    });
                    let delay = retry.delays.next().unwrap_or(STORE_RETRY_MAX);
                    retry.at = now + delay;
                    return Step::Wait(Some(retry.at));
                }
            }
        }
        if self.shared.retire(&self.name, &self.mailbox) {
            Step::Exit
        } else {
            Step::Again
        }
    }

    /// Why a restored alloc cannot resume for want of its alloc dir: a task of a driver
    /// that builds one (exec) has started, yet the dir is gone.
    pub(super) fn missing_alloc_dir(&self, spec: &ValidSpec, state: &AllocState) -> Option<String> {
        let root = self.shared.alloc_dirs.as_ref()?.root();
        let needs_dir = spec.spec.spec.tasks.iter().any(|task| {
            task.driver == stead_schemas::spec::DriverKind::Exec
                && state
                    .tasks
                    .get(&task.name)
                    .is_some_and(|t| t.started_at.is_some())
        });
        let dir = root.join(spec.id.as_str());
        (needs_dir && !dir.is_dir()).then(|| {
            format!(
                "alloc {}: alloc dir {} is missing, so its tasks cannot be resumed",
                self.name,
                dir.display()
            )
        })
    }
}
