"""Shared fixtures: a real PostgreSQL and a real Kafka-protocol broker, started here.

- PostgreSQL: ``OUTBOX_RELAY_TEST_DSN`` if set (e.g. the system PostgreSQL 15),
  otherwise an embedded PostgreSQL 18 for the session.
- Kafka: ``OUTBOX_RELAY_TEST_KAFKA`` if set, otherwise an embedded tansu broker.
  Tests that kill or pause the broker start their own (``own_broker``).
- Every test gets its own schema (``table`` = "<schema>.outbox"), dropped after.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_relay.config import Settings, load_settings
from outbox_relay.embedded import EmbeddedBroker, EmbeddedPostgres
from outbox_relay.store import OutboxStore

ROOT = Path(__file__).resolve().parent.parent


class ExternalBroker:
    def __init__(self, bootstrap: str) -> None:
        self.bootstrap_servers = bootstrap


@pytest.fixture(scope="session")
def pg_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    external = os.environ.get("OUTBOX_RELAY_TEST_DSN")
    if external:
        yield external
        return
    # Not under pytest's basetemp: a concurrent pytest run prunes old basetemp dirs.
    server = EmbeddedPostgres().start()
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET max_connections = 300")
        server.stop_server()
        server.start_server()
        yield server.dsn
    finally:
        server.stop()


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    external = os.environ.get("OUTBOX_RELAY_TEST_KAFKA")
    if external:
        yield ExternalBroker(external)
        return
    log_file = tmp_path_factory.mktemp("broker") / "broker.log"
    with EmbeddedBroker(log_file=log_file) as b:
        yield b


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    """A broker this test may kill, pause or restart."""
    b = EmbeddedBroker(log_file=tmp_path / "broker.log").start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def table(pg_dsn: str) -> Iterator[str]:
    schema = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    name = f"{schema}.outbox"
    try:
        yield name
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture
def store(pg_dsn: str, table: str) -> Iterator[OutboxStore]:
    s = OutboxStore(pg_dsn, table, pool_size=8)
    s.open()
    s.migrate()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def topic_prefix() -> str:
    """Unique topic namespace so tests sharing the session broker never mix messages."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def make_settings(pg_dsn: str, table: str, broker: Any, topic_prefix: str) -> Callable[..., Settings]:
    def make(**sections: dict[str, Any]) -> Settings:
        merged: dict[str, dict[str, Any]] = {
            "database": {"dsn": pg_dsn, "table": table},
            "kafka": {"bootstrap_servers": broker.bootstrap_servers,
                      "topic_template": topic_prefix + ".{aggregate_type}"},
            "relay": {"workers": 4, "lease_seconds": 10, "poll_interval_seconds": 0.2},
            "metrics": {"enabled": False},
            "log": {"level": "WARNING", "format": "json"},
        }
        for section, values in sections.items():
            merged.setdefault(section, {}).update(values)
        return load_settings(None, **merged)

    return make


def insert_rows(dsn: str, table: str, n: int, *, aggregate_type: str = "order", aggregates: int = 10,
                event_type: str = "OrderCreated", payload_size: int = 0, **extra: Any) -> list[int]:
    """Insert n rows with enqueue() in one transaction; return their ids."""
    from outbox_relay import enqueue

    ids = []
    with psycopg.connect(dsn) as conn, conn.transaction():
        for i in range(n):
            payload = {"seq": i}
            if payload_size:
                payload["pad"] = "x" * payload_size
            ids.append(enqueue(conn, aggregate_type=aggregate_type, aggregate_id=f"agg-{i % aggregates}",
                               event_type=event_type, payload=payload, table=table, **extra))
    return ids


def rows(dsn: str, table: str, columns: str = "id, status, attempts, lease_version, last_error") -> list[tuple]:
    schema, name = table.split(".")
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f'SELECT {columns} FROM "{schema}"."{name}" ORDER BY id').fetchall()


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
        input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real CLI as a subprocess."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "outbox_relay.cli", *args], env=full_env, capture_output=True,
                          text=True, timeout=timeout, input=input_text)


def cli_env(dsn: str, table: str, bootstrap: str = "127.0.0.1:1", **more: str) -> dict[str, str]:
    env = {
        "OUTBOX_RELAY_DATABASE__DSN": dsn,
        "OUTBOX_RELAY_DATABASE__TABLE": table,
        "OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
        "OUTBOX_RELAY_LOG__FORMAT": "json",
    }
    env.update(more)
    return env


def wait_for(predicate: Callable[[], Any], timeout: float = 90, interval: float = 0.1,
             message: str = "condition") -> Any:
    """Poll until ``predicate()`` is truthy (bounded); a correctness wait, not a timing assertion."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {message}")


def statuses(dsn: str, table: str) -> dict[str, int]:
    """Row count per status."""
    out: dict[str, int] = {}
    for r in rows(dsn, table):
        out[r[1]] = out.get(r[1], 0) + 1
    return out
