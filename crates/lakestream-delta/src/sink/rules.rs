//! The rules a Delta table sets for its rows, applied to every row the sink
//! writes: NOT NULL columns, column invariants (`delta.invariants`), CHECK
//! constraints (`delta.constraints.<name>`) and generated columns
//! (`delta.generationExpression`).
//!
//! The expressions are Spark SQL in the table's metadata; they are parsed
//! and evaluated by DataFusion against the columns written. An expression
//! DataFusion cannot plan refuses the table when the sink opens, naming
//! it: a rule that cannot be checked is never skipped.
//!
//! Semantics follow Delta's writers: a row breaks a CHECK constraint or an
//! invariant when its expression is false or NULL; a generated column the
//! query leaves out is computed from its expression (cast to the column's
//! type); one the query supplies must equal it, NULLs equal
//! (`col <=> expr`). A row that breaks a rule is not written: it is handed
//! back as a [`Violation`] naming the first rule it breaks, in the order
//! NOT NULL, generated columns, invariants, CHECK constraints (by name).

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, BooleanArray};
use arrow::compute::kernels::cmp::not_distinct;
use arrow::compute::{and, and_not, filter_record_batch, is_not_null};
use buoyant_kernel::schema::{ColumnMetadataKey, MetadataValue, StructType};
use datafusion::common::DFSchema;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::prelude::{SessionConfig, SessionContext};

use super::*;
use lakestream_sink::{RuleKind, Violation};

/// One rule, compiled against the written columns.
#[derive(Debug)]
struct Rule {
    kind: RuleKind,
    name: String,
    sql: String,
    /// The column the rule governs (NOT NULL, generated columns).
    column: Option<usize>,
    /// Evaluates to the rule's value per row (a boolean for checks and
    /// invariants, the column's value for generated columns); `None` for
    /// NOT NULL.
    expr: Option<Arc<dyn PhysicalExpr>>,
}

/// A table's rules, compiled against the columns the sink writes.
#[derive(Debug, Default)]
pub(super) struct TableRules {
    table: String,
    /// Generated columns the query leaves out, computed by the sink.
    computed: Vec<Rule>,
    /// Rules every row must keep, in the order a row's first broken one
    /// is named.
    checks: Vec<Rule>,
}

