"""Per-aggregate ordering (rows of one aggregate delivered in id order, none after a failed
one) and the write side that keeps it.

Runs in the suite's relay.on_done mode (tests/helpers/db.py: ON_DONE): in delete mode
a delivered head leaves the table instead of turning done, and its follower must
become the head all the same."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest

from outbox_relay import enqueue
from outbox_relay._embedded.embedded import read_messages
from outbox_relay.db.store import OutboxStore
from outbox_relay.runtime.relay import Relay
from tests.helpers.db import ON_DONE, assert_delivered, delivered, make_row, rows, run_sql, wait_for

ALL = ["*"]


@pytest.fixture
def store(pg_dsn: str, table: str) -> Iterator[OutboxStore]:
    """Ordered tests: the table gets the ordering indexes (`migrate` with
    relay.ordered_event_types set), which `run` requires."""
    s = OutboxStore(pg_dsn, table, pool_size=8)
    s.open()
    s.migrate(ordering=True, on_done=ON_DONE)
    try:
        yield s
    finally:
        s.close()


def _insert(dsn, table, spec):
    """spec: list of (aggregate_id, event_type) -> ids, one transaction."""
    with psycopg.connect(dsn) as conn, conn.transaction():
        return [
            int(enqueue(conn, aggregate_type="order", aggregate_id=a, event_type=e, payload={"n": i}, table=table))
            for i, (a, e) in enumerate(spec)
        ]


def _claim(store, owner="A", batch=10, run_length=1, types=ALL, lease=30.0):
    return store.claim(
        owner=owner, batch=batch, lease_seconds=lease, max_attempts=5, ordered_types=types, run_length=run_length
    ).rows


def _install_audit(dsn, table):
    """Records every finalize to done or dead in commit order per row; in delete mode a
    delivered row's finalize is its deletion (recorded as 'deleted')."""
    schema, name = table.split(".")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f'CREATE TABLE "{schema}".audit (seq bigserial PRIMARY KEY, id bigint, status text, version bigint)'
        )
        conn.execute(f'''CREATE FUNCTION "{schema}".audit_fn() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF TG_OP = 'DELETE' THEN
                INSERT INTO "{schema}".audit (id, status, version) VALUES (OLD.id, 'deleted', OLD.lease_version);
              ELSIF NEW.status IS DISTINCT FROM OLD.status AND NEW.status IN ('done', 'dead') THEN
                INSERT INTO "{schema}".audit (id, status, version) VALUES (NEW.id, NEW.status, OLD.lease_version);
              END IF;
              RETURN NULL;
            END $$''')
        conn.execute(
            f'CREATE TRIGGER audit_trg AFTER UPDATE OR DELETE ON "{schema}"."{name}" '
            f'FOR EACH ROW EXECUTE FUNCTION "{schema}".audit_fn()'
        )


def _audit(dsn, table):
    schema, _ = table.split(".")
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(f'SELECT id, status, version FROM "{schema}".audit ORDER BY seq').fetchall()


def test_first_claim_returns_only_heads_then_next_after_done(store, pg_dsn, table):
    x1, y1, x2, x3, y2 = _insert(pg_dsn, table, [("X", "E"), ("Y", "E"), ("X", "E"), ("X", "E"), ("Y", "E")])
    first = _claim(store)
    assert [c.id for c in first] == [x1, y1]
    assert _claim(store, owner="B") == []  # followers wait for their heads
    assert store.mark_done([(first[0].id, first[0].lease_version)]) == {x1}
    second = _claim(store, owner="B")
    assert [c.id for c in second] == [x2]  # Y's head is still processing
    assert store.mark_done([(first[1].id, first[1].lease_version), (second[0].id, second[0].lease_version)]) == {y1, x2}
    assert_delivered(pg_dsn, table, [x1, y1, x2])
    assert [c.id for c in _claim(store, owner="C")] == [x3, y2]


def test_unordered_types_keep_the_plain_claim(store, pg_dsn, table):
    ids = _insert(pg_dsn, table, [("X", "Ordered"), ("X", "Ordered"), ("X", "Note"), ("X", "Note")])
    claimed = [c.id for c in _claim(store, types=["Ordered"])]
    # The ordered head, and both notes (unordered types are never held back).
    assert claimed == [ids[0], ids[2], ids[3]]


def test_thirty_rows_of_one_aggregate_finalize_in_id_order(make_settings, store, pg_dsn, table):
    _install_audit(pg_dsn, table)
    ids = _insert(pg_dsn, table, [("solo", "E")] * 30)
    settings = make_settings(
        relay={"ordered_event_types": ALL, "workers": 4, "max_run_length": 1, "poll_interval_seconds": 0.05}
    )
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: len(delivered(pg_dsn, table, ids)) == 30, message="all delivered")
    finally:
        relay.stop()
    finalized = _audit(pg_dsn, table)
    assert [a[0] for a in finalized] == ids  # each row finalized once, in id order
    assert {a[1] for a in finalized} == {"deleted" if ON_DONE == "delete" else "done"}
    assert_delivered(pg_dsn, table, ids)


