//! The Kafka source against a real Kafka-protocol broker process.

use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::broker::{Broker, assert_records_once, kafka_job, orders};
use crate::common::*;

/// The order ids of `rows`, sorted.
pub(crate) fn order_ids(rows: &[serde_json::Value]) -> Vec<String> {
    let mut v: Vec<String> = rows
        .iter()
        .map(|r| r["order_id"].as_str().unwrap().to_string())
        .collect();
    v.sort();
    v
}

/// The order ids of produced `records` (key, JSON value), sorted.
pub(crate) fn expected_ids(records: &[(String, String)]) -> Vec<String> {
    let mut v: Vec<String> = records
        .iter()
        .map(|(_, v)| {
            serde_json::from_str::<serde_json::Value>(v).unwrap()["order_id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    v.sort();
    v
}

#[test]
fn kafka_to_delta_exactly_once_through_sigkills() {
    let broker = Broker::start();
    broker.create_topic("orders", 4);
    let records = orders(0, 1200);
    let placed = broker.produce("orders", 4, &records);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(
        dir.join("job.sql"),
        kafka_job(
            &broker.bootstrap(),
            "orders",
            "out",
            "'max_offsets_per_trigger' '20', 'kafka.sasl.password' 'hunter2-do-not-print'",
        ),
    )
    .unwrap();
    // Batches take milliseconds: kills land early in a run too. A loop
    // whose job finished before two kills landed starts over.
    let (kills, outputs) = kill_until_done_logged(
        dir,
        &run_job_args("ckpt"),
        &[],
        &Kills {
            max: 6,
            min: 2,
            seed: clock_seed(),
            limit: Duration::from_secs(300),
            latest: Duration::from_millis(500),
        },
    );
    eprintln!("killed {kills} times");
    let rows = read_py(&dir.join("out"));
    assert_eq!(
        order_ids(&rows),
        expected_ids(&records),
        "every record exactly once"
    );
    // The metadata columns say where each row came from.
    assert_records_once(&rows, &placed);
    assert!(rows.iter().all(|r| r["_topic"] == "orders"));
    // Secrets never reach output or the checkpoint.
    assert!(!outputs.contains("hunter2"), "a secret was printed");
    let status = run_in(dir, &["status", "--checkpoint", "ckpt"]);
    assert!(!text(&status).contains("hunter2"));
    for e in std::fs::read_dir(dir.join("ckpt/offsets")).unwrap() {
        assert!(
            !std::fs::read_to_string(e.unwrap().path())
                .unwrap()
                .contains("hunter2")
        );
    }
}

#[test]
fn kafka_continuous_mode_with_producers_then_sigterm() {
    let broker = Broker::start();
    broker.create_topic("live", 2);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(
        dir.join("job.sql"),
        kafka_job(&broker.bootstrap(), "live", "out", ""),
    )
    .unwrap();
    let mut child = bin()
        .current_dir(dir)
        .args([
            "run",
            "job.sql",
            "--checkpoint",
            "ckpt",
            "--trigger",
            "200ms",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut all = Vec::new();
    for round in 0..5 {
        let batch = orders(round * 40, 40);
        broker.produce("live", 2, &batch);
        all.extend(batch);
        std::thread::sleep(Duration::from_millis(150));
    }
    let want = expected_ids(&all);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let table = dir.join("out/_delta_log");
        if table.exists() {
            let n = query(dir, "SELECT count(*) AS n FROM 'out'");
            if n[0]["n"] == want.len() as u64 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "the job did not catch up");
        std::thread::sleep(Duration::from_millis(200));
    }
    crate::errors::unsafe_kill(child.id(), 15);
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert_eq!(order_ids(&read_py(&dir.join("out"))), want);
}

#[test]
fn kafka_starting_and_ending_offsets() {
    let broker = Broker::start();
    broker.create_topic("t", 2);
    let first = orders(0, 20);
    broker.produce("t", 2, &first);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();

    // latest: what was there before the first plan is not read.
    std::fs::write(
        dir.join("job.sql"),
        kafka_job(
            &broker.bootstrap(),
            "t",
            "latest",
            "'starting_offsets' 'latest', 'commit_offsets_to_group' 'lag-monitor'",
        ),
    )
    .unwrap();
    let o = run_job_progress(dir, "ck_latest");
    assert!(o.status.success(), "{}", text(&o));
    let second = orders(100, 10);
    broker.produce("t", 2, &second);
    let o = run_job_progress(dir, "ck_latest");
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        order_ids(&read_py(&dir.join("latest"))),
        expected_ids(&second)
    );
    // The group holds the committed end offsets, for lag monitoring.
    assert_eq!(broker.committed("lag-monitor", "t", 2), vec![15, 15]);

    // A per-partition map: partition 0 from offset 5, partition 1 from the start;
    // ending offsets bound the read (a backfill of a fixed range).
    std::fs::write(
        dir.join("job.sql"),
        kafka_job(
            &broker.bootstrap(),
            "t",
            "ranged",
            r#"'starting_offsets' '{"t": {"0": 5, "1": -2}}', 'ending_offsets' '{"t": {"0": 8, "1": 3}}'"#,
        ),
    )
    .unwrap();
    let o = run_job_progress(dir, "ck_ranged");
    assert!(o.status.success(), "{}", text(&o));
    let rows = read_py(&dir.join("ranged"));
    let mut got: Vec<(i64, i64)> = rows
        .iter()
        .map(|r| {
            (
                r["_partition"].as_i64().unwrap(),
                r["_offset"].as_i64().unwrap(),
            )
        })
        .collect();
    got.sort();
    assert_eq!(got, vec![(0, 5), (0, 6), (0, 7), (1, 0), (1, 1), (1, 2)]);
    // Progress names what the partitions hold past the bound: the high
    // watermarks (15 each) and the lag behind them.
    let last: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().last().unwrap()).unwrap();
    let src = &last["sources"][0];
    assert_eq!(
        src["latestOffset"],
        serde_json::json!({"t": {"0": 15, "1": 15}}),
        "{last}"
    );
    assert_eq!(
        src["lag"],
        serde_json::json!({"t/0": 7, "t/1": 12}),
        "{last}"
    );
    // The commit's lineage names the exact offsets read.
    let o = run_in(dir, &["table", "lineage", "ranged"]);
    assert!(o.status.success(), "{}", text(&o));
    let lineage = String::from_utf8_lossy(&o.stdout);
    assert!(
        lineage.contains("t/0: offsets [5, 8) (3 records)"),
        "{lineage}"
    );
    assert!(
        lineage.contains("t/1: offsets [0, 3) (3 records)"),
        "{lineage}"
    );
    // Bounded: later records are never read by this job.
    broker.produce("t", 2, &orders(200, 10));
    let o = run_job_progress(dir, "ck_ranged");
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(read_py(&dir.join("ranged")).len(), 6);
}

#[test]
fn kafka_partitions_that_appear_later_are_read_from_their_start() {
    // The broker cannot add partitions to a topic (CreatePartitions is not
    // supported), so new partitions arrive as a new topic matching
    // `topic_pattern`: the planner treats both the same way.
    let broker = Broker::start();
    broker.create_topic("grow-a", 2);
    let mut all = orders(0, 20);
    broker.produce("grow-a", 2, &all);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let job = kafka_job(&broker.bootstrap(), "", "out", "'topic_pattern' '^grow-'").replace(
        &format!("{}/'", broker.bootstrap()),
        &format!("{}'", broker.bootstrap()),
    );
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let o = run_job_progress(dir, "ckpt");
    assert!(o.status.success(), "{}", text(&o));
    broker.create_topic("grow-b", 3);
    let more = orders(50, 30);
    broker.produce("grow-b", 3, &more);
    broker.create_topic("other", 1);
    broker.produce("other", 1, &orders(900, 5));
    all.extend(more);
    let o = run_job_progress(dir, "ckpt");
    assert!(o.status.success(), "{}", text(&o));
    let rows = read_py(&dir.join("out"));
    assert_eq!(order_ids(&rows), expected_ids(&all));
    assert!(
        rows.iter()
            .any(|r| r["_topic"] == "grow-b" && r["_partition"] == 2)
    );
}

#[test]
fn kafka_malformed_records_and_lost_offsets_are_clear_errors() {
    let broker = Broker::start();
    broker.create_topic("bad", 1);
    broker.produce("bad", 1, &orders(0, 3));
    broker.produce(
        "bad",
        1,
        &[(
            "k".into(),
            "{\"order_id\": \"x\", \"amount\": \"much\"}".into(),
        )],
    );
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(
        dir.join("job.sql"),
        kafka_job(&broker.bootstrap(), "bad", "out", ""),
    )
    .unwrap();
    let o = run_job_progress(dir, "ckpt");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("topic bad partition 0 offset 3"),
        "the error names the record: {err}"
    );
    assert!(
        !dir.join("out/_delta_log/00000000000000000001.json")
            .exists()
    );

    // The topic is recreated: the checkpoint's offsets are beyond its end.
    let broker2 = Broker::start();
    broker2.create_topic("gone", 1);
    broker2.produce("gone", 1, &orders(0, 10));
    std::fs::write(
        dir.join("job.sql"),
        kafka_job(&broker2.bootstrap(), "gone", "out2", ""),
    )
    .unwrap();
    assert!(run_job_progress(dir, "ckpt2").status.success());
    broker2.delete_topic("gone");
    broker2.create_topic("gone", 1);
    broker2.produce("gone", 1, &orders(100, 3));
    let o = run_job_progress(dir, "ckpt2");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("data loss on topic gone partition 0"), "{err}");
    // Told to accept the loss, the job skips forward and says so.
    std::fs::write(
        dir.join("job.sql"),
        kafka_job(
            &broker2.bootstrap(),
            "gone",
            "out2",
            "'fail_on_data_loss' 'false'",
        ),
    )
    .unwrap();
    let o = run_job_progress(dir, "ckpt2");
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("data loss skipped"),
        "{}",
        text(&o)
    );
    let rows = read_py(&dir.join("out2"));
    assert_eq!(rows.len(), 13);
}

