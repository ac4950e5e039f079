//! Operator state of lakestream's stateful queries.
//!
//! A [`StateStore`] holds one operator's keyed state (say, the partial
//! aggregates of every open window) as Arrow rows in memory, grouped in
//! *buckets* by the event time at which they may be evicted (a window's end;
//! `i64::MAX` for keys that never expire). It is versioned by batch id:
//! batch N reads the state as of N−1 and [`StateStore::commit`]s N's, durably,
//! before the sink commits batch N. A replay of N loads N−1 again, so the
//! table and the state both come out as in a failure-free run.
//!
//! On disk, under the checkpoint, `state/<operator>/`:
//! - `<N>.delta.arrow`: what batch N changed (rows upserted, keys removed),
//!   written for every batch, empty or not, so the chain of versions has no
//!   gaps and each carries the operator's metadata (the event times seen);
//! - `<N>.snapshot.arrow`: the whole state after batch N, every
//!   [`SNAPSHOT_INTERVAL`] batches, so a restart reads one snapshot and the
//!   deltas after it rather than the query's whole history. It is built in
//!   the background from the files alone (the previous snapshot and the
//!   deltas since, merged in key order a batch at a time), so no batch pays
//!   for the size of the state; a restart writes one that was due and is
//!   missing.
//!
//! In memory, each bucket keeps its keys and values (arrow-row encoded) in
//! one arena with a hash table of offsets, and the bytes all its keys
//! begin with (a window's bucket: the window) once, not in every entry;
//! files are read and written an Arrow batch at a time, so neither a load
//! nor a commit holds a second copy of a large state.
//!
//! Both are Arrow IPC files of the state's columns plus
//! `__lakestream_bucket` (Int64) and `__lakestream_removed` (Boolean); the
//! schema's metadata `lakestream.state` holds a JSON object with the format
//! version, operator, batch id and the operator's metadata. A file whose
//! columns differ from the running query's is refused: the query changed
//! in a way its state cannot follow.

mod files;
mod store;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use arrow::array::{ArrayRef, BooleanArray, Int64Array, RecordBatch, new_null_array};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use arrow::error::ArrowError;
use arrow::row::{RowConverter, SortField};
use lakestream_storage::Location;
use object_store::ObjectStoreExt;

use files::{FileOut, Files};

/// The version of the state file format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// A full snapshot is written after every this many batches.
pub const SNAPSHOT_INTERVAL: u64 = 10;

/// Rows per slice of an upsert, and at most per Arrow batch of a state
/// file: what an upsert or a commit holds in Arrow form at once.
const CHUNK: usize = 65_536;

/// Rows per Arrow batch a commit writes: what a background snapshot holds
/// of each file it merges.
const FILE_CHUNK: usize = 16_384;

const BUCKET: &str = "__lakestream_bucket";
const REMOVED: &str = "__lakestream_removed";
const META: &str = "lakestream.state";

