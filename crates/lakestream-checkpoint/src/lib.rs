//! The checkpoint log of a lakestream query: what makes a micro-batch happen
//! exactly once.
//!
//! A checkpoint is a directory on any object store (a local path, `file://`,
//! `s3://`, `gs://`, `az://`) holding small, versioned JSON files:
//!
//! ```text
//! <checkpoint>/metadata      query id, created once with create-if-absent
//! <checkpoint>/query         the query's sources and sink, created once, compared at restart
//! <checkpoint>/offsets/<N>   write-ahead: source ranges of batch N, its timestamp
//! <checkpoint>/commits/<N>   batch N is in the table
//! <checkpoint>/lock          local checkpoints only: held by the running process
//! ```
//!
//! The protocol, in the order the engine follows it for batch `N`:
//!
//! ```text
//!  plan ──► offsets/N (create-if-absent) ──► execute ──► table commit(txn=N) ──► commits/N
//! ```
//!
//! `offsets/N` without `commits/N` means batch N was planned and may or may
//! not be in the table: the engine re-runs exactly that range, and the sink's
//! transaction check skips it if it was committed. This crate owns the files
//! and the fence; it links no DataFusion, Delta or Kafka code, so `status` is
//! cheap and the protocol can be tested alone.
//!
//! # Example
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use std::collections::{BTreeMap, HashMap};
//! use lakestream_checkpoint::{Checkpoint, OffsetsEntry, SourceRange};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let ckpt = Checkpoint::open(dir.path().to_str().unwrap(), &HashMap::new()).await.unwrap();
//! let mut sources = BTreeMap::new();
//! sources.insert("events".to_string(), SourceRange { start: None, end: serde_json::json!(10) });
//! ckpt.write_offsets(&OffsetsEntry::new(0, 1_700_000_000_000, sources)).await.unwrap();
//! assert_eq!(ckpt.latest_offsets().await.unwrap().unwrap().batch_id, 0);
//! assert!(ckpt.latest_commit().await.unwrap().is_none());
//! # });
//! ```

mod log;
mod view;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use lakestream_storage::Location;

/// The checkpoint file format this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;

/// Errors of the checkpoint log.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Another live process holds the checkpoint.
    #[error(
        "checkpoint in use: {location} is held by another running lakestream process ({detail}); \
         stop that process or use a different --checkpoint"
    )]
    InUse {
        /// The checkpoint location.
        location: String,
        /// What showed the checkpoint is taken.
        detail: String,
    },
    /// A checkpoint file cannot be parsed.
    #[error(
        "checkpoint file {file} is corrupt: {reason}; restore it from a backup, or remove it \
         only if you know the batch it describes never reached the table"
    )]
    Corrupt {
        /// The file's URL.
        file: String,
        /// The parse error.
        reason: String,
    },
    /// A checkpoint file was written by a different format version.
    #[error(
        "checkpoint file {file} has format version {found}; this lakestream reads version \
         {FORMAT_VERSION}: run a lakestream release that matches the checkpoint"
    )]
    UnsupportedVersion {
        /// The file's URL.
        file: String,
        /// The version found in the file.
        found: u32,
    },
    /// The query run on this checkpoint reads other sources, or writes
    /// another sink, than the query that created it.
    #[error(
        "checkpoint {location} belongs to a query with other sources or another sink, so its \
         offsets do not apply to this one: {}. Run this query with a new --checkpoint (it then \
         starts from its sources' starting offsets), or restore the query as it was. Changing \
         filters, projections or the SELECT list is allowed; changing which tables are read or \
         written is not",
        differences.join("; ")
    )]
    QueryChanged {
        /// The checkpoint location.
        location: String,
        /// Each difference, readable.
        differences: Vec<String>,
    },
    /// The checkpoint's location or store failed.
    #[error(transparent)]
    Storage(#[from] lakestream_storage::Error),
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `<checkpoint>/metadata`: who this query is. Written once, never rewritten.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metadata {
    /// Format version ([`FORMAT_VERSION`]).
    pub version: u32,
    /// The query id: the Delta `txn` app id of every commit of this query.
    pub query_id: Uuid,
    /// When the checkpoint was created, in ms since the Unix epoch.
    pub created_at_ms: i64,
}

/// One source as the checkpoint records it: what kind it is and what it
/// reads (never credentials).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedSource {
    /// The kind of source (`files`, `kafka`, `generator`).
    pub kind: String,
    /// What it reads: a location URL, topics.
    pub location: String,
}

