//! Reading a planned text file (JSON lines, CSV; gzip or zstd on the way)
//! decoded chunk by chunk as it downloads, errors located at the file and
//! line. Parquet and Avro files are [`super::columnar`]'s.

use super::*;
use arrow::datatypes::Field;

pub(super) async fn get_all(
    name: &str,
    store: &Arc<dyn ObjectStore>,
    path: &Path,
) -> Result<Bytes> {
    let store_err = |e| Error::Store {
        source_name: name.to_string(),
        file: path.to_string(),
        source: e,
    };
    store
        .get(path)
        .await
        .map_err(store_err)?
        .bytes()
        .await
        .map_err(store_err)
}

/// A streaming decoder for line-oriented text formats.
pub(super) enum TextDecoder {
    Json(arrow::json::reader::Decoder),
    Csv(Box<arrow::csv::reader::Decoder>),
}

impl TextDecoder {
    /// A decoder of `format` into `schema`; `strict`: a JSON field the
    /// schema lacks is an error (how new fields are found).
    pub(super) fn new(
        format: &FileFormat,
        schema: SchemaRef,
        batch_size: usize,
        strict: bool,
    ) -> Result<Self, String> {
        Ok(match format {
            FileFormat::Csv {
                has_header,
                delimiter,
            } => Self::Csv(Box::new(
                arrow::csv::ReaderBuilder::new(schema)
                    .with_header(*has_header)
                    .with_delimiter(*delimiter)
                    .with_batch_size(batch_size)
                    .build_decoder(),
            )),
            _ => Self::Json(
                arrow::json::ReaderBuilder::new(schema)
                    .with_batch_size(batch_size)
                    .with_strict_mode(strict)
                    .build_decoder()
                    .map_err(|e| e.to_string())?,
            ),
        })
    }

    pub(super) fn decode(&mut self, buf: &[u8]) -> Result<usize, arrow::error::ArrowError> {
        match self {
            Self::Json(d) => d.decode(buf),
            Self::Csv(d) => d.decode(buf),
        }
    }

    pub(super) fn flush(&mut self) -> Result<Option<RecordBatch>, arrow::error::ArrowError> {
        match self {
            Self::Json(d) => d.flush(),
            Self::Csv(d) => d.flush(),
        }
    }

    pub(super) fn is_full(&self, batch_size: usize) -> bool {
        match self {
            Self::Json(d) => d.len() >= batch_size,
            Self::Csv(d) => d.capacity() == 0,
        }
    }
}

pub(super) struct TextState {
    name: String,
    store: Arc<dyn ObjectStore>,
    entry: FileEntry,
    schema: SchemaRef,
    format: FileFormat,
    compression: TextCompression,
    decoder: TextDecoder,
    chunks: BoxStream<'static, object_store::Result<Bytes>>,
    buf: Bytes,
    eof: bool,
    finished: bool,
    batch_size: usize,
    /// Where undecodable lines go (`on_error 'dead_letter'`); `None`: a
    /// bad line fails the read.
    rejects: Option<Rejects>,
    /// Fields the schema lacks stop the read ([`Error::SchemaChanged`]).
    evolve: bool,
    /// Rows of this file returned so far.
    rows_out: u64,
    /// Batches decoded line by line after a bad line, still to return.
    queue: VecDeque<RecordBatch>,
}

/// How a text file is decoded.
pub(super) struct TextOptions {
    pub(super) format: FileFormat,
    pub(super) batch_size: usize,
    pub(super) compression: TextCompression,
    /// Where undecodable lines go (`on_error 'dead_letter'`).
    pub(super) rejects: Option<Rejects>,
    /// Stop at fields the schema lacks (`schema_evolution
    /// 'add_new_columns'`, JSON).
    pub(super) evolve: bool,
    /// Only the lines starting in this byte range (JSON lines, not
    /// compressed); `None`: the whole file.
    pub(super) range: Option<std::ops::Range<u64>>,
    /// The store is the local file system: smaller reads
    /// ([`read_chunk`]).
    pub(super) local: bool,
    /// The local file, open: what the page cache holds is read from it on
    /// the decoding thread (see [`ranged_chunks`] and [`line_start`]).
    pub(super) cached: Option<Arc<CachedFile>>,
}

