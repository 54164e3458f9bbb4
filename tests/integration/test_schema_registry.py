"""kafka.value_format = "avro" / "json-schema": values encoded against a real
Confluent-compatible Schema Registry (Apicurio Registry, java/registry/registry.sh) and
read back from Apache Kafka with confluent-kafka's own deserializers."""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_relay import enqueue
from outbox_relay._embedded.kafka import kafka_available
from outbox_relay.runtime.relay import Relay
from tests.helpers.db import delivered, row_states, wait_for

REPO = Path(__file__).resolve().parents[2]
REGISTRY_SH = REPO / "java" / "registry" / "registry.sh"


def _java_major(java: str) -> int:
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.TimeoutExpired):
        return 0
    for word in out.split():
        word = word.strip('"')
        if word[:2].isdigit():
            return int(word.split(".")[0])
    return 0


def _registry_missing() -> str | None:
    """Why the registry cannot run here, or None."""
    candidates = [os.environ.get("REGISTRY_JAVA", ""), os.path.join(os.environ.get("JAVA_HOME", ""), "bin", "java")]
    candidates += [shutil.which("java") or "", *sorted(glob.glob("/usr/lib/jvm/*/bin/java"))]
    if not any(c and os.access(c, os.X_OK) and _java_major(c) >= 21 for c in candidates):
        return "needs a JDK 21+ for the Schema Registry (java/registry/README.md)"
    built = (REPO / "java/registry/target/quarkus-app/quarkus-run.jar").exists()
    if not built and shutil.which("mvn") is None:
        return "needs Maven to unpack the Schema Registry (java/registry/registry.sh build)"
    return None


_MISSING = _registry_missing()

pytestmark = [
    pytest.mark.first_pass_only,
    pytest.mark.skipif(not kafka_available(), reason="needs Java and Kafka's jars (./dev kafka)"),
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
]

AVRO_V1 = {
    "type": "record",
    "name": "OrderCreated",
    "namespace": "outbox.test",
    "fields": [{"name": "id", "type": "long"}, {"name": "customer", "type": "string"}],
}
AVRO_V2 = {**AVRO_V1, "fields": [*AVRO_V1["fields"], {"name": "note", "type": ["null", "string"], "default": None}]}
# incompatible with v2 under BACKWARD: a new field without a default
AVRO_BAD = {**AVRO_V1, "fields": [*AVRO_V2["fields"], {"name": "region", "type": "string"}]}
JSON_SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "OrderCreated",
    "type": "object",
    "properties": {"id": {"type": "integer"}, "customer": {"type": "string"}},
    "required": ["id", "customer"],
}


class Registry:
    """The registry process of java/registry/registry.sh, on a fixed port."""

    def __init__(self, state_dir: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.env = {**os.environ, "REGISTRY_STATE_DIR": str(state_dir)}
        self.url = ""
        self.running = False

    def start(self) -> None:
        done = subprocess.run(
            [str(REGISTRY_SH), "start", str(self.port)], env=self.env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-2000:]
        self.url = done.stdout.strip().splitlines()[-1]
        self.running = True

    def stop(self) -> None:
        self.running = False
        subprocess.run([str(REGISTRY_SH), "stop"], env=self.env, capture_output=True, text=True, timeout=60)

    def client(self) -> Any:
        from confluent_kafka.schema_registry import SchemaRegistryClient

        # Bounded calls: a registry that stops answering fails the test, it does not hang it.
        return SchemaRegistryClient({"url": self.url, "timeout": 10})


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    process = Registry(tmp_path_factory.mktemp("registry"))
    process.start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(autouse=True)
def _outbox_table(store: Any) -> Any:
    """Every test's outbox table, migrated."""
    return store


def register(registry: Registry, subject: str, schema: dict[str, Any] | str, schema_type: str) -> int:
    from confluent_kafka.schema_registry import Schema

    text = schema if isinstance(schema, str) else json.dumps(schema)
    return int(registry.client().register_schema(subject, Schema(text, schema_type)))


def enqueue_payloads(dsn: str, table: str, payloads: list[dict[str, Any]]) -> list[int]:
    with psycopg.connect(dsn) as conn, conn.transaction():
        return [
            enqueue(
                conn,
                aggregate_type="order",
                aggregate_id=f"agg-{i}",
                event_type="OrderCreated",
                payload=payload,
                table=table,
            )
            for i, payload in enumerate(payloads)
        ]


def read_raw(bootstrap: str, topic: str, expected: int, timeout_seconds: float = 60.0) -> list[bytes]:
    """The raw values of ``topic`` (one partition-agnostic pass), until ``expected`` arrived."""
    from confluent_kafka import Consumer

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"sr-reader-{time.monotonic_ns()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "log_level": 3,
        }
    )
    values: list[bytes] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + timeout_seconds
        while len(values) < expected and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                continue
            values.append(msg.value())
    finally:
        consumer.close()
    return values


