"""Claim / lease / fencing semantics against a real PostgreSQL.

Concurrent claims, crashed workers, expired leases, the four outcomes, poison rows,
the broken COMMIT-then-publish dispatcher, and the six recovery tests (a SIGKILLed child
process, an uncommitted claim, stale success and stale retry, no retry after done, the
strict policy), plus lost-lease counting.

Runs in the suite's relay.on_done mode (tests/helpers/db.py: ON_DONE): a done
finalize leaves the row ``done`` (keep) or deletes it (delete); ``assert_delivered``
checks whichever the mode says, and everything else (fencing, retries, dead rows) must
hold alike in both.

Publishers are the plug-in boundary of the relay: the recording publishers below
are real ``SimplePublisher`` subclasses. PostgreSQL and psycopg are never faked.
"""

from __future__ import annotations

import collections
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psycopg
from psycopg import sql

from outbox_relay.db.store import OutboxStore, Reschedule
from outbox_relay.observability.metrics import RelayMetrics
from outbox_relay.publisher import Defer, Message, PermanentError, RetryableError, SimplePublisher
from outbox_relay.runtime.worker import Worker, WorkerConfig
from tests.helpers.cli import ROOT
from tests.helpers.db import DELETE_MODE, assert_delivered, insert_rows, row_state, rows, run_sql, wait_for

CHILD = Path(__file__).resolve().parent.parent / "helpers" / "claim_child.py"


# --- helpers -------------------------------------------------------------------------
class RecordingPublisher(SimplePublisher):
    """Records every message id it is asked to publish; optionally fails with an outcome."""

    def __init__(self, outcome: Exception | None = None) -> None:
        self.outcome = outcome
        self.published: list[int] = []
        self.attempts_seen: list[int] = []
        self._lock = threading.Lock()

    def publish(self, message: Message) -> None:
        with self._lock:
            self.published.append(message.id)
            self.attempts_seen.append(message.attempts)
        if self.outcome is not None:
            raise self.outcome

    @property
    def counts(self) -> collections.Counter[int]:
        with self._lock:
            return collections.Counter(self.published)


def worker_config(**overrides: object) -> WorkerConfig:
    values: dict[str, object] = {
        "owner": "test",
        "batch_size": 10,
        "lease_seconds": 30.0,
        "max_attempts": 3,
        "ordered_types": [],
        "run_length": 1,
        "strict_lease": False,
        "topic_template": "outbox.{aggregate_type}",
        "poll_interval_seconds": 0.05,
        "backoff_base_seconds": 0.001,
        "backoff_cap_seconds": 0.01,
        "publish_timeout_seconds": 5.0,
    }
    values.update(overrides)
    return WorkerConfig(**values)  # type: ignore[arg-type]


def wait_leases_expired(dsn: str, table: str, ids: Sequence[int], timeout: float = 10.0) -> None:
    """Until the database's own clock says every lease of ``ids`` has expired."""
    wait_for(
        lambda: run_sql(dsn, table, "SELECT bool_and(lease_until < now()) FROM {t} WHERE id = ANY(%s)", (list(ids),))[
            0
        ][0],
        timeout=timeout,
        interval=0.05,
        message=f"leases of {ids} to expire",
    )


def make_due(dsn: str, table: str) -> None:
    run_sql(dsn, table, "UPDATE {t} SET available_at = now() WHERE status = 'pending'")


