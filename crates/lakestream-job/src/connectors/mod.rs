//! The connector registry: which `STORED AS` name makes which source or
//! sink of a job file.
//!
//! Each connector registers a factory under its `STORED AS` name (upper
//! case) with the options it accepts: [`SourceConnector`] for `UNBOUNDED`
//! tables, [`SinkConnector`] for the `INSERT` target. Before a factory runs,
//! the registry refuses options the connector does not list (storage
//! options `aws.*`, `google.*`, `azure.*` are every connector's, and a
//! connector may pass a prefix through to its client, as Kafka does with
//! `kafka.*`): a typo must never change a job silently. [`TableContext`]
//! gives a factory the declaration, its options parsed and checked
//! (numbers, sizes, booleans, durations, times; errors positioned at the
//! declaration), and the job's storage options and checkpoint.
//!
//! The built-in connectors ([`Connectors::builtin`]): `JSON`, `CSV`,
//! `PARQUET`, `AVRO` (files, [`files`]), `KAFKA` ([`kafka`]), `GENERATOR`
//! ([`generator`]) and `DELTA` ([`delta`]) as sources; `DELTA` as the sink. An
//! embedding program adds its own with [`Connectors::register_source`] /
//! [`Connectors::register_sink`] and runs jobs with them through the
//! engine's `JobOptions::connectors`.
//! Static tables (not `UNBOUNDED`, not the target) are DataFusion's:
//! any format it reads, or `DELTA`.

pub mod delta;
pub mod files;
pub mod generator;
pub mod kafka;
pub mod settings;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use crate::parse_size;
/// What connector factories return: the job crate's result, whose error
/// is a job error positioned at the declaration ([`TableContext::error`])
/// or a source's, sink's, checkpoint's or store's own error.
pub use crate::{Error, Result};

use async_trait::async_trait;
use lakestream_sink::Sink;
use lakestream_source::Source;
use lakestream_storage::normalize_option_key;

use crate::{Job, TableDecl};

/// A factory of stream sources for one `STORED AS` name.
#[async_trait]
pub trait SourceConnector: Send + Sync {
    /// The options the connector accepts (storage options aside).
    fn options(&self) -> &'static [&'static str];

    /// Option keys with this prefix go to the connector's client as they
    /// are (Kafka: `kafka.`); the connector checks them itself.
    fn passthrough_prefix(&self) -> Option<&'static str> {
        None
    }

    /// The source for the `UNBOUNDED` table of `ctx`. Errors about the
    /// declaration come from [`TableContext::error`].
    async fn create(&self, ctx: &TableContext<'_>) -> Result<Arc<dyn Source>>;
}

/// A factory of sinks for one `STORED AS` name.
#[async_trait]
pub trait SinkConnector: Send + Sync {
    /// The options the connector accepts (storage options aside).
    fn options(&self) -> &'static [&'static str];

    /// The sink for the `INSERT` target of `ctx`.
    async fn create(&self, ctx: &TableContext<'_>) -> Result<Arc<dyn Sink>>;
}

/// The connectors a job can name, keyed by `STORED AS`.
#[derive(Clone)]
pub struct Connectors {
    sources: BTreeMap<String, Arc<dyn SourceConnector>>,
    sinks: BTreeMap<String, Arc<dyn SinkConnector>>,
}

