//! The sink idempotence suite: what the engine relies on from every sink.
//!
//! [`sink_idempotence`] runs against fresh tables from a [`SinkTarget`]:
//! a batch committed twice (and a replay of an older one) is in the table
//! once; two writers staging the same batch id commit it once, whichever
//! goes second and whatever its view of the table; after a crash right
//! after a commit, a new writer knows the batch is there and its re-run
//! commits nothing; batch ids belong to their query, and an empty batch is
//! recorded too; parts staged by another kind of sink are refused, naming
//! the batch; a batch that replaces every row (complete output mode) does
//! so once, and a replay of it leaves the table as it was; so does an
//! upsert's. Tables hold one `v BIGINT` column ([`value_batch`]).

use std::sync::Arc;

use arrow::array::{Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use lakestream_engine::sink::{CommitInfo, CommitOutcome, Sink, Staged, WriteMode};

/// A one-row batch `v = value`: the rows the suite writes.
pub fn value_batch(value: i64) -> RecordBatch {
    RecordBatch::try_new(
        Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, true)])),
        vec![Arc::new(Int64Array::from(vec![value]))],
    )
    .expect("one Int64 column")
}

/// A table under the idempotence suite: handles on it, as separate
/// writers (processes) would open it, and its rows read back.
#[async_trait::async_trait]
pub trait SinkTarget: Send + Sync {
    /// A new writer on the table, opened for [`value_batch`]'s schema.
    async fn writer(&self) -> Arc<dyn Sink>;
    /// The `v` values the table holds, sorted.
    async fn values(&self) -> Vec<i64>;
}

/// The `v` values of `batches`, in order.
pub fn column_values(batches: &[RecordBatch]) -> Vec<i64> {
    batches
        .iter()
        .flat_map(|b| {
            b.column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .values()
                .to_vec()
        })
        .collect()
}

/// Stage batch `id` with one row per value.
pub async fn stage(sink: &dyn Sink, id: u64, values: &[i64]) -> Staged {
    let mut w = sink.begin(id).await.unwrap();
    for v in values {
        w.write(value_batch(*v)).await.unwrap();
    }
    w.finish().await.unwrap()
}

/// The commit info of batch `id` of `query`.
pub fn info(query: &str, id: u64) -> CommitInfo {
    CommitInfo {
        query_id: query.into(),
        batch_id: id,
        metadata: Default::default(),
        write: WriteMode::Append,
    }
}

/// Stage and commit batch `id` of `query`.
pub async fn commit(sink: &dyn Sink, query: &str, id: u64, values: &[i64]) -> CommitOutcome {
    let staged = stage(sink, id, values).await;
    sink.commit(staged, &info(query, id)).await.unwrap()
}

/// Commit batch `id` of `query` and check it landed.
pub async fn assert_committed(sink: &dyn Sink, query: &str, id: u64, values: &[i64]) {
    let outcome = commit(sink, query, id, values).await;
    assert!(
        matches!(outcome, CommitOutcome::Committed { .. }),
        "batch {id} of {query}: {outcome:?}"
    );
}

/// Commit batch `id` of `query` again and check nothing was committed.
pub async fn assert_already(sink: &dyn Sink, query: &str, id: u64, values: &[i64]) {
    let outcome = commit(sink, query, id, values).await;
    assert!(
        matches!(outcome, CommitOutcome::AlreadyCommitted { .. }),
        "batch {id} of {query}: {outcome:?}"
    );
}

/// Stage `values` as batch `info.batch_id` and commit them with `info`;
/// check the commit landed (`committed`) or found the batch already there.
pub async fn assert_outcome(sink: &dyn Sink, info: &CommitInfo, values: &[i64], committed: bool) {
    let staged = stage(sink, info.batch_id, values).await;
    let outcome = sink.commit(staged, info).await.unwrap();
    let landed = matches!(outcome, CommitOutcome::Committed { .. });
    assert_eq!(
        landed, committed,
        "batch {} ({:?}): {outcome:?}",
        info.batch_id, info.write
    );
}

