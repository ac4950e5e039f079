//! The Kafka source under broker faults injected by librdkafka's mock
//! cluster: a broker that is down when the query starts, failing list-offset
//! and fetch requests. The query waits, retries and ends with every record
//! exactly once.

use std::sync::Arc;
use std::time::Duration;

use arrow::datatypes::{DataType, Field, Schema};
use lakestream::QueryBuilder;
use lakestream::source::kafka::{KafkaSource, KafkaSourceOptions, Topics};
use rdkafka::ClientConfig;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

async fn produce(
    mock: &MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    topic: &str,
    n: i32,
) {
    mock.create_topic(topic, 3, 1).unwrap();
    produce_more(mock, topic, n).await;
}

/// `n` more records into `topic` (made by [`produce`]).
async fn produce_more(
    mock: &MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    topic: &str,
    n: i32,
) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", mock.bootstrap_servers())
        .create()
        .unwrap();
    for i in 0..n {
        producer
            .send(
                FutureRecord::to(topic)
                    .key(&format!("k{i}"))
                    .payload(&format!("{{\"id\": {i}}}"))
                    .partition(i % 3),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
    }
}

fn query(
    bootstrap: &str,
    topic: &str,
    dir: &std::path::Path,
    read_timeout: Duration,
) -> QueryBuilder {
    query_with(bootstrap, topic, dir, read_timeout, Duration::from_secs(1))
}

fn query_with(
    bootstrap: &str,
    topic: &str,
    dir: &std::path::Path,
    read_timeout: Duration,
    request_timeout: Duration,
) -> QueryBuilder {
    let mut options = KafkaSourceOptions::new(bootstrap, Topics::List(vec![topic.into()]));
    options.max_offsets_per_trigger = Some(70);
    options.request_timeout = request_timeout;
    options.read_timeout = read_timeout;
    query_of(options, dir)
}

