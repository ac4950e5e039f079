//! The state store's tests: versions, snapshots, purge, a changed query,
//! corrupt files.

use super::*;
use arrow::array::{Array, StringArray};

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("k", DataType::Utf8, true),
        Field::new("n", DataType::Int64, false),
    ]))
}

fn batch(rows: &[(&str, i64)]) -> RecordBatch {
    RecordBatch::try_new(
        schema(),
        vec![
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.0))),
            Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.1))),
        ],
    )
    .unwrap()
}

fn pairs(b: Option<RecordBatch>) -> Vec<(String, i64)> {
    let Some(b) = b else { return Vec::new() };
    let k = b.column(0).as_any().downcast_ref::<StringArray>().unwrap();
    let n = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
    let mut v: Vec<(String, i64)> = (0..b.num_rows())
        .map(|i| (k.value(i).to_string(), n.value(i)))
        .collect();
    v.sort();
    v
}

fn store(dir: &std::path::Path) -> StateStore {
    let loc = Location::parse(dir.to_str().unwrap(), &HashMap::new()).unwrap();
    StateStore::new(loc, "agg", schema(), 1)
        .unwrap()
        .with_snapshot_interval(3)
}

#[tokio::test]
async fn committed_versions_load_back_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(dir.path());
    s.load(None).await.unwrap();
    s.upsert(&batch(&[("a", 1), ("b", 2)]), &[10, 20]).unwrap();
    s.commit(0, serde_json::json!({"max": 5})).await.unwrap();
    s.upsert(&batch(&[("a", 3)]), &[10]).unwrap();
    assert_eq!(pairs(s.evict_through(10).unwrap()), vec![("a".into(), 3)]);
    s.commit(1, serde_json::json!({"max": 6})).await.unwrap();
    // Batch 2 fails before its commit: its changes never count.
    s.upsert(&batch(&[("c", 9)]), &[30]).unwrap();

    let mut r = store(dir.path());
    r.load(Some(0)).await.unwrap();
    assert_eq!(r.rows(), 2);
    assert_eq!(r.meta(), &serde_json::json!({"max": 5}));
    let probe = batch(&[("a", 0), ("b", 0), ("z", 0)]);
    assert_eq!(
        pairs(r.lookup(&probe, &[10, 20, 20]).unwrap()),
        vec![("a".into(), 1), ("b".into(), 2)]
    );
    r.load(Some(1)).await.unwrap();
    assert_eq!(r.rows(), 1);
    assert_eq!(r.first_bucket(), Some(20));
    assert_eq!(r.meta(), &serde_json::json!({"max": 6}));
    assert!(r.lookup(&probe, &[10, 10, 10]).unwrap().is_none());
    assert!(r.is_at(Some(1)));
}

