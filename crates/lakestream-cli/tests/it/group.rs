//! Group mode: processes running one job share a topic's partitions
//! through a Kafka consumer group, each partition's position kept in the
//! Delta table; through kills and processes joining and leaving, every
//! record lands once.
//!
//! Several members at once run on librdkafka's mock cluster (a Kafka
//! protocol broker over TCP, in this test process): the suite's tansu
//! broker assigns partitions to one member at a time reliably (the
//! takeover race below runs on it), but its group coordinator stalls with
//! several members joining, leaving or dying (seen: no partition assigned
//! to anyone for minutes, with SIGKILL and with SIGTERM kills alike).

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::broker::{Broker, assert_records_once, kafka_job, orders, produce_at};
use crate::common::*;
use crate::errors::unsafe_kill;

/// The job every process runs: the same SQL, the same group.
fn group_job(bootstrap: &str) -> String {
    kafka_job(
        bootstrap,
        "grouped",
        "out",
        "'group_id' 'ingest', 'max_offsets_per_trigger' '40', \
         'kafka.session.timeout.ms' '6000', 'kafka.heartbeat.interval.ms' '500', \
         'kafka.max.poll.interval.ms' '10000'",
    )
}

/// A process of the job with its own checkpoint `ck<i>`, logging to
/// `log<i>` (appended over kills; shown when the test fails).
fn spawn(dir: &std::path::Path, i: usize) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("log{i}")))
        .unwrap();
    bin()
        .current_dir(dir)
        .args([
            "run",
            "job.sql",
            "--checkpoint",
            &format!("ck{i}"),
            "--trigger",
            "200ms",
        ])
        .env(
            "LAKESTREAM_LOG",
            "warn,lakestream_source=info,lakestream_delta=info,lakestream_engine=info,\
             buoyant_kernel::snapshot::builder=off",
        )
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap()
}

/// The last lines of every process's log.
fn logs(dir: &std::path::Path) -> String {
    let mut out = String::new();
    for i in 0..4 {
        let text = std::fs::read_to_string(dir.join(format!("log{i}"))).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        out.push_str(&format!("--- log{i}\n"));
        for l in &lines[lines.len().saturating_sub(25)..] {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}

/// Rows in the table, read by Python `deltalake` (0 before it exists).
fn rows_now(dir: &std::path::Path) -> usize {
    if !dir.join("out/_delta_log").exists() {
        return 0;
    }
    read_py(&dir.join("out")).len()
}

/// Three processes of one job share a six-partition topic at `bootstrap`
/// (records produced by `produce` while they run); a fourth joins midway,
/// the first leaves by SIGTERM, the others are SIGKILLed at random and
/// restarted. The table ends with every record once, and every
/// checkpoint verifies clean with six position chains.
fn share_a_topic(bootstrap: &str, produce: impl Fn(&[(String, String)]) -> Vec<(i32, i64)>) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(dir.join("job.sql"), group_job(bootstrap)).unwrap();
    let seed = clock_seed();
    eprintln!("group test seed: {seed}");
    let mut rng = Rng(seed | 1);

    // Three processes; records produced while they run.
    let mut procs: Vec<Option<Child>> = (0..3).map(|i| Some(spawn(dir, i))).collect();
    let mut placed = Vec::new();
    let mut kills = 0;
    let started = Instant::now();
    for round in 0..12 {
        placed.extend(produce(&orders(round * 60, 60)));
        std::thread::sleep(Duration::from_millis(400 + rng.below(600)));
        match round {
            // A fourth process joins (a rebalance)...
            4 => procs.push(Some(spawn(dir, 3))),
            // ... and the first leaves for good, stopped by SIGTERM.
            8 => {
                let mut c = procs[0].take().unwrap();
                unsafe_kill(c.id(), 15);
                let status = c.wait().unwrap();
                assert!(status.success(), "SIGTERM: exit {:?}", status.code());
            }
            _ => {
                // Restart one of the others at random.
                let i = 1 + rng.below(procs.len() as u64 - 1) as usize;
                if let Some(mut c) = procs[i].take() {
                    c.kill().unwrap(); // SIGKILL
                    c.wait().unwrap();
                    kills += 1;
                    procs[i] = Some(spawn(dir, i));
                }
            }
        }
    }
    eprintln!("produced {} records, {kills} kills", placed.len());
    let alive = |procs: &mut Vec<Option<Child>>| {
        for (i, c) in procs.iter_mut().enumerate() {
            if let Some(c) = c
                && let Some(status) = c.try_wait().unwrap()
            {
                panic!("process {i} exited on its own: {status}\n{}", logs(dir));
            }
        }
    };
    // The survivors catch up (a killed member's partitions move once the
    // group notices it is gone: the session timeout).
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let n = rows_now(dir);
        if n >= placed.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {n} of {} records after {:?}\n{}",
            placed.len(),
            started.elapsed(),
            logs(dir)
        );
        alive(&mut procs);
        std::thread::sleep(Duration::from_secs(2));
    }
    for c in procs.iter_mut().flatten() {
        unsafe_kill(c.id(), 15);
        let status = c.wait().unwrap();
        assert!(status.success(), "SIGTERM: exit {:?}", status.code());
    }
    assert_records_once(&read_py(&dir.join("out")), &placed);
    // Each process's batches, and every partition's chain of ranges
    // across all of them, check clean.
    let mut writers = 0;
    for i in 0..4 {
        let o = run_in(
            dir,
            &["verify", "--checkpoint", &format!("ck{i}"), "--json"],
        );
        assert!(o.status.success(), "verify ck{i}: {}", text(&o));
        let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(report["positions_checked"], 6, "{report}");
        let batches = report["batches_in_table"].as_u64().unwrap();
        eprintln!("ck{i}: {batches} batches in the table");
        writers += usize::from(batches > 0);
    }
    // The group shared the partitions: several processes wrote.
    assert!(writers >= 2, "only {writers} processes committed batches");
}

