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

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use arrow::array::{ArrayRef, StringArray, new_null_array};
use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use async_trait::async_trait;
use deltalake::DeltaTable;
use futures::{StreamExt, TryStreamExt, stream};
use lakestream_storage::Location;
use serde::{Deserialize, Serialize};
use tokio::sync::OnceCell;

use crate::{Backlog, BatchStream, Error, Offset, Result, Source, SourceIdentity};

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
        let location = Location::parse(location, &options.storage_options).map_err(|source| {
            Error::Location {
                source_name: name.to_string(),
                source,
            }
        })?;
        crate::require_positive(name, "max_files_per_trigger", options.max_files_per_trigger)?;
        let table = lakestream_sink::delta::load_table(&location)
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

impl Inner {
    fn parse(&self, offset: &Offset) -> Result<DeltaOffset> {
        serde_json::from_value(offset.clone()).map_err(|e| Error::InvalidOffset {
            source_name: self.name.clone(),
            offset: offset.to_string(),
            reason: e.to_string(),
        })
    }

    fn err(&self, what: &str, e: impl std::fmt::Display) -> Error {
        delta_err(&self.name, &self.location, what, e)
    }

    async fn latest_version(&self) -> Result<u64> {
        let table = self.table.lock().await;
        table
            .get_latest_version()
            .await
            .map_err(|e| self.err("cannot find the table's latest version", e))
    }

    /// The first version committed at or after `ts_ms` (one past the
    /// latest when there is none yet: the query then reads the commits
    /// still to come). Commits are in time order; a binary search reads
    /// about log2(versions) of them.
    async fn first_version_at(&self, ts_ms: i64) -> Result<u64> {
        let latest = self.latest_version().await?;
        let store = self.table.lock().await.log_store();
        let (mut lo, mut hi) = (0u64, latest + 1);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let at = match store
                .read_commit_entry(mid)
                .await
                .map_err(|e| self.err(&format!("cannot read commit {mid}"), e))?
            {
                // Removed by log retention: older than anything kept.
                None => i64::MIN,
                Some(bytes) => bytes
                    .split(|b| *b == b'\n')
                    .filter_map(|l| serde_json::from_slice::<serde_json::Value>(l).ok())
                    .find_map(|a| a["commitInfo"]["timestamp"].as_i64())
                    .unwrap_or(i64::MIN),
            };
            if at >= ts_ms {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Ok(lo)
    }

    /// The files of the snapshot at `version` (ordered by path) or of
    /// commit `version` (in log order), cached.
    async fn files(&self, version: u64, snapshot: bool) -> Result<Files> {
        if let Some(f) = self
            .cache
            .lock()
            .expect("delta cache")
            .get(&(version, snapshot))
        {
            return Ok(f.clone());
        }
        let files = if snapshot {
            self.snapshot_files(version).await?
        } else {
            self.commit_files(version).await?
        };
        let files = Arc::new(files);
        let mut cache = self.cache.lock().expect("delta cache");
        cache.insert((version, snapshot), files.clone());
        // Bounded: the oldest units go first (a replay reloads them).
        while cache.len() > 64 {
            let first = *cache.keys().next().expect("non-empty");
            cache.remove(&first);
        }
        Ok(files)
    }

    async fn snapshot_files(&self, version: u64) -> Result<Vec<DataFile>> {
        let mut table = lakestream_sink::delta::open_table(&self.location)
            .map_err(|e| self.err("cannot open the table", e))?;
        table.load_version(version).await.map_err(|e| {
            self.err(
                &format!("cannot load version {version} (the query's starting snapshot)"),
                e,
            )
        })?;
        let snapshot = table
            .snapshot()
            .map_err(|e| self.err("cannot read the table's state", e))?;
        check_readable(
            &self.name,
            &self.location,
            snapshot.protocol(),
            snapshot.metadata(),
        )?;
        let mut files: Vec<DataFile> = snapshot
            .log_data()
            .iter()
            .map(|f| DataFile {
                path: decode(&f.path()),
                size: u64::try_from(f.size()).unwrap_or(0),
                partition_values: f.partition_values_map().into_iter().collect(),
                deletion_vector: f.deletion_vector_descriptor(),
                change: None,
                vector_change: None,
            })
            .collect();
        files.sort_by(|a, b| a.path.cmp(&b.path));
        if self.options.read_change_feed {
            // The snapshot's rows are inserts at its version.
            let actions = self.commit_actions(version).await?;
            let timestamp_ms = self.commit_timestamp(version, &actions).await?;
            for f in &mut files {
                f.change = Some(Change {
                    kind: Some("insert"),
                    version,
                    timestamp_ms,
                });
            }
        }
        Ok(files)
    }

    /// The actions of commit `version`, in log order.
    async fn commit_actions(&self, version: u64) -> Result<Vec<serde_json::Value>> {
        let store = self.table.lock().await.log_store();
        let bytes = store
            .read_commit_entry(version)
            .await
            .map_err(|e| self.err(&format!("cannot read commit {version}"), e))?
            .ok_or_else(|| Error::Delta {
                source_name: self.name.clone(),
                table: self.location.url().to_string(),
                reason: format!(
                    "commit {version} is no longer in the table's log (log retention removed \
                     it before the query read it); start a new query with 'starting_version' \
                     past it"
                ),
            })?;
        bytes
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|line| {
                serde_json::from_slice(line)
                    .map_err(|e| self.err(&format!("commit {version} is not valid JSON"), e))
            })
            .collect()
    }

