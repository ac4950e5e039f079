//! Records to rows: the metadata columns (topic, partition, offset,
//! timestamp, key, headers) and the value decoded as JSON, Avro, text or
//! bytes, with malformed records named by topic, partition and offset.

use super::formats::{AvroKeys, AvroRows, JsonKeys, protobuf_json};
use super::*;
use crate::avro::framed_schema_id;

/// Builds record batches from messages: value columns plus metadata.
pub(super) struct RowBuilder {
    source: String,
    schema: SchemaRef,
    /// This batch's JSON values, kept to name the record a decode error
    /// comes from.
    pending: Vec<Vec<u8>>,
    format: ValueFormat,
    batch_size: usize,
    rows: usize,
    json: Option<arrow::json::reader::Decoder>,
    avro: Option<AvroRows>,
    value_schema: SchemaRef,
    raw: BinaryBuilder,
    text: StringBuilder,
    key: KeyColumn,
    topic: StringBuilder,
    partition: Int32Builder,
    offset: Int64Builder,
    timestamp: TimestampMillisecondBuilder,
    headers: StringBuilder,
    /// Where undecodable records go (`on_error 'dead_letter'`); `None`: a
    /// bad record fails the read.
    rejects: Option<crate::Rejects>,
}

/// The builder of the `_key` column, by the source's `key_format`.
enum KeyColumn {
    Bytes(BinaryBuilder),
    Text(StringBuilder),
    Avro(Box<AvroKeys>),
    Json(Box<JsonKeys>),
}

impl RowBuilder {
    pub(super) fn new(
        source: String,
        schema: SchemaRef,
        value_schema: SchemaRef,
        (format, key_format): (ValueFormat, KeyFormat),
        batch_size: usize,
        rejects: Option<crate::Rejects>,
    ) -> Result<Self> {
        let json = match format {
            ValueFormat::Json | ValueFormat::Protobuf(_) => {
                Some(json_decoder(&source, &value_schema, batch_size)?)
            }
            _ => None,
        };
        let avro = match &format {
            ValueFormat::Avro(values) => Some(AvroRows::new(
                values.clone(),
                value_schema.clone(),
                batch_size,
                rejects.is_some(),
                false,
            )),
            _ => None,
        };
        let key = match key_format {
            KeyFormat::String => KeyColumn::Text(StringBuilder::new()),
            KeyFormat::Raw => KeyColumn::Bytes(BinaryBuilder::new()),
            KeyFormat::Json(schema) => KeyColumn::Json(Box::new(JsonKeys {
                schema,
                keys: Vec::new(),
                present: Vec::new(),
            })),
            KeyFormat::Avro(values) => {
                let key_schema =
                    crate::avro::arrow_schema_of(&values.reader_schema).map_err(|reason| {
                        Error::InvalidOption {
                            source_name: source.clone(),
                            option: "key_format".into(),
                            reason,
                        }
                    })?;
                KeyColumn::Avro(Box::new(AvroKeys {
                    wrapped: crate::avro::is_wrapped(&values.reader_schema),
                    rows: AvroRows::new(values, key_schema, batch_size, rejects.is_some(), true),
                    present: Vec::new(),
                }))
            }
        };
        Ok(Self {
            source,
            schema,
            pending: Vec::new(),
            format,
            batch_size,
            rows: 0,
            json,
            avro,
            value_schema,
            raw: BinaryBuilder::new(),
            text: StringBuilder::new(),
            key,
            topic: StringBuilder::new(),
            partition: Int32Builder::new(),
            offset: Int64Builder::new(),
            timestamp: TimestampMillisecondBuilder::new().with_timezone("UTC"),
            headers: StringBuilder::new(),
            rejects,
        })
    }

    /// Set `m` aside as a dead letter when the source does so (`Ok`), or
    /// fail with `err`.
    fn reject(&self, m: &impl Message, err: Error) -> Result<()> {
        let Some(rejects) = &self.rejects else {
            return Err(err);
        };
        let error = match &err {
            Error::KafkaMalformed { reason, .. } => reason.clone(),
            other => other.to_string(),
        };
        rejects
            .lock()
            .expect("kafka rejected")
            .push(crate::Rejected {
                topic: Some(m.topic().to_string()),
                partition: Some(m.partition()),
                offset: Some(m.offset()),
                record: m.payload().unwrap_or_default().to_vec(),
                error,
                ..Default::default()
            });
        Ok(())
    }