/// State written by a build whose queries' strings were `Utf8View`
/// loads into a query whose strings are `Utf8`: snapshots and deltas
/// alike, through a reload and the snapshot merged from both kinds of
/// file. A column of another type is still refused.
#[tokio::test]
async fn state_written_with_string_views_loads_as_plain_strings() {
    use arrow::array::StringViewArray;
    let dir = tempfile::tempdir().unwrap();
    let views = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Utf8View, true),
        Field::new("n", DataType::Int64, false),
    ]));
    let loc = || Location::parse(dir.path().to_str().unwrap(), &HashMap::new()).unwrap();
    let mut old = StateStore::new(loc(), "agg", views.clone(), 1)
        .unwrap()
        .with_snapshot_interval(3);
    old.load(None).await.unwrap();
    for (id, rows) in [
        (0u64, vec![("a", 1i64), ("b", 2)]),
        (1, vec![("c", 3)]),
        (2, vec![("a", 4)]),
        (3, vec![("d", 5)]),
    ] {
        let b = RecordBatch::try_new(
            views.clone(),
            vec![
                Arc::new(StringViewArray::from_iter_values(rows.iter().map(|r| r.0))),
                Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.1))),
            ],
        )
        .unwrap();
        old.upsert(&b, &vec![10; rows.len()]).unwrap();
        old.commit(id, serde_json::json!({})).await.unwrap();
    }
    old.wait_for_snapshot().await.unwrap();

    // A snapshot (batch 2) and a delta (batch 3), both of views.
    let mut new = store(dir.path());
    new.load(Some(3)).await.unwrap();
    assert_eq!(
        pairs(new.all().unwrap()),
        vec![
            ("a".into(), 4),
            ("b".into(), 2),
            ("c".into(), 3),
            ("d".into(), 5)
        ]
    );
    let probe = batch(&[("a", 0), ("d", 0), ("z", 0)]);
    assert_eq!(
        pairs(new.lookup(&probe, &[10, 10, 10]).unwrap()),
        vec![("a".into(), 4), ("d".into(), 5)]
    );
    // Batches on top, in plain strings: the next snapshot merges the
    // old files with the new ones.
    new.upsert(&batch(&[("b", 7)]), &[10]).unwrap();
    new.commit(4, serde_json::json!({})).await.unwrap();
    new.upsert(&batch(&[("e", 8)]), &[10]).unwrap();
    new.commit(5, serde_json::json!({})).await.unwrap();
    new.wait_for_snapshot().await.unwrap();
    let mut again = store(dir.path());
    again.load(Some(5)).await.unwrap();
    assert_eq!(
        pairs(again.all().unwrap()),
        vec![
            ("a".into(), 4),
            ("b".into(), 7),
            ("c".into(), 3),
            ("d".into(), 5),
            ("e".into(), 8)
        ]
    );

    // Another type for the key is a changed query.
    let ints = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Int64, true),
        Field::new("n", DataType::Int64, false),
    ]));
    let mut other = StateStore::new(loc(), "agg", ints, 1).unwrap();
    let err = other.load(Some(5)).await.unwrap_err();
    assert!(matches!(err, Error::Changed { .. }), "{err}");
}

/// Keys (user, session start) indexed by user: a session's state is
/// found by its user alone, through removals, evictions and a reload.
#[tokio::test]
async fn an_index_finds_every_key_sharing_its_columns() {
    let dir = tempfile::tempdir().unwrap();
    let schema = Arc::new(Schema::new(vec![
        Field::new("user", DataType::Utf8, true),
        Field::new("start", DataType::Int64, true),
        Field::new("n", DataType::Int64, true),
    ]));
    let rows = |r: &[(&str, i64, i64)]| {
        RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringArray::from_iter_values(r.iter().map(|r| r.0))),
                Arc::new(Int64Array::from_iter_values(r.iter().map(|r| r.1))),
                Arc::new(Int64Array::from_iter_values(r.iter().map(|r| r.2))),
            ],
        )
        .unwrap()
    };
    let found = |s: &StateStore, probe: &RecordBatch| -> Vec<(String, i64, i64, i64)> {
        let Some((b, buckets)) = s.lookup_indexed(probe).unwrap() else {
            return Vec::new();
        };
        let u = b.column(0).as_any().downcast_ref::<StringArray>().unwrap();
        let st = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
        let n = b.column(2).as_any().downcast_ref::<Int64Array>().unwrap();
        let mut v: Vec<_> = (0..b.num_rows())
            .map(|i| (u.value(i).to_string(), st.value(i), n.value(i), buckets[i]))
            .collect();
        v.sort();
        v
    };
    let open = |dir: &std::path::Path| {
        let loc = Location::parse(dir.to_str().unwrap(), &HashMap::new()).unwrap();
        StateStore::new(loc, "session", schema.clone(), 2)
            .unwrap()
            .with_index(vec![0])
            .unwrap()
    };
    let mut s = open(dir.path());
    s.load(None).await.unwrap();
    s.upsert(
        &rows(&[("a", 0, 1), ("a", 100, 2), ("b", 5, 3)]),
        &[10, 110, 15],
    )
    .unwrap();
    let probe = rows(&[("a", -1, 0), ("a", -2, 0)]);
    assert_eq!(
        found(&s, &probe),
        vec![("a".into(), 0, 1, 10), ("a".into(), 100, 2, 110)]
    );
    // Session (a, 0) merged away into (a, 100); (b, 5) evicted.
    s.remove_keys(&rows(&[("a", 0, 0)]), &[10]).unwrap();
    s.upsert(&rows(&[("a", 100, 3)]), &[110]).unwrap();
    assert_eq!(s.evict_through(15).unwrap().map(|b| b.num_rows()), Some(1));
    assert_eq!(found(&s, &probe), vec![("a".into(), 100, 3, 110)]);
    assert!(found(&s, &rows(&[("b", 0, 0)])).is_empty());
    s.commit(0, serde_json::Value::Null).await.unwrap();

    let mut r = open(dir.path());
    r.load(Some(0)).await.unwrap();
    assert_eq!(r.rows(), 1);
    assert_eq!(found(&r, &probe), vec![("a".into(), 100, 3, 110)]);
    assert!(found(&r, &rows(&[("b", 0, 0)])).is_empty());
}

