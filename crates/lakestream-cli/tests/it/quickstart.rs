//! The README's quickstart, as a newcomer runs it.

use crate::common::*;

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

#[test]
fn quickstart_builds_a_delta_table_every_reader_agrees_on() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    copy_dir(&root().join("examples/data"), &dir.join("examples/data"));
    std::fs::copy(
        root().join("examples/quickstart.sql"),
        dir.join("examples/quickstart.sql"),
    )
    .unwrap();
    // The expected rows, straight from the input files.
    let mut expected = Vec::new();
    for e in std::fs::read_dir(dir.join("examples/data/events")).unwrap() {
        for line in std::fs::read_to_string(e.unwrap().path()).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            if v["amount"].as_f64().unwrap() > 0.0 {
                expected.push(v["event_id"].as_str().unwrap().to_string());
            }
        }
    }
    expected.sort();
    assert!(expected.len() > 100);

    let args = [
        "run",
        "examples/quickstart.sql",
        "--checkpoint",
        "target/quickstart/_checkpoint",
        "--trigger",
        "available-now",
        "--progress-json",
    ];
    let o = run_in(dir, &args);
    assert!(o.status.success(), "{}", text(&o));
    let progress: Vec<serde_json::Value> = String::from_utf8(o.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // 6 files, 2 per trigger: 3 batches, each one Delta commit.
    assert_eq!(progress.len(), 3, "{}", text(&o));
    assert_spark_progress_shape(&progress);
    assert_eq!(
        progress[1]["sources"][0]["startOffset"],
        progress[0]["sources"][0]["endOffset"]
    );

    let table = dir.join("target/quickstart/clean_events");
    let rows = read_py(&table);
    assert_eq!(
        ids(&rows),
        expected,
        "python deltalake sees every kept event once"
    );
    let meta = meta_py(&table);
    assert_eq!(meta["partition_columns"], serde_json::json!(["day"]));
    assert_eq!(
        meta["columns"],
        serde_json::json!([
            "event_id",
            "user_id",
            "country",
            "event_type",
            "amount",
            "ts",
            "day"
        ])
    );
    // Joined with the static users table: known users get a country.
    assert!(rows.iter().any(|r| r["country"].is_string()));

    assert_readers_agree(dir, &rows, &expected);
    // Running again finds nothing new and leaves the table as it is.
    let o = run_in(dir, &args[..6]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(meta_py(&table)["version"], 3);

    assert_status_after_three_batches(dir);
}

/// Each batch's progress (3 batches of 100 rows) in lakestream's fields
/// and in Spark's StreamingQueryProgress shape, for dashboards and parsers
/// written for Spark.
fn assert_spark_progress_shape(progress: &[serde_json::Value]) {
    for (i, p) in progress.iter().enumerate() {
        assert_eq!(p["batch_id"], i as u64);
        assert_eq!(p["table_version"], i as u64 + 1);
        assert_eq!(p["input_rows"], 100);
        for key in ["plan_ms", "write_ahead_ms", "execute_ms", "commit_ms"] {
            assert!(p["durations"][key].is_number(), "{p}");
        }
        // Spark's StreamingQueryProgress shape, for dashboards and parsers
        // written for Spark.
        assert_eq!(p["batchId"], i as u64, "{p}");
        assert_eq!(p["id"], progress[0]["id"], "{p}");
        assert_eq!(p["runId"], progress[0]["runId"], "{p}");
        assert_ne!(p["runId"], p["id"], "{p}");
        assert_eq!(p["name"], "quickstart", "{p}");
        assert!(p["timestamp"].as_str().unwrap().ends_with('Z'), "{p}");
        assert_eq!(p["numInputRows"], 100, "{p}");
        for key in [
            "latestOffset",
            "walCommit",
            "addBatch",
            "commitOffsets",
            "triggerExecution",
        ] {
            assert!(p["durationMs"][key].is_u64(), "{p}");
        }
        assert!(p["processedRowsPerSecond"].as_f64().unwrap() > 0.0, "{p}");
        let src = &p["sources"][0];
        assert_eq!(src["name"], "events", "{p}");
        assert!(
            src["description"]
                .as_str()
                .unwrap()
                .starts_with("files[file://"),
            "{p}"
        );
        assert!(src["endOffset"].is_object(), "{p}");
        assert_eq!(src["numInputRows"], 100, "{p}");
        assert_eq!(p["sink"]["numOutputRows"], p["output_rows"], "{p}");
        assert!(
            p["sink"]["description"]
                .as_str()
                .unwrap()
                .starts_with("delta "),
            "{p}"
        );
        assert_eq!(p["stateOperators"], serde_json::json!([]), "{p}");
    }
}

/// `lakestream query` reads what Python `deltalake` read (`rows`, the
/// kept events `expected`), by path, by name, and joined.
fn assert_readers_agree(dir: &std::path::Path, rows: &[serde_json::Value], expected: &[String]) {
    let ours = query(
        dir,
        "SELECT event_id FROM 'target/quickstart/clean_events' ORDER BY event_id",
    );
    assert_eq!(ids(&ours), *expected, "lakestream query agrees with python");
    let sums = query(
        dir,
        "SELECT count(*) AS n, sum(amount) AS total FROM 'target/quickstart/clean_events'",
    );
    let py_total: f64 = rows.iter().map(|r| r["amount"].as_f64().unwrap()).sum();
    assert_eq!(sums[0]["n"], expected.len() as u64);
    assert!((sums[0]["total"].as_f64().unwrap() - py_total).abs() < 1e-6);
    // The same table by a name, joined with the input's users by name too.
    let o = run_in(
        dir,
        &[
            "query",
            "--format",
            "json",
            "--table",
            "events=target/quickstart/clean_events",
            "--table",
            "users=examples/data/users.parquet",
            "SELECT count(*) AS n FROM events e JOIN users u ON e.user_id = u.user_id \
             WHERE u.country IS NOT NULL",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let joined: serde_json::Value =
        serde_json::from_slice(o.stdout.split(|b| *b == b'\n').next().unwrap()).unwrap();
    let known = rows.iter().filter(|r| r["country"].is_string()).count();
    assert_eq!(joined["n"], known as u64, "{}", text(&o));
    // One file, named by its quoted path (as `query --help` shows).
    let users = query(
        dir,
        "SELECT count(*) AS n FROM 'examples/data/users.parquet'",
    );
    assert!(users[0]["n"].as_u64().unwrap() > 0, "{users:?}");
    let o = run_in(dir, &["query", "--table", "events", "SELECT 1"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("NAME=LOCATION"), "{}", text(&o));
}

/// `status --json` after the quickstart's three batches.
fn assert_status_after_three_batches(dir: &std::path::Path) {
    let o = run_in(
        dir,
        &[
            "status",
            "--checkpoint",
            "target/quickstart/_checkpoint",
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let status: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(status["last_planned_batch"], 2);
    assert_eq!(status["last_committed_batch"], 2);
    assert_eq!(status["table_version"], 3);
    assert_eq!(status["running"], false);
    assert_eq!(status["sources"]["events"]["files_taken"], 6);
    // Each batch's progress is kept with the checkpoint.
    let recent = status["recent_batches"].as_array().unwrap();
    let ids: Vec<u64> = recent
        .iter()
        .map(|b| b["batch_id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, [0, 1, 2], "{status}");
    assert!(recent.iter().all(|b| b["input_rows"] == 100), "{status}");
    assert_eq!(recent[2]["table_version"], 3, "{status}");
}
