//! The table-feature matrix: tables made by independent writers (Python
//! `deltalake`, or a log written by hand for features no writer here makes),
//! one streaming job into each, checked by Python `deltalake`. Each feature
//! is either kept (its rules hold in the table afterwards) or refused before
//! any batch, by name, with exit code 2.

use std::path::Path;

use serde_json::{Value, json};

use crate::common::*;

/// `files` event files of 20 rows under `dir/in`; the ids of rows with a
/// positive amount (every fifth row's amount is -1.5), and of the others.
fn events(dir: &Path, files: usize) -> (Vec<String>, Vec<String>) {
    let mut kept = write_events(&dir.join("in"), 0, files, 20);
    kept.sort();
    let mut dropped: Vec<String> = (0..files)
        .flat_map(|f| (0..20).map(move |r| (f, r)))
        .filter(|(_, r)| r % 5 == 4)
        .map(|(f, r)| format!("ev-{f:04}-{r:04}"))
        .collect();
    dropped.sort();
    (kept, dropped)
}

/// A job over `dir/in` (one file a batch; `source_options` added to the
/// source's) writing `select` into the Delta table `table` with
/// `table_options`.
fn job(dir: &Path, source_options: &str, table: &str, table_options: &str, select: &str) {
    std::fs::write(
        dir.join("job.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE events (\n  event_id VARCHAR NOT NULL, user_id BIGINT, \
             event_type VARCHAR, amount DOUBLE, ts TIMESTAMP\n) STORED AS JSON LOCATION 'in'\n\
             OPTIONS ('max_files_per_trigger' '1'{source_options});\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{table}'{table_options};\n\
             INSERT INTO out {select};\n"
        ),
    )
    .unwrap();
}

/// `(event_id string, amount double)` with `extra` fields of the spec.
fn spec(extra: Value) -> Value {
    let mut s = json!({
        "columns": [
            {"name": "event_id", "type": "string"},
            {"name": "amount", "type": "double"}
        ]
    });
    for (k, v) in extra.as_object().unwrap() {
        s[k] = v.clone();
    }
    s
}

fn run_job(dir: &Path) -> std::process::Output {
    run_in(dir, &RUN_JOB)
}

/// The event ids of a dead-letter table's rows (each row's record is the
/// output row as JSON), sorted, with the rules they broke.
fn dead_letter_ids(table: &Path) -> (Vec<String>, Vec<String>) {
    let rows = read_py(table);
    let mut ids: Vec<String> = rows
        .iter()
        .map(|r| {
            let record: Value = serde_json::from_str(r["record"].as_str().unwrap()).unwrap();
            record["event_id"].as_str().unwrap_or("(null)").to_string()
        })
        .collect();
    ids.sort();
    let errors = rows
        .iter()
        .map(|r| r["error"].as_str().unwrap().to_string())
        .collect();
    (ids, errors)
}

#[test]
fn a_check_constraint_violation_fails_the_batch_naming_the_rule_and_the_row() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    events(dir, 2);
    make_table_py(
        &dir.join("out"),
        &spec(json!({"constraints": {"amount_pos": "amount > 0"}})),
    );
    let before = meta_py(&dir.join("out"))["version"].clone();
    job(dir, "", "out", "", "SELECT event_id, amount FROM events");
    let o = run_job(dir);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = stderr(&o);
    for part in [
        "CHECK constraint amount_pos (amount > 0)",
        "batch 0",
        "4 row(s)",
        r#""event_id":"ev-0000-0004""#,
        "on_error",
    ] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
    // Nothing of the batch reached the table.
    let after = meta_py(&dir.join("out"));
    assert_eq!(after["version"], before);
    assert_eq!(after["rows"], 0);
}

