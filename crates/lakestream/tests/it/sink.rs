//! The Delta sink's contract: a batch id commits at most once per query,
//! whichever process tries.

use std::sync::Arc;

use arrow::array::{Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use lakestream::sink::delta::{DeltaSink, DeltaSinkOptions};
use lakestream::sink::{CommitInfo, CommitOutcome, Sink};

fn batch(v: i64) -> RecordBatch {
    RecordBatch::try_new(
        Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, true)])),
        vec![Arc::new(Int64Array::from(vec![v]))],
    )
    .unwrap()
}

async fn write(sink: &DeltaSink, query: &str, id: u64) -> CommitOutcome {
    let mut w = sink.begin(id).await.unwrap();
    w.write(batch(id as i64)).await.unwrap();
    let staged = w.finish().await.unwrap();
    sink.commit(
        staged,
        &CommitInfo {
            query_id: query.into(),
            batch_id: id,
            metadata: Default::default(),
        },
    )
    .await
    .unwrap()
}

async fn open(dir: &std::path::Path) -> DeltaSink {
    let sink = DeltaSink::try_new(dir.to_str().unwrap(), DeltaSinkOptions::default()).unwrap();
    sink.open(batch(0).schema()).await.unwrap();
    sink
}

#[tokio::test]
async fn a_batch_id_commits_once_per_query_whoever_writes_it() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(dir.path()).await;
    for id in 0..4 {
        assert!(matches!(
            write(&a, "q1", id).await,
            CommitOutcome::Committed { .. }
        ));
    }
    // A replay of an old batch is skipped.
    assert!(matches!(
        write(&a, "q1", 2).await,
        CommitOutcome::AlreadyCommitted { .. }
    ));
    // Another writer (another process of the same query) commits batch 4.
    let b = open(dir.path()).await;
    assert!(matches!(
        write(&b, "q1", 4).await,
        CommitOutcome::Committed { version: 5 }
    ));
    // The first writer's view is behind; its commit of 4 must still be refused.
    assert!(matches!(
        write(&a, "q1", 4).await,
        CommitOutcome::AlreadyCommitted { .. }
    ));
    // Another query's ids are its own.
    assert!(matches!(
        write(&a, "q2", 4).await,
        CommitOutcome::Committed { .. }
    ));
    assert_eq!(a.committed_batch("q1").await.unwrap(), Some(4));
    assert_eq!(a.committed_batch("q2").await.unwrap(), Some(4));
    assert_eq!(a.committed_batch("q3").await.unwrap(), None);
    let (n, _) = crate::common::count_distinct(dir.path(), "v").await;
    assert_eq!(n, 6, "batches 0..=4 of q1 and 4 of q2");
}

#[tokio::test]
async fn appends_write_a_delta_checkpoint_every_ten_commits() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(dir.path()).await;
    for id in 0..25 {
        assert!(matches!(
            write(&a, "q1", id).await,
            CommitOutcome::Committed { version } if version == id + 1
        ));
        // Checkpoints are written off the batch path; wait for each.
        a.flush().await;
    }
    let log = dir.path().join("_delta_log");
    for v in [9, 19] {
        assert!(
            log.join(format!("{v:020}.checkpoint.parquet")).exists(),
            "checkpoint at version {v}"
        );
    }
    assert!(!log.join(format!("{:020}.checkpoint.parquet", 24)).exists());
    let last: serde_json::Value =
        serde_json::from_slice(&std::fs::read(log.join("_last_checkpoint")).unwrap()).unwrap();
    assert_eq!(last["version"], 19);
    // A fresh reader (from the checkpoint plus later commits) sees every
    // batch once, and the interval the table was created with.
    let table = deltalake::open_table(url::Url::from_directory_path(dir.path()).unwrap())
        .await
        .unwrap();
    assert_eq!(table.version(), Some(25));
    assert_eq!(
        table
            .snapshot()
            .unwrap()
            .metadata()
            .configuration()
            .get("delta.checkpointInterval"),
        Some(&"10".to_string())
    );
    let b = open(dir.path()).await;
    assert_eq!(b.committed_batch("q1").await.unwrap(), Some(24));
    let (n, distinct) = crate::common::count_distinct(dir.path(), "v").await;
    assert_eq!((n, distinct), (25, 25));
}

#[tokio::test]
async fn a_table_with_a_newer_writer_protocol_commits_through_delta_rs() {
    use deltalake::kernel::{DataType as DeltaType, PrimitiveType, StructField};
    let dir = tempfile::tempdir().unwrap();
    // Change data feed needs writer protocol 4: lakestream's own append
    // path does not apply, delta-rs's commit (which checks the features) does.
    let url = url::Url::from_directory_path(dir.path()).unwrap();
    let created = deltalake::DeltaTable::try_from_url(url.clone())
        .await
        .unwrap()
        .create()
        .with_columns([StructField::new(
            "v",
            DeltaType::Primitive(PrimitiveType::Long),
            true,
        )])
        .with_configuration_property(deltalake::TableProperty::EnableChangeDataFeed, Some("true"))
        .await
        .unwrap();
    let protocol = created.snapshot().unwrap().protocol().clone();
    assert!(protocol.min_writer_version() > 2, "{protocol:?}");
    let a = open(dir.path()).await;
    for id in 0..12 {
        assert!(matches!(
            write(&a, "q1", id).await,
            CommitOutcome::Committed { version } if version == id + 1
        ));
    }
    assert!(matches!(
        write(&a, "q1", 11).await,
        CommitOutcome::AlreadyCommitted { .. }
    ));
    let (n, distinct) = crate::common::count_distinct(dir.path(), "v").await;
    assert_eq!((n, distinct), (12, 12));
}
