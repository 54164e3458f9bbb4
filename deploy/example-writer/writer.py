"""Example application for the local stack: writes a business row and its outbox
event in one transaction, in a loop, at a modest rate.

Run by deploy/docker-compose.yml from the relay image (which already has
``outbox_relay`` and psycopg). Settings come from the environment:

    WRITER_DSN              PostgreSQL URI (required)
    WRITER_RATE_PER_SECOND  orders written per second (default 5)
    WRITER_OUTBOX_TABLE     outbox table (default "outbox", same as the relay's)

Each order produces OrderPlaced, then later OrderPaid and OrderShipped on the same
aggregate, so per-aggregate ordering (OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES) can
be tried out. Events go to the relay's default topic, outbox.order.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
import uuid

import psycopg

from outbox_relay import enqueue

log = logging.getLogger("example-writer")

DDL = """
CREATE TABLE IF NOT EXISTS orders (
    id          uuid PRIMARY KEY,
    customer    text NOT NULL,
    amount_cents integer NOT NULL,
    state       text NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
)
"""

_stop = False


def _request_stop(signum: int, _frame: object) -> None:
    global _stop
    _stop = True


def place_order(conn: psycopg.Connection, table: str) -> str:
    order_id = str(uuid.uuid4())
    customer = f"customer-{random.randint(1, 500)}"
    amount = random.randint(100, 50_000)
    with conn.transaction():
        conn.execute(
            "INSERT INTO orders (id, customer, amount_cents, state) VALUES (%s, %s, %s, 'placed')",
            (order_id, customer, amount),
        )
        enqueue(
            conn,
            aggregate_type="order",
            aggregate_id=order_id,
            event_type="OrderPlaced",
            payload={"order_id": order_id, "customer": customer, "amount_cents": amount},
            headers={"source": "example-writer"},
            table=table,
        )
    return order_id


def advance_order(conn: psycopg.Connection, table: str, order_id: str, state: str, event_type: str) -> None:
    with conn.transaction():
        conn.execute("UPDATE orders SET state = %s, updated_at = now() WHERE id = %s", (state, order_id))
        enqueue(
            conn,
            aggregate_type="order",
            aggregate_id=order_id,
            event_type=event_type,
            payload={"order_id": order_id, "state": state},
            headers={"source": "example-writer"},
            table=table,
        )


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    dsn = os.environ["WRITER_DSN"]
    rate = float(os.environ.get("WRITER_RATE_PER_SECOND", "5"))
    table = os.environ.get("WRITER_OUTBOX_TABLE", "outbox")
    interval = 1.0 / rate if rate > 0 else 1.0

    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)

    # autocommit: every unit of work is an explicit conn.transaction() block.
    with psycopg.connect(dsn, autocommit=True) as conn:
        # The compose stack creates "orders" for the writer role, which may not create
        # tables (least privilege); on its own the example creates it.
        if conn.execute("SELECT to_regclass('orders') IS NULL").fetchone()[0]:
            conn.execute(DDL)
        placed: list[str] = []
        paid: list[str] = []
        written = logged = 0
        next_at = time.monotonic()
        while not _stop:
            placed.append(place_order(conn, table))
            written += 1
            # Move some earlier orders along their life cycle.
            if len(placed) > 3 and random.random() < 0.7:
                order_id = placed.pop(0)
                advance_order(conn, table, order_id, "paid", "OrderPaid")
                paid.append(order_id)
                written += 1
            if len(paid) > 3 and random.random() < 0.7:
                advance_order(conn, table, paid.pop(0), "shipped", "OrderShipped")
                written += 1
            if written - logged >= 500:
                log.info("events enqueued so far: %d", written)
                logged = written
            # Fixed rate; after a stall (database down) do not try to catch up.
            next_at = max(next_at + interval, time.monotonic() - interval)
            time.sleep(max(0.0, next_at - time.monotonic()))
    log.info("stopped after %d events", written)


if __name__ == "__main__":
    main()
