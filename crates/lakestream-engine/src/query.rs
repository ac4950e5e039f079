//! Building and starting a streaming query, and watching it run (the
//! loop itself is the [`crate::driver`]).

mod plan;

use std::collections::{BTreeMap, HashMap};

use plan::{add_dead_letters, check_event_times, plan_outputs};
use std::sync::Arc;
use std::time::Duration;

use arrow::datatypes::SchemaRef;
use datafusion::dataframe::DataFrame;
use datafusion::datasource::TableProvider;
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::SessionContext;
use lakestream_checkpoint::{Checkpoint, QueryRecord, RecordedSource};
use lakestream_sink::Sink;
use lakestream_source::Source;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::driver::{Driver, OutputKind, OutputPlan, RunInfo};
use crate::progress::BatchProgress;
use crate::provider::{BatchScans, MicroBatchTable};
use crate::stateful::{
    EventTime, OutputMode, SessionWindowFunction, SlidingWindowsFunction, StatefulAggregate,
    WindowFunction,
};
use crate::{Error, FailPoint, Result, Trigger};

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
/// use lakestream_engine::delta::{DeltaSink, DeltaSinkOptions};
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
    object_stores: lakestream_storage::StoreRegistry,
    trigger: Trigger,
    poll: Duration,
    snapshot_interval: u64,
    min_batches_to_retain: u64,
    fail_point: Option<(FailPoint, u64)>,
    job: Option<lakestream_job::Job>,
    output_mode: OutputMode,
    event_times: BTreeMap<String, EventTime>,
    name: Option<String>,
    metrics: Option<Arc<crate::metrics::Metrics>>,
    /// Outputs besides the first (the one `sql`/`dataframe` and `sink`
    /// give).
    outputs: Vec<Output>,
    /// Dead-letter sinks by source name.
    dead_letters: Vec<(String, Arc<dyn Sink>)>,
    /// Static Delta tables, whose version each batch records.
    static_tables: Vec<Arc<crate::StaticDeltaTable>>,
}

/// A further output of a query ([`QueryBuilder::output`]): its own query
/// over the same micro-batch, written to its own sink.
///
/// Every batch reads its sources once and runs each output's query over
/// those rows; each output is committed to its sink on its own, with the
/// query id and batch id, so a restart after a crash between two outputs'
/// commits runs only the outputs whose sink lacks the batch.
pub struct Output {
    query: QuerySpec,
    sink: Arc<dyn Sink>,
    columns: Vec<String>,
    mode: OutputMode,
    /// Where a job file declares it (for messages).
    pos: Option<lakestream_job::Pos>,
    /// The text its fingerprint is computed from (a job's SQL).
    text: Option<String>,
}

impl Output {
    /// An output running `sql` over each batch into `sink`.
    pub fn sql(sql: impl Into<String>, sink: Arc<dyn Sink>) -> Self {
        Self::new(QuerySpec::Sql(sql.into()), sink)
    }

    /// An output running the DataFrame `df` (built on
    /// [`QueryBuilder::context`]) over each batch into `sink`.
    pub fn dataframe(df: DataFrame, sink: Arc<dyn Sink>) -> Self {
        Self::new(QuerySpec::Plan(df.into_unoptimized_plan()), sink)
    }

    pub(crate) fn plan(plan: LogicalPlan, sink: Arc<dyn Sink>) -> Self {
        Self::new(QuerySpec::Plan(plan), sink)
    }

    fn new(query: QuerySpec, sink: Arc<dyn Sink>) -> Self {
        Self {
            query,
            sink,
            columns: Vec::new(),
            mode: OutputMode::default(),
            pos: None,
            text: None,
        }
    }

    /// Rename the output columns in order (an `INSERT INTO t (a, b)` list).
    pub fn output_columns(mut self, columns: Vec<String>) -> Self {
        self.columns = columns;
        self
    }

    /// When the groups of this output's aggregation are written (default
    /// [`OutputMode::Append`]).
    pub fn output_mode(mut self, mode: OutputMode) -> Self {
        self.mode = mode;
        self
    }

    pub(crate) fn declared_at(mut self, pos: lakestream_job::Pos, text: String) -> Self {
        self.pos = Some(pos);
        self.text = Some(text);
        self
    }
}

