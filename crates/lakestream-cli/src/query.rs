//! `lakestream query`: DataFusion SQL over tables named by path or by a
//! name given with `--table NAME=LOCATION`.

use std::collections::HashMap;
use std::ops::ControlFlow;

use anyhow::{Context, bail};
use datafusion::datasource::file_format::options::{
    CsvReadOptions, JsonReadOptions, ParquetReadOptions,
};
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::{DFParser, Statement};
use datafusion::sql::sqlparser::ast::visit_relations;
use lakestream_engine::storage::Location;

/// Run `sql`, registering each of `tables` (name, location) and each
/// quoted path it names as a table, and print the result in `format`
/// (`table`, `json` lines or `csv`).
pub(crate) async fn query(
    sql: &str,
    format: &str,
    tables: &[(String, String)],
    options: &HashMap<String, String>,
) -> anyhow::Result<()> {
    let ctx = SessionContext::new();
    for (name, location) in tables {
        register(&ctx, name, location, options)
            .await
            .with_context(|| format!("cannot open table {name} at {location:?}"))?;
    }
    let statements = DFParser::parse_sql(sql).map_err(|e| anyhow::anyhow!(e.strip_backtrace()))?;
    let mut names = Vec::new();
    for stmt in &statements {
        if let Statement::Statement(s) = stmt {
            let _ = visit_relations(s.as_ref(), |rel| {
                if let Some(part) = rel.0.last()
                    && let Some(ident) = part.as_ident()
                {
                    names.push(ident.value.clone());
                }
                ControlFlow::<()>::Continue(())
            });
        }
    }
    names.sort();
    names.dedup();
    for name in names {
        let named = tables.iter().any(|(t, _)| t == &name);
        if !named && looks_like_path(&name) {
            register(&ctx, &name, &name, options)
                .await
                .with_context(|| format!("cannot open table {name:?}"))?;
        }
    }
    let df = ctx
        .sql(sql)
        .await
        .map_err(|e| anyhow::anyhow!(e.strip_backtrace()))?;
    let batches = df
        .collect()
        .await
        .map_err(|e| anyhow::anyhow!(e.strip_backtrace()))?;
    match format {
        "json" => {
            let mut w = arrow::json::LineDelimitedWriter::new(std::io::stdout().lock());
            for b in &batches {
                w.write(b)?;
            }
            w.finish()?;
        }
        "csv" => {
            let mut w = arrow::csv::Writer::new(std::io::stdout().lock());
            for b in &batches {
                w.write(b)?;
            }
        }
        _ => outln!("{}", arrow::util::pretty::pretty_format_batches(&batches)?),
    }
    Ok(())
}

fn looks_like_path(name: &str) -> bool {
    name.contains('/') || name.contains('.') || std::path::Path::new(name).exists()
}

/// Register the table at `location` as `name`.
async fn register(
    ctx: &SessionContext,
    name: &str,
    location: &str,
    options: &HashMap<String, String>,
) -> anyhow::Result<()> {
    // One local file (`data/users.parquet`): read as it is.
    let file = std::path::Path::new(location);
    if file.is_file() {
        let ext = extension_of(file).unwrap_or_default();
        return register_files(ctx, name, location, &ext).await;
    }
    let loc = Location::parse(location, options)?;
    let local = loc.local_dir().map(|p| p.to_path_buf());
    let is_delta = match &local {
        Some(p) => p.join("_delta_log").is_dir(),
        None => true,
    };
    if is_delta {
        // A table that is there but cannot be loaded is an error, never a
        // reason to read its data files raw (they include removed files).
        let table = lakestream::delta::load_table(&loc)
            .await
            .with_context(|| format!("cannot open the Delta table {location}"))?;
        if let Some(table) = table {
            table.update_datafusion_session(&ctx.state())?;
            let provider = table.table_provider().await?;
            ctx.register_table(name, provider)?;
            return Ok(());
        }
        if local.is_none() {
            bail!("{location} is not a Delta table");
        }
    }
    let path = local
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| location.to_string());
    let path = path.trim_end_matches('/').to_string();
    let ext = detect_extension(local.as_deref()).unwrap_or_default();
    register_files(ctx, name, &path, &ext).await
}

/// Register the `ext` files at `path` (a file or a directory) as `name`.
async fn register_files(
    ctx: &SessionContext,
    name: &str,
    path: &str,
    ext: &str,
) -> anyhow::Result<()> {
    match ext {
        "parquet" => {
            ctx.register_parquet(name, path, ParquetReadOptions::default())
                .await?
        }
        "csv" => {
            ctx.register_csv(name, path, CsvReadOptions::default())
                .await?
        }
        "json" | "jsonl" | "ndjson" => {
            ctx.register_json(
                name,
                path,
                JsonReadOptions::default().file_extension(&format!(".{ext}")),
            )
            .await?
        }
        _ => bail!("{path}: not a Delta table and no .parquet, .csv or .json files found"),
    }
    Ok(())
}

/// A file's extension, lower case.
fn extension_of(p: &std::path::Path) -> Option<String> {
    p.extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase())
}

/// The extension of a file, or of the files in a directory.
fn detect_extension(local: Option<&std::path::Path>) -> Option<String> {
    let p = local?;
    if p.is_file() {
        return extension_of(p);
    }
    let dir = std::fs::read_dir(p).ok()?;
    dir.filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .find_map(|e| extension_of(&e.path()))
}
