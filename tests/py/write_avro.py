"""Write an Avro object container file with fastavro (an independent
writer) for the Avro file tests.

usage: write_avro.py OUT_PATH SCHEMA_JSON CODEC < records
Each input line is one record as a JSON object; CODEC is null, deflate,
snappy or zstandard. Records go in blocks of 100.
"""
import json
import sys

import fastavro


def main() -> None:
    out, schema, codec = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    records = [json.loads(line) for line in sys.stdin if line.strip()]
    with open(out, "wb") as f:
        fastavro.writer(f, fastavro.parse_schema(schema), records, codec=codec, sync_interval=2000)


if __name__ == "__main__":
    main()
