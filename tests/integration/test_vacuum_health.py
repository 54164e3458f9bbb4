"""What holds vacuum of the outbox back, named by the gauge, ``status`` and the log.

Real PostgreSQL: a REPEATABLE READ transaction holding its snapshot, a prepared
transaction left open, a physical replication slot whose standby sends
hot_standby_feedback; and the least-privilege relay role, which cannot see another
role's transaction start until it is granted pg_read_all_stats.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import structlog
from psycopg import sql

from outbox_relay.db.store import OutboxStore
from outbox_relay.db.vacuum_health import NOT_VISIBLE_HINT, HorizonWarning
from outbox_relay.observability.metrics import RelayMetrics, StatsRefresher
from tests.helpers.cli import cli, cli_env
from tests.helpers.db import insert_rows
from tests.helpers.pg_cluster import TempServers, pg_missing_reason
from tests.helpers.wait import wait_for


@pytest.fixture
def snapshot_holder(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A session in a REPEATABLE READ transaction that took its snapshot."""
    conn = psycopg.connect(pg_dsn, application_name="t-snapshot-holder")
    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    conn.execute("SELECT count(*) FROM pg_class").fetchone()
    try:
        yield conn
    finally:
        conn.rollback()
        conn.close()


def _pid(conn: psycopg.Connection[Any]) -> int:
    return int(conn.info.backend_pid)


def _gauge(metrics: RelayMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    assert value is not None
    return value


def test_gauge_status_and_log_name_a_held_snapshot(pg_dsn: str, table: str, store: OutboxStore) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        before = store.xmin_horizon()
        assert all(h.pid != _pid(conn) for h in before.holders)
    holder = psycopg.connect(pg_dsn, application_name="t-snapshot-holder")
    try:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pg_class").fetchone()
        time.sleep(1.1)
        horizon = store.xmin_horizon()
        named = [h for h in horizon.holders if h.pid == _pid(holder)]
        assert named, horizon.holders
        h = named[0]
        assert (h.kind, h.application_name, h.state, h.visible) == (
            "backend",
            "t-snapshot-holder",
            "idle in transaction",
            True,
        )
        assert h.age_seconds is not None and h.age_seconds >= 1.0 and h.xact_start is not None
        assert horizon.holder is not None and horizon.age_seconds >= 1.0

        # The gauge, refreshed on the refresher's schedule, and one warning line.
        metrics = RelayMetrics()
        refresher = StatsRefresher(
            store, metrics, interval_seconds=60, timeout_ms=2000, ordered_types=[], xmin_horizon_warn_seconds=1.0
        )
        with structlog.testing.capture_logs() as logs:
            assert refresher.refresh_once()
            assert refresher.refresh_once()
        assert _gauge(metrics, "outbox_relay_xmin_horizon_age_seconds") >= 1.0
        warnings = [e for e in logs if e["log_level"] == "warning" and "xmin horizon" in e["event"]]
        assert len(warnings) == 1, logs  # once per crossing, not every refresh
        assert str(_pid(holder)) in warnings[0]["holder"]

        # status: human and --json
        env = cli_env(pg_dsn, table)
        doc = json.loads(cli("status", "--json", env=env).stdout)
        pids = [doc["xmin_horizon"]["holder"].get("pid")] + [o.get("pid") for o in doc["xmin_horizon"]["others"]]
        assert _pid(holder) in pids, doc["xmin_horizon"]
        mine = next(
            x for x in [doc["xmin_horizon"]["holder"], *doc["xmin_horizon"]["others"]] if x.get("pid") == _pid(holder)
        )
        assert mine["application_name"] == "t-snapshot-holder" and mine["age_seconds"] >= 1.0
        assert mine["xact_start"] and mine["user"] and mine["state"] == "idle in transaction"
        human = cli("status", env=env)
        assert human.returncode == 0, human.stderr
        assert "xmin horizon" in human.stdout and "t-snapshot-holder" in human.stdout
    finally:
        holder.rollback()
        holder.close()
    # Released: nothing of ours holds it any more; the gauge drops and an info line says so.
    with structlog.testing.capture_logs() as logs:
        refresher.refresh_once()
    remaining = store.xmin_horizon().holders
    assert all(h.pid != _pid(holder) for h in remaining)
    if not remaining:  # a shared server may have other sessions of its own
        assert _gauge(metrics, "outbox_relay_xmin_horizon_age_seconds") == 0.0
        assert any("recent again" in e["event"] for e in logs), logs


def test_vacuum_figures_gauges(pg_dsn: str, table: str, store: OutboxStore) -> None:
    insert_rows(pg_dsn, table, 50)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DELETE FROM {} WHERE id % 2 = 0").format(sql.Identifier(*table.split("."))))
        conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(*table.split("."))))
    figures = store.vacuum_figures()
    assert figures.heap_bytes > 0 and figures.index_bytes > 0
    metrics = RelayMetrics()
    StatsRefresher(store, metrics, interval_seconds=60, timeout_ms=2000, ordered_types=[]).refresh_once()
    assert _gauge(metrics, "outbox_relay_table_size_bytes", part="heap") == figures.heap_bytes
    assert _gauge(metrics, "outbox_relay_table_size_bytes", part="indexes") > 0
    assert _gauge(metrics, "outbox_relay_dead_tuples") >= 0
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM {}").format(sql.Identifier(*table.split("."))))
    # The statistics collector reports the vacuum shortly after it ends.
    deadline = time.monotonic() + 10
    while store.vacuum_figures().since_vacuum_seconds is None and time.monotonic() < deadline:
        time.sleep(0.2)
    after = store.vacuum_figures()
    assert after.since_vacuum_seconds is not None and after.since_vacuum_seconds < 60 and after.vacuums >= 1


