//! Building, starting and driving a streaming query.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use arrow::datatypes::SchemaRef;
use datafusion::dataframe::DataFrame;
use datafusion::datasource::TableProvider;
use datafusion::logical_expr::LogicalPlan;
use datafusion::physical_plan::execute_stream_partitioned;
use datafusion::prelude::{SessionConfig, SessionContext};
use futures::StreamExt;
use lakestream_checkpoint::{
    Checkpoint, CommitEntry, OffsetsEntry, QueryRecord, RecordedSource, SourceRange, now_ms,
};
use lakestream_sink::{CommitInfo, CommitOutcome, Sink};
use lakestream_source::Source;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::progress::{BatchProgress, Durations, SourceProgress};
use crate::provider::{BatchRange, BatchScans, MicroBatchTable, source_failure};
use crate::{Error, FailPoint, Result, Trigger};
use datafusion::error::DataFusionError;

/// The query text or plan, as given to the builder.
enum QuerySpec {
    Sql(String),
    Plan(LogicalPlan),
}

/// Default of [`QueryBuilder::snapshot_interval`].
pub const DEFAULT_SNAPSHOT_INTERVAL: u64 = 100;

/// Default of [`QueryBuilder::min_batches_to_retain`].
pub const DEFAULT_MIN_BATCHES_TO_RETAIN: u64 = 100;

/// Progress events a [`QueryHandle`] keeps for a reader of
/// [`QueryHandle::take_progress_events`] that falls behind (or never
/// reads); later events are dropped until it catches up.
pub const PROGRESS_EVENTS_BUFFER: usize = 1024;

/// Builds a streaming query: sources, a query, a sink, a checkpoint, a
/// trigger.
///
/// ```no_run
/// # async fn demo() -> lakestream_engine::Result<()> {
/// use std::sync::Arc;
/// use lakestream_engine::{QueryBuilder, Trigger};
/// use lakestream_engine::source::generator::{GeneratorOptions, GeneratorSource};
/// use lakestream_engine::sink::delta::{DeltaSink, DeltaSinkOptions};
///
/// let events = Arc::new(GeneratorSource::try_new("events", GeneratorOptions::default())?);
/// let sink = Arc::new(DeltaSink::try_new("target/out", DeltaSinkOptions::default())?);
/// let summary = QueryBuilder::new()
///     .source(events)?
///     .sql("SELECT event_id, amount FROM events WHERE amount > 0")
///     .sink(sink)
///     .checkpoint("target/out/_checkpoint")
///     .trigger(Trigger::AvailableNow)
///     .run()
///     .await?;
/// println!("{} batches", summary.batches);
/// # Ok(()) }
/// ```
pub struct QueryBuilder {
    ctx: SessionContext,
    tables: Vec<Arc<MicroBatchTable>>,
    query: Option<QuerySpec>,
    output_columns: Vec<String>,
    sink: Option<Arc<dyn Sink>>,
    checkpoint: Option<String>,
    checkpoint_options: HashMap<String, String>,
    trigger: Trigger,
    poll: Duration,
    snapshot_interval: u64,
    min_batches_to_retain: u64,
    fail_point: Option<(FailPoint, u64)>,
    job: Option<lakestream_job::Job>,
}

impl Default for QueryBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl QueryBuilder {
    /// A builder with a fresh DataFusion session.
    pub fn new() -> Self {
        let mut config = SessionConfig::new().with_information_schema(true);
        config.options_mut().sql_parser.collect_spans = true;
        Self::with_context(SessionContext::new_with_config(config))
    }

    /// A builder on an existing DataFusion session (its functions, settings
    /// and tables are visible to the query).
    pub fn with_context(ctx: SessionContext) -> Self {
        Self {
            ctx,
            tables: Vec::new(),
            query: None,
            output_columns: Vec::new(),
            sink: None,
            checkpoint: None,
            checkpoint_options: HashMap::new(),
            trigger: Trigger::Continuous,
            poll: Duration::from_millis(200),
            snapshot_interval: DEFAULT_SNAPSHOT_INTERVAL,
            min_batches_to_retain: DEFAULT_MIN_BATCHES_TO_RETAIN,
            fail_point: None,
            job: None,
        }
    }

    /// The DataFusion session: register UDFs or build a [`DataFrame`] over
    /// the sources added so far.
    pub fn context(&self) -> &SessionContext {
        &self.ctx
    }

