"""The built-in HTTP publisher against a real HTTP server and a real PostgreSQL.

The server (tests/helpers/http_target.py) runs in this process on 127.0.0.1 and
answers by script; the rows go through the real claim -> publish -> fenced
finalize path (``Worker.process`` or a whole ``Relay``).
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from email.utils import formatdate
from typing import Any

import psycopg
import pytest

from outbox_relay import enqueue
from outbox_relay.observability.metrics import RelayMetrics
from outbox_relay.publisher import Message, NotDelivered, RetryableError
from outbox_relay.publishers.http import HttpPublisher
from outbox_relay.runtime.relay import Relay
from outbox_relay.runtime.worker import Worker, WorkerConfig
from tests.helpers.cli import ROOT, cli, cli_env
from tests.helpers.db import insert_rows, run_sql, wait_for
from tests.helpers.http_target import HttpTarget, Step

# Exercises the broker, processes or external tools rather than PostgreSQL's SQL:
# ./dev runs it on the first pass only (see pyproject.toml markers).
pytestmark = pytest.mark.first_pass_only


@pytest.fixture
def target():
    with HttpTarget() as t:
        yield t


def state(dsn: str, table: str, row_id: int) -> dict[str, Any]:
    """One row as the database sees it now; ``due_in`` = available_at - now() in seconds."""
    schema, name = table.split(".")
    with psycopg.connect(dsn, autocommit=True) as conn:
        r = conn.execute(
            f"SELECT status, attempts, last_error, extract(epoch FROM available_at - now())::float8, lease_version "
            f'FROM "{schema}"."{name}" WHERE id = %s',
            (row_id,),
        ).fetchone()
    assert r is not None
    return {"status": r[0], "attempts": r[1], "last_error": r[2], "due_in": r[3], "lease_version": r[4]}


def add_row(
    dsn: str, table: str, event_type: str, *, aggregate_id: str = "agg-1", payload: Any = None, **extra: Any
) -> int:
    with psycopg.connect(dsn) as conn, conn.transaction():
        return int(
            enqueue(
                conn,
                aggregate_type="order",
                aggregate_id=aggregate_id,
                event_type=event_type,
                payload=payload if payload is not None else {"e": event_type},
                table=table,
                **extra,
            )
        )


def http_settings(make_settings, target: HttpTarget, *, relay: dict | None = None, http: dict | None = None):
    return make_settings(
        relay={"publisher": "http", "backoff_base_seconds": 0.05, "backoff_cap_seconds": 0.2, **(relay or {})},
        http={"url_template": f"{target.base_url}/e/{{event_type}}", **(http or {})},
    )


def worker_for(
    settings,
    store,
    publisher,
    *,
    owner: str = "test",
    lease_seconds: float | None = None,
    publish_timeout_seconds: float | None = None,
) -> Worker:
    """A Worker configured the way Relay.start() configures it (WorkerConfig.from_settings)."""
    overrides: dict[str, Any] = {"owner": owner}
    if lease_seconds is not None:
        overrides["lease_seconds"] = lease_seconds
    if publish_timeout_seconds is not None:
        overrides["publish_timeout_seconds"] = publish_timeout_seconds
    cfg = WorkerConfig.from_settings(settings, publisher, **overrides)
    return Worker(0, store, publisher, cfg, RelayMetrics())


def message(i: int, event_type: str = "E") -> Message:
    return Message(
        id=i,
        topic="t",
        key="k",
        value="{}",
        headers=[("message_id", str(i))],
        aggregate_type="order",
        aggregate_id=f"a{i}",
        event_type=event_type,
    )


# --- request format --------------------------------------------------------------------------
def test_request_carries_payload_contract_headers_and_stable_idempotency_key(
    make_settings, store, pg_dsn, table, target
):
    settings = http_settings(
        make_settings,
        target,
        http={
            "url_template": f"{target.base_url}/in/{{aggregate_type}}/{{aggregate_id}}/{{event_type}}/"
            f"{{topic}}/{{id}}?src=outbox",
            "headers": {"Authorization": "Bearer s3cret", "Content-Type": "application/cloudevents+json"},
        },
    )
    special = add_row(
        pg_dsn,
        table,
        "Order Paid",
        aggregate_id="a/b c?&#%",
        payload={"n": 1, "s": "ü"},
        topic="billing.v1",
        headers={"trace_id": "t-1", "tenant": "acme"},
    )
    plain = insert_rows(pg_dsn, table, 10, event_type="OrderCreated")
    publisher = HttpPublisher.from_settings(settings)
    try:
        worker = worker_for(settings, store, publisher)
        result = worker.run_once()
        assert result.done == 11
    finally:
        publisher.close()

    [req] = target.requests_for(special)
    assert req.method == "POST"
    # every value percent-encoded, '/' included: a row cannot change the URL's shape
    assert req.path == f"/in/order/a%2Fb%20c%3F%26%23%25/Order%20Paid/billing.v1/{special}?src=outbox"
    assert json.loads(req.body) == {"n": 1, "s": "ü"}
    h = req.headers
    assert h["content-type"] == "application/cloudevents+json"  # configured headers may override it
    assert h["authorization"] == "Bearer s3cret"
    assert h["idempotency-key"] == f"outbox-{special}"
    assert h["x-outbox-message-id"] == str(special)
    assert h["x-outbox-event-type"] == "Order Paid"
    assert h["x-outbox-aggregate-type"] == "order"
    assert h["x-outbox-aggregate-id"] == "a/b c?&#%"
    assert h["x-outbox-trace-id"] == "t-1" and h["x-outbox-tenant"] == "acme"
    for row_id in plain:
        [r] = target.requests_for(row_id)
        assert r.idempotency_key == f"outbox-{row_id}"
    assert all(state(pg_dsn, table, i)["status"] == "done" for i in [special, *plain])


def test_default_content_type_and_connection_reuse(make_settings, store, pg_dsn, table, target):
    settings = http_settings(make_settings, target, http={"max_concurrency": 1})
    ids = insert_rows(pg_dsn, table, 20)
    publisher = HttpPublisher.from_settings(settings)
    try:
        assert worker_for(settings, store, publisher).run_once().done == 20
    finally:
        publisher.close()
    reqs = target.snapshot()
    assert sorted(r.message_id for r in reqs) == ids
    assert {r.headers["content-type"] for r in reqs} == {"application/json"}
    # one keep-alive connection served the whole sequential batch
    assert len({r.client_port for r in reqs}) == 1


# --- every status class through a real Relay ---------------------------------------------------
def test_each_status_class_lands_in_its_outcome_through_the_relay(make_settings, store, pg_dsn, table, target):
    long_body = "validation failed: " + "field 'amount' must be positive; " * 60
    target.script("/e/Ok", Step(200))
    target.script("/e/Created", Step(201))
    target.script("/e/Dup", Step(409, body="already have it"))
    target.script("/e/Flaky", Step(503, body="upstream down"), Step(200))
    target.script("/e/Busy", Step(429, headers={"Retry-After": "30"}, body="slow down"))
    target.script("/e/Later", Step(425, body="customer not created yet"))
    target.script("/e/Invalid", Step(422, body=long_body))
    ids = {
        name: add_row(pg_dsn, table, name, aggregate_id=f"agg-{name}")
        for name in ("Ok", "Created", "Dup", "Flaky", "Busy", "Later", "Invalid")
    }
    settings = http_settings(
        make_settings, target, relay={"workers": 2}, http={"defer_statuses": [425], "defer_seconds": 600}
    )
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(
            lambda: (
                all(state(pg_dsn, table, ids[n])["status"] == "done" for n in ("Ok", "Created", "Dup", "Flaky"))
                and state(pg_dsn, table, ids["Invalid"])["status"] == "dead"
                and state(pg_dsn, table, ids["Busy"])["status"] == "pending"
                and state(pg_dsn, table, ids["Later"])["status"] == "pending"
            ),
            message="every row reached its outcome",
        )
        time.sleep(0.5)  # nothing due again soon: the states must be stable
    finally:
        relay.stop()

    ok, created, dup, flaky = (state(pg_dsn, table, ids[n]) for n in ("Ok", "Created", "Dup", "Flaky"))
    assert ok["attempts"] == created["attempts"] == dup["attempts"] == 1
    # 503 consumed an attempt, then 200: done on the second claim with the same key
    assert flaky["status"] == "done" and flaky["attempts"] == 2
    flaky_reqs = target.requests_for(ids["Flaky"])
    assert len(flaky_reqs) == 2
    assert {r.idempotency_key for r in flaky_reqs} == {f"outbox-{ids['Flaky']}"}

    busy = state(pg_dsn, table, ids["Busy"])
    assert busy["attempts"] == 1 and "HTTP 429" in busy["last_error"] and "slow down" in busy["last_error"]
    assert 25 < busy["due_in"] <= 30.5, busy  # Retry-After is the backoff floor
    later = state(pg_dsn, table, ids["Later"])
    assert later["attempts"] == 0  # defer refunds the attempt
    assert later["last_error"].startswith("deferred") and "HTTP 425" in later["last_error"]
    assert "customer not created yet" in later["last_error"]
    assert 590 < later["due_in"] <= 600.5  # no Retry-After: http.defer_seconds
    invalid = state(pg_dsn, table, ids["Invalid"])
    assert invalid["attempts"] == 1 and "HTTP 422" in invalid["last_error"]
    assert "validation failed: field 'amount' must be positive" in invalid["last_error"]
    assert len(invalid["last_error"]) < 400 and invalid["last_error"].endswith("…")  # body truncated
    assert len(target.requests_for(ids["Invalid"])) == 1  # permanent: never retried


# --- Retry-After and defer, step by step through Worker.process --------------------------------
def test_retry_after_seconds_and_http_date_are_the_backoff_floor(make_settings, store, pg_dsn, table, target):
    busy = add_row(pg_dsn, table, "Busy", aggregate_id="x")
    down = add_row(pg_dsn, table, "Down", aggregate_id="y")
    target.script("/e/Busy", Step(429, headers={"Retry-After": "2"}))
    target.script("/e/Down", Step(503, headers={"Retry-After": formatdate(time.time() + 6, usegmt=True)}))
    settings = http_settings(make_settings, target)
    publisher = HttpPublisher.from_settings(settings)
    try:
        result = worker_for(settings, store, publisher).run_once()
    finally:
        publisher.close()
    assert result.retried == 2
    b, d = state(pg_dsn, table, busy), state(pg_dsn, table, down)
    assert b["status"] == "pending" and b["attempts"] == 1
    assert 1.5 <= b["due_in"] <= 2.5, b  # available_at - now() in SQL
    assert d["status"] == "pending" and d["attempts"] == 1 and "HTTP 503" in d["last_error"]
    assert 4.0 <= d["due_in"] <= 6.5, d  # HTTP-date has whole-second resolution


def test_defer_status_refunds_the_attempt_and_honours_retry_after(make_settings, store, pg_dsn, table, target):
    row = add_row(pg_dsn, table, "Later")
    target.script("/e/Later", Step(425, headers={"Retry-After": "7"}, body="not yet"))
    settings = http_settings(make_settings, target, http={"defer_statuses": [425]})
    publisher = HttpPublisher.from_settings(settings)
    try:
        assert worker_for(settings, store, publisher).run_once().deferred == 1
    finally:
        publisher.close()
    s = state(pg_dsn, table, row)
    assert s["status"] == "pending" and s["attempts"] == 0
    assert s["last_error"].startswith("deferred") and "HTTP 425: not yet" in s["last_error"]
    assert 6.5 <= s["due_in"] <= 7.5, s


def test_slow_server_times_out_and_the_row_is_retried_not_hung(make_settings, store, pg_dsn, table, target):
    ids = insert_rows(pg_dsn, table, 3, event_type="Slow")
    target.script("/e/Slow", Step(200, delay=3.0))
    settings = http_settings(make_settings, target, relay={"lease_seconds": 5}, http={"timeout_seconds": 0.5})
    publisher = HttpPublisher.from_settings(settings)
    try:
        started = time.monotonic()
        result = worker_for(settings, store, publisher).run_once()
        elapsed = time.monotonic() - started
    finally:
        publisher.close()
    assert result.retried == 3
    assert elapsed < 2.0, elapsed  # per-request timeout, concurrent requests: not 3 x 3 s
    for row_id in ids:
        s = state(pg_dsn, table, row_id)
        assert s["status"] == "pending" and s["attempts"] == 1
        assert "timeout" in s["last_error"].lower(), s
        assert len(target.requests_for(row_id)) == 1


def test_invalid_row_header_goes_dead_without_a_request(make_settings, store, pg_dsn, table, target):
    bad = add_row(pg_dsn, table, "E", headers={"customer": "Müller"})
    good = add_row(pg_dsn, table, "E", headers={"customer": "Mueller"})
    settings = http_settings(make_settings, target)
    publisher = HttpPublisher.from_settings(settings)
    try:
        worker_for(settings, store, publisher).run_once()
    finally:
        publisher.close()
    s = state(pg_dsn, table, bad)
    assert s["status"] == "dead" and "not printable ASCII" in s["last_error"] and "customer" in s["last_error"]
    assert target.requests_for(bad) == []
    assert state(pg_dsn, table, good)["status"] == "done"


# --- the same Idempotency-Key on every attempt --------------------------------------------------
def test_same_idempotency_key_across_a_forced_retry(make_settings, store, pg_dsn, table, target):
    row = add_row(pg_dsn, table, "Flaky")
    target.script_id(row, Step(503), Step(200))
    settings = http_settings(make_settings, target)
    publisher = HttpPublisher.from_settings(settings)
    try:
        worker = worker_for(settings, store, publisher)
        assert worker.run_once().retried == 1
        assert state(pg_dsn, table, row)["attempts"] == 1
        time.sleep(0.25)  # backoff is at most backoff_cap_seconds (0.2 s)
        assert worker.run_once().done == 1
    finally:
        publisher.close()
    s = state(pg_dsn, table, row)
    assert s["status"] == "done" and s["attempts"] == 2
    reqs = target.requests_for(row)
    assert len(reqs) == 2
    assert [r.idempotency_key for r in reqs] == [f"outbox-{row}"] * 2
    assert reqs[0].body == reqs[1].body


def test_same_idempotency_key_across_a_lease_takeover(make_settings, store, pg_dsn, table, target):
    """A claims with a short lease; its request hangs past the lease; B reclaims the row
    (lease_version + 1) and publishes it again; A's late answer is fenced off."""
    row = add_row(pg_dsn, table, "E")
    target.script_id(row, Step(200, delay=1.5), Step(200))
    settings = http_settings(make_settings, target, relay={"lease_seconds": 5}, http={"timeout_seconds": 3})
    publisher = HttpPublisher.from_settings(settings)
    try:
        a = worker_for(settings, store, publisher, owner="A", lease_seconds=0.6, publish_timeout_seconds=4)
        b = worker_for(settings, store, publisher, owner="B", lease_seconds=5)
        [claimed_a] = a.claim()
        result_a: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result_a.update(r=a.process([claimed_a])))
        thread.start()
        wait_for(lambda: target.requests_for(row), message="A's request")
        wait_for(
            lambda: run_sql(pg_dsn, table, "SELECT lease_until < now() FROM {t} WHERE id = %s", (row,))[0][0],
            timeout=10,
            interval=0.05,
            message="A's lease to expire",
        )  # its request is still in flight
        [claimed_b] = b.claim()
        assert claimed_b.id == row and claimed_b.lease_version == claimed_a.lease_version + 1
        result_b = b.process([claimed_b])
        thread.join(10)
        assert not thread.is_alive()
    finally:
        publisher.close()
    assert result_b.done == 1
    assert result_a["r"].lost == [row]  # the stale owner cannot finalize
    s = state(pg_dsn, table, row)
    assert s["status"] == "done" and s["lease_version"] == claimed_b.lease_version
    reqs = target.requests_for(row)
    assert len(reqs) == 2
    assert [r.idempotency_key for r in reqs] == [f"outbox-{row}", f"outbox-{row}"]


