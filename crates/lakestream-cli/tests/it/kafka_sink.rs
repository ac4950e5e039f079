//! Kafka as an output, against a real Kafka-protocol broker process: each
//! batch in one transaction that commits its batch id, read back by an
//! independent reader that decides from the log's own commit and abort
//! markers what a read_committed consumer sees (`tests/py/read_committed.py`;
//! the test broker does not filter aborted records for its consumers).

use std::time::Duration;

use crate::broker::{Broker, kafka_job, orders};
use crate::common::*;

/// What `tests/py/read_committed.py` reads of `topic`.
struct Topic {
    committed: Vec<serde_json::Value>,
    aborted: u64,
    open: u64,
}

impl Topic {
    fn read(broker: &Broker, topic: &str) -> Self {
        let bootstrap = broker.bootstrap();
        let settings: serde_json::Map<String, serde_json::Value> = broker
            .client_settings()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.into()))
            .collect();
        let settings = serde_json::Value::Object(settings).to_string();
        let out = run_py_lines(
            "read_committed.py",
            &[bootstrap.as_ref(), topic.as_ref(), settings.as_ref()],
            &[],
        );
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        Self {
            committed: v["committed"].as_array().unwrap().clone(),
            aborted: v["aborted"].as_u64().unwrap(),
            open: v["open"].as_u64().unwrap(),
        }
    }

    /// The committed records' values, parsed.
    fn values(&self) -> Vec<serde_json::Value> {
        self.committed
            .iter()
            .map(|r| serde_json::from_str(r["value"].as_str().unwrap()).unwrap())
            .collect()
    }
}

/// Topic `alerts` (2 partitions) on `broker`, and a fresh directory with
/// `files` event files of `rows` events under `in/` and `job.sql`: the
/// events kept (amount > 0) to `alerts`, keyed by event id, one file per
/// batch, with the topic's extra `options`. The directory and the kept
/// ids, sorted.
fn alerts_job(
    broker: &Broker,
    files: usize,
    rows: usize,
    options: &str,
) -> (tempfile::TempDir, Vec<String>) {
    broker.create_topic("alerts", 2);
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in");
    let mut kept = write_events(&input, 0, files, rows);
    kept.sort();
    let job = format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events (\n  event_id VARCHAR NOT NULL, user_id BIGINT, \
         event_type VARCHAR, amount DOUBLE, ts TIMESTAMP\n) STORED AS JSON LOCATION '{}'\n\
         OPTIONS ('max_files_per_trigger' '1');\n\
         CREATE EXTERNAL TABLE alerts STORED AS KAFKA LOCATION 'kafka://{}/alerts'\n\
         OPTIONS ('format' 'json'{options});\n\
         INSERT INTO alerts SELECT event_id AS _key, event_id, user_id, amount, ts AS _timestamp,\n\
         CAST(user_id % 2 AS INT) AS _partition, '{{\"source\": \"files\"}}' AS _headers\n\
         FROM events WHERE amount > 0;\n",
        input.display(),
        broker.bootstrap()
    );
    std::fs::write(tmp.path().join("job.sql"), job).unwrap();
    (tmp, kept)
}

#[test]
fn files_to_kafka_each_row_once_with_its_key_partition_timestamp_and_headers() {
    let broker = Broker::start();
    let (tmp, kept) = alerts_job(&broker, 3, 20, "");
    let dir = tmp.path();
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    let topic = Topic::read(&broker, "alerts");
    assert_eq!((topic.aborted, topic.open), (0, 0));
    let values = topic.values();
    assert_exactly_once(&values, &kept);
    for (r, v) in topic.committed.iter().zip(&values) {
        // The reserved columns are the record's parts, not the value's.
        assert_eq!(r["key"], v["event_id"]);
        assert_eq!(r["partition"], v["user_id"].as_i64().unwrap() % 2);
        assert_eq!(r["headers"], serde_json::json!({"source": "files"}));
        let obj = v.as_object().unwrap();
        assert!(!obj.contains_key("_key") && !obj.contains_key("_partition"));
        assert!(obj.contains_key("amount") && !obj.contains_key("ts"));
    }
    // The events' own times (2026-01-01..03 10:00 UTC) became the
    // records' timestamps.
    let jan_1_10h = 1_767_261_600_000_i64;
    let times: std::collections::BTreeSet<i64> = topic
        .committed
        .iter()
        .map(|r| r["timestamp"].as_i64().unwrap())
        .collect();
    let want: std::collections::BTreeSet<i64> =
        (0..3).map(|d| jan_1_10h + d * 86_400_000).collect();
    assert_eq!(times, want);
    // The batch ids are committed to the query's group: batch 2 last.
    let query_id = checkpoint_query_id(dir);
    let group = format!("lakestream-{query_id}");
    assert_eq!(broker.committed(&group, "alerts", 1), vec![3]);

    // A second run over the same input finds every batch committed.
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(Topic::read(&broker, "alerts").committed.len(), kept.len());
    // New input: the next batches, once.
    let more = write_events(&dir.join("in"), 3, 2, 20);
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    let mut all: Vec<String> = kept.iter().chain(&more).cloned().collect();
    all.sort();
    assert_exactly_once(&Topic::read(&broker, "alerts").values(), &all);
    assert_eq!(broker.committed(&group, "alerts", 1), vec![5]);
}