/// `<checkpoint>/query`: the sources (by table name) and the sink of the
/// query that owns the checkpoint. Created at the first run, never
/// rewritten; a later run whose sources or sink differ is refused
/// ([`Error::QueryChanged`]), since the offsets would be applied to input
/// they do not describe.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QueryRecord {
    /// Format version ([`FORMAT_VERSION`]).
    pub version: u32,
    /// Source table name -> what it reads.
    pub sources: BTreeMap<String, RecordedSource>,
    /// What the sink writes to (the first output's, when the query has
    /// several).
    pub sink: String,
    /// What the query's further outputs write to, in order (a job with
    /// several `INSERT`s); empty for one output.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<String>,
    /// What the query's dead-letter tables are (records its sources could
    /// not decode). They hold only the batches that rejected something, so
    /// gaps in their batch ids are expected. Adding or removing one is not
    /// a change of the query.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dead_letters: Vec<String>,
}

impl QueryRecord {
    /// A record at the current format version, of a query with one output.
    pub fn new(sources: BTreeMap<String, RecordedSource>, sink: String) -> Self {
        Self {
            version: FORMAT_VERSION,
            sources,
            sink,
            outputs: Vec::new(),
            dead_letters: Vec::new(),
        }
    }

    /// The record with the query's dead-letter tables.
    pub fn with_dead_letters(mut self, dead_letters: Vec<String>) -> Self {
        self.dead_letters = dead_letters;
        self
    }

    /// The record with the query's further outputs.
    pub fn with_outputs(mut self, outputs: Vec<String>) -> Self {
        self.outputs = outputs;
        self
    }

    /// Every output of the query: the sink, then the further outputs.
    pub fn all_outputs(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.sink.as_str()).chain(self.outputs.iter().map(String::as_str))
    }

    /// How `self` (this run) differs from `recorded`, one line per
    /// difference; empty when the query may run on the checkpoint.
    pub fn differences(&self, recorded: &QueryRecord) -> Vec<String> {
        let mut out = Vec::new();
        for (name, was) in &recorded.sources {
            match self.sources.get(name) {
                None => out.push(format!(
                    "source {name} ({} {}) is no longer in the query",
                    was.kind, was.location
                )),
                Some(now) if now != was => out.push(format!(
                    "source {name} read {} {} and now reads {} {}",
                    was.kind, was.location, now.kind, now.location
                )),
                Some(_) => {}
            }
        }
        for (name, now) in &self.sources {
            if !recorded.sources.contains_key(name) {
                out.push(format!(
                    "source {name} ({} {}) is new",
                    now.kind, now.location
                ));
            }
        }
        if self.sink != recorded.sink {
            out.push(format!(
                "the output was {} and now is {}",
                recorded.sink, self.sink
            ));
        }
        for was in &recorded.outputs {
            if !self.outputs.contains(was) {
                out.push(format!("output {was} is no longer in the query"));
            }
        }
        for now in &self.outputs {
            if !recorded.outputs.contains(now) {
                // Its first batch would be the query's next one: the input
                // before it would never reach the new table.
                out.push(format!(
                    "output {now} is new (it would miss every batch before this run's)"
                ));
            }
        }
        out
    }
}

/// One source's range in a batch. `start` is the previous batch's end
/// (`None` for the first batch); the batch reads `(start, end]` in the
/// source's own offset terms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceRange {
    /// End of the previous batch, or `None` before the first batch.
    pub start: Option<serde_json::Value>,
    /// End of this batch, inclusive of everything it reads.
    pub end: serde_json::Value,
}

/// `<checkpoint>/offsets/<N>`: the write-ahead record of batch N.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OffsetsEntry {
    /// Format version ([`FORMAT_VERSION`]).
    pub version: u32,
    /// The batch id N.
    pub batch_id: u64,
    /// The batch's timestamp (ms since the epoch), fixed so a replay sees the
    /// same `now()`.
    pub batch_timestamp_ms: i64,
    /// The event-time watermark in ms, when the query has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watermark_ms: Option<i64>,
    /// Range per source name.
    pub sources: BTreeMap<String, SourceRange>,
    /// The version of each static table (a Delta table joined by the
    /// query, by name) the batch reads, fixed so a replay joins the same
    /// rows.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tables: BTreeMap<String, u64>,
}

impl OffsetsEntry {
    /// A new entry at the current format version.
    pub fn new(
        batch_id: u64,
        batch_timestamp_ms: i64,
        sources: BTreeMap<String, SourceRange>,
    ) -> Self {
        Self {
            version: FORMAT_VERSION,
            batch_id,
            batch_timestamp_ms,
            watermark_ms: None,
            sources,
            tables: BTreeMap::new(),
        }
    }
}

/// `<checkpoint>/commits/<N>`: batch N is in the table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommitEntry {
    /// Format version ([`FORMAT_VERSION`]).
    pub version: u32,
    /// The batch id N.
    pub batch_id: u64,
    /// The table version holding the batch, when the sink has versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table_version: Option<u64>,
    /// True when the table already held the batch and nothing was written.
    #[serde(default)]
    pub skipped: bool,
    /// When the batch was marked done, in ms since the Unix epoch.
    pub committed_at_ms: i64,
    /// The version holding the batch in each further output's table, by
    /// the output's identity ([`QueryRecord::outputs`]); `table_version`
    /// is the first output's. Empty for one output.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub outputs: BTreeMap<String, u64>,
    /// Set when the batch was dropped, not committed: another writer moved
    /// a source position it claimed first (Kafka group mode). Says which.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub superseded: Option<String>,
}

