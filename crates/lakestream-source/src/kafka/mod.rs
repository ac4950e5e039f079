//! The Kafka source: exactly-once reads of topic partitions by offset range.
//!
//! Offsets live in lakestream's checkpoint, never in consumer-group commits:
//! a batch's end offset maps every partition to the next offset to read, so
//! `(start, end]` is "from `start[p]` up to, not including, `end[p]`" for each
//! partition `p`. Reads use `assign()` with explicit offsets and stop at the
//! planned end, so a replay reads exactly the same records.
//!
//! Planning reads each partition's watermarks. With `isolation.level =
//! read_committed` (the default) the high watermark librdkafka reports is the
//! last stable offset, so a batch never waits on an open transaction; offsets
//! of aborted records and transaction markers are gaps the reader steps over
//! by watching the consumer position, not by counting records.
//!
//! Broker calls of librdkafka block, so planning runs on tokio's blocking
//! pool; reading uses librdkafka's async `StreamConsumer`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow::array::{
    ArrayRef, BinaryBuilder, Int32Builder, Int64Builder, RecordBatch, StringBuilder,
    TimestampMillisecondBuilder,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use async_trait::async_trait;
use futures::StreamExt;
use futures::stream;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset as KOffset, TopicPartitionList};
use serde::{Deserialize, Serialize};

use crate::{
    BatchStream, Error, Offset, Result, Skipped, Source, SourceIdentity, require_positive,
};

mod decode;
mod formats;
mod group;
mod plan;
mod read;
pub mod registry;

use decode::*;
use plan::*;

pub use group::position_app_id;

/// How record values are turned into columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueFormat {
    /// One JSON object per record, decoded into the declared columns.
    Json,
    /// The value as bytes, in a `value` column.
    Raw,
    /// The value as UTF-8 text, in a `value` column.
    String,
    /// Avro in the Confluent wire format, its writer schemas from a
    /// schema registry, resolved to the reader schema's columns.
    Avro(registry::AvroValues),
    /// Protobuf in the Confluent wire format, its files from a schema
    /// registry, read into the declared columns by field name.
    Protobuf(registry::ProtobufValues),
}

/// How record keys are turned into the `_key` column.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum KeyFormat {
    /// The key as bytes (`BINARY`).
    #[default]
    Raw,
    /// The key as UTF-8 text (`VARCHAR`); a key that is not UTF-8 is a bad
    /// record.
    String,
    /// Avro in the Confluent wire format through a schema registry: `_key`
    /// has the key schema's type (a record's fields as a struct). The
    /// reader schema is a record ([`crate::avro::as_record`]).
    Avro(registry::AvroValues),
    /// A JSON object decoded into these columns: `_key` is a struct of
    /// them. A key that is not a JSON object, or whose fields do not fit
    /// the columns, is a bad record.
    Json(SchemaRef),
}

/// Where a partition starts when the query first sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum StartingOffsets {
    /// The earliest available offset.
    Earliest,
    /// The high watermark at the first plan: only records produced later.
    Latest,
    /// Explicit offsets per topic and partition; `-2` earliest, `-1` latest.
    /// Partitions not named start at the earliest offset.
    Map(BTreeMap<String, BTreeMap<i32, i64>>),
    /// The first offset at or after this timestamp (ms since the epoch).
    Timestamp(i64),
}

/// Where a bounded source ends.
#[derive(Debug, Clone, PartialEq)]
pub enum EndingOffsets {
    /// The high watermarks at the first plan.
    Latest,
    /// Explicit offsets (exclusive) per topic and partition; `-1` latest.
    Map(BTreeMap<String, BTreeMap<i32, i64>>),
}

/// Which topics to read.
#[derive(Debug, Clone)]
pub enum Topics {
    /// These topics.
    List(Vec<String>),
    /// Every topic whose name matches (re-evaluated at each trigger).
    Pattern(regex::Regex),
}

/// Which records a read sees of topics written by transactional producers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IsolationLevel {
    /// Only records of committed transactions; planning stops at the last
    /// stable offset, so a batch never waits on an open transaction.
    #[default]
    ReadCommitted,
    /// Every record, including those of open transactions that may still be
    /// aborted: aborted records then reach the table, and a batch planned
    /// before the abort holds them. For topics without transactional
    /// producers only.
    ReadUncommitted,
}

impl IsolationLevel {
    /// The level for an option value (`read_committed`, `read_uncommitted`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "read_committed" => Some(Self::ReadCommitted),
            "read_uncommitted" => Some(Self::ReadUncommitted),
            _ => None,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Self::ReadCommitted => "read_committed",
            Self::ReadUncommitted => "read_uncommitted",
        }
    }
}

/// librdkafka settings the exactly-once reader owns: a value given by the
/// user would let a read start elsewhere than planned (`auto.offset.reset`),
/// commit offsets behind the checkpoint's back, or change which records a
/// planned range holds. Refused by [`KafkaSource::try_new`]; the reason
/// says what to use instead.
pub const RESERVED_CLIENT_KEYS: &[(&str, &str)] = &[
    (
        "auto.offset.reset",
        "a planned offset that is gone must fail or be handled by 'fail_on_data_loss', never \
         silently jump",
    ),
    (
        "isolation.level",
        "use the table option 'isolation_level' ('read_committed' or 'read_uncommitted')",
    ),
    (
        "enable.auto.commit",
        "offsets live in the checkpoint; use 'commit_offsets_to_group' to report them to a \
         consumer group for monitoring",
    ),
    (
        "enable.auto.offset.store",
        "offsets live in the checkpoint; use 'commit_offsets_to_group' to report them to a \
         consumer group for monitoring",
    ),
    (
        "group.id",
        "the reader assigns partitions by explicit offsets and never uses a group; use \
         'commit_offsets_to_group' to report offsets to a group for monitoring",
    ),
    (
        "group.instance.id",
        "the reader assigns partitions by explicit offsets and never joins a group",
    ),
    (
        "enable.partition.eof",
        "the reader decides where a range ends",
    ),
    (
        "bootstrap.servers",
        "give the brokers in the table's LOCATION (kafka://HOST:PORT/TOPIC)",
    ),
    (
        "metadata.broker.list",
        "give the brokers in the table's LOCATION (kafka://HOST:PORT/TOPIC)",
    ),
];

