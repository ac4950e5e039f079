//! An operator's state files in the store: naming and listing them,
//! reading one an Arrow batch at a time, writing one as it is encoded, and
//! building a snapshot from the files alone (off the batch path).

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, BooleanArray, RecordBatch};
use arrow::buffer::Buffer;
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use arrow::ipc::reader::FileDecoder;
use arrow::row::{RowConverter, Rows, SortField};
use futures::TryStreamExt;
use lakestream_storage::Location;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};

use crate::{BUCKET, Error, FILE_CHUNK, FORMAT_VERSION, META, REMOVED, Result, describe};

/// Bytes of a state file sent to an object store in one request: a
/// smaller file is one `put`, a larger one a multipart upload of parts this
/// size (at least the 5 MiB S3 asks of a part).
pub(crate) const PART: usize = 5 << 20;

/// The same for a checkpoint on the local file system, where a part is a
/// write into the staging file and has no minimum size: what a file being
/// written holds in memory (two parts) stays well below the state's size.
pub(crate) const LOCAL_PART: usize = 256 << 10;

/// A state file up to this size is read in one request; a larger one a
/// batch at a time (a snapshot merges many files at once: each holds one
/// batch in memory, not the whole file).
const WHOLE: usize = 1 << 20;

/// Where one operator's state files live and what they hold: all a
/// background snapshot needs, without the store's memory.
#[derive(Clone)]
pub(crate) struct Files {
    pub(crate) location: Location,
    pub(crate) operator: String,
    /// The state's columns: keys, then values.
    pub(crate) schema: SchemaRef,
    /// How many of them are keys.
    pub(crate) keys: usize,
}

impl Files {
    pub(crate) fn path(&self, batch_id: u64, kind: &str) -> Path {
        self.location
            .child(&format!("state/{}/{batch_id}.{kind}.arrow", self.operator))
    }

    pub(crate) fn url(&self, path: &Path) -> String {
        self.location.url_of(path)
    }

    /// The error for batch `batch_id`'s missing delta file.
    pub(crate) fn missing(&self, batch_id: u64) -> Error {
        Error::Missing {
            operator: self.operator.clone(),
            batch_id,
            file: self.url(&self.path(batch_id, "delta")),
        }
    }

    /// The columns of a state file: the state's, nullable, then the bucket
    /// and the removal flag.
    pub(crate) fn file_schema(&self) -> Schema {
        let mut fields: Vec<Field> = self
            .schema
            .fields()
            .iter()
            .map(|f| f.as_ref().clone().with_nullable(true))
            .collect();
        fields.push(Field::new(BUCKET, DataType::Int64, false));
        fields.push(Field::new(REMOVED, DataType::Boolean, false));
        Schema::new(fields)
    }

