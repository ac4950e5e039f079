"""Print a Delta table's rows as JSON lines, read by the Python `deltalake`
package (delta-rs bindings) and pyarrow: an independent reader.

usage: read_delta.py TABLE_PATH            rows as JSON lines
       (TABLE_PATH may be s3://...: the test S3 server is taken from
       LAKESTREAM_S3_ENDPOINT, LAKESTREAM_S3_KEY_ID, LAKESTREAM_S3_SECRET)
       read_delta.py TABLE_PATH --meta     one JSON object: version, partition columns, schema
       read_delta.py TABLE_PATH --history  the commits' commitInfo, newest first, as JSON lines
       read_delta.py TABLE_PATH --cdf      the change data feed from version 0 (load_cdf), as
                                           JSON lines with _change_type and _commit_version
       read_delta.py TABLE_PATH --protocol the protocol: versions and features, one JSON object
"""
import json
import os
import sys

import deltalake


def storage_options(uri: str):
    """Credentials and endpoint of the test S3 server for s3:// tables."""
    if not uri.startswith("s3://"):
        return None
    return {
        "AWS_ENDPOINT_URL": os.environ["LAKESTREAM_S3_ENDPOINT"],
        "AWS_ACCESS_KEY_ID": os.environ["LAKESTREAM_S3_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": os.environ["LAKESTREAM_S3_SECRET"],
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }


def main() -> None:
    table = deltalake.DeltaTable(sys.argv[1], storage_options=storage_options(sys.argv[1]))
    if "--cdf" in sys.argv[2:]:
        import pyarrow
        for row in pyarrow.table(table.load_cdf(starting_version=0).read_all()).to_pylist():
            print(json.dumps(row, default=str), flush=True)
        return
    if "--protocol" in sys.argv[2:]:
        p = table.protocol()
        print(
            json.dumps(
                {
                    "min_reader_version": p.min_reader_version,
                    "min_writer_version": p.min_writer_version,
                    "writer_features": p.writer_features,
                    "reader_features": p.reader_features,
                    "configuration": table.metadata().configuration,
                }
            ),
            flush=True,
        )
        return
    if "--history" in sys.argv[2:]:
        for commit in table.history():
            print(json.dumps(commit, default=str), flush=True)
        return
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
