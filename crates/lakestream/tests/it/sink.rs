//! The sinks' contract: a batch id commits at most once per query,
//! whichever writer tries, and a commit whose answer was lost is found by
//! the retry. The idempotence suite runs for every sink: Delta on a local
//! path, Delta on the S3-compatible server scripts/test.sh starts, and
//! memory.

use std::sync::Arc;

use lakestream::delta::{DeltaSink, DeltaSinkOptions};
use lakestream::sink::memory::MemorySink;
use lakestream::sink::{CommitInfo, CommitOutcome, Sink};
use lakestream_testkit::sink::{
    SinkTarget, column_values, commit, info, sink_idempotence, stage, value_batch as batch,
};

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
            write: Default::default(),
            claims: Vec::new(),
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
async fn a_commit_that_loses_its_version_to_another_writer_is_retried_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(dir.path()).await;
    let b = open(dir.path()).await;
    assert!(matches!(
        write(&b, "q2", 0).await,
        CommitOutcome::Committed { version: 1 }
    ));
    assert!(matches!(
        write(&a, "q1", 0).await,
        CommitOutcome::Committed { version: 2 }
    ));
    assert_eq!(a.commit_retries(), 0);
    // b last saw version 1, its own: its append of version 2 finds it
    // taken, and the conflict-checked retry commits version 3.
    assert!(matches!(
        write(&b, "q2", 1).await,
        CommitOutcome::Committed { version: 3 }
    ));
    assert_eq!(b.commit_retries(), 1);
    let (n, _) = crate::common::count_distinct(dir.path(), "v").await;
    assert_eq!(n, 3, "q2 batches 0 and 1, q1 batch 0: each once");
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

struct DeltaTarget {
    url: String,
    options: std::collections::HashMap<String, String>,
}

#[async_trait::async_trait]
impl SinkTarget for DeltaTarget {
    async fn writer(&self) -> Arc<dyn Sink> {
        let options = DeltaSinkOptions {
            storage_options: self.options.clone(),
            ..Default::default()
        };
        let sink = DeltaSink::try_new(&self.url, options).unwrap();
        sink.open(batch(0).schema()).await.unwrap();
        Arc::new(sink)
    }

    async fn values(&self) -> Vec<i64> {
        let location = lakestream::storage::Location::parse(&self.url, &self.options).unwrap();
        let Some(table) = lakestream::delta::load_table(&location).await.unwrap() else {
            return Vec::new();
        };
        let ctx = datafusion::prelude::SessionContext::new();
        table.update_datafusion_session(&ctx.state()).unwrap();
        ctx.register_table("t", table.table_provider().await.unwrap())
            .unwrap();
        let batches = ctx
            .sql("SELECT v FROM t ORDER BY v")
            .await
            .unwrap()
            .collect()
            .await
            .unwrap();
        column_values(&batches)
    }
}

struct MemoryTarget(MemorySink);

#[async_trait::async_trait]
impl SinkTarget for MemoryTarget {
    async fn writer(&self) -> Arc<dyn Sink> {
        let sink = self.0.clone();
        sink.open(batch(0).schema()).await.unwrap();
        Arc::new(sink)
    }

    async fn values(&self) -> Vec<i64> {
        let mut v = column_values(&self.0.batches());
        v.sort();
        v
    }
}

#[tokio::test]
async fn the_delta_sink_on_a_local_path_passes_the_idempotence_suite() {
    let dir = tempfile::tempdir().unwrap();
    sink_idempotence(|name| DeltaTarget {
        url: dir.path().join(name).to_str().unwrap().to_string(),
        options: Default::default(),
    })
    .await;
}

#[tokio::test]
async fn the_delta_sink_on_s3_passes_the_idempotence_suite() {
    let (options, prefix) = crate::common::s3_server("sink-suite");
    sink_idempotence(|name| DeltaTarget {
        url: format!("{prefix}{name}/"),
        options: options.clone(),
    })
    .await;
}

#[tokio::test]
async fn the_memory_sink_passes_the_idempotence_suite() {
    sink_idempotence(|name| MemoryTarget(MemorySink::new(name))).await;
}

#[tokio::test]
async fn a_memory_commit_whose_answer_was_lost_is_in_the_table_once() {
    let sink = MemorySink::new("lost");
    sink.open(batch(0).schema()).await.unwrap();
    sink.lose_next_commit_response();
    let staged = stage(&sink, 0, &[1]).await;
    let err = sink.commit(staged, &info("q", 0)).await.unwrap_err();
    assert!(err.to_string().contains("batch 0"), "{err}");
    // The caller re-runs the batch: it is found, not written again.
    assert!(matches!(
        commit(&sink, "q", 0, &[1]).await,
        CommitOutcome::AlreadyCommitted { .. }
    ));
    assert_eq!(sink.rows(), 1);
    assert_eq!(sink.version().await.unwrap(), Some(1));
}

