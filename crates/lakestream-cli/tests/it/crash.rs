//! kill -9 at random moments, restart until done: every row exactly once.

use std::time::Duration;

use crate::common::*;

/// `files` files of 20 events under `dir/in` and `job.sql` writing them
/// to `dir/out` one file a batch; the event ids, sorted.
fn events_and_job(dir: &std::path::Path, files: usize) -> Vec<String> {
    let input = dir.join("in");
    let mut ids = write_events(&input, 0, files, 20);
    ids.sort();
    std::fs::write(dir.join("job.sql"), events_job(&input, &dir.join("out"), 1)).unwrap();
    ids
}

#[test]
fn sigkill_at_random_moments_then_restart_keeps_every_row_exactly_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let expected = events_and_job(dir, 60);
    // A run of this test that killed nothing would prove nothing.
    let kills = kill_run_job(dir, 8, 3);
    let rows = read_py(&dir.join("out"));
    assert_exactly_once(&rows, &expected);
    let ours = query(
        dir,
        "SELECT count(*) AS n, count(DISTINCT event_id) AS d FROM 'out'",
    );
    assert_eq!(ours[0]["n"], expected.len() as u64);
    assert_eq!(ours[0]["d"], expected.len() as u64);
    // Table and checkpoint agree batch by batch: 60 batches, each once,
    // each starting where the one before it ended.
    assert_verified_batches(dir, kills, 60);
}

#[test]
fn sigkill_while_large_files_are_read_in_line_ranges_keeps_every_row_exactly_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    // Six files of about 2.7 MiB, one per batch: each batch is cut into two
    // line ranges, one per core, so a kill lands while both are read.
    let expected = {
        let mut v = write_events(&input, 0, 6, 25_000);
        v.sort();
        v
    };
    // A run without kills: two writers per one-day batch, so each file was
    // read by both partitions.
    clean_events_run(dir, &input, 1);
    assert_eq!(
        parquet_files(&dir.join("clean")),
        12,
        "two files per batch, one per line range"
    );
    assert_exactly_once(&read_py(&dir.join("clean")), &expected);
    std::fs::write(dir.join("job.sql"), events_job(&input, &dir.join("out"), 1)).unwrap();
    let kills = kill_run_job(dir, 6, 2);
    assert_exactly_once(&read_py(&dir.join("out")), &expected);
    assert_verified_batches(dir, kills, 6);
}

/// Batches of two 6 MiB files, one of short lines and one of long ones:
/// each file is one partition's share, cut into two pieces, and the
/// partition reading long lines (fewer rows per byte) runs out first and
/// takes the other's unbegun piece. Killed at random moments while pieces
/// change hands and restarted, every row is in the table exactly once.
#[test]
fn sigkill_while_partitions_take_each_others_pieces_keeps_every_row_exactly_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    std::fs::create_dir_all(&input).unwrap();
    let mut expected = Vec::new();
    for f in 0..4 {
        let pad = if f % 2 == 0 { 0 } else { 400 };
        let mut body = String::new();
        let mut r = 0;
        while body.len() < 6 << 20 {
            let id = format!("ev-{f}-{r:06}");
            expected.push(id.clone());
            body.push_str(&format!(
                "{{\"event_id\":\"{id}\",\"user_id\":{},\"event_type\":\"click{}\",\"amount\":1.5,\"ts\":\"2026-01-{:02}T10:00:00Z\"}}\n",
                r % 7,
                "x".repeat(pad),
                1 + f
            ));
            r += 1;
        }
        std::fs::write(input.join(format!("events-{f}.json")), body).unwrap();
    }
    expected.sort();
    // The premise, in a run without kills: a short-line day has a second
    // file, written by the partition that took its piece (each partition
    // keeps one file per day). The long-line partition is about four times
    // faster, so this held in every run watched; one batch of two is asked.
    clean_events_run(dir, &input, 2);
    let files_of_day =
        |day: &str| parquet_files(&dir.join("clean").join(format!("day=2026-01-{day}")));
    assert!(
        files_of_day("01") + files_of_day("03") > 2,
        "no piece changed hands: days 01 and 03 have {} and {} files",
        files_of_day("01"),
        files_of_day("03")
    );
    assert_exactly_once(&read_py(&dir.join("clean")), &expected);
    std::fs::write(dir.join("job.sql"), events_job(&input, &dir.join("out"), 2)).unwrap();
    let kills = kill_run_job(dir, 6, 2);
    assert_exactly_once(&read_py(&dir.join("out")), &expected);
    assert_verified_batches(dir, kills, 2);
}