/// An available-now query of `id` (and each record's partition and offset)
/// from a source with `options`, its table and checkpoint under `dir`.
fn query_of(options: KafkaSourceOptions, dir: &std::path::Path) -> QueryBuilder {
    let source = KafkaSource::try_new(
        "events",
        Some(Arc::new(Schema::new(vec![Field::new(
            "id",
            DataType::Int64,
            false,
        )]))),
        options,
    )
    .unwrap();
    crate::common::available_now(
        source,
        "SELECT id, _partition, _offset FROM events",
        dir.join("table").to_str().unwrap(),
        dir.join("ckpt").to_str().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_queries_wait_out_broker_faults_and_lose_nothing() {
    let mock = MockCluster::new(1).unwrap();
    produce(&mock, "faulty", 300).await;
    let dir = tempfile::tempdir().unwrap();
    let table = dir.path().join("table");
    let query = query(
        &mock.bootstrap_servers(),
        "faulty",
        dir.path(),
        Duration::from_secs(60),
    );

    // Fetches and offset lookups fail a few times, then the broker goes
    // down as the query starts and comes back 2 s later.
    mock.request_errors(
        RDKafkaApiKey::Fetch,
        &[
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__TRANSPORT,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
        ],
    );
    mock.request_errors(
        RDKafkaApiKey::ListOffsets,
        &[
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__TRANSPORT,
        ],
    );
    mock.broker_down(1).unwrap();
    let running = tokio::spawn(query.run());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!running.is_finished(), "the query must wait for the broker");
    mock.broker_up(1).unwrap();
    let summary = tokio::time::timeout(Duration::from_secs(120), running)
        .await
        .expect("the query finished after the broker came back")
        .unwrap()
        .unwrap();
    assert_eq!(summary.input_rows, 300);
    assert!(summary.batches >= 5, "{summary:?}");
    assert_eq!(
        crate::common::count_distinct(&table, "id").await,
        (300, 300)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_that_cannot_be_read_in_time_fails_cleanly_and_a_restart_continues() {
    let mock = MockCluster::new(1).unwrap();
    produce(&mock, "stuck", 150).await;
    let dir = tempfile::tempdir().unwrap();
    let bootstrap = mock.bootstrap_servers();
    // Batch 0 is planned, then the process "crashes".
    let err = query(&bootstrap, "stuck", dir.path(), Duration::from_secs(2))
        .fail_point(lakestream::FailPoint::AfterWriteAhead, 0)
        .run()
        .await
        .unwrap_err();
    assert!(
        matches!(err, lakestream::Error::InjectedFault { .. }),
        "{err}"
    );
    // The restart re-runs batch 0 while the broker is down: it gives up
    // after the read timeout with an error naming what it could not read.
    mock.broker_down(1).unwrap();
    let err = query(&bootstrap, "stuck", dir.path(), Duration::from_secs(2))
        .run()
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("stuck/") && msg.contains("no progress"),
        "{msg}"
    );
    assert!(
        !dir.path()
            .join("table/_delta_log/00000000000000000001.json")
            .exists()
    );
    // Broker back: the next restart finishes, every record once.
    mock.broker_up(1).unwrap();
    let summary = query(&bootstrap, "stuck", dir.path(), Duration::from_secs(30))
        .run()
        .await
        .unwrap();
    assert!(summary.batches >= 3, "{summary:?}");
    assert_eq!(
        crate::common::count_distinct(&dir.path().join("table"), "id").await,
        (150, 150)
    );
}

/// The mock broker names a controller that is not among its brokers, so
/// it never answers a topic-id lookup (DescribeTopics). A query there
/// waits for the ids briefly and once a run, not its whole request timeout
/// at each lookup, and reads every record once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_never_answers_topic_id_lookups_delays_a_run_once_and_briefly() {
    let mock = MockCluster::new(1).unwrap();
    produce(&mock, "no-ids", 300).await;
    let dir = tempfile::tempdir().unwrap();
    let bootstrap = mock.bootstrap_servers();
    for run in 0..2 {
        if run == 1 {
            // The second run (a restart) reads what came since.
            produce_more(&mock, "no-ids", 300).await;
        }
        let started = std::time::Instant::now();
        let summary = query_with(
            &bootstrap,
            "no-ids",
            dir.path(),
            Duration::from_secs(60),
            Duration::from_secs(30),
        )
        .run()
        .await
        .unwrap();
        let took = started.elapsed();
        assert_eq!(summary.input_rows, 300, "run {run}: {summary:?}");
        assert!(summary.batches >= 5, "run {run}: {summary:?}");
        // The request timeout is 30 s; the lookup waits 2 s at most.
        assert!(
            took < Duration::from_secs(15),
            "run {run} on a broker that ignores topic-id lookups took {took:?}"
        );
    }
    // Every record once: 600 rows, each (partition, offset) once.
    assert_eq!(
        crate::common::count_distinct(&dir.path().join("table"), "_partition * 1000000 + _offset")
            .await,
        (600, 600)
    );
}

/// A reader whose consumer queue fills past `queued.min.messages` (a
/// backlog fetched faster than it is decoded) has librdkafka pause its
/// fetches; it must resume as soon as the queue drains, not after
/// librdkafka's default 1 s. With a threshold of 100 messages and 8,000
/// records in produce batches of at most 40, the default pause would come
/// back dozens of times (tens of seconds); the batch reads them in well
/// under that, every record once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_whose_queue_fills_reads_on_without_pausing_a_second() {
    let mock = MockCluster::new(1).unwrap();
    mock.create_topic("full", 1, 1).unwrap();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", mock.bootstrap_servers())
        .set("batch.num.messages", "40")
        .create()
        .unwrap();
    let sends: Vec<_> = (0..8000)
        .map(|i| {
            producer
                .send_result(
                    FutureRecord::<(), String>::to("full").payload(&format!("{{\"id\": {i}}}")),
                )
                .unwrap()
        })
        .collect();
    for s in sends {
        s.await.unwrap().unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let mut options =
        KafkaSourceOptions::new(&mock.bootstrap_servers(), Topics::List(vec!["full".into()]));
    options
        .client_config
        .insert("queued.min.messages".into(), "100".into());
    let started = std::time::Instant::now();
    let summary = query_of(options, dir.path()).run().await.unwrap();
    let took = started.elapsed();
    assert_eq!(summary.input_rows, 8000, "{summary:?}");
    assert_eq!(
        crate::common::count_distinct(&dir.path().join("table"), "id").await,
        (8000, 8000)
    );
    // The mock broker leaves the topic-id lookup unanswered (2 s).
    assert!(
        took < Duration::from_secs(12),
        "reading 8,000 records with a 100-message queue took {took:?}"
    );
}
