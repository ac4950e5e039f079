//! [`QueryBuilder::for_each_batch`](crate::QueryBuilder::for_each_batch):
//! the embedder's own code runs on each batch's output, given as a
//! DataFusion [`DataFrame`], in place of a sink (Spark's `foreachBatch`).
//!
//! # Contract
//!
//! - The function is called once per batch, in batch order, with the batch
//!   id and the batch's output (the query's rows over the batch's input,
//!   held in memory: as large as a batch's output, bounded by the sources'
//!   per-trigger limits).
//! - The batch is marked done in the checkpoint only after the function
//!   returned `Ok`. An `Err` fails the query (the batch re-runs at the next
//!   start).
//! - **At least once**: after a crash (or an `Err`) between the function's
//!   effects and the checkpoint's mark, a restart calls it again with the
//!   **same batch id and the same rows** (the batch's range is fixed in the
//!   checkpoint before it runs). Make the effects idempotent per batch id:
//!   remember the last batch id done where the effects go, or write to a
//!   Delta table with a transaction `(app id, batch id)` and skip a batch
//!   id the table already holds (`examples/for_each_batch.rs` MERGEs each
//!   batch into a Delta table that way).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use async_trait::async_trait;
use datafusion::dataframe::DataFrame;
use datafusion::prelude::SessionContext;
use futures::future::BoxFuture;
use lakestream_sink::{BatchWriter, CommitInfo, CommitOutcome, Error, Result, Sink, Staged};

/// What a batch function returns when it fails.
pub type BatchFnError = Box<dyn std::error::Error + Send + Sync>;

/// A function given each batch id and the batch's output.
pub type BatchFn =
    Arc<dyn Fn(u64, DataFrame) -> BoxFuture<'static, Result<(), BatchFnError>> + Send + Sync>;

/// What [`Sink::identity`] says of a function output (and the checkpoint
/// records).
pub const IDENTITY: &str = "for_each_batch";

/// The sink that hands each batch to a [`BatchFn`].
pub(crate) struct ForEachBatch {
    f: BatchFn,
    ctx: SessionContext,
    schema: Mutex<Option<SchemaRef>>,
    calls: AtomicU64,
}

impl ForEachBatch {
    /// Call `f` with each batch, as DataFrames of `ctx` (its functions and
    /// settings apply to what `f` builds on them).
    pub(crate) fn new(f: BatchFn, ctx: SessionContext) -> Self {
        Self {
            f,
            ctx,
            schema: Mutex::new(None),
            calls: AtomicU64::new(0),
        }
    }
}

/// Collects one writer's record batches.
struct Collect {
    batch_id: u64,
    batches: Vec<RecordBatch>,
    rows: u64,
}

#[async_trait]
impl BatchWriter for Collect {
    async fn write(&mut self, batch: RecordBatch) -> Result<()> {
        self.rows += batch.num_rows() as u64;
        self.batches.push(batch);
        Ok(())
    }

    async fn finish(self: Box<Self>) -> Result<Staged> {
        Ok(Staged::new(self.batch_id, self.rows, 0, 0, self.batches))
    }
}

#[async_trait]
impl Sink for ForEachBatch {
    async fn open(&self, schema: SchemaRef) -> Result<()> {
        *self.schema.lock().expect("schema lock") = Some(schema);
        Ok(())
    }

    /// Unknown: the function's effects are its own. A replayed batch is
    /// handed to it again.
    async fn committed_batch(&self, _query_id: &str) -> Result<Option<u64>> {
        Ok(None)
    }

    async fn begin(&self, batch_id: u64) -> Result<Box<dyn BatchWriter>> {
        Ok(Box::new(Collect {
            batch_id,
            batches: Vec::new(),
            rows: 0,
        }))
    }

    /// Calls the function. The version returned counts the calls this
    /// sink made (the function has no table version to report).
    async fn commit(&self, staged: Staged, info: &CommitInfo) -> Result<CommitOutcome> {
        let batch_id = info.batch_id;
        let mut batches: Vec<RecordBatch> = staged
            .into_parts::<Vec<RecordBatch>>(IDENTITY)?
            .into_iter()
            .flatten()
            .collect();
        if batches.is_empty() {
            let schema = self.schema.lock().expect("schema lock").clone();
            let schema = schema.ok_or_else(|| Error::InvalidConfig {
                table: IDENTITY.into(),
                reason: "a batch was committed before the sink was opened".into(),
            })?;
            batches.push(RecordBatch::new_empty(schema));
        }
        let df = self.ctx.read_batches(batches).map_err(|e| Error::Commit {
            table: IDENTITY.into(),
            batch_id,
            source: Box::new(e),
        })?;
        (self.f)(batch_id, df)
            .await
            .map_err(|source| Error::Commit {
                table: IDENTITY.into(),
                batch_id,
                source,
            })?;
        let version = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        Ok(CommitOutcome::Committed { version })
    }

    fn identity(&self) -> String {
        IDENTITY.into()
    }
}
