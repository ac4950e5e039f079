//! Spark's spelling of event-time windows in SQL.
//!
//! Spark SQL names the group `window(ts, '1 minute')` `window`, so users
//! write `SELECT window.start, count(*) ... GROUP BY window(ts, '1 minute')`.
//! DataFusion would read `window.start` as column `start` of a table
//! `window`; [`rewrite_window_references`] rewrites such references into
//! field accesses on the grouping expression before the query is planned:
//! `window.start` becomes `get_field(window(ts, '1 minute'), 'start')`
//! (named `start`, as Spark names it) and a bare `window` the expression
//! itself (named `window`).

use std::ops::ControlFlow;

use datafusion::sql::sqlparser::ast::{
    self, Expr, GroupByExpr, Ident, Query, SelectItem, SetExpr, TableFactor, visit_expressions_mut,
};
use datafusion::sql::sqlparser::dialect::GenericDialect;
use datafusion::sql::sqlparser::parser::Parser;

/// The names of the grouping functions whose result may be referred to by
/// the function's name.
pub const WINDOW_FUNCTIONS: [&str; 2] = ["window", "session_window"];

/// Rewrite `window.<field>` and `window` in every `SELECT` of `query` that
/// groups by a window function (see the module docs).
pub fn rewrite_window_references(query: &mut Query) {
    rewrite_set_expr(&mut query.body);
}

fn rewrite_set_expr(body: &mut SetExpr) {
    match body {
        SetExpr::Select(select) => {
            for t in &mut select.from {
                rewrite_factor(&mut t.relation);
                for j in &mut t.joins {
                    rewrite_factor(&mut j.relation);
                }
            }
            let GroupByExpr::Expressions(groups, _) = &select.group_by else {
                return;
            };
            // A sliding window puts a row in several windows: the rows are
            // repeated, one per window, below the aggregation.
            let sliding = groups.iter().position(is_sliding_window).and_then(|i| {
                let [only] = select.from.as_slice() else {
                    return None;
                };
                if !only.joins.is_empty() {
                    return None;
                }
                Some((i, sliding_source(&only.relation, &groups[i])?))
            });
            if let Some((i, from)) = sliding {
                select.from[0].relation = from;
                let window = Expr::Identifier(Ident::new(SLIDING_COLUMN));
                if let GroupByExpr::Expressions(groups, _) = &mut select.group_by {
                    groups[i] = window.clone();
                }
                rewrite_references(select, "window", &window);
                return;
            }
            let windows: Vec<(String, Expr)> = groups
                .iter()
                .filter_map(|g| match g {
                    Expr::Function(f) => {
                        let name = f.name.to_string().to_ascii_lowercase();
                        WINDOW_FUNCTIONS
                            .contains(&name.as_str())
                            .then(|| (name, g.clone()))
                    }
                    _ => None,
                })
                .collect();
            let [(name, window)] = windows.as_slice() else {
                return;
            };
            let (name, window) = (name.clone(), window.clone());
            rewrite_references(select, &name, &window);
        }
        SetExpr::Query(q) => rewrite_window_references(q),
        SetExpr::SetOperation { left, right, .. } => {
            rewrite_set_expr(left);
            rewrite_set_expr(right);
        }
        _ => {}
    }
}

/// The column a sliding window's rows carry their window in.
pub const SLIDING_COLUMN: &str = "__lakestream_window";

/// `window(ts, size, slide)` with a slide other than its size.
fn is_sliding_window(e: &Expr) -> bool {
    let Expr::Function(f) = e else { return false };
    if !f.name.to_string().eq_ignore_ascii_case("window") {
        return false;
    }
    let text = e.to_string();
    let quoted: Vec<&str> = text.split('\'').skip(1).step_by(2).collect();
    match quoted.as_slice() {
        [.., size, slide] if quoted.len() >= 2 => {
            let (a, b) = (crate::parse_duration(size), crate::parse_duration(slide));
            a.is_some() && b.is_some() && a != b
        }
        _ => false,
    }
}

/// `(SELECT *, unnest(sliding_windows(ts, size, slide)) AS
/// __lakestream_window FROM t [AS a]) AS a`: the table `relation` with one
/// row per window of each row, under the same name.
fn sliding_source(relation: &TableFactor, window: &Expr) -> Option<TableFactor> {
    let TableFactor::Table { name, alias, .. } = relation else {
        return None;
    };
    let visible = match alias {
        Some(a) => a.name.to_string(),
        None => name.0.last()?.to_string(),
    };
    let call = window.to_string();
    let args = &call[call.find('(')?..];
    let text = format!(
        "(SELECT *, unnest(sliding_windows{args}) AS {SLIDING_COLUMN} FROM {relation}) AS {visible}"
    );
    Parser::new(&GenericDialect {})
        .try_with_sql(&text)
        .and_then(|mut p| p.parse_table_factor())
        .ok()
}

