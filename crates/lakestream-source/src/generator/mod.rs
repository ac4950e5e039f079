//! A deterministic generator of event rows, for demos, tests and benchmarks.
//!
//! Row `i` is a pure function of `(seed, i)`, so any range of offsets (row
//! numbers) can be re-read and yields the same rows. With `rows_per_second`
//! rows become available over time, like a live stream; without it all
//! `rows` are available at once.

pub mod connector;

use std::sync::Arc;
use std::time::Instant;

use arrow::array::{Float64Array, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use async_trait::async_trait;
use futures::StreamExt;
use futures::stream;

use crate::{BatchStream, Error, Offset, Result, Source, SourceIdentity, require_positive};

/// Event types the generator draws from.
pub const EVENT_TYPES: [&str; 4] = ["view", "click", "cart", "purchase"];

/// Settings of a [`GeneratorSource`].
#[derive(Debug, Clone)]
pub struct GeneratorOptions {
    /// Seed of the row function.
    pub seed: u64,
    /// Total rows; `None` for an endless stream (needs `rows_per_second`).
    pub rows: Option<u64>,
    /// Rows that become available per second since the source started.
    pub rows_per_second: Option<u64>,
    /// At most this many rows per batch.
    pub max_rows_per_trigger: Option<u64>,
    /// Rows per produced record batch.
    pub batch_size: usize,
    /// Event time of row 0, microseconds since the epoch; row i is i ms later.
    pub start_time_us: i64,
}

impl Default for GeneratorOptions {
    fn default() -> Self {
        Self {
            seed: 42,
            rows: Some(1000),
            rows_per_second: None,
            max_rows_per_trigger: None,
            batch_size: 8192,
            start_time_us: 1_767_225_600_000_000, // 2026-01-01T00:00:00Z
        }
    }
}

/// The generator source. Its schema is [`GeneratorSource::fixed_schema`].
#[derive(Debug)]
pub struct GeneratorSource {
    name: String,
    options: GeneratorOptions,
    started: Instant,
    frozen: std::sync::Mutex<Option<u64>>,
}

impl GeneratorSource {
    /// A generator named `name`.
    pub fn try_new(name: &str, options: GeneratorOptions) -> Result<Self> {
        if options.rows.is_none() && options.rows_per_second.is_none() {
            return Err(Error::InvalidOption {
                source_name: name.to_string(),
                option: "rows".into(),
                reason: "an endless generator needs rows_per_second".into(),
            });
        }
        require_positive(name, "batch_size", options.batch_size as u64)?;
        if let Some(n) = options.rows_per_second {
            require_positive(name, "rows_per_second", n)?;
        }
        if let Some(n) = options.max_rows_per_trigger {
            require_positive(name, "max_rows_per_trigger", n)?;
        }
        Ok(Self {
            name: name.to_string(),
            options,
            started: Instant::now(),
            frozen: std::sync::Mutex::new(None),
        })
    }

    /// `event_id VARCHAR NOT NULL, user_id BIGINT, event_type VARCHAR,
    /// amount DOUBLE, ts TIMESTAMP(us, UTC)`.
    pub fn fixed_schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("event_id", DataType::Utf8, false),
            Field::new("user_id", DataType::Int64, true),
            Field::new("event_type", DataType::Utf8, true),
            Field::new("amount", DataType::Float64, true),
            Field::new(
                "ts",
                DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
                true,
            ),
        ]))
    }

    fn available(&self) -> u64 {
        let by_rate = self
            .options
            .rows_per_second
            .map(|r| (self.started.elapsed().as_secs_f64() * r as f64) as u64);
        match (self.options.rows, by_rate) {
            (Some(total), Some(r)) => total.min(r),
            (Some(total), None) => total,
            (None, Some(r)) => r,
            (None, None) => 0,
        }
    }

    fn parse(&self, offset: Option<&Offset>) -> Result<u64> {
        match offset {
            None => Ok(0),
            Some(v) => v.as_u64().ok_or_else(|| Error::InvalidOffset {
                source_name: self.name.clone(),
                offset: v.to_string(),
                reason: "expected a row count".into(),
            }),
        }
    }
}

/// splitmix64: a fast, well-mixed hash of the row number.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Rows `from..to` of the generator with `options`.
pub fn generate(options: &GeneratorOptions, from: u64, to: u64) -> RecordBatch {
    let n = (to - from) as usize;
    let mut ids = Vec::with_capacity(n);
    let mut users = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    let mut amounts = Vec::with_capacity(n);
    let mut ts = Vec::with_capacity(n);
    for i in from..to {
        let h = mix(options.seed ^ mix(i));
        ids.push(format!("e{i:010}"));
        users.push((h % 1000) as i64);
        types.push(EVENT_TYPES[((h >> 10) % 4) as usize]);
        // Mostly positive amounts in cents, some zero or negative refunds.
        amounts.push(((h >> 20) % 20_000) as f64 / 100.0 - 20.0);
        ts.push(options.start_time_us + i as i64 * 1000);
    }
    RecordBatch::try_new(
        GeneratorSource::fixed_schema(),
        vec![
            Arc::new(StringArray::from(ids)),
            Arc::new(Int64Array::from(users)),
            Arc::new(StringArray::from(types)),
            Arc::new(Float64Array::from(amounts)),
            Arc::new(TimestampMicrosecondArray::from(ts).with_timezone("UTC")),
        ],
    )
    .expect("generator batch matches its schema")
}

