//! The Delta Lake sink, through delta-rs.
//!
//! Each batch is one Delta commit holding the batch's `add` actions (with
//! file statistics), a `txn` action `(appId = query id, version = batch id)`
//! and a `commitInfo` with the operation `STREAMING UPDATE` and lakestream's
//! metadata (batch id, source ranges). Before committing, the sink reads the
//! table's txn version for the query: when it is already `>=` the batch id,
//! the batch was committed before a crash and is skipped. delta-rs does not
//! enforce monotonic txn versions, so this check is made on every commit, and
//! again after a commit conflict.
//!
//! Data files stream out through delta-rs's `RecordBatchWriter`: Parquet
//! files roll at the target file size, so memory is bounded by the open
//! files, not by the batch or the table.
//!
//! On every store the table is written through delta-rs's default log
//! store, which creates `_delta_log/N.json` with a create-if-absent PUT
//! (S3 `If-None-Match`), over the store lakestream's own [`Location`]
//! built. No locking service is needed; a store that cannot create
//! atomically is refused when the sink opens
//! ([`Location::verify_atomic_create`]).

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use async_trait::async_trait;
use buoyant_kernel::table_features::ColumnMappingMode;
use deltalake::TableProperty;
use deltalake::checkpoints;
use deltalake::kernel::engine::arrow_conversion::TryIntoKernel;
use deltalake::kernel::transaction::{
    CommitBuilder, CommitData, CommitProperties, TransactionError,
};
use deltalake::kernel::{Action, StructType, Transaction};
use deltalake::logstore::{CommitOrBytes, LogStore, LogStoreRef};
use deltalake::protocol::{DeltaOperation, OutputMode, SaveMode};
use deltalake::writer::{DeltaWriter, RecordBatchWriter};
use deltalake::{BlindDeltaTable, DeltaTable, DeltaTableError};
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use tokio::sync::Mutex;

use crate::{BatchWriter, CommitInfo, CommitOutcome, Error, Result, Sink, Staged};
use lakestream_storage::Location;

/// Default target size of a data file: 128 MiB.
pub const DEFAULT_TARGET_FILE_SIZE: u64 = 128 * 1024 * 1024;

/// `delta.checkpointInterval` of the tables the sink creates: a Delta
/// checkpoint every 10 commits (delta-rs's own default is 100).
///
/// After each commit, delta-rs carries the table state forward as one
/// piece per commit since the last checkpoint and replays every piece on the
/// next commit, so a commit costs more the further it is from a checkpoint
/// (measured: ~0.4 ms per piece, 40 ms a commit just before the 100th).
/// The sink reloads the state from each new checkpoint, so this interval
/// bounds a commit's cost.
pub const DEFAULT_CHECKPOINT_INTERVAL: u64 = 10;

/// Expired-log cleanup lists the whole `_delta_log/`; it runs on a
/// checkpoint commit at most once per this many versions.
const CLEANUP_EVERY_VERSIONS: u64 = 100;

/// Settings of a [`DeltaSink`].
#[derive(Clone)]
pub struct DeltaSinkOptions {
    /// Partition columns used when the table is created; when the table
    /// exists they must match its partitioning (empty: accept the table's).
    pub partition_columns: Vec<String>,
    /// Roll to a new data file past this many bytes.
    pub target_file_size: u64,
    /// Parquet compression of data files.
    pub compression: Compression,
    /// Storage options passed to delta-rs and object_store.
    pub storage_options: HashMap<String, String>,
    /// Compact the table's small files (to `target_file_size`) after every
    /// this many batches (`None`, the default: never).
    pub auto_compact_every: Option<u64>,
    /// `delta.checkpointInterval` set on a table the sink creates (an
    /// existing table keeps its own).
    pub checkpoint_interval: u64,
}

/// Storage option values may be secrets: only their keys are shown.
impl std::fmt::Debug for DeltaSinkOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut keys: Vec<&String> = self.storage_options.keys().collect();
        keys.sort();
        f.debug_struct("DeltaSinkOptions")
            .field("partition_columns", &self.partition_columns)
            .field("target_file_size", &self.target_file_size)
            .field("compression", &self.compression)
            .field("storage_option_keys", &keys)
            .field("auto_compact_every", &self.auto_compact_every)
            .field("checkpoint_interval", &self.checkpoint_interval)
            .finish()
    }
}

impl Default for DeltaSinkOptions {
    fn default() -> Self {
        Self {
            partition_columns: Vec::new(),
            target_file_size: DEFAULT_TARGET_FILE_SIZE,
            compression: Compression::SNAPPY,
            storage_options: HashMap::new(),
            auto_compact_every: None,
            checkpoint_interval: DEFAULT_CHECKPOINT_INTERVAL,
        }
    }
}

impl DeltaSinkOptions {
    /// Parse a compression name (`snappy`, `zstd`, `none`, ...).
    pub fn parse_compression(name: &str) -> Option<Compression> {
        match name.to_ascii_lowercase().as_str() {
            "snappy" => Some(Compression::SNAPPY),
            "zstd" => Some(Compression::ZSTD(ZstdLevel::default())),
            "none" | "uncompressed" => Some(Compression::UNCOMPRESSED),
            "lz4" => Some(Compression::LZ4_RAW),
            _ => None,
        }
    }
}

