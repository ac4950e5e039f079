//! The file source: JSON-lines, CSV or Parquet files under a directory or an
//! object-store prefix.
//!
//! Each planned batch takes the files not seen before, ordered by
//! (modification time, path) and capped by `max_files_per_trigger` and
//! `max_bytes_per_trigger`. The batch's file list is its end offset, so the
//! checkpoint's `offsets/N` records exactly which files batch N read; on
//! restart [`Source::recover`] rebuilds the seen set from those lists, and no
//! file is read twice or skipped.
//!
//! Files are streamed: a file is decoded chunk by chunk as it downloads
//! (gzip and zstd text files are decompressed on the way), Parquet row group
//! by row group, and a few files per partition are read at once so batches
//! of many small files on object stores are not bound by request latency.
//! A batch of uncompressed JSON lines is cut into equal byte shares, one per
//! partition, at line boundaries, so partitions finish together however few
//! files the batch holds.
//! Writers should put files in place atomically (write elsewhere, then rename
//! or upload in one request): a half-written file that is listed is read as
//! it is.
//!
//! Listing: `available-now` lists once, at the start, and takes batches from
//! that list (which is also the progress total). Other triggers list at each
//! plan, or, with `incremental_listing` for layouts whose new files sort
//! after the old ones (`date=2026-01-02/...`), list only the paths after the
//! greatest path taken. Filters: hidden names (`.`/`_`), `path_glob`,
//! `modified_after` / `modified_before`. Hive-style directories
//! (`year=2026/month=01/`) fill the declared partition columns.
//!
//! The seen-files set is summarized by [`Source::snapshot`], so a restart
//! reads the latest summary plus the batches after it. With `max_file_age`
//! it is also bounded: once files have been taken, a file whose
//! modification time is older than the newest taken file's minus that age
//! is ignored when listed, and forgotten once taken, so the set holds only
//! the files of the last `max_file_age`.

mod source_impl;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use arrow::array::{ArrayRef, RecordBatch, StringArray, new_null_array};
use arrow::datatypes::{Schema, SchemaRef};
use async_trait::async_trait;
use bytes::{Buf, Bytes};
use futures::stream::{self, BoxStream};
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};
use parquet::arrow::ParquetRecordBatchStreamBuilder;
// `ParquetObjectReader` is deprecated in favour of a hand-written
// `AsyncFileReader`; it still does ranged reads over object_store, which is
// all this source needs.
#[allow(deprecated)]
use parquet::arrow::async_reader::ParquetObjectReader;
use serde::{Deserialize, Serialize};

use crate::{
    Backlog, BatchStream, Error, Offset, OnError, Rejected, Rejects, Result, Skipped, Source,
    SourceIdentity, require_positive,
};
use lakestream_storage::{Location, StoreRegistry};

pub(crate) mod columnar;
pub mod connector;
pub use columnar::open_parquet;
pub(crate) mod decode;
mod list;
mod seen;

use columnar::*;
use decode::*;
pub use list::Shard;
use list::*;
use seen::*;

/// The encoding of the files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileFormat {
    /// One JSON object per line.
    Json,
    /// Delimited text.
    Csv {
        /// Whether the first line of each file is a header.
        has_header: bool,
        /// The field delimiter.
        delimiter: u8,
    },
    /// Apache Parquet.
    Parquet,
    /// Apache Avro object container files (the writer schema in each
    /// file's header, resolved to the columns by name).
    Avro,
}

impl FileFormat {
    /// The format for a `STORED AS` name (`JSON`, `NDJSON`, `CSV`,
    /// `PARQUET`, `AVRO`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name.to_ascii_uppercase().as_str() {
            "JSON" | "NDJSON" | "JSONL" => Some(Self::Json),
            "CSV" => Some(Self::Csv {
                has_header: true,
                delimiter: b',',
            }),
            "PARQUET" => Some(Self::Parquet),
            "AVRO" => Some(Self::Avro),
            _ => None,
        }
    }
}

