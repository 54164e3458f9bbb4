"""A relay cut off from the database (packets dropped, no RST) for longer than its
``statement_timeout``, its connect timeout and its pool's wait, once while idle and
once while draining a backlog.

While cut: ``/readyz`` is 503 (it answers, it does not hang with the connection),
``/healthz`` stays 200 (every worker thread is alive: none is stuck). After the heal
the relay delivers again by itself: the rows inserted during the cut and the rest of
the backlog, nothing dead.
"""

from __future__ import annotations

import time

import pytest

from outbox_relay._embedded.embedded import free_port
from tests.helpers.db import assert_delivered, delivered, insert_rows, run_sql
from tests.partition.conftest import Partition, events, report, wait_until

pytestmark = [pytest.mark.partition, pytest.mark.first_pass_only]

STATEMENT_TIMEOUT_MS = 1000
# What a worker, its finalize or the lease keeper logs when a statement fails.
DATABASE_ERRORS = (
    "database unavailable; backing off",
    "finalize failed; retrying",
    "finalize failed; rows will be reclaimed after their lease",
    "lease extension failed",
)
CUT_SECONDS = 7  # > statement_timeout, > connect_timeout (2 s), > the pool's wait (5 s), > tcp_user_timeout


def _cut_and_heal(net: Partition, *, draining: bool) -> dict[str, object]:
    port = free_port()
    relay = net.start_relay(
        "relay",
        OUTBOX_RELAY_RELAY__LEASE_SECONDS="4",
        OUTBOX_RELAY_RELAY__BATCH_SIZE="50",
        # Every worker polls once a second (no LISTEN: a listening relay polls once per
        # process), so the cut is met by claims, and seen as errors, within the cut.
        OUTBOX_RELAY_RELAY__LISTEN_NOTIFY="false",
        OUTBOX_RELAY_DATABASE__STATEMENT_TIMEOUT_MS=str(STATEMENT_TIMEOUT_MS),
        OUTBOX_RELAY_DATABASE__TCP_USER_TIMEOUT_MS="3000",
        OUTBOX_RELAY_METRICS__ENABLED="true",
        OUTBOX_RELAY_METRICS__HOST="127.0.0.1",
        OUTBOX_RELAY_METRICS__PORT=str(port),
    )
    relay.wait_started()
    base = f"http://127.0.0.1:{port}"
    backlog: list[int] = []
    if draining:
        # A slow broker link keeps the relay busy for the whole cut: batches in flight.
        net.broker_proxy.delay_seconds = 0.05
        backlog = insert_rows(net.pg_dsn, net.table, 2000)
        wait_until(lambda: delivered(net.pg_dsn, net.table, backlog[:50]), 30, "draining under way")
    assert net.host.http_status(f"{base}/readyz") == 200

    net.database.cut()
    cut_at = time.monotonic()
    wait_until(
        lambda: net.host.http_status(f"{base}/readyz", timeout_seconds=5) == 503,
        30,
        "/readyz 503 while cut",
        interval=0.3,
    )
    not_ready_after = time.monotonic() - cut_at
    during_cut = insert_rows(net.pg_dsn, net.table, 20)
    time.sleep(max(0.0, CUT_SECONDS - (time.monotonic() - cut_at)))
    readyz_during = net.host.http_status(f"{base}/readyz", timeout_seconds=5)
    healthz_during = net.host.http_status(f"{base}/healthz", timeout_seconds=5)
    errors_during = sum(len(events(relay, name)) for name in DATABASE_ERRORS)

    net.database.heal()
    net.broker_proxy.delay_seconds = 0.0
    healed_at = time.monotonic()
    everything = backlog + during_cut
    wait_until(
        lambda: delivered(net.pg_dsn, net.table, during_cut) == set(during_cut), 120, "the rows inserted during the cut"
    )
    first_rows_after = time.monotonic() - healed_at
    wait_until(lambda: delivered(net.pg_dsn, net.table, everything) == set(everything), 120, "the whole backlog")
    all_after = time.monotonic() - healed_at
    wait_until(lambda: net.host.http_status(f"{base}/readyz") == 200, 30, "/readyz 200 after the heal")
    ready_after = time.monotonic() - healed_at

    assert readyz_during == 503
    assert healthz_during == 200  # every worker thread alive
    assert errors_during > 0  # the workers saw the cut as errors, not a silent hang
    assert_delivered(net.pg_dsn, net.table, everything)
    assert run_sql(net.pg_dsn, net.table, "SELECT count(*) FROM {t} WHERE status = 'dead'")[0][0] == 0
    assert relay.alive()
    assert relay.terminate() == 0
    return {
        "cut_seconds": CUT_SECONDS,
        "statement_timeout_ms": STATEMENT_TIMEOUT_MS,
        "readyz_503_after_seconds": round(not_ready_after, 2),
        "worker_errors_during_cut": errors_during,
        "heal_to_rows_of_the_cut_delivered_seconds": round(first_rows_after, 2),
        "heal_to_everything_delivered_seconds": round(all_after, 2),
        "heal_to_readyz_200_seconds": round(ready_after, 2),
        "backlog_rows": len(backlog),
    }


def test_database_cut_while_idle(partition: Partition) -> None:
    report("database cut while idle", **_cut_and_heal(partition, draining=False))


def test_database_cut_while_draining(partition: Partition) -> None:
    report("database cut while draining", **_cut_and_heal(partition, draining=True))