# --- ordering, deadlines, transport failures (publisher level) ---------------------------------
def test_ordered_aggregate_is_sent_in_sequence_and_stops_at_a_failure(make_settings, store, pg_dsn, table, target):
    ids = [add_row(pg_dsn, table, "E", aggregate_id="one", payload={"seq": i}) for i in range(5)]
    target.default = Step(200, delay=0.05)
    target.script_id(ids[2], Step(503, delay=0.05), Step(200))
    settings = http_settings(make_settings, target, relay={"ordered_event_types": ["*"], "max_run_length": 10})
    publisher = HttpPublisher.from_settings(settings)
    try:
        result = worker_for(settings, store, publisher).run_once()
    finally:
        publisher.close()
    assert result.claimed == 5 and result.done == 2 and result.retried == 1 and result.released == 2
    reqs = target.snapshot()
    assert [r.message_id for r in reqs] == ids[:3]  # in id order, nothing after the failure
    assert all(later.at - earlier.at >= 0.04 for earlier, later in itertools.pairwise(reqs))  # one at a time
    assert [state(pg_dsn, table, i)["status"] for i in ids] == ["done", "done", "pending", "pending", "pending"]
    assert [state(pg_dsn, table, i)["attempts"] for i in ids[2:]] == [1, 0, 0]


