//! The connector registry: which `STORED AS` name makes which source or
//! sink of a job file.
//!
//! Each connector registers a factory under its `STORED AS` name (upper
//! case): a [`SourceConnector`] for `UNBOUNDED` tables, a
//! [`SinkConnector`] for output tables (`INSERT` targets and dead-letter
//! tables). Each factory lives beside the implementation it builds, in its
//! connector's crate. Before a factory runs, the registry refuses options the
//! connector does not list ([`TableContext::check_options`]): a typo must
//! never change a job silently.
//!
//! The built-in connectors ([`Connectors::builtin`]): `JSON`, `CSV`,
//! `PARQUET`, `AVRO` (files), `KAFKA` (with the `kafka` feature),
//! `GENERATOR` and `DELTA` as sources; `DELTA` as the sink. An embedding
//! program adds its own with [`Connectors::register_source`] /
//! [`Connectors::register_sink`] and runs jobs with them through
//! [`JobOptions::connectors`](crate::job::JobOptions::connectors).
//! Static tables (not `UNBOUNDED`, not an output) are DataFusion's: any
//! format it reads, or `DELTA`.

use std::collections::BTreeMap;
use std::sync::Arc;

pub use lakestream_job::connector::{
    RunStorage, TableContext, is_storage_key, table_store_options,
};
pub use lakestream_job::{Error, Result};
pub use lakestream_sink::SinkConnector;
pub use lakestream_source::SourceConnector;

use async_trait::async_trait;
use lakestream_job::{Job, TableDecl};

use crate::QueryBuilder;
use lakestream_sink::Sink;
use lakestream_source::Source;

/// A factory of static tables for one `STORED AS` name: tables a query
/// reads in each batch, neither `UNBOUNDED` nor an output (a dimension
/// table joined by every batch). Formats without one are DataFusion's,
/// read whole at job start.
#[async_trait]
pub trait StaticConnector: Send + Sync {
    /// The options the connector accepts (storage options aside).
    fn options(&self) -> &'static [&'static str];

    /// Add the static table of `ctx` to the query `builder` builds (as
    /// [`QueryBuilder::static_table`] or
    /// [`QueryBuilder::static_delta_table`] do).
    async fn add(
        &self,
        ctx: &TableContext<'_>,
        builder: QueryBuilder,
    ) -> crate::Result<QueryBuilder>;
}

/// The connectors a job can name, keyed by `STORED AS`.
#[derive(Clone)]
pub struct Connectors {
    sources: BTreeMap<String, Arc<dyn SourceConnector>>,
    sinks: BTreeMap<String, Arc<dyn SinkConnector>>,
    statics: BTreeMap<String, Arc<dyn StaticConnector>>,
}

