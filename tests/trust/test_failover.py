"""PostgreSQL failover under two running relays.

A PostgreSQL 15 primary and a synchronous streaming standby (``pg_basebackup``,
``synchronous_standby_names``) built here with the system's binaries; two real
``outbox-relay run`` processes on a multi-host DSN
(``host=a,b port=p1,p2 target_session_attrs=read-write``); a writer keeps committing
through the same kind of DSN. Mid-drain the primary is SIGKILLed (postmaster and
backends at once) and the standby promoted, as a failover manager would.

Checked: both relays reconnect to the new primary by themselves and never exit; every
row whose commit was acknowledged (the backlog and the writer's) reaches the broker
(topic read back); none is left pending/processing/dead; the audit trigger (replicated
with the table) shows no stale finalize across the failover. The time from the kill to
deliveries resuming and to the backlog drained is printed (``pytest -s``) and written to
``failover_summary.json`` in the test's tmp dir.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_relay import enqueue
from outbox_relay._embedded.embedded import read_messages
from outbox_relay.db.store import OutboxStore
from tests.helpers.audit import check_audit, install_audit
from tests.helpers.pg_cluster import TempServers, pg_missing_reason
from tests.helpers.relay_process import RelayProcess, relay_env
from tests.helpers.wait import wait_for

TABLE = "public.outbox"
BACKLOG_ROWS = 20_000
LEASE_SECONDS = 4
KILL_AFTER_DONE_FRACTION = 0.2  # strike once a fifth of the backlog is delivered: mid-drain
DRAIN_TIMEOUT_SECONDS = 60


def _copy_backlog(dsn: str, n: int, aggregate_type: str) -> None:
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        with cur.copy("COPY public.outbox (aggregate_type, aggregate_id, event_type, payload) FROM STDIN") as copy:
            for i in range(n):
                copy.write_row((aggregate_type, f"agg-{i % 100}", "OrderCreated", json.dumps({"seq": i})))


def _done_count(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=2) as conn:
        return int(conn.execute("SELECT count(*) FROM public.outbox WHERE status = 'done'").fetchone()[0])


class Writer(threading.Thread):
    """Commits one row per transaction through the multi-host DSN; keeps the ids whose
    COMMIT returned (acknowledged: they must be delivered). A failed commit is retried on
    a new connection; its row may or may not exist (the application's usual ambiguity)."""

    def __init__(self, dsn: str, aggregate_type: str) -> None:
        super().__init__(name="writer", daemon=True)
        self.dsn = dsn
        self.aggregate_type = aggregate_type
        self.acknowledged: list[int] = []
        self.failed_commits = 0
        self.stop = threading.Event()

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        seq = 0
        while not self.stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, connect_timeout=2)
                with conn.transaction():
                    row_id = enqueue(
                        conn,
                        aggregate_type=self.aggregate_type,
                        aggregate_id=f"w-{seq % 10}",
                        event_type="OrderPaid",
                        payload={"seq": seq},
                        table=TABLE,
                    )
                self.acknowledged.append(int(row_id))
                seq += 1
                self.stop.wait(0.01)
            except psycopg.Error:
                self.failed_commits += 1
                if conn is not None:
                    conn.close()
                conn = None
                self.stop.wait(0.2)
        if conn is not None:
            conn.close()