/// A store indexed by its whole key finds each key's bucket whatever
/// bucket a caller would compute, through eviction and a reload.
#[tokio::test]
async fn held_buckets_find_a_key_in_whichever_bucket_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let open = || store(dir.path()).with_index(vec![0]).unwrap();
    let mut s = open();
    s.load(None).await.unwrap();
    s.upsert(&batch(&[("a", 1), ("b", 2)]), &[70, 80]).unwrap();
    let probe = batch(&[("a", 9), ("c", 9), ("b", 9)]);
    assert_eq!(
        s.held_buckets(&probe).unwrap(),
        vec![Some(70), None, Some(80)]
    );
    assert_eq!(s.evict_through(75).unwrap().map(|b| b.num_rows()), Some(1));
    assert_eq!(s.held_buckets(&probe).unwrap(), vec![None, None, Some(80)]);
    s.commit(0, serde_json::Value::Null).await.unwrap();
    let mut r = open();
    r.load(Some(0)).await.unwrap();
    assert_eq!(r.held_buckets(&probe).unwrap(), vec![None, None, Some(80)]);
}

#[tokio::test]
async fn snapshots_bound_what_a_restart_reads_and_purge_keeps_what_it_needs() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(dir.path());
    s.load(None).await.unwrap();
    for id in 0..7u64 {
        s.upsert(&batch(&[("k", id as i64)]), &[1]).unwrap();
        s.commit(id, serde_json::Value::Null).await.unwrap();
        s.wait_for_snapshot().await.unwrap();
    }
    // Snapshots after batches 2 and 5 (every 3).
    let (snapshots, deltas) = s.list().await.unwrap();
    assert_eq!(snapshots, vec![2, 5]);
    assert_eq!(deltas, (0..7).collect::<Vec<_>>());
    // Batches before 6 are never replayed: the state as of 5 (its
    // snapshot) and later is all a restart needs.
    assert_eq!(s.purge_before(6).await.unwrap(), 7);
    let (snapshots, deltas) = s.list().await.unwrap();
    assert_eq!((snapshots, deltas), (vec![5], vec![6]));
    let mut r = store(dir.path());
    r.load(Some(6)).await.unwrap();
    assert_eq!(
        pairs(r.lookup(&batch(&[("k", 0)]), &[1]).unwrap()),
        vec![("k".into(), 6)]
    );
    let err = r.load(Some(4)).await.unwrap_err();
    assert!(
        err.to_string().contains("as of batch 0 is missing"),
        "{err}"
    );
}

#[tokio::test]
async fn a_changed_query_and_a_corrupt_file_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(dir.path());
    s.load(None).await.unwrap();
    s.upsert(&batch(&[("a", 1)]), &[1]).unwrap();
    s.commit(0, serde_json::Value::Null).await.unwrap();

    let loc = Location::parse(dir.path().to_str().unwrap(), &HashMap::new()).unwrap();
    let other = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Utf8, true),
        Field::new("total", DataType::Float64, true),
    ]));
    let mut changed = StateStore::new(loc, "agg", other, 1).unwrap();
    let err = changed.load(Some(0)).await.unwrap_err().to_string();
    assert!(err.contains("written by a different query"), "{err}");
    assert!(
        err.contains("n Int64") && err.contains("total Float64"),
        "{err}"
    );

    let file = dir.path().join("state/agg/0.delta.arrow");
    std::fs::write(&file, b"not arrow").unwrap();
    let err = store(dir.path())
        .load(Some(0))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("0.delta.arrow is corrupt"), "{err}");
}