/// A Delta table as the sink of a query.
#[derive(Debug)]
pub struct DeltaSink {
    name: String,
    location: Location,
    options: DeltaSinkOptions,
    table: Mutex<Option<Loaded>>,
    txn: Mutex<Option<TxnCache>>,
    /// The newest version this sink committed or loaded; the loaded state
    /// in `table` may be older (appends do not update it).
    head: std::sync::Mutex<Option<u64>>,
    /// The Delta checkpoint being written in the background.
    checkpointing: std::sync::Mutex<Checkpointing>,
}

/// The sink's view of its table.
///
/// Appends need the table's protocol, schema, properties and newest
/// version, never its file list, whose load costs more with every file the
/// table holds (a query's restart after 5,000 batches spent most of its
/// time there). So the file list is loaded only where delta-rs needs it.
#[derive(Debug)]
struct Loaded {
    /// Protocol, schema and properties without the file list, as of
    /// `meta.version()`; the writers' store. Reloaded when another writer
    /// committed (it may have changed the schema).
    meta: BlindDeltaTable,
    /// The table with its file list, loaded on first need: delta-rs's own
    /// commit (writer protocols above 2, a version another writer took)
    /// and compaction.
    full: Option<DeltaTable>,
}

/// A Delta checkpoint written off the batch path.
#[derive(Debug, Default)]
struct Checkpointing {
    /// The task writing it; it returns the table it loaded.
    running: Option<tokio::task::JoinHandle<Result<DeltaTable>>>,
    /// A checkpoint fell due while one was running (with expired-log
    /// cleanup when `true`): started when the running one is collected.
    due: Option<bool>,
}

/// What [`DeltaSink::append_commit`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Append {
    /// The commit is this table version.
    Committed(u64),
    /// The table needs delta-rs's commit (its writer protocol).
    NotApplicable,
    /// Another writer created the version first.
    Taken,
}

/// The txn version of one app id as of one table version: lets a commit
/// check only the commits made since, instead of the whole log.
#[derive(Debug, Clone)]
struct TxnCache {
    app_id: String,
    table_version: u64,
    txn: Option<i64>,
}

/// Commits past the cache that are scanned one by one before falling back
/// to delta-rs's full lookup.
const MAX_INCREMENTAL_TXN_SCAN: u64 = 64;

impl DeltaSink {
    /// A sink writing to the Delta table at `location` (path or URL).
    /// Nothing is read or created until [`Sink::open`].
    pub fn try_new(location: &str, options: DeltaSinkOptions) -> Result<Self> {
        let location = Location::parse(location, &options.storage_options)?;
        for (option, value) in [
            ("target_file_size", options.target_file_size),
            ("checkpoint_interval", options.checkpoint_interval),
        ] {
            if value == 0 {
                return Err(Error::InvalidConfig {
                    table: location.url().to_string(),
                    reason: format!("option {option} must be at least 1"),
                });
            }
        }
        Ok(Self {
            name: location.url().to_string(),
            location,
            options,
            table: Mutex::new(None),
            txn: Mutex::new(None),
            head: std::sync::Mutex::new(None),
            checkpointing: std::sync::Mutex::new(Checkpointing::default()),
        })
    }

    /// The table's URL.
    pub fn url(&self) -> &url::Url {
        self.location.url()
    }

    fn table_err(&self, source: DeltaTableError) -> Error {
        Error::Table {
            table: self.name.clone(),
            source: Box::new(source),
        }
    }

    /// The table's log store, served by the location's store.
    fn log_store(&self) -> Result<LogStoreRef> {
        self.location.ensure_local_dir()?;
        Ok(open_table(&self.location)
            .map_err(|e| self.table_err(e))?
            .log_store())
    }

    /// The table's metadata at its latest version, without its file list:
    /// `None` when no table is there yet.
    async fn load_meta(&self) -> Result<Option<BlindDeltaTable>> {
        match BlindDeltaTable::try_new_with_log_store(self.log_store()?).await {
            Ok(meta) => Ok(Some(meta)),
            Err(DeltaTableError::NotATable(msg)) => {
                no_table_at(&self.location, &msg)
                    .await
                    .map_err(|e| self.table_err(e))?;
                Ok(None)
            }
            Err(e) => Err(self.table_err(e)),
        }
    }

    /// The table with its file list, at its latest version.
    async fn load_full(&self) -> Result<DeltaTable> {
        self.location.ensure_local_dir()?;
        let mut table = open_table(&self.location).map_err(|e| self.table_err(e))?;
        load_checked(&self.location, &mut table)
            .await
            .map_err(|e| self.table_err(e))?;
        Ok(table)
    }

