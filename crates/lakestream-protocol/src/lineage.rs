//! Lineage: what each commit records of where its rows came from.
//!
//! Every commit the engine makes carries a [`CommitLineage`] in the sink's
//! commit metadata (Delta: `commitInfo.lakestream`): the batch id, query
//! id, a fingerprint of the query, the batch's row counts and, per source,
//! the exact range it read: `{"start": .., "end": ..}` in the source's own
//! offset terms, the same values `offsets/N` holds. An offset whose JSON is
//! longer than [`INLINE_OFFSET_BYTES`] (a long list of files) is recorded
//! as its digest ([`recorded_offset`]) with a pointer to `offsets/N`, which
//! holds it in full while the checkpoint retains the batch. `lakestream
//! table lineage` prints these; `lakestream verify` checks them against the
//! checkpoint and against each other (each batch starts where the previous
//! one ended).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
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

/// An offset recorded as its digest ([`recorded_offset`]): the full offset
/// is in the checkpoint while it retains the batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedDigest {
    /// The SHA-256 of the offset's JSON, hex.
    pub sha256: String,
    /// The length of that JSON.
    pub bytes: Option<u64>,
    /// Where the checkpoint holds it (`offsets/<batch id>`).
    pub checkpoint: String,
}

impl RecordedDigest {
    /// The digest `recorded` stands for, when it is one.
    pub fn of(recorded: &Value) -> Option<Self> {
        let o = recorded.as_object().filter(|o| o.len() == 3)?;
        Some(Self {
            sha256: o.get("sha256")?.as_str()?.to_string(),
            bytes: o.get("bytes")?.as_u64(),
            checkpoint: o.get("checkpoint")?.as_str()?.to_string(),
        })
    }
}

/// The digest a recorded offset stands for: its own `sha256` when it was
/// recorded as a digest, else the digest of its JSON.
fn digest_of(recorded: &Value) -> String {
    RecordedDigest::of(recorded)
        .map_or_else(|| sha256_hex(recorded.to_string().as_bytes()), |d| d.sha256)
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

/// The format version of [`CommitLineage`] this build writes. Commits
/// written before the record carried a version read as version 1.
pub const LINEAGE_VERSION: u32 = 1;

fn version_one() -> u32 {
    1
}

/// What one commit records of the batch it holds
/// (`commitInfo.lakestream`, camelCase keys). Every field but the ids is
/// optional on reading, so commits of older builds read back.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CommitLineage {
    /// The record's format ([`LINEAGE_VERSION`]).
    #[serde(default = "version_one")]
    pub lineage_version: u32,
    /// The query that committed (its checkpoint's query id).
    #[serde(default)]
    pub query_id: String,
    /// The batch.
    #[serde(default)]
    pub batch_id: u64,
    /// [`sql_fingerprint`] of the output's query.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sql_fingerprint: Option<String>,
    /// The build that wrote it (`lakestream <version>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    /// Each source's range in words, as progress shows it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sources: BTreeMap<String, String>,
    /// Each source's exact range, as `offsets/N` holds it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub ranges: BTreeMap<String, RangeRecord>,
    /// Rows the batch read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_rows: Option<u64>,
    /// Rows this commit wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_rows: Option<u64>,
    /// Input each source left out of the batch (files skipped, say), in the
    /// source's terms.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub skipped: BTreeMap<String, Value>,
    /// Records each source rejected into the dead letters.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub dead_letters: BTreeMap<String, u64>,
    /// The event-time watermark the batch ran with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watermark_ms: Option<i64>,
    /// The version of each static table the batch joined.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub static_tables: BTreeMap<String, u64>,
    /// Group mode: each partition position's `[from, to]` this commit
    /// moves, as the positions kept in the table.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub positions: BTreeMap<String, (i64, i64)>,
}

/// One source's range in a commit's lineage.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RangeRecord {
    /// What the source reads (`kind[location]`).
    #[serde(default)]
    pub source: String,
    /// Where the range starts ([`recorded_offset`]), null for a first
    /// batch without a resolved start.
    #[serde(default)]
    pub start: Value,
    /// Where it ends ([`recorded_offset`]).
    #[serde(default)]
    pub end: Value,
}

impl CommitLineage {
    /// The lineage in a commit's metadata map, if it holds one: `None` for
    /// another writer's commit (no `batchId`), an error naming the field
    /// for a record that does not parse.
    pub fn from_value(v: &Value) -> Option<Result<Self, String>> {
        let o = v.as_object()?;
        o.get("batchId")?;
        Some(serde_json::from_value(v.clone()).map_err(|e| e.to_string()))
    }

    /// The record as a JSON object, for the sink's commit metadata.
    pub fn to_map(&self) -> serde_json::Map<String, Value> {
        match serde_json::to_value(self) {
            Ok(Value::Object(m)) => m,
            _ => unreachable!("a struct serializes to an object"),
        }
    }
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
    #[test]
    fn lineage_round_trips_and_old_records_read_back() {
        let mut l = CommitLineage {
            lineage_version: LINEAGE_VERSION,
            query_id: "q".into(),
            batch_id: 3,
            input_rows: Some(10),
            ..Default::default()
        };
        l.ranges.insert(
            "events".into(),
            RangeRecord {
                source: "files[/in]".into(),
                start: Value::Null,
                end: json!({"count": 2}),
            },
        );
        l.positions.insert("t-0".into(), (4, 9));
        let v = Value::Object(l.to_map());
        assert_eq!(v["positions"]["t-0"], json!([4, 9]));
        assert_eq!(v["inputRows"], 10);
        assert!(v.get("deadLetters").is_none());
        assert_eq!(CommitLineage::from_value(&v), Some(Ok(l)));
        // A record written before the version existed.
        let old = json!({"batchId": 0, "queryId": "q", "engine": "lakestream 0.1.0"});
        let read = CommitLineage::from_value(&old).unwrap().unwrap();
        assert_eq!(read.lineage_version, 1);
        assert_eq!(read.engine.as_deref(), Some("lakestream 0.1.0"));
        // Another writer's commit metadata is no lineage; a damaged one says why.
        assert_eq!(CommitLineage::from_value(&json!({"note": 1})), None);
        let bad = CommitLineage::from_value(&json!({"batchId": "x"})).unwrap();
        assert!(bad.unwrap_err().contains("invalid type"));
    }
}