impl TableRules {
    /// The rules of a table with `schema` (its Delta schema, with column
    /// metadata) and `configuration`, over the written columns `written`
    /// (the table's, in its order, then any new ones), for a query that
    /// produces the columns `produced`. `None` when the table has none.
    pub(super) fn compile(
        table: &str,
        schema: &StructType,
        configuration: &HashMap<String, String>,
        written: &SchemaRef,
        produced: &[String],
    ) -> Result<Option<TableRules>> {
        let refuse = |name: &str, sql: &str, why: String| Error::UnsupportedFeature {
            table: table.to_string(),
            feature: name.to_string(),
            reason: format!(
                "lakestream cannot evaluate its expression `{sql}` ({why}), and will not write \
                 rows it cannot check; write to another table, or change the expression"
            ),
        };
        let mut config = SessionConfig::new();
        // Column names keep their case, as the table spells them.
        config.options_mut().sql_parser.enable_ident_normalization = false;
        let ctx = SessionContext::new_with_config(config);
        let df_schema =
            DFSchema::try_from(written.as_ref().clone()).map_err(|e| Error::InvalidConfig {
                table: table.to_string(),
                reason: format!("the table's columns cannot be planned: {e}"),
            })?;
        let compile = |name: &str, sql: &str| -> Result<Arc<dyn PhysicalExpr>> {
            let expr = ctx
                .parse_sql_expr(sql, &df_schema)
                .map_err(|e| refuse(name, sql, e.strip_backtrace()))?;
            ctx.create_physical_expr(expr, &df_schema)
                .map_err(|e| refuse(name, sql, e.strip_backtrace()))
        };
        let mut rules = TableRules {
            table: table.to_string(),
            ..Default::default()
        };
        let mut generated = Vec::new();
        let mut invariants = Vec::new();
        for field in schema.fields() {
            let Ok(column) = written.index_of(field.name()) else {
                continue;
            };
            if !field.is_nullable() {
                rules.checks.push(Rule {
                    kind: RuleKind::NotNull,
                    name: field.name().to_string(),
                    sql: format!("{} IS NOT NULL", field.name()),
                    column: Some(column),
                    expr: None,
                });
            }
            if let Some(MetadataValue::String(sql)) =
                field.get_config_value(&ColumnMetadataKey::GenerationExpression)
            {
                let feature = format!("generatedColumns (column {})", field.name());
                let expr = compile(&feature, sql)?;
                let rule = Rule {
                    kind: RuleKind::Generated,
                    name: field.name().to_string(),
                    sql: sql.clone(),
                    column: Some(column),
                    expr: Some(expr),
                };
                if produced.iter().any(|p| p == field.name()) {
                    generated.push(rule);
                } else {
                    rules.computed.push(rule);
                }
            }
            if let Some(value) = field.get_config_value(&ColumnMetadataKey::Invariants) {
                let sql = invariant_sql(value).ok_or_else(|| Error::UnsupportedFeature {
                    table: table.to_string(),
                    feature: format!("invariants (column {})", field.name()),
                    reason: format!(
                        "its delta.invariants metadata ({value}) is not the protocol's \
                         {{\"expression\": {{\"expression\": ...}}}}; write to another table"
                    ),
                })?;
                let feature = format!("invariants (column {})", field.name());
                invariants.push(Rule {
                    kind: RuleKind::Invariant,
                    name: field.name().to_string(),
                    expr: Some(compile(&feature, &sql)?),
                    sql,
                    column: Some(column),
                });
            }
        }
        rules.checks.extend(generated);
        rules.checks.extend(invariants);
        let mut constraints: Vec<(&str, &String)> = configuration
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("delta.constraints.")?, v)))
            .collect();
        constraints.sort();
        for (name, sql) in constraints {
            let feature = format!("checkConstraints (constraint {name})");
            rules.checks.push(Rule {
                kind: RuleKind::Check,
                name: name.to_string(),
                expr: Some(compile(&feature, sql)?),
                sql: sql.clone(),
                column: None,
            });
        }
        Ok((!rules.computed.is_empty() || !rules.checks.is_empty()).then_some(rules))
    }

    /// The generated columns the sink computes (the query leaves them out).
    #[cfg(test)]
    fn computed_columns(&self) -> impl Iterator<Item = &str> {
        self.computed.iter().map(|r| r.name.as_str())
    }

    /// Fill the computed generated columns of `batch` (the written
    /// columns, those NULL), then split it into the rows that keep every
    /// rule and those that break one.
    pub(super) fn apply(
        &self,
        batch: RecordBatch,
    ) -> Result<(RecordBatch, Vec<Violation>), String> {
        let n = batch.num_rows();
        let batch = if self.computed.is_empty() {
            batch
        } else {
            let mut columns = batch.columns().to_vec();
            for rule in &self.computed {
                let (Some(i), Some(expr)) = (rule.column, &rule.expr) else {
                    continue;
                };
                let value = evaluate(expr, &batch)
                    .map_err(|e| format!("generated column {}: {e}", rule.name))?;
                let to = batch.schema().field(i).data_type().clone();
                columns[i] = arrow::compute::cast(&value, &to).map_err(|e| {
                    format!(
                        "generated column {} ({}) cannot be cast to {to}: {e}",
                        rule.name, rule.sql
                    )
                })?;
            }
            RecordBatch::try_new(batch.schema(), columns).map_err(|e| e.to_string())?
        };
        let mut keep: Option<BooleanArray> = None;
        let mut violations = Vec::new();
        for rule in &self.checks {
            let ok = self
                .holds(rule, &batch)
                .map_err(|e| format!("{} {}: {e}", rule.kind, rule.name))?;
            // Rows that break this rule and kept every earlier one.
            let broken = match &keep {
                Some(k) => and_not(k, &ok),
                None => arrow::compute::not(&ok),
            }
            .map_err(|e| e.to_string())?;
            if broken.true_count() > 0 {
                violations.push(Violation {
                    table: self.table.clone(),
                    kind: rule.kind,
                    name: rule.name.clone(),
                    expression: rule.sql.clone(),
                    rows: filter_record_batch(&batch, &broken).map_err(|e| e.to_string())?,
                });
                keep = Some(
                    match &keep {
                        Some(k) => and(k, &ok),
                        None => Ok(ok),
                    }
                    .map_err(|e| e.to_string())?,
                );
            }
        }
        let good = match keep {
            Some(k) if k.true_count() < n => {
                filter_record_batch(&batch, &k).map_err(|e| e.to_string())?
            }
            _ => batch,
        };
        Ok((good, violations))
    }

    /// Per row of `batch`, whether `rule` holds (never NULL).
    fn holds(&self, rule: &Rule, batch: &RecordBatch) -> Result<BooleanArray, String> {
        let column = rule.column.map(|i| batch.column(i));
        let ok = match (rule.kind, column, &rule.expr) {
            (RuleKind::NotNull, Some(c), _) => {
                is_not_null(c.as_ref()).map_err(|e| e.to_string())?
            }
            (RuleKind::Generated, Some(c), Some(expr)) => {
                let value = evaluate(expr, batch)?;
                let value =
                    arrow::compute::cast(&value, c.data_type()).map_err(|e| e.to_string())?;
                not_distinct(c, &value).map_err(|e| e.to_string())?
            }
            (_, _, Some(expr)) => {
                let value = evaluate(expr, batch)?;
                let value = value
                    .as_any()
                    .downcast_ref::<BooleanArray>()
                    .ok_or_else(|| {
                        format!("the expression is {}, not boolean", value.data_type())
                    })?;
                // NULL breaks the rule, as false does.
                if value.null_count() == 0 {
                    value.clone()
                } else {
                    value.iter().map(|v| Some(v == Some(true))).collect()
                }
            }
            _ => return Err("the rule has no column or expression".into()),
        };
        Ok(ok)
    }
}

