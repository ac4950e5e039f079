//! Reading a planned Parquet (row group by row group) or Avro (block by
//! block) file, with its batches conformed to the declared schema by
//! column name.

use super::*;

/// Open the Parquet file at `path` (of `size` bytes) in `store` as a
/// stream of record batches of `batch_size` rows, with the file's schema;
/// the error is the reader's message.
#[allow(deprecated)]
pub async fn open_parquet(
    store: Arc<dyn ObjectStore>,
    path: object_store::path::Path,
    size: u64,
    batch_size: usize,
) -> Result<
    (
        SchemaRef,
        parquet::arrow::async_reader::ParquetRecordBatchStream<ParquetObjectReader>,
    ),
    String,
> {
    let reader = ParquetObjectReader::new(store, path).with_file_size(size);
    let builder = ParquetRecordBatchStreamBuilder::new(reader)
        .await
        .map_err(|e| e.to_string())?;
    let file_schema = builder.schema().clone();
    let stream = builder
        .with_batch_size(batch_size)
        .build()
        .map_err(|e| e.to_string())?;
    Ok((file_schema, stream))
}

pub(super) async fn parquet_stream(
    name: String,
    store: Arc<dyn ObjectStore>,
    entry: FileEntry,
    schema: SchemaRef,
    batch_size: usize,
) -> Result<BatchStream> {
    let (file_schema, stream) =
        open_parquet(store, object_path(&entry.path), entry.size, batch_size)
            .await
            .map_err(|reason| malformed_file(&name, &entry, reason))?;
    Ok(conformed(name, entry, schema, stream, move |b| {
        (b, file_schema.clone())
    }))
}

/// The batches of the Avro object container file `entry`, `batch_size`
/// rows each, read block by block from the store (the whole file is
/// never held), conformed to `schema` by column name.
pub(super) async fn avro_stream(
    name: String,
    store: Arc<dyn ObjectStore>,
    entry: FileEntry,
    schema: SchemaRef,
    batch_size: usize,
) -> Result<BatchStream> {
    let reader = arrow_avro::reader::AsyncAvroFileReader::builder(
        crate::avro::StoreFile::new(store, object_path(&entry.path)),
        entry.size,
        batch_size,
    )
    .try_build()
    .await
    .map_err(|e| malformed_file(&name, &entry, e.to_string()))?;
    Ok(conformed(name, entry, schema, reader, |b| {
        let b = crate::avro::uuids_as_text(&b);
        let s = b.schema();
        (b, s)
    }))
}

/// A file `entry` that does not decode.
fn malformed_file(name: &str, entry: &FileEntry, reason: String) -> Error {
    Error::Malformed {
        source_name: name.to_string(),
        file: entry.path.clone(),
        line: None,
        reason,
    }
}

/// The decoded batches of `entry` (each with its columns, as `prepare`
/// gives them) conformed to `schema`; a batch that fails to decode fails
/// the stream naming the file.
fn conformed<E: std::fmt::Display>(
    name: String,
    entry: FileEntry,
    schema: SchemaRef,
    batches: impl futures::Stream<Item = Result<RecordBatch, E>> + Send + 'static,
    prepare: impl Fn(RecordBatch) -> (RecordBatch, SchemaRef) + Send + 'static,
) -> BatchStream {
    batches
        .map(move |b| {
            let b = b.map_err(|e| malformed_file(&name, &entry, e.to_string()))?;
            let (b, from) = prepare(b);
            conform(&b, &from, &schema).map_err(|reason| Error::Schema {
                source_name: name.clone(),
                file: entry.path.clone(),
                reason,
            })
        })
        .boxed()
}

/// Project and cast `batch` (with `from` schema) onto `to`, matching columns
/// by name; a column missing from the file becomes nulls when nullable.
pub(super) fn conform(
    batch: &RecordBatch,
    from: &Schema,
    to: &SchemaRef,
) -> Result<RecordBatch, String> {
    if from.fields() == to.fields() {
        return Ok(batch.clone());
    }
    let mut cols: Vec<ArrayRef> = Vec::with_capacity(to.fields().len());
    for field in to.fields() {
        match from.index_of(field.name()) {
            Ok(i) => {
                let col = batch.column(i);
                if col.data_type() == field.data_type() {
                    cols.push(col.clone());
                } else {
                    cols.push(arrow::compute::cast(col, field.data_type()).map_err(|e| {
                        format!(
                            "column {} is {} in the file, cannot be read as {}: {e}",
                            field.name(),
                            col.data_type(),
                            field.data_type()
                        )
                    })?);
                }
            }
            Err(_) if field.is_nullable() => {
                cols.push(new_null_array(field.data_type(), batch.num_rows()))
            }
            Err(_) => {
                return Err(format!(
                    "column {} is declared NOT NULL but missing from the file",
                    field.name()
                ));
            }
        }
    }
    RecordBatch::try_new(to.clone(), cols).map_err(|e| e.to_string())
}