/// Settings of a [`FileSource`].
#[derive(Debug, Clone)]
pub struct FileSourceOptions {
    /// How the files are encoded.
    pub format: FileFormat,
    /// At most this many files per batch (`None`: no cap).
    pub max_files_per_trigger: Option<usize>,
    /// At most about this many bytes per batch; a batch always takes at least
    /// one file, even one larger than the cap (`None`: no cap).
    pub max_bytes_per_trigger: Option<u64>,
    /// The byte cap instead of `max_bytes_per_trigger` when the query holds
    /// each batch in memory ([`Source::hold_batches_in_memory`]: a stateful
    /// aggregation, several outputs); `None`: `max_bytes_per_trigger` then
    /// too. Set it to `None` when `max_bytes_per_trigger` is the user's.
    pub held_max_bytes_per_trigger: Option<u64>,
    /// Rows per decoded record batch.
    pub batch_size: usize,
    /// Columns filled from Hive-style directory names (`year=2026/`), in
    /// the schema; files need not contain them.
    pub partition_columns: Vec<String>,
    /// Only files whose path below the location matches this glob
    /// (`*` stays within a directory, `**` crosses directories).
    pub path_glob: Option<String>,
    /// Only files modified at or after this time (ms since the epoch).
    pub modified_after_ms: Option<i64>,
    /// Only files modified before this time (ms since the epoch).
    pub modified_before_ms: Option<i64>,
    /// How text files are compressed.
    pub compression: TextCompression,
    /// List only paths after the greatest path taken (for layouts where new
    /// files always sort after old ones).
    pub incremental_listing: bool,
    /// Small files (under 4 MiB on average) read at once within one
    /// partition of a batch; larger files are read one at a time.
    pub read_concurrency: usize,
    /// What a batch does with a planned file that no longer exists.
    pub missing_files: MissingFiles,
    /// Bound the seen-files set by time (ms): once files were taken, files
    /// modified more than this before the newest file taken are ignored and
    /// forgotten. `None`: every file is remembered and a late file of any
    /// age is read.
    pub max_file_age_ms: Option<i64>,
    /// What a batch does with a line it cannot decode (JSON and CSV).
    pub on_error: OnError,
    /// Read only the files of this shard (several processes sharing one
    /// location, each with its own checkpoint).
    pub shard: Option<Shard>,
    /// JSON (and CSV with a header, new columns after the known ones): a
    /// file with top-level fields the schema lacks stops the batch
    /// with [`Error::SchemaChanged`] carrying the schema with them (the
    /// engine records it for the next run); `false`: such fields are
    /// ignored.
    pub schema_evolution: bool,
    /// The embedder's stores, for buckets it serves itself (empty: every
    /// location gets a store built from its URL and store options).
    pub object_stores: StoreRegistry,
}

/// What a batch does with a file it planned that is gone when it runs
/// (deleted by retention while the query was down, removed by hand).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MissingFiles {
    /// Fail the batch with [`Error::MissingFile`] naming the file: the
    /// batch is not committed and a restart tries again.
    #[default]
    Fail,
    /// Commit the batch without the file's rows; the skip is reported
    /// through [`Source::take_skipped`] (and so in the commit and progress).
    Skip,
}

impl MissingFiles {
    /// The policy for an option value (`fail`, `skip`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "fail" | "error" => Some(Self::Fail),
            "skip" => Some(Self::Skip),
            _ => None,
        }
    }
}

/// How JSON and CSV files are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TextCompression {
    /// By file extension: `.gz` gzip, `.zst` / `.zstd` zstd, else none.
    #[default]
    Auto,
    /// Not compressed.
    None,
    /// gzip (also multi-member files).
    Gzip,
    /// zstd.
    Zstd,
}

impl TextCompression {
    /// The compression for an option value (`auto`, `none`, `gzip`, `zstd`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "auto" => Some(Self::Auto),
            "none" | "uncompressed" => Some(Self::None),
            "gzip" | "gz" => Some(Self::Gzip),
            "zstd" | "zst" => Some(Self::Zstd),
            _ => None,
        }
    }

    fn for_path(self, path: &str) -> Self {
        match self {
            Self::Auto if path.ends_with(".gz") || path.ends_with(".gzip") => Self::Gzip,
            Self::Auto if path.ends_with(".zst") || path.ends_with(".zstd") => Self::Zstd,
            Self::Auto => Self::None,
            other => other,
        }
    }
}