pub(super) async fn text_stream(
    name: String,
    store: Arc<dyn ObjectStore>,
    entry: FileEntry,
    schema: SchemaRef,
    options: TextOptions,
) -> Result<BatchStream> {
    let TextOptions {
        format,
        batch_size,
        compression,
        rejects,
        evolve,
        range,
        local,
        cached,
    } = options;
    let path = object_path(&entry.path);
    let bytes = match range {
        None => 0..entry.size,
        Some(r) => {
            let line = |at| line_start(&name, &store, &entry, at, cached.as_deref());
            line(r.start).await?..line(r.end).await?
        }
    };
    let chunks = decompressed(
        ranged_chunks(store.clone(), path, bytes, read_chunk(local), cached),
        compression,
    );
    let decoder =
        TextDecoder::new(&format, schema.clone(), batch_size, evolve).map_err(|reason| {
            Error::Schema {
                source_name: name.clone(),
                file: entry.path.clone(),
                reason,
            }
        })?;
    let state = TextState {
        name,
        store,
        entry,
        schema,
        format,
        compression,
        decoder,
        chunks,
        buf: Bytes::new(),
        eof: false,
        finished: false,
        batch_size,
        rejects,
        evolve,
        rows_out: 0,
        queue: VecDeque::new(),
    };
    Ok(stream::try_unfold(state, next_text_batch).boxed())
}

pub(super) async fn next_text_batch(mut st: TextState) -> Result<Option<(RecordBatch, TextState)>> {
    match next_decoded(&mut st).await {
        Ok(Some(b)) => {
            st.rows_out += b.num_rows() as u64;
            Ok(Some((b, st)))
        }
        Ok(None) => Ok(None),
        Err(Failed::Read(e)) => Err(e),
        Err(Failed::Decode(e))
            if st.evolve
                && e.to_string().contains("missing from schema")
                && !e.to_string().contains("whilst decoding field") =>
        {
            match new_fields(ErrCtx::of(&st)).await? {
                Some(changed) => Err(changed),
                None => Err(locate_text_error(ErrCtx::of(&st), e).await),
            }
        }
        Err(Failed::Decode(e)) => match st.rejects.clone() {
            None => Err(locate_text_error(ErrCtx::of(&st), e).await),
            Some(rejects) => {
                // The rest of the file, line by line: good lines become
                // rows, bad ones dead letters.
                let ctx = ErrCtx::of(&st);
                st.queue = decode_rest_by_line(ctx, st.rows_out, st.batch_size, &rejects)
                    .await?
                    .into();
                st.finished = true;
                match st.queue.pop_front() {
                    Some(b) => {
                        st.rows_out += b.num_rows() as u64;
                        Ok(Some((b, st)))
                    }
                    None => Ok(None),
                }
            }
        },
    }
}

/// The file `st` names has fields its schema lacks: infer the file's
/// schema and return [`Error::SchemaChanged`] with the new top-level fields
/// appended (nullable); `None` when no top-level field is new.
async fn new_fields(st: ErrCtx) -> Result<Option<Error>> {
    let malformed = |reason: String| Error::Malformed {
        source_name: st.name.clone(),
        file: st.path.clone(),
        line: None,
        reason,
    };
    let bytes = get_all(&st.name, &st.store, &object_path(&st.path)).await?;
    let bytes = decompress_all(bytes, st.compression)
        .await
        .map_err(|e| malformed(format!("cannot decompress: {e}")))?;
    let (inferred, _) =
        arrow::json::reader::infer_json_schema(std::io::BufReader::new(bytes.reader()), None)
            .map_err(|e| malformed(e.to_string()))?;
    let new: Vec<&Field> = inferred
        .fields()
        .iter()
        .map(|f| f.as_ref())
        .filter(|f| st.schema.field_with_name(f.name()).is_err())
        .collect();
    if new.is_empty() {
        return Ok(None);
    }
    Ok(Some(schema_changed(&st.name, &st.path, &st.schema, &new)))
}

