"""Relays whose own clock is an hour ahead and an hour behind.

The relays run with their Python wall clock shifted (``tests/helpers/skewed_clock``:
libfaketime hangs librdkafka's timed waits, see there); the CLI commands run under
Debian's ``faketime``.

Every time that decides something comes from the database's clock (``now()`` in the
statements): when a lease expires, when a retried row is due, what ``--since 30m``
means, how old the oldest pending row is. So a relay with a skewed clock

- does not steal a lease that is live by the database's clock (one an hour-ahead
  clock would see as long expired),
- reclaims a lease that expired by the database's clock (one an hour-behind clock
  would see as live for another hour),
- claims with ``lease_until`` = the database's now + the lease (not its own now:
  an hour-behind relay would otherwise take leases that are expired from the start),
- and its CLI filters and ages match the database's clock.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox_relay._embedded.embedded import EmbeddedBroker, EmbeddedUnavailable
from outbox_relay.db.store import OutboxStore
from tests.helpers.cli import ROOT, cli_env
from tests.helpers.db import ON_DONE, delivered, insert_rows, make_row, run_sql
from tests.helpers.net_proxy import TcpProxy
from tests.helpers.relay_process import RelayProcess, relay_env
from tests.partition.conftest import report, wait_until

pytestmark = [pytest.mark.partition, pytest.mark.first_pass_only]

LEASE_SECONDS = 4
SKEWS = {"ahead": "+1h", "behind": "-1h"}
SKEW_SECONDS = {"ahead": 3600, "behind": -3600}
SKEWED_CLOCK = str(ROOT / "tests" / "helpers" / "skewed_clock")


def faketime_prefix(offset: str) -> list[str]:
    return ["faketime", "-f", offset]


@pytest.fixture
def proxied_broker(tmp_path: Path) -> Iterator[tuple[EmbeddedBroker, TcpProxy]]:
    """A broker reached through a proxy on loopback (so a test can hold its answers)."""
    broker = EmbeddedBroker(log_file=tmp_path / "broker.log")
    proxy = TcpProxy("127.0.0.1", broker.port).start()
    broker.advertised_port = proxy.port
    try:
        broker.start()
    except EmbeddedUnavailable as exc:
        proxy.stop()
        pytest.skip(str(exc))
    try:
        yield broker, proxy
    finally:
        broker.stop()
        proxy.stop()


def test_relays_with_skewed_clocks_follow_the_database_clock(
    pg_dsn: str,
    table: str,
    store: OutboxStore,
    topic_prefix: str,
    tmp_path: Path,
    proxied_broker: tuple[EmbeddedBroker, TcpProxy],
) -> None:
    if shutil.which("faketime") is None:
        pytest.skip("no `faketime` (Debian package faketime; ./dev test installs it)")
    broker, proxy = proxied_broker
    # Rows another relay holds, live for a minute by the database's clock.
    live = [
        make_row(
            pg_dsn,
            table,
            status="processing",
            lease_owner="holder",
            lease_seconds=60,
            attempts=1,
            aggregate_id=f"live-{i}",
        )
        for i in range(5)
    ]
    # Rows of a relay that died: the lease expires 2 s from now by the database's clock.
    expiring = [
        make_row(
            pg_dsn,
            table,
            status="processing",
            lease_owner="crashed",
            lease_seconds=2,
            attempts=1,
            aggregate_id=f"exp-{i}",
        )
        for i in range(5)
    ]
    expiring_made_at = time.monotonic()
    pending = insert_rows(pg_dsn, table, 10)

    log_dir = tmp_path / "relays"
    log_dir.mkdir()
    relays = []
    for name in SKEWS:
        env = relay_env(
            PYTHONPATH=SKEWED_CLOCK,
            SKEWED_CLOCK_OFFSET_SECONDS=str(SKEW_SECONDS[name]),
            OUTBOX_RELAY_DATABASE__DSN=pg_dsn,
            OUTBOX_RELAY_DATABASE__TABLE=table,
            OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS=broker.bootstrap_servers,
            OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE=topic_prefix + ".{aggregate_type}",
            OUTBOX_RELAY_RELAY__ON_DONE=ON_DONE,
            OUTBOX_RELAY_RELAY__WORKERS="2",
            OUTBOX_RELAY_RELAY__LEASE_SECONDS=str(LEASE_SECONDS),
            OUTBOX_RELAY_RELAY__OWNER=name,
            OUTBOX_RELAY_RELAY__POLL_INTERVAL_SECONDS="0.2",
            OUTBOX_RELAY_LOG__LEVEL="INFO",
        )
        relays.append(RelayProcess(name, env, log_dir))
    try:
        for relay in relays:
            relay.wait_started()
        wait_until(lambda: delivered(pg_dsn, table, pending) == set(pending), 60, "the pending rows")
        wait_until(
            lambda: delivered(pg_dsn, table, expiring) == set(expiring),
            60,
            "the rows whose lease expired by the database's clock",
        )
        expired_reclaimed_after = time.monotonic() - expiring_made_at

        # The live leases are untouched: same owner, same lease version, still processing.
        held = run_sql(pg_dsn, table, "SELECT status, lease_owner, lease_version FROM {t} WHERE id = ANY(%s)", (live,))
        assert held == [("processing", "holder", 1)] * len(live)

        # What the skewed relays claim is leased until the database's now + the lease.
        proxy.hold_downstream.set()  # the broker's acks wait: the rows stay claimed
        held_back = insert_rows(pg_dsn, table, 20, aggregate_type="held")
        claimed: list[tuple[str, float]] = []

        def held_claims() -> list[tuple[str, float]]:
            claimed[:] = run_sql(
                pg_dsn,
                table,
                "SELECT lease_owner, extract(epoch FROM lease_until - now())::float8 "
                "FROM {t} WHERE id = ANY(%s) AND status = 'processing'",
                (held_back,),
            )
            return claimed

        wait_until(held_claims, 30, "claims held")
        owners = {owner.split(":")[0] for owner, _ in claimed}
        remaining = [seconds for _, seconds in claimed]
        assert owners <= set(SKEWS)
        assert all(0 < seconds <= LEASE_SECONDS for seconds in remaining), remaining
        proxy.hold_downstream.clear()
        wait_until(lambda: delivered(pg_dsn, table, held_back) == set(held_back), 60, "the held rows")
        assert run_sql(pg_dsn, table, "SELECT status, lease_owner FROM {t} WHERE id = ANY(%s)", (live,)) == [
            ("processing", "holder")
        ] * len(live)
        for relay in relays:
            assert relay.alive()
            assert relay.terminate() == 0
    finally:
        for relay in relays:
            relay.kill()

    # The CLI's --since and ages, an hour off either way: still the database's clock.
    dead = make_row(pg_dsn, table, status="dead", attempts=3, last_error="boom", aggregate_id="dead-1")
    make_row(pg_dsn, table, status="pending", aggregate_id="old-1", created_ago_seconds=120)
    ages = {}
    for name, offset in SKEWS.items():
        env = cli_env(pg_dsn, table)
        listed = _cli_with_clock(offset, env, "dead", "list", "--json", "--since", "30m")
        assert [row["id"] for row in json.loads(listed)] == [dead], (name, listed)
        status = json.loads(_cli_with_clock(offset, env, "status", "--json"))
        ages[name] = status["oldest_pending_age_seconds"]
        assert 120 <= ages[name] < 600, (name, status)
    report(
        "clock skew",
        lease_seconds=LEASE_SECONDS,
        expired_lease_reclaimed_after_seconds=round(expired_reclaimed_after, 2),
        lease_remaining_seconds_at_claim=[round(min(remaining), 2), round(max(remaining), 2)],
        oldest_pending_age_seconds=ages,
    )


def _cli_with_clock(offset: str, env: dict[str, str], *args: str) -> str:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}
    full_env.update(env)
    result = subprocess.run(
        [*faketime_prefix(offset), sys.executable, "-m", "outbox_relay.operator.cli", *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout
