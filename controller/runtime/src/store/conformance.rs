//! Test support: the behaviour every [`Store`] implementation must have, as functions that
//! panic on the first deviation.
//!
//! An implementation's tests call [`run_all`] with a constructor of fresh, empty stores.
//! The checks that need a damaged record plant raw bytes through [`PlantRaw`], which each
//! implementation provides in its own way. These are plain functions rather than
//! `#[cfg(test)]` ones so that the tests of other crates can run them too.

use std::collections::BTreeMap;
use std::time::Duration;

use stead_reconcilers::alloc::{AllocDesired, AllocState, Limits};
use stead_schemas::device::AssignedDevice;
use stead_schemas::record::{ALLOC_RECORD_VERSION, AllocRecord, RecordError};
use stead_schemas::spec::{
    API_VERSION, AllocBody, AllocSpec, DriverConfig, DriverKind, KIND_ALLOC, Metadata, MockConfig,
    Name, TaskSpec,
};
use stead_schemas::{Revision, Timestamp};

use super::{CorruptRecord, Store, handle_to_record, state_to_record};
use crate::driver::TaskHandle;

/// Test support: writing raw bytes under an alloc's key, bypassing encoding, as disk
/// corruption or another agent version would.
pub trait PlantRaw: Store {
    /// Stores `bytes` as the record of `name`; later writes of `name` must not be skipped
    /// as unchanged.
    fn plant_raw(&self, name: &str, bytes: Vec<u8>);
}

/// A valid record of a one-task alloc named `name`; records of different `generation`s
/// differ (in the task's restart count and handle), records of the same one are equal.
///
/// # Panics
///
/// When `name` is not a valid alloc name.
pub fn sample_record(name: &str, generation: u32) -> AllocRecord {
    let name: Name = name
        .parse()
        .expect("sample records need a valid alloc name");
    let task_name: Name = "server".parse().expect("a valid task name");
    let spec = AllocSpec {
        api_version: API_VERSION.to_owned(),
        kind: KIND_ALLOC.to_owned(),
        metadata: Metadata {
            name: name.clone(),
            labels: None,
            node_selector: None,
        },
        spec: AllocBody {
            alloc_type: None,
            desired_status: None,
            restart: None,
            ephemeral_disk: None,
            shutdown_delay: None,
            tasks: vec![TaskSpec {
                name: task_name.clone(),
                driver: DriverKind::Mock,
                config: DriverConfig::Mock(MockConfig::default()),
                env: None,
                user: None,
                leader: None,
                lifecycle: None,
                restart: None,
                kill_timeout: None,
                kill_signal: None,
                shutdown_delay: None,
                logs: None,
                resources: None,
                checks: None,
            }],
        },
    };
    let now = Timestamp::from_since_epoch(Duration::from_secs(1_795_306_200));
    let desired = AllocDesired::new(&spec.spec, true, Limits::default());
    let mut state = AllocState::new(&desired, now);
    for task in state.tasks.values_mut() {
        task.restarts = generation;
    }
    let handle = TaskHandle {
        driver: DriverKind::Mock,
        id: format!("{name}-server-{generation}"),
        pid: None,
        started_at: now,
    };
    AllocRecord {
        version: ALLOC_RECORD_VERSION,
        name,
        revision: Revision::of(&spec).as_str().to_owned(),
        spec,
        removed: false,
        stopped_by_user: false,
        state: state_to_record(&state),
        handles: BTreeMap::from([(task_name.to_string(), handle_to_record(&handle))]),
        devices: BTreeMap::from([(
            task_name.to_string(),
            vec![AssignedDevice {
                group: "acme/gpu/a1".parse().expect("a group id"),
                instance: format!("gpu{generation}").parse().expect("an instance id"),
            }],
        )]),
    }
}

fn alloc_name(name: &str) -> Name {
    name.parse().expect("conformance checks use valid names")
}

/// Loads every record, panicking on a store error.
fn load(store: &dyn Store, check: &str) -> Vec<Result<AllocRecord, CorruptRecord>> {
    store
        .load_allocs()
        .unwrap_or_else(|error| panic!("{check}: load_allocs failed: {error:?}"))
}

/// Loads every record, panicking on a store error or a corrupt record (`check` names
/// the caller in the panic).
pub fn load_ok(store: &dyn Store, check: &str) -> Vec<AllocRecord> {
    load(store, check)
        .into_iter()
        .map(|loaded| loaded.unwrap_or_else(|error| panic!("{check}: corrupt record: {error:?}")))
        .collect()
}

fn put(store: &dyn Store, record: &AllocRecord, check: &str) {
    store
        .put_alloc(record)
        .unwrap_or_else(|error| panic!("{check}: put_alloc failed: {error:?}"));
}