    /// The time of commit `version` (its `actions`): its in-commit
    /// timestamp, else its commitInfo's time, else (a commit without
    /// commitInfo) the modification time of its log file.
    async fn commit_timestamp(&self, version: u64, actions: &[serde_json::Value]) -> Result<i64> {
        if let Some(t) = commit_time(actions) {
            return Ok(t);
        }
        let path = self
            .location
            .child(&format!("_delta_log/{version:020}.json"));
        let meta = object_store::ObjectStoreExt::head(self.location.store(), &path)
            .await
            .map_err(|e| self.err(&format!("cannot read the time of commit {version}"), e))?;
        Ok(meta.last_modified.timestamp_millis())
    }

    /// The file an `add`, `remove` or `cdc` action of commit `version`
    /// names.
    fn action_file(&self, version: u64, a: &serde_json::Value) -> Result<DataFile> {
        let partition_values = a["partitionValues"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().map(str::to_string)))
                    .collect()
            })
            .unwrap_or_default();
        let deletion_vector = match a.get("deletionVector") {
            Some(dv) if !dv.is_null() => Some(serde_json::from_value(dv.clone()).map_err(|e| {
                self.err(
                    &format!("commit {version} has a malformed deletion vector"),
                    e,
                )
            })?),
            _ => None,
        };
        Ok(DataFile {
            path: decode(a["path"].as_str().unwrap_or_default()),
            // Unknown (0) for a remove without extended metadata: the
            // reader asks the store.
            size: a["size"].as_u64().unwrap_or(0),
            partition_values,
            deletion_vector,
            change: None,
            vector_change: None,
        })
    }

    async fn commit_files(&self, version: u64) -> Result<Vec<DataFile>> {
        let actions = self.commit_actions(version).await?;
        let data_change = |a: &serde_json::Value| a["dataChange"].as_bool().unwrap_or(true);
        let mut adds = Vec::new();
        let mut removes = Vec::new();
        let mut cdc = Vec::new();
        for action in &actions {
            if let Some(a) = action.get("add") {
                if data_change(a) {
                    adds.push(self.action_file(version, a)?);
                }
            } else if let Some(r) = action.get("remove") {
                if data_change(r) {
                    removes.push(self.action_file(version, r)?);
                }
            } else if let Some(c) = action.get("cdc") {
                cdc.push(self.action_file(version, c)?);
            } else if let Some(m) = action.get("metaData") {
                let schema_string = m["schemaString"].as_str().unwrap_or_default();
                if !self.same_schema(schema_string) {
                    return Err(Error::Delta {
                        source_name: self.name.clone(),
                        table: self.location.url().to_string(),
                        reason: format!(
                            "commit {version} changed the table's schema; the query reads the \
                             schema it started with: start a new query (a new checkpoint) to \
                             read the new one"
                        ),
                    });
                }
            } else if action.get("protocol").is_some() {
                // Checked when the table is loaded; a new feature here is
                // caught by the reads of its files.
            }
        }
        if self.options.read_change_feed {
            if adds.is_empty() && removes.is_empty() && cdc.is_empty() {
                return Ok(Vec::new());
            }
            let timestamp_ms = self.commit_timestamp(version, &actions).await?;
            return self.change_files(version, timestamp_ms, adds, removes, cdc);
        }
        if !removes.is_empty() {
            if self.options.skip_change_commits {
                tracing::info!(source = %self.name, version, "skipping a commit that removes data (skip_change_commits)");
                return Ok(Vec::new());
            }
            return Err(Error::Delta {
                source_name: self.name.clone(),
                table: self.location.url().to_string(),
                reason: format!(
                    "commit {version} removes or rewrites data (DELETE, UPDATE, MERGE or an \
                     overwrite), which a stream of appended rows cannot follow; set OPTIONS \
                     ('skip_change_commits' 'true') to pass over such commits (their changes \
                     are then not read), or read its changes with ('read_change_feed' 'true')"
                ),
            });
        }
        Ok(adds)
    }

    /// A commit's files as the change data feed reads them: its change-data
    /// files when it has them, else its added files as inserts and its
    /// removed files as deletes (the protocol's rule).
    fn change_files(
        &self,
        version: u64,
        timestamp_ms: i64,
        adds: Vec<DataFile>,
        removes: Vec<DataFile>,
        cdc: Vec<DataFile>,
    ) -> Result<Vec<DataFile>> {
        let change = |kind| Change {
            kind,
            version,
            timestamp_ms,
        };
        if !cdc.is_empty() {
            return Ok(cdc
                .into_iter()
                .map(|mut f| {
                    f.change = Some(change(None));
                    f
                })
                .collect());
        }
        // A file both removed and added again changed only its deletion
        // vector: its deleted rows are those the new vector adds, its
        // inserted rows those the new vector no longer deletes.
        let mut removes = removes;
        let mut adds = adds;
        let mut changed = Vec::new();
        adds.retain(|a| {
            let Some(i) = removes.iter().position(|r| r.path == a.path) else {
                return true;
            };
            let before = removes.remove(i).deletion_vector;
            for (kind, restored) in [("delete", false), ("insert", true)] {
                let mut f = a.clone();
                f.change = Some(change(Some(kind)));
                f.vector_change = Some(VectorChange {
                    before: before.clone(),
                    restored,
                });
                changed.push(f);
            }
            false
        });
        let inserts = adds.into_iter().map(|mut f| {
            f.change = Some(change(Some("insert")));
            f
        });
        let deletes = removes.into_iter().map(|mut f| {
            f.change = Some(change(Some("delete")));
            f
        });
        Ok(changed.into_iter().chain(inserts).chain(deletes).collect())
    }

    /// Whether a `metaData.schemaString` describes the schema this source
    /// reads (same field names and types).
    fn same_schema(&self, schema_string: &str) -> bool {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(schema_string) else {
            return false;
        };
        let fields: Vec<(String, String)> = v["fields"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|f| {
                (
                    f["name"].as_str().unwrap_or("").to_string(),
                    f["type"].to_string(),
                )
            })
            .collect();
        fields.len() == self.table_schema.fields().len()
            && fields
                .iter()
                .zip(self.table_schema.fields())
                .all(|((n, _), f)| n == f.name())
    }

    /// The files of `(start, end]`, in order.
    async fn range_files(
        &self,
        start: Option<DeltaOffset>,
        end: DeltaOffset,
    ) -> Result<Vec<DataFile>> {
        let start = match start {
            Some(s) => s,
            None => self.first_position(),
        };
        let mut out = Vec::new();
        let mut cur = start;
        loop {
            let files = self.files(cur.version, cur.snapshot).await?;
            let last = (cur.version, cur.snapshot) == (end.version, end.snapshot);
            let to = if last { end.index } else { files.len() as u64 };
            let from = cur.index.min(to);
            out.extend(files[from as usize..to as usize].iter().cloned());
            if last || cur.version >= end.version {
                break;
            }
            cur = DeltaOffset {
                version: cur.version + 1,
                index: 0,
                snapshot: false,
            };
        }
        Ok(out)
    }

    /// Where a query without an offset starts: `starting_version`'s
    /// commit, else the snapshot at the latest version the source loaded.
    fn first_position(&self) -> DeltaOffset {
        match self.options.starting_version {
            Some(v) => DeltaOffset {
                version: v,
                index: 0,
                snapshot: false,
            },
            None => DeltaOffset {
                version: self
                    .table
                    .try_lock()
                    .ok()
                    .and_then(|t| t.version())
                    .unwrap_or(0),
                index: 0,
                snapshot: true,
            },
        }
    }

    /// Read one data file as batches of the source's schema, partition
    /// columns filled from the file's partition values.
    async fn read_file(
        &self,
        file: DataFile,
        engine: Arc<dyn buoyant_kernel::Engine>,
    ) -> Result<BatchStream> {
        let name = self.name.clone();
        let store = self.location.store().clone();
        let location = self.location.clone();
        let schema = self.schema.clone();
        let partition_columns = self.partition_columns.clone();
        let batch_size = self.options.batch_size;
        let path = location.child(&file.path);
        let url = location.url_of(&path);
        let malformed = |reason: String| Error::Malformed {
            source_name: name.clone(),
            file: url.clone(),
            line: None,
            reason,
        };
        // The rows each deletion vector deletes, ascending.
        let rows_of = |dv: Option<deltalake::kernel::DeletionVectorDescriptor>| {
            let engine = engine.clone();
            let mut root = location.url().clone();
            if !root.path().ends_with('/') {
                root.set_path(&format!("{}/", root.path()));
            }
            async move {
                let Some(dv) = dv else {
                    return Ok(Vec::new());
                };
                tokio::task::spawn_blocking(move || {
                    let dv: buoyant_kernel::actions::deletion_vector::DeletionVectorDescriptor =
                        dv.try_into().map_err(|e| format!("{e}"))?;
                    dv.row_indexes(engine.storage_handler(), &root)
                        .map_err(|e| format!("{e}"))
                })
                .await
                .map_err(|e| malformed(format!("reading its deletion vector: {e}")))?
                .map_err(|e| malformed(format!("reading its deletion vector: {e}")))
            }
        };
        let mut deleted = rows_of(file.deletion_vector.clone()).await?;
        deleted.sort_unstable();
        let filter = Arc::new(match &file.vector_change {
            None => RowFilter::Exclude(deleted),
            Some(vc) => {
                let mut before = rows_of(vc.before.clone()).await?;
                before.sort_unstable();
                let (from, minus) = if vc.restored {
                    (&before, &deleted)
                } else {
                    (&deleted, &before)
                };
                RowFilter::Include(
                    from.iter()
                        .filter(|r| minus.binary_search(r).is_err())
                        .copied()
                        .collect(),
                )
            }
        });
        let mut row = 0u64;
        let size = match file.size {
            // A remove action without its size: ask the store.
            0 => {
                object_store::ObjectStoreExt::head(&store, &path)
                    .await
                    .map_err(|e| malformed(format!("cannot read the file: {e}")))?
                    .size
            }
            n => n,
        };
        let change = file.change.clone();
        let (file_schema, stream) =
            crate::files::columnar::open_parquet(store, path, size, batch_size)
                .await
                .map_err(malformed)?;
        let parts: Vec<(usize, Option<String>)> = schema
            .fields()
            .iter()
            .enumerate()
            .filter(|(_, f)| partition_columns.iter().any(|p| p == f.name()))
            .map(|(i, f)| (i, file.partition_values.get(f.name()).cloned().flatten()))
            .collect();
        Ok(stream
            .map(move |b| {
                let b = b.map_err(|e| Error::Malformed {
                    source_name: name.clone(),
                    file: url.clone(),
                    line: None,
                    reason: e.to_string(),
                })?;
                let schema_err = |reason: String| Error::Schema {
                    source_name: name.clone(),
                    file: url.clone(),
                    reason,
                };
                let mut cols: Vec<ArrayRef> = Vec::with_capacity(schema.fields().len());
                for (i, field) in schema.fields().iter().enumerate() {
                    if let Some(c) = &change {
                        let n = b.num_rows();
                        match field.name().as_str() {
                            "_change_type" if c.kind.is_some() => {
                                cols.push(Arc::new(StringArray::from(vec![
                                    c.kind
                                        .unwrap_or_default(
                                        );
                                    n
                                ])));
                                continue;
                            }
                            "_commit_version" => {
                                cols.push(Arc::new(arrow::array::Int64Array::from(vec![
                                    c.version
                                        as i64;
                                    n
                                ])));
                                continue;
                            }
                            "_commit_timestamp" => {
                                cols.push(Arc::new(
                                    arrow::array::TimestampMicrosecondArray::from(vec![
                                        c.timestamp_ms
                                            * 1000;
                                        n
                                    ])
                                    .with_timezone("UTC"),
                                ));
                                continue;
                            }
                            _ => {}
                        }
                    }
                    if let Some((_, v)) = parts.iter().find(|(p, _)| *p == i) {
                        cols.push(match v {
                            None => new_null_array(field.data_type(), b.num_rows()),
                            Some(v) => {
                                let s: ArrayRef =
                                    Arc::new(StringArray::from(vec![v.as_str(); b.num_rows()]));
                                arrow::compute::cast(&s, field.data_type()).map_err(|e| {
                                    schema_err(format!(
                                        "partition value {v:?} of column {} is not a {}: {e}",
                                        field.name(),
                                        field.data_type()
                                    ))
                                })?
                            }
                        });
                        continue;
                    }
                    match file_schema.index_of(field.name()) {
                        Ok(j) if b.column(j).data_type() == field.data_type() => {
                            cols.push(b.column(j).clone())
                        }
                        Ok(j) => cols.push(
                            arrow::compute::cast(b.column(j), field.data_type()).map_err(|e| {
                                schema_err(format!(
                                    "column {} is {} in the file, not {}: {e}",
                                    field.name(),
                                    b.column(j).data_type(),
                                    field.data_type()
                                ))
                            })?,
                        ),
                        Err(_) => cols.push(new_null_array(field.data_type(), b.num_rows())),
                    }
                }
                let out = RecordBatch::try_new(schema.clone(), cols)
                    .map_err(|e| schema_err(e.to_string()))?;
                // Rows are numbered across the file as it was written.
                let first = row;
                row += out.num_rows() as u64;
                let Some(mask) = filter.mask(first, out.num_rows()) else {
                    return Ok(out);
                };
                arrow::compute::filter_record_batch(&out, &mask)
                    .map_err(|e| schema_err(e.to_string()))
            })
            .boxed())
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

#[async_trait]
impl Source for DeltaSource {
    fn name(&self) -> &str {
        &self.0.name
    }

    fn schema(&self) -> SchemaRef {
        self.0.schema.clone()
    }

    async fn initial_offset(&self) -> Result<Option<Offset>> {
        // Fixed when the query first runs: the snapshot of the table as it
        // is now (or the starting version's or time's commit), so a restart
        // before the first batch does not move it.
        let first = match (
            self.0.options.starting_version,
            self.0.options.starting_timestamp_ms,
        ) {
            (Some(_), _) => self.0.first_position(),
            (None, Some(ts)) => DeltaOffset {
                version: self.0.first_version_at(ts).await?,
                index: 0,
                snapshot: false,
            },
            (None, None) => DeltaOffset {
                version: self.0.latest_version().await?,
                index: 0,
                snapshot: true,
            },
        };
        Ok(Some(
            serde_json::to_value(first).expect("offset serializes"),
        ))
    }

    async fn recover(&self, ends: &[Offset]) -> Result<()> {
        for e in ends {
            self.0.parse(e)?;
        }
        Ok(())
    }

    async fn restore(&self, _snapshot: Option<&Offset>) -> Result<()> {
        *self.0.frozen.lock().expect("delta state") = None;
        self.0.cache.lock().expect("delta cache").clear();
        Ok(())
    }

    fn identity(&self) -> SourceIdentity {
        SourceIdentity {
            kind: "delta".into(),
            location: self.0.location.url().to_string(),
        }
    }

    fn backlog(&self) -> Option<Backlog> {
        *self.0.backlog.lock().expect("delta state")
    }

    async fn freeze(&self) -> Result<()> {
        let v = self.0.latest_version().await?;
        *self.0.frozen.lock().expect("delta state") = Some(v);
        Ok(())
    }

    async fn plan(&self, start: Option<&Offset>) -> Result<Option<Offset>> {
        let mut cur = match start {
            Some(s) => self.0.parse(s)?,
            None => match self.initial_offset().await? {
                Some(v) => self.0.parse(&v)?,
                None => self.0.first_position(),
            },
        };
        let mut latest = self.0.latest_version().await?;
        if let Some(f) = *self.0.frozen.lock().expect("delta state") {
            latest = latest.min(f);
        }
        let (mut taken, mut bytes) = (0u64, 0u64);
        let mut end = None;
        let (mut known, mut known_bytes) = (0u64, 0u64);
        while cur.version <= latest {
            let files = self.0.files(cur.version, cur.snapshot).await?;
            let rest = &files[(cur.index as usize).min(files.len())..];
            known += rest.len() as u64;
            known_bytes += rest.iter().map(|f| f.size).sum::<u64>();
            while (cur.index as usize) < files.len() && taken < self.0.options.max_files_per_trigger
            {
                let f = &files[cur.index as usize];
                if taken > 0
                    && self
                        .0
                        .options
                        .max_bytes_per_trigger
                        .is_some_and(|cap| bytes + f.size > cap)
                {
                    break;
                }
                taken += 1;
                bytes += f.size;
                cur.index += 1;
                end = Some(cur);
            }
            if (cur.index as usize) < files.len() || cur.version == latest {
                break;
            }
            cur = DeltaOffset {
                version: cur.version + 1,
                index: 0,
                snapshot: false,
            };
        }
        *self.0.backlog.lock().expect("delta state") = Some(Backlog {
            done: taken,
            total: known,
            bytes_done: bytes,
            bytes_total: known_bytes,
        });
        Ok(end.map(|e| serde_json::to_value(e).expect("offset serializes")))
    }

    fn read(
        &self,
        start: Option<&Offset>,
        end: &Offset,
        partitions: usize,
    ) -> Result<Vec<BatchStream>> {
        let start = start.map(|s| self.0.parse(s)).transpose()?;
        let end = self.0.parse(end)?;
        let n = partitions.max(1);
        // The range's files are resolved once, by whichever stream is
        // polled first; stream k reads files k, k + n, ...
        let list: Arc<OnceCell<Vec<DataFile>>> = Arc::new(OnceCell::new());
        Ok((0..n)
            .map(|k| {
                let list = list.clone();
                let inner = self.0.clone();
                stream::once(async move {
                    let files = list
                        .get_or_try_init(|| inner.range_files(start, end))
                        .await?;
                    let mine: Vec<DataFile> = files.iter().skip(k).step_by(n).cloned().collect();
                    Ok::<_, Error>(stream::iter(mine).then(move |f| {
                        let inner = inner.clone();
                        async move {
                            let engine = inner.table.lock().await.log_store().engine(None);
                            inner.read_file(f, engine).await
                        }
                    }))
                })
                .try_flatten()
                .try_flatten()
                .boxed()
            })
            .collect())
    }

    fn describe(&self, start: Option<&Offset>, end: &Offset) -> String {
        let show = |o: DeltaOffset| {
            format!(
                "{} {} file {}",
                if o.snapshot { "snapshot of v" } else { "v" },
                o.version,
                o.index
            )
        };
        let s = start
            .and_then(|s| self.0.parse(s).ok())
            .map(show)
            .unwrap_or_else(|| "start".into());
        let e = self.0.parse(end).map(show).unwrap_or_else(|_| "?".into());
        format!("{s} .. {e}")
    }
}