impl CommitEntry {
    /// A new entry at the current format version, stamped now.
    pub fn new(batch_id: u64, table_version: Option<u64>, skipped: bool) -> Self {
        Self {
            version: FORMAT_VERSION,
            batch_id,
            table_version,
            skipped,
            committed_at_ms: now_ms(),
            outputs: BTreeMap::new(),
            superseded: None,
        }
    }

    /// The version of the table written by output `identity` holding the
    /// batch: `table_version` for the first output (`sink`).
    pub fn version_of(&self, identity: &str, sink: &str) -> Option<u64> {
        if identity == sink {
            self.table_version
        } else {
            self.outputs.get(identity).copied()
        }
    }
}

/// `<checkpoint>/progress/<N>`: what batch N did, as the engine reported
/// it (rows, durations by phase, ranges, watermark, state). Written after
/// the batch committed, best effort, and purged with `offsets/N`: the
/// history `status` and the status page plot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgressEntry {
    /// Format version ([`FORMAT_VERSION`]).
    pub version: u32,
    /// The batch id N.
    pub batch_id: u64,
    /// The engine's progress report of the batch.
    pub progress: serde_json::Value,
}

impl ProgressEntry {
    /// A new entry at the current format version.
    pub fn new(batch_id: u64, progress: serde_json::Value) -> Self {
        Self {
            version: FORMAT_VERSION,
            batch_id,
            progress,
        }
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// An open checkpoint. Opening it takes the fence; dropping it releases it.
#[derive(Debug)]
pub struct Checkpoint {
    location: Location,
    metadata: Metadata,
    // Held for the life of the checkpoint: the OS releases the lock when the
    // process dies, so a restart after kill -9 is never blocked.
    _lock: Option<File>,
}

/// A read-only view of a checkpoint (no fence taken).
#[derive(Debug)]
pub struct CheckpointView {
    location: Location,
    metadata: Metadata,
}

fn take_lock(dir: &std::path::Path, url: &str) -> Result<File> {
    let path = dir.join("lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| lakestream_storage::Error::Io {
            path: path.display().to_string(),
            source: e,
        })?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(Error::InUse {
            location: url.to_string(),
            detail: format!("{} is locked", path.display()),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(lakestream_storage::Error::Io {
            path: path.display().to_string(),
            source: e,
        }
        .into()),
    }
}

fn file_url(location: &Location, name: &str) -> String {
    format!("{}{}", location.url(), name)
}

async fn read_metadata(location: &Location) -> Result<Option<Metadata>> {
    read_entry(location, "metadata").await
}

/// A file that carries a format version.
trait Versioned {
    fn format_version(&self) -> u32;
}

impl Versioned for Metadata {
    fn format_version(&self) -> u32 {
        self.version
    }
}
impl Versioned for OffsetsEntry {
    fn format_version(&self) -> u32 {
        self.version
    }
}
impl Versioned for QueryRecord {
    fn format_version(&self) -> u32 {
        self.version
    }
}
impl Versioned for ProgressEntry {
    fn format_version(&self) -> u32 {
        self.version
    }
}
impl Versioned for CommitEntry {
    fn format_version(&self) -> u32 {
        self.version
    }
}

async fn read_entry<T: serde::de::DeserializeOwned + Versioned>(
    location: &Location,
    name: &str,
) -> Result<Option<T>> {
    let file = file_url(location, name);
    let Some(bytes) = location.read(&location.child(name)).await? else {
        return Ok(None);
    };
    // Look at the version before the shape, so a newer format is reported as
    // such rather than as corruption.
    let raw: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt {
        file: file.clone(),
        reason: e.to_string(),
    })?;
    match raw.get("version").and_then(|v| v.as_u64()) {
        Some(v) if v == u64::from(FORMAT_VERSION) => {}
        Some(v) => {
            return Err(Error::UnsupportedVersion {
                file,
                found: u32::try_from(v).unwrap_or(u32::MAX),
            });
        }
        None => {
            return Err(Error::Corrupt {
                file,
                reason: "no \"version\" field".into(),
            });
        }
    }
    let entry: T = serde_json::from_value(raw).map_err(|e| Error::Corrupt {
        file: file.clone(),
        reason: e.to_string(),
    })?;
    debug_assert_eq!(entry.format_version(), FORMAT_VERSION);
    Ok(Some(entry))
}

async fn put_json<T: Serialize>(
    location: &Location,
    path: &Path,
    value: &T,
    mode: PutMode,
) -> Result<()> {
    let bytes = serde_json::to_vec_pretty(value).expect("checkpoint types serialize");
    let opts = PutOptions {
        mode,
        ..Default::default()
    };
    location
        .store()
        .put_opts(path, PutPayload::from(bytes), opts)
        .await
        .map_err(|e| lakestream_storage::Error::Store {
            file: format!("{}{}", location.url(), path_below_root(location, path)),
            source: e,
        })?;
    // Durable before the next protocol step relies on it (a local store
    // does not sync by itself).
    Ok(location.sync(path).await?)
}

fn path_below_root(location: &Location, path: &Path) -> String {
    let root = location.root().as_ref();
    let p = path.as_ref();
    p.strip_prefix(root)
        .map(|s| s.trim_start_matches('/').to_string())
        .unwrap_or_else(|| p.to_string())
}

async fn list_ids(location: &Location, dir: &str) -> Result<Vec<u64>> {
    if let Some(root) = location.local_dir() {
        return list_local_ids(root.join(dir)).await;
    }
    let prefix = location.child(dir);
    let metas: Vec<_> = location
        .store()
        .list(Some(&prefix))
        .try_collect()
        .await
        .map_err(|e| lakestream_storage::Error::Store {
            file: file_url(location, dir),
            source: e,
        })?;
    let mut ids: Vec<u64> = metas
        .iter()
        .filter_map(|m| m.location.filename().and_then(|f| f.parse::<u64>().ok()))
        .collect();
    ids.sort_unstable();
    Ok(ids)
}

/// [`list_ids`] on a local disk: the directory's names only. The store's
/// listing stats every entry and hops through blocking tasks, which made
/// listing the 100 kept write-ahead files a third of a restart.
async fn list_local_ids(path: std::path::PathBuf) -> Result<Vec<u64>> {
    let shown = path.display().to_string();
    let listed = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<u64>> {
        let entries = match std::fs::read_dir(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            other => other?,
        };
        let mut ids = Vec::new();
        for entry in entries {
            if let Some(id) = entry?
                .file_name()
                .to_str()
                .and_then(|f| f.parse::<u64>().ok())
            {
                ids.push(id);
            }
        }
        Ok(ids)
    })
    .await
    .map_err(|e| lakestream_storage::Error::Io {
        path: shown.clone(),
        source: std::io::Error::other(e),
    })?;
    let mut ids = listed.map_err(|source| lakestream_storage::Error::Io {
        path: shown,
        source,
    })?;
    ids.sort_unstable();
    Ok(ids)
}

