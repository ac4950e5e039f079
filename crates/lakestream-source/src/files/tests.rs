//! Tests of the parent module.

use super::*;
use arrow::datatypes::{DataType, Field};
use std::collections::HashMap;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Utf8, false),
        Field::new("n", DataType::Int64, true),
    ]))
}

fn source(dir: &std::path::Path, max_files: Option<usize>) -> FileSource {
    let mut opts = FileSourceOptions::new(FileFormat::Json);
    opts.max_files_per_trigger = max_files;
    FileSource::try_new("t", dir.to_str().unwrap(), &HashMap::new(), schema(), opts).unwrap()
}

async fn read_all(src: &FileSource, start: Option<&Offset>, end: &Offset) -> Result<usize> {
    let mut rows = 0;
    for s in src.read(start, end, 2)? {
        let batches: Vec<RecordBatch> = s.try_collect().await?;
        rows += batches.iter().map(|b| b.num_rows()).sum::<usize>();
    }
    Ok(rows)
}

/// Local chunks read on the decoding thread from the page cache are the
/// store's own bytes, for every chunk size and range, and a range past
/// the file's end gets the store's answer.
#[tokio::test]
async fn local_chunks_read_from_the_page_cache_are_the_stores_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("data.bin");
    let body: Vec<u8> = (0..(3u32 << 20) + 12_345)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&file, &body).unwrap();
    let store: Arc<dyn ObjectStore> = Arc::new(object_store::local::LocalFileSystem::new());
    let path = object_store::path::Path::from_absolute_path(&file).unwrap();
    let cached = decode::CachedFile::open(&path).expect("the file opens");
    assert_eq!(cached.size(), Some(body.len() as u64));
    let opened = |local: bool| {
        if local {
            decode::CachedFile::open(&path).map(Arc::new)
        } else {
            None
        }
    };
    // Line starts probed through the open file are the store's.
    let e = entry(path.as_ref(), body.len() as u64);
    for at in [
        0,
        1,
        9,
        70_000,
        1 << 20,
        body.len() as u64 - 1,
        body.len() as u64,
    ] {
        assert_eq!(
            decode::line_start("t", &store, &e, at, Some(&cached))
                .await
                .unwrap(),
            decode::line_start("t", &store, &e, at, None).await.unwrap(),
            "line start at {at}"
        );
    }
    assert_eq!(
        cached.read(5..1_000_005).as_deref(),
        Some(&body[5..1_000_005]),
        "a cached range is read whole"
    );
    assert_eq!(cached.read(0..body.len() as u64 + 1), None, "past the end");
    let size = body.len() as u64;
    for (range, chunk) in [
        (0..size, 1 << 20),
        (0..size, 4 << 20),
        (7..size - 3, 1 << 20),
        (1_000..1_000, 1 << 20),
        (size - 10..size, 3),
    ] {
        let mut got = Vec::new();
        for local in [true, false] {
            let chunks: Vec<bytes::Bytes> = decode::ranged_chunks(
                store.clone(),
                path.clone(),
                range.clone(),
                chunk,
                opened(local),
            )
            .try_collect()
            .await
            .unwrap();
            got.push(chunks);
        }
        assert_eq!(got[0], got[1], "{range:?} in {chunk}-byte chunks");
        let whole: Vec<u8> = got[0].iter().flat_map(|b| b.iter().copied()).collect();
        assert_eq!(whole, &body[range.start as usize..range.end as usize]);
    }
    // Past the end: whatever the store answers (an error, or the bytes
    // up to the end), the local read answers the same.
    let mut past = Vec::new();
    for local in [true, false] {
        let r: std::result::Result<Vec<bytes::Bytes>, _> = decode::ranged_chunks(
            store.clone(),
            path.clone(),
            size - 5..size + 5,
            4,
            opened(local),
        )
        .try_collect()
        .await;
        past.push(r.map_err(|e| e.to_string()));
    }
    assert_eq!(past[0], past[1], "a range past the end");
}

fn write(dir: &std::path::Path, name: &str, lines: usize) {
    let body: String = (0..lines)
        .map(|i| format!("{{\"id\": \"{name}-{i}\", \"n\": {i}}}\n"))
        .collect();
    std::fs::write(dir.join(name), body).unwrap();
}

fn entry(path: &str, size: u64) -> FileEntry {
    FileEntry {
        path: path.into(),
        size,
        mtime_ms: 0,
    }
}