    /// Add a streaming source, registered as a table under its name.
    pub fn source(mut self, source: Arc<dyn Source>) -> Result<Self> {
        let partitions = self.ctx.copied_config().target_partitions();
        let table = Arc::new(MicroBatchTable::new(source.clone(), partitions));
        self.ctx
            .register_table(source.name(), table.clone())
            .map_err(|e| Error::Plan(Box::new(e)))?;
        self.tables.push(table);
        Ok(self)
    }

    /// Add a static table (read in every batch, never tracked in offsets).
    pub fn static_table(self, name: &str, table: Arc<dyn TableProvider>) -> Result<Self> {
        self.ctx
            .register_table(name, table)
            .map_err(|e| Error::Plan(Box::new(e)))?;
        Ok(self)
    }

    /// The query to run over each batch, as SQL.
    pub fn sql(mut self, sql: impl Into<String>) -> Self {
        self.query = Some(QuerySpec::Sql(sql.into()));
        self
    }

    /// The query to run over each batch, as a DataFrame built on
    /// [`QueryBuilder::context`].
    pub fn dataframe(mut self, df: DataFrame) -> Self {
        self.query = Some(QuerySpec::Plan(df.into_unoptimized_plan()));
        self
    }

    /// Rename the output columns in order (an `INSERT INTO t (a, b)` list).
    pub fn output_columns(mut self, columns: Vec<String>) -> Self {
        self.output_columns = columns;
        self
    }

    /// Where each batch's output goes.
    pub fn sink(mut self, sink: Arc<dyn Sink>) -> Self {
        self.sink = Some(sink);
        self
    }

    /// The checkpoint location (path or URL).
    pub fn checkpoint(mut self, location: impl Into<String>) -> Self {
        self.checkpoint = Some(location.into());
        self
    }

    /// Storage options for the checkpoint location.
    pub fn checkpoint_options(mut self, options: HashMap<String, String>) -> Self {
        self.checkpoint_options = options;
        self
    }

    /// When batches run (default [`Trigger::Continuous`]).
    pub fn trigger(mut self, trigger: Trigger) -> Self {
        self.trigger = trigger;
        self
    }

    /// How often an idle continuous query looks for new data (default 200 ms).
    pub fn poll_interval(mut self, poll: Duration) -> Self {
        self.poll = poll;
        self
    }

    /// Store the sources' summaries ([`Source::snapshot`]) in the checkpoint
    /// every `n` batches (default [`DEFAULT_SNAPSHOT_INTERVAL`]), so a
    /// restart reads the latest summary and the batches after it rather
    /// than every batch ever planned.
    pub fn snapshot_interval(mut self, n: u64) -> Self {
        self.snapshot_interval = n.max(1);
        self
    }

    /// Keep at least the newest `n` batches' `offsets/N` and `commits/N`
    /// (default [`DEFAULT_MIN_BATCHES_TO_RETAIN`]); older ones are removed
    /// once the sources' snapshots cover them, so the checkpoint, and the
    /// cost of a restart, stay bounded however long the query runs.
    pub fn min_batches_to_retain(mut self, n: u64) -> Self {
        self.min_batches_to_retain = n.max(1);
        self
    }

    /// Stop with [`Error::InjectedFault`] at `point` of batch `batch_id`,
    /// leaving everything written so far in place, as a crash would. For
    /// crash tests.
    #[doc(hidden)]
    pub fn fail_point(mut self, point: FailPoint, batch_id: u64) -> Self {
        self.fail_point = Some((point, batch_id));
        self
    }

    pub(crate) fn logical_plan(mut self, plan: LogicalPlan) -> Self {
        self.query = Some(QuerySpec::Plan(plan));
        self
    }

    pub(crate) fn with_job(mut self, job: lakestream_job::Job) -> Self {
        self.job = Some(job);
        self
    }

    /// Plan and check the query, open the checkpoint (taking its fence) and
    /// the sink, then run batches in the background.
    pub async fn start(self) -> Result<QueryHandle> {
        let driver = self.prepare().await?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let (latest_tx, latest_rx) = watch::channel(None);
        let (events_tx, events_rx) = mpsc::channel(PROGRESS_EVENTS_BUFFER);
        let query_id = driver.ckpt.query_id().to_string();
        let join = tokio::spawn(driver.run(stop_rx, latest_tx, events_tx));
        Ok(QueryHandle {
            query_id,
            stop: stop_tx,
            latest: latest_rx,
            events: Some(events_rx),
            join,
        })
    }

