//! Tests of the parent module.

use super::*;
use arrow::array::{Int64Array, StringArray, StructArray};
use arrow::datatypes::{Field, Schema};

/// A batch larger than a slice is cut into slices that hold every row
/// once, every row of a key in the same slice, none much over the size.
#[test]
fn key_slices_keep_each_key_in_one_slice_and_every_row_once() {
    let n = 10_000i64;
    // Two key columns: 2,500 keys, each on four rows spread apart.
    let a: Int64Array = (0..n).map(|i| Some(i % 2_500)).collect();
    let b: StringArray = (0..n)
        .map(|i| Some(format!("k{}", i % 2_500 % 7)))
        .collect();
    let v: Int64Array = (0..n).map(Some).collect();
    let schema = Arc::new(Schema::new(vec![
        Field::new("a", DataType::Int64, true),
        Field::new("b", DataType::Utf8, true),
        Field::new("v", DataType::Int64, true),
    ]));
    let batch = RecordBatch::try_new(schema, vec![Arc::new(a), Arc::new(b), Arc::new(v)]).unwrap();
    assert_eq!(key_slices(&batch, 2, n as usize).unwrap(), vec![None]);
    let slices = key_slices(&batch, 2, 1_000).unwrap();
    assert!(slices.len() >= 8, "{} slices", slices.len());
    let mut slice_of_key = std::collections::HashMap::new();
    let mut seen = vec![false; n as usize];
    for (s, rows) in slices.iter().enumerate() {
        let rows = rows.as_ref().expect("a slice of rows");
        assert!(rows.len() <= 2_000, "slice {s}: {} rows", rows.len());
        for &r in rows.values() {
            assert!(!seen[r as usize], "row {r} twice");
            seen[r as usize] = true;
            let key = r as i64 % 2_500;
            assert_eq!(*slice_of_key.entry(key).or_insert(s), s, "key {key}");
        }
    }
    assert!(seen.iter().all(|&s| s), "every row in a slice");
}

/// Sessions of two users, `[start, end)` in seconds, merged where they
/// overlap, directly or through a third; touching sessions stay apart.
#[test]
fn overlapping_sessions_of_a_group_merge_into_their_union() {
    let rows = [
        ("a", 0, 5),
        ("a", 8, 9),
        ("b", 1, 4),
        ("a", 3, 8),
        ("a", 9, 12),
        ("a", 20, 25),
        ("b", 3, 6),
    ];
    let window = window::window_type(TimeUnit::Second, None);
    let DataType::Struct(fields) = window.clone() else {
        unreachable!()
    };
    let ts = |v: Vec<i64>| {
        cast(
            &(Arc::new(Int64Array::from(v)) as ArrayRef),
            &fields[0].data_type().clone(),
        )
        .unwrap()
    };
    let windows = StructArray::try_new(
        fields.clone(),
        vec![
            ts(rows.iter().map(|r| r.1).collect()),
            ts(rows.iter().map(|r| r.2).collect()),
        ],
        None,
    )
    .unwrap();
    let schema = Arc::new(Schema::new(vec![
        Field::new("user", DataType::Utf8, true),
        Field::new("window", window, true),
        Field::new("n", DataType::Int64, true),
    ]));
    let batch = RecordBatch::try_new(
        schema,
        vec![
            Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.0))),
            Arc::new(windows),
            Arc::new(Int64Array::from_iter_values(0..rows.len() as i64)),
        ],
    )
    .unwrap();
    let merged = merge_sessions(&batch, 1, 2).unwrap();
    let starts = window_bounds(merged.column(1), 0).unwrap();
    let ends = window_bounds(merged.column(1), 1).unwrap();
    let got: Vec<(i64, i64)> = (0..rows.len())
        .map(|i| (starts.value(i), ends.value(i)))
        .collect();
    assert_eq!(
        got,
        [(0, 8), (8, 9), (1, 6), (0, 8), (9, 12), (20, 25), (1, 6)]
    );
    // The value columns and the group keys are untouched.
    assert_eq!(merged.column(0), batch.column(0));
    assert_eq!(merged.column(2), batch.column(2));
}