def relay_until(settings: Any, until: Callable[[], bool], message: str, timeout: float = 90) -> None:
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(until, timeout=timeout, message=message)
    finally:
        relay.stop()


def registry_settings(registry: Registry, value_format: str) -> dict[str, dict[str, Any]]:
    return {
        "kafka": {"value_format": value_format},
        "schema_registry": {"url": registry.url, "latest_cache_seconds": 1, "timeout_seconds": 2},
    }


def test_avro_values_in_confluent_wire_format(
    registry: Registry, make_settings: Callable[..., Any], pg_dsn: str, table: str, topic_prefix: str, broker: Any
) -> None:
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    topic = f"{topic_prefix}.order"
    schema_id = register(registry, f"{topic}-value", AVRO_V1, "AVRO")
    payloads = [{"id": i, "customer": f"c{i}"} for i in range(5)]
    ids = enqueue_payloads(pg_dsn, table, payloads)
    relay_until(
        make_settings(**registry_settings(registry, "avro")),
        lambda: len(delivered(pg_dsn, table, ids)) == len(ids),
        "every Avro row delivered",
    )
    raw = read_raw(broker.bootstrap_servers, topic, len(ids))
    assert len(raw) == len(ids)
    deserialize = AvroDeserializer(registry.client())
    ctx = SerializationContext(topic, MessageField.VALUE)
    for value in raw:
        assert value[0] == 0 and int.from_bytes(value[1:5], "big") == schema_id
    got = sorted((deserialize(value, ctx) for value in raw), key=lambda r: r["id"])
    assert got == payloads


def test_json_schema_values_in_confluent_wire_format(
    registry: Registry, make_settings: Callable[..., Any], pg_dsn: str, table: str, topic_prefix: str, broker: Any
) -> None:
    from confluent_kafka.schema_registry.json_schema import JSONDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    topic = f"{topic_prefix}.order"
    schema_id = register(registry, f"{topic}-value", JSON_SCHEMA, "JSON")
    payloads = [{"id": i, "customer": f"c{i}"} for i in range(5)]
    ids = enqueue_payloads(pg_dsn, table, payloads)
    relay_until(
        make_settings(**registry_settings(registry, "json-schema")),
        lambda: len(delivered(pg_dsn, table, ids)) == len(ids),
        "every JSON Schema row delivered",
    )
    raw = read_raw(broker.bootstrap_servers, topic, len(ids))
    assert len(raw) == len(ids)
    deserialize = JSONDeserializer(None, schema_registry_client=registry.client())
    ctx = SerializationContext(topic, MessageField.VALUE)
    for value in raw:
        assert value[0] == 0 and int.from_bytes(value[1:5], "big") == schema_id
    got = sorted((deserialize(value, ctx) for value in raw), key=lambda r: r["id"])
    assert got == payloads


@pytest.mark.parametrize("value_format", ["avro", "json-schema"])
def test_a_row_that_does_not_fit_goes_dead_alone(
    registry: Registry,
    make_settings: Callable[..., Any],
    pg_dsn: str,
    table: str,
    topic_prefix: str,
    broker: Any,
    value_format: str,
) -> None:
    topic = f"{topic_prefix}.order"
    if value_format == "avro":
        register(registry, f"{topic}-value", AVRO_V1, "AVRO")
    else:
        register(registry, f"{topic}-value", JSON_SCHEMA, "JSON")
    payloads = [{"id": 1, "customer": "a"}, {"id": "not a number", "customer": "b"}, {"id": 3, "customer": "c"}]
    ids = enqueue_payloads(pg_dsn, table, payloads)
    good_ids, bad_id = [ids[0], ids[2]], ids[1]
    relay_until(
        make_settings(**registry_settings(registry, value_format)),
        lambda: (
            len(delivered(pg_dsn, table, good_ids)) == 2
            and row_states(pg_dsn, table, [bad_id], ("status",))[bad_id][0] == "dead"
        ),
        "the neighbours delivered and the misfit dead",
    )
    status, last_error = row_states(pg_dsn, table, [bad_id], ("status", "last_error"))[bad_id]
    assert status == "dead"
    assert "does not fit the latest schema" in last_error and f"{topic}-value" in last_error
    assert len(read_raw(broker.bootstrap_servers, topic, 2, timeout_seconds=30)) == 2


