//! Loading a SQL job file into a [`QueryBuilder`].
//!
//! Tables declared `UNBOUNDED` become sources, the `INSERT` target becomes
//! the Delta sink, other tables are static and loaded once at job start.
//! Every option is checked here, before any batch runs; an unknown option is
//! an error (a typo must not silently change a job's meaning).

use std::collections::HashMap;
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::datasource::MemTable;
use lakestream_plan::{Job, TableDecl};
use lakestream_sink::delta::{DeltaSink, DeltaSinkOptions, delta_schema};
use lakestream_source::Source;
use lakestream_source::files::{
    FileFormat, FileSource, FileSourceOptions, MissingFiles, TextCompression,
};
use lakestream_source::generator::{GeneratorOptions, GeneratorSource};
use lakestream_storage::normalize_option_key;

use crate::{Error, FailPoint, QueryBuilder, Result, Trigger};

/// How to run a job file.
#[derive(Clone)]
pub struct JobOptions {
    /// The checkpoint location.
    pub checkpoint: String,
    /// The trigger.
    pub trigger: Trigger,
    /// Storage options applied to every location of the job.
    pub storage_options: HashMap<String, String>,
    /// A test fail point.
    pub fail_point: Option<(FailPoint, u64)>,
}

/// Storage option values may be secrets: only their keys are shown.
impl std::fmt::Debug for JobOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut keys: Vec<&String> = self.storage_options.keys().collect();
        keys.sort();
        f.debug_struct("JobOptions")
            .field("checkpoint", &self.checkpoint)
            .field("trigger", &self.trigger)
            .field("storage_option_keys", &keys)
            .field("fail_point", &self.fail_point)
            .finish()
    }
}

/// Options of a streaming file table.
const FILE_OPTIONS: &[&str] = &[
    "max_files_per_trigger",
    "max_bytes_per_trigger",
    "batch_size",
    "has_header",
    "format.has_header",
    "delimiter",
    "format.delimiter",
    "path_glob",
    "modified_after",
    "modified_before",
    "compression",
    "incremental_listing",
    "read_concurrency",
    "missing_files",
    "max_file_age",
];
/// Options of a generator table.
const GENERATOR_OPTIONS: &[&str] = &[
    "rows",
    "rows_per_second",
    "seed",
    "max_rows_per_trigger",
    "batch_size",
];
/// Options of a Kafka table (plus any `kafka.*` librdkafka setting).
const KAFKA_OPTIONS: &[&str] = &[
    "format",
    "starting_offsets",
    "starting_timestamp",
    "ending_offsets",
    "max_offsets_per_trigger",
    "fail_on_data_loss",
    "isolation_level",
    "topic_pattern",
    "read_timeout",
    "request_timeout",
    "unavailable_timeout",
    "commit_offsets_to_group",
    "batch_size",
    "consumers",
];
/// Options of the Delta output table.
const DELTA_SINK_OPTIONS: &[&str] = &[
    "target_file_size",
    "compression",
    "auto_compact_every",
    "checkpoint_interval",
];