/// A batch that changes most of a large state (more keys than a file
/// chunk) writes it whole, in several Arrow batches, with its
/// removals; a reload gives back exactly the state.
#[tokio::test]
async fn a_batch_changing_most_of_a_large_state_loads_back_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(dir.path());
    s.load(None).await.unwrap();
    let n = CHUNK as i64 + 5_000;
    let names: Vec<String> = (0..n).map(|i| format!("k{i}")).collect();
    let rows: Vec<(&str, i64)> = names
        .iter()
        .zip(0..n)
        .map(|(k, i)| (k.as_str(), i))
        .collect();
    // Even keys in bucket 1, odd keys in bucket 2.
    let buckets: Vec<i64> = (0..n).map(|i| 1 + i % 2).collect();
    s.upsert(&batch(&rows), &buckets).unwrap();
    assert!(s.dirty_all);
    s.evict_through(1).unwrap();
    // An evicted key upserted again in the same batch is held.
    s.upsert(&batch(&[("k0", -1)]), &[1]).unwrap();
    s.commit(0, serde_json::Value::Null).await.unwrap();
    let expected_rows = n as u64 / 2 + 1;
    assert_eq!(s.rows(), expected_rows);

    let mut r = store(dir.path());
    r.load(Some(0)).await.unwrap();
    assert_eq!(r.rows(), expected_rows);
    assert_eq!(r.bytes(), s.bytes());
    let probe = batch(&[("k0", 0), ("k1", 0), ("k2", 0), ("k69999", 0)]);
    assert_eq!(
        pairs(r.lookup(&probe, &[1, 2, 1, 2]).unwrap()),
        vec![
            ("k0".into(), -1),
            ("k1".into(), 1),
            ("k69999".into(), 69_999)
        ]
    );
    // The next batch is incremental again.
    r.upsert(&batch(&[("k1", 7)]), &[2]).unwrap();
    assert!(!r.dirty_all);
    r.commit(1, serde_json::Value::Null).await.unwrap();
    let mut again = store(dir.path());
    again.load(Some(1)).await.unwrap();
    assert_eq!(
        pairs(again.lookup(&batch(&[("k1", 0)]), &[2]).unwrap()),
        vec![("k1".into(), 7)]
    );
}

