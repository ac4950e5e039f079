//! The edges of exactly-once: a source object reused after a failed run, a
//! corrupt newest snapshot, checkpoint files that must not grow without
//! bound, progress that nobody reads, a restart with another query.

use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema};
use lakestream::source::Source;
use lakestream::source::files::{FileFormat, FileSource, FileSourceOptions};
use lakestream::source::generator::{GeneratorOptions, GeneratorSource};
use lakestream::{Error, PROGRESS_EVENTS_BUFFER, QueryBuilder};

use crate::common::write_files;

fn file_source(dir: &std::path::Path, name: &str) -> FileSource {
    let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, true)]));
    let mut opts = FileSourceOptions::new(FileFormat::Json);
    opts.max_files_per_trigger = Some(1);
    FileSource::try_new(
        name,
        dir.join("in").to_str().unwrap(),
        &Default::default(),
        schema,
        opts,
    )
    .unwrap()
}

fn query(dir: &std::path::Path, source: FileSource) -> QueryBuilder {
    crate::common::available_now(
        source,
        "SELECT id FROM events",
        dir.join("table").to_str().unwrap(),
        dir.join("ckpt").to_str().unwrap(),
    )
}

fn count(dir: &std::path::Path, sub: &str) -> usize {
    std::fs::read_dir(dir.join(sub))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_source_object_reused_after_a_plan_that_was_never_written_ahead_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_files(&dir.join("in"), 0, 4);
    let source = Arc::new(file_source(dir, "events"));
    // A plan whose write-ahead never became durable (the process's put of
    // offsets/0 failed): the source took part-0000 in memory only.
    let taken = source.plan(None).await.unwrap();
    assert!(taken.is_some());
    // An available-now run freezes the listing; the same object then runs
    // again after more files arrive.
    let run = || async {
        crate::common::available_now_shared(
            source.clone(),
            "SELECT id FROM events",
            dir.join("table").to_str().unwrap(),
            dir.join("ckpt").to_str().unwrap(),
        )
        .run()
        .await
        .unwrap()
    };
    let summary = run().await;
    assert_eq!(summary.input_rows, 40, "{summary:?}");
    write_files(&dir.join("in"), 4, 6);
    let summary = run().await;
    assert_eq!(summary.input_rows, 20, "{summary:?}");
    let (n, d) = crate::common::count_distinct(&dir.join("table"), "id").await;
    assert_eq!((n, d), (60, 60));
}

#[tokio::test]
async fn a_generator_reused_after_an_available_now_run_is_not_capped_by_its_old_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let source = Arc::new(
        GeneratorSource::try_new(
            "events",
            GeneratorOptions {
                rows: Some(100_000),
                rows_per_second: Some(1000),
                ..Default::default()
            },
        )
        .unwrap(),
    );
    // An earlier available-now run of this object froze what was there
    // then: almost nothing.
    source.freeze().await.unwrap();
    let frozen = source
        .plan(None)
        .await
        .unwrap()
        .and_then(|v| v.as_u64())
        .unwrap_or(0);
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let s = crate::common::available_now_shared(
        source.clone(),
        "SELECT event_id FROM events",
        dir.join("table").to_str().unwrap(),
        dir.join("ckpt").to_str().unwrap(),
    )
    .trigger(lakestream::Trigger::Once)
    .run()
    .await
    .unwrap();
    assert!(
        s.input_rows >= 300 && s.input_rows > frozen + 100,
        "read {} rows; the old bound was {frozen}",
        s.input_rows
    );
}

#[tokio::test]
async fn a_corrupt_newest_snapshot_falls_back_to_the_one_before() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_files(&dir.join("in"), 0, 12);
    let s = query(dir, file_source(dir, "events"))
        .snapshot_interval(5)
        .min_batches_to_retain(1)
        .run()
        .await
        .unwrap();
    assert_eq!(s.batches, 12);
    let snaps = dir.join("ckpt/sources/events/snapshots");
    assert!(snaps.join("9").exists() && snaps.join("4").exists());
    // Write-ahead files after the older snapshot are kept for this case.
    assert!(dir.join("ckpt/offsets/5").exists());
    assert!(
        !dir.join("ckpt/offsets/4").exists(),
        "covered files are purged"
    );
    std::fs::write(
        snaps.join("9"),
        b"{\"version\": 1, \"state\": {\"files\": [",
    )
    .unwrap();
    write_files(&dir.join("in"), 12, 15);
    let s = query(dir, file_source(dir, "events"))
        .snapshot_interval(5)
        .min_batches_to_retain(1)
        .run()
        .await
        .unwrap();
    assert_eq!(s.batches, 3, "only the new files: {s:?}");
    let (n, d) = crate::common::count_distinct(&dir.join("table"), "id").await;
    assert_eq!((n, d), (150, 150));
}