/// The next chunk of the file into `st.buf` (or `st.eof`).
async fn pull(st: &mut TextState) -> Result<(), Failed> {
    match st.chunks.next().await {
        Some(Ok(b)) => st.buf = b,
        Some(Err(e)) => {
            return Err(Failed::Read(Error::Store {
                source_name: st.name.clone(),
                file: st.entry.path.clone(),
                source: e,
            }));
        }
        None => st.eof = true,
    }
    Ok(())
}

/// A CSV file whose header is the schema's columns followed by more:
/// [`Error::SchemaChanged`] with those appended (types inferred from the
/// first chunk's rows). `None` when the header adds nothing, or does not
/// start with the schema's columns (then the file is read as before).
fn csv_new_columns(st: &TextState, delimiter: u8) -> Option<Error> {
    let end = st.buf.iter().rposition(|b| *b == b'\n')?;
    let sample = &st.buf[..=end];
    let (inferred, _) = arrow::csv::reader::Format::default()
        .with_header(true)
        .with_delimiter(delimiter)
        .infer_schema(std::io::Cursor::new(sample), Some(1000))
        .ok()?;
    let names: Vec<&String> = inferred.fields().iter().map(|f| f.name()).collect();
    let known = st.schema.fields().len();
    if names.len() <= known
        || !st
            .schema
            .fields()
            .iter()
            .zip(&names)
            .all(|(f, n)| f.name() == *n)
    {
        return None;
    }
    let new: Vec<&Field> = inferred.fields()[known..]
        .iter()
        .map(|f| f.as_ref())
        .collect();
    Some(schema_changed(&st.name, &st.entry.path, &st.schema, &new))
}

/// [`Error::SchemaChanged`]: `file` of source `name` adds `new` to
/// `schema` (appended, nullable).
fn schema_changed(name: &str, file: &str, schema: &Schema, new: &[&Field]) -> Error {
    let mut fields: Vec<Field> = schema.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.extend(
        new.iter()
            .map(|f| Field::new(f.name(), f.data_type().clone(), true)),
    );
    Error::SchemaChanged {
        source_name: name.to_string(),
        file: file.to_string(),
        added: new.iter().map(|f| f.name().clone()).collect(),
        schema: Arc::new(Schema::new(fields)),
    }
}

/// Why decoding stopped: the read failed (the store, or a CSV header with
/// new columns), or the text did not decode.
enum Failed {
    Read(Error),
    Decode(arrow::error::ArrowError),
}

async fn next_decoded(st: &mut TextState) -> Result<Option<RecordBatch>, Failed> {
    if st.evolve
        && st.rows_out == 0
        && st.queue.is_empty()
        && let FileFormat::Csv {
            has_header: true,
            delimiter,
        } = st.format
        && st.buf.is_empty()
        && !st.eof
    {
        // The first chunk, to compare the header with the schema.
        pull(st).await?;
        if let Some(changed) = csv_new_columns(st, delimiter) {
            return Err(Failed::Read(changed));
        }
    }
    loop {
        if let Some(b) = st.queue.pop_front() {
            return Ok(Some(b));
        }
        if st.finished {
            return Ok(None);
        }
        if st.buf.is_empty() && !st.eof {
            pull(st).await?;
        }
        if st.eof && st.buf.is_empty() {
            // An empty buffer tells the CSV decoder the last line has ended.
            let flushed = st.decoder.decode(&[]).and_then(|_| st.decoder.flush());
            st.finished = true;
            return match flushed {
                Ok(Some(b)) if b.num_rows() > 0 => Ok(Some(b)),
                Ok(_) => Ok(None),
                Err(e) => Err(Failed::Decode(e)),
            };
        }
        let consumed = st.decoder.decode(&st.buf).map_err(Failed::Decode)?;
        st.buf.advance(consumed);
        if (st.decoder.is_full(st.batch_size) || (consumed == 0 && !st.buf.is_empty()))
            && let Some(b) = st.decoder.flush().map_err(Failed::Decode)?
        {
            return Ok(Some(b));
        }
    }
}

