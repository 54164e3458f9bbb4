"""Test support for the command line: run the real CLI as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
        input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m outbox_relay.cli ARGS`` with only the OUTBOX_RELAY_* variables given."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "outbox_relay.cli", *args], env=full_env, capture_output=True,
                          text=True, timeout=timeout, input=input_text)


def cli_env(dsn: str, table: str, bootstrap: str = "127.0.0.1:1", **more: str) -> dict[str, str]:
    env = {
        "OUTBOX_RELAY_DATABASE__DSN": dsn,
        "OUTBOX_RELAY_DATABASE__TABLE": table,
        "OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
        "OUTBOX_RELAY_LOG__FORMAT": "json",
    }
    env.update(more)
    return env