/// The query id the checkpoint in `dir/ckpt` was created with.
fn checkpoint_query_id(dir: &std::path::Path) -> String {
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("ckpt/metadata")).unwrap()).unwrap();
    meta["query_id"].as_str().unwrap().to_string()
}

#[test]
fn files_to_kafka_exactly_once_through_sigkills() {
    let broker = Broker::start();
    // Batches of 2,000 records: a kill can land while one is produced.
    let (tmp, kept) = alerts_job(&broker, 30, 2_000, "");
    let dir = tmp.path();
    // The topic cannot be put back as it was, so the loop never starts
    // over; kills must land in its one pass.
    let (kills, _) = kill_until_done_logged(
        dir,
        &run_job_args("ckpt"),
        &[],
        &Kills {
            max: 8,
            min: 0,
            seed: clock_seed(),
            limit: Duration::from_secs(300),
            latest: Duration::from_millis(600),
        },
    );
    let topic = Topic::read(&broker, "alerts");
    eprintln!(
        "killed {kills} times; {} records committed, {} aborted",
        topic.committed.len(),
        topic.aborted
    );
    assert!(kills >= 1, "no kill landed: the run proves nothing");
    assert_eq!(topic.open, 0, "a transaction was left open");
    assert_exactly_once(&topic.values(), &kept);
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("clean: 30 batches"), "{}", text(&o));
}

#[test]
fn kafka_to_kafka_exactly_once() {
    let broker = Broker::start();
    broker.create_topic("orders", 3);
    broker.create_topic("big_orders", 1);
    let records = orders(0, 300);
    broker.produce("orders", 3, &records);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // The Delta job's source, writing to a topic instead.
    let job = kafka_job(&broker.bootstrap(), "orders", "unused", "'max_offsets_per_trigger' '50'")
        .replace(
            "CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'unused';",
            &format!(
                "CREATE EXTERNAL TABLE out STORED AS KAFKA LOCATION 'kafka://{}/big_orders';",
                broker.bootstrap()
            ),
        )
        .replace(
            "INSERT INTO out SELECT order_id, customer_id, amount, ts, _topic, _partition, _offset FROM orders;",
            "INSERT INTO out SELECT order_id AS _key, order_id, amount, _partition AS source_partition, _offset AS source_offset FROM orders WHERE amount > 10;",
        );
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    let topic = Topic::read(&broker, "big_orders");
    let mut got: Vec<String> = topic
        .values()
        .iter()
        .map(|v| v["order_id"].as_str().unwrap().to_string())
        .collect();
    got.sort();
    let mut want: Vec<String> = records
        .iter()
        .map(|(_, v)| serde_json::from_str::<serde_json::Value>(v).unwrap())
        .filter(|v| v["amount"].as_f64().unwrap() > 10.0)
        .map(|v| v["order_id"].as_str().unwrap().to_string())
        .collect();
    want.sort();
    assert_eq!(got, want);
    assert!(topic.committed.iter().all(|r| r["key"].is_string()));
}

