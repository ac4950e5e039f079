//! lakestream's benchmarks live in this crate's `benches/` directory:
//! `cargo bench -p lakestream-benches --bench hot_paths` runs the criterion
//! micro-benchmarks of the hot pieces of a batch (file decoding, the
//! per-batch query, Parquet encoding, a Delta commit on a long history).
//! The end-to-end figures (backfill against the raw decode-and-encode
//! limit, per-batch overhead, restart cost, state, start-up, Kafka) come
//! from this crate's `lakestream-bench` binary (`src/main.rs`), which
//! drives the `lakestream` binary built beside it, so users can measure
//! their own machines while the shipped binary carries no benchmark code;
//! see docs/benchmarks.md.
