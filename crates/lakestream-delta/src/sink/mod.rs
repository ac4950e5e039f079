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
//! Data files stream out through delta-rs's writers: Parquet
//! files roll at the target file size, so memory is bounded by the open
//! files, not by the batch or the table.
//!
//! On every store the table is written through delta-rs's default log
//! store, which creates `_delta_log/N.json` with a create-if-absent PUT
//! (S3 `If-None-Match`), over the store lakestream's own [`Location`]
//! built. No locking service is needed; a store that cannot create
//! atomically is refused when the sink opens
//! ([`Location::verify_atomic_create`]).
//!
//! The module, by concern: this file holds the sink, its view of the table
//! (metadata without the file list; the file list loaded only where
//! delta-rs needs it); `sink_impl` the `Sink` implementation; `append` the fast
//! append (one create-if-absent write of the commit file); `txn` the
//! query's txn version (cached, brought forward commit by commit, or read
//! from the snapshot); `maintenance` Delta checkpoints and auto-compaction
//! off the batch path; `schema` the Delta schema of a query's output;
//! `writer` the streaming Parquet writer of a batch.

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

use lakestream_sink::{
    BatchWriter, CommitInfo, CommitOutcome, Error, Result, Sink, Staged, WriteMode, describe_schema,
};
use lakestream_storage::{Location, StoreRegistry};

mod append;
mod commit;
pub mod features;
mod maintenance;
mod merge;
mod partition_files;
mod positions;
mod rules;
mod schema;
mod sink_impl;
mod txn;
mod writer;

use maintenance::{checkpoint_interval, cleanup_every};
pub use schema::{cast_batch, delta_schema};
use writer::DeltaBatchWriter;

/// Default target size of a data file: 128 MiB.
pub const DEFAULT_TARGET_FILE_SIZE: u64 = 128 * 1024 * 1024;

/// Default [`DeltaSinkOptions::unordered_flush_size`]: 8 MiB. With it, a
/// batch whose rows fall in many partitions in no order takes less memory
/// at 256 MiB than a 64 MiB batch did without a flush.
pub const DEFAULT_UNORDERED_FLUSH_SIZE: u64 = 8 * 1024 * 1024;

/// `delta.checkpointInterval` of the tables the sink creates: a Delta
/// checkpoint every 10 commits (delta-rs's own default is 100).
///
/// After each commit, delta-rs carries the table state forward as one
/// piece per commit since the last checkpoint and replays every piece on the
/// next commit, so a commit costs more the further it is from a checkpoint
/// (linearly in the commits since it).
/// The sink reloads the state from each new checkpoint, so this interval
/// bounds a commit's cost.
pub const DEFAULT_CHECKPOINT_INTERVAL: u64 = 10;

/// Expired-log cleanup lists the whole `_delta_log/`; it runs on a
/// checkpoint commit at most once per this many versions.
const CLEANUP_EVERY_VERSIONS: u64 = 100;

/// Times delta-rs's commit rebases a batch over other writers' commits
/// before giving up (its default, 15, runs out when several processes
/// append to one table back to back: each attempt reads the commits that
/// won and tries the next version, and appends never conflict with them).
const COMMIT_RETRIES: usize = 100;

/// Settings of a [`DeltaSink`].
#[derive(Clone)]
pub struct DeltaSinkOptions {
    /// Partition columns used when the table is created; when the table
    /// exists they must match its partitioning (empty: accept the table's).
    pub partition_columns: Vec<String>,
    /// Roll to a new data file past this many bytes.
    pub target_file_size: u64,
    /// A partitioned table's batch whose partition values come unordered
    /// (more than 64 runs in a record batch) keeps one open file per
    /// partition; the writer closes them all each time it has taken this
    /// many bytes (in Arrow memory) of such input, so their memory stays
    /// bounded whatever the batch's size. The files closed early stay in
    /// the batch's one commit. Lower: less memory, more and smaller files.
    pub unordered_flush_size: u64,
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
    /// Evolve an existing table's schema to the query's output: columns
    /// the table lacks are added (nullable) by a `metaData` action in the
    /// first batch's commit; the table's columns the query no longer
    /// produces are written as NULL. A column whose type changed is
    /// refused. Appends only.
    pub merge_schema: bool,
    /// The embedder's stores, for buckets it serves itself (empty: the
    /// table's store is built from its URL and `storage_options`).
    pub object_stores: StoreRegistry,
}

/// Storage option values may be secrets: only their keys are shown.
impl std::fmt::Debug for DeltaSinkOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut keys: Vec<&String> = self.storage_options.keys().collect();
        keys.sort();
        f.debug_struct("DeltaSinkOptions")
            .field("partition_columns", &self.partition_columns)
            .field("target_file_size", &self.target_file_size)
            .field("unordered_flush_size", &self.unordered_flush_size)
            .field("compression", &self.compression)
            .field("storage_option_keys", &keys)
            .field("auto_compact_every", &self.auto_compact_every)
            .field("checkpoint_interval", &self.checkpoint_interval)
            .field("merge_schema", &self.merge_schema)
            .field("object_stores", &self.object_stores)
            .finish()
    }
}

