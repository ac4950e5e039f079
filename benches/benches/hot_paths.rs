//! Micro-benchmarks of the hot pieces of a batch: decoding JSON files into
//! Arrow through the file source, running the per-batch query, encoding
//! Parquet, and one Delta commit on a table with a long history.
//!
//! `cargo bench -p lakestream-benches --bench hot_paths`. End-to-end figures are
//! `lakestream-bench` (docs/benchmarks.md).

use std::collections::HashMap;
use std::sync::Arc;

use arrow::array::RecordBatch;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use datafusion::datasource::MemTable;
use datafusion::prelude::SessionContext;
use futures::TryStreamExt;
use lakestream::delta::{DeltaSink, DeltaSinkOptions};
use lakestream::sink::{CommitInfo, Sink};
use lakestream::source::Source;
use lakestream::source::files::{FileFormat, FileSource, FileSourceOptions};
use lakestream::source::generator::{GeneratorOptions, GeneratorSource, generate};

const ROWS: usize = 8192;

fn events_json(dir: &std::path::Path) {
    let mut body = String::new();
    for i in 0..ROWS {
        body.push_str(&format!(
            "{{\"event_id\":\"e{i:010}\",\"user_id\":{},\"event_type\":\"click\",\"amount\":{}.5,\"ts\":\"2026-01-01T00:00:{:02}Z\"}}\n",
            i % 977,
            i % 300,
            i % 60
        ));
    }
    std::fs::write(dir.join("events.json"), body).unwrap();
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in");
    std::fs::create_dir_all(&input).unwrap();
    events_json(&input);
    let source = FileSource::try_new(
        "events",
        input.to_str().unwrap(),
        &HashMap::new(),
        GeneratorSource::fixed_schema(),
        FileSourceOptions::new(FileFormat::Json),
    )
    .unwrap();
    let end = rt.block_on(source.plan(None)).unwrap().unwrap();

    let mut g = c.benchmark_group("batch");
    g.throughput(Throughput::Elements(ROWS as u64));
    g.bench_function("decode_json_file_8192_rows", |b| {
        b.to_async(&rt).iter(|| async {
            let mut rows = 0;
            for s in source.read(None, &end, 1).unwrap() {
                let batches: Vec<RecordBatch> = s.try_collect().await.unwrap();
                rows += batches.iter().map(|b| b.num_rows()).sum::<usize>();
            }
            assert_eq!(rows, ROWS);
        })
    });

    let batch = generate(&GeneratorOptions::default(), 0, ROWS as u64);
    let ctx = SessionContext::new();
    ctx.register_table(
        "events",
        Arc::new(MemTable::try_new(batch.schema(), vec![vec![batch.clone()]]).unwrap()),
    )
    .unwrap();
    g.bench_function("plan_and_run_query_8192_rows", |b| {
        b.to_async(&rt).iter(|| async {
            let df = ctx
                .sql("SELECT event_id, user_id, amount, ts, CAST(ts AS DATE) AS day FROM events WHERE amount > 0")
                .await
                .unwrap();
            df.collect().await.unwrap()
        })
    });

    g.bench_function("encode_parquet_8192_rows", |b| {
        b.iter(|| {
            let mut out = Vec::with_capacity(1 << 20);
            let mut w =
                parquet::arrow::ArrowWriter::try_new(&mut out, batch.schema(), None).unwrap();
            w.write(&batch).unwrap();
            w.close().unwrap();
            out.len()
        })
    });
    g.finish();

    // One commit of a one-row batch on a table that already has 300 versions.
    let table = dir.path().join("table");
    let sink = DeltaSink::try_new(table.to_str().unwrap(), DeltaSinkOptions::default()).unwrap();
    let one = generate(&GeneratorOptions::default(), 0, 1);
    let mut next = 0u64;
    rt.block_on(async {
        sink.open(one.schema()).await.unwrap();
        for _ in 0..300 {
            commit(&sink, &one, next).await;
            next += 1;
        }
    });
    c.bench_function("delta_write_and_commit_one_batch_at_v300", |b| {
        b.iter(|| {
            let id = next;
            next += 1;
            rt.block_on(commit(&sink, &one, id))
        })
    });
}

async fn commit(sink: &DeltaSink, one: &RecordBatch, id: u64) -> lakestream::sink::CommitOutcome {
    let mut w = sink.begin(id).await.unwrap();
    w.write(one.clone()).await.unwrap();
    let staged = w.finish().await.unwrap();
    sink.commit(
        staged,
        &CommitInfo {
            query_id: "bench".into(),
            batch_id: id,
            metadata: Default::default(),
            write: Default::default(),
            claims: Vec::new(),
        },
    )
    .await
    .unwrap()
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