    /// The batch ids of the snapshots and deltas kept, ascending.
    pub(crate) async fn list(&self) -> Result<(Vec<u64>, Vec<u64>)> {
        let dir = self.location.child(&format!("state/{}", self.operator));
        let metas = list_dir(&self.location, &dir).await?;
        let (mut snapshots, mut deltas) = (Vec::new(), Vec::new());
        for m in metas {
            let Some(name) = m.location.filename() else {
                continue;
            };
            let mut parts = name.splitn(3, '.');
            let (Some(id), Some(kind), Some("arrow")) = (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let Ok(id) = id.parse::<u64>() else { continue };
            match kind {
                "snapshot" => snapshots.push(id),
                "delta" => deltas.push(id),
                _ => {}
            }
        }
        snapshots.sort_unstable();
        deltas.sort_unstable();
        Ok((snapshots, deltas))
    }

    /// Open the `kind` file of `batch_id`, its header and columns checked.
    pub(crate) async fn open(&self, batch_id: u64, kind: &str) -> Result<StateFile> {
        let path = self.path(batch_id, kind);
        let file = self.url(&path);
        let store = self.location.store();
        let store_err = |source| lakestream_storage::Error::Store {
            file: file.clone(),
            source,
        };
        let corrupt = |reason: String| Error::Corrupt {
            file: file.clone(),
            reason,
        };
        let got = match store.get(&path).await {
            Ok(g) => g,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(Error::Missing {
                    operator: self.operator.clone(),
                    batch_id,
                    file,
                });
            }
            Err(e) => return Err(store_err(e).into()),
        };
        let size = got.meta.size;
        // A small file in one request; a large one by ranges.
        let whole = if size <= WHOLE as u64 {
            Some(Buffer::from(got.bytes().await.map_err(store_err)?))
        } else {
            drop(got);
            None
        };
        let range = |from: u64, to: u64| read_range(store, &path, whole.as_ref(), from, to);
        if size < 10 {
            return Err(corrupt(format!("{size} bytes: not an Arrow IPC file")));
        }
        let trailer = range(size - 10, size).await.map_err(store_err)?;
        let footer_len = arrow::ipc::reader::read_footer_length(
            trailer.as_slice().try_into().expect("10 bytes"),
        )
        .map_err(|e| corrupt(e.to_string()))? as u64;
        if footer_len + 10 > size {
            return Err(corrupt(format!("a footer of {footer_len} bytes in {size}")));
        }
        let footer_bytes = range(size - 10 - footer_len, size - 10)
            .await
            .map_err(store_err)?;
        let footer = arrow::ipc::root_as_footer(footer_bytes.as_slice())
            .map_err(|e| corrupt(format!("unreadable footer: {e}")))?;
        let schema = footer
            .schema()
            .map(arrow::ipc::convert::fb_to_schema)
            .ok_or_else(|| corrupt("no schema".into()))?;
        let header: serde_json::Value = schema
            .metadata()
            .get(META)
            .and_then(|m| serde_json::from_str(m).ok())
            .ok_or_else(|| corrupt(format!("no {META} metadata")))?;
        match header.get("version").and_then(|v| v.as_u64()) {
            Some(v) if v == u64::from(FORMAT_VERSION) => {}
            other => {
                return Err(corrupt(format!(
                    "format version {other:?}, this build reads {FORMAT_VERSION}"
                )));
            }
        }
        let expected = self.file_schema();
        let same = schema.fields().len() == expected.fields().len()
            && schema.fields().iter().zip(expected.fields()).all(|(a, b)| {
                a.name() == b.name() && same_but_layout(a.data_type(), b.data_type())
            });
        if !same {
            return Err(Error::Changed {
                operator: self.operator.clone(),
                file,
                found: describe(&schema),
                expected: describe(&expected),
            });
        }
        let blocks: Vec<arrow::ipc::Block> = footer
            .recordBatches()
            .map(|b| b.iter().copied().collect())
            .unwrap_or_default();
        let dictionaries: Vec<arrow::ipc::Block> = footer
            .dictionaries()
            .map(|b| b.iter().copied().collect())
            .unwrap_or_default();
        let upsert_batches = footer.custom_metadata().and_then(|m| {
            m.iter()
                .find(|kv| kv.key() == Some(UPSERT_BATCHES))
                .and_then(|kv| kv.value()?.parse().ok())
        });
        // Written with other string layouts (views, by builds before
        // 2026-12-06): each batch is cast to the running query's.
        let cast_to = schema
            .fields()
            .iter()
            .zip(expected.fields())
            .any(|(a, b)| a.data_type() != b.data_type())
            .then(|| Arc::new(expected.with_metadata(schema.metadata().clone())));
        let mut decoder = FileDecoder::new(Arc::new(schema), footer.version());
        for d in &dictionaries {
            let from = d.offset() as u64;
            let to = from + d.metaDataLength() as u64 + d.bodyLength() as u64;
            let buf = range(from, to).await.map_err(store_err)?;
            decoder
                .read_dictionary(d, &buf)
                .map_err(|e| corrupt(e.to_string()))?;
        }
        Ok(StateFile {
            location: self.location.clone(),
            path,
            url: file,
            header,
            blocks,
            whole,
            decoder,
            next: 0,
            upsert_batches,
            cast_to,
        })
    }
}

/// Bytes `from..to` of the file at `path`: a slice of `whole` when the file
/// was read whole, else a range request.
async fn read_range(
    store: &Arc<dyn object_store::ObjectStore>,
    path: &Path,
    whole: Option<&Buffer>,
    from: u64,
    to: u64,
) -> object_store::Result<Buffer> {
    match whole {
        Some(b) => Ok(b.slice_with_length(from as usize, (to - from) as usize)),
        None => store.get_range(path, from..to).await.map(Buffer::from),
    }
}

