//! Stateful aggregation over a stream: `GROUP BY` (with or without an
//! event-time window) computed incrementally, batch by batch, with the
//! groups' partial aggregates kept in a [`StateStore`] under the
//! checkpoint.
//!
//! DataFusion plans the query as usual; each batch, [`StatefulAggregate::run`]
//! finds the aggregation in the batch's physical plan and replaces it:
//! 1. rows of the batch whose window has already closed (its end at or
//!    before the batch's watermark) are dropped and counted, as are rows
//!    without an event time;
//! 2. a `Partial` aggregation of the remaining rows gives each group's
//!    partial state for this batch;
//! 3. those are merged (`PartialReduce`) with the stored states of the same
//!    groups only, so a batch costs what it touches, not the state's size,
//!    a slice of keys at a time, so a batch touching many groups holds one
//!    slice's merge at once;
//! 4. in `append` mode the groups whose window ended at or before the
//!    watermark are evicted and finalized (`Final`): they are the batch's
//!    output, written once, never updated;
//! 5. the state's changes are committed as of this batch (durable before
//!    the sink commits it), with the largest event time seen per source,
//!    from which the next batch's watermark is derived.
//!
//! The watermark of batch N+1 is `max(watermark of N, min over sources of
//! (largest event time seen through N − the source's delay))`, fixed in
//! `offsets/N+1` before the batch runs, so a replay drops and emits exactly
//! what the first attempt did.

mod aggregate;
pub(crate) mod window;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arrow::array::{Array, ArrayRef, AsArray, BooleanArray, RecordBatch};
use arrow::compute::{cast, concat_batches, filter_record_batch};
use arrow::datatypes::{DataType, Int64Type, SchemaRef, TimeUnit};
use datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::TaskContext;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{PhysicalExpr, ScalarFunctionExpr};
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, PhysicalGroupBy};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::{PartitionStream, StreamingTableExec};
use datafusion::physical_plan::udaf::AggregateFunctionExpr;
use datafusion::physical_plan::{
    ExecutionPlan, ExecutionPlanProperties, SendableRecordBatchStream, collect,
};
use futures::StreamExt;
use lakestream_state::StateStore;
use lakestream_storage::Location;
use serde::Serialize;

use crate::provider::BatchScans;
use crate::{Error, Result};

pub(crate) use window::{SessionWindowFunction, SlidingWindowsFunction, WindowFunction};

/// When the groups of a stateful query are written to the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputMode {
    /// Each group once, final, when the watermark passes its window's end
    /// (the default; needs a window and a watermark).
    #[default]
    Append,
    /// The groups a batch changed, merged into the table by the group keys.
    Update,
    /// The whole result, rewritten by every batch.
    Complete,
}

impl OutputMode {
    /// Parse `append`, `update` or `complete` (any case).
    pub fn parse(v: &str) -> Option<Self> {
        match v.to_ascii_lowercase().as_str() {
            "append" => Some(Self::Append),
            "update" => Some(Self::Update),
            "complete" => Some(Self::Complete),
            _ => None,
        }
    }
}

/// A stream's event time: its column and how late its rows may arrive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventTime {
    /// The timestamp column.
    pub column: String,
    /// How far behind the largest event time seen the watermark stays.
    pub delay: std::time::Duration,
}

/// A stateful operator's figures for one batch.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq)]
#[serde(default)]
pub struct StateProgress {
    /// The operator (`aggregate`).
    pub operator: String,
    /// Keys held after the batch.
    pub rows: u64,
    /// Bytes of the keys and values held.
    pub bytes: u64,
    /// Bytes of memory they take as held (see [`StateStore::memory`]).
    pub memory_bytes: u64,
    /// Groups the batch changed.
    pub rows_updated: u64,
    /// Groups the batch finalized and removed (append mode).
    pub rows_evicted: u64,
    /// Input rows dropped because their window had already closed.
    pub rows_dropped_by_watermark: u64,
    /// Input rows dropped because their event time was NULL.
    pub rows_without_event_time: u64,
}

