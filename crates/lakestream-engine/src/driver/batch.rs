//! One micro-batch: skip it if the table already holds it, else execute
//! each output's plan over the batch's ranges, stage its output and commit
//! it (one commit per output, each with the batch id).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::error::DataFusionError;
use datafusion::physical_plan::execute_stream_partitioned;
use futures::StreamExt;
use lakestream_checkpoint::{CommitEntry, OffsetsEntry};
use lakestream_sink::{CommitInfo, CommitOutcome};

use super::{Driver, OutputKind, OutputPlan};
use crate::dead_letter;
use crate::lineage;
use crate::progress::{BatchProgress, Durations, OutputProgress, SourceProgress};
use crate::provider::{BatchRange, BatchScans, source_failure};
use crate::stateful::StateProgress;
use crate::{Error, FailPoint, Result};
use arrow::datatypes::DataType;
use lakestream_source::Rejected;

impl Driver {
    pub(super) async fn run_batch(
        &self,
        entry: &OffsetsEntry,
        plan_time: Duration,
        wa_time: Duration,
        recovered: bool,
        since_last: Option<Duration>,
    ) -> Result<BatchProgress> {
        let batch_id = entry.batch_id;
        let query_id = self.ckpt.query_id().to_string();
        let t0 = Instant::now();
        self.fail(FailPoint::AfterWriteAhead, batch_id)?;

        let mut progress = BatchProgress {
            query_id: query_id.clone(),
            run_id: self.run.run_id.clone(),
            name: self.run.name.clone(),
            batch_id,
            timestamp_ms: entry.batch_timestamp_ms,
            sink: self.outputs[0].identity.clone(),
            recovered,
            watermark_ms: entry.watermark_ms,
            ..Default::default()
        };
        for t in &self.tables {
            let name = t.source().name();
            if let Some(r) = entry.sources.get(name) {
                let end = (!r.end.is_null()).then(|| r.end.clone());
                // A recovered batch was planned by an earlier run: what the
                // source saw then is not known.
                let latest = if recovered { None } else { t.source().latest() };
                progress.sources.insert(
                    name.to_string(),
                    SourceProgress {
                        start: r.start.clone(),
                        end: end.clone().or_else(|| r.start.clone()),
                        description: match &end {
                            Some(e) => t.source().describe(r.start.as_ref(), e),
                            None => "no new data".into(),
                        },
                        input_rows: 0,
                        dead_letters: 0,
                        backlog: t.source().backlog(),
                        skipped: Vec::new(),
                        identity: {
                            let id = t.source().identity();
                            format!("{}[{}]", id.kind, id.location)
                        },
                        latest: latest.as_ref().map(|l| l.offset.clone()),
                        lag: latest.map(|l| l.lag).unwrap_or_default(),
                    },
                );
            }
        }

        // A replayed batch is not executed for an output whose table holds
        // it already (a crash between two outputs' commits, or after the
        // last commit and before `commits/N`).
        let n = self.outputs.len();
        let mut versions: Vec<Option<u64>> = vec![None; n];
        let mut already = vec![false; n];
        if recovered {
            for (i, o) in self.outputs.iter().enumerate() {
                if let Some(done) = o.sink.committed_batch(&query_id).await?
                    && done >= batch_id
                {
                    already[i] = true;
                    versions[i] = o.sink.version().await?;
                }
            }
        }
        if already.iter().all(|a| *a) {
            self.ckpt
                .write_commit(&self.commit_entry(batch_id, &versions, true))
                .await?;
            progress.skipped = true;
            progress.table_version = versions[0];
            progress.outputs = self.output_progress(&versions, &already, &[]);
            progress.durations.total_ms = ms(t0.elapsed());
            return Ok(progress);
        }

        let mut scans = BatchScans::default();
        for t in &self.tables {
            if let Some(r) = entry.sources.get(t.source().name()) {
                scans.insert(
                    t.source().name(),
                    BatchRange {
                        start: r.start.clone(),
                        end: (!r.end.is_null()).then(|| r.end.clone()),
                    },
                );
            }
        }
        if let Some(st) = &self.stateful {
            for (source, et) in st.event_times() {
                let schema = self
                    .tables
                    .iter()
                    .find(|t| t.source().name().eq_ignore_ascii_case(source))
                    .map(|t| t.source().schema());
                if let Some(schema) = schema
                    && let Ok(i) = schema.index_of(&et.column)
                    && let DataType::Timestamp(unit, _) = schema.field(i).data_type()
                {
                    scans.track_event_time(source, i, *unit);
                }
            }
        }
        let t_exec = Instant::now();
        // Several queries to run: the input is read once, for all.
        let queries_to_run = self
            .outputs
            .iter()
            .zip(&already)
            .filter(|(o, a)| !**a && matches!(o.kind, OutputKind::Query(_)))
            .count();
        if queries_to_run > 1 {
            scans
                .materialize(&self.tables)
                .await
                .map_err(|source| Error::SourceInBatch { batch_id, source })?;
        }
        let scans = Arc::new(scans);
        let mut commit_time = Duration::ZERO;
        let mut written: Vec<(u64, usize, u64)> = vec![(0, 0, 0); n];
        let claims = self.claims(entry)?;
        let mut superseded: Option<String> = None;

        // Stage every query output the batch lacks: its files are written,
        // not yet visible, and the rows that break its table's rules are
        // set apart.
        let mut staged: Vec<Option<lakestream_sink::Staged>> = (0..n).map(|_| None).collect();
        for (i, output) in self.outputs.iter().enumerate() {
            if already[i] {
                continue;
            }
            if let OutputKind::Query(plan) = &output.kind {
                let (s, state) = self
                    .execute(batch_id, entry, scans.clone(), plan, output)
                    .await?;
                if state.is_some() {
                    progress.state = state;
                }
                staged[i] = Some(s);
            }
        }
        let ran_query = staged.iter().any(Option::is_some);
        if !ran_query {
            // No query ran in this attempt (a replay missing only its dead
            // letters): read to find the records the sources reject.
            scans
                .drain(&self.tables)
                .await
                .map_err(|source| Error::SourceInBatch { batch_id, source })?;
        }
        // The input is all read once the queries ran.
        let (meta, mut rejected) = self.input_summary(entry, &scans, &mut progress)?;
        // Rows breaking a table's rules go to the query's first dead-letter
        // table; without one they stay in their output's batch, whose
        // commit then fails naming the rule and the row.
        let first_dead_letters = self
            .outputs
            .iter()
            .position(|o| matches!(o.kind, OutputKind::DeadLetters(_)));
        let mut violations: Vec<(String, Rejected)> = Vec::new();
        if let Some(d) = first_dead_letters {
            for s in staged.iter_mut().flatten() {
                for v in s.take_violations() {
                    progress.rule_violations += v.rows.num_rows() as u64;
                    violations.extend(violation_rows(&v));
                }
            }
            // Committed with the dead letters by an earlier attempt.
            if already[d] {
                violations.clear();
            }
        }
        let mut exec_time = t_exec.elapsed();

        // Commit the dead letters first, then the outputs: a replay after
        // a crash between them finds the dead letters in their table and
        // stages the outputs again, whose set-apart rows it then drops.
        let order: Vec<usize> = (0..n)
            .filter(|i| matches!(self.outputs[*i].kind, OutputKind::DeadLetters(_)))
            .chain((0..n).filter(|i| matches!(self.outputs[*i].kind, OutputKind::Query(_))))
            .collect();
        let mut first_commit = true;
        for i in order {
            let output = &self.outputs[i];
            if already[i] {
                continue;
            }
            let staged = match (&output.kind, staged[i].take()) {
                (OutputKind::Query(_), Some(s)) => s,
                (OutputKind::Query(_), None) => unreachable!("a query output stages its rows"),
                (OutputKind::DeadLetters(sources), _) => {
                    let t_out = Instant::now();
                    let mut rows: Vec<(String, Rejected)> = sources
                        .iter()
                        .flat_map(|s| {
                            rejected
                                .remove(s)
                                .unwrap_or_default()
                                .into_iter()
                                .map(move |r| (s.clone(), r))
                        })
                        .collect();
                    if Some(i) == first_dead_letters {
                        rows.append(&mut violations);
                    }
                    if rows.is_empty() {
                        // Nothing rejected: no commit to the dead letters.
                        continue;
                    }
                    let mut w = output.sink.begin(batch_id).await?;
                    w.write(dead_letter::rows(rows, batch_id, entry.batch_timestamp_ms))
                        .await?;
                    let s = w.finish().await?;
                    exec_time += t_out.elapsed();
                    s
                }
            };
            if first_commit {
                self.fail(FailPoint::AfterFiles, batch_id)?;
            }
            let t_commit = Instant::now();
            let mut meta = meta.clone();
            meta.insert("sqlFingerprint".into(), output.fingerprint.clone().into());
            if !claims.is_empty() {
                // Which range of each partition this commit holds, for
                // `verify` to check the chain across processes.
                let positions: serde_json::Map<String, serde_json::Value> = claims
                    .iter()
                    .map(|c| (c.app_id.clone(), serde_json::json!([c.from, c.to])))
                    .collect();
                meta.insert("positions".into(), positions.into());
            }
            meta.insert("outputRows".into(), staged.rows.into());
            let (rows, files, bytes) = (staged.rows, staged.files, staged.bytes);
            let retries_before = output.sink.commit_retries();
            let outcome = output
                .sink
                .commit(
                    staged,
                    &CommitInfo {
                        query_id: query_id.clone(),
                        batch_id,
                        metadata: meta,
                        write: match &self.stateful {
                            Some(st) if output.stateful => st.write_mode(),
                            _ => Default::default(),
                        },
                        claims: claims.clone(),
                    },
                )
                .await?;
            progress.commit_retries += output.sink.commit_retries().saturating_sub(retries_before);
            commit_time += t_commit.elapsed();
            if let CommitOutcome::Superseded {
                app_id,
                expected,
                found,
                ..
            } = &outcome
            {
                superseded = Some(format!(
                    "position {app_id} was at {found} in the table, not at the batch's start \
                     {expected}: another process committed that partition first"
                ));
                break;
            }
            versions[i] = Some(outcome.version());
            if matches!(outcome, CommitOutcome::AlreadyCommitted { .. }) {
                already[i] = true;
            } else {
                written[i] = (rows, files, bytes);
            }
            // With several outputs, this is between two outputs' commits.
            if first_commit {
                first_commit = false;
                self.fail(FailPoint::AfterCommit, batch_id)?;
            }
        }
        let skipped = already.iter().all(|a| *a);
        let t_mark = Instant::now();
        let mut mark = self.commit_entry(batch_id, &versions, skipped);
        mark.superseded = superseded.clone();
        self.ckpt.write_commit(&mark).await?;
        commit_time += t_mark.elapsed();
        for t in &self.tables {
            let Some(r) = entry.sources.get(t.source().name()) else {
                continue;
            };
            if r.end.is_null() {
                continue;
            }
            if superseded.is_some() {
                t.source().superseded(&r.end).await;
            } else if let Err(e) = t.source().committed(&r.end).await {
                tracing::warn!(source = t.source().name(), error = %e, "source commit hook failed");
            }
        }
        if let Some(why) = &superseded {
            tracing::warn!(batch_id, reason = %why, "batch dropped, not committed");
            progress.superseded = superseded.clone();
        }

        let total = plan_time + wa_time + t0.elapsed();
        progress.skipped = skipped;
        for (rows, files, bytes) in &written {
            progress.output_rows += rows;
            progress.output_files += files;
            progress.output_bytes += bytes;
        }
        progress.table_version = versions[0];
        progress.outputs = self.output_progress(&versions, &already, &written);
        progress.durations = Durations {
            plan_ms: ms(plan_time),
            write_ahead_ms: ms(wa_time),
            execute_ms: ms(exec_time),
            commit_ms: ms(commit_time),
            total_ms: ms(total),
        };
        progress.rows_per_second = if total.as_secs_f64() > 0.0 {
            progress.input_rows as f64 / total.as_secs_f64()
        } else {
            0.0
        };
        progress.input_rows_per_second = match since_last {
            Some(d) if d.as_secs_f64() > 0.0 => progress.input_rows as f64 / d.as_secs_f64(),
            _ => 0.0,
        };
        Ok(progress)
    }

