//! [`DeltaSource`]: a Delta table's new data, as a stream.
//!
//! The source reads what is in the table when the query first starts (the
//! snapshot of that version, loaded from the log's checkpoint, never by
//! replaying the log from version 0), then each later commit's new files,
//! in commit order; or, with `starting_version` or `starting_timestamp`,
//! only the commits from that version or time on. An offset is a position in that sequence: `{version,
//! index, snapshot}` = "the first `index` files of the snapshot at
//! `version` (or of commit `version`) are taken". A snapshot's files are
//! ordered by path; a commit's in the order its log lists them; so a
//! replay after a crash reads the same files.
//!
//! Commits that only rearrange data (`dataChange: false`: OPTIMIZE,
//! compaction) add nothing. A commit that removes data (DELETE, UPDATE,
//! MERGE, an overwrite) cannot be followed by an append-only stream: the
//! plan fails naming the version, unless `skip_change_commits` is set, in
//! which case the whole commit is passed over (as Spark's option does). A
//! commit that changes the table's schema stops the query with the version
//! named. A file with a deletion vector is read without the rows its
//! vector deletes. Tables with column mapping are refused.
//!
//! With `read_change_feed` the source streams the table's change data feed
//! instead, as Spark's `readChangeFeed` does: every row with
//! `_change_type` (`insert`, `delete`, `update_preimage`,
//! `update_postimage`), `_commit_version` and `_commit_timestamp`. The
//! starting snapshot's rows are inserts at its version. A commit with
//! change-data files (`cdc` actions) is read from them alone; a commit
//! without them is read as the protocol says: its added files' rows are
//! inserts and its removed files' rows deletes, except a file removed and
//! added again with another deletion vector, whose rows the new vector
//! deletes are deletes and whose rows it no longer deletes are inserts.
//! A commit's time is its in-commit timestamp, else its commitInfo's, else
//! its log file's modification time. The units and offsets are the same as
//! for appends, with a commit's change files as its files.

mod inner;
mod source_impl;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use arrow::array::{ArrayRef, StringArray, new_null_array};
use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use async_trait::async_trait;
use deltalake::DeltaTable;
use futures::{StreamExt, TryStreamExt, stream};
use lakestream_storage::{Location, StoreRegistry};
use serde::{Deserialize, Serialize};
use tokio::sync::OnceCell;

use lakestream_source::{Backlog, BatchStream, Error, Offset, Result, Source, SourceIdentity};

/// Options of a [`DeltaSource`].
#[derive(Debug, Clone)]
pub struct DeltaSourceOptions {
    /// Read the commits from this version on, instead of the table as it
    /// is when the query first starts and the commits after it.
    pub starting_version: Option<u64>,
    /// Read the commits made at or after this time (ms since the epoch),
    /// from the first such commit on (when `starting_version` is unset).
    pub starting_timestamp_ms: Option<i64>,
    /// At most this many data files per batch (default 1000, as Spark).
    pub max_files_per_trigger: u64,
    /// At most about this many bytes of data files per batch (at least one
    /// file is taken).
    pub max_bytes_per_trigger: Option<u64>,
    /// Pass over commits that remove or change data instead of failing.
    pub skip_change_commits: bool,
    /// Stream the table's change data feed (see the module docs).
    pub read_change_feed: bool,
    /// Rows per record batch read.
    pub batch_size: usize,
    /// Storage options for the table's location.
    pub storage_options: HashMap<String, String>,
    /// The embedder's stores, for buckets it serves itself (empty: the
    /// table's store is built from its URL and `storage_options`).
    pub object_stores: StoreRegistry,
}

impl Default for DeltaSourceOptions {
    fn default() -> Self {
        Self {
            starting_version: None,
            starting_timestamp_ms: None,
            max_files_per_trigger: 1000,
            max_bytes_per_trigger: None,
            skip_change_commits: false,
            read_change_feed: false,
            batch_size: 8192,
            storage_options: HashMap::new(),
            object_stores: StoreRegistry::default(),
        }
    }
}

/// A position in the table's sequence of data files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct DeltaOffset {
    /// The table version.
    version: u64,
    /// Files of that unit taken.
    index: u64,
    /// The unit is the snapshot at `version` (the table as it was when the
    /// query started), not commit `version`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    snapshot: bool,
}

impl DeltaOffset {
    /// `commit 7, after its first 2 files` (or `the snapshot at version 7`).
    fn describe(&self) -> String {
        let unit = if self.snapshot {
            format!("the snapshot at version {}", self.version)
        } else {
            format!("commit {}", self.version)
        };
        format!("{unit}, after its first {} files", self.index)
    }
}

