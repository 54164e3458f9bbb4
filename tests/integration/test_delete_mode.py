"""relay.on_done = "delete": the fenced finalize deletes delivered rows;
dead rows stay; dedup keys outlive their rows in both modes; `migrate` sets the mode
and `run` refuses a relay whose setting differs from the table's."""

from __future__ import annotations

import psycopg
import pytest

from outbox_relay import enqueue
from outbox_relay._embedded.embedded import read_messages
from outbox_relay.db.pooler import execute_with_settings
from outbox_relay.db.store import FINALIZE_SETTINGS, FinalizeItem, OutboxStore, finalize_params
from outbox_relay.runtime.relay import Relay
from tests.helpers.cli import cli, cli_env
from tests.helpers.db import insert_rows, rows, run_sql, statuses, wait_for

ALL = ["*"]


@pytest.fixture
def delete_store(pg_dsn, table):
    s = OutboxStore(pg_dsn, table, pool_size=4)
    s.open()
    s.migrate(on_done="delete", ordering=True)
    try:
        yield s
    finally:
        s.close()


def _claim(store, *, owner="A", batch=10, lease=30.0, types=(), run_length=1):
    return store.claim(
        owner=owner, batch=batch, lease_seconds=lease, max_attempts=5, ordered_types=list(types), run_length=run_length
    ).rows


def test_finalize_deletes_done_rows_under_the_fence_and_keeps_the_rest(delete_store, pg_dsn, table):
    from outbox_relay.db.store import FinalizeItem

    a, b, c, d = insert_rows(pg_dsn, table, 4)
    claimed = {r.id: r for r in _claim(delete_store, lease=0.2)}
    wait_for(
        lambda: run_sql(pg_dsn, table, "SELECT bool_and(lease_until < now()) FROM {t}")[0][0],
        timeout=10,
        message="the lease of A's claim to expire",
    )  # then B takes them over
    again = _claim(delete_store, owner="B")
    assert [r.id for r in again] == [a, b, c, d]
    stale = delete_store.finalize([FinalizeItem(d, claimed[d].lease_version, "done")])
    assert stale == set()  # a lost lease deletes nothing
    v = {r.id: r.lease_version for r in again}
    accepted = delete_store.finalize(
        [
            FinalizeItem(a, v[a], "done"),
            FinalizeItem(b, v[b], "pending", 60.0, "retry: broker busy"),
            FinalizeItem(c, v[c], "dead", 0.0, "permanent: bad payload"),
        ]
    )
    assert accepted == {a, b, c}
    assert {r[0]: r[1] for r in rows(pg_dsn, table)} == {b: "pending", c: "dead", d: "processing"}
    assert delete_store.mark_done([(d, v[d])]) == {d}
    assert statuses(pg_dsn, table) == {"pending": 1, "dead": 1}
    depth = delete_store.stats().queue_depth
    assert depth == {"pending": 1, "processing": 0, "done": 0, "dead": 1}


@pytest.mark.parametrize("on_done", ["keep", "delete"])
def test_a_dedup_key_is_refused_after_its_row_was_delivered_until_purged(pg_dsn, table, on_done):
    with OutboxStore(pg_dsn, table, pool_size=2) as s:
        s.migrate(on_done=on_done)

        def put(key: str) -> int:
            with psycopg.connect(pg_dsn) as conn, conn.transaction():
                return enqueue(
                    conn,
                    aggregate_type="order",
                    aggregate_id="o-1",
                    event_type="ReceiptIssued",
                    payload={"order": 1},
                    table=table,
                    dedup_key=key,
                )

        first = put("receipt:o-1")
        assert not first.duplicate
        [row] = _claim(s)
        assert s.mark_done([(row.id, row.lease_version)]) == {first}
        assert [r[1] for r in rows(pg_dsn, table)] == (["done"] if on_done == "keep" else [])
        again = put("receipt:o-1")
        assert again.duplicate and int(again) == int(first)  # the delivered row's id, even if it is gone
        assert len(rows(pg_dsn, table)) == (1 if on_done == "keep" else 0)

        env = cli_env(pg_dsn, table)
        purged = cli("purge", "--older-than", "1h", env=env)
        assert purged.returncode == 0 and "dedup keys" not in purged.stdout  # the key is younger than 1h
        assert put("receipt:o-1").duplicate
        run_sql(
            pg_dsn,
            table.replace(".outbox", ".outbox_dedup_keys"),
            "UPDATE {t} SET created_at = now() - interval '2 hours'",
        )
        purged = cli("purge", "--older-than", "1h", env=env)
        assert purged.returncode == 0, purged.stderr
        if on_done == "keep":  # the done row is younger than 1h: it and its key stay
            assert "purged 0 done rows" in purged.stdout and put("receipt:o-1").duplicate
            run_sql(pg_dsn, table, "UPDATE {t} SET done_at = now() - interval '2 hours'")
            purged = cli("purge", "--older-than", "1h", env=env)
            assert "purged 1 done rows older than 1h and 1 dedup keys" in purged.stdout
        else:
            assert "purged 0 done rows older than 1h and 1 dedup keys" in purged.stdout
        fresh = put("receipt:o-1")  # retention is over: the key is new again
        assert not fresh.duplicate and int(fresh) != int(first)


