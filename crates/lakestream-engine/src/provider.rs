//! The streaming table as DataFusion sees it: a `TableProvider` whose scan
//! reads the current micro-batch's range of one source.
//!
//! The query's logical plan is built once; before each batch the driver sets
//! the range on every [`MicroBatchTable`], and physical planning calls
//! `scan`, which asks the source for fresh streams of exactly that range.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::TaskContext;
use datafusion::logical_expr::Expr;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::{PartitionStream, StreamingTableExec};
use datafusion::physical_plan::{ExecutionPlan, SendableRecordBatchStream};
use futures::StreamExt;
use lakestream_source::{BatchStream, Offset, Source};

/// The range a [`MicroBatchTable`] reads in the current batch.
#[derive(Debug, Clone)]
pub(crate) struct BatchRange {
    pub(crate) start: Option<Offset>,
    /// `None`: nothing new for this source in this batch.
    pub(crate) end: Option<Offset>,
}

/// Shared between a table's streams and the driver: the first source error
/// (kept typed, since DataFusion would flatten it to text) and a row counter.
#[derive(Debug, Default)]
pub(crate) struct ScanStats {
    pub(crate) error: Mutex<Option<lakestream_source::Error>>,
    pub(crate) rows: AtomicU64,
}

/// A source registered as a DataFusion table.
pub(crate) struct MicroBatchTable {
    source: Arc<dyn Source>,
    schema: SchemaRef,
    partitions: usize,
    range: Mutex<Option<BatchRange>>,
    stats: Arc<ScanStats>,
}

impl fmt::Debug for MicroBatchTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MicroBatchTable")
            .field("source", &self.source.name())
            .finish()
    }
}

impl MicroBatchTable {
    pub(crate) fn new(source: Arc<dyn Source>, partitions: usize) -> Self {
        Self {
            schema: source.schema(),
            source,
            partitions: partitions.max(1),
            range: Mutex::new(None),
            stats: Arc::new(ScanStats::default()),
        }
    }

    pub(crate) fn source(&self) -> &Arc<dyn Source> {
        &self.source
    }

    pub(crate) fn set_range(&self, range: Option<BatchRange>) {
        *self.range.lock().expect("range lock") = range;
        *self.stats.error.lock().expect("stats lock") = None;
        self.stats.rows.store(0, Ordering::Relaxed);
    }

    pub(crate) fn stats(&self) -> &Arc<ScanStats> {
        &self.stats
    }
}

#[async_trait]
impl TableProvider for MicroBatchTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let range = self.range.lock().expect("range lock").clone();
        let streams: Vec<BatchStream> = match range {
            Some(BatchRange {
                start,
                end: Some(end),
            }) => self
                .source
                .read(start.as_ref(), &end, self.partitions)
                .map_err(|e| DataFusionError::External(Box::new(e)))?,
            _ => Vec::new(),
        };
        let mut partitions: Vec<Arc<dyn PartitionStream>> = streams
            .into_iter()
            .map(|s| {
                Arc::new(OneShot {
                    schema: self.schema.clone(),
                    stream: Mutex::new(Some(s)),
                    stats: self.stats.clone(),
                }) as Arc<dyn PartitionStream>
            })
            .collect();
        if partitions.is_empty() {
            partitions.push(Arc::new(OneShot {
                schema: self.schema.clone(),
                stream: Mutex::new(Some(futures::stream::empty().boxed())),
                stats: self.stats.clone(),
            }));
        }
        Ok(Arc::new(StreamingTableExec::try_new(
            self.schema.clone(),
            partitions,
            projection,
            Vec::new(),
            false,
            limit,
        )?))
    }
}

/// One partition of a batch: a source stream that can be executed once.
struct OneShot {
    schema: SchemaRef,
    stream: Mutex<Option<BatchStream>>,
    stats: Arc<ScanStats>,
}

impl fmt::Debug for OneShot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OneShot")
    }
}

impl PartitionStream for OneShot {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let stream = self.stream.lock().expect("partition lock").take();
        let stats = self.stats.clone();
        let stream = match stream {
            Some(s) => s
                .map(move |r| match r {
                    Ok(b) => {
                        stats.rows.fetch_add(b.num_rows() as u64, Ordering::Relaxed);
                        Ok(b)
                    }
                    Err(e) => {
                        let msg = e.to_string();
                        stats.error.lock().expect("stats lock").get_or_insert(e);
                        Err(DataFusionError::Execution(msg))
                    }
                })
                .boxed(),
            None => futures::stream::once(async {
                Err(DataFusionError::Internal(
                    "a micro-batch partition was executed twice".into(),
                ))
            })
            .boxed(),
        };
        Box::pin(RecordBatchStreamAdapter::new(self.schema.clone(), stream))
    }
}