/// After a line of the file `st` names failed to decode: read the file again and
/// decode the lines after the rows already returned one at a time. Lines
/// that decode are returned as batches; the others are put in `rejects`
/// with their line number and text. (A CSV record spanning lines in quotes
/// is split at its newlines here.)
async fn decode_rest_by_line(
    st: ErrCtx,
    rows_out: u64,
    batch_size: usize,
    rejects: &Rejects,
) -> Result<Vec<RecordBatch>> {
    let malformed = |line: Option<u64>, reason: String| Error::Malformed {
        source_name: st.name.clone(),
        file: st.path.clone(),
        line,
        reason,
    };
    let bytes = get_all(&st.name, &st.store, &object_path(&st.path)).await?;
    let bytes = decompress_all(bytes, st.compression)
        .await
        .map_err(|e| malformed(None, format!("cannot decompress: {e}")))?;
    // Lines are decoded without the header, which is skipped here.
    let (mut header, line_format) = match &st.format {
        FileFormat::Csv {
            has_header,
            delimiter,
        } => (
            *has_header,
            FileFormat::Csv {
                has_header: false,
                delimiter: *delimiter,
            },
        ),
        other => (false, other.clone()),
    };
    let decoder = || {
        TextDecoder::new(&line_format, st.schema.clone(), batch_size, false)
            .map_err(|reason| malformed(None, reason))
    };
    let mut already = rows_out;
    let mut good: Vec<&[u8]> = Vec::new();
    let mut bad = Vec::new();
    for (i, line) in bytes.split(|b| *b == b'\n').enumerate() {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if header {
            header = false;
            continue;
        }
        if already > 0 {
            already -= 1;
            continue;
        }
        let mut d = decoder()?;
        match decode_line(&mut d, line) {
            Ok(()) => good.push(line),
            Err(e) => bad.push(Rejected {
                file: Some(st.path.clone()),
                line: Some(i as u64 + 1),
                record: line.to_vec(),
                error: e.to_string(),
                ..Default::default()
            }),
        }
    }
    let mut out = Vec::new();
    let mut d = decoder()?;
    for (n, line) in good.iter().enumerate() {
        decode_line_into(&mut d, line).map_err(|e| malformed(None, e.to_string()))?;
        if (d.is_full(batch_size) || n + 1 == good.len())
            && let Some(b) = d.flush().map_err(|e| malformed(None, e.to_string()))?
        {
            out.push(b);
        }
    }
    rejects.lock().expect("rejected lines").extend(bad);
    Ok(out)
}

/// Decode one line (without its newline) into `d`, not flushed.
fn decode_line_into(d: &mut TextDecoder, line: &[u8]) -> Result<(), arrow::error::ArrowError> {
    let mut rest = line;
    while !rest.is_empty() {
        let n = d.decode(rest)?;
        if n == 0 {
            break;
        }
        rest = &rest[n..];
    }
    d.decode(b"\n")?;
    Ok(())
}

/// Whether one line decodes into rows of the schema, on its own.
fn decode_line(d: &mut TextDecoder, line: &[u8]) -> Result<(), arrow::error::ArrowError> {
    decode_line_into(d, line)?;
    d.decode(&[])?;
    d.flush()?;
    Ok(())
}

