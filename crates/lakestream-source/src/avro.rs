//! Avro into Arrow, for every source that reads it: Kafka values in the
//! Confluent wire format (with [`crate::kafka::registry`]) and object
//! container files (`STORED AS AVRO`). Decoding is arrow-avro's; this
//! module owns what lakestream adds: the reader schema cut down to the
//! declared columns, `uuid` as text, and casting onto the columns.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, RecordBatch};
use arrow::datatypes::{DataType, Schema, SchemaRef};
use arrow_avro::reader::{Decoder, ReaderBuilder};
use arrow_avro::schema::{AvroSchema, Fingerprint, FingerprintAlgorithm, SchemaStore};

/// An Avro object container file in an object store, read by the byte
/// ranges the reader asks for (block by block).
pub struct StoreFile {
    store: Arc<dyn object_store::ObjectStore>,
    path: object_store::path::Path,
}

impl StoreFile {
    /// The file at `path` of `store`.
    pub fn new(store: Arc<dyn object_store::ObjectStore>, path: object_store::path::Path) -> Self {
        Self { store, path }
    }
}

impl arrow_avro::reader::AsyncFileReader for StoreFile {
    fn get_bytes(
        &mut self,
        range: std::ops::Range<u64>,
    ) -> futures::future::BoxFuture<'_, Result<bytes::Bytes, arrow_avro::errors::AvroError>> {
        use futures::FutureExt;
        use object_store::ObjectStoreExt;
        async move {
            self.store
                .get_range(&self.path, range)
                .await
                .map_err(|e| arrow_avro::errors::AvroError::External(Box::new(e)))
        }
        .boxed()
    }
}

/// The record name a key schema that is not a record is wrapped in (see
/// [`as_record`]).
pub const KEY_WRAPPER: &str = "lakestream_key";

/// `schema` as an Avro record: a record as it is (`false`), any other
/// schema wrapped as the single field `key` of a record named
/// [`KEY_WRAPPER`] (`true`). A record of one field is encoded exactly as
/// that field, so a primitive key (`"string"`, `"long"`) decodes through
/// the record decoder unchanged.
pub fn as_record(schema: &str) -> std::result::Result<(String, bool), String> {
    let v: serde_json::Value =
        serde_json::from_str(schema).map_err(|e| format!("the schema is not JSON: {e}"))?;
    if v.get("type").and_then(|t| t.as_str()) == Some("record") {
        return Ok((schema.to_string(), false));
    }
    let wrapped = serde_json::json!({
        "type": "record",
        "name": KEY_WRAPPER,
        "fields": [{"name": "key", "type": v}],
    });
    Ok((wrapped.to_string(), true))
}

/// Whether `reader` (a record schema) is a key wrapped by [`as_record`].
pub fn is_wrapped(reader: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(reader)
        .ok()
        .and_then(|v| {
            v.get("name")
                .and_then(|n| n.as_str())
                .map(|n| n == KEY_WRAPPER)
        })
        .unwrap_or(false)
}

/// The Arrow type of a key decoded with reader schema `reader` (a record,
/// wrapped or not): the wrapped field's type, or a struct of the record's
/// fields.
pub fn key_type(reader: &str) -> std::result::Result<DataType, String> {
    let cols = arrow_schema_of(reader)?;
    if is_wrapped(reader) {
        return Ok(cols.field(0).data_type().clone());
    }
    Ok(DataType::Struct(cols.fields().clone()))
}

/// The Confluent framing of `payload` (a record's `what`: value or key):
/// its schema id, or why it has none.
pub fn framed_schema_id(payload: Option<&[u8]>, what: &str) -> std::result::Result<u32, String> {
    match payload {
        None => Err(format!(
            "the {what} is null (a tombstone): an Avro {what} was expected"
        )),
        Some(p) if p.len() < 5 || p[0] != 0 => Err(format!(
            "the {what} is not in the Confluent wire format (magic byte 0 and a 4-byte schema \
             id before the Avro body; it starts {:02x?})",
            &p[..p.len().min(5)]
        )),
        Some(p) => Ok(u32::from_be_bytes([p[1], p[2], p[3], p[4]])),
    }
}

