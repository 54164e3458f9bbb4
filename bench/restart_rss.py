#!/usr/bin/env python3
"""RSS of the relay's Kafka publisher across broker restarts (the soak section of docs/benchmarks/tansu-2core.md).

In this process: the relay's ``KafkaPublisher`` (settings as the relay builds them)
against the embedded broker on S3 storage. Each round submits 4 batches of 1 000
messages, SIGKILLs the broker 20 ms later, starts it again 3 s later on the same
storage and, with ``--replace``, has the publisher replace its producer at once (as
after a delivery timeout: the old producer's messages are purged and judged one by
one through the isolation producer); then publishes until a batch is delivered whole.
After each round: RSS, threads of the process, live confluent_kafka Producer objects.

    .venv/bin/python bench/restart_rss.py --restarts 12 --replace
    MALLOC_ARENA_MAX=2 .venv/bin/python bench/restart_rss.py --restarts 12 --replace
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

from confluent_kafka import Producer

from outbox_relay._embedded.embedded import EmbeddedBroker, EmbeddedObjectStore
from outbox_relay.config import load_settings
from outbox_relay.publisher import Message
from outbox_relay.publishers.kafka import from_settings


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--restarts", type=int, default=12)
    parser.add_argument("--replace", action="store_true", help="replace the producer after each restart")
    args = parser.parse_args()
    seq = 0

    def batch() -> list[Message]:
        nonlocal seq
        out = []
        for _ in range(1000):
            seq += 1
            out.append(
                Message(
                    id=seq,
                    topic="rss",
                    key=f"agg-{seq % 500}",
                    value=json.dumps({"seq": seq, "note": "x" * 100}),
                    headers=[("message_id", str(seq))],
                    aggregate_type="order",
                    aggregate_id=str(seq),
                    event_type="OrderCreated",
                )
            )
        return out

    def sample(step: int, **more: object) -> None:
        gc.collect()
        print(
            json.dumps(
                {
                    "restart": step,
                    "rss_mb": rss_mb(),
                    "threads": len(os.listdir("/proc/self/task")),
                    "live_producers": sum(1 for o in gc.get_objects() if isinstance(o, Producer)),
                    **more,
                }
            ),
            flush=True,
        )

    with EmbeddedObjectStore() as storage:
        broker = EmbeddedBroker(storage=storage).start()
        try:
            settings = load_settings(
                None,
                database={"dsn": "postgresql://unused@127.0.0.1/unused", "table": "t"},
                kafka={"bootstrap_servers": broker.bootstrap_servers, "topic_template": "rss"},
                relay={"lease_seconds": 10},
            )
            publisher = from_settings(settings)
            publisher.start()
            timeout = publisher.publish_timeout_seconds(10)
            for _ in range(5):
                publisher.publish_batch(batch(), timeout_seconds=timeout)
            sample(0)
            for step in range(1, args.restarts + 1):
                pending = [publisher.submit(batch(), timeout_seconds=timeout) for _ in range(4)]
                time.sleep(0.02)
                broker.kill()
                time.sleep(3)
                broker.start()
                if args.replace:
                    publisher.request_replacement("bench: as after a delivery timeout")
                for p in pending:
                    p.wait()
                for _ in range(10):
                    if all(o is None for o in publisher.publish_batch(batch(), timeout_seconds=timeout)):
                        break
                sample(
                    step, producer_generation=publisher.generation, isolated_total=publisher.isolation.isolated_total
                )
            publisher.close()
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
