//! Planning a query's outputs: the logical plan of each, its columns renamed
//! as the table's, and the stateful aggregation found in it.

use super::*;

/// The logical plan of `query` on `ctx` (SQL is parsed with Spark's window
/// spellings rewritten).
pub(super) async fn plan_query(ctx: &SessionContext, query: QuerySpec) -> Result<LogicalPlan> {
    match query {
        QuerySpec::Plan(p) => Ok(p),
        QuerySpec::Sql(sql) => {
            let state = ctx.state();
            let mut stmt = state
                .sql_to_statement(&sql, &datafusion::config::Dialect::Generic)
                .map_err(|e| Error::Plan(Box::new(e)))?;
            if let datafusion::sql::parser::Statement::Statement(s) = &mut stmt
                && let datafusion::sql::sqlparser::ast::Statement::Query(q) = s.as_mut()
            {
                lakestream_job::window::rewrite_window_references(q);
            }
            state
                .statement_to_plan(stmt)
                .await
                .map_err(|e| Error::Plan(Box::new(e)))
        }
    }
}

/// The stateful aggregation (or deduplication) of the output query
/// `plan`, checked against its output `mode`, if it has one.
pub(super) async fn stateful_of(
    ctx: &SessionContext,
    plan: &LogicalPlan,
    is_stream: &(dyn Fn(&str) -> bool + Sync),
    state_location: &lakestream_storage::Location,
    mode: OutputMode,
    event_times: &BTreeMap<String, EventTime>,
    user_error: &(dyn Fn(String) -> Error + Sync),
) -> Result<Option<StatefulAggregate>> {
    let stateful_logical = lakestream_job::stateful_aggregate(plan, is_stream).is_some()
        || lakestream_job::stateful_distinct(plan, is_stream).is_some();
    if !stateful_logical {
        return Ok(None);
    }
    let output_schema: SchemaRef = Arc::new(plan.schema().as_arrow().clone());
    // The batch plans' shape, from a plan over no input.
    let mut state = ctx.state();
    state
        .config_mut()
        .set_extension(Arc::new(BatchScans::default()));
    let physical = state
        .create_physical_plan(plan)
        .await
        .map_err(|e| Error::Plan(Box::new(e)))?;
    let mut agg = StatefulAggregate::new(
        &physical,
        state_location,
        mode,
        event_times.clone(),
        lakestream_job::is_distinct_on(plan, is_stream),
    )?
    .ok_or_else(|| Error::Internal("the query's aggregation is missing from its plan".into()))?;
    match mode {
        OutputMode::Append if agg.is_dedup() => {}
        _ if agg.is_dedup() => {
            return Err(user_error(
                "a deduplication (SELECT DISTINCT, DISTINCT ON, or GROUP BY without \
                 aggregate functions) writes each row once, when first seen: use output_mode \
                 'append'"
                    .into(),
            ));
        }
        OutputMode::Append if !agg.is_windowed() => {
            return Err(user_error(
                "an aggregation over a stream without an event-time window cannot \
                 run in append mode: its groups never close, so none would ever be \
                 written; group by window(<event time>, '<size>') with the stream's \
                 'event_time' and 'watermark_delay' options set, or set the output \
                 table's OPTIONS ('output_mode' 'update') (changed groups merged by \
                 their keys) or ('output_mode' 'complete') (the whole result each \
                 batch)"
                    .into(),
            ));
        }
        OutputMode::Append if agg.event_times().is_empty() => {
            return Err(user_error(
                "a windowed aggregation in append mode writes a window once the \
                 watermark passes its end, and this query has no watermark: set \
                 OPTIONS ('event_time' '<timestamp column>', 'watermark_delay' \
                 '1 minute') on the stream table"
                    .into(),
            ));
        }
        OutputMode::Append => {}
        OutputMode::Complete => {
            // A table with a change data feed records a complete batch's
            // changed groups as updates by these keys, when it can name them.
            let keys = lakestream_job::group_key_positions(plan, is_stream)
                .ok()
                .map(|ps| {
                    ps.into_iter()
                        .map(|i| output_schema.field(i).name().clone())
                        .collect()
                });
            agg.set_replace_keys(keys);
        }
        OutputMode::Update if agg.is_session() => {
            return Err(user_error(
                "session windows cannot run in update mode: a session's key (its \
                 start) changes as later events extend it, so a merge by keys would \
                 leave the shorter session's row behind; use output_mode 'append' \
                 (each session once, when the watermark passes its end) or \
                 'complete'"
                    .into(),
            ));
        }
        OutputMode::Update => {
            let positions =
                lakestream_job::group_key_positions(plan, is_stream).map_err(user_error)?;
            if positions.is_empty() {
                return Err(user_error(
                    "update mode merges each group into the table by its GROUP BY \
                     keys, and this aggregation has none (one group): use \
                     output_mode 'complete'"
                        .into(),
                ));
            }
            agg.set_keys(
                positions
                    .into_iter()
                    .map(|i| output_schema.field(i).name().clone())
                    .collect(),
            );
        }
    }
    Ok(Some(agg))
}

pub(super) fn rename_output(plan: LogicalPlan, columns: &[String]) -> Result<LogicalPlan> {
    use datafusion::logical_expr::{LogicalPlanBuilder, col};
    let fields = plan.schema().columns();
    if fields.len() != columns.len() {
        return Err(Error::InvalidQuery(format!(
            "the INSERT names {} columns but the query produces {}",
            columns.len(),
            fields.len()
        )));
    }
    let exprs: Vec<_> = fields
        .into_iter()
        .zip(columns)
        .map(|(c, name)| col(c).alias(name))
        .collect();
    LogicalPlanBuilder::from(plan)
        .project(exprs)
        .and_then(|b| b.build())
        .map_err(|e| Error::Plan(Box::new(e)))
}

