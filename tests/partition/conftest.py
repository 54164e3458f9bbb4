"""A relay host of its own per test: a network namespace with a link to the database
and a link to the broker (tests/helpers/netns.py), a broker that advertises the
broker link's address, and helpers to run relays inside the namespace.

The database is the session's (``pg_dsn``), reached from the namespace through a
proxy on the database link's host address. The broker is started here (the fixture's
class), listening on 127.0.0.1 and advertising the proxy on the broker link's host
address, so every connection a relay in the namespace makes to it crosses that link.
The test process itself reaches the broker the same way (its metadata names that
address), so a broker link held or slowed by its proxy holds the test's readers too;
a cut (packets dropped in the link's router) only concerns the namespace.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_relay._embedded.embedded import EmbeddedBroker, EmbeddedUnavailable
from outbox_relay.db.store import OutboxStore
from tests.helpers.db import ON_DONE
from tests.helpers.net_proxy import TcpProxy
from tests.helpers.netns import RelayHost, netns_missing_reason
from tests.helpers.relay_process import RelayProcess, relay_env

pytestmark = pytest.mark.partition

_MISSING: list[str | None] = []


def _missing() -> str | None:
    if not _MISSING:
        _MISSING.append(netns_missing_reason())
    return _MISSING[0]


def with_host(dsn: str, host: str, port: int) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    params.update(host=host, port=str(port))
    params.pop("hostaddr", None)
    return psycopg.conninfo.make_conninfo("", **params)


@dataclass
class Partition:
    host: RelayHost
    broker: EmbeddedBroker
    database_proxy: TcpProxy
    broker_proxy: TcpProxy
    pg_dsn: str  # for the test itself, on loopback
    table: str
    topic_prefix: str
    log_dir: Path
    relays: list[RelayProcess] = field(default_factory=list)

    @property
    def database(self) -> Any:
        return self.host.links["database"]

    @property
    def broker_link(self) -> Any:
        return self.host.links["broker"]

    @property
    def relay_dsn(self) -> str:
        """The DSN a relay inside the namespace uses: across the database link."""
        return with_host(self.pg_dsn, self.database.host_address, self.database_proxy.port)

    @property
    def relay_bootstrap(self) -> str:
        return self.broker_proxy.address

    def relay_settings(self, **overrides: str) -> dict[str, str]:
        env = {
            "OUTBOX_RELAY_DATABASE__DSN": self.relay_dsn,
            "OUTBOX_RELAY_DATABASE__TABLE": self.table,
            "OUTBOX_RELAY_DATABASE__CONNECT_TIMEOUT_SECONDS": "2",
            "OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS": self.relay_bootstrap,
            "OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE": self.topic_prefix + ".{aggregate_type}",
            "OUTBOX_RELAY_RELAY__ON_DONE": ON_DONE,
            "OUTBOX_RELAY_RELAY__WORKERS": "2",
            "OUTBOX_RELAY_RELAY__LEASE_SECONDS": "4",
            "OUTBOX_RELAY_RELAY__POLL_INTERVAL_SECONDS": "0.2",
            "OUTBOX_RELAY_RELAY__BACKOFF_BASE_SECONDS": "0.05",
            "OUTBOX_RELAY_RELAY__BACKOFF_CAP_SECONDS": "1",
            "OUTBOX_RELAY_RELAY__SHUTDOWN_TIMEOUT_SECONDS": "3",
            "OUTBOX_RELAY_LOG__LEVEL": "INFO",
        }
        env.update(overrides)
        return relay_env(**env)

    def start_relay(self, name: str, *, inside: bool = True, **overrides: str) -> RelayProcess:
        """A relay inside the namespace (``inside``), or on the host with loopback addresses."""
        env = self.relay_settings(**overrides)
        if not inside:
            env["OUTBOX_RELAY_DATABASE__DSN"] = overrides.get("OUTBOX_RELAY_DATABASE__DSN", self.pg_dsn)
            env["OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS"] = self.broker.bootstrap_servers
        relay = RelayProcess(name, env, self.log_dir, prefix=self.host.prefix if inside else ())
        self.relays.append(relay)
        return relay

    def topic(self, aggregate_type: str = "order") -> str:
        return f"{self.topic_prefix}.{aggregate_type}"


@pytest.fixture
def partition(pg_dsn: str, table: str, store: OutboxStore, topic_prefix: str, tmp_path: Path) -> Iterator[Partition]:
    """``store``: the table, migrated in the suite's ``relay.on_done`` mode."""
    missing = _missing()
    if missing:
        pytest.skip(missing)
    with RelayHost(("database", "broker")) as host:
        database_proxy = host.links["database"].forward(_loopback_target(pg_dsn))
        broker = EmbeddedBroker(log_file=tmp_path / "broker.log")
        broker_proxy = host.links["broker"].forward(f"127.0.0.1:{broker.port}")
        broker.advertised_host, broker.advertised_port = host.links["broker"].host_address, broker_proxy.port
        try:
            broker.start()
        except EmbeddedUnavailable as exc:
            pytest.skip(str(exc))
        log_dir = tmp_path / "relays"
        log_dir.mkdir()
        net = Partition(host, broker, database_proxy, broker_proxy, pg_dsn, table, topic_prefix, log_dir)
        try:
            yield net
        finally:
            host.heal_all()
            for relay in net.relays:
                relay.kill()
            broker.stop()


def _loopback_target(dsn: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    host = str(params.get("host") or "/var/run/postgresql").split(",")[0]
    if host == "localhost":
        host = "127.0.0.1"
    return f"{host}:{params.get('port') or 5432}"


def events(relay: RelayProcess, name: str) -> list[dict[str, Any]]:
    return [e for e in relay.events() if e.get("event") == name]


def wait_until(predicate: Callable[[], Any], timeout_seconds: float, message: str, interval: float = 0.05) -> float:
    """Poll until truthy; returns the seconds it took (a measurement, never asserted on)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_seconds:
        if predicate():
            return time.monotonic() - started
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout_seconds:.0f}s waiting for {message}")


def report(name: str, **figures: Any) -> None:
    """One line of measurements for the docs (shown with pytest -s or -rA)."""
    print(f"\nMEASURED {name}: {json.dumps(figures, default=str)}")
