"""Publisher plug-ins loaded by reference, and deduplicated enqueue, against a real PostgreSQL."""

from __future__ import annotations

import threading

import psycopg
import pytest

from outbox_relay import enqueue
from outbox_relay.errors import ConfigError, PublisherLoadError
from outbox_relay.publisher import load_publisher
from outbox_relay.runtime.relay import Relay
from tests.helpers import custom_publisher
from tests.helpers.cli import ROOT, cli, cli_env
from tests.helpers.db import insert_rows, rows, wait_for


def by_status(dsn: str, table: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows(dsn, table):
        out[r[1]] = out.get(r[1], 0) + 1
    return out


@pytest.fixture(autouse=True)
def _reset_plugin():
    custom_publisher.reset()
    yield
    custom_publisher.reset()


# --- plug-in publishers ------------------------------------------------------------------------
def test_custom_publisher_by_reference_drains_rows_through_the_relay(make_settings, store, pg_dsn, table):
    settings = make_settings(relay={"publisher": "tests.helpers.custom_publisher:make", "workers": 3, "batch_size": 20})
    ids = insert_rows(pg_dsn, table, 100)
    poison = insert_rows(pg_dsn, table, 1, event_type="Poison")
    later = insert_rows(pg_dsn, table, 1, event_type="NotYet")
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(
            lambda: by_status(pg_dsn, table).get("done") == 100 and by_status(pg_dsn, table).get("dead") == 1,
            message="rows drained by the plug-in",
        )
        wait_for(lambda: by_status(pg_dsn, table).get("pending") == 1, message="deferred row back to pending")
        publisher = relay.publisher
    finally:
        relay.stop()
    assert isinstance(publisher, custom_publisher.RecordingPublisher)
    assert publisher.closed  # the relay closes what it loaded
    assert custom_publisher.SETTINGS_SEEN == [settings]  # the factory got the Settings, once
    received = sorted(m.id for m in custom_publisher.RECEIVED)
    assert received == ids  # each row exactly once (no failures, no takeovers here)
    first = next(m for m in custom_publisher.RECEIVED if m.id == ids[0])
    assert ("message_id", str(ids[0])) in first.headers and first.value == '{"seq": 0}'
    final = {r[0]: r for r in rows(pg_dsn, table)}
    assert final[poison[0]][1] == "dead" and "custom publisher refuses poison" in final[poison[0]][4]
    assert final[later[0]][1] == "pending" and final[later[0]][2] == 0  # deferred: attempt refunded
    assert final[later[0]][4].startswith("deferred")


def test_plain_publish_only_object_is_wrapped(make_settings, store, pg_dsn, table):
    settings = make_settings(relay={"publisher": "tests.helpers.custom_publisher:make_plain", "workers": 2})
    ids = insert_rows(pg_dsn, table, 30)
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: by_status(pg_dsn, table).get("done") == 30, message="rows drained")
    finally:
        relay.stop()
    assert sorted(m.id for m in custom_publisher.RECEIVED) == ids


@pytest.mark.parametrize(
    ("reference", "expected"),
    [
        ("nope.module:x", "cannot import 'nope.module'"),
        ("tests.helpers.custom_publisher:missing", "has no attribute 'missing'"),
        ("tests.helpers.custom_publisher:not_a_publisher", "has neither publish_batch() nor publish()"),
        ("no_colon_here", "is not 'kafka', 'http' or 'package.module:factory'"),
    ],
)
def test_bad_publisher_reference_exits_2_with_one_line(pg_dsn, table, store, reference, expected):
    env = cli_env(
        pg_dsn,
        table,
        OUTBOX_RELAY_RELAY__PUBLISHER=reference,
        OUTBOX_RELAY_METRICS__ENABLED="false",
        PYTHONPATH=str(ROOT),
    )
    proc = cli("run", env=env, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("outbox-relay: error: relay.publisher ")
    assert repr(reference) in lines[0] and expected in lines[0]


def test_load_publisher_errors_are_config_errors(make_settings):
    with pytest.raises(PublisherLoadError) as info:
        load_publisher(make_settings(relay={"publisher": "tests.helpers.custom_publisher:missing"}))
    assert isinstance(info.value, ConfigError)


# --- deduplicated enqueue ----------------------------------------------------------------------
def _enqueue(conn, table, key, seq=0, **extra):
    return enqueue(
        conn,
        aggregate_type="receipt",
        aggregate_id=f"order-{key}",
        event_type="ReceiptRequested",
        payload={"seq": seq},
        table=table,
        dedup_key=key,
        **extra,
    )


def _dedup_rows(dsn, table):
    schema, name = table.split(".")
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f'SELECT id, dedup_key, payload FROM "{schema}"."{name}" ORDER BY id').fetchall()