/// A recorded range of a Delta source, for a reader (`None` when the end
/// is not a Delta source's offset).
pub(crate) fn describe_range(
    start: &serde_json::Value,
    end: &serde_json::Value,
) -> Option<Vec<String>> {
    let end: DeltaOffset = serde_json::from_value(end.clone()).ok()?;
    let start = serde_json::from_value::<DeltaOffset>(start.clone())
        .map_or_else(|_| "the query's start".into(), |s| s.describe());
    Some(vec![format!("files from {start} to {}", end.describe())])
}

/// One data file of the table.
#[derive(Debug, Clone)]
struct DataFile {
    /// Path below the table root, decoded.
    path: String,
    size: u64,
    partition_values: BTreeMap<String, Option<String>>,
    /// The rows of the file deleted since it was written, when it has them.
    deletion_vector: Option<deltalake::kernel::DeletionVectorDescriptor>,
    /// In a change-feed source: what the file's rows are.
    change: Option<Change>,
    /// In a change-feed source, a file whose deletion vector a commit
    /// replaced: only the rows whose state changed are read.
    vector_change: Option<VectorChange>,
}

/// The rows of a file whose deletion vector a commit replaced (a remove and
/// an add of the same file): `deletion_vector` of the [`DataFile`] is the
/// new vector, `before` the old one. Read are the rows the new vector
/// deletes and the old did not (deletes), or, when `restored`, the rows
/// the old one deleted and the new one does not (inserts).
#[derive(Debug, Clone)]
struct VectorChange {
    before: Option<deltalake::kernel::DeletionVectorDescriptor>,
    restored: bool,
}

/// Which rows of a file are read, by row index in the file as written.
enum RowFilter {
    /// Every row but these (ascending).
    Exclude(Vec<u64>),
    /// Only these (ascending).
    Include(Vec<u64>),
}

impl RowFilter {
    /// The mask of rows `first..first + n`, or `None` when all are read.
    fn mask(&self, first: u64, n: usize) -> Option<arrow::array::BooleanArray> {
        let end = first + n as u64;
        let (rows, keep) = match self {
            RowFilter::Exclude(rows) => (rows, false),
            RowFilter::Include(rows) => (rows, true),
        };
        let from = rows.partition_point(|r| *r < first);
        let to = rows.partition_point(|r| *r < end);
        if from == to && !keep {
            return None;
        }
        let mut mask = vec![!keep; n];
        for r in &rows[from..to] {
            mask[(r - first) as usize] = keep;
        }
        Some(arrow::array::BooleanArray::from(mask))
    }
}

/// The change-feed columns of one file's rows.
#[derive(Debug, Clone)]
struct Change {
    /// `insert` or `delete` for a data file; `None` for a change-data file,
    /// whose rows carry their own `_change_type`.
    kind: Option<&'static str>,
    /// The commit's version.
    version: u64,
    /// The commit's time (its in-commit timestamp, else its commitInfo's),
    /// ms since the epoch.
    timestamp_ms: i64,
}

/// The columns a change-feed source adds to the table's.
const CHANGE_COLUMNS: [&str; 3] = ["_change_type", "_commit_version", "_commit_timestamp"];

/// The time of a commit from its actions: the in-commit timestamp, else
/// the commitInfo's timestamp.
fn commit_time(actions: &[serde_json::Value]) -> Option<i64> {
    let info = actions.iter().find_map(|a| a.get("commitInfo"))?;
    info["inCommitTimestamp"]
        .as_i64()
        .or_else(|| info["timestamp"].as_i64())
}

/// The files of one unit (a snapshot or a commit).
type Files = Arc<Vec<DataFile>>;

/// A Delta table as a streaming source (see the module docs).
pub struct DeltaSource(Arc<Inner>);

struct Inner {
    name: String,
    location: Location,
    options: DeltaSourceOptions,
    /// What the source produces: the table's columns (and the change-feed
    /// columns with `read_change_feed`).
    schema: SchemaRef,
    /// The table's own columns.
    table_schema: SchemaRef,
    partition_columns: Vec<String>,
    /// The version the snapshot was taken at when the query first ran
    /// (what `initial_offset` resolves), for a start without an offset.
    table: tokio::sync::Mutex<DeltaTable>,
    /// Files of the units read recently, by (version, snapshot).
    cache: Mutex<BTreeMap<(u64, bool), Files>>,
    /// The newest version `available-now` may read.
    frozen: Mutex<Option<u64>>,
    /// Files planned and files known, for progress.
    backlog: Mutex<Option<Backlog>>,
}