/// Evaluate `expr` over `batch` as an array of its rows.
fn evaluate(expr: &Arc<dyn PhysicalExpr>, batch: &RecordBatch) -> Result<ArrayRef, String> {
    expr.evaluate(batch)
        .and_then(|v| v.into_array(batch.num_rows()))
        .map_err(|e| e.strip_backtrace())
}

/// The SQL of a `delta.invariants` value:
/// `{"expression": {"expression": "x > 3"}}`, as a JSON string or object.
fn invariant_sql(value: &MetadataValue) -> Option<String> {
    let json = match value {
        MetadataValue::String(s) => serde_json::from_str::<serde_json::Value>(s).ok()?,
        MetadataValue::Other(v) => v.clone(),
        _ => return None,
    };
    json.get("expression")?
        .get("expression")?
        .as_str()
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use arrow::array::{Float64Array, Int64Array};
    use buoyant_kernel::schema::{DataType as KernelType, StructField};

    use super::*;

    fn table(fields: Vec<StructField>) -> (StructType, SchemaRef) {
        let kernel = StructType::try_new(fields).unwrap();
        let arrow: Schema = (&kernel).try_into_arrow().unwrap();
        (kernel, delta_schema(&arrow))
    }

    use deltalake::kernel::engine::arrow_conversion::TryIntoArrow;

    #[test]
    fn checks_name_the_first_rule_a_row_breaks() {
        let (kernel, written) = table(vec![
            StructField::not_null("id", KernelType::LONG),
            StructField::nullable("amount", KernelType::DOUBLE),
        ]);
        let conf = HashMap::from([
            (
                "delta.constraints.amount_pos".to_string(),
                "amount > 0".to_string(),
            ),
            ("delta.appendOnly".to_string(), "false".to_string()),
        ]);
        let rules = TableRules::compile(
            "t",
            &kernel,
            &conf,
            &written,
            &["id".into(), "amount".into()],
        )
        .unwrap()
        .unwrap();
        let batch = RecordBatch::try_new(
            written.clone(),
            vec![
                Arc::new(Int64Array::from(vec![Some(1), None, Some(3), Some(4)])),
                Arc::new(Float64Array::from(vec![
                    Some(1.0),
                    Some(-1.0),
                    None,
                    Some(-2.0),
                ])),
            ],
        )
        .unwrap();
        let (good, bad) = rules.apply(batch).unwrap();
        assert_eq!(good.num_rows(), 1);
        assert_eq!(bad.len(), 2);
        assert_eq!(bad[0].kind, RuleKind::NotNull);
        assert_eq!(bad[0].rows.num_rows(), 1);
        // NULL breaks a CHECK constraint, as in Delta's writers.
        assert_eq!(bad[1].rule(), "CHECK constraint amount_pos (amount > 0)");
        assert_eq!(bad[1].rows.num_rows(), 2);
        assert_eq!(bad[1].row_json(0), r#"{"id":3}"#);
    }

    #[test]
    fn generated_columns_are_computed_or_checked() {
        let generated = StructField::nullable("amount2", KernelType::DOUBLE).with_metadata([(
            "delta.generationExpression",
            MetadataValue::String("amount * 2".into()),
        )]);
        let (kernel, written) = table(vec![
            StructField::nullable("amount", KernelType::DOUBLE),
            generated,
        ]);
        let omitted =
            TableRules::compile("t", &kernel, &HashMap::new(), &written, &["amount".into()])
                .unwrap()
                .unwrap();
        assert_eq!(omitted.computed_columns().collect::<Vec<_>>(), ["amount2"]);
        let batch = |a: Vec<Option<f64>>, b: Vec<Option<f64>>| {
            RecordBatch::try_new(
                written.clone(),
                vec![
                    Arc::new(Float64Array::from(a)),
                    Arc::new(Float64Array::from(b)),
                ],
            )
            .unwrap()
        };
        let (good, bad) = omitted
            .apply(batch(vec![Some(1.5), None], vec![None, None]))
            .unwrap();
        assert!(bad.is_empty());
        let filled = good
            .column(1)
            .as_any()
            .downcast_ref::<Float64Array>()
            .unwrap();
        assert_eq!(filled.value(0), 3.0);
        assert!(filled.is_null(1));

        let supplied = TableRules::compile(
            "t",
            &kernel,
            &HashMap::new(),
            &written,
            &["amount".into(), "amount2".into()],
        )
        .unwrap()
        .unwrap();
        let (good, bad) = supplied
            .apply(batch(
                vec![Some(1.0), Some(2.0), None],
                vec![Some(2.0), Some(6.0), None],
            ))
            .unwrap();
        assert_eq!(good.num_rows(), 2);
        assert_eq!(bad[0].kind, RuleKind::Generated);
        assert_eq!(bad[0].row_json(0), r#"{"amount":2.0,"amount2":6.0}"#);
    }

    #[test]
    fn an_expression_datafusion_cannot_plan_refuses_the_table() {
        let (kernel, written) = table(vec![StructField::nullable("a", KernelType::LONG)]);
        let conf = HashMap::from([(
            "delta.constraints.odd".to_string(),
            "no_such_function(a) > 0".to_string(),
        )]);
        let err = TableRules::compile("t", &kernel, &conf, &written, &["a".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("constraint odd") && err.contains("no_such_function"),
            "{err}"
        );
    }
}