/// The aggregation of a stateful query (see the module docs).
pub(crate) struct StatefulAggregate {
    store: tokio::sync::Mutex<StateStore>,
    /// The group key that says when a group may be evicted: a window
    /// (evicted after its end) or, in a deduplication, the event time.
    evict: Option<Evict>,
    /// A deduplication: an aggregation without aggregate functions
    /// (`SELECT DISTINCT`, or `GROUP BY` alone), whose groups are written
    /// once, when first seen.
    dedup: bool,
    mode: OutputMode,
    /// Event time per source name.
    event_times: BTreeMap<String, EventTime>,
    /// The output columns carrying the group keys (update mode).
    keys: Vec<String>,
    /// The same in complete mode, when the output carries them all.
    replace_keys: Option<Vec<String>>,
}

/// The group key whose value says when a group may be evicted.
#[derive(Debug, Clone, Copy)]
struct Evict {
    /// Its column in the state (a group key's index among the keys).
    index: usize,
    /// What gives each input row's time, for dropping late rows.
    input: EvictInput,
    /// The unit of its timestamps.
    unit: TimeUnit,
    kind: EvictKind,
}

/// What the evicting key holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EvictKind {
    /// A window struct (`window(...)`, a sliding window): evicted after its
    /// `end`.
    Window,
    /// A session window struct: evicted after its `end`; the group's
    /// sessions that overlap merge, so a row is late when it starts before
    /// the watermark (it could belong to a session already written), not
    /// when its own session ends.
    Session,
    /// A timestamp, evicted this long after it: a `date_bin` key's stride
    /// (its bin's end), 0 for a deduplicated event time.
    Time(i64),
    /// A `DISTINCT ON` key's first event time, kept this long (the
    /// watermark delay) after it, as Spark's deduplication within the
    /// watermark: a copy whose time is within the delay of the first row's
    /// is always dropped. A row is late when its own time is at or before
    /// the watermark.
    Expire(i64),
}

/// Where an evicting time comes from in the aggregation's input rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EvictInput {
    /// The group key of this index.
    Key(usize),
    /// The argument of the aggregate of this index (a `DISTINCT ON`'s
    /// `first_value` of the event-time column).
    Aggregate(usize),
}

impl Evict {
    /// The eviction time of each value of `column` (this key's column), in
    /// its unit; NULL for a NULL window or time.
    fn times(&self, column: &ArrayRef) -> DfResult<arrow::array::PrimitiveArray<Int64Type>> {
        match self.kind {
            EvictKind::Window | EvictKind::Session => window_bounds(column, 1),
            EvictKind::Time(after) | EvictKind::Expire(after) => {
                let times = cast(column, &DataType::Int64)?;
                Ok(times
                    .as_primitive::<Int64Type>()
                    .unary(|t| t.saturating_add(after)))
            }
        }
    }

    /// True when this key is an event-time window (`window`, a sliding or
    /// session window, or `date_bin`) whose groups close.
    fn is_window(&self) -> bool {
        !matches!(self.kind, EvictKind::Time(0) | EvictKind::Expire(_))
    }

    /// True when a row whose key `column` holds these values is too late
    /// for a batch whose eviction threshold is `threshold`: each row's
    /// window has ended by then, or, for a session, it starts before it.
    fn late(&self, column: &ArrayRef, threshold: Option<i64>) -> DfResult<Vec<Option<bool>>> {
        let (times, strict) = match self.kind {
            EvictKind::Session => (window_bounds(column, 0)?, true),
            // Late by the row's own time, not by when its key expires.
            EvictKind::Expire(_) => (
                Evict {
                    kind: EvictKind::Time(0),
                    ..*self
                }
                .times(column)?,
                false,
            ),
            _ => (self.times(column)?, false),
        };
        Ok(times
            .iter()
            .map(|v| {
                v.map(|v| match threshold {
                    Some(t) if strict => v < t,
                    Some(t) => v <= t,
                    None => false,
                })
            })
            .collect())
    }
}

