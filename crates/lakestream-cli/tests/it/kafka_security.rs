//! The Kafka source against production-style clusters: topics compressed
//! with every codec by an independent producer (the `confluent-kafka`
//! Python client), a broker reached through TLS only (stunnel in front of
//! tansu, with a CA made by the test), and SASL handshakes.

use std::time::{Duration, Instant};

use crate::broker::{
    Broker, CLIENT_KEY_PASSWORD, TlsOptions, assert_records_once, kafka_job, make_ca, orders,
    produce_py, produce_py_lines,
};
use crate::common::*;
use crate::kafka::{expected_ids, order_ids};

/// `n` order records of about 3 KiB each (a compressible note: a producer
/// sends a batch uncompressed when compression would not shrink it), keyed
/// and spread over `partitions`.
fn big_orders(n: usize, partitions: i32) -> Vec<(Option<String>, String, i32)> {
    orders(0, n)
        .into_iter()
        .enumerate()
        .map(|(i, (key, value))| {
            let note = format!("order {i} ").repeat(300);
            let value = value.replacen('{', &format!("{{\"note\":\"{note}\","), 1);
            (Some(key), value, i as i32 % partitions)
        })
        .collect()
}

/// A directory with `job.sql`: `topic` on `broker` into `out`, with the
/// source's further `options`.
fn job_dir(broker: &Broker, topic: &str, options: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("job.sql"),
        kafka_job(&broker.bootstrap(), topic, "out", options),
    )
    .unwrap();
    tmp
}

/// The error line of a failed run's stderr (not librdkafka's log lines).
fn error_line(o: &std::process::Output) -> String {
    stderr(o)
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no error line: {}", text(o)))
        .to_string()
}

#[test]
fn topics_compressed_with_every_codec_are_read_exactly_once() {
    let broker = Broker::start();
    let records = big_orders(24, 2);
    for codec in ["gzip", "snappy", "lz4", "zstd"] {
        let topic = format!("orders-{codec}");
        broker.create_topic(&topic, 2);
        let placed = produce_py(&broker, &topic, &[("compression.type", codec)], &records);
        let tmp = job_dir(&broker, &topic, "'max_offsets_per_trigger' '5'");
        let dir = tmp.path();
        let o = run_in(dir, &run_job_args("ckpt"));
        assert!(o.status.success(), "{codec}: {}", text(&o));
        let rows = read_py(&dir.join("out"));
        assert_eq!(rows.len(), records.len(), "{codec}");
        assert_records_once(&rows, &placed);
    }
}

#[test]
fn a_tls_only_broker_is_read_exactly_once_under_kill_9() {
    let broker = Broker::start_tls();
    broker.create_topic("orders", 3);
    let plain = orders(0, 600);
    let records: Vec<(Option<String>, String, i32)> = plain
        .iter()
        .enumerate()
        .map(|(i, (k, v))| (Some(k.clone()), v.clone(), i as i32 % 3))
        .collect();
    let placed = produce_py(&broker, "orders", &[("compression.type", "zstd")], &records);
    let tmp = job_dir(
        &broker,
        "orders",
        &format!(
            "'max_offsets_per_trigger' '30', 'kafka.ssl.key.password' 'hunter3-never', {}",
            broker.job_options()
        ),
    );
    let dir = tmp.path();
    let (kills, outputs) = kill_until_done_logged(
        dir,
        &run_job_args("ckpt"),
        &[],
        &Kills {
            max: 5,
            min: 2,
            seed: clock_seed(),
            limit: Duration::from_secs(240),
            latest: Duration::from_millis(500),
        },
    );
    let rows = read_py(&dir.join("out"));
    assert_eq!(
        order_ids(&rows),
        expected_ids(&plain),
        "after {kills} kills"
    );
    assert_records_once(&rows, &placed);
    assert!(!outputs.contains("hunter3"), "a secret was printed");
}

#[test]
fn a_broker_whose_certificate_another_ca_signed_fails_the_query_naming_it() {
    let broker = Broker::start_tls();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    make_ca(dir, "other");
    std::fs::write(
        dir.join("job.sql"),
        kafka_job(
            &broker.bootstrap(),
            "orders",
            "out",
            &format!(
                "'request_timeout' '2s', 'kafka.security.protocol' 'SSL', \
                 'kafka.ssl.ca.location' '{}'",
                dir.join("other.pem").display()
            ),
        ),
    )
    .unwrap();
    let started = Instant::now();
    let o = run_in(dir, &run_job_args("ckpt"));
    let took = started.elapsed();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = error_line(&o);
    for part in [
        broker.bootstrap().as_str(),
        "the brokers refused the connection",
        "SSL handshake failed",
        "certificate verify failed",
        "kafka.ssl.*",
    ] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
    // Refused, not unavailable: the query does not wait out the
    // source's 'unavailable_timeout' (5 minutes by default).
    assert!(!err.contains("still unavailable"), "{err}");
    assert!(took < Duration::from_secs(60), "gave up after {took:?}");
}