/// Settings of a [`KafkaSource`].
#[derive(Clone)]
pub struct KafkaSourceOptions {
    /// `bootstrap.servers`.
    pub bootstrap_servers: String,
    /// Topics to read.
    pub topics: Topics,
    /// How values are decoded.
    pub format: ValueFormat,
    /// How keys are decoded.
    pub key_format: KeyFormat,
    /// Where new partitions of the first batch start.
    pub starting_offsets: StartingOffsets,
    /// Makes the source bounded (backfills).
    pub ending_offsets: Option<EndingOffsets>,
    /// At most this many offsets per batch over all partitions, split in
    /// proportion to each partition's backlog.
    pub max_offsets_per_trigger: Option<u64>,
    /// Fail when planned offsets are gone (default); `false` skips forward.
    pub fail_on_data_loss: bool,
    /// Which records of transactional producers are read.
    pub isolation_level: IsolationLevel,
    /// A planned range not read within this time fails the batch.
    pub read_timeout: Duration,
    /// Timeout of one metadata or watermark request.
    pub request_timeout: Duration,
    /// How long starting and planning retry an unreachable broker or a
    /// missing topic before the query fails.
    pub unavailable_timeout: Duration,
    /// Commit each batch's end offsets to this consumer group, for lag
    /// monitoring only (never read back).
    pub commit_group: Option<String>,
    /// Extra librdkafka settings (`security.protocol`, `sasl.*`, ...).
    pub client_config: BTreeMap<String, String>,
    /// Rows per record batch.
    pub batch_size: usize,
    /// Consumers a batch reads with, each taking a share of the partitions
    /// (at most one per engine partition). One librdkafka consumer already
    /// fetches from every broker at once and decoding is cheap, so the
    /// default is 1: on a local broker, two consumers over four partitions
    /// read slower than one.
    pub consumers: usize,
    /// What a batch does with a record whose value it cannot decode.
    pub on_error: crate::OnError,
    /// Read only these partitions of each topic (a static share of the
    /// topic for one of several processes, each with its own checkpoint);
    /// `None`: all.
    pub partitions: Option<std::collections::BTreeSet<i32>>,
    /// Group mode: processes running this job share the topics' partitions
    /// through this Kafka consumer group, and each partition's position
    /// lives in the output table (see `group.rs`). `None`: this process
    /// reads every partition (or `partitions`), positions in its checkpoint.
    pub group_id: Option<String>,
}

impl KafkaSourceOptions {
    /// Defaults for reading `topics` from `bootstrap_servers` as JSON.
    pub fn new(bootstrap_servers: &str, topics: Topics) -> Self {
        Self {
            bootstrap_servers: bootstrap_servers.to_string(),
            topics,
            format: ValueFormat::Json,
            key_format: KeyFormat::Raw,
            starting_offsets: StartingOffsets::Earliest,
            ending_offsets: None,
            max_offsets_per_trigger: None,
            fail_on_data_loss: true,
            isolation_level: IsolationLevel::ReadCommitted,
            read_timeout: Duration::from_secs(120),
            request_timeout: Duration::from_secs(10),
            unavailable_timeout: crate::DEFAULT_UNAVAILABLE_TIMEOUT,
            commit_group: None,
            client_config: BTreeMap::new(),
            batch_size: 8192,
            consumers: 1,
            on_error: crate::OnError::Fail,
            partitions: None,
            group_id: None,
        }
    }
}

