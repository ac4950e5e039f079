//! The streaming table as DataFusion sees it: a `TableProvider` whose scan
//! reads the current micro-batch's range of one source.
//!
//! The query's logical plan is built once. Each batch's physical plan is
//! created from a session whose config carries a [`BatchScans`] extension:
//! the range of every source in this batch, and the counters its scans
//! fill. The table itself holds no per-batch state, so two plans (a batch
//! and the next one planned early) can never see each other's ranges.
//! A source error travels through DataFusion as a [`SourceFailure`] and the
//! driver finds it, typed, with [`source_failure`].
//!
//! A query with several outputs reads each source's range once: the
//! driver [`BatchScans::materialize`]s it into memory and every output's
//! scan reads those record batches.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::{DataType, Int64Type, SchemaRef, TimeUnit};
use async_trait::async_trait;
use datafusion::catalog::Session;
use datafusion::datasource::{TableProvider, TableType};
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::TaskContext;
use datafusion::logical_expr::Expr;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::{PartitionStream, StreamingTableExec};
use datafusion::physical_plan::{ExecutionPlan, SendableRecordBatchStream};
use futures::{StreamExt, TryStreamExt};
use lakestream_source::{BatchStream, Offset, Source};

/// The range a [`MicroBatchTable`] reads in the current batch.
#[derive(Debug, Clone)]
pub(crate) struct BatchRange {
    pub(crate) start: Option<Offset>,
    /// `None`: nothing new for this source in this batch.
    pub(crate) end: Option<Offset>,
}

/// One batch's scans, by source name: what each reads, how many rows it
/// read and, for a source with an event-time column, the largest event
/// time among them. Set as a `SessionConfig` extension of the batch's
/// session.
#[derive(Debug, Default)]
pub(crate) struct BatchScans {
    ranges: HashMap<String, BatchRange>,
    rows: HashMap<String, Arc<AtomicU64>>,
    event_times: HashMap<String, EventTimeScan>,
    /// Ranges read ahead into memory, by source name, one `Vec` per
    /// partition.
    read: HashMap<String, Arc<Vec<Vec<RecordBatch>>>>,
}

/// The event-time column of a source and the largest value read, in ms.
#[derive(Debug, Clone)]
struct EventTimeScan {
    column: usize,
    unit: TimeUnit,
    max_ms: Arc<AtomicI64>,
}

impl EventTimeScan {
    fn observe(&self, batch: &RecordBatch) {
        let col = batch.column(self.column);
        let Ok(v) = arrow::compute::cast(col, &DataType::Int64) else {
            return;
        };
        if let Some(max) = arrow::compute::max(v.as_primitive::<Int64Type>()) {
            let ms = crate::stateful::window::in_ms(self.unit, max);
            self.max_ms.fetch_max(ms, Ordering::Relaxed);
        }
    }
}

impl BatchScans {
    /// Scans reading `range` from the source named `name` (a source
    /// without a range reads nothing).
    pub(crate) fn insert(&mut self, name: &str, range: BatchRange) {
        self.ranges.insert(name.to_string(), range);
        self.rows.insert(name.to_string(), Arc::default());
    }

    /// Track the largest value of column `column` (a timestamp) of source
    /// `name` in the scans.
    pub(crate) fn track_event_time(&mut self, name: &str, column: usize, unit: TimeUnit) {
        self.event_times.insert(
            name.to_string(),
            EventTimeScan {
                column,
                unit,
                max_ms: Arc::new(AtomicI64::new(i64::MIN)),
            },
        );
    }

    /// Read every range of `tables` now, into memory, so that each scan of
    /// this batch (one per output of the query) takes the same record
    /// batches instead of reading the source again. Rows and event times
    /// are counted here, once. The memory held is the batch's input, as
    /// bounded by the sources' per-trigger limits.
    pub(crate) async fn materialize(
        &mut self,
        tables: &[Arc<MicroBatchTable>],
    ) -> Result<(), Arc<lakestream_source::Error>> {
        for t in tables {
            if let Some(parts) = self.read_range(t, true).await? {
                self.read
                    .insert(t.source().name().to_string(), Arc::new(parts));
            }
        }
        Ok(())
    }

    /// Read every range of `tables` and drop the rows, counting them (a
    /// replayed batch whose only missing output is its dead letters: the
    /// sources reject records as they read).
    pub(crate) async fn drain(
        &self,
        tables: &[Arc<MicroBatchTable>],
    ) -> Result<(), Arc<lakestream_source::Error>> {
        for t in tables {
            self.read_range(t, false).await?;
        }
        Ok(())
    }

