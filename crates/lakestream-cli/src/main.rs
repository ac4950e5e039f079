//! `lakestream`: run exactly-once streaming SQL jobs into Delta tables.
//!
//! Exit codes: 0 done (or stopped gracefully), 1 the job failed while
//! running, 2 invalid command line or job file, 3 the checkpoint is in use
//! by another process, 130 aborted by a second signal.

/// `println!` for the reports of `status`, `query` and `table`: when
/// stdout is closed (`lakestream status | head -3`) the process ends
/// quietly with success, as Unix tools do, instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout(), $($arg)*) {
            crate::stdout_failed(e);
        }
    }};
}

mod audit;
mod chaos;
mod progress_bar;
mod query;
mod status;
mod table;
mod web;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};
use lakestream_engine::job::{JobOptions, load_job};
use lakestream_engine::{FailPoint, Trigger};

const EXIT_FAILED: u8 = 1;
const EXIT_INVALID: u8 = 2;
const EXIT_IN_USE: u8 = 3;
const EXIT_ABORTED: i32 = 130;

/// `--version`'s long form: the version, and the Kafka client's version
/// and what it was built with (TLS, SASL mechanisms, codecs), so a user can
/// tell what this binary can connect to.
fn long_version() -> String {
    let (_, librdkafka) = rdkafka::util::get_rdkafka_version();
    let features = rdkafka::ClientConfig::new()
        .create_native_config()
        .and_then(|c| c.get("builtin.features"))
        .unwrap_or_else(|e| format!("unknown ({e})"));
    format!(
        "{}\nlibrdkafka {librdkafka} ({features})",
        env!("CARGO_PKG_VERSION")
    )
}

