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