impl Default for QueryBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl QueryBuilder {
    /// A builder with a fresh DataFusion session.
    pub fn new() -> Self {
        // `VARCHAR` as `Utf8`, as the job parser plans the sources.
        let mut config = lakestream_job::session_config().with_information_schema(true);
        config.options_mut().sql_parser.collect_spans = true;
        Self::with_context(SessionContext::new_with_config(config))
    }

    /// A builder on an existing DataFusion session (its functions, settings
    /// and tables are visible to the query).
    pub fn with_context(ctx: SessionContext) -> Self {
        if datafusion::execution::FunctionRegistry::udf(&ctx, "window").is_err() {
            ctx.register_udf(WindowFunction::udf());
        }
        if datafusion::execution::FunctionRegistry::udf(&ctx, "sliding_windows").is_err() {
            ctx.register_udf(SlidingWindowsFunction::udf());
        }
        if datafusion::execution::FunctionRegistry::udf(&ctx, "session_window").is_err() {
            ctx.register_udf(SessionWindowFunction::udf());
        }
        Self {
            ctx,
            tables: Vec::new(),
            query: None,
            output_columns: Vec::new(),
            sink: None,
            checkpoint: None,
            checkpoint_options: HashMap::new(),
            object_stores: Default::default(),
            trigger: Trigger::Continuous,
            poll: Duration::from_millis(200),
            snapshot_interval: DEFAULT_SNAPSHOT_INTERVAL,
            min_batches_to_retain: DEFAULT_MIN_BATCHES_TO_RETAIN,
            fail_point: None,
            job: None,
            output_mode: OutputMode::default(),
            event_times: BTreeMap::new(),
            name: None,
            metrics: None,
            outputs: Vec::new(),
            dead_letters: Vec::new(),
            static_tables: Vec::new(),
        }
    }

    /// Write the records the stream `source` could not decode to `sink`
    /// (the source must set them aside: `on_error 'dead_letter'`), one
    /// commit per batch that has any, with the batch id
    /// ([`crate::dead_letter`] has the columns). Sources may share a sink.
    pub fn dead_letters(mut self, source: &str, sink: Arc<dyn Sink>) -> Self {
        self.dead_letters.push((source.to_string(), sink));
        self
    }

    /// Write a further output each batch: another query over the same
    /// batch's input (read once) into another sink, committed with its own
    /// transaction for the batch id. At most one output of a query may
    /// aggregate or deduplicate. With several outputs the batch's input is
    /// held in memory while they run: the sources are told so
    /// ([`lakestream_source::Source::hold_batches_in_memory`]) and a file
    /// source then takes its `held_max_bytes_per_trigger` per batch.
    pub fn output(mut self, output: Output) -> Self {
        self.outputs.push(output);
        self
    }

    /// Report each batch to `metrics` (Prometheus series labelled with
    /// this query's id); several queries may share one.
    pub fn metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// A name for the query, reported in progress (Spark's `name`); a job
    /// file's queries are named after the file.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
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

