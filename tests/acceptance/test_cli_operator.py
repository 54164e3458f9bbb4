"""Dead-row operations through the real CLI (a subprocess) against a real PostgreSQL: dead-row
filters, dry runs, chunked retry/skip by filter, the audit trail, `aggregate show`,
and exact counts in `status`.

Runs in the suite's relay.on_done mode (tests/helpers/db.py: ON_DONE): the dead-letter
operations must not depend on it (a skipped row stays ``done`` in both modes)."""

from __future__ import annotations

import datetime as dt
import json

import psycopg
import pytest

from outbox_relay.operator.operations import os_user
from tests.helpers.cli import cli, cli_env
from tests.helpers.console import quoted, row_states, seed_dead

pytestmark = pytest.mark.timeout(300)


def run_ok(*args: str, env: dict[str, str]) -> str:
    proc = cli(*args, env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    return proc.stdout


def one_line_error(*args: str, env: dict[str, str], code: int) -> str:
    proc = cli(*args, env=env)
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture
def bad_deploy(store, pg_dsn, table):
    """The issue's scenario in small: the PaymentCaptured rows that hit UNKNOWN_TOPIC
    must be retried, nothing else."""
    return {
        "target": seed_dead(pg_dsn, table, 8, aggregates=3),
        "old_target": seed_dead(pg_dsn, table, 2, age_seconds=3 * 3600, aggregate_prefix="old-"),
        "other_error": seed_dead(pg_dsn, table, 3, last_error="permanent: MSG_SIZE_TOO_LARGE"),
        "other_type": seed_dead(
            pg_dsn, table, 4, event_type="OrderCreated", aggregate_type="order", aggregate_prefix="order-"
        ),
        "pending": seed_dead(pg_dsn, table, 2, status="pending"),
    }


def audit(env: dict[str, str]) -> list[dict]:
    return json.loads(run_ok("audit", "list", "--json", env=env))


def test_dead_list_filters(bad_deploy, pg_dsn, table):
    env = cli_env(pg_dsn, table)
    b = bad_deploy

    def ids(*args: str) -> list[int]:
        return [r["id"] for r in json.loads(run_ok("dead", "list", "--json", *args, env=env))]

    assert ids("--event-type", "PaymentCaptured", "--error-contains", "unknown_topic") == sorted(
        b["target"] + b["old_target"]
    )
    assert ids("--event-type", "PaymentCaptured", "--error-contains", "UNKNOWN_TOPIC", "--since", "1h") == b["target"]
    assert ids("--until", "1h") == b["old_target"]
    assert ids("--aggregate-type", "order") == b["other_type"]
    assert ids("--aggregate-id", "pay-1") == [
        i for i in b["target"] + b["other_error"] if row_aggregate(pg_dsn, table, i) == "pay-1"
    ]
    # A timestamp bound (no zone = UTC) and keyset pagination by id.
    future = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S")
    assert ids("--until", future, "--event-type", "OrderCreated") == b["other_type"]
    first_page = ids("--event-type", "OrderCreated", "--limit", "2")
    assert first_page == b["other_type"][:2]
    assert ids("--event-type", "OrderCreated", "--after-id", str(first_page[-1])) == b["other_type"][2:]
    # LIKE wildcards in the operator's text are plain characters.
    assert ids("--error-contains", "%") == []

    human = run_ok("dead", "list", "--event-type", "PaymentCaptured", env=env)
    assert "13 dead rows match; showing 13" in human
    assert "by event type: PaymentCaptured 13" in human
    assert "retries exhausted: UNKNOWN_TOPIC_OR_PART" in human and "MSG_SIZE_TOO_LARGE" in human


def row_aggregate(dsn: str, table: str, row_id: int) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f"SELECT aggregate_id FROM {quoted(table)} WHERE id = %s", (row_id,)).fetchone()[0]


def test_retry_by_filter_dry_run_then_chunked_with_audit(bad_deploy, pg_dsn, table):
    env = cli_env(pg_dsn, table)
    b = bad_deploy
    everything = [i for group in b.values() for i in group]
    before = row_states(pg_dsn, table, everything)
    filters = ("--event-type", "PaymentCaptured", "--error-contains", "UNKNOWN_TOPIC")

    dry = run_ok("dead", "retry", *filters, "--dry-run", env=env)
    assert "dry run: 10 dead rows would be retried; nothing changed" in dry
    assert "by event type: PaymentCaptured 10" in dry
    assert "aggregates: 5 (old-1, old-2, pay-0, pay-1, pay-2)" in dry
    assert row_states(pg_dsn, table, everything) == before
    assert audit(env) == []  # a dry run changes nothing and records nothing

    out = run_ok("dead", "retry", *filters, "--chunk-size", "3", env=env)
    assert "retried 10 dead rows" in out
    after = row_states(pg_dsn, table, everything)
    for i in b["target"] + b["old_target"]:
        assert after[i] == ("pending", 0)
    for i in b["other_error"] + b["other_type"]:
        assert after[i] == ("dead", 12)

    [entry] = audit(env)
    assert (entry["action"], entry["source"], entry["actor"]) == ("retry", "cli", os_user())
    assert entry["selector"] == {"filter": {"event_type": "PaymentCaptured", "error_contains": "UNKNOWN_TOPIC"}}
    assert (entry["rows_matched"], entry["rows_changed"], entry["reason"]) == (10, 10, None)
    assert entry["finished_at"] is not None
    assert "none given" in run_ok("audit", "list", env=env)


