//! The connector registry: an embedder's own `STORED AS` names run in a
//! job file beside the built-in ones, with their options checked.

use std::sync::Arc;

use arrow::array::AsArray;
use lakestream::Trigger;
use lakestream::connectors::{Connectors, Result, SinkConnector, TableContext};
use lakestream::job::{JobOptions, load_job};
use lakestream::sink::Sink;
use lakestream::sink::memory::MemorySink;

/// `STORED AS MEMORY`: every job writes into one shared memory sink.
struct MemoryConnector(MemorySink);

#[async_trait::async_trait]
impl SinkConnector for MemoryConnector {
    fn options(&self) -> &'static [&'static str] {
        &["label"]
    }

    async fn create(&self, ctx: &TableContext<'_>) -> Result<Arc<dyn Sink>> {
        if ctx.option("label") == Some("") {
            return Err(ctx.error("label must not be empty"));
        }
        Ok(Arc::new(self.0.clone()))
    }
}

fn job(sink_options: &str) -> String {
    format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events STORED AS GENERATOR LOCATION 'generator'\n\
         OPTIONS ('rows' '100', 'max_rows_per_trigger' '40');\n\
         CREATE EXTERNAL TABLE out STORED AS memory LOCATION 'mem' {sink_options};\n\
         INSERT INTO out SELECT event_id FROM events;\n"
    )
}

/// The error loading `text` gives (the job must not load).
async fn load_err(text: &str, options: &JobOptions) -> String {
    match load_job("job.sql", text, options).await {
        Ok(_) => panic!("the job loaded"),
        Err(e) => e.to_string(),
    }
}

fn options(dir: &std::path::Path, sink: &MemorySink) -> JobOptions {
    let mut connectors = Connectors::builtin();
    connectors.register_sink("memory", Arc::new(MemoryConnector(sink.clone())));
    JobOptions {
        trigger: Trigger::AvailableNow,
        connectors,
        ..JobOptions::new(dir.join("ckpt").to_str().unwrap())
    }
}

#[tokio::test]
async fn a_registered_sink_runs_a_job_file_and_its_options_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let sink = MemorySink::new("out");
    let summary = load_job(
        "job.sql",
        &job("OPTIONS ('label' 'x')"),
        &options(dir.path(), &sink),
    )
    .await
    .unwrap()
    .run()
    .await
    .unwrap();
    assert_eq!(summary.batches, 3);
    assert_eq!(sink.rows(), 100);
    let ids: std::collections::HashSet<String> = sink
        .batches()
        .iter()
        .flat_map(|b| {
            b.column(0)
                .as_string::<i32>()
                .iter()
                .flatten()
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(ids.len(), 100);

    // An option the connector does not list is refused before anything runs,
    // and so is a value the connector rejects, both at the declaration.
    let other = tempfile::tempdir().unwrap();
    let err = load_err(&job("OPTIONS ('lable' 'x')"), &options(other.path(), &sink)).await;
    assert!(err.contains("unknown option \"lable\""), "{err}");
    assert!(err.contains("job.sql:3"), "{err}");
    let err = load_err(&job("OPTIONS ('label' '')"), &options(other.path(), &sink)).await;
    assert!(err.contains("label must not be empty"), "{err}");
    assert!(!other.path().join("ckpt").exists(), "nothing was written");
}

#[tokio::test]
async fn without_the_registration_the_name_is_refused_with_the_known_ones() {
    let dir = tempfile::tempdir().unwrap();
    let options = JobOptions {
        trigger: Trigger::AvailableNow,
        ..JobOptions::new(dir.path().join("ckpt").to_str().unwrap())
    };
    let err = load_err(&job(""), &options).await;
    assert!(
        err.contains("the output table out must be STORED AS DELTA"),
        "{err}"
    );
    // Refused before a source stores anything in the checkpoint (a file
    // stream without columns would store its inferred schema there).
    let input = dir.path().join("in");
    std::fs::create_dir_all(&input).unwrap();
    std::fs::write(input.join("a.json"), "{\"id\": 1}\n").unwrap();
    let inferred = format!(
        "CREATE UNBOUNDED EXTERNAL TABLE events STORED AS JSON LOCATION '{}/';\n\
         CREATE EXTERNAL TABLE out STORED AS memory LOCATION 'mem';\n\
         INSERT INTO out SELECT * FROM events;\n",
        input.display()
    );
    let err = load_err(&inferred, &options).await;
    assert!(err.contains("must be STORED AS DELTA"), "{err}");
    assert!(
        !dir.path().join("ckpt").exists(),
        "the checkpoint was touched"
    );
    let stream = "CREATE UNBOUNDED EXTERNAL TABLE events STORED AS ORC LOCATION 'in/';\n\
                  CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
                  INSERT INTO out SELECT * FROM events;\n";
    let err = load_err(stream, &options).await;
    assert!(
        err.contains("use AVRO, CSV, DELTA, GENERATOR, JSON, KAFKA or PARQUET"),
        "{err}"
    );
}
