//! A stream joined with a static Delta table (a dimension table another
//! writer, Python `deltalake`, keeps updating): each batch joins the version
//! that was the latest when it was planned, recorded in its write-ahead, so
//! a batch replayed after a crash joins the same rows; `'version'` pins one.

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};

use crate::common::*;

/// Write the users table at `table` with Python `deltalake` (overwriting
/// it): users 0..7, every one of tier `tier`; with `region`, a further
/// column before the others (a schema change).
fn write_users(table: &Path, tier: &str, region: bool) {
    let script = r#"
import sys, pyarrow as pa
from deltalake import write_deltalake
path, tier, region = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
cols = {"user_id": pa.array(range(7), pa.int64()), "tier": pa.array([tier] * 7)}
if region:
    cols = {"region": pa.array(["eu"] * 7), **cols}
write_deltalake(path, pa.table(cols), mode="overwrite", schema_mode="overwrite" if region else None)
"#;
    let o = Command::new(python())
        .arg("-c")
        .arg(script)
        .arg(table)
        .arg(tier)
        .arg(if region { "1" } else { "0" })
        .output()
        .expect("run python");
    assert!(o.status.success(), "writing users failed: {}", text(&o));
}

/// The job: events (one file a batch) joined with `users` (its
/// `users_options`) into `out`.
fn job(dir: &Path, users_options: &str) {
    std::fs::write(
        dir.join("job.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE events (\n  event_id VARCHAR NOT NULL, user_id BIGINT, \
             event_type VARCHAR, amount DOUBLE, ts TIMESTAMP\n) STORED AS JSON LOCATION 'in'\n\
             OPTIONS ('max_files_per_trigger' '1');\n\
             CREATE EXTERNAL TABLE users STORED AS DELTA LOCATION 'users'{users_options};\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
             INSERT INTO out SELECT e.event_id, u.tier FROM events e JOIN users u \
             ON e.user_id = u.user_id;\n"
        ),
    )
    .unwrap();
}

/// The tier each event file's rows were joined with, by file number,
/// checking each file's 20 rows are there once and agree.
fn tiers(dir: &Path) -> Vec<(usize, String)> {
    let rows = read_py(&dir.join("out"));
    let mut by_file: std::collections::BTreeMap<usize, Vec<(String, String)>> = Default::default();
    for r in &rows {
        let id = r["event_id"].as_str().unwrap().to_string();
        let file: usize = id[3..7].parse().unwrap();
        by_file
            .entry(file)
            .or_default()
            .push((id, r["tier"].as_str().unwrap().to_string()));
    }
    by_file
        .into_iter()
        .map(|(f, mut rows)| {
            rows.sort();
            let n = rows.len();
            rows.dedup_by(|a, b| a.0 == b.0);
            assert_eq!(rows.len(), n, "file {f}: a row twice: {rows:?}");
            assert_eq!(n, 20, "file {f}: {rows:?}");
            let tier = rows[0].1.clone();
            assert!(rows.iter().all(|r| r.1 == tier), "file {f}: {rows:?}");
            (f, tier)
        })
        .collect()
}

fn run(dir: &Path, fail: Option<&str>) -> std::process::Output {
    let envs: Vec<(&str, String)> = fail
        .map(|f| ("LAKESTREAM_FAIL_POINT", f.to_string()))
        .into_iter()
        .collect();
    run_available_now(dir, "job.sql", "ckpt", &envs, &[])
}

fn users_spec(tier: &str) -> Value {
    json!({
        "columns": [{"name": "user_id", "type": "long"}, {"name": "tier", "type": "string"}],
        "rows": (0..7).map(|u| json!({"user_id": u, "tier": tier})).collect::<Vec<_>>(),
    })
}

