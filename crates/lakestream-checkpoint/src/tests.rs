//! Tests of the parent module.

use super::*;

fn src(end: i64) -> BTreeMap<String, SourceRange> {
    let mut m = BTreeMap::new();
    m.insert(
        "s".to_string(),
        SourceRange {
            start: None,
            end: serde_json::json!(end),
        },
    );
    m
}

async fn open(dir: &std::path::Path) -> Result<Checkpoint> {
    Checkpoint::open(dir.to_str().unwrap(), &HashMap::new()).await
}

#[tokio::test]
async fn query_id_is_created_once_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let id = {
        let c = open(dir.path()).await.unwrap();
        c.query_id()
    };
    let c = open(dir.path()).await.unwrap();
    assert_eq!(c.query_id(), id);
}

#[tokio::test]
async fn second_open_while_held_is_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let _held = open(dir.path()).await.unwrap();
    let err = open(dir.path()).await.unwrap_err();
    assert!(matches!(err, Error::InUse { .. }), "{err}");
    assert!(err.to_string().contains("checkpoint in use"), "{err}");
    drop(_held);
    open(dir.path()).await.unwrap();
}

#[tokio::test]
async fn offsets_are_create_if_absent() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path()).await.unwrap();
    c.write_offsets(&OffsetsEntry::new(0, 1, src(5)))
        .await
        .unwrap();
    let err = c
        .write_offsets(&OffsetsEntry::new(0, 2, src(9)))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InUse { .. }), "{err}");
    // The first write is what stays.
    assert_eq!(c.offsets(0).await.unwrap().unwrap().batch_timestamp_ms, 1);
}

#[tokio::test]
async fn latest_is_by_number_not_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path()).await.unwrap();
    for n in [2u64, 10, 9] {
        c.write_offsets(&OffsetsEntry::new(n, 0, src(1)))
            .await
            .unwrap();
    }
    c.write_commit(&CommitEntry::new(9, Some(3), false))
        .await
        .unwrap();
    assert_eq!(c.latest_offsets().await.unwrap().unwrap().batch_id, 10);
    assert_eq!(c.latest_commit().await.unwrap().unwrap().batch_id, 9);
    assert_eq!(c.offset_ids().await.unwrap(), vec![2, 9, 10]);
}

#[tokio::test]
async fn corrupt_and_future_files_are_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let c = open(dir.path()).await.unwrap();
    std::fs::create_dir_all(dir.path().join("offsets")).unwrap();
    std::fs::write(dir.path().join("offsets/4"), b"{not json").unwrap();
    let err = c.latest_offsets().await.unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    assert!(err.to_string().contains("offsets/4"), "{err}");

    std::fs::write(
        dir.path().join("offsets/4"),
        br#"{"version": 99, "batch_id": 4}"#,
    )
    .unwrap();
    let err = c.latest_offsets().await.unwrap_err();
    assert!(
        matches!(err, Error::UnsupportedVersion { found: 99, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("offsets/4"), "{err}");
}

#[tokio::test]
async fn inspect_reads_without_the_fence() {
    let dir = tempfile::tempdir().unwrap();
    assert!(
        Checkpoint::inspect(dir.path().to_str().unwrap(), &HashMap::new())
            .await
            .unwrap()
            .is_none()
    );
    let c = open(dir.path()).await.unwrap();
    let view = Checkpoint::inspect(dir.path().to_str().unwrap(), &HashMap::new())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(view.metadata().query_id, c.query_id());
    assert_eq!(view.is_in_use(), Some(true));
    drop(c);
    assert_eq!(view.is_in_use(), Some(false));
}