#[test]
fn a_batch_is_cut_into_equal_shares_and_every_byte_is_in_one_piece() {
    let mb = 1 << 20;
    for (sizes, partitions) in [
        (vec![11 * mb; 5], 2),
        (vec![11 * mb; 5], 3),
        (vec![3 * mb, 40 * mb, 2 * mb, 500, 7 * mb], 2),
        (vec![100, 200, 300], 2),
        (vec![mb + 10; 7], 4),
    ] {
        let files: Vec<FileEntry> = sizes
            .iter()
            .enumerate()
            .map(|(i, s)| entry(&format!("f{i}"), *s))
            .collect();
        let total: u64 = sizes.iter().sum();
        let groups = split_by_bytes(files, partitions);
        assert!(groups.len() <= partitions);
        // Each file's pieces tile it, in order.
        for (i, size) in sizes.iter().enumerate() {
            let mut at = 0;
            for p in groups
                .iter()
                .flatten()
                .filter(|p| p.entry.path == format!("f{i}"))
            {
                let r = p.range.clone().unwrap_or(0..*size);
                assert_eq!(r.start, at, "{sizes:?}: file {i}");
                assert!(r.end > r.start);
                if p.range.is_some() {
                    assert!(r.end - r.start >= MIN_PIECE, "{sizes:?}: {r:?}");
                }
                at = r.end;
            }
            assert_eq!(at, *size, "{sizes:?}: file {i}");
        }
        // Shares are equal to within a small piece when the batch is
        // large enough to cut.
        if total >= partitions as u64 * 4 * MIN_PIECE {
            assert_eq!(groups.len(), partitions);
            let share = total / partitions as u64;
            for g in &groups {
                let bytes: u64 = g.iter().map(Piece::len).sum();
                assert!(
                    bytes.abs_diff(share) <= MIN_PIECE,
                    "{sizes:?}: {bytes} of {share}"
                );
            }
        }
    }
}

#[tokio::test]
async fn line_ranges_tile_a_file_line_by_line() {
    let dir = tempfile::tempdir().unwrap();
    let body = b"ab\ncd\n\nlonger line\nlast";
    std::fs::write(dir.path().join("f.json"), body).unwrap();
    let store: Arc<dyn ObjectStore> =
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(dir.path()).unwrap());
    let e = entry("f.json", body.len() as u64);
    let mut starts = Vec::new();
    for at in 0..=body.len() as u64 + 1 {
        starts.push(decode::line_start("t", &store, &e, at, None).await.unwrap());
    }
    // A line start maps to itself; any other byte to the next start.
    assert_eq!(
        starts,
        [
            0, 3, 3, 3, 6, 6, 6, 7, 19, 19, 19, 19, 19, 19, 19, 19, 19, 19, 19, 19, 23, 23, 23, 23,
            23
        ]
    );
}

/// Lines of different lengths, `{"id": "<name>-<i>", "n": <i>}`.
fn write_varied(dir: &std::path::Path, name: &str, lines: usize) {
    let body: String = (0..lines)
        .map(|i| format!("{{\"id\": \"{name}-{i}\", \"n\": {}}}\n", i * i % 100_003))
        .collect();
    std::fs::write(dir.join(name), body).unwrap();
}

fn ids_of(b: &RecordBatch) -> impl Iterator<Item = String> + '_ {
    let col = b.column(0).as_any().downcast_ref::<StringArray>().unwrap();
    col.iter().map(|v| v.unwrap().to_string())
}

/// The ids each of 2 partitions read, the partitions polled in turn,
/// one record batch each, as two cores would at an even pace.
async fn ids_by_partition(src: &FileSource, end: &Offset) -> Vec<Vec<String>> {
    let mut streams = src.read(None, end, 2).unwrap();
    let mut out = vec![Vec::new(); streams.len()];
    let mut live = vec![true; streams.len()];
    while live.iter().any(|l| *l) {
        for (i, s) in streams.iter_mut().enumerate() {
            if !live[i] {
                continue;
            }
            match s.next().await {
                Some(b) => out[i].extend(ids_of(&b.unwrap())),
                None => live[i] = false,
            }
        }
    }
    out
}

/// Five files of about 3 MiB each, in one batch.
async fn five_large_files() -> (tempfile::TempDir, FileSource, Offset, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    for i in 0..5 {
        write_varied(dir.path(), &format!("f{i}.json"), 100_000);
    }
    let mut opts = FileSourceOptions::new(FileFormat::Json);
    opts.max_bytes_per_trigger = None;
    let src = FileSource::try_new(
        "t",
        dir.path().to_str().unwrap(),
        &HashMap::new(),
        schema(),
        opts,
    )
    .unwrap();
    let end = src.plan(None).await.unwrap().unwrap();
    let mut want: Vec<String> = (0..5)
        .flat_map(|f| (0..100_000).map(move |i| format!("f{f}.json-{i}")))
        .collect();
    want.sort();
    (dir, src, end, want)
}

