"""Start-up while a dependency is away (the relay waits, never crash-loops), and logs that stay structured.

A real `outbox-relay run` subprocess is started with its database stopped, its
table not yet migrated and its broker not running. It must stay up (/healthz 200,
/readyz 503 naming what it waits for), log one structured line per retry, and start
delivering by itself once everything answers; then it rides out a broker outage and
a database restart. Every line it writes, from start to SIGTERM, must parse as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from outbox_relay._embedded.embedded import EmbeddedBroker, EmbeddedPostgres, free_port
from outbox_relay.db.store import OutboxStore
from tests.helpers.cli import ROOT
from tests.helpers.db import insert_rows, statuses, wait_for

# Exercises the broker, processes or external tools rather than PostgreSQL's SQL:
# ./dev runs it on the first pass only (see pyproject.toml markers).
pytestmark = pytest.mark.first_pass_only


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:  # not listening yet
        return 0, str(exc)


def log_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_relay_waits_for_its_dependencies_and_every_line_is_json(tmp_path, topic_prefix):
    pg = EmbeddedPostgres().start()  # not under pytest's tmp_path: its server user must reach the data
    broker = EmbeddedBroker(log_file=tmp_path / "broker.log")  # not started yet
    metrics_port = free_port()
    out = tmp_path / "relay.out"
    try:
        dsn = pg.dsn
        pg.stop_server()
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")} | {
            "OUTBOX_RELAY_DATABASE__DSN": dsn,
            "OUTBOX_RELAY_DATABASE__TABLE": "public.outbox",
            "OUTBOX_RELAY_DATABASE__CONNECT_TIMEOUT_SECONDS": "1",
            "OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap_servers,
            "OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE": topic_prefix + ".{aggregate_type}",
            "OUTBOX_RELAY_KAFKA__DELIVERY_TIMEOUT_SECONDS": "3",
            "OUTBOX_RELAY_RELAY__LEASE_SECONDS": "8",
            "OUTBOX_RELAY_RELAY__POLL_INTERVAL_SECONDS": "0.2",
            "OUTBOX_RELAY_METRICS__PORT": str(metrics_port),
            "OUTBOX_RELAY_LOG__FORMAT": "json",
            "PYTHONPATH": str(ROOT),
        }
        with out.open("wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "outbox_relay.operator.cli", "run", "--workers", "2"],
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        try:
            # 1. Database down: up, healthy, not ready, one structured line per retry.
            wait_for(
                lambda: (
                    http_get(metrics_port, "/readyz") == (503, "not ready: cannot connect to the database")
                    or "cannot connect to the database" in http_get(metrics_port, "/readyz")[1]
                ),
                timeout=30,
                message="/readyz 503 naming the database",
            )
            assert http_get(metrics_port, "/readyz")[0] == 503
            assert http_get(metrics_port, "/healthz")[0] == 200
            wait_for(
                lambda: sum(e.get("event") == "waiting for dependencies before starting" for e in log_events(out)) >= 2,
                timeout=30,
                message="retry lines",
            )
            assert proc.poll() is None
            # 2. Database back, table not migrated yet: still waiting, for the table now.
            pg.start_server()
            wait_for(
                lambda: "does not exist" in http_get(metrics_port, "/readyz")[1],
                timeout=30,
                message="waiting for the table",
            )
            with OutboxStore(dsn, "public.outbox", pool_size=1) as setup:
                setup.migrate()
            ids = insert_rows(dsn, "public.outbox", 50)
            # 3. Broker still down: waiting for it; then it starts and delivery begins by itself.
            wait_for(lambda: "Kafka" in http_get(metrics_port, "/readyz")[1], timeout=30, message="waiting for Kafka")
            assert statuses(dsn, "public.outbox") == {"pending": 50}
            broker.start()
            wait_for(lambda: statuses(dsn, "public.outbox").get("done") == 50, timeout=60, message="first rows")
            wait_for(lambda: http_get(metrics_port, "/readyz")[0] == 200, timeout=30, message="ready")
            # 4. A broker outage during the run.
            broker.kill()
            more = insert_rows(dsn, "public.outbox", 30)
            time.sleep(2)
            broker.start()
            wait_for(lambda: statuses(dsn, "public.outbox").get("done") == 80, timeout=90, message="after outage")
            # 5. A database restart during the run.
            pg.stop_server()
            time.sleep(2)
            pg.start_server()
            last = insert_rows(dsn, "public.outbox", 20)
            wait_for(lambda: statuses(dsn, "public.outbox").get("done") == 100, timeout=90, message="after restart")
            assert proc.poll() is None
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
        assert code == 0
        assert len(ids + more + last) == 100
        lines = [line for line in out.read_text().splitlines() if line.strip()]
        bad = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                bad.append(line)
                continue
            if not (isinstance(event, dict) and "event" in event and "level" in event and "timestamp" in event):
                bad.append(line)
        assert not bad, bad[:5]
        events = [json.loads(line) for line in lines]
        names = {e["event"] for e in events}
        assert {
            "waiting for dependencies before starting",
            "dependencies answer: starting",
            "relay started",
            "relay stopped",
        } <= names
        # stdlib records (psycopg-pool) and librdkafka's own lines arrive structured too.
        assert any(e.get("logger", "").startswith("psycopg") for e in events), names
    finally:
        broker.stop()
        pg.stop()