# --- claims, leases, outcomes: no row delivered twice by live owners, none lost -------
def test_four_workers_claim_200_rows_without_duplicates(pg_dsn, table, store):
    ids = insert_rows(pg_dsn, table, 200)
    barrier = threading.Barrier(4)
    claimed: list[list[int]] = [[] for _ in range(4)]
    errors: list[BaseException] = []

    def claimer(n: int) -> None:
        try:
            with OutboxStore(pg_dsn, table, pool_size=1) as own:
                barrier.wait(timeout=30)
                while True:
                    batch = own.claim(owner=f"w{n}", batch=7, lease_seconds=60, max_attempts=3).rows
                    if not batch:
                        return
                    claimed[n].extend(c.id for c in batch)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    everything = [i for per_worker in claimed for i in per_worker]
    assert len(everything) == 200
    assert sorted(everything) == sorted(ids)  # exactly the 200 ids, each once
    assert sum(1 for per_worker in claimed if per_worker) >= 2  # the claims really ran side by side
    state = rows(pg_dsn, table, "status, lease_version, attempts")
    assert set(state) == {("processing", 1, 1)}


def test_four_workers_dispatch_100_rows_each_published_once(pg_dsn, table, store):
    ids = insert_rows(pg_dsn, table, 100)
    publisher = RecordingPublisher()
    metrics = RelayMetrics()
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []
    batches: list[int] = []

    def run(n: int) -> None:
        worker = Worker(n, store, publisher, worker_config(batch_size=5), metrics)
        try:
            barrier.wait(timeout=30)
            while True:
                rows_ = worker.claim()
                if not rows_:
                    return
                result = worker.process(rows_)
                assert result.lost == [] and result.done == len(rows_)
                batches.append(n)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    counts = publisher.counts
    assert set(counts) == set(ids)
    assert set(counts.values()) == {1}, {i: c for i, c in counts.items() if c != 1}
    assert_delivered(pg_dsn, table, ids)
    assert metrics.registry.get_sample_value("outbox_relay_published_total", {"outcome": "done"}) == 100
    assert metrics.registry.get_sample_value("outbox_relay_lost_leases_total") == 0
    assert len(set(batches)) >= 2  # more than one worker actually dispatched


def test_crashed_worker_lease_expires_and_stale_finalize_is_fenced(pg_dsn, table, store):
    [row_id] = insert_rows(pg_dsn, table, 1)
    [a] = store.claim(owner="A", batch=10, lease_seconds=0.2, max_attempts=3).rows
    assert (a.id, a.lease_version, a.attempts) == (row_id, 1, 1)
    # During A's lease nobody else can take the row.
    assert store.claim(owner="B", batch=10, lease_seconds=30, max_attempts=3).rows == []

    wait_leases_expired(pg_dsn, table, [row_id])  # A "crashed": it never finalized
    [b] = store.claim(owner="B", batch=10, lease_seconds=30, max_attempts=3).rows
    assert b.id == a.id
    assert b.lease_version == a.lease_version + 1 == 2
    assert b.attempts == 2
    assert row_state(pg_dsn, table, row_id)["lease_owner"] == "B"

    assert store.mark_done([(a.id, a.lease_version)]) == set()  # A is fenced off
    assert row_state(pg_dsn, table, row_id)["status"] == "processing"
    assert store.mark_done([(b.id, b.lease_version)]) == {row_id}
    assert_delivered(pg_dsn, table, [row_id])
    if not DELETE_MODE:
        assert row_state(pg_dsn, table, row_id)["lease_version"] == 2


def test_expired_but_not_reclaimed_owner_may_finish_unless_strict(pg_dsn, table, store):
    lenient_id, strict_id = insert_rows(pg_dsn, table, 2)
    claims = store.claim(owner="A", batch=10, lease_seconds=0.2, max_attempts=3).rows
    assert [c.id for c in claims] == [lenient_id, strict_id]
    wait_leases_expired(pg_dsn, table, [lenient_id, strict_id])
    by_id = {c.id: c for c in claims}

    # Default policy: correctness is "did the generation change?", not the clock.
    assert store.mark_done([(lenient_id, by_id[lenient_id].lease_version)]) == {lenient_id}
    assert_delivered(pg_dsn, table, [lenient_id])

    # Strict policy: an expired owner cannot finalize at all, even if no one reclaimed the row.
    assert store.mark_done([(strict_id, by_id[strict_id].lease_version)], strict=True) == set()
    state = row_state(pg_dsn, table, strict_id)
    assert (state["status"], state["lease_version"]) == ("processing", 1)


