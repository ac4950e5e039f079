//! The streaming-shape check: which queries a stateless micro-batch can
//! run.

use datafusion::logical_expr::LogicalPlan;

use crate::{Job, Result};

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
