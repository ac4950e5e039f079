//! Sources of a lakestream query: where micro-batches come from.
//!
//! A [`Source`] turns "what is new since the last batch" into an offset range
//! the engine writes ahead in the checkpoint, then reads exactly that range as
//! a stream of Arrow record batches, as often as the engine asks (a replay
//! after a crash reads the same rows again).
//!
//! ```text
//!   recover(planned ends) ─► plan(start) ─► offsets/N written by the engine ─► read(start, end)
//! ```
//!
//! Implementations here:
//! - [`kafka::KafkaSource`]: Kafka topics read by explicit offset ranges
//!   (JSON, Avro or Protobuf values through a schema registry, text or
//!   bytes), or as a consumer group whose positions live in the output.
//! - [`files::FileSource`]: JSON-lines, CSV, Parquet or Avro files under a
//!   directory or object-store prefix, each file taken once, in
//!   (modification time, path) order.
//! - [`generator::GeneratorSource`]: deterministic rows from a seed, for
//!   demos, tests and benchmarks.
//!
//! (Delta tables as sources are `lakestream-delta`'s.)
//!
//! Each implementation's factory sits beside it ([`files::connector`],
//! [`kafka::connector`], [`generator::connector`]): a
//! [`SourceConnector`] registered under a `STORED AS` name that turns a
//! job's table declaration into the source. Beyond those factories, this
//! crate knows nothing of SQL, DataFusion or the table being written.

pub mod avro;
mod connector;
pub mod files;
pub mod generator;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "kafka")]
pub mod protobuf;

pub use connector::{SourceConnector, on_error};

use std::fmt::Debug;
use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use async_trait::async_trait;
use futures::stream::BoxStream;

