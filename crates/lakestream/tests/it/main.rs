//! The library API, end to end: queries built in Rust, crashes injected at
//! each protocol step, tables read back through delta-rs.

mod api;
mod common;
mod connectors;
mod golden;
mod hardening;
mod kafka_faults;
mod sink;
mod slt;
mod snapshots;
mod source_suite;
mod state;
mod store_faults;