/// The aggregation found in a batch's physical plan.
struct Found {
    /// The node to replace by the batch's output.
    top: Arc<dyn ExecutionPlan>,
    group_by: Arc<PhysicalGroupBy>,
    aggr: Vec<Arc<AggregateFunctionExpr>>,
    filters: Vec<Option<Arc<dyn PhysicalExpr>>>,
    /// The aggregation's input rows.
    raw: Arc<dyn ExecutionPlan>,
    input_schema: SchemaRef,
    /// The window among the group keys: index, expression, unit, and
    /// whether it is a session window.
    window: Option<(usize, Arc<dyn PhysicalExpr>, TimeUnit, bool)>,
}

impl Found {
    fn partial(&self, input: Arc<dyn ExecutionPlan>) -> DfResult<AggregateExec> {
        AggregateExec::try_new(
            AggregateMode::Partial,
            self.group_by.clone(),
            self.aggr.clone(),
            self.filters.clone(),
            input,
            self.input_schema.clone(),
        )
    }

    fn over_states(
        &self,
        mode: AggregateMode,
        states: Vec<RecordBatch>,
        schema: &SchemaRef,
    ) -> DfResult<AggregateExec> {
        AggregateExec::try_new(
            mode,
            Arc::new(self.group_by.as_final()),
            self.aggr.clone(),
            vec![None; self.aggr.len()],
            MemorySourceConfig::try_new_exec(&[states], schema.clone(), None)?,
            self.input_schema.clone(),
        )
    }
}

fn internal(msg: String) -> DataFusionError {
    DataFusionError::Internal(msg)
}

