//! The files of a partitioned batch's runs, one open file (set) per
//! partition value, closed early once the input has moved on.
//!
//! A backfill partitioned by day reads its input in time order: each day's
//! rows come together and then never again. delta-rs's writer keeps every
//! partition's file open to the batch's end, so each day's last row group
//! stays in memory and every file is closed at once when the input ends,
//! with the cores left idle while the last closes finish. Here a
//! partition that has had no rows for [`IDLE_ROWS`] rows of the writer's
//! input is closed on a task of its own while the input goes on. A
//! partition that comes back after that gets a new file and is then kept
//! open to the end, so unordered input costs at most one extra file per
//! partition and batch. Input whose partitions all stay busy has its
//! largest open file closed while the open files hold more than
//! [`OPEN_BYTES_BUDGET`] of input (a coarse cap). Record batches of many
//! runs (unordered partition values) take delta-rs's split instead (the
//! batch writer's `MAX_RUNS`), whose open files the batch writer closes
//! every `unordered_flush_size` of input. All files are still part of the
//! batch's one commit: a batch that fails or is killed leaves them
//! unreferenced, as before.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU64;

use buoyant_kernel::expressions::Scalar;
use buoyant_kernel::table_properties::DataSkippingNumIndexedCols;
use deltalake::DeltaTableError;
use deltalake::datafile::writer::{PartitionWriter, PartitionWriterConfig};
use deltalake::kernel::Add;
use deltalake::kernel::scalars::ScalarExt;
use deltalake::logstore::ObjectStoreRef;
use indexmap::IndexMap;
use parquet::file::properties::WriterProperties;
use tokio::task::JoinSet;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;

/// A partition untouched for this many rows of a writer's input is closed
/// (four decode batches of the file source).
pub(super) const IDLE_ROWS: u64 = 32 * 1024;

/// Past this many bytes of input (Arrow size) held in a writer's open
/// files, its largest open file is closed. A coarse cap on input, not on
/// memory: Parquet's writers for many busy partitions hold more than their
/// input's share (dictionaries, hash tables, pages), so the source's
/// per-batch byte cap stays what bounds memory (docs/benchmarks.md).
pub(super) const OPEN_BYTES_BUDGET: usize = 128 << 20;

type Closed = Result<Vec<Add>, DeltaTableError>;

/// One partition's open file.
struct Open {
    writer: PartitionWriter,
    /// The writer's input row count when this partition last got rows.
    last_seen: u64,
    /// The Arrow size of the rows written to it.
    bytes: usize,
}

/// The open files of one batch writer's partitions.
pub(super) struct PartitionFiles {
    store: ObjectStoreRef,
    /// The table's schema without its partition columns: the files' schema.
    file_schema: SchemaRef,
    /// Where the file schema's columns sit in the batches written.
    columns: Vec<usize>,
    props: WriterProperties,
    target_file_size: Option<NonZeroU64>,
    num_indexed_cols: DataSkippingNumIndexedCols,
    stats_columns: Option<Vec<String>>,
    open: HashMap<String, Open>,
    /// Partitions closed early in this batch: kept open to its end if they
    /// come back.
    closed_early: HashSet<String>,
    closing: JoinSet<Closed>,
    /// Rows written through this writer so far.
    seen: u64,
    /// The sum of the open files' `bytes`.
    open_bytes: usize,
    /// [`OPEN_BYTES_BUDGET`], lower in tests.
    budget: usize,
}

