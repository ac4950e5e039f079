//! `STORED AS GENERATOR`: the deterministic event generator as a source.

use std::sync::Arc;

use crate::Source;
use crate::generator::{GeneratorOptions, GeneratorSource};
use arrow::datatypes::{DataType, Schema, TimeUnit};
use async_trait::async_trait;

use crate::SourceConnector;
use lakestream_job::Result;
use lakestream_job::connector::TableContext;

/// Builds [`GeneratorSource`]s: `rows` (default 1000 when no rate is
/// given), `rows_per_second`, `seed`, `max_rows_per_trigger`, `batch_size`.
#[derive(Debug, Default)]
pub struct GeneratorConnector;

#[async_trait]
impl SourceConnector for GeneratorConnector {
    fn describe_range(
        &self,
        kind: &str,
        start: &crate::Offset,
        end: &crate::Offset,
    ) -> Option<Vec<String>> {
        if kind != "generator" {
            return None;
        }
        // Offsets are row numbers; a first batch starts at row 0.
        let (s, e) = (start.as_u64().unwrap_or(0), end.as_u64()?);
        Some(vec![format!(
            "rows [{s}, {e}) ({} rows)",
            e.saturating_sub(s)
        )])
    }

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
            && !same_declared_columns(declared, &source.schema())
        {
            return Err(ctx.error(format!(
                "a GENERATOR table has the columns ({}); declare those or none",
                lakestream_job::describe_schema(&source.schema())
            )));
        }
        Ok(Arc::new(source))
    }
}

/// Whether `declared` names the generator's columns, in order, with their
/// types as a declaration can spell them (any string type for a string,
/// any timestamp for the UTC microsecond timestamp).
fn same_declared_columns(declared: &Schema, actual: &Schema) -> bool {
    fn loose(t: &DataType) -> DataType {
        match t {
            DataType::Timestamp(_, _) => DataType::Timestamp(TimeUnit::Microsecond, None),
            DataType::Utf8View | DataType::LargeUtf8 => DataType::Utf8,
            other => other.clone(),
        }
    }
    declared.fields().len() == actual.fields().len()
        && declared
            .fields()
            .iter()
            .zip(actual.fields())
            .all(|(d, a)| d.name() == a.name() && loose(d.data_type()) == loose(a.data_type()))
}
