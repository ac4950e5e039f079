//! `lakestream-bench`: end-to-end figures of the real binary against the
//! floor of decoding the input and encoding Parquet, on deterministic data.
//!
//! Every figure is one line `name: value unit` on stdout. Workloads:
//! backfill (JSON files -> partitioned Delta, available-now) versus the raw
//! limit (arrow-json decode + filter + Parquet encode split by day, no
//! engine; also unsplit), many tiny
//! batches (per-batch overhead), a long table history (commit time), a
//! windowed aggregation over the backfill input, tiny batches against a
//! large and a small aggregation state, update-mode batches merging 100
//! groups into a large and a small table, several writers into one table,
//! and, with a broker, Kafka versus a raw consume + decode loop and one
//! versus two processes sharing the topic in group mode.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use arrow::array::{AsArray, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema, TimeUnit};

mod avro;
mod broker;
mod decode;
mod latency;
mod spark;

/// Sizes of the workloads.
#[derive(Debug, Clone)]
pub(crate) struct BenchConfig {
    /// The `lakestream` binary measured.
    pub(crate) lakestream: PathBuf,
    pub(crate) dir: PathBuf,
    pub(crate) rows: u64,
    pub(crate) files: u64,
    pub(crate) tiny_batches: u64,
    pub(crate) history: u64,
    pub(crate) state_groups: u64,
    pub(crate) kafka_bootstrap: Option<String>,
    /// Run the Kafka workloads against librdkafka's mock broker, started
    /// in this process (instead of a broker at `kafka_bootstrap`).
    pub(crate) kafka_mock: bool,
    pub(crate) kafka_messages: u64,
    /// An object store prefix where the several-writers workload also puts
    /// its tables, and the start-up workload a table and checkpoint.
    pub(crate) object_store_prefix: Option<String>,
    /// `--smoke`: tiny sizes, and no workload that depends on a test
    /// broker's consumer-group coordinator.
    pub(crate) smoke: bool,
    /// Produce rates (messages a second) of the Kafka latency workload.
    pub(crate) latency_rates: Vec<u64>,
    /// How long the latency workload produces at each rate.
    pub(crate) latency_seconds: f64,
    /// A Python with `pyspark`: the backfill workload also runs its
    /// queries in Spark Structured Streaming.
    pub(crate) spark_python: Option<PathBuf>,
    /// The workloads to run (all when empty): names of [`WORKLOADS`].
    pub(crate) only: Vec<String>,
    /// `--repeat`: rounds of the backfill and its raw floor, alternated.
    pub(crate) repeat: usize,
}

/// The workloads `--only` can pick.
pub(crate) const WORKLOADS: &[&str] = &[
    "backfill", "decode", "avro", "state", "update", "tiny", "writers", "history", "startup",
    "kafka", "latency",
];

impl BenchConfig {
    /// The sizes of `--smoke`: every figure, in seconds.
    pub(crate) fn smoke(mut self) -> Self {
        self.rows = 20_000;
        self.files = 4;
        self.tiny_batches = 12;
        self.history = 40;
        self.state_groups = 20_000;
        self.kafka_messages = 2_000;
        self.latency_rates = vec![100];
        self.latency_seconds = 1.0;
        self.repeat = 1;
        self.smoke = true;
        self
    }

    /// Whether `--only` (or its absence) picks `workload`.
    fn wants(&self, workload: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|w| w == workload)
    }
}

fn figure(name: &str, value: impl std::fmt::Display, unit: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{name}: {value} {unit}");
    let _ = out.flush();
}

/// The `lakestream` binary the workloads run (set once by [`bench`]).
static LAKESTREAM: OnceLock<PathBuf> = OnceLock::new();

/// The `lakestream` binary under measure.
fn lakestream() -> &'static Path {
    LAKESTREAM
        .get()
        .map(PathBuf::as_path)
        .unwrap_or(Path::new("lakestream"))
}

/// What a finished child process used, by the kernel's accounting.
struct Measured {
    status: std::process::ExitStatus,
    /// User and system CPU seconds.
    cpu_seconds: f64,
    /// Peak resident set (bytes).
    peak_rss: u64,
}

/// Wait for `child` (its pipes already taken) and read its CPU time and
/// peak RSS from `wait4`: the process is measured from outside, so the
/// measured binary carries no code for it.
fn wait_measured(child: &mut std::process::Child) -> std::io::Result<Measured> {
    use std::os::unix::process::ExitStatusExt;
    let pid = child.id() as libc::pid_t;
    let mut status: libc::c_int = 0;
    // SAFETY: an all-zero `rusage` is a valid value of the plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: `status` and `usage` are valid for writes for the call;
        // `pid` is our own child, not yet reaped (std's `Child` is never
        // waited on afterwards).
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if r >= 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok(Measured {
        status: std::process::ExitStatus::from_raw(status),
        cpu_seconds: secs(usage.ru_utime) + secs(usage.ru_stime),
        // Linux reports kilobytes.
        peak_rss: usage.ru_maxrss as u64 * 1024,
    })
}

/// Read a child's stderr to its end on a thread of its own.
fn read_all(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = pipe.read_to_end(&mut v);
        v
    })
}

/// What `lakestream run` reported about itself.
struct RunReport {
    wall: Duration,
    cpu_seconds: f64,
    peak_rss: u64,
    progress: Vec<serde_json::Value>,
}

impl RunReport {
    /// The sum of `key` over the run's batches' progress.
    fn sum(&self, key: &str) -> u64 {
        self.progress.iter().filter_map(|p| p[key].as_u64()).sum()
    }
}

fn run_job(dir: &Path, job: &str, ckpt: &str) -> anyhow::Result<RunReport> {
    run_job_with(dir, job, ckpt, &[])
}

/// [`run_job`] with `extra` arguments to `lakestream run`.
fn run_job_with(dir: &Path, job: &str, ckpt: &str, extra: &[&str]) -> anyhow::Result<RunReport> {
    let start = Instant::now();
    let mut child = Command::new(lakestream())
        .current_dir(dir)
        .args([
            "run",
            job,
            "--checkpoint",
            ckpt,
            "--trigger",
            "available-now",
            "--progress-json",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(&l).ok())
            .collect::<Vec<_>>()
    });
    let err = read_all(child.stderr.take().expect("piped"));
    let m = wait_measured(&mut child)?;
    let wall = start.elapsed();
    let progress = reader.join().expect("reader thread");
    let err = err.join().expect("stderr thread");
    let stderr = String::from_utf8_lossy(&err);
    // The run's log and its batches' progress stay in the bench
    // directory, beside the job.
    std::fs::write(dir.join(format!("{job}.log")), &err)?;
    std::fs::write(
        dir.join(format!("{job}.progress.jsonl")),
        progress
            .iter()
            .map(|p| format!("{p}\n"))
            .collect::<String>(),
    )?;
    if !m.status.success() {
        bail!("lakestream run {job} failed: {stderr}");
    }
    Ok(RunReport {
        wall,
        cpu_seconds: m.cpu_seconds,
        peak_rss: m.peak_rss,
        progress,
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn median_of(progress: &[serde_json::Value], key: &str) -> f64 {
    let mut v: Vec<f64> = progress
        .iter()
        .filter_map(|p| p["durations"][key].as_f64())
        .collect();
    v.sort_by(f64::total_cmp);
    percentile(&v, 0.5)
}

const DAY_START_S: i64 = 1_767_225_600; // 2026-01-01T00:00:00Z

/// Write `rows` events in `files` JSON-lines files; about a month of event
/// time, in order. Returns the total bytes. Each file is synced to disk, so
/// the kernel is not still writing the input back while the first
/// workload timed reads it (and not while the later ones do).
fn generate_events(dir: &Path, rows: u64, files: u64) -> anyhow::Result<u64> {
    std::fs::create_dir_all(dir)?;
    let per_file = rows.div_ceil(files.max(1));
    let span_s = 30 * 86_400i64;
    let types = ["view", "click", "cart", "purchase"];
    let mut total = 0;
    for f in 0..files {
        let path = dir.join(format!("events-{f:05}.json"));
        let mut w = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&path)?);
        let lo = f * per_file;
        let hi = ((f + 1) * per_file).min(rows);
        for i in lo..hi {
            let h = (i.wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 17;
            let ts = DAY_START_S + (i as i64 * span_s) / rows.max(1) as i64;
            let dt = chrono::DateTime::from_timestamp(ts, 0).expect("valid time");
            let amount = (h % 20_000) as f64 / 100.0 - 20.0;
            writeln!(
                w,
                "{{\"event_id\":\"e{i:010}\",\"user_id\":{},\"event_type\":\"{}\",\"amount\":{amount:.2},\"ts\":\"{}\"}}",
                h % 100_000,
                types[(h >> 20) as usize % 4],
                dt.format("%Y-%m-%dT%H:%M:%SZ")
            )?;
        }
        w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        total += std::fs::metadata(&path)?.len();
    }
    Ok(total)
}

const BACKFILL_JOB: &str = "CREATE UNBOUNDED EXTERNAL TABLE events (
  event_id VARCHAR NOT NULL, user_id BIGINT, event_type VARCHAR, amount DOUBLE, ts TIMESTAMP
) STORED AS JSON LOCATION 'events/'{OPTIONS};
CREATE EXTERNAL TABLE clean STORED AS DELTA LOCATION '{TABLE}' PARTITIONED BY (day);
INSERT INTO clean
SELECT event_id, user_id, event_type, amount, ts, CAST(ts AS DATE) AS day
FROM events WHERE amount > 0;
";

