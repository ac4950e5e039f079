//! [`KafkaSink`]: a Kafka topic as a query's output, each batch produced in
//! one Kafka transaction that also commits the batch id.
//!
//! The batch id is committed the way Kafka's own exactly-once
//! consume-transform-produce commits its input position (KIP-98, KIP-447):
//! as a consumer-group offset sent to the transaction
//! (`send_offsets_to_transaction`). The group is named for the query
//! (`lakestream-<query id>`) and the offset is kept on partition 0 of the
//! output topic, at `batch id + 1`. The broker applies it when, and only
//! when, the transaction commits, so the group's committed offset says
//! exactly which batches the topic holds: a replay finds its batch there
//! and commits nothing.
//!
//! Writers encode rows into records (JSON values; see [`crate::encode`]);
//! [`Sink::commit`] then begins the transaction, produces them, sends the
//! offset and commits. A transaction is open only while a batch commits,
//! never while its query runs, so `transaction.timeout.ms` bounds the
//! produce of one batch's records, not the batch.
//!
//! The producer's `transactional.id` is derived from the query id and the
//! topic. The first commit of a process calls `init_transactions`, which
//! fences an earlier process with the same id (a zombie's open
//! transaction is aborted, its later commits refused) and waits out a
//! transaction whose outcome is in doubt; the marker is then read again.
//! Any failed commit drops the producer, so the next attempt starts with
//! that same fencing and reading.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow::datatypes::SchemaRef;
use arrow::record_batch::RecordBatch;
use async_trait::async_trait;
use lakestream_sink::{
    BatchWriter, CommitInfo, CommitOutcome, Error, Result, Sink, Staged, WriteMode,
};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerGroupMetadata};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::encode::{Encoded, RecordLayout};

/// Settings of a [`KafkaSink`].
#[derive(Clone)]
pub struct KafkaSinkOptions {
    /// `HOST:PORT[,HOST:PORT]`.
    pub bootstrap_servers: String,
    /// The topic written (it must exist).
    pub topic: String,
    /// librdkafka settings (TLS, SASL, `compression.type`, ...), without
    /// the keys the sink owns ([`OWNED_PRODUCER_KEYS`]).
    pub client_config: BTreeMap<String, String>,
    /// The producer's `transactional.id` (default
    /// `lakestream-<query id>-<topic>`).
    pub transactional_id: Option<String>,
    /// `transaction.timeout.ms`: the longest one batch's produce and
    /// commit may take before the broker aborts it.
    pub transaction_timeout: Duration,
    /// How long a batch waits for unreachable brokers before the run
    /// fails naming them.
    pub unavailable_timeout: Duration,
}

/// Client settings the sink sets itself, and why: a job may not change them.
pub const OWNED_PRODUCER_KEYS: &[(&str, &str)] = &[
    (
        "transactional.id",
        "use the table option 'transactional_id' (default: derived from the query id and the topic)",
    ),
    (
        "enable.idempotence",
        "a transactional producer is idempotent; exactly-once needs it on",
    ),
    ("acks", "a transactional producer writes with acks=all"),
    (
        "isolation.level",
        "the sink reads its batch marker read_committed; readers of the topic set their own",
    ),
    (
        "transaction.timeout.ms",
        "use the table option 'transaction_timeout'",
    ),
];

impl std::fmt::Debug for KafkaSinkOptions {
    /// Client settings may hold secrets: only their keys are shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSinkOptions")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("topic", &self.topic)
            .field("client_config_keys", &self.client_config.keys())
            .field("transactional_id", &self.transactional_id)
            .field("transaction_timeout", &self.transaction_timeout)
            .field("unavailable_timeout", &self.unavailable_timeout)
            .finish()
    }
}

impl KafkaSinkOptions {
    /// Options for `topic` at `bootstrap_servers`: the default timeouts
    /// (transactions 60 s, unavailable brokers 60 s), no extra settings.
    pub fn new(bootstrap_servers: &str, topic: &str) -> Self {
        Self {
            bootstrap_servers: bootstrap_servers.to_string(),
            topic: topic.to_string(),
            client_config: BTreeMap::new(),
            transactional_id: None,
            transaction_timeout: Duration::from_secs(60),
            unavailable_timeout: Duration::from_secs(60),
        }
    }
}