/// Rewrite `name.<field>` and `name` in the projection and `HAVING` of
/// `select` into accesses of `window`.
fn rewrite_references(select: &mut ast::Select, name: &str, window: &Expr) {
    {
        {
            for item in &mut select.projection {
                if let SelectItem::UnnamedExpr(e) = item
                    && let Some(alias) = implicit_name(e, name)
                {
                    *item = SelectItem::ExprWithAlias {
                        expr: e.clone(),
                        alias: Ident::new(alias),
                    };
                }
                let _ = visit_expressions_mut(item, |e| {
                    replace(e, name, window);
                    ControlFlow::<()>::Continue(())
                });
            }
            if let Some(having) = &mut select.having {
                let _ = visit_expressions_mut(having, |e| {
                    replace(e, name, window);
                    ControlFlow::<()>::Continue(())
                });
            }
        }
    }
}

fn rewrite_factor(f: &mut TableFactor) {
    match f {
        TableFactor::Derived { subquery, .. } => rewrite_window_references(subquery),
        TableFactor::NestedJoin {
            table_with_joins, ..
        } => {
            rewrite_factor(&mut table_with_joins.relation);
            for j in &mut table_with_joins.joins {
                rewrite_factor(&mut j.relation);
            }
        }
        _ => {}
    }
}

/// The column name Spark gives `e` when it is `window` or `window.<field>`.
fn implicit_name(e: &Expr, name: &str) -> Option<String> {
    match e {
        Expr::Identifier(id) if is(id, name) => Some(id.value.clone()),
        Expr::CompoundIdentifier(parts) if parts.len() == 2 && is(&parts[0], name) => {
            Some(parts[1].value.clone())
        }
        _ => None,
    }
}

fn is(id: &Ident, name: &str) -> bool {
    id.quote_style.is_none() && id.value.eq_ignore_ascii_case(name)
}

fn replace(e: &mut Expr, name: &str, window: &Expr) {
    match e {
        Expr::Identifier(id) if is(id, name) => *e = window.clone(),
        Expr::CompoundIdentifier(parts) if parts.len() >= 2 && is(&parts[0], name) => {
            let mut text = window.to_string();
            for field in &parts[1..] {
                text = format!("get_field({text}, '{}')", field.value.replace('\'', "''"));
            }
            if let Ok(parsed) = Parser::new(&GenericDialect {})
                .try_with_sql(&text)
                .and_then(|mut p| p.parse_expr())
            {
                *e = parsed;
            }
        }
        _ => {}
    }
}

/// True when `f` (a function name as written) is one of
/// [`WINDOW_FUNCTIONS`].
pub fn is_window_function(f: &ast::ObjectName) -> bool {
    let name = f.to_string().to_ascii_lowercase();
    WINDOW_FUNCTIONS.contains(&name.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewritten(sql: &str) -> String {
        let mut stmts = Parser::parse_sql(&GenericDialect {}, sql).unwrap();
        let ast::Statement::Query(q) = &mut stmts[0] else {
            panic!("not a query")
        };
        rewrite_window_references(q);
        q.to_string()
    }

    #[test]
    fn window_fields_become_field_accesses_named_as_spark_names_them() {
        assert_eq!(
            rewritten(
                "SELECT window.start AS minute, window.end, window, k, count(*) FROM e \
                 GROUP BY window(ts, '1 minute'), k HAVING window.start > 0"
            ),
            "SELECT get_field(window(ts, '1 minute'), 'start') AS minute, \
             get_field(window(ts, '1 minute'), 'end') AS end, \
             window(ts, '1 minute') AS window, k, count(*) FROM e \
             GROUP BY window(ts, '1 minute'), k \
             HAVING get_field(window(ts, '1 minute'), 'start') > 0"
        );
    }

    #[test]
    fn queries_without_a_window_group_are_left_alone() {
        let sql = "SELECT window.start, count(*) FROM e GROUP BY k";
        assert_eq!(rewritten(sql), sql);
        let sql = "SELECT \"window\".start FROM e";
        assert_eq!(rewritten(sql), sql);
    }

    #[test]
    fn subqueries_in_from_are_rewritten() {
        assert_eq!(
            rewritten(
                "SELECT * FROM (SELECT window.start, sum(x) AS s FROM e \
                 GROUP BY window(ts, '5 minutes')) AS t"
            ),
            "SELECT * FROM (SELECT get_field(window(ts, '5 minutes'), 'start') AS start, \
             sum(x) AS s FROM e GROUP BY window(ts, '5 minutes')) AS t"
        );
    }
}
