//! The state store against the S3-compatible server: files larger than one
//! upload part go up in parts, are read back a batch at a time by ranges,
//! and merge into the next snapshot exactly.

use std::sync::Arc;

use arrow::array::{AsArray, Int64Array, RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Int64Type, Schema};
use lakestream::state::StateStore;
use lakestream::storage::Location;
use object_store::ObjectStoreExt;

fn rows(keys: &[String], values: impl Iterator<Item = i64>) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![
        Field::new("k", DataType::Utf8, false),
        Field::new("n", DataType::Int64, false),
    ]));
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(StringArray::from_iter_values(keys)),
            Arc::new(Int64Array::from_iter_values(values)),
        ],
    )
    .unwrap()
}

#[tokio::test]
async fn a_state_larger_than_an_upload_part_goes_to_s3_in_parts_and_loads_back() {
    let (options, prefix) = crate::common::s3_server("state-parts");
    let loc = Location::parse(&prefix, &options).unwrap();
    let keys: Vec<String> = (0..200_000).map(|i| format!("user-{i:045}")).collect();
    let all = rows(&keys, 0..200_000);
    let open = |loc: Location| {
        StateStore::new(loc, "aggregate", all.schema(), 1)
            .unwrap()
            .with_snapshot_interval(1)
    };
    let mut store = open(loc.clone());
    store.load(None).await.unwrap();
    store.upsert(&all, &vec![7; 200_000]).unwrap();
    store.commit(0, serde_json::json!({"b": 0})).await.unwrap();
    store.wait_for_snapshot().await.unwrap();
    // Batch 1 changes one key and forgets another.
    store
        .upsert(&rows(&keys[..1], [-1].into_iter()), &[7])
        .unwrap();
    store
        .remove_keys(&rows(&keys[1..2], [0].into_iter()), &[7])
        .unwrap();
    store.commit(1, serde_json::json!({"b": 1})).await.unwrap();
    // Snapshot 1 is merged from snapshot 0 (read by ranges) and delta 1.
    store.wait_for_snapshot().await.unwrap();

    for name in ["0.snapshot.arrow", "1.snapshot.arrow"] {
        let path = loc.child(&format!("state/aggregate/{name}"));
        let size = loc.store().head(&path).await.unwrap().size;
        assert!(size > 5 << 20, "{name}: {size} bytes, not past one part");
    }
    for (version, held) in [(0u64, 200_000u64), (1, 199_999)] {
        let mut again = open(Location::parse(&prefix, &options).unwrap());
        again.load(Some(version)).await.unwrap();
        assert_eq!(again.rows(), held, "as of batch {version}");
        assert_eq!(again.meta(), &serde_json::json!({"b": version}));
        let got = again.all().unwrap().unwrap();
        let mut pairs: Vec<(String, i64)> = (0..got.num_rows())
            .map(|i| {
                (
                    got.column(0).as_string::<i32>().value(i).to_string(),
                    got.column(1).as_primitive::<Int64Type>().value(i),
                )
            })
            .collect();
        pairs.sort();
        let mut want: Vec<(String, i64)> = keys.iter().cloned().zip(0..).collect();
        if version == 1 {
            want[0].1 = -1;
            want.remove(1);
        }
        assert_eq!(pairs, want, "as of batch {version}");
    }
}