/// Settings may hold secrets (`sasl.password`, `ssl.key.password`, ...):
/// their values are never shown.
impl std::fmt::Debug for KafkaSourceOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let config: BTreeMap<&str, &str> = self
            .client_config
            .iter()
            .map(|(k, v)| {
                let shown = if is_secret_key(k) {
                    "<redacted>"
                } else {
                    v.as_str()
                };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("KafkaSourceOptions")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("topics", &self.topics)
            .field("format", &self.format)
            .field("starting_offsets", &self.starting_offsets)
            .field("ending_offsets", &self.ending_offsets)
            .field("max_offsets_per_trigger", &self.max_offsets_per_trigger)
            .field("fail_on_data_loss", &self.fail_on_data_loss)
            .field("on_error", &self.on_error)
            .field("partitions", &self.partitions)
            .field("group_id", &self.group_id)
            .field("isolation_level", &self.isolation_level)
            .field("read_timeout", &self.read_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("unavailable_timeout", &self.unavailable_timeout)
            .field("commit_group", &self.commit_group)
            .field("client_config", &config)
            .field("batch_size", &self.batch_size)
            .field("consumers", &self.consumers)
            .finish()
    }
}

/// The longest `read_timeout` / `request_timeout` accepted (librdkafka
/// takes timeouts as 32-bit milliseconds).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

impl KafkaSourceOptions {
    /// Check the settings: counts at least 1, timeouts within
    /// (0, [`MAX_TIMEOUT`]], no [`RESERVED_CLIENT_KEYS`].
    pub fn validate(&self, source_name: &str) -> Result<()> {
        let invalid = |option: &str, reason: String| Error::InvalidOption {
            source_name: source_name.to_string(),
            option: option.to_string(),
            reason,
        };
        require_positive(source_name, "batch_size", self.batch_size as u64)?;
        require_positive(source_name, "consumers", self.consumers as u64)?;
        if let Some(n) = self.max_offsets_per_trigger {
            require_positive(source_name, "max_offsets_per_trigger", n)?;
        }
        for (option, d) in [
            ("read_timeout", self.read_timeout),
            ("request_timeout", self.request_timeout),
            ("unavailable_timeout", self.unavailable_timeout),
        ] {
            if d.is_zero() || d > MAX_TIMEOUT {
                return Err(invalid(
                    option,
                    format!("{d:?} is out of range: give a duration above 0 and at most 24h"),
                ));
            }
        }
        if self.group_id.is_some() {
            for (option, given) in [
                ("partitions", self.partitions.is_some()),
                ("ending_offsets", self.ending_offsets.is_some()),
                ("commit_offsets_to_group", self.commit_group.is_some()),
            ] {
                if given {
                    return Err(invalid(
                        option,
                        "cannot be combined with 'group_id': in group mode the consumer group \
                         assigns the partitions, reads never end, and positions are kept in \
                         the output table"
                            .into(),
                    ));
                }
            }
            if self
                .group_id
                .as_deref()
                .is_some_and(|g| g.is_empty() || g.contains('/'))
            {
                return Err(invalid(
                    "group_id",
                    "give a non-empty consumer group name without '/'".into(),
                ));
            }
        }
        for key in self.client_config.keys() {
            let k = key.to_ascii_lowercase();
            if let Some((_, why)) = RESERVED_CLIENT_KEYS.iter().find(|(r, _)| *r == k) {
                return Err(invalid(
                    &format!("kafka.{key}"),
                    format!(
                        "the exactly-once reader sets {k} itself and it cannot be changed: {why}"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Per topic, per partition: an offset.
type PartitionOffsets = BTreeMap<String, BTreeMap<i32, i64>>;

/// The end offset of a Kafka batch (and the initial offset of a query).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KafkaOffset {
    /// Next offset to read, per topic and partition.
    pub partitions: PartitionOffsets,
    /// The bound of a bounded source (`ending_offsets`), fixed when the
    /// query first started and carried from batch to batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ending: Option<PartitionOffsets>,
    /// Partitions first seen in this batch, with the offset they start at.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub added: PartitionOffsets,
    /// Partitions whose planned start was gone when this batch was planned
    /// (`fail_on_data_loss = false`): the batch read from `resumed_at`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub data_loss: Vec<LostRange>,
    /// The topic id (KIP-516, 32 hex digits) of each topic when the query
    /// first saw it, where the broker gives one: a changed id proves that a
    /// topic was deleted and recreated. Carried from batch to batch.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub topic_ids: BTreeMap<String, String>,
    /// Group mode: where each partition's range starts (its position in
    /// the output table when planned), since the previous batch of this
    /// process may have read other partitions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_from: Option<PartitionOffsets>,
}

/// A partition whose planned offsets no longer existed in the broker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LostRange {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The offset the checkpoint expected to read next.
    pub expected: i64,
    /// The offset reading resumed at: the partition's earliest when the
    /// start was deleted or the topic was recreated, its end when the log
    /// was truncated below the start.
    pub resumed_at: i64,
}

#[derive(Debug, Default)]
struct KafkaState {
    /// High watermarks fixed by `freeze` (available-now).
    frozen: Option<PartitionOffsets>,
    /// Watermarks read while starting (`initial_offset`, `freeze`), reused
    /// by the calls that follow within [`STARTUP_MARKS_AGE`] up to and
    /// including the first plan: a start then asks the broker once, not
    /// three times.
    startup_marks: Option<(Instant, Watermarks)>,
    /// When topic ids were last compared with the recorded ones (`None`:
    /// not yet in this run, so the first plan compares them).
    ids_checked: Option<Instant>,
    /// The brokers left a topic-id lookup unanswered in this run: no more
    /// are asked until the next run (see `KafkaSource::topic_ids`).
    ids_unanswered: bool,
    /// The high watermarks and the lag behind them at the last plan.
    latest: Option<crate::Latest>,
    /// The partitions of the source's topics as the broker's metadata last
    /// listed them, and when: plans within [`PARTITIONS_MAX_AGE`] ask for
    /// watermarks only, not for metadata too.
    partitions: Option<(Instant, BTreeMap<String, Vec<i32>>)>,
}

/// How long a plan trusts the last metadata's partition list: a partition
/// or topic added to the broker is found within this time. Each plan
/// still asks the broker for every partition's watermarks.
const PARTITIONS_MAX_AGE: Duration = Duration::from_secs(1);

/// How often planning compares topic ids with the recorded ones, besides
/// the first plan of a run and a partition found past its end: a topic
/// recreated and refilled past the old offsets is caught within this time.
const TOPIC_ID_CHECK_EVERY: Duration = Duration::from_secs(60);

/// How old startup watermarks may be to be reused (they only bound what a
/// batch reads: older ones make it read less, never wrongly).
const STARTUP_MARKS_AGE: Duration = Duration::from_secs(2);

/// Reads Kafka topics; see the module docs.
#[derive(Debug)]
pub struct KafkaSource {
    name: String,
    options: KafkaSourceOptions,
    value_schema: SchemaRef,
    schema: SchemaRef,
    state: Arc<Mutex<KafkaState>>,
    /// The client that plans (metadata, watermarks, offsets for times),
    /// created at the first plan and kept: a continuous query plans every
    /// poll interval, and a new client would reconnect each time.
    planner: PlannerSlot,
    /// The planning client's last connection error.
    connection: ConnectionErrors,
    /// Ranges the reads of the current batch found gone and skipped
    /// (`fail_on_data_loss = false`).
    skipped: Arc<Mutex<Vec<Skipped>>>,
    /// Records the reads of the current batch could not decode
    /// (`on_error 'dead_letter'`).
    rejected: crate::Rejects,
    /// Group mode's membership and positions.
    membership: group::GroupSlot,
    /// Consumers kept between batches (see [`read`]): live ones for small
    /// ranges and waits, bulk ones for large ranges.
    live_readers: read::ReaderPool,
    bulk_readers: read::ReaderPool,
    /// A live read got nothing for [`read::LIVE_STALL`] (a broker that
    /// answers short-wait fetches with nothing): bulk consumers only.
    live_stalls: Arc<std::sync::atomic::AtomicBool>,
}

#[derive(Default)]
struct PlannerSlot(Mutex<Option<Arc<Detached<BaseConsumer<PlannerContext>>>>>);

/// The last connection refusal one source's planning client met: a
/// failed TLS handshake, a refused SASL login. A request that then fails
/// for want of a broker says why, and ends the wait at once, since no
/// retry fixes it. librdkafka reports it as an error event and a `FAIL`
/// log line on the client's queue ([`serve_events`]).
#[derive(Debug, Default, Clone)]
pub(super) struct ConnectionErrors(Arc<Mutex<Option<String>>>);

impl ConnectionErrors {
    /// The last refusal since the last request that went through.
    pub(super) fn fatal(&self) -> Option<String> {
        self.0.lock().expect("kafka connection errors").clone()
    }

    /// Forget the refusals: a request went through.
    pub(super) fn clear(&self) {
        *self.0.lock().expect("kafka connection errors") = None;
    }

    /// Keep `message` (a `FAIL` log line) when it says the broker refused
    /// the connection's TLS or authentication (librdkafka's words for
    /// these are fixed).
    fn saw(&self, message: &str) {
        const REFUSALS: [&str; 5] = [
            "SSL handshake failed",
            // A TLS alert from the broker (certificate required, bad
            // certificate, unknown CA) after the handshake, as TLS 1.3
            // sends one for a missing client certificate.
            "SSL alert number",
            "SASL authentication error",
            "SASL SCRAM authentication failed",
            "Authentication failed",
        ];
        if REFUSALS.iter().any(|r| message.contains(r)) {
            *self.0.lock().expect("kafka connection errors") = Some(message.to_string());
        }
    }
}

/// The planning client's context: librdkafka's log lines go to the log as
/// with the default context, and connection refusals are kept in
/// [`ConnectionErrors`].
#[derive(Debug, Default, Clone)]
pub(super) struct PlannerContext(ConnectionErrors);

impl rdkafka::ClientContext for PlannerContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        use rdkafka::config::RDKafkaLogLevel as L;
        match level {
            L::Emerg | L::Alert | L::Critical | L::Error => {
                tracing::error!(target: "librdkafka", "librdkafka: {fac} {message}")
            }
            L::Warning => tracing::warn!(target: "librdkafka", "librdkafka: {fac} {message}"),
            L::Notice | L::Info => {
                tracing::info!(target: "librdkafka", "librdkafka: {fac} {message}")
            }
            L::Debug => tracing::debug!(target: "librdkafka", "librdkafka: {fac} {message}"),
        }
        if fac == "FAIL" {
            self.0.saw(message);
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::debug!("librdkafka: {error}: {reason}");
        if matches!(
            error.rdkafka_error_code(),
            Some(
                RDKafkaErrorCode::SSL
                    | RDKafkaErrorCode::Authentication
                    | RDKafkaErrorCode::SaslAuthenticationFailed
            )
        ) {
            *self.0.0.lock().expect("kafka connection errors") = Some(reason.to_string());
        }
    }
}

impl ConsumerContext for PlannerContext {}

/// Serve the events queued on a client that only asks for metadata: its
/// log lines and errors (rdkafka queues them until the client is polled;
/// unserved, they would pile up for the life of the query). Each poll
/// serves at most one event; an empty queue costs one length look-up.
pub(super) fn serve_events<X: ConsumerContext>(consumer: &BaseConsumer<X>) {
    use rdkafka::bindings as rd;
    let queued = || {
        // SAFETY: the client outlives this call; the queue handle taken
        // here is released before returning.
        unsafe {
            let q = rd::rd_kafka_queue_get_consumer(consumer.client().native_ptr());
            if q.is_null() {
                return 0;
            }
            let n = rd::rd_kafka_queue_length(q);
            rd::rd_kafka_queue_destroy(q);
            n
        }
    };
    // Bounded: events keep coming while a broker is down.
    for _ in 0..256 {
        if queued() == 0 {
            break;
        }
        if let Some(Ok(_)) = consumer.poll(Duration::ZERO) {
            // No partition is assigned: no message can come.
            break;
        }
    }
}

impl std::fmt::Debug for PlannerSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PlannerSlot")
    }
}

/// Names of the metadata columns every Kafka table has, after its value
/// columns.
pub const METADATA_COLUMNS: [&str; 6] = [
    "_key",
    "_topic",
    "_partition",
    "_offset",
    "_timestamp",
    "_headers",
];

fn metadata_fields(source: &str, key_format: &KeyFormat) -> Result<Vec<Field>> {
    let key = match key_format {
        KeyFormat::Raw => DataType::Binary,
        KeyFormat::String => DataType::Utf8,
        KeyFormat::Json(s) => DataType::Struct(s.fields().clone()),
        KeyFormat::Avro(a) => {
            crate::avro::key_type(&a.reader_schema).map_err(|reason| Error::InvalidOption {
                source_name: source.to_string(),
                option: "key_format".into(),
                reason: format!("the key schema of subject {}: {reason}", a.subject),
            })?
        }
    };
    Ok(vec![
        Field::new("_key", key, true),
        Field::new("_topic", DataType::Utf8, false),
        Field::new("_partition", DataType::Int32, false),
        Field::new("_offset", DataType::Int64, false),
        Field::new(
            "_timestamp",
            DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
            true,
        ),
        Field::new("_headers", DataType::Utf8, true),
    ])
}

/// Config keys whose values are secrets: never logged or shown.
pub fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k.contains("password")
        || k.contains("secret")
        || k.contains("token")
        || k.ends_with(".key")
        || k.contains("key.pem")
        || k.contains("sasl.jaas")
        || k.contains("sasl.oauthbearer.config")
}

impl KafkaSource {
    /// A Kafka source named `name`. `value_schema` gives the columns decoded
    /// from JSON values (ignored for `raw` and `string`).
    pub fn try_new(
        name: &str,
        value_schema: Option<SchemaRef>,
        options: KafkaSourceOptions,
    ) -> Result<Self> {
        options.validate(name)?;
        let value_schema = match options.format {
            ValueFormat::Json | ValueFormat::Protobuf(_) => value_schema
                .filter(|s| {
                    !s.fields().is_empty() || !matches!(options.format, ValueFormat::Protobuf(_))
                })
                .ok_or_else(|| Error::InvalidOption {
                    source_name: name.to_string(),
                    option: "format".into(),
                    reason: "format 'json' or 'protobuf' needs the value's columns declared in \
                             the table"
                        .into(),
                })?,
            ValueFormat::Raw => Arc::new(Schema::new(vec![Field::new(
                "value",
                DataType::Binary,
                true,
            )])),
            ValueFormat::String => {
                Arc::new(Schema::new(vec![Field::new("value", DataType::Utf8, true)]))
            }
            // The declared columns, or (none declared) the reader
            // schema's fields.
            ValueFormat::Avro(ref a) => match value_schema.filter(|s| !s.fields().is_empty()) {
                Some(s) => s,
                None => crate::avro::arrow_schema_of(&a.reader_schema).map_err(|reason| {
                    Error::InvalidOption {
                        source_name: name.to_string(),
                        option: "format".into(),
                        reason: format!(
                            "the Avro schema of subject {} has no columns lakestream reads: \
                             {reason}",
                            a.subject
                        ),
                    }
                })?,
            },
        };
        let mut fields: Vec<Field> = value_schema
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        for m in metadata_fields(name, &options.key_format)? {
            if fields.iter().any(|f| f.name() == m.name()) {
                return Err(Error::InvalidOption {
                    source_name: name.to_string(),
                    option: "columns".into(),
                    reason: format!("column {} is reserved for Kafka metadata", m.name()),
                });
            }
            fields.push(m);
        }
        Ok(Self {
            name: name.to_string(),
            schema: Arc::new(Schema::new(fields)),
            value_schema,
            options,
            state: Arc::new(Mutex::new(KafkaState::default())),
            planner: PlannerSlot::default(),
            connection: ConnectionErrors::default(),
            skipped: Arc::new(Mutex::new(Vec::new())),
            rejected: Arc::new(Mutex::new(Vec::new())),
            membership: group::GroupSlot::default(),
            live_readers: read::ReaderPool::default(),
            bulk_readers: read::ReaderPool::default(),
            live_stalls: Default::default(),
        })
    }

    /// The next batch after `prev` (each partition's next offset) given
    /// the partitions' watermarks `marks`: each partition's range, capped
    /// by the per-trigger limit; `None` when there is nothing to read.
    async fn plan_next(
        &self,
        prev: &KafkaOffset,
        marks: &Watermarks,
    ) -> Result<Option<KafkaOffset>> {
        let frozen = self.state.lock().expect("kafka state").frozen.clone();
        let mut next = KafkaOffset {
            ending: prev.ending.clone(),
            topic_ids: prev.topic_ids.clone(),
            ..Default::default()
        };
        // Ids are asked for when they can tell something: a topic first
        // seen, a planned offset past a partition's end (was it recreated?),
        // and every topic at the first plan of a run (it may have been
        // recreated while the query was down) and now and then.
        let periodic = {
            let mut st = self.state.lock().expect("kafka state");
            let due = st
                .ids_checked
                .is_none_or(|t| t.elapsed() >= TOPIC_ID_CHECK_EVERY);
            if due {
                st.ids_checked = Some(Instant::now());
            }
            due
        };
        let mut wanted: Vec<String> = Vec::new();
        for (topic, parts) in &marks.marks {
            let known = prev.partitions.get(topic);
            let first_seen = known.is_none() && !prev.topic_ids.contains_key(topic);
            let past_end = parts
                .iter()
                .any(|(p, (_, hi))| known.and_then(|m| m.get(p)).is_some_and(|s| s > hi));
            // Now and then every topic, so an id a slow answer missed
            // when the topic was first seen is recorded later.
            if first_seen || past_end || periodic {
                wanted.push(topic.clone());
            }
        }
        let current_ids = if wanted.is_empty() {
            BTreeMap::new()
        } else {
            self.topic_ids(wanted).await?
        };
        for (topic, id) in &current_ids {
            next.topic_ids
                .entry(topic.clone())
                .or_insert_with(|| id.clone());
        }
        // A partition without a start here is one the previous batches never
        // saw; it is recorded in `added` with the offset it starts at.
        // What each partition could give this batch, before the cap.
        let mut rows: Vec<PartitionRange> = Vec::new();
        for (topic, parts) in &marks.marks {
            for (&p, &(lo, hi)) in parts {
                // A partition (or topic) that appeared after the query started
                // is read from its earliest offset.
                let known = prev.partitions.get(topic).and_then(|m| m.get(&p)).copied();
                let mut s = known.unwrap_or(lo);
                if known.is_none() {
                    next.added.entry(topic.clone()).or_default().insert(p, lo);
                }
                let recorded_id = prev.topic_ids.get(topic).map(String::as_str);
                let current_id = current_ids.get(topic).map(String::as_str);
                if let Some((resume, detail)) = resume_point(s, lo, hi, recorded_id, current_id) {
                    // Planned offsets are gone: retention deleted them, the
                    // log was truncated, or the topic was recreated.
                    if self.options.fail_on_data_loss {
                        return Err(Error::DataLoss {
                            source_name: self.name.clone(),
                            topic: topic.clone(),
                            partition: p,
                            detail,
                        });
                    }
                    tracing::warn!(
                        source = %self.name, topic = %topic, partition = p, %detail,
                        "data loss: skipping forward (fail_on_data_loss = false)"
                    );
                    next.data_loss.push(LostRange {
                        topic: topic.clone(),
                        partition: p,
                        expected: s,
                        resumed_at: resume,
                    });
                    if let Some(id) = current_id {
                        // The current id is the one to compare with from
                        // now on (the new topic's, after a recreation).
                        next.topic_ids.insert(topic.clone(), id.to_string());
                    }
                    s = resume;
                }
                let mut limit = hi;
                if let Some(e) = prev.ending.as_ref().and_then(|e| e.get(topic)) {
                    // A bounded source reads no partition it did not know
                    // when it started.
                    limit = limit.min(e.get(&p).copied().unwrap_or(s));
                }
                if let Some(f) = frozen.as_ref() {
                    // Nor, under available-now, one that appeared later.
                    limit = limit.min(f.get(topic).and_then(|m| m.get(&p)).copied().unwrap_or(s));
                }
                rows.push(PartitionRange {
                    topic: topic.clone(),
                    partition: p,
                    start: s,
                    end: limit.max(s),
                });
            }
        }
        let backlogs: Vec<(usize, i64)> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| (i, r.end - r.start))
            .collect();
        let takes = match self.options.max_offsets_per_trigger {
            Some(cap) => split_cap(&backlogs, cap),
            None => backlogs.clone(),
        };
        let mut any = !next.data_loss.is_empty();
        let mut lag = BTreeMap::new();
        for (i, take) in takes {
            let r = &rows[i];
            any |= take > 0;
            next.partitions
                .entry(r.topic.clone())
                .or_default()
                .insert(r.partition, r.start + take);
            let hi = marks.marks[&r.topic][&r.partition].1;
            lag.insert(
                format!("{}/{}", r.topic, r.partition),
                u64::try_from(hi - (r.start + take)).unwrap_or(0),
            );
        }
        let highs: PartitionOffsets = marks
            .marks
            .iter()
            .map(|(t, parts)| {
                (
                    t.clone(),
                    parts.iter().map(|(p, (_, hi))| (*p, *hi)).collect(),
                )
            })
            .collect();
        self.state.lock().expect("kafka state").latest = Some(crate::Latest {
            offset: serde_json::to_value(highs).expect("offsets serialize"),
            lag,
        });
        if !any {
            return Ok(None);
        }
        Ok(Some(next))
    }

    fn client_config(&self) -> ClientConfig {
        client_config(&self.options)
    }

    fn parse(&self, v: &Offset) -> Result<KafkaOffset> {
        serde_json::from_value(v.clone()).map_err(|e| Error::InvalidOffset {
            source_name: self.name.clone(),
            offset: v.to_string(),
            reason: e.to_string(),
        })
    }

    /// The planning client, created on first use.
    fn planner(&self) -> Result<Arc<Detached<BaseConsumer<PlannerContext>>>> {
        let mut slot = self.planner.0.lock().expect("kafka planner");
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let c = Arc::new(Detached::new(
            self.client_config()
                .create_with_context::<_, BaseConsumer<PlannerContext>>(PlannerContext(
                    self.connection.clone(),
                ))
                .map_err(|e| create_err(&self.name, e))?,
        ));
        *slot = Some(c.clone());
        Ok(c)
    }

    fn kafka_err(&self, what: &str, e: KafkaError) -> Error {
        connection_err(&self.name, what, e, &self.connection)
    }
}

/// A Kafka client dropped on a thread of its own. rdkafka's drop of a
/// consumer with a group id (every reader has one: `assign()` needs it)
/// closes it and then polls in 100 ms steps until the close is done, and
/// the close of a consumer that only assigned partitions posts nothing
/// that ends a step early: dropped where it was used, each consumer cost
/// its thread 100 ms (a one-batch job's exit, a tokio worker when a read
/// ends early, every monitoring commit). Nothing is committed or left
/// undone by the close, so no one waits for it; a process that exits
/// meanwhile just ends it.
pub(super) struct Detached<T: Send + 'static>(Option<T>);

impl<T: Send + 'static> Detached<T> {
    pub(super) fn new(client: T) -> Self {
        Self(Some(client))
    }
}

