//! The driver: one query's loop of micro-batches, exactly once.
//!
//! [`Driver::run`] recovers ([`recover`]), then plans, writes ahead, runs
//! and commits one batch at a time ([`batch`]) as the trigger says
//! ([`wait`]), keeping the checkpoint bounded ([`snapshots`]).

mod batch;
mod recover;
mod snapshots;
mod wait;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::SessionContext;
use lakestream_checkpoint::{Checkpoint, OffsetsEntry, SourceRange, now_ms};
use lakestream_sink::Sink;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::progress::BatchProgress;
use crate::provider::MicroBatchTable;
use crate::query::QuerySummary;
use crate::stateful::StatefulAggregate;
use crate::{Error, FailPoint, PROGRESS_EVENTS_BUFFER, Result, Trigger};
use recover::Recovered;
use wait::{next_trigger, retry_transient, wait};

/// A prepared query: its tables, outputs and checkpoint.
pub(crate) struct Driver {
    pub(crate) ctx: SessionContext,
    pub(crate) tables: Vec<Arc<MicroBatchTable>>,
    /// What each batch writes, in order (at least one).
    pub(crate) outputs: Vec<OutputPlan>,
    pub(crate) ckpt: Checkpoint,
    pub(crate) trigger: Trigger,
    pub(crate) poll: Duration,
    pub(crate) snapshot_interval: u64,
    pub(crate) min_batches_to_retain: u64,
    pub(crate) fail_point: Option<(FailPoint, u64)>,
    /// The query's aggregation, when it has one (in the output whose
    /// `stateful` is set).
    pub(crate) stateful: Option<StatefulAggregate>,
    /// What progress and lineage say of this run.
    pub(crate) run: RunInfo,
    /// Where batches are reported as Prometheus series, if anywhere.
    pub(crate) metrics: Option<Arc<crate::metrics::Metrics>>,
    /// Static Delta tables: each batch records the version it reads.
    pub(crate) static_tables: Vec<Arc<crate::StaticDeltaTable>>,
}

/// What an output writes.
pub(crate) enum OutputKind {
    /// The rows of a query over the batch.
    Query(LogicalPlan),
    /// The records these sources (by name) could not decode: a
    /// dead-letter table ([`crate::dead_letter`]).
    DeadLetters(Vec<String>),
}

/// One output of the query: what it writes and its sink.
pub(crate) struct OutputPlan {
    pub(crate) kind: OutputKind,
    pub(crate) sink: Arc<dyn Sink>,
    /// [`crate::lineage::sql_fingerprint`] of its query.
    pub(crate) fingerprint: String,
    /// What the sink writes to.
    pub(crate) identity: String,
    /// Whether the query's aggregation runs in this output.
    pub(crate) stateful: bool,
}

/// The positions a sink keeps, for a source's reads.
struct SinkPositions(Arc<dyn Sink>);

#[async_trait::async_trait]
impl lakestream_source::PositionStore for SinkPositions {
    async fn positions(
        &self,
        app_ids: &[String],
    ) -> std::result::Result<BTreeMap<String, i64>, Box<dyn std::error::Error + Send + Sync>> {
        Ok(self.0.positions(app_ids).await?)
    }
}

/// What progress and lineage say of a run besides its batches.
pub(crate) struct RunInfo {
    /// New at every start of the query.
    pub(crate) run_id: String,
    /// The query's name, if any.
    pub(crate) name: Option<String>,
}

impl Driver {
    fn fail(&self, point: FailPoint, batch_id: u64) -> Result<()> {
        if self.fail_point == Some((point, batch_id)) {
            return Err(Error::InjectedFault { point, batch_id });
        }
        Ok(())
    }

    /// Keep batch `p`'s progress with the checkpoint (`progress/N`), for
    /// `status` and the status page, written while the next batch runs
    /// (the previous write is awaited first, so at most one is in flight).
    /// Best effort: the batch is committed already, and a lost report loses
    /// nothing but a point of history.
    async fn keep_progress(&self, p: &BatchProgress, pending: &mut Option<JoinHandle<()>>) {
        if let Some(previous) = pending.take() {
            let _ = previous.await;
        }
        let batch_id = p.batch_id;
        let entry = lakestream_checkpoint::ProgressEntry::new(
            batch_id,
            serde_json::to_value(p).expect("progress serializes"),
        );
        let write = self.ckpt.write_progress(entry);
        *pending = Some(tokio::spawn(async move {
            if let Err(e) = write.await {
                tracing::warn!(batch_id, error = %e, "cannot keep the batch's progress in the checkpoint");
            }
        }));
    }

