//! Progress of a running query: one [`BatchProgress`] per batch.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Where the time of a batch went, in milliseconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Durations {
    /// Asking the sources for new offsets.
    pub plan_ms: f64,
    /// Writing `offsets/N`.
    pub write_ahead_ms: f64,
    /// Reading, running the query and writing data files.
    pub execute_ms: f64,
    /// The table commit and `commits/N`.
    pub commit_ms: f64,
    /// The whole batch.
    pub total_ms: f64,
}

/// One source's range in a batch.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct SourceProgress {
    /// Offset before the batch (`null` before the first).
    pub start: Option<serde_json::Value>,
    /// Offset after the batch.
    pub end: Option<serde_json::Value>,
    /// A human summary such as "files 2..4".
    pub description: String,
    /// Rows read from this source.
    pub input_rows: u64,
    /// Records of this source that could not be decoded and went to the
    /// dead-letter table (`on_error 'dead_letter'`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dead_letters: u64,
    /// How far the source is through the input it knows of, when it can
    /// tell (files: taken and listed, with bytes).
    pub backlog: Option<lakestream_source::Backlog>,
    /// Input the batch left out by the user's choice (a vanished file
    /// with `missing_files 'skip'`), also recorded in the commit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<lakestream_source::Skipped>,
    /// What the source reads, as `kind[location]` (`files[s3://b/in/]`).
    pub identity: String,
    /// The newest offset the source saw available when the batch was
    /// planned (Kafka: high watermarks), when it can tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latest: Option<serde_json::Value>,
    /// Units available and not yet planned after this batch, per part of
    /// the source (Kafka: `topic/partition` -> offsets).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub lag: BTreeMap<String, u64>,
}

/// One output's part of a batch, for a query with several outputs.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct OutputProgress {
    /// What the output writes to (`delta file:///...`).
    pub sink: String,
    /// Rows written to its table by this batch.
    pub output_rows: u64,
    /// Data files written.
    pub output_files: usize,
    /// Bytes of data files written.
    pub output_bytes: u64,
    /// Its table's version holding the batch.
    pub table_version: Option<u64>,
    /// True when its table already held the batch (a replay after a crash
    /// between two outputs' commits) and nothing was written to it.
    pub skipped: bool,
}

/// What one batch did. Printed per batch by the CLI (`--progress-json`).
///
/// A stateful query's batches also carry the event-time watermark they ran
/// with and their aggregation's state figures.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct BatchProgress {
    /// The query id.
    pub query_id: String,
    /// This run's id: new each time the query starts.
    pub run_id: String,
    /// The query's name, when it has one (a job's file name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The batch id.
    pub batch_id: u64,
    /// The batch's timestamp (ms since the epoch; what `now()` returns in
    /// it), fixed when it was planned.
    pub timestamp_ms: i64,
    /// What the sink writes to (`delta file:///...`); the first output's
    /// when the query has several.
    pub sink: String,
    /// Rows read from all sources.
    pub input_rows: u64,
    /// Rows written to the table (to all outputs' tables, summed, when the
    /// query has several).
    pub output_rows: u64,
    /// Data files written.
    pub output_files: usize,
    /// Bytes of data files written.
    pub output_bytes: u64,
    /// Input rows per second of batch time.
    pub rows_per_second: f64,
    /// Input rows per second of wall time since the previous batch of this
    /// run started (the rate data arrived at); 0 for a run's first batch.
    pub input_rows_per_second: f64,
    /// Time split.
    pub durations: Durations,
    /// Per-source ranges.
    pub sources: BTreeMap<String, SourceProgress>,
    /// Table version after the batch (the first output's).
    pub table_version: Option<u64>,
    /// Each output's part, in the query's order, when it has several.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub outputs: Vec<OutputProgress>,
    /// Times the batch's commit found its version taken by another writer
    /// and was retried.
    pub commit_retries: u64,
    /// Output rows that broke a rule of their table (a CHECK constraint,
    /// a NOT NULL column, a generated column's expression) and went to the
    /// dead-letter table instead.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rule_violations: u64,
    /// True when the batch was found already in the table (every output's
    /// table, when it has several: replay after a crash) and nothing was
    /// written.
    pub skipped: bool,
    /// True when this batch was re-run from the write-ahead log at start.
    pub recovered: bool,
    /// Why the batch was dropped instead of committed, when it was: in
    /// Kafka group mode, another process moved one of its partitions'
    /// positions in the table first (a rebalance); its range is read by
    /// whoever owns the partition now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub superseded: Option<String>,
    /// The event-time watermark the batch ran with (ms since the epoch),
    /// when the query has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub watermark_ms: Option<i64>,
    /// The largest event time the batch read (ms since the epoch), over
    /// the sources with an event time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_time_max_ms: Option<i64>,
    /// The aggregation's state after the batch, when the query has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<crate::stateful::StateProgress>,
}

