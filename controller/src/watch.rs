//! File events for the specs directory: a `notify` watcher that wakes the specs loop,
//! which then lists the directory again.
//!
//! Events carry no meaning here beyond "look again": the listing is the level, so a
//! merged or duplicated event costs at most latency, and the periodic resync catches
//! whatever the watcher missed (an overflowed inotify queue, a directory that did not
//! exist yet). The directory is watched recursively, as the listing walks it, so an
//! editor's save by rename (`web.yaml.tmp` → `web.yaml`) is seen as the rename it is.
//!
//! The watcher hands over raw events; the loop does the debouncing (it waits
//! [`DEBOUNCE`] after a wake-up, then lists once). A debouncer that interprets events
//! would be wrong here: one that drops a file's creation and removal when both fall in
//! its window never wakes the loop for the removal, yet a resync between the two may
//! already have started the file's alloc.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::event::{AccessKind, AccessMode};
use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use thiserror::Error;
use tokio::sync::Notify;

use crate::spec_files::is_ignored_name;

/// How long the loop lets a burst of events settle before it lists. Editors write a file
/// in a few syscalls within a millisecond or two; 20 ms merges those and keeps a new
/// file's tasks well within 100 ms of the write.
pub const DEBOUNCE: Duration = Duration::from_millis(20);

/// The specs directory could not be watched.
#[derive(Debug, Error)]
#[error("cannot watch {}", path.display())]
pub struct WatchError {
    /// The directory.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: notify::Error,
}

/// A running watcher; dropping it stops watching.
pub struct SpecsWatcher {
    _watcher: RecommendedWatcher,
}

impl std::fmt::Debug for SpecsWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpecsWatcher").finish_non_exhaustive()
    }
}

impl SpecsWatcher {
    /// Watches `dir` (recursively) and calls `wake.notify_one()` for every event that may
    /// change the listing. A wake-up that arrives while the loop is busy is kept (one
    /// permit), so the loop lists once more after its current pass.
    pub fn start(dir: &Path, wake: Arc<Notify>) -> Result<Self, WatchError> {
        let error = |source| WatchError {
            path: dir.to_owned(),
            source,
        };
        let mut watcher =
            notify::recommended_watcher(move |result: notify::Result<notify::Event>| {
                let relevant = match result {
                    Ok(event) => may_change_listing(&event),
                    // Errors (an overflowed queue among them) mean events were lost: look again.
                    Err(_) => true,
                };
                if relevant {
                    wake.notify_one();
                }
            })
            .map_err(error)?;
        watcher
            .watch(dir, RecursiveMode::Recursive)
            .map_err(error)?;
        Ok(SpecsWatcher { _watcher: watcher })
    }
}

/// Whether `event` may change what a listing finds. Opening and reading files (the
/// listing itself does that) changes nothing, and neither does anything done to hidden
/// files or editor temporaries, unless the event also names another path (a rename of
/// `web.yaml.tmp` over `web.yaml` names both).
pub fn may_change_listing(event: &notify::Event) -> bool {
    if event.need_rescan() {
        return true;
    }
    let kind_matters = match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        _ => true,
    };
    kind_matters
        && (event.paths.is_empty()
            || event.paths.iter().any(|path| {
                path.file_name()
                    .and_then(|name| name.to_str())
                    .is_none_or(|name| !is_ignored_name(name))
            }))
}

#[cfg(test)]
mod tests {
    use notify::event::{CreateKind, ModifyKind, RenameMode};

    use super::*;

    fn event(kind: EventKind, paths: &[&str]) -> notify::Event {
        let mut event = notify::Event::new(kind);
        for path in paths {
            event = event.add_path(PathBuf::from(path));
        }
        event
    }

    #[test]
    fn reading_files_and_touching_editor_temporaries_do_not_wake_the_loop() {
        let open = EventKind::Access(AccessKind::Open(AccessMode::Any));
        assert!(!may_change_listing(&event(open, &["/s/web.yaml"])));
        let closed_after_reading = EventKind::Access(AccessKind::Close(AccessMode::Read));
        assert!(!may_change_listing(&event(
            closed_after_reading,
            &["/s/web.yaml"]
        )));
        let create = EventKind::Create(CreateKind::File);
        assert!(!may_change_listing(&event(create, &["/s/.web.yaml.swp"])));
        assert!(!may_change_listing(&event(create, &["/s/web.yaml.tmp"])));
    }

    #[test]
    fn writes_creations_and_renames_over_a_spec_wake_the_loop() {
        let written = EventKind::Access(AccessKind::Close(AccessMode::Write));
        assert!(may_change_listing(&event(written, &["/s/web.yaml"])));
        let create = EventKind::Create(CreateKind::File);
        assert!(may_change_listing(&event(create, &["/s/web.yaml"])));
        let rename = EventKind::Modify(ModifyKind::Name(RenameMode::Both));
        assert!(may_change_listing(&event(
            rename,
            &["/s/web.yaml.tmp", "/s/web.yaml"]
        )));
        assert!(may_change_listing(&event(EventKind::Any, &[])));
    }
}

#[cfg(test)]
mod watching {
    use super::*;

    /// Waits for one wake-up, or fails after a deadline far above any inotify latency.
    async fn woken(wake: &Notify) {
        tokio::time::timeout(Duration::from_secs(10), wake.notified())
            .await
            .expect("the watcher wakes the loop");
    }

    #[tokio::test]
    async fn a_file_created_and_removed_at_once_still_wakes_the_loop() {
        // A resync may list between the two and start the file's alloc; only a wake-up
        // for the removal stops it again.
        let dir = tempfile::tempdir().expect("temp dir");
        let wake = Arc::new(Notify::new());
        let _watcher = SpecsWatcher::start(dir.path(), wake.clone()).expect("watching");
        let file = dir.path().join("web.yaml");
        std::fs::write(&file, "x").expect("written");
        std::fs::remove_file(&file).expect("removed");
        woken(&wake).await;
    }

    #[tokio::test]
    async fn removing_a_spec_that_existed_before_the_watch_wakes_the_loop() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("web.yaml");
        std::fs::write(&file, "x").expect("written");
        let wake = Arc::new(Notify::new());
        let _watcher = SpecsWatcher::start(dir.path(), wake.clone()).expect("watching");
        std::fs::remove_file(&file).expect("removed");
        woken(&wake).await;
    }
}