    /// [`QueryBuilder::start`] and wait for the query to end.
    pub async fn run(self) -> Result<QuerySummary> {
        self.start().await?.await_termination().await
    }

    async fn prepare(self) -> Result<Driver> {
        let sink = self
            .sink
            .ok_or_else(|| Error::InvalidQuery("the query has no sink".into()))?;
        let checkpoint = self
            .checkpoint
            .ok_or_else(|| Error::InvalidQuery("the query has no checkpoint location".into()))?;
        if self.tables.is_empty() {
            return Err(Error::InvalidQuery(
                "the query has no streaming source".into(),
            ));
        }
        let plan = match self.query {
            None => {
                return Err(Error::InvalidQuery(
                    "the query has no SQL or DataFrame".into(),
                ));
            }
            Some(QuerySpec::Plan(p)) => p,
            Some(QuerySpec::Sql(sql)) => {
                let state = self.ctx.state();
                let stmt = state
                    .sql_to_statement(&sql, &datafusion::config::Dialect::Generic)
                    .map_err(|e| Error::Plan(Box::new(e)))?;
                state
                    .statement_to_plan(stmt)
                    .await
                    .map_err(|e| Error::Plan(Box::new(e)))?
            }
        };
        let plan = if self.output_columns.is_empty() {
            plan
        } else {
            rename_output(plan, &self.output_columns)?
        };
        let names: Vec<String> = self
            .tables
            .iter()
            .map(|t| t.source().name().to_string())
            .collect();
        let is_stream = |n: &str| names.iter().any(|s| s.eq_ignore_ascii_case(n));
        if let Some(job) = &self.job {
            lakestream_job::check_streaming_plan(job, &plan, &is_stream)?;
        } else if let Some(problem) = lakestream_job::streaming_plan_problem(&plan, &is_stream) {
            return Err(Error::InvalidQuery(problem));
        }
        let output_schema: SchemaRef = Arc::new(plan.schema().as_arrow().clone());
        let ckpt = Checkpoint::open(&checkpoint, &self.checkpoint_options).await?;
        // Before the sink creates anything: a checkpoint of another query
        // would apply its offsets to input they do not describe.
        let record = QueryRecord::new(
            self.tables
                .iter()
                .map(|t| {
                    let id = t.source().identity();
                    (
                        t.source().name().to_string(),
                        RecordedSource {
                            kind: id.kind,
                            location: id.location,
                        },
                    )
                })
                .collect(),
            sink.identity(),
        );
        ckpt.check_query(&record).await?;
        sink.open(output_schema).await?;
        Ok(Driver {
            ctx: self.ctx,
            tables: self.tables,
            plan,
            sink,
            ckpt,
            trigger: self.trigger,
            poll: self.poll,
            snapshot_interval: self.snapshot_interval,
            min_batches_to_retain: self.min_batches_to_retain,
            fail_point: self.fail_point,
        })
    }
}

fn rename_output(plan: LogicalPlan, columns: &[String]) -> Result<LogicalPlan> {
    use datafusion::logical_expr::{LogicalPlanBuilder, col};
    let fields = plan.schema().columns();
    if fields.len() != columns.len() {
        return Err(Error::InvalidQuery(format!(
            "the INSERT names {} columns but the query produces {}",
            columns.len(),
            fields.len()
        )));
    }
    let exprs: Vec<_> = fields
        .into_iter()
        .zip(columns)
        .map(|(c, name)| col(c).alias(name))
        .collect();
    LogicalPlanBuilder::from(plan)
        .project(exprs)
        .and_then(|b| b.build())
        .map_err(|e| Error::Plan(Box::new(e)))
}

/// A running query.
pub struct QueryHandle {
    query_id: String,
    stop: watch::Sender<bool>,
    latest: watch::Receiver<Option<BatchProgress>>,
    events: Option<mpsc::Receiver<BatchProgress>>,
    join: JoinHandle<Result<QuerySummary>>,
}

impl QueryHandle {
    /// The query id (the Delta txn app id of its commits).
    pub fn query_id(&self) -> &str {
        &self.query_id
    }

    /// The last batch's progress, if a batch has finished.
    pub fn last_progress(&self) -> Option<BatchProgress> {
        self.latest.borrow().clone()
    }

