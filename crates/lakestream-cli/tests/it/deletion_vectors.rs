//! Tables with deletion vectors and the change data feed: golden tables
//! written by Spark copied from `testdata/`, streamed from and into, with
//! kill -9 loops; checked by Python `deltalake`.

use std::path::Path;

use serde_json::{Value, json};

use crate::common::*;
use crate::features::*;

/// Copy the foreign table `testdata/delta/<name>` to `to`.
fn copy_golden(name: &str, to: &Path) {
    let from = root().join("testdata/delta").join(name);
    let copy = |from: &Path, to: &Path| {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file() {
                std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
        }
    };
    copy(&from, to);
    copy(&from.join("_delta_log"), &to.join("_delta_log"));
}

/// Sorted values of column `column` of `rows`, as i64.
fn ints(rows: &[Value], column: &str) -> Vec<i64> {
    let mut v: Vec<i64> = rows.iter().map(|r| r[column].as_i64().unwrap()).collect();
    v.sort();
    v
}

/// The table's live data files, as its log (JSON commits) says, each with
/// its `add` action: read by Python from the log, independently of any
/// Delta reader.
fn live_adds(table: &Path) -> Vec<Value> {
    let o = std::process::Command::new(python())
        .args([
            "-c",
            "import sys, glob, json\n\
             live = {}\n\
             for f in sorted(glob.glob(sys.argv[1] + '/_delta_log/*.json')):\n\
             \x20   for a in map(json.loads, open(f)):\n\
             \x20       if 'add' in a: live[a['add']['path']] = a['add']\n\
             \x20       if 'remove' in a: live.pop(a['remove']['path'], None)\n\
             print(json.dumps(list(live.values())))",
        ])
        .arg(table)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn the_delta_source_streams_only_the_live_rows_of_files_with_deletion_vectors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // The snapshot a query starts from: one file whose vector deletes 0, 9.
    copy_golden("table-with-dv-small", &dir.join("dv"));
    std::fs::write(
        dir.join("job.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE src STORED AS DELTA LOCATION 'dv';\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
         INSERT INTO out SELECT value FROM src;\n",
    )
    .unwrap();
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        ints(&read_py(&dir.join("out")), "value"),
        (1..=8).collect::<Vec<_>>()
    );

    // A commit whose added file carries a vector: read from version 0.
    copy_golden("with-short-dv", &dir.join("short"));
    std::fs::write(
        dir.join("job2.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE src STORED AS DELTA LOCATION 'short'\n\
         OPTIONS ('starting_version' '0');\n\
         CREATE EXTERNAL TABLE out2 STORED AS DELTA LOCATION 'out2';\n\
         INSERT INTO out2 SELECT id FROM src;\n",
    )
    .unwrap();
    let o = run_in(
        dir,
        &[
            "run",
            "job2.sql",
            "--checkpoint",
            "ckpt2",
            "--trigger",
            "available-now",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let streamed = ints(&read_py(&dir.join("out2")), "id");
    assert_eq!(streamed.len(), 10 - 3, "{streamed:?}");
    // The same rows as delta-rs's reader gives for the table.
    assert_eq!(streamed, ints(&query(dir, "SELECT id FROM 'short'"), "id"));
}

#[test]
fn a_stream_into_a_table_with_deletion_vectors_appends_and_keeps_them() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    copy_golden("table-with-dv-small", &dir.join("dv"));
    std::fs::create_dir_all(dir.join("in")).unwrap();
    std::fs::write(
        dir.join("in/a.json"),
        (100..110)
            .map(|v| format!("{{\"v\":{v}}}\n"))
            .collect::<String>(),
    )
    .unwrap();
    std::fs::write(
        dir.join("job.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE events (v INT) STORED AS JSON LOCATION 'in';\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'dv';\n\
         INSERT INTO out SELECT v AS value FROM events;\n",
    )
    .unwrap();
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    // The log: the old file still carries its vector; the new one has the
    // ten rows (its Parquet footer says so).
    let adds = live_adds(&dir.join("dv"));
    assert_eq!(adds.len(), 2, "{adds:?}");
    let old = adds
        .iter()
        .find(|a| {
            a["path"]
                .as_str()
                .unwrap()
                .starts_with("part-00000-fae5310a")
        })
        .unwrap();
    assert_eq!(old["deletionVector"]["cardinality"], 2, "{old}");
    let new = adds.iter().find(|a| a != &old).unwrap();
    assert!(new["deletionVector"].is_null(), "{new}");
    let o = std::process::Command::new(python())
        .args([
            "-c",
            "import sys, pyarrow.parquet as pq; print(pq.ParquetFile(sys.argv[1]).metadata.num_rows)",
        ])
        .arg(dir.join("dv").join(new["path"].as_str().unwrap()))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&o.stdout).trim(),
        "10",
        "{}",
        text(&o)
    );
    let mut expected: Vec<i64> = (1..=8).chain(100..110).collect();
    expected.sort();
    assert_eq!(
        ints(&query(dir, "SELECT value FROM 'dv'"), "value"),
        expected
    );
}

#[test]
fn update_mode_into_a_table_with_deletion_vectors_keeps_deleted_rows_deleted() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let table = dir.join("dv");
    copy_golden("table-with-dv-small", &table);
    // Another writer adds a count column (nullable): commit 2.
    let schema = json!({"type": "struct", "fields": [
        {"name": "value", "type": "integer", "nullable": true, "metadata": {}},
        {"name": "n", "type": "long", "nullable": true, "metadata": {}}
    ]});
    let commit = [
        json!({"commitInfo": {"timestamp": 1_700_000_000_000i64, "operation": "ADD COLUMNS"}}),
        json!({"metaData": {
            "id": "testId", "format": {"provider": "parquet", "options": {}},
            "schemaString": schema.to_string(), "partitionColumns": [],
            "configuration": {"delta.enableDeletionVectors": "true",
                              "delta.columnMapping.mode": "none"},
            "createdTime": 1_677_811_175_819i64
        }}),
    ];
    std::fs::write(
        table.join("_delta_log/00000000000000000002.json"),
        commit
            .iter()
            .map(Value::to_string)
            .collect::<Vec<_>>()
            .join("\n"),
    )
    .unwrap();
    // Every value 0..=9 once: 1..=8 are in the table, 0 and 9 were deleted.
    std::fs::create_dir_all(dir.join("in")).unwrap();
    std::fs::write(
        dir.join("in/a.json"),
        (0..10)
            .map(|v| format!("{{\"v\":{v}}}\n"))
            .collect::<String>(),
    )
    .unwrap();
    std::fs::write(
        dir.join("job.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE events (v INT) STORED AS JSON LOCATION 'in';\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'dv' OPTIONS ('output_mode' 'update');\n\
         INSERT INTO out SELECT v AS value, count(*) AS n FROM events GROUP BY v;\n",
    )
    .unwrap();
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    let rows = query(dir, "SELECT value, n FROM 'dv'");
    assert_eq!(
        ints(&rows, "value"),
        (0..10).collect::<Vec<_>>(),
        "{rows:?}"
    );
    assert!(rows.iter().all(|r| r["n"] == 1), "{rows:?}");
    // The rewritten file's removal names its vector, so every reader sees
    // the same logical file go.
    let mut removes = Vec::new();
    for f in std::fs::read_dir(table.join("_delta_log")).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_some_and(|e| e == "json") {
            for l in std::fs::read_to_string(&f).unwrap().lines() {
                let a: Value = serde_json::from_str(l).unwrap();
                if !a["remove"].is_null() {
                    removes.push(a["remove"].clone());
                }
            }
        }
    }
    let merged = removes
        .iter()
        .filter(|r| r["deletionTimestamp"].as_i64() > Some(1_700_000_000_000))
        .collect::<Vec<_>>();
    assert!(!merged.is_empty(), "MERGE removed no file: {removes:?}");
    for r in merged {
        if r["path"]
            .as_str()
            .unwrap()
            .starts_with("part-00000-fae5310a")
        {
            assert_eq!(r["deletionVector"]["cardinality"], 2, "{r}");
        }
    }
}

