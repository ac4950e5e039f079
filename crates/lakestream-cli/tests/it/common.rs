//! Helpers: the real binary, event files, and two independent table readers.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

/// The `lakestream` binary cargo built for these tests.
pub(crate) fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lakestream"));
    c.env_remove("LAKESTREAM_FAIL_POINT");
    c
}

/// Run the binary with `args` in `dir`.
pub(crate) fn run_in(dir: &Path, args: &[&str]) -> Output {
    bin()
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run lakestream")
}

pub(crate) use lakestream_testkit::output_text as text;

/// The stderr of `o`, as text.
pub(crate) fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub(crate) use lakestream_testkit::repo_root as root;
pub(crate) use lakestream_testkit::{python, run_py_lines};

/// The output of `tests/py/read_delta.py TABLE ARGS`, checked to succeed.
fn read_delta_py(table: &(impl AsRef<std::ffi::OsStr> + ?Sized), args: &[&str]) -> Vec<u8> {
    let o = Command::new(python())
        .arg(root().join("tests/py/read_delta.py"))
        .arg(table)
        .args(args)
        .output()
        .expect("run python");
    assert!(o.status.success(), "python reader failed: {}", text(&o));
    o.stdout
}

/// JSON lines as values.
fn json_lines(out: Vec<u8>) -> Vec<serde_json::Value> {
    String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Rows of the Delta table at `table`, read by Python `deltalake`.
pub(crate) fn read_py(table: &(impl AsRef<std::ffi::OsStr> + ?Sized)) -> Vec<serde_json::Value> {
    json_lines(read_delta_py(table, &[]))
}

/// Version, partition columns, columns and row count, read by Python.
pub(crate) fn meta_py(table: &(impl AsRef<std::ffi::OsStr> + ?Sized)) -> serde_json::Value {
    serde_json::from_slice(&read_delta_py(table, &["--meta"])).unwrap()
}

/// The commitInfo of every commit of the table at `table`, newest first,
/// read by Python.
pub(crate) fn history_py(table: &(impl AsRef<std::ffi::OsStr> + ?Sized)) -> Vec<serde_json::Value> {
    json_lines(read_delta_py(table, &["--history"]))
}

/// The change data feed of the table at `table` from version 0, read by
/// Python `deltalake`'s `load_cdf`.
pub(crate) fn cdf_py(table: &(impl AsRef<std::ffi::OsStr> + ?Sized)) -> Vec<serde_json::Value> {
    json_lines(read_delta_py(table, &["--cdf"]))
}

/// The table's protocol (versions, features) and configuration, read by
/// Python `deltalake`.
pub(crate) fn protocol_py(table: &(impl AsRef<std::ffi::OsStr> + ?Sized)) -> serde_json::Value {
    serde_json::from_slice(&read_delta_py(table, &["--protocol"])).unwrap()
}

/// Create a Delta table at `table` with Python `deltalake` from `spec`
/// (see `tests/py/make_table.py`); its protocol, as the writer left it.
pub(crate) fn make_table_py(table: &Path, spec: &serde_json::Value) -> serde_json::Value {
    let o = Command::new(python())
        .arg(root().join("tests/py/make_table.py"))
        .arg(table)
        .arg(spec.to_string())
        .output()
        .expect("run python");
    assert!(o.status.success(), "make_table.py failed: {}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Rows of `sql` through `lakestream query --format json`.
pub(crate) fn query(dir: &Path, sql: &str) -> Vec<serde_json::Value> {
    let o = run_in(dir, &["query", "--format", "json", sql]);
    assert!(o.status.success(), "query failed: {}", text(&o));
    String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Count of each value of `field` over `rows`.
pub(crate) fn counts(rows: &[serde_json::Value], field: &str) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for r in rows {
        let k = match &r[field] {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        *m.entry(k).or_insert(0) += 1;
    }
    m
}

/// Write `files` JSON-lines files of `rows` events each under `dir`, with
/// ids `ev-<file>-<row>`; amounts are positive except every 5th row.
/// Returns the ids a `WHERE amount > 0` query keeps.
pub(crate) fn write_events(
    dir: &Path,
    first_file: usize,
    files: usize,
    rows: usize,
) -> Vec<String> {
    std::fs::create_dir_all(dir).unwrap();
    let mut kept = Vec::new();
    for f in first_file..first_file + files {
        let mut body = String::new();
        for r in 0..rows {
            let id = format!("ev-{f:04}-{r:04}");
            let amount = if r % 5 == 4 { -1.5 } else { 1.0 + r as f64 };
            if amount > 0.0 {
                kept.push(id.clone());
            }
            body.push_str(&format!(
                "{{\"event_id\":\"{id}\",\"user_id\":{},\"event_type\":\"click\",\"amount\":{amount},\"ts\":\"2026-01-{:02}T10:00:00Z\"}}\n",
                r % 7,
                1 + (f % 3)
            ));
        }
        // Write then rename, as a well-behaved producer does.
        let tmp = dir.join(format!(".tmp-{f}"));
        std::fs::write(&tmp, body).unwrap();
        std::fs::rename(&tmp, dir.join(format!("events-{f:04}.json"))).unwrap();
    }
    kept
}

/// A job reading JSON events under `input` into a Delta table at `table`.
pub(crate) fn events_job(input: &Path, table: &Path, max_files: usize) -> String {
    format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events (\n  event_id VARCHAR NOT NULL, user_id BIGINT, event_type VARCHAR, amount DOUBLE, ts TIMESTAMP\n) STORED AS JSON LOCATION '{}'\nOPTIONS ('max_files_per_trigger' '{max_files}');\n\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{}' PARTITIONED BY (day);\n\n\
         INSERT INTO out\nSELECT event_id, user_id, event_type, amount, ts, CAST(ts AS DATE) AS day\nFROM events WHERE amount > 0;\n",
        input.display(),
        table.display()
    )
}

/// Sorted event ids of `rows`.
pub(crate) fn ids(rows: &[serde_json::Value]) -> Vec<String> {
    let mut v: Vec<String> = rows
        .iter()
        .map(|r| r["event_id"].as_str().unwrap().to_string())
        .collect();
    v.sort();
    v
}

/// Sorted rows as canonical JSON strings: a multiset to compare tables.
pub(crate) fn multiset(rows: &[serde_json::Value]) -> Vec<String> {
    let mut v: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
    v.sort();
    v
}

/// A small deterministic PRNG (xorshift), seeded per test run.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    /// Next value in `0..n`.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Run `lakestream <args>` in `dir` with `envs` again and again, killing it
/// with SIGKILL after a random 20..370 ms (at most `max_kills` times, seeded
/// by `seed`), until a run exits on its own. Asserts that run succeeded and
/// returns how many kills landed. Bounded: 40 runs and `limit` of time.
///
/// For jobs that share `dir` with others running at once, or keep their
/// state off `dir`: it cannot start over, so the caller checks the count.
pub(crate) fn kill_until_done(
    dir: &Path,
    args: &[&str],
    envs: &[(&str, String)],
    max_kills: usize,
    seed: u64,
    limit: std::time::Duration,
) -> usize {
    let kills = Kills {
        max: max_kills,
        min: 0,
        seed,
        limit,
        latest: std::time::Duration::from_millis(370),
    };
    kill_until_done_with(dir, args, envs, &kills)
}

/// How a crash loop kills: at most `max` kills, each after a random
/// 20 ms..`latest` (seeded by `seed`), the whole loop within `limit`.
pub(crate) struct Kills {
    /// Kills at most.
    pub(crate) max: usize,
    /// Kills that must land. When a loop ends with fewer (the job finished
    /// its input before the next delay ran out), `dir` is put back as it was
    /// before the loop and the loop starts over with delays within a
    /// `min + 1`-th of the last run's time, at most three times. 0: no
    /// start-over (and no copy of `dir`).
    pub(crate) min: usize,
    /// Seed of the kill moments (printed by the loop).
    pub(crate) seed: u64,
    /// The whole loop's time bound.
    pub(crate) limit: std::time::Duration,
    /// The latest moment after a start a kill is drawn at.
    pub(crate) latest: std::time::Duration,
}

/// Loops of [`Kills::min`] at most: the first and two starts-over.
const CRASH_LOOP_TRIES: usize = 3;

/// [`kill_until_done`] with the kill moments of `kills`; asserts at least
/// [`Kills::min`] kills landed.
pub(crate) fn kill_until_done_with(
    dir: &Path,
    args: &[&str],
    envs: &[(&str, String)],
    kills_at: &Kills,
) -> usize {
    kill_until_done_logged(dir, args, envs, kills_at).0
}

/// [`kill_until_done_with`], also returning the stdout and stderr of every
/// run, killed or not (of every loop, when it started over).
pub(crate) fn kill_until_done_logged(
    dir: &Path,
    args: &[&str],
    envs: &[(&str, String)],
    kills_at: &Kills,
) -> (usize, String) {
    use std::time::{Duration, Instant};
    let deadline = Instant::now() + kills_at.limit;
    let mut outputs = String::new();
    if kills_at.min == 0 {
        let (kills, _) = crash_loop(dir, args, envs, kills_at, deadline, &mut outputs);
        return (kills, outputs);
    }
    let before = tempfile::tempdir().unwrap();
    let before_dir = before.path().join("dir");
    copy_path(dir, &before_dir);
    let (mut seed, mut latest) = (kills_at.seed, kills_at.latest);
    for tries in 1..=CRASH_LOOP_TRIES {
        let (kills, last_run) = crash_loop(
            dir,
            args,
            envs,
            &Kills {
                seed,
                latest,
                ..*kills_at
            },
            deadline,
            &mut outputs,
        );
        if kills >= kills_at.min {
            return (kills, outputs);
        }
        assert!(
            tries < CRASH_LOOP_TRIES,
            "only {kills} of {} kills landed in {tries} loops: the job finishes before the \
             kills come",
            kills_at.min
        );
        // The last run did at most the whole job: kills within a share of
        // its time land before a run from the start is done.
        latest = (last_run / (kills_at.min as u32 + 1)).clamp(Duration::from_millis(25), latest);
        seed = seed.rotate_left(17) ^ tries as u64;
        eprintln!(
            "only {kills} of {} kills landed (the last run took {last_run:?}): from the start \
             again",
            kills_at.min
        );
        std::fs::remove_dir_all(dir).unwrap();
        copy_path(&before_dir, dir);
    }
    unreachable!("the last loop returns or fails its assertion")
}

/// How long `lakestream <args>` takes from nothing to the end of its
/// input, run in a scratch directory holding only the `inputs` (files or
/// directories) of `dir`: the time a crash loop of a job that shares `dir`
/// with others (and so cannot start over) draws its kills within a share
/// of.
pub(crate) fn clean_run_time(dir: &Path, inputs: &[&str], args: &[&str]) -> std::time::Duration {
    let scratch = tempfile::tempdir().unwrap();
    for name in inputs {
        copy_path(&dir.join(name), &scratch.path().join(name));
    }
    let started = std::time::Instant::now();
    let o = run_in(scratch.path(), args);
    let took = started.elapsed();
    assert!(o.status.success(), "a run without kills: {}", text(&o));
    took
}

/// Copy the file or directory (recursively) at `from` to `to`, which does
/// not exist yet.
fn copy_path(from: &Path, to: &Path) {
    if !from.is_dir() {
        std::fs::copy(from, to).unwrap();
        return;
    }
    std::fs::create_dir(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        copy_path(&e.path(), &to.join(e.file_name()));
    }
}

/// One crash loop of [`kill_until_done_with`], ended by `deadline`: the
/// kills landed and how long the run that finished took. Every run's
/// stdout and stderr are added to `outputs`.
fn crash_loop(
    dir: &Path,
    args: &[&str],
    envs: &[(&str, String)],
    kills_at: &Kills,
    deadline: std::time::Instant,
    outputs: &mut String,
) -> (usize, std::time::Duration) {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let (max_kills, seed) = (kills_at.max, kills_at.seed);
    let span = (kills_at.latest.as_millis() as u64)
        .saturating_sub(20)
        .max(1);
    eprintln!("crash test seed: {seed}, kills after 20..{} ms", 20 + span);
    let mut rng = Rng(seed | 1);
    let mut kills = 0;
    for attempt in 0..40 {
        assert!(Instant::now() < deadline, "crash loop took too long");
        let start = Instant::now();
        let mut child = bin()
            .current_dir(dir)
            .args(args)
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        if kills < max_kills {
            let delay = Duration::from_millis(20 + rng.below(span));
            while start.elapsed() < delay {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            if child.try_wait().unwrap().is_none() {
                child.kill().unwrap(); // SIGKILL
                outputs.push_str(&text(&child.wait_with_output().unwrap()));
                kills += 1;
                continue;
            }
        }
        let out = child.wait_with_output().unwrap();
        let took = start.elapsed();
        outputs.push_str(&text(&out));
        assert!(out.status.success(), "attempt {attempt}: {}", text(&out));
        eprintln!("killed {kills} times");
        return (kills, took);
    }
    panic!("the job never completed");
}

/// [`kill_until_done`] of [`run_job_args`] in `dir` with at most `max_kills`
/// kills at clock-seeded moments, within 240 s, starting over from `dir` as
/// it was until at least `min_kills` land; returns the kills landed.
pub(crate) fn kill_run_job(dir: &Path, max_kills: usize, min_kills: usize) -> usize {
    kill_until_done_with(
        dir,
        &run_job_args("ckpt"),
        &[],
        &Kills {
            max: max_kills,
            min: min_kills,
            seed: clock_seed(),
            limit: std::time::Duration::from_secs(240),
            latest: std::time::Duration::from_millis(370),
        },
    )
}

/// `lakestream run job.sql` to the end of the input, checkpointed at
/// `ckpt`.
pub(crate) fn run_job_args(ckpt: &str) -> [&str; 6] {
    [
        "run",
        "job.sql",
        "--checkpoint",
        ckpt,
        "--trigger",
        "available-now",
    ]
}

/// [`run_job_args`] in `dir`, checkpointed at `ckpt/`.
pub(crate) fn run_job(dir: &Path) -> Output {
    run_in(dir, &run_job_args("ckpt"))
}

/// [`run_job_args`] in `dir`, checkpointed at `ckpt`, printing each
/// batch's progress as JSON.
pub(crate) fn run_job_progress(dir: &Path, ckpt: &str) -> Output {
    run_available_now(dir, "job.sql", ckpt, &[], &["--progress-json"])
}

/// Run the job `job(table)` gives once without kills into table `clean`
/// (checkpoint `clean_ckpt`), then as `job.sql` into `out` (checkpoint
/// `ckpt`) under [`kill_until_done`] with at most `max_kills` kills.
/// Asserts both runs succeed, that at least `min_kills` kills landed, and
/// that the killed run's table, read by Python `deltalake`, holds the clean
/// run's rows (as multisets). Returns the clean table's rows.
///
/// Kills come at most a `min_kills`-th of the clean run's time after each
/// start (and never later than 370 ms), so on a machine fast enough to run
/// the whole job in a few hundred milliseconds, `min_kills` kills still land
/// before it is done: each restarted run has at least the rest of the work
/// to do, and no kill takes away more than that share of it.
pub(crate) fn killed_run_writes_the_clean_table(
    dir: &Path,
    job: &dyn Fn(&str) -> String,
    max_kills: usize,
    min_kills: usize,
) -> Vec<String> {
    use std::time::{Duration, Instant};
    std::fs::write(dir.join("clean.sql"), job("clean")).unwrap();
    let started = Instant::now();
    let o = run_available_now(dir, "clean.sql", "clean_ckpt", &[], &[]);
    let clean_run = started.elapsed();
    assert!(o.status.success(), "{}", text(&o));
    let clean = multiset(&read_py(&dir.join("clean")));
    std::fs::write(dir.join("job.sql"), job("out")).unwrap();
    let latest = (clean_run / min_kills.max(1) as u32)
        .clamp(Duration::from_millis(40), Duration::from_millis(370));
    eprintln!("clean run: {clean_run:?}");
    let kills = kill_until_done_with(
        dir,
        &run_job_args("ckpt"),
        &[],
        &Kills {
            max: max_kills,
            min: min_kills,
            seed: clock_seed(),
            limit: Duration::from_secs(240),
            latest,
        },
    );
    assert_eq!(multiset(&read_py(&dir.join("out"))), clean);
    // The killed run's table and checkpoint agree, batch by batch.
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt"]);
    assert!(
        o.status.success(),
        "verify after {kills} kills: {}",
        text(&o)
    );
    clean
}

/// `lakestream verify` of the checkpoint `ckpt` in `dir` passes after
/// `kills` kills, and finds `batches` batches in the table, each once.
pub(crate) fn assert_verified_batches(dir: &Path, kills: usize, batches: u64) {
    let o = run_in(dir, &["verify", "--checkpoint", "ckpt", "--json"]);
    assert!(
        o.status.success(),
        "verify after {kills} kills: {}",
        text(&o)
    );
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(report["batches_in_table"], batches, "{report}");
}

/// A seed for a randomized test, from the clock (printed by the test).
pub(crate) fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// Every id of `expected` (sorted) is in `rows` exactly once, and nothing else.
pub(crate) fn assert_exactly_once(rows: &[serde_json::Value], expected: &[String]) {
    let dupes: Vec<_> = counts(rows, "event_id")
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .collect();
    assert!(dupes.is_empty(), "rows written twice: {dupes:?}");
    assert_eq!(ids(rows), expected, "every kept event exactly once");
}

/// Wait (at most until `deadline`) until the job on `dir/ckpt` has taken
/// `files` files and committed every batch it planned.
pub(crate) fn wait_caught_up(dir: &Path, files: u64, deadline: std::time::Instant) {
    loop {
        let o = run_in(dir, &["status", "--checkpoint", "ckpt", "--json"]);
        let s: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        if s["sources"]["events"]["files_taken"] == files
            && s["last_committed_batch"] == s["last_planned_batch"]
        {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the job did not catch up"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// `lakestream run JOB --checkpoint CKPT --trigger available-now` in `dir`
/// with `envs` (plus `extra` arguments), to completion.
pub(crate) fn run_available_now(
    dir: &Path,
    job: &str,
    ckpt: &str,
    envs: &[(&str, String)],
    extra: &[&str],
) -> Output {
    bin()
        .current_dir(dir)
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .args([
            "run",
            job,
            "--checkpoint",
            ckpt,
            "--trigger",
            "available-now",
        ])
        .args(extra)
        .output()
        .expect("run lakestream")
}

/// `files` files of `rows` events each, event times moving forward by about
/// 20 s per file with some rows up to 90 s behind (a few of them behind the
/// 1-minute watermark: dropped the same way in every run).
pub(crate) fn write_timed_events(dir: &std::path::Path, files: usize, rows: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let base = 1_767_225_600i64; // 2026-01-01T00:00:00Z
    for f in 0..files {
        let mut body = String::new();
        for r in 0..rows {
            let late = if r % 4 == 3 { 90 } else { 0 };
            let t = base + (f as i64) * 20 + (r as i64 % 20) - late;
            let ts = chrono::DateTime::from_timestamp(t, 0).unwrap().to_rfc3339();
            body.push_str(&format!(
                "{{\"ts\":\"{ts}\",\"user_id\":{},\"amount\":{}}}\n",
                r % 5,
                f * rows + r
            ));
        }
        let tmp = dir.join(format!(".tmp-{f}"));
        std::fs::write(&tmp, body).unwrap();
        std::fs::rename(&tmp, dir.join(format!("events-{f:04}.json"))).unwrap();
    }
}

/// A per-minute, per-user windowed aggregation of the events under
/// `input` into the Delta table at `table`, in output mode `mode`.
pub(crate) fn windowed_job(input: &str, table: &str, mode: &str) -> String {
    format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events (ts TIMESTAMP, user_id BIGINT, amount BIGINT)\n\
         STORED AS JSON LOCATION '{}'\n\
         OPTIONS ('max_files_per_trigger' '1', 'event_time' 'ts', 'watermark_delay' '1 minute');\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{}' OPTIONS ('output_mode' '{mode}');\n\
         INSERT INTO out\n\
         SELECT window.start AS minute, user_id, count(*) AS n, sum(amount) AS total, \
         min(amount) AS low, avg(amount) AS mean\n\
         FROM events GROUP BY window(ts, '1 minute'), user_id;\n",
        input, table
    )
}

/// Start `tests/py/<script>` with `args`: a loopback server that prints
/// its port as its first line. Returns the process and the port.
pub(crate) fn spawn_py_server(
    script: &str,
    args: &[&std::ffi::OsStr],
) -> (std::process::Child, u16) {
    use std::io::BufRead;
    let mut child = Command::new(python())
        .arg(root().join("tests/py").join(script))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("run python");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port = line
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{script} printed no port: {line:?}"));
    (child, port)
}
