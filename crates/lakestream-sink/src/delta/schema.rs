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
                arrow::compute::cast(c, f.data_type())
                    .map_err(|e| format!("column {}: {e}", f.name()))
            }
        })
        .collect::<Result<Vec<_>, String>>()?;
    RecordBatch::try_new(schema.clone(), cols).map_err(|e| e.to_string())
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
        assert!(crate::same_columns(
            &delta_schema(&list("item")),
            &delta_schema(&list("element"))
        ));
    }
}