#[test]
fn a_kafka_output_is_refused_clearly_when_it_cannot_be_written_exactly_once() {
    let broker = Broker::start();
    broker.create_topic("alerts", 1);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_events(&dir.join("in"), 0, 1, 5);
    let input = dir.join("in");
    let select = "SELECT event_id FROM events";
    for (topic, extra, query, expect) in [
        // A topic the job would create with the broker's defaults.
        ("missing", "", select, "topic missing does not exist"),
        // Keys the sink owns.
        (
            "alerts",
            ", 'kafka.transactional.id' 'mine'",
            select,
            "transactional_id",
        ),
        ("alerts", ", 'kafka.acks' '1'", select, "acks=all"),
        // A key column of a type a key cannot be.
        (
            "alerts",
            "",
            "SELECT user_id AS _key FROM events",
            "CAST(... AS VARCHAR) AS _key",
        ),
        // Complete mode cannot take rows back out of a topic.
        (
            "alerts",
            ", 'output_mode' 'complete'",
            "SELECT user_id, count(*) AS n FROM events GROUP BY user_id",
            "complete mode",
        ),
    ] {
        let job = format!(
            "CREATE UNBOUNDED EXTERNAL TABLE events (event_id VARCHAR, user_id BIGINT, amount DOUBLE, ts TIMESTAMP)\n\
             STORED AS JSON LOCATION '{}';\n\
             CREATE EXTERNAL TABLE out STORED AS KAFKA LOCATION 'kafka://{}/{topic}'\n\
             OPTIONS ('format' 'json'{extra});\n\
             INSERT INTO out {query};\n",
            input.display(),
            broker.bootstrap()
        );
        std::fs::write(dir.join("job.sql"), job).unwrap();
        let o = run_in(dir, &run_job_args("ckpt-refused"));
        assert!(!o.status.success(), "{extra} {query}: {}", text(&o));
        let msg = stderr(&o);
        assert!(msg.contains(expect), "{extra} {query}: {msg}");
        let _ = std::fs::remove_dir_all(dir.join("ckpt-refused"));
    }
    assert!(Topic::read(&broker, "alerts").committed.is_empty());
}

