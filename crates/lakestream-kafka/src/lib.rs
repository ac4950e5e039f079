//! Kafka for lakestream: a topic as a query's output, exactly once.
//!
//! This crate owns:
//! - [`sink::KafkaSink`]: each batch produced in one Kafka transaction that
//!   also commits the batch id, as a consumer-group offset (see the
//!   module's docs for the protocol);
//! - [`encode`]: rows to records (JSON values; `_key`, `_partition`,
//!   `_headers`, `_timestamp` columns);
//! - [`connector::KafkaSinkConnector`]: `STORED AS KAFKA` on an output
//!   table, with the client settings the Kafka source reads too
//!   (`lakestream_job::settings`).

pub mod connector;
pub mod encode;
pub mod sink;

pub use connector::KafkaSinkConnector;
pub use sink::{KafkaSink, KafkaSinkOptions, marker_group};
