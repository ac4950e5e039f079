//! Bad input, bad jobs, a second process, a damaged checkpoint: clear errors
//! and nothing written to the table.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;

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
fn a_planned_file_that_vanished_fails_the_batch_unless_skipping_is_asked_for() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    let mut expected = write_events(&input, 0, 1, 10);
    std::fs::write(input.join("zz-bad.json"), "{\"event_id\": 12\n not json\n").unwrap();
    std::fs::write(dir.join("job.sql"), events_job(&input, &dir.join("out"), 1)).unwrap();
    let o = run_once(dir, "job.sql");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(stderr(&o).contains("zz-bad.json"), "{}", text(&o));
    let version_before = meta_py(&dir.join("out"))["version"].clone();

    // The file planned into batch 1 is removed: committing the batch without
    // it would lose its rows silently, so the batch fails, naming both.
    std::fs::remove_file(input.join("zz-bad.json")).unwrap();
    let o = run_once(dir, "job.sql");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let msg = stderr(&o);
    assert!(
        msg.contains("batch 1") && msg.contains("zz-bad.json") && msg.contains("no longer exists"),
        "{}",
        text(&o)
    );
    assert!(msg.contains("missing_files"), "says what to do: {msg}");
    assert_eq!(meta_py(&dir.join("out"))["version"], version_before);

    // Asked for, the skip commits the batch and is recorded: in progress and
    // in the commit's commitInfo, where an audit of the table finds it.
    let skipping = events_job(&input, &dir.join("out"), 1)
        .replace("OPTIONS (", "OPTIONS ('missing_files' 'skip', ");
    std::fs::write(dir.join("job.sql"), skipping).unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt", &[], &["--progress-json"]);
    assert!(o.status.success(), "{}", text(&o));
    let progress: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(progress.len(), 1, "{}", text(&o));
    assert_eq!(progress[0]["sources"][0]["name"], "events");
    let skipped = &progress[0]["sources"][0]["skipped"];
    assert!(
        skipped.to_string().contains("zz-bad.json"),
        "progress names the skipped file: {}",
        text(&o)
    );
    assert!(stderr(&o).contains("skipped"), "{}", text(&o));
    let history = history_py(&dir.join("out"));
    assert!(
        history[0].to_string().contains("zz-bad.json"),
        "the newest commit records the skip: {}",
        history[0]
    );
    assert!(
        !history[1].to_string().contains("zz-bad.json"),
        "only the batch that skipped records it: {}",
        history[1]
    );
    // Later files are still taken.
    expected.extend(write_events(&input, 1, 1, 10));
    let o = run_once(dir, "job.sql");
    assert!(o.status.success(), "{}", text(&o));
    expected.sort();
    assert_eq!(ids(&read_py(&dir.join("out"))), expected);
}

