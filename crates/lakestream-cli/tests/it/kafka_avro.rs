//! Avro and Protobuf values in the Confluent wire format, produced by an independent
//! client (`confluent-kafka`'s `AvroSerializer` and `ProtobufSerializer`, whose
//! `SchemaRegistryClient`
//! registers each schema) and read through a schema registry.
//!
//! The registry is `tests/py/registry.py`, a minimal stand-in for the
//! Confluent REST endpoints both sides call: no Confluent-compatible
//! registry installs from a package registry these tests may use.

use std::time::Duration;

use crate::broker::{Broker, make_ca, produce_py_lines, sign};
use crate::common::*;

/// The registry stand-in on a free loopback port, with HTTP basic auth
/// (and with TLS: the CA's directory).
struct Registry {
    child: std::process::Child,
    port: u16,
    tls: Option<tempfile::TempDir>,
}

const REGISTRY_USER: &str = "sr-user";
const REGISTRY_PASSWORD: &str = "sr-pass-never-printed";

impl Registry {
    fn start() -> Self {
        let user = format!("{REGISTRY_USER}:{REGISTRY_PASSWORD}");
        let (child, port) = spawn_py_server("registry.py", &["--user".as_ref(), user.as_ref()]);
        Self {
            child,
            port,
            tls: None,
        }
    }

    /// The registry behind HTTPS, its certificate (for 127.0.0.1) signed by
    /// a CA made here.
    fn start_tls() -> Self {
        let dir = tempfile::tempdir().unwrap();
        make_ca(dir.path(), "ca");
        sign(
            dir.path(),
            "registry",
            "/CN=127.0.0.1",
            "IP:127.0.0.1",
            None,
        );
        let user = format!("{REGISTRY_USER}:{REGISTRY_PASSWORD}");
        let (cert, key) = (
            dir.path().join("registry.pem"),
            dir.path().join("registry.key"),
        );
        let (child, port) = spawn_py_server(
            "registry.py",
            &[
                "--user".as_ref(),
                user.as_ref(),
                "--cert".as_ref(),
                cert.as_os_str(),
                "--key".as_ref(),
                key.as_os_str(),
            ],
        );
        Self {
            child,
            port,
            tls: Some(dir),
        }
    }

    /// The CA a TLS registry's certificate is signed by.
    fn ca(&self) -> Option<std::path::PathBuf> {
        self.tls.as_ref().map(|d| d.path().join("ca.pem"))
    }

    fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// The producer settings that name this registry.
    fn producer_settings(&self) -> Vec<(&'static str, String)> {
        let mut settings = vec![
            ("schema.registry.url", self.url()),
            (
                "basic.auth.user.info",
                format!("{REGISTRY_USER}:{REGISTRY_PASSWORD}"),
            ),
        ];
        if let Some(ca) = self.ca() {
            settings.push(("schema.registry.ssl.ca.location", ca.display().to_string()));
        }
        settings
    }

    /// A Kafka table's options for Protobuf values through this registry.
    fn protobuf_options(&self) -> String {
        self.job_options()
            .replace("'format' 'avro'", "'format' 'protobuf'")
    }

    /// A Kafka table's registry options.
    fn job_options(&self) -> String {
        format!(
            "'format' 'avro', 'schema_registry_url' '{}', 'schema_registry_user' \
             '{REGISTRY_USER}', 'schema_registry_password' '${{env:LS_TEST_SR_PASSWORD}}'",
            self.url()
        )
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Version 1 of the orders value schema.
const V1: &str = r#"{"type":"record","name":"Order","namespace":"shop","fields":[
 {"name":"order_id","type":"string"},
 {"name":"customer_id","type":"long"},
 {"name":"amount","type":"double"},
 {"name":"ts","type":{"type":"long","logicalType":"timestamp-millis"}}]}"#;

