"""Records read back from a topic with what ``read_messages`` leaves out: the value as
it is on the wire (None for a tombstone) and the record timestamp with its type."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaException, TopicPartition


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, str]
    timestamp_type: int  # confluent_kafka.TIMESTAMP_CREATE_TIME / TIMESTAMP_LOG_APPEND_TIME
    timestamp_ms: int


def read_records(bootstrap: str, topic: str, *, expected: int, timeout_seconds: float = 60.0) -> list[Record]:
    """Every record of ``topic`` from offset 0, until ``expected`` have arrived (or the timeout)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"records-{os.getpid()}-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "log_level": 3,
        }
    )
    try:
        meta = None
        deadline = time.monotonic() + timeout_seconds
        while meta is None and time.monotonic() < deadline:
            try:
                meta = consumer.list_topics(topic, timeout=5).topics.get(topic)
            except KafkaException:
                meta = None
            if meta is not None and not meta.partitions:
                meta = None
        assert meta is not None, f"topic {topic} has no metadata"
        consumer.assign([TopicPartition(topic, p, 0) for p in meta.partitions])
        out: list[Record] = []
        while len(out) < expected and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=500, timeout=0.5):
                if msg.error():
                    continue
                kind, stamp = msg.timestamp()
                out.append(
                    Record(
                        msg.topic(),
                        msg.partition(),
                        msg.offset(),
                        msg.key(),
                        msg.value(),
                        {str(n): (v.decode() if isinstance(v, bytes) else str(v)) for n, v in (msg.headers() or [])},
                        kind,
                        stamp,
                    )
                )
        return out
    finally:
        consumer.close()