fn delete(store: &dyn Store, name: &str, check: &str) {
    store
        .delete_alloc(&alloc_name(name))
        .unwrap_or_else(|error| panic!("{check}: delete_alloc failed: {error:?}"));
}

/// An empty store loads nothing.
pub fn empty_store_loads_nothing(store: &dyn Store) {
    let check = "empty_store_loads_nothing";
    assert!(load(store, check).is_empty(), "{check}");
}

/// A record put is loaded back equal.
pub fn put_then_load_returns_the_record(store: &dyn Store) {
    let check = "put_then_load_returns_the_record";
    let record = sample_record("web", 1);
    put(store, &record, check);
    assert_eq!(load_ok(store, check), vec![record], "{check}");
}

/// A second put of the same name replaces the first.
pub fn put_replaces_the_earlier_record(store: &dyn Store) {
    let check = "put_replaces_the_earlier_record";
    put(store, &sample_record("web", 1), check);
    put(store, &sample_record("web", 2), check);
    assert_eq!(
        load_ok(store, check),
        vec![sample_record("web", 2)],
        "{check}"
    );
    assert_eq!(store.metrics().writes, 2, "{check}: both puts were writes");
}

/// Every alloc is loaded, in ascending order of name.
pub fn load_returns_every_alloc_by_name(store: &dyn Store) {
    let check = "load_returns_every_alloc_by_name";
    for name in ["web", "api", "db-2", "db-10"] {
        put(store, &sample_record(name, 0), check);
    }
    let names: Vec<String> = load_ok(store, check)
        .into_iter()
        .map(|r| r.name.to_string())
        .collect();
    assert_eq!(names, ["api", "db-10", "db-2", "web"], "{check}");
}

/// A deleted record is no longer loaded, and the others are.
pub fn delete_removes_the_record(store: &dyn Store) {
    let check = "delete_removes_the_record";
    put(store, &sample_record("web", 0), check);
    put(store, &sample_record("api", 0), check);
    delete(store, "web", check);
    assert_eq!(
        load_ok(store, check),
        vec![sample_record("api", 0)],
        "{check}"
    );
    assert_eq!(store.metrics().deletes, 1, "{check}");
}

/// Deleting a missing record, or one twice, succeeds.
pub fn delete_is_idempotent(store: &dyn Store) {
    let check = "delete_is_idempotent";
    delete(store, "never-stored", check);
    put(store, &sample_record("web", 0), check);
    delete(store, "web", check);
    delete(store, "web", check);
    assert!(load(store, check).is_empty(), "{check}");
}

/// A put of the record last written under its name is skipped and counted.
pub fn identical_put_is_skipped_and_counted(store: &dyn Store) {
    let check = "identical_put_is_skipped_and_counted";
    let before = store.metrics();
    put(store, &sample_record("web", 0), check);
    put(store, &sample_record("web", 0), check);
    put(store, &sample_record("api", 0), check);
    put(store, &sample_record("web", 1), check);
    put(store, &sample_record("web", 1), check);
    let after = store.metrics();
    assert_eq!(after.writes - before.writes, 3, "{check}: writes");
    assert_eq!(
        after.skipped_writes - before.skipped_writes,
        2,
        "{check}: skipped writes"
    );
    let loaded = load_ok(store, check);
    assert_eq!(
        loaded,
        vec![sample_record("api", 0), sample_record("web", 1)],
        "{check}"
    );
}

/// After a delete, putting the same record again writes it.
pub fn delete_resets_write_dedupe(store: &dyn Store) {
    let check = "delete_resets_write_dedupe";
    let record = sample_record("web", 0);
    put(store, &record, check);
    delete(store, "web", check);
    put(store, &record, check);
    assert_eq!(load_ok(store, check), vec![record], "{check}");
    let metrics = store.metrics();
    assert_eq!(
        (metrics.writes, metrics.skipped_writes),
        (2, 0),
        "{check}: the second put was written"
    );
}

