//! The broker the Kafka workloads run against: one the user names with
//! `--kafka-bootstrap`, or librdkafka's mock broker (`--kafka-mock`),
//! started in the bench's own process and served over TCP on 127.0.0.1,
//! so the query under test (a child process) reaches it as it would any
//! broker.
//!
//! The two differ in what a producer may do. The suite's test broker
//! (tansu) reports a wrong high watermark after a produce request of
//! several records, so against a broker named by address every record is
//! its own request, which caps the rate a producer reaches (about 5,800
//! msg/s there). The mock broker's watermarks are exact whatever the
//! batching, so its producers batch as librdkafka does by default and the
//! latency workload reaches 20,000 msg/s and more.

use anyhow::Context;
use rdkafka::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;

/// Bytes a workload's record takes in the mock broker's log, at most
/// (payload and record overhead), for [`Broker::max_backlog`].
const MOCK_RECORD: u64 = 128;

/// A Kafka broker for the workloads (the mock one lives as long as this).
pub(crate) struct Broker {
    bootstrap: String,
    mock: Option<MockCluster<'static, DefaultProducerContext>>,
}

impl Broker {
    /// The broker at `bootstrap`.
    pub(crate) fn external(bootstrap: &str) -> Self {
        Self {
            bootstrap: bootstrap.to_string(),
            mock: None,
        }
    }

    /// librdkafka's mock broker (one node), listening on 127.0.0.1.
    pub(crate) fn mock() -> anyhow::Result<Self> {
        let mock = MockCluster::new(1).context("start librdkafka's mock broker")?;
        Ok(Self {
            bootstrap: mock.bootstrap_servers(),
            mock: Some(mock),
        })
    }

    /// `host:port` of the broker.
    pub(crate) fn bootstrap(&self) -> &str {
        &self.bootstrap
    }

    /// What the figures say of the broker: `mock` or `external`.
    pub(crate) fn kind(&self) -> &'static str {
        if self.mock.is_some() {
            "mock"
        } else {
            "external"
        }
    }

    /// The most messages of [`MOCK_RECORD`]'s size a backlog workload
    /// may put in `partitions` partitions of this broker: librdkafka's mock
    /// broker keeps at most 5 MB (and 100,000 produce batches) per
    /// partition and drops older records past that, so a backlog larger
    /// than it keeps could never be read whole. `None`: no bound.
    pub(crate) fn max_backlog(&self, partitions: u64) -> Option<u64> {
        self.mock
            .as_ref()
            .map(|_| partitions * (4 << 20) / MOCK_RECORD)
    }

    /// Create `topic` with `partitions` (the mock broker takes no admin
    /// requests: its topics are made through its own interface).
    pub(crate) fn create_topic(&self, topic: &str, partitions: i32) -> anyhow::Result<()> {
        match &self.mock {
            Some(mock) => mock
                .create_topic(topic, partitions, 1)
                .with_context(|| format!("create topic {topic} on the mock broker")),
            None => super::create_topic(&self.bootstrap, topic, partitions),
        }
    }

    /// How long a producer of the workloads lingers before sending what
    /// it holds (`linger.ms`): 0 against a broker named by address, where
    /// every record is its own request anyway; librdkafka's default 5 ms
    /// against the mock broker, which answers a fetch with one produce
    /// batch and finds it by scanning every batch it holds. At 20,000
    /// msg/s unlingered batches hold a record or two, and serving them
    /// takes the mock broker a whole core (the query falls seconds
    /// behind); lingering makes them about 100 records. A record's
    /// latency includes its linger (the `broker_ack_median` figure).
    pub(crate) fn linger_ms(&self) -> u64 {
        if self.mock.is_some() { 5 } else { 0 }
    }

    /// A producer's settings for this broker: [`Broker::linger_ms`] and a
    /// queue deep enough for the workloads; against a broker named by
    /// address one record per produce request (see the module docs),
    /// against the mock one librdkafka's batching of whatever is queued.
    pub(crate) fn producer_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap)
            .set("linger.ms", self.linger_ms().to_string())
            .set("queue.buffering.max.messages", "1000000");
        if self.mock.is_none() {
            c.set("batch.num.messages", "1");
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::Message;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    use std::time::{Duration, Instant};

    /// The mock broker serves a topic over TCP: what is produced in
    /// batched requests is read back whole, and its high watermark counts
    /// every record.
    #[test]
    fn the_mock_broker_serves_batched_records_with_exact_watermarks() {
        let broker = Broker::mock().unwrap();
        assert_eq!(broker.kind(), "mock");
        // A backlog is capped to what the mock broker keeps; a broker named
        // by address is not.
        assert_eq!(broker.max_backlog(4), Some(131_072));
        assert_eq!(Broker::external("127.0.0.1:9").max_backlog(4), None);
        // Its producers linger, so a fetch (one produce batch) is many
        // records; a broker named by address takes one record a request.
        assert_eq!(broker.linger_ms(), 5);
        assert_eq!(Broker::external("127.0.0.1:9").linger_ms(), 0);
        assert!(
            broker.bootstrap().starts_with("127.0.0.1:"),
            "{}",
            broker.bootstrap()
        );
        broker.create_topic("t", 2).unwrap();
        let producer: BaseProducer = broker.producer_config().create().unwrap();
        for i in 0..1000 {
            producer
                .send(
                    BaseRecord::<(), String>::to("t")
                        .payload(&format!("{i}"))
                        .partition(i % 2),
                )
                .unwrap();
        }
        producer.flush(Duration::from_secs(30)).unwrap();
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", broker.bootstrap())
            .set("group.id", "g")
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        for p in 0..2 {
            let (low, high) = consumer
                .fetch_watermarks("t", p, Duration::from_secs(10))
                .unwrap();
            assert_eq!((low, high), (0, 500), "partition {p}");
        }
        let mut tpl = rdkafka::TopicPartitionList::new();
        tpl.add_partition_offset("t", 0, rdkafka::Offset::Beginning)
            .unwrap();
        tpl.add_partition_offset("t", 1, rdkafka::Offset::Beginning)
            .unwrap();
        consumer.assign(&tpl).unwrap();
        let mut seen = vec![false; 1000];
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut got = 0;
        while got < 1000 && Instant::now() < deadline {
            if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
                let i: usize = std::str::from_utf8(m.payload().unwrap())
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!(!std::mem::replace(&mut seen[i], true), "record {i} twice");
                got += 1;
            }
        }
        assert_eq!(got, 1000, "records read back");
    }
}
