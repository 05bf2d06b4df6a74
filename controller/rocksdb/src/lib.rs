//! The RocksDB [`Store`]: the embedded default, under `<data-dir>/state`.
//!
//! An alloc's record is kept in parts, one column family per kind, so a change to one
//! task rewrites that task's part and nothing else:
//!
//! | family    | key              | value                                                    |
//! |-----------|------------------|----------------------------------------------------------|
//! | `allocs`  | `name`           | the record without task states, handles and devices      |
//! | `tasks`   | `name \0 task`   | the task's state (JSON `TaskStateRecord`)                |
//! | `handles` | `name \0 task`   | the task's driver handle (`TaskHandleRecord`)            |
//! | `devices` | `name`           | each task's device instances (`DeviceAssignmentRecord`)  |
//! | `meta`    | `layout`         | the layout version of this database                      |
//!
//! Each put is one atomic write batch holding only the parts whose bytes changed since
//! they were last written or read (per-part content hashes, as Nomad's boltdd keeps per
//! bucket); a put that changes nothing is skipped and counted. Writes go to the WAL
//! without fsync unless configured: they survive the agent's crash, as the crash test
//! checks; `sync: true` also survives the machine's.
//!
//! Names are validated `[a-z0-9-]` strings, so `\0` separates an alloc's part keys from
//! every other alloc's and a prefix scan finds exactly its tasks.
//!
//! This crate is the project's only C++ build; its build script links the C++ runtime
//! statically where it can ([`STATIC_CPP_RUNTIME`]).

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use rocksdb::{
    BlockBasedOptions, Cache, ColumnFamily, ColumnFamilyDescriptor, DB, DBRecoveryMode, Direction,
    InfoLogger, IteratorMode, LogLevel, Options, WriteBatch, WriteBufferManager, WriteOptions,
};
use stead_schemas::device::{DEVICE_ASSIGNMENT_RECORD_VERSION, DeviceAssignmentRecord};
use stead_schemas::record::{AllocRecord, RecordError, TaskHandleRecord, TaskStateRecord};
use stead_schemas::spec::Name;

use stead_runtime::host::map_on_every_core;
use stead_runtime::store::conformance::PlantRaw;
use stead_runtime::store::{CorruptRecord, Store, StoreError, StoreMetrics, decode_stored};

/// Whether this build links the C++ runtime RocksDB needs statically (`build.rs`).
pub const STATIC_CPP_RUNTIME: bool = cfg!(stead_static_libstdcxx);

/// The layout this agent writes; a database with a newer one is refused at open.
pub const LAYOUT_VERSION: u32 = 1;

const ALLOCS: &str = "allocs";
const TASKS: &str = "tasks";
const HANDLES: &str = "handles";
const DEVICES: &str = "devices";
const META: &str = "meta";
const FAMILIES: [&str; 5] = [ALLOCS, TASKS, HANDLES, DEVICES, META];
/// RocksDB's background jobs: one flush and one compaction at a time, for a store this
/// small.
const BACKGROUND_JOBS: i32 = 2;
const LAYOUT_KEY: &[u8] = b"layout";

/// How the database is sized and how durable its writes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RocksDbOptions {
    /// Memory for memtables and the block cache together, in bytes: memtables are
    /// charged to the cache, so RocksDB's own memory stays within this.
    pub memory_budget: usize,
    /// fsync every write (survives power loss, costs a disk flush per change).
    pub sync: bool,
    /// Skip unchanged parts and unchanged records (on by default; off only to measure
    /// what deduplication saves).
    pub dedupe: bool,
}

impl Default for RocksDbOptions {
    fn default() -> Self {
        RocksDbOptions {
            memory_budget: 8 << 20,
            sync: false,
            dedupe: true,
        }
    }
}

