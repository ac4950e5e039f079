//! The file workloads, one function each: the backfill against its raw
//! floor (and Spark), state and update-mode costs, tiny batches, several
//! writers and a long history.

use super::*;

/// The `backfill` workload.
pub(super) fn backfill_workload(cfg: &BenchConfig, dir: &Path) -> anyhow::Result<()> {
    // 1. backfill
    let input_bytes = generate_events(&dir.join("events"), cfg.rows, cfg.files)?;
    write_job(dir, "backfill.sql", "out/backfill", "")?;
    let (mut runs, mut floors) = backfill_rounds(cfg, dir)?;
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

    let (w, groups) = windowed_run(cfg, dir, secs)?;
    let w_secs = w.wall.as_secs_f64();

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
    Ok(())
}

/// Rounds of the backfill and its floor (partitioned by day as the
/// table is), alternated so that neither always runs second on a machine
/// whose speed drifts.
fn backfill_rounds(cfg: &BenchConfig, dir: &Path) -> anyhow::Result<(Vec<RunReport>, Vec<Floor>)> {
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
    Ok((runs, floors))
}

/// A windowed aggregation over the backfill's input (which took `secs`):
/// its run and the groups it wrote, with its figures printed.
fn windowed_run(cfg: &BenchConfig, dir: &Path, secs: f64) -> anyhow::Result<(RunReport, u64)> {
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

    Ok((w, groups))
}

/// The `state` workload.
pub(super) fn state_workload(cfg: &BenchConfig, dir: &Path) -> anyhow::Result<()> {
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
            large.peak_rss.saturating_sub(small.peak_rss) as f64 / large.arrow_bytes.max(1) as f64
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
    Ok(())
}

/// The `update` workload.
pub(super) fn update_workload(cfg: &BenchConfig, dir: &Path) -> anyhow::Result<()> {
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
    Ok(())
}

/// The `tiny` workload.
pub(super) fn tiny_workload(cfg: &BenchConfig, dir: &Path) -> anyhow::Result<()> {
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
    Ok(())
}

/// The `writers` workload.
pub(super) fn writers_workload(cfg: &BenchConfig, dir: &Path) -> anyhow::Result<()> {
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
    Ok(())
}

/// The `history` workload.
pub(super) fn history_workload(cfg: &BenchConfig, dir: &Path) -> anyhow::Result<()> {
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
    Ok(())
}
