//! The source conformance suite (`lakestream-testkit`) run against the
//! generator, files on a local path and files on the S3-compatible server
//! scripts/test.sh starts. The CLI's test binary runs it against the Kafka
//! broker it starts.

use std::collections::HashMap;
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema};
use lakestream::source::Source;
use lakestream::source::files::{FileFormat, FileSource, FileSourceOptions};
use lakestream::source::generator::{GeneratorOptions, GeneratorSource};
use lakestream_testkit::source_conformance as conformance;

#[tokio::test]
async fn the_generator_passes_the_source_suite() {
    let make = |rows: u64| {
        move || -> Arc<dyn Source> {
            Arc::new(
                GeneratorSource::try_new(
                    "events",
                    GeneratorOptions {
                        rows: Some(rows),
                        max_rows_per_trigger: Some(300),
                        batch_size: 64,
                        ..Default::default()
                    },
                )
                .unwrap(),
            )
        }
    };
    conformance(make(1000), make(0)(), 1000, 64).await;
}

fn id_schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, true)]))
}

fn file_options() -> FileSourceOptions {
    let mut o = FileSourceOptions::new(FileFormat::Json);
    o.max_files_per_trigger = Some(2);
    o.batch_size = 4;
    o
}

/// Seven JSON-lines files of ten rows each, ids `file * 10 + row`.
fn json_files() -> Vec<(String, String)> {
    (0..7)
        .map(|f| {
            let body: String = (0..10)
                .map(|r| format!("{{\"id\": {}}}\n", f * 10 + r))
                .collect();
            (format!("part-{f:04}.json"), body)
        })
        .collect()
}

#[tokio::test]
async fn files_on_a_local_path_pass_the_source_suite() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in");
    std::fs::create_dir_all(&input).unwrap();
    for (name, body) in json_files() {
        std::fs::write(input.join(name), body).unwrap();
    }
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let source = |path: &std::path::Path| -> Arc<dyn Source> {
        Arc::new(
            FileSource::try_new(
                "events",
                path.to_str().unwrap(),
                &HashMap::new(),
                id_schema(),
                file_options(),
            )
            .unwrap(),
        )
    };
    conformance(|| source(&input), source(&empty), 70, 4).await;
}

#[tokio::test]
async fn files_on_s3_pass_the_source_suite() {
    use object_store::{ObjectStoreExt, PutPayload};
    let (options, prefix) = crate::common::s3_server("source-suite");
    let input = format!("{prefix}in/");
    let location = lakestream::storage::Location::parse(&input, &options).unwrap();
    for (name, body) in json_files() {
        location
            .store()
            .put(&location.child(&name), PutPayload::from(body))
            .await
            .unwrap();
    }
    let source = |url: &str| -> Arc<dyn Source> {
        Arc::new(FileSource::try_new("events", url, &options, id_schema(), file_options()).unwrap())
    };
    conformance(|| source(&input), source(&format!("{prefix}empty/")), 70, 4).await;
}

/// A Delta table at `path` with `commits` appends of ten ids each.
async fn delta_table(path: &std::path::Path, commits: i64) {
    use arrow::array::Int64Array;
    use arrow::record_batch::RecordBatch;
    use lakestream::delta::{DeltaSink, DeltaSinkOptions};
    use lakestream::sink::{CommitInfo, Sink};
    let sink = DeltaSink::try_new(path.to_str().unwrap(), DeltaSinkOptions::default()).unwrap();
    sink.open(id_schema()).await.unwrap();
    for c in 0..commits {
        let ids: Vec<i64> = (0..10).map(|r| c * 10 + r).collect();
        let batch =
            RecordBatch::try_new(id_schema(), vec![Arc::new(Int64Array::from(ids))]).unwrap();
        let mut w = sink.begin(c as u64).await.unwrap();
        w.write(batch).await.unwrap();
        let staged = w.finish().await.unwrap();
        let info = CommitInfo {
            query_id: "writer".into(),
            batch_id: c as u64,
            metadata: Default::default(),
            write: Default::default(),
            claims: Vec::new(),
        };
        sink.commit(staged, &info).await.unwrap();
    }
}

#[tokio::test]
async fn a_delta_table_passes_the_source_suite() {
    use lakestream::delta::{DeltaSource, DeltaSourceOptions};
    let dir = tempfile::tempdir().unwrap();
    let (input, empty) = (dir.path().join("in"), dir.path().join("empty"));
    delta_table(&input, 7).await;
    delta_table(&empty, 0).await;
    let open = |path: &std::path::Path| {
        let path = path.to_str().unwrap().to_string();
        async move {
            let o = DeltaSourceOptions {
                max_files_per_trigger: 2,
                batch_size: 4,
                ..Default::default()
            };
            Arc::new(DeltaSource::try_new("events", &path, o).await.unwrap()) as Arc<dyn Source>
        }
    };
    // The suite builds its sources synchronously: open them first (a
    // restarted process opens the table the same way).
    let made = std::sync::Mutex::new(vec![
        open(&input).await,
        open(&input).await,
        open(&input).await,
    ]);
    let make = || {
        made.lock()
            .unwrap()
            .pop()
            .expect("the suite opens at most three sources")
    };
    conformance(make, open(&empty).await, 70, 4).await;
}
