//! A sink that keeps each committed batch in memory.
//!
//! [`MemorySink`] has the Delta sink's contract without files: a batch id
//! commits at most once per query, a commit is atomic (a batch's rows
//! appear together or not at all), and clones of one sink share one
//! table, so two clones act as two writers of the same table. The
//! engine's tests run queries into it, and an embedder can consume a
//! query's output from it. The contents live as long as the sink: a
//! process that dies loses them (use the Delta sink to keep output).
//!
//! [`MemorySink::lose_next_commit_response`] makes the next commit land and
//! then report an error, as a commit whose answer was lost on the way does:
//! callers must re-run such a batch, and the re-run must find it committed.

use std::collections::{BTreeMap, HashMap, HashSet};

use arrow::array::BooleanArray;
use arrow::compute::filter_record_batch;
use arrow::row::{RowConverter, SortField};
use std::sync::{Arc, Mutex, MutexGuard};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use async_trait::async_trait;

use crate::{
    BatchWriter, CommitInfo, CommitOutcome, Error, Result, Sink, Staged, WriteMode, describe_schema,
};

/// One committed batch of a [`MemorySink`].
#[derive(Debug, Clone)]
pub struct MemoryCommit {
    /// The table version this commit made (1 for the first commit).
    pub version: u64,
    /// The query that committed it.
    pub query_id: String,
    /// Its batch id.
    pub batch_id: u64,
    /// Its rows, in the order they were written.
    pub batches: Vec<RecordBatch>,
    /// The metadata the engine recorded with it.
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// Whether it added rows or replaced them all.
    pub write: WriteMode,
}

impl Table {
    /// The rows the table holds: the commits after the last one that
    /// replaced every row, each upsert taking the place of the earlier rows
    /// with its keys (NULLs equal).
    fn rows_now(&self) -> Vec<RecordBatch> {
        let from = self
            .commits
            .iter()
            .rposition(|c| matches!(c.write, WriteMode::ReplaceAll { .. }))
            .unwrap_or(0);
        let mut out: Vec<RecordBatch> = Vec::new();
        for c in &self.commits[from..] {
            if let (WriteMode::Upsert { keys }, Some(first)) = (&c.write, c.batches.first()) {
                let schema = first.schema();
                let idx: Vec<usize> = keys
                    .iter()
                    .filter_map(|k| schema.index_of(k).ok())
                    .collect();
                let converter = RowConverter::new(
                    idx.iter()
                        .map(|&i| SortField::new(schema.field(i).data_type().clone()))
                        .collect(),
                )
                .expect("key types the sink accepted");
                let key_rows = |b: &RecordBatch| {
                    let cols: Vec<_> = idx.iter().map(|&i| b.column(i).clone()).collect();
                    converter.convert_columns(&cols).expect("key columns")
                };
                let mut new_keys = HashSet::new();
                for b in &c.batches {
                    new_keys.extend(key_rows(b).iter().map(|r| r.as_ref().to_vec()));
                }
                out = out
                    .into_iter()
                    .map(|b| {
                        let keep: BooleanArray = key_rows(&b)
                            .iter()
                            .map(|r| Some(!new_keys.contains(r.as_ref())))
                            .collect();
                        filter_record_batch(&b, &keep).expect("same length")
                    })
                    .filter(|b| b.num_rows() > 0)
                    .collect();
            }
            out.extend(c.batches.iter().cloned());
        }
        out
    }
}

#[derive(Debug, Default)]
struct Table {
    schema: Option<SchemaRef>,
    commits: Vec<MemoryCommit>,
    /// The highest batch id committed per query.
    txn: HashMap<String, u64>,
    /// Source positions recorded by commits with claims.
    positions: BTreeMap<String, i64>,
    lose_next_response: bool,
}

/// A table in memory; clones share it.
#[derive(Debug, Clone)]
pub struct MemorySink {
    name: String,
    table: Arc<Mutex<Table>>,
}

impl MemorySink {
    /// An empty table called `name` (shown in errors and as the sink's
    /// identity in the checkpoint).
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
            table: Arc::default(),
        }
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        // A panic while the lock was held cannot leave a half-made commit:
        // a commit is one push under the lock.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every committed batch, oldest first.
    pub fn commits(&self) -> Vec<MemoryCommit> {
        self.table().commits.clone()
    }

    /// The table's rows, in commit order: every committed row since the
    /// last commit that replaced them all, less the rows a later upsert
    /// replaced.
    pub fn batches(&self) -> Vec<RecordBatch> {
        self.table().rows_now()
    }

    /// The number of rows the table holds.
    pub fn rows(&self) -> usize {
        self.batches().iter().map(|b| b.num_rows()).sum()
    }

    /// Let the next commit land, then return an error as if its answer
    /// had been lost (a fault for tests of the caller's retry).
    pub fn lose_next_commit_response(&self) {
        self.table().lose_next_response = true;
    }
}