#[derive(Parser)]
#[command(
    name = "lakestream",
    version,
    about = "Exactly-once micro-batch streaming SQL into Delta Lake tables",
    after_help = "Examples:\n  lakestream run examples/quickstart.sql --checkpoint target/quickstart/_checkpoint --trigger available-now\n  lakestream status --checkpoint target/quickstart/_checkpoint\n  lakestream query \"SELECT country, count(*) FROM 'target/quickstart/clean_events' GROUP BY country\""
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a streaming SQL job until stopped (or until its trigger runs out).
    #[command(after_help = "Examples:\n  \
        lakestream run job.sql --checkpoint ckpt/ --trigger available-now   # backfill, then exit\n  \
        lakestream run job.sql --checkpoint ckpt/ --trigger 10s             # a batch every 10 s\n  \
        lakestream run job.sql --checkpoint s3://bucket/ckpt/ --progress-json\n\n\
        SIGINT/SIGTERM finish the batch in flight and exit 0; a second signal exits at once (130).\n\
        Exit codes: 0 done, 1 failed, 2 invalid job or arguments, 3 checkpoint in use.")]
    Run {
        /// The job file (.sql).
        job: PathBuf,
        /// Checkpoint location (path or URL): the query's write-ahead log.
        #[arg(long)]
        checkpoint: String,
        /// `available-now`, `once`, or an interval such as `10s` (default: run
        /// batches back to back, polling while idle).
        #[arg(long)]
        trigger: Option<Trigger>,
        /// Print one JSON object per batch on stdout, in the shape of
        /// Spark's StreamingQueryProgress with lakestream's fields beside.
        #[arg(long)]
        progress_json: bool,
        /// Serve Prometheus metrics on /metrics and the status page on /
        /// at this address while the query runs (e.g. 127.0.0.1:9464).
        #[arg(long)]
        metrics_addr: Option<String>,
        /// Write the job's output table here instead of at the LOCATION the
        /// job declares (a scratch copy).
        #[arg(long)]
        output_location: Option<String>,
        #[command(flatten)]
        storage: StorageArgs,
    },
    /// Prove exactly-once for a job: run it as a control, run it again while
    /// killing it with SIGKILL at random moments, compare the two tables and
    /// verify the killed run's checkpoint.
    #[command(
        after_help = "Example:\n  lakestream chaos examples/quickstart.sql --kills 5\n\n\
        Both runs write below --scratch (default: a new directory under the system's temp \
        directory), never to the job's own table. The job must end (--trigger available-now): \
        files, or Kafka with ending_offsets. Exit codes: 0 pass, 1 fail (the seed to reproduce \
        is printed), 2 invalid arguments."
    )]
    Chaos {
        /// The job file (.sql).
        job: PathBuf,
        /// How many SIGKILLs to aim for.
        #[arg(long, default_value_t = 5)]
        kills: usize,
        /// Seed of the kill moments (default: from the clock; printed).
        #[arg(long)]
        seed: Option<u64>,
        /// Directory the control and the killed run write below.
        #[arg(long)]
        scratch: Option<PathBuf>,
        /// Keep the scratch tables after a pass (they are always kept after a failure).
        #[arg(long)]
        keep: bool,
        #[command(flatten)]
        storage: StorageArgs,
    },
    /// Serve the status page of a query's checkpoint: plots of its batch
    /// history, current offsets, last batches and problems.
    #[command(
        after_help = "Example:\n  lakestream ui --checkpoint target/quickstart/_checkpoint --addr 127.0.0.1:8080\n\n\
        The page reads the checkpoint at each load (and every 3 s while open): it shows a running \
        query as it goes and a stopped one as it ended."
    )]
    Ui {
        /// Checkpoint location (path or URL).
        #[arg(long)]
        checkpoint: String,
        /// Address to serve the page on.
        #[arg(long, default_value = "127.0.0.1:8080")]
        addr: String,
        #[command(flatten)]
        storage: StorageArgs,
    },
    /// Show a checkpoint: query id, last planned and committed batch, offsets.
    #[command(
        after_help = "Example:\n  lakestream status --checkpoint target/quickstart/_checkpoint"
    )]
    Status {
        /// Checkpoint location (path or URL).
        #[arg(long)]
        checkpoint: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Show the last N batches (their progress kept in the checkpoint).
        #[arg(long, default_value_t = 5)]
        batches: usize,
        #[command(flatten)]
        storage: StorageArgs,
    },
    /// Check a query's table against its checkpoint, batch by batch: every
    /// batch exactly once, source ranges contiguous and as planned, row
    /// counts consistent, orphan files listed.
    #[command(
        after_help = "Example:\n  lakestream verify --checkpoint target/quickstart/_checkpoint\n\n\
        Exit codes: 0 clean, 1 not clean (the report says why), 2 invalid arguments.\n\
        Orphan files are warnings unless --strict."
    )]
    Verify {
        /// Checkpoint location (path or URL).
        #[arg(long)]
        checkpoint: String,
        /// The table (default: the one the checkpoint's query writes).
        #[arg(long)]
        table: Option<String>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Count orphan files as errors.
        #[arg(long)]
        strict: bool,
        #[command(flatten)]
        storage: StorageArgs,
    },
    /// Maintain a Delta table: compact, vacuum, checkpoint, history, lineage.
    #[command(after_help = "Examples:\n  \
        lakestream table optimize s3://bucket/events/ --target-size 128MiB\n  \
        lakestream table vacuum target/quickstart/clean_events              # dry run: lists files\n  \
        lakestream table vacuum target/quickstart/clean_events --execute\n  \
        lakestream table checkpoint target/quickstart/clean_events\n  \
        lakestream table history target/quickstart/clean_events --limit 5\n  \
        lakestream table lineage target/quickstart/clean_events --version 2\n\n\
        Compaction is safe while a stream writes to the table.")]
    Table {
        #[command(subcommand)]
        action: TableAction,
    },
    /// Run SQL over Delta, Parquet, CSV or JSON tables, named by path or by
    /// a name given with --table.
    #[command(
        after_help = "Tables are named by their path in quotes, or by a name given with --table:\n  \
        lakestream query \"SELECT count(*) FROM 'target/quickstart/clean_events'\"\n  \
        lakestream query --table events=target/quickstart/clean_events \"SELECT day, count(*) FROM events GROUP BY day\"\n  \
        lakestream query --format json \"SELECT * FROM 'data/users.parquet' LIMIT 5\""
    )]
    Query {
        /// The SQL.
        sql: String,
        /// Output format.
        #[arg(long, default_value = "table", value_parser = ["table", "json", "csv"])]
        format: String,
        /// A table the SQL names by NAME: a Delta table, or Parquet, CSV or
        /// JSON files, at LOCATION (path or URL). Repeatable.
        #[arg(long = "table", value_name = "NAME=LOCATION", value_parser = parse_table_arg)]
        tables: Vec<(String, String)>,
        #[command(flatten)]
        storage: StorageArgs,
    },
}