/// Errors of the state store; each names the operator and, where there is
/// one, the file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing a state file failed.
    #[error(transparent)]
    Storage(#[from] lakestream_storage::Error),
    /// A state file cannot be read.
    #[error(
        "the state file {file} is corrupt ({reason}); restore it from a backup, or start the \
         query with a new checkpoint (its state is rebuilt from the input that checkpoint reads)"
    )]
    Corrupt {
        /// The file's URL.
        file: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A version the query needs has no file.
    #[error(
        "the state of operator {operator} as of batch {batch_id} is missing ({file} not found); \
         was the checkpoint's state/ directory removed, or was this checkpoint written by a \
         query without this operator? Start with a new checkpoint"
    )]
    Missing {
        /// The operator.
        operator: String,
        /// The batch whose state is missing.
        batch_id: u64,
        /// The file that should hold it.
        file: String,
    },
    /// The stored state has other columns than the running query keeps.
    #[error(
        "the state of operator {operator} in {file} was written by a different query: it keeps \
         ({found}) where this query keeps ({expected}); a changed GROUP BY or aggregate cannot \
         reuse the old state: start the changed query with a new checkpoint"
    )]
    Changed {
        /// The operator.
        operator: String,
        /// The file read.
        file: String,
        /// Its columns.
        found: String,
        /// The running query's columns.
        expected: String,
    },
    /// A column type the store cannot hold.
    #[error(
        "operator {operator} cannot keep column {column} of type {data_type} in its state; \
         change the query so it does not aggregate or group by that type"
    )]
    Unsupported {
        /// The operator.
        operator: String,
        /// The column.
        column: String,
        /// Its type.
        data_type: DataType,
    },
    /// A background snapshot task could not be joined (it panicked).
    #[error(
        "operator {operator}: the background state snapshot failed: {reason}; please report this"
    )]
    Background {
        /// The operator.
        operator: String,
        /// What happened.
        reason: String,
    },
    /// Arrow failed on rows the store built (a bug).
    #[error("operator {operator}: {source}; please report this")]
    Arrow {
        /// The operator.
        operator: String,
        /// Arrow's error.
        #[source]
        source: ArrowError,
    },
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An entry's offset in its bucket's arena, in 5 bytes (arenas up to
/// 1 TiB): a hash slot costs 6 bytes, not 9.
type Offset = [u8; 5];

fn pack(at: usize) -> Offset {
    assert!(at < 1 << 40, "a state bucket of more than 1 TiB");
    let b = (at as u64).to_le_bytes();
    [b[0], b[1], b[2], b[3], b[4]]
}

fn unpack(o: Offset) -> usize {
    let mut b = [0u8; 8];
    b[..5].copy_from_slice(&o);
    u64::from_le_bytes(b) as usize
}

/// Append `n` as a LEB128 varint.
fn put_len(data: &mut Vec<u8>, mut n: usize) {
    while n >= 0x80 {
        data.push((n as u8) | 0x80);
        n >>= 7;
    }
    data.push(n as u8);
}

/// The varint at the start of `d` and its length in bytes.
fn get_len(d: &[u8]) -> (usize, usize) {
    let (mut n, mut shift, mut i) = (0usize, 0, 0);
    loop {
        let b = d[i];
        n |= ((b & 0x7f) as usize) << shift;
        i += 1;
        if b < 0x80 {
            return (n, i);
        }
        shift += 7;
    }
}

/// The key and value of the entry at `at` in an arena, and the entry's
/// length in bytes.
fn entry_at(data: &[u8], at: usize) -> (&[u8], &[u8], usize) {
    let d = &data[at..];
    let (k, a) = get_len(d);
    let (v, b) = get_len(&d[a..]);
    let key = a + b;
    (&d[key..key + k], &d[key + k..key + k + v], key + k + v)
}

/// The keys and values of one bucket in one arena: each entry (its key's
/// and value's lengths as varints, the key, the value) back to back in
/// `data`, and a hash table of their offsets by key. A group costs its
/// encoded bytes, two bytes of lengths and a 6-byte hash slot, not an
/// allocation of its own. A value replaced by one of the same length
/// (every fixed-width aggregate) is overwritten in place; otherwise the
/// old entry becomes dead bytes, and the arena is compacted once they
/// outweigh the live ones.
///
/// The bytes every key of the bucket begins with are kept once, in
/// `prefix`, and each entry holds the rest of its key. In a window's
/// bucket that is the window itself (every group of a bucket shares its
/// window, and the window comes first in the key when it comes first in
/// the `GROUP BY`) and the high bytes of integer keys. The first key sets
/// the prefix; a key that differs from it cuts it short, and every entry
/// is rewritten once with the bytes it no longer shares (at most once per
/// byte of the key over the bucket's life, so rare and bounded).
#[derive(Default)]
struct Rows {
    data: Vec<u8>,
    table: hashbrown::HashTable<Offset>,
    /// Bytes of `data` no live entry uses.
    dead: usize,
    hasher: std::hash::RandomState,
    /// The bytes every key held begins with.
    prefix: Vec<u8>,
}

impl Rows {
    fn hash(&self, rest: &[u8]) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(rest)
    }

    /// The offset of the entry of `key`, if held.
    fn find(&self, key: &[u8]) -> Option<usize> {
        let rest = key.strip_prefix(&self.prefix[..])?;
        self.table
            .find(self.hash(rest), |&at| {
                entry_at(&self.data, unpack(at)).0 == rest
            })
            .map(|&at| unpack(at))
    }

    fn append(data: &mut Vec<u8>, rest: &[u8], value: &[u8]) -> Offset {
        let at = pack(data.len());
        put_len(data, rest.len());
        put_len(data, value.len());
        data.extend_from_slice(rest);
        data.extend_from_slice(value);
        at
    }

    /// Make `key` begin with the prefix: the first key of an empty bucket
    /// becomes it; a key differing from it cuts it to what they share.
    fn fit_prefix(&mut self, key: &[u8]) {
        if self.table.is_empty() {
            self.data.clear();
            self.dead = 0;
            self.prefix.clear();
            self.prefix.extend_from_slice(key);
            return;
        }
        if key.starts_with(&self.prefix) {
            return;
        }
        let shared = self
            .prefix
            .iter()
            .zip(key)
            .take_while(|(a, b)| a == b)
            .count();
        let moved = self.prefix.split_off(shared);
        let mut data =
            Vec::with_capacity(self.data.len() - self.dead + self.table.len() * moved.len());
        let mut rest = Vec::new();
        let mut offsets = Vec::with_capacity(self.table.len());
        for &at in self.table.iter() {
            let (k, v, _) = entry_at(&self.data, unpack(at));
            rest.clear();
            rest.extend_from_slice(&moved);
            rest.extend_from_slice(k);
            offsets.push(Self::append(&mut data, &rest, v));
        }
        self.data = data;
        self.dead = 0;
        self.table.clear();
        let (data, hasher) = (&self.data, &self.hasher);
        let hash = |a: &Offset| {
            use std::hash::BuildHasher;
            hasher.hash_one(entry_at(data, unpack(*a)).0)
        };
        for at in offsets {
            self.table.insert_unique(hash(&at), at, hash);
        }
    }

    /// Set `key`'s value; the replaced value's length, if any.
    fn insert(&mut self, key: &[u8], value: &[u8]) -> Option<usize> {
        self.fit_prefix(key);
        let rest = &key[self.prefix.len()..];
        let hash = self.hash(rest);
        let data = &mut self.data;
        match self
            .table
            .find_mut(hash, |&at| entry_at(data, unpack(at)).0 == rest)
        {
            Some(at) => {
                let (_, old, len) = entry_at(data, unpack(*at));
                let old = old.len();
                if old == value.len() {
                    let end = unpack(*at) + len;
                    data[end - old..end].copy_from_slice(value);
                } else {
                    self.dead += len;
                    *at = Self::append(data, rest, value);
                    self.compact_if_sparse();
                }
                Some(old)
            }
            None => {
                let at = Self::append(data, rest, value);
                let hasher = &self.hasher;
                self.table.insert_unique(hash, at, |&a| {
                    use std::hash::BuildHasher;
                    hasher.hash_one(entry_at(data, unpack(a)).0)
                });
                None
            }
        }
    }

    /// Remove `key`; its value's length, if it was held.
    fn remove(&mut self, key: &[u8]) -> Option<usize> {
        let rest = key.strip_prefix(&self.prefix[..])?;
        let hash = self.hash(rest);
        let data = &self.data;
        let entry = self
            .table
            .find_entry(hash, |&at| entry_at(data, unpack(at)).0 == rest)
            .ok()?;
        let (at, _) = entry.remove();
        let (_, old, len) = entry_at(&self.data, unpack(at));
        let old = old.len();
        self.dead += len;
        if self.table.is_empty() {
            self.data = Vec::new();
            self.dead = 0;
            self.prefix = Vec::new();
        } else {
            self.compact_if_sparse();
        }
        Some(old)
    }

    /// Copy the live entries into a new arena once dead bytes outweigh
    /// them (and are worth a copy).
    fn compact_if_sparse(&mut self) {
        if self.dead < 64 * 1024 || self.dead * 2 < self.data.len() {
            return;
        }
        let mut data = Vec::with_capacity(self.data.len() - self.dead);
        for at in self.table.iter_mut() {
            let from = unpack(*at);
            let len = entry_at(&self.data, from).2;
            *at = pack(data.len());
            data.extend_from_slice(&self.data[from..from + len]);
        }
        self.data = data;
        self.dead = 0;
    }

    fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.find(key).map(|at| entry_at(&self.data, at).1)
    }

    fn contains_key(&self, key: &[u8]) -> bool {
        self.find(key).is_some()
    }

    fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// The bytes every key held begins with.
    fn prefix(&self) -> &[u8] {
        &self.prefix
    }

    /// Every entry as (its key without [`Self::prefix`], its value).
    fn entries(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.table.iter().map(|&at| {
            let (k, v, _) = entry_at(&self.data, unpack(at));
            (k, v)
        })
    }

    /// Every entry as [`Self::entries`] gives it, ordered by key (what a
    /// state file holds, so a replay writes the same bytes).
    fn sorted(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let key = |at: Offset| entry_at(&self.data, unpack(at)).0;
        let mut order: Vec<Offset> = self.table.iter().copied().collect();
        order.sort_unstable_by(|&a, &b| key(a).cmp(key(b)));
        order.into_iter().map(move |at| {
            let (k, v, _) = entry_at(&self.data, unpack(at));
            (k, v)
        })
    }
}

