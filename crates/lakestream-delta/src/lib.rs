//! Delta Lake in lakestream, through delta-rs: everything that reads or
//! writes a Delta table.
//!
//! - [`sink`]: [`DeltaSink`], the output of a query. Each batch is one
//!   Delta commit with a `txn` action `(query id, batch id)`, so a batch
//!   replayed after a crash is found in the table and skipped; the table's
//!   own rules (CHECK constraints, NOT NULL, invariants, generated columns)
//!   are checked before anything commits. Also its maintenance (Delta
//!   checkpoints, auto-compaction, log cleanup off the batch path), the
//!   schema of a query's output, and the group-mode positions kept in the
//!   table ([`lakestream_source::TablePositions`]).
//! - [`source`]: [`DeltaSource`], a Delta table's snapshot then its new
//!   commits, or its change data feed.
//! - [`connector`]: their factories, `STORED AS DELTA` for an output table
//!   ([`DeltaConnector`]) and for an `UNBOUNDED` table
//!   ([`DeltaSourceConnector`]).
//! - [`open_table`], [`load_table`], [`table_features`]: a table at a
//!   location, for the engine's static tables and the CLI's table tools.
//!
//! A sink's errors are [`lakestream_sink::Error`], a source's
//! [`lakestream_source::Error`]: this crate implements those two
//! interfaces and has no error type of its own.

pub mod connector;
pub mod sink;
// `lakestream_source::Error` is the `Source` trait's error, returned here
// as the source crate's own implementations return it; its size is that
// crate's to decide.
#[allow(clippy::result_large_err)]
pub mod source;

pub use connector::{DeltaConnector, DeltaSourceConnector};
pub use sink::{
    DEFAULT_CHECKPOINT_INTERVAL, DEFAULT_TARGET_FILE_SIZE, DEFAULT_UNORDERED_FLUSH_SIZE, DeltaSink,
    DeltaSinkOptions, cast_batch, delta_schema, features, load_table, open_table, table_features,
};
pub use source::{DeltaSource, DeltaSourceOptions};
