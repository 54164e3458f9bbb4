"""Operator commands through the real CLI (a subprocess) against a real PostgreSQL:
``status [--json]``, ``dead list|retry|skip``, ``purge --older-than``, and their
error paths (exit codes, one-line messages, no traceback, no secrets).

Runs in the suite's relay.on_done mode (tests/helpers/db.py: ON_DONE; the ``store``
fixture migrates the table to it and ``cli_env`` passes it on): the dead-letter
commands and purge must behave alike in both (a skipped row is ``done`` until purged
even when the relay deletes delivered rows)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import psycopg
import pytest

from outbox_relay.db.store import STATUSES
from tests.helpers.cli import cli, cli_env
from tests.helpers.db import DELETE_MODE, ON_DONE

pytestmark = pytest.mark.timeout(300)

DEAD_FIELDS = {"id", "aggregate_type", "aggregate_id", "event_type", "attempts", "last_error", "created_at"}


# --------------------------------------------------------------------------- helpers
def qualified(table: str) -> str:
    schema, name = table.split(".")
    return f'"{schema}"."{name}"'


def seed(
    dsn: str,
    table: str,
    status: str,
    n: int = 1,
    *,
    event_type: str = "OrderCreated",
    aggregate_id: str | None = None,
    attempts: int = 0,
    last_error: str | None = None,
    age_seconds: float = 0.0,
    lease_seconds: float | None = None,
    done_age_seconds: float | None = None,
) -> list[int]:
    """Insert n rows directly in the given state; return their ids (ascending)."""
    t = qualified(table)
    lease = None
    if status == "processing":
        lease = 600.0 if lease_seconds is None else lease_seconds
    done_age = (0.0 if done_age_seconds is None else done_age_seconds) if status == "done" else None
    ids = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(n):
            row = conn.execute(
                f"INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, status, attempts, last_error,"
                " created_at, lease_owner, lease_until, lease_version, done_at)"
                " VALUES ('order', %(agg)s, %(et)s, %(payload)s::jsonb, %(status)s, %(attempts)s, %(err)s,"
                "  now() - make_interval(secs => %(age)s),"
                "  CASE WHEN %(lease)s::float8 IS NULL THEN NULL ELSE 'seeded' END,"
                "  now() + make_interval(secs => %(lease)s::float8),"
                "  CASE WHEN %(lease)s::float8 IS NULL THEN 0 ELSE 1 END,"
                "  now() - make_interval(secs => %(done_age)s::float8))"
                " RETURNING id",
                {
                    "agg": aggregate_id or f"agg-{status}-{i}",
                    "et": event_type,
                    "payload": json.dumps({"i": i}),
                    "status": status,
                    "attempts": attempts,
                    "err": last_error,
                    "age": age_seconds,
                    "lease": lease,
                    "done_age": done_age,
                },
            ).fetchone()
            ids.append(row[0])
    return ids


def state(dsn: str, table: str) -> dict[int, dict[str, Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(
            f"SELECT id, status, attempts, last_error, available_at <= now() AS due, done_at, lease_until"
            f" FROM {qualified(table)} ORDER BY id"
        )
        names = [d.name for d in cur.description]
        return {r[0]: dict(zip(names, r, strict=True)) for r in cur.fetchall()}


def assert_one_line_error(proc, code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


def run_ok(*args: str, env: dict[str, str]):
    proc = cli(*args, env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    return proc


# --------------------------------------------------------------------------- status
def test_status_json_matches_seeded_rows(store, pg_dsn, table):
    seed(pg_dsn, table, "pending", 2)
    oldest = seed(pg_dsn, table, "pending", 1, attempts=2, age_seconds=900)
    seed(pg_dsn, table, "processing", 1, attempts=1)  # lease still running
    seed(pg_dsn, table, "processing", 2, attempts=1, lease_seconds=-60)  # claimed, never finalized
    seed(pg_dsn, table, "done", 4, age_seconds=5000)  # older, but finished
    seed(pg_dsn, table, "dead", 1, attempts=5, last_error="boom", age_seconds=5000)
    assert oldest

    proc = run_ok("status", "--json", env=cli_env(pg_dsn, table))
    doc = json.loads(proc.stdout)
    assert {"queue_depth", "oldest_pending_age_seconds", "expired_leases"} <= doc.keys()
    assert doc["queue_depth"] == {"pending": 3, "processing": 3, "done": 4, "dead": 1}
    assert doc["expired_leases"] == 2
    # The 900 s old pending row is the oldest unfinished one (done/dead rows are older
    # but do not count).
    assert 900 <= doc["oldest_pending_age_seconds"] < 900 + 300
    # Attempts of pending + processing rows: 0,0,2 and 1,1,1.
    assert doc["attempts"] == {"0": 2, "1": 3, "2": 1}
    assert doc["table"] == table
    assert doc["on_done"] == ON_DONE


def test_status_json_empty_table_has_every_status(store, pg_dsn, table):
    doc = json.loads(run_ok("status", "--json", env=cli_env(pg_dsn, table)).stdout)
    assert doc["queue_depth"] == dict.fromkeys(STATUSES, 0)
    assert doc["oldest_pending_age_seconds"] == 0
    assert doc["expired_leases"] == 0


def test_status_human_table_mentions_each_status(store, pg_dsn, table):
    seed(pg_dsn, table, "pending", 3)
    seed(pg_dsn, table, "dead", 2, last_error="x")
    out = run_ok("status", env=cli_env(pg_dsn, table)).stdout
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert lines["pending"] == ["3"]
    assert lines["processing"] == ["0"]
    assert lines["done"] == ["0"]
    assert lines["dead"] == ["2"]
    assert "expired leases" in out
    assert table in out
    assert ("delivered rows are deleted" in out.splitlines()[0]) == DELETE_MODE


# --------------------------------------------------------------------------- dead list
def test_dead_list_json_fields_limit_and_filters(store, pg_dsn, table):
    a = seed(
        pg_dsn,
        table,
        "dead",
        1,
        event_type="OrderCreated",
        aggregate_id="o-1",
        attempts=5,
        last_error="retries exhausted: broker said no",
    )[0]
    b = seed(
        pg_dsn,
        table,
        "dead",
        1,
        event_type="OrderPaid",
        aggregate_id="o-2",
        attempts=3,
        last_error="permanent: too large",
    )[0]
    c = seed(
        pg_dsn,
        table,
        "dead",
        1,
        event_type="OrderCreated",
        aggregate_id="o-3",
        attempts=1,
        last_error="permanent: bad payload",
    )[0]
    seed(pg_dsn, table, "pending", 2, event_type="OrderCreated")
    seed(pg_dsn, table, "done", 1, event_type="OrderCreated")
    env = cli_env(pg_dsn, table)

    listed = json.loads(run_ok("dead", "list", "--json", env=env).stdout)
    assert isinstance(listed, list)
    assert [r["id"] for r in listed] == [a, b, c]
    for row in listed:
        assert DEAD_FIELDS <= row.keys()
        assert dt.datetime.fromisoformat(row["created_at"]).tzinfo is not None
    first = listed[0]
    assert (
        first["aggregate_type"],
        first["aggregate_id"],
        first["event_type"],
        first["attempts"],
        first["last_error"],
    ) == ("order", "o-1", "OrderCreated", 5, "retries exhausted: broker said no")

    limited = json.loads(run_ok("dead", "list", "--json", "--limit", "2", env=env).stdout)
    assert [r["id"] for r in limited] == [a, b]

    by_type = json.loads(run_ok("dead", "list", "--json", "--event-type", "OrderCreated", env=env).stdout)
    assert [r["id"] for r in by_type] == [a, c]

    by_aggregate = json.loads(run_ok("dead", "list", "--json", "--aggregate-id", "o-2", env=env).stdout)
    assert [r["id"] for r in by_aggregate] == [b]

    none = json.loads(run_ok("dead", "list", "--json", "--event-type", "Nope", env=env).stdout)
    assert none == []

    human = run_ok("dead", "list", env=env).stdout
    for row_id in (a, b, c):
        assert str(row_id) in human
    assert "too large" in human

    bad = cli("dead", "list", "--limit", "0", env=env)
    assert bad.returncode == 2, (bad.stdout, bad.stderr)
    assert "Traceback" not in bad.stderr


def test_dead_list_human_when_empty(store, pg_dsn, table):
    seed(pg_dsn, table, "pending", 1)
    assert run_ok("dead", "list", env=cli_env(pg_dsn, table)).stdout.strip() == "no dead rows"


# --------------------------------------------------------------------------- dead retry
def test_dead_retry_ids_back_to_pending_keeping_last_error(store, pg_dsn, table):
    target = seed(pg_dsn, table, "dead", 1, attempts=5, last_error="retries exhausted: timeout", age_seconds=100)[0]
    other = seed(pg_dsn, table, "dead", 1, attempts=4, last_error="other")[0]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # make "due now" observable
        conn.execute(f"UPDATE {qualified(table)} SET available_at = now() + interval '1 day' WHERE id = %s", (target,))

    proc = run_ok("dead", "retry", str(target), env=cli_env(pg_dsn, table))
    assert "retried 1" in proc.stdout
    rows = state(pg_dsn, table)
    assert rows[target]["status"] == "pending"
    assert rows[target]["attempts"] == 0
    assert rows[target]["due"] is True
    assert rows[target]["last_error"] == "retries exhausted: timeout"
    assert (rows[other]["status"], rows[other]["attempts"], rows[other]["last_error"]) == ("dead", 4, "other")


def test_dead_retry_unknown_and_not_dead_ids_exit_1(store, pg_dsn, table):
    dead = seed(pg_dsn, table, "dead", 1, attempts=5, last_error="boom")[0]
    pending = seed(pg_dsn, table, "pending", 1, attempts=1)[0]
    done = seed(pg_dsn, table, "done", 1)[0]
    unknown = dead + pending + done + 100_000

    proc = cli("dead", "retry", str(dead), str(unknown), str(pending), str(done), env=cli_env(pg_dsn, table))
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    err_lines = proc.stderr.strip().splitlines()
    by_id = {i: [line for line in err_lines if f"id {i}:" in line] for i in (unknown, pending, done)}
    assert len(by_id[unknown]) == 1 and "no such row" in by_id[unknown][0]
    assert len(by_id[pending]) == 1 and "not dead" in by_id[pending][0] and "pending" in by_id[pending][0]
    assert len(by_id[done]) == 1 and "not dead" in by_id[done][0] and "done" in by_id[done][0]
    assert not any(f"id {dead}:" in line for line in err_lines)
    # The valid id is still retried; the others are untouched.
    rows = state(pg_dsn, table)
    assert (rows[dead]["status"], rows[dead]["attempts"]) == ("pending", 0)
    assert (rows[pending]["status"], rows[pending]["attempts"]) == ("pending", 1)
    assert rows[done]["status"] == "done"
    assert unknown not in rows


def test_dead_retry_only_unknown_id(store, pg_dsn, table):
    proc = cli("dead", "retry", "424242", env=cli_env(pg_dsn, table))
    line = assert_one_line_error(proc, 1)
    assert "424242" in line and "no such row" in line


def test_dead_retry_all(store, pg_dsn, table):
    dead = seed(pg_dsn, table, "dead", 5, attempts=5, last_error="boom")
    pending = seed(pg_dsn, table, "pending", 1, attempts=2)
    done = seed(pg_dsn, table, "done", 1)

    proc = run_ok("dead", "retry", "--all", "--chunk-size", "2", env=cli_env(pg_dsn, table))
    assert "retried 5" in proc.stdout
    rows = state(pg_dsn, table)
    for i in dead:
        assert (rows[i]["status"], rows[i]["attempts"], rows[i]["due"], rows[i]["last_error"]) == (
            "pending",
            0,
            True,
            "boom",
        )
    assert (rows[pending[0]]["status"], rows[pending[0]]["attempts"]) == ("pending", 2)
    assert rows[done[0]]["status"] == "done"

    again = run_ok("dead", "retry", "--all", env=cli_env(pg_dsn, table))
    assert "retried 0" in again.stdout


def test_dead_retry_ids_and_all_is_a_usage_error(store, pg_dsn, table):
    dead = seed(pg_dsn, table, "dead", 2, attempts=5, last_error="boom")
    env = cli_env(pg_dsn, table)
    line = assert_one_line_error(cli("dead", "retry", str(dead[0]), "--all", env=env), 2)
    assert "--all" in line
    line = assert_one_line_error(cli("dead", "retry", env=env), 2)
    assert "--all" in line
    assert {r["status"] for r in state(pg_dsn, table).values()} == {"dead"}


# --------------------------------------------------------------------------- dead skip
def test_dead_skip_marks_done_with_reason(store, pg_dsn, table):
    target = seed(pg_dsn, table, "dead", 1, attempts=5, last_error="permanent: schema mismatch")[0]
    other = seed(pg_dsn, table, "dead", 1, attempts=5, last_error="keep me")[0]

    proc = run_ok(
        "dead", "skip", str(target), "--reason", "replayed by hand, ticket OPS-42", env=cli_env(pg_dsn, table)
    )
    assert "skipped 1" in proc.stdout
    rows = state(pg_dsn, table)
    assert rows[target]["status"] == "done"
    assert rows[target]["done_at"] is not None
    assert "replayed by hand, ticket OPS-42" in rows[target]["last_error"]
    assert (rows[other]["status"], rows[other]["last_error"]) == ("dead", "keep me")

    listed = json.loads(run_ok("dead", "list", "--json", env=cli_env(pg_dsn, table)).stdout)
    assert [r["id"] for r in listed] == [other]


def test_dead_skip_unknown_and_not_dead_ids_exit_1(store, pg_dsn, table):
    pending = seed(pg_dsn, table, "pending", 1)[0]
    unknown = pending + 100_000
    proc = cli("dead", "skip", str(pending), str(unknown), "--reason", "x", env=cli_env(pg_dsn, table))
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert any(f"id {pending}:" in line and "not dead" in line for line in proc.stderr.splitlines())
    assert any(f"id {unknown}:" in line and "no such row" in line for line in proc.stderr.splitlines())
    assert state(pg_dsn, table)[pending]["status"] == "pending"


# --------------------------------------------------------------------------- purge
def test_purge_removes_only_old_done_rows_in_chunks(store, pg_dsn, table):
    old_done = seed(pg_dsn, table, "done", 5, done_age_seconds=2 * 3600, age_seconds=3 * 3600)
    recent_done = seed(pg_dsn, table, "done", 2, done_age_seconds=60, age_seconds=3 * 3600)
    old_dead = seed(pg_dsn, table, "dead", 1, last_error="x", age_seconds=3 * 3600)
    old_pending = seed(pg_dsn, table, "pending", 1, age_seconds=3 * 3600)

    proc = run_ok("purge", "--older-than", "1h", "--chunk-size", "2", env=cli_env(pg_dsn, table))
    assert "purged 5" in proc.stdout
    remaining = state(pg_dsn, table)
    assert not set(old_done) & remaining.keys()
    assert set(recent_done + old_dead + old_pending) == remaining.keys()

    again = run_ok("purge", "--older-than", "1h", env=cli_env(pg_dsn, table))
    assert "purged 0" in again.stdout
    assert state(pg_dsn, table).keys() == remaining.keys()


@pytest.mark.parametrize("duration", ["bogus", "1y", "-5m", ""])
def test_purge_bad_duration_is_a_usage_error(store, pg_dsn, table, duration):
    seed(pg_dsn, table, "done", 1, done_age_seconds=7 * 86400)
    line = assert_one_line_error(cli("purge", "--older-than", duration, env=cli_env(pg_dsn, table)), 2)
    assert "--older-than" in line
    assert len(state(pg_dsn, table)) == 1


# --------------------------------------------------------------------------- failures
def test_status_missing_table_says_to_migrate(pg_dsn, table):
    for args in (("status",), ("status", "--json"), ("dead", "list", "--json"), ("purge", "--older-than", "1d")):
        proc = cli(*args, env=cli_env(pg_dsn, table))
        line = assert_one_line_error(proc, 1)
        assert "migrate" in line, args
        assert proc.stdout == ""


def test_status_unreachable_database(tmp_path):
    proc = cli("status", "--json", env=cli_env("postgresql://postgres@127.0.0.1:1/x", "outbox"))
    line = assert_one_line_error(proc, 1)
    assert "database" in line
    assert proc.stdout == ""


def test_bad_setting_is_a_usage_error():
    env = cli_env("postgresql://postgres@127.0.0.1:1/x", "outbox", OUTBOX_RELAY_RELAY__WORKERS="abc")
    line = assert_one_line_error(cli("status", env=env), 2)
    assert "workers" in line


@pytest.mark.parametrize(
    "args",
    [
        ("status",),
        ("status", "--json"),
        ("dead", "list", "--json"),
        ("dead", "retry", "--all"),
        ("purge", "--older-than", "1h"),
    ],
)
def test_dsn_password_never_printed(args):
    env = cli_env("postgresql://u:s3cretpw@127.0.0.1:1/x", "outbox")
    proc = cli(*args, env=env)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "s3cretpw" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_dsn_password_never_printed_with_bad_setting():
    env = cli_env("postgresql://u:s3cretpw@127.0.0.1:1/x", "outbox", OUTBOX_RELAY_RELAY__WORKERS="abc")
    proc = cli("status", env=env)
    assert proc.returncode == 2
    assert "s3cretpw" not in proc.stdout + proc.stderr
