//! Records to rows: the metadata columns (topic, partition, offset,
//! timestamp, key, headers) and the value decoded as JSON, text or bytes,
//! with malformed records named by topic, partition and offset.

use super::*;

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
    value_schema: SchemaRef,
    raw: BinaryBuilder,
    text: StringBuilder,
    key: BinaryBuilder,
    topic: StringBuilder,
    partition: Int32Builder,
    offset: Int64Builder,
    timestamp: TimestampMillisecondBuilder,
    headers: StringBuilder,
}

impl RowBuilder {
    pub(super) fn new(
        source: String,
        schema: SchemaRef,
        value_schema: SchemaRef,
        format: ValueFormat,
        batch_size: usize,
    ) -> Result<Self> {
        let json = match format {
            ValueFormat::Json => Some(
                arrow::json::ReaderBuilder::new(value_schema.clone())
                    .with_batch_size(batch_size)
                    .build_decoder()
                    .map_err(|e| Error::InvalidOption {
                        source_name: source.clone(),
                        option: "columns".into(),
                        reason: e.to_string(),
                    })?,
            ),
            _ => None,
        };
        Ok(Self {
            source,
            schema,
            pending: Vec::new(),
            format,
            batch_size,
            rows: 0,
            json,
            value_schema,
            raw: BinaryBuilder::new(),
            text: StringBuilder::new(),
            key: BinaryBuilder::new(),
            topic: StringBuilder::new(),
            partition: Int32Builder::new(),
            offset: Int64Builder::new(),
            timestamp: TimestampMillisecondBuilder::new().with_timezone("UTC"),
            headers: StringBuilder::new(),
        })
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
        match self.format {
            ValueFormat::Json => {
                let d = self.json.as_mut().expect("json decoder");
                let before = d.len();
                let value = m.payload().unwrap_or(b"{}");
                d.decode(value).map_err(|e| malformed(e.to_string()))?;
                d.decode(b"\n").map_err(|e| malformed(e.to_string()))?;
                if d.len() != before + 1 {
                    return Err(malformed(
                        "the value is not exactly one JSON object".to_string(),
                    ));
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
                Some(v) => self.text.append_value(
                    std::str::from_utf8(v)
                        .map_err(|e| malformed(format!("value is not UTF-8: {e}")))?,
                ),
                None => self.text.append_null(),
            },
        }
        match m.key() {
            Some(k) => self.key.append_value(k),
            None => self.key.append_null(),
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
        let mut cols: Vec<ArrayRef> = match self.format {
            ValueFormat::Json => {
                let batch = self
                    .json
                    .as_mut()
                    .expect("json decoder")
                    .flush()
                    .map_err(|e| self.locate_json_error(e))?
                    .expect("rows were decoded");
                batch.columns().to_vec()
            }
            ValueFormat::Raw => vec![Arc::new(self.raw.finish())],
            ValueFormat::String => vec![Arc::new(self.text.finish())],
        };
        self.pending.clear();
        cols.push(Arc::new(self.key.finish()));
        cols.push(Arc::new(self.topic.finish()));
        cols.push(Arc::new(self.partition.finish()));
        cols.push(Arc::new(self.offset.finish()));
        cols.push(Arc::new(self.timestamp.finish()));
        cols.push(Arc::new(self.headers.finish()));
        self.rows = 0;
        RecordBatch::try_new(self.schema.clone(), cols)
            .map(Some)
            .map_err(|e| Error::Schema {
                source_name: self.source.clone(),
                file: "kafka".into(),
                reason: e.to_string(),
            })
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
