#!/usr/bin/env python3
"""Check a running Schema Registry through confluent-kafka's own client and serializers.

Usage: check_registry.py [URL]   (default http://127.0.0.1:18081/apis/ccompat/v7,
                                   the address `registry.sh start` gives)

Registers an Avro schema under subject t-value (and t-copy-value), reads it back by id and
by subject, and round-trips one record through AvroSerializer/AvroDeserializer; then the same for JSON
Schema (subject tj-value) and Protobuf (subject tp-value) when their extras are installed
(`pip install 'confluent-kafka[avro,json,protobuf,schemaregistry]'`). Exits non-zero on
the first mismatch. Each subject is deleted first so that a second run starts alike.
"""

import json
import sys

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.serialization import MessageField, SerializationContext

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:18081/apis/ccompat/v7"

AVRO_SCHEMA = json.dumps({
    "type": "record",
    "name": "OrderCreated",
    "namespace": "outbox.test",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "customer", "type": "string"},
        {"name": "total_cents", "type": "long"},
        {"name": "note", "type": ["null", "string"], "default": None},
    ],
})
RECORD = {"id": 42, "customer": "ada", "total_cents": 1999, "note": None}

JSON_SCHEMA = json.dumps({
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "OrderCreated",
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "customer": {"type": "string"},
        "total_cents": {"type": "integer"},
    },
    "required": ["id", "customer", "total_cents"],
})

PROTO_SCHEMA = """syntax = "proto3";
package outbox.test;

message OrderCreated {
  int64 id = 1;
  string customer = 2;
  int64 total_cents = 3;
}
"""


def fresh(client, subject):
    """Soft- then hard-delete the subject, so ids and versions come from this run."""
    if subject in client.get_subjects():
        client.delete_subject(subject)
        client.delete_subject(subject, permanent=True)


def expect(what, got, want):
    if got != want:
        print(f"FAIL {what}: got {got!r}, want {want!r}")
        sys.exit(1)
    print(f"ok   {what}")


def wire_header(data):
    """Confluent framing: magic byte 0, then the schema id as a 4-byte big-endian int."""
    return data[0], int.from_bytes(data[1:5], "big")


def check_avro(client):
    from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer

    subject = "t-value"
    fresh(client, subject)
    schema_id = client.register_schema(subject, Schema(AVRO_SCHEMA, "AVRO"))
    print(f"registered Avro schema for {subject}: id {schema_id}")
    by_id = client.get_schema(schema_id)
    expect("Avro schema by id: type", by_id.schema_type, "AVRO")
    expect("Avro schema by id: same schema", json.loads(by_id.schema_str), json.loads(AVRO_SCHEMA))
    latest = client.get_latest_version(subject)
    expect("latest version of t-value: id", latest.schema_id, schema_id)
    expect("latest version of t-value: version", latest.version, 1)
    again = client.register_schema(subject, Schema(AVRO_SCHEMA, "AVRO"))
    expect("registering the same schema again gives the same id", again, schema_id)
    # Confluent's ids name the schema's content: another subject with the same schema
    # gets the same id (in Apicurio: apicurio.ccompat.legacy-id-mode.enabled=false, its default)
    fresh(client, "t-copy-value")
    other = client.register_schema("t-copy-value", Schema(AVRO_SCHEMA, "AVRO"))
    expect("the same schema under another subject gets the same id", other, schema_id)

    ctx = SerializationContext("t", MessageField.VALUE)
    serializer = AvroSerializer(client, AVRO_SCHEMA, conf={"auto.register.schemas": False,
                                                           "use.latest.version": True})
    data = serializer(RECORD, ctx)
    expect("Avro bytes: magic byte and schema id", wire_header(data), (0, schema_id))
    # a deserializer with no schema of its own: it must fetch the writer's schema by id
    back = AvroDeserializer(SchemaRegistryClient({"url": URL}))(data, ctx)
    expect("Avro record round trip", back, RECORD)
    print(f"     {len(data)} bytes: {data.hex()}")


def check_json(client):
    from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer

    subject = "tj-value"
    fresh(client, subject)
    ctx = SerializationContext("tj", MessageField.VALUE)
    record = {k: RECORD[k] for k in ("id", "customer", "total_cents")}
    data = JSONSerializer(JSON_SCHEMA, client)(record, ctx)
    magic, schema_id = wire_header(data)
    expect("JSON Schema registered on first use", client.get_latest_version(subject).schema_id, schema_id)
    expect("JSON Schema by id: type", client.get_schema(schema_id).schema_type, "JSON")
    back = JSONDeserializer(None, schema_registry_client=SchemaRegistryClient({"url": URL}))(data, ctx)
    expect("JSON record round trip", back, record)


def proto_message_class():
    """The OrderCreated message class, built from PROTO_SCHEMA's descriptor without protoc."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(name="outbox_test_order.proto", package="outbox.test",
                                             syntax="proto3")
    msg = fdp.message_type.add(name="OrderCreated")
    for number, (name, kind) in enumerate([("id", "TYPE_INT64"), ("customer", "TYPE_STRING"),
                                           ("total_cents", "TYPE_INT64")], start=1):
        msg.field.add(name=name, number=number, label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
                      type=getattr(descriptor_pb2.FieldDescriptorProto, kind))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("outbox.test.OrderCreated"))


def check_protobuf(client):
    from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer

    subject = "tp-value"
    fresh(client, subject)
    cls = proto_message_class()
    ctx = SerializationContext("tp", MessageField.VALUE)
    serializer = ProtobufSerializer(cls, client, conf={"use.deprecated.format": False})
    data = serializer(cls(id=42, customer="ada", total_cents=1999), ctx)
    magic, schema_id = wire_header(data)
    expect("Protobuf schema registered on first use", client.get_latest_version(subject).schema_id,
           schema_id)
    expect("Protobuf schema by id: type", client.get_schema(schema_id).schema_type, "PROTOBUF")
    back = ProtobufDeserializer(cls, conf={"use.deprecated.format": False})(data, ctx)
    expect("Protobuf message round trip", (back.id, back.customer, back.total_cents),
           (42, "ada", 1999))


def main():
    client = SchemaRegistryClient({"url": URL})
    print(f"registry: {URL}")
    check_avro(client)
    for name, check in (("JSON Schema", check_json), ("Protobuf", check_protobuf)):
        try:
            check(client)
        except ImportError as e:
            print(f"skip {name}: {e}")
    print("registry check passed")


if __name__ == "__main__":
    main()
