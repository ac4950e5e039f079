//! `STORED AS GENERATOR`: the deterministic event generator as a source.

use std::sync::Arc;

use async_trait::async_trait;
use lakestream_sink::delta::delta_schema;
use lakestream_source::Source;
use lakestream_source::generator::{GeneratorOptions, GeneratorSource};

use super::{SourceConnector, TableContext};
use crate::Result;
use lakestream_sink::describe_schema;

/// Builds [`GeneratorSource`]s: `rows` (default 1000 when no rate is
/// given), `rows_per_second`, `seed`, `max_rows_per_trigger`, `batch_size`.
#[derive(Debug, Default)]
pub struct GeneratorConnector;

#[async_trait]
impl SourceConnector for GeneratorConnector {
    fn options(&self) -> &'static [&'static str] {
        &[
            "rows",
            "rows_per_second",
            "seed",
            "max_rows_per_trigger",
            "batch_size",
        ]
    }

    async fn create(&self, ctx: &TableContext<'_>) -> Result<Arc<dyn Source>> {
        let t = ctx.table();
        let mut g = GeneratorOptions {
            rows: ctx.number("rows")?,
            rows_per_second: ctx.number("rows_per_second")?,
            max_rows_per_trigger: ctx.number("max_rows_per_trigger")?,
            ..Default::default()
        };
        if let Some(s) = ctx.number("seed")? {
            g.seed = s;
        }
        if let Some(b) = ctx.count("batch_size")? {
            g.batch_size = b;
        }
        if g.rows.is_none() && g.rows_per_second.is_none() {
            g.rows = Some(1000);
        }
        let source = GeneratorSource::try_new(&t.name, g)?;
        if let Some(declared) = &t.schema
            && delta_schema(declared) != delta_schema(&source.schema())
        {
            return Err(ctx.error(format!(
                "a GENERATOR table has the columns ({}); declare those or none",
                describe_schema(&source.schema())
            )));
        }
        Ok(Arc::new(source))
    }
}