    /// Every batch's progress, in order, as a channel (available once).
    ///
    /// The channel holds at most [`PROGRESS_EVENTS_BUFFER`] events: while a
    /// reader is that far behind (or when nobody takes the channel), newer
    /// events are dropped rather than kept without bound;
    /// [`QueryHandle::last_progress`] always has the latest.
    pub fn take_progress_events(&mut self) -> Option<mpsc::Receiver<BatchProgress>> {
        self.events.take()
    }

    /// Ask the query to stop after the batch in flight. Returns at once.
    pub fn stop(&self) {
        let _ = self.stop.send(true);
    }

    /// A handle that can request a stop from another task.
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(self.stop.clone())
    }

    /// Abort at once, even mid-batch. The checkpoint stays consistent: the
    /// batch in flight is re-run on restart.
    pub fn abort(&self) {
        self.join.abort();
    }

    /// Wait for the query to end: the trigger ran out, [`QueryHandle::stop`]
    /// was called, or it failed.
    pub async fn await_termination(self) -> Result<QuerySummary> {
        match self.join.await {
            Ok(r) => r,
            Err(e) if e.is_cancelled() => Err(Error::Aborted),
            Err(e) => Err(Error::Internal(format!(
                "the query task panicked: {e}; the checkpoint is consistent and a restart \
                 resumes the batch in flight; please report this"
            ))),
        }
    }
}

/// Requests a graceful stop of a running query (see [`QueryHandle::stop`]).
#[derive(Clone)]
pub struct StopHandle(watch::Sender<bool>);

impl StopHandle {
    /// Ask the query to stop after the batch in flight.
    pub fn stop(&self) {
        let _ = self.0.send(true);
    }
}

/// What a query did before it ended.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QuerySummary {
    /// The query id.
    pub query_id: String,
    /// Batches run (including recovered and skipped ones).
    pub batches: u64,
    /// Input rows over all batches.
    pub input_rows: u64,
    /// Output rows over all batches.
    pub output_rows: u64,
    /// The last batch id committed, if any.
    pub last_batch_id: Option<u64>,
    /// Table version at the end.
    pub table_version: Option<u64>,
}

struct Driver {
    ctx: SessionContext,
    tables: Vec<Arc<MicroBatchTable>>,
    plan: LogicalPlan,
    sink: Arc<dyn Sink>,
    ckpt: Checkpoint,
    trigger: Trigger,
    poll: Duration,
    snapshot_interval: u64,
    min_batches_to_retain: u64,
    fail_point: Option<(FailPoint, u64)>,
}

impl Driver {
    fn fail(&self, point: FailPoint, batch_id: u64) -> Result<()> {
        if self.fail_point == Some((point, batch_id)) {
            return Err(Error::InjectedFault { point, batch_id });
        }
        Ok(())
    }