/// Table maintenance actions.
#[derive(Subcommand)]
enum TableAction {
    /// Bin-pack small data files into files of about the target size.
    Optimize {
        /// The table (path or URL).
        table: String,
        /// Target file size (bytes, or with KiB/MiB/GiB).
        #[arg(long, default_value = "128MiB", value_parser = parse_size)]
        target_size: u64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        storage: StorageArgs,
    },
    /// Delete data files the table no longer references (dry run unless --execute).
    Vacuum {
        /// The table (path or URL).
        table: String,
        /// Keep files removed less than this many hours ago.
        #[arg(long, default_value_t = 168)]
        retention_hours: u64,
        /// Delete the files (without it, only list them).
        #[arg(long)]
        execute: bool,
        /// Allow a retention below the table's `delta.deletedFileRetentionDuration`.
        #[arg(long)]
        allow_short_retention: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        storage: StorageArgs,
    },
    /// Write a Delta log checkpoint at the current version.
    Checkpoint {
        /// The table (path or URL).
        table: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        storage: StorageArgs,
    },
    /// Show the latest commits: version, time, operation, batch id.
    History {
        /// The table (path or URL).
        table: String,
        /// How many commits.
        #[arg(long, default_value_t = 20)]
        limit: u64,
        /// Print one JSON object per commit.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        storage: StorageArgs,
    },
    /// Where a version's rows came from: its query, batch and the exact
    /// source ranges (Kafka offsets, files) its commit records.
    Lineage {
        /// The table (path or URL).
        table: String,
        /// The version (default: the latest).
        #[arg(long)]
        version: Option<u64>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        storage: StorageArgs,
    },
}

/// A size such as `134217728`, `128MiB`, `64mb` or `1GiB`.
fn parse_size(v: &str) -> Result<u64, String> {
    lakestream_engine::parse_size(v)
        .ok_or_else(|| format!("{v:?} is not a size: give bytes or a number with KiB, MiB or GiB"))
}

async fn table_command(action: TableAction) -> anyhow::Result<()> {
    match action {
        TableAction::Optimize {
            table: t,
            target_size,
            json,
            storage,
        } => table::optimize(&t, target_size, json, &storage.options()).await,
        TableAction::Vacuum {
            table: t,
            retention_hours,
            execute,
            allow_short_retention,
            json,
            storage,
        } => {
            table::vacuum(
                &t,
                retention_hours,
                execute,
                allow_short_retention,
                json,
                &storage.options(),
            )
            .await
        }
        TableAction::Checkpoint {
            table: t,
            json,
            storage,
        } => table::checkpoint(&t, json, &storage.options()).await,
        TableAction::History {
            table: t,
            limit,
            json,
            storage,
        } => table::history(&t, limit, json, &storage.options()).await,
        TableAction::Lineage {
            table: t,
            version,
            json,
            storage,
        } => audit::lineage(&t, version, json, &storage.options()).await,
    }
}

/// `KEY=VALUE` storage options; keys normalized (`aws.region` is
/// `aws_region`), a later one wins.
/// A report could not be written to stdout: a closed pipe ends the process
/// with success (the reader has what it wanted); any other error fails.
fn stdout_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("error: cannot write to stdout: {e}");
    std::process::exit(1);
}

/// `--storage-option KEY=VALUE` (repeatable), shared by every subcommand
/// that opens a location: applied to every location it opens. Keys are
/// normalized (`aws.endpoint` and `AWS_ENDPOINT` are one key).
#[derive(Debug, Clone, Default, clap::Args)]
struct StorageArgs {
    /// Storage option for every location, as KEY=VALUE (repeatable), such
    /// as aws_endpoint=http://127.0.0.1:9000.
    #[arg(long = "storage-option", value_name = "KEY=VALUE", value_parser = parse_storage_option)]
    storage_options: Vec<(String, String)>,
}