def test_skip_by_filter_with_limit_and_reason_and_legacy_forms(bad_deploy, pg_dsn, table):
    env = cli_env(pg_dsn, table)
    b = bad_deploy
    out = run_ok(
        "dead", "skip", "--event-type", "OrderCreated", "--limit", "3", "--reason", "replayed by hand", env=env
    )
    assert "skipped 3 dead rows" in out
    states = row_states(pg_dsn, table, b["other_type"])
    assert [states[i][0] for i in b["other_type"]] == ["done", "done", "done", "dead"]  # the oldest 3 by id
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        error = conn.execute(f"SELECT last_error FROM {quoted(table)} WHERE id = %s", (b["other_type"][0],)).fetchone()[
            0
        ]
    assert error == f"skipped by {os_user()}: replayed by hand"

    # Ids and --all are audited too; a skip needs a reason on every surface.
    line = one_line_error("dead", "skip", str(b["other_type"][3]), env=env, code=2)
    assert "say why" in line and "--reason" in line
    run_ok("dead", "skip", str(b["other_type"][3]), "--reason", "  duplicate of another row ", env=env)
    out = run_ok("dead", "retry", "--all", env=env)
    assert "retried 13 dead rows" in out
    entries = audit(env)
    assert [(e["action"], e["rows_changed"]) for e in entries] == [("retry", 13), ("skip", 1), ("skip", 3)]
    assert entries[0]["selector"] == {"all": True}
    assert entries[1]["selector"] == {"ids": [b["other_type"][3]]}
    assert entries[1]["reason"] == "duplicate of another row"
    assert entries[2]["selector"] == {"filter": {"event_type": "OrderCreated", "limit": 3}}
    assert entries[2]["reason"] == "replayed by hand"


def test_usage_errors_change_nothing(bad_deploy, pg_dsn, table):
    env = cli_env(pg_dsn, table)
    b = bad_deploy
    line = one_line_error("dead", "retry", str(b["target"][0]), "--event-type", "X", env=env, code=2)
    assert "exactly one" in line
    line = one_line_error("dead", "skip", env=env, code=2)
    assert "--all" in line
    line = one_line_error("dead", "retry", str(b["target"][0]), "--limit", "1", env=env, code=2)
    assert "--limit" in line
    line = one_line_error("dead", "retry", "--since", "yesterday", env=env, code=2)
    assert line.startswith("outbox-relay: error: --since:")
    line = one_line_error("dead", "list", "--until", "2025-13-45", env=env, code=2)
    assert "--until" in line
    assert {s for s, _ in row_states(pg_dsn, table, b["target"]).values()} == {"dead"}
    assert audit(env) == []


def test_aggregate_show_says_what_blocks(store, pg_dsn, table):
    env = cli_env(pg_dsn, table, OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES='["*"]')
    head = seed_dead(pg_dsn, table, 1, aggregate_prefix="cart-", aggregates=1)[0]  # aggregate "cart-0"
    followers = seed_dead(pg_dsn, table, 2, aggregate_prefix="cart-", aggregates=1, status="pending")

    doc = json.loads(run_ok("aggregate", "show", "cart-0", "--json", env=env))
    assert doc["unfinished"] == 3
    assert [r["id"] for r in doc["rows"]] == [head, *followers]
    assert doc["diagnosis"].startswith(f"blocked by dead head {head}")
    assert [r["state"] for r in doc["rows"]] == ["dead", f"waits behind head {head}", f"waits behind head {head}"]

    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # the head is retried but backs off
        conn.execute(
            f"UPDATE {quoted(table)} SET status = 'pending', available_at = now() + interval '1 hour' WHERE id = %s",
            (head,),
        )
    assert "is not yet due" in json.loads(run_ok("aggregate", "show", "cart-0", "--json", env=env))["diagnosis"]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # a relay holds it
        conn.execute(
            f"UPDATE {quoted(table)} SET status = 'processing', lease_owner = 'host:1',"
            " lease_until = now() + interval '30 seconds', lease_version = 1 WHERE id = %s",
            (head,),
        )
    human = run_ok("aggregate", "show", "cart-0", env=env)
    assert f"head {head} is in flight (host:1" in human
    assert "unordered" not in human

    plain = cli_env(pg_dsn, table)  # no ordered types: nothing holds rows back
    assert json.loads(run_ok("aggregate", "show", "cart-0", "--json", env=plain))["diagnosis"].startswith("not ordered")
    assert "nothing unfinished" in run_ok("aggregate", "show", "nobody", env=env)


def test_status_counts_exactly_above_the_cap(store, pg_dsn, table):
    seed_dead(pg_dsn, table, 250)
    env = cli_env(pg_dsn, table, OUTBOX_RELAY_METRICS__EXACT_COUNT_LIMIT="100")
    doc = json.loads(run_ok("status", "--json", env=env))
    assert doc["queue_depth"] == {"pending": 0, "processing": 0, "done": 0, "dead": 250}
    assert doc["queue_depth_estimated"] == []
    assert "dead rows match" not in run_ok("status", env=env)


def test_status_says_lower_bound_when_counting_runs_out(store, pg_dsn, table):
    seed_dead(pg_dsn, table, 50_000, aggregates=1000)
    env = cli_env(
        pg_dsn, table, OUTBOX_RELAY_METRICS__EXACT_COUNT_LIMIT="100", OUTBOX_RELAY_METRICS__EXACT_COUNT_TIMEOUT_MS="1"
    )
    doc = json.loads(run_ok("status", "--json", env=env))
    # dead is a lower bound; done (no index: its count reads the table) may be one too.
    assert "dead" in doc["queue_depth_estimated"] and set(doc["queue_depth_estimated"]) <= {"dead", "done"}
    assert 100 <= doc["queue_depth"]["dead"] < 50_000  # a proven lower bound, never more than there is
    human = run_ok("status", env=env)
    dead_line = next(line for line in human.splitlines() if line.strip().startswith("dead"))
    assert "\u2265" in dead_line and "lower bound" in dead_line
