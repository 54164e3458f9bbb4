"""The relay behind a real PgBouncer in ``pool_mode = transaction`` (database.transaction_pooler).

Each test starts its own pgbouncer (Debian's package; ``./dev test`` installs it) in
front of the session's PostgreSQL with a stock configuration: only the listen port,
trust authentication of the one user and ``pool_mode = transaction`` are set. In
particular ``ignore_startup_parameters`` is not, so a client sending the
``options`` startup parameter is refused, and server connections are shared by
transaction, so a prepared statement or a session setting would leak or vanish.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_relay import enqueue
from outbox_relay._embedded.embedded import EmbeddedPgBouncer, read_messages
from outbox_relay.db.store import OutboxStore
from outbox_relay.errors import CommitOutcomeUnknown, DatabaseUnavailable
from outbox_relay.runtime.relay import Relay
from tests.helpers.cli import cli, cli_env
from tests.helpers.db import insert_rows, make_row, run_sql, statuses, wait_for

# Exercises the broker, processes or external tools rather than PostgreSQL's SQL:
# ./dev runs it on the first pass only (see pyproject.toml markers).
pytestmark = [pytest.mark.first_pass_only, pytest.mark.timeout(300)]


@pytest.fixture
def pgbouncer(pg_dsn: str, tmp_path: Path) -> Iterator[EmbeddedPgBouncer]:
    if EmbeddedPgBouncer.binary() is None:
        pytest.skip("pgbouncer is not installed (Debian package 'pgbouncer'; ./dev test installs it when run as root)")
    with EmbeddedPgBouncer(pg_dsn, log_file=tmp_path / "pgbouncer.log") as bouncer:
        yield bouncer


def pooler_store(proxy_dsn: str, table: str, **kwargs: Any) -> OutboxStore:
    return OutboxStore(proxy_dsn, table, pool_size=3, transaction_pooler=True, **kwargs)


def _migrate_direct(pg_dsn: str, table: str, *, notify_trigger: bool = True) -> None:
    with OutboxStore(pg_dsn, table, pool_size=1) as store:
        store.migrate(notify_trigger=notify_trigger)


class _TableLock:
    """ACCESS EXCLUSIVE on the outbox table from a direct connection: every relay
    statement on it waits (a stand-in for any statement that runs too long)."""

    def __init__(self, dsn: str, table: str) -> None:
        self._conn = psycopg.connect(dsn)
        schema, name = table.split(".")
        self._conn.execute(f'LOCK TABLE "{schema}"."{name}" IN ACCESS EXCLUSIVE MODE')

    def waiting_backends(self) -> list[int]:
        rows = self._conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        ).fetchall()
        return [r[0] for r in rows]

    def release(self) -> None:
        self._conn.rollback()
        self._conn.close()


def test_stock_pgbouncer_refuses_the_direct_mode_startup_options(pgbouncer, pg_dsn, table):
    """The reason for the mode: a direct-mode store sends statement_timeout as a startup option."""
    _migrate_direct(pg_dsn, table)
    direct_mode = OutboxStore(pgbouncer.dsn, table, pool_size=1, connect_timeout_seconds=1)
    with pytest.raises(DatabaseUnavailable, match="unsupported startup parameter: options"):
        direct_mode.open()
    with pooler_store(pgbouncer.dsn, table) as store:
        assert store.table_exists()


def test_statement_over_the_timeout_is_cancelled_and_nothing_leaks(pgbouncer, pg_dsn, table):
    _migrate_direct(pg_dsn, table)
    make_row(pg_dsn, table)
    with pooler_store(pgbouncer.dsn, table, statement_timeout_ms=300) as store:
        # Many statements, more than psycopg's prepare threshold: none may fail.
        for _ in range(12):
            store.statuses([1, 2, 3])
        lock = _TableLock(pg_dsn, table)
        try:
            # An autocommit statement, a multi-statement transaction (the ordered
            # claim) and the first statement of a transaction (stats) are all bounded.
            for what, call in (
                ("claim", lambda: store.claim(owner="t", batch=5, lease_seconds=30, max_attempts=5)),
                (
                    "claim",
                    lambda: store.claim(
                        owner="t", batch=5, lease_seconds=30, max_attempts=5, ordered_types=["OrderCreated"]
                    ),
                ),
                ("finalize", lambda: store.mark_done([(1, 1)])),
                ("stats", lambda: store.stats()),
            ):
                started = time.monotonic()
                with pytest.raises(DatabaseUnavailable, match=f"{what}: canceling statement due to statement timeout"):
                    call()
                assert time.monotonic() - started < 5.0  # cancelled, not waiting for the lock
        finally:
            lock.release()
        claimed = store.claim(owner="t", batch=5, lease_seconds=30, max_attempts=5)
        assert [c.id for c in claimed.rows] == [1]
    # The timeout was transaction-local: a plain client of the same proxy never sees
    # it, and no prepared statement was left on any server connection.
    with psycopg.connect(pgbouncer.dsn, autocommit=True, prepare_threshold=None) as plain:
        for _ in range(5):
            assert plain.execute("SHOW statement_timeout").fetchone()[0] != "300ms"
            assert plain.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()[0] == 0


@pytest.mark.parametrize("ordered", [False, True], ids=["one-statement claim", "ordered claim transaction"])
def test_claim_whose_connection_breaks_reports_unknown_outcome(pgbouncer, pg_dsn, table, ordered):
    """CommitOutcomeUnknown (never publish) when the server connection dies mid-claim."""
    _migrate_direct(pg_dsn, table)
    insert_rows(pg_dsn, table, 3)
    with pooler_store(pgbouncer.dsn, table) as store:
        lock = _TableLock(pg_dsn, table)
        outcome: dict[str, BaseException] = {}

        def claim() -> None:
            try:
                store.claim(
                    owner="t", batch=5, lease_seconds=30, max_attempts=5, ordered_types=["*"] if ordered else []
                )
            except BaseException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=claim)
        thread.start()
        try:
            backends = wait_for(lock.waiting_backends, timeout=20, message="claim waiting for the lock")
            run_sql(pg_dsn, table, "SELECT pg_terminate_backend(%s)", (backends[0],))
            thread.join(timeout=20)
        finally:
            lock.release()
        assert isinstance(outcome.get("error"), CommitOutcomeUnknown), outcome
        assert statuses(pg_dsn, table) == {"pending": 3}
        # The pool replaces the broken connection: the next claim works.
        assert len(store.claim(owner="t", batch=5, lease_seconds=30, max_attempts=5).rows) == 3


def _relay_env(proxy_dsn: str, table: str, bootstrap: str, topic_prefix: str, **more: str) -> dict[str, str]:
    return cli_env(
        proxy_dsn,
        table,
        bootstrap,
        OUTBOX_RELAY_DATABASE__TRANSACTION_POOLER="true",
        OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE=topic_prefix + ".{aggregate_type}",
        OUTBOX_RELAY_METRICS__PORT="0",
        OUTBOX_RELAY_METRICS__REFRESH_INTERVAL_SECONDS="0.5",
        OUTBOX_RELAY_RELAY__POLL_INTERVAL_SECONDS="0.2",
        OUTBOX_RELAY_RELAY__LEASE_SECONDS="15",
        OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES='["Ordered"]',
        **more,
    )


def test_relay_through_pgbouncer_delivers_every_row_without_a_warning(pgbouncer, pg_dsn, table, broker, topic_prefix):
    env = _relay_env(pgbouncer.dsn, table, broker.bootstrap_servers, topic_prefix)
    migrated = cli("migrate", env=_direct(env, pg_dsn))
    assert migrated.returncode == 0, migrated.stderr
    # The application writes through the proxy too: enqueue() with ordered=True
    # (transaction-scoped advisory lock) and dedup_key, several transactions on one
    # connection (psycopg must not prepare statements there either).
    ids: set[int] = set()
    with psycopg.connect(pgbouncer.dsn, prepare_threshold=None) as app:
        for txn in range(20):
            with app.transaction():
                for i in range(10):
                    n = txn * 10 + i
                    ids.add(
                        enqueue(
                            app,
                            aggregate_type="order",
                            aggregate_id=f"a-{n % 7}",
                            event_type="Ordered" if n % 2 else "Plain",
                            payload={"n": n},
                            table=table,
                            ordered=bool(n % 2),
                            dedup_key=f"k-{n}",
                        )
                    )
        with app.transaction():
            duplicate = enqueue(
                app,
                aggregate_type="order",
                aggregate_id="a-0",
                event_type="Plain",
                payload={"n": 0},
                table=table,
                dedup_key="k-0",
            )
    assert duplicate.duplicate and duplicate in ids and len(ids) == 200

    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox_relay.operator.cli", "run", "--workers", "3"],
        env={**{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: statuses(pg_dsn, table) == {"done": 200}, timeout=90, message="all rows done")
        time.sleep(1.5)  # idle polling and a few gauge refreshes through the proxy
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(records) == len(lines), f"non-JSON log lines: {[x for x in lines if not x.startswith('{')]}"
    bad = [r for r in records if r.get("level") in ("warning", "error", "critical", "exception")]
    assert bad == []
    polling = [r for r in records if "no LISTEN" in r["event"]]
    assert len(polling) == 1 and polling[0]["level"] == "info"

    messages = read_messages(broker.bootstrap_servers, [f"{topic_prefix}.order"], expected=200, timeout=60)
    assert {int(m["headers"]["message_id"]) for m in messages} == ids


def _direct(env: dict[str, str], direct_dsn: str) -> dict[str, str]:
    """The same settings on a direct connection (what migrate needs)."""
    return dict(env, OUTBOX_RELAY_DATABASE__DSN=direct_dsn, OUTBOX_RELAY_DATABASE__TRANSACTION_POOLER="false")


def test_every_command_works_through_pgbouncer(pgbouncer, pg_dsn, table):
    env = cli_env(pgbouncer.dsn, table, OUTBOX_RELAY_DATABASE__TRANSACTION_POOLER="true")
    # migrate needs a session (a session advisory lock, CREATE INDEX CONCURRENTLY
    # without a statement timeout): through the pooler it says so in one line.
    refused = cli("migrate", env=env)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "migrate needs a direct connection" in lines[0]
    assert cli("migrate", env=_direct(env, pg_dsn)).returncode == 0
    dead = [make_row(pg_dsn, table, status="dead", attempts=3, last_error="boom") for _ in range(3)]
    make_row(pg_dsn, table, status="done")
    run_sql(pg_dsn, table, "UPDATE {t} SET done_at = now() - interval '2 hours' WHERE status = 'done'")
    results = {
        "status": cli("status", "--json", env=env),
        "dead list": cli("dead", "list", "--json", env=env),
        "dead retry": cli("dead", "retry", str(dead[0]), env=env),
        "dead skip": cli("dead", "skip", str(dead[1]), "--reason", "test", env=env),
        "dead retry --all": cli("dead", "retry", "--all", env=env),
        "purge": cli("purge", "--older-than", "1h", env=env),
    }
    for name, result in results.items():
        assert result.returncode == 0 and result.stderr == "", (name, result.stderr)
    assert json.loads(results["status"].stdout)["queue_depth"]["dead"] == 3
    assert [r["id"] for r in json.loads(results["dead list"].stdout)] == dead
    assert "retried 1 dead rows" in results["dead retry"].stdout
    assert "skipped 1 dead rows" in results["dead skip"].stdout
    assert "retried 1 dead rows" in results["dead retry --all"].stdout
    assert "purged 1 done rows" in results["purge"].stdout
    assert statuses(pg_dsn, table) == {"pending": 2, "done": 1}


def test_listen_dsn_wakes_workers_past_the_proxy(pgbouncer, pg_dsn, table, make_settings):
    """With listen_dsn the insert -> ack latency is a wake-up's, not the poll interval's
    (a correctness bound, not a benchmark: polling every 5 s could not meet it)."""
    _migrate_direct(pg_dsn, table)
    settings = make_settings(
        database={"dsn": pgbouncer.dsn, "transaction_pooler": True, "listen_dsn": pg_dsn},
        relay={"poll_interval_seconds": 5.0, "workers": 2},
    )
    relay = Relay(settings)
    relay.start()
    try:
        assert relay._listener is not None
        schema, name = table.split(".")
        idle = f'SELECT relays_idle FROM "{schema}"."{name}_relay_state"'
        wait_for(lambda: run_sql(pg_dsn, table, idle) == [(True,)], timeout=20, message="relays marked idle")
        for _ in range(3):
            [row_id] = insert_rows(pg_dsn, table, 1)
            wait_for(
                lambda rid=row_id: run_sql(
                    pg_dsn, table, "SELECT 1 FROM {t} WHERE id = %s AND status = 'done'", (rid,)
                ),
                timeout=15,
                message=f"row {row_id} done",
            )
            [(seconds,)] = run_sql(
                pg_dsn,
                table,
                "SELECT extract(epoch FROM done_at - created_at)::float8 FROM {t} WHERE id = %s",
                (row_id,),
            )
            assert seconds < 2.0, f"row {row_id} took {seconds:.2f}s: woken by polling, not by NOTIFY"
            wait_for(lambda: run_sql(pg_dsn, table, idle) == [(True,)], timeout=20, message="idle again")
    finally:
        relay.stop()


def test_pooler_without_listen_dsn_never_listens(pgbouncer, pg_dsn, table, make_settings):
    _migrate_direct(pg_dsn, table)
    settings = make_settings(database={"dsn": pgbouncer.dsn, "transaction_pooler": True})
    assert settings.relay.listen_notify and not settings.listens_for_wakeups
    with pooler_store(pgbouncer.dsn, table) as store:
        assert not store.can_listen
        with pytest.raises(Exception, match="listen_dsn"):
            store.open_listener()
    relay = Relay(settings)
    relay.start()
    try:
        assert relay._listener is None
        insert_rows(pg_dsn, table, 5)
        wait_for(lambda: statuses(pg_dsn, table) == {"done": 5}, timeout=30, message="polled rows done")
    finally:
        relay.stop()


def test_listen_dsn_password_is_never_printed(pg_dsn, table, broker, topic_prefix):
    """An unreachable listen_dsn: the relay runs (polling) and says why, without its password."""
    secret = "l1sten-s3cret"
    env = cli_env(
        pg_dsn,
        table,
        broker.bootstrap_servers,
        OUTBOX_RELAY_METRICS__PORT="0",
        OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE=topic_prefix + ".{aggregate_type}",
        OUTBOX_RELAY_DATABASE__LISTEN_DSN=f"postgresql://relay:{secret}@127.0.0.1:1/db?connect_timeout=1",
    )
    assert cli("migrate", env=env).returncode == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox_relay.operator.cli", "run", "--workers", "1"],
        env={**{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        insert_rows(pg_dsn, table, 3)
        wait_for(lambda: statuses(pg_dsn, table) == {"done": 3}, timeout=60, message="rows done by polling")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "listen connection lost" in err
    assert secret not in out + err
    invalid = cli("status", env=dict(env, OUTBOX_RELAY_DATABASE__LISTEN_DSN=f"host='x password={secret}"))
    assert invalid.returncode == 2 and "database.listen_dsn" in invalid.stderr
    assert secret not in invalid.stdout + invalid.stderr


def test_direct_connections_plan_prepared_statements_with_actual_values(store):
    """Direct mode keeps psycopg's prepared statements but never PostgreSQL's generic
    plan (bench/pooler.py: 3-10x slower finalize of 1000-row batches)."""
    with store.connection() as conn:
        assert conn.execute("SHOW plan_cache_mode").fetchone()[0] == "force_custom_plan"
        assert conn.execute("SHOW statement_timeout").fetchone()[0] == "10s"


def test_console_works_through_pgbouncer(pgbouncer, pg_dsn, table):
    """The operator console needs no session either: list, retry and audit through the proxy."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from outbox_relay.config import load_settings
    from tests.helpers.console import running_console

    _migrate_direct(pg_dsn, table)
    dead = [make_row(pg_dsn, table, status="dead", attempts=12, last_error="boom") for _ in range(3)]
    settings = load_settings(
        None,
        database={"dsn": pgbouncer.dsn, "table": table, "transaction_pooler": True},
        console={"host": "127.0.0.1", "port": 0, "token": "t0ken-for-the-test"},
        log={"level": "WARNING", "format": "json"},
    )
    with (
        running_console(settings) as url,
        httpx.Client(base_url=url, headers={"Authorization": "Bearer t0ken-for-the-test"}) as http,
    ):
        for _ in range(8):  # past psycopg's prepare threshold: nothing may be prepared
            assert http.get("/api/status").status_code == 200
        assert [r["id"] for r in http.get("/api/dead").json()["rows"]] == dead
        retried = http.post("/api/dead/retry", json={"ids": dead[:2]})
        assert retried.status_code == 200 and retried.json()["changed"] == 2, retried.text
        assert len(http.get("/api/audit").json()["entries"]) == 1
    assert statuses(pg_dsn, table) == {"pending": 2, "dead": 1}