impl StorageArgs {
    /// The options as a map (a later repetition of a key wins).
    fn options(&self) -> HashMap<String, String> {
        self.storage_options.iter().cloned().collect()
    }
}

fn parse_storage_option(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (lakestream::storage::normalize_option_key(k), v.to_string()))
        .ok_or_else(|| format!("storage option {s:?} is not KEY=VALUE"))
}

/// Tune glibc's malloc for a process that streams batches; each setting
/// is left alone when its `MALLOC_*` variable (or `GLIBC_TUNABLES`) says
/// otherwise. Called before any thread starts, so that every thread's
/// arena follows the arena limit.
///
/// - Two arenas (`MALLOC_ARENA_MAX`): by default glibc gives threads up to
///   eight arenas per core, and memory freed in one arena is not reused by
///   the others: a backfill's decode, query and Parquet threads then kept
///   tens of megabytes more resident, at the same speed.
/// - Blocks up to 32 MiB from the heap (`MALLOC_MMAP_THRESHOLD_`), and the
///   heap returned to the system only past 64 MiB free at its top
///   (`MALLOC_TRIM_THRESHOLD_`): otherwise each 4 MiB read buffer, Arrow
///   array and Parquet page buffer of a batch came from fresh pages that
///   the kernel faulted in and zeroed, and went back at its free: a backfill
///   spent a third of its page faults and system time there, and ran
///   measurably slower, for a few megabytes less peak RSS.
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
        let settings = [
            ("MALLOC_ARENA_MAX", "arena_max", libc::M_ARENA_MAX, 2),
            (
                "MALLOC_MMAP_THRESHOLD_",
                "mmap_threshold",
                libc::M_MMAP_THRESHOLD,
                32 << 20,
            ),
            (
                "MALLOC_TRIM_THRESHOLD_",
                "trim_threshold",
                libc::M_TRIM_THRESHOLD,
                64 << 20,
            ),
        ];
        for (var, tunable, param, value) in settings {
            if std::env::var_os(var).is_some()
                || tunables.contains(&format!("glibc.malloc.{tunable}"))
            {
                continue;
            }
            // SAFETY: mallopt only sets an allocator parameter, under
            // glibc's own arena lock.
            unsafe {
                libc::mallopt(param, value);
            }
        }
    }
}

fn main() -> ExitCode {
    tune_malloc();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LAKESTREAM_LOG").unwrap_or_else(
                |_| // delta-kernel logs an ERROR while probing a location that
                // holds no table yet, which is the normal first run.
                // delta-rs warns that it keeps no statistics of a binary
                // column at every commit of a dead-letter table.
                tracing_subscriber::EnvFilter::new(
                    "warn,buoyant_kernel::snapshot::builder=off,deltalake_core::writer::stats=error",
                ),
            ),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = {
        use clap::{CommandFactory, FromArgMatches};
        // Only `--version` shows it: no Kafka client configuration is made
        // at every start. Built once; clap takes a static string.
        let mut command = Cli::command();
        if std::env::args().any(|a| a == "--version") {
            let long: &'static str = Box::leak(long_version().into_boxed_str());
            command = command.long_version(long);
        }
        let matches = command.get_matches();
        Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    runtime.block_on(async {
        match cli.command {
            Command::Run {
                job,
                checkpoint,
                trigger,
                progress_json,
                metrics_addr,
                output_location,
                storage,
            } => {
                run(
                    job,
                    checkpoint,
                    trigger,
                    progress_json,
                    metrics_addr,
                    output_location,
                    storage.options(),
                )
                .await
            }
            Command::Chaos {
                job,
                kills,
                seed,
                scratch,
                keep,
                storage,
            } => {
                let seed = seed.unwrap_or_else(|| {
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_nanos() as u64)
                        .unwrap_or(1)
                });
                let scratch = scratch.unwrap_or_else(|| {
                    std::env::temp_dir()
                        .join(format!("lakestream-chaos-{seed}-{}", std::process::id()))
                });
                let c = chaos::Chaos {
                    job,
                    kills,
                    seed,
                    scratch,
                    keep,
                    storage: storage.storage_options.clone(),
                };
                verdict(c.run().await)
            }
            Command::Ui {
                checkpoint,
                addr,
                storage,
            } => report(ui(checkpoint, addr, storage.options()).await),
            Command::Status {
                checkpoint,
                json,
                batches,
                storage,
            } => report(status::status(&checkpoint, json, batches, &storage.options()).await),
            Command::Table { action } => report(table_command(action).await),
            Command::Verify {
                checkpoint,
                table,
                json,
                strict,
                storage,
            } => verdict(
                audit::verify(
                    &checkpoint,
                    table.as_deref(),
                    json,
                    strict,
                    &storage.options(),
                )
                .await,
            ),
            Command::Query {
                sql,
                format,
                tables,
                storage,
            } => report(query::query(&sql, &format, &tables, &storage.options()).await),
        }
    })
}

