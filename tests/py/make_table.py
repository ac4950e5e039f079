"""Create a Delta table with table features, written by the Python
`deltalake` package (delta-rs bindings): an independent writer, so the
tables the tests stream into are made the way users' tools make them.

usage: make_table.py TABLE_PATH SPEC_JSON

SPEC_JSON is an object:
  columns        [{"name", "type" (long, double, string, timestamp, date,
                  boolean), "nullable" (default true), "metadata" {...}}]
  partition_by   [column names]
  configuration  {table property: value}
  constraints    {name: SQL expression}  (added with ALTER TABLE ADD CONSTRAINT)
  features       [TableFeatures names: "AppendOnly", "RowTracking", ...]
  rows           [{column: value}]  (written before the constraints)

Prints the table's protocol as JSON.
"""
import json
import os
import sys

import pyarrow as pa
from deltalake import DeltaTable, Field, Schema, TableFeatures, write_deltalake
from deltalake.schema import PrimitiveType

ARROW = {
    "long": pa.int64(),
    "double": pa.float64(),
    "string": pa.string(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "date": pa.date32(),
    "boolean": pa.bool_(),
}


def main() -> None:
    path, spec = sys.argv[1], json.loads(sys.argv[2])
    columns = spec["columns"]
    schema = Schema(
        [
            Field(
                c["name"],
                PrimitiveType(c["type"]),
                nullable=c.get("nullable", True),
                metadata=c.get("metadata", {}),
            )
            for c in columns
        ]
    )
    DeltaTable.create(
        path,
        schema=schema,
        partition_by=spec.get("partition_by") or None,
        configuration=spec.get("configuration") or None,
    )
    table = DeltaTable(path)
    rows = spec.get("rows")
    if rows:
        data = pa.table(
            {
                c["name"]: pa.array([r.get(c["name"]) for r in rows], ARROW[c["type"]])
                for c in columns
            }
        )
        write_deltalake(table, data, mode="append")
        table = DeltaTable(path)
    if spec.get("constraints"):
        table.alter.add_constraint(spec["constraints"])
    for feature in spec.get("features", []):
        table.alter.add_feature(getattr(TableFeatures, feature), allow_protocol_versions_increase=True)
    p = DeltaTable(path).protocol()
    print(
        json.dumps(
            {
                "min_reader_version": p.min_reader_version,
                "min_writer_version": p.min_writer_version,
                "writer_features": p.writer_features,
                "reader_features": p.reader_features,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the exit code must mean something: see os._exit below
        print(f"make_table.py: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)
