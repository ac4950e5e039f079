//! lakestream's benchmarks live in this crate's `benches/` directory:
//! `cargo bench -p lakestream-benches --bench hot_paths` runs the criterion
//! micro-benchmarks of the hot pieces of a batch (file decoding, the
//! per-batch query, Parquet encoding, a Delta commit on a long history).
//! The end-to-end figures (backfill against the raw decode-and-encode
//! limit, per-batch overhead, restart cost, Kafka) come from the shipped
//! binary's `lakestream bench` verb, so users can measure their own
//! machines; see docs/benchmarks.md.
