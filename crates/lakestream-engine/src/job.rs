//! Loading a SQL job file into a [`QueryBuilder`]; the job file's types
//! and checks from `lakestream-job` are re-exported here.
//!
//! Tables declared `UNBOUNDED` become sources and each `INSERT` target an
//! output's sink, each through the connector registry
//! ([`crate::connectors`]); other tables are static and loaded once at job
//! start.
//! Every option is checked here, before any batch runs; an unknown option is
//! an error (a typo must not silently change a job's meaning).

use std::collections::HashMap;

use arrow::datatypes::{Field, Schema};
use lakestream_delta::delta_schema;
pub use lakestream_job::{
    Error as JobError, InsertDecl, Job, Pos, TableDecl, check_streaming_plan, parse_job, pos_of,
    streaming_plan_problem,
};
use lakestream_storage::{StoreRegistry, normalize_option_key};

use crate::connectors::{Connectors, RunStorage};
use crate::{Error, FailPoint, Output, OutputMode, QueryBuilder, Result, Trigger};
use lakestream_sink::describe_schema;

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
    /// The connectors the job's `STORED AS` names are looked up in
    /// (default: the built-in ones).
    pub connectors: Connectors,
    /// Write the `INSERT` target at this location instead of the one the
    /// job declares (a scratch copy of a job's output, as `chaos` makes);
    /// a job with several `INSERT`s writes each target in a directory of
    /// this location named after the table.
    pub output_location: Option<String>,
    /// The stores the embedding program serves some buckets with, for
    /// every location of the job and its checkpoint (default: none, each
    /// location gets a store built from its URL and storage options).
    pub object_stores: StoreRegistry,
}

impl JobOptions {
    /// Options for a job checkpointed at `checkpoint`: run continuously,
    /// no extra storage options, the built-in connectors.
    pub fn new(checkpoint: impl Into<String>) -> Self {
        Self {
            checkpoint: checkpoint.into(),
            trigger: Trigger::default(),
            storage_options: HashMap::new(),
            fail_point: None,
            connectors: Connectors::builtin(),
            output_location: None,
            object_stores: StoreRegistry::default(),
        }
    }
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
            .field("connectors", &self.connectors)
            .field("output_location", &self.output_location)
            .field("object_stores", &self.object_stores)
            .finish()
    }
}

