//! The record formats that need more than a decoder call: keys as JSON
//! objects or Avro (decoded on their own, NULL for a record without a
//! key), Avro values (a decoder per writer schema id, rebuilt after a bad
//! value) and Protobuf values (to their JSON mapping). [`super::decode`]'s
//! `RowBuilder` drives them record by record.

use super::registry::{AvroValues, Registered};
use super::*;
use crate::avro::{cast_columns, decoder_for, framed_schema_id};

/// JSON keys: each present key (checked to be an object whose fields fit
/// the columns), decoded together when the batch is finished.
pub(super) struct JsonKeys {
    pub(super) schema: SchemaRef,
    pub(super) keys: Vec<Vec<u8>>,
    pub(super) present: Vec<bool>,
}

impl JsonKeys {
    /// Keep `key` if it is a JSON object whose fields fit the columns.
    pub(super) fn push(&mut self, key: Option<&[u8]>) -> std::result::Result<(), String> {
        let Some(key) = key else {
            self.present.push(false);
            return Ok(());
        };
        let v: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(key)
            .map_err(|e| format!("the key is not a JSON object: {e}"))?;
        for f in self.schema.fields() {
            match v.get(f.name()) {
                None | Some(serde_json::Value::Null) if !f.is_nullable() => {
                    return Err(format!("the key has no {}, a NOT NULL column", f.name()));
                }
                Some(value) => json_fits(value, f.data_type())
                    .map_err(|why| format!("the key's {}: {why}", f.name()))?,
                None => {}
            }
        }
        self.keys.push(key.to_vec());
        self.present.push(true);
        Ok(())
    }

    /// Take back the last key pushed.
    pub(super) fn drop_last(&mut self) {
        if self.present.pop() == Some(true) {
            self.keys.pop();
        }
    }

    /// The `_key` column of every row pushed since the last call.
    pub(super) fn finish(&mut self) -> std::result::Result<ArrayRef, String> {
        let mut d = arrow::json::ReaderBuilder::new(self.schema.clone())
            .with_batch_size(self.keys.len().max(1))
            .build_decoder()
            .map_err(|e| e.to_string())?;
        for k in self.keys.drain(..) {
            d.decode(&k)
                .and_then(|_| d.decode(b"\n"))
                .map_err(|e| e.to_string())?;
        }
        let cols = match d.flush().map_err(|e| e.to_string())? {
            Some(b) => b.columns().to_vec(),
            None => self
                .schema
                .fields()
                .iter()
                .map(|f| arrow::array::new_empty_array(f.data_type()))
                .collect(),
        };
        let keys: ArrayRef = Arc::new(
            arrow::array::StructArray::try_new(self.schema.fields().clone(), cols, None)
                .map_err(|e| e.to_string())?,
        );
        with_nulls(keys, std::mem::take(&mut self.present))
    }
}

/// Whether JSON `value` decodes into `to` (as arrow-json reads it): the
/// checks that keep a key's type error on its own record.
pub(super) fn json_fits(
    value: &serde_json::Value,
    to: &arrow::datatypes::DataType,
) -> std::result::Result<(), String> {
    use arrow::datatypes::DataType as T;
    use serde_json::Value as V;
    let ok = match (value, to) {
        (V::Null, _) => true,
        (V::Bool(_), T::Boolean) => true,
        (V::Number(n), t) if t.is_integer() => n.is_i64() || n.is_u64(),
        (V::Number(_), t)
            if t.is_floating() || matches!(t, T::Decimal128(..) | T::Decimal256(..)) =>
        {
            true
        }
        (V::Number(_), T::Timestamp(..) | T::Date32 | T::Date64) => true,
        (V::String(_), T::Utf8 | T::LargeUtf8 | T::Utf8View) => true,
        (V::String(s), T::Timestamp(..) | T::Date32 | T::Date64) => arrow::compute::cast(
            &(Arc::new(arrow::array::StringArray::from(vec![s.as_str()])) as ArrayRef),
            to,
        )
        .is_ok_and(|a| a.null_count() == 0),
        (V::Object(_), T::Struct(_) | T::Map(..)) => true,
        (V::Array(_), T::List(_) | T::LargeList(_)) => true,
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(format!("{value} is not a {to}"))
    }
}

/// `keys` (one per present row) spread over every row: NULL where
/// `present` says a record had no key.
pub(super) fn with_nulls(
    keys: ArrayRef,
    present: Vec<bool>,
) -> std::result::Result<ArrayRef, String> {
    if present.iter().all(|p| *p) {
        return Ok(keys);
    }
    let mut next = 0u32;
    let indices: arrow::array::UInt32Array = present
        .iter()
        .map(|p| {
            p.then(|| {
                next += 1;
                next - 1
            })
        })
        .collect();
    arrow::compute::take(&keys, &indices, None).map_err(|e| e.to_string())
}