#[async_trait]
impl Sink for MemorySink {
    async fn open(&self, schema: SchemaRef) -> Result<()> {
        let mut table = self.table();
        match &table.schema {
            None => {
                table.schema = Some(schema);
                Ok(())
            }
            Some(have) => {
                let same = crate::same_columns(have, &schema);
                if same {
                    Ok(())
                } else {
                    Err(Error::SchemaMismatch {
                        table: self.name.clone(),
                        reason: format!(
                            "the table has ({}), the query produces ({})",
                            describe_schema(have),
                            describe_schema(&schema)
                        ),
                    })
                }
            }
        }
    }

    async fn committed_batch(&self, query_id: &str) -> Result<Option<u64>> {
        Ok(self.table().txn.get(query_id).copied())
    }

    async fn begin(&self, batch_id: u64) -> Result<Box<dyn BatchWriter>> {
        let schema = self
            .table()
            .schema
            .clone()
            .ok_or_else(|| Error::InvalidConfig {
                table: self.name.clone(),
                reason: "the sink was not opened".into(),
            })?;
        Ok(Box::new(MemoryWriter {
            table: self.name.clone(),
            batch_id,
            schema,
            batches: Vec::new(),
            rows: 0,
            bytes: 0,
        }))
    }

    async fn commit(&self, staged: Staged, info: &CommitInfo) -> Result<CommitOutcome> {
        let batches: Vec<RecordBatch> = staged
            .into_parts::<Vec<RecordBatch>>(&self.name)?
            .into_iter()
            .flatten()
            .collect();
        let mut table = self.table();
        let version = table.commits.len() as u64;
        if table
            .txn
            .get(&info.query_id)
            .is_some_and(|&b| b >= info.batch_id)
        {
            return Ok(CommitOutcome::AlreadyCommitted { version });
        }
        for c in &info.claims {
            if let Some(&found) = table.positions.get(&c.app_id)
                && found != c.from
            {
                return Ok(CommitOutcome::Superseded {
                    version,
                    app_id: c.app_id.clone(),
                    expected: c.from,
                    found,
                });
            }
        }
        for c in &info.claims {
            table.positions.insert(c.app_id.clone(), c.to);
        }
        table.commits.push(MemoryCommit {
            version: version + 1,
            query_id: info.query_id.clone(),
            batch_id: info.batch_id,
            batches,
            metadata: info.metadata.clone(),
            write: info.write.clone(),
        });
        table.txn.insert(info.query_id.clone(), info.batch_id);
        if std::mem::take(&mut table.lose_next_response) {
            return Err(Error::Commit {
                table: self.name.clone(),
                batch_id: info.batch_id,
                source: "the commit landed but its answer was lost (injected fault)".into(),
            });
        }
        Ok(CommitOutcome::Committed {
            version: version + 1,
        })
    }

    fn identity(&self) -> String {
        format!("memory {}", self.name)
    }

    async fn positions(&self, app_ids: &[String]) -> Result<BTreeMap<String, i64>> {
        let table = self.table();
        Ok(app_ids
            .iter()
            .filter_map(|id| table.positions.get(id).map(|p| (id.clone(), *p)))
            .collect())
    }

    async fn version(&self) -> Result<Option<u64>> {
        Ok(Some(self.table().commits.len() as u64))
    }
}

struct MemoryWriter {
    table: String,
    batch_id: u64,
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    rows: u64,
    bytes: u64,
}

#[async_trait]
impl BatchWriter for MemoryWriter {
    async fn write(&mut self, batch: RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        if batch.schema().fields().len() != self.schema.fields().len() {
            return Err(Error::SchemaMismatch {
                table: self.table.clone(),
                reason: format!(
                    "batch {} has ({}), the table ({})",
                    self.batch_id,
                    describe_schema(&batch.schema()),
                    describe_schema(&self.schema)
                ),
            });
        }
        self.rows += batch.num_rows() as u64;
        self.bytes += batch.get_array_memory_size() as u64;
        self.batches.push(batch);
        Ok(())
    }

    async fn finish(self: Box<Self>) -> Result<Staged> {
        Ok(Staged::new(
            self.batch_id,
            self.rows,
            0,
            self.bytes,
            self.batches,
        ))
    }
}
