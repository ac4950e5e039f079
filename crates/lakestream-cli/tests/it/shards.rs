//! Static shards: several processes, each with its own checkpoint, share
//! one input into one Delta table (`shard 'i/n'` on files, `partitions`
//! on Kafka), concurrently and under SIGKILL: every record exactly once.

use std::time::Duration;

use crate::broker::{Broker, assert_records_once, kafka_job, orders};
use crate::common::*;

fn shard_job(i: usize, n: usize) -> String {
    format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events (\n  event_id VARCHAR NOT NULL, user_id BIGINT, event_type VARCHAR, amount DOUBLE, ts TIMESTAMP\n) STORED AS JSON LOCATION 'in/' OPTIONS ('max_files_per_trigger' '1', 'shard' '{i}/{n}');\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
         INSERT INTO out SELECT event_id, user_id, amount FROM events WHERE amount > 0;\n"
    )
}

/// `job<i>.sql` checkpointed at `ck<i>` to the end of its input, killed
/// at most `kills` times; returns the kills landed.
fn run_shard(dir: &std::path::Path, i: usize, kills: usize, seed: u64) -> usize {
    let (job, ckpt) = (format!("job{i}.sql"), format!("ck{i}"));
    let args = [
        "run",
        &job,
        "--checkpoint",
        &ckpt,
        "--trigger",
        "available-now",
    ];
    kill_until_done(
        dir,
        &args,
        &[],
        kills,
        seed ^ i as u64,
        Duration::from_secs(240),
    )
}

#[test]
fn four_file_shards_backfill_one_table_each_file_once_through_sigkills() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut kept = write_events(&dir.join("in"), 0, 80, 10);
    kept.sort();
    for i in 0..4 {
        std::fs::write(dir.join(format!("job{i}.sql")), shard_job(i, 4)).unwrap();
    }
    let seed = clock_seed();
    let kills: usize = std::thread::scope(|s| {
        // Two shards are killed at random; all write at once.
        let runs: Vec<_> = (0..4)
            .map(|i| s.spawn(move || run_shard(dir, i, if i % 2 == 0 { 3 } else { 0 }, seed)))
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).sum()
    });
    assert!(kills >= 2, "only {kills} kills landed");
    assert_exactly_once(&read_py(&dir.join("out")), &kept);
    for i in 0..4 {
        let o = run_in(dir, &["verify", "--checkpoint", &format!("ck{i}")]);
        assert!(o.status.success(), "verify ck{i}: {}", text(&o));
    }
    // A shard's checkpoint cannot be run as another shard.
    std::fs::write(dir.join("job0.sql"), shard_job(1, 4)).unwrap();
    let o = run_available_now(dir, "job0.sql", "ck0", &[], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("shard 0/4"), "{}", text(&o));
    std::fs::write(dir.join("bad.sql"), shard_job(4, 4)).unwrap();
    let o = run_available_now(dir, "bad.sql", "ck_bad", &[], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("is not a shard"), "{}", text(&o));
}

#[test]
fn two_processes_share_a_topics_partitions_into_one_table_through_sigkills() {
    let broker = Broker::start();
    broker.create_topic("shared", 4);
    let records = orders(0, 800);
    let placed = broker.produce("shared", 4, &records);
    assert!(placed.iter().any(|(p, _)| *p == 3));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for (i, parts) in ["0,1", "2,3"].iter().enumerate() {
        std::fs::write(
            dir.join(format!("job{i}.sql")),
            kafka_job(
                &broker.bootstrap(),
                "shared",
                "out",
                &format!("'partitions' '{parts}', 'max_offsets_per_trigger' '60'"),
            ),
        )
        .unwrap();
    }
    let seed = clock_seed();
    std::thread::scope(|s| {
        for i in 0..2 {
            s.spawn(move || run_shard(dir, i, 2, seed));
        }
    });
    assert_records_once(&read_py(&dir.join("out")), &placed);
    for i in 0..2 {
        let o = run_in(dir, &["verify", "--checkpoint", &format!("ck{i}")]);
        assert!(o.status.success(), "verify ck{i}: {}", text(&o));
    }
}