/// Default `max_bytes_per_trigger`: 256 MiB. A stateless query's batch
/// streams, so its size does not set memory (the sink bounds its open
/// files whatever the batch's size); fewer, larger batches leave the cores
/// idle at fewer commits (a backfill comes closer to the raw floor at
/// 256 MiB than at 64 MiB).
pub const DEFAULT_MAX_BYTES_PER_TRIGGER: u64 = 256 << 20;

/// Default `held_max_bytes_per_trigger`: 64 MiB, for a query that holds a
/// batch's groups or rows in memory, whose peak memory grows with the
/// batch (a windowed count by user over the backfill's events more than
/// doubles it from 64 MiB to 256 MiB batches).
pub const DEFAULT_HELD_MAX_BYTES_PER_TRIGGER: u64 = 64 << 20;

impl FileSourceOptions {
    /// Options with the default byte cap ([`DEFAULT_MAX_BYTES_PER_TRIGGER`]),
    /// no file cap, a batch size of 8192 rows, no filters, compression by
    /// extension and four files read at once per partition.
    pub fn new(format: FileFormat) -> Self {
        Self {
            format,
            max_files_per_trigger: None,
            max_bytes_per_trigger: Some(DEFAULT_MAX_BYTES_PER_TRIGGER),
            held_max_bytes_per_trigger: Some(DEFAULT_HELD_MAX_BYTES_PER_TRIGGER),
            batch_size: 8192,
            partition_columns: Vec::new(),
            path_glob: None,
            modified_after_ms: None,
            modified_before_ms: None,
            compression: TextCompression::Auto,
            incremental_listing: false,
            read_concurrency: 4,
            missing_files: MissingFiles::Fail,
            max_file_age_ms: None,
            on_error: OnError::Fail,
            schema_evolution: false,
            object_stores: StoreRegistry::default(),
            shard: None,
        }
    }
}

/// One file taken by a batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Object-store path of the file.
    pub path: String,
    /// Size in bytes when listed.
    pub size: u64,
    /// Modification time when listed, ms since the epoch.
    pub mtime_ms: i64,
}

/// The end offset of a batch of the file source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilesOffset {
    /// Files taken by all batches up to and including this one.
    pub count: u64,
    /// The files of this batch, in read order.
    pub files: Vec<FileEntry>,
}

impl FilesOffset {
    /// The batch's files for a reader: how many, where they fall in the
    /// source's sequence, then each path.
    pub fn describe(&self) -> Vec<String> {
        let n = self.files.len() as u64;
        let mut out = vec![format!(
            "{n} files (files {}..{} of the source)",
            self.count.saturating_sub(n),
            self.count
        )];
        out.extend(self.files.iter().map(|f| f.path.clone()));
        out
    }
}

/// A source of files under one location. See the module docs.
#[derive(Debug)]
pub struct FileSource {
    name: String,
    location: Location,
    schema: SchemaRef,
    /// The schema decoded from files: `schema` without partition columns.
    file_schema: SchemaRef,
    glob: Option<glob::Pattern>,
    options: FileSourceOptions,
    state: Mutex<SeenState>,
    /// Files the reads of the current batch skipped (`missing_files 'skip'`).
    skipped: Arc<Mutex<Vec<Skipped>>>,
    /// Lines the reads of the current batch could not decode
    /// (`on_error 'dead_letter'`).
    rejected: Rejects,
    /// The query holds batches in memory: `held_max_bytes_per_trigger`
    /// caps them.
    held: std::sync::atomic::AtomicBool,
}