/// Opening the database failed.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// RocksDB refused to open or create it.
    #[error("cannot open the state database at {path}")]
    Open {
        /// The database directory.
        path: PathBuf,
        /// What RocksDB reported.
        #[source]
        source: rocksdb::Error,
    },
    /// A newer agent laid the database out.
    #[error(
        "the state database at {path} has layout version {found}, newer than this agent's {supported}"
    )]
    FutureLayout {
        /// The database directory.
        path: PathBuf,
        /// The stored layout version.
        found: u32,
        /// [`LAYOUT_VERSION`].
        supported: u32,
    },
    /// The directory holds database files but no `CURRENT` (which names the live
    /// manifest): creating a new database there would forget every task and record.
    #[error(
        "the state database at {} has data files ({}) but no CURRENT file; refusing to create a new database over them, which would forget every running task. Restore CURRENT from a backup, or write the newest MANIFEST file's name into it (`ls {}/MANIFEST-*`, then `echo MANIFEST-NNNNNN > {}/CURRENT`); to start this node afresh instead, move the directory away",
        path.display(),
        found.join(", "),
        path.display(),
        path.display()
    )]
    LostCurrent {
        /// The database directory.
        path: PathBuf,
        /// A few of the data files found.
        found: Vec<String>,
    },
    /// The write-ahead log is damaged and cannot be replayed even up to the damage.
    #[error(
        "the state database at {} is damaged beyond what recovery up to the damage can mend; move the directory away (keep it for inspection) and start the agent again: it makes a new database and reattaches the tasks that still run, whose records it finds in their alloc dirs",
        path.display()
    )]
    Damaged {
        /// The database directory.
        path: PathBuf,
        /// What RocksDB reported.
        #[source]
        source: rocksdb::Error,
    },
    /// The directory could not be read before opening.
    #[error("cannot read the state database directory {}", path.display())]
    ReadDir {
        /// The database directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The layout marker is unreadable.
    #[error("the state database at {path} has an unreadable layout marker {found:?}")]
    BadLayout {
        /// The database directory.
        path: PathBuf,
        /// The stored bytes.
        found: Vec<u8>,
    },
}

/// A part of an alloc's record: its family and key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct PartKey {
    family: &'static str,
    key: Vec<u8>,
}

/// One alloc as loaded: its record and the hash of each part read, or why it is unusable.
type LoadedAlloc = Result<(AllocRecord, HashMap<PartKey, u64>), CorruptRecord>;

/// The [`Store`] on RocksDB.
pub struct RocksDbStore {
    db: DB,
    path: PathBuf,
    write_options: WriteOptions,
    dedupe: bool,
    /// Per alloc, the hash of every part the database holds, when known.
    index: Mutex<HashMap<String, HashMap<PartKey, u64>>>,
    writes: AtomicU64,
    skipped_writes: AtomicU64,
    deletes: AtomicU64,
    bytes_written: AtomicU64,
    /// What was lost at open (see [`RocksDbStore::recovered`]).
    recovered: Option<String>,
}

/// Whether `path` may take a new database: it is missing, empty, or holds only what a
/// creation that never finished leaves (`CURRENT` is the last file a creation writes,
/// and no data file comes before it). One that holds data files (write-ahead logs,
/// tables) without a `CURRENT` is refused; one with `CURRENT` is opened.
fn new_database_dir(path: &Path) -> Result<bool, OpenError> {
    let entries = match std::fs::read_dir(path) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(true),
        Err(source) => {
            return Err(OpenError::ReadDir {
                path: path.to_owned(),
                source,
            });
        }
    };
    let names: Vec<String> = entries
        .filter_map(Result::ok)
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect();
    if names.iter().any(|name| name == "CURRENT") {
        return Ok(false);
    }
    let is_data = |name: &String| {
        [".log", ".sst", ".blob"]
            .iter()
            .any(|suffix| name.ends_with(suffix))
    };
    let mut names: Vec<String> = names.into_iter().filter(is_data).collect();
    if names.is_empty() {
        return Ok(true);
    }
    names.sort();
    names.truncate(5);
    Err(OpenError::LostCurrent {
        path: path.to_owned(),
        found: names,
    })
}

impl std::fmt::Debug for RocksDbStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocksDbStore")
            .field("path", &self.path)
            .field("metrics", &self.metrics())
            .finish_non_exhaustive()
    }
}

/// Where RocksDB's messages go: its warnings and errors into the agent's log.
fn rocksdb_message(level: LogLevel, message: &str) {
    let message = message.trim_end();
    match level {
        LogLevel::Warn => tracing::warn!(source = "rocksdb", "{message}"),
        LogLevel::Error | LogLevel::Fatal => tracing::error!(source = "rocksdb", "{message}"),
        LogLevel::Debug | LogLevel::Info | LogLevel::Header => {}
    }
}