/// Parse the job in `text` (named `file` in errors) and build its query.
pub async fn load_job(file: &str, text: &str, options: &JobOptions) -> Result<QueryBuilder> {
    let job = lakestream_plan::parse_job(file, text).await?;
    // `SET aws.endpoint = '...'` (and google.*, azure.*) are storage options
    // of every location in the job; options given to the run win.
    let (storage, settings) = job_storage_options(&job, &options.storage_options);
    let options = &JobOptions {
        storage_options: storage,
        ..options.clone()
    };
    let mut builder = QueryBuilder::new()
        .checkpoint(options.checkpoint.clone())
        .checkpoint_options(options.storage_options.clone())
        .trigger(options.trigger);
    if let Some((p, n)) = options.fail_point {
        builder = builder.fail_point(p, n);
    }
    for stmt in settings {
        let ctx = builder.context();
        let plan = ctx
            .state()
            .statement_to_plan(stmt.clone())
            .await
            .map_err(|e| Error::Query(e.strip_backtrace()))?;
        ctx.execute_logical_plan(plan)
            .await
            .map_err(|e| Error::Query(e.strip_backtrace()))?;
    }
    let mut sink = None;
    for t in &job.tables {
        let is_target = t.name.eq_ignore_ascii_case(&job.insert.target);
        if is_target {
            sink = Some(delta_sink(&job, t, &options.storage_options)?);
        } else if t.unbounded {
            let source = stream_source(&job, t, options).await?;
            builder = builder.source(source)?;
        } else {
            builder = register_static(&job, t, builder, &options.storage_options).await?;
        }
    }
    let plan = builder
        .context()
        .state()
        .statement_to_plan(job.insert.query.clone())
        .await
        .map_err(|e| {
            job.error(
                lakestream_plan::pos_of(&e).unwrap_or(job.insert.pos),
                e.strip_backtrace(),
            )
        })?;
    let target = job.table(&job.insert.target).expect("checked by parse_job");
    if let Some(declared) = &target.schema {
        let out: Schema = plan.schema().as_arrow().clone();
        let out = if job.insert.columns.is_empty() {
            out
        } else {
            Schema::new(
                out.fields()
                    .iter()
                    .zip(&job.insert.columns)
                    .map(|(f, n)| Field::new(n, f.data_type().clone(), true))
                    .collect::<Vec<_>>(),
            )
        };
        let (a, b) = (delta_schema(declared), delta_schema(&out));
        if a != b {
            return Err(job
                .error(
                    job.insert.pos,
                    format!(
                        "the query produces ({}) but {} declares ({})",
                        describe(&b),
                        target.name,
                        describe(&a)
                    ),
                )
                .into());
        }
    }
    Ok(builder
        .output_columns(job.insert.columns.clone())
        .logical_plan(plan)
        .sink(sink.expect("the target is declared"))
        .with_job(job))
}

fn describe(s: &Schema) -> String {
    s.fields()
        .iter()
        .map(|f| format!("{} {}", f.name(), f.data_type()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn check_options(job: &Job, t: &TableDecl, allowed: &[&str]) -> Result<()> {
    for key in t.options.keys() {
        let passthrough = is_storage_key(key) || (t.format == "KAFKA" && key.starts_with("kafka."));
        if !allowed.contains(&key.as_str()) && !passthrough {
            return Err(job
                .error(
                    t.pos,
                    format!(
                        "unknown option {key:?} for table {} (STORED AS {}); valid options: {}",
                        t.name,
                        t.format,
                        allowed.join(", ")
                    ),
                )
                .into());
        }
    }
    Ok(())
}

fn opt_num(job: &Job, t: &TableDecl, key: &str) -> Result<Option<u64>> {
    match t.options.get(key) {
        None => Ok(None),
        Some(v) => parse_size(v).map(Some).ok_or_else(|| {
            job.error(
                t.pos,
                format!(
                    "option {key} of table {} must be a number, got {v:?}",
                    t.name
                ),
            )
            .into()
        }),
    }
}

/// `1000`, `64MB`, `1GiB`, `128k` ...
/// The job's storage options: its `SET aws.* = ...` statements, then the
/// run's options on top, keys normalized so no key is there twice; and the
/// other `SET` statements (for DataFusion).
fn job_storage_options<'a>(
    job: &'a Job,
    run: &HashMap<String, String>,
) -> (
    HashMap<String, String>,
    Vec<&'a datafusion::sql::parser::Statement>,
) {
    let mut storage = HashMap::new();
    let mut settings = Vec::new();
    for stmt in &job.settings {
        match storage_setting(&stmt.to_string()) {
            Some((k, v)) => {
                storage.insert(normalize_option_key(&k), v);
            }
            None => settings.push(stmt),
        }
    }
    storage.extend(
        run.iter()
            .map(|(k, v)| (normalize_option_key(k), v.clone())),
    );
    (storage, settings)
}

/// `SET aws.region = 'eu-west-1'` as `("aws.region", "eu-west-1")` when the
/// key names a storage option (`aws.`, `google.`, `azure.`).
fn storage_setting(stmt: &str) -> Option<(String, String)> {
    let re = regex::Regex::new(
        r"(?is)^\s*SET\s+(?:SESSION\s+|LOCAL\s+)?((?:aws|google|azure)\.[A-Za-z0-9_.]+)\s*(?:=|\bTO\b)\s*(.+?)\s*;?\s*$",
    )
    .expect("valid regex");
    let c = re.captures(stmt)?;
    let v = c[2].trim();
    let v = v
        .strip_prefix('\'')
        .and_then(|v| v.strip_suffix('\''))
        .or_else(|| v.strip_prefix('"').and_then(|v| v.strip_suffix('"')))
        .unwrap_or(v);
    Some((c[1].to_ascii_lowercase(), v.replace("''", "'")))
}

/// A time option: RFC 3339 (`2026-01-31T12:00:00Z`) or a date (`2026-01-31`,
/// midnight UTC), as ms since the epoch.
fn opt_time(job: &Job, t: &TableDecl, key: &str) -> Result<Option<i64>> {
    let Some(v) = t.options.get(key) else {
        return Ok(None);
    };
    let parsed = chrono::DateTime::parse_from_rfc3339(v)
        .map(|d| d.timestamp_millis())
        .ok()
        .or_else(|| {
            chrono::NaiveDate::parse_from_str(v, "%Y-%m-%d")
                .ok()
                .and_then(|d| d.and_hms_opt(0, 0, 0))
                .map(|d| d.and_utc().timestamp_millis())
        });
    parsed.map(Some).ok_or_else(|| {
        job.error(
            t.pos,
            format!(
                "option {key} of {}: {v:?} is not a time; use 2026-01-31 or 2026-01-31T12:00:00Z",
                t.name
            ),
        )
        .into()
    })
}

/// The first of `keys` the table sets, with its value.
fn option_of<'t>(t: &'t TableDecl, keys: &[&'t str]) -> Option<(&'t str, &'t String)> {
    keys.iter().find_map(|k| t.options.get(*k).map(|v| (*k, v)))
}

fn opt_bool(job: &Job, t: &TableDecl, key: &str, v: &str) -> Result<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(job
            .error(
                t.pos,
                format!("option {key} of {}: {v:?} is not true or false", t.name),
            )
            .into()),
    }
}

fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (n, unit) = v.split_at(split);
    let n: u64 = n.parse().ok()?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// Whether a table option key is a storage option (`aws.*`, `google.*`,
/// `azure.*`, or with `_` for `.`).
fn is_storage_key(key: &str) -> bool {
    ["aws.", "google.", "azure.", "aws_", "google_", "azure_"]
        .iter()
        .any(|p| key.starts_with(p))
}

/// The storage options of table `t`: the job's, then the table's own.
/// Keys are normalized first, so two spellings of one key cannot both be
/// present and race.
fn store_options(t: &TableDecl, base: &HashMap<String, String>) -> HashMap<String, String> {
    let mut o = base.clone();
    for (k, v) in &t.options {
        if is_storage_key(k) {
            o.insert(normalize_option_key(k), v.clone());
        }
    }
    o
}

async fn stream_source(job: &Job, t: &TableDecl, options: &JobOptions) -> Result<Arc<dyn Source>> {
    if t.format == "KAFKA" {
        return kafka_source(job, t);
    }
    if t.format == "GENERATOR" {
        check_options(job, t, GENERATOR_OPTIONS)?;
        let mut g = GeneratorOptions {
            rows: None,
            ..Default::default()
        };
        g.rows = opt_num(job, t, "rows")?;
        g.rows_per_second = opt_num(job, t, "rows_per_second")?;
        if let Some(s) = opt_num(job, t, "seed")? {
            g.seed = s;
        }
        g.max_rows_per_trigger = opt_num(job, t, "max_rows_per_trigger")?;
        if let Some(b) = opt_num(job, t, "batch_size")? {
            g.batch_size = usize::try_from(b).unwrap_or(usize::MAX);
        }
        if g.rows.is_none() && g.rows_per_second.is_none() {
            g.rows = Some(1000);
        }
        let source = GeneratorSource::try_new(&t.name, g)?;
        if let Some(declared) = &t.schema
            && delta_schema(declared) != delta_schema(&source.schema())
        {
            return Err(job
                .error(
                    t.pos,
                    format!(
                        "a GENERATOR table has the columns ({}); declare those or none",
                        describe(&source.schema())
                    ),
                )
                .into());
        }
        return Ok(Arc::new(source));
    }
    let Some(mut format) = FileFormat::from_name(&t.format) else {
        return Err(job
            .error(
                t.pos,
                format!(
                    "STORED AS {} is not supported for a stream (UNBOUNDED table {}); use JSON, \
                     CSV, PARQUET or GENERATOR",
                    t.format, t.name
                ),
            )
            .into());
    };
    check_options(job, t, FILE_OPTIONS)?;
    if let FileFormat::Csv {
        has_header,
        delimiter,
    } = &mut format
    {
        if let Some((key, v)) = option_of(t, &["format.has_header", "has_header"]) {
            *has_header = opt_bool(job, t, key, v)?;
        }
        if let Some((key, v)) = option_of(t, &["format.delimiter", "delimiter"]) {
            *delimiter = match v.as_bytes() {
                [b] => *b,
                _ => {
                    return Err(job
                        .error(
                            t.pos,
                            format!(
                                "option {key} of {}: {v:?} is not one ASCII character",
                                t.name
                            ),
                        )
                        .into());
                }
            };
        }
    }
    let mut fo = FileSourceOptions::new(format.clone());
    fo.max_files_per_trigger =
        opt_num(job, t, "max_files_per_trigger")?.map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    if let Some(b) = opt_num(job, t, "max_bytes_per_trigger")? {
        fo.max_bytes_per_trigger = Some(b);
    }
    if let Some(b) = opt_num(job, t, "batch_size")? {
        fo.batch_size = usize::try_from(b).unwrap_or(usize::MAX);
    }
    if let Some(n) = opt_num(job, t, "read_concurrency")? {
        fo.read_concurrency = usize::try_from(n).unwrap_or(usize::MAX);
    }
    if let Some(v) = t.options.get("max_file_age") {
        let d = crate::parse_duration(v)
            .filter(|d| !d.is_zero())
            .ok_or_else(|| -> Error {
                job.error(
                    t.pos,
                    format!(
                        "max_file_age {v:?} for {}: give a duration above 0 and at most a year, \
                     such as 7d or 12h",
                        t.name
                    ),
                )
                .into()
            })?;
        fo.max_file_age_ms = Some(i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    }
    if let Some(v) = t.options.get("missing_files") {
        fo.missing_files = MissingFiles::from_name(v).ok_or_else(|| -> Error {
            job.error(
                t.pos,
                format!("missing_files {v:?} for {}: use fail or skip", t.name),
            )
            .into()
        })?;
    }
    fo.path_glob = t.options.get("path_glob").cloned();
    fo.modified_after_ms = opt_time(job, t, "modified_after")?;
    fo.modified_before_ms = opt_time(job, t, "modified_before")?;
    if let Some(v) = t.options.get("compression") {
        fo.compression = TextCompression::from_name(v).ok_or_else(|| -> Error {
            job.error(
                t.pos,
                format!(
                    "compression {v:?} for {}: use auto, none, gzip or zstd",
                    t.name
                ),
            )
            .into()
        })?;
    }
    if let Some(v) = t.options.get("incremental_listing") {
        fo.incremental_listing = opt_bool(job, t, "incremental_listing", v)?;
    }
    fo.partition_columns = t.partition_cols.clone();
    let store_opts = store_options(t, &options.storage_options);
    let schema = match &t.schema {
        Some(s) => s.clone(),
        None => inferred_schema(job, t, &fo, &store_opts, options).await?,
    };
    // Partition columns not declared are strings read from the directory names.
    let schema = if t.partition_cols.iter().all(|p| schema.index_of(p).is_ok()) {
        schema
    } else {
        let mut fields: Vec<Field> = schema.fields().iter().map(|f| f.as_ref().clone()).collect();
        for p in &t.partition_cols {
            if schema.index_of(p).is_err() {
                fields.push(Field::new(p, DataType::Utf8, true));
            }
        }
        Arc::new(Schema::new(fields))
    };
    Ok(Arc::new(FileSource::try_new(
        &t.name,
        &t.location,
        &store_opts,
        schema,
        fo,
    )?))
}

fn kafka_source(job: &Job, t: &TableDecl) -> Result<Arc<dyn Source>> {
    use lakestream_source::kafka::{
        EndingOffsets, IsolationLevel, KafkaSource, KafkaSourceOptions, StartingOffsets, Topics,
        ValueFormat,
    };
    check_options(job, t, KAFKA_OPTIONS)?;
    let err = |msg: String| -> Error { job.error(t.pos, msg).into() };
    let rest = t.location.strip_prefix("kafka://").ok_or_else(|| {
        err(format!(
            "a KAFKA table's LOCATION is kafka://HOST:PORT[,HOST:PORT]/TOPIC[,TOPIC], got {:?}",
            t.location
        ))
    })?;
    let (servers, topics) = rest.split_once('/').unwrap_or((rest, ""));
    let topics: Vec<String> = topics
        .split(',')
        .map(|s| s.trim().trim_end_matches('/').to_string())
        .filter(|s| !s.is_empty())
        .collect();
    let topics = match (t.options.get("topic_pattern"), topics.is_empty()) {
        (Some(p), true) => Topics::Pattern(
            regex::Regex::new(p).map_err(|e| err(format!("topic_pattern {p:?}: {e}")))?,
        ),
        (None, false) => Topics::List(topics),
        (Some(_), false) => {
            return Err(err(
                "name topics in LOCATION or give 'topic_pattern', not both".into(),
            ));
        }
        (None, true) => {
            return Err(err(format!(
                "no topic: write LOCATION 'kafka://{servers}/TOPIC' or set 'topic_pattern'"
            )));
        }
    };
    if servers.is_empty() {
        return Err(err("no bootstrap servers in LOCATION".into()));
    }
    let mut o = KafkaSourceOptions::new(servers, topics);
    o.format = match t
        .options
        .get("format")
        .map(|s| s.to_ascii_lowercase())
        .as_deref()
    {
        None | Some("json") => ValueFormat::Json,
        Some("raw") => ValueFormat::Raw,
        Some("string") => ValueFormat::String,
        Some(other) => {
            return Err(err(format!(
                "format {other:?} is not supported: use json, raw or string"
            )));
        }
    };
    let offsets_map = |key: &str,
                       v: &str|
     -> Result<
        std::collections::BTreeMap<String, std::collections::BTreeMap<i32, i64>>,
    > {
        let raw: std::collections::BTreeMap<String, std::collections::BTreeMap<String, i64>> =
            serde_json::from_str(v).map_err(|e| {
                err(format!(
                    "option {key}: expected 'earliest', 'latest' or a JSON map like {{\"topic\": {{\"0\": 42}}}}: {e}"
                ))
            })?;
        raw.into_iter()
            .map(|(t, ps)| {
                let ps = ps
                    .into_iter()
                    .map(|(p, o)| {
                        p.parse::<i32>().map(|p| (p, o)).map_err(|_| {
                            err(format!("option {key}: partition {p:?} is not a number"))
                        })
                    })
                    .collect::<Result<_>>()?;
                Ok((t, ps))
            })
            .collect()
    };
    match (
        t.options.get("starting_offsets"),
        t.options.get("starting_timestamp"),
    ) {
        (Some(_), Some(_)) => {
            return Err(err(
                "give 'starting_offsets' or 'starting_timestamp', not both".into(),
            ));
        }
        (None, Some(ts)) => {
            o.starting_offsets = StartingOffsets::Timestamp(ts.parse().map_err(|_| {
                err(format!(
                    "starting_timestamp must be milliseconds since the epoch, got {ts:?}"
                ))
            })?)
        }
        (Some(v), None) => {
            o.starting_offsets = match v.as_str() {
                "earliest" => StartingOffsets::Earliest,
                "latest" => StartingOffsets::Latest,
                json => StartingOffsets::Map(offsets_map("starting_offsets", json)?),
            }
        }
        (None, None) => {}
    }
    if let Some(v) = t.options.get("ending_offsets") {
        o.ending_offsets = Some(match v.as_str() {
            "latest" => EndingOffsets::Latest,
            json => EndingOffsets::Map(offsets_map("ending_offsets", json)?),
        });
    }
    o.max_offsets_per_trigger = opt_num(job, t, "max_offsets_per_trigger")?;
    if let Some(v) = t.options.get("fail_on_data_loss") {
        o.fail_on_data_loss = match v.to_ascii_lowercase().as_str() {
            "true" => true,
            "false" => false,
            _ => {
                return Err(err(format!(
                    "fail_on_data_loss must be true or false, got {v:?}"
                )));
            }
        };
    }
    for (key, field) in [
        ("read_timeout", &mut o.read_timeout),
        ("request_timeout", &mut o.request_timeout),
        ("unavailable_timeout", &mut o.unavailable_timeout),
    ] {
        if let Some(v) = t.options.get(key) {
            *field = crate::parse_duration(v)
                .ok_or_else(|| err(format!("{key} must be a duration like 30s, got {v:?}")))?;
        }
    }
    o.commit_group = t.options.get("commit_offsets_to_group").cloned();
    if let Some(b) = opt_num(job, t, "batch_size")? {
        o.batch_size = usize::try_from(b).unwrap_or(usize::MAX);
    }
    if let Some(n) = opt_num(job, t, "consumers")? {
        o.consumers = usize::try_from(n).unwrap_or(usize::MAX);
    }
    if let Some(v) = t.options.get("isolation_level") {
        o.isolation_level = IsolationLevel::from_name(v).ok_or_else(|| {
            err(format!(
                "isolation_level {v:?}: use read_committed or read_uncommitted"
            ))
        })?;
    }
    for (k, v) in &t.options {
        if let Some(rest) = k.strip_prefix("kafka.") {
            o.client_config.insert(rest.to_string(), v.clone());
        }
    }
    Ok(Arc::new(KafkaSource::try_new(
        &t.name,
        t.schema.clone(),
        o,
    )?))
}

/// The schema of a stream declared without columns: inferred from its first
/// file once, then fixed in the checkpoint so every restart reads the same.
async fn inferred_schema(
    job: &Job,
    t: &TableDecl,
    fo: &FileSourceOptions,
    store_opts: &HashMap<String, String>,
    options: &JobOptions,
) -> Result<SchemaRef> {
    let stored = lakestream_checkpoint::read_source_state(
        &options.checkpoint,
        &options.storage_options,
        &t.name,
        "schema",
    )
    .await?;
    if let Some(v) = stored {
        return schema_from_json(&v).ok_or_else(|| {
            Error::Query(format!(
                "the schema of {} stored in the checkpoint is not readable",
                t.name
            ))
        });
    }
    let Some(schema) = FileSource::infer_schema(&t.name, &t.location, store_opts, fo).await? else {
        return Err(job
            .error(
                t.pos,
                format!(
                    "cannot infer the schema of {}: no file under {} yet; declare the columns \
                     in the CREATE statement",
                    t.name, t.location
                ),
            )
            .into());
    };
    let v = lakestream_checkpoint::init_source_state(
        &options.checkpoint,
        &options.storage_options,
        &t.name,
        "schema",
        schema_to_json(&schema),
    )
    .await?;
    schema_from_json(&v)
        .ok_or_else(|| Error::Query(format!("the inferred schema of {} is invalid", t.name)))
}

fn schema_to_json(schema: &Schema) -> serde_json::Value {
    serde_json::Value::Array(
        schema
            .fields()
            .iter()
            .map(|f| {
                serde_json::json!({
                    "name": f.name(),
                    "type": f.data_type().to_string(),
                    "nullable": f.is_nullable(),
                })
            })
            .collect(),
    )
}

fn schema_from_json(v: &serde_json::Value) -> Option<SchemaRef> {
    let mut fields = Vec::new();
    for f in v.as_array()? {
        let t: DataType = f.get("type")?.as_str()?.parse().ok()?;
        fields.push(Field::new(
            f.get("name")?.as_str()?,
            t,
            f.get("nullable")?.as_bool()?,
        ));
    }
    Some(Arc::new(Schema::new(fields)))
}

fn delta_sink(
    job: &Job,
    t: &TableDecl,
    storage: &HashMap<String, String>,
) -> Result<Arc<DeltaSink>> {
    if t.format != "DELTA" {
        return Err(job
            .error(
                t.pos,
                format!("the output table {} must be STORED AS DELTA", t.name),
            )
            .into());
    }
    if t.unbounded {
        return Err(job
            .error(
                t.pos,
                format!("the output table {} cannot be UNBOUNDED", t.name),
            )
            .into());
    }
    check_options(job, t, DELTA_SINK_OPTIONS)?;
    let mut o = DeltaSinkOptions {
        partition_columns: t.partition_cols.clone(),
        storage_options: store_options(t, storage),
        ..Default::default()
    };
    o.auto_compact_every = opt_num(job, t, "auto_compact_every")?.filter(|n| *n > 0);
    if let Some(n) = opt_num(job, t, "target_file_size")? {
        o.target_file_size = n;
    }
    if let Some(n) = opt_num(job, t, "checkpoint_interval")? {
        if n == 0 {
            return Err(job
                .error(t.pos, "checkpoint_interval must be at least 1")
                .into());
        }
        o.checkpoint_interval = n;
    }
    if let Some(c) = t.options.get("compression") {
        o.compression = DeltaSinkOptions::parse_compression(c).ok_or_else(|| {
            job.error(
                t.pos,
                format!("unknown compression {c:?}: use snappy, zstd, lz4 or none"),
            )
        })?;
    }
    Ok(Arc::new(DeltaSink::try_new(&t.location, o)?))
}

async fn register_static(
    job: &Job,
    t: &TableDecl,
    builder: QueryBuilder,
    storage: &HashMap<String, String>,
) -> Result<QueryBuilder> {
    let ctx = builder.context().clone();
    let err = |msg: String| -> Error { job.error(t.pos, msg).into() };
    let provider: Arc<dyn datafusion::datasource::TableProvider> = match t.format.as_str() {
        "DELTA" => {
            let loc = lakestream_storage::Location::parse(&t.location, &store_options(t, storage))?;
            let table = lakestream_sink::delta::load_table(&loc)
                .await
                .map_err(|e| err(format!("cannot open Delta table {}: {e}", t.location)))?
                .ok_or_else(|| err(format!("{} is not a Delta table", t.location)))?;
            table
                .update_datafusion_session(&ctx.state())
                .map_err(|e| err(e.to_string()))?;
            table
                .table_provider()
                .await
                .map_err(|e| err(e.strip_backtrace()))?
        }
        _ => {
            // DataFusion reads the files through the same store the rest of
            // the job uses (credentials, endpoint, retries).
            let loc = lakestream_storage::Location::parse(&t.location, &store_options(t, storage))?;
            if loc.local_dir().is_none() {
                ctx.register_object_store(loc.url(), loc.store().clone());
            }
            let plan = ctx
                .state()
                .statement_to_plan(t.statement.clone())
                .await
                .map_err(|e| err(e.strip_backtrace()))?;
            ctx.execute_logical_plan(plan)
                .await
                .map_err(|e| err(e.strip_backtrace()))?;
            // Load once: a static table is read as of job start, so every
            // batch (and every replay of a batch) joins the same rows.
            let df = ctx
                .table(t.name.as_str())
                .await
                .map_err(|e| err(e.strip_backtrace()))?;
            let schema: SchemaRef = Arc::new(df.schema().as_arrow().clone());
            let batches = df.collect().await.map_err(|e| {
                err(format!(
                    "cannot read {}: {}",
                    t.location,
                    e.strip_backtrace()
                ))
            })?;
            ctx.deregister_table(t.name.as_str())
                .map_err(|e| err(e.strip_backtrace()))?;
            Arc::new(
                MemTable::try_new(schema, vec![batches]).map_err(|e| err(e.strip_backtrace()))?,
            )
        }
    };
    builder.static_table(&t.name, provider)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_settings_are_taken_from_set_statements() {
        assert_eq!(
            storage_setting("SET aws.endpoint = 'http://127.0.0.1:9000'"),
            Some(("aws.endpoint".into(), "http://127.0.0.1:9000".into()))
        );
        assert_eq!(
            storage_setting("SET AWS.Region TO 'eu-west-1'"),
            Some(("aws.region".into(), "eu-west-1".into()))
        );
        assert_eq!(
            storage_setting("SET datafusion.execution.batch_size = 1024"),
            None
        );
    }

    #[tokio::test]
    async fn run_options_override_set_statements_whatever_the_spelling() {
        let job = lakestream_plan::parse_job(
            "job.sql",
            "SET aws.endpoint = 'http://a';\nSET aws.region = 'r1';\n\
             CREATE UNBOUNDED EXTERNAL TABLE e (x INT) STORED AS JSON LOCATION 'in/';\n\
             CREATE EXTERNAL TABLE o STORED AS DELTA LOCATION 'out';\n\
             INSERT INTO o SELECT x FROM e;",
        )
        .await
        .unwrap();
        let run = HashMap::from([("AWS.ENDPOINT".to_string(), "http://b".to_string())]);
        let (storage, settings) = job_storage_options(&job, &run);
        assert_eq!(
            storage,
            HashMap::from([
                ("aws_endpoint".to_string(), "http://b".to_string()),
                ("aws_region".to_string(), "r1".to_string()),
            ])
        );
        assert!(settings.is_empty());
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("1000"), Some(1000));
        assert_eq!(parse_size("64MB"), Some(64 << 20));
        assert_eq!(parse_size("2 GiB"), Some(2 << 30));
        assert_eq!(parse_size("x"), None);
    }

    #[test]
    fn inferred_schemas_round_trip_through_json() {
        let s = Schema::new(vec![
            Field::new("a", DataType::Int64, true),
            Field::new(
                "ts",
                DataType::Timestamp(arrow::datatypes::TimeUnit::Nanosecond, None),
                false,
            ),
        ]);
        let back = schema_from_json(&schema_to_json(&s)).unwrap();
        assert_eq!(back.as_ref(), &s);
    }
}
