//! Embedding lakestream in a service: a query built in Rust (no SQL file),
//! started in the background, watched through its progress, then stopped.
//!
//! Run: `cargo run -p lakestream --example embed`
//!
//! It reads the bundled sample events under `examples/data/events/`, keeps
//! purchases with a DataFusion DataFrame, and appends them to a Delta table
//! under a temporary directory.

use std::sync::Arc;

use datafusion::prelude::{col, lit};
use lakestream::delta::{DeltaSink, DeltaSinkOptions};
use lakestream::source::files::{FileFormat, FileSource, FileSourceOptions};
use lakestream::{QueryBuilder, Trigger};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let work = tempfile::tempdir()?;
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/data/events");
    let schema = Arc::new(arrow::datatypes::Schema::new(vec![
        arrow::datatypes::Field::new("event_id", arrow::datatypes::DataType::Utf8, false),
        arrow::datatypes::Field::new("user_id", arrow::datatypes::DataType::Int64, true),
        arrow::datatypes::Field::new("event_type", arrow::datatypes::DataType::Utf8, true),
        arrow::datatypes::Field::new("amount", arrow::datatypes::DataType::Float64, true),
    ]));
    let mut options = FileSourceOptions::new(FileFormat::Json);
    options.max_files_per_trigger = Some(3);
    let events = Arc::new(FileSource::try_new(
        "events",
        data.to_str().expect("utf-8 path"),
        &Default::default(),
        schema,
        options,
    )?);
    let table_dir = work.path().join("purchases");
    let sink = Arc::new(DeltaSink::try_new(
        table_dir.to_str().expect("utf-8 path"),
        DeltaSinkOptions::default(),
    )?);

    let builder = QueryBuilder::new().source(events)?;
    // A DataFrame over the stream, built on the query's own session.
    let purchases = builder
        .context()
        .table("events")
        .await?
        .filter(col("event_type").eq(lit("purchase")))?
        .select_columns(&["event_id", "user_id", "amount"])?;
    let mut handle = builder
        .dataframe(purchases)
        .sink(sink)
        .checkpoint(work.path().join("checkpoint").to_str().expect("utf-8 path"))
        .trigger(Trigger::AvailableNow)
        .start()
        .await?;
    println!("query {} started", handle.query_id());
    let mut progress = handle.take_progress_events().expect("first take");
    let printer = tokio::spawn(async move {
        let mut batches = 0;
        while let Some(p) = progress.recv().await {
            println!("{}", p.human_line());
            batches += 1;
        }
        batches
    });
    let summary = handle.await_termination().await?;
    let batches = printer.await?;
    println!(
        "{} batches, {} rows read, {} purchases written, table version {:?}",
        summary.batches, summary.input_rows, summary.output_rows, summary.table_version
    );
    anyhow::ensure!(
        batches == 2,
        "6 files at 3 per trigger are 2 batches, saw {batches}"
    );
    anyhow::ensure!(summary.input_rows == 300, "the sample has 300 events");
    anyhow::ensure!(summary.output_rows > 0, "the sample has purchases");
    Ok(())
}