impl RocksDbStore {
    /// Opens the database in `path`, creating it only in an empty (or missing)
    /// directory: files without a `CURRENT` are refused ([`OpenError::LostCurrent`]).
    ///
    /// The write-ahead log is replayed strictly (only a torn last record, which a crash
    /// leaves, is tolerated). A log damaged anywhere else is replayed up to the damage,
    /// as RocksDB's point-in-time recovery does, and [`RocksDbStore::recovered`] says so:
    /// the records written after it are lost, and the agent reports the store degraded
    /// rather than carrying on as if nothing happened.
    pub fn open(path: &Path, options: RocksDbOptions) -> Result<Self, OpenError> {
        let create = new_database_dir(path)?;
        match Self::open_with(
            path,
            options,
            create,
            DBRecoveryMode::TolerateCorruptedTailRecords,
        ) {
            Err(OpenError::Open { source, .. })
                if source.kind() == rocksdb::ErrorKind::Corruption =>
            {
                tracing::error!(dir = %path.display(), error = %source, "the state database's write-ahead log is damaged; recovering up to the damage");
                let mut store = Self::open_with(path, options, false, DBRecoveryMode::PointInTime)
                    .map_err(|error| match error {
                        OpenError::Open { source: damage, .. } => OpenError::Damaged {
                            path: path.to_owned(),
                            source: damage,
                        },
                        other => other,
                    })?;
                store.recovered = Some(format!(
                    "the write-ahead log was damaged ({source}); state written after the damage was lost and is rebuilt from the specs and the running tasks"
                ));
                Ok(store)
            }
            opened => opened,
        }
    }

    /// What was lost when the database was opened, when its write-ahead log was damaged.
    pub fn recovered(&self) -> Option<&str> {
        self.recovered.as_deref()
    }

    fn open_with(
        path: &Path,
        options: RocksDbOptions,
        create: bool,
        recovery: DBRecoveryMode,
    ) -> Result<Self, OpenError> {
        let open_error = |source| OpenError::Open {
            path: path.to_owned(),
            source,
        };
        let budget = options.memory_budget.max(1 << 20);
        let cache = Cache::new_lru_cache(budget);
        // Memtables are charged to the cache: one limit for both.
        let buffers = WriteBufferManager::new_write_buffer_manager_with_cache(
            budget / 2,
            false,
            cache.clone(),
        );
        let mut table = BlockBasedOptions::default();
        table.set_block_cache(&cache);
        table.set_cache_index_and_filter_blocks(true);
        table.set_pin_l0_filter_and_index_blocks_in_cache(true);

        let mut family_options = Options::default();
        family_options.set_block_based_table_factory(&table);
        family_options.set_write_buffer_size((budget / 8).max(64 << 10));
        family_options.set_max_write_buffer_number(2);

        let mut db_options = family_options.clone();
        db_options.create_if_missing(create);
        db_options.create_missing_column_families(true);
        db_options.set_wal_recovery_mode(recovery);
        db_options.set_write_buffer_manager(&buffers);
        // A node agent's state is small: bound the WAL, files and threads.
        db_options.set_max_total_wal_size(4 << 20);
        db_options.set_max_open_files(64);
        db_options.set_max_background_jobs(BACKGROUND_JOBS);
        // RocksDB opens a database's table files on 16 threads by default, and starts 15
        // of them for each column family it recovers, whether there are files or not:
        // 15 when a new node's store is created (on the cores its first tasks start on),
        // 90 at every later open, each with its stack mapped and unmapped. A store this
        // small has a handful of files, which the opening thread reads itself.
        db_options.set_max_file_opening_threads(1);
        // The manifest of a store this small stays in kilobytes; RocksDB's default 4 MiB
        // preallocation costs real pages on tmpfs at every open.
        db_options.set_manifest_preallocation_size(64 << 10);
        // RocksDB's own warnings and errors go to the agent's log, where an operator looks,
        // not to a LOG file in the state dir. Below that, RocksDB writes out its whole
        // configuration at every open (about 1,150 lines, 80 KB, each timestamped and
        // written to the file): a large part of a new store's creation, on the cores the
        // first tasks start on. Those lines reach the callback as INFO and are dropped; the
        // OPTIONS file in the state dir holds the same configuration.
        db_options.set_log_level(LogLevel::Warn);
        db_options.set_info_logger(InfoLogger::new_callback_logger(
            LogLevel::Warn,
            rocksdb_message,
        ));
        db_options.set_stats_dump_period_sec(0);
        db_options.set_stats_persist_period_sec(0);

        // The default family is named too: left out, it would get RocksDB's default
        // options, whose 64 MiB write buffer sets both the write-ahead log's
        // preallocation and the free space RocksDB waits for before it resumes writes
        // after the disk filled. With every family's buffer at `budget / 8`, the store
        // recovers once that much is free again.
        let families = FAMILIES
            .iter()
            .chain(std::iter::once(&rocksdb::DEFAULT_COLUMN_FAMILY_NAME))
            .map(|name| ColumnFamilyDescriptor::new(*name, family_options.clone()));
        let db = DB::open_cf_descriptors(&db_options, path, families).map_err(open_error)?;
        let mut write_options = WriteOptions::default();
        write_options.set_sync(options.sync);
        let store = RocksDbStore {
            db,
            path: path.to_owned(),
            write_options,
            dedupe: options.dedupe,
            index: Mutex::new(HashMap::new()),
            writes: AtomicU64::new(0),
            skipped_writes: AtomicU64::new(0),
            deletes: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            recovered: None,
        };
        store.check_layout()?;
        Ok(store)
    }

