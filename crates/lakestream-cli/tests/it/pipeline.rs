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
    // The three jobs run at once, each killed at random and restarted:
    // raw until its input is done; clean and per-minute until the stage
    // before them is done and they caught up.
    std::thread::scope(|s| {
        let raw = s.spawn(|| {
            kill_until_done(
                dir,
                &args("raw.sql", "ck_raw"),
                &[],
                5,
                seed,
                Duration::from_secs(240),
            )
        });
        let mut rounds = 0;
        let mut raw_done = false;
        let mut downstream_kills = 0;
        loop {
            raw_done |= raw.is_finished();
            downstream_kills += kill_until_done(
                dir,
                &args("clean.sql", "ck_clean"),
                &[],
                2,
                seed ^ rounds,
                Duration::from_secs(240),
            );
            downstream_kills += kill_until_done(
                dir,
                &args("minute.sql", "ck_minute"),
                &[],
                2,
                seed ^ !rounds,
                Duration::from_secs(240),
            );
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
