"""Half-open database connections: the peer's packets vanish, no RST, no FIN.

With the relay's default TCP settings (``database.tcp_user_timeout_ms`` 10 s,
keepalives after 5 s idle, every 2 s, 3 probes) a statement sent into the partition
fails with "Connection timed out" after about ``tcp_user_timeout_ms``, and the idle
LISTEN connection is dropped by its keepalives, instead of waiting for the kernel's
retransmission limit (``tcp_retries2``: about 15 minutes on Linux). ``/readyz`` says
503 within its own probe timeout meanwhile, and the relay resumes after the heal.
"""

from __future__ import annotations

import time

import pytest

from outbox_relay._embedded.embedded import free_port
from outbox_relay.config import DatabaseSettings
from tests.helpers.db import delivered, insert_rows
from tests.helpers.relay_process import RelayProcess
from tests.partition.conftest import Partition, events, report, wait_until

pytestmark = [pytest.mark.partition, pytest.mark.first_pass_only]

DB_ERROR = "database unavailable; backing off"
LISTEN_LOST = "listen connection lost; polling until it is back"


def test_half_open_database_connections_are_dropped_within_the_relays_bound(partition: Partition) -> None:
    net = partition
    defaults = DatabaseSettings()
    port = free_port()
    # The relay's own defaults for every TCP setting (the fixture only shortens the
    # connect timeout, so reconnection attempts into the partition stay short).
    relay = net.start_relay(
        "relay",
        OUTBOX_RELAY_RELAY__WORKERS="2",
        OUTBOX_RELAY_METRICS__ENABLED="true",
        OUTBOX_RELAY_METRICS__HOST="127.0.0.1",
        OUTBOX_RELAY_METRICS__PORT=str(port),
    )
    relay.wait_started()
    readyz = f"http://127.0.0.1:{port}/readyz"
    warm = insert_rows(net.pg_dsn, net.table, 5)
    wait_until(lambda: delivered(net.pg_dsn, net.table, warm) == set(warm), 30, "rows before the cut")
    assert net.host.http_status(readyz) == 200

    net.database.cut()
    cut_at = time.monotonic()
    wait_until(lambda: net.host.http_status(readyz, timeout_seconds=8) == 503, 60, "/readyz 503", interval=0.2)
    readyz_after = time.monotonic() - cut_at
    wait_until(lambda: _timed_out(relay), 120, "a statement failing with a TCP timeout")
    statement_failed_after = time.monotonic() - cut_at
    first_error = _timed_out(relay)[0]
    wait_until(lambda: events(relay, LISTEN_LOST), 120, "the LISTEN connection dropped")
    listen_lost_after = time.monotonic() - cut_at

    net.database.heal()
    healed_at = time.monotonic()
    after = insert_rows(net.pg_dsn, net.table, 5)
    wait_until(lambda: delivered(net.pg_dsn, net.table, after) == set(after), 60, "delivery after the heal")
    resumed_after = time.monotonic() - healed_at

    assert relay.alive()
    assert relay.terminate() == 0
    report(
        "half-open database connection",
        tcp_user_timeout_ms=defaults.tcp_user_timeout_ms,
        keepalives=(
            defaults.tcp_keepalives_idle_seconds,
            defaults.tcp_keepalives_interval_seconds,
            defaults.tcp_keepalives_count,
        ),
        readyz_503_after_seconds=round(readyz_after, 2),
        statement_timed_out_after_seconds=round(statement_failed_after, 2),
        first_timeout=first_error,
        listen_connection_dropped_after_seconds=round(listen_lost_after, 2),
        heal_to_delivery_seconds=round(resumed_after, 2),
    )


def _timed_out(relay: RelayProcess) -> list[str]:
    """Errors of statements whose connection the kernel dropped (TCP user timeout, keepalives)."""
    return [str(e["error"]) for e in relay.events() if "Connection timed out" in str(e.get("error", ""))]