    async fn run(
        self,
        mut stop: watch::Receiver<bool>,
        latest: watch::Sender<Option<BatchProgress>>,
        events: mpsc::Sender<BatchProgress>,
    ) -> Result<QuerySummary> {
        let mut summary = QuerySummary {
            query_id: self.ckpt.query_id().to_string(),
            ..Default::default()
        };
        let dropped_events = std::sync::atomic::AtomicU64::new(0);
        let report = |p: BatchProgress, summary: &mut QuerySummary| {
            summary.batches += 1;
            summary.input_rows += p.input_rows;
            summary.output_rows += p.output_rows;
            summary.last_batch_id = Some(p.batch_id);
            summary.table_version = p.table_version.or(summary.table_version);
            // Bounded: a reader that falls behind (or none at all) loses
            // events, never the query's memory.
            if let Err(mpsc::error::TrySendError::Full(_)) = events.try_send(p.clone())
                && dropped_events.fetch_add(1, Ordering::Relaxed) == 0
            {
                tracing::warn!(
                    batch_id = p.batch_id,
                    "the progress channel is full ({PROGRESS_EVENTS_BUFFER} events unread): newer events are dropped until it is read"
                );
            }
            let _ = latest.send(Some(p));
        };

        // Recover: sources learn what earlier batches took; a batch planned
        // but not marked done is re-run with exactly its logged range.
        let ids = self.ckpt.offset_ids().await?;
        let last_id = ids.last().copied();
        // Each source's newest summary; only the batches after it are read.
        let mut snapshots: BTreeMap<String, (u64, serde_json::Value)> = BTreeMap::new();
        if let Some(last_id) = last_id {
            for t in &self.tables {
                let name = t.source().name();
                if let Some(s) = self.ckpt.latest_source_snapshot(name, last_id).await? {
                    snapshots.insert(name.to_string(), s);
                }
            }
        }
        let first_needed = if snapshots.len() == self.tables.len() {
            snapshots.values().map(|(id, _)| id + 1).min().unwrap_or(0)
        } else {
            0
        };
        // Write-ahead files before the oldest kept one were purged because
        // snapshots covered them: without a readable snapshot, a source
        // would take their input again.
        if let Some(&oldest) = ids.first()
            && first_needed < oldest
        {
            let missing: Vec<&str> = self
                .tables
                .iter()
                .map(|t| t.source().name())
                .filter(|n| !snapshots.contains_key(*n))
                .collect();
            return Err(lakestream_checkpoint::Error::Corrupt {
                file: format!("{}sources/", self.ckpt.location().url()),
                reason: format!(
                    "offsets before batch {oldest} were removed as covered by source \
                     snapshots, but no readable snapshot is left for {}",
                    missing.join(", ")
                ),
            }
            .into());
        }
        let mut ends: BTreeMap<String, Vec<serde_json::Value>> = BTreeMap::new();
        let mut last: Option<OffsetsEntry> = None;
        for id in ids
            .iter()
            .filter(|id| **id >= first_needed || Some(**id) == last_id)
        {
            if let Some(entry) = self.ckpt.offsets(*id).await? {
                for (name, r) in &entry.sources {
                    let covered = snapshots.get(name).is_some_and(|(s, _)| *id <= *s);
                    if !r.end.is_null() && !covered {
                        ends.entry(name.clone()).or_default().push(r.end.clone());
                    }
                }
                last = Some(entry);
            }
        }
        for t in &self.tables {
            let name = t.source().name();
            // Always called: it also clears what this source object learned
            // in an earlier run (an embedder may hand it to a new query).
            t.source()
                .restore(snapshots.get(name).map(|(_, s)| s))
                .await?;
            t.source()
                .recover(ends.get(name).map(|v| v.as_slice()).unwrap_or(&[]))
                .await?;
        }
        let mut prev: BTreeMap<String, Option<serde_json::Value>> = BTreeMap::new();
        let mut next_id = 0;
        if let Some(entry) = last {
            let committed = self.ckpt.latest_commit().await?.map(|c| c.batch_id);
            for (name, r) in &entry.sources {
                prev.insert(
                    name.clone(),
                    if r.end.is_null() {
                        r.start.clone()
                    } else {
                        Some(r.end.clone())
                    },
                );
            }
            next_id = entry.batch_id + 1;
            if committed.is_none_or(|c| c < entry.batch_id) {
                let p = self
                    .run_batch(&entry, Duration::ZERO, Duration::ZERO, true)
                    .await?;
                report(p, &mut summary);
            }
        }
        // A source's starting point is resolved once and kept in the
        // checkpoint, so restarting before the first batch does not move it.
        for t in &self.tables {
            let name = t.source().name().to_string();
            if prev.get(&name).is_some_and(|p| p.is_some()) {
                continue;
            }
            let stored = match self.ckpt.source_state(&name, "initial").await? {
                Some(v) => Some(v),
                None => {
                    let source = t.source();
                    let initial = retry_transient(
                        source.as_ref(),
                        "resolve starting offsets",
                        &mut stop,
                        || source.initial_offset(),
                    )
                    .await?;
                    match initial.flatten() {
                        Some(v) => Some(self.ckpt.init_source_state(&name, "initial", v).await?),
                        None => None,
                    }
                }
            };
            if stored.is_some() {
                prev.insert(name, stored);
            }
        }
        if matches!(self.trigger, Trigger::AvailableNow) {
            for t in &self.tables {
                let source = t.source();
                retry_transient(source.as_ref(), "freeze available data", &mut stop, || {
                    source.freeze()
                })
                .await?;
            }
        }

        let mut next_start = Instant::now();
        loop {
            if *stop.borrow() {
                break;
            }
            let t_plan = Instant::now();
            let mut sources = BTreeMap::new();
            let mut any = false;
            for t in &self.tables {
                let name = t.source().name().to_string();
                let start = prev.get(&name).cloned().flatten();
                let source = t.source();
                let end = retry_transient(source.as_ref(), "plan", &mut stop, || {
                    source.plan(start.as_ref())
                })
                .await?
                .flatten();
                any |= end.is_some();
                sources.insert(
                    name,
                    SourceRange {
                        start,
                        end: end.unwrap_or(serde_json::Value::Null),
                    },
                );
            }
            let plan_time = t_plan.elapsed();
            if !any {
                match self.trigger {
                    Trigger::AvailableNow | Trigger::Once => break,
                    Trigger::Continuous => {
                        wait(&mut stop, self.poll).await;
                        continue;
                    }
                    Trigger::Interval(d) => {
                        let now = Instant::now();
                        next_start = next_trigger(next_start, d, now);
                        wait(&mut stop, next_start.saturating_duration_since(now)).await;
                        continue;
                    }
                }
            }
            let entry = OffsetsEntry::new(next_id, now_ms(), sources);
            let t_wa = Instant::now();
            self.ckpt.write_offsets(&entry).await?;
            let wa_time = t_wa.elapsed();
            let p = self.run_batch(&entry, plan_time, wa_time, false).await?;
            report(p, &mut summary);
            if (next_id + 1).is_multiple_of(self.snapshot_interval) {
                self.write_snapshots(next_id).await;
            }
            for (name, r) in entry.sources {
                if !r.end.is_null() {
                    prev.insert(name, Some(r.end));
                }
            }
            next_id += 1;
            match self.trigger {
                Trigger::Once => break,
                Trigger::Interval(d) => {
                    let now = Instant::now();
                    next_start = next_start.checked_add(d).unwrap_or(now);
                    if next_start > now {
                        wait(&mut stop, next_start - now).await;
                    } else {
                        next_start = now;
                    }
                }
                _ => {}
            }
        }
        self.sink.flush().await;
        if summary.table_version.is_none() {
            summary.table_version = self.sink.version().await?;
        }
        Ok(summary)
    }