#[test]
fn a_bucket_keeps_its_entries_through_longer_values_removals_and_compaction() {
    let mut rows = Rows::default();
    let key = |i: u32| format!("key-{i:05}").into_bytes();
    for i in 0..10_000u32 {
        assert_eq!(rows.insert(&key(i), &[1; 10]), None);
    }
    // Same length: in place, no dead bytes.
    assert_eq!(rows.insert(&key(7), &[2; 10]), Some(10));
    assert_eq!(rows.dead, 0);
    let full = rows.data.len();
    // Longer values move every entry; the arena is compacted on the way.
    for i in 0..10_000u32 {
        assert_eq!(rows.insert(&key(i), &[3; 20]), Some(10));
    }
    // Dead bytes stay below the live ones; every key shares "key-0",
    // kept once.
    assert_eq!(rows.prefix(), b"key-0");
    let live = 10_000 * (2 + 4 + 20);
    assert_eq!(rows.data.len() - rows.dead, live);
    assert!(rows.data.len() <= 2 * live, "{} bytes", rows.data.len());
    assert!(rows.data.len() > full);
    for i in (0..10_000u32).step_by(2) {
        assert_eq!(rows.remove(&key(i)), Some(20));
    }
    assert_eq!(rows.remove(&key(0)), None);
    // Removing half compacted the arena.
    let live = 5_000 * (2 + 4 + 20);
    assert_eq!(rows.data.len() - rows.dead, live);
    assert!(rows.data.len() < 2 * live, "{}", rows.data.len());
    for i in 0..10_000u32 {
        let want = (i % 2 == 1).then_some(&[3u8; 20][..]);
        assert_eq!(rows.get(&key(i)), want, "key {i}");
    }
    let whole = |rows: &Rows| -> Vec<Vec<u8>> {
        rows.sorted()
            .map(|(rest, _)| [rows.prefix(), rest].concat())
            .collect()
    };
    let expected: Vec<Vec<u8>> = (0..10_000u32).filter(|i| i % 2 == 1).map(key).collect();
    assert_eq!(whole(&rows), expected);
    // Lengths past one varint byte, offsets past 4 GiB; a key sharing
    // nothing with the others rewrites them without the prefix.
    let long = vec![9u8; 300];
    assert_eq!(rows.insert(b"long", &long), None);
    assert_eq!(rows.prefix(), b"");
    assert_eq!(rows.get(b"long"), Some(&long[..]));
    let mut expected = expected;
    expected.push(b"long".to_vec());
    assert_eq!(whole(&rows), expected);
    for i in (1..10_000u32).step_by(2) {
        assert_eq!(rows.get(&key(i)), Some(&[3u8; 20][..]), "key {i}");
    }
    assert_eq!(rows.remove(b"long"), Some(300));
    assert_eq!(unpack(pack((1 << 39) + 5)), (1 << 39) + 5);
    for i in (1..10_000u32).step_by(2) {
        rows.remove(&key(i));
    }
    assert!(rows.is_empty());
    assert!(rows.data.is_empty());
}

#[test]
fn keys_sharing_their_first_bytes_keep_them_once_and_a_differing_key_cuts_the_prefix() {
    let mut rows = Rows::default();
    // A window's bucket: every key starts with the same 19 bytes.
    let key = |window: u8, user: u32| {
        let mut k = vec![window; 19];
        k.extend_from_slice(&u64::from(user).to_be_bytes());
        k
    };
    for user in 0..70_000u32 {
        assert_eq!(rows.insert(&key(1, user), &user.to_le_bytes()), None);
    }
    // The window and the user ids' five high bytes, kept once: each
    // entry holds 3 bytes of key, 4 of value and 2 of lengths.
    assert_eq!(rows.prefix(), &key(1, 0)[..24]);
    assert_eq!(rows.data.len(), 70_000 * (2 + 3 + 4));
    assert_eq!(rows.get(&key(2, 5)), None);
    assert_eq!(rows.remove(&key(2, 5)), None);
    assert!(!rows.contains_key(&key(1, 70_000)));
    assert!(
        !rows.contains_key(&key(1, 0)[..20]),
        "a key's own prefix is not the key"
    );
    // A key of another window cuts the prefix to nothing; every entry
    // is still found, by its whole key.
    assert_eq!(rows.insert(&key(2, 5), b"other"), None);
    assert_eq!(rows.prefix(), b"");
    for user in (0..70_000u32).step_by(997) {
        assert_eq!(rows.get(&key(1, user)), Some(&user.to_le_bytes()[..]));
    }
    assert_eq!(rows.get(&key(2, 5)), Some(&b"other"[..]));
    assert_eq!(rows.insert(&key(1, 3), &9u32.to_le_bytes()), Some(4));
    assert_eq!(rows.get(&key(1, 3)), Some(&9u32.to_le_bytes()[..]));
    // Emptied, the bucket takes the next key's bytes as its prefix.
    for user in 0..70_000u32 {
        assert_eq!(rows.remove(&key(1, user)), Some(4));
    }
    assert_eq!(rows.remove(&key(2, 5)), Some(5));
    assert!(rows.is_empty());
    assert_eq!(rows.insert(&key(3, 1), b"v"), None);
    assert_eq!(rows.prefix(), &key(3, 1)[..]);
    assert_eq!(rows.get(&key(3, 1)), Some(&b"v"[..]));
    assert_eq!(rows.get(&key(3, 1)[..26]), None);
}