/// The actions of commit `version` of the table at `dir`, one JSON value
/// per line, `commitInfo.timestamp` removed (the only field two commits of
/// the same actions may differ in), sorted.
fn commit_actions(dir: &std::path::Path, version: u64) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join(format!("_delta_log/{version:020}.json"))).unwrap();
    let mut actions: Vec<serde_json::Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            if let Some(info) = v.get_mut("commitInfo").and_then(|i| i.as_object_mut()) {
                info.remove("timestamp");
            }
            v
        })
        .collect();
    actions.sort_by_key(|a| a.to_string());
    actions
}

#[tokio::test]
async fn the_fast_append_writes_what_delta_rs_commit_writes() {
    use deltalake::kernel::transaction::{CommitBuilder, CommitProperties};
    use deltalake::kernel::{Action, Transaction};
    use deltalake::protocol::{DeltaOperation, OutputMode};
    let dir = tempfile::tempdir().unwrap();
    let (fast, slow) = (dir.path().join("fast"), dir.path().join("slow"));
    // Batch 0 through the sink's own append path.
    let sink = open(&fast).await;
    assert!(matches!(
        write(&sink, "q", 0).await,
        CommitOutcome::Committed { version: 1 }
    ));
    let fast_actions = commit_actions(&fast, 1);

    // The same actions committed by delta-rs's CommitBuilder to a table the
    // sink created the same way.
    drop(open(&slow).await);
    let table = deltalake::open_table(url::Url::from_directory_path(&slow).unwrap())
        .await
        .unwrap();
    let adds: Vec<Action> = fast_actions
        .iter()
        .filter(|a| a.get("add").is_some())
        .map(|a| serde_json::from_value(a.clone()).unwrap())
        .collect();
    assert_eq!(adds.len(), 1);
    let lakestream = fast_actions
        .iter()
        .find_map(|a| a.get("commitInfo"))
        .and_then(|i| i.get("lakestream"))
        .expect("lakestream's metadata in commitInfo")
        .clone();
    let props = CommitProperties::default()
        .with_application_transaction(Transaction::new("q", 0))
        .with_metadata([("lakestream".to_string(), lakestream)]);
    CommitBuilder::from(props)
        .with_actions(adds)
        .build(
            Some(table.snapshot().unwrap()),
            table.log_store(),
            DeltaOperation::StreamingUpdate {
                output_mode: OutputMode::Append,
                query_id: "q".into(),
                epoch_id: 0,
            },
        )
        .await
        .unwrap();
    assert_eq!(commit_actions(&slow, 1), fast_actions);

    // And a fresh reader of the fast table sees the batch and its txn.
    let read = deltalake::open_table(url::Url::from_directory_path(&fast).unwrap())
        .await
        .unwrap();
    let txn = read
        .snapshot()
        .unwrap()
        .transaction_version(read.log_store().as_ref(), "q")
        .await
        .unwrap();
    assert_eq!(txn, Some(0));
    assert_eq!(crate::common::count_distinct(&fast, "v").await, (1, 1));
}

