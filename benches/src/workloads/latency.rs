//! End-to-end latency of a Kafka record into the Delta table, and the
//! start-up cost of a one-batch job.
//!
//! Latency: a producer writes records at a steady rate, each carrying the
//! wall-clock time it was handed to the producer; the query runs as a user
//! starts it (default trigger, continuous); afterwards the table's log is
//! read and each row's latency is the time its commit file appeared in
//! `_delta_log` (its modification time) minus its produce time. The split
//! comes from the progress of the batch that committed the row: how long
//! the row waited before that batch started, and the batch's own plan,
//! write-ahead, execute and commit times. With the table on an object
//! store, a row is visible when its batch ended (see [`one_rate`]).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use arrow::array::AsArray;
use arrow::datatypes::Int64Type;

use super::broker::Broker;
use super::{figure, percentile};

/// Milliseconds since the epoch, with a fraction.
fn epoch_ms(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// Medians (and the p99 of the latency) over the rows of one rate.
struct Latency {
    rows: usize,
    batches: usize,
    files: usize,
    files_after_optimize: u64,
    p50: f64,
    p90: f64,
    p99: f64,
    /// From produce to the start of the batch that read the row.
    wait: f64,
    plan: f64,
    write_ahead: f64,
    execute: f64,
    commit: f64,
    /// From handing a record to the producer to the broker's ack.
    ack: f64,
    /// The rate the producer kept (messages a second).
    send_rate: f64,
}

/// When the broker acknowledged each record, from the time it was handed
/// to the producer (the record's opaque).
#[derive(Clone, Default)]
struct AckTimes(std::sync::Arc<std::sync::Mutex<Vec<f64>>>);

impl rdkafka::ClientContext for AckTimes {}

impl rdkafka::producer::ProducerContext for AckTimes {
    type DeliveryOpaque = Box<Instant>;

    fn delivery(&self, result: &rdkafka::message::DeliveryResult<'_>, sent: Self::DeliveryOpaque) {
        if result.is_ok() {
            self.0
                .lock()
                .expect("acks")
                .push(sent.elapsed().as_secs_f64() * 1000.0);
        }
    }
}

/// Run the latency workload at every rate for `seconds` each and print
/// `latency.<rate>.*` figures.
/// With `remote` (an object store prefix) each rate runs again with the
/// checkpoint and the table there (`latency_remote.<rate>.*`).
pub(super) fn kafka_latency(
    dir: &Path,
    broker: &Broker,
    rates: &[u64],
    seconds: f64,
    remote: Option<&str>,
) -> anyhow::Result<()> {
    let runs = rates.iter().map(|&r| (r, None)).chain(
        remote
            .into_iter()
            .flat_map(|p| rates.iter().map(move |&r| (r, Some(p)))),
    );
    for (rate, remote) in runs {
        let l = one_rate(dir, broker, rate, seconds, remote)
            .with_context(|| format!("latency at {rate} msg/s"))?;
        let key = match remote {
            None => format!("latency.{rate}"),
            Some(_) => format!("latency_remote.{rate}"),
        };
        figure(&format!("{key}.rows"), l.rows, "rows");
        figure(
            &format!("{key}.produced_rate"),
            format!("{:.0}", l.send_rate),
            "msg/s",
        );
        figure(
            &format!("{key}.broker_ack_median"),
            format!("{:.1}", l.ack),
            "ms (produce to the broker's ack)",
        );
        figure(&format!("{key}.batches"), l.batches, "batches");
        figure(&format!("{key}.table_files"), l.files, "files");
        figure(
            &format!("{key}.files_after_optimize"),
            l.files_after_optimize,
            "files (after `lakestream table optimize`)",
        );
        figure(&format!("{key}.p50"), format!("{:.1}", l.p50), "ms");
        figure(&format!("{key}.p90"), format!("{:.1}", l.p90), "ms");
        figure(&format!("{key}.p99"), format!("{:.1}", l.p99), "ms");
        figure(
            &format!("{key}.wait_median"),
            format!("{:.1}", l.wait),
            "ms (produced to its batch's start)",
        );
        figure(
            &format!("{key}.plan_median"),
            format!("{:.1}", l.plan),
            "ms",
        );
        figure(
            &format!("{key}.write_ahead_median"),
            format!("{:.1}", l.write_ahead),
            "ms",
        );
        figure(
            &format!("{key}.execute_median"),
            format!("{:.1}", l.execute),
            "ms (read, execute, write files)",
        );
        figure(
            &format!("{key}.commit_median"),
            format!("{:.1}", l.commit),
            "ms",
        );
    }
    Ok(())
}

/// One rate: the table and checkpoint on local disk, or under `remote`
/// (an object store prefix). A local table's rows are read back and each
/// is visible when its commit file appeared; a remote table's commit
/// times are not observable to the second, so each record is visible when
/// the batch whose Kafka range holds its offset ended (its commit had
/// returned: a bound from above), and the ranges must cover every offset
/// once.
fn one_rate(
    dir: &Path,
    broker: &Broker,
    rate: u64,
    seconds: f64,
    remote: Option<&str>,
) -> anyhow::Result<Latency> {
    use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};

    let (topic, job, location, checkpoint) = latency_job(dir, broker, rate, remote)?;
    let table = dir.join(&location);
    // Each record's produce time, by seq (the record at offset seq + 1).
    let produced_at = std::sync::Mutex::new(Vec::<f64>::new());
    let acks = AckTimes::default();
    // One record per produce request on a broker named by address (some,
    // like tansu, report a wrong high watermark after a request of several
    // records): see `Broker::producer_config`.
    // Its own thread serves the delivery reports, so each ack is timed
    // when it arrives while this one sleeps until a record is due.
    let producer: ThreadedProducer<AckTimes> =
        broker.producer_config().create_with_context(acks.clone())?;
    let send = |seq: i64| -> anyhow::Result<()> {
        let now = epoch_ms(SystemTime::now()) as i64;
        if seq >= 0 {
            produced_at.lock().expect("produce times").push(now as f64);
        }
        let body = format!("{{\"seq\":{seq},\"produced_ms\":{now}}}");
        loop {
            let record = BaseRecord::<(), String, Box<Instant>>::with_opaque_to(
                &topic,
                Box::new(Instant::now()),
            )
            .payload(&body);
            match producer.send(record) {
                Ok(()) => return Ok(()),
                Err((e, _))
                    if e.rdkafka_error_code()
                        == Some(rdkafka::types::RDKafkaErrorCode::QueueFull) =>
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err((e, _)) => bail!("produce to {topic}: {e}"),
            }
        }
    };

    let (mut child, rx, log_path) = start_query(dir, &job, &checkpoint, &topic)?;
    let stop = |child: &mut std::process::Child| {
        // SAFETY: kill(2) on a child of this process.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let _ = child.wait();
    };
    let mut progress = Vec::new();
    let mut rows = 0u64;
    let mut wait_for = |want: u64, progress: &mut Vec<serde_json::Value>| -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        while rows < want {
            let left = deadline.saturating_duration_since(Instant::now());
            let p = rx.recv_timeout(left).map_err(|_| {
                anyhow::anyhow!(
                    "the query committed {rows} of {want} records within 120 s (its log: {})",
                    log_path.display()
                )
            })?;
            rows += p["input_rows"].as_u64().unwrap_or(0);
            progress.push(p);
        }
        Ok(())
    };
    // One record first: the query is running once it has committed it.
    let warmed = send(-1)
        .and_then(|_| Ok(producer.flush(Duration::from_secs(30))?))
        .and_then(|_| wait_for(1, &mut progress));
    if let Err(e) = warmed {
        stop(&mut child);
        return Err(e);
    }
    // Then `rate` records a second, each sent when it is due.
    let total = (rate as f64 * seconds).round().max(1.0) as u64;
    let start = Instant::now();
    for i in 0..total {
        let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
        // A sleep, never a spin: on a small machine a spinning producer
        // takes a core from the query. A record sent late (a sleep
        // overshoots by tens of microseconds) carries the time it was sent.
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        if let Err(e) = send(i as i64) {
            stop(&mut child);
            return Err(e);
        }
    }
    let sent = start.elapsed();
    let flushed = producer
        .flush(Duration::from_secs(30))
        .map_err(anyhow::Error::from)
        .and_then(|_| wait_for(total + 1, &mut progress));
    stop(&mut child);
    flushed?;

    let mut seen = Visibility::new(total as usize);
    let files = if remote.is_some() {
        let produced_at = produced_at.into_inner().expect("produce times");
        visible_by_batch_end(&progress, &produced_at, &topic, &mut seen)?
    } else {
        visible_by_commit_file(&table, &progress, &mut seen)?
    };
    if let Some(missing) = seen.seen.iter().position(|s| !s) {
        bail!("record {missing} is not in the table");
    }
    let files_after_optimize = files_after_optimize(dir, &location, files)?;
    let mut ack = acks.0.lock().expect("acks").clone();
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        percentile(v, 0.5)
    };
    let Visibility {
        mut lat,
        mut waits,
        mut parts,
        ..
    } = seen;
    lat.sort_by(f64::total_cmp);
    let [plan, write_ahead, execute, commit] = &mut parts;
    Ok(Latency {
        rows: lat.len(),
        batches: progress.len(),
        files,
        files_after_optimize,
        p50: percentile(&lat, 0.5),
        p90: percentile(&lat, 0.9),
        p99: percentile(&lat, 0.99),
        wait: median(&mut waits),
        plan: median(plan),
        write_ahead: median(write_ahead),
        execute: median(execute),
        commit: median(commit),
        ack: median(&mut ack),
        send_rate: total as f64 / sent.as_secs_f64(),
    })
}