#[tokio::test]
async fn a_state_file_larger_than_a_part_is_uploaded_in_parts_and_loads_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(dir.path()).with_snapshot_interval(1);
    s.load(None).await.unwrap();
    let n = 200_000i64;
    let names: Vec<String> = (0..n).map(|i| format!("a-long-key-{i:040}")).collect();
    let rows: Vec<(&str, i64)> = names.iter().map(String::as_str).zip(0..n).collect();
    s.upsert(&batch(&rows), &vec![1; n as usize]).unwrap();
    s.commit(0, serde_json::json!({"m": 1})).await.unwrap();
    s.wait_for_snapshot().await.unwrap();
    let snapshot = dir.path().join("state/agg/0.snapshot.arrow");
    let size = std::fs::metadata(&snapshot).unwrap().len();
    // Larger than a part on any store: many parts on this local disk.
    assert!(size > files::PART as u64, "{size} bytes");

    let mut r = store(dir.path());
    r.load(Some(0)).await.unwrap();
    assert_eq!(r.rows(), n as u64);
    assert_eq!(r.bytes(), s.bytes());
    assert_eq!(r.meta(), &serde_json::json!({"m": 1}));
    let probe = batch(&[(names[0].as_str(), 0), (names[199_999].as_str(), 0)]);
    assert_eq!(
        pairs(r.lookup(&probe, &[1, 1]).unwrap()),
        vec![(names[0].clone(), 0), (names[199_999].clone(), 199_999)]
    );
}

/// The rows of `s`, sorted with their buckets... as `pairs` gives them.
fn held(s: &StateStore) -> Vec<(String, i64)> {
    pairs(s.all().unwrap())
}

#[tokio::test]
async fn snapshots_merged_from_the_files_hold_exactly_the_state_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(dir.path()).with_snapshot_interval(4);
    s.load(None).await.unwrap();
    let mut expected = Vec::new();
    for id in 0..13u64 {
        // Keys come and go: upserts into two buckets, a key moving
        // bucket, removals, an eviction, and one batch changing most
        // of the state (its delta holds every row).
        let n = if id == 5 { CHUNK as i64 + 10 } else { 50 };
        let names: Vec<String> = (0..n)
            .map(|i| format!("k{}", (i * 7 + id as i64) % 400))
            .collect();
        let rows: Vec<(&str, i64)> = names.iter().map(|k| (k.as_str(), id as i64)).collect();
        let buckets: Vec<i64> = (0..n).map(|i| 1 + (i + id as i64) % 3).collect();
        s.upsert(&batch(&rows), &buckets).unwrap();
        if id % 3 == 1 {
            let gone: Vec<(&str, i64)> = rows.iter().take(10).copied().collect();
            s.remove_keys(&batch(&gone), &buckets[..10]).unwrap();
        }
        if id == 7 {
            s.evict_through(1).unwrap();
        }
        s.commit(id, serde_json::json!({ "id": id })).await.unwrap();
        s.wait_for_snapshot().await.unwrap();
        expected.push(held(&s));
    }
    let (snapshots, _) = s.list().await.unwrap();
    assert_eq!(snapshots, vec![3, 7, 11]);
    for v in 0..13u64 {
        let mut r = store(dir.path());
        r.load(Some(v)).await.unwrap();
        assert_eq!(held(&r), expected[v as usize], "as of batch {v}");
        assert_eq!(r.meta(), &serde_json::json!({ "id": v }));
    }
    // Each snapshot alone (its deltas gone) gives the same state.
    for v in [3u64, 7, 11] {
        let copy = tempfile::tempdir().unwrap();
        let from = dir.path().join("state/agg");
        let to = copy.path().join("state/agg");
        std::fs::create_dir_all(&to).unwrap();
        let name = format!("{v}.snapshot.arrow");
        std::fs::copy(from.join(&name), to.join(&name)).unwrap();
        let mut r = store(copy.path());
        r.load(Some(v)).await.unwrap();
        assert_eq!(held(&r), expected[v as usize], "snapshot {v}");
        assert_eq!(r.rows(), expected[v as usize].len() as u64);
    }
}

