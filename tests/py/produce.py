"""Produce records to a Kafka topic with the `confluent-kafka` client: an
independent producer (its own librdkafka build), so the tests read what
producers in the field write.

usage: produce.py BOOTSTRAP TOPIC CONFIG_JSON < records

CONFIG_JSON: producer settings added to the defaults (for example
{"compression.type": "zstd", "security.protocol": "SSL",
"ssl.ca.location": "ca.pem"}). Each input line is a JSON object
{"key": str or null, "value": str, "partition": int}, or "key_hex" for
a key of any bytes, "value_hex" for a value of any bytes, or
"avro_schema" (an Avro schema's JSON) with "avro_value" (the record as a
JSON object; {"$decimal": "12.34"} stands for a decimal): serialized by the client's AvroSerializer in the Confluent
wire format, the schema registered with the registry that CONFIG_JSON's
"schema.registry.url" (with "basic.auth.user.info" and
"schema.registry.ssl.ca.location") names; "avro_key_schema" with
"avro_key" serializes the key likewise (subject TOPIC-key); "proto_file"
(a compact description of a .proto file, see `proto_class`), "proto_message"
(a message's full name) and "proto_value" (the message in Protobuf's JSON
mapping) serialize the value with the client's ProtobufSerializer. One
record per
produce request (batch.num.messages=1), since tansu's high watermark is
exact only then. Prints one JSON line per record, in input order:
{"partition": p, "offset": o}.
"""
import json
import sys

from confluent_kafka import Producer

REGISTRY_KEYS = ("schema.registry.url", "basic.auth.user.info", "schema.registry.ssl.ca.location")


SCALARS = {
    "double": 1, "float": 2, "int64": 3, "uint64": 4, "int32": 5, "bool": 8,
    "string": 9, "bytes": 12, "uint32": 13, "sint32": 17, "sint64": 18,
}
CLASSES = {}


def proto_class(spec, message):
    """The message class `message` of the file `spec` describes:
    {"name": "orders.proto", "package": "shop", "dependency": [...],
     "messages": [{"name": "Order", "fields": [{"name", "number", "type",
     "repeated"?}]}], "enums": [{"name", "values": [...]}], "imports":
     [files like this one, added first]}; a field's type
    is a scalar name or a full name with a leading dot (".shop.Place",
    ".google.protobuf.Timestamp")."""
    key = json.dumps(spec, sort_keys=True)
    if (key, message) in CLASSES:
        return CLASSES[(key, message)]
    for imported in spec.get("imports", []):
        proto_class(imported, None)
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from google.protobuf import timestamp_pb2  # noqa: F401 (registers the type)

    f = descriptor_pb2.FileDescriptorProto(name=spec["name"], package=spec["package"], syntax="proto3")
    f.dependency.extend(spec.get("dependency", []))
    enums = {f".{spec['package']}.{e['name']}" for e in spec.get("enums", [])}
    for e in spec.get("enums", []):
        ed = f.enum_type.add(name=e["name"])
        for i, v in enumerate(e["values"]):
            ed.value.add(name=v, number=i)
    for m in spec["messages"]:
        md = f.message_type.add(name=m["name"])
        for fld in m["fields"]:
            fd = md.field.add(name=fld["name"], number=fld["number"], json_name=fld["name"])
            fd.label = 3 if fld.get("repeated") else 1
            t = fld["type"]
            if t in SCALARS:
                fd.type = SCALARS[t]
            else:
                fd.type = 14 if t in enums else 11
                fd.type_name = t
    pool = descriptor_pool.Default()
    try:
        pool.Add(f)
    except TypeError:
        pass  # added before, by an earlier record
    if message is None:
        return None
    cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(message))
    CLASSES[(key, message)] = cls
    return cls


def revive(v):
    """JSON to what the Avro serializer takes: {"$decimal": s} -> Decimal."""
    if isinstance(v, dict):
        if set(v) == {"$decimal"}:
            from decimal import Decimal

            return Decimal(v["$decimal"])
        return {k: revive(x) for k, x in v.items()}
    if isinstance(v, list):
        return [revive(x) for x in v]
    return v


def main() -> None:
    bootstrap, topic, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    conf = {
        "bootstrap.servers": bootstrap,
        "batch.num.messages": 1,
        "linger.ms": 0,
        "message.timeout.ms": 30000,
        **extra,
    }
    registry_conf = {k.removeprefix("schema.registry."): conf.pop(k) for k in REGISTRY_KEYS if k in conf}
    serializers = {}

    def avro(schema, value, key=False):
        from confluent_kafka.serialization import MessageField, SerializationContext

        field = MessageField.KEY if key else MessageField.VALUE
        if (schema, field) not in serializers:
            from confluent_kafka.schema_registry import SchemaRegistryClient
            from confluent_kafka.schema_registry.avro import AvroSerializer

            client = SchemaRegistryClient(registry_conf)
            serializers[(schema, field)] = AvroSerializer(client, schema)
        return serializers[(schema, field)](value, SerializationContext(topic, field))

    def protobuf(spec, message, value):
        from confluent_kafka.schema_registry import SchemaRegistryClient
        from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
        from confluent_kafka.serialization import MessageField, SerializationContext
        from google.protobuf import json_format

        cls = proto_class(spec, message)
        if cls not in serializers:
            client = SchemaRegistryClient(registry_conf)
            serializers[cls] = ProtobufSerializer(cls, client, {"use.deprecated.format": False})
        msg = json_format.ParseDict(value, cls())
        return serializers[cls](msg, SerializationContext(topic, MessageField.VALUE))

    producer = Producer(conf)
    records = [json.loads(line) for line in sys.stdin if line.strip()]
    placed = [None] * len(records)
    failed = []

    def report(i):
        def done(err, msg):
            if err is not None:
                failed.append(f"record {i}: {err}")
            else:
                placed[i] = (msg.partition(), msg.offset())

        return done

    for i, r in enumerate(records):
        key = r.get("key")
        key = bytes.fromhex(r["key_hex"]) if "key_hex" in r else key and key.encode()
        if "avro_key_schema" in r:
            key = avro(r["avro_key_schema"], revive(r["avro_key"]), key=True)
        if "avro_schema" in r:
            value = avro(r["avro_schema"], revive(r["avro_value"]))
        elif "proto_file" in r:
            value = protobuf(r["proto_file"], r["proto_message"], r["proto_value"])
        elif "value_hex" in r:
            value = bytes.fromhex(r["value_hex"])
        else:
            value = r["value"].encode()
        producer.produce(
            topic,
            value=value,
            key=key,
            partition=r.get("partition", 0),
            on_delivery=report(i),
        )
        producer.poll(0)
    left = producer.flush(60)
    if left or failed:
        sys.exit(f"produce to {topic}: {left} record(s) undelivered; {failed[:3]}")
    for p, o in placed:
        print(json.dumps({"partition": p, "offset": o}))


if __name__ == "__main__":
    main()
