//! A SQL logic test runner for streaming jobs: `.slt` files (the
//! `sqllogictest` format DataFusion's own tests use) that declare a job,
//! feed its sources one micro-batch at a time, run it, and check the
//! output table after each run.
//!
//! Each file runs in a fresh directory; `$DIR` anywhere in a record stands
//! for it. A record's SQL is one of:
//!
//! - a job statement (`SET ...`, `CREATE [UNBOUNDED] EXTERNAL TABLE ...`,
//!   `INSERT INTO ...`): added to the job, checked when the job next runs;
//!   an `INSERT` replaces the job's previous one, so a file can try several
//!   queries over one set of tables;
//! - `FEED <table>` followed by lines: one new file with those lines in the
//!   location of the job's file-source table `<table>` (`JSON`: JSON
//!   lines; `CSV`: rows, with a header line if the table says so); the
//!   record's count is the number of non-blank lines written;
//! - `RUN [<trigger>] [CRASH <fail point> <batch id>]`: load the job from
//!   its statements and run it as `lakestream run` would, with the
//!   checkpoint at `$DIR/checkpoint` (trigger `available-now` unless given:
//!   `once`, `available-now`). The record's count is the number of batches
//!   committed; an error (a refused job, a failed batch, the injected
//!   crash) is the record's error, so `statement error <regex>` checks its
//!   message. Every `RUN` is a restart: it recovers from the checkpoint as
//!   a new process would;
//! - anything else: a query over the job's Delta tables (the sink and the
//!   static tables, each registered by its job name and read fresh with
//!   delta-rs), checked with `query <types>`.
//!
//! ```text
//! statement ok
//! CREATE UNBOUNDED EXTERNAL TABLE events (id BIGINT) STORED AS JSON LOCATION '$DIR/in';
//!
//! statement ok
//! CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION '$DIR/out';
//!
//! statement ok
//! INSERT INTO out SELECT id FROM events WHERE id > 1;
//!
//! statement ok
//! FEED events
//! {"id": 1}
//! {"id": 2}
//!
//! statement count 1
//! RUN
//!
//! query I
//! SELECT id FROM out
//! ----
//! 2
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::DataType;
use arrow::util::display::FormatOptions;
use async_trait::async_trait;
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::{DFParser, Statement};
use lakestream_engine::delta::load_table;
use lakestream_engine::job::{JobOptions, load_job};
use lakestream_engine::storage::Location;
use lakestream_engine::{FailPoint, Trigger};
use sqllogictest::{AsyncDB, DBOutput, DefaultColumnType};

/// Why a record failed: its message is what `statement error <regex>`
/// and `query error <regex>` match.
#[derive(Debug)]
pub struct SltError(String);

impl std::fmt::Display for SltError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SltError {}

fn fail(message: impl std::fmt::Display) -> SltError {
    SltError(message.to_string())
}

/// A table the job declares.
struct JobTable {
    name: String,
    format: String,
    location: String,
    unbounded: bool,
}

/// One `.slt` file's job: its statements, its directory and its feeds.
pub struct JobHarness {
    dir: PathBuf,
    statements: Vec<String>,
    feeds: u64,
}