#[tokio::test]
async fn a_snapshot_merges_delta_files_written_before_they_counted_their_upserts() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(dir.path()).with_snapshot_interval(100);
    s.load(None).await.unwrap();
    s.upsert(&batch(&[("a", 1), ("b", 2), ("c", 3)]), &[1, 1, 2])
        .unwrap();
    s.commit(0, serde_json::Value::Null).await.unwrap();
    s.upsert(&batch(&[("a", 10)]), &[1]).unwrap();
    s.remove_keys(&batch(&[("b", 0)]), &[1]).unwrap();
    s.commit(1, serde_json::Value::Null).await.unwrap();
    // Rewrite both deltas as earlier builds wrote them: no count of
    // upsert batches in the footer.
    for id in 0..2 {
        let path = dir.path().join(format!("state/agg/{id}.delta.arrow"));
        let reader =
            arrow::ipc::reader::FileReader::try_new(std::fs::File::open(&path).unwrap(), None)
                .unwrap();
        let schema = reader.schema();
        let batches: Vec<RecordBatch> = reader.map(|b| b.unwrap()).collect();
        let mut w =
            arrow::ipc::writer::FileWriter::try_new(std::fs::File::create(&path).unwrap(), &schema)
                .unwrap();
        for b in &batches {
            w.write(b).unwrap();
        }
        w.finish().unwrap();
    }
    files::snapshot_from_files(s.files.clone(), 1)
        .await
        .unwrap();
    std::fs::remove_file(dir.path().join("state/agg/0.delta.arrow")).unwrap();
    std::fs::remove_file(dir.path().join("state/agg/1.delta.arrow")).unwrap();
    let mut r = store(dir.path());
    r.load(Some(1)).await.unwrap();
    assert_eq!(held(&r), vec![("a".into(), 10), ("c".into(), 3)]);
}

#[tokio::test]
async fn a_restart_writes_the_snapshot_its_process_did_not_finish() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(dir.path());
    s.load(None).await.unwrap();
    for id in 0..7u64 {
        s.upsert(&batch(&[("k", id as i64), (&format!("k{id}"), 1)]), &[1, 1])
            .unwrap();
        s.commit(id, serde_json::Value::Null).await.unwrap();
        s.wait_for_snapshot().await.unwrap();
    }
    let snapshot = dir.path().join("state/agg/5.snapshot.arrow");
    std::fs::remove_file(&snapshot).unwrap();
    let mut r = store(dir.path());
    r.load(Some(6)).await.unwrap();
    r.wait_for_snapshot().await.unwrap();
    assert!(snapshot.exists());
    let mut again = store(dir.path());
    again.load(Some(5)).await.unwrap();
    assert_eq!(again.rows(), 7);
    assert_eq!(
        pairs(again.lookup(&batch(&[("k", 0)]), &[1]).unwrap()),
        vec![("k".into(), 5)]
    );
}

#[tokio::test]
async fn a_snapshot_that_does_not_add_up_is_not_written() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(dir.path()).with_snapshot_interval(100);
    s.load(None).await.unwrap();
    s.upsert(&batch(&[("a", 1), ("b", 2)]), &[1, 1]).unwrap();
    s.commit(0, serde_json::Value::Null).await.unwrap();
    s.upsert(&batch(&[("c", 3)]), &[1]).unwrap();
    s.commit(1, serde_json::Value::Null).await.unwrap();
    // Batch 1's delta says the state held 5 rows; the files give 3.
    let d = dir.path().join("state/agg");
    let path = d.join("1.delta.arrow");
    let reader =
        arrow::ipc::reader::FileReader::try_new(std::fs::File::open(&path).unwrap(), None).unwrap();
    let schema = reader.schema();
    let mut header: serde_json::Value = serde_json::from_str(&schema.metadata()[META]).unwrap();
    assert_eq!(header["rows"], 3);
    header["rows"] = 5.into();
    let schema = Arc::new(
        schema
            .as_ref()
            .clone()
            .with_metadata([(META.to_string(), header.to_string())].into()),
    );
    let batches: Vec<RecordBatch> = reader.map(|b| b.unwrap()).collect();
    let mut w =
        arrow::ipc::writer::FileWriter::try_new(std::fs::File::create(&path).unwrap(), &schema)
            .unwrap();
    for b in &batches {
        w.write(&RecordBatch::try_new(schema.clone(), b.columns().to_vec()).unwrap())
            .unwrap();
    }
    w.finish().unwrap();
    let err = files::snapshot_from_files(s.files.clone(), 1)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("1.delta.arrow") && err.contains("holds 3 rows where the batch recorded 5"),
        "{err}"
    );
    assert!(!d.join("1.snapshot.arrow").exists());
}

