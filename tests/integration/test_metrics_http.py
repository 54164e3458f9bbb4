"""The metrics sidecar over real HTTP, against a real PostgreSQL and a real broker.

- A running ``Relay`` scraped on ``/metrics``: gauges match the table (queue depth per
  status including seeded dead rows, the oldest age of a not-yet-due row, published
  rows), the lost-lease counter after a fenced-out finalize, ``/healthz`` while the
  workers are alive.
- Expired leases: a claim that is never finalized, seen by the gauge refresher and
  the HTTP server run without workers (a worker would reclaim the rows).
- ``/readyz`` turns 503 while the database is stopped and 200 again after; this uses
  its own embedded PostgreSQL, never the session's server.
- The exposition parses with prometheus_client's parser (and ``promtool check
  metrics`` when promtool is on PATH or in $PROMTOOL).

No timing assertions: every wait is a bounded poll for the expected state.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from outbox_relay import enqueue
from outbox_relay._embedded.embedded import EmbeddedPostgres
from outbox_relay.db.store import STATUSES, Claimed, OutboxStore
from outbox_relay.observability.metrics import MetricsServer, RelayMetrics, StatsRefresher
from outbox_relay.runtime.relay import Relay
from tests.helpers.db import insert_rows, rows

pytestmark = pytest.mark.timeout(300)

CONTRACT_FAMILIES = {
    # family name as the parser reports it -> a sample name the contract promises
    "outbox_relay_oldest_pending_age_seconds": "outbox_relay_oldest_pending_age_seconds",
    "outbox_relay_expired_leases": "outbox_relay_expired_leases",
    "outbox_relay_queue_depth": "outbox_relay_queue_depth",
    "outbox_relay_lost_leases": "outbox_relay_lost_leases_total",
    "outbox_relay_published": "outbox_relay_published_total",
}
METRICS = {"enabled": True, "host": "127.0.0.1", "port": 0, "refresh_interval_seconds": 0.2}


# --------------------------------------------------------------------------- helpers
def http_get(port: int, path: str) -> tuple[int, str]:
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=15) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_exposition(text: str) -> tuple[dict[str, Any], Samples]:
    """Parse with prometheus_client's parser; return families by name and samples by
    (sample name, sorted labels)."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples: Samples = {}
    for family in families.values():
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return families, samples


def promtool_check(text: str) -> None:
    tool = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not tool:
        return  # the parser check (always run) stands alone
    proc = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"promtool check metrics failed:\n{proc.stdout}\n{proc.stderr}"


def scrape(port: int) -> tuple[str, Samples]:
    status, body = http_get(port, "/metrics")
    assert status == 200, body
    _families, samples = parse_exposition(body)
    return body, samples


def depth(samples: Samples) -> dict[str, float]:
    return {s: samples.get(("outbox_relay_queue_depth", (("status", s),)), math.nan) for s in STATUSES}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), math.nan)


def poll(fetch: Callable[[], Any], ok: Callable[[Any], bool], *, timeout: float = 60.0, interval: float = 0.1) -> Any:
    """Fetch until ok(result) or the deadline; return the last result (the caller asserts)."""
    deadline = time.monotonic() + timeout
    result = fetch()
    while not ok(result) and time.monotonic() < deadline:
        time.sleep(interval)
        result = fetch()
    return result


def check_contract_exposition(text: str) -> Samples:
    families, samples = parse_exposition(text)
    for family, sample in CONTRACT_FAMILIES.items():
        assert family in families, f"{family} missing from /metrics"
        assert any(name == sample for name, _ in samples), f"no {sample} sample in /metrics"
    assert families["outbox_relay_oldest_pending_age_seconds"].type == "gauge"
    assert families["outbox_relay_expired_leases"].type == "gauge"
    assert families["outbox_relay_queue_depth"].type == "gauge"
    assert families["outbox_relay_lost_leases"].type == "counter"
    assert families["outbox_relay_published"].type == "counter"
    assert {s.labels["status"] for s in families["outbox_relay_queue_depth"].samples} == set(STATUSES)
    outcomes = {
        s.labels["outcome"]
        for s in families["outbox_relay_published"].samples
        if s.name == "outbox_relay_published_total"
    }
    assert outcomes == {"done", "retry", "defer", "dead"}
    promtool_check(text)
    return samples