/// Version 2: a field with a default and a nullable one added.
const V2: &str = r#"{"type":"record","name":"Order","namespace":"shop","fields":[
 {"name":"order_id","type":"string"},
 {"name":"customer_id","type":"long"},
 {"name":"amount","type":"double"},
 {"name":"ts","type":{"type":"long","logicalType":"timestamp-millis"}},
 {"name":"currency","type":"string","default":"EUR"},
 {"name":"coupon","type":["null","string"],"default":null}]}"#;

/// Version 3: one more field, registered after the query first ran.
const V3: &str = r#"{"type":"record","name":"Order","namespace":"shop","fields":[
 {"name":"order_id","type":"string"},
 {"name":"customer_id","type":"long"},
 {"name":"amount","type":"double"},
 {"name":"ts","type":{"type":"long","logicalType":"timestamp-millis"}},
 {"name":"currency","type":"string","default":"EUR"},
 {"name":"coupon","type":["null","string"],"default":null},
 {"name":"channel","type":"string","default":"web"}]}"#;

/// Order `i` as a record of `schema` (`version` 1, 2 or 3), on partition
/// `i % 2`.
fn order(i: usize, schema: &str, version: u8) -> serde_json::Value {
    let mut v = serde_json::json!({
        "order_id": format!("o-{i}"),
        "customer_id": (i % 7) as i64,
        "amount": i as f64 + 0.5,
        "ts": 1_700_000_000_000i64 + i as i64 * 1000,
    });
    if version >= 2 {
        v["currency"] = "USD".into();
        v["coupon"] = if i.is_multiple_of(2) {
            serde_json::Value::Null
        } else {
            format!("c-{i}").into()
        };
    }
    if version >= 3 {
        v["channel"] = "app".into();
    }
    serde_json::json!({
        "key": format!("k{i}"),
        "partition": (i % 2) as i32,
        "avro_schema": schema,
        "avro_value": v,
    })
}

/// A broker with topic `orders` of `partitions`, a registry, a job directory.
fn setup(partitions: i32) -> (Broker, Registry, tempfile::TempDir) {
    let broker = Broker::start();
    broker.create_topic("orders", partitions);
    (broker, Registry::start(), tempfile::tempdir().unwrap())
}

fn produce(broker: &Broker, registry: &Registry, lines: &[serde_json::Value]) -> Vec<(i32, i64)> {
    let settings = registry.producer_settings();
    let settings: Vec<(&str, &str)> = settings.iter().map(|(k, v)| (*k, v.as_str())).collect();
    produce_py_lines(broker, "orders", &settings, lines)
}

fn run(dir: &std::path::Path) -> std::process::Output {
    run_with(dir, "ckpt", REGISTRY_PASSWORD)
}

/// The job in `dir` to the end, checkpointed at `checkpoint`, with
/// `password` as the registry password in the environment.
fn run_with(dir: &std::path::Path, checkpoint: &str, password: &str) -> std::process::Output {
    bin()
        .current_dir(dir)
        .args([
            "run",
            "job.sql",
            "--checkpoint",
            checkpoint,
            "--trigger",
            "available-now",
        ])
        .env("LS_TEST_SR_PASSWORD", password)
        .output()
        .unwrap()
}