/// Every file under `dir` (none when it does not exist).
pub(crate) async fn list_dir(
    location: &Location,
    dir: &Path,
) -> Result<Vec<object_store::ObjectMeta>> {
    match location.store().list(Some(dir)).try_collect().await {
        Ok(m) => Ok(m),
        Err(object_store::Error::NotFound { .. }) => Ok(Vec::new()),
        Err(e) => Err(lakestream_storage::Error::Store {
            file: location.url_of(dir),
            source: e,
        }
        .into()),
    }
}

/// One state file, read an Arrow batch at a time: a whole small file is
/// in memory already, a large one is read by a range request per batch.
pub(crate) struct StateFile {
    location: Location,
    path: Path,
    pub(crate) url: String,
    /// The `lakestream.state` header.
    pub(crate) header: serde_json::Value,
    /// The record batches, as the footer lists them.
    blocks: Vec<arrow::ipc::Block>,
    whole: Option<Buffer>,
    decoder: FileDecoder,
    next: usize,
    /// How many batches are upserts, when the file says (older files do
    /// not).
    upsert_batches: Option<usize>,
    /// The schema batches are cast to: the file's columns are the query's
    /// with other string or binary layouts ([`same_but_layout`]).
    cast_to: Option<SchemaRef>,
}

impl StateFile {
    /// The next record batch, `None` after the last.
    pub(crate) async fn next_batch(&mut self) -> Result<Option<RecordBatch>> {
        let Some(block) = self.blocks.get(self.next).copied() else {
            return Ok(None);
        };
        self.next += 1;
        let from = block.offset() as u64;
        let to = from + block.metaDataLength() as u64 + block.bodyLength() as u64;
        if self.whole.as_ref().is_some_and(|b| to as usize > b.len()) {
            return Err(self.corrupt(format!("a batch at {from}..{to} past the end")));
        }
        let buf = read_range(
            self.location.store(),
            &self.path,
            self.whole.as_ref(),
            from,
            to,
        )
        .await
        .map_err(|source| lakestream_storage::Error::Store {
            file: self.url.clone(),
            source,
        })?;
        let batch = self
            .decoder
            .read_record_batch(&block, &buf)
            .map_err(|e| self.corrupt(e.to_string()))?;
        match (batch, &self.cast_to) {
            (Some(b), Some(to)) => {
                let columns = b
                    .columns()
                    .iter()
                    .zip(to.fields())
                    .map(|(c, f)| arrow::compute::cast(c, f.data_type()))
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|e| self.corrupt(e.to_string()))?;
                RecordBatch::try_new(to.clone(), columns)
                    .map(Some)
                    .map_err(|e| self.corrupt(e.to_string()))
            }
            (b, _) => Ok(b),
        }
    }

    fn corrupt(&self, reason: String) -> Error {
        Error::Corrupt {
            file: self.url.clone(),
            reason,
        }
    }
}

/// Whether `a` and `b` are the same type but for how strings and binaries
/// are laid out (`Utf8View`, `LargeUtf8` and `Utf8`; the binary ones),
/// at any depth: a cast turns one into the other without loss.
fn same_but_layout(a: &DataType, b: &DataType) -> bool {
    plain_layout(a) == plain_layout(b)
}

/// `t` with its string and binary types as `Utf8` and `Binary`.
fn plain_layout(t: &DataType) -> DataType {
    let field = |f: &arrow::datatypes::FieldRef| {
        Arc::new(
            f.as_ref()
                .clone()
                .with_data_type(plain_layout(f.data_type())),
        )
    };
    match t {
        DataType::Utf8View | DataType::LargeUtf8 => DataType::Utf8,
        DataType::BinaryView | DataType::LargeBinary => DataType::Binary,
        DataType::List(f) | DataType::LargeList(f) | DataType::ListView(f) => {
            DataType::List(field(f))
        }
        DataType::FixedSizeList(f, n) => DataType::FixedSizeList(field(f), *n),
        DataType::Struct(fields) => DataType::Struct(fields.iter().map(field).collect()),
        DataType::Map(f, sorted) => DataType::Map(field(f), *sorted),
        other => other.clone(),
    }
}

/// Footer metadata of a state file: how many of its record batches are
/// upserts (the removals follow them).
const UPSERT_BATCHES: &str = "lakestream.upsert_batches";

