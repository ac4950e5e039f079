//! Bad input, bad jobs, a second process, a damaged checkpoint: clear errors
//! and nothing written to the table.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn run_once(dir: &Path, job: &str) -> std::process::Output {
    run_in(
        dir,
        &[
            "run",
            job,
            "--checkpoint",
            "ckpt",
            "--trigger",
            "available-now",
        ],
    )
}

#[test]
fn a_second_process_on_a_running_checkpoint_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    write_events(&input, 0, 2, 10);
    std::fs::write(dir.join("job.sql"), events_job(&input, &dir.join("out"), 1)).unwrap();
    // A continuous run holds the checkpoint.
    let first = bin()
        .current_dir(dir)
        .args(["run", "job.sql", "--checkpoint", "ckpt", "--progress-json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while meta_version(dir) < Some(2) {
        assert!(Instant::now() < deadline, "first run made no progress");
        std::thread::sleep(Duration::from_millis(50));
    }
    let before = meta_py(&dir.join("out"));
    let second = run_once(dir, "job.sql");
    assert_eq!(second.status.code(), Some(3), "{}", text(&second));
    assert!(
        stderr(&second).contains("checkpoint in use"),
        "{}",
        text(&second)
    );
    assert_eq!(
        meta_py(&dir.join("out")),
        before,
        "the refused run wrote nothing"
    );

    // SIGTERM: the first run stops gracefully with exit 0.
    unsafe_kill(first.id(), 15);
    let out = first.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    // Once it is gone, a restart is not blocked.
    let again = run_once(dir, "job.sql");
    assert!(again.status.success(), "{}", text(&again));
}

fn meta_version(dir: &Path) -> Option<u64> {
    let log = dir.join("out/_delta_log");
    let n = std::fs::read_dir(log)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .count();
    (n > 0).then(|| n as u64 - 1)
}

/// Send `sig` to `pid` with the `kill` command (no libc dependency).
pub(crate) fn unsafe_kill(pid: u32, sig: i32) {
    let ok = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig} {pid} failed");
}

#[test]
fn a_corrupt_checkpoint_file_is_named_and_nothing_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    write_events(&input, 0, 2, 10);
    std::fs::write(dir.join("job.sql"), events_job(&input, &dir.join("out"), 1)).unwrap();
    assert!(run_once(dir, "job.sql").status.success());
    let before = meta_py(&dir.join("out"));
    std::fs::write(dir.join("ckpt/offsets/1"), b"{\"version\": 1, \"batch_").unwrap();
    write_events(&input, 2, 1, 10);
    let o = run_once(dir, "job.sql");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let msg = stderr(&o);
    assert!(
        msg.contains("ckpt/offsets/1") && msg.contains("corrupt"),
        "{msg}"
    );
    assert_eq!(meta_py(&dir.join("out")), before);

    std::fs::write(dir.join("ckpt/offsets/1"), b"{\"version\": 9}").unwrap();
    let o = run_once(dir, "job.sql");
    assert!(stderr(&o).contains("format version 9"), "{}", text(&o));
    assert_eq!(meta_py(&dir.join("out")), before);
}

#[test]
fn malformed_input_fails_the_batch_naming_file_and_line_then_a_fix_continues() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    let mut expected = write_events(&input, 0, 1, 10);
    let bad = input.join("zz-bad.json");
    std::fs::write(
        &bad,
        "{\"event_id\":\"bad-1\",\"amount\":3.0,\"ts\":\"2026-01-01T00:00:00Z\"}\n\
         {\"event_id\":\"bad-2\",\"amount\":\"lots\",\"ts\":\"2026-01-01T00:00:00Z\"}\n",
    )
    .unwrap();
    std::fs::write(dir.join("job.sql"), events_job(&input, &dir.join("out"), 1)).unwrap();
    let o = run_once(dir, "job.sql");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let msg = stderr(&o);
    assert!(
        msg.contains("zz-bad.json") && msg.contains("line 2"),
        "{msg}"
    );
    let version_before = meta_py(&dir.join("out"))["version"].clone();

    // Fix the record and restart: the same batch re-runs with the fixed file.
    std::fs::write(
        &bad,
        "{\"event_id\":\"bad-1\",\"amount\":3.0,\"ts\":\"2026-01-01T00:00:00Z\"}\n\
         {\"event_id\":\"bad-2\",\"amount\":4.0,\"ts\":\"2026-01-01T00:00:00Z\"}\n",
    )
    .unwrap();
    let o = run_once(dir, "job.sql");
    assert!(o.status.success(), "{}", text(&o));
    expected.extend(["bad-1".to_string(), "bad-2".to_string()]);
    expected.sort();
    let rows = read_py(&dir.join("out"));
    assert_eq!(ids(&rows), expected);
    assert_eq!(
        meta_py(&dir.join("out"))["version"],
        version_before.as_u64().unwrap() + 1
    );
}