#[test]
fn check_constraint_violations_go_to_the_dead_letters_exactly_once_under_kill_9() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (kept, dropped) = events(dir, 24);
    make_table_py(
        &dir.join("out"),
        &spec(json!({"constraints": {"amount_pos": "amount > 0"}})),
    );
    job(
        dir,
        ", 'on_error' 'dead_letter', 'dead_letter_location' 'dl'",
        "out",
        "",
        "SELECT event_id, amount FROM events",
    );
    let kills = kill_run_job(dir, 6, 2);
    assert_exactly_once(&read_py(&dir.join("out")), &kept);
    let (ids, errors) = dead_letter_ids(&dir.join("dl"));
    assert_eq!(ids, dropped, "each violating row once in the dead letters");
    assert!(
        errors
            .iter()
            .all(|e| e.contains("CHECK constraint amount_pos (amount > 0)")),
        "{errors:?}"
    );
    // Both tables against the checkpoint: every batch once, ranges
    // contiguous, no feature refused.
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt", "--json"]);
    assert!(
        o.status.success(),
        "verify after {kills} kills: {}",
        text(&o)
    );
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["clean"], true, "{report}");
    assert_eq!(report["tables"][0]["batches_in_table"], 24, "{report}");
    assert_eq!(
        report["tables"][0]["features"]["checkConstraints"],
        "supported"
    );
}

#[test]
fn not_null_columns_and_invariants_hold_their_rows_out() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    events(dir, 2);
    make_table_py(
        &dir.join("out"),
        &json!({"columns": [
            {"name": "event_id", "type": "string", "nullable": false},
            {"name": "amount", "type": "double", "metadata": {
                "delta.invariants": "{\"expression\": {\"expression\": \"amount < 10\"}}"
            }}
        ]}),
    );
    // Negative amounts lose their id: NOT NULL is broken first; amounts
    // of 10 and more break the invariant.
    job(
        dir,
        ", 'on_error' 'dead_letter', 'dead_letter_location' 'dl'",
        "out",
        "",
        "SELECT CASE WHEN amount > 0 THEN event_id END AS event_id, amount FROM events",
    );
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    let rows = read_py(&dir.join("out"));
    assert_eq!(
        rows.len(),
        2 * 8,
        "positive amounts below 10 of each file: {rows:?}"
    );
    assert!(
        rows.iter()
            .all(|r| !r["event_id"].is_null() && r["amount"].as_f64().unwrap() < 10.0)
    );
    let (_, errors) = dead_letter_ids(&dir.join("dl"));
    let count = |what: &str| errors.iter().filter(|e| e.contains(what)).count();
    assert_eq!(count("NOT NULL constraint on column event_id"), 2 * 4);
    assert_eq!(count("invariant amount (amount < 10)"), 2 * 8);

    // Without dead letters the batch fails, naming the column.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    events(dir, 1);
    make_table_py(
        &dir.join("out"),
        &json!({"columns": [
            {"name": "event_id", "type": "string", "nullable": false},
            {"name": "amount", "type": "double"}
        ]}),
    );
    job(
        dir,
        "",
        "out",
        "",
        "SELECT CASE WHEN amount > 0 THEN event_id END AS event_id, amount FROM events",
    );
    let o = run_job(dir);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        stderr(&o).contains("NOT NULL constraint on column event_id"),
        "{}",
        text(&o)
    );
    assert_eq!(meta_py(&dir.join("out"))["rows"], 0);
}

#[test]
fn generated_columns_are_computed_when_left_out_and_checked_when_given() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (kept, _) = events(dir, 3);
    let generated = json!({"columns": [
        {"name": "event_id", "type": "string"},
        {"name": "amount", "type": "double"},
        {"name": "amount2", "type": "double",
         "metadata": {"delta.generationExpression": "amount * 2"}}
    ]});
    make_table_py(&dir.join("out"), &generated);
    job(
        dir,
        "",
        "out",
        "",
        "SELECT event_id, amount FROM events WHERE amount > 0",
    );
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    let rows = read_py(&dir.join("out"));
    assert_exactly_once(&rows, &kept);
    for r in &rows {
        assert_eq!(
            r["amount2"].as_f64(),
            r["amount"].as_f64().map(|a| a * 2.0),
            "{r}"
        );
    }

    // A query that supplies the column must agree with the expression.
    make_table_py(&dir.join("wrong"), &generated);
    std::fs::remove_dir_all(dir.join("ckpt")).unwrap();
    job(
        dir,
        "",
        "wrong",
        "",
        "SELECT event_id, amount, amount * 3 AS amount2 FROM events",
    );
    let o = run_job(dir);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        stderr(&o).contains("generated column amount2 (GENERATED ALWAYS AS (amount * 2))"),
        "{}",
        text(&o)
    );
    assert_eq!(meta_py(&dir.join("wrong"))["rows"], 0);
}