    /// Read `t`'s range in this batch, counting rows and event times; the
    /// batches per partition when `keep`, `None` when it has no range.
    async fn read_range(
        &self,
        t: &MicroBatchTable,
        keep: bool,
    ) -> Result<Option<Vec<Vec<RecordBatch>>>, Arc<lakestream_source::Error>> {
        let name = t.source().name();
        let Some(BatchRange {
            start,
            end: Some(end),
        }) = self.ranges.get(name)
        else {
            return Ok(None);
        };
        let streams = t
            .source()
            .read(start.as_ref(), end, t.partitions)
            .map_err(Arc::new)?;
        let rows = self.rows.get(name).cloned().unwrap_or_default();
        let event_time = self.event_times.get(name).cloned();
        let parts = futures::future::try_join_all(streams.into_iter().map(|mut s| {
            let rows = rows.clone();
            let event_time = event_time.clone();
            async move {
                let mut batches = Vec::new();
                while let Some(b) = s.try_next().await? {
                    rows.fetch_add(b.num_rows() as u64, Ordering::Relaxed);
                    if let Some(et) = &event_time {
                        et.observe(&b);
                    }
                    if keep {
                        batches.push(b);
                    }
                }
                Ok::<_, lakestream_source::Error>(batches)
            }
        }))
        .await
        .map_err(Arc::new)?;
        Ok(Some(parts))
    }

    /// Rows the scans of source `name` have read so far.
    pub(crate) fn rows(&self, name: &str) -> u64 {
        self.rows.get(name).map_or(0, |r| r.load(Ordering::Relaxed))
    }

    /// The largest event time (ms) the scans of source `name` have read,
    /// if it has an event-time column and read a non-NULL one.
    pub(crate) fn event_time_max_ms(&self, name: &str) -> Option<i64> {
        let v = self.event_times.get(name)?.max_ms.load(Ordering::Relaxed);
        (v != i64::MIN).then_some(v)
    }
}

/// A source's error on its way through DataFusion (as
/// `DataFusionError::External`). Shared: an operator that fans an error out
/// to several outputs hands each a copy, and any copy leads back to it.
#[derive(Debug, Clone)]
pub(crate) struct SourceFailure(pub(crate) Arc<lakestream_source::Error>);

impl fmt::Display for SourceFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SourceFailure {}

/// The source error that caused `e`, if a source's read did.
pub(crate) fn source_failure(
    e: &(dyn std::error::Error + 'static),
) -> Option<Arc<lakestream_source::Error>> {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(f) = e.downcast_ref::<SourceFailure>() {
            return Some(f.0.clone());
        }
        next = e.source();
    }
    None
}

/// A source registered as a DataFusion table.
pub(crate) struct MicroBatchTable {
    source: Arc<dyn Source>,
    schema: SchemaRef,
    partitions: usize,
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
        }
    }

    pub(crate) fn source(&self) -> &Arc<dyn Source> {
        &self.source
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
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        _filters: &[Expr],
        limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let name = self.source.name();
        let scans = state
            .config()
            .get_extension::<BatchScans>()
            .ok_or_else(|| {
                DataFusionError::Internal(format!(
                    "the streaming table {name} was planned outside a micro-batch"
                ))
            })?;
        if let Some(parts) = scans.read.get(name) {
            let empty = [Vec::new()];
            let parts: &[Vec<RecordBatch>] = if parts.is_empty() { &empty } else { parts };
            let config = datafusion::datasource::memory::MemorySourceConfig::try_new(
                parts,
                self.schema.clone(),
                projection.cloned(),
            )?
            .with_limit(limit);
            return Ok(datafusion::datasource::source::DataSourceExec::from_data_source(config));
        }
        let rows = scans.rows.get(name).cloned().unwrap_or_default();
        let event_time = scans.event_times.get(name).cloned();
        let streams: Vec<BatchStream> = match scans.ranges.get(name) {
            Some(BatchRange {
                start,
                end: Some(end),
            }) => self
                .source
                .read(start.as_ref(), end, self.partitions)
                .map_err(|e| DataFusionError::External(Box::new(SourceFailure(Arc::new(e)))))?,
            _ => Vec::new(),
        };
        let mut partitions: Vec<Arc<dyn PartitionStream>> = streams
            .into_iter()
            .map(|s| {
                Arc::new(OneShot {
                    schema: self.schema.clone(),
                    stream: Mutex::new(Some(s)),
                    rows: rows.clone(),
                    event_time: event_time.clone(),
                }) as Arc<dyn PartitionStream>
            })
            .collect();
        if partitions.is_empty() {
            partitions.push(Arc::new(OneShot {
                schema: self.schema.clone(),
                stream: Mutex::new(Some(futures::stream::empty().boxed())),
                rows,
                event_time: None,
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
    rows: Arc<AtomicU64>,
    event_time: Option<EventTimeScan>,
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
        let rows = self.rows.clone();
        let event_time = self.event_time.clone();
        let stream = match stream {
            Some(s) => s
                .map(move |r| match r {
                    Ok(b) => {
                        rows.fetch_add(b.num_rows() as u64, Ordering::Relaxed);
                        if let Some(et) = &event_time {
                            et.observe(&b);
                        }
                        Ok(b)
                    }
                    Err(e) => Err(DataFusionError::External(Box::new(SourceFailure(
                        Arc::new(e),
                    )))),
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
