//! Alloc dirs: the directory tree of one alloc on disk.
//!
//! ```text
//! <data-dir>/allocs/                    0711, the agent's: traversed, not listed
//! <data-dir>/allocs/<alloc-id>/          0755, the agent's
//!   alloc/                               0755, shared by the alloc's tasks
//!     data/                              0777, the ephemeral disk (sticky: migrated)
//!     logs/                              0755, `<task>.stdout.N`, written by supervisors
//!     tmp/                               1777
//!   <task>/                              0755, the agent's; the task's cwd
//!     local/                             0755, the task user's
//!     secrets/                           0700, the task user's
//!     tmp/                               0700, the task user's
//!     .stead/                            0700, the agent's: its supervisor's records
//! ```
//!
//! Building is idempotent and safe to run concurrently (two tasks of one alloc start at
//! once): every directory is created if missing, then given its mode (and owner)
//! exactly, whatever the umask. One that already existed is first checked to be a real
//! directory, not a symlink; one this call made is known to be, and is only `chmod`ed
//! when the umask took bits from its mode (a task start makes ten).
//! Paths are built only from validated names ([`AllocId`], [`Name`]), never from text
//! that could hold `/` or `..`; the task name `alloc` is refused, since it would be the
//! shared directory.

use std::fs::{self, DirBuilder, Permissions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use stead_schemas::AllocId;
use stead_schemas::spec::Name;

/// The name of the directory shared by an alloc's tasks.
pub const SHARED_DIR: &str = "alloc";
/// The name of a task dir's directory for the agent's own records.
pub const CONTROL_DIR: &str = ".stead";
/// Under `alloc/logs`: the logs of the revision this one replaced.
pub const PREVIOUS_LOGS: &str = "previous";

/// A directory of an alloc dir that could not be set up or removed.
#[derive(Debug, thiserror::Error)]
pub enum AllocDirError {
    /// Creating a directory failed.
    #[error("creating directory {path}")]
    Create {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Something other than a directory (a symlink, a file) is in the way.
    #[error("{path} exists and is not a directory")]
    NotADirectory {
        /// The path.
        path: PathBuf,
    },
    /// Setting a directory's mode failed.
    #[error("setting the mode of {path} to {mode:o}")]
    Mode {
        /// The directory.
        path: PathBuf,
        /// The mode.
        mode: u32,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Handing a directory to the task's user failed.
    #[error("changing the owner of {path} to {uid}:{gid}")]
    Owner {
        /// The directory.
        path: PathBuf,
        /// The user id.
        uid: u32,
        /// The group id.
        gid: u32,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Moving a sticky directory into the replacing alloc failed.
    #[error("moving {from} to {to}")]
    Migrate {
        /// The old directory.
        from: PathBuf,
        /// Where it was to go.
        to: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Removing an alloc dir failed.
    #[error("removing {path}")]
    Remove {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A name that cannot be a directory of an alloc dir.
    #[error("{name:?} cannot name a directory of an alloc dir: {reason}")]
    InvalidName {
        /// The name.
        name: String,
        /// Why not.
        reason: &'static str,
    },
}

/// The prefix of an alloc dir moved aside to be removed ([`AllocDirs::retire`]): no alloc
/// name starts with a dot.
const RETIRED: &str = ".retired-";

/// The root of every alloc dir: `<data-dir>/allocs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocDirs {
    root: PathBuf,
}

impl AllocDirs {
    /// The alloc dirs below `data_dir`.
    pub fn new(data_dir: &Path) -> Self {
        AllocDirs {
            root: data_dir.join("allocs"),
        }
    }

    /// `<data-dir>/allocs`.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The alloc dir of `alloc_id` (not created yet).
    pub fn alloc(&self, alloc_id: &AllocId) -> AllocDir {
        AllocDir {
            path: self.root.join(alloc_id.as_str()),
        }
    }

    /// Moves the alloc dir of `alloc_id` out of every alloc's ids, to
    /// `.retired-<alloc id>` beside it, and returns it there to be removed; `None` when
    /// there is no such dir. Once moved, nothing adds to it by its old path (a replaced
    /// revision's supervisor writes its exit record after it reports the exit, and a
    /// removal racing that write failed), and a crash before its removal ends leaves a
    /// dir no alloc claims, which the orphan pass of garbage collection removes. Where
    /// the move fails (a retired dir of that id is still there and not yet emptied; an
    /// empty one is replaced), the dir is returned where it is.
    pub fn retire(&self, alloc_id: &str) -> Option<AllocDir> {
        let dir = self.alloc_by_id(alloc_id).ok()?;
        let retired = self.root.join(format!("{RETIRED}{alloc_id}"));
        match fs::rename(dir.path(), &retired) {
            Ok(()) => Some(AllocDir { path: retired }),
            Err(error) if error.kind() == io::ErrorKind::NotFound => None,
            Err(_) => Some(dir),
        }
    }

    /// The alloc ids that have a dir here (names that are no alloc id, such as retired
    /// dirs, left out); none where there is no root yet (a new node).
    pub fn ids(&self) -> io::Result<Vec<String>> {
        let entries = match fs::read_dir(&self.root) {
            Ok(entries) => entries,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(error) => return Err(error),
        };
        Ok(entries
            .filter_map(Result::ok)
            .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_dir()))
            .filter_map(|entry| entry.file_name().into_string().ok())
            .filter(|id| self.alloc_by_id(id).is_ok())
            .collect())
    }

    /// The alloc dir of an alloc id read back from elsewhere (a persisted driver handle):
    /// refused unless it is a plain name (`[a-z0-9-]`, at most 128 bytes).
    pub fn alloc_by_id(&self, alloc_id: &str) -> Result<AllocDir, AllocDirError> {
        let plain = !alloc_id.is_empty()
            && alloc_id.len() <= 128
            && !alloc_id.starts_with('-')
            && alloc_id
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !plain {
            return Err(AllocDirError::InvalidName {
                name: alloc_id.to_owned(),
                reason: "an alloc id is lowercase letters, digits and '-'",
            });
        }
        Ok(AllocDir {
            path: self.root.join(alloc_id),
        })
    }
}

/// One alloc's directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocDir {
    path: PathBuf,
}

/// One task's directories inside its alloc dir.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskDir {
    /// `<alloc>/<task>`: the task's cwd.
    pub dir: PathBuf,
    /// `<alloc>/<task>/local`: the task's own files.
    pub local: PathBuf,
    /// `<alloc>/<task>/secrets`: mode 0700.
    pub secrets: PathBuf,
    /// `<alloc>/<task>/tmp`.
    pub tmp: PathBuf,
    /// `<alloc>/<task>/.stead`: the supervisor's records, the agent's only.
    pub control: PathBuf,
}

impl AllocDir {
    /// `<data-dir>/allocs/<alloc-id>`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `<alloc>/alloc`: shared by the alloc's tasks (`STEAD_ALLOC_DIR`).
    pub fn shared(&self) -> PathBuf {
        self.path.join(SHARED_DIR)
    }

    /// `<alloc>/alloc/data`.
    pub fn data(&self) -> PathBuf {
        self.shared().join("data")
    }

    /// `<alloc>/alloc/logs`: every task's log files.
    pub fn logs(&self) -> PathBuf {
        self.shared().join("logs")
    }

    /// `<alloc>/alloc/tmp`.
    pub fn tmp(&self) -> PathBuf {
        self.shared().join("tmp")
    }

    /// The directories of `task`; refuses the name of the shared directory.
    pub fn task(&self, task: &Name) -> Result<TaskDir, AllocDirError> {
        if task.as_str() == SHARED_DIR {
            return Err(AllocDirError::InvalidName {
                name: task.to_string(),
                reason: "it is the directory the alloc's tasks share",
            });
        }
        let dir = self.path.join(task.as_str());
        Ok(TaskDir {
            local: dir.join("local"),
            secrets: dir.join("secrets"),
            tmp: dir.join("tmp"),
            control: dir.join(CONTROL_DIR),
            dir,
        })
    }

    /// Creates the alloc dir and its shared directories, if missing.
    pub fn build(&self) -> Result<(), AllocDirError> {
        // The root is made (and its mode set) only when it is missing: once it is there,
        // making an alloc dir in it is one `mkdir`, not five system calls more.
        match make_dir(&self.path, 0o755, None) {
            Err(AllocDirError::Create { source, .. })
                if source.kind() == io::ErrorKind::NotFound =>
            {
                self.build_root()?;
                make_dir(&self.path, 0o755, None)?;
            }
            made => made?,
        }
        make_dir(&self.shared(), 0o755, None)?;
        make_dir(&self.data(), 0o777, None)?;
        make_dir(&self.logs(), 0o755, None)?;
        make_dir(&self.tmp(), 0o1777, None)
    }

    /// Creates the root of every alloc dir (and the data dir above it), if missing.
    fn build_root(&self) -> Result<(), AllocDirError> {
        let root = self.path.parent().unwrap_or(&self.path);
        if let Some(data_dir) = root.parent() {
            fs::create_dir_all(data_dir).map_err(|source| AllocDirError::Create {
                path: data_dir.to_owned(),
                source,
            })?;
        }
        // Traversable whatever the umask (a service's may be 0027): tasks that run as
        // another user reach their own dirs through it by absolute path, and cannot list
        // the other allocs. A symlink an operator put there (to a larger disk, say) is
        // theirs to set up, and is followed as it is.
        let linked = fs::symlink_metadata(root).is_ok_and(|m| m.file_type().is_symlink());
        if !linked {
            make_dir(root, 0o711, None)?;
        }
        Ok(())
    }

    /// Creates `task`'s directories (and the alloc dir's), if missing; `owner` (uid, gid)
    /// receives `local`, `secrets` and `tmp`.
    pub fn build_task(
        &self,
        task: &Name,
        owner: Option<(u32, u32)>,
    ) -> Result<TaskDir, AllocDirError> {
        let dirs = self.task(task)?;
        self.build()?;
        make_dir(&dirs.dir, 0o755, None)?;
        make_dir(&dirs.local, 0o755, owner)?;
        make_dir(&dirs.secrets, 0o700, owner)?;
        make_dir(&dirs.tmp, 0o700, owner)?;
        make_dir(&dirs.control, 0o700, None)?;
        Ok(dirs)
    }

    /// Moves the sticky disk of `old` (the alloc this one replaces) into this alloc dir:
    /// `alloc/data`, and `<task>/local` of each of `tasks` (those both revisions have).
    /// Renames only, so it is quick and never copies; what is missing in `old` is
    /// skipped. A target that already holds files (an earlier, interrupted hand-over) is
    /// kept and its source left in place.
    pub fn migrate_from(&self, old: &AllocDir, tasks: &[Name]) -> Result<(), AllocDirError> {
        self.build()?;
        move_dir(&old.data(), &self.data())?;
        for task in tasks {
            let (from, to) = (old.task(task)?, self.task(task)?);
            if !from.local.is_dir() {
                continue;
            }
            make_dir(&to.dir, 0o755, None)?;
            move_dir(&from.local, &to.local)?;
        }
        Ok(())
    }

    /// Keeps the logs of `old` (the alloc this one replaces) as this one's
    /// `alloc/logs/previous/`: the newest replaced revision's only (what `old` kept of
    /// the one before goes), moved with one rename. A `previous/` already here (an
    /// earlier, interrupted hand-over) is kept.
    pub fn keep_logs_of(&self, old: &AllocDir) -> Result<(), AllocDirError> {
        let from = old.logs();
        if !from.is_dir() {
            return Ok(());
        }
        // The revision before goes with `old`'s dir: renamed out of the way here, removed
        // with the rest later, off the worker.
        let older = from.join(PREVIOUS_LOGS);
        if let Err(source) = fs::rename(&older, old.path().join(".previous-logs"))
            && source.kind() != io::ErrorKind::NotFound
        {
            return Err(AllocDirError::Remove {
                path: older,
                source,
            });
        }
        self.build()?;
        move_dir(&from, &self.logs().join(PREVIOUS_LOGS))
    }

    /// Removes the whole alloc dir; one that does not exist is removed already.
    pub fn remove(&self) -> Result<(), AllocDirError> {
        match fs::remove_dir_all(&self.path) {
            Err(error) if error.kind() != io::ErrorKind::NotFound => Err(AllocDirError::Remove {
                path: self.path.clone(),
                source: error,
            }),
            _ => Ok(()),
        }
    }
}

/// Renames directory `from` to `to`, replacing `to` when it is an empty directory.
fn move_dir(from: &Path, to: &Path) -> Result<(), AllocDirError> {
    let error = |source| AllocDirError::Migrate {
        from: from.to_owned(),
        to: to.to_owned(),
        source,
    };
    match fs::symlink_metadata(from) {
        Ok(meta) if meta.file_type().is_dir() => {}
        Ok(_) => return Ok(()), // not a directory: nothing of ours to move
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(error(e)),
    }
    match fs::remove_dir(to) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        // Not empty: keep what the new alloc has.
        Err(e) if e.kind() == io::ErrorKind::DirectoryNotEmpty => return Ok(()),
        Err(e) => return Err(error(e)),
    }
    fs::rename(from, to).map_err(error)
}

