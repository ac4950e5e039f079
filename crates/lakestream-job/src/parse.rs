//! Parsing a job file into a [`Job`], with the position of every
//! statement.

use datafusion::error::DataFusionError;
use datafusion::logical_expr::{DdlStatement, LogicalPlan};
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::{DFParser, Statement};
use datafusion::sql::sqlparser::ast::{self, Spanned};

use crate::{Error, InsertDecl, Job, Pos, Result, TableDecl};

/// Known `OPTIONS` keys that are lakestream's, not DataFusion format options.
const NAMESPACED_PREFIX: &str = "format.";

/// The session settings lakestream plans with, shared by the job parser's
/// session (which decides the sources' column types) and the engine's
/// (`lakestream_engine::QueryBuilder::new`): `VARCHAR` as `Utf8`, not
/// `Utf8View` (sources decode plain strings and the Delta sink writes them
/// without a cast, which saves CPU on every batch).
pub fn session_config() -> datafusion::prelude::SessionConfig {
    let mut config = datafusion::prelude::SessionConfig::new();
    config.options_mut().sql_parser.map_string_types_to_utf8view = false;
    config
}

/// The columns `columns` declares (`region VARCHAR, id BIGINT NOT NULL`),
/// typed as in a `CREATE EXTERNAL TABLE` column list; `Err` is
/// DataFusion's message.
pub async fn parse_columns(
    columns: &str,
) -> std::result::Result<datafusion::arrow::datatypes::SchemaRef, String> {
    let sql = format!("CREATE EXTERNAL TABLE k ({columns}) STORED AS CSV LOCATION 'k'");
    let mut statements = DFParser::parse_sql(&sql).map_err(|e| e.strip_backtrace())?;
    let (Some(stmt), None) = (statements.pop_front(), statements.pop_front()) else {
        return Err("expected a column list".into());
    };
    let ctx = SessionContext::new_with_config(session_config());
    match ctx
        .state()
        .statement_to_plan(stmt)
        .await
        .map_err(|e| e.strip_backtrace())?
    {
        LogicalPlan::Ddl(DdlStatement::CreateExternalTable(cmd))
            if !cmd.schema.fields().is_empty() =>
        {
            Ok(cmd.schema.inner().clone())
        }
        _ => Err("expected a column list".into()),
    }
}

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
    let ctx = SessionContext::new_with_config(session_config());
    let mut settings = Vec::new();
    let mut tables = Vec::new();
    let mut inserts: Vec<InsertDecl> = Vec::new();
    for (i, stmt) in statements.into_iter().enumerate() {
        let pos = starts.get(i).copied().unwrap_or_default();
        match &stmt {
            Statement::CreateExternalTable(c) => {
                let table = table_decl(&ctx, &stmt, c, pos, &err).await?;
                if tables
                    .iter()
                    .any(|t: &TableDecl| t.name.eq_ignore_ascii_case(&table.name))
                {
                    return Err(err(pos, format!("table {} is declared twice", table.name)));
                }
                tables.push(table);
            }
            Statement::Statement(s) => match s.as_ref() {
                ast::Statement::Insert(ins) => {
                    let insert = insert_decl(ins, pos, &err)?;
                    if inserts
                        .iter()
                        .any(|i| i.target.eq_ignore_ascii_case(&insert.target))
                    {
                        return Err(err(
                            pos,
                            format!(
                                "the job inserts into {} twice: one batch is committed \
                                 to a table once, so the second INSERT would never be \
                                 written; combine them with UNION ALL in one INSERT",
                                insert.target
                            ),
                        ));
                    }
                    inserts.push(insert);
                }
                ast::Statement::Set(_) => settings.push(stmt.clone()),
                other => {
                    return Err(err(
                        pos,
                        format!(
                            "unsupported statement in a job: {}; a job holds CREATE EXTERNAL \
                             TABLE, SET and INSERT INTO ... SELECT",
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
    if inserts.is_empty() {
        return Err(err(
            end,
            "the job has no INSERT INTO <table> SELECT ...: add one naming the output table".into(),
        ));
    }
    let job = Job {
        file: file.to_string(),
        settings,
        tables,
        inserts,
    };
    check_inputs_and_outputs(&job)?;
    Ok(job)
}

/// The declaration a `CREATE [UNBOUNDED] EXTERNAL TABLE` statement `stmt`
/// (`c`, at `pos`) makes, planned by DataFusion for its columns and
/// options.
async fn table_decl(
    ctx: &SessionContext,
    stmt: &Statement,
    c: &datafusion::sql::parser::CreateExternalTable,
    pos: Pos,
    err: &impl Fn(Pos, String) -> Error,
) -> Result<TableDecl> {
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
                .unwrap_or_else(|| k.strip_prefix(NAMESPACED_PREFIX).unwrap_or(k).to_string());
            (key, v.clone())
        })
        .collect();
    Ok(TableDecl {
        name,
        format: c.file_type.to_ascii_uppercase(),
        location: c.locations.first().cloned().unwrap_or_default(),
        schema,
        options,
        unbounded: c.unbounded,
        partition_cols: c.table_partition_cols.clone(),
        statement: stmt.clone(),
        pos,
    })
}

/// The `INSERT INTO target SELECT ...` `ins` at `pos`, its query with
/// window references rewritten.
fn insert_decl(
    ins: &ast::Insert,
    pos: Pos,
    err: &impl Fn(Pos, String) -> Error,
) -> Result<InsertDecl> {
    let ast::TableObject::TableName(target) = &ins.table else {
        return Err(err(pos, "INSERT INTO needs a table name".into()));
    };
    let Some(query) = &ins.source else {
        return Err(err(pos, "INSERT INTO needs a SELECT".into()));
    };
    let mut rewritten = query.clone();
    crate::window::rewrite_window_references(&mut rewritten);
    let target = target
        .0
        .last()
        .map(|p| p.to_string().trim_matches('"').to_string())
        .unwrap_or_default();
    Ok(InsertDecl {
        target,
        columns: ins.columns.iter().map(|c| c.to_string()).collect(),
        query: Statement::Statement(Box::new(ast::Statement::Query(rewritten))),
        pos: span_pos(&query.span()).unwrap_or(pos),
    })
}

/// Each `INSERT` targets a declared table that is not a stream, and the
/// job reads at least one stream. (Which formats can be the target is the
/// connector registry's to say.)
fn check_inputs_and_outputs(job: &Job) -> Result<()> {
    for insert in &job.inserts {
        match job.table(&insert.target) {
            Some(t) if t.unbounded => {
                return Err(job.error(
                    insert.pos,
                    format!(
                        "INSERT target {} is declared UNBOUNDED, as a stream this job reads: \
                         a job cannot read its own output; write to another table, or read \
                         {} in a second job",
                        insert.target, insert.target
                    ),
                ));
            }
            Some(_) => {}
            None => {
                return Err(job.error(
                    insert.pos,
                    format!(
                        "INSERT target {} is not declared: add CREATE EXTERNAL TABLE {} STORED \
                         AS DELTA LOCATION '...'",
                        insert.target, insert.target
                    ),
                ));
            }
        }
    }
    if !job.tables.iter().any(|t| t.unbounded) {
        return Err(job.error(
            job.inserts[0].pos,
            "the job reads no stream: declare its input with CREATE UNBOUNDED EXTERNAL TABLE",
        ));
    }
    Ok(())
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

/// Start positions of the non-empty statements in `text`: the first token
/// after the start and after each `;`, by the SQL tokenizer the parser uses
/// (so comments, quotes and dollar-quoted strings are skipped as it skips
/// them). Empty when the text does not tokenize (then it did not parse
/// either).
fn statement_starts(text: &str) -> Vec<Pos> {
    use datafusion::sql::sqlparser::dialect::GenericDialect;
    use datafusion::sql::sqlparser::tokenizer::{Token, Tokenizer};
    let Ok(tokens) = Tokenizer::new(&GenericDialect {}, text).tokenize_with_location() else {
        return Vec::new();
    };
    let mut starts = Vec::new();
    let mut pending = true;
    for t in tokens {
        match t.token {
            Token::Whitespace(_) | Token::EOF => {}
            Token::SemiColon => pending = true,
            _ if pending => {
                starts.push(Pos {
                    line: t.span.start.line,
                    column: t.span.start.column,
                });
                pending = false;
            }
            _ => {}
        }
    }
    starts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_start_after_comments_and_semicolons_outside_quotes() {
        let text = "-- a job\n/* block; with a semicolon */ SET a = 1;\n\
                    CREATE EXTERNAL TABLE t STORED AS JSON LOCATION 'a;b' ;\n  \
                    INSERT INTO o SELECT \"x;y\" FROM t; ;\n";
        let at = |line, column| Pos { line, column };
        assert_eq!(statement_starts(text), vec![at(2, 31), at(3, 1), at(4, 3)]);
        assert!(statement_starts("  -- only a comment\n").is_empty());
    }
}
