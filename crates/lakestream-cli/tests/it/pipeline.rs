//! Pipelines: a Delta table written by one job is the stream another job
//! reads (raw -> clean -> per-minute), checked by Python `deltalake`.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::common::*;

/// Files of raw events -> the Delta table `raw`, partitioned by day.
const RAW_JOB: &str = "CREATE UNBOUNDED EXTERNAL TABLE events (\n  event_id VARCHAR NOT NULL, user_id BIGINT, event_type VARCHAR, amount DOUBLE, ts TIMESTAMP\n) STORED AS JSON LOCATION 'in/' OPTIONS ('max_files_per_trigger' '1');\n\
CREATE EXTERNAL TABLE raw STORED AS DELTA LOCATION 'raw' PARTITIONED BY (day);\n\
INSERT INTO raw SELECT event_id, user_id, event_type, amount, ts, CAST(ts AS DATE) AS day FROM events;\n";

/// The Delta table `raw` as a stream -> the Delta table `clean`.
fn clean_job(options: &str) -> String {
    format!(
        "CREATE UNBOUNDED EXTERNAL TABLE raw STORED AS DELTA LOCATION 'raw' OPTIONS ('max_files_per_trigger' '3'{options});\n\
         CREATE EXTERNAL TABLE clean STORED AS DELTA LOCATION 'clean';\n\
         INSERT INTO clean SELECT event_id, user_id, amount, ts, day FROM raw WHERE amount > 0;\n"
    )
}

fn run(dir: &Path, job: &str, ckpt: &str) -> std::process::Output {
    run_available_now(dir, job, ckpt, &[], &[])
}

#[test]
fn a_delta_table_streams_its_snapshot_then_its_new_commits() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut expected = write_events(&dir.join("in"), 0, 4, 10);
    std::fs::write(dir.join("raw.sql"), RAW_JOB).unwrap();
    std::fs::write(dir.join("clean.sql"), clean_job("")).unwrap();
    let o = run(dir, "raw.sql", "ck_raw");
    assert!(o.status.success(), "{}", text(&o));

    // First run: the table as it is (4 files, 3 per batch: 2 batches).
    let o = run(dir, "clean.sql", "ck_clean");
    assert!(o.status.success(), "{}", text(&o));
    assert!(stderr(&o).contains("done: 2 batches"), "{}", text(&o));
    expected.sort();
    assert_exactly_once(&read_py(&dir.join("clean")), &expected);

    // New commits are read, and only they.
    expected.extend(write_events(&dir.join("in"), 4, 3, 10));
    expected.sort();
    assert!(run(dir, "raw.sql", "ck_raw").status.success());
    let o = run(dir, "clean.sql", "ck_clean");
    assert!(o.status.success(), "{}", text(&o));
    assert_exactly_once(&read_py(&dir.join("clean")), &expected);

    // Other starting points: from a version (commits 6 and 7: files 5 and
    // 6), and from a time before every commit (the whole history, commit
    // by commit instead of as a snapshot).
    let from = |name: &str, option: &str| {
        std::fs::write(
            dir.join(format!("{name}.sql")),
            clean_job(option).replace("LOCATION 'clean'", &format!("LOCATION '{name}'")),
        )
        .unwrap();
        let o = run(dir, &format!("{name}.sql"), &format!("ck_{name}"));
        assert!(o.status.success(), "{}", text(&o));
        ids(&read_py(&dir.join(name)))
    };
    let late: Vec<String> = expected
        .iter()
        .filter(|id| id.starts_with("ev-0005-") || id.starts_with("ev-0006-"))
        .cloned()
        .collect();
    assert_eq!(from("from_v6", ", 'starting_version' '6'"), late);
    assert_eq!(
        from("from_2000", ", 'starting_timestamp' '2000-01-01'"),
        expected
    );

    // A compaction of raw rearranges data without changing it: nothing to read.
    let o = run_in(dir, &["table", "optimize", "raw", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    let m: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(m["files_removed"].as_u64().unwrap() > 1, "{m}");
    let o = run(dir, "clean.sql", "ck_clean");
    assert!(o.status.success(), "{}", text(&o));
    assert!(stderr(&o).contains("done: 0 batches"), "{}", text(&o));
    assert_exactly_once(&read_py(&dir.join("clean")), &expected);

    // Another writer deletes rows from raw: a stream cannot follow that,
    // and says which commit and what to do.
    let o = Command::new(python())
        .arg(root().join("tests/py/delete_rows.py"))
        .arg(dir.join("raw"))
        .arg("user_id = 0")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let deleted_at = String::from_utf8_lossy(&o.stdout).trim().to_string();
    expected.extend(write_events(&dir.join("in"), 7, 1, 10));
    expected.sort();
    assert!(run(dir, "raw.sql", "ck_raw").status.success());
    let o = run(dir, "clean.sql", "ck_clean");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = stderr(&o);
    assert!(
        err.contains(&format!("commit {deleted_at} removes or rewrites data")),
        "{err}"
    );
    assert!(err.contains("'skip_change_commits' 'true'"), "{err}");
    // Told to, it passes over the delete and reads the append after it.
    std::fs::write(
        dir.join("clean.sql"),
        clean_job(", 'skip_change_commits' 'true'"),
    )
    .unwrap();
    let o = run(dir, "clean.sql", "ck_clean");
    assert!(o.status.success(), "{}", text(&o));
    assert_exactly_once(&read_py(&dir.join("clean")), &expected);
    let o = run_in(dir, &["verify", "--checkpoint", "ck_clean"]);
    assert!(o.status.success(), "{}", text(&o));

    // A declared column list must be the table's.
    std::fs::write(
        dir.join("bad.sql"),
        clean_job("").replace(
            "TABLE raw STORED",
            "TABLE raw (event_id VARCHAR, nope BIGINT) STORED",
        ),
    )
    .unwrap();
    let o = run(dir, "bad.sql", "ck_bad");
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        stderr(&o).contains("leave the column list out"),
        "{}",
        text(&o)
    );
}