#[test]
fn two_schema_versions_resolve_to_the_columns_and_unknown_schema_ids_are_dead_lettered() {
    let (broker, registry, tmp) = setup(2);
    let mut lines: Vec<serde_json::Value> = (0..20).map(|i| order(i, V1, 1)).collect();
    lines.extend((20..40).map(|i| order(i, V2, 2)));
    // A value whose schema id (999) the registry never gave out, and a
    // JSON value on the Avro topic.
    lines.push(
        serde_json::json!({"key": "bad1", "partition": 0, "value_hex": "00000003e70a6f2d626164"}),
    );
    lines.push(serde_json::json!({"key": "bad2", "partition": 1, "value": "{\"order_id\":\"j\"}"}));
    let placed = produce(&broker, &registry, &lines);
    let dir = tmp.path();
    std::fs::write(
        dir.join("job.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE orders (\n  order_id VARCHAR NOT NULL, amount DOUBLE, \
             ts TIMESTAMP, currency VARCHAR, coupon VARCHAR\n) STORED AS KAFKA LOCATION \
             'kafka://{}/orders'\nOPTIONS ({}, 'max_offsets_per_trigger' '9', 'on_error' \
             'dead_letter', 'dead_letter_location' 'bad');\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
             INSERT INTO out SELECT order_id, amount, ts, currency, coupon, _partition, _offset \
             FROM orders;\n",
            broker.bootstrap(),
            registry.job_options()
        ),
    )
    .unwrap();
    let o = run(dir);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        !text(&o).contains(REGISTRY_PASSWORD),
        "a secret was printed"
    );

    let rows = read_py(&dir.join("out"));
    assert_eq!(rows.len(), 40, "{rows:?}");
    let mut seen = std::collections::BTreeSet::new();
    for r in &rows {
        let i: usize = r["order_id"].as_str().unwrap()[2..].parse().unwrap();
        assert!(seen.insert(i), "order {i} twice");
        let at = placed[i];
        assert_eq!(
            (
                r["_partition"].as_i64().unwrap() as i32,
                r["_offset"].as_i64().unwrap()
            ),
            at,
            "{r}"
        );
        assert_eq!(r["amount"].as_f64().unwrap(), i as f64 + 0.5);
        if i < 20 {
            // Written before the fields existed: the reader schema's
            // default, and NULL for the nullable field.
            assert_eq!(r["currency"], "EUR", "{r}");
            assert!(r["coupon"].is_null(), "{r}");
        } else {
            assert_eq!(r["currency"], "USD", "{r}");
            let coupon = if i.is_multiple_of(2) {
                serde_json::Value::Null
            } else {
                format!("c-{i}").into()
            };
            assert_eq!(r["coupon"], coupon, "{r}");
        }
        assert!(r["ts"].as_str().unwrap().starts_with("2023-11-1"), "{r}");
    }
    let bad = read_py(&dir.join("bad"));
    assert_eq!(bad.len(), 2, "{bad:?}");
    let errors: Vec<&str> = bad.iter().map(|r| r["error"].as_str().unwrap()).collect();
    assert!(
        errors
            .iter()
            .any(|e| e.contains("schema id 999 is not known")),
        "{errors:?}"
    );
    assert!(
        errors.iter().any(|e| e.contains("Confluent wire format")),
        "{errors:?}"
    );
}

#[test]
fn undeclared_columns_come_from_the_subject_and_stay_pinned_under_kill_9() {
    let (broker, registry, tmp) = setup(2);
    let mut lines: Vec<serde_json::Value> = (0..150).map(|i| order(i, V1, 1)).collect();
    lines.extend((150..300).map(|i| order(i, V2, 2)));
    let mut placed = produce(&broker, &registry, &lines);
    let dir = tmp.path();
    std::fs::write(
        dir.join("job.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE orders STORED AS KAFKA LOCATION \
             'kafka://{}/orders'\nOPTIONS ({}, 'max_offsets_per_trigger' '20');\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
             INSERT INTO out SELECT * FROM orders;\n",
            broker.bootstrap(),
            registry.job_options()
        ),
    )
    .unwrap();
    let (kills, _) = kill_until_done_logged(
        dir,
        &run_job_args("ckpt"),
        &[("LS_TEST_SR_PASSWORD", REGISTRY_PASSWORD.to_string())],
        &Kills {
            max: 4,
            min: 1,
            seed: clock_seed(),
            limit: Duration::from_secs(180),
            latest: Duration::from_millis(400),
        },
    );
    let pinned: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("ckpt/sources/orders/avro_reader_schema")).unwrap(),
    )
    .unwrap();
    assert!(pinned.to_string().contains("coupon"), "{pinned}");

    // A third version appears; the query keeps the columns it started with.
    placed.extend(produce(
        &broker,
        &registry,
        &(300..320).map(|i| order(i, V3, 3)).collect::<Vec<_>>(),
    ));
    let o = run(dir);
    assert!(o.status.success(), "{}", text(&o));
    let rows = read_py(&dir.join("out"));
    assert_eq!(rows.len(), 320, "after {kills} kills");
    crate::broker::assert_records_once(&rows, &placed);
    let cols: std::collections::BTreeSet<&str> = rows[0]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    for c in [
        "order_id",
        "customer_id",
        "amount",
        "ts",
        "currency",
        "coupon",
        "_key",
        "_offset",
    ] {
        assert!(cols.contains(c), "{c} missing from {cols:?}");
    }
    assert!(!cols.contains("channel"), "{cols:?}");
    assert_eq!(
        rows.iter().filter(|r| r["currency"] == "EUR").count(),
        150,
        "version-1 records take the default"
    );
}