    /// Store each source's summary as of batch `batch_id` (just committed),
    /// then remove the write-ahead and commit files that every source's
    /// oldest kept snapshot covers, keeping the newest
    /// `min_batches_to_retain`. A failure only costs a longer restart:
    /// logged, not fatal.
    async fn write_snapshots(&self, batch_id: u64) {
        let mut all = true;
        for t in &self.tables {
            let source = t.source();
            let Some(snapshot) = source.snapshot() else {
                all = false;
                continue;
            };
            if let Err(e) = self
                .ckpt
                .write_source_snapshot(source.name(), batch_id, snapshot)
                .await
            {
                all = false;
                tracing::warn!(source = source.name(), batch_id, error = %e, "cannot store the source snapshot; restarts read more of the checkpoint until the next one");
            }
        }
        if !all {
            return;
        }
        if let Err(e) = self.purge(batch_id).await {
            tracing::warn!(batch_id, error = %e, "cannot remove old checkpoint files; the next snapshot tries again");
        }
    }

    /// Remove `offsets/N` and `commits/N` below both the newest
    /// `min_batches_to_retain` batches and the oldest snapshot any source
    /// keeps (a restart that finds the newest snapshot corrupt falls back
    /// to that one and reads the batches after it).
    async fn purge(&self, batch_id: u64) -> Result<()> {
        let mut keep_from = (batch_id + 1).saturating_sub(self.min_batches_to_retain);
        for t in &self.tables {
            let ids = self.ckpt.source_snapshot_ids(t.source().name()).await?;
            match ids.first() {
                Some(oldest) => keep_from = keep_from.min(oldest + 1),
                None => return Ok(()),
            }
        }
        let removed = self.ckpt.purge_before(keep_from).await?;
        if removed > 0 {
            tracing::debug!(
                batch_id,
                keep_from,
                removed,
                "removed checkpoint files covered by snapshots"
            );
        }
        Ok(())
    }

