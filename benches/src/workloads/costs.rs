//! The cost workloads: tiny batches against large and small aggregation
//! state, update-mode merges, several writers on one table.

use super::*;

/// What the state-cost workload measured.
pub(super) struct StateCost {
    /// Median batch time of the tiny batches (ms).
    pub(super) median: f64,
    /// Their p90 (ms).
    pub(super) p90: f64,
    /// The slowest of them (ms): every tenth batch is due a snapshot of
    /// the whole state, which is written off the batch path.
    pub(super) max: f64,
    /// The state's bytes as the store counts them (its row encoding).
    pub(super) bytes: u64,
    /// The memory the store says its keys and values take.
    pub(super) memory: u64,
    /// The run's peak resident memory.
    pub(super) peak_rss: u64,
    /// The Arrow size of the open groups' keys and partial states, read
    /// back from the newest state snapshot.
    pub(super) arrow_bytes: u64,
}

/// The Arrow size (the bytes of the array slices) of the state columns of
/// the newest snapshot under `ckpt` (the store's bucket and removal
/// columns left out).
pub(super) fn snapshot_arrow_bytes(ckpt: &Path) -> anyhow::Result<u64> {
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
pub(super) const STATE_EVENTS: &str =
    "CREATE UNBOUNDED EXTERNAL TABLE events (user_id BIGINT, amount DOUBLE, ts TIMESTAMP)
     STORED AS JSON LOCATION 'events/'
     OPTIONS ('max_files_per_trigger' '1', 'event_time' 'ts', 'watermark_delay' '1 minute');";

/// Tiny batches (10 rows) against `groups` open groups of a windowed
/// aggregation (one day-long window, one group per user): `opening`
/// batches of `first_rows / opening` rows each (`first_rows` at least
/// `groups`) open them, then `tiny` batches each update 10; the job runs
/// `runs` times.
pub(super) fn state_cost(
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
pub(super) fn stateless_peak(dir: &Path, runs: usize) -> anyhow::Result<u64> {
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
pub(super) fn times_after(
    r: &RunReport,
    skip: u64,
    expected: u64,
    what: &str,
) -> anyhow::Result<Vec<f64>> {
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
pub(super) struct UpdateCost {
    /// Batch time (ms).
    pub(super) median_ms: f64,
    /// Rows each MERGE wrote (the changed groups and the rows copied from
    /// the files it rewrote).
    pub(super) rows_rewritten: f64,
    /// Table files in the table when the changes began.
    pub(super) files: u64,
}

/// Update mode: first batches write `rows` groups (one per user), `chunk`
/// consecutive users a batch (so each of the table's files holds one range
/// of users, as a table appended over time holds one range of times), then
/// `batches` batches each change 100 of them, merged into the table by key:
/// spread over the whole key range (`local` false) or 100 consecutive
/// users (`local`).
pub(super) fn update_cost(
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
pub(super) struct WritersCost {
    pub(super) commits: u64,
    pub(super) retries: u64,
    pub(super) commit_median_ms: f64,
    pub(super) wall: Duration,
}

/// `writers` processes, each `shard i/writers` of `files` one-file batches
/// (10 events each), committing into one table (`table`) at once.
pub(super) fn writers_cost(
    dir: &Path,
    files: u64,
    writers: u64,
    table: &str,
) -> anyhow::Result<WritersCost> {
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

pub(super) fn write_job(dir: &Path, name: &str, table: &str, options: &str) -> anyhow::Result<()> {
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