/// Parse the job in `text` (named `file` in errors) and build its query:
/// one output per `INSERT`, all over the same batches.
pub async fn load_job(file: &str, text: &str, options: &JobOptions) -> Result<QueryBuilder> {
    let mut job = parse_job(file, text).await?;
    if let Some(location) = &options.output_location {
        // One output: written at the location; several: each in a
        // directory of it named after its table.
        let several = job.inserts.len() > 1;
        let targets: Vec<String> = job.inserts.iter().map(|i| i.target.clone()).collect();
        for t in job.tables.iter_mut() {
            if targets.iter().any(|n| t.name.eq_ignore_ascii_case(n)) {
                t.location = if several {
                    format!("{}/{}", location.trim_end_matches('/'), t.name)
                } else {
                    location.clone()
                };
            }
        }
    }
    // `SET aws.endpoint = '...'` (and google.*, azure.*) are storage options
    // of every location in the job; options given to the run win.
    let (storage, settings) = job_storage_options(&job, &options.storage_options);
    let options = &JobOptions {
        storage_options: storage,
        ..options.clone()
    };
    let run = RunStorage {
        checkpoint: options.checkpoint.clone(),
        options: options.storage_options.clone(),
        object_stores: options.object_stores.clone(),
    };
    let mut builder = QueryBuilder::new()
        .checkpoint(options.checkpoint.clone())
        .checkpoint_options(options.storage_options.clone())
        .object_stores(options.object_stores.clone())
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
            .map_err(|e| Error::Plan(Box::new(e)))?;
        ctx.execute_logical_plan(plan)
            .await
            .map_err(|e| Error::Plan(Box::new(e)))?;
    }
    // The sinks first: a job whose target no connector can write is
    // refused before any source touches the checkpoint (an inferred schema
    // is stored there).
    let mut sinks = Vec::new();
    for insert in &job.inserts {
        let target = job.table(&insert.target).expect("checked by parse_job");
        sinks.push(options.connectors.sink(&job, target, &run).await?);
    }
    let is_target = |t: &TableDecl| {
        job.inserts
            .iter()
            .any(|i| t.name.eq_ignore_ascii_case(&i.target))
    };
    for t in &job.tables {
        if is_target(t) {
            continue;
        }
        if t.unbounded {
            let source = options.connectors.source(&job, t, &run).await?;
            builder = builder.source(source)?;
            builder = event_time(&job, t, builder)?;
            if let Some(location) = t.options.get("dead_letter_location") {
                // Under a scratch output location, the dead letters too.
                let location = match &options.output_location {
                    Some(out) => format!("{}/_dead_letters_{}", out.trim_end_matches('/'), t.name),
                    None => location.clone(),
                };
                let sink = options
                    .connectors
                    .dead_letter_sink(&job, t, &location, &run)
                    .await
                    .map_err(|e| {
                        job.error(
                            t.pos,
                            format!("dead_letter_location {location:?} of {}: {e}", t.name),
                        )
                    })?;
                builder = builder.dead_letters(&t.name, sink);
            }
        } else {
            builder = options
                .connectors
                .add_static(&job, t, &run, builder)
                .await?;
        }
    }
    let mut first = None;
    for (insert, sink) in job.inserts.iter().zip(sinks) {
        let target = job.table(&insert.target).expect("checked by parse_job");
        let plan = builder
            .context()
            .state()
            .statement_to_plan(insert.query.clone())
            .await
            .map_err(|e| job.error(pos_of(&e).unwrap_or(insert.pos), e.strip_backtrace()))?;
        check_declared_schema(&job, insert, target, &plan)?;
        let mode = match target.options.get("output_mode") {
            Some(mode) => OutputMode::parse(mode).ok_or_else(|| {
                job.error(
                    target.pos,
                    format!(
                        "option output_mode of {}: {mode:?} is not an output mode; use \
                         'append', 'update' or 'complete'",
                        target.name
                    ),
                )
            })?,
            None => OutputMode::default(),
        };
        if first.is_none() {
            first = Some((plan, sink, mode, insert.columns.clone()));
        } else {
            builder = builder.output(
                Output::plan(plan, sink)
                    .output_columns(insert.columns.clone())
                    .output_mode(mode)
                    .declared_at(insert.pos, insert.query.to_string()),
            );
        }
    }
    let (plan, sink, mode, columns) = first.expect("a job has an INSERT");
    Ok(builder
        .output_mode(mode)
        .output_columns(columns)
        .logical_plan(plan)
        .sink(sink)
        .with_job(job))
}

/// Refuse an `INSERT` whose query's columns differ from those its target
/// declares.
fn check_declared_schema(
    job: &Job,
    insert: &InsertDecl,
    target: &TableDecl,
    plan: &datafusion::logical_expr::LogicalPlan,
) -> Result<()> {
    let Some(declared) = &target.schema else {
        return Ok(());
    };
    let out: Schema = plan.schema().as_arrow().clone();
    let out = if insert.columns.is_empty() {
        out
    } else {
        Schema::new(
            out.fields()
                .iter()
                .zip(&insert.columns)
                .map(|(f, n)| Field::new(n, f.data_type().clone(), true))
                .collect::<Vec<_>>(),
        )
    };
    let (a, b) = (delta_schema(declared), delta_schema(&out));
    if a != b {
        return Err(job
            .error(
                insert.pos,
                format!(
                    "the query produces ({}) but {} declares ({})",
                    describe_schema(&b),
                    target.name,
                    describe_schema(&a)
                ),
            )
            .into());
    }
    Ok(())
}