impl<T: Send + 'static> std::ops::Deref for Detached<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.0.as_ref().expect("a client is present until dropped")
    }
}

impl<T: Send + 'static> Drop for Detached<T> {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            // Should no thread start, the client is dropped here instead.
            let _ = std::thread::Builder::new()
                .name("lakestream-kafka-close".into())
                .spawn(move || drop(client));
        }
    }
}

/// A request's error, with the connection's: a request that found no
/// broker after a TLS or authentication failure fails for good, naming
/// that failure (a retry would meet it again).
pub(super) fn connection_err(
    source_name: &str,
    what: &str,
    e: KafkaError,
    connection: &ConnectionErrors,
) -> Error {
    match connection.fatal() {
        Some(why) if is_transient(&e) => Error::Kafka {
            source_name: source_name.to_string(),
            what: what.to_string(),
            reason: format!(
                "{e}: the brokers refused the connection: {why}; check the source's \
                 kafka.security.protocol, kafka.ssl.* and kafka.sasl.* settings"
            ),
            transient: false,
        },
        _ => Error::Kafka {
            source_name: source_name.to_string(),
            what: what.to_string(),
            reason: e.to_string(),
            transient: is_transient(&e),
        },
    }
}

fn create_err(source_name: &str, e: KafkaError) -> Error {
    let reason = match e {
        // librdkafka's words name the setting and repeat its value, which
        // may be a secret (a password, a client secret): the value is left
        // out.
        KafkaError::ClientConfig(_, desc, key, value) => {
            let desc = if value.is_empty() {
                desc
            } else {
                desc.replace(&value, "***")
            };
            format!("librdkafka refused the setting kafka.{key}: {desc}")
        }
        e => e.to_string(),
    };
    Error::Kafka {
        source_name: source_name.to_string(),
        what: "create consumer".into(),
        reason,
        transient: false,
    }
}