const WINDOWED_JOB: &str = "CREATE UNBOUNDED EXTERNAL TABLE events (
  event_id VARCHAR NOT NULL, user_id BIGINT, event_type VARCHAR, amount DOUBLE, ts TIMESTAMP
) STORED AS JSON LOCATION 'events/'
OPTIONS ('event_time' 'ts', 'watermark_delay' '1 minute');
CREATE EXTERNAL TABLE per_minute STORED AS DELTA LOCATION 'out/windowed';
INSERT INTO per_minute
SELECT window.start AS minute, event_type, count(*) AS n, sum(amount) AS total
FROM events GROUP BY window(ts, '1 minute'), event_type;
";

/// What the state-cost workload measured.
struct StateCost {
    /// Median batch time of the tiny batches (ms).
    median: f64,
    /// Their p90 (ms).
    p90: f64,
    /// The slowest of them (ms): every tenth batch is due a snapshot of
    /// the whole state, which is written off the batch path.
    max: f64,
    /// The state's bytes as the store counts them (its row encoding).
    bytes: u64,
    /// The memory the store says its keys and values take.
    memory: u64,
    /// The run's peak resident memory.
    peak_rss: u64,
    /// The Arrow size of the open groups' keys and partial states, read
    /// back from the newest state snapshot.
    arrow_bytes: u64,
}

/// The Arrow size (the bytes of the array slices) of the state columns of
/// the newest snapshot under `ckpt` (the store's bucket and removal
/// columns left out).
fn snapshot_arrow_bytes(ckpt: &Path) -> anyhow::Result<u64> {
    let dir = ckpt.join("state/aggregate");
    let newest = std::fs::read_dir(&dir)
        .with_context(|| format!("no state under {}", dir.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let id = name.strip_suffix(".snapshot.arrow")?.parse::<u64>().ok()?;
            Some((id, e.path()))
        })
        .max()
        .with_context(|| format!("no state snapshot under {}", dir.display()))?;
    let reader = arrow::ipc::reader::FileReader::try_new(std::fs::File::open(&newest.1)?, None)?;
    let mut total = 0u64;
    for batch in reader {
        let batch = batch?;
        let n = batch.num_columns().saturating_sub(2);
        for c in &batch.columns()[..n] {
            total += c.to_data().get_slice_memory_size()? as u64;
        }
    }
    Ok(total)
}

/// The stream the state workloads read: one file per batch, event time
/// `ts` with a one-minute watermark.
const STATE_EVENTS: &str =
    "CREATE UNBOUNDED EXTERNAL TABLE events (user_id BIGINT, amount DOUBLE, ts TIMESTAMP)
     STORED AS JSON LOCATION 'events/'
     OPTIONS ('max_files_per_trigger' '1', 'event_time' 'ts', 'watermark_delay' '1 minute');";

/// Tiny batches (10 rows) against `groups` open groups of a windowed
/// aggregation (one day-long window, one group per user): `opening`
/// batches of `first_rows / opening` rows each (`first_rows` at least
/// `groups`) open them, then `tiny` batches each update 10; the job runs
/// `runs` times.
fn state_cost(
    dir: &Path,
    groups: u64,
    first_rows: u64,
    opening: u64,
    tiny: u64,
    runs: usize,
) -> anyhow::Result<StateCost> {
    let input = dir.join("events");
    std::fs::create_dir_all(&input)?;
    let line = |user: u64, second: u64| {
        format!(
            "{{\"user_id\":{user},\"amount\":1.5,\"ts\":\"2026-01-01T00:{:02}:{:02}Z\"}}\n",
            second / 60,
            second % 60
        )
    };
    let first_rows = first_rows.max(groups);
    let opening = opening.clamp(1, first_rows);
    for b in 0..opening {
        let name = input.join(format!("a{b:06}.json"));
        let mut w = std::io::BufWriter::new(std::fs::File::create(name)?);
        for i in b * first_rows / opening..(b + 1) * first_rows / opening {
            w.write_all(line(i % groups, 0).as_bytes())?;
        }
        w.flush()?;
    }
    for i in 1..=tiny {
        let body: String = (0..10).map(|j| line((i * 10 + j) % groups, i)).collect();
        std::fs::write(input.join(format!("f{i:06}.json")), body)?;
    }
    std::fs::write(
        dir.join("state.sql"),
        format!(
            "{STATE_EVENTS}
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';
             INSERT INTO out SELECT window.start AS day, user_id, count(*) AS n, sum(amount) AS total
             FROM events GROUP BY window(ts, '1 day'), user_id;"
        ),
    )?;
    // Peak memory moves by several MiB between runs of one job here: the
    // figure is the median of `runs` runs, each from a new checkpoint (the
    // batch times come from the last).
    let mut peaks = Vec::new();
    let mut last = None;
    for _ in 0..runs.max(1) {
        for made in ["ckpt", "out"] {
            if dir.join(made).exists() {
                std::fs::remove_dir_all(dir.join(made))?;
            }
        }
        let r = run_job(dir, "state.sql", "ckpt")?;
        peaks.push(r.peak_rss);
        last = Some(r);
    }
    peaks.sort_unstable();
    let r = last.expect("at least one run");
    let mut totals = times_after(&r, opening, tiny, "state")?;
    let held = r
        .progress
        .last()
        .and_then(|p| p["state"]["rows"].as_u64())
        .unwrap_or(0);
    if held != groups {
        bail!("the state workload holds {held} groups, expected {groups}");
    }
    let bytes = r
        .progress
        .last()
        .and_then(|p| p["state"]["bytes"].as_u64())
        .unwrap_or(0);
    let memory = r
        .progress
        .last()
        .and_then(|p| p["state"]["memory_bytes"].as_u64())
        .unwrap_or(0);
    totals.sort_by(f64::total_cmp);
    Ok(StateCost {
        median: percentile(&totals, 0.5),
        p90: percentile(&totals, 0.9),
        max: totals.last().copied().unwrap_or_default(),
        bytes,
        memory,
        peak_rss: peaks[peaks.len() / 2],
        arrow_bytes: snapshot_arrow_bytes(&dir.join("ckpt"))?,
    })
}