#[test]
fn bad_option_values_are_refused_with_exit_2_before_anything_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    write_events(&input, 0, 2, 10);
    let job = events_job(&input, &dir.join("out"), 1);
    let cases = [
        (
            "'max_files_per_trigger' '1'",
            "'max_files_per_trigger' '0'",
            "max_files_per_trigger",
        ),
        (
            "'max_files_per_trigger' '1'",
            "'batch_size' '0'",
            "batch_size",
        ),
        (
            "'max_files_per_trigger' '1'",
            "'max_bytes_per_trigger' '0'",
            "max_bytes_per_trigger",
        ),
        (
            "'max_files_per_trigger' '1'",
            "'read_concurrency' '0'",
            "read_concurrency",
        ),
        (
            "'max_files_per_trigger' '1'",
            "'missing_files' 'maybe'",
            "missing_files",
        ),
        (
            "'max_files_per_trigger' '1'",
            "'max_file_age' '0s'",
            "max_file_age",
        ),
        (
            "'max_files_per_trigger' '1'",
            "'max_file_age' '400d'",
            "max_file_age",
        ),
        (
            "'max_files_per_trigger' '1'",
            "'max_files_per_trigger' '99999999999999999999999'",
            "max_files_per_trigger",
        ),
        (
            "PARTITIONED BY (day)",
            "PARTITIONED BY (day) OPTIONS ('target_file_size' '0')",
            "target_file_size",
        ),
    ];
    for (from, to, word) in cases {
        std::fs::write(dir.join("job.sql"), job.replace(from, to)).unwrap();
        let o = run_once(dir, "job.sql");
        assert_eq!(o.status.code(), Some(2), "{to}: {}", text(&o));
        assert!(stderr(&o).contains(word), "{to}: {}", text(&o));
        assert!(
            !dir.join("out/_delta_log").exists(),
            "{to}: a table was created"
        );
    }
    // CSV options are checked, not guessed.
    let csv = format!(
        "CREATE UNBOUNDED EXTERNAL TABLE e (a VARCHAR) STORED AS CSV LOCATION '{}' OPTIONS (@OPTS@);\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{}';\n\
         INSERT INTO out SELECT a FROM e;\n",
        input.display(),
        dir.join("out").display()
    );
    for (opts, word) in [
        ("'has_header' 'yes'", "has_header"),
        ("'delimiter' ''", "delimiter"),
        ("'delimiter' ';;'", "delimiter"),
    ] {
        std::fs::write(dir.join("job.sql"), csv.replace("@OPTS@", opts)).unwrap();
        let o = run_once(dir, "job.sql");
        assert_eq!(o.status.code(), Some(2), "{opts}: {}", text(&o));
        assert!(stderr(&o).contains(word), "{opts}: {}", text(&o));
    }
    // Triggers and durations out of range: an error, not a panic.
    std::fs::write(dir.join("job.sql"), &job).unwrap();
    for trigger in ["99999999999999999999s", "1e400", "400000000h"] {
        let o = run_in(
            dir,
            &[
                "run",
                "job.sql",
                "--checkpoint",
                "ckpt",
                "--trigger",
                trigger,
            ],
        );
        assert_eq!(o.status.code(), Some(2), "{trigger}: {}", text(&o));
        assert!(!stderr(&o).contains("panicked"), "{trigger}: {}", text(&o));
    }
}

#[test]
fn kafka_settings_the_reader_owns_are_refused_before_any_broker_is_asked() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for (key, value) in [
        ("kafka.auto.offset.reset", "earliest"),
        ("kafka.auto.offset.reset", "latest"),
        ("kafka.isolation.level", "read_uncommitted"),
        ("kafka.enable.auto.commit", "true"),
        ("kafka.enable.auto.offset.store", "true"),
        ("kafka.group.id", "mine"),
        ("kafka.ENABLE.AUTO.COMMIT", "true"),
    ] {
        // Port 1 on loopback: nothing listens, so a run that asked a broker
        // would hang in retries instead of exiting at once.
        let job = format!(
            "CREATE UNBOUNDED EXTERNAL TABLE orders STORED AS KAFKA \
             LOCATION 'kafka://127.0.0.1:1/orders' OPTIONS ('format' 'string', '{key}' '{value}');\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{}';\n\
             INSERT INTO out SELECT value FROM orders;\n",
            dir.join("out").display()
        );
        std::fs::write(dir.join("job.sql"), job).unwrap();
        let started = Instant::now();
        let o = run_once(dir, "job.sql");
        assert_eq!(o.status.code(), Some(2), "{key}: {}", text(&o));
        let msg = stderr(&o);
        assert!(msg.contains(&key.to_ascii_lowercase()), "{key}: {msg}");
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{key}: refused only after {:?}",
            started.elapsed()
        );
        assert!(
            !dir.join("out/_delta_log").exists(),
            "{key}: a table was created"
        );
    }
    // What a user legitimately wants has its own option.
    let job = format!(
        "CREATE UNBOUNDED EXTERNAL TABLE orders STORED AS KAFKA \
         LOCATION 'kafka://127.0.0.1:1/orders' OPTIONS ('format' 'string', 'isolation_level' 'sometimes');\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{}';\n\
         INSERT INTO out SELECT value FROM orders;\n",
        dir.join("out").display()
    );
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let o = run_once(dir, "job.sql");
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(stderr(&o).contains("read_uncommitted"), "{}", text(&o));
}