/// An upsert (update mode) reads only the table's files whose key range
/// holds one of its keys: a table of two files with disjoint ranges, a
/// batch changing keys of one, one file scanned. A NULL key cannot be
/// ranged: its upsert scans every file, and still updates rather than
/// duplicates.
#[tokio::test]
async fn an_upsert_reads_only_the_files_its_keys_can_be_in() {
    use arrow::array::{Int64Array, RecordBatch};
    let dir = tempfile::tempdir().unwrap();
    let sink = open(dir.path()).await;
    let upsert = |id| CommitInfo {
        write: lakestream::sink::WriteMode::Upsert {
            keys: vec!["v".into()],
        },
        ..info("q", id)
    };
    let low: Vec<i64> = (0..100).collect();
    let high: Vec<i64> = (1000..1100).collect();
    commit(&sink, "q", 0, &low).await;
    commit(&sink, "q", 1, &high).await;
    let staged = stage(&sink, 2, &[1005, 1050, 2000]).await;
    assert!(matches!(
        sink.commit(staged, &upsert(2)).await.unwrap(),
        CommitOutcome::Committed { .. }
    ));
    let metrics = |version: u64| {
        let log = dir.path().join(format!("_delta_log/{version:020}.json"));
        let text = std::fs::read_to_string(&log).unwrap();
        let info: serde_json::Value = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .find(|a| a.get("commitInfo").is_some())
            .unwrap();
        info["commitInfo"]["operationMetrics"].clone()
    };
    let m = metrics(3);
    assert_eq!(m["num_target_files_scanned"], 1, "{m}");
    assert_eq!(m["num_target_files_skipped_during_scan"], 1, "{m}");
    let mut expected: Vec<i64> = low.iter().chain(&high).copied().collect();
    expected.push(2000);
    let read = crate::common::read_table(dir.path(), "SELECT v FROM t ORDER BY v").await;
    assert_eq!(column_values(&read), expected);

    // NULL keys: inserted once, then updated in place.
    let null_batch = RecordBatch::try_new(
        batch(0).schema(),
        vec![std::sync::Arc::new(Int64Array::from(vec![None::<i64>]))],
    )
    .unwrap();
    for id in [3, 4] {
        let mut w = sink.begin(id).await.unwrap();
        w.write(null_batch.clone()).await.unwrap();
        w.write(batch(5)).await.unwrap();
        let staged = w.finish().await.unwrap();
        assert!(matches!(
            sink.commit(staged, &upsert(id)).await.unwrap(),
            CommitOutcome::Committed { .. }
        ));
    }
    let m = metrics(5);
    assert_eq!(m["num_target_files_skipped_during_scan"], 0, "{m}");
    // 201 rows before, one NULL row added once, 5 updated in place.
    assert_eq!(
        crate::common::count_distinct(dir.path(), "v").await,
        (202, 201)
    );
}

/// A partitioned table's batches are written by runs of equal partition
/// values (a time-ordered batch) or, past many runs, by delta-rs's own
/// split: either way every row comes back with its own partition values,
/// including a NULL one, and a batch leaves one file per partition.
#[tokio::test]
async fn a_partitioned_batch_lands_each_row_in_its_own_partition() {
    use arrow::array::{Array, AsArray, Date32Array, Int64Array, RecordBatch, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    let dir = tempfile::tempdir().unwrap();
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("day", DataType::Date32, true),
        Field::new("kind", DataType::Utf8, true),
    ]));
    let sink = DeltaSink::try_new(
        dir.path().to_str().unwrap(),
        DeltaSinkOptions {
            partition_columns: vec!["day".into(), "kind".into()],
            ..Default::default()
        },
    )
    .unwrap();
    sink.open(schema.clone()).await.unwrap();
    let rows = |ids: Vec<i64>, days: Vec<Option<i32>>, kinds: Vec<&str>| {
        RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from(ids)),
                Arc::new(Date32Array::from(days)),
                Arc::new(StringArray::from(kinds)),
            ],
        )
        .unwrap()
    };
    // Batch 0: five runs, one partition met twice, a NULL day.
    let day = |i: i64| Some(20_000 + (i % 7) as i32);
    let first = rows(
        vec![0, 1, 2, 3, 4, 5, 6],
        vec![day(0), day(0), day(1), day(1), day(0), None, None],
        vec!["a", "a", "a", "a", "b", "a", "a"],
    );
    // Batch 1: 200 rows over 14 partitions, each row a run of its own.
    let ids: Vec<i64> = (100..300).collect();
    let second = rows(
        ids.clone(),
        ids.iter().map(|&i| day(i)).collect(),
        ids.iter()
            .map(|&i| if i % 2 == 0 { "a" } else { "b" })
            .collect(),
    );
    for (id, batch) in [first, second].into_iter().enumerate() {
        let mut w = sink.begin(id as u64).await.unwrap();
        // Written in two calls: a partition's file takes both.
        let half = batch.num_rows() / 2;
        w.write(batch.slice(0, half)).await.unwrap();
        w.write(batch.slice(half, batch.num_rows() - half))
            .await
            .unwrap();
        let staged = w.finish().await.unwrap();
        sink.commit(staged, &info("q", id as u64)).await.unwrap();
    }

    // Every row with the partition values it was written with.
    let back = crate::common::read_table(
        dir.path(),
        "SELECT id, CAST(day AS BIGINT) - 20000 AS d, kind FROM t ORDER BY id",
    )
    .await;
    let mut got = Vec::new();
    for b in &back {
        let id = b.column(0).as_primitive::<arrow::datatypes::Int64Type>();
        let d = b.column(1).as_primitive::<arrow::datatypes::Int64Type>();
        let k = arrow::compute::cast(b.column(2), &DataType::Utf8).unwrap();
        let k = k.as_string::<i32>();
        for r in 0..b.num_rows() {
            got.push((
                id.value(r),
                d.is_valid(r).then(|| d.value(r)),
                k.value(r).to_string(),
            ));
        }
    }
    let mut want: Vec<(i64, Option<i64>, String)> = vec![
        (0, Some(0), "a".into()),
        (1, Some(0), "a".into()),
        (2, Some(1), "a".into()),
        (3, Some(1), "a".into()),
        (4, Some(0), "b".into()),
        (5, None, "a".into()),
        (6, None, "a".into()),
    ];
    want.extend(ids.iter().map(|&i| {
        (
            i,
            Some(i % 7),
            if i % 2 == 0 { "a" } else { "b" }.to_string(),
        )
    }));
    assert_eq!(got, want);

    // One file per partition per batch: 4 in batch 0, 14 in batch 1.
    for (version, partitions) in [(1, 4), (2, 14)] {
        let adds: Vec<serde_json::Value> = commit_actions(dir.path(), version)
            .into_iter()
            .filter_map(|a| a.get("add").cloned())
            .collect();
        let distinct: std::collections::BTreeSet<String> = adds
            .iter()
            .map(|a| a["partitionValues"].to_string())
            .collect();
        assert_eq!(
            (adds.len(), distinct.len()),
            (partitions, partitions),
            "{adds:?}"
        );
    }
}