def _max_prepared(pg_dsn: str) -> int:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        return int(conn.execute("SHOW max_prepared_transactions").fetchone()[0])  # type: ignore[index]


def test_gauge_and_status_name_a_prepared_transaction(pg_dsn: str, table: str, store: OutboxStore) -> None:
    if _max_prepared(pg_dsn) == 0:
        pytest.skip("max_prepared_transactions = 0 on this server")
    gid = "t-forgotten-" + uuid.uuid4().hex[:8]
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("SELECT pg_current_xact_id()")  # a prepared write holds its xid
        conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    try:
        time.sleep(1.1)
        horizon = store.xmin_horizon()
        prepared = [h for h in horizon.holders if h.gid == gid]
        assert prepared and prepared[0].kind == "prepared" and prepared[0].age_seconds is not None
        assert prepared[0].age_seconds >= 1.0 and prepared[0].prepared_at is not None
        metrics = RelayMetrics()
        StatsRefresher(store, metrics, interval_seconds=60, timeout_ms=2000, ordered_types=[]).refresh_once()
        assert _gauge(metrics, "outbox_relay_xmin_horizon_age_seconds") >= 1.0
        doc = json.loads(cli("status", "--json", env=cli_env(pg_dsn, table)).stdout)
        found = [doc["xmin_horizon"]["holder"], *doc["xmin_horizon"]["others"]]
        assert any(x.get("gid") == gid and x["kind"] == "prepared" for x in found), doc["xmin_horizon"]
        human = cli("status", env=cli_env(pg_dsn, table)).stdout
        assert gid in human and "prepared transaction" in human
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
    assert all(h.gid != gid for h in store.xmin_horizon().holders)


@pytest.fixture
def relay_role(pg_dsn: str, table: str, store: OutboxStore) -> Iterator[str]:
    """A login role with exactly the relay grants that `outbox-relay grants` prints,
    except pg_read_all_stats (the test grants it itself)."""
    role = "t_relay_" + uuid.uuid4().hex[:8]
    printed = cli("grants", "--relay", role, env=cli_env(pg_dsn, table)).stdout
    statements = [line for line in printed.splitlines() if line.startswith("GRANT ")]
    assert f'GRANT pg_read_all_stats TO "{role}";' in statements, printed
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        for statement in statements:
            if "pg_read_all_stats" not in statement:
                conn.execute(statement)
    try:
        yield role
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_least_privilege_role_says_what_it_cannot_see(
    pg_dsn: str, table: str, relay_role: str, snapshot_holder: psycopg.Connection[Any]
) -> None:
    dsn = psycopg.conninfo.make_conninfo(pg_dsn, user=relay_role)
    time.sleep(1.1)
    with OutboxStore(dsn, table, pool_size=1) as relay_store:
        horizon = relay_store.xmin_horizon(limit=50)
        hidden = [h for h in horizon.holders if h.pid == _pid(snapshot_holder)]
        # PostgreSQL shows every role a backend's xmin, but not its transaction start.
        assert hidden, horizon.holders
        assert not hidden[0].visible and hidden[0].age_seconds is None
        assert NOT_VISIBLE_HINT in hidden[0].describe()
        if horizon.holder is hidden[0]:
            assert math.isnan(horizon.age_seconds)  # unknown, never 0
            assert "pg_read_all_stats" in (horizon.note() or "")
            metrics = RelayMetrics()
            StatsRefresher(relay_store, metrics, interval_seconds=60, timeout_ms=2000, ordered_types=[]).refresh_once()
            assert math.isnan(_gauge(metrics, "outbox_relay_xmin_horizon_age_seconds"))
        status = cli("status", "--json", env=cli_env(dsn, table))
        assert status.returncode == 0, status.stderr
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("GRANT pg_read_all_stats TO {}").format(sql.Identifier(relay_role)))
        with OutboxStore(dsn, table, pool_size=1) as granted:
            seen = [h for h in granted.xmin_horizon(limit=50).holders if h.pid == _pid(snapshot_holder)]
        assert seen and seen[0].visible and seen[0].age_seconds is not None and seen[0].age_seconds >= 1.0
        assert seen[0].application_name == "t-snapshot-holder"


