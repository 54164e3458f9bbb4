"""Shared fixtures: a real PostgreSQL and a real Kafka broker, started here.

- PostgreSQL: ``OUTBOX_RELAY_TEST_DSN`` if set (e.g. the system PostgreSQL 15),
  otherwise an embedded PostgreSQL 18 for the session.
- Kafka: ``OUTBOX_RELAY_TEST_KAFKA`` (bootstrap servers) if set, otherwise Apache Kafka
  (``outbox_relay._embedded.kafka``, jars fetched by ``./dev``): one broker for the
  session (``broker``); tests that kill, pause or restart a broker start their own
  (``own_broker``, whose log is on disk, so ``durable_broker`` is the same thing).
  ``OUTBOX_RELAY_TEST_BROKER=tansu`` runs them on the embedded tansu broker instead (a
  machine without Java). ``tansu_broker`` / ``tansu_durable_broker`` are tansu always:
  for the tests of what only tansu has (schema-validating topics, its S3 storage).
- Every test gets its own schema (``table`` = "<schema>.outbox"), dropped after.
- ``OUTBOX_RELAY_TEST_ON_DONE`` (keep | delete, default keep): the ``relay.on_done``
  mode ``store`` migrates the table to and ``make_settings`` configures (the two must
  agree: ``run`` refuses a table set up for the other mode). ``./dev test`` runs the
  tests that depend on it once more in delete mode.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_relay._embedded.embedded import EmbeddedBroker, EmbeddedObjectStore, EmbeddedPostgres
from outbox_relay._embedded.kafka import KafkaBroker
from outbox_relay.config import Settings, load_settings
from outbox_relay.db.store import OutboxStore
from tests.helpers.db import DELETE_MODE, ON_DONE


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM ends the run as Ctrl-C does: pytest stops and the fixtures' teardown stops
    the servers they started (``./dev test`` stops its background passes that way, as
    they ignore SIGINT)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


# The directories whose files take minutes each (brokers and clusters started, killed
# and healed, namespaces cut, servers built) run first: ``./dev test`` hands the first
# pass's files to pytest-xdist workers in this order, and a long file handed out last
# would run on alone while the other workers sit idle.
SLOW_DIRECTORIES_FIRST = ("chaos", "kafka", "partition", "trust")


def _run_rank(item: pytest.Item) -> int:
    parts = Path(str(item.path)).relative_to(Path(__file__).parent).parts
    top = parts[0] if len(parts) > 1 else ""
    return SLOW_DIRECTORIES_FIRST.index(top) if top in SLOW_DIRECTORIES_FIRST else len(SLOW_DIRECTORIES_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow directories first (``SLOW_DIRECTORIES_FIRST``; a stable sort, so each
    file's tests keep their order). In delete mode (OUTBOX_RELAY_TEST_ON_DONE=delete)
    only tests with a table (the ``table`` fixture) run: one without a table (bad
    settings, an unreachable database) cannot depend on relay.on_done and ran already
    in the keep-mode pass."""
    items.sort(key=_run_rank)
    if not DELETE_MODE:
        return
    selected = [item for item in items if "table" in getattr(item, "fixturenames", ())]
    deselected = [item for item in items if "table" not in getattr(item, "fixturenames", ())]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


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
            # Prepared transactions hold back vacuum like open ones (tests/integration/test_vacuum_health.py).
            conn.execute("ALTER SYSTEM SET max_prepared_transactions = 10")
        server.stop_server()
        server.start_server()
        yield server.dsn
    finally:
        server.stop()


# Auto-created topics get several partitions, so per-key ordering is exercised.
TEST_BROKER_PROPERTIES = {"num.partitions": 4}


def _on_tansu() -> bool:
    return os.environ.get("OUTBOX_RELAY_TEST_BROKER", "kafka").lower() == "tansu"


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The session's broker (Apache Kafka, one node): never killed or paused by a test."""
    external = os.environ.get("OUTBOX_RELAY_TEST_KAFKA")
    if external:
        yield ExternalBroker(external)
        return
    log_file = tmp_path_factory.mktemp("broker") / "broker.log"
    if _on_tansu():
        with EmbeddedBroker(log_file=log_file) as tansu:
            yield tansu
        return
    # Data directory outside pytest's basetemp (a concurrent pytest run prunes it).
    node = KafkaBroker(log_file=log_file, properties=TEST_BROKER_PROPERTIES).start()
    try:
        yield node
    finally:
        node.remove()  # SIGTERM: a clean exit (which also writes the class-data archive once)


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[KafkaBroker | EmbeddedBroker]:
    """An Apache Kafka broker this test may kill, pause or restart (its log is on disk:
    a restarted broker serves what it acknowledged). A start costs seconds: tests that
    do not stop the broker use ``broker``."""
    if _on_tansu():
        tansu = EmbeddedBroker(log_file=tmp_path / "broker.log").start()
        try:
            yield tansu
        finally:
            tansu.stop()
        return
    node = KafkaBroker(log_file=tmp_path / "broker.log", properties=TEST_BROKER_PROPERTIES).start()
    try:
        yield node
    finally:
        node.kill()  # nothing to keep
        node.remove()


@pytest.fixture
def durable_broker(tmp_path: Path) -> Iterator[KafkaBroker | EmbeddedBroker]:
    """A broker this test may kill or restart that still serves, after the restart,
    whatever it acknowledged before: Apache Kafka keeps its log on disk (tansu: on S3)."""
    if _on_tansu():
        with EmbeddedObjectStore(log_file=tmp_path / "object-store.log") as storage:
            tansu = EmbeddedBroker(log_file=tmp_path / "broker.log", storage=storage).start()
            try:
                yield tansu
            finally:
                tansu.stop()
        return
    node = KafkaBroker(log_file=tmp_path / "broker.log", properties=TEST_BROKER_PROPERTIES).start()
    try:
        yield node
    finally:
        node.kill()
        node.remove()


@pytest.fixture
def tansu_durable_broker(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    """The embedded tansu broker on S3 storage (a local object store), for the tests of
    tansu's own storage: its producer sequences live in an object a test can rewrite."""
    with EmbeddedObjectStore(log_file=tmp_path / "object-store.log") as storage:
        tansu = EmbeddedBroker(log_file=tmp_path / "broker.log", storage=storage).start()
        try:
            yield tansu
        finally:
            tansu.stop()


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
    s.migrate(on_done=ON_DONE)
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
            "kafka": {
                "bootstrap_servers": broker.bootstrap_servers,
                "topic_template": topic_prefix + ".{aggregate_type}",
            },
            "relay": {"workers": 4, "lease_seconds": 10, "poll_interval_seconds": 0.2, "on_done": ON_DONE},
            "metrics": {"enabled": False},
            "log": {"level": "WARNING", "format": "json"},
        }
        for section, values in sections.items():
            merged.setdefault(section, {}).update(values)
        return load_settings(None, **merged)

    return make