    /// The positions batch `entry` moves in the output table, for sources
    /// that keep them there (Kafka group mode).
    fn claims(&self, entry: &OffsetsEntry) -> Result<Vec<lakestream_sink::PositionClaim>> {
        let mut claims = Vec::new();
        for t in &self.tables {
            let source = t.source();
            if !source.keeps_positions_in_table() {
                continue;
            }
            if let Some(r) = entry.sources.get(source.name())
                && !r.end.is_null()
            {
                let mine = source.claims(&r.end).map_err(|e| Error::SourceInBatch {
                    batch_id: entry.batch_id,
                    source: Arc::new(e),
                })?;
                claims.extend(mine.into_iter().map(|c| lakestream_sink::PositionClaim {
                    app_id: c.app_id,
                    from: c.from,
                    to: c.to,
                }));
            }
        }
        Ok(claims)
    }

    /// `commits/N`: the first output's table version, and the others' by
    /// their identity.
    fn commit_entry(&self, batch_id: u64, versions: &[Option<u64>], skipped: bool) -> CommitEntry {
        let mut entry = CommitEntry::new(batch_id, versions[0], skipped);
        for (o, v) in self.outputs.iter().zip(versions).skip(1) {
            if let Some(v) = v {
                entry.outputs.insert(o.identity.clone(), *v);
            }
        }
        entry
    }

