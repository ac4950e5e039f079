//! `lakestream-bench`: the end-to-end benchmark suite. It drives the
//! `lakestream` binary on generated data and prints one `name: value unit`
//! line per figure (docs/benchmarks.md lists them, with the figures of the
//! reference machine and the commands that give them).
//!
//! It is built beside the binary it measures:
//! `cargo build --profile dist -p lakestream-cli -p lakestream-benches`,
//! then `target/dist/lakestream-bench`. The binary it drives is the
//! `lakestream` next to it, or `--lakestream PATH`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod workloads;

/// End-to-end figures of the `lakestream` binary: throughput against the
/// raw cost of decoding and encoding, per-batch overhead, commit time,
/// state, start-up and Kafka latency, on generated data.
#[derive(Parser)]
#[command(
    name = "lakestream-bench",
    after_help = "Prints one `name: value unit` line per figure. Examples:\n  \
    lakestream-bench                      # full size: 5M events in 50 files (about 1 GB of disk)\n  \
    lakestream-bench --smoke              # every figure on tiny inputs, in seconds\n  \
    lakestream-bench --kafka-bootstrap 127.0.0.1:9092   # also Kafka -> Delta\n  \
    lakestream-bench --only latency,startup --kafka-bootstrap 127.0.0.1:9092\n  \
    lakestream-bench --only kafka,latency --kafka-mock   # librdkafka's mock broker, in process\n\n\
    Build with --profile dist for figures that mean anything; see docs/benchmarks.md."
)]
struct Args {
    #[command(subcommand)]
    floor: Option<Floor>,
    /// The `lakestream` binary to measure (default: the one beside this
    /// program).
    #[arg(long, env = "LAKESTREAM_BIN")]
    lakestream: Option<PathBuf>,
    /// Working directory (cleared first).
    #[arg(long, default_value = "target/bench")]
    dir: PathBuf,
    /// Events in the backfill.
    #[arg(long, default_value_t = 5_000_000)]
    rows: u64,
    /// Files the backfill events are spread over.
    #[arg(long, default_value_t = 50)]
    files: u64,
    /// Tiny one-file batches for the overhead figure.
    #[arg(long, default_value_t = 300)]
    tiny_batches: u64,
    /// Commits in the long-history workload.
    #[arg(long, default_value_t = 5_000)]
    history: u64,
    /// Open groups in the large state-cost workload (the small one holds 1%
    /// of them).
    #[arg(long, default_value_t = 1_000_000)]
    state_groups: u64,
    /// A Kafka broker for the Kafka workload (a topic is created).
    #[arg(long)]
    kafka_bootstrap: Option<String>,
    /// Run the Kafka workloads against librdkafka's mock broker, which the
    /// bench starts in its own process on 127.0.0.1 (the query reaches it
    /// over TCP), instead of a broker at --kafka-bootstrap. Its watermarks
    /// are exact however records are batched, so producers batch and rates
    /// like 20,000 msg/s can be measured.
    #[arg(long, conflicts_with = "kafka_bootstrap")]
    kafka_mock: bool,
    /// Messages in the Kafka workload.
    #[arg(long, default_value_t = 2_000_000)]
    kafka_messages: u64,
    /// An object-store prefix (e.g. `s3://bucket/bench`) where the
    /// several-writers workload also puts its tables and the start-up
    /// workload a table and checkpoint, besides the local ones; credentials
    /// and endpoint from the environment (`AWS_*`).
    #[arg(long, alias = "writers-table-prefix")]
    object_store_prefix: Option<String>,
    /// Produce rates (messages a second) of the Kafka latency workload.
    #[arg(long, value_delimiter = ',', default_values_t = [100u64, 1_000, 20_000])]
    latency_rates: Vec<u64>,
    /// Seconds the latency workload produces at each rate.
    #[arg(long, default_value_t = 5.0)]
    latency_seconds: f64,
    /// A Python interpreter with `pyspark` (and a Java runtime on the path):
    /// the backfill workload then also runs the same backfill and windowed
    /// queries in Spark Structured Streaming (local[2]) on the same input,
    /// and prints the ratios.
    #[arg(long, value_name = "PYTHON")]
    spark_python: Option<PathBuf>,
    /// Run only these workloads (comma-separated): backfill, decode, avro,
    /// state, update, tiny, writers, history, startup, kafka, latency.
    #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(workloads::WORKLOADS))]
    only: Vec<String>,
    /// Rounds of the backfill and its raw floor, run alternately (the order
    /// swaps every round); the figures are the medians and the ratio is the
    /// floor's median over the backfill's. One round's ratio moves by ±10%
    /// on a shared machine. 5 by default, 1 with --smoke.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=50))]
    repeat: Option<u64>,
    /// Tiny sizes: every figure in seconds (a smoke test, not a measure).
    #[arg(long)]
    smoke: bool,
}

#[derive(Subcommand)]
enum Floor {
    /// The raw floor in a process of its own (run by the bench, so that the
    /// floor, like the backfill it is compared with, pays a process's start
    /// and a fresh heap).
    #[command(name = "bench-floor", hide = true)]
    BenchFloor {
        /// The JSON-lines events.
        input: PathBuf,
        /// Where the Parquet files go.
        out: PathBuf,
        /// One file per input file instead of one per day per thread.
        #[arg(long)]
        flat: bool,
    },
}

/// The `lakestream` binary beside this program (cargo builds both into one
/// directory).
fn lakestream_beside_me() -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe()?;
    let exe = me.with_file_name("lakestream");
    exe.is_file().then_some(exe).ok_or_else(|| {
        anyhow::anyhow!(
            "no lakestream binary beside {} to measure: build both with `cargo build \
             --profile dist -p lakestream-cli -p lakestream-benches`, or give its path with \
             --lakestream",
            me.display()
        )
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match args.floor {
        Some(Floor::BenchFloor { input, out, flat }) => {
            workloads::floor_process(&input, &out, !flat)
        }
        None => (|| {
            let lakestream = match args.lakestream {
                Some(p) => p,
                None => lakestream_beside_me()?,
            };
            let cfg = workloads::BenchConfig {
                lakestream,
                object_store_prefix: args.object_store_prefix,
                latency_rates: args.latency_rates,
                latency_seconds: args.latency_seconds,
                spark_python: args.spark_python,
                only: args.only,
                smoke: false,
                dir: args.dir,
                rows: args.rows,
                files: args.files,
                tiny_batches: args.tiny_batches,
                history: args.history,
                state_groups: args.state_groups,
                kafka_bootstrap: args.kafka_bootstrap,
                kafka_mock: args.kafka_mock,
                kafka_messages: args.kafka_messages,
                repeat: 5,
            };
            let mut cfg = if args.smoke { cfg.smoke() } else { cfg };
            if let Some(r) = args.repeat {
                cfg.repeat = r as usize;
            }
            workloads::bench(cfg)
        })(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lakestream-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