/// Delivery failures of the records of the open transaction.
#[derive(Default)]
struct Deliveries {
    failed: AtomicU64,
    first: Mutex<Option<String>>,
}

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if let Err((e, m)) = result {
            use rdkafka::Message;
            self.failed.fetch_add(1, Ordering::Relaxed);
            let mut first = self.first.lock().unwrap_or_else(|e| e.into_inner());
            first.get_or_insert_with(|| format!("{}/{}: {e}", m.topic(), m.partition()));
        }
    }
}

type TxnProducer = ThreadedProducer<Deliveries>;

/// The producer of one query, after `init_transactions`.
struct Txn {
    query_id: String,
    producer: Arc<TxnProducer>,
    /// Whether this producer has not committed yet: its first commit reads
    /// the marker (a predecessor's transaction may have landed).
    fresh: bool,
}

/// The marker reader of one query: a consumer of the query's group that
/// never subscribes.
struct Marker {
    query_id: String,
    consumer: Arc<BaseConsumer>,
}

/// A Kafka topic as a query's output; see the module docs.
pub struct KafkaSink {
    options: KafkaSinkOptions,
    identity: String,
    layout: Mutex<Option<RecordLayout>>,
    txn: tokio::sync::Mutex<Option<Txn>>,
    marker: Mutex<Option<Marker>>,
    /// The marker last seen (`batch id + 1`; 0: none).
    version: AtomicU64,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink")
            .field("identity", &self.identity)
            .finish()
    }
}

/// The consumer group a query's batch ids are committed to.
pub fn marker_group(query_id: &str) -> String {
    format!("lakestream-{query_id}")
}

impl KafkaSink {
    /// A sink producing to `options.topic`. Nothing is contacted until
    /// [`Sink::open`].
    pub fn try_new(options: KafkaSinkOptions) -> Result<Self> {
        let identity = format!("kafka://{}/{}", options.bootstrap_servers, options.topic);
        let invalid = |reason: String| Error::InvalidConfig {
            table: identity.clone(),
            reason,
        };
        if options.topic.is_empty() {
            return Err(invalid(
                "no topic: write LOCATION 'kafka://HOST:PORT/TOPIC'".into(),
            ));
        }
        for key in options.client_config.keys() {
            if let Some((_, why)) = OWNED_PRODUCER_KEYS.iter().find(|(k, _)| k == key) {
                return Err(invalid(format!(
                    "the setting {key} is the sink's own: {why}"
                )));
            }
        }
        if options.transaction_timeout < Duration::from_secs(1)
            || options.transaction_timeout > Duration::from_secs(900)
        {
            return Err(invalid(format!(
                "transaction_timeout {:?} must be between 1 s and 15 minutes (the broker's \
                 transaction.max.timeout.ms is 15 minutes by default)",
                options.transaction_timeout
            )));
        }
        Ok(Self {
            identity,
            options,
            layout: Mutex::new(None),
            txn: tokio::sync::Mutex::new(None),
            marker: Mutex::new(None),
            version: AtomicU64::new(0),
        })
    }