    /// A JSON decoder holding exactly the pending values (after a value
    /// that failed left the old one in an unknown state).
    fn redecode_pending(&mut self) -> Result<()> {
        let mut d = json_decoder(&self.source, &self.value_schema, self.batch_size)?;
        for v in &self.pending {
            d.decode(v)
                .and_then(|_| d.decode(b"\n"))
                .map_err(|e| Error::Schema {
                    source_name: self.source.clone(),
                    file: "kafka".into(),
                    reason: format!("a value that decoded before no longer does: {e}"),
                })?;
        }
        self.json = Some(d);
        Ok(())
    }

    /// The schema id of `m`'s value, and the registry to fetch it from,
    /// when it is an Avro value whose writer schema has not been fetched
    /// yet: fetch it before [`RowBuilder::push`].
    pub(super) fn missing_schema(
        &self,
        m: &impl Message,
    ) -> Option<(u32, Arc<super::registry::SchemaRegistry>)> {
        let missing = |a: &AvroRows, bytes: Option<&[u8]>| {
            let id = framed_schema_id(bytes, "value").ok()?;
            // An id with a decoder was fetched: no lock per record.
            (!a.decoders.contains_key(&id) && a.values.registry.cached(id).is_none())
                .then(|| (id, a.values.registry.clone()))
        };
        let value = match &self.format {
            ValueFormat::Protobuf(p) => framed_schema_id(m.payload(), "value")
                .ok()
                .filter(|id| p.registry.cached(*id).is_none())
                .map(|id| (id, p.registry.clone())),
            _ => self.avro.as_ref().and_then(|a| missing(a, m.payload())),
        };
        value.or_else(|| match &self.key {
            KeyColumn::Avro(k) => missing(&k.rows, m.key()),
            _ => None,
        })
    }

    /// Take back the Avro key decoded for a record whose value then
    /// failed (only with dead letters: otherwise the failure fails the
    /// batch).
    fn undo_key(&mut self) -> Result<()> {
        if let KeyColumn::Json(k) = &mut self.key {
            k.drop_last();
        }
        if let KeyColumn::Avro(k) = &mut self.key
            && self.rejects.is_some()
            && k.present.pop() == Some(true)
        {
            k.rows.drop_last().map_err(|reason| Error::Schema {
                source_name: self.source.clone(),
                file: "kafka".into(),
                reason: format!("key: {reason}"),
            })?;
        }
        Ok(())
    }

    pub(super) fn is_full(&self) -> bool {
        self.rows >= self.batch_size
    }

