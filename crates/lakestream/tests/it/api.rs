//! Queries built in Rust: fail points at each protocol step, `now()` on
//! replay, stopping, refused query shapes.

use std::sync::Arc;
use std::time::Duration;

use arrow::array::AsArray;
use lakestream::delta::{DeltaSink, DeltaSinkOptions};
use lakestream::source::generator::{GeneratorOptions, GeneratorSource};
use lakestream::{Error, FailPoint, QueryBuilder, Trigger};

fn generator(rows: u64, per_batch: u64) -> Arc<GeneratorSource> {
    Arc::new(
        GeneratorSource::try_new(
            "events",
            GeneratorOptions {
                rows: Some(rows),
                max_rows_per_trigger: Some(per_batch),
                batch_size: 64,
                ..Default::default()
            },
        )
        .unwrap(),
    )
}

fn builder(dir: &std::path::Path, rows: u64, per_batch: u64, sql: &str) -> QueryBuilder {
    QueryBuilder::new()
        .source(generator(rows, per_batch))
        .unwrap()
        .sql(sql)
        .sink(Arc::new(
            DeltaSink::try_new(
                dir.join("table").to_str().unwrap(),
                DeltaSinkOptions {
                    partition_columns: vec!["event_type".into()],
                    ..Default::default()
                },
            )
            .unwrap(),
        ))
        .checkpoint(dir.join("ckpt").to_str().unwrap())
        .trigger(Trigger::AvailableNow)
}

/// Run `sql` over the Delta table at `dir/table`, read with delta-rs.
async fn read(dir: &std::path::Path, sql: &str) -> Vec<arrow::array::RecordBatch> {
    crate::common::read_table(&dir.join("table"), sql).await
}

async fn count_and_distinct(dir: &std::path::Path) -> (i64, i64) {
    crate::common::count_distinct(&dir.join("table"), "event_id").await
}

const SQL: &str = "SELECT event_id, user_id, event_type, amount, ts FROM events WHERE amount > 0";

#[tokio::test]
async fn every_row_lands_once_whichever_step_crashes() {
    let clean = tempfile::tempdir().unwrap();
    let summary = builder(clean.path(), 2000, 500, SQL).run().await.unwrap();
    assert_eq!(summary.batches, 4);
    assert_eq!(summary.input_rows, 2000);
    let expected = count_and_distinct(clean.path()).await;
    assert_eq!(expected.0, expected.1);
    assert_eq!(expected.0 as u64, summary.output_rows);

    for point in [
        FailPoint::AfterWriteAhead,
        FailPoint::AfterFiles,
        FailPoint::AfterCommit,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let err = builder(dir.path(), 2000, 500, SQL)
            .fail_point(point, 2)
            .run()
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::InjectedFault { batch_id: 2, .. }),
            "{err}"
        );
        builder(dir.path(), 2000, 500, SQL).run().await.unwrap();
        assert_eq!(count_and_distinct(dir.path()).await, expected, "{point:?}");
    }
}

#[tokio::test]
async fn a_replayed_batch_sees_the_same_now() {
    let dir = tempfile::tempdir().unwrap();
    let sql = "SELECT event_id, event_type, now() AS seen_at FROM events";
    let err = builder(dir.path(), 100, 100, sql)
        .fail_point(FailPoint::AfterFiles, 0)
        .run()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InjectedFault { .. }));
    // Later wall-clock time; the batch's logged timestamp must win.
    tokio::time::sleep(Duration::from_millis(20)).await;
    builder(dir.path(), 100, 100, sql).run().await.unwrap();
    let offsets: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("ckpt/offsets/0")).unwrap()).unwrap();
    let logged_ms = offsets["batch_timestamp_ms"].as_i64().unwrap();
    let b = read(
        dir.path(),
        "SELECT DISTINCT CAST(seen_at AS BIGINT) AS us FROM t",
    )
    .await;
    let col = b[0].column(0).as_primitive::<arrow::datatypes::Int64Type>();
    assert_eq!(col.len(), 1);
    assert_eq!(col.value(0), logged_ms * 1000);
}

