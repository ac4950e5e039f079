//! The file source's seen-files snapshots: a restart reads the newest
//! snapshot and the batches after it, so the write-ahead files before the
//! snapshot are not needed, and no file is read twice or skipped.

use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema};
use lakestream::QueryBuilder;
use lakestream::source::files::{FileFormat, FileSource, FileSourceOptions};

use crate::common::write_files;

fn query(dir: &std::path::Path) -> QueryBuilder {
    let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, true)]));
    let mut opts = FileSourceOptions::new(FileFormat::Json);
    opts.max_files_per_trigger = Some(1);
    let source = FileSource::try_new(
        "events",
        dir.join("in").to_str().unwrap(),
        &Default::default(),
        schema,
        opts,
    )
    .unwrap();
    crate::common::available_now(
        source,
        "SELECT id FROM events",
        dir.join("table").to_str().unwrap(),
        dir.join("ckpt").to_str().unwrap(),
    )
    .snapshot_interval(5)
}

fn names(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort_by_key(|n| n.parse::<u64>().unwrap_or(u64::MAX));
    v
}

#[tokio::test]
async fn restarts_read_the_snapshot_and_later_batches_only() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_files(&dir.join("in"), 0, 12);
    let s = query(dir).run().await.unwrap();
    assert_eq!(s.batches, 12);
    // Snapshots after batches 4 and 9; the newest two are kept.
    let snaps = dir.join("ckpt/sources/events/snapshots");
    assert_eq!(names(&snaps), ["4", "9"]);

    // The write-ahead files the snapshot covers are not read at restart:
    // without them the restart still knows every file it took.
    for id in 0..=9 {
        std::fs::remove_file(dir.join(format!("ckpt/offsets/{id}"))).unwrap();
    }
    write_files(&dir.join("in"), 12, 15);
    let s = query(dir).run().await.unwrap();
    assert_eq!(s.batches, 3, "only the new files are read");
    assert_eq!(s.input_rows, 30);
    let (n, d) = crate::common::count_distinct(&dir.join("table"), "id").await;
    assert_eq!((n, d), (150, 150));
    assert_eq!(names(&snaps), ["9", "14"]);
}