    /// Each output's part of the batch, when the query has several.
    fn output_progress(
        &self,
        versions: &[Option<u64>],
        already: &[bool],
        written: &[(u64, usize, u64)],
    ) -> Vec<OutputProgress> {
        if self.outputs.len() < 2 {
            return Vec::new();
        }
        self.outputs
            .iter()
            .enumerate()
            .map(|(i, o)| {
                let (rows, files, bytes) = written.get(i).copied().unwrap_or_default();
                OutputProgress {
                    sink: o.identity.clone(),
                    output_rows: rows,
                    output_files: files,
                    output_bytes: bytes,
                    table_version: versions[i],
                    skipped: already[i],
                }
            })
            .collect()
    }

    /// What the batch read, once its scans ran: input rows, skipped input,
    /// dead letters and the largest event time into `progress`; the commit
    /// metadata every output's commit carries (ranges read, engine,
    /// counts); and the records each source rejected. Fails when a source
    /// rejected records and no output of the query takes its dead letters
    /// (they would be lost).
    fn input_summary(
        &self,
        entry: &OffsetsEntry,
        scans: &BatchScans,
        progress: &mut BatchProgress,
    ) -> Result<(CommitMeta, Rejections)> {
        let batch_id = entry.batch_id;
        let mut skipped_input = BTreeMap::new();
        let mut rejected = BTreeMap::new();
        for t in &self.tables {
            let name = t.source().name();
            let rows = scans.rows(name);
            progress.input_rows += rows;
            let skipped = t.source().take_skipped();
            let dead = t.source().take_rejected();
            if let Some(p) = progress.sources.get_mut(name) {
                p.input_rows = rows;
                p.skipped = skipped.clone();
                p.dead_letters = dead.len() as u64;
            }
            if !skipped.is_empty() {
                skipped_input.insert(name.to_string(), skipped);
            }
            if !dead.is_empty() {
                let taken = self.outputs.iter().any(|o| {
                    matches!(&o.kind, OutputKind::DeadLetters(s) if s.iter().any(|s| s == name))
                });
                if !taken {
                    return Err(Error::InvalidQuery(format!(
                        "batch {batch_id}: source {name} set aside {} records it could not \
                         decode (first: {}) but the query has no dead-letter table for it; \
                         give it one (dead_letter_location, QueryBuilder::dead_letters)",
                        dead.len(),
                        dead[0].error
                    )));
                }
                rejected.insert(name.to_string(), dead);
            }
        }
        progress.event_time_max_ms = self
            .tables
            .iter()
            .filter_map(|t| scans.event_time_max_ms(t.source().name()))
            .max();
        let mut meta = serde_json::Map::new();
        meta.insert(
            "sources".into(),
            serde_json::to_value(
                progress
                    .sources
                    .iter()
                    .map(|(k, v)| (k.clone(), v.description.clone()))
                    .collect::<BTreeMap<_, _>>(),
            )
            .expect("serializable"),
        );
        if !skipped_input.is_empty() {
            // An audit of the table's history sees what this batch left out.
            meta.insert(
                "skipped".into(),
                serde_json::to_value(&skipped_input).expect("serializable"),
            );
        }
        meta.insert(
            "engine".into(),
            serde_json::json!(concat!("lakestream ", env!("CARGO_PKG_VERSION"))),
        );
        // Lineage: the exact ranges read, as `offsets/N` holds them.
        let ranges: serde_json::Map<String, serde_json::Value> = entry
            .sources
            .iter()
            .map(|(name, r)| {
                let start = r
                    .start
                    .as_ref()
                    .map(|v| lineage::recorded_offset(v, batch_id))
                    .unwrap_or(serde_json::Value::Null);
                let source = progress
                    .sources
                    .get(name)
                    .map(|p| p.identity.clone())
                    .unwrap_or_default();
                (
                    name.clone(),
                    serde_json::json!({
                        "source": source,
                        "start": start,
                        "end": lineage::recorded_offset(&r.end, batch_id),
                    }),
                )
            })
            .collect();
        meta.insert("ranges".into(), ranges.into());
        meta.insert("inputRows".into(), progress.input_rows.into());
        if !rejected.is_empty() {
            let counts: serde_json::Map<String, serde_json::Value> = rejected
                .iter()
                .map(|(k, v)| (k.clone(), (v.len() as u64).into()))
                .collect();
            meta.insert("deadLetters".into(), counts.into());
        }
        if let Some(w) = entry.watermark_ms {
            meta.insert("watermarkMs".into(), w.into());
        }
        if !entry.tables.is_empty() {
            // Lineage: which version of each static table was joined.
            meta.insert(
                "staticTables".into(),
                serde_json::to_value(&entry.tables).expect("serializable"),
            );
        }
        Ok((meta, rejected))
    }