#[test]
fn registry_and_schema_problems_are_named() {
    let (broker, registry, tmp) = setup(1);
    let lines: Vec<serde_json::Value> = (0..3)
        .map(|i| {
            let mut l = order(i, V1, 1);
            l["partition"] = 0.into();
            l
        })
        .chain([serde_json::json!({"key": "x", "partition": 0, "value_hex": "00000003e70a"})])
        .collect();
    produce(&broker, &registry, &lines);
    let dir = tmp.path();
    let job = |cols: &str, extra: &str| {
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE orders ({cols}) STORED AS KAFKA LOCATION \
             'kafka://{}/orders'\nOPTIONS ({}{extra});\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
             INSERT INTO out SELECT order_id FROM orders;\n",
            broker.bootstrap(),
            registry.job_options()
        )
    };
    // A record with an unknown schema id fails the batch, naming it.
    std::fs::write(dir.join("job.sql"), job("order_id VARCHAR", "")).unwrap();
    let o = run(dir);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let e = stderr(&o);
    assert!(
        e.contains("topic orders partition 0 offset 3") && e.contains("schema id 999"),
        "{e}"
    );
    assert!(
        !dir.join("out").exists() || read_py(&dir.join("out")).is_empty(),
        "the failed batch wrote rows"
    );

    // A wrong password: the registry's 401, and what to check.
    let o = run_with(dir, "ckpt2", "wrong-one");
    assert_ne!(o.status.code(), Some(0), "{}", text(&o));
    let e = stderr(&o);
    assert!(
        e.contains("401") && e.contains("schema_registry_password"),
        "{e}"
    );
    assert!(!e.contains("wrong-one"), "{e}");

    // A declared column the subject's schema lacks: refused before any batch.
    std::fs::write(
        dir.join("job.sql"),
        job("order_id VARCHAR, colour VARCHAR", ""),
    )
    .unwrap();
    let o = run_with(dir, "ckpt3", REGISTRY_PASSWORD);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let e = stderr(&o);
    assert!(
        e.contains("column colour") && e.contains("orders-value"),
        "{e}"
    );
}

/// Nested and logical Avro types, written with `qty` an `int`, read with
/// the latest schema where it is a `long` (a promotion).
const TYPES_V1: &str = r#"{"type":"record","name":"Shipment","fields":[
 {"name":"id","type":"string"},
 {"name":"qty","type":"int"},
 {"name":"address","type":{"type":"record","name":"Address","fields":[
   {"name":"city","type":"string"},{"name":"zip","type":["null","string"],"default":null}]}},
 {"name":"tags","type":{"type":"array","items":"string"}},
 {"name":"attrs","type":{"type":"map","values":"long"}},
 {"name":"status","type":{"type":"enum","name":"Status","symbols":["NEW","SENT","LOST"]}},
 {"name":"price","type":{"type":"bytes","logicalType":"decimal","precision":10,"scale":2}},
 {"name":"day","type":{"type":"int","logicalType":"date"}},
 {"name":"at","type":{"type":"long","logicalType":"timestamp-micros"}},
 {"name":"ref","type":{"type":"string","logicalType":"uuid"}}]}"#;