    /// The loaded table's file list, brought to the newest version this
    /// sink has seen (loaded on first use).
    async fn full<'a>(&self, loaded: &'a mut Loaded) -> Result<&'a mut DeltaTable> {
        let head = self.head(loaded);
        let full = match loaded.full.take() {
            Some(mut t) => {
                if t.version() != head {
                    t.update_state().await.map_err(|e| self.table_err(e))?;
                }
                t
            }
            None => self.load_full().await?,
        };
        if let Some(v) = full.version() {
            self.set_head(v);
        }
        Ok(loaded.full.insert(full))
    }

    /// The newest table version this sink has seen: its own last commit,
    /// or the loaded state when that is newer.
    fn head(&self, loaded: &Loaded) -> Option<u64> {
        let known = *self.head.lock().expect("head lock");
        let loaded_version = loaded
            .full
            .as_ref()
            .and_then(|t| t.version())
            .map_or(loaded.meta.version(), |v| v.max(loaded.meta.version()));
        Some(known.map_or(loaded_version, |k| k.max(loaded_version)))
    }

    fn set_head(&self, version: u64) {
        let mut head = self.head.lock().expect("head lock");
        *head = Some(head.map_or(version, |h| h.max(version)));
    }

    /// Learn the table's latest version. A version past this sink's own
    /// head was committed by another writer, which may have changed the
    /// schema or protocol: the metadata is reloaded then (and the file
    /// list, when one is loaded).
    async fn refresh(&self, loaded: &mut Loaded) -> Result<()> {
        let head = self.head(loaded).unwrap_or_default();
        let latest = loaded
            .meta
            .log_store()
            .get_latest_version(head)
            .await
            .map_err(|e| self.table_err(e))?;
        if latest > head {
            if let Some(meta) = self.load_meta().await? {
                loaded.meta = meta;
            }
            if let Some(full) = loaded.full.as_mut() {
                full.update_state().await.map_err(|e| self.table_err(e))?;
            }
        }
        self.set_head(latest);
        Ok(())
    }

    /// Append a batch as commit `head + 1` with one create-if-absent write
    /// of the commit file: the bytes delta-rs's commit writes, without its
    /// post-commit state update, which re-derives every file of the table
    /// (parsing each file's statistics) and so costs more with every file
    /// the table holds.
    ///
    /// Does not commit when the table's writer protocol is above 2
    /// (delta-rs's commit then checks the table features), or when another
    /// writer created that version first (delta-rs's commit then reads it
    /// and checks for conflicts).
    async fn append_commit(
        &self,
        loaded: &Loaded,
        actions: &[Action],
        operation: DeltaOperation,
        app_metadata: HashMap<String, serde_json::Value>,
        transaction: Transaction,
        batch_id: u64,
    ) -> Result<Append> {
        let Some(head) = self.head(loaded) else {
            return Ok(Append::NotApplicable);
        };
        if loaded.meta.protocol().min_writer_version() > 2 {
            return Ok(Append::NotApplicable);
        }
        let commit_err = |e: TransactionError| Error::Commit {
            table: self.name.clone(),
            batch_id,
            source: Box::new(DeltaTableError::from(e)),
        };
        let version = head + 1;
        let bytes = CommitData::new(actions.to_vec(), operation, app_metadata, vec![transaction])
            .get_bytes()
            .map_err(commit_err)?;
        match loaded
            .meta
            .log_store()
            .write_commit_entry(
                version,
                CommitOrBytes::LogBytes(bytes),
                uuid::Uuid::new_v4(),
            )
            .await
        {
            Ok(()) => Ok(Append::Committed(version)),
            Err(TransactionError::VersionAlreadyExists(_)) => {
                tracing::debug!(table = %self.name, version, "version taken by another writer; committing through delta-rs");
                Ok(Append::Taken)
            }
            Err(e) => Err(commit_err(e)),
        }
    }

    /// After an [`append_commit`](Self::append_commit) of `version`: remember
    /// it, start a Delta checkpoint when one is due, and compact.
    ///
    /// The checkpoint is written off the batch path, on its own task: it
    /// loads the table (its cost grows with the table's files) and the
    /// next batches do not wait for it.
    /// The batch is committed whatever happens to the checkpoint: a failure
    /// is logged and the next due one tries again.
    async fn after_append(&self, loaded: &mut Loaded, version: u64, info: &CommitInfo) {
        let batch = i64::try_from(info.batch_id).expect("batch ids fit in i64");
        self.set_head(version);
        self.remember_txn(&info.query_id, version, Some(batch))
            .await;
        self.collect_checkpoint(loaded, false).await;
        let interval = checkpoint_interval(&loaded.meta);
        if (version + 1).is_multiple_of(interval) {
            let cleanup = (version + 1).is_multiple_of(cleanup_every(interval));
            self.spawn_checkpoint(version, cleanup);
        }
        self.maybe_compact(loaded, info.batch_id).await;
    }

    /// Write a Delta checkpoint at the table's latest version (at least
    /// `version`) on a task of its own. While the previous one still runs,
    /// this one waits as `due` and starts when that one is collected (one
    /// checkpoint, at the then latest version, stands for all that fell
    /// due meanwhile).
    fn spawn_checkpoint(&self, version: u64, cleanup: bool) {
        let mut slot = self.checkpointing.lock().expect("checkpoint slot");
        if slot.running.as_ref().is_some_and(|h| !h.is_finished()) {
            tracing::debug!(table = %self.name, version, "the previous Delta checkpoint is still being written; this one starts after it");
            slot.due = Some(slot.due.unwrap_or(false) || cleanup);
            return;
        }
        let location = self.location.clone();
        let name = self.name.clone();
        slot.running = Some(tokio::spawn(async move {
            let table_err = |source: DeltaTableError| Error::Table {
                table: name.clone(),
                source: Box::new(source),
            };
            location.ensure_local_dir()?;
            let mut table = open_table(&location).map_err(table_err)?;
            load_checked(&location, &mut table)
                .await
                .map_err(table_err)?;
            checkpoints::create_checkpoint(&table, None)
                .await
                .map_err(table_err)?;
            if cleanup {
                checkpoints::cleanup_metadata(&table, None)
                    .await
                    .map_err(table_err)?;
            }
            Ok(table)
        }));
    }

    /// Take the result of a finished background checkpoint (with `wait`,
    /// wait for a running one). Its freshly loaded table replaces the
    /// sink's file list when the sink holds one (a state reloaded from a
    /// checkpoint does not replay the commits since the old one); the
    /// sink does not start holding one for it.
    async fn collect_checkpoint(&self, loaded: &mut Loaded, wait: bool) {
        let handle = {
            let mut slot = self.checkpointing.lock().expect("checkpoint slot");
            if wait || slot.running.as_ref().is_some_and(|h| h.is_finished()) {
                slot.running.take()
            } else {
                None
            }
        };
        let Some(handle) = handle else { return };
        let due = self
            .checkpointing
            .lock()
            .expect("checkpoint slot")
            .due
            .take();
        match handle.await {
            Ok(Ok(fresh)) => {
                if let Some(v) = fresh.version() {
                    self.set_head(v);
                }
                if let Some(full) = loaded.full.as_mut()
                    && fresh.version() >= full.version()
                {
                    *full = fresh;
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(table = %self.name, error = %e, "Delta checkpoint failed; the next one retries");
            }
            Err(e) => {
                tracing::warn!(table = %self.name, error = %e, "Delta checkpoint task failed; the next one retries");
            }
        }
        if let Some(cleanup) = due {
            self.spawn_checkpoint(self.head(loaded).unwrap_or_default(), cleanup);
        }
    }

    /// Compact after every `auto_compact_every` batches.
    async fn maybe_compact(&self, loaded: &mut Loaded, batch_id: u64) {
        if let Some(n) = self.options.auto_compact_every
            && (batch_id + 1).is_multiple_of(n)
        {
            let full = match self.full(loaded).await {
                Ok(full) => full,
                Err(e) => {
                    tracing::warn!(table = %self.name, batch_id, error = %e, "auto-compaction skipped: the table could not be read");
                    return;
                }
            };
            self.compact(full, batch_id).await;
            if let Some(v) = full.version() {
                self.set_head(v);
            }
        }
    }

    /// Bin-pack the table's small files (auto-compaction after `batch_id`).
    /// The compaction commit only rearranges data (`dataChange: false`); a
    /// failure is logged and the stream goes on: compaction is an
    /// optimization, never part of the batch.
    async fn compact(&self, table: &mut DeltaTable, batch_id: u64) {
        let target = std::num::NonZeroU64::new(self.options.target_file_size)
            .unwrap_or(std::num::NonZeroU64::MIN);
        match table.clone().optimize().with_target_size(target).await {
            Ok((compacted, m)) => {
                tracing::info!(
                    table = %self.name,
                    batch_id,
                    files_removed = m.num_files_removed,
                    files_added = m.num_files_added,
                    "auto-compaction"
                );
                *table = compacted;
            }
            Err(e) => {
                tracing::warn!(table = %self.name, batch_id, error = %e, "auto-compaction failed; the next one retries");
            }
        }
    }

    /// The txn version recorded for `query_id` as of the newest version
    /// this sink has seen.
    ///
    /// The whole-log lookup costs more as the log grows between Delta
    /// checkpoints, so the answer is cached per table version and brought
    /// up to date by reading only the commits made since (usually none:
    /// this process is the only writer of its query).
    async fn txn_version(&self, loaded: &Loaded, query_id: &str) -> Result<Option<i64>> {
        let current = self.head(loaded).unwrap_or_default();
        let log_store = loaded.meta.log_store();
        let cached = self.txn.lock().await.clone();
        if let Some(c) = cached
            && c.app_id == query_id
            && c.table_version <= current
            && current - c.table_version <= MAX_INCREMENTAL_TXN_SCAN
            && let Some(txn) = scan_txn(
                log_store.as_ref(),
                query_id,
                c.table_version,
                current,
                c.txn,
            )
            .await
        {
            self.remember_txn(query_id, current, txn).await;
            return Ok(txn);
        }
        let txn = snapshot_txn(&log_store, current, query_id)
            .await
            .map_err(|e| self.table_err(e))?;
        self.remember_txn(query_id, current, txn).await;
        Ok(txn)
    }

    async fn remember_txn(&self, app_id: &str, table_version: u64, txn: Option<i64>) {
        *self.txn.lock().await = Some(TxnCache {
            app_id: app_id.to_string(),
            table_version,
            txn,
        });
    }
}