/// Errors that a later attempt may not see (broker down, timeouts).
fn is_transient(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::OperationTimedOut
                | RDKafkaErrorCode::RequestTimedOut
                | RDKafkaErrorCode::LeaderNotAvailable
                | RDKafkaErrorCode::NotLeaderForPartition
                | RDKafkaErrorCode::NetworkException
                | RDKafkaErrorCode::BrokerNotAvailable
                | RDKafkaErrorCode::UnknownTopicOrPartition
                | RDKafkaErrorCode::CoordinatorLoadInProgress
                | RDKafkaErrorCode::NotCoordinator
        )
    ) || matches!(e, KafkaError::MetadataFetch(_))
}

/// `fetch.wait.max.ms` of the consumers that read small ranges and wait
/// for new records (docs/sql.md, "Reading and latency"): an idle reader
/// asks again every 10 ms.
pub const LIVE_FETCH_WAIT_MAX_MS: u64 = 10;

/// `fetch.queue.backoff.ms` of reading consumers: how long librdkafka
/// waits to fetch again after the consumer's queue passed its thresholds.
pub const FETCH_QUEUE_BACKOFF_MS: u64 = 10;

/// A read stream whose ranges hold at most this many offsets is read by a
/// live consumer; a larger one (a backlog being caught up) by a bulk
/// consumer with librdkafka's fetch defaults.
pub const LIVE_RANGE_OFFSETS: i64 = 10_000;