#[test]
fn raw_clean_per_minute_chain_through_sigkills_equals_a_batch_computation() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut expected = write_events(&dir.join("in"), 0, 24, 10);
    expected.sort();
    std::fs::write(dir.join("raw.sql"), RAW_JOB).unwrap();
    std::fs::write(dir.join("clean.sql"), clean_job("")).unwrap();
    // Per minute of event time over clean, in update mode: the final table
    // is the GROUP BY over every clean row, however batches fell.
    std::fs::write(
        dir.join("minute.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE clean STORED AS DELTA LOCATION 'clean' OPTIONS ('max_files_per_trigger' '2');\n\
         CREATE EXTERNAL TABLE per_minute STORED AS DELTA LOCATION 'per_minute' OPTIONS ('output_mode' 'update');\n\
         INSERT INTO per_minute SELECT date_trunc('minute', ts) AS minute, count(*) AS n, sum(amount) AS total \
         FROM clean GROUP BY date_trunc('minute', ts);\n",
    )
    .unwrap();
    // raw's first commit must exist before clean can start reading it.
    let o = run_available_now(
        dir,
        "raw.sql",
        "ck_raw",
        &[("LAKESTREAM_FAIL_POINT", "after-commit:1".into())],
        &[],
    );
    assert!(
        !o.status.success(),
        "stopped after its second batch: {}",
        text(&o)
    );
    let args = |job: &'static str, ckpt: &'static str| -> [&'static str; 6] {
        [
            "run",
            job,
            "--checkpoint",
            ckpt,
            "--trigger",
            "available-now",
        ]
    };
    let seed = clock_seed();
    // Kills come within a third of a whole run of raw alone, so they land
    // before a run is done even on a fast machine (raw cannot start over:
    // the others read its table meanwhile; clean and per-minute runs are
    // shorter still, as they only catch up).
    let raw_alone = clean_run_time(dir, &["in", "raw.sql"], &args("raw.sql", "ck_raw"));
    eprintln!("raw alone: {raw_alone:?}");
    let kills = |max: usize, seed: u64| Kills {
        max,
        min: 0,
        seed,
        limit: Duration::from_secs(240),
        latest: (raw_alone / 3).clamp(Duration::from_millis(40), Duration::from_millis(370)),
    };
    // The three jobs run at once, each killed at random and restarted:
    // raw until its input is done; clean and per-minute until the stage
    // before them is done and they caught up.
    std::thread::scope(|s| {
        let raw =
            s.spawn(|| kill_until_done_with(dir, &args("raw.sql", "ck_raw"), &[], &kills(5, seed)));
        let mut rounds = 0;
        let mut raw_done = false;
        let mut downstream_kills = 0;
        loop {
            raw_done |= raw.is_finished();
            for (job, ckpt, seed) in [
                ("clean.sql", "ck_clean", seed ^ rounds),
                ("minute.sql", "ck_minute", seed ^ !rounds),
            ] {
                downstream_kills +=
                    kill_until_done_with(dir, &args(job, ckpt), &[], &kills(2, seed));
            }
            rounds += 1;
            if raw_done {
                break;
            }
            assert!(rounds < 40, "the chain did not finish");
        }
        let raw_kills = raw.join().unwrap();
        assert!(raw_kills >= 2, "only {raw_kills} kills of raw landed");
        assert!(
            downstream_kills >= 2,
            "only {downstream_kills} kills of clean and per-minute landed"
        );
    });

    // Every raw event once in raw, every kept one once in clean.
    let raw_ids = {
        let mut v = ids(&read_py(&dir.join("raw")));
        v.sort();
        v
    };
    assert_eq!(raw_ids.len(), 240);
    assert_exactly_once(&read_py(&dir.join("clean")), &expected);
    // per_minute equals the batch computation over clean's rows.
    let batch = query(
        dir,
        "SELECT date_trunc('minute', ts) AS minute, count(*) AS n, sum(amount) AS total FROM 'clean' \
         GROUP BY date_trunc('minute', ts) ORDER BY minute",
    );
    let streamed = query(
        dir,
        "SELECT minute, n, total FROM 'per_minute' ORDER BY minute",
    );
    assert!(!batch.is_empty());
    assert_eq!(streamed, batch);
    for ckpt in ["ck_raw", "ck_clean", "ck_minute"] {
        let o = run_in(dir, &["verify", "--checkpoint", ckpt]);
        assert!(o.status.success(), "verify {ckpt}: {}", text(&o));
    }
}