/// The stateful aggregation of `plan`, if it has one.
fn find(plan: &Arc<dyn ExecutionPlan>) -> DfResult<Option<Found>> {
    let mut top = None;
    plan.apply(|node| {
        if node.downcast_ref::<AggregateExec>().is_some() {
            top = Some(node.clone());
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    })?;
    let Some(top) = top else { return Ok(None) };
    let agg = top
        .downcast_ref::<AggregateExec>()
        .expect("found as an AggregateExec");
    let partial = match agg.mode() {
        AggregateMode::Single | AggregateMode::SinglePartitioned => agg,
        AggregateMode::Final | AggregateMode::FinalPartitioned => {
            let mut cur = agg.input();
            loop {
                if let Some(a) = cur.downcast_ref::<AggregateExec>() {
                    if *a.mode() != AggregateMode::Partial {
                        return Err(internal(format!(
                            "a stateful query plans two aggregations ({:?} under {:?})",
                            a.mode(),
                            agg.mode()
                        )));
                    }
                    break a;
                }
                match cur.children().as_slice() {
                    [one] => cur = one,
                    _ => {
                        return Err(internal(format!(
                            "no partial aggregation under the {:?} aggregation",
                            agg.mode()
                        )));
                    }
                }
            }
        }
        other => {
            return Err(internal(format!(
                "a stateful query's top aggregation is {other:?}"
            )));
        }
    };
    let group_by = partial.group_expr().clone();
    if group_by.has_grouping_set() {
        return Err(DataFusionError::Plan(
            "GROUPING SETS, ROLLUP and CUBE over a stream are not supported yet".into(),
        ));
    }
    // `window(ts, size)`, or the column a sliding window's rows carry
    // their window in.
    let input_schema = partial.input_schema();
    let window = group_by.expr().iter().enumerate().find_map(|(i, (e, _))| {
        let mut session = false;
        let data_type = match e.downcast_ref::<ScalarFunctionExpr>() {
            Some(f) if f.name() == "window" => f.return_type().clone(),
            Some(f) if f.name() == "session_window" => {
                session = true;
                f.return_type().clone()
            }
            Some(_) => return None,
            None => {
                let c = e.downcast_ref::<Column>()?;
                if c.name() != lakestream_job::window::SLIDING_COLUMN {
                    return None;
                }
                e.data_type(&input_schema).ok()?
            }
        };
        match &data_type {
            DataType::Struct(fields) => match fields.first()?.data_type() {
                DataType::Timestamp(unit, _) => Some((i, e.clone(), *unit, session)),
                _ => None,
            },
            _ => None,
        }
    });
    Ok(Some(Found {
        top: top.clone(),
        group_by: Arc::new(group_by),
        aggr: partial.aggr_expr().to_vec(),
        filters: partial.filter_expr().to_vec(),
        raw: partial.input().clone(),
        input_schema: partial.input_schema(),
        window,
    }))
}

/// How a `DISTINCT ON` whose keys do not hold the event time forgets a
/// key: by its first row's event time (the `first_value` of a stream's
/// event-time column, part of the key's state), kept for the watermark
/// delay after that time. `None` when no column is a stream's event time.
fn distinct_on_expiry(found: &Found, event_times: &BTreeMap<String, EventTime>) -> Option<Evict> {
    let mut index = found.group_by.expr().len();
    for (j, aggr) in found.aggr.iter().enumerate() {
        let fields = aggr.state_fields().ok()?;
        let args = aggr.expressions();
        let column = match args.as_slice() {
            [arg] if aggr.fun().name() == "first_value" => arg.downcast_ref::<Column>(),
            _ => None,
        };
        let time = column.and_then(|c| event_times.values().find(|et| et.column == c.name()));
        if let (Some(et), Some(first)) = (time, fields.first())
            && let DataType::Timestamp(unit, _) = first.data_type()
        {
            let delay = i64::try_from(et.delay.as_millis()).unwrap_or(i64::MAX);
            return Some(Evict {
                index,
                input: EvictInput::Aggregate(j),
                unit: *unit,
                kind: EvictKind::Expire(window::ms_in(*unit, delay)),
            });
        }
        index += fields.len();
    }
    None
}

/// Field `field` (0: start, 1: end) of each window in `windows`, in the
/// timestamps' own unit; NULL for a NULL window.
fn window_bounds(
    windows: &ArrayRef,
    field: usize,
) -> DfResult<arrow::array::PrimitiveArray<Int64Type>> {
    let s = windows
        .as_struct_opt()
        .ok_or_else(|| internal(format!("a window column of type {}", windows.data_type())))?;
    let values = cast(s.column(field), &DataType::Int64)?;
    let values = values.as_primitive::<Int64Type>().clone();
    // A NULL window (a NULL event time) has no bounds, whatever the child
    // holds.
    Ok(match s.nulls() {
        Some(n) => {
            let merged = arrow::buffer::NullBuffer::union(Some(n), values.nulls());
            arrow::array::PrimitiveArray::<Int64Type>::new(values.values().clone(), merged)
        }
        None => values,
    })
}

/// A `date_bin(stride, ts)` among the group keys (a constant stride
/// without months, a timestamp result): its index, the timestamps' unit
/// and the stride in that unit.
fn date_bin_key(group_by: &PhysicalGroupBy) -> Option<(usize, TimeUnit, i64)> {
    use datafusion::common::ScalarValue;
    group_by.expr().iter().enumerate().find_map(|(i, (e, _))| {
        let f = e.downcast_ref::<ScalarFunctionExpr>()?;
        if f.name() != "date_bin" {
            return None;
        }
        let DataType::Timestamp(unit, _) = f.return_type() else {
            return None;
        };
        let stride = f
            .args()
            .first()?
            .downcast_ref::<datafusion::physical_expr::expressions::Literal>()?;
        const DAY_NS: i64 = 86_400_000_000_000;
        let ns = match stride.value() {
            ScalarValue::IntervalMonthDayNano(Some(v)) if v.months == 0 => {
                i64::from(v.days) * DAY_NS + v.nanoseconds
            }
            ScalarValue::IntervalDayTime(Some(v)) => {
                i64::from(v.days) * DAY_NS + i64::from(v.milliseconds) * 1_000_000
            }
            _ => return None,
        };
        let width = match unit {
            TimeUnit::Second => ns / 1_000_000_000,
            TimeUnit::Millisecond => ns / 1_000_000,
            TimeUnit::Microsecond => ns / 1_000,
            TimeUnit::Nanosecond => ns,
        };
        (width > 0).then_some((i, *unit, width))
    })
}

/// `states` (partial states, the group keys first, the session window
/// key at `window` among the `keys`) with each session replaced by the
/// union of the sessions of its group it overlaps, directly or through
/// others: `[0, 5)`, `[3, 8)` and `[8, 9)` of one group become `[0, 8)`,
/// `[0, 8)` and `[8, 9)`. Aggregating the result by its keys merges the
/// states of each union.
fn merge_sessions(states: &RecordBatch, window: usize, keys: usize) -> DfResult<RecordBatch> {
    let column = states.column(window);
    let starts = window_bounds(column, 0)?;
    let ends = window_bounds(column, 1)?;
    let others: Vec<ArrayRef> = (0..keys)
        .filter(|&k| k != window)
        .map(|k| states.column(k).clone())
        .collect();
    let groups = if others.is_empty() {
        None
    } else {
        let converter = arrow::row::RowConverter::new(
            others
                .iter()
                .map(|c| arrow::row::SortField::new(c.data_type().clone()))
                .collect(),
        )?;
        Some(converter.convert_columns(&others)?)
    };
    // NULL windows (no event time) were filtered out before; keep any
    // as they are.
    let mut order: Vec<usize> = (0..states.num_rows())
        .filter(|&i| starts.is_valid(i) && ends.is_valid(i))
        .collect();
    order.sort_by(|&a, &b| {
        let by_group = match &groups {
            Some(g) => g.row(a).cmp(&g.row(b)),
            None => std::cmp::Ordering::Equal,
        };
        by_group.then(starts.value(a).cmp(&starts.value(b)))
    });
    let mut new_start: Vec<Option<i64>> = starts.iter().collect();
    let mut new_end: Vec<Option<i64>> = ends.iter().collect();
    let mut run: Vec<usize> = Vec::new();
    let mut run_end = i64::MIN;
    let mut flush = |run: &mut Vec<usize>, end: i64| {
        if let Some(&first) = run.first() {
            let start = starts.value(first);
            for &i in run.iter() {
                new_start[i] = Some(start);
                new_end[i] = Some(end);
            }
        }
        run.clear();
    };
    for &i in &order {
        let same_group = match (&groups, run.last()) {
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(g), Some(&last)) => g.row(i) == g.row(last),
        };
        if !(same_group && starts.value(i) < run_end) {
            flush(&mut run, run_end);
            run_end = i64::MIN;
        }
        run.push(i);
        run_end = run_end.max(ends.value(i));
    }
    flush(&mut run, run_end);
    let s = column.as_struct();
    let typed = |v: Vec<Option<i64>>, field: usize| -> DfResult<ArrayRef> {
        let a: ArrayRef = Arc::new(arrow::array::Int64Array::from(v));
        Ok(cast(&a, s.column(field).data_type())?)
    };
    let merged = arrow::array::StructArray::try_new(
        s.fields().clone(),
        vec![typed(new_start, 0)?, typed(new_end, 1)?],
        s.nulls().cloned(),
    )?;
    let mut columns = states.columns().to_vec();
    columns[window] = Arc::new(merged);
    Ok(RecordBatch::try_new(states.schema(), columns)?)
}