#[test]
fn an_append_only_table_refuses_update_and_complete_modes_before_the_first_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (kept, _) = events(dir, 2);
    let per_user = json!({
        "columns": [{"name": "user_id", "type": "long"}, {"name": "n", "type": "long"}],
        "configuration": {"delta.appendOnly": "true"}
    });
    for mode in ["update", "complete"] {
        let table = format!("per_user_{mode}");
        make_table_py(&dir.join(&table), &per_user);
        let _ = std::fs::remove_dir_all(dir.join("ckpt"));
        job(
            dir,
            "",
            &table,
            &format!(" OPTIONS ('output_mode' '{mode}')"),
            "SELECT user_id, count(*) AS n FROM events GROUP BY user_id",
        );
        let o = run_job(dir);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        let err = stderr(&o);
        assert!(
            err.contains("table feature appendOnly is not supported")
                && err.contains(&format!("the {mode} output mode")),
            "{err}"
        );
        assert_eq!(meta_py(&dir.join(&table))["version"], 0, "no batch ran");
    }
    // Appends are what the table is for.
    make_table_py(
        &dir.join("out"),
        &spec(json!({"configuration": {"delta.appendOnly": "true"}})),
    );
    let _ = std::fs::remove_dir_all(dir.join("ckpt"));
    job(
        dir,
        "",
        "out",
        "",
        "SELECT event_id, amount FROM events WHERE amount > 0",
    );
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    assert_exactly_once(&read_py(&dir.join("out")), &kept);
}

/// A table whose log is written by hand (for features no writer on this
/// machine makes): one commit with `protocol` and a metaData of
/// `(event_id string, amount double)` with `configuration`, and
/// `commit_info` first when given.
fn hand_made_table(
    table: &Path,
    protocol: Value,
    configuration: Value,
    commit_info: Option<Value>,
) {
    let log = table.join("_delta_log");
    std::fs::create_dir_all(&log).unwrap();
    let schema = json!({"type": "struct", "fields": [
        {"name": "event_id", "type": "string", "nullable": true, "metadata": {}},
        {"name": "amount", "type": "double", "nullable": true, "metadata": {}}
    ]});
    let mut lines = Vec::new();
    if let Some(ci) = commit_info {
        lines.push(json!({ "commitInfo": ci }));
    }
    lines.push(json!({ "protocol": protocol }));
    lines.push(json!({"metaData": {
        "id": "3f4bd0a4-5c47-4d5f-9d0e-1b7e0c2a9a11",
        "format": {"provider": "parquet", "options": {}},
        "schemaString": schema.to_string(),
        "partitionColumns": [],
        "configuration": configuration,
        "createdTime": 1_796_000_000_000i64
    }}));
    let body: Vec<String> = lines.iter().map(Value::to_string).collect();
    std::fs::write(log.join("00000000000000000000.json"), body.join("\n")).unwrap();
}

