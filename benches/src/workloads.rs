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
mod costs;
mod decode;
mod files;
mod floor;
mod kafka;
mod latency;
mod spark;

use costs::*;
use files::*;
pub(crate) use floor::floor_process;
use floor::*;
use kafka::*;

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
        backfill_workload(&cfg, dir)?;
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
        state_workload(&cfg, dir)?;
    }

    if cfg.wants("update") {
        update_workload(&cfg, dir)?;
    }

    if cfg.wants("tiny") {
        tiny_workload(&cfg, dir)?;
    }

    if cfg.wants("writers") {
        writers_workload(&cfg, dir)?;
    }

    if cfg.wants("history") {
        history_workload(&cfg, dir)?;
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