#[test]
fn the_kafka_to_kafka_example_runs_as_documented() {
    let broker = Broker::start();
    broker.create_topic("orders", 2);
    broker.create_topic("large_orders", 2);
    broker.create_topic("customer_totals", 1);
    let records = orders(0, 400);
    broker.produce("orders", 2, &records);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // The example as shipped, pointed at this test's broker, in batches of
    // 50 records per partition so the totals change over several batches.
    let job = std::fs::read_to_string(root().join("examples/kafka_to_kafka.sql"))
        .unwrap()
        .replace("127.0.0.1:9092", &broker.bootstrap())
        .replace(
            "'max_offsets_per_trigger' '100000'",
            "'max_offsets_per_trigger' '100'",
        );
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let o = run_job_progress(dir, "target/kafka_to_kafka/_checkpoint");
    assert!(o.status.success(), "{}", text(&o));
    let orders: Vec<serde_json::Value> = records
        .iter()
        .map(|(_, v)| serde_json::from_str(v).unwrap())
        .collect();

    let large = Topic::read(&broker, "large_orders");
    let mut got: Vec<String> = large
        .values()
        .iter()
        .map(|v| v["order_id"].as_str().unwrap().to_string())
        .collect();
    got.sort();
    let mut want: Vec<String> = orders
        .iter()
        .filter(|o| o["amount"].as_f64().unwrap() >= 25.0)
        .map(|o| o["order_id"].as_str().unwrap().to_string())
        .collect();
    want.sort();
    assert_eq!(got, want, "each large order once");
    for r in &large.committed {
        let p = r["headers"]["source_partition"].as_str().unwrap();
        assert!(p == "0" || p == "1", "{r}");
        assert!(r["key"].as_str().unwrap().starts_with("o-"));
    }

    // The newest record per customer is its total over every order.
    let totals = Topic::read(&broker, "customer_totals");
    let mut newest = std::collections::BTreeMap::new();
    for (r, v) in totals.committed.iter().zip(totals.values()) {
        newest.insert(r["key"].as_str().unwrap().to_string(), v);
    }
    let mut expected = std::collections::BTreeMap::new();
    for o in &orders {
        let e = expected
            .entry(o["customer_id"].as_i64().unwrap().to_string())
            .or_insert((0, 0.0));
        e.0 += 1;
        e.1 += o["amount"].as_f64().unwrap();
    }
    assert_eq!(newest.len(), expected.len());
    for (k, (n, total)) in &expected {
        let v = &newest[k];
        assert_eq!(v["orders"].as_i64(), Some(*n), "{k}: {v}");
        assert!(
            (v["total"].as_f64().unwrap() - total).abs() < 1e-6,
            "{k}: {v}"
        );
    }
    // Several batches changed the totals: a changelog, not one record each.
    assert!(
        totals.committed.len() > expected.len(),
        "{}",
        totals.committed.len()
    );
    let o = run_in(
        dir,
        &[
            "verify",
            "--checkpoint",
            "target/kafka_to_kafka/_checkpoint",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn a_crash_between_a_delta_and_a_kafka_commit_replays_only_the_output_that_lacks_the_batch() {
    let broker = Broker::start();
    broker.create_topic("alerts", 1);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut kept = write_events(&dir.join("in"), 0, 3, 10);
    kept.sort();
    for (first, second) in [("DELTA", "KAFKA"), ("KAFKA", "DELTA")] {
        let ckpt = format!("ckpt-{first}");
        let _ = std::fs::remove_dir_all(dir.join("table"));
        broker.delete_topic("alerts");
        broker.create_topic("alerts", 1);
        let location = |format: &str| match format {
            "KAFKA" => format!("kafka://{}/alerts", broker.bootstrap()),
            _ => dir.join("table").display().to_string(),
        };
        let job = format!(
            "CREATE UNBOUNDED EXTERNAL TABLE events (event_id VARCHAR, user_id BIGINT, \
             amount DOUBLE, ts TIMESTAMP)\n\
             STORED AS JSON LOCATION '{}' OPTIONS ('max_files_per_trigger' '1');\n\
             CREATE EXTERNAL TABLE first STORED AS {first} LOCATION '{}';\n\
             CREATE EXTERNAL TABLE second STORED AS {second} LOCATION '{}';\n\
             INSERT INTO first SELECT event_id, amount FROM events WHERE amount > 0;\n\
             INSERT INTO second SELECT event_id, amount FROM events WHERE amount > 0;\n",
            dir.join("in").display(),
            location(first),
            location(second)
        );
        std::fs::write(dir.join("job.sql"), job).unwrap();
        // Batch 1 is committed to the first output, then the process fails.
        let o = run_available_now(
            dir,
            "job.sql",
            &ckpt,
            &[("LAKESTREAM_FAIL_POINT", "after-commit:1".into())],
            &[],
        );
        assert!(!o.status.success(), "{}", text(&o));
        let o = run_available_now(dir, "job.sql", &ckpt, &[], &[]);
        assert!(o.status.success(), "{}", text(&o));
        let topic = Topic::read(&broker, "alerts");
        assert_exactly_once(&topic.values(), &kept);
        assert_exactly_once(&read_py(&dir.join("table")), &kept);
        let o = run_in(dir, &["verify", "--checkpoint", &ckpt]);
        assert!(o.status.success(), "{first} then {second}: {}", text(&o));
    }
}

#[test]
fn unreachable_brokers_fail_the_run_naming_them_within_unavailable_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_events(&dir.join("in"), 0, 1, 5);
    // Port 1 on loopback: nothing listens.
    let job = format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events (event_id VARCHAR, amount DOUBLE)\n\
         STORED AS JSON LOCATION '{}';\n\
         CREATE EXTERNAL TABLE out STORED AS KAFKA LOCATION 'kafka://127.0.0.1:1/alerts'\n\
         OPTIONS ('unavailable_timeout' '2s');\n\
         INSERT INTO out SELECT event_id FROM events;\n",
        dir.join("in").display()
    );
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let started = std::time::Instant::now();
    let o = run_job(dir);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    let msg = stderr(&o);
    assert!(
        msg.contains("127.0.0.1:1") && msg.contains("unavailable_timeout"),
        "{msg}"
    );
}

#[test]
fn a_tls_only_broker_is_written_with_the_settings_the_source_takes() {
    let broker = Broker::start_tls();
    let (tmp, kept) = alerts_job(&broker, 2, 20, &format!(", {}", broker.job_options()));
    let dir = tmp.path();
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    assert_exactly_once(&Topic::read(&broker, "alerts").values(), &kept);
}

#[test]
fn a_delta_tables_change_feed_streams_to_kafka_exactly_once_under_kill_9() {
    let broker = Broker::start();
    broker.create_topic("user_changes", 2);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // An update-mode count per user into a table with its change feed on.
    crate::deletion_vectors::counts_with_feed(dir, 8);
    std::fs::write(
        dir.join("job.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE changes STORED AS DELTA LOCATION 'per_user'\n\
             OPTIONS ('read_change_feed' 'true', 'max_files_per_trigger' '1', \
             'starting_version' '0');\n\
             CREATE EXTERNAL TABLE out STORED AS KAFKA \
             LOCATION 'kafka://{}/user_changes';\n\
             INSERT INTO out SELECT CAST(user_id AS VARCHAR) AS _key, user_id, n, \
             _change_type, _commit_version FROM changes;\n",
            broker.bootstrap()
        ),
    )
    .unwrap();
    let (kills, _) = kill_until_done_logged(
        dir,
        &run_job_args("ckpt"),
        &[],
        &Kills {
            max: 4,
            min: 0,
            seed: clock_seed(),
            limit: Duration::from_secs(240),
            latest: Duration::from_millis(300),
        },
    );
    let topic = Topic::read(&broker, "user_changes");
    let python = cdf_py(&dir.join("per_user"));
    // Every change once: 7 inserts, then 7 pre- and post-images a batch.
    assert_eq!(
        crate::deletion_vectors::changes(&topic.values()),
        crate::deletion_vectors::changes(&python),
        "after {kills} kills"
    );
    assert_eq!(topic.committed.len(), 7 + 7 * 2 * 7);
}

#[test]
fn a_second_process_on_the_checkpoint_fences_a_hung_first_and_nothing_is_doubled() {
    // An object-store checkpoint takes no OS lock: a second process can
    // start while the first hangs (a paused VM, a GC pause, SIGSTOP). The
    // second's producer fences the first's; when the first wakes, its
    // commit is refused and it stops.
    let s3 = lakestream_testkit::s3::S3Server::from_env();
    let broker = Broker::start();
    // A fenced producer's commit waits out this bound.
    let (tmp, kept) = alerts_job(&broker, 40, 1_000, ", 'unavailable_timeout' '10s'");
    let dir = tmp.path();
    let ckpt = format!("{}ckpt/", s3.prefix("fence"));
    let args = run_job_args(&ckpt);
    let spawn = || {
        bin()
            .current_dir(dir)
            .envs(s3.env())
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let mut rng = Rng(clock_seed() | 1);
    let first = spawn();
    std::thread::sleep(Duration::from_millis(400 + rng.below(600)));
    let pid = first.id() as libc::pid_t;
    // SAFETY: signalling our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let second = spawn().wait_with_output().unwrap();
    assert!(second.status.success(), "{}", text(&second));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let first = first.wait_with_output().unwrap();
    let topic = Topic::read(&broker, "alerts");
    eprintln!(
        "first process: {:?}; {} aborted records",
        first.status, topic.aborted
    );
    // Woken, the first cannot commit what the second holds: its
    // transaction is refused (the broker fenced it; tansu answers a fenced
    // producer's commit by letting it time out), or its next write-ahead
    // finds the second's. Had it been paused between batches, it would
    // find the checkpoint taken.
    let msg = stderr(&first);
    assert!(
        !first.status.success(),
        "the fenced process exited 0: {msg}"
    );
    assert!(
        msg.contains("nothing of the batch is visible") || msg.contains("in use"),
        "{msg}"
    );
    assert_eq!(topic.open, 0);
    assert_exactly_once(&topic.values(), &kept);
}

#[test]
fn a_record_the_broker_refuses_aborts_its_batch_and_nothing_of_it_is_visible() {
    let broker = Broker::start();
    broker.create_topic("alerts", 2);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_events(&dir.join("in"), 0, 1, 20);
    // Partition 7 of a 2-partition topic: librdkafka cannot deliver it.
    let job = format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events (event_id VARCHAR, user_id BIGINT, amount DOUBLE, ts TIMESTAMP)\n\
         STORED AS JSON LOCATION '{}';\n\
         CREATE EXTERNAL TABLE out STORED AS KAFKA LOCATION 'kafka://{}/alerts'\n\
         OPTIONS ('unavailable_timeout' '10s');\n\
         INSERT INTO out SELECT event_id, CASE WHEN user_id = 3 THEN 7 ELSE 0 END AS _partition \
         FROM events;\n",
        dir.join("in").display(),
        broker.bootstrap()
    );
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let o = run_job(dir);
    assert!(!o.status.success(), "{}", text(&o));
    let msg = stderr(&o);
    assert!(
        msg.contains("batch 0") && msg.contains("nothing of the batch is visible"),
        "{msg}"
    );
    let topic = Topic::read(&broker, "alerts");
    assert!(topic.committed.is_empty(), "{:?}", topic.committed);
    assert_eq!(topic.open, 0);
}

#[test]
fn verify_finds_a_batch_the_checkpoint_marks_done_that_the_topic_lacks() {
    let broker = Broker::start();
    let (tmp, _) = alerts_job(&broker, 3, 10, "");
    let dir = tmp.path();
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("clean: 3 batches"), "{}", text(&o));
    // Damage: the checkpoint now says batch 3 was planned and is done,
    // though no transaction committed it to the topic.
    for log in ["offsets", "commits"] {
        let from = dir.join(format!("ckpt/{log}/2"));
        let mut entry: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&from).unwrap()).unwrap();
        entry["batch_id"] = 3.into();
        std::fs::write(
            dir.join(format!("ckpt/{log}/3")),
            serde_json::to_vec_pretty(&entry).unwrap(),
        )
        .unwrap();
    }
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let out = text(&o);
    assert!(
        out.contains("NOT CLEAN")
            && out.contains("marks batch 3 done, but the last batch committed to alerts is 2"),
        "{out}"
    );
}