fn report(r: anyhow::Result<()>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            // A table this writer refuses: the command, not the
            // environment, is what to change.
            let refused = e.chain().any(|c| {
                matches!(
                    c.downcast_ref::<lakestream::sink::Error>(),
                    Some(lakestream::sink::Error::UnsupportedFeature { .. })
                )
            });
            ExitCode::from(if refused { EXIT_INVALID } else { EXIT_FAILED })
        }
    }
}

/// The exit of a check (`verify`, `chaos`): 0 when it passed, 1 when it
/// did not (its report says why) or could not run.
fn verdict(r: anyhow::Result<bool>) -> ExitCode {
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(EXIT_FAILED),
        Err(e) => report(Err(e)),
    }
}

fn engine_exit(e: &lakestream_engine::Error) -> ExitCode {
    eprintln!("error: {e}");
    if e.is_checkpoint_in_use() {
        return ExitCode::from(EXIT_IN_USE);
    }
    match e.kind() {
        lakestream_engine::ErrorKind::User => ExitCode::from(EXIT_INVALID),
        lakestream_engine::ErrorKind::External | lakestream_engine::ErrorKind::Internal => {
            ExitCode::from(EXIT_FAILED)
        }
    }
}

/// `NAME=LOCATION` of `lakestream query --table`.
fn parse_table_arg(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, location)) if !name.trim().is_empty() && !location.trim().is_empty() => {
            Ok((name.trim().to_string(), location.trim().to_string()))
        }
        _ => Err(format!(
            "{s:?} is not NAME=LOCATION (for example events=target/quickstart/clean_events)"
        )),
    }
}

/// `LAKESTREAM_FAIL_POINT=after-commit:3` stops the run at that point of
/// that batch, as a crash would (for crash tests).
fn fail_point_from_env() -> anyhow::Result<Option<(FailPoint, u64)>> {
    let Ok(v) = std::env::var("LAKESTREAM_FAIL_POINT") else {
        return Ok(None);
    };
    let (p, n) = v
        .split_once(':')
        .context("LAKESTREAM_FAIL_POINT must be POINT:BATCH")?;
    Ok(Some((
        p.parse().map_err(anyhow::Error::msg)?,
        n.parse().context("LAKESTREAM_FAIL_POINT batch id")?,
    )))
}