/// Three files of four days each, in time order: a short day, a long one,
/// a short one, a long one. Each file is one batch, read in two line
/// ranges, one per core, so each range holds a short day and then more than
/// 32,768 rows of the next: every batch closes the short days' files while
/// it still reads (the sink's early close). Killed at random moments and
/// restarted, the job writes what a run without kills writes.
#[test]
fn sigkill_while_batches_close_the_days_their_input_has_left_writes_what_a_clean_run_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    std::fs::create_dir_all(&input).unwrap();
    let mut rows = 0;
    for f in 0..3 {
        let mut body = String::new();
        for (d, n) in [2_000, 34_000, 2_000, 34_000].into_iter().enumerate() {
            let day = 1 + 4 * f + d;
            for r in 0..n {
                body.push_str(&format!(
                    "{{\"event_id\":\"ev-{f}-{d}-{r:05}\",\"user_id\":{},\"event_type\":\"click\",\"amount\":1.5,\"ts\":\"2026-01-{day:02}T10:00:00Z\"}}\n",
                    r % 7
                ));
            }
            rows += n;
        }
        std::fs::write(input.join(format!("events-{f}.json")), body).unwrap();
    }
    let job = |table: &str| events_job(&input, &dir.join(table), 1);
    let clean = killed_run_writes_the_clean_table(dir, &job, 6, 2);
    assert_eq!(clean.len(), rows, "every row once");
    let days = query(dir, "SELECT count(DISTINCT day) AS days FROM 'clean'");
    assert_eq!(days[0]["days"], 12);
    // One batch a file, each in the table once.
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["batches_in_table"], 3, "{report}");
}

/// Input whose days come in random order takes delta-rs's split, which
/// keeps every day's file open; with a small `unordered_flush_size` each
/// batch closes its files many times before its commit. Killed at random
/// moments (files closed early but not committed, a commit half done) and
/// restarted, the job writes what a run without kills writes.
#[test]
fn sigkill_while_unordered_days_are_flushed_mid_batch_writes_what_a_clean_run_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    std::fs::create_dir_all(&input).unwrap();
    let mut rng = Rng(clock_seed() | 1);
    let mut rows = 0;
    for f in 0..3 {
        let mut body = String::new();
        for r in 0..30_000 {
            let day = 1 + rng.below(12);
            body.push_str(&format!(
                "{{\"event_id\":\"ev-{f}-{r:05}\",\"user_id\":{},\"event_type\":\"click\",\"amount\":1.5,\"ts\":\"2026-01-{day:02}T10:00:00Z\"}}\n",
                r % 7
            ));
            rows += 1;
        }
        std::fs::write(input.join(format!("events-{f}.json")), body).unwrap();
    }
    let job = |table: &str| {
        events_job(&input, &dir.join(table), 1).replace(
            "PARTITIONED BY (day);",
            "PARTITIONED BY (day)\nOPTIONS ('unordered_flush_size' '256KiB');",
        )
    };
    let clean = killed_run_writes_the_clean_table(dir, &job, 6, 2);
    assert_eq!(clean.len(), rows, "every row once");
    // The flush closed each day's file many times a batch: far more files
    // than the 36 (12 days, 3 batches) of one file per day and batch.
    let log = dir.join("clean").join("_delta_log");
    let adds: usize = std::fs::read_dir(&log)
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            p.extension()
                .is_some_and(|x| x == "json")
                .then(|| std::fs::read_to_string(p).unwrap())
        })
        .map(|t| t.lines().filter(|l| l.starts_with("{\"add\"")).count())
        .sum();
    eprintln!("{adds} files in the clean table");
    assert!(adds > 3 * 12 * 2, "{adds} files");
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["batches_in_table"], 3, "{report}");
}

