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