/// A state file being written: each Arrow batch encoded and sent to the
/// store as it comes; the file appears whole, or not at all, at
/// [`FileOut::finish`].
pub(crate) struct FileOut {
    writer: arrow::ipc::writer::FileWriter<Vec<u8>>,
    upload: Upload,
    location: Location,
    path: Path,
    url: String,
    operator: String,
    /// The file's schema (with the header in its metadata).
    pub(crate) schema: SchemaRef,
    upsert_batches: usize,
}

impl FileOut {
    /// Start the file at `path` with `header` as its `lakestream.state`.
    pub(crate) fn new(files: &Files, path: Path, header: &serde_json::Value) -> Result<Self> {
        let schema = Arc::new(
            files
                .file_schema()
                .with_metadata([(META.to_string(), header.to_string())].into()),
        );
        let writer = arrow::ipc::writer::FileWriter::try_new(Vec::new(), &schema).map_err(|e| {
            Error::Arrow {
                operator: files.operator.clone(),
                source: e,
            }
        })?;
        Ok(Self {
            writer,
            upload: Upload::new(
                files.location.store().clone(),
                path.clone(),
                if files.location.local_dir().is_some() {
                    LOCAL_PART
                } else {
                    PART
                },
            ),
            location: files.location.clone(),
            url: files.url(&path),
            path,
            operator: files.operator.clone(),
            schema,
            upsert_batches: 0,
        })
    }

    fn arrow_err(&self, source: arrow::error::ArrowError) -> Error {
        Error::Arrow {
            operator: self.operator.clone(),
            source,
        }
    }

    fn store_err(&self, source: object_store::Error) -> Error {
        lakestream_storage::Error::Store {
            file: self.url.clone(),
            source,
        }
        .into()
    }

    /// Add `batch` (upserts, which come before every removal, when
    /// `upserts`).
    pub(crate) async fn write(&mut self, batch: &RecordBatch, upserts: bool) -> Result<()> {
        if upserts {
            self.upsert_batches += 1;
        }
        self.writer.write(batch).map_err(|e| self.arrow_err(e))?;
        let bytes = std::mem::take(self.writer.get_mut());
        self.upload.send(bytes).await.map_err(|e| self.store_err(e))
    }

    /// Finish the file: footer, the upload completed, synced.
    pub(crate) async fn finish(mut self) -> Result<()> {
        self.writer
            .write_metadata(UPSERT_BATCHES, self.upsert_batches.to_string());
        self.writer.finish().map_err(|e| self.arrow_err(e))?;
        let rest = std::mem::take(self.writer.get_mut());
        self.upload
            .send(rest)
            .await
            .map_err(|e| self.store_err(e))?;
        let (location, path, url) = (self.location, self.path, self.url);
        self.upload
            .finish()
            .await
            .map_err(|source| lakestream_storage::Error::Store { file: url, source })?;
        Ok(location.sync(&path).await?)
    }
}

/// One file written to a store as its bytes come: buffered up to a part
/// ([`PART`], or [`LOCAL_PART`] on a local disk) and then one `put`, or a
/// multipart upload with one part in flight, so a file's bytes are never
/// all in memory at once. The file appears whole or not at all.
struct Upload {
    store: Arc<dyn object_store::ObjectStore>,
    path: Path,
    part: usize,
    buffer: Vec<u8>,
    multipart: Option<object_store::WriteMultipart>,
}

impl Upload {
    fn new(store: Arc<dyn object_store::ObjectStore>, path: Path, part: usize) -> Self {
        Self {
            store,
            path,
            part,
            buffer: Vec::new(),
            multipart: None,
        }
    }

    /// Add `bytes` to the file.
    async fn send(&mut self, bytes: Vec<u8>) -> object_store::Result<()> {
        if self.multipart.is_none() && self.buffer.len() + bytes.len() <= self.part {
            self.buffer.extend_from_slice(&bytes);
            return Ok(());
        }
        if self.multipart.is_none() {
            let upload = self.store.put_multipart(&self.path).await?;
            let mut m = object_store::WriteMultipart::new_with_chunk_size(upload, self.part);
            m.put(std::mem::take(&mut self.buffer).into());
            self.multipart = Some(m);
        }
        let m = self.multipart.as_mut().expect("set above");
        m.wait_for_capacity(1).await?;
        m.put(bytes.into());
        Ok(())
    }

