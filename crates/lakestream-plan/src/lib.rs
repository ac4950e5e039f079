//! SQL job files: parsing them, and checking a streaming query before any
//! batch runs.
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
//! statements and the one `INSERT`. [`check_streaming_plan`] refuses query
//! shapes that a stateless micro-batch cannot run (an aggregation, sort,
//! limit or window over a stream, a join of two streams). Every error carries
//! the line and column in the job file. This crate does no I/O: the engine
//! registers the tables and runs the plan.

use std::collections::BTreeMap;
use std::fmt;

use datafusion::arrow::datatypes::SchemaRef;
use datafusion::error::DataFusionError;
use datafusion::logical_expr::{DdlStatement, LogicalPlan};
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::{DFParser, Statement};
use datafusion::sql::sqlparser::ast::{self, Spanned};

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

/// Errors of job parsing and checking; each names the file and position.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The job is not valid: syntax, unknown table or column, type error,
    /// unsupported statement or query shape.
    #[error("{file}:{pos}: {message}")]
    Job {
        /// The job file name.
        file: String,
        /// Where in the file.
        pos: Pos,
        /// What is wrong and what to do.
        message: String,
    },
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

/// The job's `INSERT INTO target SELECT ...`.
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
    /// The insert.
    pub insert: InsertDecl,
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

/// Known `OPTIONS` keys that are lakestream's, not DataFusion format options.
const NAMESPACED_PREFIX: &str = "format.";

/// Parse the text of a job file. `file` names it in errors.
pub async fn parse_job(file: &str, text: &str) -> Result<Job> {
    let err = |pos: Pos, message: String| Error::Job {
        file: file.to_string(),
        pos,
        message,
    };
    let statements = DFParser::parse_sql(text).map_err(|e| {
        let msg = e.strip_backtrace();
        err(pos_in_message(&msg).unwrap_or_default(), msg)
    })?;
    let starts = statement_starts(text);
    let ctx = SessionContext::new();
    let mut settings = Vec::new();
    let mut tables = Vec::new();
    let mut insert = None;
    for (i, stmt) in statements.into_iter().enumerate() {
        let pos = starts.get(i).copied().unwrap_or_default();
        match &stmt {
            Statement::CreateExternalTable(c) => {
                let name = c
                    .name
                    .0
                    .last()
                    .map(|p| p.to_string().trim_matches('"').to_string())
                    .unwrap_or_default();
                let plan = ctx
                    .state()
                    .statement_to_plan(stmt.clone())
                    .await
                    .map_err(|e| err(pos_of(&e).unwrap_or(pos), e.strip_backtrace()))?;
                let LogicalPlan::Ddl(DdlStatement::CreateExternalTable(cmd)) = plan else {
                    return Err(err(pos, "expected CREATE EXTERNAL TABLE".into()));
                };
                let schema = (!c.columns.is_empty()).then(|| cmd.schema.inner().clone());
                let options = cmd
                    .options
                    .iter()
                    .map(|(k, v)| {
                        let key = c
                            .options
                            .iter()
                            .find(|(orig, _)| orig.eq_ignore_ascii_case(k))
                            .map(|(orig, _)| orig.to_lowercase())
                            .unwrap_or_else(|| {
                                k.strip_prefix(NAMESPACED_PREFIX).unwrap_or(k).to_string()
                            });
                        (key, v.clone())
                    })
                    .collect();
                if tables
                    .iter()
                    .any(|t: &TableDecl| t.name.eq_ignore_ascii_case(&name))
                {
                    return Err(err(pos, format!("table {name} is declared twice")));
                }
                tables.push(TableDecl {
                    name,
                    format: c.file_type.to_ascii_uppercase(),
                    location: c.locations.first().cloned().unwrap_or_default(),
                    schema,
                    options,
                    unbounded: c.unbounded,
                    partition_cols: c.table_partition_cols.clone(),
                    statement: stmt.clone(),
                    pos,
                });
            }
            Statement::Statement(s) => match s.as_ref() {
                ast::Statement::Insert(ins) => {
                    if insert.is_some() {
                        return Err(err(
                            pos,
                            "a job has exactly one INSERT; split the job into several jobs \
                             with their own checkpoints"
                                .into(),
                        ));
                    }
                    let ast::TableObject::TableName(target) = &ins.table else {
                        return Err(err(pos, "INSERT INTO needs a table name".into()));
                    };
                    let Some(query) = &ins.source else {
                        return Err(err(pos, "INSERT INTO needs a SELECT".into()));
                    };
                    insert = Some(InsertDecl {
                        target: target
                            .0
                            .last()
                            .map(|p| p.to_string().trim_matches('"').to_string())
                            .unwrap_or_default(),
                        columns: ins.columns.iter().map(|c| c.to_string()).collect(),
                        query: Statement::Statement(Box::new(ast::Statement::Query(query.clone()))),
                        pos: span_pos(&query.span()).unwrap_or(pos),
                    });
                }
                ast::Statement::Set(_) => settings.push(stmt.clone()),
                other => {
                    return Err(err(
                        pos,
                        format!(
                            "unsupported statement in a job: {}; a job holds CREATE EXTERNAL \
                             TABLE, SET and one INSERT INTO ... SELECT",
                            first_words(&other.to_string())
                        ),
                    ));
                }
            },
            other => {
                return Err(err(
                    pos,
                    format!(
                        "unsupported statement in a job: {}",
                        first_words(&other.to_string())
                    ),
                ));
            }
        }
    }
    let end = Pos {
        line: text.lines().count().max(1) as u64,
        column: 1,
    };
    let insert = insert.ok_or_else(|| {
        err(
            end,
            "the job has no INSERT INTO <table> SELECT ...: add one naming the output table".into(),
        )
    })?;
    let job = Job {
        file: file.to_string(),
        settings,
        tables,
        insert,
    };
    // Which formats can be the target is the connector registry's to say.
    match job.table(&job.insert.target) {
        Some(_) => {}
        None => {
            return Err(job.error(
                job.insert.pos,
                format!(
                    "INSERT target {} is not declared: add CREATE EXTERNAL TABLE {} STORED AS \
                     DELTA LOCATION '...'",
                    job.insert.target, job.insert.target
                ),
            ));
        }
    }
    if !job.tables.iter().any(|t| t.unbounded) {
        return Err(job.error(
            job.insert.pos,
            "the job reads no stream: declare its input with CREATE UNBOUNDED EXTERNAL TABLE",
        ));
    }
    Ok(job)
}