/// The peak RSS (median of `runs` runs) of the stateless job over the
/// input [`state_cost`] wrote in `dir`, in the same batches: each row
/// projected into the table, no state kept. What the state costs is the
/// stateful run's peak above this one.
fn stateless_peak(dir: &Path, runs: usize) -> anyhow::Result<u64> {
    std::fs::write(
        dir.join("stateless.sql"),
        format!(
            "{STATE_EVENTS}
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'stateless-out';
             INSERT INTO out SELECT ts AS day, user_id, 1 AS n, amount AS total FROM events;"
        ),
    )?;
    let mut peaks = Vec::new();
    for _ in 0..runs.max(1) {
        for made in ["stateless-ckpt", "stateless-out"] {
            if dir.join(made).exists() {
                std::fs::remove_dir_all(dir.join(made))?;
            }
        }
        peaks.push(run_job(dir, "stateless.sql", "stateless-ckpt")?.peak_rss);
    }
    peaks.sort_unstable();
    Ok(peaks[peaks.len() / 2])
}

/// The batch times (ms) of run `r` after its first `skip` batches, which
/// must be `expected` batches of the `what` workload.
fn times_after(r: &RunReport, skip: u64, expected: u64, what: &str) -> anyhow::Result<Vec<f64>> {
    let totals: Vec<f64> = r
        .progress
        .iter()
        .skip(skip as usize)
        .filter_map(|p| p["durations"]["total_ms"].as_f64())
        .collect();
    if totals.len() as u64 != expected {
        bail!(
            "the {what} workload ran {} batches after its first {skip}, expected {expected}",
            totals.len()
        );
    }
    Ok(totals)
}

/// What [`update_cost`] measured: medians over the changing batches.
struct UpdateCost {
    /// Batch time (ms).
    median_ms: f64,
    /// Rows each MERGE wrote (the changed groups and the rows copied from
    /// the files it rewrote).
    rows_rewritten: f64,
    /// Table files in the table when the changes began.
    files: u64,
}

/// Update mode: first batches write `rows` groups (one per user), `chunk`
/// consecutive users a batch (so each of the table's files holds one range
/// of users, as a table appended over time holds one range of times), then
/// `batches` batches each change 100 of them, merged into the table by key:
/// spread over the whole key range (`local` false) or 100 consecutive
/// users (`local`).
fn update_cost(
    dir: &Path,
    rows: u64,
    chunk: u64,
    batches: u64,
    local: bool,
) -> anyhow::Result<UpdateCost> {
    let input = dir.join("events");
    std::fs::create_dir_all(&input)?;
    let line = |user: u64| format!("{{\"user_id\":{user},\"amount\":1.5}}\n");
    let chunk = chunk.clamp(1, rows.max(1));
    let first = rows.div_ceil(chunk);
    for c in 0..first {
        let mut w =
            std::io::BufWriter::new(std::fs::File::create(input.join(format!("f{c:06}.json")))?);
        for u in c * chunk..((c + 1) * chunk).min(rows) {
            w.write_all(line(u).as_bytes())?;
        }
        w.flush()?;
    }
    for i in 1..=batches {
        let body: String = if local {
            // 100 consecutive users somewhere in the table.
            let start = (i * 7919 * 101) % rows.saturating_sub(100).max(1);
            (0..100).map(|j| line((start + j) % rows)).collect()
        } else {
            // 100 keys spread over the whole key range.
            (0..100)
                .map(|j| line((j * rows / 100 + i * 7) % rows))
                .collect()
        };
        std::fs::write(input.join(format!("f{:06}.json", first + i - 1)), body)?;
    }
    std::fs::write(
        dir.join("update.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE events (user_id BIGINT, amount DOUBLE)
         STORED AS JSON LOCATION 'events/' OPTIONS ('max_files_per_trigger' '1');
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out' OPTIONS ('output_mode' 'update');
         INSERT INTO out SELECT user_id, count(*) AS n, sum(amount) AS total
         FROM events GROUP BY user_id;",
    )?;
    let r = run_job(dir, "update.sql", "ckpt")?;
    let mut totals = times_after(&r, first, batches, "update")?;
    totals.sort_by(f64::total_cmp);
    // What each MERGE wrote, from its commit's operationMetrics; the files
    // the first batches left, from their adds and removes.
    let log = dir.join("out/_delta_log");
    let mut rewritten = Vec::new();
    let mut files = 0u64;
    let mut version = 0u64;
    while let Ok(text) = std::fs::read_to_string(log.join(format!("{version:020}.json"))) {
        version += 1;
        let actions: Vec<serde_json::Value> = text
            .lines()
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()?;
        let Some(batch) = actions
            .iter()
            .find_map(|a| a["commitInfo"]["lakestream"]["batchId"].as_u64())
        else {
            continue;
        };
        if batch < first {
            files += actions.iter().filter(|a| a.get("add").is_some()).count() as u64;
            files =
                files.saturating_sub(
                    actions.iter().filter(|a| a.get("remove").is_some()).count() as u64
                );
        } else if let Some(n) = actions
            .iter()
            .find_map(|a| a["commitInfo"]["operationMetrics"]["num_output_rows"].as_f64())
        {
            rewritten.push(n);
        }
    }
    rewritten.sort_by(f64::total_cmp);
    Ok(UpdateCost {
        median_ms: percentile(&totals, 0.5),
        rows_rewritten: percentile(&rewritten, 0.5),
        files,
    })
}

/// What [`writers_cost`] measured.
struct WritersCost {
    commits: u64,
    retries: u64,
    commit_median_ms: f64,
    wall: Duration,
}

/// `writers` processes, each `shard i/writers` of `files` one-file batches
/// (10 events each), committing into one table (`table`) at once.
fn writers_cost(dir: &Path, files: u64, writers: u64, table: &str) -> anyhow::Result<WritersCost> {
    std::fs::create_dir_all(dir.join("events"))?;
    for i in 0..files {
        let body: String = (0..10)
            .map(|j| {
                format!(
                    "{{\"event_id\":\"w{i}-{j}\",\"user_id\":{j},\"event_type\":\"view\",\"amount\":{}.5,\"ts\":\"2026-01-01T00:00:00Z\"}}\n",
                    j + 1
                )
            })
            .collect();
        std::fs::write(dir.join("events").join(format!("w{i:06}.json")), body)?;
    }
    for i in 0..writers {
        write_job(
            dir,
            &format!("job{i}.sql"),
            table,
            &format!("'max_files_per_trigger' '1', 'shard' '{i}/{writers}'"),
        )?;
    }
    let start = Instant::now();
    let reports: Vec<RunReport> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..writers)
            .map(|i| s.spawn(move || run_job(dir, &format!("job{i}.sql"), &format!("ckpt{i}"))))
            .collect();
        runs.into_iter()
            .map(|r| r.join().expect("writer thread"))
            .collect::<anyhow::Result<_>>()
    })?;
    let wall = start.elapsed();
    let progress: Vec<&serde_json::Value> = reports.iter().flat_map(|r| &r.progress).collect();
    // The shards cover every file once: as many batches as files, each
    // with its 10 rows.
    let rows: u64 = progress
        .iter()
        .filter_map(|p| p["input_rows"].as_u64())
        .sum();
    if progress.len() as u64 != files || rows != files * 10 {
        bail!(
            "{writers} writers committed {} batches of {rows} rows, expected {files} of {}",
            progress.len(),
            files * 10
        );
    }
    let mut commit_ms: Vec<f64> = progress
        .iter()
        .filter_map(|p| p["durations"]["commit_ms"].as_f64())
        .collect();
    commit_ms.sort_by(f64::total_cmp);
    Ok(WritersCost {
        commits: progress.len() as u64,
        retries: progress
            .iter()
            .filter_map(|p| p["commit_retries"].as_u64())
            .sum(),
        commit_median_ms: percentile(&commit_ms, 0.5),
        wall,
    })
}

fn write_job(dir: &Path, name: &str, table: &str, options: &str) -> anyhow::Result<()> {
    let opts = if options.is_empty() {
        String::new()
    } else {
        format!("\nOPTIONS ({options})")
    };
    std::fs::write(
        dir.join(name),
        BACKFILL_JOB
            .replace("{OPTIONS}", &opts)
            .replace("{TABLE}", table),
    )?;
    Ok(())
}