#[test]
fn an_unreachable_broker_fails_after_the_configured_wait_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // Nothing listens on port 1 of loopback.
    let job = format!(
        "CREATE UNBOUNDED EXTERNAL TABLE orders STORED AS KAFKA \
         LOCATION 'kafka://127.0.0.1:1/orders' OPTIONS ('format' 'string', \
         'unavailable_timeout' '2s', 'request_timeout' '1s');\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{}';\n\
         INSERT INTO out SELECT value FROM orders;\n",
        dir.join("out").display()
    );
    std::fs::write(dir.join("job.sql"), job).unwrap();
    let started = Instant::now();
    let o = run_once(dir, "job.sql");
    let took = started.elapsed();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let msg = stderr(&o);
    assert!(
        msg.contains("127.0.0.1:1") && msg.contains("still unavailable after"),
        "{}",
        text(&o)
    );
    assert!(msg.contains("waiting"), "the wait is logged: {}", text(&o));
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(60),
        "gave up after {took:?}"
    );
}

#[test]
fn a_restart_with_other_sources_or_another_table_is_refused_and_a_new_filter_is_not() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    write_events(&input, 0, 2, 10);
    let job = events_job(&input, &dir.join("out"), 1);
    std::fs::write(dir.join("job.sql"), &job).unwrap();
    let o = run_once(dir, "job.sql");
    assert!(o.status.success(), "{}", text(&o));
    let before = meta_py(&dir.join("out"));
    write_events(&input, 2, 1, 10);

    let other = dir.join("other");
    write_events(&other, 0, 1, 10);
    let cases = [
        (job.replace("events", "clicks"), "source clicks"),
        (
            job.replace(&input.display().to_string(), &other.display().to_string()),
            "now reads files",
        ),
        (
            job.replace(
                &dir.join("out").display().to_string(),
                &dir.join("out2").display().to_string(),
            ),
            "the output was",
        ),
    ];
    for (changed, word) in cases {
        std::fs::write(dir.join("job.sql"), &changed).unwrap();
        let o = run_once(dir, "job.sql");
        assert_eq!(o.status.code(), Some(2), "{word}: {}", text(&o));
        let msg = stderr(&o);
        assert!(msg.contains(word), "{word}: {msg}");
        assert!(
            msg.contains("new --checkpoint"),
            "{word}: says what to do: {msg}"
        );
        assert_eq!(
            meta_py(&dir.join("out")),
            before,
            "{word}: the table changed"
        );
        assert!(
            !dir.join("out2").exists(),
            "{word}: another table was created"
        );
    }
    // A changed filter (or option) keeps the offsets' meaning: allowed,
    // and only the new file is read.
    std::fs::write(
        dir.join("job.sql"),
        job.replace("WHERE amount > 0", "WHERE amount > 2")
            .replace("OPTIONS (", "OPTIONS ('max_file_age' '30d', "),
    )
    .unwrap();
    let o = run_once(dir, "job.sql");
    assert!(o.status.success(), "{}", text(&o));
    assert!(stderr(&o).contains("1 batches"), "{}", text(&o));
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

/// `lakestream status | head -1`: the reader closed the pipe; the report
/// ends quietly with success instead of a panic and a backtrace. So does
/// a bad `--storage-option`, refused as a usage error before anything runs.
#[test]
fn reports_to_a_closed_pipe_end_quietly_and_bad_storage_options_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in");
    write_events(&input, 0, 2, 5);
    std::fs::write(
        dir.path().join("job.sql"),
        events_job(&input, &dir.path().join("table"), 1),
    )
    .unwrap();
    let ckpt = dir.path().join("ckpt");
    let out = run_in(
        dir.path(),
        &[
            "run",
            "job.sql",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--trigger",
            "available-now",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));

    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = bin()
        .args(["status", "--checkpoint", ckpt.to_str().unwrap()])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));

    let out = run_in(
        dir.path(),
        &[
            "status",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--storage-option",
            "aws_region",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        stderr(&out).contains("storage option \"aws_region\" is not KEY=VALUE"),
        "{}",
        stderr(&out)
    );
}
