//! Prometheus metrics of running queries.
//!
//! [`Metrics`] holds a `prometheus-client` [`Registry`] that every query
//! given it ([`crate::QueryBuilder::metrics`]) updates after each batch:
//! counters of batches and rows, histograms of batch time and its phases,
//! gauges of Kafka lag, file backlog, watermark delay, state size, the last
//! committed batch and the table version. Every series carries the query id
//! (`query`), and the source (`source`) where it is about one. The CLI
//! serves [`Metrics::encode`] on `/metrics` of `--metrics-addr`; an
//! embedding service mounts [`Metrics::registry`] in its own server.
//!
//! Names follow Prometheus conventions: `lakestream_` prefix, the unit in
//! the name (`_seconds`, `_bytes`, `_rows`), counters ending in `_total`.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::progress::BatchProgress;

/// Labels of a query-wide series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Query {
    query: String,
}

/// Labels of a per-source series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Source {
    query: String,
    source: String,
}

/// Labels of a per-partition series (Kafka: `topic/partition`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Partition {
    query: String,
    source: String,
    partition: String,
}

/// Labels of a batch phase.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Phase {
    query: String,
    phase: String,
}

/// Labels of a stateful operator.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Operator {
    query: String,
    operator: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

fn seconds_histogram() -> Histogram {
    // 1 ms .. ~65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// The metrics of the queries that report to it (see the module docs).
pub struct Metrics {
    registry: Registry,
    batches: Family<Query, Counter>,
    batches_skipped: Family<Query, Counter>,
    batches_superseded: Family<Query, Counter>,
    input_rows: Family<Source, Counter>,
    dead_letters: Family<Source, Counter>,
    output_rows: Family<Query, Counter>,
    output_files: Family<Query, Counter>,
    output_bytes: Family<Query, Counter>,
    commit_retries: Family<Query, Counter>,
    batch_seconds: Family<Query, Histogram, fn() -> Histogram>,
    phase_seconds: Family<Phase, Histogram, fn() -> Histogram>,
    kafka_lag: Family<Partition, Gauge>,
    /// The partitions each source's lag series were last set for: a
    /// partition no longer planned (moved to another process in group
    /// mode) loses its series.
    lag_series: std::sync::Mutex<HashMap<Source, Vec<Partition>>>,
    backlog_files: Family<Source, Gauge>,
    backlog_bytes: Family<Source, Gauge>,
    watermark_delay: Family<Query, FloatGauge>,
    state_rows: Family<Operator, Gauge>,
    state_bytes: Family<Operator, Gauge>,
    state_memory: Family<Operator, Gauge>,
    rows_dropped_late: Family<Query, Counter>,
    last_batch: Family<Query, Gauge>,
    table_version: Family<Query, Gauge>,
    last_batch_time: Family<Query, FloatGauge>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Empty metrics with every lakestream series registered.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = Self {
            batches: Family::default(),
            batches_skipped: Family::default(),
            batches_superseded: Family::default(),
            input_rows: Family::default(),
            dead_letters: Family::default(),
            output_rows: Family::default(),
            output_files: Family::default(),
            output_bytes: Family::default(),
            commit_retries: Family::default(),
            batch_seconds: Family::new_with_constructor(seconds_histogram),
            phase_seconds: Family::new_with_constructor(seconds_histogram),
            kafka_lag: Family::default(),
            lag_series: Default::default(),
            backlog_files: Family::default(),
            backlog_bytes: Family::default(),
            watermark_delay: Family::default(),
            state_rows: Family::default(),
            state_bytes: Family::default(),
            state_memory: Family::default(),
            rows_dropped_late: Family::default(),
            last_batch: Family::default(),
            table_version: Family::default(),
            last_batch_time: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "lakestream_batches",
            "Micro-batches completed (committed, or found already in the table)",
            m.batches.clone(),
        );
        registry.register(
            "lakestream_dead_letter_records",
            "Records a source could not decode, written to the dead-letter table instead",
            m.dead_letters.clone(),
        );
        registry.register(
            "lakestream_batches_skipped",
            "Batches replayed after a restart and found already in the table",
            m.batches_skipped.clone(),
        );
        registry.register(
            "lakestream_batches_superseded",
            "Batches dropped because another process committed their partitions first (Kafka \
             group mode, around rebalances)",
            m.batches_superseded.clone(),
        );
        registry.register(
            "lakestream_input_rows",
            "Rows read from the source",
            m.input_rows.clone(),
        );
        registry.register(
            "lakestream_output_rows",
            "Rows written to the table",
            m.output_rows.clone(),
        );
        registry.register(
            "lakestream_output_files",
            "Data files written to the table",
            m.output_files.clone(),
        );
        registry.register(
            "lakestream_output_bytes",
            "Bytes of data files written to the table",
            m.output_bytes.clone(),
        );
        registry.register(
            "lakestream_commit_retries",
            "Commits that found their table version taken by another writer and were retried",
            m.commit_retries.clone(),
        );
        registry.register(
            "lakestream_batch_duration_seconds",
            "Wall time of a batch, from planning to its commit",
            m.batch_seconds.clone(),
        );
        registry.register(
            "lakestream_batch_phase_duration_seconds",
            "Wall time of a batch's phases: plan, write_ahead, execute, commit",
            m.phase_seconds.clone(),
        );
        registry.register(
            "lakestream_kafka_lag_records",
            "Records in a Kafka partition not yet planned into a batch (high watermark minus \
             the last planned end)",
            m.kafka_lag.clone(),
        );
        registry.register(
            "lakestream_file_backlog_files",
            "Files listed by a file source and not yet taken by a batch",
            m.backlog_files.clone(),
        );
        registry.register(
            "lakestream_file_backlog_bytes",
            "Bytes of the files listed and not yet taken",
            m.backlog_bytes.clone(),
        );
        registry.register(
            "lakestream_watermark_delay_seconds",
            "How far the event-time watermark is behind the wall clock",
            m.watermark_delay.clone(),
        );
        registry.register(
            "lakestream_state_rows",
            "Keys held by a stateful operator",
            m.state_rows.clone(),
        );
        registry.register(
            "lakestream_state_bytes",
            "Bytes of keys and values held by a stateful operator",
            m.state_bytes.clone(),
        );
        registry.register(
            "lakestream_state_memory_bytes",
            "Bytes of memory a stateful operator's keys and values take as held",
            m.state_memory.clone(),
        );
        registry.register(
            "lakestream_rows_dropped_by_watermark",
            "Input rows dropped by a stateful operator because they arrived after the watermark",
            m.rows_dropped_late.clone(),
        );
        registry.register(
            "lakestream_last_committed_batch",
            "Id of the last batch in the table",
            m.last_batch.clone(),
        );
        registry.register(
            "lakestream_table_version",
            "Table version after the last batch",
            m.table_version.clone(),
        );
        registry.register(
            "lakestream_last_batch_timestamp_seconds",
            "When the last batch was planned, in seconds since the Unix epoch",
            m.last_batch_time.clone(),
        );
        Self { registry, ..m }
    }

    /// The registry, to mount in an embedding service's own server or to
    /// add its own metrics to before handing `self` to queries.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The registry, to register a program's own series next to
    /// lakestream's before the metrics are shared with queries.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// The registry in the OpenMetrics text format (what `/metrics` serves,
    /// content type [`Metrics::CONTENT_TYPE`]).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }

    /// The content type of [`Metrics::encode`].
    pub const CONTENT_TYPE: &'static str =
        "application/openmetrics-text; version=1.0.0; charset=utf-8";

    /// Record batch `p`.
    pub(crate) fn observe(&self, p: &BatchProgress) {
        let q = Query {
            query: p.query_id.clone(),
        };
        self.batches.get_or_create(&q).inc();
        if p.skipped {
            self.batches_skipped.get_or_create(&q).inc();
        }
        if p.superseded.is_some() {
            self.batches_superseded.get_or_create(&q).inc();
        }
        self.output_rows.get_or_create(&q).inc_by(p.output_rows);
        self.output_files
            .get_or_create(&q)
            .inc_by(p.output_files as u64);
        self.output_bytes.get_or_create(&q).inc_by(p.output_bytes);
        self.commit_retries
            .get_or_create(&q)
            .inc_by(p.commit_retries);
        self.batch_seconds
            .get_or_create(&q)
            .observe(p.durations.total_ms / 1000.0);
        for (phase, ms) in [
            ("plan", p.durations.plan_ms),
            ("write_ahead", p.durations.write_ahead_ms),
            ("execute", p.durations.execute_ms),
            ("commit", p.durations.commit_ms),
        ] {
            self.phase_seconds
                .get_or_create(&Phase {
                    query: p.query_id.clone(),
                    phase: phase.into(),
                })
                .observe(ms / 1000.0);
        }
        for (name, s) in &p.sources {
            let src = Source {
                query: p.query_id.clone(),
                source: name.clone(),
            };
            self.input_rows.get_or_create(&src).inc_by(s.input_rows);
            if s.dead_letters > 0 {
                self.dead_letters.get_or_create(&src).inc_by(s.dead_letters);
            }
            let now: Vec<Partition> = s
                .lag
                .keys()
                .map(|part| Partition {
                    query: p.query_id.clone(),
                    source: name.clone(),
                    partition: part.clone(),
                })
                .collect();
            if let Some(before) = self
                .lag_series
                .lock()
                .expect("lag series")
                .insert(src.clone(), now.clone())
            {
                for gone in before.iter().filter(|b| !now.contains(b)) {
                    self.kafka_lag.remove(gone);
                }
            }
            for (part, lag) in &s.lag {
                self.kafka_lag
                    .get_or_create(&Partition {
                        query: p.query_id.clone(),
                        source: name.clone(),
                        partition: part.clone(),
                    })
                    .set(i64::try_from(*lag).unwrap_or(i64::MAX));
            }
            if let Some(b) = s.backlog {
                self.backlog_files
                    .get_or_create(&src)
                    .set(b.total.saturating_sub(b.done) as i64);
                self.backlog_bytes
                    .get_or_create(&src)
                    .set(b.bytes_total.saturating_sub(b.bytes_done) as i64);
            }
        }
        if let Some(w) = p.watermark_ms {
            let now = lakestream_checkpoint::now_ms();
            self.watermark_delay
                .get_or_create(&q)
                .set((now - w).max(0) as f64 / 1000.0);
        }
        if let Some(st) = &p.state {
            let op = Operator {
                query: p.query_id.clone(),
                operator: st.operator.clone(),
            };
            self.state_rows.get_or_create(&op).set(st.rows as i64);
            self.state_bytes.get_or_create(&op).set(st.bytes as i64);
            self.state_memory
                .get_or_create(&op)
                .set(st.memory_bytes as i64);
            self.rows_dropped_late
                .get_or_create(&q)
                .inc_by(st.rows_dropped_by_watermark);
        }
        self.last_batch.get_or_create(&q).set(p.batch_id as i64);
        if let Some(v) = p.table_version {
            self.table_version.get_or_create(&q).set(v as i64);
        }
        self.last_batch_time
            .get_or_create(&q)
            .set(p.timestamp_ms as f64 / 1000.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::progress::{Durations, SourceProgress};

    #[test]
    fn a_batch_shows_in_every_series_it_has_figures_for() {
        let m = Metrics::new();
        let mut p = BatchProgress {
            query_id: "q1".into(),
            batch_id: 4,
            input_rows: 10,
            output_rows: 7,
            output_files: 2,
            output_bytes: 900,
            table_version: Some(5),
            timestamp_ms: 1_700_000_000_000,
            durations: Durations {
                plan_ms: 1.0,
                write_ahead_ms: 2.0,
                execute_ms: 30.0,
                commit_ms: 7.0,
                total_ms: 40.0,
            },
            ..Default::default()
        };
        p.sources.insert(
            "orders".into(),
            SourceProgress {
                input_rows: 10,
                lag: [("tx/0".to_string(), 25u64)].into(),
                ..Default::default()
            },
        );
        m.observe(&p);
        m.observe(&BatchProgress {
            batch_id: 5,
            ..p.clone()
        });
        let text = m.encode();
        for line in [
            "lakestream_batches_total{query=\"q1\"} 2",
            "lakestream_input_rows_total{query=\"q1\",source=\"orders\"} 20",
            "lakestream_output_rows_total{query=\"q1\"} 14",
            "lakestream_commit_retries_total{query=\"q1\"} 0",
            "lakestream_kafka_lag_records{query=\"q1\",source=\"orders\",partition=\"tx/0\"} 25",
            "lakestream_last_committed_batch{query=\"q1\"} 5",
            "lakestream_table_version{query=\"q1\"} 5",
            "lakestream_batch_duration_seconds_count{query=\"q1\"} 2",
            "lakestream_batch_phase_duration_seconds_count{query=\"q1\",phase=\"execute\"} 2",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn a_partition_no_longer_read_loses_its_lag_series_and_a_dropped_batch_is_counted() {
        let m = Metrics::new();
        let batch = |parts: &[&str], superseded: bool| {
            let mut p = BatchProgress {
                query_id: "q1".into(),
                superseded: superseded.then(|| "moved".to_string()),
                ..Default::default()
            };
            p.sources.insert(
                "orders".into(),
                SourceProgress {
                    lag: parts.iter().map(|p| (p.to_string(), 3u64)).collect(),
                    ..Default::default()
                },
            );
            p
        };
        m.observe(&batch(&["t/0", "t/1"], false));
        // Partition 0 moved to another process (group mode).
        m.observe(&batch(&["t/1"], true));
        let text = m.encode();
        assert!(!text.contains("partition=\"t/0\""), "{text}");
        assert!(text.contains("partition=\"t/1\"} 3"), "{text}");
        assert!(
            text.contains("lakestream_batches_superseded_total{query=\"q1\"} 1"),
            "{text}"
        );
    }
}