/// The contract every sink keeps, run against fresh tables from `target`
/// (called with a name per scenario). Panics, naming the scenario's
/// batch, on the first breach.
pub async fn sink_idempotence<T: SinkTarget>(target: impl Fn(&str) -> T) {
    // A batch committed twice by one writer is in the table once; so is a
    // replay of an older batch.
    let t = target("twice");
    let a = t.writer().await;
    assert_committed(&*a, "q", 0, &[1, 2]).await;
    assert_committed(&*a, "q", 1, &[3]).await;
    assert_already(&*a, "q", 1, &[3]).await;
    assert_already(&*a, "q", 0, &[1, 2]).await;
    assert_eq!(t.values().await, vec![1, 2, 3]);

    // Two writers stage the same batch; whichever commits second finds it
    // committed, whatever its view of the table was.
    let t = target("two-writers");
    let (a, b) = (t.writer().await, t.writer().await);
    let from_a = stage(&*a, 0, &[10, 11]).await;
    let from_b = stage(&*b, 0, &[10, 11]).await;
    let first = b.commit(from_b, &info("q", 0)).await.unwrap();
    let second = a.commit(from_a, &info("q", 0)).await.unwrap();
    assert!(
        matches!(first, CommitOutcome::Committed { .. }),
        "{first:?}"
    );
    assert!(
        matches!(second, CommitOutcome::AlreadyCommitted { .. }),
        "{second:?}"
    );
    assert_eq!(t.values().await, vec![10, 11]);

    // After a crash right after a commit, a new writer knows the batch is
    // in the table, and its re-run commits nothing.
    let t = target("restart");
    let a = t.writer().await;
    assert_committed(&*a, "q", 0, &[20]).await;
    assert_committed(&*a, "q", 1, &[21]).await;
    drop(a);
    let b = t.writer().await;
    assert_eq!(b.committed_batch("q").await.unwrap(), Some(1));
    assert_already(&*b, "q", 1, &[21]).await;
    assert_committed(&*b, "q", 2, &[22]).await;
    assert_eq!(t.values().await, vec![20, 21, 22]);

    // Batch ids belong to their query; an empty batch is recorded too.
    let t = target("queries");
    let a = t.writer().await;
    assert_committed(&*a, "q1", 5, &[30]).await;
    assert_committed(&*a, "q2", 5, &[31]).await;
    assert_committed(&*a, "q2", 6, &[]).await;
    assert_eq!(a.committed_batch("q1").await.unwrap(), Some(5));
    assert_eq!(a.committed_batch("q2").await.unwrap(), Some(6));
    assert_eq!(a.committed_batch("q3").await.unwrap(), None);
    assert_eq!(t.values().await, vec![30, 31]);

    // A batch that replaces every row does, once: its replay (after the
    // appends of later batches) changes nothing.
    let t = target("replace");
    let a = t.writer().await;
    let replace = |id| CommitInfo {
        write: WriteMode::ReplaceAll,
        ..info("q", id)
    };
    assert_committed(&*a, "q", 0, &[40, 41]).await;
    assert_outcome(&*a, &replace(1), &[42], true).await;
    assert_eq!(t.values().await, vec![42]);
    assert_outcome(&*a, &replace(2), &[43, 44], true).await;
    assert_outcome(&*t.writer().await, &replace(2), &[99], false).await;
    assert_eq!(t.values().await, vec![43, 44]);

    // An upsert replaces the rows with its keys and adds the others; a
    // replay of it (by another writer) changes nothing.
    let t = target("upsert");
    let a = t.writer().await;
    let upsert = |id| CommitInfo {
        write: WriteMode::Upsert {
            keys: vec!["v".into()],
        },
        ..info("q", id)
    };
    assert_committed(&*a, "q", 0, &[50, 51]).await;
    assert_outcome(&*a, &upsert(1), &[51, 52], true).await;
    assert_eq!(t.values().await, vec![50, 51, 52]);
    assert_outcome(&*t.writer().await, &upsert(1), &[53], false).await;
    assert_eq!(t.values().await, vec![50, 51, 52]);

    // Parts staged by another kind of sink are refused, naming the batch.
    let t = target("foreign");
    let a = t.writer().await;
    let foreign = Staged::new(7, 1, 0, 0, "not this sink's part");
    let err = a.commit(foreign, &info("q", 7)).await.unwrap_err();
    assert!(err.to_string().contains("batch 7"), "{err}");
    assert_eq!(a.committed_batch("q").await.unwrap(), None);
}