def sql_scalar(dsn: str, query: str, params: tuple = ()) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
        assert row is not None
        return row[0]


def qualified(table: str) -> str:
    schema, name = table.split(".")
    return f'"{schema}"."{name}"'


def table_depth(dsn: str, table: str) -> dict[str, int]:
    counts = dict.fromkeys(STATUSES, 0)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for status, n in conn.execute(f"SELECT status, count(*) FROM {qualified(table)} GROUP BY status"):
            counts[status] = int(n)
    return counts


# --------------------------------------------------------------------------- a running relay
def test_running_relay_metrics_match_the_table(make_settings, store, pg_dsn, table):
    t = qualified(table)
    # Seed before the relay starts:
    # - 3 dead rows, created long ago (they must not count as the oldest pending row);
    # - one pending row that is not due for an hour, backdated 1000 s;
    # - one processing row whose lease runs for an hour (no worker may reclaim it),
    #   later used for the fenced-out finalize;
    # - 2 ordinary rows the relay publishes to the broker.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        dead_ids = [
            r[0]
            for r in conn.execute(
                f"INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, status, attempts, last_error,"
                f" created_at) SELECT 'order', 'dead-' || g, 'OrderCreated', '{{}}'::jsonb, 'dead', 5, 'boom',"
                f" now() - interval '5000 seconds' FROM generate_series(1, 3) AS g RETURNING id"
            ).fetchall()
        ]
        with conn.transaction():
            not_due = enqueue(
                conn,
                aggregate_type="order",
                aggregate_id="later",
                event_type="OrderCreated",
                payload={"later": True},
                table=table,
                delay=3600,
            )
        conn.execute(f"UPDATE {t} SET created_at = now() - interval '1000 seconds' WHERE id = %s", (not_due,))
        held = conn.execute(
            f"INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, status, attempts,"
            f" lease_owner, lease_until, lease_version) VALUES ('order', 'held', 'OrderCreated', '{{}}'::jsonb,"
            f" 'processing', 1, 'someone-else', now() + interval '1 hour', 1) RETURNING id"
        ).fetchone()[0]
    published = insert_rows(pg_dsn, table, 2, aggregate_type="order")

    relay = Relay(make_settings(metrics=METRICS, relay={"workers": 2}))
    relay.start()
    try:
        port = relay.metrics_port
        assert isinstance(port, int) and port > 0

        status, body = http_get(port, "/healthz")
        assert status == 200, body
        assert "2 workers alive" in body

        expected = {"pending": 1, "processing": 1, "done": 2, "dead": 3}

        def settled(result: tuple[str, Samples]) -> bool:
            _text, s = result
            return depth(s) == expected and value(s, "outbox_relay_published_total", outcome="done") == 2

        text, samples = poll(lambda: scrape(port), settled)
        assert depth(samples) == expected, text
        assert table_depth(pg_dsn, table) == expected
        assert {r[0]: r[1] for r in rows(pg_dsn, table)}[published[0]] == "done"
        assert value(samples, "outbox_relay_published_total", outcome="done") == 2
        for outcome in ("retry", "defer", "dead"):
            assert value(samples, "outbox_relay_published_total", outcome=outcome) == 0
        assert value(samples, "outbox_relay_expired_leases") == 0
        assert value(samples, "outbox_relay_lost_leases_total") == 0
        check_contract_exposition(text)

        # Oldest age: the not-yet-due pending row (1000 s old), not the older dead rows.
        age_query = f"SELECT extract(epoch FROM now() - created_at)::float8 FROM {t} WHERE id = %s"
        before = sql_scalar(pg_dsn, age_query, (not_due,))
        _text, samples = scrape(port)
        after = sql_scalar(pg_dsn, age_query, (not_due,))
        gauge = value(samples, "outbox_relay_oldest_pending_age_seconds")
        assert 1000 <= before <= after < 4000
        assert before - 30 <= gauge <= after + 0.001, (before, gauge, after)

        # Fenced-out finalize: the held row was claimed at version 1, then taken over
        # (version 2). A worker finalizing with its stale claim must be refused and counted.
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"UPDATE {t} SET lease_version = 2, lease_owner = 'newer' WHERE id = %s", (held,))
            created_at = conn.execute(f"SELECT created_at FROM {t} WHERE id = %s", (held,)).fetchone()[0]
        stale = Claimed(
            id=held,
            lease_version=1,
            attempts=1,
            aggregate_type="order",
            aggregate_id="held",
            event_type="OrderCreated",
            payload="{}",
            topic=None,
            headers=None,
            created_at=created_at,
        )
        result = relay.workers[0].finalize([stale], [None])
        assert result.lost == [held]
        assert result.done == 0
        assert [r for r in rows(pg_dsn, table) if r[0] == held] == [(held, "processing", 1, 2, None)]

        text, samples = poll(lambda: scrape(port), lambda r: value(r[1], "outbox_relay_lost_leases_total") == 1)
        assert value(samples, "outbox_relay_lost_leases_total") == 1, text
        # The refused finalize is not a publish outcome.
        assert value(samples, "outbox_relay_published_total", outcome="done") == 2
        assert depth(samples) == expected
        check_contract_exposition(text)

        # A dead-row change made behind the relay's back shows up on the next refresh.
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"UPDATE {t} SET status = 'done', done_at = now() WHERE id = %s", (dead_ids[0],))
        expected = {"pending": 1, "processing": 1, "done": 3, "dead": 2}
        _text, samples = poll(lambda: scrape(port), lambda r: depth(r[1]) == expected)
        assert depth(samples) == expected == table_depth(pg_dsn, table)

        status, body = http_get(port, "/readyz")
        assert status == 200, body
        status, body = http_get(port, "/healthz")
        assert status == 200, body
        assert http_get(port, "/nope")[0] == 404
    finally:
        relay.stop(timeout_seconds=10)


