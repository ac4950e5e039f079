//! The Kafka workloads: a topic filled and read raw, the engine against it,
//! and one against two processes in group mode.

use super::*;

/// Create `topic` with `partitions` on the broker at `bootstrap`.
pub(super) fn create_topic(bootstrap: &str, topic: &str, partitions: i32) -> anyhow::Result<()> {
    use rdkafka::ClientConfig;
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;

    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()?;
    tokio::runtime::Runtime::new()?.block_on(admin.create_topics(
        &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
        &AdminOptions::new(),
    ))?;
    Ok(())
}

/// The Kafka workloads; `group`: also group mode with one and two
/// processes.
pub(super) fn kafka_bench(
    dir: &Path,
    broker: &broker::Broker,
    messages: u64,
    group: bool,
) -> anyhow::Result<()> {
    let bootstrap = broker.bootstrap();
    let messages = match broker.max_backlog(4) {
        Some(max) if messages > max => {
            figure(
                "kafka.messages_capped",
                max,
                "messages (the mock broker keeps about 5 MB a partition)",
            );
            max
        }
        _ => messages,
    };
    let topic = format!("bench-{}", std::process::id());
    broker.create_topic(&topic, 4)?;
    produce_orders(broker, &topic, messages)?;

    let raw = raw_consume(bootstrap, &topic, messages)?;

    std::fs::write(
        dir.join("kafka.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE orders (
               order_id VARCHAR NOT NULL, customer_id BIGINT, amount DOUBLE, ts TIMESTAMP
             ) STORED AS KAFKA LOCATION 'kafka://{bootstrap}/{topic}';
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out/kafka';
             INSERT INTO out SELECT order_id, customer_id, amount, ts FROM orders;"
        ),
    )?;
    let r = run_job(dir, "kafka.sql", "ckpt/kafka")?;
    let n = r.sum("input_rows");
    if n != messages {
        bail!("the kafka job read {n} of {messages} messages");
    }
    // The engine's rate over `secs`, and against the raw loop.
    let rate = |name: &str, ratio: &str, unit: &str, secs: f64| {
        figure(name, format!("{:.0}", messages as f64 / secs), unit);
        figure(ratio, format!("{:.2}", raw / secs), "x");
    };
    rate(
        "kafka.engine_rate",
        "ratio.kafka_engine_over_raw",
        "msg/s",
        r.wall.as_secs_f64(),
    );
    // The same without the process's start-up (connecting, metadata, the
    // topic's id): what the batches alone took.
    let in_batches: f64 = r
        .progress
        .iter()
        .filter_map(|p| p["durations"]["total_ms"].as_f64())
        .sum::<f64>()
        / 1000.0;
    if in_batches > 0.0 {
        rate(
            "kafka.engine_batch_rate",
            "ratio.kafka_batches_over_raw",
            "msg/s (inside batches: start-up excluded)",
            in_batches,
        );
    }

    kafka_to_kafka(dir, broker, &topic, messages)?;

    // Group mode: one, then two processes of one job share the topic.
    // Not in smoke runs: a test broker's group coordinator may stall
    // while members join (tansu's does), and a smoke run must not hang.
    if !group {
        figure("kafka.group.skipped", 1, "(smoke run)");
        return Ok(());
    }
    for processes in [1usize, 2] {
        let g = group_cost(dir, bootstrap, &topic, messages, processes)?;
        let key = format!("kafka.group.{processes}");
        figure(
            &format!("{key}.rate"),
            format!("{:.0}", messages as f64 / g.busy.as_secs_f64()),
            "msg/s (first batch to last)",
        );
        figure(
            &format!("{key}.start"),
            format!("{:.0}", g.join.as_secs_f64() * 1000.0),
            "ms (spawn to first batch)",
        );
        figure(&format!("{key}.batches"), g.batches, "batches");
        figure(
            &format!("{key}.superseded"),
            format!(
                "{:.1}",
                100.0 * g.superseded as f64 / g.batches.max(1) as f64
            ),
            "% of batches",
        );
        figure(
            &format!("{key}.retried"),
            format!("{:.1}", 100.0 * g.retries as f64 / g.batches.max(1) as f64),
            "% of commits",
        );
    }
    Ok(())
}