#[test]
fn features_this_writer_cannot_keep_are_refused_by_name_before_any_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    events(dir, 1);
    let identity = json!({"columns": [
        {"name": "event_id", "type": "string"},
        {"name": "amount", "type": "double"},
        {"name": "id", "type": "long", "metadata": {
            "delta.identity.start": 1, "delta.identity.step": 1,
            "delta.identity.allowExplicitInsert": false
        }}
    ], "features": ["IdentityColumns"]});
    let by_python: Vec<(&str, Value, &str)> = vec![
        (
            "row_tracking",
            spec(json!({"features": ["RowTracking"]})),
            "rowTracking",
        ),
        (
            "column_mapping",
            spec(json!({"configuration": {"delta.columnMapping.mode": "name"}})),
            "columnMapping",
        ),
        ("identity", identity, "identityColumns"),
        (
            "iceberg",
            spec(json!({"features": ["IcebergCompatV1"]})),
            "icebergCompatV1",
        ),
    ];
    let mut cases: Vec<(String, String)> = Vec::new();
    for (name, s, feature) in by_python {
        make_table_py(&dir.join(name), &s);
        cases.push((name.to_string(), feature.to_string()));
    }
    hand_made_table(
        &dir.join("catalog"),
        json!({"minReaderVersion": 3, "minWriterVersion": 7,
               "readerFeatures": ["catalogManaged"], "writerFeatures": ["catalogManaged"]}),
        json!({}),
        None,
    );
    cases.push(("catalog".into(), "catalogManaged".into()));
    hand_made_table(
        &dir.join("unknown"),
        json!({"minReaderVersion": 1, "minWriterVersion": 7,
               "writerFeatures": ["appendOnly", "someFutureFeature"]}),
        json!({}),
        None,
    );
    cases.push(("unknown".into(), "someFutureFeature".into()));
    hand_made_table(
        &dir.join("txn_retention"),
        json!({"minReaderVersion": 1, "minWriterVersion": 2}),
        json!({"delta.setTransactionRetentionDuration": "interval 1 days"}),
        None,
    );
    cases.push((
        "txn_retention".into(),
        "delta.setTransactionRetentionDuration".into(),
    ));
    for (table, feature) in &cases {
        let _ = std::fs::remove_dir_all(dir.join("ckpt"));
        let select = if table == "identity" {
            "SELECT event_id, amount, CAST(NULL AS BIGINT) AS id FROM events"
        } else {
            "SELECT event_id, amount FROM events"
        };
        job(dir, "", table, "", select);
        let o = run_job(dir);
        assert_eq!(o.status.code(), Some(2), "{table}: {}", text(&o));
        let err = stderr(&o);
        assert!(
            err.contains(&format!(
                "table feature {feature} is not supported by this writer"
            )),
            "{table}: {err}"
        );
        // Nothing written: the log holds its first commit(s) only.
        let log = std::fs::read_dir(dir.join(table).join("_delta_log"))
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
            .count();
        let made = if table.contains('_') || ["identity", "iceberg"].contains(&table.as_str()) {
            log
        } else {
            1
        };
        assert_eq!(log, made, "{table}");
        assert!(
            !dir.join(table).read_dir().unwrap().any(|e| e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".parquet")),
            "{table}: no data file written"
        );
    }
    // Maintenance refuses them too.
    let o = run_in(dir, &["table", "optimize", "row_tracking"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("rowTracking"), "{}", text(&o));
}

#[test]
fn verify_reports_a_feature_the_writer_cannot_keep() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    events(dir, 2);
    job(dir, "", "out", "", "SELECT event_id, amount FROM events");
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt", "--json"]);
    assert!(o.status.success(), "{}", text(&o));
    // Another tool turns row tracking on.
    let o = std::process::Command::new(python())
        .args([
            "-c",
            "import sys, deltalake; t = deltalake.DeltaTable(sys.argv[1]); \
             t.alter.add_feature(deltalake.TableFeatures.RowTracking, \
             allow_protocol_versions_increase=True)",
        ])
        .arg(dir.join("out"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt", "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["features"]["rowTracking"], "refused", "{report}");
    assert!(
        report["errors"].to_string().contains("rowTracking"),
        "{report}"
    );
    // And the next run stops before its first batch.
    write_events(&dir.join("in"), 2, 1, 20);
    let o = run_job(dir);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

#[test]
fn every_commit_to_a_table_with_in_commit_timestamps_carries_one() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (kept, _) = events(dir, 4);
    // Far in the future: each commit must still come after it.
    let future = 4_102_444_800_000i64;
    hand_made_table(
        &dir.join("out"),
        json!({"minReaderVersion": 1, "minWriterVersion": 7,
               "writerFeatures": ["inCommitTimestamp", "appendOnly", "invariants"]}),
        json!({"delta.enableInCommitTimestamps": "true"}),
        Some(json!({"timestamp": future, "inCommitTimestamp": future,
                    "operation": "CREATE TABLE", "operationParameters": {}})),
    );
    job(
        dir,
        "",
        "out",
        "",
        "SELECT event_id, amount FROM events WHERE amount > 0",
    );
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    assert_exactly_once(&read_py(&dir.join("out")), &kept);
    let mut previous = future;
    for v in 1..=4 {
        let commit =
            std::fs::read_to_string(dir.join(format!("out/_delta_log/{v:020}.json"))).unwrap();
        let first: Value = serde_json::from_str(commit.lines().next().unwrap()).unwrap();
        let ict = first["commitInfo"]["inCommitTimestamp"]
            .as_i64()
            .unwrap_or_else(|| panic!("commit {v} has no inCommitTimestamp first: {commit}"));
        assert!(ict > previous, "commit {v}: {ict} after {previous}");
        previous = ict;
    }
    // MERGE and overwrite commit through delta-rs, which writes none.
    let o = run_in(dir, &["table", "optimize", "out"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("inCommitTimestamp"), "{}", text(&o));
}

/// The table's writer and reader features, sorted, as Python left them.
fn feature_lists(protocol: &Value) -> (Vec<String>, Vec<String>) {
    let sorted = |v: &Value| {
        let mut f: Vec<String> = v
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| s.as_str().unwrap().to_string())
            .collect();
        f.sort();
        f
    };
    (
        sorted(&protocol["writer_features"]),
        sorted(&protocol["reader_features"]),
    )
}

