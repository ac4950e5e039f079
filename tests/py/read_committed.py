"""Read a Kafka topic as a read_committed consumer would, deciding from the
log itself which records committed: an independent check of a transactional
producer on brokers that do not filter aborted transactions for their
consumers (tansu, librdkafka's mock cluster).

Every record batch of every partition is fetched raw (Fetch v4,
read_uncommitted) and parsed with kafka-python's record parser. A
transactional batch belongs to its producer's open transaction until that
producer's next control batch: a COMMIT marker makes its records visible, an
ABORT marker drops them. Non-transactional records are visible at once.

Usage: read_committed.py BOOTSTRAP TOPIC [SETTINGS]
SETTINGS: a JSON object of librdkafka-style TLS settings (security.protocol,
ssl.ca.location, ssl.certificate.location, ssl.key.location,
ssl.key.password, ssl.endpoint.identification.algorithm).
Prints one JSON object: {"committed": [{"partition", "offset", "key",
"value", "headers", "timestamp"}...], "aborted": N, "open": N}, where values
are UTF-8 text (or null) and headers a {name: text} object.
"""
import json
import sys
import time

from kafka import TopicPartition
from kafka.client_async import KafkaClient
from kafka.protocol.fetch import FetchRequest
from kafka.protocol.list_offsets import ListOffsetsRequest
from kafka.record.memory_records import MemoryRecords

bootstrap, topic = sys.argv[1], sys.argv[2]
settings = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
TLS = {
    "security.protocol": "security_protocol",
    "ssl.ca.location": "ssl_cafile",
    "ssl.certificate.location": "ssl_certfile",
    "ssl.key.location": "ssl_keyfile",
    "ssl.key.password": "ssl_password",
}
kwargs = {TLS[k]: v for k, v in settings.items() if k in TLS}
if settings.get("ssl.endpoint.identification.algorithm") == "none":
    kwargs["ssl_check_hostname"] = False
client = KafkaClient(bootstrap_servers=bootstrap, api_version=(2, 0), **kwargs)
deadline = time.time() + 30
client.cluster.request_update()
partitions = None
while time.time() < deadline:
    client.poll(timeout_ms=200)
    partitions = client.cluster.partitions_for_topic(topic)
    if partitions:
        break
    client.cluster.request_update()
if not partitions:
    sys.exit(f"read_committed.py: topic {topic} not found at {bootstrap}")


def text(b):
    return None if b is None else b.decode("utf-8", "replace")


def send(node, request):
    end = time.time() + 30
    while not client.ready(node):
        client.poll(timeout_ms=100)
        if time.time() > end:
            sys.exit(f"read_committed.py: broker {node} not ready")
    future = client.send(node, request)
    client.poll(future=future, timeout_ms=30000)
    if not future.is_done or future.failed():
        sys.exit(f"read_committed.py: request failed: {future.exception}")
    return future.value


committed, aborted, still_open = [], 0, 0
for p in sorted(partitions):
    leader = client.cluster.leader_for_partition(TopicPartition(topic, p))
    # The end of the log (latest offset).
    resp = send(leader, ListOffsetsRequest[1](-1, [(topic, [(p, -1)])]))
    end_offset = resp.topics[0][1][0][3]
    pending = {}  # producer id -> records of its open transaction
    offset = 0
    while offset < end_offset:
        resp = send(leader, FetchRequest[4](
            -1, 500, 1, 8 << 20, 0, [(topic, [(p, offset, 8 << 20)])]))
        _, parts = resp.topics[0]
        _, error, _hw, _lso, _aborted, data = parts[0]
        if error:
            sys.exit(f"read_committed.py: fetch {topic}/{p}@{offset}: error {error}")
        records = MemoryRecords(data)
        progressed = False
        while True:
            batch = records.next_batch()
            if batch is None:
                break
            if batch.base_offset + batch.last_offset_delta < offset:
                continue
            progressed = True
            offset = batch.base_offset + batch.last_offset_delta + 1
            recs = list(batch)
            if batch.is_control_batch:
                for r in recs:
                    done = pending.pop(batch.producer_id, [])
                    if r.abort:
                        aborted += len(done)
                    else:
                        committed.extend(done)
                continue
            rows = [{
                "partition": p,
                "offset": r.offset,
                "key": text(r.key),
                "value": text(r.value),
                "headers": {k: text(v) for k, v in r.headers},
                "timestamp": r.timestamp,
            } for r in recs]
            if batch.is_transactional:
                pending.setdefault(batch.producer_id, []).extend(rows)
            else:
                committed.extend(rows)
        if not progressed:
            sys.exit(f"read_committed.py: no progress at {topic}/{p}@{offset} of {end_offset}")
    still_open += sum(len(v) for v in pending.values())
client.close()
print(json.dumps({"committed": committed, "aborted": aborted, "open": still_open}))