/// The change data feed's rows by commit version: (change type, key, n),
/// sorted, per version.
fn feed_by_version(
    table: &Path,
    key: &str,
) -> std::collections::BTreeMap<i64, Vec<(String, i64, i64)>> {
    let mut by: std::collections::BTreeMap<i64, Vec<(String, i64, i64)>> = Default::default();
    for r in cdf_py(table) {
        by.entry(r["_commit_version"].as_i64().unwrap())
            .or_default()
            .push((
                r["_change_type"].as_str().unwrap().to_string(),
                r[key].as_i64().unwrap(),
                r["n"].as_i64().unwrap(),
            ));
    }
    for v in by.values_mut() {
        v.sort();
    }
    by
}

/// `dir/per_user`: `(user_id long, n long)` with its change data feed
/// enabled, made by Python `deltalake`.
fn per_user_with_feed(dir: &Path) {
    make_table_py(
        &dir.join("per_user"),
        &json!({
            "columns": [{"name": "user_id", "type": "long"}, {"name": "n", "type": "long"}],
            "configuration": {"delta.enableChangeDataFeed": "true"}
        }),
    );
}

#[test]
fn update_mode_writes_the_change_data_feed_once_per_batch_under_kill_9() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    counts_job(dir, 12);
    let kills = kill_run_job(dir, 5, 2);
    // Each file has three events of users 0..=5 and two of user 6.
    let per_file = |u: i64| if u == 6 { 2 } else { 3 };
    let rows = read_py(&dir.join("per_user"));
    assert_eq!(rows.len(), 7, "{rows:?}");
    for r in &rows {
        let u = r["user_id"].as_i64().unwrap();
        assert_eq!(r["n"].as_i64().unwrap(), 12 * per_file(u), "{r}");
    }
    // One version of the feed per batch: its first inserts every user,
    // each later one updates every user from k to k + 1 files' count.
    let feed = feed_by_version(&dir.join("per_user"), "user_id");
    assert_eq!(feed.len(), 12, "after {kills} kills: {feed:?}");
    for (i, changes) in feed.values().enumerate() {
        let i = i as i64;
        let mut expected = Vec::new();
        for u in 0..7 {
            if i == 0 {
                expected.push(("insert".to_string(), u, per_file(u)));
            } else {
                expected.push(("update_postimage".to_string(), u, (i + 1) * per_file(u)));
                expected.push(("update_preimage".to_string(), u, i * per_file(u)));
            }
        }
        expected.sort();
        assert_eq!(changes, &expected, "batch {i}");
    }
}

