//! One micro-batch, as the protocol's steps say ([`lakestream_protocol::
//! BatchSteps`]): skip the outputs whose tables hold it already, execute
//! each other output's plan over the batch's ranges, stage its output and
//! commit it (one commit per output, each with the batch id), then mark
//! the batch done.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::error::DataFusionError;
use datafusion::physical_plan::execute_stream_partitioned;
use futures::StreamExt;
use lakestream_checkpoint::{CommitEntry, OffsetsEntry};
use lakestream_protocol::{Action, BatchReport, BatchSteps, Committed, OutputRole};
use lakestream_sink::{CommitInfo, CommitOutcome};

use super::{Driver, OutputKind, OutputPlan};
use crate::dead_letter;
use crate::lineage::{self, CommitLineage, RangeRecord};
use crate::progress::{BatchProgress, Durations, OutputProgress, SourceProgress};
use crate::provider::{BatchRange, BatchScans, source_failure};
use crate::stateful::StateProgress;
use crate::{Error, FailPoint, Result};
use arrow::datatypes::DataType;
use lakestream_source::Rejected;

/// What one attempt at a batch has gathered between its steps.
#[derive(Default)]
struct Attempt {
    /// Each output's staged rows, until committed.
    staged: Vec<Option<lakestream_sink::Staged>>,
    /// What every commit records (ranges read, counts, engine).
    lineage: CommitLineage,
    /// The records each source rejected, for the dead-letter outputs.
    rejected: Rejections,
    /// Rows set apart by their table's rules, for the first dead-letter
    /// output.
    violations: Vec<(String, Rejected)>,
    /// Rows, files and bytes each output's commit added.
    written: Vec<(u64, usize, u64)>,
    exec_time: Duration,
    commit_time: Duration,
    /// Whether an output commit was carried out yet (for fault injection).
    committed_once: bool,
    /// Whether any output was staged or the input read (not so when every
    /// output held the batch already).
    executed: bool,
}

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
        let t0 = Instant::now();
        self.fail(FailPoint::AfterWriteAhead, batch_id)?;
        let mut progress = self.start_progress(entry, recovered);
        let roles = self
            .outputs
            .iter()
            .map(|o| match o.kind {
                OutputKind::Query(_) => OutputRole::Query,
                OutputKind::DeadLetters(_) => OutputRole::DeadLetters,
            })
            .collect();
        let mut steps = BatchSteps::new(batch_id, roles, recovered);
        let n = self.outputs.len();
        let mut at = Attempt {
            staged: (0..n).map(|_| None).collect(),
            written: vec![(0, 0, 0); n],
            ..Default::default()
        };
        let report = loop {
            match steps.next() {
                Action::CheckOutputs => {
                    let found = self.check_outputs(batch_id).await?;
                    steps.checked(&found);
                }
                Action::Execute(queries) => {
                    self.stage(entry, &queries, &steps, &mut at, &mut progress)
                        .await?;
                    steps.executed();
                }
                Action::Commit(i) => {
                    let outcome = self.commit_output(entry, i, &mut at, &mut progress).await?;
                    steps.committed(i, outcome);
                }
                Action::Mark(m) => {
                    let t_mark = Instant::now();
                    let mut mark = self.commit_entry(batch_id, &m.versions, m.skipped);
                    mark.superseded = m.superseded;
                    self.ckpt.write_commit(&mark).await?;
                    at.commit_time += t_mark.elapsed();
                    steps.marked();
                }
                Action::Notify { superseded } => {
                    self.notify_sources(entry, superseded).await;
                    steps.notified();
                }
                Action::Done(report) => break report,
            }
        };
        if let Some(why) = &report.superseded {
            tracing::warn!(batch_id, reason = %why, "batch dropped, not committed");
        }
        self.finish_progress(
            &mut progress,
            &report,
            &at,
            [plan_time, wa_time, t0.elapsed()],
            since_last,
        );
        Ok(progress)
    }

    /// The batch's progress before it runs: its ids and what each source
    /// reads.
    fn start_progress(&self, entry: &OffsetsEntry, recovered: bool) -> BatchProgress {
        let mut progress = BatchProgress {
            query_id: self.ckpt.query_id().to_string(),
            run_id: self.run.run_id.clone(),
            name: self.run.name.clone(),
            batch_id: entry.batch_id,
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
        progress
    }

    /// Each output's table version when its table holds batch `batch_id`
    /// for the query already (a crash between two outputs' commits, or
    /// after the last commit and before `commits/N`).
    async fn check_outputs(&self, batch_id: u64) -> Result<Vec<Option<u64>>> {
        let query_id = self.ckpt.query_id().to_string();
        let mut found = Vec::with_capacity(self.outputs.len());
        for o in &self.outputs {
            found.push(match o.sink.committed_batch(&query_id).await? {
                Some(done) if done >= batch_id => o.sink.version().await?,
                _ => None,
            });
        }
        Ok(found)
    }

    /// Stage every query output in `queries` (files written, not yet
    /// visible), read the input to its end, and set apart the rows that
    /// break a table's rules.
    async fn stage(
        &self,
        entry: &OffsetsEntry,
        queries: &[usize],
        steps: &BatchSteps,
        at: &mut Attempt,
        progress: &mut BatchProgress,
    ) -> Result<()> {
        let batch_id = entry.batch_id;
        let t_exec = Instant::now();
        at.executed = true;
        let mut scans = self.batch_scans(entry);
        // Several queries to run: the input is read once, for all.
        if queries.len() > 1 {
            scans
                .materialize(&self.tables)
                .await
                .map_err(|source| Error::SourceInBatch { batch_id, source })?;
        }
        let scans = Arc::new(scans);
        for &i in queries {
            let output = &self.outputs[i];
            let OutputKind::Query(plan) = &output.kind else {
                unreachable!("the protocol stages query outputs only")
            };
            let (s, state) = self
                .execute(batch_id, entry, scans.clone(), plan, output)
                .await?;
            if state.is_some() {
                progress.state = state;
            }
            at.staged[i] = Some(s);
        }
        if queries.is_empty() {
            // No query runs in this attempt (a replay missing only its dead
            // letters): read to find the records the sources reject.
            scans
                .drain(&self.tables)
                .await
                .map_err(|source| Error::SourceInBatch { batch_id, source })?;
        }
        // The input is all read once the queries ran.
        let (lineage, rejected) = self.input_summary(entry, &scans, progress)?;
        at.lineage = lineage;
        at.rejected = rejected;
        // Rows breaking a table's rules go to the query's first dead-letter
        // table; without one they stay in their output's batch, whose
        // commit then fails naming the rule and the row.
        if let Some(d) = self.first_dead_letters() {
            for s in at.staged.iter_mut().flatten() {
                for v in s.take_violations() {
                    progress.rule_violations += v.rows.num_rows() as u64;
                    at.violations.extend(violation_rows(&v));
                }
            }
            // Committed with the dead letters by an earlier attempt.
            if steps.holds(d) {
                at.violations.clear();
            }
        }
        at.exec_time += t_exec.elapsed();
        Ok(())
    }

    /// The query's first dead-letter output, which takes rule violations.
    fn first_dead_letters(&self) -> Option<usize> {
        self.outputs
            .iter()
            .position(|o| matches!(o.kind, OutputKind::DeadLetters(_)))
    }

    /// The batch's ranges as its scans read them, with the event-time
    /// columns the aggregation's watermark tracks.
    fn batch_scans(&self, entry: &OffsetsEntry) -> BatchScans {
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
        scans
    }

    /// Commit output `i`'s part of the batch: its staged rows, or (a
    /// dead-letter output) the records its sources rejected.
    async fn commit_output(
        &self,
        entry: &OffsetsEntry,
        i: usize,
        at: &mut Attempt,
        progress: &mut BatchProgress,
    ) -> Result<Committed> {
        let batch_id = entry.batch_id;
        let output = &self.outputs[i];
        let staged = match (&output.kind, at.staged[i].take()) {
            (OutputKind::Query(_), Some(s)) => s,
            (OutputKind::Query(_), None) => unreachable!("a query output stages its rows"),
            (OutputKind::DeadLetters(sources), _) => {
                let t_out = Instant::now();
                let mut rows: Vec<(String, Rejected)> = sources
                    .iter()
                    .flat_map(|s| {
                        at.rejected
                            .remove(s)
                            .unwrap_or_default()
                            .into_iter()
                            .map(move |r| (s.clone(), r))
                    })
                    .collect();
                if Some(i) == self.first_dead_letters() {
                    rows.append(&mut at.violations);
                }
                if rows.is_empty() {
                    // Nothing rejected: no commit to the dead letters.
                    return Ok(Committed::Nothing);
                }
                let mut w = output.sink.begin(batch_id).await?;
                w.write(dead_letter::rows(rows, batch_id, entry.batch_timestamp_ms))
                    .await?;
                let s = w.finish().await?;
                at.exec_time += t_out.elapsed();
                s
            }
        };
        if !at.committed_once {
            self.fail(FailPoint::AfterFiles, batch_id)?;
        }
        let t_commit = Instant::now();
        let claims = self.claims(entry)?;
        let mut lineage = at.lineage.clone();
        lineage.sql_fingerprint = Some(output.fingerprint.clone());
        // Which range of each partition this commit holds, for `verify` to
        // check the chain across processes.
        lineage.positions = claims
            .iter()
            .map(|c| (c.app_id.clone(), (c.from, c.to)))
            .collect();
        lineage.output_rows = Some(staged.rows);
        let (rows, files, bytes) = (staged.rows, staged.files, staged.bytes);
        let retries_before = output.sink.commit_retries();
        let outcome = output
            .sink
            .commit(
                staged,
                &CommitInfo {
                    query_id: self.ckpt.query_id().to_string(),
                    batch_id,
                    metadata: lineage.to_map(),
                    write: match &self.stateful {
                        Some(st) if output.stateful => st.write_mode(),
                        _ => Default::default(),
                    },
                    claims,
                },
            )
            .await?;
        progress.commit_retries += output.sink.commit_retries().saturating_sub(retries_before);
        at.commit_time += t_commit.elapsed();
        let committed = match outcome {
            CommitOutcome::Superseded {
                app_id,
                expected,
                found,
                ..
            } => Committed::Superseded {
                reason: format!(
                    "position {app_id} was at {found} in the table, not at the batch's start \
                     {expected}: another process committed that partition first"
                ),
            },
            CommitOutcome::AlreadyCommitted { version } => Committed::AlreadyHeld { version },
            CommitOutcome::Committed { version } => {
                at.written[i] = (rows, files, bytes);
                Committed::Written { version }
            }
        };
        // With several outputs, this is between two outputs' commits.
        if !at.committed_once && !matches!(committed, Committed::Superseded { .. }) {
            at.committed_once = true;
            self.fail(FailPoint::AfterCommit, batch_id)?;
        }
        Ok(committed)
    }

    /// Tell each source its range of the batch is committed, or (when
    /// another process committed its positions first) that it is not.
    async fn notify_sources(&self, entry: &OffsetsEntry, superseded: bool) {
        for t in &self.tables {
            let Some(r) = entry.sources.get(t.source().name()) else {
                continue;
            };
            if r.end.is_null() {
                continue;
            }
            if superseded {
                if let Some(positions) = t.source().table_positions() {
                    positions.superseded(&r.end).await;
                }
            } else if let Err(e) = t.source().committed(&r.end).await {
                tracing::warn!(source = t.source().name(), error = %e, "source commit hook failed");
            }
        }
    }

    /// Fill in what the batch did, once it is over.
    fn finish_progress(
        &self,
        progress: &mut BatchProgress,
        report: &BatchReport,
        at: &Attempt,
        [plan_time, wa_time, run_time]: [Duration; 3],
        since_last: Option<Duration>,
    ) {
        progress.skipped = report.skipped;
        progress.superseded = report.superseded.clone();
        for (rows, files, bytes) in &at.written {
            progress.output_rows += rows;
            progress.output_files += files;
            progress.output_bytes += bytes;
        }
        progress.table_version = report.versions[0];
        progress.outputs = self.output_progress(&report.versions, &report.held, &at.written);
        let total = plan_time + wa_time + run_time;
        progress.durations = if !at.executed {
            // Every output held the batch: only the check and the mark ran.
            Durations {
                total_ms: ms(run_time),
                ..Default::default()
            }
        } else {
            Durations {
                plan_ms: ms(plan_time),
                write_ahead_ms: ms(wa_time),
                execute_ms: ms(at.exec_time),
                commit_ms: ms(at.commit_time),
                total_ms: ms(total),
            }
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
    }

    /// The positions batch `entry` moves in the output table, for sources
    /// that keep them there (Kafka group mode).
    fn claims(&self, entry: &OffsetsEntry) -> Result<Vec<lakestream_sink::PositionClaim>> {
        let mut claims = Vec::new();
        for t in &self.tables {
            let source = t.source();
            let Some(positions) = source.table_positions() else {
                continue;
            };
            if let Some(r) = entry.sources.get(source.name())
                && !r.end.is_null()
            {
                claims.extend(positions.claims(&r.end).map_err(|e| Error::SourceInBatch {
                    batch_id: entry.batch_id,
                    source: Arc::new(e),
                })?);
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
    ) -> Result<(CommitLineage, Rejections)> {
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
        let mut lineage = CommitLineage {
            lineage_version: lineage::LINEAGE_VERSION,
            query_id: self.ckpt.query_id().to_string(),
            batch_id,
            engine: Some(concat!("lakestream ", env!("CARGO_PKG_VERSION")).into()),
            sources: progress
                .sources
                .iter()
                .map(|(k, v)| (k.clone(), v.description.clone()))
                .collect(),
            input_rows: Some(progress.input_rows),
            watermark_ms: entry.watermark_ms,
            dead_letters: rejected
                .iter()
                .map(|(k, v)| (k.clone(), v.len() as u64))
                .collect(),
            ..Default::default()
        };
        // An audit of the table's history sees what this batch left out.
        for (name, skipped) in skipped_input {
            lineage
                .skipped
                .insert(name, serde_json::to_value(&skipped).expect("serializable"));
        }
        // The exact ranges read, as `offsets/N` holds them.
        for (name, r) in &entry.sources {
            lineage.ranges.insert(
                name.clone(),
                RangeRecord {
                    source: progress
                        .sources
                        .get(name)
                        .map(|p| p.identity.clone())
                        .unwrap_or_default(),
                    start: r
                        .start
                        .as_ref()
                        .map(|v| lineage::recorded_offset(v, batch_id))
                        .unwrap_or(serde_json::Value::Null),
                    end: lineage::recorded_offset(&r.end, batch_id),
                },
            );
        }
        // Which version of each static table was joined.
        lineage.static_tables = entry.tables.clone();
        Ok((lineage, rejected))
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