#[test]
fn kafka_transaction_markers_are_stepped_over() {
    // Records written in transactions leave marker offsets that no consumer
    // receives; a batch ending on one must still complete.
    let broker = Broker::start();
    broker.create_topic("tx", 1);
    let records = orders(0, 12);
    let placed = broker.produce_transactional("tx", &records, 4);
    let last = placed.iter().map(|(_, o)| *o).max().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(
        dir.join("job.sql"),
        kafka_job(&broker.bootstrap(), "tx", "out", "'read_timeout' '20s'"),
    )
    .unwrap();
    let started = Instant::now();
    let o = run_job_progress(dir, "ckpt");
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "the reader waited on a marker"
    );
    let rows = read_py(&dir.join("out"));
    assert_eq!(order_ids(&rows), expected_ids(&records));
    let status = run_in(dir, &["status", "--checkpoint", "ckpt", "--json"]);
    let s: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let end = s["sources"]["orders"]["partitions"]["tx"]["0"]
        .as_i64()
        .unwrap();
    assert!(
        end > last + 1,
        "the planned end ({end}) lies past a marker (last record {last})"
    );
}

#[test]
fn the_kafka_example_runs_as_documented() {
    let broker = Broker::start();
    broker.create_topic("orders", 2);
    let records = orders(0, 300);
    broker.produce("orders", 2, &records);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // The example as shipped, pointed at this test's broker.
    let job = std::fs::read_to_string(root().join("examples/kafka_to_delta.sql"))
        .unwrap()
        .replace("127.0.0.1:9092", &broker.bootstrap());
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let o = run_job_progress(dir, "target/orders/_checkpoint");
    assert!(o.status.success(), "{}", text(&o));
    let rows = read_py(&dir.join("target/orders/orders"));
    let want: Vec<String> = expected_ids(&records)
        .into_iter()
        .filter(|id| id[2..].parse::<usize>().unwrap() % 7 != 0)
        .collect();
    assert_eq!(order_ids(&rows), want);
    assert!(rows.iter().all(|r| r["kafka_offset"].is_u64()), "{rows:?}");
}