/// The txn version of `app_id` after the commits `(from, to]`, starting
/// from `txn` at `from`; `None` when a commit cannot be read (then the
/// caller reads the snapshot).
async fn scan_txn(
    store: &dyn LogStore,
    app_id: &str,
    from: u64,
    to: u64,
    mut txn: Option<i64>,
) -> Option<Option<i64>> {
    for v in from + 1..=to {
        let bytes = store.read_commit_entry(v).await.ok()??;
        for line in bytes.split(|b| *b == b'\n') {
            // Cheap pre-filter: most commit lines are adds.
            if !line.windows(6).any(|w| w == b"\"txn\":") {
                continue;
            }
            let action: serde_json::Value = serde_json::from_slice(line).ok()?;
            let t = &action["txn"];
            if t["appId"].as_str() == Some(app_id) {
                txn = Some(t["version"].as_i64()?);
            }
        }
    }
    Some(txn)
}

/// The txn version of `app_id` in the table's snapshot at `version`, read
/// by the Delta kernel from the newest checkpoint and the commits after it
/// (the txn column only: no file list is built).
async fn snapshot_txn(
    log_store: &LogStoreRef,
    version: u64,
    app_id: &str,
) -> Result<Option<i64>, DeltaTableError> {
    let engine = log_store.engine(None);
    // The kernel joins paths onto the root: it must end with a slash.
    let mut root = log_store.root_url().clone();
    if !root.path().ends_with('/') {
        root.set_path(&format!("{}/", root.path()));
    }
    let app_id = app_id.to_string();
    tokio::task::spawn_blocking(move || {
        let snapshot = buoyant_kernel::snapshot::Snapshot::builder_for(root.as_str())
            .at_version(version)
            .build(engine.as_ref())?;
        Ok(snapshot.get_app_id_version(&app_id, engine.as_ref())?)
    })
    .await
    .map_err(|e| DeltaTableError::Generic(format!("txn lookup task: {e}")))?
}

