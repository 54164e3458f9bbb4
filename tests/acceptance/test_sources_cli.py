"""Operator commands with several sources, through the real CLI (a subprocess) against
two databases of a real PostgreSQL: --source on every per-outbox command, status of
every source, migrate --all-sources, and the error paths (no --source with several
sources, an unknown source: exit 2, one line)."""

from __future__ import annotations

import json
import os

import psycopg
import pytest

from tests.helpers import sources as source_helpers
from tests.helpers.cli import cli
from tests.helpers.db import DELETE_MODE, ON_DONE, make_row

pytestmark = pytest.mark.timeout(300)

databases = source_helpers.databases  # the fixture


def sources_env(**sources: str) -> dict[str, str]:
    env = {"OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1", "OUTBOX_RELAY_LOG__FORMAT": "json"}
    for name, dsn in sources.items():
        env[f"OUTBOX_RELAY_SOURCES__{name.upper()}__DSN"] = dsn
    if DELETE_MODE:
        env["OUTBOX_RELAY_RELAY__ON_DONE"] = "delete"
    return env


def ok(result) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_migrate_all_sources_then_status_of_every_source(databases, pg_dsn):
    dsn_a = databases("a", migrate=False)
    dsn_b = databases("b", migrate=False)
    env = sources_env(a=dsn_a, b=dsn_b)
    out = ok(cli("migrate", "--all-sources", env=env))
    assert "source a:" in out and "source b:" in out and "migrated 2 sources" in out
    make_row(dsn_a, "outbox", status="pending")
    make_row(dsn_b, "outbox", status="dead", last_error="boom")
    make_row(dsn_b, "outbox", status="dead", last_error="boom")

    doc = json.loads(ok(cli("status", "--json", env=env)))
    assert doc["sources"]["a"]["queue_depth"]["pending"] == 1
    assert doc["sources"]["b"]["queue_depth"]["dead"] == 2
    text = ok(cli("status", env=env))
    assert "source a" in text and "source b" in text
    one = json.loads(ok(cli("status", "--json", "--source", "b", env=env)))
    assert one["queue_depth"]["dead"] == 2 and one["on_done"] == ON_DONE


def test_operator_commands_take_the_source(databases):
    dsn_a, dsn_b = databases("a"), databases("b")
    env = sources_env(a=dsn_a, b=dsn_b)
    dead_b = make_row(dsn_b, "outbox", status="dead", aggregate_id="order-7", last_error="rejected")
    make_row(dsn_a, "outbox", status="dead", aggregate_id="order-1", last_error="other")

    listed = json.loads(ok(cli("dead", "list", "--json", "--source", "b", env=env)))
    assert [row["id"] for row in listed] == [dead_b] and listed[0]["aggregate_id"] == "order-7"
    assert "order-7" in ok(cli("aggregate", "show", "order-7", "--source", "b", env=env))
    dry = ok(cli("dead", "retry", "--source", "b", "--all", "--dry-run", env=env))
    assert "1" in dry
    ok(cli("dead", "retry", "--source", "b", str(dead_b), "--reason", "fixed", env=env))
    with psycopg.connect(dsn_b) as conn:
        assert conn.execute("SELECT status FROM outbox WHERE id = %s", (dead_b,)).fetchone() == ("pending",)
    with psycopg.connect(dsn_a) as conn:  # the other source's dead row is untouched
        assert conn.execute("SELECT count(*) FROM outbox WHERE status = 'dead'").fetchone() == (1,)
    audit = json.loads(ok(cli("audit", "list", "--json", "--source", "b", env=env)))
    assert audit and audit[0]["action"] == "retry" and audit[0]["reason"] == "fixed"
    dead_a = json.loads(ok(cli("dead", "list", "--json", "--source", "a", env=env)))
    ok(cli("dead", "skip", "--source", "a", str(dead_a[0]["id"]), "--reason", "obsolete", env=env))
    assert "purged" in ok(cli("purge", "--source", "a", "--older-than", "0s", env=env))
    with psycopg.connect(dsn_a) as conn:
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
    grants = ok(cli("grants", "--source", "a", env=env))
    assert "GRANT" in grants and psycopg.conninfo.conninfo_to_dict(dsn_a)["dbname"] in grants


def test_a_source_must_be_named_and_must_exist(databases):
    env = sources_env(a=databases("a"), b=databases("b"))
    result = cli("dead", "list", env=env)
    assert result.returncode == 2
    assert "several sources are configured: name one with --source NAME (configured: a, b)" in result.stderr
    assert "Traceback" not in result.stderr
    result = cli("status", "--source", "nope", env=env)
    assert result.returncode == 2 and "--source nope: no such source (sources: a, b)" in result.stderr


def test_status_of_every_source_reports_an_unreachable_one_and_exits_1(databases):
    env = sources_env(a=databases("a"), down="postgresql://postgres@127.0.0.1:1/postgres?connect_timeout=2")
    result = cli("status", "--json", env=env)
    assert result.returncode == 1
    doc = json.loads(result.stdout)
    assert doc["sources"]["a"]["queue_depth"]["pending"] == 0
    assert "cannot connect" in doc["sources"]["down"]["error"]


def test_discovered_databases_are_sources_for_the_cli(databases, pg_dsn):
    databases("t1")
    prefix = databases.prefix
    env = {
        "OUTBOX_RELAY_DISCOVERY__DSN": pg_dsn,
        "OUTBOX_RELAY_DISCOVERY__DATABASE_PATTERN": prefix + r"\_%",
        "OUTBOX_RELAY_LOG__FORMAT": "json",
    }
    new_dsn = databases("t2", migrate=False)
    out = ok(cli("migrate", "--source", f"{prefix}_t2", env=env))
    assert "migrated outbox" in out
    make_row(new_dsn, "outbox", status="pending")
    doc = json.loads(ok(cli("status", "--json", env=env)))
    assert set(doc["sources"]) == {f"{prefix}_t1", f"{prefix}_t2"}
    assert doc["sources"][f"{prefix}_t2"]["queue_depth"]["pending"] == 1
    assert os.environ.get("OUTBOX_RELAY_DISCOVERY__DSN") is None  # nothing leaked into this process
