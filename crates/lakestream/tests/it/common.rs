//! Building test queries, and reading tables back through delta-rs and
//! DataFusion.

use arrow::array::AsArray;
use datafusion::prelude::SessionContext;

/// An available-now query of `sql` over `source` into the Delta table at
/// `table` (default options), checkpointed at `ckpt`.
pub(crate) fn available_now(
    source: impl lakestream::source::Source + 'static,
    sql: &str,
    table: &str,
    ckpt: &str,
) -> lakestream::QueryBuilder {
    available_now_shared(std::sync::Arc::new(source), sql, table, ckpt)
}

/// [`available_now`] over a source object the caller keeps (and may hand
/// to another query).
pub(crate) fn available_now_shared(
    source: std::sync::Arc<dyn lakestream::source::Source>,
    sql: &str,
    table: &str,
    ckpt: &str,
) -> lakestream::QueryBuilder {
    use lakestream::delta::{DeltaSink, DeltaSinkOptions};
    lakestream::QueryBuilder::new()
        .source(source)
        .unwrap()
        .sql(sql)
        .sink(std::sync::Arc::new(
            DeltaSink::try_new(table, DeltaSinkOptions::default()).unwrap(),
        ))
        .checkpoint(ckpt)
        .trigger(lakestream::Trigger::AvailableNow)
}

/// Write JSON-lines files `part-<from>.json` .. `part-<to - 1>.json` of 10
/// rows each under `dir`, with ids `file * 10 + row`.
pub(crate) fn write_files(dir: &std::path::Path, from: usize, to: usize) {
    std::fs::create_dir_all(dir).unwrap();
    for f in from..to {
        let body: String = (0..10)
            .map(|r| format!("{{\"id\": {}}}\n", f * 10 + r))
            .collect();
        std::fs::write(dir.join(format!("part-{f:04}.json")), body).unwrap();
    }
}

/// Run `sql` over the Delta table at `table` (registered as `t`).
pub(crate) async fn read_table(
    table: &std::path::Path,
    sql: &str,
) -> Vec<arrow::array::RecordBatch> {
    let url = url::Url::from_directory_path(table).unwrap();
    let t = deltalake::DeltaTable::try_from_url(url).await.unwrap();
    let ctx = SessionContext::new();
    t.update_datafusion_session(&ctx.state()).unwrap();
    ctx.register_table("t", t.table_provider().await.unwrap())
        .unwrap();
    ctx.sql(sql).await.unwrap().collect().await.unwrap()
}

/// Row count and distinct count of `column` in the table at `table`.
pub(crate) async fn count_distinct(table: &std::path::Path, column: &str) -> (i64, i64) {
    let b = read_table(
        table,
        &format!("SELECT count(*), count(DISTINCT {column}) FROM t"),
    )
    .await;
    let get = |i: usize| {
        b[0].column(i)
            .as_primitive::<arrow::datatypes::Int64Type>()
            .value(0)
    };
    (get(0), get(1))
}

/// The S3-compatible server scripts/test.sh started: storage options to
/// reach it, and a fresh prefix URL `s3://<bucket>/<name>-<nanos>/` for one
/// test. Panics with the way to get a server when none is configured.
pub(crate) fn s3_server(name: &str) -> (std::collections::HashMap<String, String>, String) {
    let s3 = lakestream_testkit::s3::S3Server::from_env();
    (s3.options(), s3.prefix(name))
}
