//! Helpers shared by the scenario tests in `tests/tests/`.

use std::path::{Path, PathBuf};

/// The `tests/` package directory; fixtures live below it.
pub fn package_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The workspace root.
pub fn workspace_dir() -> PathBuf {
    package_dir()
        .parent()
        .expect("the tests package sits in the workspace")
        .to_owned()
}

/// The file `compiler -print-file-name=NAME` names, when it is one: whether the
/// toolchain has an archive such as `libc.a` or `libstdc++.a` to link statically.
pub fn compiler_file(compiler: &str, name: &str) -> Option<PathBuf> {
    let output = std::process::Command::new(compiler)
        .arg(format!("-print-file-name={name}"))
        .output()
        .ok()
        .filter(|output| output.status.success())?;
    Some(PathBuf::from(
        String::from_utf8_lossy(&output.stdout).trim(),
    ))
    .filter(|path| path.is_absolute() && path.is_file())
}

/// Runs the `stead` CLI in-process with `args` (without the program name); returns the
/// exit code, stdout and stderr.
pub fn stead(args: &[&str]) -> (u8, String, String) {
    let mut out = Vec::new();
    let mut err = Vec::new();
    let argv = std::iter::once("stead").chain(args.iter().copied());
    let code = stead_controller::cli::run(argv, &mut out, &mut err);
    (
        code,
        String::from_utf8(out).expect("the CLI prints utf-8"),
        String::from_utf8(err).expect("the CLI prints utf-8"),
    )
}

/// Compares `actual` with the snapshot file at `path`. With `UPDATE_EXPECT=1` in the
/// environment the snapshot is (re)written instead; otherwise a missing or different
/// snapshot is returned as a message describing the difference.
pub fn check_snapshot(path: &Path, actual: &str) -> Result<(), String> {
    if std::env::var_os("UPDATE_EXPECT").is_some() {
        std::fs::write(path, actual).map_err(|e| format!("{}: {e}", path.display()))?;
        return Ok(());
    }
    let expected = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "{}: {e}; run with UPDATE_EXPECT=1 to create it, then review it",
            path.display()
        )
    })?;
    if expected == actual {
        Ok(())
    } else {
        Err(format!(
            "{} differs (UPDATE_EXPECT=1 rewrites it)\n--- expected\n{expected}\n--- actual\n{actual}",
            path.display()
        ))
    }
}

/// The tasks' parent cgroup of the agents whose files are in `dir`, a temporary dir:
/// agents of one test process sit in one cgroup and their allocs' ids repeat, so each
/// test's agents get their own, named for the dir (unique), the same across restarts.
pub fn cgroup_parent(dir: &std::path::Path) -> String {
    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    let name: String = name.chars().filter(char::is_ascii_alphanumeric).collect();
    format!("stead-test-{name}")
}

/// The cgroups named `parent` (made by [`cgroup_parent`]'s agents), in every
/// hierarchy below `/sys/fs/cgroup`.
pub fn test_cgroups(parent: &str) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![(std::path::PathBuf::from("/sys/fs/cgroup"), 0)];
    while let Some((dir, depth)) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.filter_map(Result::ok) {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if entry.file_name() == parent {
                found.push(entry.path());
            } else if depth < 6 {
                dirs.push((entry.path(), depth + 1));
            }
        }
    }
    found.sort();
    found
}

/// The dirs directly below `dir`.
pub fn subdirs(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Kills every process in the cgroups named `parent` and below them, in every
/// hierarchy, and removes them: an agent a test killed leaves its tasks running, and
/// their cgroups, by design.
pub fn remove_test_cgroups(parent: &str) {
    for root in test_cgroups(parent) {
        let mut tree = subdirs(&root);
        tree.push(root);
        for dir in &tree {
            for _ in 0..200 {
                for pid in std::fs::read_to_string(dir.join("cgroup.procs"))
                    .unwrap_or_default()
                    .lines()
                {
                    if let Some(pid) = pid.parse().ok().and_then(rustix::process::Pid::from_raw) {
                        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                    }
                }
                if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }
}

/// Whether the tests run as root (some checks need it, others assume it).
pub fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            == Some("0")
    })
}

/// Taken by the tests that run real agents and bound how long something takes, and by the
/// heaviest of them (the crash test): the scenario tests share one process and its two
/// test threads, so such tests take turns rather than measure each other's load.
pub fn real_time_turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