def test_runs_take_a_contiguous_run_behind_the_head(store, pg_dsn, table):
    ids = _insert(pg_dsn, table, [("X", "E")] * 5 + [("Y", "E")] * 2)
    schema, name = table.split(".")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # X's 4th row is not due yet
        conn.execute(
            f'UPDATE "{schema}"."{name}" SET available_at = now() + interval \'1 hour\' WHERE id = %s', (ids[3],)
        )
    claimed = [c.id for c in _claim(store, run_length=10)]
    assert claimed == [ids[0], ids[1], ids[2], ids[5], ids[6]]  # X's run stops at the not-due row


def test_kafka_order_per_key_equals_id_order(make_settings, store, pg_dsn, table, broker, topic_prefix):
    spec = [(f"agg-{i % 5}", "E") for i in range(500)]
    ids = _insert(pg_dsn, table, spec)
    settings = make_settings(relay={"ordered_event_types": ALL, "workers": 4, "batch_size": 50, "max_run_length": 20})
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: len(delivered(pg_dsn, table, ids)) == 500, message="all delivered")
    finally:
        relay.stop()
    messages = read_messages(broker.bootstrap_servers, [f"{topic_prefix}.order"], expected=500, timeout=60)
    per_key: dict[str, list[int]] = {}
    for m in sorted(messages, key=lambda m: (m["partition"], m["offset"])):
        per_key.setdefault(m["key"], []).append(int(m["headers"]["message_id"]))
    expected: dict[str, list[int]] = {}
    for row_id, (agg, _) in zip(ids, spec, strict=True):
        expected.setdefault(agg, []).append(row_id)
    for key, sent in per_key.items():
        first_seen = list(dict.fromkeys(sent))  # a redelivery may repeat an id; first occurrences must be ordered
        assert first_seen == expected[key], key


def test_dead_head_blocks_only_its_aggregate_until_skip_or_retry(store, pg_dsn, table):
    x1, x2, y1, y2 = _insert(pg_dsn, table, [("X", "E"), ("X", "E"), ("Y", "E"), ("Y", "E")])
    heads = _claim(store)
    assert [c.id for c in heads] == [x1, y1]
    assert store.mark_dead([(x1, heads[0].lease_version, "permanent: broken")]) == {x1}
    assert store.mark_done([(y1, heads[1].lease_version)]) == {y1}
    assert_delivered(pg_dsn, table, [y1])
    assert [c.id for c in _claim(store, owner="B")] == [y2]  # Y flows, X is blocked
    stats = store.stats(ordered_types=ALL)
    assert stats.blocked_aggregates == [("X", x1)]
    assert _claim(store, owner="C") == []
    # retry: the head comes back first, then the follower
    assert store.dead_retry([x1]) == {x1}
    again = _claim(store, owner="D")
    assert [c.id for c in again] == [x1]
    store.mark_dead([(x1, again[0].lease_version, "still broken")])
    assert _claim(store, owner="E") == []
    # skip: marks the head done deliberately, which unblocks the follower
    assert store.dead_skip([x1], "skipped: operator") == {x1}
    assert [c.id for c in _claim(store, owner="F")] == [x2]
    assert store.stats(ordered_types=ALL).blocked_aggregates == []


def _concurrent_writers(dsn, table, ordered, between=None):
    """T1 enqueues first but commits last; T2 enqueues after T1 and commits first
    (unless the aggregate lock makes it wait). Returns (t1_id, t2_id, commit order)."""
    commits: list[str] = []
    t1_inserted = threading.Event()
    t2_done = threading.Event()
    result: dict[str, int] = {}

    def t2() -> None:
        t1_inserted.wait(10)
        with psycopg.connect(dsn) as conn, conn.transaction():
            result["t2"] = int(
                enqueue(
                    conn,
                    aggregate_type="order",
                    aggregate_id="A",
                    event_type="E",
                    payload={"w": 2},
                    table=table,
                    ordered=ordered,
                )
            )
        commits.append("t2")
        t2_done.set()

    thread = threading.Thread(target=t2)
    thread.start()
    with psycopg.connect(dsn) as conn, conn.transaction():
        result["t1"] = int(
            enqueue(
                conn,
                aggregate_type="order",
                aggregate_id="A",
                event_type="E",
                payload={"w": 1},
                table=table,
                ordered=ordered,
            )
        )
        t1_inserted.set()
        t2_done.wait(1.0)  # without the lock T2 commits here, before T1
        if between is not None:
            between()
        commits.append("t1")
    thread.join(10)
    return result["t1"], result["t2"], commits


def test_write_side_lock_makes_id_order_equal_commit_order(store, pg_dsn, table):
    t1, t2, commits = _concurrent_writers(pg_dsn, table, ordered=True)
    assert commits == ["t1", "t2"]  # T2 waited for T1's commit
    assert t1 < t2
    assert [c.id for c in _claim(store)] == [t1]
    assert [r[0] for r in rows(pg_dsn, table)] == [t1, t2]


