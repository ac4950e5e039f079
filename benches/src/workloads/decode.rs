//! Decoding the backfill's JSON files two ways, in this process: through
//! lakestream's file source (its own ranged reader and arrow-json decoder)
//! and through DataFusion's JSON datasource (`FileScanConfig` with its JSON
//! source, what `register_json` plans). Both read every column into Arrow
//! with the same schema on the same number of partitions; nothing is
//! written. The figure says whether the file source could read through
//! DataFusion instead without losing speed.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use arrow::datatypes::{DataType, Field, Schema, TimeUnit};
use datafusion::execution::context::SessionConfig;
use datafusion::physical_plan::ExecutionPlanProperties;
use datafusion::prelude::{JsonReadOptions, SessionContext};
use futures::StreamExt;
use lakestream_engine::source::Source;
use lakestream_engine::source::files::{FileFormat, FileSource, FileSourceOptions};

use super::{figure, percentile};

/// The backfill's schema as its job declares it: SQL's `VARCHAR` is
/// `Utf8` in lakestream's sessions.
fn schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        Field::new("event_id", DataType::Utf8, false),
        Field::new("user_id", DataType::Int64, true),
        Field::new("event_type", DataType::Utf8, true),
        Field::new("amount", DataType::Float64, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Nanosecond, None), true),
    ]))
}

/// Rows in `streams`, polled at once.
async fn count_rows<S, E>(streams: Vec<S>) -> anyhow::Result<u64>
where
    S: futures::Stream<Item = Result<arrow::array::RecordBatch, E>> + Unpin,
    E: std::error::Error + Send + Sync + 'static,
{
    let counts = futures::future::try_join_all(streams.into_iter().map(|mut s| async move {
        let mut n = 0u64;
        while let Some(b) = s.next().await {
            n += b?.num_rows() as u64;
        }
        Ok::<_, anyhow::Error>(n)
    }))
    .await?;
    Ok(counts.into_iter().sum())
}

/// Rows read by lakestream's file source: every file in one range, split
/// over `partitions` streams polled at once.
async fn ours(input: &Path, partitions: usize) -> anyhow::Result<u64> {
    file_source_rows(input, FileFormat::Json, schema(), partitions).await
}

/// Rows the file source reads from the `format` files under `input` as
/// `schema`, every file in one range, on `partitions` streams polled at
/// once.
pub(super) async fn file_source_rows(
    input: &Path,
    format: FileFormat,
    schema: Arc<Schema>,
    partitions: usize,
) -> anyhow::Result<u64> {
    let mut o = FileSourceOptions::new(format);
    o.max_bytes_per_trigger = None;
    let source = FileSource::try_new(
        "events",
        input.to_str().context("a UTF-8 path")?,
        &HashMap::new(),
        schema,
        o,
    )?;
    source.restore(None).await?;
    source.recover(&[]).await?;
    source.freeze().await?;
    let start = source.initial_offset().await?;
    let end = source
        .plan(start.as_ref())
        .await?
        .context("no input to read")?;
    let streams = source.read(start.as_ref(), &end, partitions)?;
    count_rows(streams).await
}

/// Rows read by DataFusion's JSON datasource on `partitions` partitions.
async fn datafusion(input: &Path, partitions: usize) -> anyhow::Result<u64> {
    let ctx =
        SessionContext::new_with_config(SessionConfig::new().with_target_partitions(partitions));
    let schema = schema();
    ctx.register_json(
        "events",
        input.to_str().context("a UTF-8 path")?,
        JsonReadOptions::default()
            .schema(&schema)
            .file_extension(".json"),
    )
    .await?;
    let plan = ctx
        .sql("SELECT * FROM events")
        .await?
        .create_physical_plan()
        .await?;
    let task = ctx.task_ctx();
    let streams = (0..plan.output_partitioning().partition_count())
        .map(|i| plan.execute(i, task.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    count_rows(streams).await
}

/// Time both readers over `input` (`rows` events), alternating, `runs`
/// times each; print the medians and their ratio.
pub(super) fn decode(input: &Path, rows: u64, runs: usize) -> anyhow::Result<()> {
    let partitions = std::thread::available_parallelism()?.get().min(2);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(partitions)
        .enable_all()
        .build()?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let t = Instant::now();
        let n = rt.block_on(ours(input, partitions))?;
        a.push(t.elapsed().as_secs_f64());
        if n != rows {
            bail!("the file source read {n} rows of {rows}");
        }
        let t = Instant::now();
        let n = rt.block_on(datafusion(input, partitions))?;
        b.push(t.elapsed().as_secs_f64());
        if n != rows {
            bail!("DataFusion's JSON datasource read {n} rows of {rows}");
        }
    }
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    let (a, b) = (percentile(&a, 0.5), percentile(&b, 0.5));
    figure(
        "decode.file_source",
        format!("{:.0}", rows as f64 / a),
        "rows/s (lakestream's file source, every column)",
    );
    figure(
        "decode.datafusion_json",
        format!("{:.0}", rows as f64 / b),
        "rows/s (DataFusion's JSON datasource, every column)",
    );
    figure(
        "ratio.datafusion_json_over_file_source",
        format!("{:.2}", a / b),
        "x (above 1: DataFusion's is faster)",
    );
    Ok(())
}