#[test]
fn a_replayed_range_the_log_no_longer_holds_fails_promptly_or_is_skipped_and_recorded() {
    // Batch 0 commits offsets 0..10; batch 1 is planned over 10..20 and the
    // process dies before reading it; the topic is then recreated with 3
    // records. The replay can never read its range: before, the reader
    // waited out read_timeout and failed, on every restart.
    let broker = Broker::start();
    broker.create_topic("trunc", 1);
    broker.produce("trunc", 1, &orders(0, 20));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let job = |extra: &str| {
        let opts = format!("'read_timeout' '100s', 'max_offsets_per_trigger' '10'{extra}");
        kafka_job(&broker.bootstrap(), "trunc", "out", &opts)
    };
    std::fs::write(dir.join("job.sql"), job("")).unwrap();
    let o = run_available_now(
        dir,
        "job.sql",
        "ckpt",
        &[("LAKESTREAM_FAIL_POINT", "after-write-ahead:1".into())],
        &[],
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert_eq!(read_py(&dir.join("out")).len(), 10);
    broker.delete_topic("trunc");
    broker.create_topic("trunc", 1);
    broker.produce("trunc", 1, &orders(100, 3));

    let started = Instant::now();
    let o = run_job_progress(dir, "ckpt");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("batch 1") && err.contains("data loss on topic trunc partition 0"),
        "{err}"
    );
    assert!(err.contains("offsets 10..20"), "names the range: {err}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "failed only after {:?}",
        started.elapsed()
    );
    assert_eq!(read_py(&dir.join("out")).len(), 10, "nothing was committed");

    // Told to accept the loss, the replay commits nothing of the gone range
    // and records the skip in progress and in the table's history; the next
    // batch sees the recreated topic (its id changed) and reads it from its
    // start, each record once.
    std::fs::write(dir.join("job.sql"), job(", 'fail_on_data_loss' 'false'")).unwrap();
    let o = run_job_progress(dir, "ckpt");
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("trunc/0 offsets 10..20"), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("was recreated (topic id"),
        "{}",
        text(&o)
    );
    assert!(stdout.contains("resumed at 0"), "{}", text(&o));
    let history = history_py(&dir.join("out"));
    assert!(
        history
            .iter()
            .any(|c| c.to_string().contains("trunc/0 offsets 10..20")),
        "{history:?}"
    );
    let rows = read_py(&dir.join("out"));
    let mut expected = orders(0, 10);
    expected.extend(orders(100, 3));
    assert_eq!(order_ids(&rows), expected_ids(&expected));
}

