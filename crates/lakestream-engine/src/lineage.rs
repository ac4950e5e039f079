//! Lineage: what each commit records of where its rows came from.
//!
//! Every commit the engine makes carries, in the sink's commit metadata
//! (Delta: `commitInfo.lakestream`), the batch id, query id, a fingerprint
//! of the query, the batch's row counts and, per source, the exact range
//! it read: `{"start": .., "end": ..}` in the source's own offset terms,
//! the same values `offsets/N` holds. An offset whose JSON is longer than
//! [`INLINE_OFFSET_BYTES`] (a long list of files) is recorded as its
//! digest ([`recorded_offset`]) with a pointer to `offsets/N`, which holds
//! it in full while the checkpoint retains the batch. `lakestream table
//! lineage` prints these; `lakestream verify` checks them against the
//! checkpoint and against each other (each batch starts where the previous
//! one ended).

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// Offsets up to this many bytes of JSON are recorded whole in a commit.
pub const INLINE_OFFSET_BYTES: usize = 8 * 1024;

/// The hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// `offset` as batch `batch_id`'s commit records it: itself, or when its
/// JSON is longer than [`INLINE_OFFSET_BYTES`],
/// `{"sha256": .., "bytes": .., "checkpoint": "offsets/<batch_id>"}`.
pub fn recorded_offset(offset: &Value, batch_id: u64) -> Value {
    let text = offset.to_string();
    if text.len() <= INLINE_OFFSET_BYTES {
        return offset.clone();
    }
    json!({
        "sha256": sha256_hex(text.as_bytes()),
        "bytes": text.len(),
        "checkpoint": format!("offsets/{batch_id}"),
    })
}

/// The digest a recorded offset stands for: its own `sha256` when it was
/// recorded as a digest, else the digest of its JSON.
fn digest_of(recorded: &Value) -> String {
    match (recorded.get("sha256"), recorded.get("checkpoint")) {
        (Some(Value::String(d)), Some(_)) if recorded.as_object().is_some_and(|o| o.len() == 3) => {
            d.clone()
        }
        _ => sha256_hex(recorded.to_string().as_bytes()),
    }
}

/// Whether two offsets, each either whole or recorded as a digest, are the
/// same offset.
pub fn same_offset(a: &Value, b: &Value) -> bool {
    a == b || digest_of(a) == digest_of(b)
}

/// A fingerprint of a query's text: the SHA-256 of the SQL with its
/// whitespace collapsed, so reformatting a job does not change it and any
/// other edit does.
pub fn sql_fingerprint(sql: &str) -> String {
    let normalized = sql.split_whitespace().collect::<Vec<_>>().join(" ");
    format!("sha256:{}", sha256_hex(normalized.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_offsets_are_recorded_whole_and_long_ones_as_their_digest() {
        let small = json!({"partitions": {"t": {"0": 5}}});
        assert_eq!(recorded_offset(&small, 3), small);
        let files: Vec<Value> = (0..400)
            .map(|i| json!({"path": format!("data/part-{i:05}.json"), "size": i}))
            .collect();
        let long = json!({"count": 400, "files": files});
        let rec = recorded_offset(&long, 7);
        assert_eq!(rec["checkpoint"], "offsets/7");
        assert!(rec.to_string().len() < 200);
        // The same offset recorded by two batches (one's end, the next's
        // start) compares equal; a different one does not.
        assert!(same_offset(&rec, &recorded_offset(&long, 8)));
        assert!(same_offset(&rec, &long));
        let mut other = long.clone();
        other["count"] = json!(401);
        assert!(!same_offset(&rec, &recorded_offset(&other, 8)));
        assert!(!same_offset(
            &small,
            &json!({"partitions": {"t": {"0": 6}}})
        ));
    }

    #[test]
    fn the_fingerprint_ignores_layout_but_not_content() {
        let a = sql_fingerprint("INSERT INTO t\n  SELECT a FROM s");
        assert_eq!(a, sql_fingerprint("INSERT INTO t SELECT a   FROM s"));
        assert_ne!(a, sql_fingerprint("INSERT INTO t SELECT b FROM s"));
        assert!(a.starts_with("sha256:"));
    }
}