#[test]
fn nested_and_logical_types_become_arrow_types_and_int_promotes_to_long() {
    let (broker, registry, tmp) = setup(1);
    let v2 = TYPES_V1.replace(
        r#""name":"qty","type":"int""#,
        r#""name":"qty","type":"long""#,
    );
    let record = |i: i64, schema: &str| {
        serde_json::json!({
            "key": null,
            "partition": 0,
            "avro_schema": schema,
            "avro_value": {
                "id": format!("s-{i}"),
                "qty": i,
                "address": {"city": "Lyon", "zip": if i == 0 { serde_json::Value::Null } else { "69001".into() }},
                "tags": ["a", format!("t{i}")],
                "attrs": {"w": i * 10},
                "status": "SENT",
                "price": {"$decimal": format!("{i}.25")},
                "day": 19_700 + i,
                "at": 1_700_000_000_123_456i64 + i,
                "ref": format!("00000000-0000-4000-8000-00000000000{i}"),
            },
        })
    };
    produce(&broker, &registry, &[record(0, TYPES_V1), record(1, &v2)]);
    let dir = tmp.path();
    std::fs::write(
        dir.join("job.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE shipments STORED AS KAFKA LOCATION \
             'kafka://{}/orders'\nOPTIONS ({});\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
             INSERT INTO out SELECT id, qty, address, address.city AS city, tags, attrs, \
             status, price, day, at, ref FROM shipments;\n",
            broker.bootstrap(),
            registry.job_options()
        ),
    )
    .unwrap();
    let o = run(dir);
    assert!(o.status.success(), "{}", text(&o));
    let mut rows = read_py(&dir.join("out"));
    rows.sort_by_key(|r| r["id"].as_str().unwrap().to_string());
    assert_eq!(rows.len(), 2, "{rows:?}");
    let r = &rows[1];
    assert_eq!(r["qty"], 1, "{r}");
    assert_eq!(r["address"]["city"], "Lyon", "{r}");
    assert_eq!(r["address"]["zip"], "69001", "{r}");
    assert!(rows[0]["address"]["zip"].is_null(), "{rows:?}");
    assert_eq!(r["city"], "Lyon", "{r}");
    assert_eq!(r["tags"], serde_json::json!(["a", "t1"]), "{r}");
    assert_eq!(r["status"], "SENT", "{r}");
    assert_eq!(r["price"].to_string().trim_matches('"'), "1.25", "{r}");
    assert_eq!(r["day"], "2023-12-10", "{r}");
    assert_eq!(r["ref"], "00000000-0000-4000-8000-000000000001", "{r}");
    assert!(r["at"].as_str().unwrap().starts_with("2023-11-14"), "{r}");
    assert!(r["attrs"].to_string().contains("10"), "{r}");
    let types = meta_py(&dir.join("out"))["types"].clone();
    assert_eq!(
        types,
        serde_json::json!([
            "string",
            "int64",
            "struct<city: string, zip: string>",
            "string",
            "list<element: string>",
            "map<string, int64>",
            "string",
            "decimal128(10, 2)",
            "date32[day]",
            "timestamp[us, tz=UTC]",
            "string"
        ])
    );
}

#[test]
fn a_registry_behind_tls_is_trusted_through_its_ca_and_refused_without_it() {
    let broker = Broker::start();
    broker.create_topic("orders", 1);
    let registry = Registry::start_tls();
    let lines: Vec<serde_json::Value> = (0..5)
        .map(|i| {
            let mut l = order(i, V2, 2);
            l["partition"] = 0.into();
            l
        })
        .collect();
    let placed = produce(&broker, &registry, &lines);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let job = |ca: &str| {
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE orders (order_id VARCHAR, currency VARCHAR) \
             STORED AS KAFKA LOCATION 'kafka://{}/orders'\nOPTIONS ({}{ca});\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
             INSERT INTO out SELECT order_id, currency, _partition, _offset FROM orders;\n",
            broker.bootstrap(),
            registry.job_options()
        )
    };
    // Without the CA: the registry's certificate is not trusted.
    std::fs::write(dir.join("job.sql"), job("")).unwrap();
    let o = run(dir);
    assert_ne!(o.status.code(), Some(0), "{}", text(&o));
    let e = stderr(&o);
    assert!(
        e.contains(&registry.url()) && e.to_lowercase().contains("certificate"),
        "{e}"
    );

    let ca = format!(
        ", 'schema_registry_ca_location' '{}'",
        registry.ca().unwrap().display()
    );
    std::fs::write(dir.join("job.sql"), job(&ca)).unwrap();
    let o = run(dir);
    assert!(o.status.success(), "{}", text(&o));
    let rows = read_py(&dir.join("out"));
    crate::broker::assert_records_once(&rows, &placed);
    assert!(rows.iter().all(|r| r["currency"] == "USD"), "{rows:?}");
}