#[async_trait]
impl Source for GeneratorSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn schema(&self) -> SchemaRef {
        Self::fixed_schema()
    }

    async fn recover(&self, ends: &[Offset]) -> Result<()> {
        for e in ends {
            self.parse(Some(e))?;
        }
        Ok(())
    }

    async fn restore(&self, _snapshot: Option<&Offset>) -> Result<()> {
        // A bound frozen by an earlier available-now run must not cap this one.
        *self.frozen.lock().expect("generator state") = None;
        Ok(())
    }

    fn identity(&self) -> SourceIdentity {
        SourceIdentity {
            kind: "generator".into(),
            location: String::new(),
        }
    }

    async fn freeze(&self) -> Result<()> {
        *self.frozen.lock().expect("generator state") = Some(self.available());
        Ok(())
    }

    async fn plan(&self, start: Option<&Offset>) -> Result<Option<Offset>> {
        let start = self.parse(start)?;
        let mut end = self.available();
        if let Some(f) = *self.frozen.lock().expect("generator state") {
            end = end.min(f);
        }
        if let Some(cap) = self.options.max_rows_per_trigger {
            end = end.min(start.saturating_add(cap));
        }
        Ok((end > start).then(|| serde_json::json!(end)))
    }

    fn read(
        &self,
        start: Option<&Offset>,
        end: &Offset,
        partitions: usize,
    ) -> Result<Vec<BatchStream>> {
        let start = self.parse(start)?;
        let end = self.parse(Some(end))?;
        let partitions = partitions.max(1) as u64;
        // At least an Arrow batch per partition: a tiny batch is one stream
        // (one output file), not one per core.
        let per = (end - start)
            .div_ceil(partitions)
            .max(self.options.batch_size.max(1) as u64);
        let mut out = Vec::new();
        let mut lo = start;
        while lo < end {
            let hi = (lo + per).min(end);
            let opts = self.options.clone();
            let step = opts.batch_size.max(1) as u64;
            let chunks: Vec<(u64, u64)> = (lo..hi)
                .step_by(step as usize)
                .map(|a| (a, (a + step).min(hi)))
                .collect();
            out.push(
                stream::iter(chunks)
                    .map(move |(a, b)| Ok(generate(&opts, a, b)))
                    .boxed(),
            );
            lo = hi;
        }
        Ok(out)
    }

    fn describe(&self, start: Option<&Offset>, end: &Offset) -> String {
        format!(
            "rows {}..{}",
            self.parse(start).unwrap_or(0),
            self.parse(Some(end)).unwrap_or(0)
        )
    }

    fn count_hint(&self, start: Option<&Offset>, end: &Offset) -> Option<u64> {
        Some(self.parse(Some(end)).ok()? - self.parse(start).ok()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::TryStreamExt;

    #[tokio::test]
    async fn ranges_are_deterministic_and_capped() {
        let opts = GeneratorOptions {
            rows: Some(25),
            max_rows_per_trigger: Some(10),
            batch_size: 4,
            ..Default::default()
        };
        let g = GeneratorSource::try_new("g", opts.clone()).unwrap();
        let e0 = g.plan(None).await.unwrap().unwrap();
        assert_eq!(e0, serde_json::json!(10));
        let mut rows = 0;
        for s in g.read(None, &e0, 2).unwrap() {
            let b: Vec<RecordBatch> = s.try_collect().await.unwrap();
            rows += b.iter().map(|b| b.num_rows()).sum::<usize>();
        }
        assert_eq!(rows, 10);
        // Ten rows over eight cores, four per Arrow batch: three streams of
        // a batch (the last shorter), not eight.
        assert_eq!(g.read(None, &e0, 8).unwrap().len(), 3);
        // A range within one Arrow batch is one stream whatever the cores.
        assert_eq!(
            g.read(Some(&serde_json::json!(7)), &e0, 2).unwrap().len(),
            1
        );
        assert_eq!(generate(&opts, 3, 5), generate(&opts, 3, 5));
        let e1 = g.plan(Some(&e0)).await.unwrap().unwrap();
        let e2 = g.plan(Some(&e1)).await.unwrap().unwrap();
        assert_eq!(e2, serde_json::json!(25));
        assert!(g.plan(Some(&e2)).await.unwrap().is_none());
    }
}