    fn config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        for (k, v) in &self.options.client_config {
            c.set(k, v);
        }
        c.set("bootstrap.servers", &self.options.bootstrap_servers);
        c
    }

    fn table_error(&self, msg: String) -> Error {
        Error::Table {
            table: self.identity.clone(),
            source: msg.into(),
        }
    }

    fn timeout(&self) -> Duration {
        self.options.unavailable_timeout
    }

    /// What a timed-out or failed client call tells the user.
    fn unreachable(&self, what: &str, e: &KafkaError) -> String {
        format!(
            "{what}: {e}; the brokers {} did not answer within unavailable_timeout {:?}: check \
             that they run and are reachable, and the TLS/SASL settings",
            self.options.bootstrap_servers,
            self.timeout()
        )
    }

    /// The marker reader for `query_id`, created on first use.
    fn marker(&self, query_id: &str) -> Result<Arc<BaseConsumer>> {
        let mut marker = self.marker.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = marker.as_ref().filter(|m| m.query_id == query_id) {
            return Ok(m.consumer.clone());
        }
        let consumer: BaseConsumer = self
            .config()
            .set("group.id", marker_group(query_id))
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .create()
            .map_err(|e| self.table_error(format!("cannot create the Kafka client: {e}")))?;
        let consumer = Arc::new(consumer);
        *marker = Some(Marker {
            query_id: query_id.to_string(),
            consumer: consumer.clone(),
        });
        Ok(consumer)
    }

    /// The batch id committed last for `query_id`, read fresh.
    async fn read_marker(&self, query_id: &str) -> Result<Option<u64>> {
        let consumer = self.marker(query_id)?;
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&self.options.topic, 0);
        let timeout = self.timeout();
        let read = tokio::task::spawn_blocking(move || consumer.committed_offsets(tpl, timeout))
            .await
            .map_err(|e| self.table_error(format!("reading the batch marker: {e}")))?
            .map_err(|e| {
                self.table_error(self.unreachable(
                    &format!(
                        "reading the committed batch of group {}",
                        marker_group(query_id)
                    ),
                    &e,
                ))
            })?;
        let offset = read
            .elements()
            .first()
            .map(|e| e.offset())
            .unwrap_or(Offset::Invalid);
        Ok(match offset {
            Offset::Offset(n) if n > 0 => {
                self.version.fetch_max(n as u64, Ordering::Relaxed);
                Some(n as u64 - 1)
            }
            _ => None,
        })
    }

    /// A transactional producer for `query_id`, after `init_transactions`
    /// (which fences earlier producers with the same id).
    async fn init_producer(&self, query_id: &str) -> Result<Txn> {
        let id = self
            .options
            .transactional_id
            .clone()
            .unwrap_or_else(|| format!("lakestream-{query_id}-{}", self.options.topic));
        let ms = self.options.transaction_timeout.as_millis().to_string();
        let mut config = self.config();
        config
            .set("transactional.id", &id)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("transaction.timeout.ms", &ms);
        if !self
            .options
            .client_config
            .contains_key("message.timeout.ms")
        {
            config.set("message.timeout.ms", &ms);
        }
        let producer: TxnProducer = config
            .create_with_context(Deliveries::default())
            .map_err(|e| self.table_error(format!("cannot create the Kafka producer: {e}")))?;
        let producer = Arc::new(producer);
        let p = producer.clone();
        let timeout = self.timeout();
        tokio::task::spawn_blocking(move || p.init_transactions(timeout))
            .await
            .map_err(|e| self.table_error(format!("init_transactions: {e}")))?
            .map_err(|e| {
                self.table_error(
                    self.unreachable(&format!("starting the transactional producer {id}"), &e),
                )
            })?;
        Ok(Txn {
            query_id: query_id.to_string(),
            producer,
            fresh: true,
        })
    }
}

#[async_trait]
impl Sink for KafkaSink {
    async fn open(&self, schema: SchemaRef) -> Result<()> {
        let layout = RecordLayout::new(&schema).map_err(|reason| Error::InvalidConfig {
            table: self.identity.clone(),
            reason,
        })?;
        *self.layout.lock().unwrap_or_else(|e| e.into_inner()) = Some(layout);
        // The topic must exist: a job never creates one with the broker's
        // defaults by accident.
        let client: BaseConsumer = self
            .config()
            .create()
            .map_err(|e| self.table_error(format!("cannot create the Kafka client: {e}")))?;
        let topic = self.options.topic.clone();
        let timeout = self.timeout();
        let metadata =
            tokio::task::spawn_blocking(move || client.fetch_metadata(Some(&topic), timeout))
                .await
                .map_err(|e| self.table_error(format!("reading the topic's metadata: {e}")))?
                .map_err(|e| {
                    self.table_error(self.unreachable("reading the topic's metadata", &e))
                })?;
        let found = metadata
            .topics()
            .iter()
            .find(|t| t.name() == self.options.topic);
        match found {
            Some(t) if t.error().is_none() && !t.partitions().is_empty() => Ok(()),
            _ => Err(self.table_error(format!(
                "topic {} does not exist at {}: create it first (kafka-topics.sh --create \
                 --topic {} --partitions N)",
                self.options.topic, self.options.bootstrap_servers, self.options.topic
            ))),
        }
    }

    async fn accepts(&self, write: &WriteMode) -> Result<()> {
        let keyed = self
            .layout
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(RecordLayout::has_key);
        let reason = match write {
            WriteMode::Append => return Ok(()),
            WriteMode::Upsert { .. } if keyed => return Ok(()),
            WriteMode::Upsert { keys } => format!(
                "update mode on a Kafka topic needs a _key column: each batch's changed rows \
                 are new records, and the newest record per key is the row (a changelog, \
                 compacted topics keep just that); add e.g. CAST({} AS VARCHAR) AS _key",
                keys.first().map(String::as_str).unwrap_or("key")
            ),
            WriteMode::ReplaceAll { .. } => "complete mode rewrites the whole result each \
                batch, which a Kafka topic cannot take back; use update mode with a _key \
                column, or a Delta table"
                .to_string(),
        };
        Err(Error::InvalidConfig {
            table: self.identity.clone(),
            reason,
        })
    }