def test_three_retryable_failures_end_dead(pg_dsn, table, store):
    [row_id] = insert_rows(pg_dsn, table, 1)
    publisher = RecordingPublisher(RetryableError("broker said 503"))
    metrics = RelayMetrics()
    worker = Worker(0, store, publisher, worker_config(max_attempts=3), metrics)

    expected = [("pending", 1), ("pending", 2), ("dead", 3)]
    for round_, (status, attempts) in enumerate(expected, start=1):
        make_due(pg_dsn, table)  # skip the (tiny) backoff deterministically
        claimed = worker.claim()
        assert [c.id for c in claimed] == [row_id]
        result = worker.process(claimed)
        assert result.lost == []
        state = row_state(pg_dsn, table, row_id)
        assert (state["status"], state["attempts"]) == (status, attempts), f"round {round_}"
        assert "broker said 503" in str(state["last_error"])
        assert state["lease_until"] is None
        if status == "pending":
            assert result.retried == 1
        else:
            assert result.dead == 1
            assert "retries exhausted after 3 attempts" in str(state["last_error"])

    assert publisher.published == [row_id] * 3
    assert publisher.attempts_seen == [1, 2, 3]
    make_due(pg_dsn, table)
    assert worker.claim() == []  # dead rows are never claimed again
    assert metrics.registry.get_sample_value("outbox_relay_published_total", {"outcome": "retry"}) == 2
    assert metrics.registry.get_sample_value("outbox_relay_published_total", {"outcome": "dead"}) == 1


def test_defer_returns_to_pending_with_attempt_refunded(pg_dsn, table, store):
    [row_id] = insert_rows(pg_dsn, table, 1)
    publisher = RecordingPublisher(Defer(120, "customer account not created yet"))
    metrics = RelayMetrics()
    worker = Worker(0, store, publisher, worker_config(), metrics)
    claimed = worker.claim()
    assert [c.attempts for c in claimed] == [1]
    result = worker.process(claimed)
    assert result.deferred == 1 and result.lost == []

    state = row_state(pg_dsn, table, row_id)
    assert (state["status"], state["attempts"], state["lease_until"]) == ("pending", 0, None)
    assert "customer account not created yet" in str(state["last_error"])
    [(delay,)] = run_sql(
        pg_dsn, table, "SELECT extract(epoch FROM available_at - now())::float8 FROM {t} WHERE id = %s", (row_id,)
    )
    assert 100 < delay <= 120  # moved forward by ~the delay (minus the seconds this test took)
    assert worker.claim() == []  # not due yet
    assert metrics.registry.get_sample_value("outbox_relay_published_total", {"outcome": "defer"}) == 1


def test_permanent_error_goes_dead_at_once(pg_dsn, table, store):
    [row_id] = insert_rows(pg_dsn, table, 1)
    publisher = RecordingPublisher(PermanentError("topic does not accept this schema"))
    worker = Worker(0, store, publisher, worker_config(max_attempts=5), RelayMetrics())
    result = worker.process(worker.claim())
    assert result.dead == 1 and result.lost == []
    state = row_state(pg_dsn, table, row_id)
    assert (state["status"], state["attempts"], state["lease_until"]) == ("dead", 1, None)
    assert "topic does not accept this schema" in str(state["last_error"])
    make_due(pg_dsn, table)
    assert worker.claim() == []
    assert publisher.published == [row_id]