/// The table's `delta.checkpointInterval` (delta-rs's default: 100).
fn checkpoint_interval(meta: &BlindDeltaTable) -> u64 {
    meta.table_properties()
        .checkpoint_interval
        .map(|n| n.get())
        .unwrap_or(100)
}

/// Versions between expired-log cleanups: a multiple of the checkpoint
/// interval, at least CLEANUP_EVERY_VERSIONS.
fn cleanup_every(interval: u64) -> u64 {
    let interval = interval.max(1);
    interval * (CLEANUP_EVERY_VERSIONS / interval).max(1)
}

/// A [`DeltaTable`] handle (not loaded) for the table at `location`, served
/// by the location's store (the fast local store for local tables) and
/// committing with create-if-absent PUTs on every scheme.
pub fn open_table(location: &Location) -> Result<DeltaTable, DeltaTableError> {
    register_log_stores();
    let url = location.url().clone();
    let store: deltalake::logstore::ObjectStoreRef = if url.scheme() == "file" {
        Arc::new(lakestream_storage::FastLocalStore::new())
    } else {
        location.store().clone()
    };
    deltalake::DeltaTableBuilder::from_url(url.clone())?
        .with_storage_backend(store, url)
        .build()
}

/// Open and load the Delta table at `location`: `None` when no table is
/// there yet.
pub async fn load_table(location: &Location) -> Result<Option<DeltaTable>, DeltaTableError> {
    let mut table = open_table(location)?;
    load_checked(location, &mut table).await?;
    Ok(table.version().is_some().then_some(table))
}

/// Load `table` (at `location`); a missing table is not an error and
/// leaves it unloaded.
async fn load_checked(location: &Location, table: &mut DeltaTable) -> Result<(), DeltaTableError> {
    match table.load().await {
        Err(DeltaTableError::NotATable(msg)) => no_table_at(location, &msg).await,
        other => other,
    }
}

/// After delta-rs found no table at `location` (`msg`): `Ok` when there is
/// really no log at all. A log that could not be listed or read (a store
/// error on the way) is an error, never a reason to create the table
/// afresh or read its files raw.
async fn no_table_at(location: &Location, msg: &str) -> Result<(), DeltaTableError> {
    use futures::StreamExt;
    let log = location.child("_delta_log");
    match location.store().list(Some(&log)).next().await {
        None => Ok(()),
        Some(Err(e)) => Err(DeltaTableError::ObjectStore { source: e }),
        Some(Ok(_)) => Err(DeltaTableError::Generic(format!(
            "the table has a _delta_log that could not be loaded ({msg}); retry, or check the \
             store"
        ))),
    }
}