    /// A batch's result, after acting on a failure that asks for it: a
    /// source whose files gained fields has its new schema recorded in the
    /// checkpoint, for the restart to read them.
    async fn on_batch_error(&self, r: Result<BatchProgress>) -> Result<BatchProgress> {
        let e = match r {
            Ok(p) => return Ok(p),
            Err(e) => e,
        };
        if let Error::SourceInBatch { source, .. } = &e
            && let lakestream_source::Error::SchemaChanged {
                source_name,
                schema,
                ..
            } = source.as_ref()
        {
            let state = lakestream_source::files::connector::schema_to_json(schema);
            self.ckpt
                .replace_source_state(source_name, "schema", state)
                .await?;
            tracing::warn!(source = %source_name, "the source's schema gained columns; recorded in the checkpoint for the next run");
        }
        Err(e)
    }

    /// Sources that keep their positions in the output table (Kafka group
    /// mode) read them through the query's one output sink.
    async fn attach_position_stores(&self) -> Result<()> {
        let Some(first) = self
            .tables
            .iter()
            .find(|t| t.source().table_positions().is_some())
        else {
            return Ok(());
        };
        let name = first.source().name().to_string();
        if self.outputs.len() != 1 {
            return Err(Error::InvalidQuery(format!(
                "source {name} keeps its positions in the output table (group_id): the query \
                 must write exactly one table, without a dead-letter table, since positions \
                 and rows commit together in one table"
            )));
        }
        if self.stateful.is_some() {
            return Err(Error::InvalidQuery(format!(
                "source {name} is read in group mode (group_id), where partitions move between \
                 processes, but an aggregation's state lives in one process's checkpoint: use \
                 static 'partitions' (one share per process) for a stateful query"
            )));
        }
        let sink = self.outputs[0].sink.clone();
        // Refused here, before any batch, by a sink that cannot keep them.
        sink.positions(&[]).await?;
        for t in &self.tables {
            if let Some(positions) = t.source().table_positions() {
                positions.set_position_store(Arc::new(SinkPositions(sink.clone())));
            }
        }
        Ok(())
    }

    /// Between plans that found nothing (continuous trigger): until any
    /// source may have new data past `prev`, a stop is requested, or the
    /// poll interval passed.
    async fn wait_for_data(
        &self,
        prev: &BTreeMap<String, Option<serde_json::Value>>,
        stop: &mut watch::Receiver<bool>,
    ) {
        let waits = self.tables.iter().map(|t| {
            let source = t.source();
            let after = prev.get(source.name()).cloned().flatten();
            let poll = self.poll;
            Box::pin(async move { source.wait_for_data(after.as_ref(), poll).await })
        });
        tokio::select! {
            _ = futures::future::select_all(waits) => {}
            _ = stop.changed() => {}
        }
    }