/// The stream table `t`'s event time, from its `event_time` and
/// `watermark_delay` options (both or neither).
fn event_time(job: &Job, t: &TableDecl, builder: QueryBuilder) -> Result<QueryBuilder> {
    let column = t.options.get("event_time");
    let delay = t.options.get("watermark_delay");
    let err = |msg: String| -> Error { job.error(t.pos, msg).into() };
    match (column, delay) {
        (None, None) => Ok(builder),
        (Some(column), Some(delay)) => {
            let delay = crate::parse_duration(delay).ok_or_else(|| {
                err(format!(
                    "option watermark_delay of {}: {delay:?} is not a duration; use '10 seconds', \
                     '1 minute', '2 hours'",
                    t.name
                ))
            })?;
            Ok(builder.event_time(&t.name, column, delay))
        }
        (Some(_), None) => Err(err(format!(
            "{} sets 'event_time' without 'watermark_delay': say how late rows may arrive, \
             e.g. 'watermark_delay' '1 minute' ('0s' for none)",
            t.name
        ))),
        (None, Some(_)) => Err(err(format!(
            "{} sets 'watermark_delay' without 'event_time': name its timestamp column, \
             e.g. 'event_time' 'ts'",
            t.name
        ))),
    }
}

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
        match storage_setting(stmt) {
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

/// `SET aws.region = 'eu-west-1'` (or `TO`, `SESSION`, `LOCAL`) as
/// `("aws.region", "eu-west-1")` when the key names a storage option
/// (`aws.`, `google.`, `azure.`), read from the statement's syntax tree.
fn storage_setting(stmt: &datafusion::sql::parser::Statement) -> Option<(String, String)> {
    use datafusion::sql::sqlparser::ast::{Expr, Set, Statement, Value};
    let datafusion::sql::parser::Statement::Statement(s) = stmt else {
        return None;
    };
    let Statement::Set(Set::SingleAssignment {
        hivevar: false,
        variable,
        values,
        ..
    }) = s.as_ref()
    else {
        return None;
    };
    let key = variable
        .0
        .iter()
        .map(|part| {
            part.as_ident()
                .map_or_else(|| part.to_string(), |i| i.value.clone())
        })
        .collect::<Vec<_>>()
        .join(".")
        .to_ascii_lowercase();
    if !["aws.", "google.", "azure."]
        .iter()
        .any(|p| key.starts_with(p))
    {
        return None;
    }
    let [value] = values.as_slice() else {
        return None;
    };
    let value = match value {
        Expr::Value(v) => match &v.value {
            Value::SingleQuotedString(s) | Value::DoubleQuotedString(s) => s.clone(),
            other => other.to_string(),
        },
        Expr::Identifier(i) => i.value.clone(),
        other => other.to_string(),
    };
    Some((key, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_settings_are_taken_from_set_statements() {
        let setting = |sql: &str| {
            let mut stmts = datafusion::sql::parser::DFParser::parse_sql(sql).unwrap();
            storage_setting(&stmts.pop_front().unwrap())
        };
        assert_eq!(
            setting("SET aws.endpoint = 'http://127.0.0.1:9000'"),
            Some(("aws.endpoint".into(), "http://127.0.0.1:9000".into()))
        );
        assert_eq!(
            setting("SET AWS.Region TO 'eu-west-1'"),
            Some(("aws.region".into(), "eu-west-1".into()))
        );
        assert_eq!(
            setting("SET aws.secret_access_key = 'it''s'"),
            Some(("aws.secret_access_key".into(), "it's".into()))
        );
        assert_eq!(
            setting("SET SESSION google.service_account = \"/k.json\""),
            Some(("google.service_account".into(), "/k.json".into()))
        );
        assert_eq!(setting("SET datafusion.execution.batch_size = 1024"), None);
    }

    #[tokio::test]
    async fn run_options_override_set_statements_whatever_the_spelling() {
        let job = parse_job(
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
}