#[test]
fn a_topic_that_does_not_exist_fails_after_the_configured_wait_naming_it() {
    let broker = Broker::start();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(
        dir.join("job.sql"),
        kafka_job(
            &broker.bootstrap(),
            "nosuchtopic",
            "out",
            "'unavailable_timeout' '3s'",
        ),
    )
    .unwrap();
    let started = Instant::now();
    let o = run_job_progress(dir, "ckpt");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("nosuchtopic") && err.contains("still unavailable after"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "gave up only after {:?}",
        started.elapsed()
    );
}

/// The source conformance suite (`lakestream-testkit`) against the real
/// broker: ranges read twice or as two partitions give the same records,
/// a restarted source plans the rest with every record once, an empty
/// topic plans nothing, reads stream in `batch_size` pieces.
#[test]
fn the_kafka_source_passes_the_source_suite() {
    use lakestream_engine::source::Source;
    use lakestream_engine::source::kafka::{
        KafkaSource, KafkaSourceOptions, StartingOffsets, Topics, ValueFormat,
    };
    let broker = Broker::start();
    broker.create_topic("suite", 3);
    broker.create_topic("suite-empty", 1);
    broker.produce("suite", 3, &orders(0, 60));
    let source = |topic: &str| -> std::sync::Arc<dyn Source> {
        let mut o = KafkaSourceOptions::new(&broker.bootstrap(), Topics::List(vec![topic.into()]));
        o.format = ValueFormat::String;
        o.starting_offsets = StartingOffsets::Earliest;
        o.max_offsets_per_trigger = Some(10);
        o.batch_size = 4;
        std::sync::Arc::new(KafkaSource::try_new("orders", None, o).unwrap())
    };
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        lakestream_testkit::source_conformance(|| source("suite"), source("suite-empty"), 60, 4)
            .await;
    });
}

/// A windowed aggregation over a Kafka topic, killed with SIGKILL at random
/// moments and restarted until done, writes the table a run without kills
/// writes: the same windows, counts and sums, each once (its watermarks
/// and late rows fixed by the write-ahead, its state restored per batch).
#[test]
fn kafka_windowed_aggregation_through_sigkills_writes_what_a_clean_run_writes() {
    let broker = Broker::start();
    broker.create_topic("clicks", 3);
    let base = 1_767_225_600i64; // 2026-01-01T00:00:00Z
    let records: Vec<(String, String)> = (0..900i64)
        .map(|i| {
            // Three records a second, every ninth 90 s late.
            let t = base + i / 3 - if i % 9 == 8 { 90 } else { 0 };
            let ts = chrono::DateTime::from_timestamp(t, 0).unwrap().to_rfc3339();
            (
                format!("u-{}", i % 5),
                format!("{{\"ts\":\"{ts}\",\"user_id\":{},\"amount\":{i}}}", i % 5),
            )
        })
        .collect();
    broker.produce("clicks", 3, &records);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let job = |table: &str| {
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE clicks (ts TIMESTAMP, user_id BIGINT, amount BIGINT)\n\
             STORED AS KAFKA LOCATION 'kafka://{}/clicks'\n\
             OPTIONS ('format' 'json', 'max_offsets_per_trigger' '60', 'event_time' 'ts', \
             'watermark_delay' '1 minute');\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{table}';\n\
             INSERT INTO out SELECT window.start AS minute, user_id, count(*) AS n, \
             sum(amount) AS total FROM clicks GROUP BY window(ts, '1 minute'), user_id;\n",
            broker.bootstrap()
        )
    };
    let clean = killed_run_writes_the_clean_table(dir, &job, 6, 2);
    // Five minutes of event time, five users: the closed windows.
    assert!(clean.len() >= 20, "only {} groups written", clean.len());
}