def test_rows_wait_while_the_registry_is_down(
    registry: Registry, make_settings: Callable[..., Any], pg_dsn: str, table: str, topic_prefix: str, broker: Any
) -> None:
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    topic = f"{topic_prefix}.order"
    payloads = [{"id": i, "customer": f"c{i}"} for i in range(4)]
    ids = enqueue_payloads(pg_dsn, table, payloads)
    registry.stop()
    relay = Relay(make_settings(**registry_settings(registry, "avro")))
    relay.start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            states = row_states(pg_dsn, table, ids, ("status",))
            # claimed now and then (processing), released again, never delivered nor dead
            assert all(state[0] in ("pending", "processing") for state in states.values()), states
            time.sleep(0.5)
        registry.start()  # an in-memory registry: empty again, the schema is registered anew
        schema_id = register(registry, f"{topic}-value", AVRO_V1, "AVRO")
        wait_for(lambda: len(delivered(pg_dsn, table, ids)) == len(ids), timeout=120, message="all delivered")
    finally:
        relay.stop()
        if not registry.running:  # the next tests need it
            registry.start()
    states = row_states(pg_dsn, table, ids, ("status", "attempts"))
    assert all(state[0] != "dead" for state in states.values())
    raw = read_raw(broker.bootstrap_servers, topic, len(ids))
    deserialize = AvroDeserializer(registry.client())
    ctx = SerializationContext(topic, MessageField.VALUE)
    assert {int.from_bytes(v[1:5], "big") for v in raw} == {schema_id}
    assert sorted((deserialize(v, ctx) for v in raw), key=lambda r: r["id"]) == payloads


def test_missing_subject_defers_the_rows(
    registry: Registry, make_settings: Callable[..., Any], pg_dsn: str, table: str, topic_prefix: str
) -> None:
    ids = enqueue_payloads(pg_dsn, table, [{"id": 1, "customer": "a"}])
    relay = Relay(make_settings(**registry_settings(registry, "avro")))
    relay.start()
    try:
        wait_for(
            lambda: (
                (row_states(pg_dsn, table, ids, ("last_error",))[ids[0]][0] or "").find("no schema registered") >= 0
            ),
            timeout=60,
            message="the row deferred for its missing schema",
        )
    finally:
        relay.stop()
    status, attempts = row_states(pg_dsn, table, ids, ("status", "attempts"))[ids[0]]
    assert status == "pending" and attempts == 0


def test_schema_evolution(
    registry: Registry, make_settings: Callable[..., Any], pg_dsn: str, table: str, topic_prefix: str, broker: Any
) -> None:
    from confluent_kafka.schema_registry import Schema
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.schema_registry.error import SchemaRegistryError
    from confluent_kafka.serialization import MessageField, SerializationContext

    topic = f"{topic_prefix}.order"
    subject = f"{topic}-value"
    client = registry.client()
    register(registry, subject, AVRO_V1, "AVRO")
    client.set_compatibility(subject, "BACKWARD")
    v2_id = register(registry, subject, AVRO_V2, "AVRO")
    with pytest.raises(SchemaRegistryError) as refused:
        client.register_schema(subject, Schema(json.dumps(AVRO_BAD), "AVRO"))
    assert refused.value.http_status_code in (409, 422)
    assert client.get_latest_version(subject).schema_id == v2_id

    payloads = [{"id": 1, "customer": "a", "note": "gift"}, {"id": 2, "customer": "b"}]
    ids = enqueue_payloads(pg_dsn, table, payloads)
    relay_until(
        make_settings(**registry_settings(registry, "avro")),
        lambda: len(delivered(pg_dsn, table, ids)) == len(ids),
        "rows delivered with the new version",
    )
    raw = read_raw(broker.bootstrap_servers, topic, len(ids))
    assert {int.from_bytes(v[1:5], "big") for v in raw} == {v2_id}
    ctx = SerializationContext(topic, MessageField.VALUE)
    got = sorted((AvroDeserializer(client)(v, ctx) for v in raw), key=lambda r: r["id"])
    assert got == [{"id": 1, "customer": "a", "note": "gift"}, {"id": 2, "customer": "b", "note": None}]