/// Whole keys built from a bucket's prefix and its entries' rests, back to
/// back in one buffer: what decoding keys into Arrow reads.
#[derive(Default)]
struct KeyBuf {
    data: Vec<u8>,
    ends: Vec<usize>,
}

impl KeyBuf {
    fn push(&mut self, prefix: &[u8], rest: &[u8]) {
        self.data.extend_from_slice(prefix);
        self.data.extend_from_slice(rest);
        self.ends.push(self.data.len());
    }

    fn clear(&mut self) {
        self.data.clear();
        self.ends.clear();
    }

    fn keys(&self) -> Vec<&[u8]> {
        let mut start = 0;
        self.ends
            .iter()
            .map(|&end| {
                let k = &self.data[start..end];
                start = end;
                k
            })
            .collect()
    }
}

/// The row encoding of a store's key or value columns; with none (a
/// deduplication keeps keys only; an aggregation without `GROUP BY` has
/// one group) every row encodes as empty.
struct Values(Option<RowConverter>);

/// A batch's rows, encoded into one buffer: row `i`'s bytes by index, no
/// allocation per row.
enum Encoded {
    /// `n` rows of no columns, each empty.
    Empty(usize),
    Rows(arrow::row::Rows),
}

impl Encoded {
    fn len(&self) -> usize {
        match self {
            Self::Empty(n) => *n,
            Self::Rows(r) => r.num_rows(),
        }
    }