def test_relay_drains_in_delete_mode_and_the_broker_has_every_message(
    make_settings, delete_store, pg_dsn, table, broker, topic_prefix
):
    ids = insert_rows(pg_dsn, table, 300, aggregates=7)
    relay = Relay(make_settings(relay={"on_done": "delete", "ordered_event_types": ALL, "max_run_length": 5}))
    relay.start()
    try:
        wait_for(lambda: statuses(pg_dsn, table) == {}, message="every row delivered and deleted")

        def published() -> float | None:
            return relay.metrics.registry.get_sample_value("outbox_relay_published_total", {"outcome": "done"})

        # The worker counts a batch once its finalize has returned, a moment after the
        # finalize's DELETE committed: wait for the count, then check it is exact.
        wait_for(lambda: (published() or 0) >= 300, message="every delivery counted")
        counted = published()
    finally:
        relay.stop()
    assert counted == 300
    messages = read_messages(broker.bootstrap_servers, [f"{topic_prefix}.order"], expected=300, timeout=60)
    assert {int(m["headers"]["message_id"]) for m in messages} == set(ids)


def test_dead_head_blocks_in_delete_mode_and_skip_keeps_the_audit_row(delete_store, pg_dsn, table):
    x1, x2, x3 = insert_rows(pg_dsn, table, 3, aggregates=1)  # one aggregate, agg-0
    heads = _claim(delete_store, types=ALL)
    assert [h.id for h in heads] == [x1]
    delete_store.mark_dead([(x1, heads[0].lease_version, "permanent: broken")])
    assert _claim(delete_store, owner="B", types=ALL) == []  # x2 and x3 wait behind the dead head
    assert delete_store.stats(ordered_types=ALL).blocked_aggregates == [("agg-0", x1)]
    assert delete_store.dead_skip([x1], "skipped: operator") == {x1}
    [follower] = _claim(delete_store, owner="C", types=ALL)
    assert follower.id == x2
    delete_store.mark_done([(x2, follower.lease_version)])
    state = {r[0]: (r[1], r[4]) for r in rows(pg_dsn, table)}
    assert state[x1] == ("done", "skipped: operator")  # kept for the operator until purge
    assert x2 not in state and state[x3][0] == "pending"


def test_migrate_sets_the_mode_and_run_refuses_a_different_setting(pg_dsn, table, broker):
    env = cli_env(pg_dsn, table, broker.bootstrap_servers, OUTBOX_RELAY_METRICS__PORT="0")
    assert cli("migrate", env=env).returncode == 0
    delete_env = dict(env, OUTBOX_RELAY_RELAY__ON_DONE="delete")
    refused = cli("run", env=delete_env, timeout=60)
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "'delete'" in lines[0] and "'keep'" in lines[0] and "migrate" in lines[0], lines
    switched = cli("migrate", env=delete_env)
    assert switched.returncode == 0 and "deletes delivered rows" in switched.stdout
    status = cli("status", "--json", env=delete_env)
    assert '"on_done": "delete"' in status.stdout
    assert cli("migrate", env=delete_env).stdout.strip().endswith(f"migrated {table}")  # nothing else to say
    bad = cli("migrate", env=dict(env, OUTBOX_RELAY_RELAY__ON_DONE="archive"))
    assert bad.returncode == 2 and "on_done" in bad.stderr