impl Default for DeltaSinkOptions {
    fn default() -> Self {
        Self {
            partition_columns: Vec::new(),
            target_file_size: DEFAULT_TARGET_FILE_SIZE,
            unordered_flush_size: DEFAULT_UNORDERED_FLUSH_SIZE,
            compression: Compression::SNAPPY,
            storage_options: HashMap::new(),
            auto_compact_every: None,
            checkpoint_interval: DEFAULT_CHECKPOINT_INTERVAL,
            merge_schema: false,
            object_stores: StoreRegistry::default(),
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
    /// Appends that lost their version to another writer and went through
    /// delta-rs's conflict-checked commit instead.
    retries: std::sync::atomic::AtomicU64,
    /// How the query's output differs from the table's columns, when it
    /// does (`merge_schema`).
    evolution: std::sync::Mutex<Option<Evolution>>,
    /// Source positions kept in the table, as of one version.
    positions: Mutex<positions::PositionCache>,
    /// What the table's protocol and properties ask of this writer, as of
    /// [`Sink::open`] (or the sink's own schema change since).
    contract: std::sync::Mutex<Contract>,
}

/// The table's features and row rules as the sink opened it, and what
/// they were derived from: a commit finding them changed by another
/// writer refuses to commit a batch written under the old ones.
#[derive(Debug, Default)]
struct Contract {
    features: features::TableFeatures,
    /// The rules every written row is checked against (`None`: none).
    rules: Option<Arc<rules::TableRules>>,
    /// The query leaves out generated columns the sink computes: batches
    /// are matched to the table's columns by name.
    computes_columns: bool,
    /// The protocol, configuration and schema the above come from.
    source: String,
    /// The newest `inCommitTimestamp` the sink knows, with its version.
    last_ict: Option<(u64, i64)>,
}

/// A query's output written into a table with other columns
/// (`merge_schema`).
#[derive(Debug, Clone)]
struct Evolution {
    /// The columns written: the table's, then the query's new ones. Rows
    /// are matched to them by name; a column the query lacks is NULL.
    schema: SchemaRef,
    /// The table's new metadata, carried by the next commit, while the
    /// table lacks the new columns.
    metadata: Option<deltalake::kernel::Metadata>,
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
        let location =
            Location::parse_with(location, &options.storage_options, &options.object_stores)?;
        for (option, value) in [
            ("target_file_size", options.target_file_size),
            ("unordered_flush_size", options.unordered_flush_size),
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
            retries: Default::default(),
            evolution: Default::default(),
            positions: Default::default(),
            contract: Default::default(),
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
        // Another process may create the table between delta-rs's look and
        // ours (several processes starting on one new table): a log that
        // has commits by the time we list it is loaded again.
        use backon::BackoffBuilder;
        // 20, 40, 80 ms: three more looks.
        let mut waits = backon::ExponentialBuilder::default()
            .with_min_delay(std::time::Duration::from_millis(20))
            .with_factor(2.0)
            .with_max_times(3)
            .build();
        loop {
            match BlindDeltaTable::try_new_with_log_store(self.log_store()?).await {
                Ok(meta) => return Ok(Some(meta)),
                Err(DeltaTableError::NotATable(msg)) => {
                    match no_table_at(&self.location, &msg).await {
                        Ok(()) => return Ok(None),
                        Err(e) => match waits.next() {
                            Some(wait) => tokio::time::sleep(wait).await,
                            None => return Err(self.table_err(e)),
                        },
                    }
                }
                // The kernel refuses tables it cannot load (one whose commits
                // a catalog coordinates, say): name the feature when the log
                // says which.
                Err(e) => {
                    return Err(match features::from_log(&self.location).await {
                        Some(found) => match found.check(&self.name) {
                            Err(refused) => refused,
                            Ok(()) => self.table_err(e),
                        },
                        None => self.table_err(e),
                    });
                }
            }
        }
    }

    /// The sink's view of the table in `slot`, loaded (metadata only) when
    /// the sink has not looked yet; `None` when there is no table.
    async fn loaded<'a>(&self, slot: &'a mut Option<Loaded>) -> Result<Option<&'a mut Loaded>> {
        if slot.is_none() {
            match self.load_meta().await? {
                Some(meta) => *slot = Some(Loaded { meta, full: None }),
                None => return Ok(None),
            }
        }
        Ok(slot.as_mut())
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

    /// Refuse to commit batch `batch_id` when another writer changed the
    /// table's protocol, properties or schema since the sink opened it:
    /// the batch's rows were checked against the old rules. A restart
    /// opens the table again and checks the batch against the new ones.
    fn check_contract(&self, loaded: &Loaded, batch_id: u64) -> Result<()> {
        let now = contract_source(&loaded.meta);
        if self.contract.lock().expect("contract lock").source == now {
            return Ok(());
        }
        Err(Error::Commit {
            table: self.name.clone(),
            batch_id,
            source: "another writer changed the table's protocol, properties or schema while \
                     the batch was written; the batch is not committed: restart the query to \
                     check it against the table as it is now"
                .into(),
        })
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

/// The features of the table `meta` and how this sink handles each.
pub(crate) fn features_of(meta: &BlindDeltaTable) -> features::TableFeatures {
    let protocol = meta.protocol();
    let named: Vec<String> = protocol
        .writer_features()
        .map(|f| f.iter().map(|f| f.to_string()).collect())
        .unwrap_or_default();
    features::TableFeatures::of(
        protocol.min_reader_version(),
        protocol.min_writer_version(),
        &named,
        meta.metadata().configuration(),
        &meta.schema(),
    )
}

/// The features of the Delta table at `location` and how this sink
/// handles each (`None`: no table there): what `verify` reports and what
/// maintenance checks before it rewrites files.
pub async fn table_features(location: &Location) -> Result<Option<features::TableFeatures>> {
    location.ensure_local_dir()?;
    let table_err = |source: DeltaTableError| Error::Table {
        table: location.url().to_string(),
        source: Box::new(source),
    };
    let log_store = open_table(location).map_err(table_err)?.log_store();
    match BlindDeltaTable::try_new_with_log_store(log_store).await {
        Ok(meta) => Ok(Some(features_of(&meta))),
        Err(DeltaTableError::NotATable(_)) => Ok(None),
        Err(e) => Err(table_err(e)),
    }
}

/// What the sink's rules for a table are derived from: its protocol,
/// properties and schema.
fn contract_source(meta: &BlindDeltaTable) -> String {
    let config: std::collections::BTreeMap<_, _> = meta.metadata().configuration().iter().collect();
    format!(
        "{}\n{}\n{}",
        serde_json::to_string(meta.protocol()).unwrap_or_default(),
        serde_json::to_string(&config).unwrap_or_default(),
        serde_json::to_string(meta.schema().as_ref()).unwrap_or_default(),
    )
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

/// After delta-rs found no table at `location` (`msg`): `Ok` when the log
/// holds no commit or checkpoint (nothing at all, or only another writer's
/// temporary file while it creates the table: several processes starting
/// on one new table). A log that could not be listed or read (a store
/// error on the way) is an error, never a reason to create the table
/// afresh or read its files raw.
async fn no_table_at(location: &Location, msg: &str) -> Result<(), DeltaTableError> {
    use futures::TryStreamExt;
    let log = location.child("_delta_log");
    let mut entries = location.store().list(Some(&log));
    while let Some(meta) = entries
        .try_next()
        .await
        .map_err(|source| DeltaTableError::ObjectStore { source })?
    {
        if meta.location.filename().is_some_and(is_log_file) {
            return Err(DeltaTableError::Generic(format!(
                "the table has a _delta_log that could not be loaded ({msg}); retry, or check \
                 the store"
            )));
        }
    }
    Ok(())
}

/// Whether `name` (in `_delta_log/`) is a commit (`N.json`), a checkpoint
/// (`N.checkpoint[.i.n].parquet`) or the checkpoint pointer, rather than a
/// writer's temporary file (the local store stages a create-if-absent as
/// `N.json#1` before linking it in place).
fn is_log_file(name: &str) -> bool {
    if name == "_last_checkpoint" {
        return true;
    }
    let Some((version, rest)) = name.split_once('.') else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if version.len() != 20 || !digits(version) {
        return false;
    }
    match rest.strip_prefix("checkpoint.") {
        None => rest == "json",
        Some(tail) => {
            let parts: Vec<&str> = tail.split('.').collect();
            matches!(parts.as_slice(), ["parquet"])
                || matches!(parts.as_slice(), [i, n, "parquet"] if digits(i) && digits(n))
        }
    }
}

#[cfg(test)]
mod log_file_tests {
    #[test]
    fn only_commits_checkpoints_and_the_pointer_make_a_log() {
        for yes in [
            "00000000000000000000.json",
            "00000000000000000009.checkpoint.parquet",
            "00000000000000000009.checkpoint.0000000001.0000000002.parquet",
            "_last_checkpoint",
        ] {
            assert!(super::is_log_file(yes), "{yes}");
        }
        for no in [
            "00000000000000000000.json#1",
            "_commit_0f3a.json.tmp",
            "00000000000000000000.crc.tmp",
            "0.json",
        ] {
            assert!(!super::is_log_file(no), "{no}");
        }
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