fn first_words(s: &str) -> String {
    s.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

fn span_pos(span: &datafusion::sql::sqlparser::tokenizer::Span) -> Option<Pos> {
    (span.start.line > 0).then_some(Pos {
        line: span.start.line,
        column: span.start.column,
    })
}

/// The position a DataFusion error points at: its diagnostic's span, or a
/// "Line: L, Column: C" in the message (parser errors).
pub fn pos_of(e: &DataFusionError) -> Option<Pos> {
    if let Some(d) = e.diagnostic()
        && let Some(span) = &d.span
        && span.start.line > 0
    {
        return Some(Pos {
            line: span.start.line,
            column: span.start.column,
        });
    }
    pos_in_message(&e.to_string())
}

fn pos_in_message(msg: &str) -> Option<Pos> {
    let i = msg.find("Line: ")?;
    let rest = &msg[i + 6..];
    let line: u64 = rest
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    let j = rest.find("Column: ")?;
    let column: u64 = rest[j + 8..]
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    Some(Pos { line, column })
}

/// Start positions of the non-empty statements in `text`, skipping
/// whitespace and comments, honouring quotes.
fn statement_starts(text: &str) -> Vec<Pos> {
    let mut starts = Vec::new();
    let (mut line, mut col) = (1u64, 1u64);
    let mut pending = true; // looking for the start of a statement
    let mut chars = text.chars().peekable();
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        let here = Pos { line, column: col };
        let advance = |c: char, line: &mut u64, col: &mut u64| {
            if c == '\n' {
                *line += 1;
                *col = 1;
            } else {
                *col += 1;
            }
        };
        advance(c, &mut line, &mut col);
        if let Some(q) = quote {
            if c == q {
                quote = None;
            }
            continue;
        }
        if c == '-' && chars.peek() == Some(&'-') {
            for c in chars.by_ref() {
                advance(c, &mut line, &mut col);
                if c == '\n' {
                    break;
                }
            }
            continue;
        }
        if c == '/' && chars.peek() == Some(&'*') {
            let mut prev = ' ';
            for c in chars.by_ref() {
                advance(c, &mut line, &mut col);
                if prev == '*' && c == '/' {
                    break;
                }
                prev = c;
            }
            continue;
        }
        if c == ';' {
            pending = true;
            continue;
        }
        if c.is_whitespace() {
            continue;
        }
        if pending {
            starts.push(here);
            pending = false;
        }
        if c == '\'' || c == '"' {
            quote = Some(c);
        }
    }
    starts
}