#[test]
fn avro_keys_become_typed_columns_null_keys_null_and_a_bad_key_is_dead_lettered() {
    let (broker, registry, tmp) = setup(1);
    broker.create_topic("keyed", 1);
    let record_key = r#"{"type":"record","name":"OrderKey","fields":[
        {"name":"region","type":"string"},{"name":"id","type":"long"}]}"#;
    let with_key = |i: usize, key: Option<serde_json::Value>| {
        let mut l = order(i, V1, 1);
        l["partition"] = 0.into();
        l.as_object_mut().unwrap().remove("key");
        match key {
            Some(k) => {
                l["avro_key_schema"] = k["schema"].clone();
                l["avro_key"] = k["value"].clone();
            }
            None => l["key"] = serde_json::Value::Null,
        }
        l
    };
    // Topic orders: string keys (a primitive key schema), one record
    // without a key, one whose key is not in the wire format.
    let mut lines: Vec<serde_json::Value> = (0..6)
        .map(|i| {
            with_key(
                i,
                Some(serde_json::json!({"schema": "\"string\"", "value": format!("user-{i}")})),
            )
        })
        .collect();
    lines.push(with_key(6, None));
    let mut bad = with_key(7, None);
    bad["key"] = "plain-text-key".into();
    lines.push(bad);
    produce(&broker, &registry, &lines);
    // Topic keyed: record keys.
    let lines: Vec<serde_json::Value> = (0..4)
        .map(|i| {
            with_key(
                i,
                Some(serde_json::json!({
                    "schema": record_key,
                    "value": {"region": if i % 2 == 0 { "eu" } else { "us" }, "id": i},
                })),
            )
        })
        .collect();
    let settings = registry.producer_settings();
    let settings: Vec<(&str, &str)> = settings.iter().map(|(k, v)| (*k, v.as_str())).collect();
    produce_py_lines(&broker, "keyed", &settings, &lines);

    let dir = tmp.path();
    std::fs::write(
        dir.join("job.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE orders (order_id VARCHAR) STORED AS KAFKA LOCATION \
             'kafka://{b}/orders'\nOPTIONS ({o}, 'key_format' 'avro', 'on_error' 'dead_letter', \
             'dead_letter_location' 'bad');\n\
             CREATE UNBOUNDED EXTERNAL TABLE keyed (order_id VARCHAR) STORED AS KAFKA LOCATION \
             'kafka://{b}/keyed'\nOPTIONS ({o}, 'key_format' 'avro');\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
             CREATE EXTERNAL TABLE out2 STORED AS DELTA LOCATION 'out2';\n\
             INSERT INTO out SELECT order_id, _key AS user FROM orders;\n\
             INSERT INTO out2 SELECT order_id, _key.region AS region, _key.id AS key_id FROM keyed;\n",
            b = broker.bootstrap(),
            o = registry.job_options()
        ),
    )
    .unwrap();
    let o = run(dir);
    assert!(o.status.success(), "{}", text(&o));
    let mut rows = read_py(&dir.join("out"));
    rows.sort_by_key(|r| r["order_id"].as_str().unwrap().to_string());
    let got: Vec<(String, serde_json::Value)> = rows
        .iter()
        .map(|r| {
            (
                r["order_id"].as_str().unwrap().to_string(),
                r["user"].clone(),
            )
        })
        .collect();
    let mut want: Vec<(String, serde_json::Value)> = (0..6)
        .map(|i| (format!("o-{i}"), format!("user-{i}").into()))
        .collect();
    want.push(("o-6".into(), serde_json::Value::Null));
    assert_eq!(got, want);
    assert_one_dead_letter(dir, "the key is not in the Confluent wire format");
    let mut rows = read_py(&dir.join("out2"));
    rows.sort_by_key(|r| r["order_id"].as_str().unwrap().to_string());
    let regions: Vec<(&str, i64)> = rows
        .iter()
        .map(|r| (r["region"].as_str().unwrap(), r["key_id"].as_i64().unwrap()))
        .collect();
    assert_eq!(regions, [("eu", 0), ("us", 1), ("eu", 2), ("us", 3)]);
}