/// Errors of the sources. Each names the source and the thing that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kafka record could not be decoded.
    #[error(
        "source {source_name}: malformed record at topic {topic} partition {partition} offset \
         {offset}: {reason}; the batch was not written and re-runs from the checkpoint; set \
         undecodable records aside with OPTIONS ('on_error' 'dead_letter', \
         'dead_letter_location' '<table>')"
    )]
    KafkaMalformed {
        /// The source's table name.
        source_name: String,
        /// Topic.
        topic: String,
        /// Partition.
        partition: i32,
        /// Offset.
        offset: i64,
        /// What is wrong with it.
        reason: String,
    },
    /// Planned Kafka offsets no longer exist.
    #[error(
        "source {source_name}: data loss on topic {topic} partition {partition}: {detail}; \
         set 'fail_on_data_loss' 'false' to skip to the earliest available offset and continue"
    )]
    DataLoss {
        /// The source's table name.
        source_name: String,
        /// Topic.
        topic: String,
        /// Partition.
        partition: i32,
        /// What was found.
        detail: String,
    },
    /// A Kafka request failed.
    #[error("source {source_name}: kafka: {what}: {reason}")]
    Kafka {
        /// The source's table name.
        source_name: String,
        /// What was being done.
        what: String,
        /// librdkafka's message.
        reason: String,
        /// Whether retrying later may succeed (broker down, timeout).
        transient: bool,
    },
    /// A file has fields the source's schema lacks, and the source evolves
    /// its schema (`schema_evolution 'add_new_columns'`): the batch stops
    /// so the query restarts with `schema`.
    #[error(
        "source {source_name}: {file} has new fields ({}); the schema with them is recorded \
         in the checkpoint: restart the query to read them (the batch re-runs with the new \
         schema; an output table needs OPTIONS ('merge_schema' 'true') to take new columns)",
        added.join(", ")
    )]
    SchemaChanged {
        /// The source's table name.
        source_name: String,
        /// The file with the new fields.
        file: String,
        /// The new fields' names.
        added: Vec<String>,
        /// The source's schema with the new fields appended (nullable).
        schema: SchemaRef,
    },
    /// A record could not be decoded.
    #[error(
        "source {source_name}: malformed input in {file}{}: {reason}; fix the file and \
         restart (the checkpoint still points at this batch), or remove it and restart with \
         OPTIONS ('missing_files' 'skip'), or set undecodable records aside with OPTIONS \
         ('on_error' 'dead_letter', 'dead_letter_location' '<table>')",
        line.map(|l| format!(" at line {l}")).unwrap_or_default()
    )]
    Malformed {
        /// The source's table name.
        source_name: String,
        /// The file (URL or path).
        file: String,
        /// 1-based line number, when known.
        line: Option<u64>,
        /// What is wrong with it.
        reason: String,
    },
    /// The schema registry could not be asked, or gave an answer the
    /// source cannot use.
    #[error("source {source_name}: schema registry {url}: {what}: {reason}")]
    SchemaRegistry {
        /// The source's table name.
        source_name: String,
        /// The registry's URL(s).
        url: String,
        /// What was asked.
        what: String,
        /// What went wrong and what to do.
        reason: String,
        /// Whether retrying later may succeed (registry down, timeout).
        transient: bool,
    },
    /// A file's columns do not fit the source's schema.
    #[error("source {source_name}: {file} does not match the declared schema: {reason}")]
    Schema {
        /// The source's table name.
        source_name: String,
        /// The file.
        file: String,
        /// What differs.
        reason: String,
    },
    /// The positions kept in the output table could not be read.
    #[error(
        "source {source_name}: reading its positions from the output table failed: {source}; \
         the batch was not planned and the query retries or restarts from the table"
    )]
    Positions {
        /// The source's table name.
        source_name: String,
        /// What the table lookup said.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A source option is missing or invalid.
    #[error("source {source_name}: option {option}: {reason}")]
    InvalidOption {
        /// The source's table name.
        source_name: String,
        /// The option key.
        option: String,
        /// Why it was refused.
        reason: String,
    },
    /// An offset in the checkpoint does not have this source's shape.
    #[error("source {source_name}: offset {offset} in the checkpoint is not valid: {reason}")]
    InvalidOffset {
        /// The source's table name.
        source_name: String,
        /// The offending JSON.
        offset: String,
        /// Why it was refused.
        reason: String,
    },
    /// Reading from storage failed.
    #[error("source {source_name}: cannot read {file}: {source}")]
    Store {
        /// The source's table name.
        source_name: String,
        /// The file or prefix.
        file: String,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
    /// A file planned into a batch no longer exists when the batch runs.
    #[error(
        "source {source_name}: {file} was planned into this batch but no longer exists; \
         restore the file and restart, or set OPTIONS ('missing_files' 'skip') to commit the \
         batch without its rows (the skip is recorded in the commit and in progress)"
    )]
    MissingFile {
        /// The source's table name.
        source_name: String,
        /// The file (URL or path).
        file: String,
    },
    /// A Delta table source could not read its table's log, or found a
    /// commit it cannot follow.
    #[error("source {source_name}: Delta table {table}: {reason}")]
    Delta {
        /// The source's table name.
        source_name: String,
        /// The table's URL.
        table: String,
        /// What went wrong and what to do.
        reason: String,
    },
    /// A location could not be resolved.
    #[error("source {source_name}: {source}")]
    Location {
        /// The source's table name.
        source_name: String,
        /// The error.
        #[source]
        source: lakestream_storage::Error,
    },
}

impl Error {
    /// Whether a later attempt may succeed without anything being changed
    /// (a broker that is briefly unavailable).
    ///
    /// Object-store errors are never transient here: the store client has
    /// already retried 5xx, timeouts and resets with backoff (its retry
    /// config), so what reaches the source is final (403, 404, retries
    /// exhausted) and fails the query with the store's message.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Kafka { transient, .. } | Error::SchemaRegistry { transient, .. } => *transient,
            // Reading the table's positions while planning changes nothing:
            // a store hiccup is retried like an unreachable broker.
            Error::Positions { .. } => true,
            _ => false,
        }
    }
}

pub use lakestream_protocol::PositionClaim;

