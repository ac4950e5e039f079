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

impl StatefulAggregate {
    /// The stateful aggregation of a query whose batch plans look like
    /// `plan`, keeping its state under the checkpoint at `checkpoint`.
    /// `distinct_on`: the aggregation is a `DISTINCT ON`'s (`first_value`
    /// of each column per key), a deduplication that keeps each key's
    /// first row. `None` when the plan has no aggregation.
    pub(crate) fn new(
        plan: &Arc<dyn ExecutionPlan>,
        checkpoint: &Location,
        mode: OutputMode,
        event_times: BTreeMap<String, EventTime>,
        distinct_on: bool,
    ) -> Result<Option<Self>> {
        let Some(found) = find(plan).map_err(|e| Error::Plan(Box::new(e)))? else {
            return Ok(None);
        };
        let schema = found
            .partial(found.raw.clone())
            .map_err(|e| Error::Plan(Box::new(e)))?
            .schema();
        let keys = found.group_by.expr().len();
        let session = found.window.as_ref().and_then(|w| w.3.then_some(w.0));
        let dedup = (found.aggr.is_empty() || distinct_on) && session.is_none();
        let operator = match (dedup, session) {
            (true, _) => "dedup",
            (false, Some(_)) => "session",
            (false, None) => "aggregate",
        };
        let mut store = StateStore::new(checkpoint.clone(), operator, schema, keys)?;
        if let Some(window) = session {
            // A group's sessions are found by its keys without the window.
            store = store.with_index((0..keys).filter(|&k| k != window).collect())?;
        }
        let evict = match &found.window {
            Some((index, _, unit, session)) => Some(Evict {
                index: *index,
                input: EvictInput::Key(*index),
                unit: *unit,
                kind: if *session {
                    EvictKind::Session
                } else {
                    EvictKind::Window
                },
            }),
            // `date_bin(stride, ts)`: a tumbling window named by its start.
            None if !dedup => date_bin_key(&found.group_by).map(|(index, unit, width)| Evict {
                index,
                input: EvictInput::Key(index),
                unit,
                kind: EvictKind::Time(width),
            }),
            // A deduplication keyed by a stream's event time forgets a key
            // once the watermark passes its time.
            None if dedup => found
                .group_by
                .expr()
                .iter()
                .enumerate()
                .find_map(|(index, (e, _))| {
                    let c = e.downcast_ref::<Column>()?;
                    if !event_times.values().any(|et| et.column == c.name()) {
                        return None;
                    }
                    match e.data_type(&found.input_schema).ok()? {
                        DataType::Timestamp(unit, _) => Some(Evict {
                            index,
                            input: EvictInput::Key(index),
                            unit,
                            kind: EvictKind::Time(0),
                        }),
                        _ => None,
                    }
                })
                .or_else(|| {
                    if distinct_on {
                        distinct_on_expiry(&found, &event_times)
                    } else {
                        None
                    }
                }),
            None => None,
        };
        if evict.is_some_and(|e| matches!(e.kind, EvictKind::Expire(_))) {
            // A key's bucket comes from its first row: found by the key.
            store = store.with_index((0..keys).collect())?;
        }
        Ok(Some(Self {
            store: tokio::sync::Mutex::new(store),
            evict,
            dedup,
            mode,
            event_times,
            keys: Vec::new(),
            replace_keys: None,
        }))
    }

    /// Merge update-mode output into the table by these output columns.
    pub(crate) fn set_keys(&mut self, keys: Vec<String>) {
        self.keys = keys;
    }

    /// Complete-mode output names its rows by these output columns.
    pub(crate) fn set_replace_keys(&mut self, keys: Option<Vec<String>>) {
        self.replace_keys = keys;
    }