/// A record that is not valid JSON is reported as malformed, naming its alloc, and the
/// other records still load; a later put of that alloc is written.
pub fn corrupt_record_is_reported_while_others_load(store: &dyn PlantRaw) {
    let check = "corrupt_record_is_reported_while_others_load";
    put(store, &sample_record("api", 0), check);
    put(store, &sample_record("web", 0), check);
    put(store, &sample_record("zoo", 0), check);
    store.plant_raw("web", b"\x00\xffnot a record".to_vec());
    let loaded = load(store, check);
    assert_eq!(loaded.len(), 3, "{check}: every alloc is reported");
    assert_eq!(
        loaded[0].as_ref().ok(),
        Some(&sample_record("api", 0)),
        "{check}"
    );
    assert_eq!(
        loaded[2].as_ref().ok(),
        Some(&sample_record("zoo", 0)),
        "{check}"
    );
    match &loaded[1] {
        Err(CorruptRecord {
            name,
            source: RecordError::Malformed { .. },
        }) => assert_eq!(name, "web", "{check}"),
        other => panic!("{check}: expected web to be malformed, got {other:?}"),
    }
    put(store, &sample_record("web", 0), check);
    assert_eq!(
        load_ok(store, check).len(),
        3,
        "{check}: the put repaired web"
    );
}

/// A record written by a newer agent is reported as a future version, not as garbage.
pub fn future_version_record_is_reported_as_such(store: &dyn PlantRaw) {
    let check = "future_version_record_is_reported_as_such";
    let mut record = sample_record("web", 0);
    record.version = ALLOC_RECORD_VERSION + 1;
    store.plant_raw("web", record.encode());
    put(store, &sample_record("api", 0), check);
    let loaded = load(store, check);
    assert_eq!(loaded.len(), 2, "{check}");
    assert_eq!(
        loaded[0].as_ref().ok(),
        Some(&sample_record("api", 0)),
        "{check}"
    );
    match &loaded[1] {
        Err(CorruptRecord {
            name,
            source: RecordError::FutureVersion { found, supported },
        }) => {
            assert_eq!(name, "web", "{check}");
            assert_eq!(
                (*found, *supported),
                (ALLOC_RECORD_VERSION + 1, ALLOC_RECORD_VERSION),
                "{check}"
            );
        }
        other => panic!("{check}: expected a future version, got {other:?}"),
    }
}

/// A record stored under another alloc's name is reported under the name it is stored at.
pub fn record_under_another_name_is_corrupt(store: &dyn PlantRaw) {
    let check = "record_under_another_name_is_corrupt";
    store.plant_raw("web", sample_record("api", 0).encode());
    let loaded = load(store, check);
    match loaded.as_slice() {
        [
            Err(CorruptRecord {
                name,
                source: RecordError::NameMismatch { found },
            }),
        ] => {
            assert_eq!(name, "web", "{check}");
            assert_eq!(found.as_str(), "api", "{check}");
        }
        other => panic!("{check}: expected one name mismatch, got {other:?}"),
    }
}

/// Enough records for a load spread over several threads come back in order of name,
/// each equal to what was put, and the one damaged in its place.
pub fn a_load_of_many_records_keeps_their_order_and_their_damage_in_place(store: &dyn PlantRaw) {
    let check = "a_load_of_many_records_keeps_their_order_and_their_damage_in_place";
    let count = crate::host::MIN_PER_THREAD * 4 + 5;
    let names: Vec<String> = (0..count).map(|i| format!("alloc-{i:04}")).collect();
    for (i, name) in names.iter().enumerate() {
        put(store, &sample_record(name, i as u32 % 7), check);
    }
    let damaged = count / 3;
    store.plant_raw(&names[damaged], b"not a record".to_vec());
    let loaded = load(store, check);
    assert_eq!(loaded.len(), count, "{check}: every alloc is reported");
    for (i, (name, result)) in names.iter().zip(&loaded).enumerate() {
        match result {
            Ok(record) => {
                assert_ne!(i, damaged, "{check}: the damaged record loaded");
                assert_eq!(record, &sample_record(name, i as u32 % 7), "{check}");
            }
            Err(corrupt) => {
                assert_eq!(i, damaged, "{check}: {corrupt:?}");
                assert_eq!(&corrupt.name, name, "{check}");
            }
        }
    }
}

/// Runs every check, each on a fresh empty store from `make`.
pub fn run_all(make: impl Fn() -> Box<dyn PlantRaw>) {
    let plain: [fn(&dyn Store); 8] = [
        empty_store_loads_nothing,
        put_then_load_returns_the_record,
        put_replaces_the_earlier_record,
        load_returns_every_alloc_by_name,
        delete_removes_the_record,
        delete_is_idempotent,
        identical_put_is_skipped_and_counted,
        delete_resets_write_dedupe,
    ];
    for check in plain {
        check(make().as_ref());
    }
    let damaged: [fn(&dyn PlantRaw); 4] = [
        corrupt_record_is_reported_while_others_load,
        future_version_record_is_reported_as_such,
        record_under_another_name_is_corrupt,
        a_load_of_many_records_keeps_their_order_and_their_damage_in_place,
    ];
    for check in damaged {
        check(make().as_ref());
    }
}
