use std::sync::Arc;

use arrow::array::{
    ArrayRef, Int64Array, MapBuilder, RecordBatch, StringArray, StringBuilder,
    TimestampMicrosecondArray,
};
use arrow::datatypes::{DataType, Field, Schema};

use super::*;

fn batch(columns: Vec<(&str, ArrayRef)>) -> RecordBatch {
    let fields: Vec<Field> = columns
        .iter()
        .map(|(n, a)| Field::new(*n, a.data_type().clone(), true))
        .collect();
    RecordBatch::try_new(
        Arc::new(Schema::new(fields)),
        columns.into_iter().map(|(_, a)| a).collect(),
    )
    .unwrap()
}

fn text(v: Option<&[u8]>) -> Option<&str> {
    v.map(|b| std::str::from_utf8(b).unwrap())
}

#[test]
fn reserved_columns_make_the_record_and_the_rest_its_json_value() {
    let mut headers = MapBuilder::new(None, StringBuilder::new(), StringBuilder::new());
    headers.keys().append_value("source");
    headers.values().append_value("web");
    headers.append(true).unwrap();
    headers.append(false).unwrap();
    let b = batch(vec![
        ("user", Arc::new(StringArray::from(vec![Some("ann"), None]))),
        ("n", Arc::new(Int64Array::from(vec![3, 4]))),
        ("_key", Arc::new(StringArray::from(vec![Some("k1"), None]))),
        (
            "_partition",
            Arc::new(Int64Array::from(vec![Some(1), None])),
        ),
        (
            "_timestamp",
            Arc::new(TimestampMicrosecondArray::from(vec![Some(1_500_000), None])),
        ),
        ("_headers", Arc::new(headers.finish())),
    ]);
    let layout = RecordLayout::new(&b.schema()).unwrap();
    assert!(layout.has_key());
    let e = layout.encode(&b).unwrap();
    assert_eq!(e.len(), 2);
    let r0 = e.record(0);
    assert_eq!(text(r0.value), Some(r#"{"user":"ann","n":3}"#));
    assert_eq!(text(r0.key), Some("k1"));
    assert_eq!(r0.partition, Some(1));
    assert_eq!(r0.timestamp_ms, Some(1_500));
    assert_eq!(
        r0.headers.unwrap(),
        &vec![("source".to_string(), Some(b"web".to_vec()))]
    );
    // NULLs: no key, the partitioner's partition, the producer's time, a
    // value without the NULL column.
    let r1 = e.record(1);
    assert_eq!(text(r1.value), Some(r#"{"n":4}"#));
    assert_eq!((r1.key, r1.partition, r1.timestamp_ms), (None, None, None));
    assert!(r1.headers.unwrap().is_empty());
}

#[test]
fn headers_as_a_json_object_and_an_output_with_no_value_column() {
    let b = batch(vec![
        ("_key", Arc::new(StringArray::from(vec!["a"]))),
        (
            "_headers",
            Arc::new(StringArray::from(vec![
                r#"{"trace": "t1", "n": 2, "gone": null}"#,
            ])),
        ),
    ]);
    let e = RecordLayout::new(&b.schema()).unwrap().encode(&b).unwrap();
    let r = e.record(0);
    assert_eq!(r.value, None);
    assert_eq!(
        r.headers.unwrap(),
        // In name order; the values as text (a JSON string's without quotes).
        &vec![
            ("gone".to_string(), None),
            ("n".to_string(), Some(b"2".to_vec())),
            ("trace".to_string(), Some(b"t1".to_vec())),
        ]
    );
    let bad = batch(vec![("_headers", Arc::new(StringArray::from(vec!["[1]"])))]);
    let err = RecordLayout::new(&bad.schema())
        .unwrap()
        .encode(&bad)
        .unwrap_err();
    assert!(err.contains("not a JSON object"), "{err}");
}

#[test]
fn reserved_columns_of_the_wrong_type_are_refused_by_name() {
    for (name, dt, want) in [
        ("_key", DataType::Int64, "CAST(... AS VARCHAR) AS _key"),
        ("_partition", DataType::Utf8, "an integer type"),
        ("_timestamp", DataType::Utf8, "a TIMESTAMP"),
        ("_headers", DataType::Int32, "a MAP"),
    ] {
        let schema = Schema::new(vec![Field::new(name, dt, true)]);
        let err = RecordLayout::new(&schema).unwrap_err();
        assert!(err.contains(name) && err.contains(want), "{err}");
    }
}

#[test]
fn a_negative_partition_is_an_error() {
    let b = batch(vec![(
        "_partition",
        Arc::new(Int64Array::from(vec![0, -2])),
    )]);
    let err = RecordLayout::new(&b.schema())
        .unwrap()
        .encode(&b)
        .unwrap_err();
    assert!(err.contains("-2"), "{err}");
}

#[test]
fn values_with_newlines_stay_one_record_each() {
    let b = batch(vec![(
        "s",
        Arc::new(StringArray::from(vec!["a\nb", "c"])) as ArrayRef,
    )]);
    let e = RecordLayout::new(&b.schema()).unwrap().encode(&b).unwrap();
    assert_eq!(text(e.record(0).value), Some(r#"{"s":"a\nb"}"#));
    assert_eq!(text(e.record(1).value), Some(r#"{"s":"c"}"#));
}