/// The latency job of `rate` on a new topic of `broker`, written to `dir`:
/// its topic, job file, table location and checkpoint (on local disk, or
/// under `remote`).
fn latency_job(
    dir: &Path,
    broker: &Broker,
    rate: u64,
    remote: Option<&str>,
) -> anyhow::Result<(String, String, String, String)> {
    let bootstrap = broker.bootstrap();
    let topic = format!(
        "latency-{}-{rate}{}",
        std::process::id(),
        if remote.is_some() { "-remote" } else { "" }
    );
    broker.create_topic(&topic, 1)?;
    let job = format!("{topic}.sql");
    let (location, checkpoint) = match remote {
        None => (
            format!("out/latency-{rate}"),
            format!("ckpt/latency-{rate}"),
        ),
        Some(prefix) => {
            let base = format!("{}/{topic}", prefix.trim_end_matches('/'));
            (format!("{base}/table"), format!("{base}/ckpt"))
        }
    };
    std::fs::write(
        dir.join(&job),
        format!(
            "CREATE UNBOUNDED EXTERNAL TABLE events (seq BIGINT NOT NULL, produced_ms BIGINT NOT NULL)
             STORED AS KAFKA LOCATION 'kafka://{bootstrap}/{topic}'
             OPTIONS ('starting_offsets' 'earliest');
             CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '{location}';
             INSERT INTO out SELECT seq, produced_ms FROM events;"
        ),
    )?;
    Ok((topic, job, location, checkpoint))
}

