//! lakestream: exactly-once micro-batch stream processing with DataFusion
//! SQL into Delta Lake tables.
//!
//! ```text
//!  Source ─► offsets/N (write-ahead) ─► DataFusion SQL over the batch ─► Parquet files
//!                                                                           │
//!  commits/N ◄──────────── one Delta commit: add actions + txn(query id, N) ◄┘
//! ```
//!
//! This crate re-exports the library API: build a query from sources, a SQL
//! string or a DataFusion `DataFrame`, a sink and a checkpoint with
//! [`QueryBuilder`], start it, watch its progress and stop it through the
//! [`QueryHandle`]. A batch replayed after a crash is skipped by the table's
//! transaction record, so the table is the same as if nothing had failed.
//!
//! ```no_run
//! # async fn demo() -> lakestream::Result<()> {
//! use std::sync::Arc;
//! use lakestream::{QueryBuilder, Trigger};
//! use lakestream::source::generator::{GeneratorOptions, GeneratorSource};
//! use lakestream::delta::{DeltaSink, DeltaSinkOptions};
//!
//! let events = Arc::new(GeneratorSource::try_new("events", GeneratorOptions::default())?);
//! let table = Arc::new(DeltaSink::try_new("target/events", DeltaSinkOptions::default())?);
//! let summary = QueryBuilder::new()
//!     .source(events)?
//!     .sql("SELECT event_id, amount FROM events WHERE amount > 0")
//!     .sink(table)
//!     .checkpoint("target/events_checkpoint")
//!     .trigger(Trigger::AvailableNow)
//!     .run()
//!     .await?;
//! assert!(summary.output_rows > 0);
//! # Ok(()) }
//! ```
//!
//! The modules, one per concern:
//! - [`storage`]: locations, object stores, durable local writes.
//! - [`checkpoint`]: the offsets/commits log and its fence.
//! - [`state`]: the keyed state of stateful queries (windows, sessions,
//!   deduplication), versioned by batch under the checkpoint.
//! - [`source`]: the `Source` trait; file (JSON, CSV, Parquet, Avro), Kafka,
//!   Delta and generator sources.
//! - [`sink`]: the `Sink` trait, the Delta and memory sinks.
//! - [`job`]: SQL job files: parsing with positions, the streaming-shape
//!   check, loading and running a job.
//! - [`connectors`]: the registry of `STORED AS` names a job file can use;
//!   register your own sources and sinks there.
//! - [`metrics`]: Prometheus metrics of running queries
//!   (`QueryBuilder::metrics`), to serve from your own HTTP server.
//! - [`lineage`]: what each commit records of the input it came from.

pub use lakestream_engine::{
    BatchProgress, DEFAULT_MIN_BATCHES_TO_RETAIN, DEFAULT_SNAPSHOT_INTERVAL, Durations, Error,
    ErrorKind, EventTime, FailPoint, MAX_DURATION, Output, OutputMode, OutputProgress,
    PROGRESS_EVENTS_BUFFER, QueryBuilder, QueryHandle, QuerySummary, Result, SourceProgress,
    StateProgress, StopHandle, Trigger, checkpoint, connectors, delta, job, lineage, metrics,
    parse_duration, parse_size, sink, source, state, storage,
};

/// Kafka outputs: the transactional [`kafka::KafkaSink`] and its settings.
#[cfg(feature = "kafka")]
pub use lakestream_engine::kafka;

/// Serve some buckets (`s3://bucket/`, `gs://...`, `az://...`) with your
/// own object stores, for the queries you hand the registry to.
pub use lakestream_engine::storage::StoreRegistry;
