//! Checkpoints written by earlier builds (`testdata/checkpoints/`: files,
//! windowed, Kafka with per-batch progress) must stay
//! readable: every file parses through the checkpoint API and the sources'
//! offset types, and a run on a copy is accepted as the same query.

use std::collections::{BTreeMap, HashMap};

use lakestream::checkpoint::{Checkpoint, Error, QueryRecord, RecordedSource};
use lakestream::source::files::FilesOffset;

fn golden(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../testdata/checkpoints")
        .join(name)
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

#[tokio::test]
async fn a_version_1_file_stream_checkpoint_is_still_read() {
    let path = golden("v1-files");
    let none = HashMap::new();
    // Read-only, as `lakestream status` reads it.
    let view = Checkpoint::inspect(path.to_str().unwrap(), &none)
        .await
        .unwrap()
        .expect("a checkpoint");
    assert_eq!(
        view.metadata().query_id.to_string(),
        "42d44558-f6af-4c07-8c1d-ff437fb69c46"
    );
    let planned = view.latest_offsets().await.unwrap().unwrap();
    assert_eq!(planned.batch_id, 2);
    assert_eq!(planned.batch_timestamp_ms, 1_796_111_126_342);
    let range = &planned.sources["events"];
    let end: FilesOffset = serde_json::from_value(range.end.clone()).unwrap();
    let start: FilesOffset = serde_json::from_value(range.start.clone().expect("a start")).unwrap();
    assert_eq!((start.count, end.count), (2, 3));
    assert_eq!(end.files.len(), 1);
    assert_eq!(end.files[0].path, "tmp/golden/in/part-2.json");
    assert_eq!(end.files[0].size, 72);
    let done = view.latest_commit().await.unwrap().unwrap();
    assert_eq!((done.batch_id, done.table_version), (2, Some(3)));
    assert!(!done.skipped);

    // The inferred schema kept for the source.
    let schema = lakestream::checkpoint::read_source_state(
        &lakestream::storage::Location::parse(path.to_str().unwrap(), &none).unwrap(),
        "events",
        "schema",
    )
    .await
    .unwrap()
    .expect("a stored schema");
    let names: Vec<&str> = schema
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["id", "name"]);

    // A run on a copy takes the fence, reads every batch, and is the same
    // query; another sink is refused.
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&path, dir.path());
    let ckpt = Checkpoint::open(dir.path().to_str().unwrap(), &none)
        .await
        .unwrap();
    for id in 0..=2 {
        let entry = ckpt.offsets(id).await.unwrap().unwrap();
        let end: FilesOffset = serde_json::from_value(entry.sources["events"].end.clone()).unwrap();
        assert_eq!(end.count, id + 1);
    }
    let sources = BTreeMap::from([(
        "events".to_string(),
        RecordedSource {
            kind: "files".into(),
            location: "file:///tmp/golden/in/".into(),
        },
    )]);
    let same = QueryRecord::new(sources.clone(), "delta file:///tmp/golden/out/".into());
    ckpt.check_query(&same).await.unwrap();
    let other = QueryRecord::new(sources, "delta file:///tmp/elsewhere/".into());
    let err = ckpt.check_query(&other).await.unwrap_err();
    assert!(matches!(err, Error::QueryChanged { .. }), "{err}");
}