    /// Add a static Delta table under its name: each batch reads the
    /// version it was planned with (the latest then, or the pinned one),
    /// recorded in the batch's write-ahead so a replay joins the same rows.
    pub fn static_delta_table(mut self, table: Arc<crate::StaticDeltaTable>) -> Result<Self> {
        self.ctx
            .register_table(table.name(), table.clone())
            .map_err(|e| Error::Plan(Box::new(e)))?;
        self.static_tables.push(table);
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

    /// Hand each batch's output to `f` instead of a sink: `f(batch_id,
    /// df)` runs once per batch, in order, and the batch is done when it
    /// returns `Ok`. After a crash `f` may be called again with the same
    /// batch id and rows (at least once): make its effects idempotent per
    /// batch id (see [`crate::for_each`]).
    pub fn for_each_batch<F, Fut>(self, f: F) -> Self
    where
        F: Fn(u64, DataFrame) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = std::result::Result<(), crate::for_each::BatchFnError>>
            + Send
            + 'static,
    {
        let f: crate::for_each::BatchFn = Arc::new(move |id, df| Box::pin(f(id, df)));
        let sink = Arc::new(crate::for_each::ForEachBatch::new(f, self.ctx.clone()));
        self.sink(sink)
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

    /// The stores the embedding program serves some buckets with, for the
    /// checkpoint and the query's state (default: none; each location gets
    /// a store built from its URL and storage options). Sources and sinks
    /// built by the caller take the same registry in their options; a job
    /// file's are built with it ([`crate::JobOptions::object_stores`]).
    pub fn object_stores(mut self, stores: lakestream_storage::StoreRegistry) -> Self {
        self.object_stores = stores;
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

    /// When the groups of an aggregation are written (default
    /// [`OutputMode::Append`]).
    pub fn output_mode(mut self, mode: OutputMode) -> Self {
        self.output_mode = mode;
        self
    }

    /// Give the stream `source` an event time: its timestamp `column`, and
    /// a watermark that trails the largest event time seen by `delay`.
    /// Rows reaching an aggregation after the watermark passed their
    /// window's end are dropped (and counted); windows are written once
    /// the watermark passes their end.
    pub fn event_time(mut self, source: &str, column: &str, delay: Duration) -> Self {
        self.event_times.insert(
            source.to_string(),
            EventTime {
                column: column.to_string(),
                delay,
            },
        );
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
        let query = self
            .query
            .ok_or_else(|| Error::InvalidQuery("the query has no SQL or DataFrame".into()))?;
        let mut first = Output::new(query, sink)
            .output_columns(self.output_columns)
            .output_mode(self.output_mode);
        if let Some(insert) = self.job.as_ref().and_then(|j| j.inserts.first()) {
            first = first.declared_at(insert.pos, insert.query.to_string());
        }
        let specs: Vec<Output> = std::iter::once(first).chain(self.outputs).collect();
        let name = self.name.clone().or_else(|| {
            self.job.as_ref().map(|j| {
                std::path::Path::new(&j.file)
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_else(|| j.file.clone())
            })
        });
        let names: Vec<String> = self
            .tables
            .iter()
            .map(|t| t.source().name().to_string())
            .collect();
        let is_stream = |n: &str| names.iter().any(|s| s.eq_ignore_ascii_case(n));
        let job = self.job.as_ref();
        let user_error = |pos: Option<lakestream_job::Pos>, msg: String| -> Error {
            match (job, pos) {
                (Some(job), Some(pos)) => Error::from(job.error(pos, msg)),
                _ => Error::InvalidQuery(msg),
            }
        };
        let first_pos = specs[0].pos;
        check_event_times(&self.tables, &self.event_times, &|msg| {
            user_error(first_pos, msg)
        })?;
        let state_location = lakestream_storage::Location::parse_with(
            &checkpoint,
            &self.checkpoint_options,
            &self.object_stores,
        )?;
        let (mut outputs, stateful) = plan_outputs(
            &self.ctx,
            specs,
            job,
            &is_stream,
            &state_location,
            &self.event_times,
            &user_error,
        )
        .await?;
        let first_dead_letter = outputs.len();
        add_dead_letters(&mut outputs, self.dead_letters, &self.tables, &|msg| {
            user_error(first_pos, msg)
        })?;
        let ckpt = Checkpoint::open_at(state_location.clone()).await?;
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
            outputs[0].identity.clone(),
        )
        .with_outputs(
            outputs[1..first_dead_letter]
                .iter()
                .map(|o| o.identity.clone())
                .collect(),
        )
        .with_dead_letters(
            outputs[first_dead_letter..]
                .iter()
                .map(|o| o.identity.clone())
                .collect(),
        );
        ckpt.check_query(&record).await?;
        for o in &outputs {
            let schema = match &o.kind {
                OutputKind::Query(plan) => Arc::new(plan.schema().as_arrow().clone()),
                OutputKind::DeadLetters(_) => crate::dead_letter::schema(),
            };
            o.sink.open(schema).await?;
            // A table that cannot take this output's writes (an
            // append-only table under MERGE) is refused before any batch.
            let write = match &stateful {
                Some(st) if o.stateful => st.write_mode(),
                _ => lakestream_sink::WriteMode::Append,
            };
            o.sink.accepts(&write).await?;
        }
        Ok(Driver {
            ctx: self.ctx,
            tables: self.tables,
            outputs,
            ckpt,
            trigger: self.trigger,
            poll: self.poll,
            snapshot_interval: self.snapshot_interval,
            min_batches_to_retain: self.min_batches_to_retain,
            fail_point: self.fail_point,
            stateful,
            metrics: self.metrics,
            static_tables: self.static_tables,
            run: RunInfo {
                run_id: uuid::Uuid::new_v4().to_string(),
                name,
            },
        })
    }
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
