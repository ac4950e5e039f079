"""Parse OpenMetrics text (stdin) strictly with prometheus_client and print
one JSON line per sample: {"family", "type", "unit", "name", "labels", "value"}.
Exits non-zero (with the parser's message) when the text is not valid."""
import json
import sys

from prometheus_client.openmetrics.parser import text_string_to_metric_families

text = sys.stdin.read()
for family in text_string_to_metric_families(text):
    for s in family.samples:
        print(json.dumps({
            "family": family.name,
            "type": family.type,
            "unit": family.unit,
            "name": s.name,
            "labels": s.labels,
            "value": s.value,
        }), flush=True)
