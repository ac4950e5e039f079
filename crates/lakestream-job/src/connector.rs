//! What a connector's factory sees of a job: one table declaration, its
//! options read and checked ([`TableContext`]), and the run's settings.
//!
//! A connector is a factory registered under a `STORED AS` name
//! (`lakestream-source`'s `SourceConnector`, `lakestream-sink`'s
//! `SinkConnector`, next to the implementations they build); the engine's
//! registry turns a job's tables into sources and sinks through them.
//! Before a factory runs, the registry refuses options the connector does
//! not list ([`TableContext::check_options`]): storage options `aws.*`,
//! `google.*`, `azure.*` are every connector's, and a connector may pass a
//! prefix through to its client, as Kafka does with `kafka.*`. A typo must
//! never change a job silently. Options are parsed here (numbers, sizes,
//! booleans, durations, times), with errors positioned at the declaration.

use std::collections::HashMap;
use std::time::Duration;

use lakestream_storage::{Location, StoreRegistry, normalize_option_key};

use crate::{Error, Job, Result, TableDecl, parse_size};

/// What every table of a run shares: where its checkpoint is and how it
/// reaches storage.
#[derive(Debug, Clone, Default)]
pub struct RunStorage {
    /// The checkpoint location (a path or URL).
    pub checkpoint: String,
    /// The job's storage options (its `SET aws.* = ...` statements and
    /// the run's options), before each table's own.
    pub options: HashMap<String, String>,
    /// The stores the embedding program serves some buckets with; every
    /// location of the run is resolved through them.
    pub object_stores: StoreRegistry,
}

/// What a connector's factory sees: one table declaration of a job, its
/// options read and checked, and the run's settings.
pub struct TableContext<'a> {
    job: &'a Job,
    table: &'a TableDecl,
    run: &'a RunStorage,
}

impl<'a> TableContext<'a> {
    /// The context of table `table` of `job`, for a run with `run`'s
    /// checkpoint and storage.
    pub fn new(job: &'a Job, table: &'a TableDecl, run: &'a RunStorage) -> Self {
        Self { job, table, run }
    }

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
        &self.run.checkpoint
    }

    /// The run's checkpoint, resolved through the run's stores.
    pub fn checkpoint_location(&self) -> lakestream_storage::Result<Location> {
        Location::parse_with(
            &self.run.checkpoint,
            &self.run.options,
            &self.run.object_stores,
        )
    }

    /// The stores the embedding program serves some buckets with; a
    /// connector resolves every location of the table through them.
    pub fn object_stores(&self) -> &'a StoreRegistry {
        &self.run.object_stores
    }

    /// The job's storage options (its `SET aws.* = ...` statements and the
    /// run's options), before the table's own.
    pub fn storage_options(&self) -> &'a HashMap<String, String> {
        &self.run.options
    }

    /// An error about the declaration, positioned at it (exit code 2).
    pub fn error(&self, message: impl Into<String>) -> Error {
        self.job.error(self.table.pos, message)
    }

    /// The table's storage options: the job's, then the table's own.
    /// Keys are normalized first, so two spellings of one key cannot both
    /// be present and race.
    pub fn store_options(&self) -> HashMap<String, String> {
        table_store_options(self.table, &self.run.options)
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
    pub fn check_options(&self, allowed: &[&str], passthrough: Option<&str>) -> Result<()> {
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
pub fn is_storage_key(key: &str) -> bool {
    ["aws.", "google.", "azure.", "aws_", "google_", "azure_"]
        .iter()
        .any(|p| key.starts_with(p))
}