impl FileSource {
    /// A file source named `name` over `location` (path or URL) producing
    /// `schema`.
    pub fn try_new(
        name: &str,
        location: &str,
        store_options: &std::collections::HashMap<String, String>,
        schema: SchemaRef,
        options: FileSourceOptions,
    ) -> Result<Self> {
        let location = Location::parse_with(location, store_options, &options.object_stores)
            .map_err(|source| Error::Location {
                source_name: name.to_string(),
                source,
            })?;
        let invalid = |option: &str, reason: String| Error::InvalidOption {
            source_name: name.to_string(),
            option: option.to_string(),
            reason,
        };
        require_positive(name, "batch_size", options.batch_size as u64)?;
        require_positive(name, "read_concurrency", options.read_concurrency as u64)?;
        if let Some(n) = options.max_files_per_trigger {
            require_positive(name, "max_files_per_trigger", n as u64)?;
        }
        if let Some(n) = options.max_bytes_per_trigger {
            require_positive(name, "max_bytes_per_trigger", n)?;
        }
        if let Some(n) = options.held_max_bytes_per_trigger {
            require_positive(name, "held_max_bytes_per_trigger", n)?;
        }
        if let Some(n) = options.max_file_age_ms {
            require_positive(name, "max_file_age", u64::try_from(n).unwrap_or(0))?;
        }
        for p in &options.partition_columns {
            if schema.index_of(p).is_err() {
                return Err(invalid(
                    "partition_columns",
                    format!("partition column {p} is not in the schema"),
                ));
            }
        }
        let file_schema = Arc::new(Schema::new(
            schema
                .fields()
                .iter()
                .filter(|f| !options.partition_columns.contains(f.name()))
                .cloned()
                .collect::<Vec<_>>(),
        ));
        if options.on_error == OnError::DeadLetter
            && matches!(options.format, FileFormat::Parquet | FileFormat::Avro)
        {
            return Err(invalid(
                "on_error",
                "'dead_letter' sets aside undecodable lines of JSON and CSV files; a Parquet \
                 or Avro file is read whole or not at all"
                    .into(),
            ));
        }
        let evolvable = matches!(
            options.format,
            FileFormat::Json
                | FileFormat::Csv {
                    has_header: true,
                    ..
                }
        );
        if options.schema_evolution && !evolvable {
            return Err(invalid(
                "schema_evolution",
                "'add_new_columns' applies to JSON files and CSV files with a header (new \
                 columns after the known ones); Parquet and headerless CSV keep the schema \
                 they started with"
                    .into(),
            ));
        }
        let glob = compile_glob(name, &options)?;
        Ok(Self {
            name: name.to_string(),
            location,
            schema,
            file_schema,
            glob,
            options,
            state: Mutex::new(SeenState::default()),
            skipped: Arc::new(Mutex::new(Vec::new())),
            rejected: Arc::new(Mutex::new(Vec::new())),
            held: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// List the files this source may read, in read order, after `after`
    /// (a path) when given.
    async fn list(&self, after: Option<&str>) -> Result<Vec<FileEntry>> {
        let filter = ListFilter::new(self.glob.as_ref(), &self.options);
        let mut files = list_files(&self.name, &self.location, &filter, after).await?;
        if self.options.incremental_listing {
            // Path order is what the listing offset relies on.
            files.sort_by(|a, b| a.path.cmp(&b.path));
        }
        Ok(files)
    }

    /// With incremental listing, the greatest path taken: list after it.
    fn listing_offset(&self) -> Option<String> {
        if !self.options.incremental_listing {
            return None;
        }
        self.state
            .lock()
            .expect("file source state")
            .max_path
            .clone()
    }

    /// Partition values of a file from its `key=value` directories.
    fn partition_values(&self, path: &str) -> Vec<(String, Option<String>)> {
        let root = self.location.root().as_ref();
        let rel = path
            .strip_prefix(root)
            .map(|r| r.trim_start_matches('/'))
            .unwrap_or(path);
        let mut dirs: Vec<&str> = rel.split('/').collect();
        dirs.pop();
        self.options
            .partition_columns
            .iter()
            .map(|col| {
                // Directory names are listed encoded; Hive escapes too
                // (`ts=2026-01-01 00%3A00`): decode both.
                let v = dirs.iter().rev().find_map(|d| {
                    d.split_once('=').filter(|(k, _)| k == col).map(|(_, v)| {
                        let once = percent_encoding::percent_decode_str(v).decode_utf8_lossy();
                        percent_encoding::percent_decode_str(&once)
                            .decode_utf8_lossy()
                            .into_owned()
                    })
                });
                (col.clone(), v.filter(|v| v != "__HIVE_DEFAULT_PARTITION__"))
            })
            .collect()
    }

    #[allow(deprecated)]
    /// Infer a schema from the first file (in read order) under `location`
    /// that a source with `options` would read (its glob, time bounds and
    /// compression apply), or `None` when there is no such file yet.
    pub async fn infer_schema(
        name: &str,
        location: &str,
        store_options: &std::collections::HashMap<String, String>,
        options: &FileSourceOptions,
    ) -> Result<Option<SchemaRef>> {
        let location = Location::parse_with(location, store_options, &options.object_stores)
            .map_err(|source| Error::Location {
                source_name: name.to_string(),
                source,
            })?;
        let glob = compile_glob(name, options)?;
        let filter = ListFilter::new(glob.as_ref(), options);
        let format = &options.format;
        let files = list_files(name, &location, &filter, None).await?;
        let Some(first) = files.first() else {
            return Ok(None);
        };
        let store = location.store().clone();
        let path = object_path(&first.path);
        let file = first.path.clone();
        let malformed = |reason: String| Error::Malformed {
            source_name: name.to_string(),
            file: file.clone(),
            line: None,
            reason,
        };
        let schema = match format {
            FileFormat::Parquet => {
                let reader = ParquetObjectReader::new(store, path).with_file_size(first.size);
                let builder = ParquetRecordBatchStreamBuilder::new(reader)
                    .await
                    .map_err(|e| malformed(e.to_string()))?;
                builder.schema().as_ref().clone()
            }
            FileFormat::Avro => {
                let reader = arrow_avro::reader::AsyncAvroFileReader::builder(
                    crate::avro::StoreFile::new(store, path),
                    first.size,
                    1,
                )
                .try_build()
                .await
                .map_err(|e| malformed(e.to_string()))?;
                crate::avro::columns_of(&reader.schema()).as_ref().clone()
            }
            FileFormat::Json => {
                let bytes = decompress_all(
                    get_all(name, &store, &path).await?,
                    options.compression.for_path(&first.path),
                )
                .await
                .map_err(|e| malformed(e.to_string()))?;
                let (schema, _) = arrow::json::reader::infer_json_schema(
                    std::io::BufReader::new(bytes.reader()),
                    Some(1000),
                )
                .map_err(|e| malformed(e.to_string()))?;
                schema
            }
            FileFormat::Csv {
                has_header,
                delimiter,
            } => {
                let bytes = decompress_all(
                    get_all(name, &store, &path).await?,
                    options.compression.for_path(&first.path),
                )
                .await
                .map_err(|e| malformed(e.to_string()))?;
                let (schema, _) = arrow::csv::reader::Format::default()
                    .with_header(*has_header)
                    .with_delimiter(*delimiter)
                    .infer_schema(bytes.reader(), Some(1000))
                    .map_err(|e| malformed(e.to_string()))?;
                schema
            }
        };
        Ok(Some(Arc::new(schema)))
    }

    fn parse_offset(&self, offset: &Offset) -> Result<FilesOffset> {
        serde_json::from_value(offset.clone()).map_err(|e| Error::InvalidOffset {
            source_name: self.name.clone(),
            offset: offset.to_string(),
            reason: e.to_string(),
        })
    }

    /// Whether a batch of `files` may be cut into line ranges: JSON lines
    /// read as they are (not compressed), failing on a bad line (dead
    /// letters keep the line-by-line fallback of whole files).
    fn splittable(&self, files: &[FileEntry]) -> bool {
        self.options.format == FileFormat::Json
            && self.options.on_error == OnError::Fail
            && files
                .iter()
                .all(|f| self.options.compression.for_path(&f.path) == TextCompression::None)
    }

    /// The byte cap of the next batch: `held_max_bytes_per_trigger` once
    /// the query holds batches in memory, if set.
    fn max_bytes_per_trigger(&self) -> Option<u64> {
        match self.options.held_max_bytes_per_trigger {
            Some(held) if self.held.load(std::sync::atomic::Ordering::Relaxed) => Some(held),
            _ => self.options.max_bytes_per_trigger,
        }
    }

    /// Whether the files are on the local file system.
    fn local(&self) -> bool {
        self.location.local_dir().is_some()
    }

    fn file_stream(&self, piece: Piece) -> BatchStream {
        let Piece { entry, range } = piece;
        let local = self.local();
        let store = self.location.store().clone();
        let schema = self.file_schema.clone();
        let name = self.name.clone();
        let format = self.options.format.clone();
        let batch_size = self.options.batch_size;
        let compression = self.options.compression.for_path(&entry.path);
        let partitions = self.partition_values(&entry.path);
        let full = self.schema.clone();
        let file = entry.path.clone();
        let missing = match self.options.missing_files {
            MissingFiles::Fail => None,
            MissingFiles::Skip => Some(self.skipped.clone()),
        };
        let evolve = self.options.schema_evolution;
        let rejects = match self.options.on_error {
            OnError::Fail => None,
            OnError::DeadLetter => Some(self.rejected.clone()),
        };
        let fut = async move {
            let path = object_path(&entry.path);
            // A local file is opened here, on the decoding thread: its size
            // and what the page cache holds of it are read without handing
            // a request to the store's blocking pool.
            let cached = if local {
                CachedFile::open(&path).map(Arc::new)
            } else {
                None
            };
            // The size is re-read rather than taken from the plan: a file
            // rewritten in place (fixing a malformed record) is read whole.
            let size = match cached.as_ref().and_then(|f| f.size()) {
                Some(size) => Some(size),
                None => present(&name, &entry, store.head(&path).await)?.map(|m| m.size),
            };
            let Some(size) = size else {
                // Reported once, by the file's first piece.
                if range.as_ref().is_some_and(|r| r.start > 0) {
                    return Ok(stream::empty().boxed());
                }
                return vanished(&name, &entry, missing.as_ref());
            };
            // A file rewritten since the plan is read whole, by its first
            // piece.
            let range = match range {
                Some(r) if size != entry.size => {
                    if r.start > 0 {
                        return Ok(stream::empty().boxed());
                    }
                    None
                }
                r => r,
            };
            let entry = FileEntry { size, ..entry };
            match format {
                FileFormat::Parquet => parquet_stream(name, store, entry, schema, batch_size).await,
                FileFormat::Avro => avro_stream(name, store, entry, schema, batch_size).await,
                FileFormat::Json | FileFormat::Csv { .. } => {
                    let options = TextOptions {
                        format,
                        batch_size,
                        compression,
                        rejects,
                        evolve,
                        range,
                        local,
                        cached,
                    };
                    text_stream(name, store, entry, schema, options).await
                }
            }
        };
        let batches = stream::once(fut).try_flatten();
        if partitions.is_empty() {
            return batches.boxed();
        }
        let source = self.name.clone();
        batches
            .map(move |b| {
                with_partition_columns(&b?, &full, &partitions).map_err(|reason| Error::Schema {
                    source_name: source.clone(),
                    file: file.clone(),
                    reason,
                })
            })
            .boxed()
    }
}

/// `batch` (a file's columns) with the partition columns added from the
/// file's directory names, in `schema`'s column order.
fn with_partition_columns(
    batch: &RecordBatch,
    schema: &SchemaRef,
    values: &[(String, Option<String>)],
) -> Result<RecordBatch, String> {
    let n = batch.num_rows();
    let cols = schema
        .fields()
        .iter()
        .map(|f| match values.iter().find(|(k, _)| k == f.name()) {
            Some((_, v)) => {
                let strings: ArrayRef = Arc::new(StringArray::from(vec![v.as_deref(); n]));
                let strict = arrow::compute::CastOptions {
                    safe: false,
                    ..Default::default()
                };
                arrow::compute::cast_with_options(&strings, f.data_type(), &strict).map_err(|e| {
                    format!(
                        "partition directory {}={} is not a {}: {e}",
                        f.name(),
                        v.as_deref().unwrap_or("null"),
                        f.data_type()
                    )
                })
            }
            None => batch
                .column_by_name(f.name())
                .cloned()
                .ok_or_else(|| format!("column {} missing", f.name())),
        })
        .collect::<Result<Vec<_>, String>>()?;
    RecordBatch::try_new(schema.clone(), cols).map_err(|e| e.to_string())
}

/// Bytes below which a file is not cut between partitions: a piece costs
/// two small reads to find its line boundaries.
const MIN_PIECE: u64 = 1 << 20;

/// A batch's file, or the lines whose first byte lies in `range` of it
/// (`None`: the whole file). The range is of the size the plan listed.
#[derive(Debug, Clone)]
struct Piece {
    entry: FileEntry,
    range: Option<std::ops::Range<u64>>,
}

impl Piece {
    fn whole(entry: FileEntry) -> Self {
        Self { entry, range: None }
    }

    fn len(&self) -> u64 {
        self.range
            .as_ref()
            .map_or(self.entry.size, |r| r.end - r.start)
    }
}

/// The size of the pieces a partition can take from another's group: a
/// partition left without work waits at most about one piece's decoding
/// for the other to finish. Local pieces cost a `stat` and a file open;
/// an object's cost a `HEAD` request, so they are larger.
fn steal_piece(local: bool) -> u64 {
    if local { 4 << 20 } else { 16 << 20 }
}

/// `group`'s pieces cut into pieces of about `size` bytes (the last of a
/// range takes a remainder under [`MIN_PIECE`]), in order.
fn cut_pieces(group: Vec<Piece>, size: u64) -> Vec<Piece> {
    let size = size.max(MIN_PIECE);
    let mut out = Vec::new();
    for piece in group {
        let range = piece.range.clone().unwrap_or(0..piece.entry.size);
        let mut at = range.start;
        loop {
            let to = if range.end - at <= size + MIN_PIECE {
                range.end
            } else {
                at + size
            };
            let whole = at == 0 && to == piece.entry.size;
            out.push(Piece {
                entry: piece.entry.clone(),
                range: (!whole).then_some(at..to),
            });
            at = to;
            if at >= range.end {
                break;
            }
        }
    }
    out
}

/// A batch's pieces, one queue per partition, each piece's stream not yet
/// started; shared by the partitions' streams (see `read`).
struct SharedPieces {
    groups: Mutex<Vec<VecDeque<(u64, BatchStream)>>>,
}

impl SharedPieces {
    fn partitions(&self) -> usize {
        self.groups.lock().expect("batch pieces").len()
    }

    /// Partition `own`'s next piece: the first of its own queue, else the
    /// last of the queue with the most bytes left (its reader is busy at
    /// the queue's front). `None` once every queue is empty.
    fn next(&self, own: usize) -> Option<BatchStream> {
        let mut groups = self.groups.lock().expect("batch pieces");
        if let Some((_, piece)) = groups[own].pop_front() {
            return Some(piece);
        }
        let busiest = (0..groups.len())
            .max_by_key(|i| groups[*i].iter().map(|(bytes, _)| *bytes).sum::<u64>())?;
        groups[busiest].pop_back().map(|(_, piece)| piece)
    }
}

/// Whole files over `partitions` groups, largest first to the lightest
/// group, so groups finish together when files cannot be cut.
fn spread_by_size(files: Vec<FileEntry>, partitions: usize) -> Vec<Vec<Piece>> {
    let partitions = partitions.max(1).min(files.len().max(1));
    let mut groups: Vec<Vec<Piece>> = vec![Vec::new(); partitions];
    let mut order = files;
    order.sort_by(|a, b| b.size.cmp(&a.size).then(a.path.cmp(&b.path)));
    let mut load = vec![0u64; partitions];
    for f in order {
        let i = (0..partitions).min_by_key(|i| load[*i]).unwrap_or(0);
        load[i] += f.size;
        groups[i].push(Piece::whole(f));
    }
    groups
}

/// The batch's bytes in `partitions` groups of equal size: the files in
/// plan order, cut where a group is full (never into a piece smaller than
/// [`MIN_PIECE`]), so every partition has the same work however many files
/// the batch holds (five equal files over two partitions would otherwise
/// leave one core idle for a fifth of the batch).
fn split_by_bytes(files: Vec<FileEntry>, partitions: usize) -> Vec<Vec<Piece>> {
    let total: u64 = files.iter().map(|f| f.size).sum();
    let share = total.div_ceil(partitions as u64).max(1);
    let mut groups: Vec<Vec<Piece>> = vec![Vec::new()];
    let mut room = share;
    for f in files {
        let mut at = 0;
        while at < f.size {
            let left = f.size - at;
            let last = groups.len() == partitions;
            let to = if last || left <= room.saturating_add(MIN_PIECE) {
                // The rest of the file fits (give or take a small piece).
                f.size
            } else if room >= MIN_PIECE {
                at + room
            } else {
                // Too little room for a piece: the group is full.
                at
            };
            if to > at {
                let range = (at > 0 || to < f.size).then_some(at..to);
                let piece = Piece {
                    entry: f.clone(),
                    range,
                };
                groups.last_mut().expect("a group").push(piece);
                room = room.saturating_sub(to - at);
                at = to;
            } else {
                room = 0;
            }
            if room == 0 && !last {
                groups.push(Vec::new());
                room = share;
            }
        }
    }
    groups.retain(|g| !g.is_empty());
    groups
}

#[cfg(test)]
mod tests;
