//! Jobs: SQL job files parsed with positions, the streaming-shape check,
//! and what a connector's factory sees of a table declaration.
//!
//! A job is a `.sql` file in DataFusion's dialect:
//!
//! ```sql
//! CREATE UNBOUNDED EXTERNAL TABLE events (...) STORED AS JSON LOCATION 'in/';
//! CREATE EXTERNAL TABLE users STORED AS PARQUET LOCATION 'users.parquet';
//! CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out/' PARTITIONED BY (day);
//! INSERT INTO out SELECT ... FROM events e LEFT JOIN users u ON ...;
//! ```
//!
//! [`parse_job`] turns the text into a [`Job`]: table declarations, `SET`
//! statements and the `INSERT`s (one per output table). [`check_streaming_plan`] refuses query
//! shapes that a stateless micro-batch cannot run (an aggregation, sort,
//! limit or window over a stream, a join of two streams). Every error about
//! the job carries the line and column in the job file.
//! [`connector::TableContext`] gives a connector's factory one declaration
//! with typed, checked options; the engine (`lakestream-engine`) keeps the
//! registry of factories, loads a job through it and runs it.

pub mod connector;
mod parse;
pub mod settings;
mod shape;
mod values;
pub mod window;

pub use parse::{parse_columns, parse_job, pos_of, session_config};
pub use shape::{
    check_streaming_plan, group_key_positions, is_distinct_on, stateful_aggregate,
    stateful_distinct, streaming_plan_problem,
};
pub use values::{MAX_DURATION, parse_duration, parse_size};

use std::collections::BTreeMap;
use std::fmt;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::sql::parser::Statement;

/// A position in a job file, 1-based.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pos {
    /// Line, from 1.
    pub line: u64,
    /// Column, from 1.
    pub column: u64,
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

/// Errors of loading a job: the job itself (each names the file and
/// position), or what a connector met while building a table's source or
/// sink (its own error, kept typed).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The job is not valid: syntax, unknown table or column, type error,
    /// unsupported statement or query shape, a bad option.
    #[error("{file}:{pos}: {message}")]
    Job {
        /// The job file name.
        file: String,
        /// Where in the file.
        pos: Pos,
        /// What is wrong and what to do.
        message: String,
    },
    /// A connector could not build its source or sink (its store failed
    /// while inferring a schema, an invalid client setting): the
    /// connector's own error, kept whole (the engine recovers its type).
    #[error(transparent)]
    Connector(Box<dyn std::error::Error + Send + Sync>),
    /// The checkpoint (where a connector keeps state such as an inferred
    /// schema) failed or is corrupt.
    #[error(transparent)]
    Checkpoint(Box<lakestream_checkpoint::Error>),
    /// A location could not be resolved, or its store failed.
    #[error(transparent)]
    Storage(Box<lakestream_storage::Error>),
}

impl Error {
    /// A connector's own error (a source's or sink's), kept whole.
    pub fn connector(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Error::Connector(Box::new(e))
    }
}

impl From<lakestream_checkpoint::Error> for Error {
    fn from(e: lakestream_checkpoint::Error) -> Self {
        Error::Checkpoint(Box::new(e))
    }
}
impl From<lakestream_storage::Error> for Error {
    fn from(e: lakestream_storage::Error) -> Self {
        Error::Storage(Box::new(e))
    }
}

/// A schema as `name type, ...`, for messages.
pub fn describe_schema(s: &datafusion::arrow::datatypes::Schema) -> String {
    s.fields()
        .iter()
        .map(|f| format!("{} {}", f.name(), f.data_type()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A `CREATE [UNBOUNDED] EXTERNAL TABLE` of the job.
#[derive(Debug, Clone)]
pub struct TableDecl {
    /// Table name as written (unquoted).
    pub name: String,
    /// `STORED AS` value, upper case (`JSON`, `CSV`, `PARQUET`, `DELTA`, ...).
    pub format: String,
    /// `LOCATION` value.
    pub location: String,
    /// Declared columns, `None` when the statement declares none.
    pub schema: Option<SchemaRef>,
    /// `OPTIONS`, keys lower case; keys without a namespace get DataFusion's
    /// `format.` prefix stripped back off, so `'max_files_per_trigger'` is
    /// `max_files_per_trigger` and `'format.has_header'` stays as written.
    pub options: BTreeMap<String, String>,
    /// `UNBOUNDED`: a streaming source.
    pub unbounded: bool,
    /// `PARTITIONED BY` columns.
    pub partition_cols: Vec<String>,
    /// The statement as DataFusion would run it (for static tables).
    pub statement: Statement,
    /// Where the statement starts.
    pub pos: Pos,
}

/// One of the job's `INSERT INTO target SELECT ...` statements.
#[derive(Debug, Clone)]
pub struct InsertDecl {
    /// The target table's name.
    pub target: String,
    /// Column list after the table name, if any.
    pub columns: Vec<String>,
    /// The query, as a statement DataFusion can plan.
    pub query: Statement,
    /// Where the statement starts.
    pub pos: Pos,
}

/// A parsed job file.
#[derive(Debug, Clone)]
pub struct Job {
    /// The file name used in errors.
    pub file: String,
    /// `SET` statements, in order.
    pub settings: Vec<Statement>,
    /// Table declarations, in order.
    pub tables: Vec<TableDecl>,
    /// The inserts, in order (at least one; each into its own table).
    /// Every batch runs each over the same input and commits each to its
    /// table.
    pub inserts: Vec<InsertDecl>,
}

impl Job {
    /// The declaration of table `name` (case-insensitive).
    pub fn table(&self, name: &str) -> Option<&TableDecl> {
        self.tables
            .iter()
            .find(|t| t.name.eq_ignore_ascii_case(name))
    }

    /// An error at `pos` of this job's file.
    pub fn error(&self, pos: Pos, message: impl Into<String>) -> Error {
        Error::Job {
            file: self.file.clone(),
            pos,
            message: message.into(),
        }
    }
}