impl std::fmt::Debug for DeltaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeltaSource")
            .field("name", &self.0.name)
            .field("location", &self.0.location.url().as_str())
            .field("starting_version", &self.0.options.starting_version)
            .finish_non_exhaustive()
    }
}

fn delta_err(name: &str, table: &Location, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Delta {
        source_name: name.to_string(),
        table: table.url().to_string(),
        reason: format!("{what}: {e}"),
    }
}

impl DeltaSource {
    /// A source named `name` over the Delta table at `location`. Loads the
    /// table's latest version for its schema; fails when there is no table
    /// or its features are ones this source cannot read.
    pub async fn try_new(name: &str, location: &str, options: DeltaSourceOptions) -> Result<Self> {
        let location =
            Location::parse_with(location, &options.storage_options, &options.object_stores)
                .map_err(|source| Error::Location {
                    source_name: name.to_string(),
                    source,
                })?;
        lakestream_source::require_positive(
            name,
            "max_files_per_trigger",
            options.max_files_per_trigger,
        )?;
        let table = crate::sink::load_table(&location)
            .await
            .map_err(|e| delta_err(name, &location, "cannot load the table", e))?
            .ok_or_else(|| Error::Delta {
                source_name: name.to_string(),
                table: location.url().to_string(),
                reason: "there is no Delta table there (no _delta_log); a Delta source reads an \
                         existing table"
                    .into(),
            })?;
        let snapshot = table
            .snapshot()
            .map_err(|e| delta_err(name, &location, "cannot read the table's state", e))?;
        check_readable(name, &location, snapshot.protocol(), snapshot.metadata())?;
        let table_schema = snapshot.snapshot().arrow_schema();
        let schema = if options.read_change_feed {
            let cdf = snapshot
                .metadata()
                .configuration()
                .get("delta.enableChangeDataFeed")
                .is_some_and(|v| v.eq_ignore_ascii_case("true"));
            if !cdf {
                return Err(Error::Delta {
                    source_name: name.to_string(),
                    table: location.url().to_string(),
                    reason: "read_change_feed reads the table's change data feed, which it \
                             does not record: enable it on the table (table property \
                             delta.enableChangeDataFeed = true) and read the changes made after"
                        .into(),
                });
            }
            if let Some(c) = CHANGE_COLUMNS
                .iter()
                .find(|c| table_schema.index_of(c).is_ok())
            {
                return Err(Error::Delta {
                    source_name: name.to_string(),
                    table: location.url().to_string(),
                    reason: format!(
                        "the table has a column {c}, a name the change data feed adds; \
                         rename it to read the feed"
                    ),
                });
            }
            let mut fields: Vec<arrow::datatypes::FieldRef> =
                table_schema.fields().iter().cloned().collect();
            use arrow::datatypes::{DataType, Field, TimeUnit};
            fields.push(Arc::new(Field::new("_change_type", DataType::Utf8, false)));
            fields.push(Arc::new(Field::new(
                "_commit_version",
                DataType::Int64,
                false,
            )));
            fields.push(Arc::new(Field::new(
                "_commit_timestamp",
                DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
                false,
            )));
            Arc::new(arrow::datatypes::Schema::new(fields))
        } else {
            table_schema.clone()
        };
        let partition_columns = snapshot.metadata().partition_columns().to_vec();
        Ok(Self(Arc::new(Inner {
            name: name.to_string(),
            location,
            options,
            schema,
            table_schema,
            partition_columns,
            table: tokio::sync::Mutex::new(table),
            cache: Mutex::new(BTreeMap::new()),
            frozen: Mutex::new(None),
            backlog: Mutex::new(None),
        })))
    }
}

/// Refuse table features this source cannot read correctly.
fn check_readable(
    name: &str,
    location: &Location,
    protocol: &deltalake::kernel::Protocol,
    metadata: &deltalake::kernel::Metadata,
) -> Result<()> {
    let refuse = |what: &str| {
        Err(Error::Delta {
            source_name: name.to_string(),
            table: location.url().to_string(),
            reason: format!("the table uses {what}, which the Delta source cannot read yet"),
        })
    };
    if let Some(features) = protocol.reader_features() {
        for f in features {
            let f = format!("{f:?}").to_ascii_lowercase();
            if f.contains("columnmapping") {
                return refuse("column mapping");
            }
        }
    }
    if metadata
        .configuration()
        .get("delta.columnMapping.mode")
        .is_some_and(|m| m != "none")
    {
        return refuse("column mapping");
    }
    Ok(())
}

/// A log path, percent-decoded (Delta stores paths URL-encoded).
fn decode(path: &str) -> String {
    percent_encoding::percent_decode_str(path)
        .decode_utf8_lossy()
        .into_owned()
}
