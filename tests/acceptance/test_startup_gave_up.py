"""`outbox-relay run` with its database and its broker both down: once
relay.startup_timeout_seconds runs out it exits 1 with one line naming both (one
source, and several sources)."""

from __future__ import annotations

import pytest

from tests.helpers.cli import cli, cli_env

pytestmark = pytest.mark.first_pass_only

DOWN_DSN = "postgresql://app:s3cretpw@127.0.0.1:1/db"


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("outbox-relay: error: ")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_run_names_every_dependency_that_is_down():
    env = cli_env(
        DOWN_DSN,
        "outbox",
        "127.0.0.1:1",
        OUTBOX_RELAY_METRICS__PORT="0",
        OUTBOX_RELAY_DATABASE__CONNECT_TIMEOUT_SECONDS="1",
        OUTBOX_RELAY_RELAY__STARTUP_TIMEOUT_SECONDS="2",
    )
    result = cli("run", env=env, timeout=90)
    assert result.returncode == 1, result.stderr
    line = _error_line(result.stderr)
    assert "database and broker still down" in line
    assert "database: cannot connect to the database" in line
    assert "broker: cannot reach the Kafka cluster at 127.0.0.1:1" in line
    assert "s3cretpw" not in result.stderr + result.stdout and "Traceback" not in result.stderr


def test_run_with_sources_names_every_dependency_that_is_down():
    env = cli_env(
        DOWN_DSN,
        "outbox",
        "127.0.0.1:1",
        OUTBOX_RELAY_METRICS__PORT="0",
        OUTBOX_RELAY_DATABASE__CONNECT_TIMEOUT_SECONDS="1",
        OUTBOX_RELAY_RELAY__STARTUP_TIMEOUT_SECONDS="3",
        OUTBOX_RELAY_SOURCES__ORDERS__DSN=DOWN_DSN,
        OUTBOX_RELAY_SOURCES__BILLING__DSN=DOWN_DSN.replace(":1/", ":2/"),
    )
    result = cli("run", env=env, timeout=90)
    assert result.returncode == 1, result.stderr
    line = _error_line(result.stderr)
    assert "database and broker still down" in line
    assert "database: no source became ready (billing: " in line and "; orders: " in line
    assert "broker: cannot reach the Kafka cluster at 127.0.0.1:1" in line
    assert "s3cretpw" not in result.stderr + result.stdout and "Traceback" not in result.stderr