    async fn committed_batch(&self, query_id: &str) -> Result<Option<u64>> {
        self.read_marker(query_id).await
    }

    async fn begin(&self, batch_id: u64) -> Result<Box<dyn BatchWriter>> {
        let layout = self
            .layout
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| Error::InvalidConfig {
                table: self.identity.clone(),
                reason: "begin before open".into(),
            })?;
        Ok(Box::new(KafkaWriter {
            identity: self.identity.clone(),
            layout,
            batch_id,
            encoded: Vec::new(),
            rows: 0,
            bytes: 0,
        }))
    }

    async fn commit(&self, staged: Staged, info: &CommitInfo) -> Result<CommitOutcome> {
        staged.check_violations()?;
        let batch_id = info.batch_id;
        let parts: Vec<Vec<Encoded>> = staged.into_parts(&self.identity)?;
        let commit_err = |msg: String| Error::Commit {
            table: self.identity.clone(),
            batch_id,
            source: msg.into(),
        };
        let mut slot = self.txn.lock().await;
        if slot.as_ref().is_none_or(|t| t.query_id != info.query_id) {
            *slot = None;
            *slot = Some(self.init_producer(&info.query_id).await?);
        }
        let txn = slot.as_mut().expect("set above");
        if txn.fresh
            && let Some(done) = self.read_marker(&info.query_id).await?
            && done >= batch_id
        {
            return Ok(CommitOutcome::AlreadyCommitted { version: done + 1 });
        }
        let consumer = self.marker(&info.query_id)?;
        let group = consumer
            .group_metadata()
            .ok_or_else(|| commit_err("the marker consumer has no group metadata".into()))?;
        let mut marker = TopicPartitionList::new();
        marker
            .add_partition_offset(&self.options.topic, 0, Offset::Offset(batch_id as i64 + 1))
            .map_err(|e| commit_err(e.to_string()))?;
        // The metadata names what the offset is, for people who list the
        // group's offsets.
        if let Some(mut e) = marker.find_partition(&self.options.topic, 0) {
            e.set_metadata(format!(
                "lakestream batch {batch_id} of query {}",
                info.query_id
            ));
        }
        let producer = txn.producer.clone();
        let topic = self.options.topic.clone();
        let timeout = self.options.unavailable_timeout;
        let run = tokio::task::spawn_blocking(move || {
            produce_batch(&producer, &topic, &parts, &marker, &group, timeout)
        })
        .await
        .map_err(|e| commit_err(format!("the producer task failed: {e}")))?;
        match run {
            Ok(()) => {
                txn.fresh = false;
                let version = batch_id + 1;
                self.version.fetch_max(version, Ordering::Relaxed);
                Ok(CommitOutcome::Committed { version })
            }
            Err(failure) => {
                // Whatever the transaction's state, start the next attempt
                // from init_transactions: it aborts what is open and settles
                // a commit whose answer was lost.
                let producer = slot.take().map(|t| t.producer);
                if failure.abort
                    && let Some(p) = producer
                {
                    let _ = tokio::task::spawn_blocking(move || p.abort_transaction(timeout)).await;
                }
                Err(commit_err(failure.message(self)))
            }
        }
    }

    fn identity(&self) -> String {
        self.identity.clone()
    }

    async fn version(&self) -> Result<Option<u64>> {
        Ok(match self.version.load(Ordering::Relaxed) {
            0 => None,
            v => Some(v),
        })
    }
}

/// Why a transaction failed, and whether it can still be aborted.
struct TxnFailure {
    step: &'static str,
    error: String,
    fenced: bool,
    timed_out: bool,
    abort: bool,
}

impl TxnFailure {
    fn from_kafka(step: &'static str, e: KafkaError) -> Self {
        let rd = e.rdkafka_error_code();
        let (fenced, abort) = match &e {
            KafkaError::Transaction(t) => (
                t.is_fatal()
                    || rd == Some(rdkafka::types::RDKafkaErrorCode::Fenced)
                    || rd == Some(rdkafka::types::RDKafkaErrorCode::ProducerFenced),
                t.txn_requires_abort(),
            ),
            _ => (false, false),
        };
        let timed_out = matches!(
            rd,
            Some(
                rdkafka::types::RDKafkaErrorCode::MessageTimedOut
                    | rdkafka::types::RDKafkaErrorCode::OperationTimedOut
                    | rdkafka::types::RDKafkaErrorCode::RequestTimedOut
            )
        );
        Self {
            step,
            error: e.to_string(),
            fenced,
            timed_out,
            abort,
        }
    }

