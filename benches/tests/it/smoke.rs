//! `lakestream-bench --smoke`: every workload runs and prints its figures.

use lakestream_testkit::broker::Broker;
use lakestream_testkit::python;

use crate::{run_in, text};

#[test]
fn the_benchmark_prints_every_figure() {
    let broker = Broker::start();
    let tmp = tempfile::tempdir().unwrap();
    let o = run_in(
        tmp.path(),
        &[
            "--smoke",
            "--dir",
            "b",
            "--kafka-bootstrap",
            &broker.bootstrap(),
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    let figures: std::collections::BTreeMap<&str, f64> = out
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.split_once(": ")?;
            Some((name, rest.split_whitespace().next()?.parse().ok()?))
        })
        .collect();
    for name in [
        "backfill.rows",
        "backfill.throughput",
        "backfill.cpu",
        "backfill.peak_rss",
        "backfill.batches",
        "backfill.output_files",
        "raw.throughput",
        "raw.cpu",
        "raw.peak_rss",
        "ratio.backfill_over_raw",
        "windowed.throughput",
        "windowed.groups_written",
        "ratio.windowed_over_backfill",
        "decode.file_source",
        "decode.datafusion_json",
        "ratio.datafusion_json_over_file_source",
        "state.small_median",
        "state.large_median",
        "state.large_max",
        "state.large_bytes",
        "state.large_arrow_bytes",
        "state.large_peak_rss",
        "state.large_one_batch_peak_rss",
        "ratio.state_large_over_small",
        "update.small_median",
        "update.large_median",
        "ratio.update_large_over_small",
        "update_local.small_median",
        "update_local.large_median",
        "ratio.update_local_large_over_small",
        "overhead.median",
        "overhead.p99",
        "overhead.commit",
        "history.commit_early",
        "history.commit_late",
        "history.restart_at_50",
        "ratio.restart_long_over_short",
        "kafka.raw_rate",
        "kafka.engine_rate",
        "ratio.kafka_engine_over_raw",
        "writers.1.commits_per_s",
        "writers.8.commits_per_s",
        "writers.8.commit_median",
        "kafka.group.skipped",
        "startup.files",
        "startup.kafka",
        "latency.100.p50",
        "latency.100.p99",
        "latency.100.execute_median",
        "latency.100.commit_median",
        "latency.100.broker_ack_median",
    ] {
        let v = figures
            .get(name)
            .unwrap_or_else(|| panic!("no figure {name}:\n{out}"));
        assert!(v.is_finite() && *v > 0.0, "{name} = {v}\n{out}");
    }
    assert_eq!(figures["backfill.rows"], 20_000.0);
    assert_eq!(figures["overhead.batches"], 12.0);
    assert_eq!(figures["state.large_groups"], 20_000.0);
    // The checkpoint keeps the newest 100 batches at most, and 40 here.
    assert_eq!(figures["history.offsets_files_kept"], 40.0);
    // Update mode, 20,000 groups in 20 files: MERGE rewrites the files that
    // can hold the batch's keys. Keys spread over the table rewrite all of
    // it; 100 neighbouring keys, one or two files of 1,000 groups.
    assert_eq!(figures["update.large_files"], 20.0);
    assert_eq!(figures["update.large_rows_rewritten"], 20_000.0);
    assert!(
        figures["update_local.large_rows_rewritten"] <= 2_000.0,
        "{out}"
    );
    // One second at 100 records a second, each in the table once.
    assert_eq!(figures["latency.100.rows"], 100.0);
    // A broker named by address takes one record a request: no linger.
    assert_eq!(figures["kafka.producer_linger"], 0.0);
    // The latency query's log and its batches' progress are kept in the
    // bench directory, to see why a query fell behind.
    let kept: Vec<_> = std::fs::read_dir(tmp.path().join("b"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("latency-"))
        .collect();
    let log = kept
        .iter()
        .find(|p| p.extension().is_some_and(|e| e == "log"))
        .unwrap_or_else(|| panic!("no latency query log in {kept:?}"));
    let log = std::fs::read_to_string(log).unwrap();
    assert!(log.contains("started"), "{log}");
    let progress = kept
        .iter()
        .find(|p| p.to_string_lossy().ends_with(".progress.jsonl"))
        .unwrap_or_else(|| panic!("no latency progress in {kept:?}"));
    let batches = std::fs::read_to_string(progress)
        .unwrap()
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l).is_ok_and(|v| v["batch_id"].is_u64())
        })
        .count();
    // Every batch the figures counted (the warm-up batch among them).
    assert!(
        batches as f64 >= figures["latency.100.batches"],
        "{batches} progress lines for {} batches",
        figures["latency.100.batches"]
    );

    // --only runs the workloads it names and nothing else.
    let o = run_in(
        tmp.path(),
        &["--smoke", "--dir", "only", "--only", "startup"],
    );
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    assert!(out.contains("startup.files: "), "{out}");
    assert!(!out.contains("backfill."), "{out}");
    assert!(!out.contains("startup.kafka"), "{out}");
    let o = run_in(tmp.path(), &["--only", "backfil"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

/// The Spark comparison needs a Python with pyspark: one without it stops
/// the bench with an error that says so, after lakestream's own figures.
#[test]
fn a_spark_comparison_without_pyspark_says_what_it_needs() {
    let tmp = tempfile::tempdir().unwrap();
    let python = python();
    let o = run_in(
        tmp.path(),
        &[
            "--smoke",
            "--dir",
            "b",
            "--only",
            "backfill",
            "--spark-python",
            python.to_str().unwrap(),
        ],
    );
    assert!(!o.status.success(), "{}", text(&o));
    let out = text(&o);
    assert!(out.contains("windowed.throughput: "), "{out}");
    assert!(
        out.contains("the Spark comparison failed") && out.contains("needs pyspark"),
        "{out}"
    );
    assert!(out.contains("No module named 'pyspark'"), "{out}");
    assert!(!out.contains("ratio.backfill_over_spark"), "{out}");
}

/// `--repeat N` runs the backfill and its floor N times each, alternated;
/// the figures are the medians, and each round's ratio is printed.
#[test]
fn the_backfill_ratio_is_taken_over_alternated_rounds() {
    let tmp = tempfile::tempdir().unwrap();
    let o = run_in(
        tmp.path(),
        &[
            "--smoke", "--dir", "b", "--only", "backfill", "--repeat", "3",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    let values = |name: &str| -> Vec<f64> {
        let line = out
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .unwrap_or_else(|| panic!("no figure {name}:\n{out}"));
        line.split_whitespace()
            .map_while(|v| v.parse().ok())
            .collect()
    };
    let engine = values("backfill.wall_rounds");
    let floor = values("raw.wall_rounds");
    let ratios = values("ratio.backfill_over_raw_rounds");
    assert_eq!(
        (engine.len(), floor.len(), ratios.len()),
        (3, 3, 3),
        "{out}"
    );
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[1]
    };
    // The printed figures are the medians of the rounds (to the printed
    // precision), and the ratio is the floor's median over the backfill's.
    assert!(
        (values("backfill.wall")[0] - median(&engine)).abs() < 0.0015,
        "{out}"
    );
    assert!(
        (values("raw.wall")[0] - median(&floor)).abs() < 0.0015,
        "{out}"
    );
    let ratio = values("ratio.backfill_over_raw")[0];
    assert!(
        (ratio - median(&floor) / median(&engine)).abs() < 0.02,
        "{out}"
    );
    for (i, r) in ratios.iter().enumerate() {
        assert!((r - floor[i] / engine[i]).abs() < 0.02, "round {i}: {out}");
    }
    // The bench fails a round that did not read every row; the last
    // round's table is left in place.
    assert_eq!(values("backfill.rows")[0], 20_000.0);
    assert!(tmp.path().join("b/out/backfill/_delta_log").is_dir());
}