    /// The database directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the layout marker, writing it into a new database; a newer layout is refused.
    fn check_layout(&self) -> Result<(), OpenError> {
        let open_error = |source| OpenError::Open {
            path: self.path.clone(),
            source,
        };
        let meta = self.family(META);
        match self.db.get_cf(meta, LAYOUT_KEY).map_err(open_error)? {
            None => {
                let mut batch = WriteBatch::default();
                batch.put_cf(meta, LAYOUT_KEY, LAYOUT_VERSION.to_string());
                self.db
                    .write_opt(batch, &self.write_options)
                    .map_err(open_error)
            }
            Some(found) => {
                let parsed = std::str::from_utf8(&found)
                    .ok()
                    .and_then(|text| text.parse::<u32>().ok());
                match parsed {
                    // Layout 1 is the first: an older one would be migrated here.
                    Some(LAYOUT_VERSION) => Ok(()),
                    Some(version) if version > LAYOUT_VERSION => Err(OpenError::FutureLayout {
                        path: self.path.clone(),
                        found: version,
                        supported: LAYOUT_VERSION,
                    }),
                    _ => Err(OpenError::BadLayout {
                        path: self.path.clone(),
                        found: found.clone(),
                    }),
                }
            }
        }
    }

    fn family(&self, name: &str) -> &ColumnFamily {
        self.db
            .cf_handle(name)
            .expect("every family is created at open")
    }

    fn index(&self) -> MutexGuard<'_, HashMap<String, HashMap<PartKey, u64>>> {
        // Every update is one map call, so a panic cannot leave it half updated.
        self.index.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues the deletion of every part of `name` in `batch`.
    fn delete_parts(&self, batch: &mut WriteBatch, name: &str) {
        batch.delete_cf(self.family(ALLOCS), name);
        batch.delete_cf(self.family(DEVICES), name);
        let (from, to) = prefix_range(name);
        batch.delete_range_cf(self.family(TASKS), &from, &to);
        batch.delete_range_cf(self.family(HANDLES), &from, &to);
    }

    /// Every `(suffix, value)` of `family` under `name`'s prefix, in key order.
    fn scan_prefix(&self, family: &str, name: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let (from, _) = prefix_range(name);
        let mut parts = Vec::new();
        let mode = IteratorMode::From(&from, Direction::Forward);
        for item in self.db.iterator_cf(self.family(family), mode) {
            let (key, value) = item.map_err(load_error)?;
            let Some(suffix) = key.strip_prefix(from.as_slice()) else {
                break;
            };
            parts.push((
                String::from_utf8_lossy(suffix).into_owned(),
                value.into_vec(),
            ));
        }
        Ok(parts)
    }

    /// Loads one alloc from its header bytes and its task and handle parts.
    fn load_one(&self, name: &str, header: &[u8]) -> Result<LoadedAlloc, StoreError> {
        let mut hashes = HashMap::new();
        hashes.insert(part(ALLOCS, name.as_bytes()), hash_bytes(header));
        let mut record = match decode_stored(name, header) {
            Ok(record) => record,
            Err(corrupt) => return Ok(Err(corrupt)),
        };
        let corrupt = |source| CorruptRecord {
            name: name.to_owned(),
            source: RecordError::Malformed { source },
        };
        for (task, bytes) in self.scan_prefix(TASKS, name)? {
            hashes.insert(part(TASKS, &part_key(name, &task)), hash_bytes(&bytes));
            match serde_json::from_slice::<TaskStateRecord>(&bytes) {
                Ok(state) => {
                    record.state.tasks.insert(task, state);
                }
                Err(error) => return Ok(Err(corrupt(error))),
            }
        }
        for (task, bytes) in self.scan_prefix(HANDLES, name)? {
            hashes.insert(part(HANDLES, &part_key(name, &task)), hash_bytes(&bytes));
            match serde_json::from_slice::<TaskHandleRecord>(&bytes) {
                Ok(handle) => {
                    record.handles.insert(task, handle);
                }
                Err(error) => return Ok(Err(corrupt(error))),
            }
        }
        let devices = self
            .db
            .get_cf(self.family(DEVICES), name)
            .map_err(load_error)?;
        if let Some(bytes) = devices {
            hashes.insert(part(DEVICES, name.as_bytes()), hash_bytes(&bytes));
            match serde_json::from_slice::<DeviceAssignmentRecord>(&bytes) {
                Ok(devices) if devices.version == DEVICE_ASSIGNMENT_RECORD_VERSION => {
                    record.devices = devices.tasks;
                }
                Ok(devices) => {
                    return Ok(Err(CorruptRecord {
                        name: name.to_owned(),
                        source: if devices.version > DEVICE_ASSIGNMENT_RECORD_VERSION {
                            RecordError::FutureVersion {
                                found: devices.version,
                                supported: DEVICE_ASSIGNMENT_RECORD_VERSION,
                            }
                        } else {
                            RecordError::UnknownVersion {
                                found: devices.version,
                            }
                        },
                    }));
                }
                Err(error) => return Ok(Err(corrupt(error))),
            }
        }
        Ok(Ok((record, hashes)))
    }