    /// Row `i`'s bytes.
    fn get(&self, i: usize) -> &[u8] {
        match self {
            Self::Empty(_) => &[],
            Self::Rows(r) => r.row(i).data(),
        }
    }

    fn iter(&self) -> impl Iterator<Item = &[u8]> {
        (0..self.len()).map(|i| self.get(i))
    }
}

impl Values {
    /// Each of the `n` rows of `columns`, encoded.
    fn encode(&self, columns: &[ArrayRef], n: usize) -> Result<Encoded, ArrowError> {
        match &self.0 {
            None => Ok(Encoded::Empty(n)),
            Some(c) => Ok(Encoded::Rows(c.convert_columns(columns)?)),
        }
    }

    /// The columns of `values` (encoded rows).
    fn decode(&self, values: &[&[u8]]) -> Result<Vec<ArrayRef>, ArrowError> {
        match &self.0 {
            None => Ok(Vec::new()),
            Some(c) => {
                let p = c.parser();
                c.convert_rows(values.iter().map(|v| p.parse(v)))
            }
        }
    }
}

/// A secondary index of a store's keys by some of their columns: the
/// sessions of a session window are looked up by their group keys without
/// the window. Not written to disk; rebuilt as the state is loaded.
struct Index {
    /// The indexed key columns.
    columns: Vec<usize>,
    rows: Values,
    /// Index key → (key → bucket) of the keys held with that index key.
    map: HashMap<Box<[u8]>, KeyBuckets>,
}

/// The keys under one index key, each with its bucket.
type KeyBuckets = HashMap<Box<[u8]>, i64>;

impl Index {
    fn encode(&self, batch: &RecordBatch) -> Result<Encoded, ArrowError> {
        let columns: Vec<ArrayRef> = self
            .columns
            .iter()
            .map(|&i| batch.column(i).clone())
            .collect();
        self.rows.encode(&columns, batch.num_rows())
    }

    fn insert(&mut self, prefix: Box<[u8]>, key: Box<[u8]>, bucket: i64) {
        self.map.entry(prefix).or_default().insert(key, bucket);
    }

    fn remove(&mut self, prefix: &[u8], key: &[u8]) {
        if let Some(keys) = self.map.get_mut(prefix) {
            keys.remove(key);
            if keys.is_empty() {
                self.map.remove(prefix);
            }
        }
    }
}

/// The `(bucket, key)`s changed since the last commit, each once: upserted
/// when the bucket holds the key at the commit, removed when not. Values
/// are not copied: the commit reads them from the buckets. Entries (the
/// bucket, the key's length as a varint, the key) lie back to back in one
/// arena with a hash table of their offsets, as in [`Rows`]: a changed
/// key costs its bytes and a few more, not an allocation of its own.
#[derive(Default)]
struct Changes {
    data: Vec<u8>,
    table: hashbrown::HashTable<Offset>,
    hasher: std::hash::RandomState,
}

impl Changes {
    fn entry(data: &[u8], at: usize) -> (i64, &[u8]) {
        let bucket = i64::from_le_bytes(data[at..at + 8].try_into().expect("8 bytes"));
        let (len, n) = get_len(&data[at + 8..]);
        let key = at + 8 + n;
        (bucket, &data[key..key + len])
    }

