//! `STORED AS JSON | CSV | PARQUET` on an `UNBOUNDED` table: new files
//! under a location, as a source.

use std::collections::HashMap;
use std::sync::Arc;

use crate::Source;
use crate::files::{FileFormat, FileSource, FileSourceOptions, MissingFiles, TextCompression};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use async_trait::async_trait;

use crate::SourceConnector;
use lakestream_job::connector::TableContext;
use lakestream_job::{Error, Result};

/// Builds [`FileSource`]s; the format is the `STORED AS` name.
#[derive(Debug, Default)]
pub struct FilesConnector;

#[async_trait]
impl SourceConnector for FilesConnector {
    fn describe_range(
        &self,
        kind: &str,
        _start: &crate::Offset,
        end: &crate::Offset,
    ) -> Option<Vec<String>> {
        if kind != "files" {
            return None;
        }
        let end: crate::files::FilesOffset = serde_json::from_value(end.clone()).ok()?;
        Some(end.describe())
    }

    fn options(&self) -> &'static [&'static str] {
        &[
            "max_files_per_trigger",
            "max_bytes_per_trigger",
            "batch_size",
            "has_header",
            "format.has_header",
            "delimiter",
            "format.delimiter",
            "path_glob",
            "modified_after",
            "modified_before",
            "compression",
            "incremental_listing",
            "read_concurrency",
            "missing_files",
            "max_file_age",
            "on_error",
            "dead_letter_location",
            "schema_evolution",
            "shard",
        ]
    }

    async fn create(&self, ctx: &TableContext<'_>) -> Result<Arc<dyn Source>> {
        let t = ctx.table();
        let Some(mut format) = FileFormat::from_name(&t.format) else {
            return Err(ctx.error(format!(
                "STORED AS {} is not a file format (JSON, CSV, PARQUET, AVRO)",
                t.format
            )));
        };
        if let FileFormat::Csv {
            has_header,
            delimiter,
        } = &mut format
        {
            if let Some((key, v)) = ctx.first_option(&["format.has_header", "has_header"]) {
                *has_header = ctx.parse_bool(key, v)?;
            }
            if let Some((key, v)) = ctx.first_option(&["format.delimiter", "delimiter"]) {
                *delimiter = match v.as_bytes() {
                    [b] => *b,
                    _ => {
                        return Err(ctx.error(format!(
                            "option {key} of {}: {v:?} is not one ASCII character",
                            t.name
                        )));
                    }
                };
            }
        }
        let mut fo = FileSourceOptions::new(format.clone());
        fo.max_files_per_trigger = ctx.count("max_files_per_trigger")?;
        if let Some(b) = ctx.number("max_bytes_per_trigger")? {
            // The user's cap, whatever the query holds in memory.
            fo.max_bytes_per_trigger = Some(b);
            fo.held_max_bytes_per_trigger = None;
        }
        if let Some(b) = ctx.count("batch_size")? {
            fo.batch_size = b;
        }
        if let Some(n) = ctx.count("read_concurrency")? {
            fo.read_concurrency = n;
        }
        if let Some(v) = ctx.option("max_file_age") {
            let d = lakestream_job::parse_duration(v)
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    ctx.error(format!(
                        "max_file_age {v:?} for {}: give a duration above 0 and at most a \
                         year, such as 7d or 12h",
                        t.name
                    ))
                })?;
            fo.max_file_age_ms = Some(i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        }
        if let Some(v) = ctx.option("missing_files") {
            fo.missing_files = MissingFiles::from_name(v).ok_or_else(|| {
                ctx.error(format!(
                    "missing_files {v:?} for {}: use fail or skip",
                    t.name
                ))
            })?;
        }
        fo.on_error = crate::on_error(ctx)?;
        if let Some(v) = ctx.option("shard") {
            fo.shard = Some(crate::files::Shard::parse(v).ok_or_else(|| {
                ctx.error(format!(
                    "option shard of {}: {v:?} is not a shard; give 'i/n' with 0 <= i < n, \
                     e.g. '0/4' .. '3/4' for four processes",
                    t.name
                ))
            })?);
        }
        if let Some(v) = ctx.option("schema_evolution") {
            fo.schema_evolution = match v.to_ascii_lowercase().as_str() {
                "none" => false,
                "add_new_columns" => true,
                _ => {
                    return Err(ctx.error(format!(
                        "option schema_evolution of {}: {v:?} is not a mode; use \
                         'add_new_columns' or 'none' (the default)",
                        t.name
                    )));
                }
            };
            if fo.schema_evolution && t.schema.is_some() {
                return Err(ctx.error(format!(
                    "{} declares its columns and sets schema_evolution 'add_new_columns': the \
                     schema evolves when it is inferred (and kept in the checkpoint); declare \
                     new columns yourself, or leave the column list out",
                    t.name
                )));
            }
        }
        fo.path_glob = ctx.option("path_glob").map(str::to_string);
        fo.modified_after_ms = ctx.time_ms("modified_after")?;
        fo.modified_before_ms = ctx.time_ms("modified_before")?;
        if let Some(v) = ctx.option("compression") {
            fo.compression = TextCompression::from_name(v).ok_or_else(|| {
                ctx.error(format!(
                    "compression {v:?} for {}: use auto, none, gzip or zstd",
                    t.name
                ))
            })?;
        }
        if let Some(b) = ctx.boolean("incremental_listing")? {
            fo.incremental_listing = b;
        }
        fo.partition_columns = t.partition_cols.clone();
        fo.object_stores = ctx.object_stores().clone();
        let store_opts = ctx.store_options();
        let schema = match &t.schema {
            Some(s) => s.clone(),
            None => inferred_schema(ctx, &fo, &store_opts).await?,
        };
        // Partition columns not declared are strings read from the directory names.
        let schema = if t.partition_cols.iter().all(|p| schema.index_of(p).is_ok()) {
            schema
        } else {
            let mut fields: Vec<Field> =
                schema.fields().iter().map(|f| f.as_ref().clone()).collect();
            for p in &t.partition_cols {
                if schema.index_of(p).is_err() {
                    fields.push(Field::new(p, DataType::Utf8, true));
                }
            }
            Arc::new(Schema::new(fields))
        };
        Ok(Arc::new(FileSource::try_new(
            &t.name,
            &t.location,
            &store_opts,
            schema,
            fo,
        )?))
    }
}