#[tokio::test]
async fn purged_write_ahead_without_any_readable_snapshot_is_an_error_not_a_reread() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_files(&dir.join("in"), 0, 12);
    query(dir, file_source(dir, "events"))
        .snapshot_interval(5)
        .min_batches_to_retain(1)
        .run()
        .await
        .unwrap();
    let snaps = dir.join("ckpt/sources/events/snapshots");
    for s in ["4", "9"] {
        std::fs::write(snaps.join(s), b"garbage").unwrap();
    }
    let err = query(dir, file_source(dir, "events"))
        .run()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Checkpoint(_)), "{err}");
    assert!(err.to_string().contains("events"), "{err}");
    let (n, _) = crate::common::count_distinct(&dir.join("table"), "id").await;
    assert_eq!(n, 120, "nothing was read twice");
}

#[tokio::test]
async fn a_long_run_keeps_the_checkpoint_bounded_and_progress_unread_costs_no_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let batches = PROGRESS_EVENTS_BUFFER as u64 + 200;
    let source = GeneratorSource::try_new(
        "events",
        GeneratorOptions {
            rows: Some(batches),
            max_rows_per_trigger: Some(1),
            ..Default::default()
        },
    )
    .unwrap();
    let mut handle = crate::common::available_now(
        source,
        "SELECT event_id FROM events",
        dir.join("table").to_str().unwrap(),
        dir.join("ckpt").to_str().unwrap(),
    )
    .start()
    .await
    .unwrap();
    // Taken but never read while the query runs.
    let mut events = handle.take_progress_events().unwrap();
    let summary = handle.await_termination().await.unwrap();
    assert_eq!(summary.batches, batches);
    let mut kept = 0;
    while events.try_recv().is_ok() {
        kept += 1;
    }
    assert_eq!(
        kept, PROGRESS_EVENTS_BUFFER,
        "events beyond the buffer are dropped"
    );

    // Defaults: snapshots every 100 batches, the newest 100 kept.
    let ckpt = dir.join("ckpt");
    let offsets = count(&ckpt, "offsets");
    let commits = count(&ckpt, "commits");
    assert!(
        offsets <= 200 && commits <= 200,
        "offsets {offsets}, commits {commits}"
    );
    assert!(offsets >= 100, "the newest 100 are kept: {offsets}");
    assert!(!ckpt.join("offsets/0").exists());

    // A restart goes on from where it was.
    let source = GeneratorSource::try_new(
        "events",
        GeneratorOptions {
            rows: Some(batches + 5),
            max_rows_per_trigger: Some(1),
            ..Default::default()
        },
    )
    .unwrap();
    let s = crate::common::available_now(
        source,
        "SELECT event_id FROM events",
        dir.join("table").to_str().unwrap(),
        dir.join("ckpt").to_str().unwrap(),
    )
    .run()
    .await
    .unwrap();
    assert_eq!(s.batches, 5);
    let (n, d) = crate::common::count_distinct(&dir.join("table"), "event_id").await;
    assert_eq!((n, d), (batches as i64 + 5, batches as i64 + 5));
}

#[tokio::test]
async fn a_renamed_source_is_refused_and_the_table_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_files(&dir.join("in"), 0, 2);
    query(dir, file_source(dir, "events")).run().await.unwrap();
    write_files(&dir.join("in"), 2, 3);
    let err = crate::common::available_now(
        file_source(dir, "clicks"),
        "SELECT id FROM clicks",
        dir.join("table").to_str().unwrap(),
        dir.join("ckpt").to_str().unwrap(),
    )
    .run()
    .await
    .unwrap_err();
    let msg = err.to_string();
    assert!(err.is_user_error(), "{msg}");
    assert!(
        msg.contains("source events") && msg.contains("source clicks"),
        "{msg}"
    );
    let (n, _) = crate::common::count_distinct(&dir.join("table"), "id").await;
    assert_eq!(n, 20);
}

#[test]
fn secrets_in_kafka_settings_never_reach_debug_output() {
    use lakestream::source::kafka::{KafkaSource, KafkaSourceOptions, Topics};
    let mut o = KafkaSourceOptions::new("127.0.0.1:1", Topics::List(vec!["t".into()]));
    for (k, v) in [
        ("sasl.password", "hunter2-sasl"),
        ("ssl.key.password", "hunter2-ssl"),
        ("sasl.oauthbearer.client.secret", "hunter2-oauth"),
        ("security.protocol", "SASL_SSL"),
    ] {
        o.client_config.insert(k.into(), v.into());
    }
    let source = KafkaSource::try_new(
        "orders",
        None,
        KafkaSourceOptions {
            format: lakestream::source::kafka::ValueFormat::String,
            ..o.clone()
        },
    )
    .unwrap();
    for shown in [
        format!("{o:?}"),
        format!("{source:?}"),
        format!("{source:#?}"),
    ] {
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(
            shown.contains("sasl.password"),
            "keys stay visible: {shown}"
        );
        assert!(
            shown.contains("SASL_SSL"),
            "non-secrets stay visible: {shown}"
        );
    }
}

