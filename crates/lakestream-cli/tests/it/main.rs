//! End-to-end tests of the `lakestream` binary: real processes, real Delta
//! tables, checked by Python `deltalake` and by `lakestream query`.

mod audit;
mod avro_files;
mod backfill;
mod common;
mod crash;
mod dead_letters;
mod deletion_vectors;
mod errors;
mod evolution;
mod faults;
mod features;
mod group;
mod kafka;
mod kafka_avro;
mod kafka_security;
mod kafka_sink;
mod maintenance;
mod ops;
mod pipeline;
mod quickstart;
mod s3;
mod shards;
mod signals;
mod static_tables;

use lakestream_testkit::broker;