/// Run every workload and print its figures.
pub(crate) fn bench(cfg: BenchConfig) -> anyhow::Result<()> {
    // Absolute: the workloads run it from their own directories.
    let exe = std::fs::canonicalize(&cfg.lakestream)
        .with_context(|| format!("the lakestream binary {}", cfg.lakestream.display()))?;
    let _ = LAKESTREAM.set(exe);
    let dir = &cfg.dir;
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("clear {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir)?;
    figure(
        "machine.cores",
        std::thread::available_parallelism()?.get(),
        "cores",
    );

    if cfg.wants("backfill") {
        // 1. backfill
        let input_bytes = generate_events(&dir.join("events"), cfg.rows, cfg.files)?;
        write_job(dir, "backfill.sql", "out/backfill", "")?;
        // Rounds of the backfill and its floor (partitioned by day as the
        // table is), alternated so that neither always runs second on a
        // machine whose speed drifts; medians of each.
        let mut runs: Vec<RunReport> = Vec::new();
        let mut floors: Vec<Floor> = Vec::new();
        let floor = || raw_limit_process(&dir.join("events"), &dir.join("raw"), true);
        for round in 0..cfg.repeat.max(1) {
            for made in ["ckpt/backfill", "out/backfill", "raw"] {
                if dir.join(made).exists() {
                    std::fs::remove_dir_all(dir.join(made))?;
                }
            }
            if round % 2 == 1 {
                floors.push(floor()?);
            }
            let r = run_job(dir, "backfill.sql", "ckpt/backfill")?;
            let input_rows = r.sum("input_rows");
            if input_rows != cfg.rows {
                bail!(
                    "the backfill's round {round} read {input_rows} rows, expected {}",
                    cfg.rows
                );
            }
            runs.push(r);
            if round % 2 == 0 {
                floors.push(floor()?);
            }
        }
        let rounds: Vec<String> = runs
            .iter()
            .zip(&floors)
            .map(|(r, f)| format!("{:.2}", f.wall / r.wall.as_secs_f64()))
            .collect();
        let round_walls = |walls: &mut dyn Iterator<Item = f64>| {
            walls
                .map(|w| format!("{w:.3}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let engine_walls = round_walls(&mut runs.iter().map(|r| r.wall.as_secs_f64()));
        let floor_walls = round_walls(&mut floors.iter().map(|f| f.wall));
        runs.sort_by_key(|r| r.wall);
        let r = runs.swap_remove(runs.len() / 2);
        floors.sort_by(|a, b| a.wall.total_cmp(&b.wall));
        let Floor {
            wall: raw_secs,
            cpu: raw_cpu,
            peak_rss: raw_rss,
        } = floors[floors.len() / 2];
        let secs = r.wall.as_secs_f64();
        let out_files = r.sum("output_files");
        let out_bytes = r.sum("output_bytes");
        figure("backfill.rows", cfg.rows, "rows");
        figure(
            "backfill.input",
            format!("{:.1}", input_bytes as f64 / 1e6),
            "MB",
        );
        figure(
            "backfill.wall",
            format!("{secs:.3}"),
            "s (median of the rounds)",
        );
        figure("backfill.wall_rounds", engine_walls, "s");
        figure(
            "backfill.throughput",
            format!("{:.0}", cfg.rows as f64 / secs),
            "rows/s",
        );
        figure(
            "backfill.input_rate",
            format!("{:.1}", input_bytes as f64 / 1e6 / secs),
            "MB/s",
        );
        figure("backfill.cpu", format!("{:.2}", r.cpu_seconds), "cpu-s");
        figure("backfill.batches", r.progress.len(), "batches");
        figure("backfill.output_files", out_files, "files");
        figure(
            "backfill.output",
            format!("{:.1}", out_bytes as f64 / 1e6),
            "MB",
        );
        figure(
            "backfill.peak_rss",
            format!("{:.1}", r.peak_rss as f64 / (1 << 20) as f64),
            "MiB",
        );

        // 2. raw limit on the same files (run in the rounds above)
        let flat_secs = raw_limit_process(&dir.join("events"), &dir.join("raw-flat"), false)?.wall;
        figure(
            "raw.wall",
            format!("{raw_secs:.3}"),
            "s (median of the rounds)",
        );
        figure("raw.wall_rounds", floor_walls, "s");
        figure(
            "raw.throughput",
            format!("{:.0}", cfg.rows as f64 / raw_secs),
            "rows/s",
        );
        figure("raw.cpu", format!("{raw_cpu:.2}"), "cpu-s");
        figure(
            "raw.peak_rss",
            format!("{:.1}", raw_rss as f64 / (1 << 20) as f64),
            "MiB",
        );
        figure(
            "ratio.backfill_over_raw",
            format!("{:.2}", raw_secs / secs),
            format!(
                "x (medians of {} alternated rounds; the floor writes one file per day per \
                 thread, as the table)",
                rounds.len()
            )
            .as_str(),
        );
        figure(
            "ratio.backfill_over_raw_rounds",
            rounds.join(" "),
            "x (each round's own ratio)",
        );
        // The earlier floor: one unpartitioned file per input file.
        figure("raw_flat.wall", format!("{flat_secs:.3}"), "s");
        figure(
            "ratio.backfill_over_raw_flat",
            format!("{:.2}", flat_secs / secs),
            "x",
        );

        // 2b. a windowed aggregation over the same input
        std::fs::write(dir.join("windowed.sql"), WINDOWED_JOB)?;
        let w = run_job(dir, "windowed.sql", "ckpt/windowed")?;
        let w_secs = w.wall.as_secs_f64();
        let w_input = w.sum("input_rows");
        if w_input != cfg.rows {
            bail!(
                "the windowed run read {w_input} rows, expected {}",
                cfg.rows
            );
        }
        let groups = w.sum("output_rows");
        figure("windowed.wall", format!("{w_secs:.3}"), "s");
        figure(
            "windowed.throughput",
            format!("{:.0}", cfg.rows as f64 / w_secs),
            "rows/s",
        );
        figure("windowed.cpu", format!("{:.2}", w.cpu_seconds), "cpu-s");
        figure("windowed.batches", w.progress.len(), "batches");
        figure("windowed.groups_written", groups, "rows");
        figure(
            "windowed.peak_rss",
            format!("{:.1}", w.peak_rss as f64 / (1 << 20) as f64),
            "MiB",
        );
        figure(
            "ratio.windowed_over_backfill",
            format!("{:.2}", secs / w_secs),
            "x",
        );

        // 2c. the same two queries in Spark Structured Streaming
        if let Some(python) = &cfg.spark_python {
            let ours = spark::Ours {
                backfill: spark::Run {
                    wall: secs,
                    cpu: r.cpu_seconds,
                    rows_written: r
                        .progress
                        .iter()
                        .filter_map(|p| p["output_rows"].as_u64())
                        .sum(),
                },
                windowed: spark::Run {
                    wall: w_secs,
                    cpu: w.cpu_seconds,
                    rows_written: groups,
                },
            };
            spark::compare(python, dir, cfg.rows, &ours)?;
        }
    }

    // 2a. decoding the same files: the file source against DataFusion's
    // JSON datasource
    if cfg.wants("decode") {
        let events = dir.join("events");
        if !events.exists() {
            generate_events(&events, cfg.rows, cfg.files)?;
        }
        decode::decode(&events, cfg.rows, if cfg.smoke { 1 } else { 3 })?;
    }

    // 2b. Avro against JSON on the same records: Kafka values record by
    // record, and files through the file source.
    if cfg.wants("avro") {
        avro::avro(dir, cfg.rows, cfg.files, if cfg.smoke { 1 } else { 3 })?;
    }

    if cfg.wants("state") {
        // 2c. tiny batches against a large and a small state, each opened
        // by ten batches of a tenth of the rows (as a stream with a cap per
        // trigger opens them), and again by one batch of all of them.
        let small = (cfg.state_groups / 100).max(1);
        // Both runs read the same rows, so they differ in their groups only.
        let first = cfg.state_groups;
        let runs = if cfg.smoke { 1 } else { 3 };
        let cost = |name: &str, groups: u64, opening: u64, tiny: u64| {
            state_cost(&dir.join(name), groups, first, opening, tiny, runs)
        };
        let small_ms = cost("state-small", small, 10, 30)?;
        let large_ms = cost("state-large", cfg.state_groups, 10, 30)?;
        let small_one = cost("state-small-one", small, 1, 10)?;
        let large_one = cost("state-large-one", cfg.state_groups, 1, 10)?;
        figure("state.small_groups", small, "groups");
        figure(
            "state.small_median",
            format!("{:.2}", small_ms.median),
            "ms",
        );
        figure("state.small_p90", format!("{:.2}", small_ms.p90), "ms");
        figure("state.large_groups", cfg.state_groups, "groups");
        figure(
            "state.large_median",
            format!("{:.2}", large_ms.median),
            "ms",
        );
        figure("state.large_p90", format!("{:.2}", large_ms.p90), "ms");
        figure("state.large_max", format!("{:.2}", large_ms.max), "ms");
        let mib = |b: u64| format!("{:.1}", b as f64 / (1 << 20) as f64);
        figure("state.large_bytes", mib(large_ms.bytes), "MiB");
        figure("state.large_memory", mib(large_ms.memory), "MiB");
        figure("state.large_arrow_bytes", mib(large_ms.arrow_bytes), "MiB");
        figure("state.small_peak_rss", mib(small_ms.peak_rss), "MiB");
        figure("state.large_peak_rss", mib(large_ms.peak_rss), "MiB");
        figure(
            "state.small_one_batch_peak_rss",
            mib(small_one.peak_rss),
            "MiB",
        );
        figure(
            "state.large_one_batch_peak_rss",
            mib(large_one.peak_rss),
            "MiB",
        );
        figure(
            "ratio.state_large_over_small",
            format!("{:.2}", large_ms.median / small_ms.median),
            "x",
        );
        // The memory the large state costs beyond the small run (the same job
        // over as many input rows, into 1% of the groups), per byte of the
        // groups' Arrow size.
        let over_arrow = |large: &StateCost, small: &StateCost| {
            format!(
                "{:.2}",
                large.peak_rss.saturating_sub(small.peak_rss) as f64
                    / large.arrow_bytes.max(1) as f64
            )
        };
        figure(
            "ratio.state_rss_over_arrow",
            over_arrow(&large_ms, &small_ms),
            "x",
        );
        // The same when one batch opens every group: that batch's own
        // aggregation of a million groups is in the peak.
        figure(
            "ratio.state_rss_over_arrow_one_batch",
            over_arrow(&large_one, &small_one),
            "x",
        );
        // Against the baseline the target names: the stateless job over the
        // same input in the same batches (the small run's batches are a
        // hundredth of the size, so the figures above also count what a
        // large batch holds).
        let stateless = stateless_peak(&dir.join("state-large"), runs)?;
        let stateless_one = stateless_peak(&dir.join("state-large-one"), runs)?;
        figure("state.stateless_peak_rss", mib(stateless), "MiB");
        figure(
            "state.stateless_one_batch_peak_rss",
            mib(stateless_one),
            "MiB",
        );
        let over_stateless = |large: &StateCost, base: u64| {
            format!(
                "{:.2}",
                large.peak_rss.saturating_sub(base) as f64 / large.arrow_bytes.max(1) as f64
            )
        };
        figure(
            "ratio.state_rss_over_arrow_beyond_stateless",
            over_stateless(&large_ms, stateless),
            "x",
        );
        figure(
            "ratio.state_rss_over_arrow_one_batch_beyond_stateless",
            over_stateless(&large_one, stateless_one),
            "x",
        );
    }

    if cfg.wants("update") {
        // 2d. update mode: 100 changed groups a batch merged into a table of a
        // tenth of the large state's groups, and of all of them, both written
        // as files of a twentieth of the large one's users (2 and 20 files):
        // keys spread over the table, then 100 neighbouring keys.
        let small_rows = (cfg.state_groups / 10).max(1);
        let chunk = (cfg.state_groups / 20).max(100);
        figure("update.small_rows", small_rows, "rows");
        figure("update.large_rows", cfg.state_groups, "rows");
        for (name, local) in [("update", false), ("update_local", true)] {
            let small = update_cost(
                &dir.join(format!("{name}-small")),
                small_rows,
                chunk,
                10,
                local,
            )?;
            let large = update_cost(
                &dir.join(format!("{name}-large")),
                cfg.state_groups,
                chunk,
                10,
                local,
            )?;
            for (size, c) in [("small", &small), ("large", &large)] {
                figure(
                    &format!("{name}.{size}_median"),
                    format!("{:.2}", c.median_ms),
                    "ms",
                );
                figure(
                    &format!("{name}.{size}_rows_rewritten"),
                    format!("{:.0}", c.rows_rewritten),
                    "rows",
                );
                figure(&format!("{name}.{size}_files"), c.files, "files");
            }
            figure(
                &format!("ratio.{name}_large_over_small"),
                format!("{:.2}", large.median_ms / small.median_ms),
                "x",
            );
        }
    }

    if cfg.wants("tiny") {
        // 3. many tiny batches
        let tiny = dir.join("tiny");
        std::fs::create_dir_all(tiny.join("events"))?;
        for i in 0..cfg.tiny_batches {
            let body: String = (0..10)
            .map(|j| {
                format!(
                    "{{\"event_id\":\"t{i}-{j}\",\"user_id\":{j},\"event_type\":\"view\",\"amount\":{}.5,\"ts\":\"2026-01-01T00:00:00Z\"}}\n",
                    j + 1
                )
            })
            .collect();
            std::fs::write(tiny.join("events").join(format!("t{i:06}.json")), body)?;
        }
        write_job(&tiny, "tiny.sql", "out", "'max_files_per_trigger' '1'")?;
        // With metrics served, as an operated query runs: their cost is part
        // of the overhead.
        let r = run_job_with(
            &tiny,
            "tiny.sql",
            "ckpt",
            &["--metrics-addr", "127.0.0.1:0"],
        )?;
        let mut totals: Vec<f64> = r
            .progress
            .iter()
            .filter_map(|p| p["durations"]["total_ms"].as_f64())
            .collect();
        totals.sort_by(f64::total_cmp);
        figure("overhead.batches", totals.len(), "batches");
        // Everything between batches too (progress kept in the checkpoint,
        // snapshots, reporting), and the process's start spread over them.
        figure(
            "overhead.wall_per_batch",
            format!(
                "{:.2}",
                r.wall.as_secs_f64() * 1000.0 / totals.len().max(1) as f64
            ),
            "ms",
        );
        figure(
            "overhead.median",
            format!("{:.2}", percentile(&totals, 0.5)),
            "ms",
        );
        figure(
            "overhead.p99",
            format!("{:.2}", percentile(&totals, 0.99)),
            "ms",
        );
        for key in ["plan_ms", "write_ahead_ms", "execute_ms", "commit_ms"] {
            figure(
                &format!("overhead.{}", key.trim_end_matches("_ms")),
                format!("{:.2}", median_of(&r.progress, key)),
                "ms",
            );
        }
    }

    if cfg.wants("writers") {
        // 3b. several writers, one table: shards of the tiny files, each its
        // own process and checkpoint, committing into one table at once.
        let files = (cfg.tiny_batches * 2 / 3).max(4);
        let mut stores = vec![("writers".to_string(), None)];
        if let Some(prefix) = &cfg.object_store_prefix {
            let run = format!(
                "{}/run-{}",
                prefix.trim_end_matches('/'),
                std::process::id()
            );
            stores.push(("writers_remote".to_string(), Some(run)));
        }
        for (key, prefix) in &stores {
            for writers in [1u64, 2, 4, 8] {
                let table = match prefix {
                    Some(p) => format!("{p}/writers-{writers}"),
                    None => "out".to_string(),
                };
                let work = dir.join(format!("{key}-{writers}"));
                let w = writers_cost(&work, files, writers, &table)?;
                figure(
                    &format!("{key}.{writers}.commits_per_s"),
                    format!("{:.1}", w.commits as f64 / w.wall.as_secs_f64()),
                    "commits/s",
                );
                figure(
                    &format!("{key}.{writers}.retried"),
                    format!("{:.1}", 100.0 * w.retries as f64 / w.commits.max(1) as f64),
                    "% of commits",
                );
                figure(
                    &format!("{key}.{writers}.commit_median"),
                    format!("{:.2}", w.commit_median_ms),
                    "ms",
                );
            }
        }
    }

    if cfg.wants("history") {
        // 4. long history: commit time early and late in a table's life
        let hist = dir.join("history");
        std::fs::create_dir_all(&hist)?;
        std::fs::write(
            hist.join("history.sql"),
            format!(
                "CREATE UNBOUNDED EXTERNAL TABLE events STORED AS GENERATOR LOCATION 'generator'
             OPTIONS ('rows' '{}', 'max_rows_per_trigger' '10');
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';
             INSERT INTO out SELECT event_id, amount FROM events;",
                cfg.history * 10
            ),
        )?;
        let r = run_job(&hist, "history.sql", "ckpt")?;
        let window = (cfg.history / 10).clamp(3, 50) as usize;
        let commits: Vec<f64> = r
            .progress
            .iter()
            .filter_map(|p| p["durations"]["commit_ms"].as_f64())
            .collect();
        let median_window = |from: usize| {
            let mut w: Vec<f64> = commits.iter().skip(from).take(window).copied().collect();
            w.sort_by(f64::total_cmp);
            percentile(&w, 0.5)
        };
        let early = median_window(5);
        let late = median_window(commits.len().saturating_sub(window));
        figure("history.versions", commits.len(), "versions");
        figure("history.commit_early", format!("{early:.2}"), "ms");
        figure("history.commit_late", format!("{late:.2}"), "ms");
        figure(
            "ratio.history_late_over_early",
            format!("{:.2}", late / early),
            "x",
        );

        // A restart's cost must not grow with the query's age: the checkpoint
        // keeps the newest batches and snapshots, not every batch ever run.
        // Median of three restarts that find nothing new, after 50 batches and
        // after the long history.
        let restart_median = |dir: &Path| -> anyhow::Result<f64> {
            let mut walls = Vec::new();
            for _ in 0..3 {
                walls.push(run_job(dir, "history.sql", "ckpt")?.wall.as_secs_f64() * 1000.0);
            }
            walls.sort_by(f64::total_cmp);
            Ok(percentile(&walls, 0.5))
        };
        let short = dir.join("history-50");
        std::fs::create_dir_all(&short)?;
        std::fs::write(
            short.join("history.sql"),
            std::fs::read_to_string(hist.join("history.sql"))?
                .replace(&format!("'rows' '{}'", cfg.history * 10), "'rows' '500'"),
        )?;
        run_job(&short, "history.sql", "ckpt")?;
        let restart_short = restart_median(&short)?;
        let restart_long = restart_median(&hist)?;
        let kept = std::fs::read_dir(hist.join("ckpt/offsets"))?.count();
        figure("history.restart_at_50", format!("{restart_short:.1}"), "ms");
        figure(
            &format!("history.restart_at_{}", commits.len()),
            format!("{restart_long:.1}"),
            "ms",
        );
        figure("history.offsets_files_kept", kept, "files");
        figure(
            "ratio.restart_long_over_short",
            format!("{:.2}", restart_long / restart_short),
            "x",
        );
    }

    let broker = match (&cfg.kafka_bootstrap, cfg.kafka_mock) {
        (Some(b), false) => Some(broker::Broker::external(b)),
        (None, true) => Some(broker::Broker::mock()?),
        (Some(_), true) => bail!("--kafka-bootstrap and --kafka-mock name two brokers: give one"),
        (None, false) => None,
    };
    if let Some(b) = &broker {
        figure("kafka.broker", b.kind(), "");
        figure(
            "kafka.producer_linger",
            b.linger_ms(),
            "ms (the workloads' producers' linger.ms)",
        );
    }

    // 5. start-up: a one-batch job from exec to exit
    if cfg.wants("startup") {
        let runs = if cfg.smoke { 3 } else { 9 };
        latency::startup(
            dir,
            broker.as_ref(),
            cfg.object_store_prefix.as_deref(),
            runs,
        )?;
    }

    // 6. kafka: throughput, then the latency of records produced at a
    // steady rate
    match &broker {
        Some(broker) => {
            if cfg.wants("kafka") {
                kafka_bench(dir, broker, cfg.kafka_messages, !cfg.smoke)?;
            }
            if cfg.wants("latency") {
                latency::kafka_latency(
                    dir,
                    broker,
                    &cfg.latency_rates,
                    cfg.latency_seconds,
                    cfg.object_store_prefix.as_deref(),
                )?;
            }
        }
        None => figure("kafka.skipped", 1, "(no --kafka-bootstrap or --kafka-mock)"),
    }
    Ok(())
}

/// `lakestream-bench bench-floor`: the raw floor over `input`, in this
/// process (the parent times it from spawn to exit and reads its CPU time
/// and peak RSS when it ends).
pub(crate) fn floor_process(input: &Path, out: &Path, partitioned: bool) -> anyhow::Result<()> {
    raw_limit(input, out, partitioned)
}

/// What one run of the raw floor took.
#[derive(Clone, Copy)]
struct Floor {
    /// Spawn to exit (s).
    wall: f64,
    /// The process's CPU seconds.
    cpu: f64,
    /// Its peak RSS (bytes).
    peak_rss: u64,
}

/// The raw floor over `input` in a child process (`lakestream-bench
/// bench-floor`), as the backfill runs: a fresh process, timed from spawn
/// to exit.
fn raw_limit_process(input: &Path, out: &Path, partitioned: bool) -> anyhow::Result<Floor> {
    let start = Instant::now();
    let mut child = Command::new(std::env::current_exe()?)
        .arg("bench-floor")
        .arg(input)
        .arg(out)
        .args((!partitioned).then_some("--flat"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let err = read_all(child.stderr.take().expect("piped"));
    let m = wait_measured(&mut child)?;
    let wall = start.elapsed().as_secs_f64();
    let err = err.join().expect("stderr thread");
    if !m.status.success() {
        bail!(
            "the raw floor's process failed: {}",
            String::from_utf8_lossy(&err)
        );
    }
    Ok(Floor {
        wall,
        cpu: m.cpu_seconds,
        peak_rss: m.peak_rss,
    })
}

/// Decode the JSON files with arrow-json, filter, add the day column and
/// write snappy Parquet with the same writer settings, on 2 threads: no
/// checkpoint, no Delta, no DataFusion.
///
/// `partitioned`: as the backfill's table, each thread writes one file per
/// day instead of one per input file. A day's file stays open across input
/// files and is closed once the input has moved past that day (the bench's
/// input is in time order), so the floor holds a few days' row groups in
/// memory rather than the whole output.
fn raw_limit(input: &Path, out: &Path, partitioned: bool) -> anyhow::Result<()> {
    std::fs::create_dir_all(out)?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(input)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.sort();
    let schema = Arc::new(Schema::new(vec![
        Field::new("event_id", DataType::Utf8, false),
        Field::new("user_id", DataType::Int64, true),
        Field::new("event_type", DataType::Utf8, true),
        Field::new("amount", DataType::Float64, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Nanosecond, None), true),
    ]));
    let threads = std::thread::available_parallelism()?.get().min(2);
    std::thread::scope(|s| -> anyhow::Result<()> {
        let mut handles = Vec::new();
        for t in 0..threads {
            let mine: Vec<PathBuf> = files.iter().skip(t).step_by(threads).cloned().collect();
            let schema = schema.clone();
            handles.push(s.spawn(move || -> anyhow::Result<()> {
                let mut sink = RawSink::new(out, t, partitioned);
                for f in mine {
                    raw_one(&f, &mut sink, schema.clone())?;
                }
                sink.close()
            }));
        }
        for h in handles {
            h.join().expect("raw thread")?;
        }
        Ok(())
    })
}

/// Where the raw loop writes: one file per input file, or one per day.
struct RawSink<'a> {
    out: &'a Path,
    thread: usize,
    partitioned: bool,
    /// The open writers: per day (partitioned), or the current file's.
    writers: std::collections::HashMap<i32, parquet::arrow::ArrowWriter<std::fs::File>>,
    /// Files closed so far per day (partitioned): a day seen again after
    /// its file was closed gets a new file.
    closed: std::collections::HashMap<i32, usize>,
    /// The `fsync`s of closed files, each on a thread of its own (the
    /// engine's data files are synced in the background too).
    syncs: Vec<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl<'a> RawSink<'a> {
    fn new(out: &'a Path, thread: usize, partitioned: bool) -> Self {
        Self {
            out,
            thread,
            partitioned,
            writers: Default::default(),
            closed: Default::default(),
            syncs: Vec::new(),
        }
    }

    fn props() -> parquet::file::properties::WriterProperties {
        parquet::file::properties::WriterProperties::builder()
            .set_compression(parquet::basic::Compression::SNAPPY)
            .build()
    }

    /// Start input `name` (a file per input when not partitioned).
    fn begin(&mut self, name: &std::ffi::OsStr, schema: &Arc<Schema>) -> anyhow::Result<()> {
        if !self.partitioned {
            self.close_all()?;
            let w = parquet::arrow::ArrowWriter::try_new(
                std::fs::File::create(self.out.join(name).with_extension("parquet"))?,
                schema.clone(),
                Some(Self::props()),
            )?;
            self.writers.insert(0, w);
        }
        Ok(())
    }

    /// Write `batch`, whose last column is the day. Partitioned, the day
    /// is in the file's path and not written into it, as in the table.
    fn write(&mut self, batch: &RecordBatch) -> anyhow::Result<()> {
        if !self.partitioned {
            self.writers.get_mut(&0).expect("begun").write(batch)?;
            return Ok(());
        }
        let day = batch.column(batch.num_columns() - 1);
        let data = batch.project(&(0..batch.num_columns() - 1).collect::<Vec<_>>())?;
        let runs = arrow::compute::partition(std::slice::from_ref(day))?;
        let days = day.as_primitive::<arrow::datatypes::Date32Type>();
        for r in runs.ranges() {
            let d = days.value(r.start);
            let w = match self.writers.entry(d) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let dir = self.out.join(format!("day={d}"));
                    std::fs::create_dir_all(&dir)?;
                    let n = self.closed.get(&d).copied().unwrap_or(0);
                    e.insert(parquet::arrow::ArrowWriter::try_new(
                        std::fs::File::create(
                            dir.join(format!("part-{}-{n}.parquet", self.thread)),
                        )?,
                        data.schema(),
                        Some(Self::props()),
                    )?)
                }
            };
            w.write(&data.slice(r.start, r.end - r.start))?;
        }
        // Days before this batch's first one are done when the input is in
        // time order (the bench's is): their files are closed now, so the
        // floor holds a few days' row groups, not the whole output.
        if let Some(first) = runs.ranges().first().map(|r| days.value(r.start)) {
            let done: Vec<i32> = self
                .writers
                .keys()
                .copied()
                .filter(|d| *d < first)
                .collect();
            for d in done {
                if let Some(w) = self.writers.remove(&d) {
                    self.finish(w)?;
                    *self.closed.entry(d).or_default() += 1;
                }
            }
        }
        Ok(())
    }

    /// Close `w`'s file and start its `fsync`.
    fn finish(&mut self, w: parquet::arrow::ArrowWriter<std::fs::File>) -> anyhow::Result<()> {
        let file = w.into_inner()?;
        self.syncs.push(std::thread::spawn(move || file.sync_all()));
        Ok(())
    }

    fn close_all(&mut self) -> anyhow::Result<()> {
        let open: Vec<_> = self.writers.drain().map(|(_, w)| w).collect();
        for w in open {
            self.finish(w)?;
        }
        Ok(())
    }

    /// Close every file and wait until all are on disk.
    fn close(mut self) -> anyhow::Result<()> {
        self.close_all()?;
        for s in self.syncs.drain(..) {
            s.join().expect("sync thread")?;
        }
        Ok(())
    }
}

fn raw_one(file: &Path, sink: &mut RawSink<'_>, schema: Arc<Schema>) -> anyhow::Result<()> {
    let reader = arrow::json::ReaderBuilder::new(schema)
        .with_batch_size(8192)
        .build(BufReader::with_capacity(
            1 << 20,
            std::fs::File::open(file)?,
        ))?;
    let out_schema = Arc::new(Schema::new(vec![
        Field::new("event_id", DataType::Utf8, true),
        Field::new("user_id", DataType::Int64, true),
        Field::new("event_type", DataType::Utf8, true),
        Field::new("amount", DataType::Float64, true),
        Field::new(
            "ts",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            true,
        ),
        Field::new("day", DataType::Date32, true),
    ]));
    sink.begin(file.file_name().expect("file name"), &out_schema)?;
    for batch in reader {
        let batch = batch?;
        let amount = batch
            .column(3)
            .as_primitive::<arrow::datatypes::Float64Type>();
        let keep =
            arrow::compute::kernels::cmp::gt(amount, &arrow::array::Float64Array::new_scalar(0.0))?;
        let batch = arrow::compute::filter_record_batch(&batch, &keep)?;
        // The naive time is UTC: the unit is cast and the zone set, as the
        // sink does (arrow's cast to a zone converts every value).
        let ts = arrow::compute::cast(
            batch.column(4),
            &DataType::Timestamp(TimeUnit::Microsecond, None),
        )?;
        let ts = arrow::array::make_array(
            ts.to_data()
                .into_builder()
                .data_type(out_schema.field(4).data_type().clone())
                .build()?,
        );
        let day = arrow::compute::cast(batch.column(4), &DataType::Date32)?;
        let mut cols = batch.columns()[..4].to_vec();
        cols.push(ts);
        cols.push(day);
        sink.write(&RecordBatch::try_new(out_schema.clone(), cols)?)?;
    }
    Ok(())
}

/// Create `topic` with `partitions` on the broker at `bootstrap`.
fn create_topic(bootstrap: &str, topic: &str, partitions: i32) -> anyhow::Result<()> {
    use rdkafka::ClientConfig;
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;

    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()?;
    tokio::runtime::Runtime::new()?.block_on(admin.create_topics(
        &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
        &AdminOptions::new(),
    ))?;
    Ok(())
}

/// The Kafka workloads; `group`: also group mode with one and two
/// processes.
fn kafka_bench(
    dir: &Path,
    broker: &broker::Broker,
    messages: u64,
    group: bool,
) -> anyhow::Result<()> {
    use rdkafka::ClientConfig;
    use rdkafka::Message;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

    let bootstrap = broker.bootstrap();
    let messages = match broker.max_backlog(4) {
        Some(max) if messages > max => {
            figure(
                "kafka.messages_capped",
                max,
                "messages (the mock broker keeps about 5 MB a partition)",
            );
            max
        }
        _ => messages,
    };
    let topic = format!("bench-{}", std::process::id());
    broker.create_topic(&topic, 4)?;
    let producer: BaseProducer = broker.producer_config().create()?;
    let start = Instant::now();
    for i in 0..messages {
        let value = format!(
            "{{\"order_id\":\"o{i:010}\",\"customer_id\":{},\"amount\":{}.25,\"ts\":\"2026-02-01T00:00:00Z\"}}",
            i % 9973,
            i % 500
        );
        loop {
            match producer.send(
                BaseRecord::<(), String>::to(&topic)
                    .payload(&value)
                    .partition((i % 4) as i32),
            ) {
                Ok(()) => break,
                Err((e, _))
                    if e.rdkafka_error_code()
                        == Some(rdkafka::types::RDKafkaErrorCode::QueueFull) =>
                {
                    producer.poll(Duration::from_millis(10));
                }
                Err((e, _)) => bail!("produce: {e}"),
            }
        }
    }
    producer.flush(Duration::from_secs(300))?;
    figure("kafka.messages", messages, "messages");
    figure(
        "kafka.produce_rate",
        format!("{:.0}", messages as f64 / start.elapsed().as_secs_f64()),
        "msg/s",
    );

    // Raw: consume every partition from offset 0 and decode into Arrow.
    let schema = Arc::new(Schema::new(vec![
        Field::new("order_id", DataType::Utf8, false),
        Field::new("customer_id", DataType::Int64, true),
        Field::new("amount", DataType::Float64, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Nanosecond, None), true),
    ]));
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", "lakestream-bench")
        .set("enable.auto.commit", "false")
        .create()?;
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..4 {
        tpl.add_partition_offset(&topic, p, rdkafka::Offset::Beginning)?;
    }
    consumer.assign(&tpl)?;
    let mut decoder = arrow::json::ReaderBuilder::new(schema)
        .with_batch_size(8192)
        .build_decoder()?;
    let start = Instant::now();
    let mut got = 0u64;
    let mut rows = 0usize;
    while got < messages {
        if start.elapsed() > Duration::from_secs(600) {
            bail!("raw consume stalled at {got} of {messages}");
        }
        // Transient poll errors are retried like the engine does.
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) {
            if decoder.len() >= 8192 {
                rows += decoder.flush()?.map(|b| b.num_rows()).unwrap_or(0);
            }
            decoder.decode(m.payload().unwrap_or(b"{}"))?;
            decoder.decode(b"\n")?;
            got += 1;
        }
    }
    rows += decoder.flush()?.map(|b| b.num_rows()).unwrap_or(0);
    let raw = start.elapsed().as_secs_f64();
    if rows as u64 != messages {
        bail!("raw decode produced {rows} rows of {messages}");
    }
    figure(
        "kafka.raw_rate",
        format!("{:.0}", messages as f64 / raw),
        "msg/s",
    );

    std::fs::write(
        dir.join("kafka.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE orders (
               order_id VARCHAR NOT NULL, customer_id BIGINT, amount DOUBLE, ts TIMESTAMP
             ) STORED AS KAFKA LOCATION 'kafka://{bootstrap}/{topic}';
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out/kafka';
             INSERT INTO out SELECT order_id, customer_id, amount, ts FROM orders;"
        ),
    )?;
    let r = run_job(dir, "kafka.sql", "ckpt/kafka")?;
    let n = r.sum("input_rows");
    if n != messages {
        bail!("the kafka job read {n} of {messages} messages");
    }
    // The engine's rate over `secs`, and against the raw loop.
    let rate = |name: &str, ratio: &str, unit: &str, secs: f64| {
        figure(name, format!("{:.0}", messages as f64 / secs), unit);
        figure(ratio, format!("{:.2}", raw / secs), "x");
    };
    rate(
        "kafka.engine_rate",
        "ratio.kafka_engine_over_raw",
        "msg/s",
        r.wall.as_secs_f64(),
    );
    // The same without the process's start-up (connecting, metadata, the
    // topic's id): what the batches alone took.
    let in_batches: f64 = r
        .progress
        .iter()
        .filter_map(|p| p["durations"]["total_ms"].as_f64())
        .sum::<f64>()
        / 1000.0;
    if in_batches > 0.0 {
        rate(
            "kafka.engine_batch_rate",
            "ratio.kafka_batches_over_raw",
            "msg/s (inside batches: start-up excluded)",
            in_batches,
        );
    }

    // Group mode: one, then two processes of one job share the topic.
    // Not in smoke runs: a test broker's group coordinator may stall
    // while members join (tansu's does), and a smoke run must not hang.
    if !group {
        figure("kafka.group.skipped", 1, "(smoke run)");
        return Ok(());
    }
    for processes in [1usize, 2] {
        let g = group_cost(dir, bootstrap, &topic, messages, processes)?;
        let key = format!("kafka.group.{processes}");
        figure(
            &format!("{key}.rate"),
            format!("{:.0}", messages as f64 / g.busy.as_secs_f64()),
            "msg/s (first batch to last)",
        );
        figure(
            &format!("{key}.start"),
            format!("{:.0}", g.join.as_secs_f64() * 1000.0),
            "ms (spawn to first batch)",
        );
        figure(&format!("{key}.batches"), g.batches, "batches");
        figure(
            &format!("{key}.superseded"),
            format!(
                "{:.1}",
                100.0 * g.superseded as f64 / g.batches.max(1) as f64
            ),
            "% of batches",
        );
        figure(
            &format!("{key}.retried"),
            format!("{:.1}", 100.0 * g.retries as f64 / g.batches.max(1) as f64),
            "% of commits",
        );
    }
    Ok(())
}

