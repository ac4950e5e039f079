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
//! upsert's. Positions kept in the table (Kafka group mode) move as a
//! compare-and-set: of two writers claiming the same range at once exactly
//! one lands, a stale claim lands nothing, and a new writer reads where
//! the last commit left them. Tables hold one `v BIGINT` column
//! ([`value_batch`]).

use std::sync::Arc;

use arrow::array::{Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use lakestream_engine::sink::{CommitInfo, CommitOutcome, PositionClaim, Sink, Staged, WriteMode};

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
        claims: Vec::new(),
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
    batches_land_once(&target).await;
    batch_ids_are_per_query(&target("queries")).await;
    replacements_and_upserts_land_once(&target).await;
    claimed_positions_land_once(&target("positions")).await;
    // Parts staged by another kind of sink are refused, naming the batch.
    let t = target("foreign");
    let a = t.writer().await;
    let foreign = Staged::new(7, 1, 0, 0, "not this sink's part");
    let err = a.commit(foreign, &info("q", 7)).await.unwrap_err();
    assert!(err.to_string().contains("batch 7"), "{err}");
    assert_eq!(a.committed_batch("q").await.unwrap(), None);
}

/// A batch committed twice, by one writer, by two, or after a restart, is
/// in the table once.
async fn batches_land_once<T: SinkTarget>(target: &impl Fn(&str) -> T) {
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
}

/// Batch ids belong to their query; an empty batch is recorded too.
async fn batch_ids_are_per_query(t: &impl SinkTarget) {
    let a = t.writer().await;
    assert_committed(&*a, "q1", 5, &[30]).await;
    assert_committed(&*a, "q2", 5, &[31]).await;
    assert_committed(&*a, "q2", 6, &[]).await;
    assert_eq!(a.committed_batch("q1").await.unwrap(), Some(5));
    assert_eq!(a.committed_batch("q2").await.unwrap(), Some(6));
    assert_eq!(a.committed_batch("q3").await.unwrap(), None);
    assert_eq!(t.values().await, vec![30, 31]);
}

/// A replacement and an upsert land once: their replays change nothing.
async fn replacements_and_upserts_land_once<T: SinkTarget>(target: &impl Fn(&str) -> T) {
    // A batch that replaces every row does, once: its replay (after the
    // appends of later batches) changes nothing.
    let t = target("replace");
    let a = t.writer().await;
    let replace = |id| CommitInfo {
        write: WriteMode::ReplaceAll { keys: None },
        claims: Vec::new(),
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
}

/// Positions kept in the table ([`PositionClaim`]s): of two claims of one
/// range exactly one lands, a stale claim is superseded, and a commit's
/// claims land together or not at all.
async fn claimed_positions_land_once(t: &impl SinkTarget) {
    // partition at once (a rebalance race); exactly one commit lands, the
    // other is told it was superseded, and the chain of ranges goes on
    // from where the winner left it.
    let (a, b) = (t.writer().await, t.writer().await);
    let part = "g/topic/0".to_string();
    let claimed = |query: &str, id, from, to| CommitInfo {
        claims: vec![PositionClaim {
            app_id: part.clone(),
            from,
            to,
        }],
        ..info(query, id)
    };
    assert!(
        a.positions(std::slice::from_ref(&part))
            .await
            .unwrap()
            .is_empty()
    );
    let (sa, sb) = (stage(&*a, 0, &[60]).await, stage(&*b, 0, &[61]).await);
    let (ia, ib) = (claimed("qa", 0, 0, 10), claimed("qb", 0, 0, 10));
    let (ra, rb) = tokio::join!(a.commit(sa, &ia), b.commit(sb, &ib));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    let landed = [&ra, &rb]
        .iter()
        .filter(|o| matches!(o, CommitOutcome::Committed { .. }))
        .count();
    assert_eq!(landed, 1, "two claims of one range: {ra:?} / {rb:?}");
    let (winner, loser, loser_q) = if matches!(ra, CommitOutcome::Committed { .. }) {
        (a.clone(), b.clone(), "qb")
    } else {
        (b.clone(), a.clone(), "qa")
    };
    let lost = if loser_q == "qb" { &rb } else { &ra };
    assert!(
        matches!(
            lost,
            CommitOutcome::Superseded {
                expected: 0,
                found: 10,
                ..
            }
        ),
        "{lost:?}"
    );
    assert_eq!(t.values().await.len(), 1);
    let fresh = t.writer().await;
    assert_eq!(
        fresh.positions(std::slice::from_ref(&part)).await.unwrap(),
        [(part.clone(), 10)].into_iter().collect()
    );
    // The loser plans again from the table: its next range lands.
    assert_outcome(&*loser, &claimed(loser_q, 1, 10, 20), &[62], true).await;
    // The winner, still at 10, is superseded and nothing is written.
    let stale = stage(&*winner, 1, &[63]).await;
    let winner_q = if loser_q == "qb" { "qa" } else { "qb" };
    let outcome = winner
        .commit(stale, &claimed(winner_q, 1, 10, 15))
        .await
        .unwrap();
    assert!(
        matches!(
            outcome,
            CommitOutcome::Superseded {
                expected: 10,
                found: 20,
                ..
            }
        ),
        "{outcome:?}"
    );
    // A commit with two claims lands for both or neither.
    let both = CommitInfo {
        claims: vec![
            PositionClaim {
                app_id: "g/topic/1".into(),
                from: 0,
                to: 5,
            },
            PositionClaim {
                app_id: part.clone(),
                from: 15,
                to: 25,
            },
        ],
        ..info(winner_q, 2)
    };
    assert_outcome(&*fresh, &both, &[64], false).await;
    let ids = vec![part.clone(), "g/topic/1".to_string()];
    assert_eq!(
        fresh.positions(&ids).await.unwrap(),
        [(part.clone(), 20)].into_iter().collect()
    );
    let mut values = t.values().await;
    values.retain(|v| *v != 60 && *v != 61);
    assert_eq!(values, vec![62]);
}
