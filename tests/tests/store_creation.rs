//! A new store's creation, which may overlap task starts: at a lower CPU priority than the
//! agent's, with RocksDB's own threads left at the agent's. A test binary of its own, so
//! that no other test has started RocksDB's process-wide threads first.

use std::path::Path;

use stead_controller::priority::BACKGROUND_NICENESS;
use stead_controller::store::{RocksDbOptions, RocksDbStore};

/// The nice value in a `/proc/.../stat` file: the 19th field, the 17th after the
/// command's closing parenthesis.
fn nice_in(stat: &Path) -> i32 {
    let text = std::fs::read_to_string(stat).expect("reads the stat file");
    let (_, after) = text
        .rsplit_once(')')
        .expect("a stat line names its command");
    after
        .split_whitespace()
        .nth(16)
        .expect("a stat line has a nice value")
        .parse()
        .expect("the nice value is a number")
}

/// The names and nice values of this process's threads whose name starts with `prefix`.
fn threads_named(prefix: &str) -> Vec<(String, i32)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc/self/task").expect("lists the threads") {
        let dir = entry.expect("reads a thread").path();
        let Ok(name) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        let name = name.trim_end().to_owned();
        if name.starts_with(prefix) {
            found.push((name, nice_in(&dir.join("stat"))));
        }
    }
    found
}

#[test]
fn a_store_created_in_the_background_runs_lower_and_leaves_rocksdbs_threads_at_the_agents_priority()
{
    let agent = nice_in(Path::new("/proc/thread-self/stat"));
    let dir = tempfile::tempdir().expect("makes a temporary dir");
    let path = dir.path().join("state");
    let (opener, store) = std::thread::spawn(move || {
        let store = RocksDbStore::create_in_background(&path, RocksDbOptions::default())
            .expect("creates the store");
        (nice_in(Path::new("/proc/thread-self/stat")), store)
    })
    .join()
    .expect("the creating thread ends");
    assert_eq!(opener, (agent + BACKGROUND_NICENESS).min(19));
    let rocksdb = threads_named("rocksdb:");
    assert!(
        rocksdb.len() >= 2,
        "a flush and a compaction thread run: {rocksdb:?}"
    );
    for (name, nice) in &rocksdb {
        assert_eq!(*nice, agent, "{name} keeps the agent's priority");
    }
    // The agent's own thread is as it was.
    assert_eq!(nice_in(Path::new("/proc/thread-self/stat")), agent);
    drop(store);
}