def test_without_the_write_side_lock_ids_and_commits_can_disagree(pg_dsn, table, store):
    """Documents why ordered=True exists: the later id commits first, and a relay
    claiming in between would take it as the aggregate's head."""
    claimed = []
    t1, t2, commits = _concurrent_writers(
        pg_dsn, table, ordered=False, between=lambda: claimed.extend(c.id for c in _claim(store))
    )
    assert commits == ["t2", "t1"] and t1 < t2
    assert claimed == [t2]  # delivered before t1, though t1 has the lower id


def test_ordered_backlog_does_not_starve_unordered_rows(store, pg_dsn, table):
    _insert(pg_dsn, table, [(f"agg-{i}", "Ordered") for i in range(50)])
    notes = _insert(pg_dsn, table, [("agg-x", "Note")] * 10)
    claimed = _claim(store, batch=10, types=["Ordered"])
    assert len(claimed) == 10
    assert {c.id for c in claimed} & set(notes)  # unordered rows got their share


def test_run_stops_before_producing_after_a_row_that_cannot_be_built(store, pg_dsn, table):
    """A row of a run that fails before reaching the broker (bad headers) must not be
    overtaken: the rows behind it are released unproduced, the rest of the batch goes."""
    from outbox_relay.observability.metrics import RelayMetrics
    from outbox_relay.publisher import SimplePublisher
    from outbox_relay.runtime.worker import Worker, WorkerConfig

    x1, x2, x3, y1 = _insert(pg_dsn, table, [("X", "E"), ("X", "E"), ("X", "E"), ("Y", "E")])
    schema, name = table.split(".")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'UPDATE "{schema}"."{name}" SET headers = \'{{"n": 1}}\' WHERE id = %s', (x1,))

    published: list[int] = []

    class Recorder(SimplePublisher):
        def publish(self, message):
            published.append(message.id)

    cfg = WorkerConfig(
        owner="w",
        batch_size=10,
        lease_seconds=30,
        max_attempts=3,
        ordered_types=ALL,
        run_length=10,
        strict_lease=False,
        topic_template="t.{aggregate_type}",
        poll_interval_seconds=1,
        backoff_base_seconds=1,
        backoff_cap_seconds=5,
        publish_timeout_seconds=5,
    )
    result = Worker(0, store, Recorder(), cfg, RelayMetrics()).run_once()
    assert published == [y1]
    assert result.dead == 1 and result.released == 2 and result.done == 1
    state = {r[0]: (r[1], r[2]) for r in rows(pg_dsn, table)}
    assert state[x1][0] == "dead"
    assert state[x2] == ("pending", 0) and state[x3] == ("pending", 0)  # attempts refunded
    assert_delivered(pg_dsn, table, [y1])
    # X is now blocked behind its dead head; Y is done.
    assert store.stats(ordered_types=ALL).blocked_aggregates == [("X", x1)]


def test_an_empty_aggregate_id_is_an_aggregate_like_any_other(store, pg_dsn, table):
    """'' is a valid aggregate_id (writers may insert the columns themselves): the
    round-robin start of the ordered claim must not skip it."""
    # enqueue() refuses an empty aggregate_id; an SQL writer can still insert one.
    e1, e2, x1 = (make_row(pg_dsn, table, aggregate_id=agg, event_type="E") for agg in ("", "", "x"))
    assert sorted(c.id for c in _claim(store)) == [e1, x1]  # both heads, '' included
    first = _claim(store, owner="B")
    assert first == []  # followers wait for their heads
    run_sql(pg_dsn, table, "UPDATE {t} SET status = 'done', lease_until = NULL WHERE id IN (%s, %s)", (e1, x1))
    assert [c.id for c in _claim(store, owner="C")] == [e2]


def test_round_robin_resumes_in_the_columns_collation_order(store, pg_dsn, table):
    """The next claim's round-robin start is the last claimed aggregate in the order
    the skip scan walks, i.e. the column's collation, not Python's code-point order
    (they differ for en_US/ICU collations: there 'a' < 'b' < 'B' < 'C')."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        if conn.execute("SELECT count(*) FROM pg_collation WHERE collname = 'en-x-icu'").fetchone()[0] == 0:
            pytest.skip("this PostgreSQL has no ICU collations")
    run_sql(pg_dsn, table, 'ALTER TABLE {t} ALTER COLUMN aggregate_id TYPE text COLLATE "en-x-icu"')
    _insert(pg_dsn, table, [("b", "E"), ("B", "E"), ("a", "E"), ("C", "E")])
    result = store.claim(owner="A", batch=10, lease_seconds=30, max_attempts=5, ordered_types=ALL)
    assert sorted(c.aggregate_id for c in result.rows) == ["B", "C", "a", "b"]
    assert result.ordered_after == "C"  # max() in Python would say "b" and revisit "B" and "C" first