/// The same topic into another topic, each batch one Kafka transaction,
/// against a raw loop that produces the same records in transactions of
/// the same size (no reading, no query): the engine's rate, and the ratio.
fn kafka_to_kafka(
    dir: &Path,
    broker: &broker::Broker,
    topic: &str,
    messages: u64,
) -> anyhow::Result<()> {
    let bootstrap = broker.bootstrap();
    let out = format!("{topic}-out");
    broker.create_topic(&out, 4)?;
    std::fs::write(
        dir.join("kafka_to_kafka.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE orders (
               order_id VARCHAR NOT NULL, customer_id BIGINT, amount DOUBLE, ts TIMESTAMP
             ) STORED AS KAFKA LOCATION 'kafka://{bootstrap}/{topic}';
             CREATE EXTERNAL TABLE out STORED AS KAFKA LOCATION 'kafka://{bootstrap}/{out}';
             INSERT INTO out SELECT order_id AS _key, order_id, customer_id, amount, ts
             FROM orders;"
        ),
    )?;
    let r = run_job(dir, "kafka_to_kafka.sql", "ckpt/kafka_to_kafka")?;
    let n = r.sum("input_rows");
    if n != messages {
        bail!("the kafka -> kafka job read {n} of {messages} messages");
    }
    let batches = r.progress.len().max(1) as u64;
    let in_batches: f64 = r
        .progress
        .iter()
        .filter_map(|p| p["durations"]["total_ms"].as_f64())
        .sum::<f64>()
        / 1000.0;
    let per_txn = messages.div_ceil(batches);
    let raw = raw_transactions(broker, &format!("{out}-raw"), messages, per_txn)?;
    let raw_both = raw_consume_produce(broker, topic, &format!("{out}-raw2"), messages, per_txn)?;
    figure("kafka_to_kafka.batches", batches, "batches (transactions)");
    let rate = messages as f64 / r.wall.as_secs_f64();
    figure("kafka_to_kafka.engine_rate", format!("{rate:.0}"), "msg/s");
    figure(
        "kafka_to_kafka.engine_batch_rate",
        format!("{:.0}", messages as f64 / in_batches.max(1e-9)),
        "msg/s (inside batches: start-up excluded)",
    );
    figure(
        "kafka_to_kafka.raw_txn_rate",
        format!("{:.0}", messages as f64 / raw),
        "msg/s (produce only, same transactions)",
    );
    figure(
        "ratio.kafka_to_kafka_over_raw_txn",
        format!("{:.2}", raw / r.wall.as_secs_f64()),
        "x (target >= 0.8)",
    );
    figure(
        "ratio.kafka_to_kafka_batches_over_raw_txn",
        format!("{:.2}", raw / in_batches.max(1e-9)),
        "x (start-up excluded)",
    );
    figure(
        "kafka_to_kafka.raw_consume_produce_rate",
        format!("{:.0}", messages as f64 / raw_both),
        "msg/s (consume, then produce each payload, same transactions)",
    );
    figure(
        "ratio.kafka_to_kafka_over_raw_consume_produce",
        format!("{:.2}", raw_both / r.wall.as_secs_f64()),
        "x",
    );
    figure(
        "ratio.kafka_to_kafka_batches_over_raw_consume_produce",
        format!("{:.2}", raw_both / in_batches.max(1e-9)),
        "x (start-up excluded)",
    );
    Ok(())
}

/// A raw transactional producer to a 4-partition topic, committing every
/// `per_txn` records with a group offset as the sink does: the raw loops'
/// shared output.
struct RawTxnOutput {
    producer: rdkafka::producer::BaseProducer,
    /// A consumer of the output's group: its metadata goes with each
    /// commit (and a loop may read with it).
    consumer: rdkafka::consumer::BaseConsumer,
    out: String,
    per_txn: u64,
    in_txn: std::cell::Cell<u64>,
    txns: std::cell::Cell<i64>,
}