/// Where the first line starting at or after byte `at` of `entry` begins:
/// just past the first newline at or after `at - 1` (0 for 0, the file's
/// size when no line starts there). A range `a..b` of a file then owns the
/// lines starting in it: `line_start(a)..line_start(b)`, so ranges that
/// tile a file read each of its lines exactly once. A probe that `cached`
/// (the local file) holds in the page cache is read from it.
pub(super) async fn line_start(
    name: &str,
    store: &Arc<dyn ObjectStore>,
    entry: &FileEntry,
    at: u64,
    cached: Option<&CachedFile>,
) -> Result<u64> {
    const PROBE: u64 = 64 << 10;
    if at == 0 || at >= entry.size {
        return Ok(at.min(entry.size));
    }
    let path = object_path(&entry.path);
    let mut from = at - 1;
    while from < entry.size {
        let to = (from + PROBE).min(entry.size);
        let bytes = match cached.and_then(|f| f.read(from..to)) {
            Some(bytes) => bytes,
            None => store
                .get_range(&path, from..to)
                .await
                .map_err(|source| Error::Store {
                    source_name: name.to_string(),
                    file: entry.path.clone(),
                    source,
                })?,
        };
        if let Some(i) = bytes.iter().position(|b| *b == b'\n') {
            return Ok(from + i as u64 + 1);
        }
        from = to;
    }
    Ok(entry.size)
}

/// Bytes read per request from an object store: large reads keep the
/// round trip per request negligible.
pub(super) const READ_CHUNK: u64 = 4 << 20;

/// Bytes read per request from a local disk. A request costs a blocking
/// task, not a round trip, and a 1 MiB buffer is still in the core's cache
/// when the decoder reads it: against 4 MiB, a backfill takes the same time
/// with less peak memory and fewer page faults.
pub(super) const LOCAL_READ_CHUNK: u64 = 1 << 20;

/// Bytes per read request: [`LOCAL_READ_CHUNK`] from a local disk,
/// [`READ_CHUNK`] from an object store.
pub(super) fn read_chunk(local: bool) -> u64 {
    if local { LOCAL_READ_CHUNK } else { READ_CHUNK }
}

/// The file as a stream of `chunk`-byte ranges, the next one fetched while
/// the current one is decoded.
///
/// On the local file system (`cached`: the file, open), a range the page
/// cache holds whole is read on the decoding thread itself (`preadv2` with
/// `RWF_NOWAIT`, which never waits on the disk); any other range is read
/// by the store, on its blocking pool. Handing every read to the pool cost
/// two thread wake-ups per chunk, and beside a busy neighbour each one gave
/// the core away: beside busy neighbours the backfill ran measurably slower
/// that way than reading cached ranges here, with many more voluntary
/// context switches; on a quiet machine the two are even.
pub(super) fn ranged_chunks(
    store: Arc<dyn ObjectStore>,
    path: Path,
    bytes: std::ops::Range<u64>,
    chunk: u64,
    cached: Option<Arc<CachedFile>>,
) -> BoxStream<'static, object_store::Result<Bytes>> {
    let end = bytes.end;
    let ranges: Vec<std::ops::Range<u64>> = bytes
        .step_by(chunk as usize)
        .map(|a| a..(a + chunk).min(end))
        .collect();
    stream::iter(ranges)
        .map(move |r| {
            let store = store.clone();
            let path = path.clone();
            let cached = cached.clone();
            async move {
                if let Some(b) = cached.as_deref().and_then(|f| f.read(r.clone())) {
                    // A read from the page cache never waits, so without
                    // this the decoding task would keep its worker for a
                    // whole batch, and the tasks closing the files its
                    // writer finished (holding their row groups) would wait
                    // for the batch's end: peak memory rose from 66 to 155
                    // MiB on the backfill.
                    tokio::task::yield_now().await;
                    return Ok(b);
                }
                store.get_range(&path, r).await
            }
        })
        .buffered(2)
        .boxed()
}