/// One read of `events`, three outputs: every kept event, the large ones,
/// and a running total per user (update mode).
const SPLIT_JOB: &str = "CREATE UNBOUNDED EXTERNAL TABLE events (\n  event_id VARCHAR NOT NULL, user_id BIGINT, event_type VARCHAR, amount DOUBLE, ts TIMESTAMP\n) STORED AS JSON LOCATION 'in/' OPTIONS ('max_files_per_trigger' '2');\n\
CREATE EXTERNAL TABLE clean STORED AS DELTA LOCATION 'clean';\n\
CREATE EXTERNAL TABLE big STORED AS DELTA LOCATION 'big';\n\
CREATE EXTERNAL TABLE per_user STORED AS DELTA LOCATION 'per_user' OPTIONS ('output_mode' 'update');\n\
INSERT INTO clean SELECT event_id, user_id, amount, ts FROM events WHERE amount > 0;\n\
INSERT INTO big SELECT event_id, amount FROM events WHERE amount > 5;\n\
INSERT INTO per_user SELECT user_id, count(*) AS n, sum(amount) AS total FROM events GROUP BY user_id;\n";

/// The three tables of [`SPLIT_JOB`] hold exactly what a batch
/// computation over every input file gives.
fn assert_split_tables(dir: &Path, kept: &[String]) {
    assert_exactly_once(&read_py(&dir.join("clean")), kept);
    let big: Vec<String> = {
        let mut v = ids(&read_py(&dir.join("big")));
        v.sort();
        v
    };
    let expected_big: Vec<String> = query(
        dir,
        "SELECT event_id FROM 'clean' WHERE amount > 5 ORDER BY event_id",
    )
    .iter()
    .map(|r| r["event_id"].as_str().unwrap().to_string())
    .collect();
    assert!(!expected_big.is_empty());
    assert_eq!(big, expected_big, "big: every large event exactly once");
    // Every event counts for its user, the negative ones too.
    let streamed = query(
        dir,
        "SELECT user_id, n, total FROM 'per_user' ORDER BY user_id",
    );
    let mut by_user: std::collections::BTreeMap<i64, (i64, f64)> = Default::default();
    for f in std::fs::read_dir(dir.join("in")).unwrap() {
        let body = std::fs::read_to_string(f.unwrap().path()).unwrap();
        for line in body.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let e = by_user.entry(v["user_id"].as_i64().unwrap()).or_default();
            e.0 += 1;
            e.1 += v["amount"].as_f64().unwrap();
        }
    }
    let expected: Vec<serde_json::Value> = by_user
        .iter()
        .map(|(u, (n, t))| serde_json::json!({"user_id": u, "n": n, "total": t}))
        .collect();
    assert_eq!(
        streamed, expected,
        "per_user: the GROUP BY over every event"
    );
}