/// A source that keeps its positions in the output table (Kafka group
/// mode), as [`Source::table_positions`] offers it: the engine gives it a
/// [`PositionStore`] before the first plan, commits each batch with its
/// [`TablePositions::claims`], and calls [`TablePositions::superseded`]
/// when another writer moved a position first.
#[async_trait]
pub trait TablePositions: Send + Sync {
    /// Where to read the positions from.
    fn set_position_store(&self, store: std::sync::Arc<dyn PositionStore>);

    /// The positions batch `end` moves forward.
    fn claims(&self, end: &Offset) -> Result<Vec<PositionClaim>>;

    /// Batch `end` was dropped: another writer moved one of its positions
    /// before its commit. The source forgets the positions it holds and
    /// reads them from the table at the next plan.
    async fn superseded(&self, end: &Offset);
}

/// Where a source reads the positions it keeps in the output table: the
/// engine gives it one over the query's output sink.
#[async_trait]
pub trait PositionStore: Send + Sync {
    /// The positions the table holds now (a fresh read) for `app_ids`;
    /// app ids never written are absent.
    async fn positions(
        &self,
        app_ids: &[String],
    ) -> std::result::Result<
        std::collections::BTreeMap<String, i64>,
        Box<dyn std::error::Error + Send + Sync>,
    >;
}

/// How far a source is through the input it knows of (for progress bars).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Backlog {
    /// Units (files) taken by planned batches.
    pub done: u64,
    /// Units known: taken plus listed and not yet taken.
    pub total: u64,
    /// Bytes taken by planned batches.
    pub bytes_done: u64,
    /// Bytes known.
    pub bytes_total: u64,
}

/// What a source saw available at its last plan ([`Source::latest`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Latest {
    /// The newest offset available, in the source's own terms (Kafka: each
    /// topic's partitions with their high watermark).
    pub offset: Offset,
    /// Units available and not yet planned, per part of the source (Kafka:
    /// `topic/partition` -> offsets behind the high watermark).
    pub lag: std::collections::BTreeMap<String, u64>,
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Something a read left out of a batch on purpose, by the user's choice
/// (a vanished file with `missing_files 'skip'`). The engine records it in
/// the batch's commit and progress so an audit can see it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Skipped {
    /// What was left out (a file path, a partition range).
    pub what: String,
    /// Why.
    pub reason: String,
}

/// What a source does with a record it cannot turn into a row (malformed
/// JSON, a value of the wrong type, NULL in a NOT NULL column, invalid
/// UTF-8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnError {
    /// Fail the batch, naming the record (file and line, or topic,
    /// partition and offset): nothing is committed and a restart tries
    /// again.
    #[default]
    Fail,
    /// Leave the record out of the batch and hand it over through
    /// [`Source::take_rejected`]; the engine writes it to the query's
    /// dead-letter table in the batch.
    DeadLetter,
}

impl OnError {
    /// The policy for an option value (`fail`, `dead_letter`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "fail" => Some(Self::Fail),
            "dead_letter" => Some(Self::DeadLetter),
            _ => None,
        }
    }
}

/// A record a read left out because it could not be turned into a row
/// (with [`OnError::DeadLetter`]): where it was, its bytes and why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Rejected {
    /// The file it is in (file sources).
    pub file: Option<String>,
    /// Its line in the file, from 1 (text files).
    pub line: Option<u64>,
    /// Its topic (Kafka).
    pub topic: Option<String>,
    /// Its partition (Kafka).
    pub partition: Option<i32>,
    /// Its offset (Kafka).
    pub offset: Option<i64>,
    /// The record as read (a line without its newline, a message value).
    pub record: Vec<u8>,
    /// Why it could not be read.
    pub error: String,
}

/// Where the reads of a batch put their rejected records, shared by the
/// streams of one source.
pub type Rejects = Arc<std::sync::Mutex<Vec<Rejected>>>;