/// Avro keys: the decoded (non-null) keys, and which rows have one.
pub(super) struct AvroKeys {
    pub(super) rows: AvroRows,
    pub(super) present: Vec<bool>,
    /// The key schema is not a record (see `crate::avro::as_record`): the
    /// single decoded column is the key.
    pub(super) wrapped: bool,
}

impl AvroKeys {
    /// The `_key` column of every row pushed since the last call: NULL
    /// where a record had no key.
    pub(super) fn finish(&mut self) -> std::result::Result<ArrayRef, String> {
        let cols = self.rows.finish()?;
        let keys: ArrayRef = if self.wrapped {
            cols[0].clone()
        } else {
            Arc::new(
                arrow::array::StructArray::try_new(
                    self.rows.value_schema.fields().clone(),
                    cols,
                    None,
                )
                .map_err(|e| e.to_string())?,
            )
        };
        with_nulls(keys, std::mem::take(&mut self.present))
    }
}

/// The value columns of Avro records: one decoder per writer schema id,
/// each resolving to the reader schema. Records are decoded in arrival
/// order; a change of schema id closes the rows decoded so far.
pub(super) struct AvroRows {
    pub(super) values: AvroValues,
    pub(super) value_schema: SchemaRef,
    pub(super) batch_size: usize,
    /// Per writer schema id: its decoder, or why it cannot resolve to the
    /// reader schema.
    pub(super) decoders: HashMap<u32, std::result::Result<arrow_avro::reader::Decoder, String>>,
    /// The id of the decoder holding undelivered rows.
    pub(super) current: Option<u32>,
    /// With dead letters: the values in `current`'s decoder, to decode
    /// again after a bad one left it in an unknown state.
    pub(super) keep_pending: bool,
    pub(super) pending: Vec<Vec<u8>>,
    /// Rows decoded under earlier schema ids, cast to the columns.
    pub(super) done: Vec<RecordBatch>,
    /// Keys: a writer schema that is not a record is wrapped as the
    /// reader schema is.
    pub(super) key: bool,
}

impl AvroRows {
    pub(super) fn new(
        values: AvroValues,
        value_schema: SchemaRef,
        batch_size: usize,
        keep_pending: bool,
        key: bool,
    ) -> Self {
        Self {
            values,
            value_schema,
            batch_size,
            decoders: HashMap::new(),
            current: None,
            keep_pending,
            pending: Vec::new(),
            done: Vec::new(),
            key,
        }
    }

    /// The writer schema `id` from the registry's cache, or why a record
    /// written with it is bad.
    fn writer(&self, id: u32) -> std::result::Result<Arc<str>, String> {
        let what = if self.key { "key" } else { "value" };
        match self.values.registry.cached(id) {
            Some(Registered::Avro(w)) => Ok(w),
            Some(Registered::Unknown) => Err(format!(
                "the {what}'s schema id {id} is not known to the schema registry {}",
                self.values.registry.urls()
            )),
            Some(Registered::Protobuf(_)) => Err(format!(
                "the {what}'s schema id {id} is a PROTOBUF schema in the registry, not Avro"
            )),
            Some(Registered::OtherType(t)) => Err(format!(
                "the {what}'s schema id {id} is a {t} schema in the registry, not Avro"
            )),
            None => Err(format!("schema id {id} was not fetched from the registry")),
        }
    }

    /// The decoder of writer schema `id` (written as `writer`).
    pub(super) fn fresh_decoder(
        &self,
        id: u32,
        writer: &str,
    ) -> std::result::Result<arrow_avro::reader::Decoder, String> {
        let writer = if self.key {
            crate::avro::as_record(writer)?.0
        } else {
            writer.to_string()
        };
        decoder_for(id, &writer, &self.values.reader_schema, self.batch_size)
    }

    /// Take back the last value pushed (with `keep_pending` only): the
    /// decoder is rebuilt from the values before it.
    pub(super) fn drop_last(&mut self) -> std::result::Result<(), String> {
        let (Some(id), Some(_)) = (self.current, self.pending.pop()) else {
            return Ok(());
        };
        let writer = self.writer(id)?;
        self.redecode_pending(id, &writer)
    }