    async fn run_batch(
        &self,
        entry: &OffsetsEntry,
        plan_time: Duration,
        wa_time: Duration,
        recovered: bool,
    ) -> Result<BatchProgress> {
        let batch_id = entry.batch_id;
        let query_id = self.ckpt.query_id().to_string();
        let t0 = Instant::now();
        self.fail(FailPoint::AfterWriteAhead, batch_id)?;

        let mut progress = BatchProgress {
            query_id: query_id.clone(),
            batch_id,
            input_rows: 0,
            output_rows: 0,
            output_files: 0,
            output_bytes: 0,
            rows_per_second: 0.0,
            durations: Durations::default(),
            sources: BTreeMap::new(),
            table_version: None,
            skipped: false,
            recovered,
        };
        for t in &self.tables {
            let name = t.source().name();
            if let Some(r) = entry.sources.get(name) {
                let end = (!r.end.is_null()).then(|| r.end.clone());
                progress.sources.insert(
                    name.to_string(),
                    SourceProgress {
                        start: r.start.clone(),
                        end: end.clone().or_else(|| r.start.clone()),
                        description: match &end {
                            Some(e) => t.source().describe(r.start.as_ref(), e),
                            None => "no new data".into(),
                        },
                        input_rows: 0,
                        backlog: t.source().backlog(),
                        skipped: Vec::new(),
                    },
                );
            }
        }

        // A replayed batch that the table already holds is not executed.
        if recovered
            && let Some(done) = self.sink.committed_batch(&query_id).await?
            && done >= batch_id
        {
            let version = self.sink.version().await?;
            self.ckpt
                .write_commit(&CommitEntry::new(batch_id, version, true))
                .await?;
            progress.skipped = true;
            progress.table_version = version;
            progress.durations.total_ms = ms(t0.elapsed());
            return Ok(progress);
        }

        let mut scans = BatchScans::default();
        for t in &self.tables {
            if let Some(r) = entry.sources.get(t.source().name()) {
                scans.insert(
                    t.source().name(),
                    BatchRange {
                        start: r.start.clone(),
                        end: (!r.end.is_null()).then(|| r.end.clone()),
                    },
                );
            }
        }
        let scans = Arc::new(scans);
        let t_exec = Instant::now();
        let staged = self
            .execute(batch_id, entry.batch_timestamp_ms, scans.clone())
            .await?;
        let mut skipped_input = BTreeMap::new();
        for t in &self.tables {
            let rows = scans.rows(t.source().name());
            progress.input_rows += rows;
            let skipped = t.source().take_skipped();
            if let Some(p) = progress.sources.get_mut(t.source().name()) {
                p.input_rows = rows;
                p.skipped = skipped.clone();
            }
            if !skipped.is_empty() {
                skipped_input.insert(t.source().name().to_string(), skipped);
            }
        }
        let exec_time = t_exec.elapsed();
        self.fail(FailPoint::AfterFiles, batch_id)?;

        let t_commit = Instant::now();
        let mut meta = serde_json::Map::new();
        meta.insert(
            "sources".into(),
            serde_json::to_value(
                progress
                    .sources
                    .iter()
                    .map(|(k, v)| (k.clone(), v.description.clone()))
                    .collect::<BTreeMap<_, _>>(),
            )
            .expect("serializable"),
        );
        if !skipped_input.is_empty() {
            // An audit of the table's history sees what this batch left out.
            meta.insert(
                "skipped".into(),
                serde_json::to_value(&skipped_input).expect("serializable"),
            );
        }
        meta.insert(
            "engine".into(),
            serde_json::json!(concat!("lakestream ", env!("CARGO_PKG_VERSION"))),
        );
        let (rows, files, bytes) = (staged.rows, staged.files, staged.bytes);
        let outcome = self
            .sink
            .commit(
                staged,
                &CommitInfo {
                    query_id,
                    batch_id,
                    metadata: meta,
                },
            )
            .await?;
        self.fail(FailPoint::AfterCommit, batch_id)?;
        let skipped = matches!(outcome, CommitOutcome::AlreadyCommitted { .. });
        self.ckpt
            .write_commit(&CommitEntry::new(
                batch_id,
                Some(outcome.version()),
                skipped,
            ))
            .await?;
        let commit_time = t_commit.elapsed();
        for t in &self.tables {
            if let Some(r) = entry.sources.get(t.source().name())
                && !r.end.is_null()
                && let Err(e) = t.source().committed(&r.end).await
            {
                tracing::warn!(source = t.source().name(), error = %e, "source commit hook failed");
            }
        }

        let total = plan_time + wa_time + t0.elapsed();
        progress.skipped = skipped;
        if !skipped {
            progress.output_rows = rows;
            progress.output_files = files;
            progress.output_bytes = bytes;
        }
        progress.table_version = Some(outcome.version());
        progress.durations = Durations {
            plan_ms: ms(plan_time),
            write_ahead_ms: ms(wa_time),
            execute_ms: ms(exec_time),
            commit_ms: ms(commit_time),
            total_ms: ms(total),
        };
        progress.rows_per_second = if total.as_secs_f64() > 0.0 {
            progress.input_rows as f64 / total.as_secs_f64()
        } else {
            0.0
        };
        Ok(progress)
    }

