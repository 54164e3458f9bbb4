"""Least privilege: ``outbox-relay grants`` prints what each role needs, and it is enough.

Three non-owner roles get exactly the printed statements (applied by the table's
owner). Then: the relay drains as its role (claims, lease extensions, finalizes, wake-ups,
gauges); the operator commands work as theirs; the writer can enqueue (plain,
``ordered=True``, ``dedup_key``) but can neither change a row's status or lease nor
read other rows' contents.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import errors as pg_errors
from psycopg import sql

from outbox_relay import enqueue
from outbox_relay.runtime.relay import Relay
from tests.helpers.cli import cli, cli_env
from tests.helpers.db import insert_rows, statuses, wait_for


@pytest.fixture
def roles(pg_dsn: str) -> Iterator[dict[str, str]]:
    """relay/operator/writer login roles (no privileges of their own), dropped after."""
    suffix = uuid.uuid4().hex[:8]
    names = {kind: f"t_{kind}_{suffix}" for kind in ("relay", "operator", "writer")}
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name in names.values():
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        yield names
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for name in names.values():
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def as_role(dsn: str, role: str) -> str:
    return psycopg.conninfo.make_conninfo(dsn, user=role)


def test_printed_grants_are_exactly_enough(
    pg_dsn: str, table: str, store: Any, roles: dict[str, str], make_settings: Any
) -> None:
    printed = cli(
        "grants",
        "--relay",
        roles["relay"],
        "--operator",
        roles["operator"],
        "--writer",
        roles["writer"],
        env=cli_env(pg_dsn, table),
    )
    assert printed.returncode == 0, printed.stderr
    statements = [line for line in printed.stdout.splitlines() if line and not line.startswith("--")]
    assert statements and all(s.startswith("GRANT ") and s.endswith(";") for s in statements)
    with psycopg.connect(pg_dsn, autocommit=True) as owner:  # the owner applies them
        for statement in statements:
            owner.execute(statement)

    # --- writer: enqueue in all its forms ---------------------------------------------
    with psycopg.connect(as_role(pg_dsn, roles["writer"])) as writer:
        with writer.transaction():
            plain = enqueue(
                writer,
                aggregate_type="order",
                aggregate_id="a1",
                event_type="OrderCreated",
                payload={"n": 1},
                table=table,
                headers={"tenant": "x"},
                delay=0,
            )
            ordered = enqueue(
                writer,
                aggregate_type="order",
                aggregate_id="a1",
                event_type="OrderPaid",
                payload={"n": 2},
                table=table,
                ordered=True,
            )
            first = enqueue(
                writer,
                aggregate_type="order",
                aggregate_id="a2",
                event_type="OrderCreated",
                payload={"n": 3},
                table=table,
                dedup_key="k-1",
            )
            again = enqueue(
                writer,
                aggregate_type="order",
                aggregate_id="a2",
                event_type="OrderCreated",
                payload={"n": 3},
                table=table,
                dedup_key="k-1",
            )
        assert again == first and again.duplicate and not first.duplicate
        schema, name = table.split(".")
        ident = sql.Identifier(schema, name)
        refused = {
            "update status": sql.SQL("UPDATE {} SET status = 'done'").format(ident),
            "update lease": sql.SQL("UPDATE {} SET lease_version = lease_version + 1").format(ident),
            "read payloads": sql.SQL("SELECT payload FROM {}").format(ident),
            "read statuses": sql.SQL("SELECT status FROM {}").format(ident),
            "insert as done": sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, status) "
                "VALUES ('o', 'a', 'E', '{{}}', 'done')"
            ).format(ident),
            "delete": sql.SQL("DELETE FROM {}").format(ident),
        }
        for what, statement in refused.items():
            with pytest.raises(pg_errors.InsufficientPrivilege), writer.transaction():  # noqa: PT012 - the fail names the statement and rolls back a write that went through
                writer.execute(statement)
                pytest.fail(f"the writer could {what}")
    written = [plain, ordered, first]

    # --- relay: drains as its role (claims, lease extension, finalize, wake-ups, gauges) ------
    backlog = insert_rows(pg_dsn, table, 200)
    settings = make_settings(
        database={"dsn": as_role(pg_dsn, roles["relay"])},
        metrics={"enabled": True, "port": 0, "host": "127.0.0.1", "refresh_interval_seconds": 0.2},
    )
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: statuses(pg_dsn, table).get("done") == len(backlog) + len(written), message="drained")
        more = insert_rows(pg_dsn, table, 20)  # a wake-up through LISTEN/NOTIFY and the idle flag
        wait_for(
            lambda: statuses(pg_dsn, table).get("done") == len(backlog) + len(written) + len(more),
            message="drained after a wake-up",
        )
        wait_for(
            lambda: (
                relay.metrics.registry.get_sample_value("outbox_relay_queue_depth", {"status": "done"})
                == len(backlog) + len(written) + len(more)
            ),
            timeout=30,
            message="gauges refreshed by the relay role",
        )
    finally:
        relay.stop()
    assert relay.metrics.registry.get_sample_value("outbox_relay_lost_leases_total") == 0
    with psycopg.connect(as_role(pg_dsn, roles["relay"])) as relay_conn:
        for what, statement in {
            "rewrite a payload": sql.SQL("UPDATE {} SET payload = '{{}}'").format(ident),
            "insert rows": sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('o', 'a', 'E', '{{}}')"
            ).format(ident),
        }.items():
            with pytest.raises(pg_errors.InsufficientPrivilege), relay_conn.transaction():  # noqa: PT012 - the fail names the statement and rolls back a write that went through
                relay_conn.execute(statement)
                pytest.fail(f"the relay could {what}")

    # --- operator: status, dead list/retry/skip, purge ----------------------------------
    with psycopg.connect(pg_dsn, autocommit=True) as owner:
        dead = [
            r[0]
            for r in owner.execute(
                sql.SQL("UPDATE {} SET status = 'dead', last_error = 'boom' WHERE id = ANY(%s) RETURNING id").format(
                    ident
                ),
                (backlog[:3],),
            ).fetchall()
        ]
    operator_env = cli_env(as_role(pg_dsn, roles["operator"]), table)
    for args in (
        ["status", "--json"],
        ["dead", "list", "--json"],
        ["dead", "retry", str(dead[0])],
        ["dead", "skip", str(dead[1]), "--reason", "test"],
        ["dead", "retry", "--all"],
        ["purge", "--older-than", "0s"],
    ):
        result = cli(*args, env=operator_env)
        assert result.returncode == 0, f"{args}: {result.stderr}"
    with psycopg.connect(pg_dsn, autocommit=True) as owner:
        left = owner.execute(sql.SQL("SELECT id, status FROM {} ORDER BY id").format(ident)).fetchall()
    # retry/retry --all put two rows back to pending; skip and purge finished the rest.
    assert sorted(r[0] for r in left if r[1] == "pending") == sorted([dead[0], dead[2]])
    assert all(r[1] == "pending" for r in left)


def test_grants_refuses_a_role_name_that_is_not_an_identifier(pg_dsn: str, table: str) -> None:
    result = cli("grants", "--writer", 'app"; DROP TABLE x; --', env=cli_env(pg_dsn, table))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "invalid role name" in result.stderr
    assert result.stdout == ""