    /// How the aggregation's output changes the table.
    pub(crate) fn write_mode(&self) -> lakestream_sink::WriteMode {
        match self.mode {
            OutputMode::Complete => lakestream_sink::WriteMode::ReplaceAll {
                keys: self.replace_keys.clone(),
            },
            OutputMode::Update => lakestream_sink::WriteMode::Upsert {
                keys: self.keys.clone(),
            },
            OutputMode::Append => lakestream_sink::WriteMode::Append,
        }
    }

    /// True when the aggregation groups by an event-time window.
    pub(crate) fn is_windowed(&self) -> bool {
        self.evict.is_some_and(|e| e.is_window())
    }

    /// True when the aggregation groups by a session window.
    pub(crate) fn is_session(&self) -> bool {
        self.evict.is_some_and(|e| e.kind == EvictKind::Session)
    }

    /// True for a deduplication (no aggregate functions): each group is
    /// written once, when first seen.
    pub(crate) fn is_dedup(&self) -> bool {
        self.dedup
    }

    /// The event-time column per source name.
    pub(crate) fn event_times(&self) -> &BTreeMap<String, EventTime> {
        &self.event_times
    }

    /// The watermark for the batch after `last` (`None`: before the first
    /// batch), given the watermark `prev` that batch `last` ran with.
    pub(crate) async fn next_watermark(
        &self,
        last: Option<u64>,
        prev: Option<i64>,
    ) -> Result<Option<i64>> {
        let mut store = self.store.lock().await;
        if !store.is_at(last) {
            store.load(last).await?;
        }
        let seen = event_time_max(store.meta());
        let candidate = self
            .event_times
            .iter()
            .filter_map(|(source, et)| {
                let max = seen.get(source)?;
                Some(max.saturating_sub(et.delay.as_millis() as i64))
            })
            .min();
        Ok(match (prev, candidate) {
            (Some(p), Some(c)) => Some(p.max(c)),
            (p, c) => p.or(c),
        })
    }

    /// True when a batch without new input would emit rows: in `append`
    /// mode, some window held ends at or before `watermark`.
    pub(crate) async fn has_output_at(&self, watermark: Option<i64>) -> bool {
        let (Some(evict), Some(w), OutputMode::Append, false) =
            (self.evict, watermark, self.mode, self.dedup)
        else {
            return false;
        };
        let unit = evict.unit;
        let store = self.store.lock().await;
        store
            .first_bucket()
            .is_some_and(|b| b <= window::ms_in(unit, w))
    }