    fn hash(hasher: &std::hash::RandomState, bucket: i64, key: &[u8]) -> u64 {
        use std::hash::BuildHasher;
        hasher.hash_one((bucket, key))
    }

    fn insert(&mut self, bucket: i64, key: &[u8]) {
        let hash = Self::hash(&self.hasher, bucket, key);
        let data = &mut self.data;
        if self
            .table
            .find(hash, |&at| Self::entry(data, unpack(at)) == (bucket, key))
            .is_some()
        {
            return;
        }
        let at = pack(data.len());
        data.extend_from_slice(&bucket.to_le_bytes());
        put_len(data, key.len());
        data.extend_from_slice(key);
        let hasher = &self.hasher;
        self.table.insert_unique(hash, at, |&a| {
            let (b, k) = Self::entry(data, unpack(a));
            Self::hash(hasher, b, k)
        });
    }

    fn len(&self) -> usize {
        self.table.len()
    }

    fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Forget every change, and the memory they held.
    fn clear(&mut self) {
        self.data = Vec::new();
        self.table = hashbrown::HashTable::new();
    }

    fn iter(&self) -> impl Iterator<Item = (i64, &[u8])> {
        self.table
            .iter()
            .map(|&at| Self::entry(&self.data, unpack(at)))
    }

    /// Keep only the changes `keep` says yes to.
    fn retain(&mut self, mut keep: impl FnMut(i64, &[u8]) -> bool) {
        let mut kept = Changes::default();
        for (bucket, key) in self.iter() {
            if keep(bucket, key) {
                kept.insert(bucket, key);
            }
        }
        *self = kept;
    }
}

pub use store::StateStore;

/// What the newest state file of one operator says about its state.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The operator (`aggregate`, `session`, `dedup`).
    pub operator: String,
    /// The batch the state is as of.
    pub batch_id: u64,
    /// Keys held after that batch.
    pub rows: u64,
    /// Bytes of the keys and values held (their row encoding).
    pub bytes: u64,
    /// The operator's metadata (the largest event time seen per source).
    pub meta: serde_json::Value,
}

/// The state of each operator under the checkpoint at `location`, as of
/// the newest batch at or before `through` (the last committed batch;
/// `None`: the newest written), read from that batch's delta file header.
/// Empty when the query keeps no state.
pub async fn summaries(location: &Location, through: Option<u64>) -> Result<Vec<Summary>> {
    let dir = location.child("state");
    let metas = files::list_dir(location, &dir).await?;
    // operator → newest delta batch id within `through`.
    let mut newest: BTreeMap<String, (u64, object_store::path::Path)> = BTreeMap::new();
    for m in metas {
        let parts: Vec<String> = m.location.parts().map(|p| p.as_ref().to_string()).collect();
        let [.., operator, name] = parts.as_slice() else {
            continue;
        };
        let Some(id) = name
            .strip_suffix(".delta.arrow")
            .and_then(|id| id.parse::<u64>().ok())
        else {
            continue;
        };
        if through.is_some_and(|t| id > t) {
            continue;
        }
        let e = newest
            .entry(operator.to_string())
            .or_insert((id, m.location.clone()));
        if id >= e.0 {
            *e = (id, m.location.clone());
        }
    }
    let mut out = Vec::new();
    for (operator, (batch_id, path)) in newest {
        let file = location.url_of(&path);
        let corrupt = |reason: String| Error::Corrupt {
            file: file.clone(),
            reason,
        };
        let Some(bytes) = location.read(&path).await? else {
            continue; // purged meanwhile
        };
        let reader = arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(bytes), None)
            .map_err(|e| corrupt(e.to_string()))?;
        let header: serde_json::Value = reader
            .schema()
            .metadata()
            .get(META)
            .and_then(|m| serde_json::from_str(m).ok())
            .ok_or_else(|| corrupt(format!("no {META} metadata")))?;
        let number = |k: &str| header.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
        out.push(Summary {
            operator,
            batch_id,
            rows: number("rows"),
            bytes: number("bytes"),
            meta: header.get("meta").cloned().unwrap_or_default(),
        });
    }
    Ok(out)
}

fn describe(schema: &Schema) -> String {
    schema
        .fields()
        .iter()
        .filter(|f| f.name() != BUCKET && f.name() != REMOVED)
        .map(|f| format!("{} {}", f.name(), f.data_type()))
        .collect::<Vec<_>>()
        .join(", ")
}
