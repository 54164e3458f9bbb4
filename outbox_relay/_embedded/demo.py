"""``outbox-relay demo``: the whole path on embedded servers, nothing to install.

Starts an embedded PostgreSQL and the embedded Kafka-protocol broker, migrates,
writes sample events through ``enqueue()``, runs the relay with N workers, reads
every event back from Kafka, prints a summary, and cleans up.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections import Counter

import psycopg
import typer

from ..api import enqueue
from ..config import load_settings
from ..db.store import make_store
from ..observability.logs import configure_logging
from ..runtime.relay import Relay
from .embedded import EmbeddedBroker, EmbeddedPostgres, read_messages

AGGREGATE_TYPES = ("order", "customer", "invoice")
EVENT_TYPES = {
    "order": ("OrderCreated", "OrderPaid", "OrderShipped"),
    "customer": ("CustomerRegistered", "CustomerUpdated"),
    "invoice": ("InvoiceIssued",),
}


def run_demo(*, events: int = 5000, workers: int = 4) -> int:
    say = typer.echo
    configure_logging("WARNING", "console")
    rng = random.Random(42)
    with tempfile.TemporaryDirectory(prefix="outbox-relay-demo-") as tmp:
        say("starting embedded PostgreSQL 18 ...")
        with EmbeddedPostgres(base_dir=tmp) as pg:
            say("starting embedded Kafka-protocol broker (tansu) ...")
            with EmbeddedBroker(log_file=f"{tmp}/broker.log") as broker:
                settings = load_settings(
                    database={"dsn": pg.dsn, "table": "outbox"},
                    kafka={"bootstrap_servers": broker.bootstrap_servers},
                    relay={"workers": workers, "lease_seconds": 30},
                    metrics={"enabled": False},
                )
                store = make_store(settings, pool_size=1)
                with store:
                    store.migrate()
                say(f"writing {events} events through enqueue() ...")
                with psycopg.connect(pg.dsn) as conn:
                    per_tx = 500
                    for start in range(0, events, per_tx):
                        with conn.transaction():
                            for i in range(start, min(events, start + per_tx)):
                                agg_type = AGGREGATE_TYPES[i % len(AGGREGATE_TYPES)]
                                enqueue(
                                    conn,
                                    aggregate_type=agg_type,
                                    aggregate_id=f"{agg_type}-{rng.randrange(100)}",
                                    event_type=rng.choice(EVENT_TYPES[agg_type]),
                                    payload={"seq": i, "amount": rng.randrange(1, 10_000), "note": "demo"},
                                )
                say(f"running the relay with {workers} workers ...")
                relay = Relay(settings)
                started = time.monotonic()
                relay.start()
                counter = make_store(settings, pool_size=1)
                with counter:
                    try:
                        deadline = time.monotonic() + 300
                        while time.monotonic() < deadline:
                            done = counter.exact_depth(budget_ms=5000, statuses=("done",), first_upto=events)["done"]
                            if done.n >= events:
                                break
                            time.sleep(0.05)
                        elapsed = time.monotonic() - started
                    finally:
                        relay.stop()
                    depth: dict[str, int] = {
                        status: count.n
                        for status, count in counter.exact_depth(budget_ms=10_000, first_upto=2 * events).items()
                    }
                topics = [f"outbox.{t}" for t in AGGREGATE_TYPES]
                say("reading every event back from Kafka ...")
                messages = read_messages(broker.bootstrap_servers, topics, expected=events, timeout=60)
                ids = Counter(m["headers"]["message_id"] for m in messages)
                unique = len(ids)
                duplicates = sum(n - 1 for n in ids.values())
                sample = messages[0] if messages else None
                say("")
                say("summary")
                say(f"  events written      {events}")
                say(
                    f"  rows done           {depth.get('done', 0)}  (dead {depth.get('dead', 0)}, "
                    f"pending {depth.get('pending', 0)}, processing {depth.get('processing', 0)})"
                )
                say(f"  delivered (unique)  {unique}")
                say(f"  duplicates          {duplicates}  (at-least-once; consumers dedupe on message_id)")
                say(f"  throughput          {depth.get('done', 0) / elapsed:,.0f} events/s with {workers} workers")
                if sample:
                    say(
                        f"  sample message      topic={sample['topic']} key={sample['key']} "
                        f"headers={json.dumps(sample['headers'])}"
                    )
                ok = unique == events and depth.get("done", 0) == events
                say("demo " + ("succeeded" if ok else "FAILED: not every event was delivered"))
                return 0 if ok else 1
