//! Avro against JSON on the same records, two ways, in this process:
//!
//! - **Kafka values**: Confluent-framed Avro values (magic byte, schema
//!   id, body) against JSON objects, each decoded record by record into
//!   Arrow as the Kafka source decodes them (Avro: arrow-avro's decoder with
//!   the writer schema resolved to the reader schema; JSON: arrow-json's,
//!   one value and a newline at a time), flushed every 8192 records.
//! - **Files**: the same events as Avro object container files (deflate)
//!   and as JSON lines, read through lakestream's file source.
//!
//! Nothing is written to a table: the figures are decoding alone.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::bail;
use arrow::array::{
    ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray, TimestampMicrosecondArray,
};
use arrow::datatypes::{DataType, Field, Schema, TimeUnit};
use lakestream_engine::source::avro::decoder_for;
use lakestream_engine::source::files::FileFormat;

use super::decode::file_source_rows;
use super::{figure, percentile};

/// Rows per decoded batch, as the Kafka source's default `batch_size`.
const BATCH: usize = 8192;

/// The events' columns (timestamps in microseconds, UTC: Avro's
/// `timestamp-micros`).
fn schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        Field::new("event_id", DataType::Utf8, false),
        Field::new("user_id", DataType::Int64, false),
        Field::new("event_type", DataType::Utf8, false),
        Field::new("amount", DataType::Float64, false),
        Field::new(
            "ts",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            false,
        ),
    ]))
}

/// Events `from..to`, deterministic.
fn events(from: u64, to: u64) -> anyhow::Result<RecordBatch> {
    const TYPES: [&str; 4] = ["view", "click", "cart", "purchase"];
    let ids: Vec<String> = (from..to).map(|i| format!("ev-{i:012}")).collect();
    let cols: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from(ids)),
        Arc::new(Int64Array::from_iter_values(
            (from..to).map(|i| (i * 7919 % 100_000) as i64),
        )),
        Arc::new(StringArray::from_iter_values(
            (from..to).map(|i| TYPES[(i % 4) as usize]),
        )),
        Arc::new(Float64Array::from_iter_values(
            (from..to).map(|i| (i % 10_000) as f64 / 100.0),
        )),
        Arc::new(
            TimestampMicrosecondArray::from_iter_values(
                (from..to).map(|i| 1_767_225_600_000_000 + i as i64 * 1000),
            )
            .with_timezone("UTC"),
        ),
    ];
    Ok(RecordBatch::try_new(schema(), cols)?)
}

/// The events' Avro schema, as arrow-avro's writer derives it.
fn avro_schema() -> anyhow::Result<String> {
    let s = arrow_avro::schema::AvroSchema::try_from(schema().as_ref())?;
    Ok(s.json_string)
}

/// Encoded record values, one `Vec` each.
type Values = Vec<Vec<u8>>;

/// `n` events as Confluent-framed Avro values (schema id 1) and as JSON
/// objects.
fn values(n: u64) -> anyhow::Result<(Values, Values)> {
    let mut avro = Vec::with_capacity(n as usize);
    let mut json = Vec::with_capacity(n as usize);
    let mut from = 0;
    while from < n {
        let to = (from + BATCH as u64).min(n);
        let batch = events(from, to)?;
        let mut enc = arrow_avro::writer::WriterBuilder::new(schema().as_ref().clone())
            .with_fingerprint_strategy(arrow_avro::schema::FingerprintStrategy::Id(1))
            .build_encoder::<arrow_avro::writer::format::AvroSoeFormat>()?;
        enc.encode(&batch)?;
        avro.extend(enc.flush().iter().map(|b| b.to_vec()));
        let mut w = arrow::json::LineDelimitedWriter::new(Vec::new());
        w.write(&batch)?;
        w.finish()?;
        json.extend(
            w.into_inner()
                .split(|b| *b == b'\n')
                .filter(|l| !l.is_empty())
                .map(<[u8]>::to_vec),
        );
        from = to;
    }
    if avro.len() as u64 != n || json.len() as u64 != n {
        bail!(
            "encoded {} Avro and {} JSON values of {n}",
            avro.len(),
            json.len()
        );
    }
    Ok((avro, json))
}

/// Rows decoded from `values` (Confluent-framed Avro), record by record.
fn decode_avro(values: &[Vec<u8>], writer: &str) -> anyhow::Result<u64> {
    let mut d = decoder_for(1, writer, writer, BATCH).map_err(anyhow::Error::msg)?;
    let mut rows = 0u64;
    for (i, v) in values.iter().enumerate() {
        if d.decode(v)? != v.len() {
            bail!("value {i} was not decoded whole");
        }
        if (i + 1) % BATCH == 0 {
            rows += d.flush()?.map_or(0, |b| b.num_rows() as u64);
        }
    }
    rows += d.flush()?.map_or(0, |b| b.num_rows() as u64);
    Ok(rows)
}