/// A partition whose reader is slow (here: not polled until the other
/// is done) reads its first piece only; the other takes every piece it
/// had not begun, and every line is still read once.
#[tokio::test]
async fn a_partition_that_runs_out_takes_the_unread_pieces_of_the_other() {
    let (_dir, src, end, want) = five_large_files().await;
    let mut streams = src.read(None, &end, 2).unwrap();
    assert_eq!(streams.len(), 2);
    let first: Vec<RecordBatch> = streams[0].by_ref().try_collect().await.unwrap();
    let second: Vec<RecordBatch> = streams[1].by_ref().try_collect().await.unwrap();
    let first: Vec<String> = first.iter().flat_map(ids_of).collect();
    let second: Vec<String> = second.iter().flat_map(ids_of).collect();
    // Its group is half of the batch; its first piece, 4 MiB of about
    // 9 MiB, less than a third.
    assert!(
        !second.is_empty() && second.len() * 3 < want.len(),
        "the slow partition read {} of {} rows: its first piece, no more",
        second.len(),
        want.len()
    );
    let mut all = [first, second].concat();
    all.sort();
    assert!(all == want, "a line read twice or not at all");
}

#[test]
fn pieces_are_cut_smaller_and_still_tile_their_files() {
    let mb = 1 << 20;
    let whole = Piece::whole(entry("a", 11 * mb));
    let tail = Piece {
        entry: entry("b", 20 * mb),
        range: Some(3 * mb..20 * mb),
    };
    let small = Piece::whole(entry("c", 5 * mb));
    let cut = cut_pieces(vec![whole, tail, small], 4 * mb);
    let ranges: Vec<(String, Option<std::ops::Range<u64>>)> = cut
        .iter()
        .map(|p| (p.entry.path.clone(), p.range.clone()))
        .collect();
    assert_eq!(
        ranges,
        [
            ("a".to_string(), Some(0..4 * mb)),
            ("a".to_string(), Some(4 * mb..8 * mb)),
            ("a".to_string(), Some(8 * mb..11 * mb)),
            ("b".to_string(), Some(3 * mb..7 * mb)),
            ("b".to_string(), Some(7 * mb..11 * mb)),
            ("b".to_string(), Some(11 * mb..15 * mb)),
            ("b".to_string(), Some(15 * mb..20 * mb)),
            ("c".to_string(), None),
        ]
    );
}

#[tokio::test]
async fn a_batch_of_few_large_files_reads_every_line_once_in_equal_partitions() {
    // Five files of about 3 MiB: two partitions of whole files would
    // read three and two.
    let (dir, src, end, want) = five_large_files().await;
    let parts = ids_by_partition(&src, &end).await;
    assert_eq!(parts.len(), 2);
    let (a, b) = (parts[0].len(), parts[1].len());
    assert!(a.abs_diff(b) * 20 < a + b, "rows per partition {a} and {b}");
    let mut all: Vec<String> = parts.concat();
    all.sort();
    assert_eq!(all.len(), want.len());
    assert!(all == want, "a line read twice or not at all");
    // A file rewritten after the plan is read whole, once.
    write_varied(dir.path(), "f2.json", 90_000);
    let parts = ids_by_partition(&src, &end).await;
    let f2 = parts
        .concat()
        .into_iter()
        .filter(|id| id.starts_with("f2.json-"))
        .count();
    assert_eq!(f2, 90_000);
}

#[tokio::test]
async fn files_are_taken_once_in_capped_batches() {
    let dir = tempfile::tempdir().unwrap();
    for i in 0..5 {
        write(dir.path(), &format!("f{i}.json"), 3);
    }
    std::fs::write(dir.path().join(".hidden"), "junk").unwrap();
    let src = source(dir.path(), Some(2));
    let b0 = src.plan(None).await.unwrap().unwrap();
    assert_eq!(read_all(&src, None, &b0).await.unwrap(), 6);
    let b1 = src.plan(Some(&b0)).await.unwrap().unwrap();
    let b2 = src.plan(Some(&b1)).await.unwrap().unwrap();
    assert_eq!(read_all(&src, Some(&b1), &b2).await.unwrap(), 3);
    assert!(src.plan(Some(&b2)).await.unwrap().is_none());
    assert_eq!(src.describe(Some(&b1), &b2), "files 4..5");

    // A restarted source that recovers the planned ends takes nothing again.
    let again = source(dir.path(), Some(2));
    again.recover(&[b0, b1, b2.clone()]).await.unwrap();
    assert!(again.plan(Some(&b2)).await.unwrap().is_none());
    write(dir.path(), "later.json", 1);
    let b3 = again.plan(Some(&b2)).await.unwrap().unwrap();
    assert_eq!(read_all(&again, Some(&b2), &b3).await.unwrap(), 1);
}

