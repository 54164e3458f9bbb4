"""Operator pause and resume (operator/pauses.py) on a real PostgreSQL and Apache Kafka:
paused rows are not claimed while others are, keep their attempts and come back in
their old order on resume; rows inserted after a pause are parked by the claim; an
ordered aggregate keeps its order across a pause; two relays (replicas) both honour a
pause at their next claim; every pause and resume is in the audit trail and in `status`;
the console's JSON API pauses and resumes with the same rules."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest

from outbox_relay.core.ordering import OrderingRule
from outbox_relay.db.store import OutboxStore
from outbox_relay.operator.operations import diagnose_aggregate
from outbox_relay.operator.pauses import (
    AlreadyPaused,
    NoSuchPause,
    PauseTarget,
    pause,
    pause_overview,
    resume,
)
from outbox_relay.runtime.relay import Relay
from tests.helpers import sources as source_helpers
from tests.helpers.cli import cli, cli_env
from tests.helpers.console import console_settings, running_console
from tests.helpers.db import DELETE_MODE, insert_rows, run_sql
from tests.helpers.wait import wait_for
from tests.integration.test_metrics_http import METRICS, poll, scrape, value
from tests.integration.test_sources import fetch, metric, running, sources_settings

pytestmark = pytest.mark.timeout(300)
databases = source_helpers.databases  # the fixture
__all__ = ["running"]  # a fixture of tests/integration/test_sources.py, used here
TOKEN = "pause-console-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
FAR_FUTURE_YEAR = 2900


def claim_all(store: OutboxStore, ordered_types: list[str] | None = None, batch: int = 1000) -> list[Any]:
    """Every row one claim takes (a bounded loop of claims until one comes back empty)."""
    taken: list[Any] = []
    for _ in range(20):
        result = store.claim(
            owner="test", batch=batch, lease_seconds=30, max_attempts=5, ordered_types=ordered_types or []
        )
        if not result.rows:
            break
        taken += result.rows
    return taken


def states(dsn: str, table: str) -> dict[int, dict[str, Any]]:
    found = run_sql(
        dsn,
        table,
        "SELECT id, status, attempts, lease_version, available_at, extract(year FROM available_at) FROM {t}",
    )
    return {
        r[0]: {"status": r[1], "attempts": r[2], "lease_version": r[3], "available_at": r[4], "year": int(r[5])}
        for r in found
    }


def test_pause_parks_and_resume_restores(store: OutboxStore, pg_dsn: str, table: str) -> None:
    paused_ids = insert_rows(pg_dsn, table, 30, event_type="Paused")
    other_ids = insert_rows(pg_dsn, table, 20, event_type="Other")
    # some paused rows have been tried before: a pause keeps their attempts
    run_sql(pg_dsn, table, "UPDATE {t} SET attempts = 2 WHERE id = ANY(%s)", [paused_ids[:5]])
    before = states(pg_dsn, table)

    result = pause(
        store, PauseTarget("event_type", "Paused"), reason="downstream down", actor="ops", source="cli", max_attempts=5
    )
    assert result.rows_parked == 30
    parked = states(pg_dsn, table)
    for row_id in paused_ids:
        assert parked[row_id]["year"] > FAR_FUTURE_YEAR
        assert parked[row_id]["attempts"] == before[row_id]["attempts"]
        assert parked[row_id]["lease_version"] == before[row_id]["lease_version"]
    with pytest.raises(AlreadyPaused):
        pause(store, PauseTarget("event_type", "Paused"), reason="again", actor="ops", source="cli", max_attempts=5)

    taken = claim_all(store)
    assert {r.id for r in taken} == set(other_ids)

    # a row inserted after the pause: the claim does not take it, and parks it
    late = insert_rows(pg_dsn, table, 3, event_type="Paused")
    assert claim_all(store) == []
    assert all(states(pg_dsn, table)[i]["year"] > FAR_FUTURE_YEAR for i in late)
    overview = pause_overview(store, count_cap=1000)
    assert overview["paused_rows"] == 33 and [p["value"] for p in overview["active"]] == ["Paused"]
    assert overview["active"][0]["kind"] == "operator"

    resumed = resume(store, pause_id=None, target=PauseTarget("event_type", "Paused"), actor="ops", source="cli")
    assert resumed.rows_unparked == 33
    after = states(pg_dsn, table)
    for row_id in paused_ids:  # the original available_at, to the microsecond
        assert after[row_id]["available_at"] == before[row_id]["available_at"]
        assert after[row_id]["attempts"] == before[row_id]["attempts"]
    taken = claim_all(store)
    assert sorted(r.id for r in taken) == sorted(paused_ids + late)
    assert {r.id: r.attempts for r in taken if r.id in paused_ids[:5]} == dict.fromkeys(paused_ids[:5], 3)
    with pytest.raises(NoSuchPause):
        resume(store, pause_id=resumed.pause.id, target=None, actor="ops", source="cli")

    audit = [(e["action"], e["rows_changed"], e["reason"]) for e in store.audit_list()]
    assert ("pause", 30, "downstream down") in audit and ("resume", 33, None) in audit


def test_pause_by_topic_and_aggregate_type(store: OutboxStore, pg_dsn: str, table: str) -> None:
    on_topic = insert_rows(pg_dsn, table, 4, aggregate_type="invoice", topic="billing")
    invoices = insert_rows(pg_dsn, table, 5, aggregate_type="invoice")
    orders = insert_rows(pg_dsn, table, 6, aggregate_type="order")
    by_topic = pause(store, PauseTarget("topic", "billing"), reason="r", actor="ops", source="cli", max_attempts=5)
    by_type = pause(
        store, PauseTarget("aggregate_type", "invoice"), reason="r", actor="ops", source="cli", max_attempts=5
    )
    assert (by_topic.rows_parked, by_type.rows_parked) == (4, 5)
    assert {r.id for r in claim_all(store)} == set(orders)
    # ending one pause leaves the rows the other still matches parked
    back = resume(store, pause_id=by_type.pause.id, target=None, actor="ops", source="cli")
    assert back.rows_unparked == 5
    assert {r.id for r in claim_all(store)} == set(invoices)
    resume(store, pause_id=by_topic.pause.id, target=None, actor="ops", source="cli")
    assert {r.id for r in claim_all(store)} == set(on_topic)


def test_ordered_aggregate_keeps_its_order(store: OutboxStore, pg_dsn: str, table: str) -> None:
    """Pausing one ordered event type holds back, in each aggregate whose earliest
    unfinished ordered row is paused, every ordered row behind it (of any type)."""
    ordered = ["A", "B"]
    first = insert_rows(pg_dsn, table, 1, event_type="A", aggregates=1)  # agg-0: A then B
    second = insert_rows(pg_dsn, table, 1, event_type="B", aggregates=1)
    pause(store, PauseTarget("event_type", "A"), reason="hold A", actor="ops", source="cli", max_attempts=5)
    late_a = insert_rows(pg_dsn, table, 1, event_type="A", aggregate_type="x", aggregates=1)  # not yet parked
    assert claim_all(store, ordered) == []  # B waits behind the paused A; the late A is not taken
    rows, _total = store.aggregate_rows("agg-0")
    assert "paused by an operator" in diagnose_aggregate(rows, OrderingRule.of(ordered), max_attempts=5)
    resume(store, pause_id=None, target=PauseTarget("event_type", "A"), actor="ops", source="cli")
    sequence: list[int] = []
    for _ in range(10):  # one head per aggregate per claim, in id order
        rows = store.claim(owner="t", batch=1, lease_seconds=30, max_attempts=5, ordered_types=ordered).rows
        if not rows:
            break
        sequence += [r.id for r in rows]
        store.mark_done([(r.id, r.lease_version) for r in rows])
    assert sequence == first + second + late_a


def test_cli_pause_status_resume(store: OutboxStore, pg_dsn: str, table: str) -> None:
    insert_rows(pg_dsn, table, 7, event_type="Held")
    env = cli_env(pg_dsn, table)
    refused = cli("pause", "--event-type", "Held", env=env)
    assert refused.returncode == 2 and "--reason" in refused.stderr, refused.stderr
    both = cli("pause", "--event-type", "Held", "--topic", "t", "--reason", "r", env=env)
    assert both.returncode == 2 and "exactly one" in both.stderr
    done = cli("pause", "--event-type", "Held", "--reason", "consumer migration", "--json", env=env)
    assert done.returncode == 0, done.stderr
    made = json.loads(done.stdout)
    assert made["rows_parked"] == 7 and made["pause"]["kind"] == "operator"

    status = cli("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert doc["operator_pauses"]["paused_rows"] == 7
    assert [(p["selector"], p["value"], p["reason"]) for p in doc["operator_pauses"]["active"]] == [
        ("event_type", "Held", "consumer migration")
    ]
    text = cli("status", env=env)
    assert "operator pause" in text.stdout and "Held" in text.stdout

    listed = cli("pauses", "--json", env=env)
    assert [p["id"] for p in json.loads(listed.stdout)] == [made["pause"]["id"]]
    back = cli("resume", str(made["pause"]["id"]), "--json", env=env)
    assert back.returncode == 0, back.stderr
    assert json.loads(back.stdout)["rows_unparked"] == 7
    again = cli("resume", "--event-type", "Held", env=env)
    assert again.returncode == 1 and "no active pause" in again.stderr
    audit = cli("audit", "list", "--json", env=env)
    actions = [e["action"] for e in json.loads(audit.stdout)]
    assert actions[:2] == ["resume", "pause"]


def test_two_relays_honour_a_pause(make_settings, store: OutboxStore, pg_dsn: str, table: str) -> None:
    """Two relays of one outbox (two replicas): rows of a paused event type inserted
    while both run are delivered by neither; the others are; after the resume, all."""
    settings = make_settings(relay={"workers": 2, "poll_interval_seconds": 0.2})
    relays = [
        Relay(make_settings(relay={"workers": 2, "poll_interval_seconds": 0.2}, metrics=METRICS)),
        Relay(settings),
    ]
    for relay in relays:
        relay.start()
    try:
        pause(
            store, PauseTarget("event_type", "Held"), reason="two replicas", actor="ops", source="cli", max_attempts=5
        )
        held = insert_rows(pg_dsn, table, 40, event_type="Held")
        free = insert_rows(pg_dsn, table, 40, event_type="Free")

        def finished(ids: list[int]) -> bool:
            left = run_sql(
                pg_dsn,
                table,
                "SELECT count(*) FROM {t} WHERE id = ANY(%s) AND status IN ('pending', 'processing')",
                [ids],
            )
            return left[0][0] == 0

        wait_for(lambda: finished(free), timeout=60, message="the unpaused rows delivered")
        time.sleep(1.0)  # several claim cycles of both relays
        left = run_sql(
            pg_dsn, table, "SELECT status, attempts, count(*) FROM {t} WHERE id = ANY(%s) GROUP BY 1, 2", [held]
        )
        assert left == [("pending", 0, 40)], left
        # the claims that met them parked them: the gauges show one operator pause, 40 rows
        port = relays[0].metrics_port
        assert isinstance(port, int)

        def gauges() -> tuple[float, float]:
            _text, samples = scrape(port)
            return value(samples, "outbox_relay_operator_pauses"), value(samples, "outbox_relay_paused_rows")

        assert poll(gauges, lambda g: g == (1.0, 40.0), timeout=30) == (1.0, 40.0)
        assert value(scrape(port)[1], "outbox_relay_circuit_breaker_open") == 0.0  # not the breaker's pause
        resume(store, pause_id=None, target=PauseTarget("event_type", "Held"), actor="ops", source="cli")
        wait_for(lambda: finished(held), timeout=60, message="the resumed rows delivered")
    finally:
        for relay in relays:
            relay.stop()


def test_console_api_pause_resume(make_settings, store: OutboxStore, pg_dsn: str, table: str) -> None:
    insert_rows(pg_dsn, table, 5, event_type="Held")
    settings = make_settings(console={"token": TOKEN})
    with running_console(settings) as base:
        bad = httpx.post(f"{base}/api/pauses", json={"event_type": "Held"}, headers=BEARER, timeout=30)
        assert bad.status_code == 400 and "reason" in bad.json()["error"]
        made = httpx.post(
            f"{base}/api/pauses", json={"event_type": "Held", "reason": "from the API"}, headers=BEARER, timeout=30
        )
        assert made.status_code == 200, made.text
        doc = made.json()
        assert doc["rows_parked"] == 5
        listed = httpx.get(f"{base}/api/pauses", headers=BEARER, timeout=30).json()
        assert listed["paused_rows"] == 5 and listed["active"][0]["reason"] == "from the API"
        page = httpx.get(f"{base}/pauses", headers=BEARER, timeout=30)
        assert page.status_code == 200 and "Held" in page.text
        back = httpx.post(f"{base}/api/pauses/{doc['pause']['id']}/resume", json={}, headers=BEARER, timeout=30)
        assert back.status_code == 200, back.text
        assert back.json()["rows_unparked"] == 5
        gone = httpx.post(f"{base}/api/pauses/{doc['pause']['id']}/resume", json={}, headers=BEARER, timeout=30)
        assert gone.status_code == 404
    actions = [(e["action"], e["source"]) for e in store.audit_list()]
    assert ("pause", "api") in actions and ("resume", "api") in actions  # made with the API's bearer token


def test_a_pause_of_one_source_in_a_many_source_relay(databases, broker, topic_prefix, running) -> None:
    """`pause --source b` in a configuration of two outboxes: a many-source relay
    (MultiRelay) delivers source a's rows and b's unpaused ones, not b's paused rows;
    the gauges carry source="b"; after `resume --source b` everything is delivered."""
    dsn_a, dsn_b = databases("a"), databases("b")
    settings = sources_settings(broker, topic_prefix, {"a": {"dsn": dsn_a}, "b": {"dsn": dsn_b}})
    env = {
        "OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1",
        "OUTBOX_RELAY_SOURCES__A__DSN": dsn_a,
        "OUTBOX_RELAY_SOURCES__B__DSN": dsn_b,
    }
    if DELETE_MODE:
        env["OUTBOX_RELAY_RELAY__ON_DONE"] = "delete"
    refused = cli("pause", "--event-type", "Held", "--reason", "r", env=env)
    assert refused.returncode == 2 and "--source" in refused.stderr
    made = cli("pause", "--event-type", "Held", "--reason", "b only", "--source", "b", "--json", env=env)
    assert made.returncode == 0, made.stderr
    held_a = insert_rows(dsn_a, "outbox", 6, event_type="Held")
    held_b = insert_rows(dsn_b, "outbox", 8, event_type="Held")
    free_b = insert_rows(dsn_b, "outbox", 4, event_type="Free")
    relay = running(settings)

    def unfinished(dsn: str, ids: list[int]) -> int:
        query = "SELECT count(*) FROM {t} WHERE id = ANY(%s) AND status IN ('pending', 'processing')"
        return int(run_sql(dsn, "outbox", query, [ids])[0][0])

    wait_for(lambda: unfinished(dsn_a, held_a) == 0 and unfinished(dsn_b, free_b) == 0, timeout=60)
    port = relay.metrics_port
    assert port is not None
    wait_for(
        lambda: metric(fetch(port, "/metrics")[1], "outbox_relay_paused_rows", source="b") == 8,
        timeout=30,
        message="source b's paused rows gauge",
    )
    text = fetch(port, "/metrics")[1]
    assert metric(text, "outbox_relay_operator_pauses", source="b") == 1
    assert metric(text, "outbox_relay_operator_pauses", source="a") == 0
    assert unfinished(dsn_b, held_b) == 8
    status = json.loads(cli("status", "--json", env=env).stdout)
    assert status["sources"]["b"]["operator_pauses"]["paused_rows"] == 8
    assert status["sources"]["a"]["operator_pauses"]["active"] == []
    back = cli("resume", "--event-type", "Held", "--source", "b", env=env)
    assert back.returncode == 0, back.stderr
    wait_for(lambda: unfinished(dsn_b, held_b) == 0, timeout=60, message="source b's resumed rows delivered")


def test_console_pages_pause_and_resume_with_csrf_and_escape(store: OutboxStore, pg_dsn: str, table: str) -> None:
    """The Pauses page of a logged-in session: a form post without the session's CSRF
    token changes nothing; with it the pause is made (its hostile value escaped on every
    page) and the overview shows it; the Resume button ends it; the audit log has both."""
    hostile = "<script>document.title='pwned'</script>"
    insert_rows(pg_dsn, table, 3, event_type=f"Evt{hostile}")
    with (
        running_console(console_settings(pg_dsn, table, token=TOKEN)) as url,
        httpx.Client(base_url=url, follow_redirects=False) as http,
    ):
        assert http.post("/login", data={"name": "eve", "token": TOKEN}).status_code == 303
        page = http.get("/pauses")
        assert page.status_code == 200 and "0</strong> active pauses" in page.text
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
        form = {"selector": "event_type", "value": f"Evt{hostile}", "reason": "hold"}
        assert http.post("/pauses/apply", data=form).status_code == 403
        assert store.pauses() == []
        missing = http.post("/pauses/apply", data=dict(form, reason="", csrf_token=csrf))
        assert missing.status_code == 400 and "reason" in missing.text
        done = http.post("/pauses/apply", data=dict(form, csrf_token=csrf))
        assert done.status_code == 303, done.text
        assert [p.value for p in store.pauses()] == [f"Evt{hostile}"]
        assert {r[1] for r in run_sql(pg_dsn, table, "SELECT id, available_at > now() FROM {t}")} == {True}
        listed, overview = http.get("/pauses"), http.get("/")
        for shown in (listed, overview):
            assert shown.status_code == 200 and "<script>document" not in shown.text
        assert "&lt;script&gt;" in listed.text and "3</strong> pending rows parked" in listed.text
        assert 'id="operator-pauses"' in overview.text
        pause_id = store.pauses()[0].id
        assert http.post(f"/pauses/{pause_id}/resume", data={}).status_code == 403
        back = http.post(f"/pauses/{pause_id}/resume", data={"csrf_token": csrf})
        assert back.status_code == 303, back.text
        assert store.pauses() == []
        assert {r[1] for r in run_sql(pg_dsn, table, "SELECT id, available_at <= now() FROM {t}")} == {True}
        again = http.post(f"/pauses/{pause_id}/resume", data={"csrf_token": csrf})
        assert again.status_code == 404
    actions = [(e["action"], e["source"], e["actor"]) for e in store.audit_list()]
    assert actions[:2] == [("resume", "console", "eve"), ("pause", "console", "eve")]


def test_a_pause_parks_rows_whose_lease_expired_and_fences_their_owner(store: OutboxStore, pg_dsn: str, table: str):
    """A paused row claimed by a relay that then died (its lease expired) is parked as a
    pending row with a new lease_version, so the lost owner's finalize is refused;
    attempts are kept. One that used every attempt is left to the reaper."""
    lost, poison = insert_rows(pg_dsn, table, 2, event_type="Held")
    claimed = {r.id: r for r in claim_all(store)}
    run_sql(pg_dsn, table, "UPDATE {t} SET lease_until = now() - interval '1 s'")
    run_sql(pg_dsn, table, "UPDATE {t} SET attempts = 5 WHERE id = %s", [poison])
    made = pause(store, PauseTarget("event_type", "Held"), reason="r", actor="ops", source="cli", max_attempts=5)
    assert made.rows_parked == 1
    after = states(pg_dsn, table)
    assert after[lost]["status"] == "pending" and after[lost]["year"] > FAR_FUTURE_YEAR
    assert after[lost]["lease_version"] == claimed[lost].lease_version + 1
    assert after[lost]["attempts"] == claimed[lost].attempts
    assert after[poison]["status"] == "processing"
    assert store.mark_done([(lost, claimed[lost].lease_version)]) == set()  # the lost owner is fenced out
    resume(store, pause_id=made.pause.id, target=None, actor="ops", source="cli")
    assert [r.id for r in claim_all(store)] == [lost]