impl PartitionFiles {
    /// The files of a table whose schema is `table_schema` (partition
    /// columns `partition_columns`), for batches of the schema `batches`;
    /// `None` when the batches' non-partition columns do not have the
    /// table's types as they are (delta-rs's writer conforms those).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        store: ObjectStoreRef,
        table_schema: &arrow::datatypes::Schema,
        partition_columns: &[String],
        batches: &arrow::datatypes::Schema,
        props: WriterProperties,
        target_file_size: Option<NonZeroU64>,
        configuration: &HashMap<String, String>,
    ) -> Option<Self> {
        let mut fields = Vec::new();
        let mut columns = Vec::new();
        for field in table_schema.fields() {
            if partition_columns.contains(field.name()) {
                continue;
            }
            let (i, f) = batches.column_with_name(field.name())?;
            if f.data_type() != field.data_type() {
                return None;
            }
            fields.push(field.clone());
            columns.push(i);
        }
        let num_indexed_cols = configuration
            .get("delta.dataSkippingNumIndexedCols")
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(
                DataSkippingNumIndexedCols::NumColumns(
                    deltalake::table::config::DEFAULT_NUM_INDEX_COLS,
                ),
                DataSkippingNumIndexedCols::NumColumns,
            );
        let stats_columns = configuration
            .get("delta.dataSkippingStatsColumns")
            .map(|v| v.split(',').map(str::to_string).collect());
        Some(Self {
            store,
            file_schema: std::sync::Arc::new(arrow::datatypes::Schema::new(fields)),
            columns,
            props,
            target_file_size,
            num_indexed_cols,
            stats_columns,
            open: HashMap::new(),
            closed_early: HashSet::new(),
            closing: JoinSet::new(),
            seen: 0,
            open_bytes: 0,
            budget: OPEN_BYTES_BUDGET,
        })
    }

    /// Write `run`, a slice of one partition's rows (`values`) whose Arrow
    /// size is about `bytes`, to that partition's file.
    pub(super) async fn write(
        &mut self,
        run: &RecordBatch,
        values: &IndexMap<String, Scalar>,
        bytes: usize,
    ) -> Result<(), DeltaTableError> {
        let key = partition_key(values);
        let data = RecordBatch::try_new(
            self.file_schema.clone(),
            self.columns
                .iter()
                .map(|i| run.column(*i).clone())
                .collect(),
        )?;
        let seen = self.seen;
        if let Some(open) = self.open.get_mut(&key) {
            open.last_seen = seen;
            open.bytes += bytes;
            self.open_bytes += bytes;
            return open.writer.write(&data).await;
        }
        let config = PartitionWriterConfig::try_new(
            self.file_schema.clone(),
            values.clone(),
            Some(self.props.clone()),
            self.target_file_size,
            None,
            None,
            None,
        )?;
        let mut writer = PartitionWriter::try_with_config(
            self.store.clone(),
            config,
            self.num_indexed_cols,
            self.stats_columns.clone(),
        )?;
        if let Err(e) = writer.write(&data).await {
            let _ = writer.abort().await;
            return Err(e);
        }
        self.open.insert(
            key,
            Open {
                writer,
                last_seen: seen,
                bytes,
            },
        );
        self.open_bytes += bytes;
        Ok(())
    }

    /// Count `rows` more rows of input (after their runs were written),
    /// close the partitions they left idle, then the largest open files
    /// while the open ones hold more than [`OPEN_BYTES_BUDGET`].
    pub(super) fn advance(&mut self, rows: u64) {
        self.seen += rows;
        let seen = self.seen;
        let idle: Vec<String> = self
            .open
            .iter()
            .filter(|(key, open)| {
                seen - open.last_seen >= IDLE_ROWS && !self.closed_early.contains(*key)
            })
            .map(|(key, _)| key.clone())
            .collect();
        for key in idle {
            self.close(&key);
            self.closed_early.insert(key);
        }
        while self.open_bytes > self.budget {
            let Some(largest) = self
                .open
                .iter()
                .max_by_key(|(_, open)| open.bytes)
                .map(|(key, _)| key.clone())
            else {
                break;
            };
            self.close(&largest);
        }
    }

    /// Close partition `key`'s open file on a task of its own.
    fn close(&mut self, key: &str) {
        if let Some(open) = self.open.remove(key) {
            self.open_bytes -= open.bytes;
            self.closing.spawn(open.writer.close());
        }
    }

    /// Close every file and return the `add` actions of all of them, the
    /// ones closed early included. On an error the other closes are still
    /// awaited (an upload cut off mid-way leaves parts a vacuum cannot
    /// see); the first error is returned.
    pub(super) async fn finish(mut self) -> Result<Vec<Add>, DeltaTableError> {
        let keys: Vec<String> = self.open.keys().cloned().collect();
        for key in keys {
            self.close(&key);
        }
        let mut adds = Vec::new();
        let mut first_err = None;
        while let Some(joined) = self.closing.join_next().await {
            match joined {
                Ok(Ok(closed)) => adds.extend(closed),
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(e) => {
                    first_err.get_or_insert(DeltaTableError::GenericError {
                        source: Box::new(e),
                    });
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(adds),
        }
    }
}

/// A failed batch drops its writer: its open files' uploads are aborted
/// and the closes under way are let finish (their files are never
/// committed; a vacuum removes them), off the caller's path.
impl Drop for PartitionFiles {
    fn drop(&mut self) {
        let open = std::mem::take(&mut self.open);
        let mut closing = std::mem::take(&mut self.closing);
        if open.is_empty() && closing.is_empty() {
            return;
        }
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            closing.detach_all();
            handle.spawn(async move {
                for (_, open) in open {
                    let _ = open.writer.abort().await;
                }
            });
        }
    }
}