#[test]
fn sasl_scram_and_plain_handshakes_reach_the_broker_and_a_refusal_is_named() {
    // tansu checks SCRAM credentials but keeps no users a test can create
    // when authentication is on, and offers no PLAIN: each SCRAM exchange
    // runs to the broker's answer (proving the mechanism is built in), the
    // PLAIN handshake to the broker's refusal of the mechanism, and the
    // query fails at once naming each.
    let broker = Broker::start_authenticated();
    for (mechanism, refusal) in [
        ("SCRAM-SHA-256", "SASL SCRAM authentication failed"),
        ("SCRAM-SHA-512", "SASL SCRAM authentication failed"),
        ("PLAIN", "SASL PLAIN mechanism handshake failed"),
    ] {
        let tmp = job_dir(
            &broker,
            "orders",
            &format!(
                "'request_timeout' '2s', 'kafka.security.protocol' 'SASL_PLAINTEXT', \
                     'kafka.sasl.mechanism' '{mechanism}', 'kafka.sasl.username' 'alice', \
                     'kafka.sasl.password' 'hunter4-never'"
            ),
        );
        let dir = tmp.path();
        let o = run_in(dir, &run_job_args("ckpt"));
        assert_eq!(o.status.code(), Some(1), "{mechanism}: {}", text(&o));
        let err = error_line(&o);
        for part in [
            broker.bootstrap().as_str(),
            "the brokers refused the connection",
            refusal,
            "kafka.sasl.*",
        ] {
            assert!(
                err.contains(part),
                "{mechanism}: {part:?} missing from: {err}"
            );
        }
        assert!(
            !text(&o).contains("No provider for SASL"),
            "{mechanism}: {}",
            text(&o)
        );
        assert!(!text(&o).contains("hunter4"), "a secret was printed");
    }
}

/// `n` small order records over `partitions` partitions.
fn small_orders(n: usize, partitions: i32) -> Vec<(Option<String>, String, i32)> {
    orders(0, n)
        .into_iter()
        .enumerate()
        .map(|(i, (k, v))| (Some(k), v, i as i32 % partitions))
        .collect()
}

#[test]
fn mutual_tls_with_an_encrypted_client_key_reads_the_topic_and_no_certificate_is_refused() {
    let broker = Broker::start_tls_with(TlsOptions {
        client_certificate: true,
        ..TlsOptions::default()
    });
    broker.create_topic("orders", 2);
    let records = small_orders(40, 2);
    let placed = produce_py(&broker, "orders", &[], &records);
    let tmp = job_dir(&broker, "orders", &broker.job_options());
    let dir = tmp.path();
    let o = run_in(dir, &run_job_args("ckpt"));
    assert!(o.status.success(), "{}", text(&o));
    assert_records_once(&read_py(&dir.join("out")), &placed);
    assert!(
        !text(&o).contains(CLIENT_KEY_PASSWORD),
        "a secret was printed"
    );

    // Without a client certificate the endpoint ends the handshake.
    let ca = broker
        .job_options()
        .split(", ")
        .filter(|o| o.contains("security.protocol") || o.contains("ssl.ca.location"))
        .collect::<Vec<_>>()
        .join(", ");
    let tmp = job_dir(&broker, "orders", &format!("'request_timeout' '2s', {ca}"));
    let o = run_in(tmp.path(), &run_job_args("ckpt"));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = error_line(&o);
    assert!(err.contains(&broker.bootstrap()), "{err}");
    assert!(
        err.contains("the brokers refused the connection") && err.contains("certificate required"),
        "{err}"
    );
}

