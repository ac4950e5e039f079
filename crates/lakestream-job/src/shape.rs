//! The streaming-shape check: which queries micro-batches can run, and
//! the one aggregation that runs statefully.

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::logical_expr::{Aggregate, Distinct, Expr, LogicalPlan};

use crate::{Job, Pos, Result};

/// Refuse plans a micro-batch cannot run correctly (see
/// [`streaming_plan_problem`]), naming the position `pos` of the `INSERT`
/// whose query `plan` is. `is_stream` tells whether a table name is a
/// stream.
pub fn check_streaming_plan(
    job: &Job,
    pos: Pos,
    plan: &LogicalPlan,
    is_stream: &dyn Fn(&str) -> bool,
) -> Result<()> {
    match streaming_plan_problem(plan, is_stream) {
        Some(msg) => Err(job.error(pos, msg)),
        None => Ok(()),
    }
}

/// The stateful aggregation of `plan`: an `Aggregate` over a stream with
/// only projections, filters (`HAVING`) and aliases above it.
pub fn stateful_aggregate<'a>(
    plan: &'a LogicalPlan,
    is_stream: &dyn Fn(&str) -> bool,
) -> Option<&'a Aggregate> {
    match below_stateless_top(plan) {
        LogicalPlan::Aggregate(a) if !streams_in(&a.input, is_stream).is_empty() => Some(a),
        _ => None,
    }
}

/// `plan` without the projections, filters and aliases at its top.
fn below_stateless_top(plan: &LogicalPlan) -> &LogicalPlan {
    match plan {
        LogicalPlan::Projection(p) => below_stateless_top(&p.input),
        LogicalPlan::Filter(f) => below_stateless_top(&f.input),
        LogicalPlan::SubqueryAlias(a) => below_stateless_top(&a.input),
        other => other,
    }
}

/// The positions, in `plan`'s output, of the columns that carry the
/// stateful aggregation's group keys (a key itself, or a field of a window
/// key such as `window.start`), one per key: the columns an update-mode
/// output is merged by. `Err` names a key the output does not carry.
pub fn group_key_positions(
    plan: &LogicalPlan,
    is_stream: &dyn Fn(&str) -> bool,
) -> std::result::Result<Vec<usize>, String> {
    let Some(agg) = stateful_aggregate(plan, is_stream) else {
        return Err("the query has no aggregation over a stream".into());
    };
    let mut chain = Vec::new();
    let mut node = plan;
    while !matches!(node, LogicalPlan::Aggregate(_)) {
        chain.push(node);
        node = node.inputs()[0];
    }
    let names: Vec<String> = agg
        .group_expr
        .iter()
        .map(|e| e.schema_name().to_string())
        .collect();
    let mut positions: Vec<Option<usize>> = (0..agg.group_expr.len()).map(Some).collect();
    for node in chain.into_iter().rev() {
        let LogicalPlan::Projection(p) = node else {
            continue; // filters and aliases keep positions
        };
        let input = p.input.schema();
        positions = positions
            .into_iter()
            .map(|pos| {
                let pos = pos?;
                let (q, f) = input.qualified_field(pos);
                let key = datafusion::common::Column::new(q.cloned(), f.name());
                p.expr.iter().position(|e| carries(e, &key))
            })
            .collect();
    }
    positions
        .into_iter()
        .zip(names)
        .map(|(p, name)| {
            p.ok_or_else(|| {
                format!(
                    "the output has no column for the GROUP BY key {name}; update mode merges \
                     each group's row into the table by its keys, so select every key"
                )
            })
        })
        .collect()
}

/// True when `e` is the column `key` or a field of it (`get_field(key, ..)`).
fn carries(e: &Expr, key: &datafusion::common::Column) -> bool {
    match e {
        Expr::Alias(a) => carries(&a.expr, key),
        Expr::Column(c) => c == key,
        Expr::ScalarFunction(f) if f.func.name() == "get_field" => {
            matches!(f.args.first(), Some(Expr::Column(c)) if c == key)
        }
        _ => false,
    }
}

/// The stateful deduplication of `plan`: a `SELECT DISTINCT` or
/// `SELECT DISTINCT ON (...)` over a stream with only projections, filters
/// and aliases above it.
pub fn stateful_distinct<'a>(
    plan: &'a LogicalPlan,
    is_stream: &dyn Fn(&str) -> bool,
) -> Option<&'a LogicalPlan> {
    match below_stateless_top(plan) {
        node @ LogicalPlan::Distinct(d) if !streams_in(d.input(), is_stream).is_empty() => {
            Some(node)
        }
        _ => None,
    }
}

/// True when the stateful deduplication of `plan` is a
/// `SELECT DISTINCT ON (...)`: the first row of each key is kept, whole.
pub fn is_distinct_on(plan: &LogicalPlan, is_stream: &dyn Fn(&str) -> bool) -> bool {
    matches!(
        stateful_distinct(plan, is_stream),
        Some(LogicalPlan::Distinct(Distinct::On(_)))
    )
}

