"""Chaos suite ("Survive faults"): two relay processes x 4 workers drain ~20k events
while a seeded driver SIGKILLs and SIGTERMs relays, SIGSTOPs the broker, terminates
the relays' database backends, and SIGSTOPs a relay for longer than its lease (a stale
worker that wakes up after its rows were reclaimed and tries to finalize them).

Checked at the end:
- every outbox id reached the broker at least once (the topic is read back);
- every row is ``done`` (none ``processing``, none ``dead``);
- a test-only audit trigger shows no stale finalize: each processing -> done/pending/dead
  transition keeps the lease_version and that version is the highest the row ever had;
  each claim bumps the version by exactly one and takes a processing row only after its
  lease expired; a lease keeper's extension keeps owner and version;
- SIGTERMed relays hand off gracefully (exit 0), no relay exits on its own, no worker
  thread crashed.

The broker is only ever paused (SIGSTOP/SIGCONT), never killed: on tansu (which the
suite can still run on) a restart would lose delivered messages and make the first
check unverifiable; a Kafka broker restart is tests/kafka/test_broker_restart.py. The
fault *schedule* is deterministic (random.Random(1234)); timing is not.
A JSON summary (duplicates, faults injected, recovery time, ...) is written to the test's
tmp dir and printed (visible with ``pytest -s``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_relay._embedded.embedded import EmbeddedBroker, read_messages
from outbox_relay.db.store import OutboxStore
from tests.helpers.audit import check_audit, install_audit
from tests.helpers.cli import ROOT, cli_env
from tests.helpers.db import insert_rows
from tests.helpers.wait import wait_for

pytestmark = pytest.mark.chaos

SEED = 1234
WORKERS = 4
RELAYS = 2
BATCHES = 20
BATCH_ROWS = 1000
TOTAL = BATCHES * BATCH_ROWS
FAULTS_PER_KIND = 4
STRIKE_DELAY = (0.05, 0.5)  # seconds from an enqueue commit to the fault: hit in-flight batches
FAULT_GAP = (0.5, 2.0)  # seconds after a fault before the next step
PAUSE_SECONDS = (2.0, 6.0)  # broker SIGSTOP duration
LEASE_SECONDS = 5
FREEZE_SECONDS = (LEASE_SECONDS + 1.5, LEASE_SECONDS + 3.0)  # relay SIGSTOP: longer than its lease
DRAIN_TIMEOUT = 90.0  # after the last fault: all rows done within this (less if the budget is short)
TEST_BUDGET = 285.0  # seconds; pytest-timeout is 300: fail with a diagnosis before it fires
READBACK_TIMEOUT = 60.0
GRACEFUL_EXIT_TIMEOUT = 30.0  # a SIGTERMed relay must have exited (0) within this


# --- the relay processes -------------------------------------------------------------
class RelayProcess:
    def __init__(self, slot: int, generation: int, env: dict[str, str], log_dir: Path) -> None:
        self.slot = slot
        self.name = f"relay{slot}-gen{generation}"
        self.log_path = log_dir / f"{self.name}.log"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "outbox_relay.operator.cli", "run", "--workers", str(WORKERS)],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.stop_kind: str | None = None  # "kill" | "term" | "final"

    def signal(self, sig: signal.Signals) -> None:
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def started(self) -> bool:
        return any(e.get("event") == "relay started" for e in self.events())


def status_counts(conn: psycopg.Connection[Any], table: str) -> dict[str, int]:
    schema, name = table.split(".")
    return dict(conn.execute(f'SELECT status, count(*) FROM "{schema}"."{name}" GROUP BY status').fetchall())


# --- the test ------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("on_done", ["keep", "delete"])
def test_chaos_two_relays_survive_kills_pauses_and_backend_terminations(
    pg_dsn: str, table: str, own_broker: EmbeddedBroker, tmp_path: Path, on_done: str
) -> None:
    """Both relay.on_done modes: with ``delete`` a delivered row leaves the table (the
    audit records the fenced delete as a transition to "deleted")."""
    finished = "deleted" if on_done == "delete" else "done"
    t0 = time.monotonic()
    rng = random.Random(SEED)
    topic_prefix = "chaos" + uuid.uuid4().hex[:10]
    topics = [f"{topic_prefix}.order", f"{topic_prefix}.invoice"]

    def finished_rows(counts: dict[str, int]) -> int:
        """Rows delivered and finalized: done, or (delete mode) gone from the table."""
        if on_done == "delete":
            return TOTAL - sum(counts.values()) if not counts.get("done") else -1
        return counts.get("done", 0)

    migrator = OutboxStore(pg_dsn, table, pool_size=1, application_name="outbox-chaos-test")
    migrator.open()
    try:
        migrator.migrate(on_done=on_done)
    finally:
        migrator.close()
    audit = install_audit(pg_dsn, table)

    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}
    env.update(
        cli_env(
            pg_dsn,
            table,
            own_broker.bootstrap_servers,
            OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE=topic_prefix + ".{aggregate_type}",
            OUTBOX_RELAY_METRICS__PORT="0",
            OUTBOX_RELAY_METRICS__HOST="127.0.0.1",
            OUTBOX_RELAY_RELAY__LEASE_SECONDS=str(LEASE_SECONDS),
            OUTBOX_RELAY_RELAY__ON_DONE=on_done,
            OUTBOX_RELAY_RELAY__BATCH_SIZE="25",
            # Small batches and a long linger keep batches in flight long enough for the faults to
            # strike them (a broker round trip of ~0.1 s); 8 workers still drain ~1k events/s.
            OUTBOX_RELAY_KAFKA__LINGER_MS="100",
            OUTBOX_RELAY_RELAY__MAX_ATTEMPTS="50",
            OUTBOX_RELAY_RELAY__BACKOFF_BASE_SECONDS="0.05",
            OUTBOX_RELAY_RELAY__BACKOFF_CAP_SECONDS="2",
            OUTBOX_RELAY_RELAY__POLL_INTERVAL_SECONDS="0.2",
            OUTBOX_RELAY_RELAY__SHUTDOWN_TIMEOUT_SECONDS="3",
            OUTBOX_RELAY_LOG__FORMAT="json",
            OUTBOX_RELAY_LOG__LEVEL="INFO",
        )
    )
    log_dir = tmp_path / "relay-logs"
    log_dir.mkdir()

    generation = [0]
    every: list[RelayProcess] = []

    def spawn(slot: int) -> RelayProcess:
        generation[0] += 1
        relay = RelayProcess(slot, generation[0], env, log_dir)
        every.append(relay)
        return relay

    active: list[RelayProcess] = [spawn(slot) for slot in range(RELAYS)]
    faults: Counter = Counter()
    unexpected_exits: list[str] = []
    backends_terminated = [0]
    enqueued_ids: list[int] = []
    batches_written = [0]

    def enqueue_batch() -> None:
        batch = batches_written[0]
        aggregate_type = "order" if batch % 2 == 0 else "invoice"
        enqueued_ids.extend(
            insert_rows(
                pg_dsn, table, BATCH_ROWS, aggregate_type=aggregate_type, aggregates=50, event_type="ChaosHappened"
            )
        )
        batches_written[0] += 1

    def supervise() -> None:
        """A relay that exited without being told to (e.g. refused to start) is replaced
        like an orchestrator would, and reported."""
        for i, relay in enumerate(active):
            if relay.proc.poll() is not None and relay.stop_kind is None:
                tail = relay.log_path.read_text(errors="replace")[-800:]
                unexpected_exits.append(f"{relay.name} exit {relay.proc.returncode}: {tail}")
                active[i] = spawn(relay.slot)

    monitor = psycopg.connect(pg_dsn, autocommit=True)  # no application_name: never terminated
    schedule = ["kill", "term", "pause", "pg_terminate", "freeze"] * FAULTS_PER_KIND
    rng.shuffle(schedule)
    # Batches written before each fault: spread over the whole schedule, so that every
    # fault strikes while the relays are busy with a fresh batch.
    per_step = [len(range(i, BATCHES, len(schedule))) for i in range(len(schedule))]
    last_fault_end = t0
    last_fault_start = time.time()
    try:
        wait_for(
            lambda: all(r.started() or r.proc.poll() is not None for r in active),
            60,
            interval=0.2,
            message="relays to start",
        )
        assert all(r.proc.poll() is None for r in active), [r.log_path.read_text()[-2000:] for r in active]

        # --- fault phase: write a batch, strike while it is in flight, let it breathe ---
        for step, (kind, batches) in enumerate(zip(schedule, per_step, strict=True)):
            supervise()
            for _ in range(batches):
                enqueue_batch()
            time.sleep(rng.uniform(*STRIKE_DELAY))
            last_fault_start = time.time()
            if kind in ("kill", "term"):
                slot = rng.randrange(RELAYS)
                victim = active[slot]
                victim.stop_kind = kind
                victim.signal(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
                active[slot] = spawn(slot)  # the replacement starts at once (rolling restart)
            elif kind == "freeze":
                # A stale worker: the relay stops past its lease (lease keeper included), the
                # other relay reclaims its rows, then it wakes up and tries to finalize.
                victim = active[rng.randrange(RELAYS)]
                seconds = rng.uniform(*FREEZE_SECONDS)
                victim.signal(signal.SIGSTOP)
                try:
                    time.sleep(seconds)
                finally:
                    victim.signal(signal.SIGCONT)
            elif kind == "pause":
                seconds = rng.uniform(*PAUSE_SECONDS)
                own_broker.pause()
                try:
                    time.sleep(seconds)
                finally:
                    own_broker.resume()
            else:
                backends_terminated[0] += monitor.execute(
                    "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = 'outbox-relay' AND datname = current_database() "
                    "AND pid <> pg_backend_pid()) AS t"
                ).fetchone()[0]
            faults[kind] += 1
            last_fault_end = time.monotonic()
            if step < len(schedule) - 1:
                time.sleep(rng.uniform(*FAULT_GAP))
        fault_phase_seconds = last_fault_end - t0

        # --- drain ---------------------------------------------------------------------
        assert len(enqueued_ids) == TOTAL
        drain_timeout = max(
            20.0, min(DRAIN_TIMEOUT, TEST_BUDGET - (time.monotonic() - t0) - READBACK_TIMEOUT - GRACEFUL_EXIT_TIMEOUT)
        )
        drain_deadline = time.monotonic() + drain_timeout
        counts: dict[str, int] = {}
        while time.monotonic() < drain_deadline:
            supervise()
            counts = status_counts(monitor, table)
            if finished_rows(counts) == TOTAL:
                break
            time.sleep(0.25)
        drain_seconds = time.monotonic() - last_fault_end
        assert finished_rows(counts) == TOTAL, (
            f"not drained {drain_timeout:.0f}s after the last fault: {counts}; "
            f"first unfinished: {monitor.execute(_unfinished_sql(table)).fetchall()}"
        )

        # --- stop the last relays gracefully ------------------------------------------
        for relay in active:
            relay.stop_kind = "final"
            relay.signal(signal.SIGTERM)
    finally:
        own_broker.resume_quietly()
        # SIGTERMed relays (during the run and now) get a bounded time to exit; stragglers are killed.
        deadline = time.monotonic() + GRACEFUL_EXIT_TIMEOUT
        for relay in every:
            if relay.stop_kind is None:
                relay.signal(signal.SIGKILL)
            try:
                relay.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                relay.signal(signal.SIGKILL)
                relay.proc.wait(timeout=10)
        monitor.close()

    # --- checks ----------------------------------------------------------------------
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        final_counts = status_counts(conn, table)
        schema, name = table.split(".")
        ids = [r[0] for r in conn.execute(f'SELECT id FROM "{schema}"."{name}" ORDER BY id').fetchall()]
        max_attempts_seen = conn.execute(f'SELECT max(attempts) FROM "{schema}"."{name}"').fetchone()[0]
        finalized_ids = {
            r[0] for r in conn.execute(f"SELECT DISTINCT id FROM {audit} WHERE new_status = %s", (finished,)).fetchall()
        }
    if on_done == "delete":
        assert final_counts == {}, final_counts  # every row delivered and deleted
        ids = sorted(finalized_ids)
    else:
        assert final_counts == {"done": TOTAL}, final_counts
    assert set(ids) == set(enqueued_ids) == finalized_ids

    expected = set(ids)
    seen: set[int] = set()
    growth = {"n": 0, "at": time.monotonic()}

    def complete(out: list[dict[str, object]]) -> bool:
        # Read until every id arrived and nothing new came for 2 s (so duplicates count fully).
        for m in out[len(seen_order) :]:
            seen_order.append(m)
            seen.add(int(m["headers"]["message_id"]))
        if len(out) != growth["n"]:
            growth["n"], growth["at"] = len(out), time.monotonic()
        return expected <= seen and time.monotonic() - growth["at"] > 2.0

    seen_order: list[dict[str, object]] = []
    read_started = time.monotonic()
    messages = read_messages(
        own_broker.bootstrap_servers, topics, expected=10 * TOTAL, timeout=READBACK_TIMEOUT, stop_when=complete
    )
    read_seconds = time.monotonic() - read_started
    delivered_ids = Counter(int(m["headers"]["message_id"]) for m in messages)
    missing = expected - set(delivered_ids)
    foreign = set(delivered_ids) - expected

    violations, transitions = check_audit(pg_dsn, audit)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        last_done = conn.execute(
            f"SELECT extract(epoch FROM max(at))::float8 FROM {audit} WHERE new_status = %s", (finished,)
        ).fetchone()[0]
    # From the injection of the last fault to the last row's done (a fault lasting seconds,
    # e.g. a relay SIGSTOPped past its lease, may be recovered from while it still lasts).
    recovery_seconds = last_done - last_fault_start

    events: Counter = Counter()
    crashes: list[str] = []
    for relay in every:
        for e in relay.events():
            events[e.get("event", "?")] += 1
            if e.get("event") == "worker crashed":
                crashes.append(f"{relay.name}: {e}")
    graceful = {r.name: r.proc.returncode for r in every if r.stop_kind in ("term", "final")}

    summary = {
        "on_done": on_done,
        "seed": SEED,
        "events": TOTAL,
        "deliveries": len(messages),
        "unique_delivered": len(delivered_ids),
        "duplicates": len(messages) - len(delivered_ids),
        "missing": len(missing),
        "faults": {
            "sigkill_relay": faults["kill"],
            "sigterm_relay": faults["term"],
            "broker_pause": faults["pause"],
            "pg_terminate_backend": faults["pg_terminate"],
            "sigstop_relay_past_lease": faults["freeze"],
            "backends_terminated": backends_terminated[0],
        },
        "schedule": " ".join(schedule),
        "fault_phase_seconds": round(fault_phase_seconds, 1),
        "last_fault": schedule[-1],
        "recovery_seconds": round(recovery_seconds, 1),
        "drained_seconds_after_last_fault_ended": round(drain_seconds, 1),
        "total_seconds": round(time.monotonic() - t0, 1),
        "readback_seconds": round(read_seconds, 1),
        "relay_processes": len(every),
        "unexpected_exits": len(unexpected_exits),
        "graceful_exit_codes": graceful,
        "max_attempts_seen": max_attempts_seen,
        "audit_transitions": dict(sorted(transitions.items())),
        "stale_finalize_violations": len(violations),
        "log_events": {
            k: events[k]
            for k in (
                "lost lease: finalize rejected, row belongs to a newer claim",
                "replacing kafka producer",
                "broker unreachable: circuit breaker open, claiming paused",
                "claim commit outcome unknown; not publishing",
                "database unavailable; backing off",
                "finalize failed; retrying",
                "finalize failed; rows will be reclaimed after their lease",
                "lease lost while publishing: a newer claim owns the row",
                "shutdown deadline reached: releasing unacknowledged rows",
                "worker crashed",
            )
        },
        "relay_logs": str(log_dir),
    }
    summary_path = tmp_path / "chaos_summary.json"
    summary_path.write_text(json.dumps(summary, indent=2))
    print(f"\nchaos summary ({summary_path}):\n{summary_path.read_text()}")

    assert not missing, f"{len(missing)} ids never reached the broker, e.g. {sorted(missing)[:20]}"
    assert not foreign, f"messages with unknown ids: {sorted(foreign)[:20]}"
    assert not violations, f"{len(violations)} audit violations:\n" + "\n".join(violations[:30])
    assert not crashes, "worker threads crashed:\n" + "\n".join(crashes[:10])
    assert not unexpected_exits, "relays exited without being stopped:\n" + "\n".join(unexpected_exits)
    assert all(code == 0 for code in graceful.values()), f"SIGTERMed relays did not exit 0: {graceful}"
    assert set(faults.values()) == {FAULTS_PER_KIND} and len(faults) == 5, faults


def _unfinished_sql(table: str) -> str:
    schema, name = table.split(".")
    return (
        f"SELECT id, status, attempts, lease_version, lease_owner, lease_until, available_at, last_error "
        f'FROM "{schema}"."{name}" WHERE status <> \'done\' ORDER BY id LIMIT 10'
    )