/// Consumers are kept from batch to batch: a range that starts where the
/// last one ended reads on (with what the consumer fetched past it), any
/// other start (a replay) is assigned afresh, a read dropped midway loses
/// nothing for the next one, and the wait between plans wakes on a new
/// record instead of sleeping the poll interval.
#[test]
fn kept_consumers_read_exactly_the_planned_ranges_and_wake_on_a_new_record() {
    use futures::StreamExt;
    use lakestream_engine::source::Source;
    use lakestream_engine::source::kafka::{KafkaSource, KafkaSourceOptions, Topics, ValueFormat};
    let broker = Broker::start();
    broker.create_topic("kept", 2);
    let placed = broker.produce("kept", 2, &orders(0, 40));
    for p in 0..2 {
        assert_eq!(placed.iter().filter(|(q, _)| *q == p).count(), 20);
    }
    let source = || {
        let mut o = KafkaSourceOptions::new(&broker.bootstrap(), Topics::List(vec!["kept".into()]));
        o.format = ValueFormat::String;
        o.batch_size = 3;
        KafkaSource::try_new("orders", None, o).unwrap()
    };
    let at = |a: i64, b: i64| serde_json::json!({"partitions": {"kept": {"0": a, "1": b}}});
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let read = |source: &KafkaSource, s: serde_json::Value, e: serde_json::Value| {
            let streams = source.read(Some(&s), &e, 1).unwrap();
            async move {
                let mut rows = Vec::new();
                for mut stream in streams {
                    while let Some(b) = stream.next().await {
                        rows.extend(lakestream_testkit::rows_of(&b.unwrap()));
                    }
                }
                rows.sort();
                rows
            }
        };
        let kept = source();
        kept.restore(None).await.unwrap();
        let first = read(&kept, at(0, 0), at(5, 5)).await;
        assert_eq!(first.len(), 10);
        // Reads on: the consumer stands at 5/5 and fetched past it.
        let second = read(&kept, at(5, 5), at(12, 12)).await;
        assert_eq!(second.len(), 14);
        // A replay of the first range: assigned afresh, the same rows.
        assert_eq!(read(&kept, at(0, 0), at(5, 5)).await, first);
        // A read dropped after its first record batch.
        {
            let mut streams = kept.read(Some(&at(5, 5)), &at(20, 20), 1).unwrap();
            assert_eq!(streams[0].next().await.unwrap().unwrap().num_rows(), 3);
        }
        assert_eq!(read(&kept, at(5, 5), at(12, 12)).await, second);
        let rest = read(&kept, at(12, 12), at(20, 20)).await;
        assert_eq!(rest.len(), 16);
        // Together, exactly what a new consumer reads of the whole topic.
        let mut together = [first, second, rest].concat();
        together.sort();
        let fresh = source();
        fresh.restore(None).await.unwrap();
        assert_eq!(together, read(&fresh, at(0, 0), at(20, 20)).await);

        // Nothing new: the wait lasts its whole time.
        let t = Instant::now();
        kept.wait_for_data(Some(&at(20, 20)), Duration::from_millis(300))
            .await;
        assert!(
            t.elapsed() >= Duration::from_millis(250),
            "{:?}",
            t.elapsed()
        );
        // A record produced while waiting ends the wait.
        let bootstrap = broker.bootstrap();
        let producer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            let rt = tokio::runtime::Runtime::new().unwrap();
            crate::broker::produce_at(&rt, &bootstrap, "kept", 1, &orders(40, 1))
        });
        let t = Instant::now();
        kept.wait_for_data(Some(&at(20, 20)), Duration::from_secs(30))
            .await;
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert_eq!(producer.join().unwrap(), vec![(0, 20)]);
        let new = read(&kept, at(20, 20), at(21, 20)).await;
        assert_eq!(new.len(), 1);
        assert!(new[0].contains("o-000040"), "{new:?}");
    });
}
