//! The dead-letter table: the records a source with
//! `on_error 'dead_letter'` could not decode, written in the batch that
//! read them, with where they came from and why.
//!
//! A dead-letter table is an output of the query like any other: one Delta
//! commit per batch that rejected something, with `txn(query id, batch
//! id)`, so a replayed batch neither loses nor repeats a record (a batch
//! rejects the same records each time it reads its range). Batches that
//! reject nothing commit nothing to it.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, BinaryBuilder, Int32Builder, Int64Builder, StringBuilder, TimestampMicrosecondBuilder,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use arrow::record_batch::RecordBatch;
use lakestream_source::Rejected;

/// The columns of a dead-letter table.
///
/// | column | type | |
/// |---|---|---|
/// | `source` | string | the stream table's name in the job |
/// | `file` | string | the file (file sources) |
/// | `line` | bigint | the line in the file, from 1 |
/// | `topic`, `partition`, `offset` | string, int, bigint | where in Kafka |
/// | `record` | string | the record as text (invalid UTF-8 replaced) |
/// | `record_bytes` | binary | the record's exact bytes |
/// | `error` | string | why it could not be read |
/// | `batch_id` | bigint | the batch that read it |
/// | `batch_timestamp` | timestamp (UTC) | that batch's timestamp |
pub fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("source", DataType::Utf8, true),
        Field::new("file", DataType::Utf8, true),
        Field::new("line", DataType::Int64, true),
        Field::new("topic", DataType::Utf8, true),
        Field::new("partition", DataType::Int32, true),
        Field::new("offset", DataType::Int64, true),
        Field::new("record", DataType::Utf8, true),
        Field::new("record_bytes", DataType::Binary, true),
        Field::new("error", DataType::Utf8, true),
        Field::new("batch_id", DataType::Int64, true),
        Field::new(
            "batch_timestamp",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            true,
        ),
    ]))
}

/// The rows of `rejected` (each with its source's name), in a stable order
/// (by source, then position), for batch `batch_id` planned at
/// `batch_timestamp_ms`.
pub(crate) fn rows(
    mut rejected: Vec<(String, Rejected)>,
    batch_id: u64,
    batch_timestamp_ms: i64,
) -> RecordBatch {
    rejected.sort();
    let mut source = StringBuilder::new();
    let mut file = StringBuilder::new();
    let mut line = Int64Builder::new();
    let mut topic = StringBuilder::new();
    let mut partition = Int32Builder::new();
    let mut offset = Int64Builder::new();
    let mut record = StringBuilder::new();
    let mut bytes = BinaryBuilder::new();
    let mut error = StringBuilder::new();
    let mut batch = Int64Builder::new();
    let mut ts = TimestampMicrosecondBuilder::new().with_timezone("UTC");
    for (name, r) in &rejected {
        source.append_value(name);
        file.append_option(r.file.as_deref());
        line.append_option(r.line.map(|l| i64::try_from(l).unwrap_or(i64::MAX)));
        topic.append_option(r.topic.as_deref());
        partition.append_option(r.partition);
        offset.append_option(r.offset);
        record.append_value(String::from_utf8_lossy(&r.record));
        bytes.append_value(&r.record);
        error.append_value(&r.error);
        batch.append_value(i64::try_from(batch_id).unwrap_or(i64::MAX));
        ts.append_value(batch_timestamp_ms.saturating_mul(1000));
    }
    let cols: Vec<ArrayRef> = vec![
        Arc::new(source.finish()),
        Arc::new(file.finish()),
        Arc::new(line.finish()),
        Arc::new(topic.finish()),
        Arc::new(partition.finish()),
        Arc::new(offset.finish()),
        Arc::new(record.finish()),
        Arc::new(bytes.finish()),
        Arc::new(error.finish()),
        Arc::new(batch.finish()),
        Arc::new(ts.finish()),
    ];
    RecordBatch::try_new(schema(), cols).expect("the dead-letter columns match their schema")
}