/// Start `lakestream run job` in `dir` as a user starts it (the default
/// trigger): the child, each batch's progress as it comes, and the log it
/// writes.
fn start_query(
    dir: &Path,
    job: &str,
    checkpoint: &str,
    topic: &str,
) -> anyhow::Result<(
    std::process::Child,
    std::sync::mpsc::Receiver<serde_json::Value>,
    std::path::PathBuf,
)> {
    // The query, started as a user starts it: the default trigger. Its
    // log and progress lines are kept beside the job (set LAKESTREAM_LOG
    // for more) and named when the query falls behind.
    let exe = super::lakestream();
    let log_path = dir.join(format!("{topic}.log"));
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("create the query's log {}", log_path.display()))?;
    let mut child = Command::new(exe)
        .current_dir(dir)
        .args(["run", job, "--checkpoint", checkpoint, "--progress-json"])
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel::<serde_json::Value>();
    // Each batch's progress is kept beside the log, one JSON line a batch.
    let progress_path = dir.join(format!("{topic}.progress.jsonl"));
    let mut progress_file = std::io::BufWriter::new(
        std::fs::File::create(&progress_path)
            .with_context(|| format!("create {}", progress_path.display()))?,
    );
    std::thread::spawn(move || {
        use std::io::Write;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = writeln!(progress_file, "{line}").and_then(|_| progress_file.flush());
            if let Ok(v) = serde_json::from_str(&line) {
                let _ = tx.send(v);
            }
        }
    });
    Ok((child, rx, log_path))
}

/// The records found in the table: each one's latency, and the parts of
/// its batch's time.
struct Visibility {
    /// Record `seq` was found.
    seen: Vec<bool>,
    /// Produced to visible, ms.
    lat: Vec<f64>,
    /// Produced to its batch's start, ms.
    waits: Vec<f64>,
    /// Its batch's plan, write-ahead, execute and commit times, ms.
    parts: [Vec<f64>; 4],
}

impl Visibility {
    /// For `total` records.
    fn new(total: usize) -> Self {
        Self {
            seen: vec![false; total],
            lat: Vec::new(),
            waits: Vec::new(),
            parts: Default::default(),
        }
    }