def test_schema_files_registered_at_start(
    registry: Registry,
    make_settings: Callable[..., Any],
    pg_dsn: str,
    table: str,
    topic_prefix: str,
    broker: Any,
    tmp_path: Path,
) -> None:
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    topic = f"{topic_prefix}.order"
    subject = f"{topic}-value"
    schema_file = tmp_path / "order.avsc"
    schema_file.write_text(json.dumps(AVRO_V1))
    sections = registry_settings(registry, "avro")
    sections["schema_registry"]["schema_files"] = {subject: str(schema_file)}
    payloads = [{"id": i, "customer": f"c{i}"} for i in range(3)]
    ids = enqueue_payloads(pg_dsn, table, payloads)
    relay_until(make_settings(**sections), lambda: len(delivered(pg_dsn, table, ids)) == len(ids), "rows delivered")
    client = registry.client()
    latest = client.get_latest_version(subject)
    assert latest.version == 1 and json.loads(latest.schema.schema_str)["name"] == "OrderCreated"
    raw = read_raw(broker.bootstrap_servers, topic, len(ids))
    assert {int.from_bytes(v[1:5], "big") for v in raw} == {latest.schema_id}
    ctx = SerializationContext(topic, MessageField.VALUE)
    assert sorted((AvroDeserializer(client)(v, ctx) for v in raw), key=lambda r: r["id"]) == payloads

    # A second start with the same file: no new version.
    more = enqueue_payloads(pg_dsn, table, [{"id": 9, "customer": "z"}])
    relay_until(make_settings(**sections), lambda: len(delivered(pg_dsn, table, more)) == 1, "row delivered")
    assert client.get_versions(subject) == [1]


def test_incompatible_schema_file_stops_the_start(
    registry: Registry,
    make_settings: Callable[..., Any],
    pg_dsn: str,
    table: str,
    topic_prefix: str,
    tmp_path: Path,
) -> None:
    from outbox_relay.errors import ConfigError

    topic = f"{topic_prefix}.order"
    subject = f"{topic}-value"
    client = registry.client()
    register(registry, subject, AVRO_V2, "AVRO")
    client.set_compatibility(subject, "BACKWARD")
    schema_file = tmp_path / "order.avsc"
    schema_file.write_text(json.dumps(AVRO_BAD))
    password_file = tmp_path / "password"
    password_file.write_text("sr-Pa55word-never-shown\n")
    sections = registry_settings(registry, "avro")
    sections["schema_registry"].update(
        schema_files={subject: str(schema_file)},
        basic_auth_user="relay",
        basic_auth_password_file=str(password_file),
    )
    ids = enqueue_payloads(pg_dsn, table, [{"id": 1, "customer": "a"}])
    relay = Relay(make_settings(**sections))
    try:
        with pytest.raises(ConfigError) as refused:
            relay.start()
    finally:
        relay.stop()
    line = str(refused.value)
    print(line)
    assert "\n" not in line and "refused" in line and subject in line and str(schema_file) in line
    assert "409" in line or "422" in line
    assert "sr-Pa55word-never-shown" not in line
    assert client.get_versions(subject) == [1]
    status, attempts = row_states(pg_dsn, table, ids, ("status", "attempts"))[ids[0]]
    assert status == "pending" and attempts == 0


def test_schema_files_wait_for_a_registry_that_does_not_answer(
    make_settings: Callable[..., Any], pg_dsn: str, table: str, topic_prefix: str, tmp_path: Path
) -> None:
    from outbox_relay.errors import OutboxRelayError

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    schema_file = tmp_path / "order.avsc"
    schema_file.write_text(json.dumps(AVRO_V1))
    settings = make_settings(
        kafka={"value_format": "avro"},
        schema_registry={
            "url": f"http://127.0.0.1:{closed_port}/apis/ccompat/v7",
            "timeout_seconds": 1,
            "schema_files": {f"{topic_prefix}.order-value": str(schema_file)},
        },
        relay={"startup_timeout_seconds": 4},
    )
    ids = enqueue_payloads(pg_dsn, table, [{"id": 1, "customer": "a"}])
    relay = Relay(settings)
    try:
        with pytest.raises(OutboxRelayError) as gave_up:
            relay.start()
    finally:
        relay.stop()
    assert "not ready within relay.startup_timeout_seconds" in str(gave_up.value)
    assert "schema registry unreachable" in str(gave_up.value)
    assert row_states(pg_dsn, table, ids, ("status", "attempts"))[ids[0]] == ("pending", 0)