/// The schema of a stream declared without columns: inferred from its first
/// file once, then fixed in the checkpoint so every restart reads the same.
async fn inferred_schema(
    ctx: &TableContext<'_>,
    fo: &FileSourceOptions,
    store_opts: &HashMap<String, String>,
) -> Result<SchemaRef> {
    let t = ctx.table();
    pinned_columns(ctx, async {
        let Some(schema) = FileSource::infer_schema(&t.name, &t.location, store_opts, fo).await?
        else {
            return Err(ctx.error(format!(
                "cannot infer the schema of {}: no file under {} yet; declare the columns in \
                 the CREATE statement",
                t.name, t.location
            )));
        };
        Ok(schema.as_ref().clone())
    })
    .await
}

/// The columns of a table declared without them: those kept in the
/// checkpoint (`sources/<table>/schema`), or else what `infer` finds,
/// kept there first, so every restart and replay reads with the same.
pub(crate) async fn pinned_columns(
    ctx: &TableContext<'_>,
    infer: impl std::future::Future<Output = Result<arrow::datatypes::Schema>>,
) -> Result<SchemaRef> {
    let t = ctx.table();
    let ckpt = ctx
        .checkpoint_location()
        .map_err(lakestream_checkpoint::Error::from)?;
    let stored = lakestream_checkpoint::read_source_state(&ckpt, &t.name, "schema").await?;
    let corrupt = |reason: String| {
        Error::from(lakestream_checkpoint::Error::Corrupt {
            file: format!(
                "{}/sources/{}/schema",
                ctx.checkpoint().trim_end_matches('/'),
                t.name
            ),
            reason: format!("{reason} (the stored schema of the table {})", t.name),
        })
    };
    if let Some(v) = stored {
        return schema_from_json(&v).map_err(corrupt);
    }
    let schema = infer.await?;
    let v =
        lakestream_checkpoint::init_source_state(&ckpt, &t.name, "schema", schema_to_json(&schema))
            .await?;
    schema_from_json(&v).map_err(corrupt)
}