/// `reader`, an Avro record schema, with only the fields named by
/// `columns`, in their order (a name matches exactly, else ignoring case).
/// A column the schema lacks is an error naming it.
pub fn project_reader_schema(
    reader: &str,
    columns: &Schema,
) -> std::result::Result<String, String> {
    let mut v: serde_json::Value =
        serde_json::from_str(reader).map_err(|e| format!("the schema is not JSON: {e}"))?;
    let obj = v
        .as_object_mut()
        .filter(|o| o.get("type").and_then(|t| t.as_str()) == Some("record"))
        .ok_or("the value schema is not an Avro record")?;
    let fields = obj
        .get_mut("fields")
        .and_then(|f| f.as_array_mut())
        .ok_or("the record has no fields")?;
    let name_of = |f: &serde_json::Value| {
        f.get("name")
            .and_then(|n| n.as_str())
            .unwrap_or_default()
            .to_string()
    };
    let mut out = Vec::with_capacity(columns.fields().len());
    for c in columns.fields() {
        let found = fields
            .iter()
            .position(|f| name_of(f) == *c.name())
            .or_else(|| {
                let matches: Vec<usize> = fields
                    .iter()
                    .enumerate()
                    .filter(|(_, f)| name_of(f).eq_ignore_ascii_case(c.name()))
                    .map(|(i, _)| i)
                    .collect();
                (matches.len() == 1).then(|| matches[0])
            });
        let Some(i) = found else {
            let names: Vec<String> = fields.iter().map(name_of).collect();
            return Err(format!(
                "column {} is not a field of the Avro schema (fields: {})",
                c.name(),
                names.join(", ")
            ));
        };
        out.push(fields[i].clone());
    }
    *fields = out;
    Ok(v.to_string())
}

/// The Arrow columns of Avro record schema `schema` (its fields, in order).
pub fn arrow_schema_of(schema: &str) -> std::result::Result<SchemaRef, String> {
    let mut store = SchemaStore::new_with_type(FingerprintAlgorithm::Id);
    store
        .set(Fingerprint::Id(0), AvroSchema::new(schema.to_string()))
        .map_err(|e| e.to_string())?;
    let d = ReaderBuilder::new()
        .with_writer_schema_store(store)
        .build_decoder()
        .map_err(|e| e.to_string())?;
    Ok(columns_of(&d.schema()))
}

/// The columns a query sees of arrow-avro's `schema`: its fields without
/// the Avro schema metadata, a `uuid` as its text (as producers wrote it).
pub fn columns_of(s: &Schema) -> SchemaRef {
    let fields: Vec<arrow::datatypes::Field> = s
        .fields()
        .iter()
        .map(|f| {
            if is_uuid(f) {
                arrow::datatypes::Field::new(f.name(), DataType::Utf8, f.is_nullable())
            } else {
                f.as_ref().clone()
            }
        })
        .collect();
    Arc::new(Schema::new(fields))
}

/// A decoder of values written with schema `writer` (id `id`) into the
/// reader schema.
pub fn decoder_for(
    id: u32,
    writer: &str,
    reader: &str,
    batch_size: usize,
) -> std::result::Result<Decoder, String> {
    let mut store = SchemaStore::new_with_type(FingerprintAlgorithm::Id);
    store
        .set(Fingerprint::Id(id), AvroSchema::new(writer.to_string()))
        .map_err(|e| e.to_string())?;
    ReaderBuilder::new()
        .with_writer_schema_store(store)
        .with_reader_schema(AvroSchema::new(reader.to_string()))
        .with_batch_size(batch_size.max(1))
        .build_decoder()
        .map_err(|e| e.to_string())
}

/// `batch`'s columns cast to `schema`'s types, by position.
pub fn cast_columns(
    batch: &RecordBatch,
    schema: &Schema,
) -> std::result::Result<Vec<ArrayRef>, String> {
    batch
        .columns()
        .iter()
        .zip(schema.fields())
        .map(|(c, f)| {
            if c.data_type() == f.data_type() {
                Ok(c.clone())
            } else if let (DataType::FixedSizeBinary(16), DataType::Utf8) =
                (c.data_type(), f.data_type())
            {
                Ok(uuid_text(c))
            } else {
                arrow::compute::cast(c, f.data_type()).map_err(|e| {
                    format!(
                        "column {}: the Avro value's {} does not convert to {}: {e}",
                        f.name(),
                        c.data_type(),
                        f.data_type()
                    )
                })
            }
        })
        .collect()
}

/// `batch` (arrow-avro's) with its top-level `uuid` columns as text.
pub fn uuids_as_text(batch: &RecordBatch) -> RecordBatch {
    let schema = batch.schema();
    if !schema.fields().iter().any(|f| is_uuid(f)) {
        return batch.clone();
    }
    let cols: Vec<ArrayRef> = batch
        .columns()
        .iter()
        .zip(schema.fields())
        .map(|(c, f)| if is_uuid(f) { uuid_text(c) } else { c.clone() })
        .collect();
    RecordBatch::try_new(columns_of(&schema), cols).expect("same columns, uuids as text")
}