async fn latest<T: serde::de::DeserializeOwned + Versioned>(
    location: &Location,
    dir: &str,
) -> Result<Option<T>> {
    match list_ids(location, dir).await?.last() {
        Some(id) => read_entry(location, &format!("{dir}/{id}")).await,
        None => Ok(None),
    }
}

/// Read `<checkpoint>/sources/<source>/<file>` (a source's private JSON
/// state, such as an inferred schema), if present. Does not take the fence.
pub async fn read_source_state(
    location: &Location,
    source: &str,
    file: &str,
) -> Result<Option<serde_json::Value>> {
    read_state_at(location, source, file).await
}

#[derive(Deserialize)]
struct StateWrapper {
    version: u32,
    state: serde_json::Value,
}

impl Versioned for StateWrapper {
    fn format_version(&self) -> u32 {
        self.version
    }
}

async fn read_state_at(
    location: &Location,
    source: &str,
    file: &str,
) -> Result<Option<serde_json::Value>> {
    let w: Option<StateWrapper> = read_entry(location, &format!("sources/{source}/{file}")).await?;
    Ok(w.map(|w| w.state))
}

async fn init_state_at(
    loc: &Location,
    source: &str,
    file: &str,
    state: serde_json::Value,
) -> Result<serde_json::Value> {
    let path = loc.child(&format!("sources/{source}/{file}"));
    let body = serde_json::json!({ "version": FORMAT_VERSION, "state": state });
    match put_json(loc, &path, &body, PutMode::Create).await {
        Ok(()) => Ok(state),
        Err(Error::Storage(lakestream_storage::Error::Store {
            source: object_store::Error::AlreadyExists { .. },
            ..
        })) => Ok(read_state_at(loc, source, file).await?.unwrap_or(state)),
        Err(e) => Err(e),
    }
}

/// Write `<checkpoint>/sources/<source>/<file>` unless it exists; returns
/// the state that is stored afterwards (the existing one wins, so every
/// process of a query sees the same value).
pub async fn init_source_state(
    location: &Location,
    source: &str,
    file: &str,
    state: serde_json::Value,
) -> Result<serde_json::Value> {
    location.ensure_local_dir()?;
    init_state_at(location, source, file, state).await
}

#[cfg(test)]
mod tests;