#[tokio::test]
async fn a_continuous_query_reports_progress_and_stops_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let source = Arc::new(
        GeneratorSource::try_new(
            "events",
            GeneratorOptions {
                rows: None,
                rows_per_second: Some(5000),
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let mut handle = QueryBuilder::new()
        .source(source)
        .unwrap()
        .sql("SELECT event_id, amount FROM events")
        .sink(Arc::new(
            DeltaSink::try_new(
                dir.path().join("table").to_str().unwrap(),
                DeltaSinkOptions::default(),
            )
            .unwrap(),
        ))
        .checkpoint(dir.path().join("ckpt").to_str().unwrap())
        .trigger(Trigger::Interval(Duration::from_millis(50)))
        .start()
        .await
        .unwrap();
    let mut events = handle.take_progress_events().unwrap();
    let first = tokio::time::timeout(Duration::from_secs(30), events.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.batch_id, 0);
    let stop = handle.stop_handle();
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.stop();
    let summary = tokio::time::timeout(Duration::from_secs(30), handle.await_termination())
        .await
        .unwrap()
        .unwrap();
    assert!(summary.batches >= 2, "{summary:?}");
    let (n, d) = count_and_distinct(dir.path()).await;
    assert_eq!(n as u64, summary.output_rows);
    assert_eq!(n, d);
}

#[tokio::test]
async fn an_aggregation_over_a_stream_is_refused_before_any_batch() {
    let dir = tempfile::tempdir().unwrap();
    let err = builder(
        dir.path(),
        100,
        100,
        "SELECT event_type, count(*) AS n FROM events GROUP BY event_type",
    )
    .start()
    .await
    .err()
    .expect("refused");
    assert!(err.to_string().contains("aggregation"), "{err}");
    assert!(!dir.path().join("table/_delta_log").exists());
    assert!(!dir.path().join("ckpt").exists());
}

#[tokio::test]
async fn a_commit_whose_answer_was_lost_fails_the_run_and_the_restart_skips_the_batch() {
    use lakestream::sink::memory::MemorySink;
    let dir = tempfile::tempdir().unwrap();
    let sink = MemorySink::new("out");
    let query = |sink: &MemorySink| {
        QueryBuilder::new()
            .source(generator(1000, 250))
            .unwrap()
            .sql("SELECT event_id FROM events")
            .sink(Arc::new(sink.clone()))
            .checkpoint(dir.path().join("ckpt").to_str().unwrap())
            .trigger(Trigger::AvailableNow)
    };
    // Batch 0 commits; the answer of batch 1's commit is lost.
    let first = query(&sink)
        .fail_point(FailPoint::AfterCommit, 0)
        .run()
        .await
        .unwrap_err();
    assert!(
        matches!(first, Error::InjectedFault { batch_id: 0, .. }),
        "{first}"
    );
    sink.lose_next_commit_response();
    let lost = query(&sink).run().await.unwrap_err();
    assert!(lost.to_string().contains("batch 1"), "{lost}");
    assert_eq!(
        sink.commits().len(),
        2,
        "batch 1 landed although its commit failed"
    );
    // The restart finds batch 1 in the table, marks it done and goes on.
    let summary = query(&sink).run().await.unwrap();
    assert_eq!(summary.batches, 3, "batch 1 (found in the table), 2 and 3");
    let ids: Vec<u64> = sink.commits().iter().map(|c| c.batch_id).collect();
    assert_eq!(ids, vec![0, 1, 2, 3]);
    assert_eq!(sink.rows(), 1000);
    let mut seen = std::collections::HashSet::new();
    for b in sink.batches() {
        for id in b.column(0).as_string::<i32>().iter().flatten() {
            assert!(seen.insert(id.to_string()), "row twice");
        }
    }
    assert_eq!(seen.len(), 1000);
}

/// `rows` generated events, 250 a batch, into two outputs: every event id
/// into `all`, the positive ones (id and amount) into `positive`.
fn all_and_positive(
    dir: &std::path::Path,
    rows: u64,
    all: &lakestream::sink::memory::MemorySink,
    positive: &lakestream::sink::memory::MemorySink,
) -> QueryBuilder {
    QueryBuilder::new()
        .source(generator(rows, 250))
        .unwrap()
        .sql("SELECT event_id FROM events")
        .sink(Arc::new(all.clone()))
        .output(lakestream::Output::sql(
            "SELECT event_id, amount FROM events WHERE amount > 0",
            Arc::new(positive.clone()),
        ))
        .checkpoint(dir.join("ckpt").to_str().unwrap())
        .trigger(Trigger::AvailableNow)
}

#[tokio::test]
async fn several_outputs_each_hold_every_batch_once_whichever_commit_fails() {
    use lakestream::sink::memory::MemorySink;
    let dir = tempfile::tempdir().unwrap();
    let (all, positive) = (MemorySink::new("all"), MemorySink::new("positive"));
    let query =
        |all: &MemorySink, positive: &MemorySink| all_and_positive(dir.path(), 1000, all, positive);
    // Batch 0 reaches `all` only; then batch 1's commit to `positive`
    // fails after landing (its answer lost).
    let first = query(&all, &positive)
        .fail_point(FailPoint::AfterCommit, 0)
        .run()
        .await
        .unwrap_err();
    assert!(
        matches!(first, Error::InjectedFault { batch_id: 0, .. }),
        "{first}"
    );
    assert_eq!(all.commits().len(), 1);
    assert_eq!(positive.commits().len(), 0);
    let mut handle = query(&all, &positive).start().await.unwrap();
    let mut events = handle.take_progress_events().unwrap();
    let summary = handle.await_termination().await.unwrap();
    assert_eq!(summary.batches, 4);
    let replay = events.recv().await.unwrap();
    assert!(replay.recovered && !replay.skipped, "{replay:?}");
    assert!(
        replay.outputs[0].skipped && !replay.outputs[1].skipped,
        "{replay:?}"
    );
    assert_eq!(replay.output_rows, replay.outputs[1].output_rows);
    assert_eq!(
        all.commits().iter().map(|c| c.batch_id).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    assert_eq!(
        positive
            .commits()
            .iter()
            .map(|c| c.batch_id)
            .collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    assert_eq!(all.rows(), 1000);
    let positive_ids = |sink: &MemorySink| {
        let mut ids = Vec::new();
        for b in sink.batches() {
            assert_eq!(b.num_columns(), 2);
            ids.extend(
                b.column(0)
                    .as_string::<i32>()
                    .iter()
                    .flatten()
                    .map(str::to_string),
            );
        }
        ids
    };
    let ids = positive_ids(&positive);
    let unique: std::collections::HashSet<&String> = ids.iter().collect();
    assert_eq!(unique.len(), ids.len(), "a row twice in positive");
    assert!(!ids.is_empty() && ids.len() < 1000, "{}", ids.len());

    // A second run over new input: the lost answer of `positive`'s commit
    // fails the run; the restart commits the batch to `all` only once more.
    let dir2 = tempfile::tempdir().unwrap();
    let (all2, positive2) = (MemorySink::new("all"), MemorySink::new("positive"));
    let query2 = || all_and_positive(dir2.path(), 500, &all2, &positive2);
    positive2.lose_next_commit_response();
    let lost = query2().run().await.unwrap_err();
    assert!(lost.to_string().contains("batch 0"), "{lost}");
    query2().run().await.unwrap();
    assert_eq!(
        all2.commits()
            .iter()
            .map(|c| c.batch_id)
            .collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert_eq!(
        positive2
            .commits()
            .iter()
            .map(|c| c.batch_id)
            .collect::<Vec<_>>(),
        vec![0, 1]
    );
    assert_eq!(all2.rows(), 500);
}

#[tokio::test]
async fn two_outputs_into_one_sink_are_refused() {
    use lakestream::Output;
    use lakestream::sink::memory::MemorySink;
    let dir = tempfile::tempdir().unwrap();
    let sink = MemorySink::new("out");
    let err = QueryBuilder::new()
        .source(generator(10, 10))
        .unwrap()
        .sql("SELECT event_id FROM events")
        .sink(Arc::new(sink.clone()))
        .output(Output::sql(
            "SELECT event_id FROM events",
            Arc::new(sink.clone()),
        ))
        .checkpoint(dir.path().join("ckpt").to_str().unwrap())
        .trigger(Trigger::AvailableNow)
        .run()
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("two outputs of the query write to"),
        "{err}"
    );
    assert!(sink.commits().is_empty());
}

#[tokio::test]
async fn a_windowed_count_writes_each_window_once_when_the_watermark_passes_it() {
    use lakestream::sink::memory::MemorySink;
    let dir = tempfile::tempdir().unwrap();
    let sink = MemorySink::new("out");
    // Row i has event time 2026-01-01 + i ms: 10 one-second windows of 1000
    // rows, read 1000 rows a batch.
    let mut handle = QueryBuilder::new()
        .source(generator(10_000, 1000))
        .unwrap()
        .sql(
            "SELECT window.start AS second, window.end, count(*) AS n, min(ts) AS first \
             FROM events GROUP BY window(ts, '1 second')",
        )
        .event_time("events", "ts", Duration::ZERO)
        .sink(Arc::new(sink.clone()))
        .checkpoint(dir.path().join("ckpt").to_str().unwrap())
        .trigger(Trigger::AvailableNow)
        .start()
        .await
        .unwrap();
    let mut events = handle.take_progress_events().unwrap();
    let summary = handle.await_termination().await.unwrap();
    let mut progress = Vec::new();
    while let Ok(p) = events.try_recv() {
        progress.push(p);
    }
    // Batch N runs with the watermark of the newest event read through
    // batch N-1 (delay 0): 999 ms into the window batch N-1 read, so the
    // window before that one, whose end it has passed, is written by batch
    // N, whole. After the input ends, one batch without input writes the
    // window the watermark closed last.
    assert_eq!(summary.batches, 11, "{progress:#?}");
    let start_ms = 1_767_225_600_000i64;
    assert_eq!(progress[0].watermark_ms, None);
    for (n, p) in progress.iter().enumerate().skip(1) {
        assert_eq!(
            p.watermark_ms,
            Some(start_ms + n as i64 * 1000 - 1),
            "batch {n}"
        );
        let written = u64::from(n >= 2);
        assert_eq!(p.output_rows, written, "batch {n}");
        let state = p.state.as_ref().unwrap();
        assert_eq!(state.rows_evicted, written, "batch {n}");
        assert_eq!(
            state.rows,
            if n == 10 { 1 } else { 2 },
            "batch {n}: windows open"
        );
        assert_eq!(state.rows_dropped_by_watermark, 0, "batch {n}");
    }
    let mut windows: Vec<(i64, i64, i64, i64)> = Vec::new();
    for b in sink.batches() {
        let start = b
            .column(0)
            .as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
        let end = b
            .column(1)
            .as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
        let n = b.column(2).as_primitive::<arrow::datatypes::Int64Type>();
        let first = b
            .column(3)
            .as_primitive::<arrow::datatypes::TimestampMicrosecondType>();
        for i in 0..b.num_rows() {
            windows.push((start.value(i), end.value(i), n.value(i), first.value(i)));
        }
    }
    windows.sort();
    let expected: Vec<(i64, i64, i64, i64)> = (0..9)
        .map(|s| {
            let us = (start_ms + s * 1000) * 1000;
            (us, us + 1_000_000, 1000, us)
        })
        .collect();
    // The last window (9 s) stays open: no event has passed its end.
    assert_eq!(windows, expected);
    // Its state is in the checkpoint.
    let state_files = std::fs::read_dir(dir.path().join("ckpt/state/aggregate"))
        .unwrap()
        .count();
    assert!(state_files >= 10, "{state_files} state files");
}

#[tokio::test]
async fn an_embedding_program_reads_the_queries_metrics_from_its_registry() {
    let dir = tempfile::tempdir().unwrap();
    // The program's own series live in the same registry.
    let mut metrics = lakestream::metrics::Metrics::new();
    let requests = prometheus_client::metrics::counter::Counter::<u64>::default();
    metrics.registry_mut().register(
        "app_requests",
        "The program's own counter",
        requests.clone(),
    );
    requests.inc_by(7);
    let metrics = Arc::new(metrics);
    let summary = builder(dir.path(), 1000, 250, SQL)
        .metrics(metrics.clone())
        .run()
        .await
        .unwrap();
    assert_eq!(summary.batches, 4);
    let q = summary.query_id.clone();
    let text = metrics.encode();
    for line in [
        format!("lakestream_batches_total{{query=\"{q}\"}} 4"),
        format!("lakestream_input_rows_total{{query=\"{q}\",source=\"events\"}} 1000"),
        format!(
            "lakestream_output_rows_total{{query=\"{q}\"}} {}",
            summary.output_rows
        ),
        format!("lakestream_last_committed_batch{{query=\"{q}\"}} 3"),
    ] {
        assert!(text.contains(&line), "{line} not in:\n{text}");
    }
    assert!(text.contains("app_requests_total 7"), "{text}");
    // The registry is prometheus-client's: a program's own server encodes it.
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, metrics.registry()).unwrap();
    assert_eq!(out, text);
}

/// The event ids of a batch's DataFrame, sorted.
async fn event_ids(df: datafusion::prelude::DataFrame) -> Vec<String> {
    let mut ids: Vec<String> = df
        .collect()
        .await
        .unwrap()
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
    ids.sort();
    ids
}

#[tokio::test]
async fn for_each_batch_hands_a_replayed_batch_its_same_rows_again() {
    use std::sync::Mutex;
    type Calls = Arc<Mutex<Vec<(u64, Vec<String>)>>>;
    let dir = tempfile::tempdir().unwrap();
    let calls: Calls = Arc::default();
    let query = |calls: &Calls, fail_at: Option<u64>| {
        let calls = calls.clone();
        QueryBuilder::new()
            .source(generator(1000, 250))
            .unwrap()
            .sql("SELECT event_id FROM events WHERE amount > 0")
            .for_each_batch(move |batch_id, df| {
                let calls = calls.clone();
                async move {
                    let ids = event_ids(df).await;
                    calls.lock().unwrap().push((batch_id, ids));
                    if fail_at == Some(batch_id) {
                        return Err("the downstream service is down".into());
                    }
                    Ok(())
                }
            })
            .checkpoint(dir.path().join("ckpt").to_str().unwrap())
            .trigger(Trigger::AvailableNow)
    };
    // Batch 1's function ran, then the process died before the mark.
    let err = query(&calls, None)
        .fail_point(FailPoint::AfterCommit, 1)
        .run()
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::InjectedFault { batch_id: 1, .. }),
        "{err}"
    );
    // Batch 2's function fails: the query fails naming the batch and the
    // cause, and nothing is marked done.
    let err = query(&calls, Some(2)).run().await.unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("batch 2") && msg.contains("the downstream service is down"),
        "{msg}"
    );
    let summary = query(&calls, None).run().await.unwrap();
    assert_eq!(summary.last_batch_id, Some(3));
    let calls = calls.lock().unwrap();
    let order: Vec<u64> = calls.iter().map(|(id, _)| *id).collect();
    assert_eq!(order, vec![0, 1, 1, 2, 2, 3], "at least once, in order");
    assert_eq!(calls[1].1, calls[2].1, "a replay sees the same rows");
    assert_eq!(calls[3].1, calls[4].1);
    let all: Vec<&String> = [0, 1, 3, 5].iter().flat_map(|i| &calls[*i].1).collect();
    let n = all.len();
    let distinct: std::collections::HashSet<&&String> = all.iter().collect();
    assert_eq!(distinct.len(), n, "no row in two batches");
    assert!(n > 0 && n < 1000);
}

