//! Streaming one batch's output into new Parquet files.
//!
//! A partitioned table's batch is cut into runs of equal partition values
//! and each run goes to its partition's file as a slice. Output of a
//! time-ordered input (a backfill partitioned by day) holds one run or a
//! few per batch, which delta-rs's own split would pay for with a row
//! conversion of the partition columns and a `take` of every column. A
//! batch of many short runs (unordered partition values) still takes
//! delta-rs's split, which gathers each partition's rows once and keeps
//! every partition's file open; the writer closes them all (a flush whose
//! files stay in the batch's one commit) each time that split has taken
//! `unordered_flush_size` bytes of input, so the open files' memory does
//! not grow with the batch.

use buoyant_kernel::expressions::Scalar;
use deltalake::kernel::Add;
use deltalake::kernel::scalars::ScalarExt;
use indexmap::IndexMap;

use super::partition_files::PartitionFiles;
use super::schema::by_name;
use super::*;

/// A run of a batch: its first row, its length, its partition values.
type Run = (usize, usize, IndexMap<String, Scalar>);

/// Above this many runs in a batch, delta-rs's split (one `take` per
/// partition) costs less than a slice write per run.
const MAX_RUNS: usize = 64;

/// What writes a batch's Parquet files.
pub(super) enum FileWriter {
    /// Files of the table's schema, as its metadata says.
    Blind(Box<RecordBatchWriter>),
    /// Files of a schema the table does not have yet (`merge_schema`: the
    /// batch's commit brings the new columns).
    Evolving(Box<deltalake::datafile::writer::DeltaWriter>),
}

/// One writer of a batch: files roll at the target size.
pub(super) struct DeltaBatchWriter {
    pub(super) table: String,
    pub(super) batch_id: u64,
    pub(super) schema: SchemaRef,
    /// Match the batch's columns to `schema` by name, NULL for those it
    /// lacks (`merge_schema`); else by position.
    pub(super) by_name: bool,
    pub(super) writer: FileWriter,
    /// The table's partition columns and where they sit in `schema`
    /// (empty: unpartitioned, or a writer that splits for itself).
    pub(super) partitions: Vec<(String, usize)>,
    /// The runs' files, closed early once the input moves past their
    /// partition (`None`: the runs go to `writer`).
    pub(super) files: Option<PartitionFiles>,
    pub(super) rows: u64,
    /// Input (Arrow bytes) delta-rs's split of a partitioned table may
    /// take before the writer closes its open files.
    pub(super) flush_after: usize,
    /// Input the split has taken since its files were last closed.
    pub(super) unflushed: usize,
    /// The files closed before the batch's end.
    pub(super) flushed: Vec<Add>,
    /// The table's rules each row must keep (`None`: it has none).
    pub(super) rules: Option<Arc<super::rules::TableRules>>,
    /// The rows that broke one, left out of the files.
    pub(super) violations: Vec<lakestream_sink::Violation>,
}

impl DeltaBatchWriter {
    /// The runs of equal partition values in `batch`, each with its
    /// values, or `None` when delta-rs's split should do it: no partition
    /// columns, too many runs, or a type the run kernels cannot compare.
    fn runs(&self, batch: &RecordBatch) -> Option<Vec<Run>> {
        if self.partitions.is_empty() {
            return None;
        }
        let columns: Vec<_> = self
            .partitions
            .iter()
            .map(|(_, i)| batch.column(*i).clone())
            .collect();
        let runs = arrow::compute::partition(&columns).ok()?;
        if runs.len() > MAX_RUNS {
            return None;
        }
        runs.ranges()
            .into_iter()
            .map(|r| {
                let values = self
                    .partitions
                    .iter()
                    .zip(&columns)
                    .map(|((name, _), col)| {
                        Some((name.clone(), Scalar::from_array(col.as_ref(), r.start)?))
                    })
                    .collect::<Option<IndexMap<_, _>>>()?;
                Some((r.start, r.end - r.start, values))
            })
            .collect()
    }
}

#[async_trait]
impl BatchWriter for DeltaBatchWriter {
    async fn write(&mut self, batch: RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        let batch = if self.by_name {
            by_name(&batch, &self.schema)
        } else {
            Ok(batch)
        };
        let batch = batch
            .and_then(|b| cast_batch(&b, &self.schema))
            .map_err(|reason| Error::SchemaMismatch {
                table: self.table.clone(),
                reason,
            })?;
        let batch = match &self.rules {
            Some(rules) => {
                let (good, bad) = rules.apply(batch).map_err(|reason| Error::Write {
                    table: self.table.clone(),
                    batch_id: self.batch_id,
                    source: format!("checking the table's rules: {reason}").into(),
                })?;
                self.violations.extend(bad);
                if good.num_rows() == 0 {
                    return Ok(());
                }
                good
            }
            None => batch,
        };
        self.rows += batch.num_rows() as u64;
        let runs = self.runs(&batch);
        let written = match (&mut self.writer, runs, self.files.as_mut()) {
            (FileWriter::Blind(_), Some(runs), Some(files)) => {
                let per_row = batch.get_array_memory_size() / batch.num_rows();
                let mut written = Ok(());
                for (start, len, values) in runs {
                    written = files
                        .write(&batch.slice(start, len), &values, len * per_row)
                        .await;
                    if written.is_err() {
                        break;
                    }
                }
                files.advance(batch.num_rows() as u64);
                written
            }
            (FileWriter::Blind(w), Some(runs), None) => {
                let mut written = Ok(());
                for (start, len, values) in runs {
                    written = w
                        .write_partition(
                            batch.slice(start, len),
                            &values,
                            deltalake::writer::WriteMode::Default,
                        )
                        .await
                        .map(|_| ());
                    if written.is_err() {
                        break;
                    }
                }
                written
            }
            (FileWriter::Blind(w), None, _) => {
                let bytes = batch.get_array_memory_size();
                match w.write(batch).await {
                    Ok(()) if !self.partitions.is_empty() => {
                        self.unflushed += bytes;
                        if self.unflushed < self.flush_after {
                            Ok(())
                        } else {
                            self.unflushed = 0;
                            w.flush().await.map(|adds| self.flushed.extend(adds))
                        }
                    }
                    written => written,
                }
            }
            (FileWriter::Evolving(w), _, _) => w.write(&batch).await,
        };
        written.map_err(|e| Error::Write {
            table: self.table.clone(),
            batch_id: self.batch_id,
            source: Box::new(e),
        })
    }

    async fn finish(self: Box<Self>) -> Result<Staged> {
        let adds = match self.writer {
            FileWriter::Blind(mut w) => w.flush().await,
            FileWriter::Evolving(w) => w.close().await,
        };
        let mut flushed = self.flushed;
        let adds = adds.map(|adds| {
            flushed.extend(adds);
            flushed
        });
        let adds = match (adds, self.files) {
            (Ok(mut adds), Some(files)) => files.finish().await.map(|more| {
                adds.extend(more);
                adds
            }),
            (adds, _) => adds,
        };
        let adds = adds.map_err(|e| Error::Write {
            table: self.table.clone(),
            batch_id: self.batch_id,
            source: Box::new(e),
        })?;
        let bytes = adds.iter().map(|a| a.size.max(0) as u64).sum();
        let files = adds.len();
        let actions: Vec<Action> = adds.into_iter().map(Action::Add).collect();
        Ok(Staged::new(self.batch_id, self.rows, files, bytes, actions)
            .with_violations(self.violations))
    }
}