    /// Run `output`'s query `plan` over the batch and stage what it
    /// writes.
    async fn execute(
        &self,
        batch_id: u64,
        entry: &OffsetsEntry,
        scans: Arc<BatchScans>,
        plan: &datafusion::logical_expr::LogicalPlan,
        output: &OutputPlan,
    ) -> Result<(lakestream_sink::Staged, Option<StateProgress>)> {
        let exec_err = move |e| batch_error(batch_id, e);
        let mut state = self.ctx.state();
        state.config_mut().set_extension(scans.clone());
        // Static Delta tables read the versions the write-ahead fixed.
        state
            .config_mut()
            .set_extension(Arc::new(crate::static_delta::TableVersions(
                entry.tables.clone(),
            )));
        // `now()` and friends see the batch's logged timestamp, so a replay
        // computes what the first attempt computed.
        state.execution_props_mut().query_execution_start_time =
            chrono::DateTime::from_timestamp_millis(entry.batch_timestamp_ms);
        let mut physical = state.create_physical_plan(plan).await.map_err(exec_err)?;
        // The aggregation runs (and its state is committed, durably) before
        // the rest of the plan writes the batch's output.
        let mut state_progress = None;
        if output.stateful
            && let Some(st) = &self.stateful
        {
            let (plan, p) = st
                .run(
                    batch_id,
                    entry.watermark_ms,
                    physical,
                    state.task_ctx(),
                    &scans,
                )
                .await
                .map_err(|e| match e {
                    Error::Execution { source, .. } => batch_error(batch_id, *source),
                    other => other,
                })?;
            physical = plan;
            state_progress = Some(p);
        }
        // One writer per output partition, each on its own task: decoding,
        // the query and Parquet encoding of a partition run together, and
        // partitions run in parallel. The files of all writers form the
        // batch's one commit.
        let streams = execute_stream_partitioned(physical, state.task_ctx()).map_err(exec_err)?;
        let mut tasks = tokio::task::JoinSet::new();
        for mut stream in streams {
            let sink = output.sink.clone();
            tasks.spawn(async move {
                let mut writer = sink.begin(batch_id).await?;
                while let Some(batch) = stream.next().await {
                    writer.write(batch.map_err(exec_err)?).await?;
                }
                Ok::<_, Error>(writer.finish().await?)
            });
        }
        let mut staged: Option<lakestream_sink::Staged> = None;
        while let Some(done) = tasks.join_next().await {
            let part = done.map_err(|e| {
                Error::Internal(format!(
                    "batch {batch_id}: a writer task failed: {e}; the batch is not committed \
                     and a restart re-runs it; please report this"
                ))
            })??;
            staged = Some(match staged {
                Some(s) => s.merge(part),
                None => part,
            });
        }
        let staged = match staged {
            Some(s) => s,
            None => output.sink.begin(batch_id).await?.finish().await?,
        };
        Ok((staged, state_progress))
    }
}

/// The dead-letter rows of output rows that broke a rule of their table:
/// each row as a JSON object of its columns, under the table's URL as its
/// source, with the rule it broke.
fn violation_rows(v: &lakestream_sink::Violation) -> Vec<(String, Rejected)> {
    (0..v.rows.num_rows())
        .map(|i| {
            (
                v.table.clone(),
                Rejected {
                    record: v.row_json(i).into_bytes(),
                    error: format!("the row violates the table's {}", v.rule()),
                    ..Default::default()
                },
            )
        })
        .collect()
}

/// What every output's commit of a batch records (`commitInfo.lakestream`).
type CommitMeta = serde_json::Map<String, serde_json::Value>;

/// The records each source (by name) could not decode in a batch.
type Rejections = BTreeMap<String, Vec<Rejected>>;

/// DataFusion's error while running batch `batch_id`, typed: the source's
/// own error when a source read failed (through any number of operators),
/// DataFusion's otherwise.
fn batch_error(batch_id: u64, e: DataFusionError) -> Error {
    match source_failure(&e) {
        Some(source) => Error::SourceInBatch { batch_id, source },
        None => Error::Execution {
            batch_id,
            source: Box::new(e),
        },
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
