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
pub(crate) fn events(dir: &Path, files: usize) -> (Vec<String>, Vec<String>) {
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
pub(crate) fn job(
    dir: &Path,
    source_options: &str,
    table: &str,
    table_options: &str,
    select: &str,
) {
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
pub(crate) fn spec(extra: Value) -> Value {
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

/// The event ids of a dead-letter table's rows (each row's record is the
/// output row as JSON), sorted, with the rules they broke.
pub(crate) fn dead_letter_ids(table: &Path) -> (Vec<String>, Vec<String>) {
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
pub(crate) fn a_check_constraint_violation_fails_the_batch_naming_the_rule_and_the_row() {
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
pub(crate) fn check_constraint_violations_go_to_the_dead_letters_exactly_once_under_kill_9() {
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
pub(crate) fn not_null_columns_and_invariants_hold_their_rows_out() {
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
pub(crate) fn generated_columns_are_computed_when_left_out_and_checked_when_given() {
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
pub(crate) fn an_append_only_table_refuses_update_and_complete_modes_before_the_first_batch() {
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
pub(crate) fn hand_made_table(
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
pub(crate) fn features_this_writer_cannot_keep_are_refused_by_name_before_any_batch() {
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
pub(crate) fn verify_reports_a_feature_the_writer_cannot_keep() {
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
pub(crate) fn every_commit_to_a_table_with_in_commit_timestamps_carries_one() {
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
pub(crate) fn feature_lists(protocol: &Value) -> (Vec<String>, Vec<String>) {
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
pub(crate) fn features_that_ask_nothing_of_appends_are_kept_as_they_are() {
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
pub(crate) fn a_v2_checkpoint_table_with_deletion_vectors_gets_v2_checkpoints() {
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
