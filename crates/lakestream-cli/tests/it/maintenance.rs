//! `lakestream table`: compaction while a stream appends to the same table,
//! then vacuum (dry run, then for real), a log checkpoint and the history,
//! with the table's rows checked by Python `deltalake` after each step.

use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::errors::unsafe_kill;

/// The operation of each entry of `lakestream table history --json`.
fn operations(history: &serde_json::Value) -> Vec<&str> {
    history
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["operation"].as_str().unwrap())
        .collect()
}

fn table_cmd(dir: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["table"];
    all.extend_from_slice(args);
    all.push("--json");
    let o = run_in(dir, &all);
    assert!(o.status.success(), "{args:?}: {}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    if lines.len() == 1 {
        lines.into_iter().next().unwrap()
    } else {
        serde_json::Value::Array(lines)
    }
}

fn data_files(table: &std::path::Path) -> usize {
    let mut n = 0;
    for day in std::fs::read_dir(table).unwrap() {
        let day = day.unwrap().path();
        if day.is_dir() && !day.ends_with("_delta_log") {
            n += std::fs::read_dir(&day).unwrap().count();
        }
    }
    n
}

#[test]
fn compaction_while_a_stream_writes_keeps_every_row_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    let mut expected = write_events(&input, 0, 10, 10);
    std::fs::write(dir.join("job.sql"), events_job(&input, &dir.join("out"), 1)).unwrap();
    let child = bin()
        .current_dir(dir)
        .args([
            "run",
            "job.sql",
            "--checkpoint",
            "ckpt",
            "--trigger",
            "20ms",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the table, then compact repeatedly while files keep arriving.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !dir
        .join("out/_delta_log/00000000000000000002.json")
        .exists()
    {
        assert!(Instant::now() < deadline, "the stream did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut removed = 0;
    for round in 0..6 {
        expected.extend(write_events(&input, 10 + round * 5, 5, 10));
        let m = table_cmd(dir, &["optimize", "out", "--target-size", "1MiB"]);
        removed += m["files_removed"].as_u64().unwrap();
    }
    assert!(removed > 0, "compaction never compacted anything");
    // Let the stream catch up with all 40 files, then stop it.
    wait_caught_up(dir, 40, deadline);
    unsafe_kill(child.id(), 15);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    expected.sort();
    let table = dir.join("out");
    assert_exactly_once(&read_py(&table), &expected);

    // The history shows both writers.
    let history = table_cmd(dir, &["history", "out", "--limit", "1000"]);
    let ops = operations(&history);
    assert!(ops.contains(&"OPTIMIZE"), "{ops:?}");
    let batches: Vec<u64> = history
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|h| h["batch_id"].as_u64())
        .collect();
    assert_eq!(
        batches.len(),
        40,
        "one stream commit per batch: {batches:?}"
    );
    assert_eq!(history[0]["version"], meta_py(&table)["version"]);

    // One last compaction, then vacuum: a dry run lists and keeps the
    // compacted-away files, --execute deletes them, the rows stay.
    table_cmd(dir, &["optimize", "out"]);
    let before = data_files(&table);
    let live = meta_py(&table)["files"].as_u64().unwrap() as usize;
    assert!(before > live, "{before} files on disk, {live} live");
    let args = ["vacuum", "out", "--retention-hours", "0"];
    let o = run_in(dir, &["table", "vacuum", "out", "--retention-hours", "0"]);
    assert!(!o.status.success(), "a short retention needs the flag");
    assert!(text(&o).contains("--allow-short-retention"), "{}", text(&o));
    let dry = table_cmd(dir, &[&args[..], &["--allow-short-retention"]].concat());
    assert_eq!(dry["dry_run"], true);
    assert_eq!(dry["files"].as_array().unwrap().len(), before - live);
    assert_eq!(data_files(&table), before, "a dry run deletes nothing");
    let done = table_cmd(
        dir,
        &[&args[..], &["--allow-short-retention", "--execute"]].concat(),
    );
    assert_eq!(done["files"].as_array().unwrap().len(), before - live);
    assert_eq!(data_files(&table), live);
    assert_exactly_once(&read_py(&table), &expected);

    // A log checkpoint at the current version.
    let v = meta_py(&table)["version"].as_u64().unwrap();
    let c = table_cmd(dir, &["checkpoint", "out"]);
    assert_eq!(c["checkpoint_version"], v);
    assert!(
        table
            .join(format!("_delta_log/{v:020}.checkpoint.parquet"))
            .exists()
    );
    assert_exactly_once(&read_py(&table), &expected);
}

#[test]
fn auto_compaction_runs_every_n_batches_inside_the_job() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    let mut expected = write_events(&input, 0, 10, 10);
    expected.sort();
    let job = events_job(&input, &dir.join("out"), 1).replace(
        "PARTITIONED BY (day);",
        "PARTITIONED BY (day)\nOPTIONS ('auto_compact_every' '5');",
    );
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let history = table_cmd(dir, &["history", "out", "--limit", "100"]);
    let ops = operations(&history);
    assert_eq!(
        ops.iter().filter(|o| **o == "OPTIMIZE").count(),
        2,
        "after batches 4 and 9: {ops:?}"
    );
    // Each of the three days ends up in one file.
    assert_eq!(meta_py(&dir.join("out"))["files"], 3);
    assert_exactly_once(&read_py(&dir.join("out")), &expected);
}