#[test]
fn complete_mode_writes_only_the_groups_that_changed_to_the_change_data_feed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir_all(dir.join("in")).unwrap();
    let line = |u: i64| {
        format!(
            "{{\"event_id\":\"e\",\"user_id\":{u},\"event_type\":\"click\",\"amount\":1.0,\"ts\":\"2026-01-01T10:00:00Z\"}}\n"
        )
    };
    for (name, users) in [("a", vec![1, 2]), ("b", vec![1]), ("c", vec![3])] {
        let body: String = users.into_iter().map(line).collect();
        std::fs::write(dir.join("in").join(format!("{name}.json")), body).unwrap();
    }
    per_user_with_feed(dir);
    job(
        dir,
        "",
        "per_user",
        " OPTIONS ('output_mode' 'complete')",
        "SELECT user_id, count(*) AS n FROM events GROUP BY user_id",
    );
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    let feed: Vec<Vec<(String, i64, i64)>> = feed_by_version(&dir.join("per_user"), "user_id")
        .into_values()
        .collect();
    let c = |t: &str, u: i64, n: i64| (t.to_string(), u, n);
    assert_eq!(
        feed,
        vec![
            vec![c("insert", 1, 1), c("insert", 2, 1)],
            vec![c("update_postimage", 1, 2), c("update_preimage", 1, 1)],
            vec![c("insert", 3, 1)],
        ]
    );
    let mut rows: Vec<(i64, i64)> = read_py(&dir.join("per_user"))
        .iter()
        .map(|r| (r["user_id"].as_i64().unwrap(), r["n"].as_i64().unwrap()))
        .collect();
    rows.sort();
    assert_eq!(rows, vec![(1, 2), (2, 1), (3, 1)]);
}