#[tokio::test]
async fn a_query_corrected_before_its_first_batch_takes_the_checkpoint_over() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_files(&dir.join("in"), 0, 3);
    // A mistyped location: nothing is listed, no batch is planned.
    let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, true)]));
    let typo = FileSource::try_new(
        "events",
        dir.join("inn").to_str().unwrap(),
        &Default::default(),
        schema,
        FileSourceOptions::new(FileFormat::Json),
    )
    .unwrap();
    let s = query(dir, typo).run().await.unwrap();
    assert_eq!(s.batches, 0);
    let s = query(dir, file_source(dir, "events")).run().await.unwrap();
    assert_eq!(s.input_rows, 30, "{s:?}");
    // From now on the corrected query is the checkpoint's.
    let err = crate::common::available_now(
        file_source(dir, "clicks"),
        "SELECT id FROM clicks",
        dir.join("table").to_str().unwrap(),
        dir.join("ckpt").to_str().unwrap(),
    )
    .run()
    .await
    .unwrap_err();
    assert!(err.is_user_error(), "{err}");
}

/// A source whose planning panics: a bug, not a bad job.
#[derive(Debug)]
struct PanickingSource;

#[async_trait::async_trait]
impl Source for PanickingSource {
    fn name(&self) -> &str {
        "events"
    }
    fn schema(&self) -> arrow::datatypes::SchemaRef {
        Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, true)]))
    }
    async fn recover(
        &self,
        _ends: &[lakestream::source::Offset],
    ) -> lakestream::source::Result<()> {
        Ok(())
    }
    async fn restore(
        &self,
        _snapshot: Option<&lakestream::source::Offset>,
    ) -> lakestream::source::Result<()> {
        Ok(())
    }
    fn identity(&self) -> lakestream::source::SourceIdentity {
        lakestream::source::SourceIdentity {
            kind: "test".into(),
            location: String::new(),
        }
    }
    async fn freeze(&self) -> lakestream::source::Result<()> {
        Ok(())
    }
    async fn plan(
        &self,
        _start: Option<&lakestream::source::Offset>,
    ) -> lakestream::source::Result<Option<lakestream::source::Offset>> {
        panic!("a bug in a source");
    }
    fn read(
        &self,
        _start: Option<&lakestream::source::Offset>,
        _end: &lakestream::source::Offset,
        _partitions: usize,
    ) -> lakestream::source::Result<Vec<lakestream::source::BatchStream>> {
        Ok(Vec::new())
    }
    fn describe(
        &self,
        _start: Option<&lakestream::source::Offset>,
        _end: &lakestream::source::Offset,
    ) -> String {
        String::new()
    }
}

#[tokio::test]
async fn a_panicking_query_is_an_internal_error_not_an_invalid_job() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let err = crate::common::available_now(
        PanickingSource,
        "SELECT id FROM events",
        dir.join("table").to_str().unwrap(),
        dir.join("ckpt").to_str().unwrap(),
    )
    .run()
    .await
    .unwrap_err();
    assert!(matches!(err, Error::Internal(_)), "{err}");
    assert!(!err.is_user_error(), "{err}");
    assert_eq!(err.kind(), lakestream::ErrorKind::Internal);
    assert!(err.to_string().contains("panicked"), "{err}");
}

