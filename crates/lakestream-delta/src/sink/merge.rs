//! Upserts (an aggregation's update output mode): the batch's rows merged
//! into the table by key columns with delta-rs's MERGE, in one commit that
//! also records the batch id.
//!
//! The batch's writers have written its rows as Parquet files like any
//! batch's; they are few (the groups the batch changed), so they are read
//! back as MERGE's source, and removed once the merge has committed: no
//! commit ever referenced them.

use arrow::array::ArrayRef;
use datafusion::common::ScalarValue;
use datafusion::functions_aggregate::min_max::{MaxAccumulator, MinAccumulator};
use datafusion::logical_expr::Accumulator;
use datafusion::prelude::{Expr, SessionContext};
use futures::TryStreamExt;
use object_store::ObjectStoreExt;
#[allow(deprecated)]
use parquet::arrow::async_reader::ParquetObjectReader;

use super::*;

impl DeltaSink {
    /// Merge the rows of the files in `adds` into `table` by `keys`
    /// (matched rows updated, others inserted) in one commit with `props`.
    /// With `replace`, the rows are the whole table: the table's rows they
    /// lack are deleted, and a matched row is rewritten only when a value
    /// differs. Returns the new table version.
    pub(super) async fn upsert(
        &self,
        table: &mut DeltaTable,
        adds: &[Action],
        keys: &[String],
        replace: bool,
        props: CommitProperties,
        batch_id: u64,
    ) -> Result<u64> {
        let write_err = |e: Box<dyn std::error::Error + Send + Sync>| Error::Write {
            table: self.name.clone(),
            batch_id,
            source: e,
        };
        let store = table.log_store().object_store(None);
        let mut paths = Vec::new();
        let mut batches: Vec<RecordBatch> = Vec::new();
        for a in adds {
            let Action::Add(add) = a else { continue };
            let path = object_store::path::Path::from_url_path(&add.path)
                .map_err(|e| write_err(Box::new(e)))?;
            #[allow(deprecated)]
            let reader = ParquetObjectReader::new(store.clone(), path.clone())
                .with_file_size(add.size.max(0) as u64);
            let stream = parquet::arrow::ParquetRecordBatchStreamBuilder::new(reader)
                .await
                .map_err(|e| write_err(Box::new(e)))?
                .build()
                .map_err(|e| write_err(Box::new(e)))?;
            batches.extend(
                stream
                    .try_collect::<Vec<_>>()
                    .await
                    .map_err(|e| write_err(Box::new(e)))?,
            );
            paths.push(path);
        }
        let Some(first) = batches.first() else {
            return Err(Error::InvalidConfig {
                table: self.name.clone(),
                reason: format!("batch {batch_id}: an upsert without rows"),
            });
        };
        let columns: Vec<String> = first
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        for k in keys {
            if !columns.contains(k) {
                return Err(Error::InvalidConfig {
                    table: self.name.clone(),
                    reason: format!("the upsert key {k} is not a column of the output"),
                });
            }
        }
        let side =
            |alias: &str, c: &str| Expr::Column(datafusion::common::Column::new(Some(alias), c));
        let predicate = keys
            .iter()
            .map(|k| {
                datafusion::logical_expr::binary_expr(
                    side("target", k),
                    datafusion::logical_expr::Operator::IsNotDistinctFrom,
                    side("source", k),
                )
            })
            .reduce(Expr::and);
        let predicate = match (predicate, replace) {
            (Some(p), _) => p,
            // A global aggregate's one row replaces the table's one row.
            (None, true) => datafusion::prelude::lit(true),
            (None, false) => {
                return Err(Error::InvalidConfig {
                    table: self.name.clone(),
                    reason: "an upsert needs at least one key column".into(),
                });
            }
        };
        // Every changed key lies within its column's range over the batch:
        // with those ranges in the predicate, MERGE skips the table's files
        // whose statistics lie outside them, instead of reading them all.
        // A replacement reads every file anyway (rows the batch lacks go).
        let predicate = if replace {
            predicate
        } else {
            key_ranges(&batches, keys)
                .into_iter()
                .fold(predicate, |p, range| p.and(range))
        };
        // A replacement rewrites a row only when one of its values changed.
        let changed = columns
            .iter()
            .filter(|c| !keys.contains(c))
            .map(|c| {
                datafusion::logical_expr::binary_expr(
                    side("source", c),
                    datafusion::logical_expr::Operator::IsDistinctFrom,
                    side("target", c),
                )
            })
            .reduce(Expr::or);
        let source = SessionContext::new()
            .read_batches(batches)
            .map_err(|e| write_err(Box::new(e)))?;
        let mut merge = table
            .clone()
            .merge(source, predicate)
            .with_source_alias("source")
            .with_target_alias("target")
            .with_commit_properties(props);
        if !replace || changed.is_some() {
            merge = merge
                .when_matched_update(|u| {
                    let u = match (&changed, replace) {
                        (Some(c), true) => u.predicate(c.clone()),
                        _ => u,
                    };
                    columns
                        .iter()
                        .fold(u, |u, c| u.update(c.as_str(), side("source", c)))
                })
                .map_err(|e| self.table_err(e))?;
        }
        merge = merge
            .when_not_matched_insert(|i| {
                columns
                    .iter()
                    .fold(i, |i, c| i.set(c.as_str(), side("source", c)))
            })
            .map_err(|e| self.table_err(e))?;
        if replace {
            merge = merge
                .when_not_matched_by_source_delete(|d| d)
                .map_err(|e| self.table_err(e))?;
        }
        let (merged, _metrics) = merge.await.map_err(|e| Error::Commit {
            table: self.name.clone(),
            batch_id,
            source: Box::new(e),
        })?;
        let version = merged.version().unwrap_or_default();
        *table = merged;
        for p in paths {
            let _ = store.delete(&p).await;
        }
        Ok(version)
    }
}