#[test]
fn sigkilled_members_of_a_group_lose_and_repeat_nothing_on_the_mock_cluster() {
    let mock = rdkafka::mocking::MockCluster::new(1).unwrap();
    mock.create_topic("grouped", 6, 1).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let bootstrap = mock.bootstrap_servers();
    share_a_topic(&bootstrap, |values| {
        produce_at(&rt, &bootstrap, "grouped", 6, values)
    });
}

#[test]
fn group_mode_refuses_what_it_cannot_keep_exactly_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let job = |options: &str| kafka_job("127.0.0.1:1", "t", "out", options);
    for (options, args, wanted) in [
        (
            "'group_id' 'g', 'partitions' '0'",
            vec!["--trigger", "200ms"],
            "cannot be combined with 'group_id'",
        ),
        (
            "'group_id' 'g'",
            vec!["--trigger", "available-now"],
            "group mode runs continuously",
        ),
        (
            "'group_id' 'a/b'",
            vec!["--trigger", "200ms"],
            "without '/'",
        ),
    ] {
        std::fs::write(dir.join("job.sql"), job(options)).unwrap();
        let mut a = vec!["run", "job.sql", "--checkpoint", "ck"];
        a.extend(args);
        let o = run_in(dir, &a);
        assert_eq!(o.status.code(), Some(2), "{options}: {}", text(&o));
        assert!(stderr(&o).contains(wanted), "{options}: {}", text(&o));
        let _ = std::fs::remove_dir_all(dir.join("ck"));
    }
}

#[test]
fn a_replayed_batch_whose_partitions_another_process_committed_is_dropped_not_duplicated() {
    let broker = Broker::start();
    broker.create_topic("raced", 2);
    let placed = broker.produce("raced", 2, &orders(0, 100));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let job = kafka_job(
        &broker.bootstrap(),
        "raced",
        "out",
        "'group_id' 'race', 'kafka.session.timeout.ms' '6000', 'kafka.heartbeat.interval.ms' '500'",
    );
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let run = |ckpt: &str, trigger: &str, fail: Option<&str>| {
        let mut c = bin();
        c.current_dir(dir).args([
            "run",
            "job.sql",
            "--checkpoint",
            ckpt,
            "--trigger",
            trigger,
            "--progress-json",
        ]);
        if let Some(f) = fail {
            c.env("LAKESTREAM_FAIL_POINT", f);
        }
        c
    };
    // Process A plans batch 0 over both partitions, writes its files and
    // dies before the commit; its write-ahead holds the range.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let o = run("ck_a", "200ms", Some("after-files:0"))
            .output()
            .unwrap();
        assert!(!o.status.success(), "{}", text(&o));
        if dir.join("ck_a/offsets/0").exists() {
            break;
        }
        assert!(Instant::now() < deadline, "A never planned: {}", text(&o));
    }
    // Process B, with its own checkpoint, owns both partitions now and
    // commits the same records.
    let mut b = run("ck_b", "200ms", None)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    while rows_now(dir) < placed.len() {
        assert!(Instant::now() < deadline, "B did not catch up");
        std::thread::sleep(Duration::from_millis(500));
    }
    unsafe_kill(b.id(), 15);
    assert!(b.wait().unwrap().success());
    // A kills and replays batch 0: superseded, dropped, not written.
    let o = run("ck_a", "once", None).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let first: serde_json::Value = serde_json::from_str(
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .expect("a progress line"),
    )
    .unwrap();
    assert_eq!(first["batch_id"], 0, "{first}");
    assert_eq!(first["recovered"], true, "{first}");
    assert!(
        first["superseded"]
            .as_str()
            .is_some_and(|s| s.contains("race/raced/")),
        "{first}"
    );
    assert_records_once(&read_py(&dir.join("out")), &placed);
    for ck in ["ck_a", "ck_b"] {
        let o = run_in(dir, &["verify", "--checkpoint", ck]);
        assert!(o.status.success(), "verify {ck}: {}", text(&o));
    }
}