def test_claimed_three_times_without_outcome_is_reaped_dead(pg_dsn, table, store):
    [row_id] = insert_rows(pg_dsn, table, 1)
    for attempt in (1, 2, 3):
        result = store.claim(owner=f"crashy{attempt}", batch=10, lease_seconds=0.2, max_attempts=3)
        assert [(c.id, c.attempts, c.lease_version) for c in result.rows] == [(row_id, attempt, attempt)]
        wait_leases_expired(pg_dsn, table, [row_id])  # the worker "dies" every time

    result = store.claim(owner="survivor", batch=10, lease_seconds=0.2, max_attempts=3)
    assert result.rows == []
    assert [(i, v) for i, v, _owner in result.reaped] == [(row_id, 3)]
    state = row_state(pg_dsn, table, row_id)
    assert (state["status"], state["attempts"], state["lease_until"]) == ("dead", 3, None)
    assert "lease expired" in str(state["last_error"])

    time.sleep(0.3)
    again = store.claim(owner="survivor", batch=10, lease_seconds=30, max_attempts=3)
    assert again.rows == [] and again.reaped == []
    assert row_state(pg_dsn, table, row_id)["status"] == "dead"


def test_reaped_rows_report_the_last_owner(pg_dsn, table, store):
    [row_id] = insert_rows(pg_dsn, table, 1)
    for attempt in (1, 2):
        store.claim(owner=f"crashy{attempt}", batch=10, lease_seconds=0.2, max_attempts=2)
        wait_leases_expired(pg_dsn, table, [row_id])
    result = store.claim(owner="survivor", batch=10, lease_seconds=30, max_attempts=2)
    assert result.rows == []
    assert result.reaped == [(row_id, 2, "crashy2")]


def _two_worker_interleaving(
    claim: Callable[[str], list[tuple[int, int | None]]],
    finalize: Callable[[str, list[tuple[int, int | None]]], None],
    publisher: RecordingPublisher,
    message_for: Callable[[int], Message],
) -> None:
    """Worker A claims (and commits), then pauses before publishing; worker B runs a
    whole claim -> publish -> finalize cycle meanwhile; then A resumes."""
    a_committed = threading.Event()
    b_finished = threading.Event()
    errors: list[BaseException] = []

    def worker_a() -> None:
        try:
            claims = claim("A")
            a_committed.set()
            assert b_finished.wait(timeout=30)  # paused between COMMIT and publish
            for row_id, _ in claims:
                publisher.publish(message_for(row_id))
            finalize("A", claims)
        except BaseException as exc:
            errors.append(exc)
            a_committed.set()

    thread = threading.Thread(target=worker_a)
    thread.start()
    try:
        assert a_committed.wait(timeout=30)
        claims_b = claim("B")
        for row_id, _ in claims_b:
            publisher.publish(message_for(row_id))
        finalize("B", claims_b)
    finally:
        b_finished.set()
        thread.join(timeout=30)
    assert not errors, errors


