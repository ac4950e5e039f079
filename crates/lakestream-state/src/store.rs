//! [`StateStore`]: one operator's keyed state in memory, its loads from
//! and commits to the checkpoint's state files, and their purge.

use super::*;

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

#[cfg(test)]
mod tests;