/// `target.k BETWEEN min AND max` for each key column `k` of `batches`
/// whose values (the batch's changed keys) have a range: ordered types
/// without NULLs or NaN-prone floats. A key that cannot be ranged adds
/// nothing (the merge then reads more files, never fewer rows).
fn key_ranges(batches: &[RecordBatch], keys: &[String]) -> Vec<Expr> {
    let mut ranges = Vec::new();
    for k in keys {
        let Some(Ok(index)) = batches.first().map(|b| b.schema().index_of(k)) else {
            continue;
        };
        let data_type = batches[0].schema().field(index).data_type().clone();
        let rangeable = data_type.is_integer()
            || data_type.is_temporal()
            || matches!(
                data_type,
                DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View | DataType::Boolean
            )
            || matches!(
                data_type,
                DataType::Decimal128(..) | DataType::Decimal256(..)
            );
        if !rangeable {
            continue;
        }
        let columns: Vec<ArrayRef> = batches.iter().map(|b| b.column(index).clone()).collect();
        if columns.iter().any(|c| c.null_count() > 0) {
            continue;
        }
        let bound = |mut acc: Box<dyn Accumulator>| -> Option<ScalarValue> {
            for c in &columns {
                acc.update_batch(std::slice::from_ref(c)).ok()?;
            }
            acc.evaluate().ok().filter(|v| !v.is_null())
        };
        let (Some(low), Some(high)) = (
            MinAccumulator::try_new(&data_type)
                .ok()
                .and_then(|a| bound(Box::new(a))),
            MaxAccumulator::try_new(&data_type)
                .ok()
                .and_then(|a| bound(Box::new(a))),
        ) else {
            continue;
        };
        let target = Expr::Column(datafusion::common::Column::new(Some("target"), k));
        ranges.push(target.between(Expr::Literal(low, None), Expr::Literal(high, None)));
    }
    ranges
}
