//! `STORED AS DELTA` as the `INSERT` target: the Delta sink.

use std::sync::Arc;

use async_trait::async_trait;
use lakestream_sink::Sink;
use lakestream_sink::delta::{DeltaSink, DeltaSinkOptions};

use super::{SinkConnector, TableContext};
use crate::Result;

/// Builds [`DeltaSink`]s: `target_file_size`, `compression`,
/// `auto_compact_every`, `checkpoint_interval`; `PARTITIONED BY` columns.
#[derive(Debug, Default)]
pub struct DeltaConnector;

#[async_trait]
impl SinkConnector for DeltaConnector {
    fn options(&self) -> &'static [&'static str] {
        &[
            "target_file_size",
            "compression",
            "auto_compact_every",
            "checkpoint_interval",
        ]
    }

    async fn create(&self, ctx: &TableContext<'_>) -> Result<Arc<dyn Sink>> {
        let t = ctx.table();
        let mut o = DeltaSinkOptions {
            partition_columns: t.partition_cols.clone(),
            storage_options: ctx.store_options(),
            ..Default::default()
        };
        o.auto_compact_every = ctx.number("auto_compact_every")?.filter(|n| *n > 0);
        if let Some(n) = ctx.number("target_file_size")? {
            o.target_file_size = n;
        }
        if let Some(n) = ctx.number("checkpoint_interval")? {
            if n == 0 {
                return Err(ctx.error("checkpoint_interval must be at least 1"));
            }
            o.checkpoint_interval = n;
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