    async fn execute(
        &self,
        batch_id: u64,
        batch_ts_ms: i64,
        scans: Arc<BatchScans>,
    ) -> Result<lakestream_sink::Staged> {
        let exec_err = move |e| batch_error(batch_id, e);
        let mut state = self.ctx.state();
        state.config_mut().set_extension(scans);
        // `now()` and friends see the batch's logged timestamp, so a replay
        // computes what the first attempt computed.
        state.execution_props_mut().query_execution_start_time =
            chrono::DateTime::from_timestamp_millis(batch_ts_ms);
        let physical = state
            .create_physical_plan(&self.plan)
            .await
            .map_err(exec_err)?;
        // One writer per output partition, each on its own task: decoding,
        // the query and Parquet encoding of a partition run together, and
        // partitions run in parallel. The files of all writers form the
        // batch's one commit.
        let streams = execute_stream_partitioned(physical, state.task_ctx()).map_err(exec_err)?;
        let mut tasks = tokio::task::JoinSet::new();
        for mut stream in streams {
            let sink = self.sink.clone();
            tasks.spawn(async move {
                let mut writer = sink.begin(batch_id).await?;
                while let Some(batch) = stream.next().await {
                    writer.write(batch.map_err(exec_err)?).await?;
                }
                Ok::<_, Error>(writer.finish().await?)
            });
        }
        let mut staged: Option<lakestream_sink::Staged> = None;
        while let Some(done) = tasks.join_next().await {
            let part = done.map_err(|e| {
                Error::Internal(format!(
                    "batch {batch_id}: a writer task failed: {e}; the batch is not committed \
                     and a restart re-runs it; please report this"
                ))
            })??;
            staged = Some(match staged {
                Some(s) => s.merge(part),
                None => part,
            });
        }
        match staged {
            Some(s) => Ok(s),
            None => Ok(self.sink.begin(batch_id).await?.finish().await?),
        }
    }
}

/// DataFusion's error while running batch `batch_id`, typed: the source's
/// own error when a source read failed (through any number of operators),
/// DataFusion's otherwise.
fn batch_error(batch_id: u64, e: DataFusionError) -> Error {
    match source_failure(&e) {
        Some(source) => Error::SourceInBatch { batch_id, source },
        None => Error::Execution {
            batch_id,
            source: Box::new(e),
        },
    }
}

/// The start of the next interval after `previous`: one interval later, or
/// one interval from `now` when the query fell behind (a batch that ran
/// longer than the interval), never an overflow.
fn next_trigger(previous: Instant, interval: Duration, now: Instant) -> Instant {
    match previous.checked_add(interval) {
        Some(t) if t >= now => t,
        _ => now.checked_add(interval).unwrap_or(now),
    }
}

/// Run a source call; while it reports a transient failure (a broker or
/// store briefly unavailable), wait with backoff, say so, and call again,
/// for at most the source's [`Source::unavailable_timeout`]; then fail with
/// [`Error::SourceUnavailable`]. Returns `None` when a stop is requested
/// while waiting.
async fn retry_transient<T, F, Fut>(
    source: &dyn Source,
    what: &str,
    stop: &mut watch::Receiver<bool>,
    mut call: F,
) -> Result<Option<T>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = lakestream_source::Result<T>>,
{
    let name = source.name();
    let limit = source.unavailable_timeout();
    let started = Instant::now();
    let mut delay = Duration::from_millis(250);
    loop {
        match call().await {
            Ok(v) => return Ok(Some(v)),
            Err(e) if e.is_transient() && !*stop.borrow() => {
                let waited = started.elapsed();
                if waited >= limit {
                    return Err(Error::SourceUnavailable {
                        source_name: name.to_string(),
                        what: what.to_string(),
                        waited,
                        last: Box::new(e),
                    });
                }
                tracing::warn!(
                    source = name,
                    error = %e,
                    "{what}: source unavailable; waiting {:?} before trying again (giving up after {:?})",
                    delay,
                    limit
                );
                wait(stop, delay.min(limit - waited)).await;
                if *stop.borrow() {
                    return Ok(None);
                }
                delay = (delay * 2).min(Duration::from_secs(30));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Sleep for `d` or until a stop is requested.
async fn wait(stop: &mut watch::Receiver<bool>, d: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = stop.changed() => {}
    }
}
