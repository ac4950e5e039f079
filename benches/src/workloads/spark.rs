//! The backfill and windowed queries in Spark Structured Streaming, in the
//! same run as lakestream's (`lakestream-bench --spark-python PYTHON`):
//! the ratios the project's speed claims rest on, measured on this machine
//! and this input rather than quoted from another day.
//!
//! The script (`spark.py`, compiled in) runs both queries available-now on
//! `local[2]` over the bench's JSON events (the windowed one with 2 shuffle
//! partitions, tuned for the two cores, and again with Spark's default
//! 200: `windowed_default`) and reports the query's wall
//! time (the Spark session's start apart), the JVM's CPU seconds and peak
//! memory. Spark writes its own Parquet file sink, a lighter sink than a
//! Delta table, so the ratios understate lakestream's lead, if anything.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::figure;

/// The Spark side of the comparison, run by `python` from `bench_dir`.
const SCRIPT: &str = include_str!("spark.py");

/// How long the Spark run may take before the bench gives up on it.
const LIMIT: Duration = Duration::from_secs(1800);

/// lakestream's figures for one of the queries.
pub(super) struct Run {
    /// Wall seconds.
    pub(super) wall: f64,
    /// CPU seconds.
    pub(super) cpu: f64,
    /// Rows written to the table: Spark must write the same.
    pub(super) rows_written: u64,
}

/// lakestream's figures for the same queries.
pub(super) struct Ours {
    pub(super) backfill: Run,
    pub(super) windowed: Run,
}

/// Run the Spark script over `bench_dir/events` (`rows` events) and print
/// its figures and lakestream's ratios to them. Each Spark query must
/// write as many rows as lakestream's did.
pub(super) fn compare(
    python: &Path,
    bench_dir: &Path,
    rows: u64,
    ours: &Ours,
) -> anyhow::Result<()> {
    let script = bench_dir.join("spark.py");
    std::fs::write(&script, SCRIPT)?;
    let mut child = Command::new(python)
        .arg(&script)
        .arg(bench_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("start {} for the Spark comparison", python.display()))?;
    let stdout = child.stdout.take().expect("piped");
    let lines = std::thread::spawn(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(&l).ok())
            .collect::<Vec<_>>()
    });
    let stderr = child.stderr.take().expect("piped");
    let errors = std::thread::spawn(move || {
        let mut tail = std::collections::VecDeque::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tail.len() == 20 {
                tail.pop_front();
            }
            tail.push_back(line);
        }
        tail.into_iter().collect::<Vec<_>>().join("\n")
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if start.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "the Spark comparison took over {} s; stopped",
                LIMIT.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let figures = lines.join().expect("stdout reader");
    let errors = errors.join().expect("stderr reader");
    if !status.success() {
        bail!(
            "the Spark comparison failed ({status}; it needs pyspark in {} and a Java \
             runtime): {errors}",
            python.display()
        );
    }
    let get = |workload: &str| {
        figures
            .iter()
            .find(|f| f["workload"] == workload)
            .with_context(|| format!("the Spark run reported no {workload} figures: {errors}"))
    };
    figure(
        "spark.session_start",
        format!("{:.1}", get("start")?["wall"].as_f64().unwrap_or(0.0)),
        "s (not counted below)",
    );
    for (name, ours) in [
        ("backfill", &ours.backfill),
        ("windowed", &ours.windowed),
        ("windowed_default", &ours.windowed),
    ] {
        let s = get(name)?;
        let written = s["rows_written"].as_u64().unwrap_or(0);
        if written != ours.rows_written {
            bail!(
                "Spark's {name} wrote {written} rows, lakestream's {}: the two runs did not \
                 compute the same result",
                ours.rows_written
            );
        }
        let s_wall = s["wall"].as_f64().unwrap_or(f64::NAN);
        let s_cpu = s["cpu"].as_f64().unwrap_or(f64::NAN);
        figure(&format!("spark.{name}.wall"), format!("{s_wall:.3}"), "s");
        figure(
            &format!("spark.{name}.throughput"),
            format!("{:.0}", rows as f64 / s_wall),
            "rows/s",
        );
        figure(&format!("spark.{name}.cpu"), format!("{s_cpu:.2}"), "cpu-s");
        figure(
            &format!("spark.{name}.batches"),
            s["batches"].as_u64().unwrap_or(0),
            "batches",
        );
        figure(&format!("spark.{name}.rows_written"), written, "rows");
        figure(
            &format!("spark.{name}.peak_rss"),
            format!(
                "{:.1}",
                s["peak_rss"].as_f64().unwrap_or(0.0) / (1u64 << 20) as f64
            ),
            "MiB",
        );
        figure(
            &format!("ratio.{name}_over_spark"),
            format!("{:.1}", s_wall / ours.wall),
            "x (rows/s, same input, same run)",
        );
        figure(
            &format!("ratio.{name}_spark_cpu_over_ours"),
            format!("{:.1}", s_cpu / ours.cpu),
            "x (CPU seconds)",
        );
    }
    Ok(())
}