impl JobHarness {
    /// A harness whose job lives under `dir` (`$DIR`).
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            statements: Vec::new(),
            feeds: 0,
        }
    }

    fn job_text(&self) -> String {
        self.statements.join("\n")
    }

    /// The job's `CREATE EXTERNAL TABLE` statements so far (the job may
    /// not be complete yet: no `INSERT`).
    fn tables(&self) -> Result<Vec<JobTable>, SltError> {
        let statements = DFParser::parse_sql(&self.job_text()).map_err(fail)?;
        Ok(statements
            .into_iter()
            .filter_map(|s| match s {
                Statement::CreateExternalTable(c) => Some(JobTable {
                    name: c.name.to_string(),
                    format: c.file_type.to_ascii_uppercase(),
                    location: c.locations.first().cloned().unwrap_or_default(),
                    unbounded: c.unbounded,
                }),
                _ => None,
            })
            .collect())
    }

    async fn feed(&mut self, rest: &str) -> Result<DBOutput<DefaultColumnType>, SltError> {
        let (name, lines) = rest.split_once('\n').unwrap_or((rest, ""));
        let name = name.trim().trim_end_matches(';');
        let table = self
            .tables()?
            .into_iter()
            .find(|t| t.name == name)
            .ok_or_else(|| fail(format!("FEED {name}: the job declares no table {name}")))?;
        let ext = match table.format.as_str() {
            "JSON" => "json",
            "CSV" => "csv",
            other => {
                return Err(fail(format!(
                    "FEED {name}: STORED AS {other} cannot be fed lines (JSON or CSV only)"
                )));
            }
        };
        let location = Path::new(&table.location);
        std::fs::create_dir_all(location).map_err(fail)?;
        self.feeds += 1;
        let file = location.join(format!("feed-{:05}.{ext}", self.feeds));
        // Written aside and renamed in, as a producer would: a listing never
        // sees half a file.
        let tmp = self.dir.join(format!(".feed-{:05}.tmp", self.feeds));
        let mut body = lines.trim_end_matches('\n').to_string();
        body.push('\n');
        std::fs::write(&tmp, body).map_err(fail)?;
        std::fs::rename(&tmp, &file).map_err(fail)?;
        Ok(DBOutput::StatementComplete(
            lines.lines().filter(|l| !l.trim().is_empty()).count() as u64,
        ))
    }

    async fn run_job(&mut self, args: &str) -> Result<DBOutput<DefaultColumnType>, SltError> {
        let mut options = JobOptions::new(self.dir.join("checkpoint").display().to_string());
        options.trigger = Trigger::AvailableNow;
        let words: Vec<&str> = args.split_whitespace().collect();
        let mut rest = words.as_slice();
        if let [first, tail @ ..] = rest
            && !first.eq_ignore_ascii_case("CRASH")
        {
            options.trigger = match first.to_ascii_lowercase().as_str() {
                "once" => Trigger::Once,
                "available-now" => Trigger::AvailableNow,
                other => {
                    return Err(fail(format!(
                        "RUN {other}: the harness runs `once` or `available-now`"
                    )));
                }
            };
            rest = tail;
        }
        match rest {
            [] => {}
            [crash, point, batch] if crash.eq_ignore_ascii_case("CRASH") => {
                let point: FailPoint = point.parse().map_err(fail)?;
                let batch: u64 = batch
                    .parse()
                    .map_err(|_| fail(format!("RUN ... CRASH: bad batch id {batch:?}")))?;
                options.fail_point = Some((point, batch));
            }
            _ => {
                return Err(fail(format!(
                    "RUN {args}: expected RUN [once|available-now] [CRASH <point> <batch id>]"
                )));
            }
        }
        let builder = load_job("job.sql", &self.job_text(), &options)
            .await
            .map_err(fail)?;
        let summary = builder.run().await.map_err(fail)?;
        Ok(DBOutput::StatementComplete(summary.batches))
    }

    async fn query(&mut self, sql: &str) -> Result<DBOutput<DefaultColumnType>, SltError> {
        let ctx = SessionContext::new();
        for t in self.tables()?.iter().filter(|t| !t.unbounded) {
            if t.format != "DELTA" {
                continue;
            }
            let location = Location::parse(&t.location, &HashMap::new()).map_err(fail)?;
            // A table the job has not created yet is simply absent: the
            // query then fails naming it.
            if location.local_dir().is_some_and(|d| !d.exists()) {
                continue;
            }
            let Some(table) = load_table(&location).await.map_err(fail)? else {
                continue;
            };
            table
                .update_datafusion_session(&ctx.state())
                .map_err(fail)?;
            let provider = table.table_provider().await.map_err(fail)?;
            ctx.register_table(t.name.as_str(), provider)
                .map_err(fail)?;
        }
        let df = ctx.sql(sql).await.map_err(fail)?;
        let types = df
            .schema()
            .fields()
            .iter()
            .map(|f| column_type(f.data_type()))
            .collect();
        let batches = df.collect().await.map_err(fail)?;
        Ok(DBOutput::Rows {
            types,
            rows: format_rows(&batches)?,
        })
    }
}