def test_broken_dispatcher_publishes_twice_and_leased_claim_does_not(pg_dsn, table, store):
    """Reproduces the naive dispatcher that leases and fencing tokens exist to replace.

    ``SELECT ... FOR UPDATE SKIP LOCKED`` in a transaction, COMMIT, then publish, then
    ``UPDATE ... SET status = 'done'`` -- with no lease. Row locks end at COMMIT, so while
    worker A is paused between its commit and its publish, worker B selects the very
    same rows and every message is published twice. This test documents that failure
    (the duplication is the asserted outcome), then runs the same interleaving with
    ``OutboxStore.claim``, whose committed lease makes B find nothing to take.
    """
    ident = sql.Identifier(*table.split("."))
    broken_ids = insert_rows(pg_dsn, table, 3, aggregate_type="broken")
    bodies = {
        r[0]: r
        for r in run_sql(pg_dsn, table, "SELECT id, aggregate_type, aggregate_id, event_type, payload::text FROM {t}")
    }

    def message_for(row_id: int) -> Message:
        _, agg_type, agg_id, event_type, payload = bodies[row_id]
        return Message(
            id=row_id,
            topic=f"outbox.{agg_type}",
            key=agg_id,
            value=payload,
            headers=[("message_id", str(row_id))],
            aggregate_type=agg_type,
            aggregate_id=agg_id,
            event_type=event_type,
        )

    def broken_claim(owner: str) -> list[tuple[int, int | None]]:
        with psycopg.connect(pg_dsn) as conn:
            with conn.transaction():
                picked = conn.execute(
                    sql.SQL(
                        "SELECT id, aggregate_id, event_type, payload FROM {} "
                        "WHERE status = 'pending' ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED"
                    ).format(ident),
                    (50,),
                ).fetchall()
            # COMMITted: the row locks are gone, the rows are still 'pending'.
        return [(r[0], None) for r in picked]

    def broken_finalize(owner: str, claims: list[tuple[int, int | None]]) -> None:
        with psycopg.connect(pg_dsn) as conn:
            for row_id, _ in claims:
                with conn.transaction():
                    conn.execute(
                        sql.SQL("UPDATE {} SET status = 'done', done_at = now() WHERE id = %s").format(ident), (row_id,)
                    )

    broken = RecordingPublisher()
    _two_worker_interleaving(broken_claim, broken_finalize, broken, message_for)
    assert broken.counts == dict.fromkeys(broken_ids, 2)  # every message published twice
    assert {r[1] for r in rows(pg_dsn, table)} == {"done"}  # and the table looks perfectly fine

    # The same interleaving with the real lease-writing claim and fenced finalize.
    leased_ids = insert_rows(pg_dsn, table, 3, aggregate_type="leased")
    bodies.update(
        {
            r[0]: r
            for r in run_sql(
                pg_dsn, table, "SELECT id, aggregate_type, aggregate_id, event_type, payload::text FROM {t}"
            )
        }
    )
    finalized: dict[str, set[int]] = {}

    def leased_claim(owner: str) -> list[tuple[int, int | None]]:
        return [
            (c.id, c.lease_version) for c in store.claim(owner=owner, batch=50, lease_seconds=30, max_attempts=3).rows
        ]

    def leased_finalize(owner: str, claims: list[tuple[int, int | None]]) -> None:
        finalized[owner] = store.mark_done([(i, v) for i, v in claims if v is not None])

    leased = RecordingPublisher()
    _two_worker_interleaving(leased_claim, leased_finalize, leased, message_for)
    assert leased.counts == dict.fromkeys(leased_ids, 1)  # each message published exactly once
    assert finalized == {"B": set(), "A": set(leased_ids)}  # B found nothing; A finished its rows
    assert_delivered(pg_dsn, table, leased_ids)
    # The broken dispatcher's own UPDATE marked its rows done in either mode.
    assert run_sql(pg_dsn, table, "SELECT id, status FROM {t} WHERE id = ANY(%s) ORDER BY id", (broken_ids,)) == [
        (i, "done") for i in broken_ids
    ]