/// (change type, commit version, user, n) of change-feed rows, sorted.
pub(crate) fn changes(rows: &[Value]) -> Vec<(String, i64, i64, i64)> {
    let mut v: Vec<_> = rows
        .iter()
        .map(|r| {
            (
                r["_change_type"].as_str().unwrap().to_string(),
                r["_commit_version"].as_i64().unwrap(),
                r["user_id"].as_i64().unwrap(),
                r["n"].as_i64().unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

/// `files` event files and `job.sql`: an update-mode count per user into
/// `per_user`, a table made with its change data feed enabled.
fn counts_job(dir: &Path, files: usize) {
    events(dir, files);
    per_user_with_feed(dir);
    job(
        dir,
        "",
        "per_user",
        " OPTIONS ('output_mode' 'update')",
        "SELECT user_id, count(*) AS n FROM events GROUP BY user_id",
    );
}

/// [`counts_job`] as `counts.sql`, run over its files (checkpoint
/// `ckpt_counts`).
pub(crate) fn counts_with_feed(dir: &Path, files: usize) {
    counts_job(dir, files);
    std::fs::rename(dir.join("job.sql"), dir.join("counts.sql")).unwrap();
    let o = run_available_now(dir, "counts.sql", "ckpt_counts", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
}

/// The job reading `per_user`'s change feed (with `options`) into `feed`.
fn feed_job(dir: &Path, options: &str) {
    std::fs::write(
        dir.join("job.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE changes STORED AS DELTA LOCATION 'per_user'\n\
             OPTIONS ('read_change_feed' 'true', 'max_files_per_trigger' '1'{options});\n\
             CREATE EXTERNAL TABLE feed STORED AS DELTA LOCATION 'feed';\n\
             INSERT INTO feed SELECT * FROM changes;\n"
        ),
    )
    .unwrap();
}

#[test]
fn the_change_feed_streams_into_a_table_exactly_once_under_kill_9() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    counts_with_feed(dir, 8);
    feed_job(dir, ", 'starting_version' '0'");
    let kills = kill_run_job(dir, 5, 2);
    let ours = read_py(&dir.join("feed"));
    let python = cdf_py(&dir.join("per_user"));
    // Every change once: 7 inserts, then 7 pre- and post-images a batch.
    assert_eq!(ours.len(), 7 + 7 * 2 * 7, "after {kills} kills");
    assert_eq!(changes(&ours), changes(&python), "after {kills} kills");
    // Each version's commit time, as Python reads it.
    let times = |rows: &[Value]| {
        rows.iter()
            .map(|r| {
                (
                    r["_commit_version"].as_i64().unwrap(),
                    // A UTC timestamp here; Python's reader drops the zone.
                    r["_commit_timestamp"]
                        .as_str()
                        .unwrap()
                        .trim_end_matches("+00:00")
                        .to_string(),
                )
            })
            .collect::<std::collections::BTreeSet<_>>()
    };
    assert_eq!(times(&ours), times(&python));
}

#[test]
fn the_change_feed_starts_with_the_snapshot_as_inserts_and_needs_the_feed_enabled() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    counts_with_feed(dir, 2);
    let snapshot = meta_py(&dir.join("per_user"))["version"].as_i64().unwrap();
    feed_job(dir, "");
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    // Two more files through the counting job: updates of every user.
    write_events(&dir.join("in"), 2, 2, 20);
    let o = run_available_now(dir, "counts.sql", "ckpt_counts", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    let per_file = |u: i64| if u == 6 { 2 } else { 3 };
    let mut expected = Vec::new();
    for u in 0..7 {
        expected.push(("insert".to_string(), snapshot, u, 2 * per_file(u)));
        for k in 1..=2 {
            let v = snapshot + k;
            let n = (2 + k) * per_file(u);
            expected.push(("update_preimage".to_string(), v, u, n - per_file(u)));
            expected.push(("update_postimage".to_string(), v, u, n));
        }
    }
    expected.sort();
    assert_eq!(changes(&read_py(&dir.join("feed"))), expected);

    // Another writer overwrites the table: a commit of adds and removes
    // (without change files, read by the protocol's rule), read as Python
    // reads it.
    let o = std::process::Command::new(python())
        .arg("-c")
        .arg(
            "import sys, pyarrow as pa\nfrom deltalake import write_deltalake\n\
             write_deltalake(sys.argv[1], pa.table({'user_id': pa.array([1, 9], pa.int64()), \
             'n': pa.array([5, 5], pa.int64())}), mode='overwrite')",
        )
        .arg(dir.join("per_user"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    let last = snapshot + 3;
    let of = |rows: Vec<Value>| -> Vec<_> {
        changes(&rows).into_iter().filter(|c| c.1 == last).collect()
    };
    let overwrite = of(read_py(&dir.join("feed")));
    assert_eq!(overwrite, of(cdf_py(&dir.join("per_user"))));
    assert_eq!(overwrite.len(), 7 + 2, "{overwrite:?}");

    // A table that does not record its feed is refused, saying how.
    make_table_py(
        &dir.join("plain"),
        &spec(json!({"rows": [{"event_id": "a", "amount": 1.0}]})),
    );
    std::fs::write(
        dir.join("plain.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE changes STORED AS DELTA LOCATION 'plain'\n\
         OPTIONS ('read_change_feed' 'true');\n\
         CREATE EXTERNAL TABLE feed STORED AS DELTA LOCATION 'feed2';\n\
         INSERT INTO feed SELECT * FROM changes;\n",
    )
    .unwrap();
    let o = run_available_now(dir, "plain.sql", "ckpt_plain", &[], &[]);
    assert_ne!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        stderr(&o).contains("delta.enableChangeDataFeed = true"),
        "{}",
        text(&o)
    );
}

#[test]
fn the_change_feed_of_deletes_and_restores_by_deletion_vectors_is_read_from_the_vectors() {
    // Written by Spark with deletion vectors and no change-data files: each
    // commit after the first replaces the one file's vector. Its history:
    // v0 inserts 0..=9; v1 deletes 0, 9; v2 restores them; v3 deletes 0, 1,
    // 4, 5; v4 restores 1, 4; v5 restores 0, 5 and deletes 3; v6 restores 3.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    copy_golden("cdf-table-with-dv", &dir.join("cdf"));
    std::fs::write(
        dir.join("job.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE changes STORED AS DELTA LOCATION 'cdf'\n\
         OPTIONS ('read_change_feed' 'true', 'starting_version' '0', \
         'max_files_per_trigger' '1');\n\
         CREATE EXTERNAL TABLE feed STORED AS DELTA LOCATION 'feed';\n\
         INSERT INTO feed SELECT value, _change_type, _commit_version FROM changes;\n",
    )
    .unwrap();
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    let mut got: Vec<(i64, String, i64)> = read_py(&dir.join("feed"))
        .iter()
        .map(|r| {
            (
                r["_commit_version"].as_i64().unwrap(),
                r["_change_type"].as_str().unwrap().to_string(),
                r["value"].as_i64().unwrap(),
            )
        })
        .collect();
    got.sort();
    let mut expected: Vec<(i64, String, i64)> = Vec::new();
    let mut add = |version: i64, kind: &str, values: &[i64]| {
        for v in values {
            expected.push((version, kind.to_string(), *v));
        }
    };
    add(0, "insert", &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    add(1, "delete", &[0, 9]);
    add(2, "insert", &[0, 9]);
    add(3, "delete", &[0, 1, 4, 5]);
    add(4, "insert", &[1, 4]);
    add(5, "insert", &[0, 5]);
    add(5, "delete", &[3]);
    add(6, "insert", &[3]);
    expected.sort();
    assert_eq!(got, expected);
}

#[test]
fn spark_tables_with_column_mapping_are_refused_as_output_and_as_source() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    events(dir, 1);
    for mode in ["name", "id"] {
        let table = format!("cm_{mode}");
        copy_golden(&format!("partition-cm-{mode}"), &dir.join(&table));
        // As the output.
        let _ = std::fs::remove_dir_all(dir.join("ckpt"));
        job(
            dir,
            "",
            &table,
            "",
            "SELECT CAST(amount AS INT) AS value, event_type AS category FROM events",
        );
        let o = run_job(dir);
        assert_eq!(o.status.code(), Some(2), "{mode}: {}", text(&o));
        assert!(
            stderr(&o).contains("table feature columnMapping is not supported by this writer"),
            "{mode}: {}",
            text(&o)
        );
        // As a stream.
        let _ = std::fs::remove_dir_all(dir.join("ckpt"));
        std::fs::write(
            dir.join("job.sql"),
            format!(
                "CREATE UNBOUNDED EXTERNAL TABLE t STORED AS DELTA LOCATION '{table}';\n\
                 CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
                 INSERT INTO out SELECT * FROM t;\n"
            ),
        )
        .unwrap();
        let o = run_job(dir);
        assert_ne!(o.status.code(), Some(0), "{mode}: {}", text(&o));
        assert!(
            stderr(&o).contains("column mapping, which the Delta source cannot read yet"),
            "{mode}: {}",
            text(&o)
        );
    }
}