def test_empty_table_exposes_every_status_as_zero(make_settings, store):
    relay = Relay(make_settings(metrics=METRICS, relay={"workers": 1}))
    relay.start()
    try:
        port = relay.metrics_port
        assert port
        text, samples = poll(lambda: scrape(port), lambda r: depth(r[1]) == dict.fromkeys(STATUSES, 0))
        assert depth(samples) == dict.fromkeys(STATUSES, 0), text
        assert value(samples, "outbox_relay_oldest_pending_age_seconds") == 0
        assert value(samples, "outbox_relay_expired_leases") == 0
        check_contract_exposition(text)
        # name[] narrows the scrape to those samples (as prometheus_client's own handler)
        code, narrow = http_get(port, "/metrics?name[]=outbox_relay_queue_depth")
        assert code == 200
        _families, narrow_samples = parse_exposition(narrow)
        assert {name for name, _labels in narrow_samples} == {"outbox_relay_queue_depth"}, narrow
        assert depth(narrow_samples) == dict.fromkeys(STATUSES, 0)
    finally:
        relay.stop(timeout_seconds=10)


# --------------------------------------------------------------------------- expired leases
def test_expired_leases_gauge_after_a_claim_never_finalized(store, pg_dsn, table):
    """No workers here: a worker would reclaim the expired rows at once."""
    insert_rows(pg_dsn, table, 5)
    claimed = store.claim(owner="ghost", batch=3, lease_seconds=0.2, max_attempts=5).rows
    assert len(claimed) == 3

    metrics = RelayMetrics()
    refresher = StatsRefresher(store, metrics, interval_seconds=0.2, timeout_ms=2000, ordered_types=[])
    server = MetricsServer(
        metrics, host="127.0.0.1", port=0, healthy=lambda: (True, "ok"), ready=lambda: (store.ping(), "ready")
    )
    refresher.start()
    server.start()
    try:
        # One refresh sets the gauges one query after the other: wait for all of them.
        def settled(result: tuple[str, Samples]) -> bool:
            return value(result[1], "outbox_relay_expired_leases") == 3 and depth(result[1]) == {
                "pending": 2,
                "processing": 3,
                "done": 0,
                "dead": 0,
            }

        text, samples = poll(lambda: scrape(server.port), settled)
        assert value(samples, "outbox_relay_expired_leases") == 3, text
        assert (
            sql_scalar(
                pg_dsn, f"SELECT count(*) FROM {qualified(table)} WHERE status = 'processing' AND lease_until < now()"
            )
            == 3
        )
        assert depth(samples) == {"pending": 2, "processing": 3, "done": 0, "dead": 0}
        assert value(samples, "outbox_relay_stats_refresh_errors_total") == 0
        check_contract_exposition(text)

        # Finalizing the claim (fenced, still at its version) clears the gauge.
        assert store.mark_done([(c.id, c.lease_version) for c in claimed]) == {c.id for c in claimed}
        # (A scrape between two queries of a refresh sees the lease gauge cleared and
        # the depths still as they were.)
        finalized = {"pending": 2, "processing": 0, "done": 3, "dead": 0}
        text, samples = poll(
            lambda: scrape(server.port),
            lambda r: value(r[1], "outbox_relay_expired_leases") == 0 and depth(r[1]) == finalized,
        )
        assert value(samples, "outbox_relay_expired_leases") == 0, text
        assert depth(samples) == finalized
    finally:
        server.stop()
        refresher.stop()


