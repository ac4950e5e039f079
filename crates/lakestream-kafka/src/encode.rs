//! Rows to Kafka records. The value is a JSON object of the row's columns
//! (NULL columns left out, as Spark's `to_json` does); the reserved
//! columns set the record's other parts and are not in the value:
//!
//! | column | type | the record's |
//! |---|---|---|
//! | `_key` | a string or binary type | key |
//! | `_partition` | an integer type | partition (NULL: the partitioner, on the key) |
//! | `_headers` | a map of strings to strings or binaries (in its order), or a JSON object as text (in name order; a JSON string's value without quotes, other values as JSON, `null` as a header without a value) | headers |
//! | `_timestamp` | a timestamp, or an integer of milliseconds since the epoch | timestamp |
//!
//! A batch is encoded into one buffer of values and its columns kept as
//! arrays, so a row costs no allocation of its own.

use std::sync::Arc;

use arrow::array::{Array, AsArray, BinaryArray, Int32Array, Int64Array, RecordBatch};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Schema, TimeUnit};

/// The record's key.
pub const KEY: &str = "_key";
/// The record's partition.
pub const PARTITION: &str = "_partition";
/// The record's headers.
pub const HEADERS: &str = "_headers";
/// The record's timestamp.
pub const TIMESTAMP: &str = "_timestamp";

/// Which columns of the output make which part of a record; checked once
/// against the output's schema.
#[derive(Debug, Clone)]
pub struct RecordLayout {
    key: Option<usize>,
    partition: Option<usize>,
    headers: Option<usize>,
    timestamp: Option<usize>,
    value: Vec<usize>,
}

impl RecordLayout {
    /// The layout of records made from rows of `schema`, or why the
    /// schema cannot make records (a reserved column of a type it cannot
    /// be, a column named twice).
    pub fn new(schema: &Schema) -> Result<Self, String> {
        let mut layout = Self {
            key: None,
            partition: None,
            headers: None,
            timestamp: None,
            value: Vec::new(),
        };
        for (i, field) in schema.fields().iter().enumerate() {
            let dt = field.data_type();
            let slot = match field.name().as_str() {
                KEY => {
                    check(
                        is_bytes(dt),
                        KEY,
                        dt,
                        "a string or binary type; write CAST(... AS VARCHAR) AS _key for another type",
                    )?;
                    &mut layout.key
                }
                PARTITION => {
                    check(dt.is_integer(), PARTITION, dt, "an integer type")?;
                    &mut layout.partition
                }
                HEADERS => {
                    check(
                        is_header_map(dt) || is_text(dt),
                        HEADERS,
                        dt,
                        "a MAP of strings to strings or binaries, or a JSON object as text",
                    )?;
                    &mut layout.headers
                }
                TIMESTAMP => {
                    check(
                        matches!(dt, DataType::Timestamp(_, _)) || dt.is_integer(),
                        TIMESTAMP,
                        dt,
                        "a TIMESTAMP, or an integer of milliseconds since the epoch",
                    )?;
                    &mut layout.timestamp
                }
                _ => {
                    layout.value.push(i);
                    continue;
                }
            };
            if slot.replace(i).is_some() {
                return Err(format!("the output has two columns named {}", field.name()));
            }
        }
        Ok(layout)
    }

    /// Whether the records carry a key (`_key`).
    pub fn has_key(&self) -> bool {
        self.key.is_some()
    }

    /// The records of `batch`'s rows.
    pub fn encode(&self, batch: &RecordBatch) -> Result<Encoded, String> {
        let rows = batch.num_rows();
        let (values, ends) = if self.value.is_empty() {
            (Vec::new(), None)
        } else {
            let projected = batch
                .project(&self.value)
                .map_err(|e| format!("the record values: {e}"))?;
            let mut out = Vec::with_capacity(rows * 64);
            {
                let mut w = arrow::json::LineDelimitedWriter::new(&mut out);
                w.write(&projected)
                    .and_then(|_| w.finish())
                    .map_err(|e| format!("the record values as JSON: {e}"))?;
            }
            let mut ends = Vec::with_capacity(rows);
            for (i, b) in out.iter().enumerate() {
                if *b == b'\n' {
                    ends.push(i);
                }
            }
            if ends.len() != rows {
                return Err(format!(
                    "the record values as JSON: {} lines for {rows} rows",
                    ends.len()
                ));
            }
            (out, Some(ends))
        };
        let column = |i: Option<usize>| i.map(|i| batch.column(i).clone());
        let keys = column(self.key)
            .map(|c| cast(&c, &DataType::Binary).map(|a| a.as_binary::<i32>().clone()))
            .transpose()
            .map_err(|e| format!("column {KEY}: {e}"))?;
        let partitions = column(self.partition)
            .map(|c| cast(&c, &DataType::Int32).map(|a| a.as_primitive().clone()))
            .transpose()
            .map_err(|e| format!("column {PARTITION}: {e}"))?;
        if let Some(p) = &partitions
            && let Some(bad) = p.iter().flatten().find(|p| *p < 0)
        {
            return Err(format!(
                "column {PARTITION} holds {bad}: partitions are 0 or more"
            ));
        }
        let timestamps = column(self.timestamp).map(timestamps_ms).transpose()?;
        let headers = column(self.headers).map(|c| headers(&c)).transpose()?;
        Ok(Encoded {
            rows,
            values,
            ends,
            keys,
            partitions,
            timestamps,
            headers,
        })
    }
}