#[test]
fn removing_a_malformed_file_lets_the_job_continue_without_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    let mut expected = write_events(&input, 0, 1, 10);
    std::fs::write(input.join("zz-bad.json"), "{\"event_id\": 12\n not json\n").unwrap();
    std::fs::write(dir.join("job.sql"), events_job(&input, &dir.join("out"), 1)).unwrap();
    let o = run_once(dir, "job.sql");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(stderr(&o).contains("zz-bad.json"), "{}", text(&o));
    std::fs::remove_file(input.join("zz-bad.json")).unwrap();
    let o = run_once(dir, "job.sql");
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        stderr(&o).contains("no longer exists"),
        "the skip is reported: {}",
        text(&o)
    );
    // Later files are still taken.
    expected.extend(write_events(&input, 1, 1, 10));
    let o = run_once(dir, "job.sql");
    assert!(o.status.success(), "{}", text(&o));
    expected.sort();
    assert_eq!(ids(&read_py(&dir.join("out"))), expected);
}

#[test]
fn a_stream_without_declared_columns_gets_its_schema_inferred_once() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    let mut expected = write_events(&input, 0, 1, 10);
    let job = format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events STORED AS JSON LOCATION '{}';\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{}';\n\
         INSERT INTO out SELECT event_id, amount FROM events WHERE amount > 0;\n",
        input.display(),
        dir.join("out").display()
    );
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let o = run_once(dir, "job.sql");
    assert!(o.status.success(), "{}", text(&o));
    assert!(dir.join("ckpt/sources/events/schema").exists());
    // A later file with an extra field does not change the stored schema.
    std::fs::write(
        input.join("zz-more.json"),
        "{\"event_id\":\"x-1\",\"amount\":2.5,\"extra\":true}\n",
    )
    .unwrap();
    expected.push("x-1".into());
    let o = run_once(dir, "job.sql");
    assert!(o.status.success(), "{}", text(&o));
    expected.sort();
    let rows = read_py(&dir.join("out"));
    assert_eq!(ids(&rows), expected);
    assert_eq!(
        meta_py(&dir.join("out"))["columns"],
        serde_json::json!(["event_id", "amount"])
    );
}

#[test]
fn a_query_that_does_not_fit_the_table_is_refused_before_writing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    write_events(&input, 0, 1, 10);
    std::fs::write(dir.join("job.sql"), events_job(&input, &dir.join("out"), 1)).unwrap();
    assert!(run_once(dir, "job.sql").status.success());
    let before = meta_py(&dir.join("out"));
    let other = format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events (event_id VARCHAR, amount DOUBLE) STORED AS JSON LOCATION '{}';\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{}';\n\
         INSERT INTO out SELECT event_id, amount * 2 AS doubled FROM events;\n",
        input.display(),
        dir.join("out").display()
    );
    std::fs::write(dir.join("other.sql"), other).unwrap();
    let o = run_in(
        dir,
        &[
            "run",
            "other.sql",
            "--checkpoint",
            "ckpt2",
            "--trigger",
            "available-now",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        stderr(&o).contains("does not match the table's schema"),
        "{}",
        text(&o)
    );
    assert_eq!(meta_py(&dir.join("out")), before);
}

#[test]
fn job_errors_point_at_line_and_column() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    write_events(&input, 0, 1, 10);
    let head = format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events (event_id VARCHAR, amount DOUBLE) STORED AS JSON LOCATION '{}';\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{}';\n",
        input.display(),
        dir.join("out").display()
    );
    let cases = [
        (
            "INSERT INTO out\nSELECT event_id, amont FROM events;\n",
            "job.sql:4:18",
            "amont",
        ),
        (
            "INSERT INTO out\nSELECT * FROM nothere;\n",
            "job.sql:4:",
            "nothere",
        ),
        (
            "INSERT INTO out\nSELECT event_id, sum(amount) AS s FROM events GROUP BY event_id;\n",
            "job.sql:4:",
            "aggregation",
        ),
        (
            "INSERT INTO out\nSELEC event_id FROM events;\n",
            "job.sql:",
            "Expected",
        ),
    ];
    for (tail, pos, word) in cases {
        std::fs::write(dir.join("job.sql"), format!("{head}{tail}")).unwrap();
        let o = run_once(dir, "job.sql");
        assert_eq!(o.status.code(), Some(2), "{tail}: {}", text(&o));
        let msg = stderr(&o);
        assert!(msg.contains(pos) && msg.contains(word), "{tail}: {msg}");
        assert!(
            !dir.join("out/_delta_log").exists(),
            "{tail}: a table was created"
        );
    }
    // An unknown option is refused, not ignored.
    std::fs::write(
        dir.join("job.sql"),
        head.replace(
            "STORED AS JSON",
            "STORED AS JSON OPTIONS ('max_file_per_trigger' '2')",
        ) + "INSERT INTO out SELECT event_id, amount FROM events;\n",
    )
    .unwrap();
    let o = run_once(dir, "job.sql");
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("max_file_per_trigger"), "{}", text(&o));
}