    /// Record `seq` (produced at `produced`) visible at `visible`, written
    /// by the batch of progress `batch`; an error for a record seen twice.
    fn row(
        &mut self,
        seq: i64,
        produced: f64,
        visible: f64,
        batch: Option<&serde_json::Value>,
    ) -> anyhow::Result<()> {
        let Ok(i) = usize::try_from(seq) else {
            return Ok(()); // the warm-up record
        };
        if i >= self.seen.len() || std::mem::replace(&mut self.seen[i], true) {
            bail!("record {seq} is in the table twice (or was never sent)");
        }
        let d = |key: &str| batch.and_then(|b| b["durations"][key].as_f64());
        self.lat.push(visible - produced);
        if let Some(total) = d("total_ms") {
            self.waits.push((visible - total - produced).max(0.0));
        }
        for (k, key) in ["plan_ms", "write_ahead_ms", "execute_ms", "commit_ms"]
            .iter()
            .enumerate()
        {
            if let Some(v) = d(key) {
                self.parts[k].push(v);
            }
        }
        Ok(())
    }
}

/// A remote table's records, each visible when the batch whose Kafka range
/// holds its offset ended; returns the files the batches wrote.
fn visible_by_batch_end(
    progress: &[serde_json::Value],
    produced_at: &[f64],
    topic: &str,
    seen: &mut Visibility,
) -> anyhow::Result<usize> {
    let mut files = 0;
    let offset = |p: &serde_json::Value, key: &str| {
        p["sources"][0][key]["partitions"][topic]["0"]
            .as_i64()
            .unwrap_or(0)
    };
    for p in progress {
        files += p["output_files"].as_u64().unwrap_or(0) as usize;
        let ended = p["timestamp_ms"].as_f64().unwrap_or(0.0)
            + p["durations"]["total_ms"].as_f64().unwrap_or(0.0);
        // Offset 0 is the warm-up record; offset o holds seq o - 1.
        for o in offset(p, "startOffset")..offset(p, "endOffset") {
            let seq = o - 1;
            let produced = usize::try_from(seq)
                .ok()
                .and_then(|i| produced_at.get(i))
                .copied()
                .unwrap_or(ended);
            seen.row(seq, produced, ended, Some(p))?;
        }
    }
    Ok(files)
}

/// A local table's records, read back from each commit's files, each
/// visible when its commit file appeared; returns the files added.
fn visible_by_commit_file(
    table: &Path,
    progress: &[serde_json::Value],
    seen: &mut Visibility,
) -> anyhow::Result<usize> {
    let mut files = 0;
    // Each commit: when it appeared, and the batch that made it.
    let by_version: BTreeMap<u64, &serde_json::Value> = progress
        .iter()
        .filter_map(|p| Some((p["table_version"].as_u64()?, p)))
        .collect();
    let log = table.join("_delta_log");
    for entry in std::fs::read_dir(&log).with_context(|| format!("read {}", log.display()))? {
        let path = entry?.path();
        let Some(version) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".json"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        let visible = epoch_ms(std::fs::metadata(&path)?.modified()?);
        let batch = by_version.get(&version).copied();
        for line in std::fs::read_to_string(&path)?.lines() {
            let action: serde_json::Value = serde_json::from_str(line)?;
            let Some(file) = action["add"]["path"].as_str() else {
                continue;
            };
            files += 1;
            let file = table.join(
                percent_encoding::percent_decode_str(file)
                    .decode_utf8()
                    .context("an add path")?
                    .as_ref(),
            );
            let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
                std::fs::File::open(&file).with_context(|| format!("open {}", file.display()))?,
            )?
            .build()?;
            for b in reader {
                let b = b?;
                let seq = b
                    .column_by_name("seq")
                    .context("a seq column")?
                    .as_primitive::<Int64Type>();
                let produced = b
                    .column_by_name("produced_ms")
                    .context("a produced_ms column")?
                    .as_primitive::<Int64Type>();
                for (s, p) in seq.values().iter().zip(produced.values()) {
                    seen.row(*s, *p as f64, visible, batch)?;
                }
            }
        }
    }
    Ok(files)
}