    fn message(&self, sink: &KafkaSink) -> String {
        let mut m = format!(
            "{}: {}; nothing of the batch is visible to read_committed readers",
            self.step, self.error
        );
        if self.fenced {
            m.push_str(
                "; another producer with the same transactional.id started (a second process \
                 on this checkpoint and output?): this one is fenced and stops",
            );
        } else if self.timed_out {
            m.push_str(&format!(
                "; the brokers {} did not finish it in time: check them, or raise \
                 transaction_timeout ({:?}, the longest one batch's produce may take)",
                sink.options.bootstrap_servers, sink.options.transaction_timeout
            ));
        }
        m
    }
}

/// Produce one batch's records in one transaction, send the marker offset
/// to it and commit it (blocking).
fn produce_batch(
    producer: &TxnProducer,
    topic: &str,
    parts: &[Vec<Encoded>],
    marker: &TopicPartitionList,
    group: &ConsumerGroupMetadata,
    timeout: Duration,
) -> std::result::Result<(), TxnFailure> {
    let fail = TxnFailure::from_kafka;
    producer
        .begin_transaction()
        .map_err(|e| fail("begin_transaction", e))?;
    let ctx = producer.context();
    ctx.failed.store(0, Ordering::Relaxed);
    *ctx.first.lock().unwrap_or_else(|e| e.into_inner()) = None;
    for encoded in parts.iter().flatten() {
        for i in 0..encoded.len() {
            let r = encoded.record(i);
            let mut record: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(topic);
            if let Some(k) = r.key {
                record = record.key(k);
            }
            if let Some(v) = r.value {
                record = record.payload(v);
            }
            if let Some(p) = r.partition {
                record = record.partition(p);
            }
            if let Some(t) = r.timestamp_ms {
                record = record.timestamp(t);
            }
            if let Some(h) = r.headers.filter(|h| !h.is_empty()) {
                let mut headers = OwnedHeaders::new_with_capacity(h.len());
                for (key, value) in h {
                    headers = headers.insert(Header {
                        key,
                        value: value.as_deref(),
                    });
                }
                record = record.headers(headers);
            }
            let mut pending = record;
            let started = std::time::Instant::now();
            loop {
                match producer.send(pending) {
                    Ok(()) => break,
                    Err((KafkaError::MessageProduction(code), back))
                        if code == rdkafka::types::RDKafkaErrorCode::QueueFull
                            && started.elapsed() < timeout =>
                    {
                        pending = back;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err((e, _)) => return Err(fail_abort("producing a record", e)),
                }
            }
        }
    }
    producer
        .send_offsets_to_transaction(marker, group, timeout)
        .map_err(|e| fail("sending the batch id to the transaction", e))?;
    // commit_transaction waits for every record's delivery and fails when
    // one failed; the first such failure says why.
    producer.commit_transaction(timeout).map_err(|e| {
        let mut f = fail("commit_transaction", e);
        let failed = ctx.failed.load(Ordering::Relaxed);
        if failed > 0 {
            let first = ctx.first.lock().unwrap_or_else(|e| e.into_inner()).clone();
            f.error.push_str(&format!(
                " ({failed} record(s) were not delivered, the first {})",
                first.unwrap_or_default()
            ));
        }
        f
    })
}

/// A failure inside an open transaction that did not come from the
/// transaction API: the transaction is aborted.
fn fail_abort(step: &'static str, e: KafkaError) -> TxnFailure {
    let mut f = TxnFailure::from_kafka(step, e);
    f.abort = true;
    f
}

/// Encodes one writer's rows into records, kept until the commit.
struct KafkaWriter {
    identity: String,
    layout: RecordLayout,
    batch_id: u64,
    encoded: Vec<Encoded>,
    rows: u64,
    bytes: u64,
}

#[async_trait]
impl BatchWriter for KafkaWriter {
    async fn write(&mut self, batch: RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        let e = self.layout.encode(&batch).map_err(|reason| Error::Write {
            table: self.identity.clone(),
            batch_id: self.batch_id,
            source: reason.into(),
        })?;
        self.rows += e.len() as u64;
        self.bytes += e.bytes();
        self.encoded.push(e);
        Ok(())
    }

    async fn finish(self: Box<Self>) -> Result<Staged> {
        Ok(Staged::new(
            self.batch_id,
            self.rows,
            0,
            self.bytes,
            self.encoded,
        ))
    }
}
