"""Print a Delta table's rows as JSON lines, read by the Python `deltalake`
package (delta-rs bindings) and pyarrow: an independent reader.

usage: read_delta.py TABLE_PATH            rows as JSON lines
       read_delta.py TABLE_PATH --meta     one JSON object: version, partition columns, schema
"""
import json
import os
import sys

import deltalake


def main() -> None:
    table = deltalake.DeltaTable(sys.argv[1])
    if "--meta" in sys.argv[2:]:
        data = table.to_pyarrow_table()
        print(
            json.dumps(
                {
                    "version": table.version(),
                    "partition_columns": table.metadata().partition_columns,
                    "columns": [f.name for f in data.schema],
                    "types": [str(f.type) for f in data.schema],
                    "rows": data.num_rows,
                    "files": len(table.file_uris()),
                }
            ),
            flush=True,
        )
        return
    for row in table.to_pyarrow_table().to_pylist():
        print(json.dumps(row, default=str), flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the exit code must mean something: see os._exit below
        print(f"read_delta.py: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    # deltalake can abort at interpreter shutdown after a successful read.
    os._exit(0)