fn check(ok: bool, column: &str, dt: &DataType, want: &str) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(format!("column {column} is {dt}; it must be {want}"))
    }
}

fn is_text(dt: &DataType) -> bool {
    matches!(
        dt,
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
    )
}

fn is_bytes(dt: &DataType) -> bool {
    is_text(dt)
        || matches!(
            dt,
            DataType::Binary | DataType::LargeBinary | DataType::BinaryView
        )
}

fn is_header_map(dt: &DataType) -> bool {
    match dt {
        DataType::Map(entries, _) => match entries.data_type() {
            DataType::Struct(fields) if fields.len() == 2 => {
                is_text(fields[0].data_type()) && is_bytes(fields[1].data_type())
            }
            _ => false,
        },
        _ => false,
    }
}

/// `_timestamp` as milliseconds since the epoch.
fn timestamps_ms(c: Arc<dyn Array>) -> Result<Int64Array, String> {
    let err = |e: arrow::error::ArrowError| format!("column {TIMESTAMP}: {e}");
    let c = match c.data_type() {
        DataType::Timestamp(_, _) => cast(
            &cast(&c, &DataType::Timestamp(TimeUnit::Millisecond, None)).map_err(err)?,
            &DataType::Int64,
        )
        .map_err(err)?,
        _ => cast(&c, &DataType::Int64).map_err(err)?,
    };
    Ok(c.as_primitive().clone())
}

/// One record's headers: name, value (NULL: a header without a value).
pub type Headers = Vec<(String, Option<Vec<u8>>)>;

/// `_headers` as each row's list of headers.
fn headers(c: &Arc<dyn Array>) -> Result<Vec<Headers>, String> {
    let err = |e: arrow::error::ArrowError| format!("column {HEADERS}: {e}");
    if let DataType::Map(_, _) = c.data_type() {
        let map = c.as_map();
        let names = cast(map.keys(), &DataType::Utf8).map_err(err)?;
        let names = names.as_string::<i32>();
        let values = cast(map.values(), &DataType::Binary).map_err(err)?;
        let values = values.as_binary::<i32>();
        return Ok((0..map.len())
            .map(|row| {
                if map.is_null(row) {
                    return Vec::new();
                }
                let offsets = map.value_offsets();
                (offsets[row] as usize..offsets[row + 1] as usize)
                    .map(|i| {
                        let v = (!values.is_null(i)).then(|| values.value(i).to_vec());
                        (names.value(i).to_string(), v)
                    })
                    .collect()
            })
            .collect());
    }
    let text = cast(c, &DataType::Utf8).map_err(err)?;
    let text = text.as_string::<i32>();
    (0..text.len())
        .map(|row| {
            if text.is_null(row) {
                return Ok(Vec::new());
            }
            let object: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(text.value(row)).map_err(|e| {
                    format!(
                        "column {HEADERS} holds {:?}, which is not a JSON object: {e}",
                        text.value(row)
                    )
                })?;
            Ok(object
                .into_iter()
                .map(|(k, v)| {
                    let v = match v {
                        serde_json::Value::Null => None,
                        serde_json::Value::String(s) => Some(s.into_bytes()),
                        other => Some(other.to_string().into_bytes()),
                    };
                    (k, v)
                })
                .collect())
        })
        .collect()
}

/// A batch's rows as records, ready to produce.
#[derive(Debug)]
pub struct Encoded {
    rows: usize,
    values: Vec<u8>,
    ends: Option<Vec<usize>>,
    keys: Option<BinaryArray>,
    partitions: Option<Int32Array>,
    timestamps: Option<Int64Array>,
    headers: Option<Vec<Headers>>,
}

/// One record of an [`Encoded`] batch, borrowed from it.
#[derive(Debug, PartialEq, Eq)]
pub struct Record<'a> {
    /// The key.
    pub key: Option<&'a [u8]>,
    /// The value (`None` when the output has no value column).
    pub value: Option<&'a [u8]>,
    /// The partition (`None`: the partitioner's choice).
    pub partition: Option<i32>,
    /// Milliseconds since the epoch (`None`: the producer's time).
    pub timestamp_ms: Option<i64>,
    /// The headers.
    pub headers: Option<&'a Headers>,
}

impl Encoded {
    /// How many records.
    pub fn len(&self) -> usize {
        self.rows
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Bytes of keys and values.
    pub fn bytes(&self) -> u64 {
        let keys = self.keys.as_ref().map_or(0, |k| k.values().len());
        (self.values.len() + keys) as u64
    }

    /// Record `i`.
    pub fn record(&self, i: usize) -> Record<'_> {
        let value = self.ends.as_ref().map(|ends| {
            let start = if i == 0 { 0 } else { ends[i - 1] + 1 };
            &self.values[start..ends[i]]
        });
        let present = |a: &dyn Array| !a.is_null(i);
        Record {
            key: self
                .keys
                .as_ref()
                .filter(|k| present(*k))
                .map(|k| k.value(i)),
            value,
            partition: self
                .partitions
                .as_ref()
                .filter(|p| present(*p))
                .map(|p| p.value(i)),
            timestamp_ms: self
                .timestamps
                .as_ref()
                .filter(|t| present(*t))
                .map(|t| t.value(i)),
            headers: self.headers.as_ref().map(|h| &h[i]),
        }
    }
}

#[cfg(test)]
mod tests;