/// Cloud schemes commit through delta-rs's default log store: each commit
/// file is created with `PutMode::Create`, which object_store sends as a
/// conditional PUT (`If-None-Match: *` on S3, generation/etag preconditions
/// on GCS and Azure).
#[derive(Debug, Default)]
struct ConditionalPutLogStores;

impl deltalake::logstore::LogStoreFactory for ConditionalPutLogStores {
    fn with_options(
        &self,
        prefixed_store: deltalake::logstore::ObjectStoreRef,
        root_store: deltalake::logstore::ObjectStoreRef,
        location: &url::Url,
        options: &deltalake::logstore::StorageConfig,
    ) -> deltalake::DeltaResult<deltalake::logstore::LogStoreRef> {
        Ok(deltalake::logstore::default_logstore(
            prefixed_store,
            root_store,
            location,
            options,
        ))
    }
}

fn register_log_stores() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let factories = deltalake::logstore::logstore_factories();
        for scheme in ["s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl"] {
            let url = url::Url::parse(&format!("{scheme}://")).expect("scheme URL");
            if !factories.contains_key(&url) {
                factories.insert(url, Arc::new(ConditionalPutLogStores));
            }
        }
    });
}

/// The schema lakestream writes for a query output: Delta's types (UTC
/// microsecond timestamps, plain strings and binaries) and every column
/// nullable, so any reader opens the table.
///
/// A timestamp without a time zone is taken as UTC.
pub fn delta_schema(schema: &Schema) -> SchemaRef {
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|f| Field::new(f.name(), delta_type(f.data_type()), true))
        .collect();
    Arc::new(Schema::new(fields))
}