/// What a source reads, for the checkpoint's record of the query: a restart
/// whose sources read something else is refused, since its offsets would
/// not mean the same.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SourceIdentity {
    /// The kind of source (`files`, `kafka`, `generator`).
    pub kind: String,
    /// What it reads in that kind's terms: a location URL, a topic list or
    /// pattern. Never holds credentials.
    pub location: String,
}

/// Default of [`Source::unavailable_timeout`]: five minutes.
pub const DEFAULT_UNAVAILABLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// Refuse a zero for an option that counts something per batch or per
/// read: a zero would stop a query after no batch or spin without end.
pub fn require_positive(source_name: &str, option: &str, value: u64) -> Result<()> {
    if value == 0 {
        return Err(Error::InvalidOption {
            source_name: source_name.to_string(),
            option: option.to_string(),
            reason: "must be at least 1".into(),
        });
    }
    Ok(())
}

/// A stream of record batches from a source.
pub type BatchStream = BoxStream<'static, Result<RecordBatch>>;

/// An offset in a source's own terms, as stored in `offsets/N`.
pub type Offset = serde_json::Value;

/// A streaming source of record batches.
///
/// The engine calls the methods in this order: [`Source::restore`] once (with
/// the newest snapshot, if any) and [`Source::recover`] once with the ends of
/// the batches planned after it, then per batch [`Source::plan`],
/// (write-ahead in the checkpoint), [`Source::read`] (possibly more than once
/// for the same range after a failure) and finally [`Source::committed`].
/// Implementations must be deterministic: `read(start, end)` returns the same
/// rows every time it is called with the same range.
#[async_trait]
pub trait Source: Send + Sync + Debug {
    /// The table name this source is registered under.
    fn name(&self) -> &str;

    /// The schema of every batch this source produces.
    fn schema(&self) -> SchemaRef;

    /// Where the query starts reading this source, resolved once when the
    /// query first runs (for example Kafka's `starting_offsets: latest`).
    /// The engine stores it in the checkpoint and passes it as the `start`
    /// of the first batch, so a restart before the first batch does not
    /// move the starting point. `None` (the default): the first batch's
    /// start is `None`.
    async fn initial_offset(&self) -> Result<Option<Offset>> {
        Ok(None)
    }

    /// Restore what the source needs to know about batches already planned
    /// (`ends` holds each planned batch's end offset, in batch order, after
    /// the snapshot given to [`Source::restore`], if any). Called once before
    /// the first [`Source::plan`]. An error means the checkpoint does not
    /// belong to this source.
    async fn recover(&self, ends: &[Offset]) -> Result<()>;

    /// A compact summary of every batch planned so far, which the engine
    /// stores in the checkpoint now and then, so a restart reads the
    /// summary and the batches after it instead of every batch ever run.
    /// The default, `Value::Null`, suits sources whose last end says it all
    /// (Kafka offsets, generator rows); the file source summarizes the
    /// files it has taken. `None`: no summary now.
    fn snapshot(&self) -> Option<Offset> {
        Some(Offset::Null)
    }

    /// Forget everything learned since this source was created (files
    /// taken by plans whose write-ahead never became durable, a frozen
    /// bound of an earlier run) and start from a summary
    /// [`Source::snapshot`] returned, or from nothing when `snapshot` is
    /// `None`; [`Source::recover`] follows with the ends of the batches
    /// planned after it. Called at every start of a query, so a source
    /// object can be handed to a new query after a failed one without
    /// losing input.
    async fn restore(&self, snapshot: Option<&Offset>) -> Result<()>;

    /// What the reads of the last batch left out by the user's choice
    /// (drained: a second call returns nothing). Called by the engine after
    /// a batch executed, before its commit. The default: nothing.
    fn take_skipped(&self) -> Vec<Skipped> {
        Vec::new()
    }

    /// The records the reads of the last batch could not turn into rows
    /// and left out ([`OnError::DeadLetter`]), drained like
    /// [`Source::take_skipped`]. A read of the same range rejects the same
    /// records. The default: nothing.
    fn take_rejected(&self) -> Vec<Rejected> {
        Vec::new()
    }