#[tokio::test]
async fn max_file_age_bounds_the_seen_set_and_ignores_late_old_files() {
    let dir = tempfile::tempdir().unwrap();
    let day = 86_400_000i64;
    let base = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
    let write_aged = |name: &str, days: u64| {
        write(dir.path(), name, 2);
        let f = std::fs::File::options()
            .write(true)
            .open(dir.path().join(name))
            .unwrap();
        f.set_modified(base + std::time::Duration::from_secs(days * 86_400))
            .unwrap();
    };
    for d in 1..=10u64 {
        write_aged(&format!("f{d:02}.json"), d);
    }
    let mut opts = FileSourceOptions::new(FileFormat::Json);
    opts.max_file_age_ms = Some(2 * day);
    let src = FileSource::try_new(
        "s",
        dir.path().to_str().unwrap(),
        &Default::default(),
        schema(),
        opts,
    )
    .unwrap();
    // The first batch takes every file, whatever its age.
    let e0 = src.plan(None).await.unwrap().unwrap();
    assert_eq!(src.parse_offset(&e0).unwrap().files.len(), 10);
    // Only the files of the last two days are remembered.
    let snap = src.snapshot().unwrap();
    assert_eq!(snap["files"].as_array().unwrap().len(), 3, "{snap}");
    // Forgotten files are not taken again, a late old file is ignored,
    // a new one is taken.
    write_aged("late-old.json", 3);
    write_aged("f11.json", 11);
    let e1 = src.plan(Some(&e0)).await.unwrap().unwrap();
    let files: Vec<String> = src
        .parse_offset(&e1)
        .unwrap()
        .files
        .iter()
        .map(|f| f.path.rsplit('/').next().unwrap().to_string())
        .collect();
    assert_eq!(files, ["f11.json"]);
    assert!(src.plan(Some(&e1)).await.unwrap().is_none());

    // A restart from the snapshot behaves the same.
    let again = FileSource::try_new(
        "s",
        dir.path().to_str().unwrap(),
        &Default::default(),
        schema(),
        FileSourceOptions {
            max_file_age_ms: Some(2 * day),
            ..FileSourceOptions::new(FileFormat::Json)
        },
    )
    .unwrap();
    again.restore(Some(&snap)).await.unwrap();
    again.recover(std::slice::from_ref(&e1)).await.unwrap();
    assert!(again.plan(Some(&e1)).await.unwrap().is_none());
    assert_eq!(
        again.snapshot().unwrap()["files"].as_array().unwrap().len(),
        3
    );

    // Removing (or raising) the option later does not bring forgotten
    // files back: they were read once.
    let unbounded = FileSource::try_new(
        "s",
        dir.path().to_str().unwrap(),
        &Default::default(),
        schema(),
        FileSourceOptions::new(FileFormat::Json),
    )
    .unwrap();
    unbounded
        .restore(Some(&src.snapshot().unwrap()))
        .await
        .unwrap();
    assert!(unbounded.plan(Some(&e1)).await.unwrap().is_none());
    write_aged("f12.json", 12);
    let e2 = unbounded.plan(Some(&e1)).await.unwrap().unwrap();
    assert_eq!(unbounded.parse_offset(&e2).unwrap().files.len(), 1);
}

#[tokio::test]
async fn frozen_sources_ignore_files_that_arrive_later() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "a.json", 1);
    let src = source(dir.path(), None);
    src.freeze().await.unwrap();
    write(dir.path(), "b.json", 1);
    let b0 = src.plan(None).await.unwrap().unwrap();
    assert_eq!(read_all(&src, None, &b0).await.unwrap(), 1);
    assert!(src.plan(Some(&b0)).await.unwrap().is_none());
}

#[tokio::test]
async fn malformed_json_names_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("bad.json"),
        "{\"id\": \"a\", \"n\": 1}\n{\"id\": \"b\", \"n\": \"x\"}\n",
    )
    .unwrap();
    let src = source(dir.path(), None);
    let b0 = src.plan(None).await.unwrap().unwrap();
    let err = read_all(&src, None, &b0).await.unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("bad.json"), "{msg}");
    assert!(msg.contains("line 2"), "{msg}");
}

#[tokio::test]
async fn json_schema_is_inferred_from_the_first_file() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "a.json", 2);
    let schema = FileSource::infer_schema(
        "t",
        dir.path().to_str().unwrap(),
        &HashMap::new(),
        &FileSourceOptions::new(FileFormat::Json),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(
        schema.field_with_name("n").unwrap().data_type(),
        &DataType::Int64
    );
}
