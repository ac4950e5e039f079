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

/// A row a delta file upserts: its bucket, its key as a prefix and the
/// rest (see [`Rows`]), its value.
type Upsert<'a> = (i64, &'a [u8], &'a [u8], &'a [u8]);

/// One operator's keyed state (see the crate docs).
pub struct StateStore {
    key_rows: Values,
    value_rows: Values,
    buckets: BTreeMap<i64, Rows>,
    /// Changes since the last commit.
    pending: Changes,
    /// The batch the state in memory is as of (`None`: before the first).
    version: Option<u64>,
    loaded: bool,
    meta: serde_json::Value,
    rows: u64,
    bytes: u64,
    snapshot_interval: u64,
    index: Option<Index>,
    /// The batch upserted most of the state: the commit writes every row
    /// held as an upsert, and `pending` tracks removals only (a copy of
    /// every changed key would double the keys' memory).
    dirty_all: bool,
    files: Files,
    /// The snapshot being written in the background, if any.
    snapshot: Option<tokio::task::JoinHandle<Result<()>>>,
}

impl std::fmt::Debug for StateStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateStore")
            .field("operator", &self.files.operator)
            .field("version", &self.version)
            .field("rows", &self.rows)
            .finish()
    }
}

impl StateStore {
    /// A store for `operator` under the checkpoint at `location`, keeping
    /// rows of `schema`: its first `keys` columns are the key, the rest the
    /// value. Nothing is read until [`StateStore::load`].
    pub fn new(location: Location, operator: &str, schema: SchemaRef, keys: usize) -> Result<Self> {
        let sort_fields = |fields: &[Arc<Field>]| -> Result<Vec<SortField>> {
            fields
                .iter()
                .map(|f| {
                    let sf = SortField::new(f.data_type().clone());
                    if RowConverter::supports_fields(std::slice::from_ref(&sf)) {
                        Ok(sf)
                    } else {
                        Err(Error::Unsupported {
                            operator: operator.to_string(),
                            column: f.name().clone(),
                            data_type: f.data_type().clone(),
                        })
                    }
                })
                .collect()
        };
        let fields = schema.fields();
        let arrow_err = |source| Error::Arrow {
            operator: operator.to_string(),
            source,
        };
        let key_rows = match &fields[..keys] {
            [] => Values(None),
            k => Values(Some(RowConverter::new(sort_fields(k)?).map_err(arrow_err)?)),
        };
        let value_rows = match &fields[keys..] {
            [] => Values(None),
            v => Values(Some(RowConverter::new(sort_fields(v)?).map_err(arrow_err)?)),
        };
        let files = Files {
            location,
            operator: operator.to_string(),
            schema,
            keys,
        };
        Ok(Self {
            key_rows,
            value_rows,
            buckets: BTreeMap::new(),
            pending: Changes::default(),
            version: None,
            loaded: false,
            meta: serde_json::Value::Null,
            rows: 0,
            bytes: 0,
            snapshot_interval: SNAPSHOT_INTERVAL,
            index: None,
            dirty_all: false,
            files,
            snapshot: None,
        })
    }

    /// Index the keys by the key columns `columns` (positions among the
    /// key columns), for [`Self::lookup_indexed`]. Call before loading.
    pub fn with_index(mut self, columns: Vec<usize>) -> Result<Self> {
        let fields = self.files.schema.fields();
        let sort_fields: Vec<SortField> = columns
            .iter()
            .filter(|&&i| i < self.files.keys)
            .map(|&i| SortField::new(fields[i].data_type().clone()))
            .collect();
        let rows = if sort_fields.is_empty() {
            Values(None)
        } else {
            Values(Some(
                RowConverter::new(sort_fields).map_err(self.arrow_err())?,
            ))
        };
        let columns = columns
            .into_iter()
            .filter(|&i| i < self.files.keys)
            .collect();
        self.index = Some(Index {
            columns,
            rows,
            map: HashMap::new(),
        });
        Ok(self)
    }

    /// Write a snapshot after every `n` batches instead of
    /// [`SNAPSHOT_INTERVAL`].
    pub fn with_snapshot_interval(mut self, n: u64) -> Self {
        self.snapshot_interval = n.max(1);
        self
    }

    /// The operator's name.
    pub fn operator(&self) -> &str {
        &self.files.operator
    }

    /// The schema of the rows kept (key columns, then value columns).
    pub fn schema(&self) -> &SchemaRef {
        &self.files.schema
    }

    /// True when the state in memory is the state as of `version`.
    pub fn is_at(&self, version: Option<u64>) -> bool {
        self.loaded && self.version == version && self.pending.is_empty() && !self.dirty_all
    }

    /// The operator metadata committed with the state in memory
    /// (`null` before the first batch).
    pub fn meta(&self) -> &serde_json::Value {
        &self.meta
    }

    /// Keys held.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Bytes of the keys and values held (their row encoding).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes of memory the keys and values take as held: each bucket's
    /// arena (live and dead entries) and prefix, and its hash table.
    /// Lower than [`Self::bytes`] when a bucket's keys share their first
    /// bytes; what the process holds besides is the allocator's.
    pub fn memory(&self) -> u64 {
        self.buckets
            .values()
            .map(|r| (r.data.len() + r.prefix.len() + r.table.allocation_size()) as u64)
            .sum()
    }

    /// The smallest bucket holding a key, if any.
    pub fn first_bucket(&self) -> Option<i64> {
        self.buckets.keys().next().copied()
    }

    fn file(&self, batch_id: u64, kind: &str) -> object_store::path::Path {
        self.files.path(batch_id, kind)
    }

