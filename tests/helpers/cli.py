"""Test support for the command line: run the real CLI as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.db import DELETE_MODE

ROOT = Path(__file__).resolve().parent.parent.parent


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, input_text: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m outbox_relay.operator.cli ARGS`` with only the OUTBOX_RELAY_* variables given."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "outbox_relay.operator.cli", *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input_text,
    )


def cli_env(dsn: str, table: str, bootstrap: str = "127.0.0.1:1", **more: str) -> dict[str, str]:
    env = {
        "OUTBOX_RELAY_DATABASE__DSN": dsn,
        "OUTBOX_RELAY_DATABASE__TABLE": table,
        "OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
        "OUTBOX_RELAY_LOG__FORMAT": "json",
    }
    if DELETE_MODE:  # the suite's relay.on_done mode (tests/helpers/db.py: ON_DONE)
        env["OUTBOX_RELAY_RELAY__ON_DONE"] = "delete"
    env.update(more)
    return env