# --- the six recovery tests: every failure of an owner ends with the row delivered once --
def test_sigkilled_child_leaves_committed_claim_recovered_after_lease(pg_dsn, table, store, tmp_path):
    ids = insert_rows(pg_dsn, table, 1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    stderr_path = tmp_path / "child.stderr"
    with open(stderr_path, "wb") as stderr:
        child = subprocess.Popen(
            [sys.executable, str(CHILD), pg_dsn, table], stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=str(ROOT)
        )
    try:
        ready, _, _ = select.select([child.stdout], [], [], 60)
        assert ready, f"child printed nothing: {stderr_path.read_text()}"
        line = child.stdout.readline()  # type: ignore[union-attr]
        assert line, f"child exited early ({child.poll()}): {stderr_path.read_text()}"
        claim = json.loads(line)
        assert claim == [{"id": ids[0], "lease_version": 1, "attempts": 1}]
        # Only now, with the claim known to be committed, kill the worker.
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        child.stdout.close()  # type: ignore[union-attr]

    state = row_state(pg_dsn, table, ids[0])
    assert (state["status"], state["lease_version"], state["attempts"]) == ("processing", 1, 1)
    assert str(state["lease_owner"]).startswith("child:")
    # The 30 s lease still runs: nobody may take the row yet.
    assert store.claim(owner="next", batch=10, lease_seconds=30, max_attempts=3).rows == []

    # Test fixture instead of a 30 s wait: the lease has run out.
    run_sql(pg_dsn, table, "UPDATE {t} SET lease_until = now() - interval '1 second' WHERE id = %s", (ids[0],))
    [again] = store.claim(owner="next", batch=10, lease_seconds=30, max_attempts=3).rows
    assert (again.id, again.lease_version, again.attempts) == (ids[0], 2, 2)
    assert store.mark_done([(ids[0], 1)]) == set()  # the dead child's generation stays fenced
    assert row_state(pg_dsn, table, ids[0])["status"] == "processing"
    assert store.mark_done([(ids[0], 2)]) == {ids[0]}
    assert_delivered(pg_dsn, table, ids)


def test_uncommitted_claim_holds_row_and_rollback_frees_it(pg_dsn, table, store):
    first, second, _third = insert_rows(pg_dsn, table, 3)
    params = {
        "owner": "open-tx",
        "batch": 1,
        "lease_seconds": 30.0,
        "max_attempts": 3,
        "ordered_types": [],
        "all_ordered": False,
        "excluded_types": [],
        "candidates": 1,
        "max_batch_bytes": 2**62,
        "max_message_bytes": None,
    }
    with psycopg.connect(pg_dsn) as conn:  # not autocommit: the claim stays uncommitted
        held = conn.execute(store.sql.query("claim"), params).fetchall()
        assert [r[1] for r in held if not r[0]] == [first]  # column 0: reaped flag, 1: id

        # A concurrent claim skips the locked row and takes another one.
        [other] = store.claim(owner="B", batch=1, lease_seconds=30, max_attempts=3).rows
        assert other.id == second
        # Outside the open transaction, the held row is still untouched pending.
        state = row_state(pg_dsn, table, first)
        assert (state["status"], state["lease_version"], state["attempts"]) == ("pending", 0, 0)

        conn.rollback()

    state = row_state(pg_dsn, table, first)
    assert (state["status"], state["lease_version"], state["attempts"]) == ("pending", 0, 0)
    [freed] = store.claim(owner="C", batch=1, lease_seconds=30, max_attempts=3).rows
    assert (freed.id, freed.lease_version, freed.attempts) == (first, 1, 1)


def test_stale_success_and_stale_retry_are_rejected(pg_dsn, table, store):
    [row_id] = insert_rows(pg_dsn, table, 1)
    [old] = store.claim(owner="A", batch=1, lease_seconds=30, max_attempts=5).rows
    assert old.lease_version == 1
    # A newer live generation, built directly so the fencing is tested independently
    # of the reclaim query.
    run_sql(
        pg_dsn,
        table,
        "UPDATE {t} SET lease_version = lease_version + 1, attempts = attempts + 1, "
        "lease_owner = 'B', lease_until = now() + interval '30 seconds' WHERE id = %s",
        (row_id,),
    )
    before = row_state(pg_dsn, table, row_id)

    assert store.mark_done([(row_id, old.lease_version)]) == set()  # stale success
    assert row_state(pg_dsn, table, row_id) == before
    assert store.reschedule([Reschedule(row_id, old.lease_version, 60.0, "late failure", False)]) == set()
    assert store.reschedule([Reschedule(row_id, old.lease_version, 60.0, "late defer", True)]) == set()
    assert store.mark_dead([(row_id, old.lease_version, "late permanent")]) == set()
    assert row_state(pg_dsn, table, row_id) == before  # status, attempts, owner, error all untouched
    assert before["status"] == "processing" and before["lease_version"] == 2 and before["last_error"] is None

    # The current generation still finalizes normally.
    assert store.reschedule([Reschedule(row_id, 2, 0.0, "current failure", False)]) == {row_id}
    state = row_state(pg_dsn, table, row_id)
    assert (state["status"], state["attempts"], state["last_error"]) == ("pending", 2, "current failure")


def test_retry_cannot_move_done_row_back_to_pending(pg_dsn, table, store):
    [row_id] = insert_rows(pg_dsn, table, 1)
    [c] = store.claim(owner="A", batch=1, lease_seconds=30, max_attempts=3).rows
    assert store.mark_done([(c.id, c.lease_version)]) == {row_id}
    assert_delivered(pg_dsn, table, [row_id])
    done = rows(pg_dsn, table, "*")  # the whole row (delete mode: no row at all)

    # Same generation, a late retry or defer after success: rejected.
    assert store.reschedule([Reschedule(row_id, c.lease_version, 0.0, "late retry", False)]) == set()
    assert store.reschedule([Reschedule(row_id, c.lease_version, 0.0, None, True)]) == set()
    assert store.mark_dead([(row_id, c.lease_version, "late dead")]) == set()
    assert store.mark_done([(c.id, c.lease_version)]) == set()  # a second success finalizes nothing
    assert rows(pg_dsn, table, "*") == done
    make_due(pg_dsn, table)
    assert store.claim(owner="B", batch=1, lease_seconds=30, max_attempts=3).rows == []


def test_strict_policy_rejects_expired_owner(pg_dsn, table, store):
    [row_id] = insert_rows(pg_dsn, table, 1)
    [c] = store.claim(owner="A", batch=1, lease_seconds=0.2, max_attempts=3).rows
    wait_leases_expired(pg_dsn, table, [row_id])  # expired, nobody reclaimed

    assert store.mark_done([(row_id, c.lease_version)], strict=True) == set()
    assert store.reschedule([Reschedule(row_id, c.lease_version, 0.0, "late", False)], strict=True) == set()
    assert store.mark_dead([(row_id, c.lease_version, "late")], strict=True) == set()
    state = row_state(pg_dsn, table, row_id)
    assert (state["status"], state["lease_version"], state["lease_owner"]) == ("processing", 1, "A")

    # A live owner passes the strict check.
    [again] = store.claim(owner="B", batch=1, lease_seconds=30, max_attempts=3).rows
    assert again.lease_version == 2
    assert store.mark_done([(row_id, again.lease_version)], strict=True) == {row_id}
    assert_delivered(pg_dsn, table, [row_id])


def test_worker_finalize_counts_lost_leases(pg_dsn, table, store):
    ids = insert_rows(pg_dsn, table, 3)
    metrics = RelayMetrics()
    worker = Worker(0, store, RecordingPublisher(), worker_config(lease_seconds=0.2), metrics)
    claimed = worker.claim()
    assert [c.id for c in claimed] == ids
    wait_leases_expired(pg_dsn, table, ids)
    taken = store.claim(owner="successor", batch=10, lease_seconds=30, max_attempts=3).rows
    assert [(c.id, c.lease_version) for c in taken] == [(i, 2) for i in ids]

    result = worker.finalize(claimed, [None, RetryableError("late"), PermanentError("late")])
    assert sorted(result.lost) == ids
    assert (result.done, result.retried, result.dead) == (0, 0, 0)
    assert metrics.registry.get_sample_value("outbox_relay_lost_leases_total") == 3
    assert metrics.registry.get_sample_value("outbox_relay_published_total", {"outcome": "done"}) == 0
    # The successor's state is untouched and it can still finish.
    assert {r[1:4] for r in rows(pg_dsn, table)} == {("processing", 2, 2)}
    assert store.mark_done([(c.id, c.lease_version) for c in taken]) == set(ids)
    assert_delivered(pg_dsn, table, ids)