/// A `.proto` file for `tests/py/produce.py`'s `proto_class`: `Order` in
/// `package`, with `currency` (field 8) when `with_currency`.
fn orders_proto(package: &str, with_currency: bool) -> serde_json::Value {
    let mut fields = serde_json::json!([
        {"name": "order_id", "number": 1, "type": "string"},
        {"name": "amount", "number": 2, "type": "double"},
        {"name": "ts", "number": 3, "type": ".google.protobuf.Timestamp"},
        {"name": "status", "number": 4, "type": format!(".{package}.Status")},
        {"name": "tags", "number": 5, "type": "string", "repeated": true},
        {"name": "qty", "number": 7, "type": "int64"},
        {"name": "place", "number": 6, "type": ".common.Place"}
    ]);
    if with_currency {
        fields
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({"name": "currency", "number": 8, "type": "string"}));
    }
    serde_json::json!({
        "name": format!("{package}/orders.proto"),
        "package": package,
        "dependency": ["google/protobuf/timestamp.proto", "common/place.proto"],
        "imports": [{
            "name": "common/place.proto",
            "package": "common",
            "messages": [{"name": "Place", "fields": [{"name": "city", "number": 1, "type": "string"}]}],
        }],
        "enums": [{"name": "Status", "values": ["NEW", "SENT"]}],
        "messages": [{"name": "Order", "fields": fields}],
    })
}

#[test]
fn protobuf_values_of_two_schema_versions_are_read_by_field_name_and_unknown_ids_dead_lettered() {
    let (broker, registry, tmp) = setup(1);
    let proto = |i: usize, package: &str, v2: bool| {
        proto_order(i, package, v2, i as f64 + 0.5, format!("k{i}").into())
    };
    let mut lines: Vec<serde_json::Value> = (0..10).map(|i| proto(i, "shop", false)).collect();
    lines.extend((10..20).map(|i| proto(i, "shop.v2", true)));
    lines
        .push(serde_json::json!({"key": "bad", "partition": 0, "value_hex": "00000003e7000a016f"}));
    produce(&broker, &registry, &lines);
    let dir = tmp.path();
    std::fs::write(
        dir.join("job.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE orders (order_id VARCHAR NOT NULL, amount DOUBLE, \
             ts TIMESTAMP, status VARCHAR, qty BIGINT, currency VARCHAR, tags VARCHAR[], \
             place STRUCT<city VARCHAR>) STORED AS KAFKA \
             LOCATION 'kafka://{}/orders'\nOPTIONS ({}, 'on_error' 'dead_letter', \
             'dead_letter_location' 'bad');\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
             INSERT INTO out SELECT * EXCEPT (_key, _topic, _timestamp, _headers) FROM orders;\n",
            broker.bootstrap(),
            registry.protobuf_options()
        ),
    )
    .unwrap();
    let rows = run_sorted(dir);
    assert_eq!(rows.len(), 20, "{rows:?}");
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["amount"].as_f64().unwrap(), i as f64 + 0.5, "{r}");
        assert_eq!(r["place"]["city"], format!("city-{i}"), "{r}");
        // Written before the field existed: no value.
        assert_proto_row(i, r, i >= 10);
    }
    assert_one_dead_letter(dir, "schema id 999 is not known");
}