#[test]
fn a_crash_loop_whose_kills_come_after_the_job_is_done_starts_over_until_they_land() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let expected = events_and_job(dir, 8);
    // Delays drawn up to ten minutes: the first loop's run finishes eight
    // small batches long before its kill is due, so no kill lands in it.
    let kills = kill_until_done_with(
        dir,
        &run_job_args("ckpt"),
        &[],
        &Kills {
            max: 4,
            min: 2,
            seed: clock_seed(),
            limit: Duration::from_secs(240),
            latest: Duration::from_secs(600),
        },
    );
    assert!(kills >= 2, "only {kills} kills landed");
    // The loop that counted started from the input alone: the table holds
    // each row once and eight batches, not a finished run's rows again.
    assert_exactly_once(&read_py(&dir.join("out")), &expected);
    assert_verified_batches(dir, kills, 8);
}

/// Run the events job over `input` into `dir/clean` without kills,
/// `max_files` files a batch.
fn clean_events_run(dir: &std::path::Path, input: &std::path::Path, max_files: usize) {
    std::fs::write(
        dir.join("clean.sql"),
        events_job(input, &dir.join("clean"), max_files),
    )
    .unwrap();
    let o = run_available_now(dir, "clean.sql", "clean_ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
}

/// The Parquet files under `dir`.
fn parquet_files(dir: &std::path::Path) -> usize {
    walkdir(dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .count()
}

/// Every file under `dir`, recursively.
fn walkdir(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walkdir(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A windowed aggregation in output mode `mode`, killed at random moments
/// and restarted until done, ends with the table a run without kills
/// writes.
fn windowed_sigkill_loop(mode: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    write_timed_events(&input, 40, 50);
    let job = |table: &str| {
        windowed_job(
            &input.display().to_string(),
            &dir.join(table).display().to_string(),
            mode,
        )
    };
    let clean = killed_run_writes_the_clean_table(dir, &job, 8, 3);
    // 40 files, 20 s apart: 13 minutes of windows, 5 users each.
    assert!(clean.len() >= 50, "only {} groups written", clean.len());

    // `status` shows the state the table's last batch left (the windows
    // still open) and the watermark.
    let o = run_in(dir, &["status", "--checkpoint", "ckpt", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let state = &s["state"][0];
    assert_eq!(state["operator"], "aggregate", "{s}");
    assert_eq!(state["as_of_batch"], s["last_committed_batch"], "{s}");
    assert!(state["rows"].as_u64().unwrap() > 0, "{s}");
    assert!(
        state["bytes"].as_u64().unwrap() > state["rows"].as_u64().unwrap(),
        "{s}"
    );
    assert!(s["watermark_ms"].as_i64().is_some(), "{s}");
    let o = run_in(dir, &["status", "--checkpoint", "ckpt"]);
    let human = text(&o);
    assert!(human.contains("state aggregate: "), "{human}");
    assert!(
        human.contains("watermark:            2026-01-01T"),
        "{human}"
    );
}

#[test]
fn sigkill_during_a_windowed_aggregation_writes_what_a_run_without_kills_writes() {
    windowed_sigkill_loop("append");
}

#[test]
fn sigkill_during_an_update_mode_aggregation_merges_what_a_run_without_kills_merges() {
    windowed_sigkill_loop("update");
}

/// A `DISTINCT ON` with a watermark (each user kept 30 s of event time
/// after its first row, then forgotten and written again), killed at
/// random moments and restarted until done, ends with the table a run
/// without kills writes.
#[test]
fn sigkill_during_a_deduplication_within_the_watermark_writes_what_a_clean_run_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    write_timed_events(&input, 40, 50);
    let job = |table: &str| {
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE events (ts TIMESTAMP, user_id BIGINT, amount BIGINT)\n\
             STORED AS JSON LOCATION '{}'\n\
             OPTIONS ('max_files_per_trigger' '1', 'event_time' 'ts', 'watermark_delay' '30 seconds');\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{}';\n\
             INSERT INTO out SELECT DISTINCT ON (user_id) user_id, ts, amount FROM events\n\
             ORDER BY user_id, ts, amount;\n",
            input.display(),
            dir.join(table).display()
        )
    };
    let clean = killed_run_writes_the_clean_table(dir, &job, 8, 3);
    // 5 users over 13 minutes of event time: each forgotten and written
    // again many times (kept for good, there would be 5 rows).
    assert!(clean.len() >= 30, "only {} first rows written", clean.len());
}