impl BatchProgress {
    /// One human line: `batch 3: 1200 rows in 45 ms (26.7k rows/s) -> 2 files, table v4 [events: files 4..6]`.
    pub fn human_line(&self) -> String {
        let srcs: Vec<String> = self
            .sources
            .iter()
            .map(|(k, v)| format!("{k}: {}", v.description))
            .collect();
        let what = if self.skipped {
            "already in the table, skipped".to_string()
        } else {
            format!(
                "{} rows in, {} rows out in {:.0} ms ({:.1}k rows/s) -> {} files",
                self.input_rows,
                self.output_rows,
                self.durations.total_ms,
                self.rows_per_second / 1000.0,
                self.output_files
            )
        };
        let skipped: Vec<String> = self
            .sources
            .iter()
            .flat_map(|(k, v)| {
                v.skipped
                    .iter()
                    .map(move |x| format!("; {k} skipped {}: {}", x.what, x.reason))
                    .chain((v.dead_letters > 0).then(|| {
                        format!("; {k}: {} records to the dead-letter table", v.dead_letters)
                    }))
            })
            .collect();
        let done: Vec<String> = self
            .sources
            .values()
            .filter_map(|s| s.backlog)
            .filter(|b| b.total > 0)
            .map(|b| {
                format!(
                    ", {}/{} files ({})",
                    b.done,
                    b.total,
                    percent(b.bytes_done, b.bytes_total)
                )
            })
            .collect();
        let version = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
        let tables = if self.outputs.is_empty() {
            format!("table v{}", version(self.table_version))
        } else {
            // `delta file:///x/clean` -> `clean v3`
            let each: Vec<String> = self
                .outputs
                .iter()
                .map(|o| {
                    let name = o
                        .sink
                        .trim_end_matches('/')
                        .rsplit('/')
                        .next()
                        .unwrap_or("");
                    format!("{name} v{}", version(o.table_version))
                })
                .collect();
            format!("tables {}", each.join(", "))
        };
        format!(
            "batch {}{}: {what}, {tables} [{}{}]{}",
            self.batch_id,
            if self.recovered { " (recovered)" } else { "" },
            srcs.join("; "),
            skipped.concat(),
            done.concat()
        )
    }