/// The dead-letter table `bad` in `dir` holds one record, whose error says
/// `needle`.
fn assert_one_dead_letter(dir: &std::path::Path, needle: &str) {
    let bad = read_py(&dir.join("bad"));
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(
        bad[0]["error"].as_str().unwrap().contains(needle),
        "{bad:?}"
    );
}

#[test]
fn protobuf_columns_left_out_come_from_the_subjects_latest_message_and_stay_pinned() {
    let (broker, registry, tmp) = setup(1);
    let proto = |i: usize, package: &str, v2: bool| {
        proto_order(i, package, v2, i as f64, serde_json::Value::Null)
    };
    let lines: Vec<serde_json::Value> = (0..3)
        .map(|i| proto(i, "shop", false))
        .chain((3..6).map(|i| proto(i, "shop.v2", true)))
        .collect();
    produce(&broker, &registry, &lines);
    let dir = tmp.path();
    std::fs::write(
        dir.join("job.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE orders STORED AS KAFKA LOCATION \
             'kafka://{}/orders'\nOPTIONS ({});\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
             INSERT INTO out SELECT order_id, amount, ts, status, tags, qty, place.city AS city, \
             currency, _offset FROM orders;\n",
            broker.bootstrap(),
            registry.protobuf_options()
        ),
    )
    .unwrap();
    let rows = run_sorted(dir);
    assert!(dir.join("ckpt/sources/orders/schema").exists());
    assert_eq!(rows.len(), 6, "{rows:?}");
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["city"], format!("city-{i}"), "{r}");
        assert_proto_row(i, r, i >= 3);
    }
}

/// Order `i` for `tests/py/produce.py`: a `package.Order` Protobuf value
/// (with `currency` when `v2`), `amount`, keyed `key`, on partition 0.
fn proto_order(
    i: usize,
    package: &str,
    v2: bool,
    amount: f64,
    key: serde_json::Value,
) -> serde_json::Value {
    let mut value = serde_json::json!({
        "order_id": format!("o-{i}"),
        "amount": amount,
        "ts": "2026-01-01T00:00:01Z",
        "status": if i.is_multiple_of(2) { "NEW" } else { "SENT" },
        "tags": ["a", "b"],
        "qty": (i as i64) * 10_000_000_000,
        "place": {"city": format!("city-{i}")},
    });
    if v2 {
        value["currency"] = "USD".into();
    }
    serde_json::json!({
        "key": key,
        "partition": 0,
        "proto_file": orders_proto(package, v2),
        "proto_message": format!("{package}.Order"),
        "proto_value": value,
    })
}

/// Row `r` holds what [`proto_order`] `i` wrote (`currency` only if the
/// writer's version had the field).
fn assert_proto_row(i: usize, r: &serde_json::Value, has_currency: bool) {
    assert_eq!(r["order_id"], format!("o-{i}"), "{r}");
    assert_eq!(r["qty"].as_i64().unwrap(), i as i64 * 10_000_000_000, "{r}");
    let status = if i.is_multiple_of(2) { "NEW" } else { "SENT" };
    assert_eq!(r["status"], status, "{r}");
    assert_eq!(r["tags"], serde_json::json!(["a", "b"]), "{r}");
    assert!(
        r["ts"].as_str().unwrap().starts_with("2026-01-01 00:00:01"),
        "{r}"
    );
    let currency = if has_currency {
        "USD".into()
    } else {
        serde_json::Value::Null
    };
    assert_eq!(r["currency"], currency, "{r}");
}

/// Run the job in `dir` to the end; the rows of `out` by offset.
fn run_sorted(dir: &std::path::Path) -> Vec<serde_json::Value> {
    let o = run(dir);
    assert!(o.status.success(), "{}", text(&o));
    let mut rows = read_py(&dir.join("out"));
    rows.sort_by_key(|r| r["_offset"].as_i64().unwrap());
    rows
}
