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

mod source;
mod source_impl;
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

pub mod connector;
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

impl KafkaOffset {
    /// The records of the range from `start` (`None`: the query's first
    /// batch) to this offset, one line per partition that has any:
    /// `topic/partition: offsets [s, e) (n records)`. A partition first
    /// seen in the batch starts where it was added; one whose start was
    /// lost starts where reading resumed.
    pub fn describe_range(&self, start: Option<&KafkaOffset>) -> Vec<String> {
        let mut out = Vec::new();
        for (topic, partitions) in &self.partitions {
            for (&p, &e) in partitions {
                let at = |o: &PartitionOffsets| o.get(topic).and_then(|t| t.get(&p)).copied();
                let s = start
                    .and_then(|s| at(&s.partitions))
                    .or_else(|| at(&self.added))
                    .unwrap_or(e);
                let s = self
                    .data_loss
                    .iter()
                    .find(|l| l.topic == *topic && l.partition == p)
                    .map_or(s, |l| l.resumed_at);
                if e > s {
                    out.push(format!(
                        "{topic}/{p}: offsets [{s}, {e}) ({} records)",
                        e - s
                    ));
                }
            }
        }
        if out.is_empty() {
            out.push("no records".into());
        }
        out
    }
}

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

#[cfg(test)]
mod tests;