/// The format [`schema_to_json`] writes.
pub const SCHEMA_FORMAT: u64 = 2;

/// A stream's schema as the checkpoint keeps it (`sources/<table>/schema`):
/// `{"format": 2, "schema": ...}` with arrow-schema's own serde form of the
/// schema (every type, nested ones included, and metadata). Format 1, an
/// array of `{name, type, nullable}` with types as Arrow prints them, is
/// still read.
pub fn schema_to_json(schema: &Schema) -> serde_json::Value {
    serde_json::json!({
        "format": SCHEMA_FORMAT,
        "schema": serde_json::to_value(schema).expect("a schema serializes"),
    })
}

/// Read what [`schema_to_json`] (or an older version) wrote; the error
/// says what is wrong with it.
fn schema_from_json(v: &serde_json::Value) -> std::result::Result<SchemaRef, String> {
    if let Some(fields) = v.as_array() {
        return schema_from_format_1(fields).ok_or_else(|| "not a schema lakestream wrote".into());
    }
    match v.get("format").and_then(|f| f.as_u64()) {
        Some(SCHEMA_FORMAT) => v
            .get("schema")
            .cloned()
            .ok_or_else(|| "no schema in it".to_string())
            .and_then(|s| serde_json::from_value::<Schema>(s).map_err(|e| e.to_string()))
            .map(Arc::new),
        Some(n) if n > SCHEMA_FORMAT => Err(format!(
            "format {n}, written by a newer lakestream (this one reads formats 1 to \
             {SCHEMA_FORMAT}): run the query with that version"
        )),
        _ => Err("not a schema lakestream wrote".into()),
    }
}

/// Format 1: `[{name, type, nullable}]`.
fn schema_from_format_1(fields: &[serde_json::Value]) -> Option<SchemaRef> {
    let mut out = Vec::new();
    for f in fields {
        let t: DataType = f.get("type")?.as_str()?.parse().ok()?;
        out.push(Field::new(
            f.get("name")?.as_str()?,
            t,
            f.get("nullable")?.as_bool()?,
        ));
    }
    Some(Arc::new(Schema::new(out)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inferred_schemas_round_trip_through_json() {
        let s = Schema::new(vec![
            Field::new("a", DataType::Int64, true),
            Field::new(
                "ts",
                DataType::Timestamp(arrow::datatypes::TimeUnit::Nanosecond, None),
                false,
            ),
        ]);
        let back = schema_from_json(&schema_to_json(&s)).unwrap();
        assert_eq!(back.as_ref(), &s);
    }

    #[test]
    fn nested_types_and_metadata_round_trip_and_older_and_newer_formats_are_told_apart() {
        let s = Schema::new(vec![
            Field::new(
                "user",
                DataType::Struct(
                    vec![
                        Field::new("id", DataType::Int64, false),
                        Field::new_list("tags", Field::new_list_field(DataType::Utf8, true), true),
                    ]
                    .into(),
                ),
                true,
            ),
            Field::new("amount", DataType::Decimal128(12, 2), true),
        ])
        .with_metadata([("origin".to_string(), "inferred".to_string())].into());
        let stored = schema_to_json(&s);
        assert_eq!(stored["format"], 2);
        assert_eq!(schema_from_json(&stored).unwrap().as_ref(), &s);
        // Format 1, as earlier versions wrote it.
        let v1 = serde_json::json!([
            {"name": "a", "type": "Int64", "nullable": true},
            {"name": "ts", "type": "Timestamp(Nanosecond, None)", "nullable": false}
        ]);
        let back = schema_from_json(&v1).unwrap();
        assert_eq!(back.field(1).data_type().to_string(), "Timestamp(ns)");
        let newer = serde_json::json!({"format": 3, "schema": {}});
        let e = schema_from_json(&newer).unwrap_err();
        assert!(e.contains("format 3, written by a newer lakestream"), "{e}");
        assert!(schema_from_json(&serde_json::json!({"x": 1})).is_err());
    }
}
