//! The Delta schema of a query's output, and casting batches onto it.

use super::*;

/// The schema lakestream writes for a query output: Delta's types (UTC
/// microsecond timestamps, plain strings and binaries) and every column
/// nullable, so any reader opens the table.
///
/// A timestamp without a time zone is taken as UTC.
pub fn delta_schema(schema: &Schema) -> SchemaRef {
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .map(|f| Field::new(f.name(), delta_type(f.data_type()), true))
        .collect();
    Arc::new(Schema::new(fields))
}

fn delta_type(t: &DataType) -> DataType {
    match t {
        DataType::Timestamp(_, _) => DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
        DataType::Utf8View | DataType::LargeUtf8 => DataType::Utf8,
        DataType::BinaryView | DataType::LargeBinary => DataType::Binary,
        DataType::Date64 => DataType::Date32,
        DataType::UInt8 => DataType::Int16,
        DataType::UInt16 => DataType::Int32,
        DataType::UInt32 | DataType::UInt64 => DataType::Int64,
        DataType::Float16 => DataType::Float32,
        DataType::Dictionary(_, v) => delta_type(v),
        // Delta names a list's items `element` (Arrow writers say `item`):
        // the name is not part of the column's type.
        DataType::List(f) | DataType::LargeList(f) | DataType::ListView(f) => DataType::List(
            Arc::new(Field::new("element", delta_type(f.data_type()), true)),
        ),
        // Delta names a map's entries `key_value`; keys are never NULL.
        DataType::Map(entries, sorted) => {
            let (k, v) = match entries.data_type() {
                DataType::Struct(kv) if kv.len() == 2 => (kv[0].clone(), kv[1].clone()),
                _ => return t.clone(),
            };
            DataType::Map(
                Arc::new(Field::new(
                    "key_value",
                    DataType::Struct(
                        vec![
                            Field::new("key", delta_type(k.data_type()), false),
                            Field::new("value", delta_type(v.data_type()), true),
                        ]
                        .into(),
                    ),
                    false,
                )),
                *sorted,
            )
        }
        // Delta has no fixed-size binary.
        DataType::FixedSizeBinary(_) => DataType::Binary,
        DataType::Struct(fields) => DataType::Struct(
            fields
                .iter()
                .map(|f| Field::new(f.name(), delta_type(f.data_type()), true))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Cast `batch` onto `schema` (same column order), as [`delta_schema`] maps
/// types.
pub fn cast_batch(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch, String> {
    if batch.schema().fields() == schema.fields() {
        return Ok(batch.clone());
    }
    let cols = batch
        .columns()
        .iter()
        .zip(schema.fields())
        .map(|(c, f)| {
            if c.data_type() == f.data_type() {
                Ok(c.clone())
            } else {
                cast_column(c, f.data_type()).map_err(|e| format!("column {}: {e}", f.name()))
            }
        })
        .collect::<Result<Vec<_>, String>>()?;
    RecordBatch::try_new(schema.clone(), cols).map_err(|e| e.to_string())
}

/// Cast `column` to `to`. A naive timestamp is UTC here
/// ([`delta_schema`]): arrow's cast takes it as local time in the target
/// zone and converts every value through that zone's rules (a visible share
/// of a backfill's CPU), which for UTC is the identity, so only the unit is
/// cast and the zone is set.
fn cast_column(
    column: &arrow::array::ArrayRef,
    to: &DataType,
) -> Result<arrow::array::ArrayRef, arrow::error::ArrowError> {
    match (column.data_type(), to) {
        (DataType::Timestamp(_, None), DataType::Timestamp(unit, Some(tz)))
            if matches!(tz.as_ref(), "UTC" | "+00:00") =>
        {
            let naive = arrow::compute::cast(column, &DataType::Timestamp(*unit, None))?;
            let data = naive
                .to_data()
                .into_builder()
                .data_type(to.clone())
                .build()?;
            Ok(arrow::array::make_array(data))
        }
        _ => arrow::compute::cast(column, to),
    }
}

/// `batch`'s columns in the order of `schema`'s, matched by name; a
/// column `batch` lacks is NULL (types are cast afterwards).
pub(super) fn by_name(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch, String> {
    let n = batch.num_rows();
    let cols: Vec<arrow::array::ArrayRef> = schema
        .fields()
        .iter()
        .map(|f| {
            batch
                .column_by_name(f.name())
                .cloned()
                .unwrap_or_else(|| arrow::array::new_null_array(f.data_type(), n))
        })
        .collect();
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .zip(&cols)
        .map(|(f, c)| Field::new(f.name(), c.data_type().clone(), true))
        .collect();
    RecordBatch::try_new(Arc::new(Schema::new(fields)), cols).map_err(|e| e.to_string())
}

impl DeltaSink {
    /// How the query's output `wanted` is written into the table `meta`
    /// (Arrow columns `existing`) with `merge_schema`: new columns
    /// appended, nullable, with the metadata to commit; the table's
    /// columns the query lacks written as NULL. A column of another type,
    /// or a NOT NULL column the query lacks, is refused.
    pub(super) fn evolve(
        &self,
        meta: &BlindDeltaTable,
        existing: &Schema,
        wanted: &Schema,
    ) -> Result<Evolution> {
        let mismatch = |reason: String| Error::SchemaMismatch {
            table: self.name.clone(),
            reason,
        };
        let have = delta_schema(existing);
        let mut fields: Vec<Field> = existing
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        let mut added = Vec::new();
        for w in wanted.fields() {
            match have.field_with_name(w.name()) {
                Ok(h) if h.data_type() == w.data_type() => {}
                Ok(h) => {
                    return Err(mismatch(format!(
                        "column {} is {} in the table and {} in the query: merge_schema adds \
                         columns but never changes a column's type; cast it in the query",
                        w.name(),
                        h.data_type(),
                        w.data_type()
                    )));
                }
                Err(_) => {
                    fields.push(Field::new(w.name(), w.data_type().clone(), true));
                    added.push(w.name().clone());
                }
            }
        }
        for h in have.fields() {
            if wanted.field_with_name(h.name()).is_err() && !h.is_nullable() {
                return Err(mismatch(format!(
                    "column {} is NOT NULL in the table and the query no longer produces it",
                    h.name()
                )));
            }
        }
        let schema = Arc::new(Schema::new(fields));
        let metadata = if added.is_empty() {
            None
        } else {
            let kernel: StructType = schema
                .as_ref()
                .try_into_kernel()
                .map_err(|e| mismatch(format!("the new columns cannot be a Delta schema: {e}")))?;
            use deltalake::kernel::MetadataExt;
            let m = meta
                .metadata()
                .clone()
                .with_schema(&kernel)
                .map_err(|e| self.table_err(DeltaTableError::from(e)))?;
            tracing::info!(table = %self.name, columns = %added.join(", "), "merge_schema: the next commit adds columns to the table");
            Some(m)
        };
        Ok(Evolution { schema, metadata })
    }

    /// After the commit that added the new columns: later batches are
    /// plain appends to the evolved table.
    pub(super) async fn schema_evolved(&self, loaded: &mut Loaded) -> Result<()> {
        if let Some(ev) = self.evolution.lock().expect("evolution lock").as_mut() {
            ev.metadata = None;
        }
        if let Some(meta) = self.load_meta().await? {
            // The table's rules now come from the schema this sink wrote.
            self.contract.lock().expect("contract lock").source = contract_source(&meta);
            loaded.meta = meta;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table written with a list column reads back with Delta's item
    /// name (`element`); the query still says `item`. A restart must see
    /// the same column, not a mismatch.
    #[test]
    fn list_item_names_do_not_make_schemas_differ() {
        let list = |item: &str| {
            Schema::new(vec![Field::new(
                "xs",
                DataType::List(Arc::new(Field::new(item, DataType::Int64, true))),
                true,
            )])
        };
        assert!(lakestream_sink::same_columns(
            &delta_schema(&list("item")),
            &delta_schema(&list("element"))
        ));
    }

    /// Likewise a map's entries: Arrow writers say `entries`, Delta reads
    /// back `key_value`.
    #[test]
    fn map_entry_names_do_not_make_schemas_differ() {
        let map = |entries: &str, value_nullable: bool| {
            let kv = DataType::Struct(
                vec![
                    Field::new("key", DataType::Utf8, false),
                    Field::new("value", DataType::Int64, value_nullable),
                ]
                .into(),
            );
            Schema::new(vec![Field::new(
                "m",
                DataType::Map(Arc::new(Field::new(entries, kv, false)), false),
                true,
            )])
        };
        assert!(lakestream_sink::same_columns(
            &delta_schema(&map("entries", false)),
            &delta_schema(&map("key_value", true))
        ));
    }

    /// A naive timestamp is written as the same UTC instant, in every
    /// unit, nulls kept: what arrow's cast (naive as local time in UTC)
    /// gives, without its per-value time-zone lookups.
    #[test]
    fn naive_timestamps_are_cast_to_the_same_utc_instants() {
        use arrow::array::{
            Array, ArrayRef, TimestampMicrosecondArray, TimestampMillisecondArray,
            TimestampNanosecondArray, TimestampSecondArray,
        };
        let values = [
            Some(1_767_225_600_123_456_789i64),
            None,
            Some(-86_400_000_000_001),
            Some(0),
            Some(999),
        ];
        let columns: Vec<ArrayRef> = vec![
            Arc::new(TimestampNanosecondArray::from(values.to_vec())),
            Arc::new(TimestampMicrosecondArray::from(values.to_vec())),
            Arc::new(TimestampMillisecondArray::from(
                values
                    .iter()
                    .map(|v| v.map(|v| v / 1_000_000))
                    .collect::<Vec<_>>(),
            )),
            Arc::new(TimestampSecondArray::from(
                values
                    .iter()
                    .map(|v| v.map(|v| v / 1_000_000_000))
                    .collect::<Vec<_>>(),
            )),
        ];
        for column in columns {
            let input = Schema::new(vec![Field::new("ts", column.data_type().clone(), true)]);
            let batch =
                RecordBatch::try_new(Arc::new(input.clone()), vec![column.clone()]).unwrap();
            let out = cast_batch(&batch, &delta_schema(&input)).unwrap();
            let utc = DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()));
            let expected = arrow::compute::cast(&column, &utc).unwrap();
            assert_eq!(out.column(0).data_type(), &utc);
            assert_eq!(out.column(0).to_data(), expected.to_data(), "{column:?}");
            assert_eq!(out.column(0).null_count(), 1);
        }
    }
}