    fn arrow_err(&self) -> impl Fn(ArrowError) -> Error + '_ {
        move |source| Error::Arrow {
            operator: self.files.operator.clone(),
            source,
        }
    }

    /// Replace the state in memory by the state as of batch `version`
    /// (`None`: the empty state before the first batch), read from the
    /// newest snapshot at or before it and the deltas after that.
    pub async fn load(&mut self, version: Option<u64>) -> Result<()> {
        self.buckets.clear();
        self.dirty_all = false;
        if let Some(index) = &mut self.index {
            index.map.clear();
        }
        self.pending.clear();
        self.rows = 0;
        self.bytes = 0;
        self.meta = serde_json::Value::Null;
        self.loaded = false;
        if let Some(v) = version {
            let (snapshots, deltas) = self.list().await?;
            let base = snapshots.iter().rev().find(|&&s| s <= v).copied();
            let first_delta = match base {
                Some(s) => {
                    self.apply_file(s, "snapshot").await?;
                    s + 1
                }
                None => deltas.first().copied().unwrap_or(0).min(v),
            };
            if base.is_none() && first_delta != 0 {
                return Err(self.files.missing(0));
            }
            for id in first_delta..=v {
                if deltas.binary_search(&id).is_err() {
                    return Err(self.files.missing(id));
                }
                self.apply_file(id, "delta").await?;
            }
            // A snapshot that was due and is missing (its process stopped
            // while writing it) is written now.
            let due = (v + 1) / self.snapshot_interval * self.snapshot_interval;
            if let Some(due) = due.checked_sub(1)
                && base.is_none_or(|b| b < due)
            {
                self.start_snapshot(due);
            }
        }
        self.pending.clear();
        self.version = version;
        self.loaded = true;
        Ok(())
    }

    async fn list(&self) -> Result<(Vec<u64>, Vec<u64>)> {
        self.files.list().await
    }

    /// Apply the `kind` file of `batch_id` to the state in memory, an
    /// Arrow batch at a time.
    async fn apply_file(&mut self, batch_id: u64, kind: &str) -> Result<()> {
        let mut file = self.files.open(batch_id, kind).await?;
        let url = file.url.clone();
        let corrupt = |reason: String| Error::Corrupt {
            file: url.clone(),
            reason,
        };
        self.meta = file.header.get("meta").cloned().unwrap_or_default();
        let n = self.files.schema.fields().len();
        while let Some(batch) = file.next_batch().await? {
            let buckets = batch
                .column(n)
                .as_any()
                .downcast_ref::<Int64Array>()
                .ok_or_else(|| corrupt(format!("{BUCKET} is not Int64")))?
                .clone();
            let removed = batch
                .column(n + 1)
                .as_any()
                .downcast_ref::<BooleanArray>()
                .ok_or_else(|| corrupt(format!("{REMOVED} is not Boolean")))?
                .clone();
            let keys = self
                .key_rows
                .encode(&batch.columns()[..self.files.keys], batch.num_rows())
                .map_err(|e| corrupt(e.to_string()))?;
            let values = self
                .value_rows
                .encode(&batch.columns()[self.files.keys..n], batch.num_rows())
                .map_err(|e| corrupt(e.to_string()))?;
            let prefixes = self.prefixes(&batch).map_err(|e| corrupt(e.to_string()))?;
            for (i, (key, value)) in keys.iter().zip(values.iter()).enumerate() {
                let prefix = prefixes.as_ref().map(|p| p.get(i));
                if removed.value(i) {
                    self.remove(buckets.value(i), key, prefix);
                } else {
                    self.put(buckets.value(i), key, value, prefix);
                }
            }
        }
        Ok(())
    }

    /// The index key of each row of `batch`, when the store is indexed.
    fn prefixes(&self, batch: &RecordBatch) -> Result<Option<Encoded>, ArrowError> {
        self.index.as_ref().map(|i| i.encode(batch)).transpose()
    }

    fn put(&mut self, bucket: i64, key: &[u8], value: &[u8], prefix: Option<&[u8]>) {
        if let (Some(index), Some(prefix)) = (&mut self.index, prefix) {
            index.insert(prefix.into(), key.into(), bucket);
        }
        let rows = self.buckets.entry(bucket).or_default();
        let (key_len, value_len) = (key.len() as u64, value.len() as u64);
        match rows.insert(key, value) {
            Some(old) => self.bytes = self.bytes + value_len - old as u64,
            None => {
                self.rows += 1;
                self.bytes += key_len + value_len;
            }
        }
    }

    fn remove(&mut self, bucket: i64, key: &[u8], prefix: Option<&[u8]>) {
        if let (Some(index), Some(prefix)) = (&mut self.index, prefix) {
            index.remove(prefix, key);
        }
        if let Some(rows) = self.buckets.get_mut(&bucket)
            && let Some(old) = rows.remove(key)
        {
            self.rows -= 1;
            self.bytes -= (key.len() + old) as u64;
            if rows.is_empty() {
                self.buckets.remove(&bucket);
            }
        }
    }

    /// The rows held for the keys of `batch` (a batch of [`Self::schema`];
    /// only its key columns are read), each key once, in `buckets[i]` for
    /// row `i`. `None` when none of them is held.
    pub fn lookup(&self, batch: &RecordBatch, buckets: &[i64]) -> Result<Option<RecordBatch>> {
        let keys = self
            .key_rows
            .encode(&batch.columns()[..self.files.keys], batch.num_rows())
            .map_err(self.arrow_err())?;
        let mut seen = std::collections::HashSet::new();
        let (mut found_keys, mut found_values) = (Vec::new(), Vec::new());
        for (key, &bucket) in keys.iter().zip(buckets) {
            if let Some(rows) = self.buckets.get(&bucket)
                && let Some(v) = rows.get(key)
                && seen.insert((bucket, key))
            {
                found_keys.push(key);
                found_values.push(v);
            }
        }
        if found_keys.is_empty() {
            return Ok(None);
        }
        self.to_batch(&found_keys, &found_values).map(Some)
    }

    /// Set the value of every key in `batch` (a batch of [`Self::schema`]),
    /// row `i` in `buckets[i]`.
    pub fn upsert(&mut self, batch: &RecordBatch, buckets: &[i64]) -> Result<()> {
        let n = batch.num_rows();
        for start in (0..n).step_by(CHUNK) {
            let len = CHUNK.min(n - start);
            self.upsert_slice(&batch.slice(start, len), &buckets[start..start + len])?;
            if !self.dirty_all
                && self.pending.len() > CHUNK
                && self.pending.len() as u64 * 2 > self.rows
            {
                // Most of the state changed: the commit writes it all, and
                // only removals need tracking (checked per slice, so a
                // batch opening a million groups never holds a million
                // copies of their keys).
                self.dirty_all = true;
                let held = &self.buckets;
                self.pending
                    .retain(|b, k| !held.get(&b).is_some_and(|rows| rows.contains_key(k)));
            }
        }
        Ok(())
    }

    fn upsert_slice(&mut self, batch: &RecordBatch, buckets: &[i64]) -> Result<()> {
        let keys = self
            .key_rows
            .encode(&batch.columns()[..self.files.keys], batch.num_rows())
            .map_err(self.arrow_err())?;
        let values = self
            .value_rows
            .encode(&batch.columns()[self.files.keys..], batch.num_rows())
            .map_err(self.arrow_err())?;
        let prefixes = self.prefixes(batch).map_err(self.arrow_err())?;
        for (i, ((key, value), &bucket)) in keys.iter().zip(values.iter()).zip(buckets).enumerate()
        {
            if !self.dirty_all {
                self.pending.insert(bucket, key);
            }
            let prefix = prefixes.as_ref().map(|p| p.get(i));
            self.put(bucket, key, value, prefix);
        }
        Ok(())
    }

    /// Remove the keys of `batch` (only its key columns are read), row `i`
    /// from `buckets[i]`.
    pub fn remove_keys(&mut self, batch: &RecordBatch, buckets: &[i64]) -> Result<()> {
        let keys = self
            .key_rows
            .encode(&batch.columns()[..self.files.keys], batch.num_rows())
            .map_err(self.arrow_err())?;
        let prefixes = self.prefixes(batch).map_err(self.arrow_err())?;
        for (i, (key, &bucket)) in keys.iter().zip(buckets).enumerate() {
            let prefix = prefixes.as_ref().map(|p| p.get(i));
            let held = self
                .buckets
                .get(&bucket)
                .is_some_and(|rows| rows.contains_key(key));
            if held {
                self.remove(bucket, key, prefix);
                self.pending.insert(bucket, key);
            }
        }
        Ok(())
    }

    /// Every row held whose indexed columns (see [`Self::with_index`])
    /// equal those of some row of `batch`, with the bucket of each. `None`
    /// when there is none or the store has no index.
    pub fn lookup_indexed(&self, batch: &RecordBatch) -> Result<Option<(RecordBatch, Vec<i64>)>> {
        let Some(index) = &self.index else {
            return Ok(None);
        };
        let prefixes = index.encode(batch).map_err(self.arrow_err())?;
        let mut seen = std::collections::HashSet::new();
        let (mut keys, mut values, mut buckets) = (Vec::new(), Vec::new(), Vec::new());
        for prefix in prefixes.iter() {
            if !seen.insert(prefix) {
                continue;
            }
            let Some(held) = index.map.get(prefix) else {
                continue;
            };
            for (key, &bucket) in held {
                if let Some(v) = self
                    .buckets
                    .get(&bucket)
                    .and_then(|rows| rows.get(key.as_ref()))
                {
                    keys.push(key.as_ref());
                    values.push(v);
                    buckets.push(bucket);
                }
            }
        }
        if keys.is_empty() {
            return Ok(None);
        }
        Ok(Some((self.to_batch(&keys, &values)?, buckets)))
    }

    /// For each row of `batch` (only its key columns are read), the bucket
    /// its key is held in, or `None` when it is not held: for a store whose
    /// rows move between buckets (a key's bucket comes from its value), so
    /// a key is found wherever it is. Needs an index over every key column
    /// (see [`Self::with_index`]); without an index every key is `None`.
    pub fn held_buckets(&self, batch: &RecordBatch) -> Result<Vec<Option<i64>>> {
        let Some(index) = &self.index else {
            return Ok(vec![None; batch.num_rows()]);
        };
        let prefixes = index.encode(batch).map_err(self.arrow_err())?;
        let keys = self
            .key_rows
            .encode(&batch.columns()[..self.files.keys], batch.num_rows())
            .map_err(self.arrow_err())?;
        Ok(prefixes
            .iter()
            .zip(keys.iter())
            .map(|(prefix, key)| {
                index
                    .map
                    .get(prefix)
                    .and_then(|held| held.get(key).copied())
            })
            .collect())
    }

    /// For each row of `batch` (only its key columns are read), whether the
    /// store holds its key in `buckets[i]`.
    pub fn contains(&self, batch: &RecordBatch, buckets: &[i64]) -> Result<Vec<bool>> {
        let keys = self
            .key_rows
            .encode(&batch.columns()[..self.files.keys], batch.num_rows())
            .map_err(self.arrow_err())?;
        Ok(keys
            .iter()
            .zip(buckets)
            .map(|(k, b)| self.buckets.get(b).is_some_and(|rows| rows.contains_key(k)))
            .collect())
    }

    /// Remove and return every row in a bucket at or below `through`.
    pub fn evict_through(&mut self, through: i64) -> Result<Option<RecordBatch>> {
        let kept = self.buckets.split_off(&through.saturating_add(1));
        let evicted = std::mem::replace(&mut self.buckets, kept);
        if evicted.is_empty() {
            return Ok(None);
        }
        let (mut full, mut values, mut of) = (KeyBuf::default(), Vec::new(), Vec::new());
        for (&bucket, rows) in &evicted {
            for (rest, v) in rows.entries() {
                full.push(rows.prefix(), rest);
                values.push(v);
                of.push(bucket);
            }
        }
        let keys = full.keys();
        for (key, &bucket) in keys.iter().zip(&of) {
            self.pending.insert(bucket, key);
        }
        let value_bytes: usize = values.iter().map(|v| v.len()).sum();
        self.rows -= keys.len() as u64;
        self.bytes -= (full.data.len() + value_bytes) as u64;
        let batch = self.to_batch(&keys, &values)?;
        if let Some(prefixes) = self.prefixes(&batch).map_err(self.arrow_err())?
            && let Some(index) = &mut self.index
        {
            for (prefix, key) in prefixes.iter().zip(&keys) {
                index.remove(prefix, key);
            }
        }
        Ok(Some(batch))
    }

    /// Every row held, `None` when there is none.
    pub fn all(&self) -> Result<Option<RecordBatch>> {
        let (mut full, mut values) = (KeyBuf::default(), Vec::new());
        for rows in self.buckets.values() {
            for (rest, v) in rows.entries() {
                full.push(rows.prefix(), rest);
                values.push(v);
            }
        }
        if values.is_empty() {
            return Ok(None);
        }
        self.to_batch(&full.keys(), &values).map(Some)
    }

    fn to_batch(&self, keys: &[&[u8]], values: &[&[u8]]) -> Result<RecordBatch> {
        let mut columns = self.key_rows.decode(keys).map_err(self.arrow_err())?;
        columns.extend(self.value_rows.decode(values).map_err(self.arrow_err())?);
        RecordBatch::try_new_with_options(
            self.files.schema.clone(),
            columns,
            &arrow::array::RecordBatchOptions::new().with_row_count(Some(keys.len())),
        )
        .map_err(self.arrow_err())
    }

    /// Make the changes since the last commit the state as of `batch_id`,
    /// durably (a delta file), with the operator's `meta`. Durable when
    /// this returns; a replay of the same batch overwrites the file with
    /// the same content. The file is written as it is encoded, a chunk of
    /// rows at a time, so a large change is never held twice in memory.
    ///
    /// Every few batches a snapshot of the state as of `batch_id` is then
    /// started in the background, built from the files alone (the newest
    /// snapshot and the deltas after it), so the batch costs what it
    /// changed, not the size of the state; a snapshot still being written
    /// when the next is due makes that one skipped, and a failed one only
    /// makes a restart read more deltas.
    pub async fn commit(&mut self, batch_id: u64, meta: serde_json::Value) -> Result<()> {
        let mut upserts: Vec<Upsert<'_>> = Vec::new();
        let mut removals: Vec<(i64, &[u8])> = Vec::new();
        for (bucket, key) in self.pending.iter() {
            match self.buckets.get(&bucket).and_then(|rows| rows.get(key)) {
                Some(v) if !self.dirty_all => upserts.push((bucket, key, &[], v)),
                Some(_) => {} // written below with every row
                None => removals.push((bucket, key)),
            }
        }
        // Deterministic files: a replay writes the same bytes.
        upserts.sort_unstable();
        removals.sort_unstable();
        if self.dirty_all {
            self.write_delta(batch_id, &meta, self.sorted_rows(), &removals)
                .await?;
        } else {
            self.write_delta(batch_id, &meta, upserts.into_iter(), &removals)
                .await?;
        }
        self.pending.clear();
        self.dirty_all = false;
        self.version = Some(batch_id);
        self.meta = meta;
        self.loaded = true;
        if (batch_id + 1).is_multiple_of(self.snapshot_interval) {
            self.start_snapshot(batch_id);
        }
        Ok(())
    }

    /// Start writing the snapshot of `batch_id` in the background, unless
    /// one is being written.
    fn start_snapshot(&mut self, batch_id: u64) {
        if let Some(task) = &self.snapshot {
            if !task.is_finished() {
                tracing::debug!(
                    operator = %self.files.operator,
                    batch_id,
                    "the previous state snapshot is still being written; this one is skipped"
                );
                return;
            }
            let task = self.snapshot.take().expect("checked above");
            if let Some(Ok(Err(e))) = futures::FutureExt::now_or_never(task) {
                tracing::warn!(
                    operator = %self.files.operator,
                    "a state snapshot failed (a restart reads more deltas): {e}"
                );
            }
        }
        let files = self.files.clone();
        self.snapshot = Some(tokio::spawn(files::snapshot_from_files(files, batch_id)));
    }

    /// Wait for the snapshot being written in the background, if any, and
    /// return how it ended (a clean stop waits, so the next start reads
    /// it; tests wait to see it).
    pub async fn wait_for_snapshot(&mut self) -> Result<()> {
        match self.snapshot.take() {
            None => Ok(()),
            Some(task) => task.await.map_err(|e| Error::Background {
                operator: self.files.operator.clone(),
                reason: e.to_string(),
            })?,
        }
    }

    /// Every row held as (bucket, key prefix, rest of the key, value),
    /// ordered by bucket and key.
    fn sorted_rows(&self) -> impl Iterator<Item = Upsert<'_>> + Send {
        self.buckets.iter().flat_map(|(&bucket, rows)| {
            rows.sorted()
                .map(move |(rest, v)| (bucket, rows.prefix(), rest, v))
        })
    }

    /// Write batch `batch_id`'s delta file: `upserts`, then `removals` (a
    /// reader applies them in this order), a chunk per Arrow batch, each
    /// sent to the store as it is encoded; synced when this returns.
    async fn write_delta<'a>(
        &'a self,
        batch_id: u64,
        meta: &serde_json::Value,
        upserts: impl Iterator<Item = Upsert<'a>> + Send,
        removals: &[(i64, &[u8])],
    ) -> Result<()> {
        let header = serde_json::json!({
            "version": FORMAT_VERSION,
            "operator": self.files.operator,
            "batch_id": batch_id,
            "rows": self.rows,
            "bytes": self.bytes,
            "meta": meta,
        });
        let mut out = FileOut::new(&self.files, self.file(batch_id, "delta"), &header)?;
        let schema = out.schema.clone();
        let mut chunk: Vec<Upsert<'_>> = Vec::with_capacity(CHUNK.min(1024));
        let mut full = KeyBuf::default();
        let mut upserts = upserts.peekable();
        while upserts.peek().is_some() {
            chunk.clear();
            chunk.extend(upserts.by_ref().take(FILE_CHUNK));
            full.clear();
            for u in &chunk {
                full.push(u.1, u.2);
            }
            let keys = full.keys();
            let values: Vec<&[u8]> = chunk.iter().map(|u| u.3).collect();
            let mut columns = self.key_rows.decode(&keys).map_err(self.arrow_err())?;
            columns.extend(self.value_rows.decode(&values).map_err(self.arrow_err())?);
            columns.push(Arc::new(Int64Array::from_iter_values(
                chunk.iter().map(|u| u.0),
            )));
            columns.push(Arc::new(BooleanArray::from(vec![false; chunk.len()])));
            let batch = RecordBatch::try_new(schema.clone(), columns).map_err(self.arrow_err())?;
            out.write(&batch, true).await?;
        }
        let value_fields = &schema.fields()[self.files.keys..self.files.schema.fields().len()];
        for chunk in removals.chunks(FILE_CHUNK) {
            let keys: Vec<&[u8]> = chunk.iter().map(|r| r.1).collect();
            let mut columns = self.key_rows.decode(&keys).map_err(self.arrow_err())?;
            for f in value_fields {
                columns.push(new_null_array(f.data_type(), chunk.len()));
            }
            columns.push(Arc::new(Int64Array::from_iter_values(
                chunk.iter().map(|r| r.0),
            )));
            columns.push(Arc::new(BooleanArray::from(vec![true; chunk.len()])));
            let batch = RecordBatch::try_new_with_options(
                schema.clone(),
                columns,
                &arrow::array::RecordBatchOptions::new().with_row_count(Some(chunk.len())),
            )
            .map_err(self.arrow_err())?;
            out.write(&batch, false).await?;
        }
        out.finish().await
    }

    /// Remove the files no restart can need once batches before
    /// `keep_from` are never replayed: everything older than the newest
    /// snapshot at or before `keep_from − 1`. Best effort; returns the
    /// number of files removed.
    pub async fn purge_before(&self, keep_from: u64) -> Result<usize> {
        let Some(need) = keep_from.checked_sub(1) else {
            return Ok(0);
        };
        let (snapshots, deltas) = self.list().await?;
        let Some(base) = snapshots.iter().rev().find(|&&s| s <= need).copied() else {
            return Ok(0);
        };
        let mut removed = 0;
        let old = snapshots
            .iter()
            .filter(|&&s| s < base)
            .map(|&s| (s, "snapshot"))
            .chain(deltas.iter().filter(|&&d| d <= base).map(|&d| (d, "delta")));
        for (id, kind) in old {
            if self
                .files
                .location
                .store()
                .delete(&self.file(id, kind))
                .await
                .is_ok()
            {
                removed += 1;
            }
        }
        Ok(removed)
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Array, StringArray};

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("k", DataType::Utf8, true),
            Field::new("n", DataType::Int64, false),
        ]))
    }

    fn batch(rows: &[(&str, i64)]) -> RecordBatch {
        RecordBatch::try_new(
            schema(),
            vec![
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.0))),
                Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.1))),
            ],
        )
        .unwrap()
    }

    fn pairs(b: Option<RecordBatch>) -> Vec<(String, i64)> {
        let Some(b) = b else { return Vec::new() };
        let k = b.column(0).as_any().downcast_ref::<StringArray>().unwrap();
        let n = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
        let mut v: Vec<(String, i64)> = (0..b.num_rows())
            .map(|i| (k.value(i).to_string(), n.value(i)))
            .collect();
        v.sort();
        v
    }

    fn store(dir: &std::path::Path) -> StateStore {
        let loc = Location::parse(dir.to_str().unwrap(), &HashMap::new()).unwrap();
        StateStore::new(loc, "agg", schema(), 1)
            .unwrap()
            .with_snapshot_interval(3)
    }

    #[tokio::test]
    async fn committed_versions_load_back_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        s.load(None).await.unwrap();
        s.upsert(&batch(&[("a", 1), ("b", 2)]), &[10, 20]).unwrap();
        s.commit(0, serde_json::json!({"max": 5})).await.unwrap();
        s.upsert(&batch(&[("a", 3)]), &[10]).unwrap();
        assert_eq!(pairs(s.evict_through(10).unwrap()), vec![("a".into(), 3)]);
        s.commit(1, serde_json::json!({"max": 6})).await.unwrap();
        // Batch 2 fails before its commit: its changes never count.
        s.upsert(&batch(&[("c", 9)]), &[30]).unwrap();

        let mut r = store(dir.path());
        r.load(Some(0)).await.unwrap();
        assert_eq!(r.rows(), 2);
        assert_eq!(r.meta(), &serde_json::json!({"max": 5}));
        let probe = batch(&[("a", 0), ("b", 0), ("z", 0)]);
        assert_eq!(
            pairs(r.lookup(&probe, &[10, 20, 20]).unwrap()),
            vec![("a".into(), 1), ("b".into(), 2)]
        );
        r.load(Some(1)).await.unwrap();
        assert_eq!(r.rows(), 1);
        assert_eq!(r.first_bucket(), Some(20));
        assert_eq!(r.meta(), &serde_json::json!({"max": 6}));
        assert!(r.lookup(&probe, &[10, 10, 10]).unwrap().is_none());
        assert!(r.is_at(Some(1)));
    }

    /// State written by a build whose queries' strings were `Utf8View`
    /// loads into a query whose strings are `Utf8`: snapshots and deltas
    /// alike, through a reload and the snapshot merged from both kinds of
    /// file. A column of another type is still refused.
    #[tokio::test]
    async fn state_written_with_string_views_loads_as_plain_strings() {
        use arrow::array::StringViewArray;
        let dir = tempfile::tempdir().unwrap();
        let views = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Utf8View, true),
            Field::new("n", DataType::Int64, false),
        ]));
        let loc = || Location::parse(dir.path().to_str().unwrap(), &HashMap::new()).unwrap();
        let mut old = StateStore::new(loc(), "agg", views.clone(), 1)
            .unwrap()
            .with_snapshot_interval(3);
        old.load(None).await.unwrap();
        for (id, rows) in [
            (0u64, vec![("a", 1i64), ("b", 2)]),
            (1, vec![("c", 3)]),
            (2, vec![("a", 4)]),
            (3, vec![("d", 5)]),
        ] {
            let b = RecordBatch::try_new(
                views.clone(),
                vec![
                    Arc::new(StringViewArray::from_iter_values(rows.iter().map(|r| r.0))),
                    Arc::new(Int64Array::from_iter_values(rows.iter().map(|r| r.1))),
                ],
            )
            .unwrap();
            old.upsert(&b, &vec![10; rows.len()]).unwrap();
            old.commit(id, serde_json::json!({})).await.unwrap();
        }
        old.wait_for_snapshot().await.unwrap();

        // A snapshot (batch 2) and a delta (batch 3), both of views.
        let mut new = store(dir.path());
        new.load(Some(3)).await.unwrap();
        assert_eq!(
            pairs(new.all().unwrap()),
            vec![
                ("a".into(), 4),
                ("b".into(), 2),
                ("c".into(), 3),
                ("d".into(), 5)
            ]
        );
        let probe = batch(&[("a", 0), ("d", 0), ("z", 0)]);
        assert_eq!(
            pairs(new.lookup(&probe, &[10, 10, 10]).unwrap()),
            vec![("a".into(), 4), ("d".into(), 5)]
        );
        // Batches on top, in plain strings: the next snapshot merges the
        // old files with the new ones.
        new.upsert(&batch(&[("b", 7)]), &[10]).unwrap();
        new.commit(4, serde_json::json!({})).await.unwrap();
        new.upsert(&batch(&[("e", 8)]), &[10]).unwrap();
        new.commit(5, serde_json::json!({})).await.unwrap();
        new.wait_for_snapshot().await.unwrap();
        let mut again = store(dir.path());
        again.load(Some(5)).await.unwrap();
        assert_eq!(
            pairs(again.all().unwrap()),
            vec![
                ("a".into(), 4),
                ("b".into(), 7),
                ("c".into(), 3),
                ("d".into(), 5),
                ("e".into(), 8)
            ]
        );

        // Another type for the key is a changed query.
        let ints = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Int64, true),
            Field::new("n", DataType::Int64, false),
        ]));
        let mut other = StateStore::new(loc(), "agg", ints, 1).unwrap();
        let err = other.load(Some(5)).await.unwrap_err();
        assert!(matches!(err, Error::Changed { .. }), "{err}");
    }

    /// Keys (user, session start) indexed by user: a session's state is
    /// found by its user alone, through removals, evictions and a reload.
    #[tokio::test]
    async fn an_index_finds_every_key_sharing_its_columns() {
        let dir = tempfile::tempdir().unwrap();
        let schema = Arc::new(Schema::new(vec![
            Field::new("user", DataType::Utf8, true),
            Field::new("start", DataType::Int64, true),
            Field::new("n", DataType::Int64, true),
        ]));
        let rows = |r: &[(&str, i64, i64)]| {
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(StringArray::from_iter_values(r.iter().map(|r| r.0))),
                    Arc::new(Int64Array::from_iter_values(r.iter().map(|r| r.1))),
                    Arc::new(Int64Array::from_iter_values(r.iter().map(|r| r.2))),
                ],
            )
            .unwrap()
        };
        let found = |s: &StateStore, probe: &RecordBatch| -> Vec<(String, i64, i64, i64)> {
            let Some((b, buckets)) = s.lookup_indexed(probe).unwrap() else {
                return Vec::new();
            };
            let u = b.column(0).as_any().downcast_ref::<StringArray>().unwrap();
            let st = b.column(1).as_any().downcast_ref::<Int64Array>().unwrap();
            let n = b.column(2).as_any().downcast_ref::<Int64Array>().unwrap();
            let mut v: Vec<_> = (0..b.num_rows())
                .map(|i| (u.value(i).to_string(), st.value(i), n.value(i), buckets[i]))
                .collect();
            v.sort();
            v
        };
        let open = |dir: &std::path::Path| {
            let loc = Location::parse(dir.to_str().unwrap(), &HashMap::new()).unwrap();
            StateStore::new(loc, "session", schema.clone(), 2)
                .unwrap()
                .with_index(vec![0])
                .unwrap()
        };
        let mut s = open(dir.path());
        s.load(None).await.unwrap();
        s.upsert(
            &rows(&[("a", 0, 1), ("a", 100, 2), ("b", 5, 3)]),
            &[10, 110, 15],
        )
        .unwrap();
        let probe = rows(&[("a", -1, 0), ("a", -2, 0)]);
        assert_eq!(
            found(&s, &probe),
            vec![("a".into(), 0, 1, 10), ("a".into(), 100, 2, 110)]
        );
        // Session (a, 0) merged away into (a, 100); (b, 5) evicted.
        s.remove_keys(&rows(&[("a", 0, 0)]), &[10]).unwrap();
        s.upsert(&rows(&[("a", 100, 3)]), &[110]).unwrap();
        assert_eq!(s.evict_through(15).unwrap().map(|b| b.num_rows()), Some(1));
        assert_eq!(found(&s, &probe), vec![("a".into(), 100, 3, 110)]);
        assert!(found(&s, &rows(&[("b", 0, 0)])).is_empty());
        s.commit(0, serde_json::Value::Null).await.unwrap();

        let mut r = open(dir.path());
        r.load(Some(0)).await.unwrap();
        assert_eq!(r.rows(), 1);
        assert_eq!(found(&r, &probe), vec![("a".into(), 100, 3, 110)]);
        assert!(found(&r, &rows(&[("b", 0, 0)])).is_empty());
    }

    /// A store indexed by its whole key finds each key's bucket whatever
    /// bucket a caller would compute, through eviction and a reload.
    #[tokio::test]
    async fn held_buckets_find_a_key_in_whichever_bucket_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        let open = || store(dir.path()).with_index(vec![0]).unwrap();
        let mut s = open();
        s.load(None).await.unwrap();
        s.upsert(&batch(&[("a", 1), ("b", 2)]), &[70, 80]).unwrap();
        let probe = batch(&[("a", 9), ("c", 9), ("b", 9)]);
        assert_eq!(
            s.held_buckets(&probe).unwrap(),
            vec![Some(70), None, Some(80)]
        );
        assert_eq!(s.evict_through(75).unwrap().map(|b| b.num_rows()), Some(1));
        assert_eq!(s.held_buckets(&probe).unwrap(), vec![None, None, Some(80)]);
        s.commit(0, serde_json::Value::Null).await.unwrap();
        let mut r = open();
        r.load(Some(0)).await.unwrap();
        assert_eq!(r.held_buckets(&probe).unwrap(), vec![None, None, Some(80)]);
    }

    #[tokio::test]
    async fn snapshots_bound_what_a_restart_reads_and_purge_keeps_what_it_needs() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        s.load(None).await.unwrap();
        for id in 0..7u64 {
            s.upsert(&batch(&[("k", id as i64)]), &[1]).unwrap();
            s.commit(id, serde_json::Value::Null).await.unwrap();
            s.wait_for_snapshot().await.unwrap();
        }
        // Snapshots after batches 2 and 5 (every 3).
        let (snapshots, deltas) = s.list().await.unwrap();
        assert_eq!(snapshots, vec![2, 5]);
        assert_eq!(deltas, (0..7).collect::<Vec<_>>());
        // Batches before 6 are never replayed: the state as of 5 (its
        // snapshot) and later is all a restart needs.
        assert_eq!(s.purge_before(6).await.unwrap(), 7);
        let (snapshots, deltas) = s.list().await.unwrap();
        assert_eq!((snapshots, deltas), (vec![5], vec![6]));
        let mut r = store(dir.path());
        r.load(Some(6)).await.unwrap();
        assert_eq!(
            pairs(r.lookup(&batch(&[("k", 0)]), &[1]).unwrap()),
            vec![("k".into(), 6)]
        );
        let err = r.load(Some(4)).await.unwrap_err();
        assert!(
            err.to_string().contains("as of batch 0 is missing"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_changed_query_and_a_corrupt_file_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        s.load(None).await.unwrap();
        s.upsert(&batch(&[("a", 1)]), &[1]).unwrap();
        s.commit(0, serde_json::Value::Null).await.unwrap();

        let loc = Location::parse(dir.path().to_str().unwrap(), &HashMap::new()).unwrap();
        let other = Arc::new(Schema::new(vec![
            Field::new("k", DataType::Utf8, true),
            Field::new("total", DataType::Float64, true),
        ]));
        let mut changed = StateStore::new(loc, "agg", other, 1).unwrap();
        let err = changed.load(Some(0)).await.unwrap_err().to_string();
        assert!(err.contains("written by a different query"), "{err}");
        assert!(
            err.contains("n Int64") && err.contains("total Float64"),
            "{err}"
        );

        let file = dir.path().join("state/agg/0.delta.arrow");
        std::fs::write(&file, b"not arrow").unwrap();
        let err = store(dir.path())
            .load(Some(0))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("0.delta.arrow is corrupt"), "{err}");
    }

    /// A batch that changes most of a large state (more keys than a file
    /// chunk) writes it whole, in several Arrow batches, with its
    /// removals; a reload gives back exactly the state.
    #[tokio::test]
    async fn a_batch_changing_most_of_a_large_state_loads_back_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        s.load(None).await.unwrap();
        let n = CHUNK as i64 + 5_000;
        let names: Vec<String> = (0..n).map(|i| format!("k{i}")).collect();
        let rows: Vec<(&str, i64)> = names
            .iter()
            .zip(0..n)
            .map(|(k, i)| (k.as_str(), i))
            .collect();
        // Even keys in bucket 1, odd keys in bucket 2.
        let buckets: Vec<i64> = (0..n).map(|i| 1 + i % 2).collect();
        s.upsert(&batch(&rows), &buckets).unwrap();
        assert!(s.dirty_all);
        s.evict_through(1).unwrap();
        // An evicted key upserted again in the same batch is held.
        s.upsert(&batch(&[("k0", -1)]), &[1]).unwrap();
        s.commit(0, serde_json::Value::Null).await.unwrap();
        let expected_rows = n as u64 / 2 + 1;
        assert_eq!(s.rows(), expected_rows);

        let mut r = store(dir.path());
        r.load(Some(0)).await.unwrap();
        assert_eq!(r.rows(), expected_rows);
        assert_eq!(r.bytes(), s.bytes());
        let probe = batch(&[("k0", 0), ("k1", 0), ("k2", 0), ("k69999", 0)]);
        assert_eq!(
            pairs(r.lookup(&probe, &[1, 2, 1, 2]).unwrap()),
            vec![
                ("k0".into(), -1),
                ("k1".into(), 1),
                ("k69999".into(), 69_999)
            ]
        );
        // The next batch is incremental again.
        r.upsert(&batch(&[("k1", 7)]), &[2]).unwrap();
        assert!(!r.dirty_all);
        r.commit(1, serde_json::Value::Null).await.unwrap();
        let mut again = store(dir.path());
        again.load(Some(1)).await.unwrap();
        assert_eq!(
            pairs(again.lookup(&batch(&[("k1", 0)]), &[2]).unwrap()),
            vec![("k1".into(), 7)]
        );
    }

    #[test]
    fn a_bucket_keeps_its_entries_through_longer_values_removals_and_compaction() {
        let mut rows = Rows::default();
        let key = |i: u32| format!("key-{i:05}").into_bytes();
        for i in 0..10_000u32 {
            assert_eq!(rows.insert(&key(i), &[1; 10]), None);
        }
        // Same length: in place, no dead bytes.
        assert_eq!(rows.insert(&key(7), &[2; 10]), Some(10));
        assert_eq!(rows.dead, 0);
        let full = rows.data.len();
        // Longer values move every entry; the arena is compacted on the way.
        for i in 0..10_000u32 {
            assert_eq!(rows.insert(&key(i), &[3; 20]), Some(10));
        }
        // Dead bytes stay below the live ones; every key shares "key-0",
        // kept once.
        assert_eq!(rows.prefix(), b"key-0");
        let live = 10_000 * (2 + 4 + 20);
        assert_eq!(rows.data.len() - rows.dead, live);
        assert!(rows.data.len() <= 2 * live, "{} bytes", rows.data.len());
        assert!(rows.data.len() > full);
        for i in (0..10_000u32).step_by(2) {
            assert_eq!(rows.remove(&key(i)), Some(20));
        }
        assert_eq!(rows.remove(&key(0)), None);
        // Removing half compacted the arena.
        let live = 5_000 * (2 + 4 + 20);
        assert_eq!(rows.data.len() - rows.dead, live);
        assert!(rows.data.len() < 2 * live, "{}", rows.data.len());
        for i in 0..10_000u32 {
            let want = (i % 2 == 1).then_some(&[3u8; 20][..]);
            assert_eq!(rows.get(&key(i)), want, "key {i}");
        }
        let whole = |rows: &Rows| -> Vec<Vec<u8>> {
            rows.sorted()
                .map(|(rest, _)| [rows.prefix(), rest].concat())
                .collect()
        };
        let expected: Vec<Vec<u8>> = (0..10_000u32).filter(|i| i % 2 == 1).map(key).collect();
        assert_eq!(whole(&rows), expected);
        // Lengths past one varint byte, offsets past 4 GiB; a key sharing
        // nothing with the others rewrites them without the prefix.
        let long = vec![9u8; 300];
        assert_eq!(rows.insert(b"long", &long), None);
        assert_eq!(rows.prefix(), b"");
        assert_eq!(rows.get(b"long"), Some(&long[..]));
        let mut expected = expected;
        expected.push(b"long".to_vec());
        assert_eq!(whole(&rows), expected);
        for i in (1..10_000u32).step_by(2) {
            assert_eq!(rows.get(&key(i)), Some(&[3u8; 20][..]), "key {i}");
        }
        assert_eq!(rows.remove(b"long"), Some(300));
        assert_eq!(unpack(pack((1 << 39) + 5)), (1 << 39) + 5);
        for i in (1..10_000u32).step_by(2) {
            rows.remove(&key(i));
        }
        assert!(rows.is_empty());
        assert!(rows.data.is_empty());
    }

    #[test]
    fn keys_sharing_their_first_bytes_keep_them_once_and_a_differing_key_cuts_the_prefix() {
        let mut rows = Rows::default();
        // A window's bucket: every key starts with the same 19 bytes.
        let key = |window: u8, user: u32| {
            let mut k = vec![window; 19];
            k.extend_from_slice(&u64::from(user).to_be_bytes());
            k
        };
        for user in 0..70_000u32 {
            assert_eq!(rows.insert(&key(1, user), &user.to_le_bytes()), None);
        }
        // The window and the user ids' five high bytes, kept once: each
        // entry holds 3 bytes of key, 4 of value and 2 of lengths.
        assert_eq!(rows.prefix(), &key(1, 0)[..24]);
        assert_eq!(rows.data.len(), 70_000 * (2 + 3 + 4));
        assert_eq!(rows.get(&key(2, 5)), None);
        assert_eq!(rows.remove(&key(2, 5)), None);
        assert!(!rows.contains_key(&key(1, 70_000)));
        assert!(
            !rows.contains_key(&key(1, 0)[..20]),
            "a key's own prefix is not the key"
        );
        // A key of another window cuts the prefix to nothing; every entry
        // is still found, by its whole key.
        assert_eq!(rows.insert(&key(2, 5), b"other"), None);
        assert_eq!(rows.prefix(), b"");
        for user in (0..70_000u32).step_by(997) {
            assert_eq!(rows.get(&key(1, user)), Some(&user.to_le_bytes()[..]));
        }
        assert_eq!(rows.get(&key(2, 5)), Some(&b"other"[..]));
        assert_eq!(rows.insert(&key(1, 3), &9u32.to_le_bytes()), Some(4));
        assert_eq!(rows.get(&key(1, 3)), Some(&9u32.to_le_bytes()[..]));
        // Emptied, the bucket takes the next key's bytes as its prefix.
        for user in 0..70_000u32 {
            assert_eq!(rows.remove(&key(1, user)), Some(4));
        }
        assert_eq!(rows.remove(&key(2, 5)), Some(5));
        assert!(rows.is_empty());
        assert_eq!(rows.insert(&key(3, 1), b"v"), None);
        assert_eq!(rows.prefix(), &key(3, 1)[..]);
        assert_eq!(rows.get(&key(3, 1)), Some(&b"v"[..]));
        assert_eq!(rows.get(&key(3, 1)[..26]), None);
    }

    #[tokio::test]
    async fn a_state_file_larger_than_a_part_is_uploaded_in_parts_and_loads_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path()).with_snapshot_interval(1);
        s.load(None).await.unwrap();
        let n = 200_000i64;
        let names: Vec<String> = (0..n).map(|i| format!("a-long-key-{i:040}")).collect();
        let rows: Vec<(&str, i64)> = names.iter().map(String::as_str).zip(0..n).collect();
        s.upsert(&batch(&rows), &vec![1; n as usize]).unwrap();
        s.commit(0, serde_json::json!({"m": 1})).await.unwrap();
        s.wait_for_snapshot().await.unwrap();
        let snapshot = dir.path().join("state/agg/0.snapshot.arrow");
        let size = std::fs::metadata(&snapshot).unwrap().len();
        // Larger than a part on any store: many parts on this local disk.
        assert!(size > files::PART as u64, "{size} bytes");

        let mut r = store(dir.path());
        r.load(Some(0)).await.unwrap();
        assert_eq!(r.rows(), n as u64);
        assert_eq!(r.bytes(), s.bytes());
        assert_eq!(r.meta(), &serde_json::json!({"m": 1}));
        let probe = batch(&[(names[0].as_str(), 0), (names[199_999].as_str(), 0)]);
        assert_eq!(
            pairs(r.lookup(&probe, &[1, 1]).unwrap()),
            vec![(names[0].clone(), 0), (names[199_999].clone(), 199_999)]
        );
    }

    /// The rows of `s`, sorted with their buckets... as `pairs` gives them.
    fn held(s: &StateStore) -> Vec<(String, i64)> {
        pairs(s.all().unwrap())
    }

    #[tokio::test]
    async fn snapshots_merged_from_the_files_hold_exactly_the_state_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path()).with_snapshot_interval(4);
        s.load(None).await.unwrap();
        let mut expected = Vec::new();
        for id in 0..13u64 {
            // Keys come and go: upserts into two buckets, a key moving
            // bucket, removals, an eviction, and one batch changing most
            // of the state (its delta holds every row).
            let n = if id == 5 { CHUNK as i64 + 10 } else { 50 };
            let names: Vec<String> = (0..n)
                .map(|i| format!("k{}", (i * 7 + id as i64) % 400))
                .collect();
            let rows: Vec<(&str, i64)> = names.iter().map(|k| (k.as_str(), id as i64)).collect();
            let buckets: Vec<i64> = (0..n).map(|i| 1 + (i + id as i64) % 3).collect();
            s.upsert(&batch(&rows), &buckets).unwrap();
            if id % 3 == 1 {
                let gone: Vec<(&str, i64)> = rows.iter().take(10).copied().collect();
                s.remove_keys(&batch(&gone), &buckets[..10]).unwrap();
            }
            if id == 7 {
                s.evict_through(1).unwrap();
            }
            s.commit(id, serde_json::json!({ "id": id })).await.unwrap();
            s.wait_for_snapshot().await.unwrap();
            expected.push(held(&s));
        }
        let (snapshots, _) = s.list().await.unwrap();
        assert_eq!(snapshots, vec![3, 7, 11]);
        for v in 0..13u64 {
            let mut r = store(dir.path());
            r.load(Some(v)).await.unwrap();
            assert_eq!(held(&r), expected[v as usize], "as of batch {v}");
            assert_eq!(r.meta(), &serde_json::json!({ "id": v }));
        }
        // Each snapshot alone (its deltas gone) gives the same state.
        for v in [3u64, 7, 11] {
            let copy = tempfile::tempdir().unwrap();
            let from = dir.path().join("state/agg");
            let to = copy.path().join("state/agg");
            std::fs::create_dir_all(&to).unwrap();
            let name = format!("{v}.snapshot.arrow");
            std::fs::copy(from.join(&name), to.join(&name)).unwrap();
            let mut r = store(copy.path());
            r.load(Some(v)).await.unwrap();
            assert_eq!(held(&r), expected[v as usize], "snapshot {v}");
            assert_eq!(r.rows(), expected[v as usize].len() as u64);
        }
    }

    #[tokio::test]
    async fn a_snapshot_merges_delta_files_written_before_they_counted_their_upserts() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path()).with_snapshot_interval(100);
        s.load(None).await.unwrap();
        s.upsert(&batch(&[("a", 1), ("b", 2), ("c", 3)]), &[1, 1, 2])
            .unwrap();
        s.commit(0, serde_json::Value::Null).await.unwrap();
        s.upsert(&batch(&[("a", 10)]), &[1]).unwrap();
        s.remove_keys(&batch(&[("b", 0)]), &[1]).unwrap();
        s.commit(1, serde_json::Value::Null).await.unwrap();
        // Rewrite both deltas as earlier builds wrote them: no count of
        // upsert batches in the footer.
        for id in 0..2 {
            let path = dir.path().join(format!("state/agg/{id}.delta.arrow"));
            let reader =
                arrow::ipc::reader::FileReader::try_new(std::fs::File::open(&path).unwrap(), None)
                    .unwrap();
            let schema = reader.schema();
            let batches: Vec<RecordBatch> = reader.map(|b| b.unwrap()).collect();
            let mut w = arrow::ipc::writer::FileWriter::try_new(
                std::fs::File::create(&path).unwrap(),
                &schema,
            )
            .unwrap();
            for b in &batches {
                w.write(b).unwrap();
            }
            w.finish().unwrap();
        }
        files::snapshot_from_files(s.files.clone(), 1)
            .await
            .unwrap();
        std::fs::remove_file(dir.path().join("state/agg/0.delta.arrow")).unwrap();
        std::fs::remove_file(dir.path().join("state/agg/1.delta.arrow")).unwrap();
        let mut r = store(dir.path());
        r.load(Some(1)).await.unwrap();
        assert_eq!(held(&r), vec![("a".into(), 10), ("c".into(), 3)]);
    }

    #[tokio::test]
    async fn a_restart_writes_the_snapshot_its_process_did_not_finish() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        s.load(None).await.unwrap();
        for id in 0..7u64 {
            s.upsert(&batch(&[("k", id as i64), (&format!("k{id}"), 1)]), &[1, 1])
                .unwrap();
            s.commit(id, serde_json::Value::Null).await.unwrap();
            s.wait_for_snapshot().await.unwrap();
        }
        let snapshot = dir.path().join("state/agg/5.snapshot.arrow");
        std::fs::remove_file(&snapshot).unwrap();
        let mut r = store(dir.path());
        r.load(Some(6)).await.unwrap();
        r.wait_for_snapshot().await.unwrap();
        assert!(snapshot.exists());
        let mut again = store(dir.path());
        again.load(Some(5)).await.unwrap();
        assert_eq!(again.rows(), 7);
        assert_eq!(
            pairs(again.lookup(&batch(&[("k", 0)]), &[1]).unwrap()),
            vec![("k".into(), 5)]
        );
    }

    #[tokio::test]
    async fn a_snapshot_that_does_not_add_up_is_not_written() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path()).with_snapshot_interval(100);
        s.load(None).await.unwrap();
        s.upsert(&batch(&[("a", 1), ("b", 2)]), &[1, 1]).unwrap();
        s.commit(0, serde_json::Value::Null).await.unwrap();
        s.upsert(&batch(&[("c", 3)]), &[1]).unwrap();
        s.commit(1, serde_json::Value::Null).await.unwrap();
        // Batch 1's delta says the state held 5 rows; the files give 3.
        let d = dir.path().join("state/agg");
        let path = d.join("1.delta.arrow");
        let reader =
            arrow::ipc::reader::FileReader::try_new(std::fs::File::open(&path).unwrap(), None)
                .unwrap();
        let schema = reader.schema();
        let mut header: serde_json::Value = serde_json::from_str(&schema.metadata()[META]).unwrap();
        assert_eq!(header["rows"], 3);
        header["rows"] = 5.into();
        let schema = Arc::new(
            schema
                .as_ref()
                .clone()
                .with_metadata([(META.to_string(), header.to_string())].into()),
        );
        let batches: Vec<RecordBatch> = reader.map(|b| b.unwrap()).collect();
        let mut w =
            arrow::ipc::writer::FileWriter::try_new(std::fs::File::create(&path).unwrap(), &schema)
                .unwrap();
        for b in &batches {
            w.write(&RecordBatch::try_new(schema.clone(), b.columns().to_vec()).unwrap())
                .unwrap();
        }
        w.finish().unwrap();
        let err = files::snapshot_from_files(s.files.clone(), 1)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("1.delta.arrow")
                && err.contains("holds 3 rows where the batch recorded 5"),
            "{err}"
        );
        assert!(!d.join("1.snapshot.arrow").exists());
    }

    #[tokio::test]
    async fn summaries_give_each_operators_size_as_of_a_batch() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::parse(dir.path().to_str().unwrap(), &HashMap::new()).unwrap();
        assert!(summaries(&loc, None).await.unwrap().is_empty());
        let mut s = store(dir.path());
        s.load(None).await.unwrap();
        s.upsert(&batch(&[("a", 1), ("b", 2)]), &[10, 20]).unwrap();
        s.commit(0, serde_json::json!({"max": 5})).await.unwrap();
        s.upsert(&batch(&[("c", 3)]), &[30]).unwrap();
        s.commit(1, serde_json::json!({"max": 6})).await.unwrap();
        let all = summaries(&loc, None).await.unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(
            (all[0].operator.as_str(), all[0].batch_id, all[0].rows),
            ("agg", 1, 3)
        );
        assert_eq!(all[0].bytes, s.bytes());
        assert_eq!(all[0].meta, serde_json::json!({"max": 6}));
        // Batch 1 is written but not committed to the table: as of 0.
        let at0 = summaries(&loc, Some(0)).await.unwrap();
        assert_eq!((at0[0].batch_id, at0[0].rows), (0, 2));
    }

    #[tokio::test]
    async fn a_store_of_keys_only_keeps_and_forgets_keys() {
        let dir = tempfile::tempdir().unwrap();
        let loc = Location::parse(dir.path().to_str().unwrap(), &HashMap::new()).unwrap();
        let keys = Arc::new(Schema::new(vec![Field::new("k", DataType::Utf8, true)]));
        let batch = |k: &[&str]| {
            RecordBatch::try_new(
                keys.clone(),
                vec![Arc::new(StringArray::from_iter_values(k.iter()))],
            )
            .unwrap()
        };
        let mut s = StateStore::new(loc.clone(), "dedup", keys.clone(), 1).unwrap();
        s.load(None).await.unwrap();
        s.upsert(&batch(&["a", "b"]), &[1, 2]).unwrap();
        assert_eq!(
            s.contains(&batch(&["a", "z"]), &[1, 1]).unwrap(),
            [true, false]
        );
        s.commit(0, serde_json::Value::Null).await.unwrap();
        s.evict_through(1).unwrap();
        s.commit(1, serde_json::Value::Null).await.unwrap();
        let mut r = StateStore::new(loc, "dedup", keys.clone(), 1).unwrap();
        r.load(Some(0)).await.unwrap();
        assert_eq!(r.rows(), 2);
        r.load(Some(1)).await.unwrap();
        assert_eq!(
            r.contains(&batch(&["a", "b"]), &[1, 2]).unwrap(),
            [false, true]
        );
        assert_eq!(r.all().unwrap().unwrap().num_rows(), 1);
    }

    #[test]
    fn rows_and_bytes_follow_upserts_and_evictions() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(dir.path());
        s.upsert(&batch(&[("a", 1), ("bb", 2)]), &[1, 2]).unwrap();
        let two = s.bytes();
        assert_eq!(s.rows(), 2);
        s.upsert(&batch(&[("a", 5)]), &[1]).unwrap();
        assert_eq!((s.rows(), s.bytes()), (2, two));
        assert_eq!(pairs(s.evict_through(1).unwrap()), vec![("a".into(), 5)]);
        assert_eq!(s.rows(), 1);
        assert!(s.evict_through(1).unwrap().is_none());
        s.evict_through(100).unwrap();
        assert_eq!((s.rows(), s.bytes()), (0, 0));
    }
}