#[test]
fn each_batch_joins_the_dimension_table_as_planned_and_a_replay_joins_the_same_version() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let users = dir.join("users");
    make_table_py(&users, &users_spec("bronze"));
    let v = meta_py(&users)["version"].as_i64().unwrap();
    job(dir, "");

    write_events(&dir.join("in"), 0, 1, 20);
    let o = run(dir, None);
    assert!(o.status.success(), "{}", text(&o));

    // The table changes while the stream runs: the next batch sees it.
    write_users(&users, "silver", false);
    write_events(&dir.join("in"), 1, 1, 20);
    let o = run(dir, None);
    assert!(o.status.success(), "{}", text(&o));

    // Batch 2 is planned (the write-ahead records users at v + 1) and its
    // files written, then the process dies before the commit. The table
    // changes again before the restart: the replay still joins v + 1.
    write_events(&dir.join("in"), 2, 1, 20);
    let o = run(dir, Some("after-files:2"));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let ahead: Value =
        serde_json::from_slice(&std::fs::read(dir.join("ckpt/offsets/2")).unwrap()).unwrap();
    assert_eq!(ahead["tables"], json!({"users": v + 1}), "{ahead}");
    write_users(&users, "gold", false);
    let o = run(dir, None);
    assert!(o.status.success(), "{}", text(&o));

    // Batch 3 is planned after the change.
    write_events(&dir.join("in"), 3, 1, 20);
    let o = run(dir, None);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        tiers(dir),
        vec![
            (0, "bronze".to_string()),
            (1, "silver".to_string()),
            (2, "silver".to_string()),
            (3, "gold".to_string()),
        ]
    );
    // Each commit names the version it joined.
    let joined: Vec<Value> = history_py(&dir.join("out"))
        .iter()
        .filter_map(|c| c.get("lakestream"))
        .map(|c| json!([c["batchId"], c["staticTables"]["users"]]))
        .collect();
    assert_eq!(
        joined,
        vec![
            json!([3, v + 2]),
            json!([2, v + 1]),
            json!([1, v + 1]),
            json!([0, v])
        ]
    );

    // A replay reads its recorded version by column name: batch 4 is
    // planned at the gold version, the process dies, a column is added
    // (the restart plans against it), and the replay still joins gold.
    write_events(&dir.join("in"), 4, 1, 20);
    let o = run(dir, Some("after-files:4"));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    write_users(&users, "platinum", true);
    let o = run(dir, None);
    assert!(o.status.success(), "{}", text(&o));
    write_events(&dir.join("in"), 5, 1, 20);
    let o = run(dir, None);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        tiers(dir)[4..],
        [(4, "gold".to_string()), (5, "platinum".to_string())]
    );
}

#[test]
fn a_pinned_version_is_joined_by_every_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let users = dir.join("users");
    make_table_py(&users, &users_spec("bronze"));
    let v = meta_py(&users)["version"].as_i64().unwrap();
    write_users(&users, "silver", false);
    job(dir, &format!(" OPTIONS ('version' '{v}')"));
    for f in 0..2 {
        write_events(&dir.join("in"), f, 1, 20);
        let o = run(dir, None);
        assert!(o.status.success(), "{}", text(&o));
        write_users(&users, "gold", false);
    }
    assert_eq!(
        tiers(dir),
        vec![(0, "bronze".to_string()), (1, "bronze".to_string())]
    );

    // A version the table does not have is refused before any batch.
    job(dir, " OPTIONS ('version' '99')");
    write_events(&dir.join("in"), 2, 1, 20);
    let o = run_available_now(dir, "job.sql", "ckpt2", &[], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = stderr(&o);
    assert!(err.contains("users") && err.contains("version 99"), "{err}");
    job(dir, " OPTIONS ('version' 'latest')");
    let o = run_available_now(dir, "job.sql", "ckpt2", &[], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("not a table version"), "{}", text(&o));
    // A misspelled option is refused too, naming the ones there are: the
    // static table goes through its connector like a source or a sink.
    job(dir, " OPTIONS ('versoin' '1')");
    let o = run_available_now(dir, "job.sql", "ckpt2", &[], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = stderr(&o);
    assert!(
        err.contains("unknown option \"versoin\" for table users (STORED AS DELTA)")
            && err.contains("valid options: version"),
        "{err}"
    );
}