def _wait_until_blocked_on_lock(dsn: str, pid: int) -> None:
    def blocked():
        with psycopg.connect(dsn, autocommit=True) as conn:
            r = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
        return r is not None and r[0] == "Lock"

    wait_for(blocked, timeout=10, interval=0.05, message="second inserter waiting on the first's lock")


def test_concurrent_enqueue_of_one_dedup_key_yields_one_row(store, pg_dsn, table):
    first_inserted = threading.Event()
    release_first = threading.Event()
    results: dict[str, object] = {}
    errors: list[BaseException] = []

    def first() -> None:
        try:
            with psycopg.connect(pg_dsn) as conn:
                with conn.transaction():
                    results["first"] = _enqueue(conn, table, "order-42", seq=1)
                    first_inserted.set()
                    release_first.wait(20)
        except BaseException as exc:  # reported by the test
            errors.append(exc)
            first_inserted.set()

    conn2 = psycopg.connect(pg_dsn)
    pid2 = conn2.info.backend_pid

    def second() -> None:
        try:
            with conn2.transaction():
                got = _enqueue(conn2, table, "order-42", seq=2)
                results["second"] = got
                # the transaction was not aborted by the conflict: it goes on and commits
                results["second_select"] = conn2.execute("SELECT 41 + 1").fetchone()[0]
                results["second_other"] = _enqueue(conn2, table, "order-43", seq=3)
        except BaseException as exc:
            errors.append(exc)

    t1 = threading.Thread(target=first)
    t1.start()
    assert first_inserted.wait(20) and not errors
    t2 = threading.Thread(target=second)
    t2.start()
    try:
        _wait_until_blocked_on_lock(pg_dsn, pid2)  # both inserted, neither committed: the second waits
        assert "second" not in results
        release_first.set()
        t1.join(20)
        t2.join(20)
    finally:
        release_first.set()
        conn2.close()
    assert not errors, errors
    first_id, second_id = results["first"], results["second"]
    assert not first_id.duplicate
    assert second_id == first_id and second_id.duplicate is True
    assert results["second_select"] == 42
    assert not results["second_other"].duplicate
    table_rows = _dedup_rows(pg_dsn, table)
    assert [(r[0], r[1], r[2]) for r in table_rows] == [
        (first_id, "order-42", {"seq": 1}),
        (results["second_other"], "order-43", {"seq": 3}),
    ]


def test_second_inserter_gets_the_key_when_the_first_rolls_back(store, pg_dsn, table):
    first_inserted = threading.Event()
    release_first = threading.Event()
    results: dict[str, object] = {}

    def first() -> None:
        with psycopg.connect(pg_dsn) as conn:
            conn.execute("BEGIN")
            results["first"] = _enqueue(conn, table, "k", seq=1)
            first_inserted.set()
            release_first.wait(20)
            conn.rollback()

    conn2 = psycopg.connect(pg_dsn)
    pid2 = conn2.info.backend_pid

    def second() -> None:
        with conn2.transaction():
            results["second"] = _enqueue(conn2, table, "k", seq=2)

    t1 = threading.Thread(target=first)
    t1.start()
    assert first_inserted.wait(20)
    t2 = threading.Thread(target=second)
    t2.start()
    try:
        _wait_until_blocked_on_lock(pg_dsn, pid2)
        release_first.set()
        t1.join(20)
        t2.join(20)
    finally:
        release_first.set()
        conn2.close()
    assert not results["second"].duplicate and results["second"] != results["first"]
    assert [(r[0], r[2]) for r in _dedup_rows(pg_dsn, table)] == [(results["second"], {"seq": 2})]


def test_duplicate_after_commit_and_rows_without_key(store, pg_dsn, table):
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            a = _enqueue(conn, table, "same")
        with conn.transaction():
            b = _enqueue(conn, table, "same")
            again = _enqueue(conn, table, "same")  # also inside one transaction
            plain1 = enqueue(conn, aggregate_type="x", aggregate_id="1", event_type="E", payload={}, table=table)
            plain2 = enqueue(conn, aggregate_type="x", aggregate_id="1", event_type="E", payload={}, table=table)
    assert not a.duplicate and b == a and b.duplicate and again == a and again.duplicate
    assert not plain1.duplicate and not plain2.duplicate and plain1 != plain2  # NULL keys never conflict
    assert len(_dedup_rows(pg_dsn, table)) == 3