    /// The query keeps what a batch reads in memory while the batch runs:
    /// its groups (a stateful aggregation) or its rows (several outputs
    /// over one read), so a batch's size sets the query's memory. A source
    /// whose batch size is a default meant for streaming reads (the file
    /// source's `max_bytes_per_trigger`) takes smaller batches from its
    /// next plan on. Called by the engine before the first plan. The
    /// default: nothing.
    fn hold_batches_in_memory(&self) {}

    /// What this source reads, recorded in the checkpoint when the query
    /// first runs and compared at every restart.
    fn identity(&self) -> SourceIdentity;

    /// How long the engine keeps retrying this source's transient failures
    /// ([`Error::is_transient`]: a broker down, a topic not there yet) while
    /// starting or planning before it fails the query. Default
    /// [`DEFAULT_UNAVAILABLE_TIMEOUT`].
    fn unavailable_timeout(&self) -> std::time::Duration {
        DEFAULT_UNAVAILABLE_TIMEOUT
    }

    /// How much of the known input is done, for progress display: `None`
    /// when the source cannot tell (the default).
    fn backlog(&self) -> Option<Backlog> {
        None
    }

    /// The newest input the source saw available at its last
    /// [`Source::plan`], and how far behind it that plan left each part of
    /// the source. Progress reports it as Spark's `latestOffset`, metrics
    /// as lag. `None` (the default) when the source cannot tell.
    fn latest(&self) -> Option<Latest> {
        None
    }

    /// Fix the data that `available-now` processes: after this, [`Source::plan`]
    /// never goes past what is available at this moment.
    async fn freeze(&self) -> Result<()>;

    /// The end of the next batch starting at `start` (the previous batch's
    /// end, `None` before the first batch), capped by the source's per-trigger
    /// limits; `None` when nothing new is available. The source may consider
    /// the returned range taken: the engine writes it ahead before reading.
    /// Errors are retryable (listing or metadata failures).
    async fn plan(&self, start: Option<&Offset>) -> Result<Option<Offset>>;

    /// Read exactly `(start, end]` as up to `partitions` streams: their
    /// union is the range whatever order they are polled in (a stream that
    /// ends early may take over another's unread part, so which stream
    /// returns a row can depend on it); order across streams is
    /// unspecified. Streams do no work until polled.
    fn read(
        &self,
        start: Option<&Offset>,
        end: &Offset,
        partitions: usize,
    ) -> Result<Vec<BatchStream>>;

    /// Wait until data past `after` (the previous batch's end, as
    /// [`Source::plan`] gets it) may be available, for at most `max`. A
    /// continuous query calls it when a plan found nothing new, instead of
    /// sleeping its poll interval, so a record is read soon after it
    /// arrives. Returning early is always allowed (the next plan decides
    /// what a batch reads); a failure is reported by that plan, not here.
    /// The default sleeps `max`.
    async fn wait_for_data(&self, _after: Option<&Offset>, max: std::time::Duration) {
        tokio::time::sleep(max).await
    }

    /// A short human description of a range for progress output, such as
    /// "files 10..12" or "rows 1000..2000".
    fn describe(&self, start: Option<&Offset>, end: &Offset) -> String;

    /// Number of input rows or records in `(start, end]` when known without
    /// reading (the generator knows, files do not).
    fn count_hint(&self, _start: Option<&Offset>, _end: &Offset) -> Option<u64> {
        None
    }

    /// Called after batch `end` is durably in the table. The default does
    /// nothing; sources may release resources. Errors are logged, not fatal.
    async fn committed(&self, _end: &Offset) -> Result<()> {
        Ok(())
    }

    /// The source's positions kept in the output table (Kafka group mode),
    /// when it keeps them there instead of deriving each batch's start
    /// from the previous batch's end. The default: `None`.
    fn table_positions(&self) -> Option<&dyn TablePositions> {
        None
    }
}