# --------------------------------------------------------------------------- readiness
def test_readyz_follows_the_database(make_settings, tmp_path):
    """Own embedded PostgreSQL: stopping it never disturbs the session's server."""
    pg = EmbeddedPostgres().start()  # system tmp: its server user must reach the data
    relay: Relay | None = None
    stopped = False
    try:
        own = OutboxStore(pg.dsn, "outbox", pool_size=2)
        with own:
            own.migrate()
        insert_rows(pg.dsn, "outbox", 1, aggregate_type="ready")
        relay = Relay(make_settings(database={"dsn": pg.dsn, "table": "outbox"}, metrics=METRICS, relay={"workers": 1}))
        relay.start()
        port = relay.metrics_port
        assert port

        status, body = poll(lambda: http_get(port, "/readyz"), lambda r: r[0] == 200)
        assert (status, body.strip()) == (200, "ready")
        _text, samples = poll(lambda: scrape(port), lambda r: depth(r[1])["done"] == 1)
        assert depth(samples) == {"pending": 0, "processing": 0, "done": 1, "dead": 0}

        pg.stop_server()
        stopped = True
        status, body = poll(lambda: http_get(port, "/readyz"), lambda r: r[0] == 503, timeout=90, interval=0.3)
        assert status == 503, body
        assert "database unreachable" in body
        # The workers survive the outage: still alive, so no restart is asked for.
        status, body = http_get(port, "/healthz")
        assert status == 200, body
        # Gauges are not left frozen at their last value while the table cannot be read.
        text, samples = poll(
            lambda: scrape(port), lambda r: all(math.isnan(v) for v in depth(r[1]).values()), timeout=60
        )
        assert all(math.isnan(v) for v in depth(samples).values()), text
        assert value(samples, "outbox_relay_stats_refresh_errors_total") >= 1
        check_contract_exposition(text)

        pg.start_server()
        stopped = False
        status, body = poll(lambda: http_get(port, "/readyz"), lambda r: r[0] == 200, timeout=90, interval=0.3)
        assert (status, body.strip()) == (200, "ready")
        _text, samples = poll(lambda: scrape(port), lambda r: depth(r[1])["done"] == 1)
        assert depth(samples) == {"pending": 0, "processing": 0, "done": 1, "dead": 0}
        assert http_get(port, "/healthz")[0] == 200
    finally:
        if stopped:
            pg.start_server()
        if relay is not None:
            relay.stop(timeout_seconds=10)
        pg.stop()
