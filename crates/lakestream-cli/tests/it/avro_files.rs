//! `STORED AS AVRO`: object container files written by an independent
//! writer (Python's fastavro), every codec, two schema versions in one
//! prefix, read exactly once under kill -9.

use std::path::Path;

use crate::common::*;

const V1: &str = r#"{"type":"record","name":"Event","fields":[
 {"name":"event_id","type":"string"},
 {"name":"amount","type":"double"},
 {"name":"ts","type":{"type":"long","logicalType":"timestamp-micros"}},
 {"name":"ref","type":{"type":"string","logicalType":"uuid"}},
 {"name":"place","type":{"type":"record","name":"Place","fields":[{"name":"city","type":"string"}]}}]}"#;

/// Version 2 adds a field.
const V2: &str = r#"{"type":"record","name":"Event","fields":[
 {"name":"event_id","type":"string"},
 {"name":"amount","type":"double"},
 {"name":"ts","type":{"type":"long","logicalType":"timestamp-micros"}},
 {"name":"ref","type":{"type":"string","logicalType":"uuid"}},
 {"name":"place","type":{"type":"record","name":"Place","fields":[{"name":"city","type":"string"}]}},
 {"name":"currency","type":"string","default":"EUR"}]}"#;

/// Write `in/<name>.avro`: `n` events `ev-<tag>-<i>` of `schema` with `codec`.
fn write_avro(dir: &Path, name: &str, tag: &str, n: usize, schema: &str, codec: &str) {
    let lines: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            let mut r = serde_json::json!({
                "event_id": format!("ev-{tag}-{i:04}"),
                "amount": i as f64 + 0.5,
                "ts": 1_767_225_600_000_000i64 + i as i64,
                "ref": format!("00000000-0000-4000-8000-{i:012}"),
                "place": {"city": "Oslo"},
            });
            if schema == V2 {
                r["currency"] = "NOK".into();
            }
            r
        })
        .collect();
    let out = dir.join("in").join(format!("{name}.avro"));
    run_py_lines(
        "write_avro.py",
        &[out.as_os_str(), schema.as_ref(), codec.as_ref()],
        &lines,
    );
}

#[test]
fn avro_files_of_every_codec_and_two_schema_versions_are_read_once_under_kill_9() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir(dir.join("in")).unwrap();
    let codecs = ["null", "deflate", "snappy", "zstandard"];
    for f in 0..8 {
        let schema = if f < 4 { V1 } else { V2 };
        let name = format!("f{f}");
        write_avro(dir, &name, &name, 400, schema, codecs[f % 4]);
    }
    let job = |table: &str| {
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE events (event_id VARCHAR NOT NULL, amount DOUBLE, \
             ts TIMESTAMP, ref VARCHAR, currency VARCHAR) STORED AS AVRO LOCATION 'in/' \
             OPTIONS ('max_files_per_trigger' '1');\n\
             CREATE EXTERNAL TABLE {table} STORED AS DELTA LOCATION '{table}';\n\
             INSERT INTO {table} SELECT * FROM events;\n"
        )
    };
    killed_run_writes_the_clean_table(dir, &job, 4, 2);
    let rows = read_py(&dir.join("out"));
    assert_eq!(rows.len(), 3200);
    let ids: std::collections::BTreeSet<&str> = rows
        .iter()
        .map(|r| r["event_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 3200, "a row twice");
    for r in &rows {
        let f: usize = r["event_id"].as_str().unwrap()[4..5].parse().unwrap();
        // A file written before the field existed has no value for it.
        let currency = if f < 4 {
            serde_json::Value::Null
        } else {
            "NOK".into()
        };
        assert_eq!(r["currency"], currency, "{r}");
        assert!(
            r["ref"]
                .as_str()
                .unwrap()
                .starts_with("00000000-0000-4000-8000-"),
            "{r}"
        );
        assert!(r["ts"].as_str().unwrap().starts_with("2026-01-01"), "{r}");
    }
}

#[test]
fn undeclared_avro_columns_come_from_the_first_file_and_a_broken_file_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir(dir.join("in")).unwrap();
    write_avro(dir, "a", "a", 10, V1, "deflate");
    std::fs::write(
        dir.join("job.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE events STORED AS AVRO LOCATION 'in/';\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
         INSERT INTO out SELECT event_id, place.city AS city, ref FROM events;\n",
    )
    .unwrap();
    let o = run_in(dir, &run_job_args("ckpt"));
    assert!(o.status.success(), "{}", text(&o));
    let rows = read_py(&dir.join("out"));
    assert_eq!(rows.len(), 10);
    assert_eq!(rows[0]["city"], "Oslo");
    assert!(rows[0]["ref"].as_str().unwrap().len() == 36, "{}", rows[0]);

    // Not an Avro file: the batch fails naming it, nothing is written.
    std::fs::write(dir.join("in/b.avro"), b"Obj\x01 not really avro").unwrap();
    let o = run_in(dir, &run_job_args("ckpt"));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(stderr(&o).contains("b.avro"), "{}", text(&o));
    assert_eq!(read_py(&dir.join("out")).len(), 10);
}