    /// Run the aggregation of batch `batch_id` (watermark `watermark_ms`):
    /// returns `plan` with the aggregation replaced by the batch's output
    /// groups, after committing the state as of this batch.
    pub(crate) async fn run(
        &self,
        batch_id: u64,
        watermark_ms: Option<i64>,
        plan: Arc<dyn ExecutionPlan>,
        ctx: Arc<TaskContext>,
        scans: &BatchScans,
    ) -> Result<(Arc<dyn ExecutionPlan>, StateProgress)> {
        let df = |e: DataFusionError| Error::Execution {
            batch_id,
            source: Box::new(e),
        };
        let found = find(&plan).map_err(df)?.ok_or_else(|| {
            Error::Internal(format!(
                "batch {batch_id}: the aggregation is gone from the plan"
            ))
        })?;
        let mut store = self.store.lock().await;
        let prev = lakestream_protocol::state_base(batch_id);
        if !store.is_at(prev) {
            store.load(prev).await?;
        }
        let schema = store.schema().clone();
        // Complete mode keeps every group (and so takes late rows too).
        let threshold = match (self.evict, watermark_ms, self.mode) {
            (_, _, OutputMode::Complete) => None,
            (Some(e), Some(w), _) => Some(window::ms_in(e.unit, w)),
            _ => None,
        };
        let dropped = Arc::new(AtomicU64::new(0));
        let no_time = Arc::new(AtomicU64::new(0));
        let raw = match self.evict {
            Some(evict) => late_filter(
                found.raw.clone(),
                evict,
                match evict.input {
                    EvictInput::Key(i) => found.group_by.expr()[i].0.clone(),
                    EvictInput::Aggregate(j) => found.aggr[j].expressions()[0].clone(),
                },
                threshold,
                dropped.clone(),
                no_time.clone(),
                ctx.clone(),
            )
            .map_err(df)?,
            None => found.raw.clone(),
        };
        let partial = found.partial(raw).map_err(df)?;
        let parts = collect(Arc::new(partial), ctx.clone()).await.map_err(df)?;
        let mut progress = StateProgress {
            operator: store.operator().to_string(),
            ..Default::default()
        };
        let parts = rebatch(&schema, parts).map_err(df)?;
        let mut changed: Vec<RecordBatch> = Vec::new();
        if !parts.is_empty() {
            let new = concat_batches(&schema, &parts).map_err(|e| df(e.into()))?;
            drop(parts); // only `new` is needed from here: half the memory
            let session = self.evict.filter(|e| e.kind == EvictKind::Session);
            // A batch touching many groups merges them a slice of keys at a
            // time (each key in one slice), so what the merge holds at once
            // (DataFusion's hash table, the stored states looked up, the
            // merged rows) is bounded by the slice, not by the batch.
            let keys = found.group_by.expr().len();
            let slices = match session {
                Some(_) => vec![None],
                None => key_slices(&new, keys, MERGE_SLICE).map_err(df)?,
            };
            for slice in slices {
                let new = match slice {
                    None => new.clone(),
                    Some(rows) => {
                        arrow::compute::take_record_batch(&new, &rows).map_err(|e| df(e.into()))?
                    }
                };
                // What to merge: the batch's states and the stored ones of the
                // same groups. A session window's stored sessions of those
                // groups are merged with the batch's where they overlap, and
                // the merged sessions replace them.
                let (input, replaced) = match session {
                    Some(evict) => {
                        let old = store.lookup_indexed(&new)?;
                        let mut all = vec![new];
                        all.extend(old.as_ref().map(|(o, _)| o.clone()));
                        let all = concat_batches(&schema, &all).map_err(|e| df(e.into()))?;
                        let all = merge_sessions(&all, evict.index, keys).map_err(df)?;
                        (vec![all], old)
                    }
                    None => {
                        let buckets = self.buckets(&store, &new, batch_id)?;
                        let old = store.lookup(&new, &buckets)?;
                        (std::iter::once(new).chain(old).collect(), None)
                    }
                };
                let merge = found
                    .over_states(AggregateMode::PartialReduce, input, &schema)
                    .map_err(df)?;
                let merged = rebatch(
                    &schema,
                    collect(Arc::new(merge), ctx.clone()).await.map_err(df)?,
                )
                .map_err(df)?;
                if let Some((o, buckets)) = replaced {
                    store.remove_keys(&o, &buckets)?;
                }
                // Each merged batch is dropped once upserted: a batch opening
                // many groups holds them once in Arrow form, not again until
                // the commit (append and complete modes keep nothing).
                for b in merged {
                    let buckets = self.buckets(&store, &b, batch_id)?;
                    if self.dedup {
                        // Only keys not seen before are new output.
                        let seen = store.contains(&b, &buckets)?;
                        let fresh: BooleanArray = seen.iter().map(|s| Some(!s)).collect();
                        let fresh = filter_record_batch(&b, &fresh).map_err(|e| df(e.into()))?;
                        if fresh.num_rows() > 0 {
                            changed.push(fresh);
                        }
                    } else if self.mode == OutputMode::Update {
                        changed.push(b.clone());
                    }
                    progress.rows_updated += b.num_rows() as u64;
                    store.upsert(&b, &buckets)?;
                }
            }
        }
        let finished = if self.dedup || self.mode == OutputMode::Update {
            // The groups this batch changed (a deduplication's: the keys it
            // saw first) are the output; a group the watermark passed was
            // written when it last changed, and goes without output.
            if let Some(t) = threshold
                && let Some(gone) = store.evict_through(t)?
            {
                progress.rows_evicted = gone.num_rows() as u64;
            }
            match changed.as_slice() {
                [] => None,
                batches => Some(concat_batches(&schema, batches).map_err(|e| df(e.into()))?),
            }
        } else {
            match (self.mode, threshold) {
                (OutputMode::Complete, _) => store.all()?,
                (_, Some(t)) => store.evict_through(t)?,
                (_, None) => None,
            }
        };
        let top_schema = found.top.schema();
        let mut out = Vec::new();
        if let Some(states) = finished {
            if self.mode == OutputMode::Append && !self.dedup {
                progress.rows_evicted = states.num_rows() as u64;
            }
            let fin = found
                .over_states(AggregateMode::Final, vec![states], &schema)
                .map_err(df)?;
            out =
                rebatch(&top_schema, collect(Arc::new(fin), ctx).await.map_err(df)?).map_err(df)?;
        }
        let mut seen = event_time_max(store.meta());
        for source in self.event_times.keys() {
            if let Some(max) = scans.event_time_max_ms(source) {
                let e = seen.entry(source.clone()).or_insert(max);
                *e = (*e).max(max);
            }
        }
        store
            .commit(batch_id, serde_json::json!({ "event_time_max_ms": seen }))
            .await?;
        progress.rows = store.rows();
        progress.bytes = store.bytes();
        progress.memory_bytes = store.memory();
        progress.rows_dropped_by_watermark = dropped.load(Ordering::Relaxed);
        progress.rows_without_event_time = no_time.load(Ordering::Relaxed);
        drop(store);

        let leaf: Arc<dyn ExecutionPlan> =
            MemorySourceConfig::try_new_exec(&[out], top_schema, None).map_err(df)?;
        let top = found.top.clone();
        let plan = plan
            .transform_down(|node| {
                Ok(if Arc::ptr_eq(&node, &top) {
                    Transformed::new(leaf.clone(), true, TreeNodeRecursion::Jump)
                } else {
                    Transformed::no(node)
                })
            })
            .map_err(df)?
            .data;
        Ok((plan, progress))
    }

