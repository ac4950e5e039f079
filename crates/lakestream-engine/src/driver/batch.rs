//! One micro-batch: skip it if the table already holds it, else execute
//! the plan over the batch's ranges, stage the output and commit it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use datafusion::error::DataFusionError;
use datafusion::physical_plan::execute_stream_partitioned;
use futures::StreamExt;
use lakestream_checkpoint::{CommitEntry, OffsetsEntry};
use lakestream_sink::{CommitInfo, CommitOutcome};

use super::Driver;
use crate::lineage;
use crate::progress::{BatchProgress, Durations, SourceProgress};
use crate::provider::{BatchRange, BatchScans, source_failure};
use crate::stateful::StateProgress;
use crate::{Error, FailPoint, Result};
use arrow::datatypes::DataType;

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
            sink: self.run.sink.clone(),
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

        // A replayed batch that the table already holds is not executed.
        if recovered
            && let Some(done) = self.sink.committed_batch(&query_id).await?
            && done >= batch_id
        {
            let version = self.sink.version().await?;
            self.ckpt
                .write_commit(&CommitEntry::new(batch_id, version, true))
                .await?;
            progress.skipped = true;
            progress.table_version = version;
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
        let scans = Arc::new(scans);
        let t_exec = Instant::now();
        let (staged, state) = self.execute(batch_id, entry, scans.clone()).await?;
        progress.state = state;
        let mut skipped_input = BTreeMap::new();
        for t in &self.tables {
            let rows = scans.rows(t.source().name());
            progress.input_rows += rows;
            let skipped = t.source().take_skipped();
            if let Some(p) = progress.sources.get_mut(t.source().name()) {
                p.input_rows = rows;
                p.skipped = skipped.clone();
            }
            if !skipped.is_empty() {
                skipped_input.insert(t.source().name().to_string(), skipped);
            }
        }
        progress.event_time_max_ms = self
            .tables
            .iter()
            .filter_map(|t| scans.event_time_max_ms(t.source().name()))
            .max();
        let exec_time = t_exec.elapsed();
        self.fail(FailPoint::AfterFiles, batch_id)?;

        let t_commit = Instant::now();
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
        meta.insert("sqlFingerprint".into(), self.run.fingerprint.clone().into());
        meta.insert("inputRows".into(), progress.input_rows.into());
        meta.insert("outputRows".into(), staged.rows.into());
        if let Some(w) = entry.watermark_ms {
            meta.insert("watermarkMs".into(), w.into());
        }
        let (rows, files, bytes) = (staged.rows, staged.files, staged.bytes);
        let retries_before = self.sink.commit_retries();
        let outcome = self
            .sink
            .commit(
                staged,
                &CommitInfo {
                    query_id,
                    batch_id,
                    metadata: meta,
                    write: self
                        .stateful
                        .as_ref()
                        .map(|s| s.write_mode())
                        .unwrap_or_default(),
                },
            )
            .await?;
        progress.commit_retries = self.sink.commit_retries().saturating_sub(retries_before);
        self.fail(FailPoint::AfterCommit, batch_id)?;
        let skipped = matches!(outcome, CommitOutcome::AlreadyCommitted { .. });
        self.ckpt
            .write_commit(&CommitEntry::new(
                batch_id,
                Some(outcome.version()),
                skipped,
            ))
            .await?;
        let commit_time = t_commit.elapsed();
        for t in &self.tables {
            if let Some(r) = entry.sources.get(t.source().name())
                && !r.end.is_null()
                && let Err(e) = t.source().committed(&r.end).await
            {
                tracing::warn!(source = t.source().name(), error = %e, "source commit hook failed");
            }
        }

        let total = plan_time + wa_time + t0.elapsed();
        progress.skipped = skipped;
        if !skipped {
            progress.output_rows = rows;
            progress.output_files = files;
            progress.output_bytes = bytes;
        }
        progress.table_version = Some(outcome.version());
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

    async fn execute(
        &self,
        batch_id: u64,
        entry: &OffsetsEntry,
        scans: Arc<BatchScans>,
    ) -> Result<(lakestream_sink::Staged, Option<StateProgress>)> {
        let exec_err = move |e| batch_error(batch_id, e);
        let mut state = self.ctx.state();
        state.config_mut().set_extension(scans.clone());
        // `now()` and friends see the batch's logged timestamp, so a replay
        // computes what the first attempt computed.
        state.execution_props_mut().query_execution_start_time =
            chrono::DateTime::from_timestamp_millis(entry.batch_timestamp_ms);
        let mut physical = state
            .create_physical_plan(&self.plan)
            .await
            .map_err(exec_err)?;
        // The aggregation runs (and its state is committed, durably) before
        // the rest of the plan writes the batch's output.
        let mut state_progress = None;
        if let Some(st) = &self.stateful {
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
            let sink = self.sink.clone();
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
            None => self.sink.begin(batch_id).await?.finish().await?,
        };
        Ok((staged, state_progress))
    }
}

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