PROTO_ORDER = """syntax = "proto3";
package outbox.test;

import "google/protobuf/timestamp.proto";

message OrderCreated {
  int64 id = 1;
  string customer = 2;
  repeated Line lines = 3;
  google.protobuf.Timestamp placed_at = 4;
  Status status = 5;

  message Line {
    string sku = 1;
    int32 quantity = 2;
  }
}

enum Status {
  STATUS_UNSPECIFIED = 0;
  PLACED = 1;
  PAID = 2;
}

message OrderCancelled {
  int64 id = 1;
  string reason = 2;
}
"""


def generated_module(tmp_path: Path, proto_text: str) -> Any:
    """The reader's own generated Python module of ``proto_text`` (protoc --python_out)."""
    import importlib.util

    import grpc_tools

    source = tmp_path / "reader"
    source.mkdir()
    (source / "order.proto").write_text(proto_text)
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{source}",
            f"-I{include}",
            f"--python_out={source}",
            "order.proto",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    spec = importlib.util.spec_from_file_location("order_pb2", source / "order_pb2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_protobuf_values_in_confluent_wire_format(
    registry: Registry,
    make_settings: Callable[..., Any],
    pg_dsn: str,
    table: str,
    topic_prefix: str,
    broker: Any,
    tmp_path: Path,
) -> None:
    from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext
    from google.protobuf import json_format

    topic = f"{topic_prefix}.order"
    subject = f"{topic}-value"
    proto_file = tmp_path / "order.proto"
    proto_file.write_text(PROTO_ORDER)
    sections = registry_settings(registry, "protobuf")
    sections["schema_registry"]["schema_files"] = {subject: str(proto_file)}
    payloads: list[dict[str, Any]] = [
        {
            "id": i,
            "customer": f"c{i}",
            "lines": [{"sku": "A-1", "quantity": i + 1}],
            "placedAt": "2026-01-02T03:04:05.500Z",
            "status": "PAID",
        }
        for i in range(4)
    ]
    payloads.append({"id": "9007199254740993", "customer": "big id as a string", "status": 1})
    good = enqueue_payloads(pg_dsn, table, payloads)
    misfits = enqueue_payloads(
        pg_dsn,
        table,
        [{"id": 1, "customer": "x", "colour": "red"}, {"id": "not a number", "customer": "y"}, ["not", "an object"]],
    )
    relay_until(
        make_settings(**sections),
        lambda: (
            len(delivered(pg_dsn, table, good)) == len(good)
            and all(state[0] == "dead" for state in row_states(pg_dsn, table, misfits, ("status",)).values())
        ),
        "the Protobuf rows delivered and the misfits dead",
    )
    for _status, last_error in row_states(pg_dsn, table, misfits, ("status", "last_error")).values():
        assert f"does not fit the latest schema of {subject}" in last_error, last_error
    schema_id = registry.client().get_latest_version(subject).schema_id
    raw = read_raw(broker.bootstrap_servers, topic, len(good))
    assert len(raw) == len(good)
    for value in raw:
        # magic byte, schema id, message indexes [0] (the first message: one zero byte)
        assert value[0] == 0 and int.from_bytes(value[1:5], "big") == schema_id and value[5] == 0
    reader = generated_module(tmp_path, PROTO_ORDER)
    deserialize = ProtobufDeserializer(reader.OrderCreated, {"use.deprecated.format": False})
    ctx = SerializationContext(topic, MessageField.VALUE)
    got = sorted((deserialize(value, ctx) for value in raw), key=lambda m: m.id)
    expected = sorted((json_format.ParseDict(p, reader.OrderCreated()) for p in payloads), key=lambda m: m.id)
    assert got == expected
    assert got[0].lines[0].sku == "A-1" and got[0].placed_at.nanos == 500_000_000
    assert got[-1].id == 9007199254740993 and got[-1].status == reader.PLACED