/// The key of a partition value set: its values as Delta writes them in
/// paths.
fn partition_key(values: &IndexMap<String, Scalar>) -> String {
    let mut key = String::new();
    for (name, value) in values {
        key.push_str(name);
        key.push('=');
        key.push_str(&value.serialize_encoded());
        key.push('/');
    }
    key
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use object_store::ObjectStore;
    use object_store::local::LocalFileSystem;

    use super::*;

    fn schema() -> Schema {
        Schema::new(vec![
            Field::new("n", DataType::Int64, true),
            Field::new("day", DataType::Utf8, true),
        ])
    }

    fn files(dir: &std::path::Path) -> (PartitionFiles, ObjectStoreRef) {
        let store: ObjectStoreRef = Arc::new(LocalFileSystem::new_with_prefix(dir).unwrap());
        let files = PartitionFiles::new(
            store.clone(),
            &schema(),
            &["day".to_string()],
            &schema(),
            WriterProperties::default(),
            None,
            &HashMap::new(),
        )
        .expect("same types");
        (files, store)
    }

    /// Rows `from..from + rows` of partition `day`.
    fn rows(from: i64, rows: usize, day: &str) -> RecordBatch {
        RecordBatch::try_new(
            Arc::new(schema()),
            vec![
                Arc::new(Int64Array::from_iter_values(from..from + rows as i64)),
                Arc::new(StringArray::from(vec![day; rows])),
            ],
        )
        .unwrap()
    }

    fn values(day: &str) -> IndexMap<String, Scalar> {
        IndexMap::from([("day".to_string(), Scalar::String(day.to_string()))])
    }

    /// Write `batches` batches of 8,192 rows of `day`, as the sink does.
    async fn write_day(files: &mut PartitionFiles, day: &str, batches: usize, from: &mut i64) {
        for _ in 0..batches {
            let batch = rows(*from, 8192, day);
            *from += 8192;
            files.write(&batch, &values(day), 8192 * 16).await.unwrap();
            files.advance(8192);
        }
    }

    async fn parquet_files(store: &ObjectStoreRef, day: &str) -> usize {
        use futures::TryStreamExt;
        let prefix = object_store::path::Path::from(format!("day={day}"));
        let listed: Vec<_> = store.list(Some(&prefix)).try_collect().await.unwrap();
        listed
            .iter()
            .filter(|m| m.location.as_ref().ends_with(".parquet"))
            .count()
    }

    fn total_rows(adds: &[Add]) -> i64 {
        adds.iter()
            .map(|a| {
                let stats: serde_json::Value =
                    serde_json::from_str(a.stats.as_deref().expect("stats")).unwrap();
                stats["numRecords"].as_i64().unwrap()
            })
            .sum()
    }

    #[tokio::test]
    async fn a_day_the_input_has_left_is_written_out_before_the_batch_ends() {
        let dir = tempfile::tempdir().unwrap();
        let (mut files, store) = files(dir.path());
        let mut n = 0;
        write_day(&mut files, "2026-01-01", 5, &mut n).await;
        assert_eq!(parquet_files(&store, "2026-01-01").await, 0, "still open");
        write_day(&mut files, "2026-01-02", 5, &mut n).await;
        // The first day's file is closed on a task of its own while the
        // second day is written: it is in the store before `finish`.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while parquet_files(&store, "2026-01-01").await == 0 {
            assert!(std::time::Instant::now() < deadline, "day 1 never closed");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(parquet_files(&store, "2026-01-02").await, 0, "still open");
        let adds = files.finish().await.unwrap();
        assert_eq!(adds.len(), 2, "one file per day");
        assert_eq!(total_rows(&adds), 10 * 8192);
    }

    #[tokio::test]
    async fn a_day_that_comes_back_gets_one_more_file_and_then_stays_open() {
        let dir = tempfile::tempdir().unwrap();
        let (mut files, store) = files(dir.path());
        let mut n = 0;
        for _ in 0..4 {
            write_day(&mut files, "2026-01-01", 5, &mut n).await;
            write_day(&mut files, "2026-01-02", 5, &mut n).await;
        }
        let adds = files.finish().await.unwrap();
        assert_eq!(total_rows(&adds), 40 * 8192);
        // Each day closed early once, then came back and was kept open.
        assert_eq!(parquet_files(&store, "2026-01-01").await, 2);
        assert_eq!(parquet_files(&store, "2026-01-02").await, 2);
        assert_eq!(adds.len(), 4);
    }

    #[tokio::test]
    async fn busy_partitions_past_the_budget_close_their_largest_file() {
        let dir = tempfile::tempdir().unwrap();
        let (mut files, store) = files(dir.path());
        files.budget = 3 * 8192 * 16;
        let mut n = 0;
        // Unordered input: both days in every batch, so neither is idle.
        for _ in 0..4 {
            for day in ["2026-01-01", "2026-01-02"] {
                let batch = rows(n, 1024, day);
                n += 1024;
                files.write(&batch, &values(day), 8192 * 16).await.unwrap();
            }
            files.advance(2048);
            assert!(files.open_bytes <= files.budget, "held past the budget");
        }
        let adds = files.finish().await.unwrap();
        assert_eq!(total_rows(&adds), 8 * 1024);
        assert!(adds.len() > 2, "the budget closed files: {}", adds.len());
        assert_eq!(
            parquet_files(&store, "2026-01-01").await + parquet_files(&store, "2026-01-02").await,
            adds.len()
        );
    }
}