/// A local file open for reads of what the page cache already holds.
pub(super) struct CachedFile(std::fs::File);

impl CachedFile {
    /// The file the local store reads for `path`, or `None` when it cannot
    /// be opened here (the store then reads and reports it).
    pub(super) fn open(path: &Path) -> Option<Self> {
        if !cfg!(target_os = "linux") {
            return None;
        }
        let file = object_store::local::LocalFileSystem::new()
            .path_to_filesystem(path)
            .ok()?;
        std::fs::File::open(file).ok().map(Self)
    }

    /// The file's size now (`fstat`), or `None` when it cannot be read
    /// here (the store's `head` then answers).
    pub(super) fn size(&self) -> Option<u64> {
        self.0.metadata().ok().map(|m| m.len())
    }

    /// The bytes of `range` when the page cache holds all of them; `None`
    /// when any would wait on the disk, lie past the file's end, or the
    /// read fails (the store then reads the range).
    #[cfg(target_os = "linux")]
    pub(super) fn read(&self, range: std::ops::Range<u64>) -> Option<Bytes> {
        use std::os::fd::AsRawFd;
        let len = usize::try_from(range.end.checked_sub(range.start)?).ok()?;
        let mut buf: Vec<u8> = Vec::with_capacity(len);
        let mut done = 0usize;
        while done < len {
            let iov = libc::iovec {
                // SAFETY: `done < len <= capacity`: the pointer stays in
                // the buffer's allocation.
                iov_base: unsafe { buf.as_mut_ptr().add(done) }.cast(),
                iov_len: len - done,
            };
            let at = libc::off_t::try_from(range.start + done as u64).ok()?;
            // SAFETY: one iovec over the buffer's spare capacity, a valid
            // open descriptor; the kernel writes at most `iov_len` bytes.
            let n = unsafe { libc::preadv2(self.0.as_raw_fd(), &iov, 1, at, libc::RWF_NOWAIT) };
            if n <= 0 {
                // Not cached (EAGAIN), the file's end, or an error.
                return None;
            }
            done += n as usize;
        }
        // SAFETY: the kernel wrote all `len` bytes.
        unsafe { buf.set_len(len) };
        Some(Bytes::from(buf))
    }

    #[cfg(not(target_os = "linux"))]
    pub(super) fn read(&self, _range: std::ops::Range<u64>) -> Option<Bytes> {
        None
    }
}

/// The decompressed bytes of a compressed chunk stream, in chunks of up to
/// 1 MiB; other streams pass through.
pub(super) fn decompressed(
    chunks: BoxStream<'static, object_store::Result<Bytes>>,
    compression: TextCompression,
) -> BoxStream<'static, object_store::Result<Bytes>> {
    use async_compression::tokio::bufread::{GzipDecoder, ZstdDecoder};
    use tokio_util::io::{ReaderStream, StreamReader};
    let err = |store: &'static str| {
        move |e: std::io::Error| object_store::Error::Generic {
            store,
            source: Box::new(e),
        }
    };
    match compression {
        TextCompression::Gzip => {
            let mut d = GzipDecoder::new(StreamReader::new(chunks.map_err(std::io::Error::other)));
            d.multiple_members(true);
            ReaderStream::with_capacity(d, 1 << 20)
                .map_err(err("gzip decoder"))
                .boxed()
        }
        TextCompression::Zstd => {
            let mut d = ZstdDecoder::new(StreamReader::new(chunks.map_err(std::io::Error::other)));
            d.multiple_members(true);
            ReaderStream::with_capacity(d, 1 << 20)
                .map_err(err("zstd decoder"))
                .boxed()
        }
        TextCompression::Auto | TextCompression::None => chunks,
    }
}

