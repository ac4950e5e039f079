//! kill -9 at random moments, restart until done: every row exactly once.

use std::time::Duration;

use crate::common::*;

/// `lakestream run job.sql` to the end of the input, checkpointed at `ckpt`.
const RUN_JOB: [&str; 6] = [
    "run",
    "job.sql",
    "--checkpoint",
    "ckpt",
    "--trigger",
    "available-now",
];

#[test]
fn sigkill_at_random_moments_then_restart_keeps_every_row_exactly_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    let expected = {
        let mut v = write_events(&input, 0, 60, 20);
        v.sort();
        v
    };
    std::fs::write(dir.join("job.sql"), events_job(&input, &dir.join("out"), 1)).unwrap();
    let kills = kill_until_done(
        dir,
        &RUN_JOB,
        &[],
        8,
        clock_seed(),
        Duration::from_secs(240),
    );
    // 60 one-file batches take far longer than the longest delay: a run of
    // this test that killed nothing would prove nothing.
    assert!(kills >= 3, "only {kills} kills landed");
    let rows = read_py(&dir.join("out"));
    assert_exactly_once(&rows, &expected);
    let ours = query(
        dir,
        "SELECT count(*) AS n, count(DISTINCT event_id) AS d FROM 'out'",
    );
    assert_eq!(ours[0]["n"], expected.len() as u64);
    assert_eq!(ours[0]["d"], expected.len() as u64);
}

/// `files` files of `rows` events each, event times moving forward by about
/// 20 s per file with some rows up to 90 s behind (a few of them behind the
/// 1-minute watermark: dropped the same way in every run).
fn write_timed_events(dir: &std::path::Path, files: usize, rows: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let base = 1_767_225_600i64; // 2026-01-01T00:00:00Z
    for f in 0..files {
        let mut body = String::new();
        for r in 0..rows {
            let late = if r % 4 == 3 { 90 } else { 0 };
            let t = base + (f as i64) * 20 + (r as i64 % 20) - late;
            let ts = chrono::DateTime::from_timestamp(t, 0).unwrap().to_rfc3339();
            body.push_str(&format!(
                "{{\"ts\":\"{ts}\",\"user_id\":{},\"amount\":{}}}\n",
                r % 5,
                f * rows + r
            ));
        }
        let tmp = dir.join(format!(".tmp-{f}"));
        std::fs::write(&tmp, body).unwrap();
        std::fs::rename(&tmp, dir.join(format!("events-{f:04}.json"))).unwrap();
    }
}

fn windowed_job(input: &std::path::Path, table: &std::path::Path, mode: &str) -> String {
    format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events (ts TIMESTAMP, user_id BIGINT, amount BIGINT)\n\
         STORED AS JSON LOCATION '{}'\n\
         OPTIONS ('max_files_per_trigger' '1', 'event_time' 'ts', 'watermark_delay' '1 minute');\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{}' OPTIONS ('output_mode' '{mode}');\n\
         INSERT INTO out\n\
         SELECT window.start AS minute, user_id, count(*) AS n, sum(amount) AS total, \
         min(amount) AS low, avg(amount) AS mean\n\
         FROM events GROUP BY window(ts, '1 minute'), user_id;\n",
        input.display(),
        table.display()
    )
}

/// A windowed aggregation in output mode `mode`, killed at random moments
/// and restarted until done, ends with the table a run without kills
/// writes.
fn windowed_sigkill_loop(mode: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    write_timed_events(&input, 40, 50);
    // The reference: the same input, no kills.
    std::fs::write(
        dir.join("clean.sql"),
        windowed_job(&input, &dir.join("clean"), mode),
    )
    .unwrap();
    let o = run_available_now(dir, "clean.sql", "clean_ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let clean = multiset(&read_py(&dir.join("clean")));
    // 40 files, 20 s apart: 13 minutes of windows, 5 users each.
    assert!(clean.len() >= 50, "only {} groups written", clean.len());

    std::fs::write(
        dir.join("job.sql"),
        windowed_job(&input, &dir.join("out"), mode),
    )
    .unwrap();
    let kills = kill_until_done(
        dir,
        &RUN_JOB,
        &[],
        8,
        clock_seed(),
        Duration::from_secs(240),
    );
    assert!(kills >= 3, "only {kills} kills landed");
    assert_eq!(multiset(&read_py(&dir.join("out"))), clean);
}

#[test]
fn sigkill_during_a_windowed_aggregation_writes_what_a_run_without_kills_writes() {
    windowed_sigkill_loop("append");
}

#[test]
fn sigkill_during_an_update_mode_aggregation_merges_what_a_run_without_kills_merges() {
    windowed_sigkill_loop("update");
}