    pub(super) fn push(&mut self, m: &impl Message) -> Result<()> {
        let malformed = |reason: String| Error::KafkaMalformed {
            source_name: self.source.clone(),
            topic: m.topic().to_string(),
            partition: m.partition(),
            offset: m.offset(),
            reason,
        };
        // A key that is not text where text is wanted: the record is bad
        // before any builder takes a part of it.
        if let (KeyColumn::Text(_), Some(k)) = (&self.key, m.key())
            && let Err(e) = std::str::from_utf8(k)
        {
            return self.reject(m, malformed(format!("key is not UTF-8: {e}")));
        }
        if let KeyColumn::Json(k) = &mut self.key
            && let Err(reason) = k.push(m.key())
        {
            return self.reject(m, malformed(reason));
        }
        if let KeyColumn::Avro(k) = &mut self.key {
            let decoded = match m.key() {
                None => Ok(()),
                Some(bytes) => k.rows.push(Some(bytes)),
            };
            match decoded {
                Ok(()) => k.present.push(m.key().is_some()),
                Err(reason) => return self.reject(m, malformed(reason)),
            }
        }
        match &self.format {
            ValueFormat::Avro(_) => {
                let pushed = self.avro.as_mut().expect("avro decoder").push(m.payload());
                if let Err(reason) = pushed {
                    let err = malformed(reason);
                    self.undo_key()?;
                    return self.reject(m, err);
                }
            }
            ValueFormat::Json | ValueFormat::Protobuf(_) => {
                let converted;
                let value = match &self.format {
                    ValueFormat::Protobuf(p) => match protobuf_json(p, m.payload()) {
                        Ok(json) => {
                            converted = json;
                            converted.as_slice()
                        }
                        Err(reason) => {
                            let err = malformed(reason);
                            self.undo_key()?;
                            return self.reject(m, err);
                        }
                    },
                    _ => m.payload().unwrap_or(b"{}"),
                };
                let d = self.json.as_mut().expect("json decoder");
                let before = d.len();
                let decoded = d
                    .decode(value)
                    .and_then(|_| d.decode(b"\n"))
                    .map_err(|e| e.to_string())
                    .and_then(|_| {
                        if d.len() == before + 1 {
                            Ok(())
                        } else {
                            Err("the value is not exactly one JSON object".to_string())
                        }
                    });
                if let Err(reason) = decoded {
                    let err = malformed(reason);
                    if self.rejects.is_none() {
                        return Err(err);
                    }
                    self.redecode_pending()?;
                    self.undo_key()?;
                    return self.reject(m, err);
                }
                self.pending.push(value.to_vec());
                // Type errors surface at flush; flushing per record would be
                // slow, so a failed flush is retried record by record in
                // `finish` to name the offset.
            }
            ValueFormat::Raw => match m.payload() {
                Some(v) => self.raw.append_value(v),
                None => self.raw.append_null(),
            },
            ValueFormat::String => match m.payload() {
                Some(v) => match std::str::from_utf8(v) {
                    Ok(text) => self.text.append_value(text),
                    Err(e) => {
                        let err = malformed(format!("value is not UTF-8: {e}"));
                        self.undo_key()?;
                        return self.reject(m, err);
                    }
                },
                None => self.text.append_null(),
            },
        }
        match (&mut self.key, m.key()) {
            (KeyColumn::Bytes(b), Some(k)) => b.append_value(k),
            (KeyColumn::Bytes(b), None) => b.append_null(),
            (KeyColumn::Text(b), Some(k)) => {
                b.append_value(std::str::from_utf8(k).expect("checked before the value"))
            }
            (KeyColumn::Text(b), None) => b.append_null(),
            // Decoded before the value.
            (KeyColumn::Avro(_) | KeyColumn::Json(_), _) => {}
        }
        self.topic.append_value(m.topic());
        self.partition.append_value(m.partition());
        self.offset.append_value(m.offset());
        match m.timestamp().to_millis() {
            Some(t) => self.timestamp.append_value(t),
            None => self.timestamp.append_null(),
        }
        match m.headers() {
            Some(h) => {
                let mut obj = serde_json::Map::new();
                for hd in h.iter() {
                    obj.insert(
                        hd.key.to_string(),
                        hd.value
                            .map(|v| {
                                serde_json::Value::String(String::from_utf8_lossy(v).into_owned())
                            })
                            .unwrap_or(serde_json::Value::Null),
                    );
                }
                self.headers
                    .append_value(serde_json::Value::Object(obj).to_string());
            }
            None => self.headers.append_null(),
        }
        self.rows += 1;
        Ok(())
    }

    pub(super) fn finish(&mut self) -> Result<Option<RecordBatch>> {
        if self.rows == 0 {
            return Ok(None);
        }
        // With dead letters, the records whose values fail the schema (a
        // type error shows at flush) are left out: `keep` says which.
        let mut keep: Option<arrow::array::BooleanArray> = None;
        let mut cols: Vec<ArrayRef> = match &self.format {
            ValueFormat::Avro(_) => {
                self.avro
                    .as_mut()
                    .expect("avro decoder")
                    .finish()
                    .map_err(|reason| Error::Schema {
                        source_name: self.source.clone(),
                        file: "kafka".into(),
                        reason,
                    })?
            }
            ValueFormat::Json | ValueFormat::Protobuf(_) => {
                let flushed = self.json.as_mut().expect("json decoder").flush();
                let batch = match flushed {
                    Ok(b) => b,
                    Err(e) if self.rejects.is_none() => return Err(self.locate_json_error(e)),
                    Err(_) => {
                        let (mask, batch) = self.reject_undecodable()?;
                        keep = Some(mask);
                        batch
                    }
                };
                match batch {
                    Some(b) => b.columns().to_vec(),
                    // Every record of the batch was rejected.
                    None => self
                        .value_schema
                        .fields()
                        .iter()
                        .map(|f| arrow::array::new_empty_array(f.data_type()))
                        .collect(),
                }
            }
            ValueFormat::Raw => vec![Arc::new(self.raw.finish())],
            ValueFormat::String => vec![Arc::new(self.text.finish())],
        };
        self.pending.clear();
        let mut meta: Vec<ArrayRef> = vec![
            match &mut self.key {
                KeyColumn::Bytes(b) => Arc::new(b.finish()),
                KeyColumn::Text(b) => Arc::new(b.finish()),
                KeyColumn::Json(k) => k.finish().map_err(|reason| Error::Schema {
                    source_name: self.source.clone(),
                    file: "kafka".into(),
                    reason: format!("key: {reason}"),
                })?,
                KeyColumn::Avro(k) => k.finish().map_err(|reason| Error::Schema {
                    source_name: self.source.clone(),
                    file: "kafka".into(),
                    reason: format!("key: {reason}"),
                })?,
            },
            Arc::new(self.topic.finish()),
            Arc::new(self.partition.finish()),
            Arc::new(self.offset.finish()),
            Arc::new(self.timestamp.finish()),
            Arc::new(self.headers.finish()),
        ];
        self.rows = 0;
        if let Some(mask) = &keep {
            meta = meta
                .iter()
                .map(|c| arrow::compute::filter(c, mask))
                .collect::<Result<_, _>>()
                .map_err(|e| Error::Schema {
                    source_name: self.source.clone(),
                    file: "kafka".into(),
                    reason: e.to_string(),
                })?;
        }
        cols.extend(meta);
        if cols[0].is_empty() {
            return Ok(None);
        }
        RecordBatch::try_new(self.schema.clone(), cols)
            .map(Some)
            .map_err(|e| Error::Schema {
                source_name: self.source.clone(),
                file: "kafka".into(),
                reason: e.to_string(),
            })
    }