/// A whole (small) file decompressed in memory: schema inference and the
/// error path only.
pub(super) async fn decompress_all(
    bytes: Bytes,
    compression: TextCompression,
) -> std::io::Result<Bytes> {
    use async_compression::tokio::bufread::{GzipDecoder, ZstdDecoder};
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    match compression {
        TextCompression::Gzip => {
            let mut d = GzipDecoder::new(&bytes[..]);
            d.multiple_members(true);
            d.read_to_end(&mut out).await?;
        }
        TextCompression::Zstd => {
            let mut d = ZstdDecoder::new(&bytes[..]);
            d.multiple_members(true);
            d.read_to_end(&mut out).await?;
        }
        TextCompression::Auto | TextCompression::None => return Ok(bytes),
    }
    Ok(Bytes::from(out))
}

/// `Ok(None)` when the store says the file does not exist.
pub(super) fn present<T>(
    name: &str,
    entry: &FileEntry,
    r: object_store::Result<T>,
) -> Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(e) => Err(Error::Store {
            source_name: name.to_string(),
            file: entry.path.clone(),
            source: e,
        }),
    }
}

/// A file planned into a batch that is gone when the batch runs (retention
/// deleted it while the query was down, or the user removed it). Without
/// `skip` the batch fails naming the file: committing it would lose the
/// file's rows silently. With `skip` the file is left out, loudly, and
/// recorded for the commit.
pub(super) fn vanished(
    name: &str,
    entry: &FileEntry,
    skip: Option<&Arc<Mutex<Vec<Skipped>>>>,
) -> Result<BatchStream> {
    let Some(skipped) = skip else {
        return Err(Error::MissingFile {
            source_name: name.to_string(),
            file: entry.path.clone(),
        });
    };
    tracing::warn!(
        source = name,
        file = %entry.path,
        "a file planned into this batch no longer exists; its rows are skipped (missing_files = skip)"
    );
    skipped.lock().expect("skipped files").push(Skipped {
        what: entry.path.clone(),
        reason: "planned but no longer exists (missing_files = skip)".into(),
    });
    Ok(stream::empty().boxed())
}

/// Turn a decode error into one naming the line: re-read the file (this is
/// the error path only) and decode it line by line until one fails.
pub(super) struct ErrCtx {
    name: String,
    store: Arc<dyn ObjectStore>,
    path: String,
    schema: SchemaRef,
    format: FileFormat,
    compression: TextCompression,
}

impl ErrCtx {
    pub(super) fn of(st: &TextState) -> Self {
        Self {
            name: st.name.clone(),
            store: st.store.clone(),
            path: st.entry.path.clone(),
            schema: st.schema.clone(),
            format: st.format.clone(),
            compression: st.compression,
        }
    }
}

pub(super) async fn locate_text_error(st: ErrCtx, err: arrow::error::ArrowError) -> Error {
    let mut line = None;
    let mut reason = err.to_string();
    if st.format == FileFormat::Json
        && let Ok(bytes) = get_all(&st.name, &st.store, &object_path(&st.path)).await
        && let Ok(bytes) = decompress_all(bytes, st.compression).await
    {
        for (i, text) in bytes.split(|b| *b == b'\n').enumerate() {
            if text.iter().all(|b| b.is_ascii_whitespace()) {
                continue;
            }
            let Ok(mut d) = TextDecoder::new(&st.format, st.schema.clone(), 16, false) else {
                break;
            };
            if let Err(e) = d.decode(text).and_then(|_| d.flush()) {
                line = Some(i as u64 + 1);
                reason = e.to_string();
                break;
            }
        }
    } else if let Some(l) = csv_line_of(&reason) {
        line = Some(l);
    }
    Error::Malformed {
        source_name: st.name,
        file: st.path,
        line,
        reason,
    }
}

/// arrow-csv reports "... at line N" counting data rows from 1 after the
/// header; keep that number as it names the line a user looks for.
pub(super) fn csv_line_of(reason: &str) -> Option<u64> {
    let idx = reason.rfind("line ")?;
    reason[idx + 5..]
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}