impl RawTxnOutput {
    const TIMEOUT: Duration = Duration::from_secs(60);

    /// Create `out` and the clients; nothing is produced yet.
    fn new(broker: &broker::Broker, out: &str, per_txn: u64) -> anyhow::Result<Self> {
        broker.create_topic(out, 4)?;
        let client = |key: &str| {
            let mut c = rdkafka::ClientConfig::new();
            c.set("bootstrap.servers", broker.bootstrap())
                .set(key, format!("lakestream-bench-{out}"));
            c
        };
        Ok(Self {
            producer: client("transactional.id")
                .set("queue.buffering.max.messages", "1000000")
                .create()?,
            consumer: client("group.id")
                .set("enable.auto.commit", "false")
                .create()?,
            out: out.to_string(),
            per_txn,
            in_txn: Default::default(),
            txns: Default::default(),
        })
    }

    /// Start the producer's transactions and open the first.
    fn start(&self) -> anyhow::Result<()> {
        use rdkafka::producer::Producer;
        self.producer.init_transactions(Self::TIMEOUT)?;
        self.producer.begin_transaction()?;
        Ok(())
    }

    /// Produce one record (waiting while the queue is full); commit the
    /// transaction when it holds `per_txn` and open the next.
    fn send(&self, key: Option<&[u8]>, payload: &[u8]) -> anyhow::Result<()> {
        use rdkafka::producer::{BaseRecord, Producer};
        let mut record = BaseRecord::<[u8], [u8]>::to(&self.out).payload(payload);
        if let Some(key) = key {
            record = record.key(key);
        }
        loop {
            match self.producer.send(record) {
                Ok(()) => break,
                Err((e, back))
                    if e.rdkafka_error_code()
                        == Some(rdkafka::types::RDKafkaErrorCode::QueueFull) =>
                {
                    record = back;
                    self.producer.poll(Duration::from_millis(1));
                }
                Err((e, _)) => bail!("produce: {e}"),
            }
        }
        self.in_txn.set(self.in_txn.get() + 1);
        if self.in_txn.get() == self.per_txn {
            self.commit()?;
            self.producer.begin_transaction()?;
        }
        Ok(())
    }

    /// Commit the open transaction with the next group offset.
    fn commit(&self) -> anyhow::Result<()> {
        use rdkafka::consumer::Consumer;
        use rdkafka::producer::Producer;
        let group = self
            .consumer
            .group_metadata()
            .context("the consumer has no group metadata")?;
        self.txns.set(self.txns.get() + 1);
        let mut marker = rdkafka::TopicPartitionList::new();
        marker.add_partition_offset(&self.out, 0, rdkafka::Offset::Offset(self.txns.get()))?;
        self.producer
            .send_offsets_to_transaction(&marker, &group, Self::TIMEOUT)?;
        self.producer.commit_transaction(Self::TIMEOUT)?;
        self.in_txn.set(0);
        Ok(())
    }

    /// Commit what the open transaction holds.
    fn finish(self) -> anyhow::Result<()> {
        if self.in_txn.get() > 0 {
            self.commit()?;
        }
        Ok(())
    }
}

/// The raw floor of a transactional output: `messages` records like the
/// engine's (key and JSON value) produced to `topic` in transactions of
/// `per_txn`, each committed with a group offset as the sink's are; its
/// time in seconds.
fn raw_transactions(
    broker: &broker::Broker,
    topic: &str,
    messages: u64,
    per_txn: u64,
) -> anyhow::Result<f64> {
    let out = RawTxnOutput::new(broker, topic, per_txn)?;
    let start = Instant::now();
    out.start()?;
    for i in 0..messages {
        let key = format!("o{i:010}");
        let value = format!(
            "{{\"order_id\":\"{key}\",\"customer_id\":{},\"amount\":{}.25,\"ts\":\"2026-02-01T00:00:00\"}}",
            i % 9973,
            i % 500
        );
        out.send(Some(key.as_bytes()), value.as_bytes())?;
    }
    out.finish()?;
    Ok(start.elapsed().as_secs_f64())
}