def test_publish_batch_returns_by_its_deadline(target):
    target.default = Step(200, delay=2.0)
    publisher = HttpPublisher(f"{target.base_url}/e/{{event_type}}", timeout_seconds=3, max_concurrency=1)
    try:
        started = time.monotonic()
        outcomes = publisher.publish_batch([message(1), message(2), message(3)], timeout_seconds=0.5)
        elapsed = time.monotonic() - started
    finally:
        publisher.close()
    assert elapsed < 1.0, elapsed
    assert isinstance(outcomes[0], RetryableError) and not isinstance(outcomes[0], NotDelivered)
    assert "timeout" in outcomes[0].reason.lower()
    assert all(isinstance(o, NotDelivered) for o in outcomes[1:])  # never sent: attempt refunded


def test_connection_refused_is_a_transport_retry():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    publisher = HttpPublisher(f"http://127.0.0.1:{port}/e", timeout_seconds=2)
    try:
        [outcome] = publisher.publish_batch([message(7)], timeout_seconds=3)
    finally:
        publisher.close()
    assert isinstance(outcome, RetryableError) and outcome.transport
    assert "connection failed" in outcome.reason and "127.0.0.1" in outcome.reason


def test_bad_url_template_is_a_startup_error_exit_2(pg_dsn, table, store):
    env = cli_env(
        pg_dsn,
        table,
        OUTBOX_RELAY_RELAY__PUBLISHER="http",
        OUTBOX_RELAY_METRICS__ENABLED="false",
        OUTBOX_RELAY_HTTP__URL_TEMPLATE="http://user:pw@127.0.0.1:1/e/{nope}",
        PYTHONPATH=str(ROOT),
    )
    proc = cli("run", env=env, timeout=60)
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [
        "outbox-relay: error: http.url_template: unknown placeholder {nope}; use {aggregate_type}, "
        "{aggregate_id}, {event_type}, {topic}, {id}"
    ], proc.stderr
    assert "pw" not in proc.stderr