async fn run(
    job: PathBuf,
    checkpoint: String,
    trigger: Option<Trigger>,
    progress_json: bool,
    metrics_addr: Option<String>,
    output_location: Option<String>,
    storage_options: HashMap<String, String>,
) -> ExitCode {
    let text = match std::fs::read_to_string(&job) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read job file {}: {e}", job.display());
            return ExitCode::from(EXIT_INVALID);
        }
    };
    let fail_point = match fail_point_from_env() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(EXIT_INVALID);
        }
    };
    let options = JobOptions {
        trigger: trigger.unwrap_or_default(),
        storage_options,
        fail_point,
        output_location,
        ..JobOptions::new(checkpoint)
    };
    let mut builder = match load_job(&job.display().to_string(), &text, &options).await {
        Ok(b) => b,
        Err(e) => return engine_exit(&e),
    };
    let metrics = metrics_addr
        .as_ref()
        .map(|_| Arc::new(lakestream_engine::metrics::Metrics::new()));
    if let Some(m) = &metrics {
        builder = builder.metrics(m.clone());
    }
    let mut handle = match builder.start().await {
        Ok(h) => h,
        Err(e) => return engine_exit(&e),
    };
    if let Some(addr) = &metrics_addr {
        let site = web::Site::new(
            options.checkpoint.clone(),
            options.storage_options.clone(),
            metrics,
        );
        match web::start(addr, site).await {
            Ok(a) => {
                eprintln!("lakestream: metrics on http://{a}/metrics, status page on http://{a}/")
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                handle.abort();
                return ExitCode::from(EXIT_INVALID);
            }
        }
    }
    eprintln!(
        "lakestream: query {} started ({})",
        handle.query_id(),
        job.display()
    );
    let mut events = handle.take_progress_events().expect("first take");
    let bar = matches!(options.trigger, Trigger::AvailableNow)
        && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let printer = tokio::spawn(async move {
        use std::io::Write;
        let mut bar = bar.then(progress_bar::Bar::new);
        while let Some(p) = events.recv().await {
            match (&mut bar, p.backlog()) {
                (Some(bar), Some(backlog)) => bar.update(&p, backlog),
                _ => eprintln!("{}", p.human_line()),
            }
            if progress_json {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{}", p.spark_json());
                let _ = out.flush();
            }
        }
        if let Some(bar) = bar {
            bar.finish();
        }
    });
    let stopper = handle.stop_handle();
    tokio::spawn(async move {
        signal().await;
        eprintln!("lakestream: stopping after the batch in flight (signal again to abort)");
        stopper.stop();
        signal().await;
        eprintln!("lakestream: aborted; the batch in flight re-runs on restart");
        std::process::exit(EXIT_ABORTED);
    });
    let result = handle.await_termination().await;
    let _ = printer.await;
    match result {
        Ok(summary) => {
            eprintln!(
                "lakestream: done: {} batches, {} rows in, {} rows out, table version {}",
                summary.batches,
                summary.input_rows,
                summary.output_rows,
                summary
                    .table_version
                    .map(|v| v.to_string())
                    .unwrap_or_else(|| "-".into())
            );
            ExitCode::SUCCESS
        }
        Err(e) => engine_exit(&e),
    }
}

/// `lakestream ui`: serve the status page of `checkpoint` until a signal.
async fn ui(
    checkpoint: String,
    addr: String,
    options: HashMap<String, String>,
) -> anyhow::Result<()> {
    // Fail now on a location that is not a checkpoint, not at the first
    // page load.
    lakestream_engine::checkpoint::Checkpoint::inspect(&checkpoint, &options)
        .await?
        .with_context(|| format!("no checkpoint at {checkpoint}"))?;
    let site = web::Site::new(checkpoint, options, None);
    let a = web::start(&addr, site).await?;
    eprintln!("lakestream: status page on http://{a}/ (Ctrl-C stops)");
    signal().await;
    Ok(())
}

async fn signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    /// Minor page faults of the calling thread so far.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn thread_minor_faults() -> i64 {
        // SAFETY: getrusage fills the zeroed struct it is given.
        unsafe {
            let mut usage: libc::rusage = std::mem::zeroed();
            assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut usage), 0);
            usage.ru_minflt
        }
    }

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn batch_buffers_freed_at_a_batch_end_are_reused_not_faulted_in_again() {
        if std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc."))
            || std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_some()
        {
            return;
        }
        super::tune_malloc();
        // Twenty batches, each holding eight 4 MiB buffers (read ranges,
        // Arrow arrays, Parquet pages) and freeing them at its end.
        let pages_per_batch = 8 * (4 << 20) / 4096;
        let before = thread_minor_faults();
        for batch in 0..20u8 {
            let buffers: Vec<Vec<u8>> = (0..8).map(|_| vec![batch + 1; 4 << 20]).collect();
            assert!(buffers.iter().all(|b| b[4096] == batch + 1));
        }
        let faults = thread_minor_faults() - before;
        // glibc's own thresholds give the heap back at each batch end, and
        // every batch faults its pages in again (about 20 batches' worth).
        assert!(
            faults < 3 * pages_per_batch,
            "{faults} minor faults for 20 batches of {pages_per_batch} pages"
        );
    }
}