/// Which consumers read a range (see [`LIVE_RANGE_OFFSETS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReaderKind {
    /// Small ranges and waits for new records: a short fetch wait.
    Live,
    /// Large ranges: librdkafka's fetch defaults.
    Bulk,
}

fn client_config(o: &KafkaSourceOptions) -> ClientConfig {
    client_config_for(o, None)
}

/// The settings of a reading consumer of `kind`, or (`None`) of a client
/// that does not fetch. The user's `kafka.*` settings come last and win.
fn client_config_for(o: &KafkaSourceOptions, kind: Option<ReaderKind>) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &o.bootstrap_servers)
        // `assign()` needs some group id; nothing is ever committed under it.
        .set("group.id", "lakestream-reader")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false")
        .set("isolation.level", o.isolation_level.as_str())
        // A planned offset that no longer exists must be an error, never a
        // silent jump.
        .set("auto.offset.reset", "error")
        .set("client.id", "lakestream");
    if kind.is_some() {
        // A reader that fills its queue past `queued.min.messages` (a
        // backlog fetched faster than it is decoded) has librdkafka stop
        // fetching for `fetch.queue.backoff.ms`, 1 s by default, even once
        // the queue is drained: a batch then stalled for a second.
        c.set("fetch.queue.backoff.ms", FETCH_QUEUE_BACKOFF_MS.to_string());
    }
    if kind == Some(ReaderKind::Live) {
        // A kept live reader's fetch waits at most this long for new
        // records: brokers that hold a fetch for its whole wait even when
        // records arrive would otherwise delay a record by up to
        // librdkafka's default 500 ms.
        c.set("fetch.wait.max.ms", LIVE_FETCH_WAIT_MAX_MS.to_string());
    }
    for (k, v) in &o.client_config {
        c.set(k, v);
    }
    c
}