#[test]
fn features_that_ask_nothing_of_appends_are_kept_as_they_are() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (kept, _) = events(dir, 3);
    let made = make_table_py(
        &dir.join("out"),
        &spec(json!({
            // Python `deltalake` writes to no table with domainMetadata:
            // it comes last.
            "features": ["TimestampWithoutTimezone", "ChangeDataFeed", "CheckConstraints",
                         "GeneratedColumns", "Invariants", "AppendOnly", "DomainMetadata"],
            "configuration": {"delta.checkpointInterval": "2"}
        })),
    );
    job(
        dir,
        "",
        "out",
        "",
        "SELECT event_id, amount FROM events WHERE amount > 0",
    );
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    assert_exactly_once(&read_py(&dir.join("out")), &kept);
    let after = protocol_py(&dir.join("out"));
    assert_eq!(feature_lists(&after), feature_lists(&made));
    assert_eq!(after["min_reader_version"], made["min_reader_version"]);
}

#[test]
fn a_v2_checkpoint_table_with_deletion_vectors_gets_v2_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (kept, _) = events(dir, 5);
    let made = make_table_py(
        &dir.join("out"),
        &spec(json!({
            "features": ["V2Checkpoint", "DeletionVectors"],
            "configuration": {"delta.checkpointInterval": "2", "delta.checkpointPolicy": "v2"}
        })),
    );
    job(
        dir,
        "",
        "out",
        "",
        "SELECT event_id, amount FROM events WHERE amount > 0",
    );
    let o = run_job(dir);
    assert!(o.status.success(), "{}", text(&o));
    // Python `deltalake` reads neither feature: the table through
    // lakestream's reader (delta-rs), its protocol from its log.
    let rows = query(dir, "SELECT event_id FROM 'out'");
    assert_exactly_once(&rows, &kept);
    let o = std::process::Command::new(python())
        .args([
            "-c",
            "import sys, glob, json, pyarrow.parquet as pq\n\
             d = sys.argv[1] + '/_delta_log/'\n\
             cps = sorted(glob.glob(d + '*.checkpoint*.parquet'))\n\
             t = pq.read_table(cps[-1])\n\
             v2 = 'checkpointMetadata' in t.column_names and \
             t.column('checkpointMetadata').null_count < t.num_rows\n\
             p = [a['protocol'] for f in sorted(glob.glob(d + '*.json')) \
             for a in map(json.loads, open(f)) if 'protocol' in a][-1]\n\
             print(json.dumps({'checkpoints': len(cps), 'v2': v2, 'protocol': p}))",
        ])
        .arg(dir.join("out"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let said: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(said["checkpoints"].as_u64().unwrap() >= 2, "{said}");
    assert_eq!(
        said["v2"], true,
        "checkpoints carry checkpointMetadata: {said}"
    );
    assert_eq!(
        feature_lists(&json!({
            "writer_features": said["protocol"]["writerFeatures"],
            "reader_features": said["protocol"]["readerFeatures"],
        })),
        feature_lists(&made)
    );
}

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
fn changes(rows: &[Value]) -> Vec<(String, i64, i64, i64)> {
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
fn counts_with_feed(dir: &Path, files: usize) {
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