    /// Plan batch `next_id`: each source's range from where the last batch
    /// ended (`prev`), and the watermark it runs with. Whether it has work:
    /// new input anywhere, or windows the watermark closes (written now,
    /// not whenever more input comes).
    async fn plan_next(
        &self,
        prev: &BTreeMap<String, Option<serde_json::Value>>,
        next_id: u64,
        watermark: Option<i64>,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<(BTreeMap<String, SourceRange>, bool, Option<i64>)> {
        let mut sources = BTreeMap::new();
        let mut any = false;
        for t in &self.tables {
            let name = t.source().name().to_string();
            let start = prev.get(&name).cloned().flatten();
            let source = t.source();
            let end = retry_transient(source.as_ref(), "plan", stop, || {
                source.plan(start.as_ref())
            })
            .await?
            .flatten();
            any |= end.is_some();
            sources.insert(
                name,
                SourceRange {
                    start,
                    end: end.unwrap_or(serde_json::Value::Null),
                },
            );
        }
        let next_watermark = match &self.stateful {
            Some(st) => st.next_watermark(next_id.checked_sub(1), watermark).await?,
            None => None,
        };
        if !any
            && let Some(st) = &self.stateful
            && st.has_output_at(next_watermark).await
        {
            any = true;
        }
        Ok((sources, any, next_watermark))
    }

    pub(crate) async fn run(
        self,
        mut stop: watch::Receiver<bool>,
        latest: watch::Sender<Option<BatchProgress>>,
        events: mpsc::Sender<BatchProgress>,
    ) -> Result<QuerySummary> {
        let mut summary = QuerySummary {
            query_id: self.ckpt.query_id().to_string(),
            ..Default::default()
        };
        let dropped_events = std::sync::atomic::AtomicU64::new(0);
        let report = |p: BatchProgress, summary: &mut QuerySummary| {
            summary.batches += 1;
            summary.input_rows += p.input_rows;
            summary.output_rows += p.output_rows;
            summary.last_batch_id = Some(p.batch_id);
            summary.table_version = p.table_version.or(summary.table_version);
            if let Some(m) = &self.metrics {
                m.observe(&p);
            }
            // Bounded: a reader that falls behind (or none at all) loses
            // events, never the query's memory.
            if let Err(mpsc::error::TrySendError::Full(_)) = events.try_send(p.clone())
                && dropped_events.fetch_add(1, Ordering::Relaxed) == 0
            {
                tracing::warn!(
                    batch_id = p.batch_id,
                    "the progress channel is full ({PROGRESS_EVENTS_BUFFER} events unread): newer events are dropped until it is read"
                );
            }
            let _ = latest.send(Some(p));
        };

        self.attach_position_stores().await?;
        let Recovered {
            mut prev,
            mut next_id,
            pending,
            // The watermark the last planned batch ran with.
            watermark_ms: mut watermark,
        } = self.recover().await?;
        // When the previous batch of this run started (for the input rate).
        let mut last_start: Option<Instant> = None;
        // The progress write in flight.
        let mut progress_write: Option<JoinHandle<()>> = None;
        if let Some(entry) = pending {
            last_start = Some(Instant::now());
            let p = self
                .run_batch(&entry, Duration::ZERO, Duration::ZERO, true, None)
                .await;
            let p = self.on_batch_error(p).await?;
            self.keep_progress(&p, &mut progress_write).await;
            report(p, &mut summary);
        }
        self.resolve_starts(&mut prev, &mut stop).await?;
        if matches!(self.trigger, Trigger::AvailableNow) {
            for t in &self.tables {
                let source = t.source();
                retry_transient(source.as_ref(), "freeze available data", &mut stop, || {
                    source.freeze()
                })
                .await?;
            }
        }

        let mut next_start = Instant::now();
        loop {
            if *stop.borrow() {
                break;
            }
            let t_plan = Instant::now();
            let (sources, any, next_watermark) =
                self.plan_next(&prev, next_id, watermark, &mut stop).await?;
            let plan_time = t_plan.elapsed();
            if !any {
                match self.trigger {
                    Trigger::AvailableNow | Trigger::Once => break,
                    Trigger::Continuous => {
                        self.wait_for_data(&prev, &mut stop).await;
                        continue;
                    }
                    Trigger::Interval(d) => {
                        let now = Instant::now();
                        next_start = next_trigger(next_start, d, now);
                        wait(&mut stop, next_start.saturating_duration_since(now)).await;
                        continue;
                    }
                }
            }
            let mut entry = OffsetsEntry::new(next_id, now_ms(), sources);
            entry.watermark_ms = next_watermark;
            for t in &self.static_tables {
                entry
                    .tables
                    .insert(t.name().to_string(), t.version_for_batch().await?);
            }
            let t_wa = Instant::now();
            self.ckpt.write_offsets(&entry).await?;
            let wa_time = t_wa.elapsed();
            let since_last = last_start.map(|t| t.elapsed());
            last_start = Some(t_plan);
            let p = self
                .run_batch(&entry, plan_time, wa_time, false, since_last)
                .await;
            let p = self.on_batch_error(p).await?;
            self.keep_progress(&p, &mut progress_write).await;
            report(p, &mut summary);
            if (next_id + 1).is_multiple_of(self.snapshot_interval) {
                self.write_snapshots(next_id).await;
            }
            for (name, r) in entry.sources {
                if !r.end.is_null() {
                    prev.insert(name, Some(r.end));
                }
            }
            watermark = next_watermark;
            next_id += 1;
            match self.trigger {
                Trigger::Once => break,
                Trigger::Interval(d) => {
                    let now = Instant::now();
                    next_start = next_start.checked_add(d).unwrap_or(now);
                    if next_start > now {
                        wait(&mut stop, next_start - now).await;
                    } else {
                        next_start = now;
                    }
                }
                _ => {}
            }
        }
        if let Some(w) = progress_write {
            let _ = w.await;
        }
        for o in &self.outputs {
            o.sink.flush().await;
        }
        if let Some(st) = &self.stateful {
            // A snapshot being written in the background is finished, so
            // the next start reads it rather than the deltas before it.
            st.wait_for_snapshot().await;
        }
        if summary.table_version.is_none() {
            summary.table_version = self.outputs[0].sink.version().await?;
        }
        Ok(summary)
    }
}