    /// Bytes written to the database since it was opened (keys and values of changed
    /// parts).
    pub fn bytes_written(&self) -> u64 {
        self.bytes_written.load(Ordering::Relaxed)
    }
}

impl Store for RocksDbStore {
    fn put_alloc(&self, record: &AllocRecord) -> Result<(), StoreError> {
        let name = record.name.as_str();
        let parts = split(record);
        let known = self.index().get(name).cloned();
        let mut batch = WriteBatch::default();
        if known.is_none() {
            // Nothing is known of what the database holds for it: clear every part first.
            self.delete_parts(&mut batch, name);
        }
        let mut hashes = HashMap::with_capacity(parts.len());
        let mut bytes = 0u64;
        let mut changed = false;
        for (key, value) in &parts {
            let hash = hash_bytes(value);
            let unchanged = self.dedupe && known.as_ref().and_then(|k| k.get(key)) == Some(&hash);
            if !unchanged {
                batch.put_cf(self.family(key.family), &key.key, value);
                bytes += (key.key.len() + value.len()) as u64;
                changed = true;
            }
            hashes.insert(key.clone(), hash);
        }
        for key in known.iter().flat_map(HashMap::keys) {
            if !hashes.contains_key(key) {
                batch.delete_cf(self.family(key.family), &key.key);
                changed = true;
            }
        }
        if !changed {
            self.skipped_writes.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        match self.db.write_opt(batch, &self.write_options) {
            Ok(()) => {
                self.index().insert(name.to_owned(), hashes);
                self.writes.fetch_add(1, Ordering::Relaxed);
                self.bytes_written.fetch_add(bytes, Ordering::Relaxed);
                Ok(())
            }
            Err(error) => {
                self.index().remove(name);
                Err(StoreError::Write {
                    name: record.name.clone(),
                    source: Box::new(error),
                })
            }
        }
    }

    fn delete_alloc(&self, name: &Name) -> Result<(), StoreError> {
        let mut batch = WriteBatch::default();
        self.delete_parts(&mut batch, name.as_str());
        let result = self.db.write_opt(batch, &self.write_options);
        self.index().remove(name.as_str());
        match result {
            Ok(()) => {
                self.deletes.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(error) => Err(StoreError::Delete {
                name: name.clone(),
                source: Box::new(error),
            }),
        }
    }

    fn load_allocs(&self) -> Result<Vec<Result<AllocRecord, CorruptRecord>>, StoreError> {
        let mut loaded = Vec::new();
        let mut headers = Vec::new();
        for item in self
            .db
            .iterator_cf(self.family(ALLOCS), IteratorMode::Start)
        {
            let (key, value) = item.map_err(load_error)?;
            headers.push((String::from_utf8_lossy(&key).into_owned(), value));
        }
        // Decoded over the host's cores: at thousands of allocs, an agent's restart waits
        // on it.
        let decoded = map_on_every_core(headers, |(name, header)| {
            let result = self.load_one(&name, &header);
            (name, result)
        });
        for (name, result) in decoded {
            match result? {
                Ok((record, hashes)) => {
                    self.index().insert(name, hashes);
                    loaded.push(Ok(record));
                }
                Err(corrupt) => {
                    self.index().remove(&name);
                    loaded.push(Err(corrupt));
                }
            }
        }
        Ok(loaded)
    }

    fn metrics(&self) -> StoreMetrics {
        StoreMetrics {
            writes: self.writes.load(Ordering::Relaxed),
            skipped_writes: self.skipped_writes.load(Ordering::Relaxed),
            deletes: self.deletes.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
        }
    }
}

impl PlantRaw for RocksDbStore {
    fn plant_raw(&self, name: &str, bytes: Vec<u8>) {
        self.db
            .put_cf(self.family(ALLOCS), name, bytes)
            .expect("planting a raw record");
        self.index().remove(name);
    }
}

/// The parts of a record: the header (the record without task states and handles), each
/// task's state and each task's handle, encoded.
fn split(record: &AllocRecord) -> BTreeMap<PartKey, Vec<u8>> {
    let name = record.name.as_str();
    let mut parts = BTreeMap::new();
    for (task, state) in &record.state.tasks {
        let bytes = serde_json::to_vec(state).expect("task states serialize to JSON");
        parts.insert(part(TASKS, &part_key(name, task)), bytes);
    }
    for (task, handle) in &record.handles {
        let bytes = serde_json::to_vec(handle).expect("handles serialize to JSON");
        parts.insert(part(HANDLES, &part_key(name, task)), bytes);
    }
    let mut header = AllocRecord {
        version: record.version,
        name: record.name.clone(),
        spec: record.spec.clone(),
        revision: record.revision.clone(),
        removed: record.removed,
        stopped_by_user: record.stopped_by_user,
        state: record.state.clone(),
        handles: BTreeMap::new(),
        devices: BTreeMap::new(),
    };
    header.state.tasks.clear();
    if !record.devices.is_empty() {
        let devices = DeviceAssignmentRecord {
            version: DEVICE_ASSIGNMENT_RECORD_VERSION,
            tasks: record.devices.clone(),
        };
        let bytes = serde_json::to_vec(&devices).expect("device assignments serialize to JSON");
        parts.insert(part(DEVICES, name.as_bytes()), bytes);
    }
    parts.insert(part(ALLOCS, name.as_bytes()), header.encode());
    parts
}

fn part(family: &'static str, key: &[u8]) -> PartKey {
    PartKey {
        family,
        key: key.to_vec(),
    }
}

/// `name \0 task`.
fn part_key(name: &str, task: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(name.len() + 1 + task.len());
    key.extend_from_slice(name.as_bytes());
    key.push(0);
    key.extend_from_slice(task.as_bytes());
    key
}

/// The key range `[name \0, name \1)` holding exactly `name`'s task parts.
fn prefix_range(name: &str) -> (Vec<u8>, Vec<u8>) {
    let mut from = name.as_bytes().to_vec();
    from.push(0);
    let mut to = name.as_bytes().to_vec();
    to.push(1);
    (from, to)
}

fn hash_bytes(bytes: &[u8]) -> u64 {
    let mut hasher = DefaultHasher::new();
    bytes.hash(&mut hasher);
    hasher.finish()
}

fn load_error(error: rocksdb::Error) -> StoreError {
    StoreError::Load {
        source: Box::new(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stead_runtime::store::conformance::{self, sample_record};

    fn open(dir: &Path) -> RocksDbStore {
        RocksDbStore::open(dir, RocksDbOptions::default()).expect("opens")
    }

    /// The names of the files in `dir`.
    fn file_names(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .expect("lists")
            .map(|entry| {
                entry
                    .expect("entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect()
    }

    #[test]
    fn rocksdb_writes_no_log_file_into_the_state_dir_and_keeps_its_options_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = open(dir.path());
        store.put_alloc(&sample_record("web", 1)).expect("put");
        drop(store);
        // Reopened: RocksDB would roll a LOG file into LOG.old.* here.
        drop(open(dir.path()));
        let names = file_names(dir.path());
        assert!(
            !names.iter().any(|name| name.starts_with("LOG")),
            "no LOG file: {names:?}"
        );
        assert!(
            names.iter().any(|name| name.starts_with("OPTIONS-")),
            "the configuration is still on disk: {names:?}"
        );
    }

    #[test]
    fn rocksdb_opens_table_files_on_the_opening_thread_alone() {
        let dir = tempfile::tempdir().expect("temp dir");
        drop(open(dir.path()));
        let options = file_names(dir.path())
            .into_iter()
            .find(|name| name.starts_with("OPTIONS-"))
            .map(|name| dir.path().join(name))
            .expect("an OPTIONS file");
        let text = std::fs::read_to_string(&options).expect("readable");
        let setting: Vec<&str> = text
            .lines()
            .map(str::trim)
            .filter(|line| line.starts_with("max_file_opening_threads="))
            .collect();
        assert_eq!(
            setting,
            ["max_file_opening_threads=1"],
            "in {}",
            options.display()
        );
    }

    #[test]
    fn rocksdb_warnings_and_errors_reach_the_agents_log_and_its_chatter_does_not() {
        #[derive(Clone, Default)]
        struct Captured(std::sync::Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Captured {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().expect("lock").extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            rocksdb_message(LogLevel::Header, "Options.max_open_files: 64\n");
            rocksdb_message(LogLevel::Info, "Options.max_open_files: 64\n");
            rocksdb_message(LogLevel::Warn, "[WARN] a warning\n");
            rocksdb_message(LogLevel::Error, "[ERROR] an error\n");
        });
        let text = String::from_utf8(captured.0.lock().expect("lock").clone()).expect("utf-8");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "only the warning and the error: {text}");
        assert!(
            lines[0].contains("WARN") && lines[0].contains("a warning"),
            "{text}"
        );
        assert!(
            lines[1].contains("ERROR") && lines[1].contains("an error"),
            "{text}"
        );
        assert!(
            lines.iter().all(|line| line.contains("source=\"rocksdb\"")),
            "{text}"
        );
    }

    #[test]
    fn a_state_dir_whose_current_is_gone_is_refused_untouched_and_opens_once_it_is_back() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = open(dir.path());
        store.put_alloc(&sample_record("web", 1)).expect("put");
        drop(store);
        let current = std::fs::read(dir.path().join("CURRENT")).expect("CURRENT");
        std::fs::remove_file(dir.path().join("CURRENT")).expect("removed");
        let mut before = file_names(dir.path());
        before.sort();

        let error = RocksDbStore::open(dir.path(), RocksDbOptions::default()).expect_err("refused");
        let text = error.to_string();
        assert!(matches!(error, OpenError::LostCurrent { .. }), "{text}");
        assert!(text.contains(&dir.path().display().to_string()), "{text}");
        assert!(text.contains("no CURRENT file"), "{text}");
        assert!(text.contains("MANIFEST-"), "{text}");
        let mut after = file_names(dir.path());
        after.sort();
        assert_eq!(before, after, "nothing created or removed");

        std::fs::write(dir.path().join("CURRENT"), current).expect("restored");
        let store = open(dir.path());
        assert!(store.recovered().is_none());
        let loaded = store.load_allocs().expect("loads");
        assert_eq!(loaded.len(), 1);
    }

    #[test]
    fn a_new_database_is_made_in_a_missing_or_empty_dir_only() {
        let dir = tempfile::tempdir().expect("temp dir");
        drop(open(&dir.path().join("missing")));
        let empty = tempfile::tempdir().expect("temp dir");
        drop(open(empty.path()));
        let other = tempfile::tempdir().expect("temp dir");
        std::fs::write(other.path().join("000004.log"), b"").expect("a stray log");
        let error =
            RocksDbStore::open(other.path(), RocksDbOptions::default()).expect_err("refused");
        assert!(matches!(error, OpenError::LostCurrent { .. }), "{error}");
    }

    #[test]
    fn garbage_in_the_middle_of_the_write_ahead_log_is_recovered_up_to_it_and_said() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = open(dir.path());
        for n in 0..40 {
            store
                .put_alloc(&sample_record(&format!("web-{n:02}"), 1))
                .expect("put");
        }
        drop(store);
        let log = file_names(dir.path())
            .into_iter()
            .filter(|name| name.ends_with(".log"))
            .max()
            .map(|name| dir.path().join(name))
            .expect("a write-ahead log");
        let mut bytes = std::fs::read(&log).expect("read");
        assert!(bytes.len() > 4096, "{} bytes", bytes.len());
        let middle = bytes.len() / 2;
        bytes[middle..middle + 64].fill(0xa5);
        std::fs::write(&log, bytes).expect("damaged");

        let store = open(dir.path());
        let recovered = store.recovered().expect("the damage is said");
        assert!(recovered.contains("write-ahead log"), "{recovered}");
        let loaded = store.load_allocs().expect("loads");
        assert!(
            !loaded.is_empty() && loaded.len() < 40,
            "recovered up to the damage: {}",
            loaded.len()
        );
        drop(store);
        // Recovered once: the next open is clean.
        assert!(open(dir.path()).recovered().is_none());
    }

    #[test]
    fn rocksdb_store_passes_the_conformance_suite() {
        let root = tempfile::tempdir().expect("temp dir");
        let counter = AtomicU64::new(0);
        conformance::run_all(|| {
            let n = counter.fetch_add(1, Ordering::Relaxed);
            Box::new(open(&root.path().join(format!("db-{n}"))))
        });
    }

    #[test]
    fn records_survive_reopening() {
        let dir = tempfile::tempdir().expect("temp dir");
        {
            let store = open(dir.path());
            store.put_alloc(&sample_record("web", 3)).expect("written");
            store.put_alloc(&sample_record("api", 1)).expect("written");
        }
        let store = open(dir.path());
        let loaded: Vec<AllocRecord> = store
            .load_allocs()
            .expect("loads")
            .into_iter()
            .map(|r| r.expect("decodes"))
            .collect();
        assert_eq!(
            loaded,
            vec![sample_record("api", 1), sample_record("web", 3)]
        );
        // What was read is known: writing it again is skipped.
        store.put_alloc(&sample_record("web", 3)).expect("skipped");
        assert_eq!(store.metrics().skipped_writes, 1);
        assert_eq!(store.metrics().writes, 0);
    }

    #[test]
    fn a_task_change_rewrites_only_that_tasks_part() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = open(dir.path());
        let first = sample_record("web", 0);
        store.put_alloc(&first).expect("written");
        let after_first = store.bytes_written();
        let mut second = first.clone();
        second
            .state
            .tasks
            .values_mut()
            .for_each(|task| task.restarts += 1);
        store.put_alloc(&second).expect("written");
        let delta = store.bytes_written() - after_first;
        let task_part = serde_json::to_vec(&second.state.tasks["server"])
            .expect("encodes")
            .len() as u64;
        assert_eq!(delta, task_part + "web\0server".len() as u64);
        assert!(delta < after_first / 2, "{delta} of {after_first}");
    }

    #[test]
    fn released_devices_are_deleted_and_a_newer_devices_part_fails_only_its_alloc() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = open(dir.path());
        let mut record = sample_record("web", 0);
        assert!(!record.devices.is_empty());
        store.put_alloc(&record).expect("written");
        store.put_alloc(&sample_record("api", 0)).expect("written");
        record.devices.clear();
        store.put_alloc(&record).expect("written");
        let devices = |store: &RocksDbStore, name: &str| {
            store
                .db
                .get_cf(store.family(DEVICES), name)
                .expect("readable")
        };
        assert_eq!(devices(&store, "web"), None, "the devices part is gone");
        store
            .db
            .put_cf(
                store.family(DEVICES),
                "api",
                br#"{"version":99,"tasks":{}}"#,
            )
            .expect("planted");
        drop(store);
        let store = open(dir.path());
        let loaded = store.load_allocs().expect("loads");
        let api = loaded[0]
            .as_ref()
            .expect_err("api's devices are from the future");
        assert!(api.to_string().contains("api"), "{api}");
        assert!(matches!(
            api.source,
            RecordError::FutureVersion { found: 99, .. }
        ));
        assert_eq!(loaded[1].as_ref().expect("web decodes"), &record);
    }

    #[test]
    fn a_dropped_handle_is_deleted() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = open(dir.path());
        let mut record = sample_record("web", 0);
        store.put_alloc(&record).expect("written");
        record.handles.clear();
        store.put_alloc(&record).expect("written");
        drop(store);
        let store = open(dir.path());
        let loaded = store.load_allocs().expect("loads");
        assert_eq!(loaded[0].as_ref().expect("decodes"), &record);
    }