impl std::fmt::Debug for Connectors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connectors")
            .field("sources", &self.sources.keys().collect::<Vec<_>>())
            .field("sinks", &self.sinks.keys().collect::<Vec<_>>())
            .field("statics", &self.statics.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Default for Connectors {
    fn default() -> Self {
        Self::builtin()
    }
}

impl Connectors {
    /// No connector at all.
    pub fn empty() -> Self {
        Self {
            sources: BTreeMap::new(),
            sinks: BTreeMap::new(),
            statics: BTreeMap::new(),
        }
    }

    /// The connectors lakestream ships: files (`JSON`, `CSV`, `PARQUET`, `AVRO`),
    /// `KAFKA` (with the `kafka` feature), `GENERATOR` and `DELTA` sources,
    /// the `DELTA` sink.
    pub fn builtin() -> Self {
        use lakestream_source::{files, generator};
        let mut c = Self::empty();
        for format in ["JSON", "CSV", "PARQUET", "AVRO"] {
            c.register_source(format, Arc::new(files::connector::FilesConnector));
        }
        #[cfg(feature = "kafka")]
        {
            c.register_source(
                "KAFKA",
                Arc::new(lakestream_source::kafka::connector::KafkaConnector),
            );
            c.register_sink("KAFKA", Arc::new(lakestream_kafka::KafkaSinkConnector));
        }
        c.register_source(
            "GENERATOR",
            Arc::new(generator::connector::GeneratorConnector),
        );
        c.register_source("DELTA", Arc::new(lakestream_delta::DeltaSourceConnector));
        c.register_sink("DELTA", Arc::new(lakestream_delta::DeltaConnector));
        c.register_static("DELTA", Arc::new(crate::static_delta::StaticDeltaConnector));
        c
    }

    /// Make `STORED AS name` (any case) on an `UNBOUNDED` table build its
    /// source with `connector`, replacing a connector of that name.
    pub fn register_source(&mut self, name: &str, connector: Arc<dyn SourceConnector>) {
        self.sources.insert(name.to_ascii_uppercase(), connector);
    }

    /// Make `STORED AS name` (any case) on the `INSERT` target build its
    /// sink with `connector`, replacing a connector of that name.
    pub fn register_sink(&mut self, name: &str, connector: Arc<dyn SinkConnector>) {
        self.sinks.insert(name.to_ascii_uppercase(), connector);
    }

    /// Make `STORED AS name` (any case) on a static table build it with
    /// `connector`, replacing a connector of that name.
    pub fn register_static(&mut self, name: &str, connector: Arc<dyn StaticConnector>) {
        self.statics.insert(name.to_ascii_uppercase(), connector);
    }

    /// Add the static table `t` of `job` to the query `builder` builds:
    /// through its `STORED AS` name's static connector, or else as a
    /// DataFusion table of that format read at job start.
    pub async fn add_static(
        &self,
        job: &Job,
        t: &TableDecl,
        run: &RunStorage,
        builder: QueryBuilder,
    ) -> crate::Result<QueryBuilder> {
        let ctx = TableContext::new(job, t, run);
        match self.statics.get(&t.format) {
            Some(c) => {
                ctx.check_options(c.options(), None)?;
                c.add(&ctx, builder).await
            }
            None => datafusion_static(&ctx, builder).await,
        }
    }

    /// The source of the `UNBOUNDED` table `t` of `job`, for a run with
    /// `run`'s checkpoint and storage.
    pub async fn source(
        &self,
        job: &Job,
        t: &TableDecl,
        run: &RunStorage,
    ) -> Result<Arc<dyn Source>> {
        let ctx = TableContext::new(job, t, run);
        let Some(c) = self.sources.get(&t.format) else {
            if cfg!(not(feature = "kafka")) && t.format == "KAFKA" {
                return Err(ctx.error(format!(
                    "STORED AS KAFKA (table {}) needs lakestream built with the `kafka` cargo \
                     feature (on by default; this build was made without it)",
                    t.name
                )));
            }
            return Err(ctx.error(format!(
                "STORED AS {} is not supported for a stream (UNBOUNDED table {}); use {}",
                t.format,
                t.name,
                one_of(self.sources.keys())
            )));
        };
        let allowed: Vec<&str> = c.options().iter().chain(STREAM_OPTIONS).copied().collect();
        ctx.check_options(&allowed, c.passthrough_prefix())?;
        c.create(&ctx).await
    }

    /// The sink of the `INSERT` target `t` of `job` (see
    /// [`Connectors::source`]).
    pub async fn sink(&self, job: &Job, t: &TableDecl, run: &RunStorage) -> Result<Arc<dyn Sink>> {
        let ctx = TableContext::new(job, t, run);
        let Some(c) = self.sinks.get(&t.format) else {
            return Err(ctx.error(format!(
                "the output table {} must be STORED AS {}",
                t.name,
                one_of(self.sinks.keys())
            )));
        };
        if t.unbounded {
            return Err(ctx.error(format!("the output table {} cannot be UNBOUNDED", t.name)));
        }
        let allowed: Vec<&str> = c.options().iter().chain(OUTPUT_OPTIONS).copied().collect();
        ctx.check_options(&allowed, c.passthrough_prefix())?;
        c.create(&ctx).await
    }
}

impl Connectors {
    /// Lines that tell a reader what a range recorded in a commit's
    /// lineage holds: `source` is the record's `kind[location]`, and the
    /// connector of that kind reads `start` and `end` through its typed
    /// offsets. An offset too long to record whole (kept as its digest)
    /// says where the full one is; anything no connector reads is printed
    /// as JSON.
    pub fn describe_range(
        &self,
        source: &str,
        start: &serde_json::Value,
        end: &serde_json::Value,
    ) -> Vec<String> {
        if end.is_null() {
            return vec!["no new data".into()];
        }
        if let Some(d) = lakestream_protocol::lineage::RecordedDigest::of(end) {
            return vec![format!(
                "a long offset ({} bytes of JSON) recorded as its sha256 {}; the checkpoint's {} \
                 holds it in full while it retains the batch",
                d.bytes.map_or_else(|| "?".into(), |b| b.to_string()),
                d.sha256,
                d.checkpoint
            )];
        }
        let kind = source.split('[').next().unwrap_or(source);
        self.sources
            .values()
            .find_map(|c| c.describe_range(kind, start, end))
            .unwrap_or_else(|| vec![format!("from {start} to {end}")])
    }
}

/// The format of every dead-letter table (`dead_letter_location`).
pub const DEAD_LETTER_FORMAT: &str = "DELTA";

impl Connectors {
    /// The sink of the dead-letter table of stream table `t` at `location`
    /// (its `dead_letter_location`, or a scratch location under a test
    /// run's output): the `DELTA` sink connector's, with `t`'s storage
    /// options, as if declared by `t`.
    pub async fn dead_letter_sink(
        &self,
        job: &Job,
        t: &TableDecl,
        location: &str,
        run: &RunStorage,
    ) -> Result<Arc<dyn Sink>> {
        let decl = TableDecl {
            name: format!("{}_dead_letters", t.name),
            format: DEAD_LETTER_FORMAT.into(),
            location: location.into(),
            schema: None,
            options: t
                .options
                .iter()
                .filter(|(k, _)| is_storage_key(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            unbounded: false,
            partition_cols: Vec::new(),
            statement: t.statement.clone(),
            pos: t.pos,
        };
        self.sink(job, &decl, run).await
    }
}

/// A static table of a format no static connector is registered for:
/// DataFusion's own (`CSV`, `PARQUET`, `JSON`, `AVRO`, `ARROW`), read whole
/// once at job start through the job's store and kept in memory.
async fn datafusion_static(
    ctx: &TableContext<'_>,
    builder: QueryBuilder,
) -> crate::Result<QueryBuilder> {
    let t = ctx.table();
    let err = |msg: String| -> crate::Error { ctx.error(msg).into() };
    let storage = ctx.store_options();
    let session = builder.context();
    // DataFusion reads the files through the same store the rest of
    // the job uses (credentials, endpoint, retries).
    let loc = lakestream_storage::Location::parse_with(&t.location, &storage, ctx.object_stores())?;
    if loc.local_dir().is_none() {
        session.register_object_store(loc.url(), loc.store().clone());
    }
    let plan = session
        .state()
        .statement_to_plan(t.statement.clone())
        .await
        .map_err(|e| err(e.strip_backtrace()))?;
    session
        .execute_logical_plan(plan)
        .await
        .map_err(|e| err(e.strip_backtrace()))?;
    // Load once: a static table is read as of job start, so every
    // batch (and every replay of a batch) joins the same rows.
    let df = session
        .table(t.name.as_str())
        .await
        .map_err(|e| err(e.strip_backtrace()))?;
    let schema: arrow::datatypes::SchemaRef = Arc::new(df.schema().as_arrow().clone());
    let batches = df.collect().await.map_err(|e| {
        err(format!(
            "cannot read {}: {}",
            t.location,
            e.strip_backtrace()
        ))
    })?;
    session
        .deregister_table(t.name.as_str())
        .map_err(|e| err(e.strip_backtrace()))?;
    let provider: Arc<dyn datafusion::datasource::TableProvider> = Arc::new(
        datafusion::datasource::MemTable::try_new(schema, vec![batches])
            .map_err(|e| err(e.strip_backtrace()))?,
    );
    session
        .register_table(t.name.as_str(), provider)
        .map_err(|e| crate::Error::Plan(Box::new(e)))?;
    Ok(builder)
}

/// Options every stream table takes, whatever its connector: its event
/// time column and watermark delay (read by the engine).
pub const STREAM_OPTIONS: &[&str] = &["event_time", "watermark_delay"];

/// Options every output table takes, whatever its connector: when an
/// aggregation's groups are written (read by the engine).
pub const OUTPUT_OPTIONS: &[&str] = &["output_mode"];

/// `A`, `A or B`, `A, B or C`.
fn one_of<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let names: Vec<&str> = names.map(String::as_str).collect();
    match names.split_last() {
        None => "a registered connector (none is registered)".into(),
        Some((last, [])) => (*last).to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_ranges_are_described_by_their_kinds_connector() {
        use serde_json::json;
        let c = Connectors::builtin();
        let files = c.describe_range(
            "files[file:///in/]",
            &json!(null),
            &json!({"count": 5, "files": [
                {"path": "in/a.json", "size": 1, "mtime_ms": 1},
                {"path": "in/b.json", "size": 1, "mtime_ms": 2}]}),
        );
        assert_eq!(
            files,
            [
                "2 files (files 3..5 of the source)",
                "in/a.json",
                "in/b.json"
            ]
        );
        #[cfg(feature = "kafka")]
        {
            let kafka = c.describe_range(
                "kafka[t]",
                &json!({"partitions": {"t": {"0": 10, "1": 4}}}),
                &json!({"partitions": {"t": {"0": 15, "1": 4, "2": 3}},
                        "added": {"t": {"2": 0}}}),
            );
            assert_eq!(
                kafka,
                [
                    "t/0: offsets [10, 15) (5 records)",
                    "t/2: offsets [0, 3) (3 records)"
                ]
            );
        }
        assert_eq!(
            c.describe_range("generator[g]", &json!(100), &json!(250)),
            ["rows [100, 250) (150 rows)"]
        );
        assert_eq!(
            c.describe_range(
                "delta[file:///t/]",
                &json!({"version": 3, "index": 0, "snapshot": true}),
                &json!({"version": 5, "index": 2}),
            ),
            [
                "files from the snapshot at version 3, after its first 0 files to commit 5, \
              after its first 2 files"
            ]
        );
        let digest = lakestream_protocol::lineage::recorded_offset(&json!("x".repeat(20_000)), 7);
        let lines = c.describe_range("kafka[t]", &json!(null), &digest);
        assert!(
            lines[0].contains("offsets/7") && lines[0].contains("20002 bytes"),
            "{lines:?}"
        );
        // A kind no connector knows, or offsets that are not its kind's.
        assert_eq!(
            c.describe_range("mine[x]", &json!(1), &json!({"a": 2})),
            [r#"from 1 to {"a":2}"#]
        );
        assert_eq!(
            c.describe_range("files[x]", &json!(null), &json!(null)),
            ["no new data"]
        );
    }

    #[test]
    fn connector_lists_read_as_prose() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(one_of(names(&["DELTA"]).iter()), "DELTA");
        assert_eq!(one_of(names(&["A", "B", "C"]).iter()), "A, B or C");
    }
}