/// Whether `f` is arrow-avro's column of an Avro `uuid`.
fn is_uuid(f: &arrow::datatypes::Field) -> bool {
    f.data_type() == &DataType::FixedSizeBinary(16)
        && (f.metadata().get("logicalType").is_some_and(|n| n == "uuid")
            || f.metadata()
                .get("ARROW:extension:name")
                .is_some_and(|n| n == "arrow.uuid"))
}

/// 16-byte UUIDs as their canonical text (`8-4-4-4-12` lowercase hex).
fn uuid_text(c: &ArrayRef) -> ArrayRef {
    let b = c
        .as_any()
        .downcast_ref::<arrow::array::FixedSizeBinaryArray>()
        .expect("a fixed-size binary column");
    let mut out = arrow::array::StringBuilder::with_capacity(b.len(), b.len() * 36);
    for v in b.iter() {
        match v {
            None => out.append_null(),
            Some(bytes) => {
                let h: String = bytes.iter().map(|x| format!("{x:02x}")).collect();
                out.append_value(format!(
                    "{}-{}-{}-{}-{}",
                    &h[..8],
                    &h[8..12],
                    &h[12..16],
                    &h[16..20],
                    &h[20..]
                ));
            }
        }
    }
    Arc::new(out.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::datatypes::Field;

    const V1: &str = r#"{"type":"record","name":"Order","namespace":"shop","fields":[
        {"name":"order_id","type":"string"},{"name":"amount","type":"double"}]}"#;
    const V2: &str = r#"{"type":"record","name":"Order","namespace":"shop","fields":[
        {"name":"order_id","type":"string"},{"name":"amount","type":"double"},
        {"name":"currency","type":"string","default":"EUR"}]}"#;

    fn framed(id: u32, body: &[u8]) -> Vec<u8> {
        let mut v = vec![0];
        v.extend(id.to_be_bytes());
        v.extend(body);
        v
    }

    /// Avro binary of a string.
    fn avro_str(s: &str) -> Vec<u8> {
        let n = s.len() as i64;
        let mut out = vec![((n << 1) ^ (n >> 63)) as u8];
        out.extend(s.as_bytes());
        out
    }

    #[test]
    fn a_field_added_with_a_default_takes_it_for_older_values() {
        let reader = project_reader_schema(
            V2,
            &Schema::new(vec![
                Field::new("amount", DataType::Float64, true),
                Field::new("CURRENCY", DataType::Utf8, true),
            ]),
        )
        .unwrap();
        let mut body = avro_str("o-1");
        body.extend(12.5f64.to_le_bytes());
        let mut d = decoder_for(7, V1, &reader, 16).unwrap();
        assert_eq!(d.decode(&framed(7, &body)).unwrap(), body.len() + 5);
        let b = d.flush().unwrap().unwrap();
        assert_eq!(b.num_rows(), 1);
        let cur = b
            .column(1)
            .as_any()
            .downcast_ref::<arrow::array::StringArray>();
        assert_eq!(cur.unwrap().value(0), "EUR");
        let amt = b
            .column(0)
            .as_any()
            .downcast_ref::<arrow::array::Float64Array>();
        assert_eq!(amt.unwrap().value(0), 12.5);
    }

    #[test]
    fn framing_and_missing_columns_are_named() {
        assert_eq!(
            framed_schema_id(Some(&[0, 0, 0, 1, 2, 9]), "value"),
            Ok(258)
        );
        let e = framed_schema_id(Some(b"{\"a\":1}"), "key").unwrap_err();
        assert!(
            e.contains("the key is not in the Confluent wire format"),
            "{e}"
        );
        assert!(
            framed_schema_id(None, "value")
                .unwrap_err()
                .contains("tombstone")
        );
        let (wrapped, was) = as_record("\"string\"").unwrap();
        assert!(was && is_wrapped(&wrapped));
        assert_eq!(key_type(&wrapped).unwrap(), DataType::Utf8);
        assert!(!as_record(V1).unwrap().1);
        let e = project_reader_schema(
            V1,
            &Schema::new(vec![Field::new("x", DataType::Utf8, true)]),
        )
        .unwrap_err();
        assert!(
            e.contains("column x") && e.contains("order_id, amount"),
            "{e}"
        );
        let s = arrow_schema_of(V2).unwrap();
        let names: Vec<&str> = s.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, ["order_id", "amount", "currency"]);
    }
}