/// The files a table of `files` files holds after `lakestream table
/// optimize` (what compaction makes of the many small files of tiny
/// batches).
fn files_after_optimize(dir: &Path, location: &str, files: usize) -> anyhow::Result<u64> {
    let out = Command::new(super::lakestream())
        .current_dir(dir)
        .args(["table", "optimize", "--json", location])
        .output()?;
    if !out.status.success() {
        bail!(
            "lakestream table optimize failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let m: serde_json::Value = serde_json::from_slice(&out.stdout).context("optimize's JSON")?;
    Ok((files as u64 + m["files_added"].as_u64().unwrap_or(0))
        .saturating_sub(m["files_removed"].as_u64().unwrap_or(0)))
}

/// Start-up: a one-batch job (one small input, a new checkpoint and a new
/// table each time) from exec to exit, first commit included; the median
/// of `runs`. `kafka` is a broker to measure a Kafka source too; `remote`
/// an object store prefix to measure the file job with its checkpoint and
/// table there.
pub(super) fn startup(
    dir: &Path,
    kafka: Option<&Broker>,
    remote: Option<&str>,
    runs: usize,
) -> anyhow::Result<()> {
    let work = dir.join("startup");
    std::fs::create_dir_all(work.join("events"))?;
    let body: String = (0..10)
        .map(|j| {
            format!(
                "{{\"event_id\":\"s{j}\",\"user_id\":{j},\"event_type\":\"view\",\"amount\":{j}.5,\"ts\":\"2026-01-01T00:00:00Z\"}}\n"
            )
        })
        .collect();
    std::fs::write(work.join("events/part-0.json"), body)?;
    std::fs::write(
        work.join("files.sql"),
        "CREATE UNBOUNDED EXTERNAL TABLE events (
           event_id VARCHAR NOT NULL, user_id BIGINT, event_type VARCHAR, amount DOUBLE, ts TIMESTAMP
         ) STORED AS JSON LOCATION 'events/';
         CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out-files';
         INSERT INTO out SELECT * FROM events;",
    )?;
    let mut jobs = vec![("files", "out-files".to_string(), "ckpt".to_string())];
    if let Some(prefix) = remote {
        let base = format!(
            "{}/startup-{}",
            prefix.trim_end_matches('/'),
            std::process::id()
        );
        std::fs::write(
            work.join("s3.sql"),
            std::fs::read_to_string(work.join("files.sql"))?.replace("'out-files'", "'{TABLE}'"),
        )?;
        jobs.push(("s3", base, String::new()));
    }
    if let Some(broker) = kafka {
        use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
        let bootstrap = broker.bootstrap();
        let topic = format!("startup-{}", std::process::id());
        broker.create_topic(&topic, 1)?;
        let producer: BaseProducer = broker.producer_config().create()?;
        for j in 0..10 {
            producer
                .send(BaseRecord::<(), String>::to(&topic).payload(&format!(
                    "{{\"event_id\":\"s{j}\",\"user_id\":{j},\"amount\":{j}.5}}"
                )))
                .map_err(|(e, _)| e)?;
        }
        producer.flush(Duration::from_secs(30))?;
        std::fs::write(
            work.join("kafka.sql"),
            format!(
                "CREATE UNBOUNDED EXTERNAL TABLE events (
                   event_id VARCHAR NOT NULL, user_id BIGINT, amount DOUBLE
                 ) STORED AS KAFKA LOCATION 'kafka://{bootstrap}/{topic}'
                 OPTIONS ('starting_offsets' 'earliest');
                 CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out-kafka';
                 INSERT INTO out SELECT * FROM events;"
            ),
        )?;
        jobs.push(("kafka", "out-kafka".to_string(), "ckpt".to_string()));
    }
    for (name, table, ckpt) in jobs {
        let mut walls = Vec::new();
        for i in 0..runs {
            let (job, ckpt) = if ckpt.is_empty() {
                // On the object store: a new table and checkpoint each run.
                let job = format!("{name}-{i}.sql");
                std::fs::write(
                    work.join(&job),
                    std::fs::read_to_string(work.join(format!("{name}.sql")))?
                        .replace("{TABLE}", &format!("{table}/table-{i}")),
                )?;
                (job, format!("{table}/ckpt-{i}"))
            } else {
                let _ = std::fs::remove_dir_all(work.join(&table));
                let _ = std::fs::remove_dir_all(work.join(&ckpt));
                (format!("{name}.sql"), ckpt.clone())
            };
            let r = super::run_job(&work, &job, &ckpt)?;
            let rows: u64 = r
                .progress
                .iter()
                .filter_map(|p| p["input_rows"].as_u64())
                .sum();
            if rows != 10 {
                bail!("the {name} start-up job read {rows} of 10 rows");
            }
            walls.push(r.wall.as_secs_f64() * 1000.0);
        }
        walls.sort_by(f64::total_cmp);
        figure(
            &format!("startup.{name}"),
            format!("{:.1}", percentile(&walls, 0.5)),
            "ms (exec to exit, one batch committed; median)",
        );
    }
    Ok(())
}
