//! `STORED AS DELTA`: the Delta sink as the `INSERT` target, and the
//! Delta source for an `UNBOUNDED` table.

use std::sync::Arc;

use async_trait::async_trait;
use lakestream_job::Result;
use lakestream_job::connector::TableContext;
use lakestream_sink::{Sink, SinkConnector};
use lakestream_source::{Source, SourceConnector};

use crate::{DeltaSink, DeltaSinkOptions, DeltaSource, DeltaSourceOptions};

/// Builds [`DeltaSink`]s: `target_file_size`, `unordered_flush_size`,
/// `compression`, `auto_compact_every`, `checkpoint_interval`, `merge_schema`;
/// `PARTITIONED BY` columns.
#[derive(Debug, Default)]
pub struct DeltaConnector;

#[async_trait]
impl SinkConnector for DeltaConnector {
    fn options(&self) -> &'static [&'static str] {
        &[
            "target_file_size",
            "unordered_flush_size",
            "compression",
            "auto_compact_every",
            "checkpoint_interval",
            "merge_schema",
        ]
    }

    async fn create(&self, ctx: &TableContext<'_>) -> Result<Arc<dyn Sink>> {
        let t = ctx.table();
        let mut o = DeltaSinkOptions {
            partition_columns: t.partition_cols.clone(),
            storage_options: ctx.store_options(),
            object_stores: ctx.object_stores().clone(),
            ..Default::default()
        };
        o.auto_compact_every = ctx.number("auto_compact_every")?.filter(|n| *n > 0);
        if let Some(n) = ctx.number("target_file_size")? {
            o.target_file_size = n;
        }
        if let Some(n) = ctx.number("unordered_flush_size")? {
            o.unordered_flush_size = n;
        }
        if let Some(n) = ctx.number("checkpoint_interval")? {
            if n == 0 {
                return Err(ctx.error("checkpoint_interval must be at least 1"));
            }
            o.checkpoint_interval = n;
        }
        if let Some(merge) = ctx.boolean("merge_schema")? {
            let mode = t.options.get("output_mode").map(|m| m.to_ascii_lowercase());
            if merge && mode.as_deref().is_some_and(|m| m != "append") {
                return Err(ctx.error(format!(
                    "{}: merge_schema adds columns with appended batches; an aggregation in \
                     output_mode {:?} cannot change the table's columns",
                    t.name,
                    mode.unwrap_or_default()
                )));
            }
            o.merge_schema = merge;
        }
        if let Some(c) = ctx.option("compression") {
            o.compression = DeltaSinkOptions::parse_compression(c).ok_or_else(|| {
                ctx.error(format!(
                    "unknown compression {c:?}: use snappy, zstd, lz4 or none"
                ))
            })?;
        }
        Ok(Arc::new(DeltaSink::try_new(&t.location, o)?))
    }
}

/// Builds [`DeltaSource`]s for
/// `UNBOUNDED` tables `STORED AS DELTA`: `starting_version`,
/// `starting_timestamp`,
/// `max_files_per_trigger`, `max_bytes_per_trigger`,
/// `skip_change_commits`, `read_change_feed`, `batch_size`. The schema is
/// the table's (with the change-feed columns when reading the feed): a
/// declared column list must name those columns.
#[derive(Debug, Default)]
pub struct DeltaSourceConnector;

#[async_trait]
impl SourceConnector for DeltaSourceConnector {
    fn describe_range(
        &self,
        kind: &str,
        start: &lakestream_source::Offset,
        end: &lakestream_source::Offset,
    ) -> Option<Vec<String>> {
        if kind != "delta" {
            return None;
        }
        crate::source::describe_range(start, end)
    }

    fn options(&self) -> &'static [&'static str] {
        &[
            "starting_version",
            "starting_timestamp",
            "max_files_per_trigger",
            "max_bytes_per_trigger",
            "skip_change_commits",
            "read_change_feed",
            "batch_size",
        ]
    }

    async fn create(&self, ctx: &TableContext<'_>) -> Result<Arc<dyn Source>> {
        let t = ctx.table();
        let mut o = DeltaSourceOptions {
            storage_options: ctx.store_options(),
            object_stores: ctx.object_stores().clone(),
            ..Default::default()
        };
        o.starting_version = ctx.number("starting_version")?;
        o.starting_timestamp_ms = ctx.time_ms("starting_timestamp")?;
        if o.starting_version.is_some() && o.starting_timestamp_ms.is_some() {
            return Err(ctx.error(format!(
                "table {}: give starting_version or starting_timestamp, not both",
                t.name
            )));
        }
        if let Some(n) = ctx.number("max_files_per_trigger")? {
            o.max_files_per_trigger = n;
        }
        o.max_bytes_per_trigger = ctx.number("max_bytes_per_trigger")?;
        if let Some(b) = ctx.boolean("skip_change_commits")? {
            o.skip_change_commits = b;
        }
        if let Some(b) = ctx.boolean("read_change_feed")? {
            o.read_change_feed = b;
        }
        if o.read_change_feed && o.skip_change_commits {
            return Err(ctx.error(format!(
                "table {}: read_change_feed reads the changes skip_change_commits would pass \
                 over; give one of them",
                t.name
            )));
        }
        if let Some(n) = ctx.count("batch_size")? {
            o.batch_size = n.max(1);
        }
        let source = DeltaSource::try_new(&t.name, &t.location, o).await?;
        if let Some(declared) = &t.schema {
            let actual = source.schema();
            let names = |s: &arrow::datatypes::Schema| {
                s.fields()
                    .iter()
                    .map(|f| f.name().to_ascii_lowercase())
                    .collect::<Vec<_>>()
            };
            if names(declared) != names(&actual) {
                return Err(ctx.error(format!(
                    "the Delta table {} has the columns {}, not {}: leave the column list out \
                     (a Delta source reads the table's own schema)",
                    t.location,
                    names(&actual).join(", "),
                    names(declared).join(", ")
                )));
            }
        }
        Ok(Arc::new(source))
    }
}