#[test]
fn a_certificate_for_another_name_is_refused_unless_endpoint_identification_is_off() {
    let broker = Broker::start_tls_with(TlsOptions {
        server_name: "DNS:kafka.example".into(),
        ..TlsOptions::default()
    });
    broker.create_topic("orders", 1);
    let records = small_orders(10, 1);
    let placed = produce_py(&broker, "orders", &[], &records);
    // The CA signed it, but it names another host than 127.0.0.1.
    let checked = broker
        .job_options()
        .replace("'kafka.ssl.endpoint.identification.algorithm' 'none'", "")
        .trim_end_matches([',', ' '])
        .to_string();
    let tmp = job_dir(
        &broker,
        "orders",
        &format!("'request_timeout' '2s', {checked}"),
    );
    let o = run_in(tmp.path(), &run_job_args("ckpt"));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = error_line(&o);
    assert!(
        err.contains("the brokers refused the connection")
            && err.contains("certificate verify failed"),
        "{err}"
    );
    let tmp = job_dir(&broker, "orders", &broker.job_options());
    let o = run_in(tmp.path(), &run_job_args("ckpt"));
    assert!(o.status.success(), "{}", text(&o));
    assert_records_once(&read_py(&tmp.path().join("out")), &placed);
}

/// An OAuth 2.0 token endpoint on loopback (`tests/py/token_server.py`)
/// that logs each request it answers; killed on drop.
struct TokenServer {
    child: std::process::Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl TokenServer {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let requests = dir.path().join("requests.jsonl");
        let (child, port) = spawn_py_server("token_server.py", &[requests.as_os_str()]);
        Self { child, port, dir }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/oauth2/token", self.port)
    }

