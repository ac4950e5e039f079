//! Code per batch: `QueryBuilder::for_each_batch` hands each micro-batch's
//! output to a function, which here adds each user's events and amounts to
//! running totals in a Delta table with a MERGE.
//!
//! Run: `cargo run -p lakestream --example for_each_batch`
//!
//! Adding to totals is not idempotent, and the function may be called again
//! with a batch after a crash (at least once). So the MERGE commits with a
//! Delta transaction `(APP_ID, batch id)`, and a batch id the table already
//! holds is skipped: each batch counts exactly once.

use std::sync::Arc;

use datafusion::functions_aggregate::expr_fn::{count, sum};
use datafusion::prelude::{DataFrame, SessionContext, col, lit};
use deltalake::DeltaTable;
use deltalake::kernel::transaction::CommitProperties;
use deltalake::kernel::{DataType, StructField, Transaction};
use lakestream::delta::{load_table, open_table};
use lakestream::source::files::{FileFormat, FileSource, FileSourceOptions};
use lakestream::storage::Location;
use lakestream::{QueryBuilder, Trigger};

/// The transaction app id the totals table records batch ids under.
const APP_ID: &str = "user-totals";

/// The totals table at `location`, created empty when absent.
async fn totals_table(location: &Location) -> anyhow::Result<DeltaTable> {
    if let Some(t) = load_table(location).await? {
        return Ok(t);
    }
    Ok(open_table(location)?
        .create()
        .with_columns([
            StructField::new("user_id", DataType::LONG, true),
            StructField::new("events", DataType::LONG, true),
            StructField::new("amount", DataType::DOUBLE, true),
        ])
        .await?)
}

/// Add batch `batch_id`'s events per user to the totals, once.
async fn add_to_totals(
    location: &Location,
    batch_id: u64,
    events: DataFrame,
) -> anyhow::Result<()> {
    let table = totals_table(location).await?;
    let done = table
        .snapshot()?
        .transaction_version(table.log_store().as_ref(), APP_ID)
        .await?;
    if done.is_some_and(|v| v >= batch_id as i64) {
        println!("batch {batch_id}: already in the totals, skipped");
        return Ok(());
    }
    let per_user = events.aggregate(
        vec![col("user_id")],
        vec![
            count(lit(1)).alias("events"),
            sum(col("amount")).alias("amount"),
        ],
    )?;
    let (table, metrics) = table
        .merge(per_user, col("target.user_id").eq(col("source.user_id")))
        .with_source_alias("source")
        .with_target_alias("target")
        .with_commit_properties(
            CommitProperties::default()
                .with_application_transaction(Transaction::new(APP_ID, batch_id as i64)),
        )
        .when_matched_update(|u| {
            u.update("events", col("target.events") + col("source.events"))
                .update("amount", col("target.amount") + col("source.amount"))
        })?
        .when_not_matched_insert(|i| {
            i.set("user_id", col("source.user_id"))
                .set("events", col("source.events"))
                .set("amount", col("source.amount"))
        })?
        .await?;
    println!(
        "batch {batch_id}: {} users updated, {} new -> totals v{}",
        metrics.num_target_rows_updated,
        metrics.num_target_rows_inserted,
        table.version().unwrap_or_default()
    );
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let work = tempfile::tempdir()?;
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/data/events");
    let schema = Arc::new(arrow::datatypes::Schema::new(vec![
        arrow::datatypes::Field::new("event_id", arrow::datatypes::DataType::Utf8, false),
        arrow::datatypes::Field::new("user_id", arrow::datatypes::DataType::Int64, true),
        arrow::datatypes::Field::new("amount", arrow::datatypes::DataType::Float64, true),
    ]));
    let mut options = FileSourceOptions::new(FileFormat::Json);
    options.max_files_per_trigger = Some(2);
    let events = Arc::new(FileSource::try_new(
        "events",
        data.to_str().expect("utf-8 path"),
        &Default::default(),
        schema,
        options,
    )?);
    let totals_dir = work.path().join("user_totals");
    std::fs::create_dir_all(&totals_dir)?;
    let totals = Location::parse(
        totals_dir.to_str().expect("utf-8 path"),
        &Default::default(),
    )?;

    let loc = totals.clone();
    let summary = QueryBuilder::new()
        .source(events)?
        .sql("SELECT user_id, amount FROM events")
        .for_each_batch(move |batch_id, df| {
            let loc = loc.clone();
            async move { Ok(add_to_totals(&loc, batch_id, df).await?) }
        })
        .checkpoint(work.path().join("checkpoint").to_str().expect("utf-8 path"))
        .trigger(Trigger::AvailableNow)
        .run()
        .await?;
    println!("{} batches, {} rows", summary.batches, summary.input_rows);

    // The totals hold every event exactly once.
    let ctx = SessionContext::new();
    let table = load_table(&totals).await?.expect("the totals table");
    ctx.register_table("totals", table.table_provider().await?)?;
    let counted = ctx
        .sql("SELECT CAST(sum(events) AS BIGINT) AS n FROM totals")
        .await?
        .collect()
        .await?;
    let n = arrow::array::cast::AsArray::as_primitive::<arrow::datatypes::Int64Type>(
        counted[0].column(0),
    )
    .value(0);
    anyhow::ensure!(
        n as u64 == summary.input_rows,
        "the totals count {n} events, the query read {}",
        summary.input_rows
    );
    ctx.sql("SELECT * FROM totals ORDER BY user_id")
        .await?
        .show()
        .await?;
    Ok(())
}