fn event_time_max(meta: &serde_json::Value) -> BTreeMap<String, i64> {
    meta.get("event_time_max_ms")
        .and_then(|m| serde_json::from_value(m.clone()).ok())
        .unwrap_or_default()
}

/// Groups a merge takes at once (see [`key_slices`]).
const MERGE_SLICE: usize = 16_384;

/// The rows of `batch` split into slices of about `slice` rows by a hash
/// of its first `keys` columns, so rows of one key share a slice; `None`
/// (the whole batch, one slice) when it is no larger than `slice`.
fn key_slices(
    batch: &RecordBatch,
    keys: usize,
    slice: usize,
) -> DfResult<Vec<Option<arrow::array::UInt32Array>>> {
    let n = batch.num_rows();
    if n <= slice {
        return Ok(vec![None]);
    }
    let count = n.div_ceil(slice);
    let mut hashes = vec![0u64; n];
    let state = datafusion::common::hash_utils::RandomState::with_seed(0);
    datafusion::common::hash_utils::create_hashes(&batch.columns()[..keys], &state, &mut hashes)?;
    let mut rows: Vec<Vec<u32>> = vec![Vec::with_capacity(slice + slice / 4); count];
    for (i, h) in hashes.iter().enumerate() {
        rows[(h % count as u64) as usize].push(i as u32);
    }
    Ok(rows
        .into_iter()
        .filter(|r| !r.is_empty())
        .map(|r| Some(arrow::array::UInt32Array::from(r)))
        .collect())
}