def test_warning_is_logged_once_per_crossing() -> None:
    from outbox_relay.db.vacuum_health import XminHolder, XminHorizon

    old = XminHorizon([XminHolder(kind="prepared", horizon_xid="1000", age_xids=5, age_seconds=400.0, gid="g1")])
    young = XminHorizon([XminHolder(kind="prepared", horizon_xid="1000", age_xids=5, age_seconds=4.0, gid="g1")])
    with structlog.testing.capture_logs() as logs:
        warning = HorizonWarning(300.0, structlog.get_logger("t"))
        for horizon in (young, old, old, old, young, old):
            warning.observe(horizon, table="t.outbox")
    levels = [(e["log_level"], e["event"][:20]) for e in logs]
    assert [lvl for lvl, _ in levels] == ["warning", "info", "warning"], levels
    assert logs[0]["holder_gid"] == "g1"


def test_physical_slot_with_hot_standby_feedback_is_named() -> None:
    missing = pg_missing_reason()
    if missing:
        pytest.skip(missing)
    slot = "t_standby_slot"
    with TempServers() as servers:
        primary = (
            servers.server("primary")
            .initdb(settings={"wal_level": "replica", "max_wal_senders": "5", "max_replication_slots": "5"})
            .start()
        )
        primary.execute("SELECT pg_create_physical_replication_slot(%s, true)", (slot,))
        standby = servers.server("standby").basebackup_of(primary, application_name="standby1")
        standby.configure(
            {"primary_slot_name": slot, "hot_standby_feedback": "on", "wal_receiver_status_interval": "1s"}
        )
        standby.start()
        table = "t_slot.outbox"
        primary.execute("CREATE SCHEMA t_slot")
        with OutboxStore(primary.dsn(), table, pool_size=1) as store:
            store.migrate()
            # A standby query holding its snapshot: the feedback pins the slot's xmin.
            with psycopg.connect(standby.dsn(), application_name="t-standby-reader") as reader:
                reader.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                reader.execute("SELECT count(*) FROM pg_class").fetchone()
                for _ in range(5):  # move the primary on: the slot's xmin stays behind
                    primary.execute("SELECT pg_current_xact_id()")

                def slot_named() -> Any:
                    holders = store.xmin_horizon().holders
                    return [h for h in holders if h.kind == "slot" and h.slot_name == slot and h.age_xids >= 5]

                held = wait_for(slot_named, 30, message="the slot's xmin to be reported")
                assert held[0].slot_type == "physical" and held[0].age_seconds is None  # a slot records no time
                metrics = RelayMetrics()
                refresher = StatsRefresher(store, metrics, interval_seconds=60, timeout_ms=2000, ordered_types=[])
                # Counted from when this process first saw the slot at its xmin: the
                # standby's first reports may still move it, so refresh until it holds.
                deadline = time.monotonic() + 20
                refresher.refresh_once()
                while _gauge(metrics, "outbox_relay_xmin_horizon_age_seconds") < 1.0 and time.monotonic() < deadline:
                    time.sleep(0.5)
                    refresher.refresh_once()
                assert _gauge(metrics, "outbox_relay_xmin_horizon_age_seconds") >= 1.0
                doc = json.loads(cli("status", "--json", env=cli_env(primary.dsn(), table)).stdout)
                found = [doc["xmin_horizon"]["holder"], *doc["xmin_horizon"]["others"]]
                slot_doc = next(x for x in found if x.get("slot_name") == slot)
                assert slot_doc["kind"] == "slot" and slot_doc["age_xids"] >= 5 and slot_doc["age_seconds"] is None
                if doc["xmin_horizon"]["holder"] == slot_doc:
                    assert "replication slot" in doc["xmin_horizon"]["note"]