    /// After a failed flush with dead letters on: decode the pending
    /// values one by one, reject the ones that fail, and decode the others
    /// again. Returns which records are kept and their values' batch.
    fn reject_undecodable(&mut self) -> Result<(arrow::array::BooleanArray, Option<RecordBatch>)> {
        let topics = self.topic.finish_cloned();
        let parts = self.partition.finish_cloned();
        let offsets = self.offset.finish_cloned();
        let mut keep = Vec::with_capacity(self.pending.len());
        let mut good = json_decoder(&self.source, &self.value_schema, self.pending.len().max(1))?;
        let mut bad = Vec::new();
        for (i, v) in self.pending.iter().enumerate() {
            let mut d = json_decoder(&self.source, &self.value_schema, 16)?;
            match d.decode(v).and_then(|_| d.flush()) {
                Ok(_) => {
                    good.decode(v)
                        .and_then(|_| good.decode(b"\n"))
                        .map_err(|e| Error::Schema {
                            source_name: self.source.clone(),
                            file: "kafka".into(),
                            reason: e.to_string(),
                        })?;
                    keep.push(true);
                }
                Err(e) => {
                    bad.push(crate::Rejected {
                        topic: Some(topics.value(i).to_string()),
                        partition: Some(parts.value(i)),
                        offset: Some(offsets.value(i)),
                        record: v.clone(),
                        error: e.to_string(),
                        ..Default::default()
                    });
                    keep.push(false);
                }
            }
        }
        let batch = good.flush().map_err(|e| self.locate_json_error(e))?;
        self.json = Some(json_decoder(
            &self.source,
            &self.value_schema,
            self.batch_size,
        )?);
        if let Some(r) = &self.rejects {
            r.lock().expect("kafka rejected").extend(bad);
        }
        Ok((keep.into(), batch))
    }

    pub(super) fn locate_json_error(&self, e: arrow::error::ArrowError) -> Error {
        // Decode the batch's values one by one to find the record at fault.
        let topics = self.topic.finish_cloned();
        let parts = self.partition.finish_cloned();
        let offsets = self.offset.finish_cloned();
        let mut at = None;
        for (i, v) in self.pending.iter().enumerate() {
            let Ok(mut d) =
                arrow::json::ReaderBuilder::new(self.value_schema.clone()).build_decoder()
            else {
                break;
            };
            if let Err(err) = d.decode(v).and_then(|_| d.flush()) {
                at = Some((i, err.to_string()));
                break;
            }
        }
        let (i, reason) = at.unwrap_or((0, e.to_string()));
        Error::KafkaMalformed {
            source_name: self.source.clone(),
            topic: topics.value(i).to_string(),
            partition: parts.value(i),
            offset: offsets.value(i),
            reason,
        }
    }
}

/// A JSON decoder of `schema` for the source `source`.
fn json_decoder(
    source: &str,
    schema: &SchemaRef,
    batch_size: usize,
) -> Result<arrow::json::reader::Decoder> {
    arrow::json::ReaderBuilder::new(schema.clone())
        .with_batch_size(batch_size)
        .build_decoder()
        .map_err(|e| Error::InvalidOption {
            source_name: source.to_string(),
            option: "columns".into(),
            reason: e.to_string(),
        })
}