/// Rows decoded from `values` (JSON objects), record by record.
fn decode_json(values: &[Vec<u8>]) -> anyhow::Result<u64> {
    let mut d = arrow::json::ReaderBuilder::new(schema())
        .with_batch_size(BATCH)
        .build_decoder()?;
    let mut rows = 0u64;
    for (i, v) in values.iter().enumerate() {
        d.decode(v)?;
        d.decode(b"\n")?;
        if (i + 1) % BATCH == 0 {
            rows += d.flush()?.map_or(0, |b| b.num_rows() as u64);
        }
    }
    rows += d.flush()?.map_or(0, |b| b.num_rows() as u64);
    Ok(rows)
}

/// Write `rows` events as `files` Avro files (deflate) under `dir/avro`
/// and as JSON lines under `dir/json`, a batch at a time.
fn write_files(dir: &Path, rows: u64, files: u64) -> anyhow::Result<()> {
    for sub in ["avro", "json"] {
        std::fs::create_dir_all(dir.join(sub))?;
    }
    let per = rows.div_ceil(files);
    for f in 0..files {
        let (lo, hi) = (f * per, ((f + 1) * per).min(rows));
        let avro = std::fs::File::create(dir.join(format!("avro/part-{f:04}.avro")))?;
        let mut aw = arrow_avro::writer::WriterBuilder::new(schema().as_ref().clone())
            .with_compression(Some(arrow_avro::compression::CompressionCodec::Deflate))
            .build::<_, arrow_avro::writer::format::AvroOcfFormat>(std::io::BufWriter::new(avro))?;
        let json = std::fs::File::create(dir.join(format!("json/part-{f:04}.json")))?;
        let mut jw = arrow::json::LineDelimitedWriter::new(std::io::BufWriter::new(json));
        let mut from = lo;
        while from < hi {
            let to = (from + BATCH as u64).min(hi);
            let b = events(from, to)?;
            aw.write(&b)?;
            jw.write(&b)?;
            from = to;
        }
        aw.finish()?;
        jw.finish()?;
    }
    Ok(())
}

/// The median seconds of `runs` calls of `f`, which must return `rows`.
fn median_secs(
    runs: usize,
    rows: u64,
    what: &str,
    mut f: impl FnMut() -> anyhow::Result<u64>,
) -> anyhow::Result<f64> {
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        let n = f()?;
        times.push(t.elapsed().as_secs_f64());
        if n != rows {
            bail!("{what} decoded {n} rows of {rows}");
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(percentile(&times, 0.5))
}

/// Both comparisons over `rows` events (Kafka values: at most 2M, held
/// in memory), `runs` times each; print the medians and ratios.
pub(super) fn avro(dir: &Path, rows: u64, files: u64, runs: usize) -> anyhow::Result<()> {
    let n = rows.min(2_000_000);
    let (avro, json) = values(n)?;
    let writer = avro_schema()?;
    let avro_bytes: usize = avro.iter().map(Vec::len).sum();
    let json_bytes: usize = json.iter().map(Vec::len).sum();
    let (mut a, mut j) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        a.push(median_secs(1, n, "Avro", || decode_avro(&avro, &writer))?);
        j.push(median_secs(1, n, "JSON", || decode_json(&json))?);
    }
    a.sort_by(f64::total_cmp);
    j.sort_by(f64::total_cmp);
    let (a, j) = (percentile(&a, 0.5), percentile(&j, 0.5));
    figure(
        "avro.kafka_values_avro",
        format!("{:.0}", n as f64 / a),
        &format!(
            "records/s (Confluent-framed Avro, {:.1} bytes each)",
            avro_bytes as f64 / n as f64
        ),
    );
    figure(
        "avro.kafka_values_json",
        format!("{:.0}", n as f64 / j),
        &format!(
            "records/s (JSON, {:.1} bytes each)",
            json_bytes as f64 / n as f64
        ),
    );
    figure(
        "ratio.avro_over_json_values",
        format!("{:.2}", j / a),
        "x (above 1: Avro decodes faster)",
    );

    let input = dir.join("avro_bench");
    if !input.exists() {
        write_files(&input, rows, files)?;
    }
    let partitions = std::thread::available_parallelism()?.get().min(2);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(partitions)
        .enable_all()
        .build()?;
    let (mut fa, mut fj) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        fa.push(median_secs(1, rows, "the Avro files", || {
            rt.block_on(file_source_rows(
                &input.join("avro"),
                FileFormat::Avro,
                schema(),
                partitions,
            ))
        })?);
        fj.push(median_secs(1, rows, "the JSON files", || {
            rt.block_on(file_source_rows(
                &input.join("json"),
                FileFormat::Json,
                schema(),
                partitions,
            ))
        })?);
    }
    fa.sort_by(f64::total_cmp);
    fj.sort_by(f64::total_cmp);
    let (fa, fj) = (percentile(&fa, 0.5), percentile(&fj, 0.5));
    figure(
        "avro.files_avro",
        format!("{:.0}", rows as f64 / fa),
        "rows/s (Avro files, deflate, through the file source)",
    );
    figure(
        "avro.files_json",
        format!("{:.0}", rows as f64 / fj),
        "rows/s (JSON files, through the file source)",
    );
    figure(
        "ratio.avro_over_json_files",
        format!("{:.2}", fj / fa),
        "x (above 1: Avro files read faster)",
    );
    Ok(())
}
