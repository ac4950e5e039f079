//! Checkpoints written by earlier builds (`testdata/checkpoints/`) must stay
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
        path.to_str().unwrap(),
        &none,
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