#[tokio::test]
async fn a_malformed_record_fails_its_batch_with_the_sources_own_error_through_any_plan() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let input = dir.join("in");
    write_files(&input, 0, 1);
    std::fs::write(input.join("part-0001.json"), "{\"id\": 1}\n{\"id\": \"x\n").unwrap();
    let mut opts = FileSourceOptions::new(FileFormat::Json);
    opts.max_files_per_trigger = Some(10);
    let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, true)]));
    let source = FileSource::try_new(
        "events",
        input.to_str().unwrap(),
        &Default::default(),
        schema.clone(),
        opts,
    )
    .unwrap();
    // A hash join repartitions the stream: the source's error reaches the
    // driver through shared copies, and is still the source's own error.
    let ids = arrow::array::RecordBatch::try_new(
        schema.clone(),
        vec![Arc::new(arrow::array::Int64Array::from(vec![1, 2, 3]))],
    )
    .unwrap();
    let names = datafusion::datasource::MemTable::try_new(schema, vec![vec![ids]]).unwrap();
    let err = crate::common::available_now(
        source,
        "SELECT e.id FROM events e JOIN names n ON e.id = n.id",
        dir.join("table").to_str().unwrap(),
        dir.join("ckpt").to_str().unwrap(),
    )
    .static_table("names", Arc::new(names))
    .unwrap()
    .run()
    .await
    .unwrap_err();
    let Error::SourceInBatch { batch_id, source } = &err else {
        panic!("not the source's error: {err:?}");
    };
    assert_eq!(*batch_id, 0);
    let lakestream::source::Error::Malformed { file, line, .. } = source.as_ref() else {
        panic!("not a malformed-input error: {source:?}");
    };
    assert!(file.ends_with("part-0001.json"), "{file}");
    assert_eq!(*line, Some(2));
    assert_eq!(err.kind(), lakestream::ErrorKind::External);
    // Nothing of the batch reached the table.
    assert!(
        !dir.join("table/_delta_log/00000000000000000001.json")
            .exists()
    );
}

#[tokio::test]
async fn errors_say_whose_move_it_is() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let plan_err = query(dir, file_source(dir, "events"))
        .sql("SELECT no_such_column FROM events")
        .run()
        .await
        .unwrap_err();
    assert!(matches!(plan_err, Error::Plan(_)), "{plan_err:?}");
    assert_eq!(plan_err.kind(), lakestream::ErrorKind::User);
    assert!(
        plan_err.to_string().contains("no_such_column"),
        "{plan_err}"
    );
    let shape_err = query(dir, file_source(dir, "events"))
        .sql("SELECT id FROM events ORDER BY id")
        .run()
        .await
        .unwrap_err();
    assert!(matches!(shape_err, Error::InvalidQuery(_)), "{shape_err:?}");
    assert_eq!(shape_err.kind(), lakestream::ErrorKind::User);
}

/// A query that streams its batches reads a file source at
/// `max_bytes_per_trigger`; one that holds a batch in memory (a stateful
/// aggregation's groups, the rows several outputs share) at the smaller
/// `held_max_bytes_per_trigger`, unless that is unset (a cap the user
/// chose applies to both). Every run reads every row once.
#[tokio::test]
async fn queries_that_hold_batches_in_memory_read_smaller_batches() {
    use lakestream::sink::memory::MemorySink;
    use lakestream::{Output, OutputMode, Trigger};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // Eight files of 10 rows, 105-115 bytes each.
    write_files(&dir.join("in"), 0, 8);
    let source = |held: Option<u64>| {
        let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, true)]));
        let mut opts = FileSourceOptions::new(FileFormat::Json);
        opts.max_bytes_per_trigger = Some(1 << 20);
        opts.held_max_bytes_per_trigger = held;
        FileSource::try_new(
            "events",
            dir.join("in").to_str().unwrap(),
            &Default::default(),
            schema,
            opts,
        )
        .unwrap()
    };
    let run = |name: &str, held: Option<u64>, sql: &str, mode: OutputMode, second: bool| {
        let sink = MemorySink::new("out");
        let other = MemorySink::new("other");
        let mut q = QueryBuilder::new()
            .source(Arc::new(source(held)))
            .unwrap()
            .sql(sql)
            .output_mode(mode)
            .sink(Arc::new(sink.clone()))
            .checkpoint(dir.join(name).to_str().unwrap())
            .trigger(Trigger::AvailableNow);
        if second {
            q = q.output(Output::sql(
                "SELECT id FROM events",
                Arc::new(other.clone()),
            ));
        }
        async move {
            let summary = q.run().await.unwrap();
            let rows: usize = sink.batches().iter().map(|b| b.num_rows()).sum();
            let other: usize = other.batches().iter().map(|b| b.num_rows()).sum();
            (summary.batches, rows, other)
        }
    };
    let plain = "SELECT id FROM events";
    let grouped = "SELECT id % 2 AS k, count(*) AS n FROM events GROUP BY id % 2";
    // Streaming: all 880 bytes in one batch.
    assert_eq!(
        run("c1", Some(250), plain, OutputMode::Append, false).await,
        (1, 80, 0)
    );
    // Two files a batch under the held cap: stateful, or two outputs.
    let (batches, _, _) = run("c2", Some(250), grouped, OutputMode::Complete, false).await;
    assert_eq!(batches, 4);
    assert_eq!(
        run("c3", Some(250), plain, OutputMode::Append, true).await,
        (4, 80, 80)
    );
    // No held cap: the stateful query reads at max_bytes_per_trigger.
    let (batches, _, _) = run("c4", None, grouped, OutputMode::Complete, false).await;
    assert_eq!(batches, 1);
}