    /// The requests answered so far.
    fn requests(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.dir.path().join("requests.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn oauthbearer_oidc_fetches_a_token_with_the_client_credentials_and_never_prints_the_secret() {
    // The broker takes the OAUTHBEARER handshake and refuses the token (it
    // has no key to check it with): the flow runs from the token endpoint
    // to the broker's answer.
    let broker = Broker::start_authenticated();
    let tokens = TokenServer::start();
    let tmp = job_dir(
        &broker,
        "orders",
        &format!(
            "'request_timeout' '2s', 'kafka.security.protocol' 'SASL_PLAINTEXT', \
             'kafka.sasl.mechanism' 'OAUTHBEARER', 'kafka.sasl.oauthbearer.method' 'oidc', \
             'kafka.sasl.oauthbearer.client.id' 'lakestream-app', \
             'kafka.sasl.oauthbearer.client.secret' 'hunter5-never', \
             'kafka.sasl.oauthbearer.token.endpoint.url' '{}'",
            tokens.url()
        ),
    );
    let o = run_in(tmp.path(), &run_job_args("ckpt"));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = error_line(&o);
    assert!(
        err.contains("the brokers refused the connection")
            && err.contains("SASL authentication error"),
        "{err}"
    );
    let requests = tokens.requests();
    assert!(!requests.is_empty(), "no token was asked for: {}", text(&o));
    for r in &requests {
        assert_eq!(r["path"], "/oauth2/token", "{r}");
        assert_eq!(r["body"], "grant_type=client_credentials", "{r}");
        // HTTP basic authentication with lakestream-app:hunter5-never.
        assert_eq!(
            r["authorization"], "Basic bGFrZXN0cmVhbS1hcHA6aHVudGVyNS1uZXZlcg==",
            "{r}"
        );
    }
    assert!(!text(&o).contains("hunter5"), "a secret was printed");
}

#[test]
fn a_setting_librdkafka_refuses_is_named_without_its_value() {
    // A misspelt password setting: librdkafka's own message repeats the
    // value it was given.
    let broker = Broker::start();
    let tmp = job_dir(
        &broker,
        "orders",
        "'kafka.security.protocol' 'SASL_PLAINTEXT', 'kafka.sasl.mechanism' 'PLAIN', \
         'kafka.sasl.passwd' 'hunter6-never'",
    );
    let o = run_in(tmp.path(), &run_job_args("ckpt"));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = error_line(&o);
    assert!(
        err.contains("librdkafka refused the setting kafka.sasl.passwd"),
        "{err}"
    );
    assert!(
        !text(&o).contains("hunter6"),
        "a value was printed: {}",
        text(&o)
    );
}

#[test]
fn the_long_version_names_the_kafka_features_the_binary_was_built_with() {
    let o = bin().arg("--version").output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    let line = out
        .lines()
        .find(|l| l.starts_with("librdkafka "))
        .unwrap_or_else(|| panic!("no librdkafka line: {out}"));
    for feature in [
        "ssl",
        "sasl_plain",
        "sasl_scram",
        "sasl_oauthbearer",
        "oidc",
        "gzip",
        "snappy",
        "lz4",
        "zstd",
    ] {
        assert!(
            line.split(['(', ',', ')']).any(|f| f.trim() == feature),
            "{feature} missing from: {line}"
        );
    }
}

#[test]
fn string_keys_are_text_and_a_key_that_is_not_utf8_is_a_bad_record() {
    let broker = Broker::start();
    broker.create_topic("orders", 1);
    let values = orders(0, 3);
    let mut placed = produce_py(
        &broker,
        "orders",
        &[],
        &[
            (Some("user-1".into()), values[0].1.clone(), 0),
            (None, values[1].1.clone(), 0),
        ],
    );
    // A key of bytes that are not UTF-8, through the producer's hex form.
    let bad = produce_py_lines(
        &broker,
        "orders",
        &[],
        &[serde_json::json!({"key_hex": "fffe00", "value": values[2].1, "partition": 0})],
    )[0]
    .1;
    // Without dead letters the batch fails naming the record.
    let tmp = job_dir(&broker, "orders", "'key_format' 'string'");
    let o = run_in(tmp.path(), &run_job_args("ckpt"));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = error_line(&o);
    assert!(
        err.contains("key is not UTF-8") && err.contains(&format!("offset {bad}")),
        "{err}"
    );
    // With them, the other two rows go on, their keys as text.
    let tmp = keyed_job(
        &broker,
        "'key_format' 'string'",
        "order_id, _key, upper(_key) AS shout",
    );
    let dir = tmp.path();
    let o = run_in(dir, &run_job_args("ckpt"));
    assert!(o.status.success(), "{}", text(&o));
    // A text column: string functions apply to it.
    let mut keys: Vec<(serde_json::Value, serde_json::Value)> = read_py(&dir.join("out"))
        .iter()
        .map(|r| (r["_key"].clone(), r["shout"].clone()))
        .collect();
    keys.sort_by_key(|k| k.0.to_string());
    assert_eq!(
        keys,
        vec![
            (serde_json::json!("user-1"), serde_json::json!("USER-1")),
            (serde_json::Value::Null, serde_json::Value::Null),
        ]
    );
    let dead = read_py(&dir.join("bad"));
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["offset"].as_i64(), Some(bad), "{dead:?}");
    assert!(
        dead[0]["error"]
            .as_str()
            .unwrap()
            .contains("key is not UTF-8")
    );
    placed.push((0, bad));
    assert_eq!(placed, vec![(0, 0), (0, 1), (0, 2)]);
}

#[test]
fn settings_come_from_a_properties_file_and_the_environment_never_the_job_file() {
    let broker = Broker::start_tls_with(TlsOptions {
        client_certificate: true,
        ..TlsOptions::default()
    });
    broker.create_topic("orders", 2);
    let placed = produce_py(&broker, "orders", &[], &small_orders(30, 2));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // The file a Kafka client would read, brokers included; the key's
    // password comes from the environment.
    let mut props = format!(
        "# client settings\nbootstrap.servers = {}\n",
        broker.bootstrap()
    );
    for (k, v) in broker.client_settings() {
        let v = if k == "ssl.key.password" {
            "${env:LS_TEST_KEY_PASSWORD}".to_string()
        } else {
            v
        };
        props.push_str(&format!("{k}={v}\n"));
    }
    std::fs::write(dir.join("client.properties"), props).unwrap();
    let job = kafka_job("", "orders", "out", "'properties_file' 'client.properties'");
    assert!(job.contains("'kafka:///orders'"), "{job}");
    std::fs::write(dir.join("job.sql"), &job).unwrap();

    // Unset, the variable is named and nothing runs.
    let o = bin()
        .current_dir(dir)
        .args(run_job_args("ckpt"))
        .env_remove("LS_TEST_KEY_PASSWORD")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let err = error_line(&o);
    assert!(
        err.contains("LS_TEST_KEY_PASSWORD") && err.contains("not set"),
        "{err}"
    );
    assert!(!dir.join("out").exists());

    let o = bin()
        .current_dir(dir)
        .args(run_job_args("ckpt"))
        .env("LS_TEST_KEY_PASSWORD", CLIENT_KEY_PASSWORD)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_records_once(&read_py(&dir.join("out")), &placed);
    assert!(
        !text(&o).contains(CLIENT_KEY_PASSWORD),
        "a secret was printed"
    );

    // A `kafka.*` option wins over the file: a wrong password in the job
    // (from another variable) is what the client uses, and it fails.
    std::fs::write(
        dir.join("job.sql"),
        kafka_job(
            "",
            "orders",
            "out2",
            "'properties_file' 'client.properties', 'kafka.ssl.key.password' '${env:LS_TEST_WRONG}'",
        ),
    )
    .unwrap();
    let o = bin()
        .current_dir(dir)
        .args(run_job_args("ckpt"))
        .env("LS_TEST_KEY_PASSWORD", CLIENT_KEY_PASSWORD)
        .env("LS_TEST_WRONG", "not-the-password")
        .output()
        .unwrap();
    assert_ne!(o.status.code(), Some(0), "{}", text(&o));
    assert!(!text(&o).contains("not-the-password"), "{}", text(&o));
    assert!(!dir.join("out2").exists());

    // A file that sets what the reader owns is refused, naming the key.
    std::fs::write(dir.join("bad.properties"), "group.id=shared-app\n").unwrap();
    std::fs::write(
        dir.join("job.sql"),
        kafka_job(
            &broker.bootstrap(),
            "orders",
            "out3",
            "'properties_file' 'bad.properties'",
        ),
    )
    .unwrap();
    let o = run_in(dir, &run_job_args("ckpt"));
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(error_line(&o).contains("group.id"), "{}", text(&o));
}

#[test]
fn json_keys_become_a_struct_of_the_key_columns_and_a_key_that_does_not_fit_is_a_bad_record() {
    let broker = Broker::start();
    broker.create_topic("orders", 1);
    let values = orders(0, 6);
    let keys = [
        Some(r#"{"region": "eu", "id": 1}"#),
        Some(r#"{"region": "us", "id": 2, "extra": true}"#),
        None,
        Some(r#"{"region": "eu", "id": "three"}"#),
        Some("not json"),
        Some(r#"{"region": "ap", "id": 6}"#),
    ];
    let records: Vec<(Option<String>, String, i32)> = keys
        .iter()
        .zip(&values)
        .map(|(k, (_, v))| (k.map(str::to_string), v.clone(), 0))
        .collect();
    let placed = produce_py(&broker, "orders", &[], &records);
    let tmp = keyed_job(
        &broker,
        "'key_format' 'json', 'key_columns' 'region VARCHAR NOT NULL, id BIGINT'",
        "order_id, _key.region AS region, _key.id + 100 AS id, _offset",
    );
    let dir = tmp.path();
    let o = run_in(dir, &run_job_args("ckpt"));
    assert!(o.status.success(), "{}", text(&o));
    let mut rows: Vec<(i64, serde_json::Value, serde_json::Value)> = read_py(&dir.join("out"))
        .iter()
        .map(|r| {
            (
                r["_offset"].as_i64().unwrap(),
                r["region"].clone(),
                r["id"].clone(),
            )
        })
        .collect();
    rows.sort_by_key(|r| r.0);
    let at = |i: usize| placed[i].1;
    assert_eq!(
        rows,
        vec![
            (at(0), "eu".into(), 101.into()),
            (at(1), "us".into(), 102.into()),
            (at(2), serde_json::Value::Null, serde_json::Value::Null),
            (at(5), "ap".into(), 106.into()),
        ]
    );
    let mut dead: Vec<(i64, String)> = read_py(&dir.join("bad"))
        .iter()
        .map(|r| {
            (
                r["offset"].as_i64().unwrap(),
                r["error"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    dead.sort();
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert!(
        dead[0].0 == at(3) && dead[0].1.contains("the key's id"),
        "{dead:?}"
    );
    assert!(
        dead[1].0 == at(4) && dead[1].1.contains("not a JSON object"),
        "{dead:?}"
    );

    // key_columns are required, and checked.
    std::fs::write(
        dir.join("job.sql"),
        kafka_job(&broker.bootstrap(), "orders", "out2", "'key_format' 'json'"),
    )
    .unwrap();
    let o = run_available_now(dir, "job.sql", "ckpt2", &[], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(error_line(&o).contains("key_columns"), "{}", text(&o));
}

/// A directory with `job.sql`: topic `orders` (keys read with
/// `key_options`, bad records to table `bad`) into `out` as `select`.
fn keyed_job(broker: &Broker, key_options: &str, select: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("job.sql"),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE orders (order_id VARCHAR NOT NULL) STORED AS KAFKA \
             LOCATION 'kafka://{}/orders' OPTIONS ({key_options}, \
             'on_error' 'dead_letter', 'dead_letter_location' 'bad');\n\
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out';\n\
             INSERT INTO out SELECT {select} FROM orders;\n",
            broker.bootstrap()
        ),
    )
    .unwrap();
    tmp
}