/// Batches of `schema` with the columns of `batches` (the same types;
/// field names and nullability may differ), the empty ones left out.
fn rebatch(schema: &SchemaRef, batches: Vec<RecordBatch>) -> DfResult<Vec<RecordBatch>> {
    batches
        .into_iter()
        .filter(|b| b.num_rows() > 0)
        .map(|b| {
            RecordBatch::try_new(schema.clone(), b.columns().to_vec())
                .map_err(DataFusionError::from)
        })
        .collect()
}

/// `raw` without the rows whose eviction time (of the key `evict`, its
/// expression `window` evaluated on them) is at or before `threshold`
/// (counted in `dropped`) or NULL (counted in `no_time`).
fn late_filter(
    raw: Arc<dyn ExecutionPlan>,
    evict: Evict,
    window: Arc<dyn PhysicalExpr>,
    threshold: Option<i64>,
    dropped: Arc<AtomicU64>,
    no_time: Arc<AtomicU64>,
    ctx: Arc<TaskContext>,
) -> DfResult<Arc<dyn ExecutionPlan>> {
    let schema = raw.schema();
    let mut partitions: Vec<Arc<dyn PartitionStream>> = Vec::new();
    for i in 0..raw.output_partitioning().partition_count() {
        let input = raw.execute(i, ctx.clone())?;
        let (window, dropped, no_time) = (window.clone(), dropped.clone(), no_time.clone());
        let stream = input.map(move |batch| {
            let batch = batch?;
            let windows = window.evaluate(&batch)?.into_array(batch.num_rows())?;
            let mut late = 0;
            let mut missing = 0;
            let keep: BooleanArray = evict
                .late(&windows, threshold)?
                .into_iter()
                .map(|l| {
                    Some(match l {
                        None => {
                            missing += 1;
                            false
                        }
                        Some(true) => {
                            late += 1;
                            false
                        }
                        Some(false) => true,
                    })
                })
                .collect();
            dropped.fetch_add(late, Ordering::Relaxed);
            no_time.fetch_add(missing, Ordering::Relaxed);
            if late + missing == 0 {
                return Ok(batch);
            }
            Ok(filter_record_batch(&batch, &keep)?)
        });
        partitions.push(Arc::new(Once {
            schema: schema.clone(),
            stream: std::sync::Mutex::new(Some(Box::pin(RecordBatchStreamAdapter::new(
                schema.clone(),
                stream,
            )))),
        }));
    }
    if partitions.is_empty() {
        partitions.push(Arc::new(Once {
            schema: schema.clone(),
            stream: std::sync::Mutex::new(Some(Box::pin(RecordBatchStreamAdapter::new(
                schema.clone(),
                futures::stream::empty(),
            )))),
        }));
    }
    Ok(Arc::new(StreamingTableExec::try_new(
        schema,
        partitions,
        None,
        Vec::new(),
        false,
        None,
    )?))
}

/// A stream that is executed once.
struct Once {
    schema: SchemaRef,
    stream: std::sync::Mutex<Option<SendableRecordBatchStream>>,
}

impl std::fmt::Debug for Once {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Once")
    }
}

impl PartitionStream for Once {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        match self.stream.lock().expect("partition lock").take() {
            Some(s) => s,
            None => Box::pin(RecordBatchStreamAdapter::new(
                self.schema.clone(),
                futures::stream::once(async {
                    Err(DataFusionError::Internal(
                        "a stateful partition was executed twice".into(),
                    ))
                }),
            )),
        }
    }
}

#[cfg(test)]
mod tests;