def test_retry_after_parsing_edge_cases():
    from outbox_relay.publishers.http import parse_retry_after

    now = time.time()
    assert parse_retry_after(None) is None and parse_retry_after("") is None
    assert parse_retry_after("soon") is None and parse_retry_after("-1") is None and parse_retry_after("nan") is None
    assert parse_retry_after(" 3 ") == 3.0
    assert parse_retry_after("999999999999") == 86400.0  # capped to a day
    assert parse_retry_after(formatdate(now - 60, usegmt=True), now=now) == 0.0  # a past date: now
    assert 9 <= parse_retry_after(formatdate(now + 10, usegmt=True), now=now) <= 10


def test_unreachable_target_opens_the_breaker_instead_of_burning_attempts(make_settings, store, pg_dsn, table):
    from outbox_relay._embedded.embedded import free_port

    port = free_port()
    down = HttpTarget(port=port)  # not started yet: connections are refused
    settings = make_settings(
        relay={
            "publisher": "http",
            "backoff_base_seconds": 0.05,
            "backoff_cap_seconds": 0.2,
            "max_attempts": 3,
            "workers": 2,
        },
        http={"url_template": f"http://127.0.0.1:{port}/e/{{event_type}}"},
    )
    relay = Relay(settings)
    relay.start()  # an HTTP target may be down at start-up: the relay starts anyway
    try:
        ids = [add_row(pg_dsn, table, "Ok", aggregate_id=f"a{i}") for i in range(10)]
        wait_for(lambda: relay.breaker is not None and relay.breaker.is_open, message="breaker open")
        assert not relay.readiness()[0]
        time.sleep(1.0)  # several probe rounds while the target is down
        assert all(state(pg_dsn, table, i)["status"] != "dead" for i in ids)
        down.start()
        wait_for(lambda: all(state(pg_dsn, table, i)["status"] == "done" for i in ids), message="all done")
    finally:
        relay.stop()
        down.stop()
    assert relay.breaker.opened_count >= 1
    assert all(state(pg_dsn, table, i)["attempts"] < settings.relay.max_attempts for i in ids)


def test_a_tombstone_goes_dead_without_a_request_and_a_partition_is_ignored(
    make_settings, store, pg_dsn, table, target
):
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        tombstone = enqueue(
            conn,
            aggregate_type="order",
            aggregate_id="agg-1",
            event_type="Erased",
            payload=None,
            tombstone=True,
            table=table,
        )
    placed = add_row(pg_dsn, table, "E", partition=3)
    settings = http_settings(make_settings, target)
    publisher = HttpPublisher.from_settings(settings)
    try:
        worker_for(settings, store, publisher).run_once()
    finally:
        publisher.close()
    s = state(pg_dsn, table, tombstone)
    assert s["status"] == "dead" and s["attempts"] == 1
    assert "the row is a tombstone" in s["last_error"] and "HTTP publisher has no body" in s["last_error"]
    assert target.requests_for(tombstone) == []
    assert state(pg_dsn, table, placed)["status"] == "done"  # partition: a Kafka placement, nothing over HTTP
    assert len(target.requests_for(placed)) == 1