@pytest.mark.timeout(180)
def test_primary_killed_mid_drain_relays_follow_the_promoted_standby(broker: Any, tmp_path: Path) -> None:
    missing = pg_missing_reason()
    if missing:
        pytest.skip(missing)
    topic_prefix = "failover" + uuid.uuid4().hex[:8]
    backlog_type, writer_type = "order", "payment"
    topics = [f"{topic_prefix}.{backlog_type}", f"{topic_prefix}.{writer_type}"]

    with TempServers() as servers:
        primary = (
            servers.server("primary")
            .initdb(
                settings={
                    "wal_level": "replica",
                    "max_wal_senders": "5",
                    "synchronous_standby_names": "FIRST 1 (standby1)",
                    "synchronous_commit": "on",
                }
            )
            .start()
        )
        standby = servers.server("standby").basebackup_of(primary, application_name="standby1")
        # The standby's own settings once promoted: it has no standby of its own, so it must
        # not wait for one (it would inherit the primary's synchronous_standby_names and every
        # commit would hang). A failover manager (e.g. Patroni) does the same at promotion.
        standby.configure({"synchronous_standby_names": "", "wal_retrieve_retry_interval": "500ms"})
        standby.start()
        wait_for(
            lambda: primary.execute(
                "SELECT 1 FROM pg_stat_replication WHERE application_name = 'standby1' AND sync_state = 'sync'"
            ),
            30,
            message="the standby to be synchronous",
            ignoring=(psycopg.Error,),
        )

        with OutboxStore(primary.dsn(), TABLE, pool_size=1) as setup:
            setup.migrate()
        audit = install_audit(primary.dsn(), TABLE)
        _copy_backlog(primary.dsn(), BACKLOG_ROWS, backlog_type)

        multi_host = (
            f"host=127.0.0.1,127.0.0.1 port={primary.port},{standby.port} user=postgres "
            "dbname=postgres target_session_attrs=read-write"
        )
        env = relay_env(
            OUTBOX_RELAY_DATABASE__DSN=multi_host,
            OUTBOX_RELAY_DATABASE__TABLE=TABLE,
            OUTBOX_RELAY_DATABASE__CONNECT_TIMEOUT_SECONDS="2",
            OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS=broker.bootstrap_servers,
            OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE=topic_prefix + ".{aggregate_type}",
            OUTBOX_RELAY_RELAY__WORKERS="2",
            OUTBOX_RELAY_RELAY__BATCH_SIZE="100",
            OUTBOX_RELAY_RELAY__LEASE_SECONDS=str(LEASE_SECONDS),
            OUTBOX_RELAY_RELAY__MAX_ATTEMPTS="50",
            OUTBOX_RELAY_RELAY__BACKOFF_BASE_SECONDS="0.1",
            OUTBOX_RELAY_RELAY__BACKOFF_CAP_SECONDS="1",
            OUTBOX_RELAY_RELAY__POLL_INTERVAL_SECONDS="0.2",
            OUTBOX_RELAY_LOG__LEVEL="INFO",
        )
        relays = [RelayProcess(f"relay{i}", env, tmp_path) for i in range(2)]
        writer = Writer(multi_host, writer_type)
        try:
            for relay in relays:
                relay.wait_started()
            writer.start()
            wait_for(
                lambda: _done_count(primary.dsn()) >= BACKLOG_ROWS * KILL_AFTER_DONE_FRACTION,
                60,
                message="the relays to be mid-drain",
                interval=0.02,
                ignoring=(psycopg.Error,),
            )

            done_at_kill = _done_count(primary.dsn())
            killed_at = time.monotonic()
            primary.crash()
            standby.promote()
            promoted_seconds = time.monotonic() - killed_at
            done_at_promotion = _done_count(standby.dsn())
            resumed_seconds = wait_for(
                lambda: _done_count(standby.dsn()) > done_at_promotion and time.monotonic() - killed_at,
                DRAIN_TIMEOUT_SECONDS,
                message="deliveries to resume on the new primary",
                interval=0.05,
                ignoring=(psycopg.Error,),
            )
            # Let the writer commit on the new primary for a moment, then stop it.
            time.sleep(1.0)
            writer.stop.set()
            writer.join(timeout=10)

            def drained() -> float | None:
                with psycopg.connect(standby.dsn(), autocommit=True) as conn:
                    busy = conn.execute(
                        "SELECT EXISTS (SELECT 1 FROM public.outbox WHERE status IN ('pending', 'processing'))"
                    ).fetchone()[0]
                return None if busy else time.monotonic() - killed_at

            drained_seconds = wait_for(
                drained,
                DRAIN_TIMEOUT_SECONDS,
                interval=0.1,
                ignoring=(psycopg.Error,),
                message="the backlog to drain after the failover",
            )
            exited = {r.name: r.proc.returncode for r in relays if not r.alive()}
            assert not exited, f"relays exited during the failover: {exited}\n" + "\n".join(
                r.output()[-2000:] for r in relays
            )
            exit_codes = [relay.terminate() for relay in relays]
        finally:
            writer.stop.set()
            for relay in relays:
                relay.kill()

        assert exit_codes == [0, 0], [r.output()[-2000:] for r in relays]
        with psycopg.connect(standby.dsn(), autocommit=True) as conn:
            counts = dict(conn.execute("SELECT status, count(*) FROM public.outbox GROUP BY status").fetchall())
            all_ids = {r[0] for r in conn.execute("SELECT id FROM public.outbox").fetchall()}
        acknowledged = set(writer.acknowledged)
        assert counts == {"done": len(all_ids)}, counts
        assert acknowledged <= all_ids, "a commit acknowledged under synchronous replication was lost"
        assert len(all_ids) >= BACKLOG_ROWS + len(acknowledged)

        messages = read_messages(
            broker.bootstrap_servers,
            topics,
            expected=len(all_ids),
            timeout=60,
            stop_when=lambda out: all_ids <= {int(m["headers"]["message_id"]) for m in out},
        )
        delivered = {int(m["headers"]["message_id"]) for m in messages}
        assert all_ids - delivered == set(), f"{len(all_ids - delivered)} rows never reached the broker"

        violations, transitions = check_audit(standby.dsn(), audit)
        assert violations == [], violations[:10]
        crashes = [e for r in relays for e in r.events() if e.get("event") == "worker crashed"]
        assert crashes == []

    summary = {
        "backlog_rows": BACKLOG_ROWS,
        "writer_acknowledged": len(acknowledged),
        "writer_failed_commits": writer.failed_commits,
        "done_at_kill": done_at_kill,
        "promote_seconds": round(promoted_seconds, 2),
        "kill_to_deliveries_resumed_seconds": round(float(resumed_seconds), 2),
        "promotion_to_deliveries_resumed_seconds": round(float(resumed_seconds) - promoted_seconds, 2),
        "kill_to_drained_seconds": round(float(drained_seconds), 2),
        "lease_seconds": LEASE_SECONDS,
        "deliveries": len(messages),
        "duplicates": len(messages) - len(delivered),
        "audit_transitions": dict(sorted(transitions.items())),
    }
    (tmp_path / "failover_summary.json").write_text(json.dumps(summary, indent=2))
    print("\nfailover summary:", json.dumps(summary))
