//! File events for the specs directory: a `notify` watcher that wakes the specs loop,
//! which then lists the directory again.
//!
//! Events carry no meaning here beyond "look again": the listing is the level, so a
//! merged or duplicated event costs at most latency, and the periodic resync catches
//! whatever the watcher missed (an overflowed inotify queue, a directory that did not
//! exist yet). The directory is watched recursively, as the listing walks it, so an
//! editor's save by rename (`web.yaml.tmp` → `web.yaml`) is seen as the rename it is.
//!
//! The directory itself may be replaced (renamed away and made again, or a symlink to it
//! swapped, as deploy tools do): its parent is watched too, for events naming it, and
//! [`SpecsWatcher::watches`] tells the loop when the directory it watches is no longer
//! the one at the path, so that it starts a new watcher.
//!
//! The watcher hands over raw events; the loop does the debouncing (it waits
//! [`DEBOUNCE`] after a wake-up, then lists once). A debouncer that interprets events
//! would be wrong here: one that drops a file's creation and removal when both fall in
//! its window never wakes the loop for the removal, yet a resync between the two may
//! already have started the file's alloc.

use std::ffi::OsStr;
use std::os::unix::fs::MetadataExt;
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
    /// The watched directory's device and inode, or `None` when it did not exist.
    identity: Option<(u64, u64)>,
}

/// The device and inode of the directory at `dir` (through symlinks), if there is one.
fn identity(dir: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(dir)
        .ok()
        .filter(std::fs::Metadata::is_dir)
        .map(|meta| (meta.dev(), meta.ino()))
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
    ///
    /// A missing `dir` is watched for through its parent alone (an error when the parent
    /// is missing too); the loop starts a new watcher once [`Self::watches`] says so.
    pub fn start(dir: &Path, wake: Arc<Notify>) -> Result<Self, WatchError> {
        let error = |source| WatchError {
            path: dir.to_owned(),
            source,
        };
        let absolute = std::path::absolute(dir).map_err(|e| error(notify::Error::io(e)))?;
        let parent = absolute.parent().map(Path::to_owned);
        let name = absolute.file_name().map(ToOwned::to_owned);
        let (filter_parent, filter_name) = (parent.clone(), name.clone());
        let mut watcher =
            notify::recommended_watcher(move |result: notify::Result<notify::Event>| {
                let relevant = match result {
                    Ok(event) => {
                        wakes_the_loop(&event, filter_parent.as_deref(), filter_name.as_deref())
                    }
                    // Errors (an overflowed queue among them) mean events were lost: look again.
                    Err(_) => true,
                };
                if relevant {
                    wake.notify_one();
                }
            })
            .map_err(error)?;
        // The parent first: a directory made after this is seen being made.
        if let Some(parent) = parent.as_deref().filter(|_| name.is_some()) {
            watcher
                .watch(parent, RecursiveMode::NonRecursive)
                .map_err(error)?;
        }
        let identity = identity(&absolute);
        if identity.is_some() {
            watcher
                .watch(&absolute, RecursiveMode::Recursive)
                .map_err(error)?;
        } else if parent.is_none() || name.is_none() {
            return Err(error(notify::Error::path_not_found()));
        }
        Ok(SpecsWatcher {
            _watcher: watcher,
            identity,
        })
    }

    /// Whether the directory at `dir` is still the one this watcher watches (or, when
    /// there was none, there still is none).
    pub fn watches(&self, dir: &Path) -> bool {
        identity(dir) == self.identity
    }
}

/// Whether `event`, from the watch on the specs directory (named `name` in `parent`) or
/// the one on its parent, should wake the loop: in the parent, only a change to the
/// directory itself does (not reading it, and not its neighbours); inside it, whatever
/// [`may_change_listing`] says; an event that lost others (an overflowed queue) always.
pub fn wakes_the_loop(event: &notify::Event, parent: Option<&Path>, name: Option<&OsStr>) -> bool {
    if event.need_rescan() || event.paths.is_empty() {
        return true;
    }
    let (in_parent, inside): (Vec<&PathBuf>, Vec<&PathBuf>) =
        event.paths.iter().partition(|path| path.parent() == parent);
    let itself = in_parent.iter().any(|path| path.file_name() == name)
        && !matches!(event.kind, EventKind::Access(_));
    itself || (!inside.is_empty() && may_change_listing(event))
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
    fn in_the_parent_only_a_change_to_the_directory_itself_wakes_the_loop_and_lost_events_always_do()
     {
        let wakes = |event: &notify::Event| {
            wakes_the_loop(event, Some(Path::new("/etc")), Some(OsStr::new(".specs")))
        };
        let rename = EventKind::Modify(ModifyKind::Name(RenameMode::From));
        assert!(wakes(&event(rename, &["/etc/.specs"])), "moved away");
        let made = EventKind::Create(CreateKind::Folder);
        assert!(wakes(&event(made, &["/etc/.specs"])), "made again");
        let opened = EventKind::Access(AccessKind::Open(AccessMode::Any));
        assert!(
            !wakes(&event(opened, &["/etc/.specs"])),
            "read by a listing"
        );
        let written = EventKind::Access(AccessKind::Close(AccessMode::Write));
        assert!(!wakes(&event(written, &["/etc/agent.yaml"])), "a neighbour");
        assert!(wakes(&event(written, &["/etc/.specs/web.yaml"])), "a spec");
        assert!(!wakes(&event(written, &["/etc/.specs/.web.yaml.swp"])));
        let overflow = notify::Event::new(EventKind::Other).set_flag(notify::event::Flag::Rescan);
        assert!(wakes(&overflow), "events were lost");
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
    async fn a_replaced_directory_wakes_the_loop_and_is_no_longer_the_one_watched() {
        let parent = tempfile::tempdir().expect("temp dir");
        let dir = parent.path().join("specs");
        std::fs::create_dir(&dir).expect("made");
        let moved = Arc::new(Notify::new());
        let watcher = SpecsWatcher::start(&dir, moved.clone()).expect("watching");
        assert!(watcher.watches(&dir));
        std::fs::rename(&dir, parent.path().join("specs.old")).expect("renamed away");
        woken(&moved).await;
        assert!(!watcher.watches(&dir), "nothing is at the path");
        drop(watcher);

        // A missing directory is watched for through its parent.
        let made = Arc::new(Notify::new());
        let watcher = SpecsWatcher::start(&dir, made.clone()).expect("watching the parent");
        assert!(watcher.watches(&dir), "still nothing at the path");
        std::fs::create_dir(&dir).expect("made again");
        woken(&made).await;
        assert!(!watcher.watches(&dir), "a new directory is at the path");
    }

    #[tokio::test]
    async fn files_beside_the_directory_do_not_wake_the_loop() {
        let parent = tempfile::tempdir().expect("temp dir");
        let dir = parent.path().join("specs");
        std::fs::create_dir(&dir).expect("made");
        let wake = Arc::new(Notify::new());
        let _watcher = SpecsWatcher::start(&dir, wake.clone()).expect("watching");
        std::fs::write(parent.path().join("agent.yaml"), "x").expect("written");
        assert!(
            tokio::time::timeout(Duration::from_millis(200), wake.notified())
                .await
                .is_err(),
            "a file beside the specs dir woke the loop"
        );
        // The watcher does watch: a spec wakes it.
        std::fs::write(dir.join("web.yaml"), "x").expect("written");
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