    /// Wait for the state snapshot being written in the background, if
    /// any (a failed one is logged: a restart reads more deltas).
    pub(crate) async fn wait_for_snapshot(&self) {
        let mut store = self.store.lock().await;
        if let Err(e) = store.wait_for_snapshot().await {
            tracing::warn!("{e} (a restart reads more state deltas)");
        }
    }

    /// Remove the state files no restart can need once batches before
    /// `keep_from` are never replayed.
    pub(crate) async fn purge_before(&self, keep_from: u64) -> Result<usize> {
        Ok(self.store.lock().await.purge_before(keep_from).await?)
    }

    /// The bucket of each row of `states`: its eviction time (a window's
    /// end, a deduplicated event time), or `i64::MAX` (never evicted). A
    /// `DISTINCT ON` key expiring by its first row's time stays in the
    /// bucket it is held in (a later row's time does not move it).
    fn buckets(&self, store: &StateStore, states: &RecordBatch, batch_id: u64) -> Result<Vec<i64>> {
        let Some(evict) = self.evict else {
            return Ok(vec![i64::MAX; states.num_rows()]);
        };
        let times = evict
            .times(states.column(evict.index))
            .map_err(|e| Error::Execution {
                batch_id,
                source: Box::new(e),
            })?;
        let mut buckets: Vec<i64> = times.iter().map(|e| e.unwrap_or(i64::MAX)).collect();
        if matches!(evict.kind, EvictKind::Expire(_)) {
            for (b, held) in buckets.iter_mut().zip(store.held_buckets(states)?) {
                if let Some(held) = held {
                    *b = held;
                }
            }
        }
        Ok(buckets)
    }
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
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray, StructArray};
    use arrow::datatypes::{Field, Schema};

    /// A batch larger than a slice is cut into slices that hold every row
    /// once, every row of a key in the same slice, none much over the size.
    #[test]
    fn key_slices_keep_each_key_in_one_slice_and_every_row_once() {
        let n = 10_000i64;
        // Two key columns: 2,500 keys, each on four rows spread apart.
        let a: Int64Array = (0..n).map(|i| Some(i % 2_500)).collect();
        let b: StringArray = (0..n)
            .map(|i| Some(format!("k{}", i % 2_500 % 7)))
            .collect();
        let v: Int64Array = (0..n).map(Some).collect();
        let schema = Arc::new(Schema::new(vec![
            Field::new("a", DataType::Int64, true),
            Field::new("b", DataType::Utf8, true),
            Field::new("v", DataType::Int64, true),
        ]));
        let batch =
            RecordBatch::try_new(schema, vec![Arc::new(a), Arc::new(b), Arc::new(v)]).unwrap();
        assert_eq!(key_slices(&batch, 2, n as usize).unwrap(), vec![None]);
        let slices = key_slices(&batch, 2, 1_000).unwrap();
        assert!(slices.len() >= 8, "{} slices", slices.len());
        let mut slice_of_key = std::collections::HashMap::new();
        let mut seen = vec![false; n as usize];
        for (s, rows) in slices.iter().enumerate() {
            let rows = rows.as_ref().expect("a slice of rows");
            assert!(rows.len() <= 2_000, "slice {s}: {} rows", rows.len());
            for &r in rows.values() {
                assert!(!seen[r as usize], "row {r} twice");
                seen[r as usize] = true;
                let key = r as i64 % 2_500;
                assert_eq!(*slice_of_key.entry(key).or_insert(s), s, "key {key}");
            }
        }
        assert!(seen.iter().all(|&s| s), "every row in a slice");
    }

    /// Sessions of two users, `[start, end)` in seconds, merged where they
    /// overlap, directly or through a third; touching sessions stay apart.
    #[test]
    fn overlapping_sessions_of_a_group_merge_into_their_union() {
        let rows = [
            ("a", 0, 5),
            ("a", 8, 9),
            ("b", 1, 4),
            ("a", 3, 8),
            ("a", 9, 12),
            ("a", 20, 25),
            ("b", 3, 6),
        ];
        let window = window::window_type(TimeUnit::Second, None);
        let DataType::Struct(fields) = window.clone() else {
            unreachable!()
        };
        let ts = |v: Vec<i64>| {
            cast(
                &(Arc::new(Int64Array::from(v)) as ArrayRef),
                &fields[0].data_type().clone(),
            )
            .unwrap()
        };
        let windows = StructArray::try_new(
            fields.clone(),
            vec![
                ts(rows.iter().map(|r| r.1).collect()),
                ts(rows.iter().map(|r| r.2).collect()),
            ],
            None,
        )
        .unwrap();
        let schema = Arc::new(Schema::new(vec![
            Field::new("user", DataType::Utf8, true),
            Field::new("window", window, true),
            Field::new("n", DataType::Int64, true),
        ]));
        let batch = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.0))),
                Arc::new(windows),
                Arc::new(Int64Array::from_iter_values(0..rows.len() as i64)),
            ],
        )
        .unwrap();
        let merged = merge_sessions(&batch, 1, 2).unwrap();
        let starts = window_bounds(merged.column(1), 0).unwrap();
        let ends = window_bounds(merged.column(1), 1).unwrap();
        let got: Vec<(i64, i64)> = (0..rows.len())
            .map(|i| (starts.value(i), ends.value(i)))
            .collect();
        assert_eq!(
            got,
            [(0, 8), (8, 9), (1, 6), (0, 8), (9, 12), (20, 25), (1, 6)]
        );
        // The value columns and the group keys are untouched.
        assert_eq!(merged.column(0), batch.column(0));
        assert_eq!(merged.column(2), batch.column(2));
    }
}