    /// Replace schema `id`'s decoder by a fresh one holding exactly the
    /// pending values (after one left it in an unknown state, or was taken
    /// back).
    pub(super) fn redecode_pending(
        &mut self,
        id: u32,
        writer: &str,
    ) -> std::result::Result<(), String> {
        let mut fresh = self.fresh_decoder(id, writer)?;
        for v in &self.pending {
            fresh
                .decode(v)
                .map_err(|e| format!("a value that decoded before no longer does: {e}"))?;
        }
        self.decoders.insert(id, Ok(fresh));
        Ok(())
    }

    /// Decode one value; `Err` says why it is a bad record (nothing of it
    /// was kept).
    pub(super) fn push(&mut self, payload: Option<&[u8]>) -> std::result::Result<(), String> {
        let what = if self.key { "key" } else { "value" };
        let id = framed_schema_id(payload, what)?;
        let p = payload.expect("framed");
        // A decoder exists only for an id the registry gave an Avro schema
        // for: the cache is asked once per id, not per record.
        if !self.decoders.contains_key(&id) {
            let writer = self.writer(id)?;
            let d = self.fresh_decoder(id, &writer);
            self.decoders.insert(id, d);
        }
        if self.current != Some(id) {
            self.flush_current()?;
            self.current = Some(id);
        }
        let d = self.decoders.get_mut(&id).expect("inserted");
        let d = match d {
            Ok(d) => d,
            Err(e) => {
                return Err(format!(
                    "the {what}'s schema id {id} cannot be resolved to the reader schema \
                     (subject {}): {e}",
                    self.values.subject
                ));
            }
        };
        let reason = match d.decode(p) {
            Ok(n) if n == p.len() => {
                if self.keep_pending {
                    self.pending.push(p.to_vec());
                }
                return Ok(());
            }
            Ok(n) => format!(
                "the Avro body of schema id {id} does not match its schema ({} of {} bytes \
                 read)",
                n,
                p.len()
            ),
            Err(e) => format!("the Avro body does not decode with schema id {id}: {e}"),
        };
        if self.keep_pending {
            // The failed value may have left part of a row in the decoder:
            // a fresh one takes the values before it again.
            self.redecode_pending(id, &self.writer(id)?)?;
        }
        Err(reason)
    }

    /// Close the rows of the current schema id into `done`.
    pub(super) fn flush_current(&mut self) -> std::result::Result<(), String> {
        self.pending.clear();
        let Some(id) = self.current.take() else {
            return Ok(());
        };
        if let Some(Ok(d)) = self.decoders.get_mut(&id)
            && let Some(b) = d.flush().map_err(|e| e.to_string())?
        {
            let cols = cast_columns(&b, &self.value_schema)?;
            let b = RecordBatch::try_new_with_options(
                self.value_schema.clone(),
                cols,
                &arrow::record_batch::RecordBatchOptions::new().with_row_count(Some(b.num_rows())),
            )
            .map_err(|e| e.to_string())?;
            self.done.push(b);
        }
        Ok(())
    }

    /// The value columns of every row pushed since the last call.
    pub(super) fn finish(&mut self) -> std::result::Result<Vec<ArrayRef>, String> {
        self.flush_current()?;
        let done = std::mem::take(&mut self.done);
        if done.is_empty() {
            return Ok(self
                .value_schema
                .fields()
                .iter()
                .map(|f| arrow::array::new_empty_array(f.data_type()))
                .collect());
        }
        let b =
            arrow::compute::concat_batches(&self.value_schema, &done).map_err(|e| e.to_string())?;
        Ok(b.columns().to_vec())
    }
}

/// A Protobuf value (Confluent-framed) as canonical JSON, or why it is a
/// bad record.
pub(super) fn protobuf_json(
    p: &super::registry::ProtobufValues,
    payload: Option<&[u8]>,
) -> std::result::Result<Vec<u8>, String> {
    let id = framed_schema_id(payload, "value")?;
    let body = &payload.expect("framed")[5..];
    match p.registry.cached(id) {
        Some(Registered::Protobuf(file)) => crate::protobuf::to_json(&file, body),
        Some(Registered::Unknown) => Err(format!(
            "the value's schema id {id} is not known to the schema registry {}",
            p.registry.urls()
        )),
        Some(Registered::Avro(_)) => Err(format!(
            "the value's schema id {id} is an Avro schema in the registry, not Protobuf"
        )),
        Some(Registered::OtherType(t)) => Err(format!(
            "the value's schema id {id} is a {t} schema in the registry, not Protobuf"
        )),
        None => Err(format!("schema id {id} was not fetched from the registry")),
    }
}