fn streams_in(plan: &LogicalPlan, is_stream: &dyn Fn(&str) -> bool) -> Vec<String> {
    let mut found = Vec::new();
    let _ = plan.apply_with_subqueries(|node| {
        if let LogicalPlan::TableScan(scan) = node
            && is_stream(scan.table_name.table())
        {
            found.push(scan.table_name.table().to_string());
        }
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

/// What makes `plan` unfit for micro-batches, if anything: over a stream,
/// one aggregation (`GROUP BY`, with or without an event-time window) or
/// `SELECT DISTINCT` at the top of the query is run statefully; any other aggregation, a
/// window function, sort, limit, distinct or subquery over a stream, a
/// join of two streams, grouping sets and `DISTINCT` aggregates are
/// refused.
pub fn streaming_plan_problem(
    plan: &LogicalPlan,
    is_stream: &dyn Fn(&str) -> bool,
) -> Option<String> {
    let stateful = stateful_aggregate(plan, is_stream);
    let distinct = stateful_distinct(plan, is_stream);
    if let Some(agg) = stateful {
        let s = streams_in(&agg.input, is_stream).remove(0);
        if agg
            .group_expr
            .iter()
            .any(|e| matches!(e, Expr::GroupingSet(_)))
        {
            return Some(format!(
                "GROUPING SETS, ROLLUP and CUBE over the streaming table {s} are not supported \
                 yet; group by plain columns or a window"
            ));
        }
        let mut distinct = None;
        for e in &agg.aggr_expr {
            let _ = e.apply(|e| {
                if let Expr::AggregateFunction(f) = e
                    && f.params.distinct
                {
                    distinct = Some(f.func.name().to_string());
                    return Ok(TreeNodeRecursion::Stop);
                }
                Ok(TreeNodeRecursion::Continue)
            });
        }
        if let Some(name) = distinct {
            return Some(format!(
                "{name}(DISTINCT ...) over the streaming table {s} is not supported yet: its \
                 state would be every distinct value; use approx_distinct(...) for a count of \
                 distinct values"
            ));
        }
    }
    let mut problem = None;
    // Subqueries in expressions (`IN (SELECT ...)`, scalar subqueries) are
    // visited too: an aggregate over the stream hides there as well.
    let _ = plan.apply_with_subqueries(|node| {
        let what = match node {
            LogicalPlan::Aggregate(a) if stateful.is_some_and(|s| std::ptr::eq(s, a)) => None,
            LogicalPlan::Distinct(_) if distinct.is_some_and(|d| std::ptr::eq(d, node)) => None,
            LogicalPlan::Subquery(_) => Some("a subquery"),
            LogicalPlan::Aggregate(_) => Some(
                "an aggregation (GROUP BY or an aggregate function) other than one at the \
                 top of the query",
            ),
            LogicalPlan::Window(_) => Some("a window function"),
            LogicalPlan::Sort(_) => Some("ORDER BY"),
            LogicalPlan::Limit(_) => Some("LIMIT"),
            LogicalPlan::Distinct(_) => Some("DISTINCT (other than SELECT DISTINCT at the top)"),
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
                     projections, filters, joins with static tables and one GROUP BY at the \
                     top of the query over each micro-batch"
                ));
                return Ok(TreeNodeRecursion::Stop);
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
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    });
    problem
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Pos, parse_job};

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
        assert_eq!(job.inserts.len(), 1);
        assert_eq!(job.inserts[0].target, "out");
        assert_eq!(job.inserts[0].pos.line, 7);
    }

    #[tokio::test]
    async fn a_job_may_insert_into_several_tables_but_each_once() {
        let two = format!(
            "{JOB}CREATE EXTERNAL TABLE big STORED AS DELTA LOCATION 'big/';\n\
             INSERT INTO big SELECT event_id FROM events WHERE amount > 100;\n"
        );
        let job = parse_job("job.sql", &two).await.unwrap();
        let targets: Vec<&str> = job.inserts.iter().map(|i| i.target.as_str()).collect();
        assert_eq!(targets, ["out", "big"]);
        assert_eq!(job.inserts[1].pos.line, 9);

        let twice = format!("{JOB}INSERT INTO OUT SELECT event_id, NULL FROM events;\n");
        let err = parse_job("job.sql", &twice).await.unwrap_err().to_string();
        assert!(
            err.starts_with("job.sql:8:") && err.contains("inserts into OUT twice"),
            "{err}"
        );

        let own = "CREATE UNBOUNDED EXTERNAL TABLE e (a INT) STORED AS JSON LOCATION 'x';\n\
                   INSERT INTO e SELECT a FROM e;";
        let err = parse_job("j.sql", own).await.unwrap_err().to_string();
        assert!(err.contains("cannot read its own output"), "{err}");
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
