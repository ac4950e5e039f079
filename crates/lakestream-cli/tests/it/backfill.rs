//! Backfills of a prefix: Hive partition directories become columns,
//! `path_glob` and `modified_after` / `modified_before` choose the files,
//! gzip and zstd files are read like plain ones, progress names files done
//! of the total, incremental listing, and a restart after many batches reads
//! the seen-files snapshot instead of every batch.

use std::io::Write;
use std::path::Path;

use crate::common::*;

/// Events `ev-<tag>-<i>` as JSON lines.
fn events(tag: &str, n: usize) -> (String, Vec<String>) {
    let mut body = String::new();
    let mut ids = Vec::new();
    for i in 0..n {
        let id = format!("ev-{tag}-{i:03}");
        body.push_str(&format!(
            "{{\"event_id\":\"{id}\",\"amount\":{}.5,\"ts\":\"2026-01-01T00:00:00Z\"}}\n",
            i + 1
        ));
        ids.push(id);
    }
    (body, ids)
}

fn put(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn gzip(text: &str) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(text.as_bytes()).unwrap();
    e.finish().unwrap()
}

/// Set a file's modification time with `touch -d` (no extra crate).
fn set_mtime(path: &Path, when: &str) {
    let ok = std::process::Command::new("touch")
        .args(["-d", when])
        .arg(path)
        .status()
        .unwrap()
        .success();
    assert!(ok, "touch -d {when} failed");
}

#[test]
fn partitions_globs_time_bounds_and_compressed_files() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    let mut expected = Vec::new();
    let mut month = std::collections::BTreeMap::new();
    // Plain, gzip and zstd files in Hive-style month directories.
    let (body, ids) = events("jan", 20);
    put(
        &input.join("year=2026/month=01/part-0.json"),
        body.as_bytes(),
    );
    month.extend(ids.iter().map(|i| (i.clone(), 1)));
    expected.extend(ids);
    let (body, ids) = events("feb", 30);
    put(
        &input.join("year=2026/month=02/part-0.json.gz"),
        &gzip(&body),
    );
    month.extend(ids.iter().map(|i| (i.clone(), 2)));
    expected.extend(ids);
    let (body, ids) = events("mar", 25);
    put(
        &input.join("year=2026/month=03/part-0.json.zst"),
        &zstd::encode_all(body.as_bytes(), 3).unwrap(),
    );
    month.extend(ids.iter().map(|i| (i.clone(), 3)));
    expected.extend(ids);
    // Left out: a file the glob does not match, and one too old.
    put(&input.join("year=2026/month=03/README.txt"), b"not data");
    let (body, _) = events("old", 5);
    let old = input.join("year=2025/month=12/part-0.json");
    put(&old, body.as_bytes());
    set_mtime(&old, "2020-06-01");
    expected.sort();

    std::fs::write(
        dir.join("job.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE events (\n  event_id VARCHAR, amount DOUBLE, ts TIMESTAMP, month INT\n) STORED AS JSON LOCATION 'in/'\n\
         PARTITIONED BY (year, month)\n\
         OPTIONS ('path_glob' '**/*.json*', 'modified_after' '2021-01-01', 'max_files_per_trigger' '1');\n\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\n\
         INSERT INTO out SELECT event_id, amount, year, month FROM events;\n",
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    // Without a terminal: one plain line per batch, with files done of the
    // total listed at start.
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("1/3 files"), "{}", text(&o));
    assert!(err.contains("3/3 files (100% of bytes)"), "{}", text(&o));

    let rows = read_py(&dir.join("out"));
    assert_exactly_once(&rows, &expected);
    for r in &rows {
        let id = r["event_id"].as_str().unwrap();
        assert_eq!(r["year"], "2026", "{r}");
        assert_eq!(r["month"], month[id], "{r}");
    }
    let meta = meta_py(&dir.join("out"));
    assert_eq!(meta["types"][3], "int32", "{meta}");

    // A file before the upper bound only: modified_before keeps it out.
    let (body, _) = events("late", 3);
    put(
        &input.join("year=2026/month=04/part-0.json"),
        body.as_bytes(),
    );
    let job = std::fs::read_to_string(dir.join("job.sql"))
        .unwrap()
        .replace(
            "'2021-01-01'",
            "'2021-01-01', 'modified_before' '2021-06-01'",
        );
    std::fs::write(dir.join("job2.sql"), job).unwrap();
    let o = run_available_now(dir, "job2.sql", "ckpt2", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("done: 0 batches"),
        "{}",
        text(&o)
    );
}