/// Refuse plans a stateless micro-batch cannot run correctly: aggregation,
/// window, sort, limit or distinct over a streaming table, or a join of two
/// streams. `is_stream` tells whether a table name is a stream.
pub fn check_streaming_plan(
    job: &Job,
    plan: &LogicalPlan,
    is_stream: &dyn Fn(&str) -> bool,
) -> Result<()> {
    match streaming_plan_problem(plan, is_stream) {
        Some(msg) => Err(job.error(job.insert.pos, msg)),
        None => Ok(()),
    }
}

/// What makes `plan` unfit for stateless micro-batches, if anything (see
/// [`check_streaming_plan`]).
pub fn streaming_plan_problem(
    plan: &LogicalPlan,
    is_stream: &dyn Fn(&str) -> bool,
) -> Option<String> {
    fn streams_in(plan: &LogicalPlan, is_stream: &dyn Fn(&str) -> bool) -> Vec<String> {
        let mut found = Vec::new();
        let _ = plan.apply_with_subqueries(|node| {
            if let LogicalPlan::TableScan(scan) = node
                && is_stream(scan.table_name.table())
            {
                found.push(scan.table_name.table().to_string());
            }
            Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
        });
        found
    }
    let mut problem = None;
    // Subqueries in expressions (`IN (SELECT ...)`, scalar subqueries) are
    // visited too: an aggregate over the stream hides there as well.
    let _ = plan.apply_with_subqueries(|node| {
        let what = match node {
            LogicalPlan::Subquery(_) => Some("a subquery"),
            LogicalPlan::Aggregate(_) => Some("an aggregation (GROUP BY or an aggregate function)"),
            LogicalPlan::Window(_) => Some("a window function"),
            LogicalPlan::Sort(_) => Some("ORDER BY"),
            LogicalPlan::Limit(_) => Some("LIMIT"),
            LogicalPlan::Distinct(_) => Some("DISTINCT"),
            LogicalPlan::RecursiveQuery(_) => Some("a recursive query"),
            _ => None,
        };
        if let Some(what) = what {
            let streams: Vec<String> = node
                .inputs()
                .iter()
                .flat_map(|i| streams_in(i, is_stream))
                .collect();
            if let Some(s) = streams.first() {
                problem = Some(format!(
                    "{what} over the streaming table {s} is not supported yet: lakestream runs \
                     stateless queries over each micro-batch (projections, filters, joins with \
                     static tables)"
                ));
                return Ok(datafusion::common::tree_node::TreeNodeRecursion::Stop);
            }
        }
        if let LogicalPlan::Join(j) = node {
            let l = streams_in(&j.left, is_stream);
            let r = streams_in(&j.right, is_stream);
            if let (Some(a), Some(b)) = (l.first(), r.first()) {
                problem = Some(format!(
                    "a join of two streams ({a} and {b}) is not supported yet: join a stream \
                     with static tables only"
                ));
                return Ok(datafusion::common::tree_node::TreeNodeRecursion::Stop);
            }
        }
        Ok(datafusion::common::tree_node::TreeNodeRecursion::Continue)
    });
    problem
}