/// Check each declared event time: its source is a stream of the query and
/// the column a timestamp of it. `err` makes the error at the job's first
/// output.
pub(super) fn check_event_times(
    tables: &[Arc<MicroBatchTable>],
    event_times: &BTreeMap<String, EventTime>,
    err: &(dyn Fn(String) -> Error + Sync),
) -> Result<()> {
    for (source, et) in event_times {
        let Some(t) = tables
            .iter()
            .find(|t| t.source().name().eq_ignore_ascii_case(source))
        else {
            return Err(err(format!(
                "an event time is set for {source}, which is not a stream of this query"
            )));
        };
        let schema = t.source().schema();
        match schema.field_with_name(&et.column).map(|f| f.data_type()) {
            Ok(arrow::datatypes::DataType::Timestamp(_, _)) => {}
            Ok(other) => {
                return Err(err(format!(
                    "the event time column {} of {source} is {other}, not a timestamp; \
                         declare it TIMESTAMP",
                    et.column
                )));
            }
            Err(_) => {
                return Err(err(format!(
                    "the event time column {} is not a column of {source}",
                    et.column
                )));
            }
        }
    }
    Ok(())
}

/// Plan each output: its fingerprint, logical plan (columns renamed as its
/// table's), the streaming-shape check and the aggregation it holds (one
/// in the whole query at most). Outputs writing to the same table are
/// refused.
pub(super) async fn plan_outputs(
    ctx: &SessionContext,
    specs: Vec<Output>,
    job: Option<&lakestream_job::Job>,
    is_stream: &(dyn Fn(&str) -> bool + Sync),
    state_location: &lakestream_storage::Location,
    event_times: &BTreeMap<String, EventTime>,
    user_error: &(dyn Fn(Option<lakestream_job::Pos>, String) -> Error + Sync),
) -> Result<(Vec<OutputPlan>, Option<StatefulAggregate>)> {
    let mut outputs: Vec<OutputPlan> = Vec::new();
    let mut stateful: Option<(usize, StatefulAggregate)> = None;
    for spec in specs {
        let fingerprint = match (&spec.text, &spec.query) {
            (Some(text), _) => crate::lineage::sql_fingerprint(text),
            (None, QuerySpec::Sql(sql)) => crate::lineage::sql_fingerprint(sql),
            (None, QuerySpec::Plan(p)) => {
                crate::lineage::sql_fingerprint(&p.display_indent().to_string())
            }
        };
        let plan = plan_query(ctx, spec.query).await?;
        let plan = if spec.columns.is_empty() {
            plan
        } else {
            rename_output(plan, &spec.columns)?
        };
        match (job, spec.pos) {
            (Some(job), Some(pos)) => {
                lakestream_job::check_streaming_plan(job, pos, &plan, &is_stream)?
            }
            _ => {
                if let Some(problem) = lakestream_job::streaming_plan_problem(&plan, &is_stream) {
                    return Err(Error::InvalidQuery(problem));
                }
            }
        }
        let agg = stateful_of(
            ctx,
            &plan,
            is_stream,
            state_location,
            spec.mode,
            event_times,
            &|msg| user_error(spec.pos, msg),
        )
        .await?;
        let identity = spec.sink.identity();
        if let Some(agg) = agg {
            if stateful.is_some() {
                return Err(user_error(
                    spec.pos,
                    "a query may hold one aggregation or deduplication among its outputs, \
                     and this is the second: write the other from a job of its own (it \
                     may read the first job's table as a stream)"
                        .into(),
                ));
            }
            stateful = Some((outputs.len(), agg));
        }
        if outputs.iter().any(|o| o.identity == identity) {
            return Err(user_error(
                spec.pos,
                format!(
                    "two outputs of the query write to {identity}: each batch is committed \
                     to a table once, so the second would never be written"
                ),
            ));
        }
        outputs.push(OutputPlan {
            kind: OutputKind::Query(plan),
            sink: spec.sink,
            fingerprint,
            identity,
            stateful: false,
        });
    }
    let stateful = stateful.map(|(i, agg)| {
        outputs[i].stateful = true;
        agg
    });
    Ok((outputs, stateful))
}

/// Append a dead-letter output per table the query's sources send their
/// rejected records to (sources sharing one table share one output).
pub(super) fn add_dead_letters(
    outputs: &mut Vec<OutputPlan>,
    dead_letters: Vec<(String, Arc<dyn Sink>)>,
    tables: &[Arc<MicroBatchTable>],
    err: &(dyn Fn(String) -> Error + Sync),
) -> Result<()> {
    let first_dead_letter = outputs.len();
    for (source, sink) in dead_letters {
        let Some(t) = tables
            .iter()
            .find(|t| t.source().name().eq_ignore_ascii_case(&source))
        else {
            return Err(err(format!(
                "dead letters are set for {source}, which is not a stream of this query"
            )));
        };
        let name = t.source().name().to_string();
        let identity = sink.identity();
        if let Some(o) = outputs[first_dead_letter..]
            .iter_mut()
            .find(|o| o.identity == identity)
        {
            // Several sources may share one dead-letter table.
            if let OutputKind::DeadLetters(names) = &mut o.kind {
                names.push(name);
            }
            continue;
        }
        if outputs.iter().any(|o| o.identity == identity) {
            return Err(err(format!(
                "the dead letters of {name} go to {identity}, an output of the query: \
                     give them a table of their own"
            )));
        }
        outputs.push(OutputPlan {
            kind: OutputKind::DeadLetters(vec![name]),
            sink,
            fingerprint: crate::lineage::sql_fingerprint("dead letters"),
            identity,
            stateful: false,
        });
    }
    Ok(())
}