/// The floor of a Kafka -> Kafka job: consume the `messages` of the 4
/// partitions of `topic` and produce each payload unchanged to `out`, in
/// transactions of `per_txn` committed with a group offset; no decoding,
/// no query. Its time in seconds.
fn raw_consume_produce(
    broker: &broker::Broker,
    topic: &str,
    out: &str,
    messages: u64,
    per_txn: u64,
) -> anyhow::Result<f64> {
    use rdkafka::Message;
    use rdkafka::consumer::Consumer;
    let out = RawTxnOutput::new(broker, out, per_txn)?;
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..4 {
        tpl.add_partition_offset(topic, p, rdkafka::Offset::Beginning)?;
    }
    out.consumer.assign(&tpl)?;
    let start = Instant::now();
    out.start()?;
    let mut got = 0u64;
    while got < messages {
        if start.elapsed() > Duration::from_secs(600) {
            bail!("raw consume-produce stalled at {got} of {messages}");
        }
        let Some(Ok(m)) = out.consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        out.send(None, m.payload().unwrap_or_default())?;
        got += 1;
    }
    out.finish()?;
    Ok(start.elapsed().as_secs_f64())
}

/// `messages` JSON orders to the 4 partitions of `topic`, round robin.
fn produce_orders(broker: &broker::Broker, topic: &str, messages: u64) -> anyhow::Result<()> {
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let producer: BaseProducer = broker.producer_config().create()?;
    let start = Instant::now();
    for i in 0..messages {
        let value = format!(
            "{{\"order_id\":\"o{i:010}\",\"customer_id\":{},\"amount\":{}.25,\"ts\":\"2026-02-01T00:00:00Z\"}}",
            i % 9973,
            i % 500
        );
        loop {
            match producer.send(
                BaseRecord::<(), String>::to(topic)
                    .payload(&value)
                    .partition((i % 4) as i32),
            ) {
                Ok(()) => break,
                Err((e, _))
                    if e.rdkafka_error_code()
                        == Some(rdkafka::types::RDKafkaErrorCode::QueueFull) =>
                {
                    producer.poll(Duration::from_millis(10));
                }
                Err((e, _)) => bail!("produce: {e}"),
            }
        }
    }
    producer.flush(Duration::from_secs(300))?;
    figure("kafka.messages", messages, "messages");
    figure(
        "kafka.produce_rate",
        format!("{:.0}", messages as f64 / start.elapsed().as_secs_f64()),
        "msg/s",
    );

    Ok(())
}

/// The raw floor: consume every partition of `topic` from offset 0 and
/// decode the `messages` into Arrow, in a plain loop; its time in seconds.
fn raw_consume(bootstrap: &str, topic: &str, messages: u64) -> anyhow::Result<f64> {
    use rdkafka::ClientConfig;
    use rdkafka::Message;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let schema = Arc::new(Schema::new(vec![
        Field::new("order_id", DataType::Utf8, false),
        Field::new("customer_id", DataType::Int64, true),
        Field::new("amount", DataType::Float64, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Nanosecond, None), true),
    ]));
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "lakestream-bench")
        .set("enable.auto.commit", "false")
        .create()?;
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..4 {
        tpl.add_partition_offset(topic, p, rdkafka::Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let mut decoder = arrow::json::ReaderBuilder::new(schema)
        .with_batch_size(8192)
        .build_decoder()?;
    let start = Instant::now();
    let mut got = 0u64;
    let mut rows = 0usize;
    while got < messages {
        if start.elapsed() > Duration::from_secs(600) {
            bail!("raw consume stalled at {got} of {messages}");
        }
        // Transient poll errors are retried like the engine does.
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            if decoder.len() >= 8192 {
                rows += decoder.flush()?.map(|b| b.num_rows()).unwrap_or(0);
            }
            decoder.decode(m.payload().unwrap_or(b"{}"))?;
            decoder.decode(b"\n")?;
            got += 1;
        }
    }
    rows += decoder.flush()?.map(|b| b.num_rows()).unwrap_or(0);
    let raw = start.elapsed().as_secs_f64();
    if rows as u64 != messages {
        bail!("raw decode produced {rows} rows of {messages}");
    }
    figure(
        "kafka.raw_rate",
        format!("{:.0}", messages as f64 / raw),
        "msg/s",
    );

    Ok(raw)
}