    /// Make the file whole in the store.
    async fn finish(self) -> object_store::Result<()> {
        match self.multipart {
            None => self
                .store
                .put(&self.path, PutPayload::from(self.buffer))
                .await
                .map(|_| ()),
            Some(m) => m.finish().await.map(|_| ()),
        }
    }
}

/// One sorted run of a state file's rows, read a batch at a time: its
/// upserts, or its removals (each written in (bucket, key) order).
struct Run {
    file: StateFile,
    removals: bool,
    /// Later files win: 0 for the snapshot, then the deltas in order.
    priority: usize,
    batch: Option<RecordBatch>,
    keys: Option<Rows>,
    row: usize,
    /// The current batch's place among the output chunk's sources.
    source: Option<usize>,
}

impl Run {
    async fn open(
        files: &Files,
        batch_id: u64,
        kind: &str,
        removals: bool,
        priority: usize,
        conv: &RowConverter,
    ) -> Result<Self> {
        let mut file = files.open(batch_id, kind).await?;
        if removals && let Some(n) = file.upsert_batches {
            file.next = n;
        }
        let mut run = Self {
            file,
            removals,
            priority,
            batch: None,
            keys: None,
            row: 0,
            source: None,
        };
        run.load(files, conv).await?;
        Ok(run)
    }

    /// Move to the run's next non-empty batch (`batch` is `None` at the
    /// end of the run).
    async fn load(&mut self, files: &Files, conv: &RowConverter) -> Result<()> {
        self.batch = None;
        self.keys = None;
        self.row = 0;
        self.source = None;
        let n = files.schema.fields().len();
        let found = self.next_of_kind(files, conv, n).await;
        if self.batch.is_none() {
            // The run is over: let go of a file read whole.
            self.file.whole = None;
        }
        found
    }

    async fn next_of_kind(&mut self, files: &Files, conv: &RowConverter, n: usize) -> Result<()> {
        while let Some(b) = self.file.next_batch().await? {
            if b.num_rows() == 0 {
                continue;
            }
            let removal = b.column(n + 1).as_boolean().value(0);
            if removal != self.removals {
                if self.removals {
                    continue; // the upserts before the removals
                }
                return Ok(()); // the removals after the upserts
            }
            let keys = conv
                .convert_columns(&b.columns()[..files.keys])
                .map_err(|e| self.file.corrupt(e.to_string()))?;
            self.keys = Some(keys);
            self.batch = Some(b);
            return Ok(());
        }
        Ok(())
    }

    /// The current row's bucket and encoded key.
    fn key(&self, bucket_column: usize) -> Option<(i64, &[u8])> {
        let b = self.batch.as_ref()?;
        let bucket = b
            .column(bucket_column)
            .as_primitive::<Int64Type>()
            .value(self.row);
        Some((bucket, self.keys.as_ref()?.row(self.row).data()))
    }

    async fn advance(&mut self, files: &Files, conv: &RowConverter) -> Result<()> {
        self.row += 1;
        if self
            .batch
            .as_ref()
            .is_some_and(|b| self.row >= b.num_rows())
        {
            self.load(files, conv).await?;
        }
        Ok(())
    }
}