impl std::fmt::Debug for Connectors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connectors")
            .field("sources", &self.sources.keys().collect::<Vec<_>>())
            .field("sinks", &self.sinks.keys().collect::<Vec<_>>())
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
        }
    }

    /// The connectors lakestream ships: files (`JSON`, `CSV`, `PARQUET`, `AVRO`),
    /// `KAFKA`, `GENERATOR` and `DELTA` sources, the `DELTA` sink.
    pub fn builtin() -> Self {
        let mut c = Self::empty();
        for format in ["JSON", "CSV", "PARQUET", "AVRO"] {
            c.register_source(format, Arc::new(files::FilesConnector));
        }
        c.register_source("KAFKA", Arc::new(kafka::KafkaConnector));
        c.register_source("GENERATOR", Arc::new(generator::GeneratorConnector));
        c.register_source("DELTA", Arc::new(delta::DeltaSourceConnector));
        c.register_sink("DELTA", Arc::new(delta::DeltaConnector));
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

    /// The source of the `UNBOUNDED` table `t` of `job`, for a run
    /// checkpointed at `checkpoint` with the job's `storage_options`.
    pub async fn source(
        &self,
        job: &Job,
        t: &TableDecl,
        checkpoint: &str,
        storage_options: &HashMap<String, String>,
    ) -> Result<Arc<dyn Source>> {
        let ctx = TableContext {
            job,
            table: t,
            checkpoint,
            storage_options,
        };
        let Some(c) = self.sources.get(&t.format) else {
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
    pub async fn sink(
        &self,
        job: &Job,
        t: &TableDecl,
        checkpoint: &str,
        storage_options: &HashMap<String, String>,
    ) -> Result<Arc<dyn Sink>> {
        let ctx = TableContext {
            job,
            table: t,
            checkpoint,
            storage_options,
        };
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
        ctx.check_options(&allowed, None)?;
        c.create(&ctx).await
    }
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

/// What a connector's factory sees: one table declaration of a job, its
/// options read and checked, and the run's settings.
pub struct TableContext<'a> {
    job: &'a Job,
    table: &'a TableDecl,
    checkpoint: &'a str,
    storage_options: &'a HashMap<String, String>,
}

impl<'a> TableContext<'a> {
    /// The declaration.
    pub fn table(&self) -> &'a TableDecl {
        self.table
    }

    /// The job the declaration is in.
    pub fn job(&self) -> &'a Job {
        self.job
    }

    /// The run's checkpoint location (a connector may keep state there,
    /// as the files connector keeps an inferred schema).
    pub fn checkpoint(&self) -> &'a str {
        self.checkpoint
    }

    /// The job's storage options (its `SET aws.* = ...` statements and the
    /// run's options), before the table's own.
    pub fn storage_options(&self) -> &'a HashMap<String, String> {
        self.storage_options
    }

    /// An error about the declaration, positioned at it (exit code 2).
    pub fn error(&self, message: impl Into<String>) -> Error {
        self.job.error(self.table.pos, message)
    }

    /// The table's storage options: the job's, then the table's own.
    /// Keys are normalized first, so two spellings of one key cannot both
    /// be present and race.
    pub fn store_options(&self) -> HashMap<String, String> {
        table_store_options(self.table, self.storage_options)
    }

    /// The raw value of option `key`.
    pub fn option(&self, key: &str) -> Option<&'a str> {
        self.table.options.get(key).map(String::as_str)
    }

    /// The first of `keys` the table sets, with its value (for options
    /// with two spellings).
    pub fn first_option(&self, keys: &[&'static str]) -> Option<(&'static str, &'a str)> {
        keys.iter().find_map(|k| self.option(k).map(|v| (*k, v)))
    }

    /// A count or size option: `1000`, `64MB`, `1GiB`, `128k`.
    pub fn number(&self, key: &str) -> Result<Option<u64>> {
        match self.option(key) {
            None => Ok(None),
            Some(v) => parse_size(v).map(Some).ok_or_else(|| {
                self.error(format!(
                    "option {key} of table {} must be a number, got {v:?}",
                    self.table.name
                ))
            }),
        }
    }

    /// A count option as `usize` (saturating).
    pub fn count(&self, key: &str) -> Result<Option<usize>> {
        Ok(self
            .number(key)?
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)))
    }

    /// A `true` / `false` option (any case); anything else is an error.
    pub fn boolean(&self, key: &str) -> Result<Option<bool>> {
        self.option(key)
            .map(|v| self.parse_bool(key, v))
            .transpose()
    }

    /// `v` as the value of boolean option `key`.
    pub fn parse_bool(&self, key: &str, v: &str) -> Result<bool> {
        match v.to_ascii_lowercase().as_str() {
            "true" => Ok(true),
            "false" => Ok(false),
            _ => Err(self.error(format!(
                "option {key} of {}: {v:?} is not true or false",
                self.table.name
            ))),
        }
    }

    /// A duration option (`30s`, `5m`, `7d`, at most a year), or the
    /// message `what` when it is not one.
    pub fn duration(
        &self,
        key: &str,
        what: impl FnOnce(&str) -> String,
    ) -> Result<Option<Duration>> {
        match self.option(key) {
            None => Ok(None),
            Some(v) => crate::parse_duration(v)
                .map(Some)
                .ok_or_else(|| self.error(what(v))),
        }
    }

    /// What the stream does with a record it cannot decode: `on_error`
    /// (`fail`, the default, or `dead_letter`), which must come with
    /// `dead_letter_location` (the table the engine writes them to) and
    /// the other way round.
    pub fn on_error(&self) -> Result<lakestream_source::OnError> {
        use lakestream_source::OnError;
        let name = &self.table.name;
        let policy = match self.option("on_error") {
            None => OnError::Fail,
            Some(v) => OnError::from_name(v).ok_or_else(|| {
                self.error(format!(
                    "option on_error of {name}: {v:?} is not a policy; use 'fail' (the \
                     default) or 'dead_letter'"
                ))
            })?,
        };
        match (policy, self.option("dead_letter_location")) {
            (OnError::DeadLetter, None) => Err(self.error(format!(
                "{name} sets on_error 'dead_letter' without dead_letter_location: name the \
                 Delta table its undecodable records go to, e.g. 'dead_letter_location' \
                 'out/{name}_dead_letters'"
            ))),
            (OnError::Fail, Some(_)) => Err(self.error(format!(
                "{name} sets dead_letter_location but not on_error 'dead_letter': without it \
                 an undecodable record fails the batch and nothing goes there"
            ))),
            _ => Ok(policy),
        }
    }

    /// A time option: RFC 3339 (`2026-01-31T12:00:00Z`) or a date
    /// (`2026-01-31`, midnight UTC), as ms since the epoch.
    pub fn time_ms(&self, key: &str) -> Result<Option<i64>> {
        let Some(v) = self.option(key) else {
            return Ok(None);
        };
        let parsed = chrono::DateTime::parse_from_rfc3339(v)
            .map(|d| d.timestamp_millis())
            .ok()
            .or_else(|| {
                chrono::NaiveDate::parse_from_str(v, "%Y-%m-%d")
                    .ok()
                    .and_then(|d| d.and_hms_opt(0, 0, 0))
                    .map(|d| d.and_utc().timestamp_millis())
            });
        parsed.map(Some).ok_or_else(|| {
            self.error(format!(
                "option {key} of {}: {v:?} is not a time; use 2026-01-31 or 2026-01-31T12:00:00Z",
                self.table.name
            ))
        })
    }

    /// Refuse an option that is not in `allowed`, not a storage option and
    /// not under `passthrough`.
    fn check_options(&self, allowed: &[&str], passthrough: Option<&str>) -> Result<()> {
        let t = self.table;
        for key in t.options.keys() {
            let passed = is_storage_key(key) || passthrough.is_some_and(|p| key.starts_with(p));
            if !allowed.contains(&key.as_str()) && !passed {
                return Err(self.error(format!(
                    "unknown option {key:?} for table {} (STORED AS {}); valid options: {}",
                    t.name,
                    t.format,
                    allowed.join(", ")
                )));
            }
        }
        Ok(())
    }
}

/// The storage options of table `t`: `base` (the job's), then the
/// table's own, keys normalized (static tables use it too).
pub fn table_store_options(
    t: &TableDecl,
    base: &HashMap<String, String>,
) -> HashMap<String, String> {
    let mut o = base.clone();
    for (k, v) in &t.options {
        if is_storage_key(k) {
            o.insert(normalize_option_key(k), v.clone());
        }
    }
    o
}

/// Whether a table option key is a storage option (`aws.*`, `google.*`,
/// `azure.*`, or with `_` for `.`).
pub(crate) fn is_storage_key(key: &str) -> bool {
    ["aws.", "google.", "azure.", "aws_", "google_", "azure_"]
        .iter()
        .any(|p| key.starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connector_lists_read_as_prose() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(one_of(names(&["DELTA"]).iter()), "DELTA");
        assert_eq!(one_of(names(&["A", "B", "C"]).iter()), "A, B or C");
    }
}