def test_finalize_whose_reply_was_lost_is_recognised_in_delete_mode(pg_dsn, table, delete_store):
    """As test_outages' keep-mode test: the committed first finalize deleted the rows, so
    the retry matches nothing and finds no row; a done row that is gone was finished."""
    from outbox_relay.errors import DatabaseUnavailable
    from outbox_relay.observability.metrics import RelayMetrics
    from outbox_relay.publisher import SimplePublisher
    from outbox_relay.runtime.worker import Worker, WorkerConfig

    class ReplyLostOnce(OutboxStore):
        failed = False

        def finalize(self, items, *, strict=False, durable=True):
            result = super().finalize(items, strict=strict, durable=durable)
            if not self.failed:
                self.failed = True
                raise DatabaseUnavailable("finalize done: server closed the connection unexpectedly")
            return result

    class Ok(SimplePublisher):
        def publish(self, message):
            return None

    flaky = ReplyLostOnce(pg_dsn, table, pool_size=2)
    flaky.open()
    try:
        insert_rows(pg_dsn, table, 5)
        metrics = RelayMetrics()
        cfg = WorkerConfig(
            owner="w",
            batch_size=10,
            lease_seconds=30,
            max_attempts=3,
            ordered_types=[],
            run_length=1,
            strict_lease=False,
            topic_template="t.{aggregate_type}",
            poll_interval_seconds=1,
            backoff_base_seconds=1,
            backoff_cap_seconds=5,
            publish_timeout_seconds=5,
        )
        result = Worker(0, flaky, Ok(), cfg, metrics).run_once()
    finally:
        flaky.close()
    assert flaky.failed
    assert result.done == 5 and result.lost == []
    assert metrics.registry.get_sample_value("outbox_relay_lost_leases_total") == 0
    assert statuses(pg_dsn, table) == {}


def _finalize_plan(pg_dsn, table, on_done, ordering):
    """EXPLAIN ANALYZE (rolled back) of a 300-row all-done finalize, on a table whose
    statistics were taken while no row was processing (autovacuum's ANALYZE of an idle
    outbox), plus a 2000-row pending backlog the ordering index also holds."""
    store = OutboxStore(pg_dsn, table, pool_size=1)
    store.open()
    try:
        store.migrate(on_done=on_done, ordering=ordering)
        insert_rows(pg_dsn, table, 2300)
        run_sql(pg_dsn, table, "UPDATE {t} SET status = 'dead', last_error = 'old' WHERE id %% 2 = 0")
        run_sql(pg_dsn, table, "ANALYZE {t}")  # nothing processing when the statistics were taken
        run_sql(pg_dsn, table, "UPDATE {t} SET status = 'pending', last_error = NULL WHERE status = 'dead'")
        claimed = _claim(store, batch=300, types=["*"] if ordering else (), run_length=100 if ordering else 1)
        assert len(claimed) == 300
        query = store.sql.query("finalize", strict=False)
        params = finalize_params([FinalizeItem(r.id, r.lease_version, "done") for r in claimed])
        with psycopg.connect(pg_dsn) as conn:  # planned as the store plans it (FINALIZE_SETTINGS)
            cur = conn.cursor()
            execute_with_settings(
                cur, psycopg.sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + query, params, FINALIZE_SETTINGS
            )
            plan = cur.fetchone()[0]
            conn.rollback()
    finally:
        store.close()

    def nodes(node):
        yield node
        for child in node.get("Plans", []):
            yield from nodes(child)

    return list(nodes(plan[0]["Plan"])), nodes


@pytest.mark.parametrize("ordering", [False, True], ids=["plain", "ordered"])
def test_delete_mode_finalize_looks_delivered_rows_up_once(pg_dsn, table, ordering):
    """Delete mode under the same stale statistics: the delete's inputs are read once
    (no rescan of the batch per processing row, which cost 0.2-0.8 s per 1000 rows)."""
    all_nodes, nodes = _finalize_plan(pg_dsn, table, "delete", ordering)
    deletes = [n for n in all_nodes if n.get("Operation") == "Delete"]
    assert len(deletes) == 1 and deletes[0]["Actual Rows"] == 300
    rescanned = [
        n["Node Type"]
        for n in nodes(deletes[0])
        if n["Node Type"] in ("Function Scan", "CTE Scan") and n["Actual Loops"] > 1
    ]
    assert rescanned == []


def test_keep_mode_finalize_never_runs_the_delete_join(pg_dsn, table):
    """The delete branch of the finalize is gated by a one-time check of the table's
    mode: in keep mode its join is never executed, whatever the statistics say (taken
    here while no row was processing, which once made it loop over the batch per row)."""
    all_nodes, nodes = _finalize_plan(pg_dsn, table, "keep", True)
    deletes = [n for n in all_nodes if n.get("Operation") == "Delete"]
    assert len(deletes) == 1
    joins = [n for n in nodes(deletes[0]) if "Join Type" in n]
    assert joins and all(n["Actual Loops"] == 0 for n in joins)  # gated off: never executed
    updates = [n for n in all_nodes if n.get("Operation") == "Update"]
    assert updates[0]["Actual Rows"] == 300