/// Write the snapshot of `batch_id` from the files alone: the newest
/// snapshot before it and every delta after that, merged in (bucket, key)
/// order, the latest file winning, a batch of each at a time, so it needs
/// neither the state in memory nor a second copy of it. The snapshot must
/// hold as many rows as delta `batch_id` says the state held, or nothing is
/// written. Nothing to do when the snapshot exists.
pub(crate) async fn snapshot_from_files(files: Files, batch_id: u64) -> Result<()> {
    let (snapshots, deltas) = files.list().await?;
    if snapshots.binary_search(&batch_id).is_ok() {
        return Ok(());
    }
    let base = snapshots.iter().rev().find(|&&s| s < batch_id).copied();
    let first = base.map_or(0, |s| s + 1);
    for id in first..=batch_id {
        if deltas.binary_search(&id).is_err() {
            return Err(files.missing(id));
        }
    }
    let fields = files.schema.fields();
    let conv = RowConverter::new(
        fields[..files.keys]
            .iter()
            .map(|f| SortField::new(f.data_type().clone()))
            .collect(),
    )
    .map_err(|e| Error::Arrow {
        operator: files.operator.clone(),
        source: e,
    })?;
    let mut runs = Vec::new();
    if let Some(s) = base {
        runs.push(Run::open(&files, s, "snapshot", false, 0, &conv).await?);
    }
    for (i, id) in (first..=batch_id).enumerate() {
        for removals in [false, true] {
            runs.push(Run::open(&files, id, "delta", removals, i + 1, &conv).await?);
        }
    }
    let header = runs
        .last()
        .map(|r| r.file.header.clone())
        .expect("at least one delta");
    let held = header.get("rows").and_then(|r| r.as_u64());
    let path = files.path(batch_id, "snapshot");
    let mut out = FileOut::new(&files, path, &header)?;
    let n = fields.len();
    let (mut picks, mut sources): (Vec<(usize, usize)>, Vec<RecordBatch>) =
        (Vec::new(), Vec::new());
    let mut written = 0u64;
    let mut key = Vec::new();
    loop {
        let mut best: Option<usize> = None;
        for i in 0..runs.len() {
            let Some(k) = runs[i].key(n) else { continue };
            best = match best {
                None => Some(i),
                Some(j) => {
                    let kj = runs[j].key(n).expect("a current row");
                    match k.cmp(&kj) {
                        std::cmp::Ordering::Less => Some(i),
                        std::cmp::Ordering::Equal if runs[i].priority > runs[j].priority => Some(i),
                        _ => Some(j),
                    }
                }
            };
        }
        let Some(w) = best else { break };
        let (bucket, k) = runs[w].key(n).expect("a current row");
        key.clear();
        key.extend_from_slice(k);
        if !runs[w].removals {
            let run = &mut runs[w];
            let source = match run.source {
                Some(s) => s,
                None => {
                    sources.push(run.batch.clone().expect("a current batch"));
                    run.source = Some(sources.len() - 1);
                    sources.len() - 1
                }
            };
            picks.push((source, run.row));
        }
        // A run leaving a batch the output still points into: write the
        // output first, so no batch outlives its run's cursor (at most one
        // batch per run is held).
        let leaving = runs.iter().any(|r| {
            r.source.is_some()
                && r.key(n) == Some((bucket, &key[..]))
                && r.batch.as_ref().is_some_and(|b| r.row + 1 >= b.num_rows())
        });
        if leaving || picks.len() >= FILE_CHUNK {
            written += flush(&mut out, &mut picks, &mut sources, &mut runs, n).await?;
        }
        for run in runs.iter_mut() {
            if run.key(n) == Some((bucket, &key[..])) {
                run.advance(&files, &conv).await?;
            }
        }
    }
    written += flush(&mut out, &mut picks, &mut sources, &mut runs, n).await?;
    if held.is_some_and(|h| h != written) {
        return Err(Error::Corrupt {
            file: files.url(&files.path(batch_id, "delta")),
            reason: format!(
                "its snapshot, merged from the files, holds {written} rows where the batch \
                 recorded {}",
                held.unwrap_or_default()
            ),
        });
    }
    out.finish().await
}

/// Write the picked rows (source batch, row) as one batch of `out`; the
/// rows written.
async fn flush(
    out: &mut FileOut,
    picks: &mut Vec<(usize, usize)>,
    sources: &mut Vec<RecordBatch>,
    runs: &mut [Run],
    n: usize,
) -> Result<u64> {
    let rows = picks.len();
    if rows > 0 {
        let mut columns: Vec<ArrayRef> = Vec::with_capacity(n + 2);
        for c in 0..=n {
            let arrays: Vec<&dyn Array> = sources.iter().map(|b| b.column(c).as_ref()).collect();
            columns.push(arrow::compute::interleave(&arrays, picks).map_err(|e| out.arrow_err(e))?);
        }
        columns.push(Arc::new(BooleanArray::from(vec![false; rows])));
        let batch =
            RecordBatch::try_new(out.schema.clone(), columns).map_err(|e| out.arrow_err(e))?;
        out.write(&batch, true).await?;
    }
    picks.clear();
    sources.clear();
    for run in runs {
        run.source = None;
    }
    Ok(rows as u64)
}