#[async_trait]
impl Source for KafkaSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    async fn recover(&self, ends: &[Offset]) -> Result<()> {
        for e in ends {
            self.parse(e)?;
        }
        Ok(())
    }

    async fn restore(&self, _snapshot: Option<&Offset>) -> Result<()> {
        // A bound frozen by an earlier available-now run (or watermarks of an
        // earlier start) must not cap this run.
        *self.state.lock().expect("kafka state") = KafkaState::default();
        self.membership.forget();
        self.live_readers.clear();
        self.bulk_readers.clear();
        self.skipped.lock().expect("kafka skipped").clear();
        self.rejected.lock().expect("kafka rejected").clear();
        Ok(())
    }

    fn take_skipped(&self) -> Vec<Skipped> {
        std::mem::take(&mut *self.skipped.lock().expect("kafka skipped"))
    }

    fn take_rejected(&self) -> Vec<crate::Rejected> {
        std::mem::take(&mut *self.rejected.lock().expect("kafka rejected"))
    }

    fn unavailable_timeout(&self) -> Duration {
        self.options.unavailable_timeout
    }

    fn identity(&self) -> SourceIdentity {
        let location = match &self.options.topics {
            Topics::List(list) => {
                let mut l = list.clone();
                l.sort();
                format!("topics {}", l.join(","))
            }
            Topics::Pattern(re) => format!("topic pattern {}", re.as_str()),
        };
        // The isolation level decides where a planned range may end (the
        // last stable offset or the high watermark): a change would make a
        // checkpoint's offsets look truncated or reach past open
        // transactions.
        let location = format!("{location} ({})", self.options.isolation_level.as_str());
        // A checkpoint of one share of the partitions must not be reused by
        // another.
        let location = match &self.options.partitions {
            Some(p) => format!(
                "{location} partitions {}",
                p.iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            None => location,
        };
        let location = match &self.options.group_id {
            Some(g) => format!("{location} group {g}"),
            None => location,
        };
        SourceIdentity {
            kind: "kafka".into(),
            location,
        }
    }

    async fn freeze(&self) -> Result<()> {
        if self.options.group_id.is_some() {
            return Err(Error::InvalidOption {
                source_name: self.name.clone(),
                option: "group_id".into(),
                reason: "group mode runs continuously (partitions move between processes): use \
                         a continuous trigger, or static 'partitions' for available-now"
                    .into(),
            });
        }
        let marks = self.startup_watermarks().await?;
        let frozen = marks
            .marks
            .into_iter()
            .map(|(t, ps)| (t, ps.into_iter().map(|(p, (_, hi))| (p, hi)).collect()))
            .collect();
        self.state.lock().expect("kafka state").frozen = Some(frozen);
        Ok(())
    }

    async fn initial_offset(&self) -> Result<Option<Offset>> {
        if self.options.group_id.is_some() {
            // Each partition starts at its position in the table.
            return Ok(None);
        }
        let marks = self.startup_watermarks().await?;
        let topics: Vec<String> = marks.marks.keys().cloned().collect();
        let initial = KafkaOffset {
            partitions: self.resolve_starting(&marks).await?,
            ending: self
                .options
                .ending_offsets
                .as_ref()
                .map(|spec| resolve_ending(spec, &marks)),
            added: PartitionOffsets::new(),
            data_loss: Vec::new(),
            topic_ids: self.topic_ids(topics).await?,
            group_from: None,
        };
        Ok(Some(
            serde_json::to_value(initial).expect("offset serializes"),
        ))
    }

    async fn plan(&self, start: Option<&Offset>) -> Result<Option<Offset>> {
        if self.options.group_id.is_some() {
            return Ok(self
                .plan_group()
                .await?
                .map(|o| serde_json::to_value(o).expect("offset serializes")));
        }
        let prev = match start {
            Some(s) => self.parse(s)?,
            // Used without an engine that stores the initial offset.
            None => match self.initial_offset().await? {
                Some(v) => self.parse(&v)?,
                None => KafkaOffset::default(),
            },
        };
        // The first plan may use the watermarks read while starting; every
        // later plan asks the broker.
        let startup = self.state.lock().expect("kafka state").startup_marks.take();
        let marks = match startup {
            Some((at, marks)) if at.elapsed() < STARTUP_MARKS_AGE => marks,
            _ => self.watermarks().await?,
        };
        Ok(self
            .plan_next(&prev, &marks)
            .await?
            .map(|o| serde_json::to_value(o).expect("offset serializes")))
    }

    fn read(
        &self,
        start: Option<&Offset>,
        end: &Offset,
        partitions: usize,
    ) -> Result<Vec<BatchStream>> {
        let end = self.parse(end)?;
        let start = match (&end.group_from, start) {
            (Some(from), _) => KafkaOffset {
                partitions: from.clone(),
                ..Default::default()
            },
            (None, Some(s)) => self.parse(s)?,
            (None, None) => KafkaOffset::default(),
        };
        let ranges = self.ranges(&start, &end)?;
        let n = partitions
            .min(self.options.consumers)
            .max(1)
            .min(ranges.len().max(1));
        let mut groups: Vec<Vec<PartitionRange>> = vec![Vec::new(); n];
        for (i, r) in ranges.into_iter().enumerate() {
            groups[i % n].push(r);
        }
        Ok(groups
            .into_iter()
            .filter(|g| !g.is_empty())
            .map(|g| self.range_stream(g))
            .collect())
    }

    async fn wait_for_data(&self, after: Option<&Offset>, max: Duration) {
        let started = Instant::now();
        // Group mode: the partitions owned move between plans, and the
        // plan asks the group; waiting on a fetch is for fixed partitions.
        let after = match after.map(|a| self.parse(a)) {
            Some(Ok(a)) if self.options.group_id.is_none() => a,
            _ => return tokio::time::sleep(max).await,
        };
        let starts: Vec<((String, i32), i64)> = after
            .partitions
            .iter()
            .flat_map(|(t, ps)| ps.iter().map(move |(p, o)| ((t.clone(), *p), *o)))
            .collect();
        if starts.is_empty() {
            return tokio::time::sleep(max).await;
        }
        let waited = self
            .live_readers
            .wait_for_message(
                &client_config_for(&self.options, Some(ReaderKind::Live)),
                &starts,
                max,
                self.options.consumers,
            )
            .await;
        if let Err(e) = waited {
            // The next plan reports what is wrong; until then, no busy loop.
            tracing::debug!(source = %self.name, error = %e, "waiting for records failed");
            tokio::time::sleep(max.saturating_sub(started.elapsed())).await;
        }
    }

    fn latest(&self) -> Option<crate::Latest> {
        self.state.lock().expect("kafka state").latest.clone()
    }

    fn describe(&self, start: Option<&Offset>, end: &Offset) -> String {
        let Ok(end) = self.parse(end) else {
            return "offsets ?".into();
        };
        let start = match &end.group_from {
            Some(from) => KafkaOffset {
                partitions: from.clone(),
                ..Default::default()
            },
            None => start.and_then(|s| self.parse(s).ok()).unwrap_or_default(),
        };
        let ranges = self.ranges(&start, &end).unwrap_or_default();
        let total: i64 = ranges.iter().map(|r| r.end - r.start).sum();
        let parts = ranges.len();
        let mut d = format!("{total} offsets over {parts} partitions");
        for l in &end.data_loss {
            d.push_str(&format!(
                "; data loss skipped {}/{}: expected offset {}, resumed at {}",
                l.topic, l.partition, l.expected, l.resumed_at
            ));
        }
        d
    }

    fn table_positions(&self) -> Option<&dyn crate::TablePositions> {
        self.options
            .group_id
            .is_some()
            .then_some(self as &dyn crate::TablePositions)
    }

    async fn committed(&self, end: &Offset) -> Result<()> {
        if self.options.group_id.is_some() {
            self.membership.advance(&self.parse(end)?);
            return Ok(());
        }
        let Some(group) = self.options.commit_group.clone() else {
            return Ok(());
        };
        let end = self.parse(end)?;
        let mut cfg = self.client_config();
        cfg.set("group.id", &group);
        let name = self.name.clone();
        tokio::task::spawn_blocking(move || -> Result<()> {
            let consumer: Detached<BaseConsumer> =
                Detached::new(cfg.create().map_err(|e| create_err(&name, e))?);
            let mut tpl = TopicPartitionList::new();
            for (t, ps) in &end.partitions {
                for (p, o) in ps {
                    let _ = tpl.add_partition_offset(t, *p, KOffset::Offset(*o));
                }
            }
            consumer
                .commit(&tpl, rdkafka::consumer::CommitMode::Sync)
                .map_err(|e| Error::Kafka {
                    source_name: name,
                    what: format!("commit offsets to group {group} (monitoring only)"),
                    reason: e.to_string(),
                    transient: true,
                })
        })
        .await
        .unwrap_or(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::producer::Producer;

    use super::read::*;
    use super::*;

    /// A reader's consumer (a group id, partitions assigned, fetching) is
    /// closed on a thread of its own: dropping it returns at once, where
    /// rdkafka's own drop waits out a 100 ms poll first, which a one-batch
    /// Kafka job's exit would wait for. librdkafka's mock broker serves
    /// the fetches.
    #[test]
    fn a_dropped_consumer_does_not_hold_up_its_thread() {
        let mock = rdkafka::mocking::MockCluster::new(1).unwrap();
        mock.create_topic("t", 1, 1).unwrap();
        let make = || -> BaseConsumer {
            let c: BaseConsumer = client_config(&KafkaSourceOptions::new(
                &mock.bootstrap_servers(),
                Topics::List(vec!["t".into()]),
            ))
            .create()
            .unwrap();
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition_offset("t", 0, KOffset::Offset(0))
                .unwrap();
            c.assign(&tpl).unwrap();
            // Connected and fetching (the partition is empty).
            assert!(c.poll(Duration::from_millis(300)).is_none());
            c
        };
        let plain = make();
        let started = Instant::now();
        drop(plain);
        let plain = started.elapsed();
        let detached = Detached::new(make());
        let started = Instant::now();
        drop(detached);
        let detached = started.elapsed();
        assert!(
            detached < Duration::from_millis(50),
            "dropping a detached consumer took {detached:?} (rdkafka's own drop: {plain:?})"
        );
    }

    /// librdkafka's mock broker, owned by the producer client it is
    /// reached through, recording the requests it serves.
    struct TrackedMock {
        producer: rdkafka::producer::BaseProducer,
        cluster: *mut rdkafka::bindings::rd_kafka_mock_cluster_t,
    }

    impl TrackedMock {
        fn new() -> Self {
            let producer: rdkafka::producer::BaseProducer = ClientConfig::new()
                .set("test.mock.num.brokers", "1")
                // Records go out in batches of 50: a fetch of one batch
                // stands for a fetch of many.
                .set("batch.num.messages", "50")
                .set("linger.ms", "100")
                .create()
                .unwrap();
            // SAFETY: the handle is the producer's own, valid while it
            // lives; the cluster it returns lives as long as the producer.
            let cluster = unsafe {
                rdkafka::bindings::rd_kafka_handle_mock_cluster(producer.client().native_ptr())
            };
            assert!(!cluster.is_null());
            Self { producer, cluster }
        }

        fn cluster(
            &self,
        ) -> rdkafka::mocking::MockCluster<'_, rdkafka::producer::DefaultProducerContext> {
            self.producer.client().mock_cluster().unwrap()
        }

        /// `n` records into each partition of a new `topic`.
        fn produce(&self, topic: &str, partitions: i32, n: usize) {
            self.cluster().create_topic(topic, partitions, 1).unwrap();
            for p in 0..partitions {
                self.produce_more(topic, p, n);
            }
        }

        /// `n` more records into partition `p` of `topic`.
        fn produce_more(&self, topic: &str, p: i32, n: usize) {
            use rdkafka::producer::BaseRecord;
            for i in 0..n {
                let v = format!("r{i}");
                self.producer
                    .send(BaseRecord::<(), String>::to(topic).payload(&v).partition(p))
                    .unwrap();
            }
            self.producer.flush(Duration::from_secs(10)).unwrap();
        }

        /// Record the requests served from now on (forgetting earlier ones).
        fn track(&self) {
            // SAFETY: `cluster` is valid while the producer lives.
            unsafe {
                rdkafka::bindings::rd_kafka_mock_clear_requests(self.cluster);
                rdkafka::bindings::rd_kafka_mock_start_request_tracking(self.cluster);
            }
        }

        /// How many offset lookups (ListOffsets requests) were served since
        /// [`Self::track`].
        fn offset_lookups(&self) -> usize {
            let list_offsets = rdkafka::types::RDKafkaApiKey::ListOffsets as i16;
            let mut n = 0usize;
            // SAFETY: the array and its requests are ours to read and then
            // destroy, as librdkafka's mock API documents.
            unsafe {
                let reqs = rdkafka::bindings::rd_kafka_mock_get_requests(self.cluster, &mut n);
                let got = (0..n)
                    .filter(|&i| {
                        rdkafka::bindings::rd_kafka_mock_request_api_key(*reqs.add(i))
                            == list_offsets
                    })
                    .count();
                rdkafka::bindings::rd_kafka_mock_request_destroy_array(reqs, n);
                got
            }
        }
    }

    /// A string source over `topic` of `mock`, restored as at a start.
    async fn string_source(mock: &TrackedMock, topic: &str) -> KafkaSource {
        let bootstrap = mock.cluster().bootstrap_servers();
        let mut o = KafkaSourceOptions::new(&bootstrap, Topics::List(vec![topic.into()]));
        o.format = ValueFormat::String;
        // One batch of records per fetch, and no fetching ahead of what
        // the reader takes past a batch.
        o.client_config
            .insert("max.partition.fetch.bytes".into(), "1000".into());
        o.client_config
            .insert("queued.min.messages".into(), "10".into());
        let source = KafkaSource::try_new("records", None, o).unwrap();
        source.restore(None).await.unwrap();
        source
    }

    async fn read_all(source: &KafkaSource, start: Offset, end: Offset) -> usize {
        let mut rows = 0;
        for mut stream in source.read(Some(&start), &end, 1).unwrap() {
            while let Some(b) = stream.next().await {
                rows += b.unwrap().num_rows();
            }
        }
        rows
    }

    /// A plan asks for the watermarks of all of a topic's partitions in
    /// two offset lookups (the earliest offsets and the latest), not two a
    /// partition, and gets every partition's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_plan_looks_up_every_partitions_offsets_in_two_requests() {
        let mock = TrackedMock::new();
        mock.produce("wide", 8, 3);
        let source = string_source(&mock, "wide").await;
        // The first plan of a run (it may also ask for the start's offsets).
        let first = source.plan(None).await.unwrap().expect("records to read");
        // A later plan, from the first batch's end, after two records more.
        mock.produce_more("wide", 5, 2);
        mock.track();
        let end = source
            .plan(Some(&first))
            .await
            .unwrap()
            .expect("new records");
        let lookups = mock.offset_lookups();
        for p in 0..8 {
            assert_eq!(first["partitions"]["wide"][p.to_string()], 3, "{first}");
            let want = if p == 5 { 5 } else { 3 };
            assert_eq!(end["partitions"]["wide"][p.to_string()], want, "{end}");
        }
        assert_eq!(lookups, 2, "offset lookups for a plan over 8 partitions");
    }

    /// A reader that is receiving records does not stop to ask whether its
    /// ranges still exist, even when each fetch takes longer than its
    /// receive wait: those lookups queue behind the fetches on the broker.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_that_receives_records_asks_for_no_watermarks() {
        let mock = TrackedMock::new();
        mock.produce("slow", 1, 300);
        let source = string_source(&mock, "slow").await;
        let at = |o: i64| serde_json::json!({"partitions": {"slow": {"0": o}}});
        // The consumer connects on a fast broker and is kept at offset 1.
        assert_eq!(read_all(&source, at(0), at(1)).await, 1);
        // Then every answer takes 600 ms: each batch of 50 records arrives
        // after the reader's 500 ms receive wait ran out.
        mock.cluster()
            .broker_round_trip_time(1, Duration::from_millis(600))
            .unwrap();
        mock.track();
        let started = Instant::now();
        assert_eq!(read_all(&source, at(1), at(300)).await, 299);
        let took = started.elapsed();
        let lookups = mock.offset_lookups();
        assert!(
            took > Duration::from_millis(1500),
            "the slow broker served the read in {took:?}: the test shows nothing"
        );
        assert_eq!(lookups, 0, "offset lookups while reading for {took:?}");
    }

    #[test]
    fn a_reader_tells_a_deleted_start_and_a_gone_tail_from_a_range_still_being_read() {
        // Still readable: inside the log, or done.
        assert_eq!(range_gap(10, 20, 0, 25), None);
        assert_eq!(range_gap(10, 20, 0, 15), None);
        assert_eq!(range_gap(20, 20, 30, 40), None);
        // Retention deleted the start: skip to the earliest offset, or the
        // whole rest when the earliest lies past the end.
        assert_eq!(
            range_gap(10, 20, 15, 25),
            Some(RangeGap::StartDeleted { to: 15 })
        );
        assert_eq!(
            range_gap(10, 20, 30, 40),
            Some(RangeGap::StartDeleted { to: 20 })
        );
        // The reader reached the log's end before the planned end.
        assert_eq!(range_gap(12, 20, 0, 12), Some(RangeGap::TailGone));
        assert_eq!(range_gap(10, 20, 0, 3), Some(RangeGap::TailGone));
    }

    #[test]
    fn a_start_past_the_end_resumes_at_the_end_unless_the_topic_id_changed() {
        // Inside the partition: nothing lost.
        assert_eq!(resume_point(5, 0, 10, None, None), None);
        assert_eq!(resume_point(10, 0, 10, Some("a"), Some("a")), None);
        // Deleted by retention: from the earliest.
        let (at, detail) = resume_point(2, 4, 10, None, None).unwrap();
        assert_eq!(at, 4);
        assert!(detail.contains("offsets 2..4"), "{detail}");
        // Truncated (same or unknown id): from the end, so nothing the
        // table holds is read again.
        for (was, now) in [
            (Some("a"), Some("a")),
            (None, Some("a")),
            (Some("a"), None),
            (None, None),
        ] {
            let (at, detail) = resume_point(12, 0, 7, was, now).unwrap();
            assert_eq!(at, 7, "{was:?} {now:?}");
            assert!(detail.contains("offsets 7..12"), "{detail}");
        }
        // Recreated, proven by the id: past the new end, the new topic from
        // its start; inside it (batches may have read it since the last
        // check), on from the offset, never a record twice.
        for (s, lo, hi, at_expected) in [(12, 0, 7, 0), (5, 0, 10, 5), (0, 0, 0, 0), (3, 4, 9, 4)] {
            let (at, detail) = resume_point(s, lo, hi, Some("a"), Some("b")).unwrap();
            assert_eq!(at, at_expected, "{s} {lo} {hi}");
            assert!(detail.contains("recreated"), "{detail}");
        }
    }
}
