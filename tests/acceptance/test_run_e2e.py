"""The real CLI end to end: migrate, run --workers 4 as a subprocess, read Kafka back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psycopg

from outbox_relay import enqueue
from outbox_relay._embedded.embedded import read_messages
from tests.helpers.cli import cli, cli_env
from tests.helpers.db import statuses, wait_for


def test_migrate_run_drain_and_sigterm(pg_dsn, table, broker, topic_prefix, tmp_path):
    env = cli_env(
        pg_dsn,
        table,
        broker.bootstrap_servers,
        OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE=topic_prefix + ".{aggregate_type}",
        OUTBOX_RELAY_METRICS__PORT="0",
        OUTBOX_RELAY_RELAY__LEASE_SECONDS="15",
    )
    migrated = cli("migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr
    assert cli("migrate", env=env).returncode == 0  # idempotent

    n = 3000
    expected = {}
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        for i in range(n):
            agg_type = "order" if i % 3 else "invoice"
            topic = f"{topic_prefix}.override" if i % 50 == 0 else None
            headers = {"trace_id": f"tr-{i}"} if i % 7 == 0 else None
            payload = {"seq": i, "text": "héllo", "nested": {"n": i}}
            row_id = enqueue(
                conn,
                aggregate_type=agg_type,
                aggregate_id=f"a-{i % 40}",
                event_type="Happened",
                payload=payload,
                topic=topic,
                headers=headers,
                table=table,
            )
            expected[int(row_id)] = (topic or f"{topic_prefix}.{agg_type}", f"a-{i % 40}", payload, headers, agg_type)

    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox_relay.operator.cli", "run", "--workers", "4"],
        env={**{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: statuses(pg_dsn, table).get("done") == n, timeout=120, interval=0.2, message=f"all {n} rows done"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    # Logs are JSON lines off a terminal and mention the graceful stop.
    events = [json.loads(line)["event"] for line in err.splitlines() if line.startswith("{")]
    assert "relay stopped" in events

    topics = sorted({t for t, *_ in expected.values()})
    messages = read_messages(broker.bootstrap_servers, topics, expected=n, timeout=90)
    by_id = {}
    for m in messages:
        by_id.setdefault(int(m["headers"]["message_id"]), m)
    assert set(by_id) == set(expected), f"missing {len(set(expected) - set(by_id))}"
    for row_id, (topic, key, payload, headers, agg_type) in expected.items():
        m = by_id[row_id]
        assert m["topic"] == topic
        assert m["key"] == key
        assert json.loads(m["value"]) == payload
        assert m["headers"]["event_type"] == "Happened"
        assert m["headers"]["aggregate_type"] == agg_type
        assert m["headers"]["aggregate_id"] == key
        for name, value in (headers or {}).items():
            assert m["headers"][name] == value


def test_bad_setting_exits_2_with_one_line(pg_dsn, table):
    env = cli_env(pg_dsn, table, OUTBOX_RELAY_RELAY__LEASE_SECONDS="ten")
    result = cli("run", env=env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "relay.lease_seconds" in lines[0]


def test_delivery_timeout_not_below_lease_is_refused(pg_dsn, table):
    env = cli_env(
        pg_dsn, table, OUTBOX_RELAY_RELAY__LEASE_SECONDS="10", OUTBOX_RELAY_KAFKA__DELIVERY_TIMEOUT_SECONDS="10"
    )
    result = cli("run", env=env)
    assert result.returncode == 2
    assert "delivery_timeout_seconds" in result.stderr and "Traceback" not in result.stderr


def test_table_name_with_semicolon_is_refused(pg_dsn):
    env = cli_env(pg_dsn, 'outbox"; DROP TABLE x; --')
    result = cli("migrate", env=env)
    assert result.returncode == 2
    assert "invalid table name" in result.stderr and "Traceback" not in result.stderr


def test_run_against_missing_table_says_migrate(pg_dsn, table, broker):
    env = cli_env(
        pg_dsn,
        table.split(".")[0] + ".nothing_here",
        broker.bootstrap_servers,
        OUTBOX_RELAY_METRICS__PORT="0",
        OUTBOX_RELAY_RELAY__STARTUP_TIMEOUT_SECONDS="1",
    )
    result = cli("run", env=env, timeout=60)
    assert result.returncode == 1
    assert "migrate" in result.stderr and "Traceback" not in result.stderr


def test_run_against_unreachable_broker_is_clear(pg_dsn, table):
    env = cli_env(
        pg_dsn,
        table,
        "127.0.0.1:1",
        OUTBOX_RELAY_METRICS__PORT="0",
        OUTBOX_RELAY_DATABASE__CONNECT_TIMEOUT_SECONDS="1",
        OUTBOX_RELAY_RELAY__STARTUP_TIMEOUT_SECONDS="1",
    )
    assert cli("migrate", env=env).returncode == 0
    result = cli("run", env=env, timeout=60)
    assert result.returncode == 1
    assert "Kafka" in result.stderr and "127.0.0.1:1" in result.stderr and "Traceback" not in result.stderr


def test_run_against_unreachable_database_hides_password(table):
    env = cli_env(
        "postgresql://app:s3cretpw@127.0.0.1:1/db",
        table,
        OUTBOX_RELAY_METRICS__PORT="0",
        OUTBOX_RELAY_DATABASE__CONNECT_TIMEOUT_SECONDS="1",
        OUTBOX_RELAY_RELAY__STARTUP_TIMEOUT_SECONDS="1",
    )
    result = cli("run", env=env, timeout=60)
    assert result.returncode == 1
    assert "cannot connect to the database" in result.stderr
    assert "s3cretpw" not in result.stderr + result.stdout and "Traceback" not in result.stderr


def test_sasl_password_never_printed(pg_dsn, table):
    secret = "kafka-s3cret-pw"
    # A validation error elsewhere in the kafka section...
    bad = cli(
        "run",
        env=cli_env(
            pg_dsn, table, OUTBOX_RELAY_KAFKA__SASL_PASSWORD=secret, OUTBOX_RELAY_KAFKA__SECURITY_PROTOCOL="bogus"
        ),
    )
    assert bad.returncode == 2 and "kafka.security_protocol" in bad.stderr
    # ...and a start-up failure against an unreachable SASL broker.
    unreachable = cli(
        "run",
        env=cli_env(
            pg_dsn,
            table,
            "127.0.0.1:1",
            OUTBOX_RELAY_METRICS__PORT="0",
            OUTBOX_RELAY_RELAY__STARTUP_TIMEOUT_SECONDS="2",
            OUTBOX_RELAY_KAFKA__SECURITY_PROTOCOL="sasl_plaintext",
            OUTBOX_RELAY_KAFKA__SASL_MECHANISM="PLAIN",
            OUTBOX_RELAY_KAFKA__SASL_USERNAME="relay",
            OUTBOX_RELAY_KAFKA__SASL_PASSWORD=secret,
            OUTBOX_RELAY_LOG__LEVEL="DEBUG",
        ),
        timeout=90,
    )
    assert unreachable.returncode in (1, 2)
    for result in (bad, unreachable):
        assert secret not in result.stdout + result.stderr
        assert "Traceback" not in result.stderr


def test_kafka_property_typo_is_a_config_error(pg_dsn, table, broker):
    env = cli_env(
        pg_dsn,
        table,
        broker.bootstrap_servers,
        OUTBOX_RELAY_METRICS__PORT="0",
        OUTBOX_RELAY_KAFKA__EXTRA='{"linger.msec": "5"}',
    )
    assert cli("migrate", env=env).returncode == 0
    result = cli("run", env=env, timeout=60)
    assert result.returncode == 2
    assert "linger.msec" in result.stderr and "Traceback" not in result.stderr


def test_usage_errors_are_one_line_exit_2(pg_dsn, table):
    for args in (("dead", "retry", "abc"), ("purge",), ("status", "--bogus"), ("bogus",)):
        result = cli(*args, env=cli_env(pg_dsn, table))
        assert result.returncode == 2, args
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("outbox-relay: error:"), (args, result.stderr)


def test_non_json_list_setting_names_its_variable(pg_dsn, table):
    result = cli("status", env=cli_env(pg_dsn, table, OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES="A,B"))
    assert result.returncode == 2
    assert "OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES must be JSON" in result.stderr