#[tokio::test]
async fn a_batch_touching_more_groups_than_one_merge_takes_keeps_every_group_exact() {
    use lakestream::OutputMode;
    use lakestream::sink::memory::MemorySink;
    let dir = tempfile::tempdir().unwrap();
    let sink = MemorySink::new("out");
    // 150,000 rows over 50,000 groups (row i in group i % 50,000), 75,000
    // rows a batch: each batch touches more groups than a merge takes at
    // once, and the second one changes every group the first opened.
    let summary = QueryBuilder::new()
        .source(generator(150_000, 75_000))
        .unwrap()
        .sql(
            "SELECT CAST(substr(event_id, 2) AS BIGINT) % 50000 AS k, count(*) AS n, \
             sum(CAST(substr(event_id, 2) AS BIGINT)) AS total, \
             min(CAST(substr(event_id, 2) AS BIGINT)) AS first \
             FROM events GROUP BY CAST(substr(event_id, 2) AS BIGINT) % 50000",
        )
        .output_mode(OutputMode::Complete)
        .sink(Arc::new(sink.clone()))
        .checkpoint(dir.path().join("ckpt").to_str().unwrap())
        .trigger(Trigger::AvailableNow)
        .start()
        .await
        .unwrap()
        .await_termination()
        .await
        .unwrap();
    assert_eq!(summary.batches, 2);
    let mut groups: Vec<(i64, i64, i64, i64)> = Vec::new();
    for b in sink.batches() {
        let col = |i: usize| b.column(i).as_primitive::<arrow::datatypes::Int64Type>();
        let (k, n, total, first) = (col(0), col(1), col(2), col(3));
        for i in 0..b.num_rows() {
            groups.push((k.value(i), n.value(i), total.value(i), first.value(i)));
        }
    }
    groups.sort();
    // Group k holds rows k, k + 50,000 and k + 100,000.
    let expected: Vec<(i64, i64, i64, i64)> =
        (0..50_000).map(|k| (k, 3, 3 * k + 150_000, k)).collect();
    assert_eq!(groups.len(), expected.len());
    assert_eq!(groups, expected);
}