#[test]
fn a_corrupt_gzip_file_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut bad = gzip(&events("bad", 50).0);
    let n = bad.len();
    bad.truncate(n / 2);
    put(&dir.join("in/part-0.json.gz"), &bad);
    std::fs::write(
        dir.join("job.sql"),
        events_job(&dir.join("in"), &dir.join("out"), 1),
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("part-0.json.gz"), "{}", text(&o));
    assert!(err.contains("gzip"), "{}", text(&o));
}

#[test]
fn incremental_listing_and_snapshots_keep_restarts_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    let mut expected = Vec::new();
    let day_file = |d: usize| input.join(format!("date=2026-01-{d:02}/events.json"));
    for d in 1..=3 {
        let (body, ids) = events(&format!("d{d}"), 4);
        put(&day_file(d), body.as_bytes());
        expected.extend(ids);
    }
    let job = "CREATE UNBOUNDED EXTERNAL TABLE events (event_id VARCHAR, amount DOUBLE, ts TIMESTAMP)\n\
               STORED AS JSON LOCATION 'in/'\n\
               OPTIONS ('incremental_listing' 'true', 'max_files_per_trigger' '1');\n\
               CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
               INSERT INTO out SELECT event_id, amount FROM events;\n";
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    // New days arrive after the last one read; a restart lists only the
    // paths after it, so a file dropped late into an old day is not seen
    // (the documented contract of incremental listing).
    for d in 4..=5 {
        let (body, ids) = events(&format!("d{d}"), 4);
        put(&day_file(d), body.as_bytes());
        expected.extend(ids);
    }
    let (body, _) = events("late", 4);
    put(&input.join("date=2026-01-02/late.json"), body.as_bytes());
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("done: 2 batches"),
        "{}",
        text(&o)
    );
    expected.sort();
    assert_exactly_once(&read_py(&dir.join("out")), &expected);
}

#[test]
fn file_and_directory_names_with_escapes_are_read_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    let mut expected = Vec::new();
    // Names a store encodes (`%`, `#`, space, `~`) and a Hive-escaped
    // partition value (`%3A` is `:`).
    for (i, name) in [
        "hour=2026-01-01 00%3A00/a%20b~1.json",
        "hour=2026-01-01 01%3A00/c#d.json",
    ]
    .iter()
    .enumerate()
    {
        let (body, ids) = events(&format!("n{i}"), 5);
        put(&input.join(name), body.as_bytes());
        expected.extend(ids);
    }
    expected.sort();
    std::fs::write(
        dir.join("job.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE events (event_id VARCHAR, amount DOUBLE, ts TIMESTAMP)\n\
         STORED AS JSON LOCATION 'in/' PARTITIONED BY (hour);\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
         INSERT INTO out SELECT event_id, hour FROM events;\n",
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        !String::from_utf8_lossy(&o.stderr).contains("no longer exists"),
        "{}",
        text(&o)
    );
    let rows = read_py(&dir.join("out"));
    assert_exactly_once(&rows, &expected);
    let mut hours: Vec<&str> = rows.iter().map(|r| r["hour"].as_str().unwrap()).collect();
    hours.sort();
    hours.dedup();
    assert_eq!(hours, ["2026-01-01 00:00", "2026-01-01 01:00"]);
}

#[test]
fn a_partition_directory_that_does_not_fit_its_type_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (body, _) = events("x", 3);
    put(&dir.join("in/month=abc/part-0.json"), body.as_bytes());
    std::fs::write(
        dir.join("job.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE events (event_id VARCHAR, amount DOUBLE, month INT)\n\
         STORED AS JSON LOCATION 'in/' PARTITIONED BY (month);\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
         INSERT INTO out SELECT event_id, month FROM events;\n",
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("month=abc"), "{}", text(&o));
    assert!(err.contains("part-0.json"), "{}", text(&o));
}