    #[test]
    fn a_garbage_task_part_fails_only_its_alloc() {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = open(dir.path());
        store.put_alloc(&sample_record("api", 0)).expect("written");
        store.put_alloc(&sample_record("web", 0)).expect("written");
        store
            .db
            .put_cf(store.family(TASKS), part_key("web", "server"), b"{not json")
            .expect("planted");
        let loaded = store.load_allocs().expect("loads");
        assert_eq!(loaded[0].as_ref().ok(), Some(&sample_record("api", 0)));
        match &loaded[1] {
            Err(CorruptRecord {
                name,
                source: RecordError::Malformed { .. },
            }) => assert_eq!(name, "web"),
            other => panic!("expected web to be malformed, got {other:?}"),
        }
    }

    #[test]
    fn a_database_of_a_newer_layout_is_refused_naming_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        {
            let store = open(dir.path());
            store
                .db
                .put_cf(store.family(META), LAYOUT_KEY, "2")
                .expect("planted");
        }
        let error = RocksDbStore::open(dir.path(), RocksDbOptions::default())
            .expect_err("a newer layout is refused");
        let message = error.to_string();
        assert!(
            message.contains(&dir.path().display().to_string()),
            "{message}"
        );
        assert!(message.contains("layout version 2"), "{message}");
    }
}