fn delta_type(t: &DataType) -> DataType {
    match t {
        DataType::Timestamp(_, _) => DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
        DataType::Utf8View | DataType::LargeUtf8 => DataType::Utf8,
        DataType::BinaryView | DataType::LargeBinary => DataType::Binary,
        DataType::Date64 => DataType::Date32,
        DataType::UInt8 => DataType::Int16,
        DataType::UInt16 => DataType::Int32,
        DataType::UInt32 | DataType::UInt64 => DataType::Int64,
        DataType::Float16 => DataType::Float32,
        DataType::Dictionary(_, v) => delta_type(v),
        DataType::List(f) | DataType::LargeList(f) | DataType::ListView(f) => DataType::List(
            Arc::new(Field::new(f.name(), delta_type(f.data_type()), true)),
        ),
        DataType::Struct(fields) => DataType::Struct(
            fields
                .iter()
                .map(|f| Field::new(f.name(), delta_type(f.data_type()), true))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Cast `batch` onto `schema` (same column order), as [`delta_schema`] maps
/// types.
pub fn cast_batch(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch, String> {
    if batch.schema().fields() == schema.fields() {
        return Ok(batch.clone());
    }
    let cols = batch
        .columns()
        .iter()
        .zip(schema.fields())
        .map(|(c, f)| {
            if c.data_type() == f.data_type() {
                Ok(c.clone())
            } else {
                arrow::compute::cast(c, f.data_type())
                    .map_err(|e| format!("column {}: {e}", f.name()))
            }
        })
        .collect::<Result<Vec<_>, String>>()?;
    RecordBatch::try_new(schema.clone(), cols).map_err(|e| e.to_string())
}

fn describe_schema(s: &Schema) -> String {
    s.fields()
        .iter()
        .map(|f| format!("{} {}", f.name(), f.data_type()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[async_trait]
impl Sink for DeltaSink {
    async fn open(&self, schema: SchemaRef) -> Result<()> {
        let wanted = delta_schema(&schema);
        for p in &self.options.partition_columns {
            if wanted.index_of(p).is_err() {
                return Err(Error::InvalidConfig {
                    table: self.name.clone(),
                    reason: format!(
                        "partition column {p} is not in the query's output ({})",
                        describe_schema(&wanted)
                    ),
                });
            }
        }
        self.location.verify_atomic_create().await?;
        let mut guard = self.table.lock().await;
        let meta = match self.load_meta().await? {
            Some(meta) => meta,
            None => {
                let kernel: StructType =
                    wanted
                        .as_ref()
                        .try_into_kernel()
                        .map_err(|e| Error::InvalidConfig {
                            table: self.name.clone(),
                            reason: format!("the query's output cannot be a Delta schema: {e}"),
                        })?;
                let created = open_table(&self.location)
                    .map_err(|e| self.table_err(e))?
                    .create()
                    .with_columns(kernel.fields().cloned())
                    .with_partition_columns(self.options.partition_columns.clone())
                    .with_configuration_property(
                        TableProperty::CheckpointInterval,
                        Some(self.options.checkpoint_interval.max(1).to_string()),
                    )
                    .with_save_mode(SaveMode::Ignore)
                    .await;
                // Created by someone else meanwhile: check it like any table.
                match (self.load_meta().await?, created) {
                    (Some(meta), _) => meta,
                    (None, Err(e)) => return Err(self.table_err(e)),
                    (None, Ok(_)) => {
                        return Err(self.table_err(DeltaTableError::Generic(
                            "the table was created but its log cannot be read back; check the \
                             store"
                                .into(),
                        )));
                    }
                }
            }
        };
        let existing = meta.arrow_schema().map_err(|e| self.table_err(e))?;
        let have = delta_schema(&existing);
        if have.fields().len() != wanted.fields().len()
            || have
                .fields()
                .iter()
                .zip(wanted.fields())
                .any(|(a, b)| a.name() != b.name() || a.data_type() != b.data_type())
        {
            return Err(Error::SchemaMismatch {
                table: self.name.clone(),
                reason: format!(
                    "the table has ({}), the query produces ({})",
                    describe_schema(&have),
                    describe_schema(&wanted)
                ),
            });
        }
        let parts: Vec<String> = meta.metadata().partition_columns().to_vec();
        if !self.options.partition_columns.is_empty() && parts != self.options.partition_columns {
            return Err(Error::SchemaMismatch {
                table: self.name.clone(),
                reason: format!(
                    "the table is partitioned by ({}), the job asks for ({})",
                    parts.join(", "),
                    self.options.partition_columns.join(", ")
                ),
            });
        }
        if meta
            .table_properties()
            .column_mapping_mode
            .is_some_and(|m| m != ColumnMappingMode::None)
        {
            return Err(Error::InvalidConfig {
                table: self.name.clone(),
                reason: "the table uses column mapping, which lakestream cannot write yet; \
                         write to a table without it"
                    .into(),
            });
        }
        self.set_head(meta.version());
        *guard = Some(Loaded { meta, full: None });
        Ok(())
    }

    async fn committed_batch(&self, query_id: &str) -> Result<Option<u64>> {
        let mut guard = self.table.lock().await;
        let loaded = match guard.as_mut() {
            Some(l) => l,
            None => match self.load_meta().await? {
                Some(meta) => guard.insert(Loaded { meta, full: None }),
                None => return Ok(None),
            },
        };
        self.refresh(loaded).await?;
        Ok(self
            .txn_version(loaded, query_id)
            .await?
            .and_then(|v| u64::try_from(v).ok()))
    }

    async fn begin(&self, batch_id: u64) -> Result<Box<dyn BatchWriter>> {
        let guard = self.table.lock().await;
        let loaded = guard.as_ref().ok_or_else(|| Error::InvalidConfig {
            table: self.name.clone(),
            reason: "the sink was not opened".into(),
        })?;
        let write_err = |e: DeltaTableError| Error::Write {
            table: self.name.clone(),
            batch_id,
            source: Box::new(e),
        };
        let props = WriterProperties::builder()
            .set_compression(self.options.compression)
            .build();
        let writer = RecordBatchWriter::for_blind_appends(&loaded.meta)
            .map_err(write_err)?
            .with_writer_properties(props)
            .with_target_file_size(self.options.target_file_size);
        let schema = delta_schema(loaded.meta.arrow_schema().map_err(write_err)?.as_ref());
        Ok(Box::new(DeltaBatchWriter {
            table: self.name.clone(),
            batch_id,
            schema,
            writer,
            rows: 0,
        }))
    }

    async fn commit(&self, staged: Staged, info: &CommitInfo) -> Result<CommitOutcome> {
        let mut guard = self.table.lock().await;
        let loaded = guard.as_mut().ok_or_else(|| Error::InvalidConfig {
            table: self.name.clone(),
            reason: "the sink was not opened".into(),
        })?;
        self.collect_checkpoint(loaded, false).await;
        let actions: Vec<Action> = staged
            .into_parts::<Vec<Action>>(&self.name)?
            .into_iter()
            .flatten()
            .collect();
        let batch = i64::try_from(info.batch_id).expect("batch ids fit in i64");
        // With this query's txn known at the newest version this sink has
        // seen, the log is not re-read: a commit by another writer since
        // then makes our create-if-absent fail (or, on the delta-rs path,
        // is caught by its conflict check), and that path re-reads.
        let head = self.head(loaded);
        let cached = self.txn.lock().await.clone();
        let txn = match cached {
            Some(c) if c.app_id == info.query_id && Some(c.table_version) == head => c.txn,
            _ => {
                self.refresh(loaded).await?;
                self.txn_version(loaded, &info.query_id).await?
            }
        };
        if txn.is_some_and(|v| v >= batch) {
            return Ok(CommitOutcome::AlreadyCommitted {
                version: self.head(loaded).unwrap_or_default(),
            });
        }
        let mut meta = info.metadata.clone();
        meta.insert("batchId".into(), serde_json::json!(info.batch_id));
        meta.insert("queryId".into(), serde_json::json!(info.query_id));
        let app_metadata: HashMap<String, serde_json::Value> =
            HashMap::from([("lakestream".to_string(), serde_json::Value::Object(meta))]);
        let operation = DeltaOperation::StreamingUpdate {
            output_mode: OutputMode::Append,
            query_id: info.query_id.clone(),
            epoch_id: batch,
        };
        let transaction = Transaction::new(&info.query_id, batch);

        let append = self
            .append_commit(
                loaded,
                &actions,
                operation.clone(),
                app_metadata.clone(),
                transaction.clone(),
                info.batch_id,
            )
            .await?;
        if let Append::Committed(version) = append {
            self.after_append(loaded, version, info).await;
            return Ok(CommitOutcome::Committed { version });
        }

        // delta-rs's commit: for tables with newer writer protocols, and
        // after another writer committed the version we tried.
        if append == Append::Taken {
            self.refresh(loaded).await?;
        }
        if let Some(v) = self.txn_version(loaded, &info.query_id).await?
            && v >= batch
        {
            return Ok(CommitOutcome::AlreadyCommitted {
                version: self.head(loaded).unwrap_or_default(),
            });
        }
        // delta-rs writes a Delta checkpoint with commit `v` when `v + 1` is
        // a multiple of the interval. Expired-log cleanup lists the whole
        // log: it runs with such a commit, and at most once per
        // CLEANUP_EVERY_VERSIONS versions, so a commit's cost does not grow
        // with the log.
        let interval = checkpoint_interval(&loaded.meta);
        let table = self.full(loaded).await?;
        let next = table.version().unwrap_or_default() + 1;
        let props = CommitProperties::default()
            .with_cleanup_expired_logs(Some((next + 1).is_multiple_of(cleanup_every(interval))))
            .with_application_transaction(transaction)
            .with_metadata(app_metadata);
        let state = table.snapshot().map_err(|e| self.table_err(e))?;
        let result = CommitBuilder::from(props)
            .with_actions(actions)
            .build(Some(state), table.log_store(), operation)
            .await;
        match result {
            Ok(done) => {
                let version = done.version();
                if done.metrics.new_checkpoint_created {
                    // This commit wrote a Delta checkpoint. A state carried
                    // from commit to commit keeps every commit's actions as
                    // its own piece, and replaying them all makes each
                    // commit slower than the last; reloading from the fresh
                    // checkpoint keeps the cost of a commit flat.
                    *table = self.load_full().await?;
                } else {
                    // The commit returns the new state: no need to re-read the log.
                    table.state = Some(done.snapshot());
                }
                self.set_head(version);
                self.remember_txn(&info.query_id, version, Some(batch))
                    .await;
                self.maybe_compact(loaded, info.batch_id).await;
                Ok(CommitOutcome::Committed { version })
            }
            Err(err) => {
                // A conflict on our own app id means another attempt of this
                // query committed first: if it holds this batch, we are done.
                let conflict = matches!(
                    &err,
                    DeltaTableError::Transaction {
                        source: TransactionError::CommitConflict(_)
                    }
                );
                if conflict {
                    self.refresh(loaded).await?;
                    if let Some(v) = self.txn_version(loaded, &info.query_id).await?
                        && v >= batch
                    {
                        return Ok(CommitOutcome::AlreadyCommitted {
                            version: self.head(loaded).unwrap_or_default(),
                        });
                    }
                }
                Err(Error::Commit {
                    table: self.name.clone(),
                    batch_id: info.batch_id,
                    source: Box::new(err),
                })
            }
        }
    }

    fn identity(&self) -> String {
        format!("delta {}", self.location.url())
    }

    async fn flush(&self) {
        let mut guard = self.table.lock().await;
        let Some(loaded) = guard.as_mut() else { return };
        // Collecting a checkpoint may start one that fell due meanwhile.
        while self
            .checkpointing
            .lock()
            .expect("checkpoint slot")
            .running
            .is_some()
        {
            self.collect_checkpoint(loaded, true).await;
        }
    }

    async fn version(&self) -> Result<Option<u64>> {
        let mut guard = self.table.lock().await;
        let loaded = match guard.as_mut() {
            Some(l) => l,
            None => match self.load_meta().await? {
                Some(meta) => guard.insert(Loaded { meta, full: None }),
                None => return Ok(None),
            },
        };
        Ok(self.head(loaded))
    }
}

struct DeltaBatchWriter {
    table: String,
    batch_id: u64,
    schema: SchemaRef,
    writer: RecordBatchWriter,
    rows: u64,
}

#[async_trait]
impl BatchWriter for DeltaBatchWriter {
    async fn write(&mut self, batch: RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        let batch = cast_batch(&batch, &self.schema).map_err(|reason| Error::SchemaMismatch {
            table: self.table.clone(),
            reason,
        })?;
        self.rows += batch.num_rows() as u64;
        self.writer.write(batch).await.map_err(|e| Error::Write {
            table: self.table.clone(),
            batch_id: self.batch_id,
            source: Box::new(e),
        })
    }

    async fn finish(mut self: Box<Self>) -> Result<Staged> {
        let adds = self.writer.flush().await.map_err(|e| Error::Write {
            table: self.table.clone(),
            batch_id: self.batch_id,
            source: Box::new(e),
        })?;
        let bytes = adds.iter().map(|a| a.size.max(0) as u64).sum();
        let files = adds.len();
        let actions: Vec<Action> = adds.into_iter().map(Action::Add).collect();
        Ok(Staged::new(self.batch_id, self.rows, files, bytes, actions))
    }
}