    /// This batch in the shape of Spark's `StreamingQueryProgress` (`id`,
    /// `runId`, `batchId`, `numInputRows`, `durationMs`, `eventTime`,
    /// `stateOperators`, `sources`, `sink`, ...), so dashboards and parsers
    /// written for Spark read it, with lakestream's own fields beside
    /// Spark's (`batch_id`, `durations`, `table_version`, ...). Spark's
    /// `sources` is a list of objects, each with lakestream's `name`,
    /// `range`, `backlog`, `lag` and `skipped` added.
    pub fn spark_json(&self) -> serde_json::Value {
        use serde_json::{Value, json};
        let iso = |ms: i64| {
            chrono::DateTime::from_timestamp_millis(ms)
                .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        };
        let total_s = self.durations.total_ms / 1000.0;
        let sources: Vec<Value> = self
            .sources
            .iter()
            .map(|(name, s)| {
                let processed = if total_s > 0.0 {
                    s.input_rows as f64 / total_s
                } else {
                    0.0
                };
                let share = if self.input_rows > 0 {
                    s.input_rows as f64 / self.input_rows as f64
                } else {
                    0.0
                };
                let mut o = json!({
                    "description": s.identity,
                    "startOffset": s.start,
                    "endOffset": s.end,
                    "latestOffset": s.latest,
                    "numInputRows": s.input_rows,
                    "inputRowsPerSecond": self.input_rows_per_second * share,
                    "processedRowsPerSecond": processed,
                    "name": name,
                    "range": s.description,
                });
                if let Some(b) = s.backlog {
                    o["backlog"] = json!(b);
                }
                if !s.lag.is_empty() {
                    o["lag"] = json!(s.lag);
                }
                if !s.skipped.is_empty() {
                    o["skipped"] = json!(s.skipped);
                }
                if s.dead_letters > 0 {
                    o["deadLetters"] = json!(s.dead_letters);
                }
                o
            })
            .collect();
        let mut event_time = serde_json::Map::new();
        if let Some(w) = self.watermark_ms.and_then(iso) {
            event_time.insert("watermark".into(), json!(w));
        }
        if let Some(m) = self.event_time_max_ms.and_then(iso) {
            event_time.insert("max".into(), json!(m));
        }
        let state_operators: Vec<Value> = self
            .state
            .iter()
            .map(|st| {
                json!({
                    "operatorName": st.operator,
                    "numRowsTotal": st.rows,
                    "numRowsUpdated": st.rows_updated,
                    "numRowsRemoved": st.rows_evicted,
                    "memoryUsedBytes": st.memory_bytes,
                    "numRowsDroppedByWatermark": st.rows_dropped_by_watermark,
                    "customMetrics": { "numRowsWithoutEventTime": st.rows_without_event_time },
                })
            })
            .collect();
        let mut out = match serde_json::to_value(self).expect("progress serializes") {
            Value::Object(m) => m,
            _ => unreachable!("a struct serializes to an object"),
        };
        let spark = json!({
            "id": self.query_id,
            "runId": self.run_id,
            "name": self.name,
            "timestamp": iso(self.timestamp_ms),
            "batchId": self.batch_id,
            "batchDuration": self.durations.total_ms.round() as u64,
            "numInputRows": self.input_rows,
            "inputRowsPerSecond": self.input_rows_per_second,
            "processedRowsPerSecond": self.rows_per_second,
            "durationMs": {
                "latestOffset": self.durations.plan_ms.round() as u64,
                "walCommit": self.durations.write_ahead_ms.round() as u64,
                "addBatch": self.durations.execute_ms.round() as u64,
                "commitOffsets": self.durations.commit_ms.round() as u64,
                "triggerExecution": self.durations.total_ms.round() as u64,
            },
            "eventTime": event_time,
            "stateOperators": state_operators,
            "sources": sources,
            "sink": { "description": self.sink, "numOutputRows": self.output_rows },
        });
        if let Value::Object(m) = spark {
            out.extend(m);
        }
        Value::Object(out)
    }

    /// The input known to all sources that report a backlog, summed.
    pub fn backlog(&self) -> Option<lakestream_source::Backlog> {
        let mut sum: Option<lakestream_source::Backlog> = None;
        for b in self.sources.values().filter_map(|s| s.backlog) {
            let s = sum.get_or_insert_with(Default::default);
            s.done += b.done;
            s.total += b.total;
            s.bytes_done += b.bytes_done;
            s.bytes_total += b.bytes_total;
        }
        sum
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// `done` of `total` as a percentage of bytes, such as "42% of bytes".
fn percent(done: u64, total: u64) -> String {
    if total == 0 {
        return "0 bytes".into();
    }
    format!("{:.0}% of bytes", done as f64 * 100.0 / total as f64)
}