/// What [`group_cost`] measured.
struct GroupCost {
    /// From spawning the processes to the first batch's start.
    join: Duration,
    /// From the first batch's start to the table holding every message.
    busy: Duration,
    batches: u64,
    superseded: u64,
    retries: u64,
}

/// `processes` processes of one job in one new consumer group read
/// `topic` (holding `messages`) into one table, until their committed
/// batches hold every message; then they are stopped with SIGTERM.
fn group_cost(
    dir: &Path,
    bootstrap: &str,
    topic: &str,
    messages: u64,
    processes: usize,
) -> anyhow::Result<GroupCost> {
    let job = format!("group{processes}.sql");
    std::fs::write(
        dir.join(&job),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE orders (
               order_id VARCHAR NOT NULL, customer_id BIGINT, amount DOUBLE, ts TIMESTAMP
             ) STORED AS KAFKA LOCATION 'kafka://{bootstrap}/{topic}'
             OPTIONS ('group_id' 'bench-{processes}-{pid}', 'max_offsets_per_trigger' '20000',
                      'kafka.session.timeout.ms' '6000');
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out/group-{processes}';
             INSERT INTO out SELECT order_id, customer_id, amount, ts FROM orders;",
            pid = std::process::id()
        ),
    )?;
    let exe = lakestream();
    let start = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel::<serde_json::Value>();
    let mut children = Vec::new();
    for i in 0..processes {
        let mut child = Command::new(exe)
            .current_dir(dir)
            .args([
                "run",
                &job,
                "--checkpoint",
                &format!("ckpt/group-{processes}-{i}"),
                "--trigger",
                "100ms",
                "--progress-json",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let stdout = child.stdout.take().expect("piped");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        children.push(child);
    }
    let stop = |children: &mut Vec<std::process::Child>| {
        for c in children.iter_mut() {
            // SAFETY: kill(2) on a child of this process.
            unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
            let _ = c.wait();
        }
    };
    let deadline = start + Duration::from_secs(600);
    let (mut rows, mut batches, mut superseded, mut retries) = (0u64, 0u64, 0u64, 0u64);
    let mut first: Option<Instant> = None;
    while rows < messages {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(p) = rx.recv_timeout(left) else {
            stop(&mut children);
            bail!(
                "group mode with {processes} processes read {rows} of {messages} messages in 600 s"
            );
        };
        let took =
            Duration::from_secs_f64(p["durations"]["total_ms"].as_f64().unwrap_or(0.0) / 1000.0);
        first.get_or_insert(Instant::now() - took);
        batches += 1;
        retries += p["commit_retries"].as_u64().unwrap_or(0);
        if p.get("superseded").is_some_and(|s| !s.is_null()) {
            superseded += 1;
        } else if p["skipped"] != true {
            rows += p["input_rows"].as_u64().unwrap_or(0);
        }
    }
    let first = first.expect("a batch ran");
    let busy = first.elapsed();
    stop(&mut children);
    Ok(GroupCost {
        join: first.saturating_duration_since(start),
        busy,
        batches,
        superseded,
        retries,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_from_the_sorted_values() {
        let v = [1.0, 2.0, 3.0, 4.0, 100.0];
        assert_eq!(percentile(&v, 0.5), 3.0);
        assert_eq!(percentile(&v, 0.99), 100.0);
    }

    #[test]
    fn a_child_is_measured_from_outside() {
        // A child that touches 64 MiB and spins a little.
        let mut child = Command::new("python3")
            .args(["-c", "b = bytearray(64 << 20); sum(range(3_000_000))"])
            .spawn()
            .expect("python3");
        let m = wait_measured(&mut child).unwrap();
        assert!(m.status.success());
        assert!(m.cpu_seconds > 0.0);
        assert!(m.peak_rss > 64 << 20, "peak RSS {}", m.peak_rss);
    }
}