#[test]
fn one_job_writes_three_tables_from_one_read_exactly_once_through_sigkills() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut kept = write_events(&dir.join("in"), 0, 16, 10);
    kept.sort();
    std::fs::write(dir.join("job.sql"), SPLIT_JOB).unwrap();
    kill_run_job(dir, 6, 2);
    assert_split_tables(dir, &kept);
    // verify checks each output's table against the checkpoint.
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt", "--json"]);
    assert!(o.status.success(), "verify: {}", text(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let tables: Vec<&str> = report["tables"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["table"].as_str().unwrap().trim_end_matches('/'))
        .collect();
    assert_eq!(tables.len(), 3, "{report}");
    assert!(
        tables[0].ends_with("/clean") && tables[2].ends_with("/per_user"),
        "{tables:?}"
    );
    for t in report["tables"].as_array().unwrap() {
        assert_eq!(t["batches_in_table"], 8, "{t}");
    }
    // Each table's commits carry the batch's lineage and its own query.
    let history = history_py(&dir.join("big"));
    let info = history
        .iter()
        .find(|h| h["lakestream"]["batchId"] == 0)
        .expect("batch 0 in big");
    assert_eq!(info["lakestream"]["inputRows"], 20);
    assert_ne!(
        info["lakestream"]["sqlFingerprint"],
        history_py(&dir.join("clean"))
            .iter()
            .find(|h| h["lakestream"]["batchId"] == 0)
            .unwrap()["lakestream"]["sqlFingerprint"]
    );
}

#[test]
fn a_crash_between_two_outputs_commits_replays_only_the_missing_output() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut kept = write_events(&dir.join("in"), 0, 6, 10);
    kept.sort();
    std::fs::write(dir.join("job.sql"), SPLIT_JOB).unwrap();
    // Batch 1 commits to clean, then the process dies before big.
    let o = run_available_now(
        dir,
        "job.sql",
        "ckpt",
        &[("LAKESTREAM_FAIL_POINT", "after-commit:1".into())],
        &[],
    );
    assert!(!o.status.success(), "{}", text(&o));
    let clean_batches: Vec<u64> = history_py(&dir.join("clean"))
        .iter()
        .filter_map(|h| h["lakestream"]["batchId"].as_u64())
        .collect();
    let big_batches: Vec<u64> = history_py(&dir.join("big"))
        .iter()
        .filter_map(|h| h["lakestream"]["batchId"].as_u64())
        .collect();
    assert!(clean_batches.contains(&1), "{clean_batches:?}");
    assert!(!big_batches.contains(&1), "{big_batches:?}");

    let o = run_available_now(dir, "job.sql", "ckpt", &[], &["--progress-json"]);
    assert!(o.status.success(), "{}", text(&o));
    let progress: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let replay = progress
        .iter()
        .find(|p| p["batch_id"] == 1)
        .expect("batch 1 re-run");
    assert_eq!(replay["recovered"], true);
    let outputs = replay["outputs"].as_array().unwrap();
    assert_eq!(outputs.len(), 3);
    assert_eq!(outputs[0]["skipped"], true, "clean had it: {replay}");
    assert_eq!(outputs[1]["skipped"], false, "big did not: {replay}");
    assert_eq!(outputs[2]["skipped"], false, "nor per_user: {replay}");
    assert_eq!(
        replay["output_rows"],
        outputs[1]["output_rows"].as_u64().unwrap() + outputs[2]["output_rows"].as_u64().unwrap()
    );
    assert_split_tables(dir, &kept);
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt"]);
    assert!(o.status.success(), "verify: {}", text(&o));
    // Two aggregations in one job are refused before anything runs.
    std::fs::write(
        dir.join("two.sql"),
        format!(
            "{SPLIT_JOB}CREATE EXTERNAL TABLE per_type STORED AS DELTA LOCATION 'per_type' OPTIONS ('output_mode' 'complete');\n\
             INSERT INTO per_type SELECT event_type, count(*) AS n FROM events GROUP BY event_type;\n"
        ),
    )
    .unwrap();
    let o = run_available_now(dir, "two.sql", "ck_two", &[], &[]);
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("two.sql:11:") && err.contains("one aggregation or deduplication"),
        "{err}"
    );
    assert!(!dir.join("per_type").exists());
}
