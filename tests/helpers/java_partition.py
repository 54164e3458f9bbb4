"""The partition Apache Kafka's Java producer chooses for a key, from Kafka's own jar.

Runs ``tests/helpers/java/JavaPartition.java`` (Java's single-file source launch) on
the kafka-clients classpath the suite already uses for its brokers: what
``BuiltInPartitioner.partitionForKey`` answers, i.e. ``toPositive(murmur2(key)) % n``,
the placement of KafkaProducer, Kafka Connect and Debezium for a non-null key."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from outbox_relay._embedded.kafka import java_binary, kafka_classpath

SOURCE = Path(__file__).with_name("java") / "JavaPartition.java"


def java_partitions(keys: Sequence[bytes], counts: Sequence[int], timeout_seconds: float = 120.0) -> list[list[int]]:
    """For each key, its partition under each of ``counts`` partitions (in that order)."""
    done = subprocess.run(
        [java_binary(), "-Xmx64m", "-XX:+UseSerialGC", "-cp", kafka_classpath(), str(SOURCE), *map(str, counts)],
        input="".join(key.hex() + "\n" for key in keys),
        capture_output=True,
        text=True,
        timeout=timeout_seconds,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"JavaPartition failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    lines = done.stdout.splitlines()
    if len(lines) != len(keys):
        raise RuntimeError(f"JavaPartition answered {len(lines)} lines for {len(keys)} keys")
    return [[int(p) for p in line.split()] for line in lines]