/// Unordered partition values keep one open file per partition until the
/// writer closes them; past `unordered_flush_size` of such input it closes
/// them mid-batch. The files closed early are in the batch's one commit
/// with the rest, every row lands once in its own partition, and nothing
/// is visible before the commit.
#[tokio::test]
async fn unordered_partitions_flushed_mid_batch_commit_every_row_once() {
    use arrow::array::{AsArray, Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Int64Type, Schema};
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("day", DataType::Int64, false),
    ]));
    // Ten record batches of 1,000 rows over 20 days, each row a run of
    // its own (delta-rs's split, not the runs' writer).
    let batches: Vec<RecordBatch> = (0..10)
        .map(|b| {
            let ids: Vec<i64> = (b * 1000..(b + 1) * 1000).collect();
            let days: Vec<i64> = ids.iter().map(|i| (i * 7) % 20).collect();
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(Int64Array::from(ids)),
                    Arc::new(Int64Array::from(days)),
                ],
            )
            .unwrap()
        })
        .collect();
    let run = |flush: Option<u64>| {
        let schema = schema.clone();
        let batches = batches.clone();
        async move {
            let dir = tempfile::tempdir().unwrap();
            let mut options = DeltaSinkOptions {
                partition_columns: vec!["day".into()],
                ..Default::default()
            };
            if let Some(f) = flush {
                options.unordered_flush_size = f;
            }
            let sink = DeltaSink::try_new(dir.path().to_str().unwrap(), options).unwrap();
            sink.open(schema).await.unwrap();
            let mut w = sink.begin(0).await.unwrap();
            for b in batches {
                w.write(b).await.unwrap();
            }
            let staged = w.finish().await.unwrap();
            // Written, not committed: the table has no row yet.
            let before = crate::common::read_table(dir.path(), "SELECT id FROM t").await;
            assert_eq!(before.iter().map(|b| b.num_rows()).sum::<usize>(), 0);
            sink.commit(staged, &info("q", 0)).await.unwrap();
            let adds = commit_actions(dir.path(), 1)
                .into_iter()
                .filter(|a| a.get("add").is_some())
                .count();
            let back =
                crate::common::read_table(dir.path(), "SELECT id, day FROM t ORDER BY id").await;
            let mut rows = Vec::new();
            for b in &back {
                let id = b.column(0).as_primitive::<Int64Type>();
                let day = arrow::compute::cast(b.column(1), &DataType::Int64).unwrap();
                let day = day.as_primitive::<Int64Type>();
                rows.extend((0..b.num_rows()).map(|r| (id.value(r), day.value(r))));
            }
            (adds, rows)
        }
    };
    let want: Vec<(i64, i64)> = (0..10_000).map(|i| (i, (i * 7) % 20)).collect();
    // The default budget (8 MiB) is never reached: one file per day.
    let (files, rows) = run(None).await;
    assert_eq!(files, 20);
    assert_eq!(rows, want);
    // A budget below one record batch closes every day's file after each.
    let (files, rows) = run(Some(1)).await;
    assert_eq!(files, 200);
    assert_eq!(rows, want);
}
