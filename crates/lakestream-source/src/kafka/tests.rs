//! Tests of the parent module.

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
                    rdkafka::bindings::rd_kafka_mock_request_api_key(*reqs.add(i)) == list_offsets
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