/// The agent's umask, from `/proc/self/status` (read once; `None` where it is not shown).
fn umask() -> Option<u32> {
    static UMASK: OnceLock<Option<u32>> = OnceLock::new();
    *UMASK.get_or_init(|| {
        let status = fs::read_to_string("/proc/self/status").ok()?;
        let value = status.lines().find_map(|l| l.strip_prefix("Umask:"))?;
        u32::from_str_radix(value.trim(), 8).ok()
    })
}

/// Creates `path` if missing, checks it is a directory (not a symlink), and sets its
/// mode and, when given, its owner.
fn make_dir(path: &Path, mode: u32, owner: Option<(u32, u32)>) -> Result<(), AllocDirError> {
    let current = match DirBuilder::new().mode(mode & 0o777).create(path) {
        // Made just now: a directory, with the mode less the umask.
        Ok(()) => umask().map(|umask| mode & 0o777 & !umask),
        Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
            let metadata = fs::symlink_metadata(path).map_err(|source| AllocDirError::Create {
                path: path.to_owned(),
                source,
            })?;
            if !metadata.file_type().is_dir() {
                return Err(AllocDirError::NotADirectory {
                    path: path.to_owned(),
                });
            }
            Some(metadata.permissions().mode() & 0o7777)
        }
        Err(source) => {
            return Err(AllocDirError::Create {
                path: path.to_owned(),
                source,
            });
        }
    };
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::lchown(path, Some(uid), Some(gid)).map_err(|source| {
            AllocDirError::Owner {
                path: path.to_owned(),
                uid,
                gid,
                source,
            }
        })?;
    }
    if current != Some(mode) {
        fs::set_permissions(path, Permissions::from_mode(mode)).map_err(|source| {
            AllocDirError::Mode {
                path: path.to_owned(),
                mode,
                source,
            }
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn alloc_id() -> AllocId {
        let name: Name = "web".parse().expect("valid");
        let revision = stead_schemas::Revision::from_hex(&"ab".repeat(32)).expect("hex");
        AllocId::new(&name, &revision)
    }

    fn mode(path: &Path) -> u32 {
        fs::symlink_metadata(path)
            .expect("exists")
            .permissions()
            .mode()
            & 0o7777
    }

    #[test]
    fn the_root_is_made_when_missing_and_left_as_it_is_once_there() {
        let data = tempfile::tempdir().expect("tempdir");
        let dirs = AllocDirs::new(data.path());
        let task: Name = "server".parse().expect("valid");
        dirs.alloc(&alloc_id())
            .build_task(&task, None)
            .expect("built");
        assert_eq!(mode(dirs.root()), 0o711);
        // An operator's later choice of mode is kept by the next alloc's build.
        fs::set_permissions(dirs.root(), Permissions::from_mode(0o751)).expect("chmod");
        let other = AllocId::new(
            &"api".parse().expect("valid"),
            &stead_schemas::Revision::from_hex(&"cd".repeat(32)).expect("hex"),
        );
        dirs.alloc(&other).build_task(&task, None).expect("built");
        assert_eq!(mode(dirs.root()), 0o751);
        // A root removed meanwhile is made again, with its mode.
        fs::remove_dir_all(dirs.root()).expect("removed");
        let task_dir = dirs.alloc(&other).build_task(&task, None).expect("rebuilt");
        assert_eq!(mode(dirs.root()), 0o711);
        assert!(task_dir.secrets.is_dir());
    }

    #[test]
    fn a_task_dir_has_its_layout_and_modes_and_secrets_are_private() {
        let data = tempfile::tempdir().expect("tempdir");
        let dirs = AllocDirs::new(data.path());
        let alloc = dirs.alloc(&alloc_id());
        let task: Name = "server".parse().expect("valid");
        let task_dir = alloc.build_task(&task, None).expect("built");
        assert_eq!(task_dir.dir, alloc.path().join("server"));
        assert!(alloc.path().starts_with(data.path().join("allocs")));
        for (path, expected) in [
            (alloc.data(), 0o777),
            (alloc.logs(), 0o755),
            (alloc.tmp(), 0o1777),
            (task_dir.local.clone(), 0o755),
            (task_dir.secrets.clone(), 0o700),
            (task_dir.tmp.clone(), 0o700),
            (task_dir.control.clone(), 0o700),
        ] {
            assert_eq!(mode(&path), expected, "{}", path.display());
        }
        // Building again is a no-op, and repairs a mode changed behind our back.
        fs::set_permissions(&task_dir.secrets, Permissions::from_mode(0o755)).expect("chmod");
        alloc.build_task(&task, None).expect("rebuilt");
        assert_eq!(mode(&task_dir.secrets), 0o700);
    }

    #[test]
    fn an_allocs_dir_linked_elsewhere_by_the_operator_is_followed_as_it_is() {
        let data = tempfile::tempdir().expect("tempdir");
        let elsewhere = tempfile::tempdir().expect("tempdir");
        fs::set_permissions(elsewhere.path(), Permissions::from_mode(0o750)).expect("chmod");
        std::os::unix::fs::symlink(elsewhere.path(), data.path().join("allocs")).expect("link");
        let dirs = AllocDirs::new(data.path());
        let alloc = dirs.alloc(&alloc_id());
        let task: Name = "server".parse().expect("valid");
        let task_dir = alloc
            .build_task(&task, None)
            .expect("built through the link");
        assert!(
            elsewhere
                .path()
                .join(alloc_id().as_str())
                .join("server")
                .is_dir()
        );
        assert!(task_dir.dir.is_dir());
        assert_eq!(
            mode(elsewhere.path()),
            0o750,
            "the operator's dir is left as set"
        );
    }

    #[test]
    fn concurrent_builds_of_one_alloc_all_succeed() {
        let data = tempfile::tempdir().expect("tempdir");
        let dirs = AllocDirs::new(data.path());
        let alloc = dirs.alloc(&alloc_id());
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8)
                .map(|i| {
                    let alloc = alloc.clone();
                    scope.spawn(move || {
                        let task: Name = format!("task-{}", i % 3).parse().expect("valid");
                        alloc.build_task(&task, None).map(|_| ())
                    })
                })
                .collect();
            for handle in handles {
                handle.join().expect("no panic").expect("built");
            }
        });
        assert_eq!(mode(&alloc.data()), 0o777);
    }

    #[test]
    fn a_task_named_alloc_and_ids_that_are_not_plain_names_are_refused() {
        let data = tempfile::tempdir().expect("tempdir");
        let dirs = AllocDirs::new(data.path());
        let alloc = dirs.alloc(&alloc_id());
        let shared: Name = "alloc".parse().expect("a valid name");
        assert!(matches!(
            alloc.task(&shared),
            Err(AllocDirError::InvalidName { .. })
        ));
        for bad in ["../etc", "a/b", "", "-x", "A", ".."] {
            assert!(dirs.alloc_by_id(bad).is_err(), "{bad:?}");
        }
        assert_eq!(dirs.alloc_by_id(alloc_id().as_str()).expect("plain"), alloc);
    }

    #[test]
    fn a_symlink_in_place_of_a_directory_is_refused_and_not_followed() {
        let data = tempfile::tempdir().expect("tempdir");
        let elsewhere = tempfile::tempdir().expect("tempdir");
        let dirs = AllocDirs::new(data.path());
        let alloc = dirs.alloc(&alloc_id());
        let task: Name = "server".parse().expect("valid");
        let task_dir = alloc.build_task(&task, None).expect("built");
        fs::remove_dir(&task_dir.secrets).expect("removed");
        std::os::unix::fs::symlink(elsewhere.path(), &task_dir.secrets).expect("symlinked");
        let before = mode(elsewhere.path());
        assert!(matches!(
            alloc.build_task(&task, None),
            Err(AllocDirError::NotADirectory { .. })
        ));
        assert_eq!(mode(elsewhere.path()), before);
    }

    #[test]
    fn a_sticky_disk_moves_data_and_local_into_the_new_alloc_dir() {
        let data = tempfile::tempdir().expect("tempdir");
        let dirs = AllocDirs::new(data.path());
        let old = dirs.alloc(&alloc_id());
        let name: Name = "web".parse().expect("valid");
        let revision = stead_schemas::Revision::from_hex(&"cd".repeat(32)).expect("hex");
        let new = dirs.alloc(&AllocId::new(&name, &revision));
        let kept: Name = "server".parse().expect("valid");
        let dropped: Name = "helper".parse().expect("valid");
        let kept_dir = old.build_task(&kept, None).expect("built");
        let dropped_dir = old.build_task(&dropped, None).expect("built");
        fs::write(old.data().join("db"), "rows").expect("written");
        fs::write(kept_dir.local.join("cache"), "warm").expect("written");
        fs::write(dropped_dir.local.join("cache"), "cold").expect("written");

        new.migrate_from(&old, std::slice::from_ref(&kept))
            .expect("migrated");
        assert_eq!(
            fs::read_to_string(new.data().join("db")).expect("moved"),
            "rows"
        );
        assert_eq!(
            fs::read_to_string(new.task(&kept).expect("task").local.join("cache")).expect("moved"),
            "warm"
        );
        assert!(
            !new.path().join("helper").exists(),
            "only shared tasks move"
        );
        assert!(!old.data().exists());
        assert_eq!(
            mode(&new.data()),
            0o777,
            "the moved directory keeps its mode"
        );
    }

    #[test]
    fn a_retired_alloc_dir_is_moved_out_of_the_alloc_ids_whole_and_retiring_none_is_nothing() {
        let data = tempfile::tempdir().expect("tempdir");
        let dirs = AllocDirs::new(data.path());
        let alloc = dirs.alloc(&alloc_id());
        let task: Name = "server".parse().expect("valid");
        let task_dir = alloc.build_task(&task, None).expect("built");
        fs::write(task_dir.control.join("run.exit"), "0").expect("written");

        let retired = dirs.retire(alloc_id().as_str()).expect("moved");
        assert!(
            !alloc.path().exists(),
            "nothing is left under the alloc's id"
        );
        let name = retired
            .path()
            .file_name()
            .expect("a name")
            .to_string_lossy();
        assert_eq!(name, format!(".retired-{}", alloc_id().as_str()));
        assert!(
            dirs.alloc_by_id(&name).is_err(),
            "a retired dir is no alloc's"
        );
        let record = task_dir
            .control
            .strip_prefix(alloc.path())
            .expect("inside the alloc dir")
            .join("run.exit");
        assert_eq!(
            fs::read_to_string(retired.path().join(record)).expect("kept"),
            "0"
        );
        assert!(
            dirs.retire(alloc_id().as_str()).is_none(),
            "a dir retired already"
        );
        assert_eq!(
            dirs.ids().expect("listed"),
            Vec::<String>::new(),
            "a retired dir is no alloc id"
        );

        // A retired dir of the same id still there: the new one is removed in place.
        alloc.build().expect("built again");
        assert_eq!(dirs.ids().expect("listed"), [alloc_id().as_str()]);
        let in_place = dirs.retire(alloc_id().as_str()).expect("returned");
        assert_eq!(in_place.path(), alloc.path());
        in_place.remove().expect("removed");
        retired.remove().expect("removed");
        assert_eq!(fs::read_dir(dirs.root()).expect("listed").count(), 0);
    }

    #[test]
    fn task_directories_are_handed_to_the_tasks_user() {
        if rustix::process::geteuid().as_raw() != 0 {
            return; // only root can give directories away
        }
        let data = tempfile::tempdir().expect("tempdir");
        let alloc = AllocDirs::new(data.path()).alloc(&alloc_id());
        let task: Name = "server".parse().expect("valid");
        let task_dir = alloc
            .build_task(&task, Some((65534, 65534)))
            .expect("built");
        for path in [&task_dir.local, &task_dir.secrets, &task_dir.tmp] {
            let metadata = fs::metadata(path).expect("exists");
            assert_eq!((metadata.uid(), metadata.gid()), (65534, 65534));
        }
        assert_eq!(fs::metadata(&task_dir.control).expect("exists").uid(), 0);
        alloc.remove().expect("removed");
        assert!(!alloc.path().exists());
        alloc.remove().expect("removing twice is fine");
    }
}