/// A Kafka query's checkpoint (3 batches over a 2-partition topic of 40
/// records, 15 offsets per trigger), written on 2026-12-01 by `lakestream
/// run` against the suite's broker: its offsets, starting point and the
/// progress kept per batch must stay readable.
#[tokio::test]
async fn a_version_1_kafka_checkpoint_and_its_progress_are_still_read() {
    use lakestream::source::kafka::KafkaOffset;
    let path = golden("v1-kafka");
    let none = HashMap::new();
    let view = Checkpoint::inspect(path.to_str().unwrap(), &none)
        .await
        .unwrap()
        .expect("a checkpoint");
    assert_eq!(
        view.metadata().query_id.to_string(),
        "f82f8841-0000-478f-bcef-052262619d3b"
    );
    let record = view.query_record().await.unwrap().unwrap();
    assert_eq!(record.sources["orders"].kind, "kafka");
    assert_eq!(
        record.sources["orders"].location,
        "topics orders (read_committed)"
    );

    // Each batch starts where the one before ended, per partition.
    let mut ends = Vec::new();
    for id in view.offset_ids().await.unwrap() {
        let entry = view.offsets(id).await.unwrap().unwrap();
        let range = &entry.sources["orders"];
        let start: KafkaOffset = serde_json::from_value(range.start.clone().unwrap()).unwrap();
        let end: KafkaOffset = serde_json::from_value(range.end.clone()).unwrap();
        if let Some(prev) = ends.last() {
            assert_eq!(&start.partitions, prev);
        }
        assert_eq!(end.topic_ids["orders"], "01a2340667e17e62896c965782d83635");
        ends.push(end.partitions);
    }
    assert_eq!(ends.len(), 3);
    assert_eq!(
        ends.last().unwrap()["orders"],
        BTreeMap::from([(0, 20), (1, 20)])
    );
    // The starting point resolved at the first run.
    let initial = lakestream::checkpoint::read_source_state(
        &lakestream::storage::Location::parse(path.to_str().unwrap(), &none).unwrap(),
        "orders",
        "initial",
    )
    .await
    .unwrap()
    .expect("a starting point");
    let initial: KafkaOffset = serde_json::from_value(initial).unwrap();
    assert_eq!(
        initial.partitions["orders"],
        BTreeMap::from([(0, 0), (1, 0)])
    );
    let done = view.latest_commit().await.unwrap().unwrap();
    assert_eq!((done.batch_id, done.table_version), (2, Some(3)));

    // The progress of each batch, as status and the status page read it.
    let progress = view.recent_progress(10).await.unwrap();
    let parsed: Vec<lakestream::BatchProgress> = progress
        .into_iter()
        .map(|e| serde_json::from_value(e.progress).unwrap())
        .collect();
    let ids: Vec<u64> = parsed.iter().map(|p| p.batch_id).collect();
    assert_eq!(ids, [0, 1, 2]);
    assert_eq!(parsed.iter().map(|p| p.input_rows).sum::<u64>(), 40);
    assert_eq!(parsed[2].table_version, Some(3));
    assert_eq!(
        parsed[2].sources["orders"].identity,
        "kafka[topics orders (read_committed)]"
    );
}

/// A windowed aggregation's checkpoint (11 batches: a state snapshot after
/// batch 9, deltas for every batch), state format version 1, written on
/// 2026-12-01 by `lakestream run` over 11 one-file batches (event times
/// 12:00:00-12:03:35, 1-minute windows, a 1-minute watermark delay): its
/// state must load back exactly, from the snapshot and the delta after
/// it, as a restart loads it.
#[tokio::test]
async fn a_version_1_windowed_checkpoint_keeps_its_state_readable() {
    use arrow::array::{Array, AsArray};
    use arrow::datatypes::{Int64Type, Schema};
    let path = golden("v1-windowed");
    let none = HashMap::new();
    let loc = lakestream::storage::Location::parse(path.to_str().unwrap(), &none).unwrap();
    let summaries = lakestream::state::summaries(&loc, None).await.unwrap();
    assert_eq!(summaries.len(), 1);
    let s = &summaries[0];
    assert_eq!(
        (s.operator.as_str(), s.batch_id, s.rows, s.bytes),
        ("aggregate", 10, 4, 188)
    );
    assert_eq!(
        s.meta["event_time_max_ms"]["events"],
        serde_json::json!(1_767_269_015_000i64)
    );

    // The store's columns, as the snapshot records them.
    let snapshot = path.join("state/aggregate/9.snapshot.arrow");
    let reader =
        arrow::ipc::reader::FileReader::try_new(std::fs::File::open(snapshot).unwrap(), None)
            .unwrap();
    let fields = reader.schema().fields().clone();
    let schema = std::sync::Arc::new(Schema::new(fields[..fields.len() - 2].to_vec()));
    let mut store = lakestream::state::StateStore::new(loc, "aggregate", schema, 2).unwrap();
    store.load(Some(10)).await.unwrap();
    assert_eq!((store.rows(), store.bytes()), (4, 188));
    // Open after batch 10: the 12:02 and 12:03 windows of kinds a and b,
    // with 9, 9, 6 and 6 events.
    let all = store.all().unwrap().expect("open windows");
    let count = all
        .schema()
        .fields()
        .iter()
        .position(|f| f.name().starts_with("count"))
        .expect("a count state");
    let mut groups: Vec<(String, String, i64)> = (0..all.num_rows())
        .map(|i| {
            let window = all.column(0).as_struct();
            let start =
                arrow::compute::cast(window.column(0), &arrow::datatypes::DataType::Utf8).unwrap();
            (
                start.as_string::<i32>().value(i).to_string(),
                arrow::compute::cast(all.column(1), &arrow::datatypes::DataType::Utf8)
                    .unwrap()
                    .as_string::<i32>()
                    .value(i)
                    .to_string(),
                all.column(count).as_primitive::<Int64Type>().value(i),
            )
        })
        .collect();
    groups.sort();
    assert_eq!(
        groups,
        [
            ("2026-01-01T12:02:00".into(), "a".into(), 9),
            ("2026-01-01T12:02:00".into(), "b".into(), 9),
            ("2026-01-01T12:03:00".into(), "a".into(), 6),
            ("2026-01-01T12:03:00".into(), "b".into(), 6),
        ]
    );
    assert!(all.column(0).null_count() == 0);
}