#[cfg(test)]
mod tests {
    use super::*;

    const JOB: &str = "-- a comment; with a semicolon\n\
CREATE UNBOUNDED EXTERNAL TABLE events (\n  event_id VARCHAR NOT NULL, amount DOUBLE, ts TIMESTAMP\n) STORED AS JSON LOCATION 'in/'\nOPTIONS ('max_files_per_trigger' '2', 'format.has_header' 'true');\n\
CREATE EXTERNAL TABLE out STORED AS DELTA LOCATION 'out/' PARTITIONED BY (day);\n\
INSERT INTO out SELECT event_id, CAST(ts AS DATE) AS day FROM events WHERE amount > 0;\n";

    #[tokio::test]
    async fn a_job_parses_into_tables_and_one_insert() {
        let job = parse_job("job.sql", JOB).await.unwrap();
        assert_eq!(job.tables.len(), 2);
        let ev = job.table("events").unwrap();
        assert!(ev.unbounded);
        assert_eq!(ev.format, "JSON");
        assert_eq!(ev.pos, Pos { line: 2, column: 1 });
        assert_eq!(ev.options.get("max_files_per_trigger").unwrap(), "2");
        assert_eq!(ev.options.get("format.has_header").unwrap(), "true");
        let schema = ev.schema.clone().unwrap();
        assert!(!schema.field_with_name("event_id").unwrap().is_nullable());
        let out = job.table("out").unwrap();
        assert_eq!(out.partition_cols, vec!["day"]);
        assert!(out.schema.is_none());
        assert_eq!(job.insert.target, "out");
        assert_eq!(job.insert.pos.line, 7);
    }

    #[tokio::test]
    async fn syntax_errors_carry_line_and_column() {
        let err = parse_job(
            "bad.sql",
            "CREATE EXTERNAL TABLE t STORED AS DELTA LOCATION 'x';\nINSERT INTO t SELEC 1;",
        )
        .await
        .unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with("bad.sql:2:"), "{msg}");
    }

    #[tokio::test]
    async fn the_target_must_be_a_declared_delta_table() {
        let err = parse_job(
            "j.sql",
            "CREATE UNBOUNDED EXTERNAL TABLE e (a INT) STORED AS JSON LOCATION 'x';\nINSERT INTO nowhere SELECT a FROM e;",
        )
        .await
        .unwrap_err();
        assert!(err.to_string().contains("nowhere is not declared"), "{err}");
    }

    async fn plan_of(sql: &str) -> LogicalPlan {
        use datafusion::arrow::datatypes::{DataType, Field, Schema};
        use datafusion::datasource::MemTable;
        use std::sync::Arc;
        let ctx = datafusion::prelude::SessionContext::new();
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, true)]));
        for t in ["e", "u"] {
            let mem = MemTable::try_new(schema.clone(), vec![vec![]]).unwrap();
            ctx.register_table(t, Arc::new(mem)).unwrap();
        }
        ctx.state().create_logical_plan(sql).await.unwrap()
    }

    #[tokio::test]
    async fn subqueries_over_the_stream_are_refused_and_over_static_tables_allowed() {
        let is_stream = |n: &str| n == "e";
        for sql in [
            "SELECT a FROM e WHERE a > (SELECT avg(a) FROM e)",
            "SELECT a FROM u WHERE a IN (SELECT a FROM e)",
            "SELECT a FROM e WHERE EXISTS (SELECT 1 FROM e AS e2 WHERE e2.a = e.a)",
        ] {
            let problem = streaming_plan_problem(&plan_of(sql).await, &is_stream);
            let problem = problem.unwrap_or_else(|| panic!("not refused: {sql}"));
            assert!(problem.contains("streaming table e"), "{sql}: {problem}");
        }
        for sql in [
            "SELECT a FROM e WHERE a IN (SELECT a FROM u)",
            "SELECT a FROM e WHERE a > (SELECT max(a) FROM u)",
        ] {
            let problem = streaming_plan_problem(&plan_of(sql).await, &is_stream);
            assert_eq!(problem, None, "{sql}");
        }
    }
}