def test_protobuf_message_named_by_the_event_type(
    registry: Registry,
    make_settings: Callable[..., Any],
    pg_dsn: str,
    table: str,
    topic_prefix: str,
    broker: Any,
    tmp_path: Path,
) -> None:
    from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    topic = f"{topic_prefix}.order"
    subject = f"{topic}-value"
    register(registry, subject, PROTO_ORDER, "PROTOBUF")
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        ids = [
            enqueue(
                conn,
                aggregate_type="order",
                aggregate_id="agg-1",
                event_type="outbox.test.OrderCancelled",
                payload={"id": 7, "reason": "changed my mind"},
                table=table,
            )
        ]
    relay_until(
        make_settings(**registry_settings(registry, "protobuf")),
        lambda: len(delivered(pg_dsn, table, ids)) == 1,
        "the row delivered",
    )
    [value] = read_raw(broker.bootstrap_servers, topic, 1)
    assert value[5:7] == b"\x02\x02"  # message indexes [1], zigzag varints: count 1, index 1
    reader = generated_module(tmp_path, PROTO_ORDER)
    got = ProtobufDeserializer(reader.OrderCancelled, {"use.deprecated.format": False})(
        value, SerializationContext(topic, MessageField.VALUE)
    )
    assert (got.id, got.reason) == (7, "changed my mind")


def test_protobuf_rows_wait_while_the_registry_does_not_answer(
    make_settings: Callable[..., Any], pg_dsn: str, table: str
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    ids = enqueue_payloads(pg_dsn, table, [{"id": 1, "customer": "a"}, {"id": 2, "customer": "b"}])
    relay = Relay(
        make_settings(
            kafka={"value_format": "protobuf"},
            schema_registry={"url": f"http://127.0.0.1:{closed_port}/apis/ccompat/v7", "timeout_seconds": 1},
        )
    )
    relay.start()
    try:
        wait_for(
            lambda: all(
                "schema registry unreachable" in (state[0] or "")
                for state in row_states(pg_dsn, table, ids, ("last_error",)).values()
            ),
            timeout=60,
            message="both rows tried",
        )
    finally:
        relay.stop()
    for status, attempts in row_states(pg_dsn, table, ids, ("status", "attempts")).values():
        assert status == "pending" and attempts == 0


def test_a_row_encoded_by_its_writer_is_not_encoded_again(
    registry: Registry, make_settings: Callable[..., Any], pg_dsn: str, table: str, topic_prefix: str, broker: Any
) -> None:
    from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    topic = f"{topic_prefix}.order"
    register(registry, f"{topic}-value", AVRO_V1, "AVRO")
    ctx = SerializationContext(topic, MessageField.VALUE)
    # The writer's own Confluent-framed Avro value, made with the same registry.
    framed = AvroSerializer(registry.client(), None, conf={"auto.register.schemas": False, "use.latest.version": True})(
        {"id": 7, "customer": "writer"}, ctx
    )
    assert framed is not None
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        ids = [
            enqueue(
                conn,
                aggregate_type="order",
                aggregate_id="agg-w",
                event_type="OrderCreated",
                payload=None,
                payload_bytes=framed,
                table=table,
            )
        ]
    ids += enqueue_payloads(pg_dsn, table, [{"id": 8, "customer": "relay"}])
    relay_until(
        make_settings(**registry_settings(registry, "avro")),
        lambda: len(delivered(pg_dsn, table, ids)) == 2,
        "both rows delivered",
    )
    raw = read_raw(broker.bootstrap_servers, topic, 2)
    assert framed in raw
    deserialize = AvroDeserializer(registry.client())
    assert sorted((deserialize(v, ctx) for v in raw), key=lambda r: r["id"]) == [
        {"id": 7, "customer": "writer"},
        {"id": 8, "customer": "relay"},
    ]


def test_protobuf_rows_wait_for_a_subject_that_holds_no_protobuf_schema(
    registry: Registry, make_settings: Callable[..., Any], pg_dsn: str, table: str, topic_prefix: str
) -> None:
    register(registry, f"{topic_prefix}.order-value", AVRO_V1, "AVRO")
    ids = enqueue_payloads(pg_dsn, table, [{"id": 1, "customer": "a"}])
    relay = Relay(make_settings(**registry_settings(registry, "protobuf")))
    relay.start()
    try:
        wait_for(
            lambda: "cannot be used" in (row_states(pg_dsn, table, ids, ("last_error",))[ids[0]][0] or ""),
            timeout=60,
            message="the row deferred",
        )
    finally:
        relay.stop()
    status, attempts, last_error = row_states(pg_dsn, table, ids, ("status", "attempts", "last_error"))[ids[0]]
    assert status == "pending" and attempts == 0
    assert "is AVRO, not PROTOBUF" in last_error