#[tokio::test]
async fn summaries_give_each_operators_size_as_of_a_batch() {
    let dir = tempfile::tempdir().unwrap();
    let loc = Location::parse(dir.path().to_str().unwrap(), &HashMap::new()).unwrap();
    assert!(summaries(&loc, None).await.unwrap().is_empty());
    let mut s = store(dir.path());
    s.load(None).await.unwrap();
    s.upsert(&batch(&[("a", 1), ("b", 2)]), &[10, 20]).unwrap();
    s.commit(0, serde_json::json!({"max": 5})).await.unwrap();
    s.upsert(&batch(&[("c", 3)]), &[30]).unwrap();
    s.commit(1, serde_json::json!({"max": 6})).await.unwrap();
    let all = summaries(&loc, None).await.unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(
        (all[0].operator.as_str(), all[0].batch_id, all[0].rows),
        ("agg", 1, 3)
    );
    assert_eq!(all[0].bytes, s.bytes());
    assert_eq!(all[0].meta, serde_json::json!({"max": 6}));
    // Batch 1 is written but not committed to the table: as of 0.
    let at0 = summaries(&loc, Some(0)).await.unwrap();
    assert_eq!((at0[0].batch_id, at0[0].rows), (0, 2));
}

#[tokio::test]
async fn a_store_of_keys_only_keeps_and_forgets_keys() {
    let dir = tempfile::tempdir().unwrap();
    let loc = Location::parse(dir.path().to_str().unwrap(), &HashMap::new()).unwrap();
    let keys = Arc::new(Schema::new(vec![Field::new("k", DataType::Utf8, true)]));
    let batch = |k: &[&str]| {
        RecordBatch::try_new(
            keys.clone(),
            vec![Arc::new(StringArray::from_iter_values(k.iter()))],
        )
        .unwrap()
    };
    let mut s = StateStore::new(loc.clone(), "dedup", keys.clone(), 1).unwrap();
    s.load(None).await.unwrap();
    s.upsert(&batch(&["a", "b"]), &[1, 2]).unwrap();
    assert_eq!(
        s.contains(&batch(&["a", "z"]), &[1, 1]).unwrap(),
        [true, false]
    );
    s.commit(0, serde_json::Value::Null).await.unwrap();
    s.evict_through(1).unwrap();
    s.commit(1, serde_json::Value::Null).await.unwrap();
    let mut r = StateStore::new(loc, "dedup", keys.clone(), 1).unwrap();
    r.load(Some(0)).await.unwrap();
    assert_eq!(r.rows(), 2);
    r.load(Some(1)).await.unwrap();
    assert_eq!(
        r.contains(&batch(&["a", "b"]), &[1, 2]).unwrap(),
        [false, true]
    );
    assert_eq!(r.all().unwrap().unwrap().num_rows(), 1);
}

#[test]
fn rows_and_bytes_follow_upserts_and_evictions() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = store(dir.path());
    s.upsert(&batch(&[("a", 1), ("bb", 2)]), &[1, 2]).unwrap();
    let two = s.bytes();
    assert_eq!(s.rows(), 2);
    s.upsert(&batch(&[("a", 5)]), &[1]).unwrap();
    assert_eq!((s.rows(), s.bytes()), (2, two));
    assert_eq!(pairs(s.evict_through(1).unwrap()), vec![("a".into(), 5)]);
    assert_eq!(s.rows(), 1);
    assert!(s.evict_through(1).unwrap().is_none());
    s.evict_through(100).unwrap();
    assert_eq!((s.rows(), s.bytes()), (0, 0));
}