/// `I` for integers, `R` for floating point and decimals, `T` for the rest.
fn column_type(t: &DataType) -> DefaultColumnType {
    if t.is_integer() {
        DefaultColumnType::Integer
    } else if t.is_floating() || matches!(t, DataType::Decimal128(..) | DataType::Decimal256(..)) {
        DefaultColumnType::FloatingPoint
    } else {
        DefaultColumnType::Text
    }
}

/// Every value as arrow displays it; `NULL` for nulls, `(empty)` for an
/// empty string (a blank would vanish from the expected output).
fn format_rows(batches: &[RecordBatch]) -> Result<Vec<Vec<String>>, SltError> {
    let options = FormatOptions::default().with_null("NULL");
    let mut rows = Vec::new();
    for batch in batches {
        for row in crate::cells_of(batch, &options).map_err(fail)? {
            rows.push(
                row.into_iter()
                    .map(|v| if v.is_empty() { "(empty)".into() } else { v })
                    .collect(),
            );
        }
    }
    Ok(rows)
}

/// The first word of `sql`, upper-cased, and what follows it.
fn split_verb(sql: &str) -> (String, &str) {
    let sql = sql.trim_start();
    let end = sql
        .find(|c: char| c.is_whitespace() || c == ';')
        .unwrap_or(sql.len());
    (sql[..end].to_ascii_uppercase(), &sql[end..])
}

#[async_trait]
impl AsyncDB for JobHarness {
    type Error = SltError;
    type ColumnType = DefaultColumnType;

    async fn run(&mut self, sql: &str) -> Result<DBOutput<DefaultColumnType>, SltError> {
        let dir = self.dir.display().to_string();
        let sql = sql.replace("$DIR", &dir);
        let (verb, rest) = split_verb(&sql);
        match verb.as_str() {
            "SET" | "CREATE" | "INSERT" => {
                if verb == "INSERT" {
                    self.statements
                        .retain(|s| split_verb(s).0.as_str() != "INSERT");
                }
                self.statements.push(ensure_semicolon(&sql));
                Ok(DBOutput::StatementComplete(0))
            }
            "FEED" => self.feed(rest.trim_start_matches([' ', '\t'])).await,
            "RUN" => self.run_job(rest.trim().trim_end_matches(';')).await,
            _ => self.query(&sql).await,
        }
    }

    async fn shutdown(&mut self) {}

    fn engine_name(&self) -> &str {
        "lakestream"
    }

    async fn sleep(dur: std::time::Duration) {
        tokio::time::sleep(dur).await
    }
}

fn ensure_semicolon(sql: &str) -> String {
    let s = sql.trim_end();
    if s.ends_with(';') {
        s.to_string()
    } else {
        format!("{s};")
    }
}

/// Run the `.slt` file at `path` in a fresh directory under `scratch`.
/// The error names the file, the failing record's line and what differed.
pub async fn run_file(path: &Path, scratch: &Path) -> Result<(), String> {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let dir = scratch.join(stem);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let dir = Arc::new(dir);
    let mut runner = sqllogictest::Runner::new(move || {
        let dir = dir.clone();
        async move { Ok(JobHarness::new(&dir)) }
    });
    runner.with_column_validator(sqllogictest::strict_column_validator);
    runner
        .run_file_async(path)
        .await
        .map_err(|e| format!("{}", e.display(false)))
}