/// What [`group_cost`] measured.
pub(super) struct GroupCost {
    /// From spawning the processes to the first batch's start.
    pub(super) join: Duration,
    /// From the first batch's start to the table holding every message.
    pub(super) busy: Duration,
    pub(super) batches: u64,
    pub(super) superseded: u64,
    pub(super) retries: u64,
}

/// `processes` processes of one job in one new consumer group read
/// `topic` (holding `messages`) into one table, until their committed
/// batches hold every message; then they are stopped with SIGTERM.
pub(super) fn group_cost(
    dir: &Path,
    bootstrap: &str,
    topic: &str,
    messages: u64,
    processes: usize,
) -> anyhow::Result<GroupCost> {
    let job = format!("group{processes}.sql");
    std::fs::write(
        dir.join(&job),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE orders (
               order_id VARCHAR NOT NULL, customer_id BIGINT, amount DOUBLE, ts TIMESTAMP
             ) STORED AS KAFKA LOCATION 'kafka://{bootstrap}/{topic}'
             OPTIONS ('group_id' 'bench-{processes}-{pid}', 'max_offsets_per_trigger' '20000',
                      'kafka.session.timeout.ms' '6000');
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out/group-{processes}';
             INSERT INTO out SELECT order_id, customer_id, amount, ts FROM orders;",
            pid = std::process::id()
        ),
    )?;
    let exe = lakestream();
    let start = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel::<serde_json::Value>();
    let mut children = Vec::new();
    for i in 0..processes {
        let mut child = Command::new(exe)
            .current_dir(dir)
            .args([
                "run",
                &job,
                "--checkpoint",
                &format!("ckpt/group-{processes}-{i}"),
                "--trigger",
                "100ms",
                "--progress-json",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let stdout = child.stdout.take().expect("piped");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        children.push(child);
    }
    let stop = |children: &mut Vec<std::process::Child>| {
        for c in children.iter_mut() {
            // SAFETY: kill(2) on a child of this process.
            unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
            let _ = c.wait();
        }
    };
    let deadline = start + Duration::from_secs(600);
    let (mut rows, mut batches, mut superseded, mut retries) = (0u64, 0u64, 0u64, 0u64);
    let mut first: Option<Instant> = None;
    while rows < messages {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(p) = rx.recv_timeout(left) else {
            stop(&mut children);
            bail!(
                "group mode with {processes} processes read {rows} of {messages} messages in 600 s"
            );
        };
        let took =
            Duration::from_secs_f64(p["durations"]["total_ms"].as_f64().unwrap_or(0.0) / 1000.0);
        first.get_or_insert(Instant::now() - took);
        batches += 1;
        retries += p["commit_retries"].as_u64().unwrap_or(0);
        if p.get("superseded").is_some_and(|s| !s.is_null()) {
            superseded += 1;
        } else if p["skipped"] != true {
            rows += p["input_rows"].as_u64().unwrap_or(0);
        }
    }
    let first = first.expect("a batch ran");
    let busy = first.elapsed();
    stop(&mut children);
    Ok(GroupCost {
        join: first.saturating_duration_since(start),
        busy,
        batches,
        superseded,
        retries,
    })
}
