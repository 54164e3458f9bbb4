"""``outbox-relay run`` as a real subprocess, its output in a file (a pipe could fill up)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.helpers.cli import ROOT


def relay_env(**settings: str) -> dict[str, str]:
    """The test process's environment without any OUTBOX_RELAY_* of its own, plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}
    env.update({"OUTBOX_RELAY_LOG__FORMAT": "json", "OUTBOX_RELAY_METRICS__ENABLED": "false"})
    env.update(settings)
    return env


class RelayProcess:
    def __init__(self, name: str, env: dict[str, str], log_dir: Path, *args: str, prefix: Sequence[str] = ()) -> None:
        """``prefix``: a command that runs the relay elsewhere (``ip netns exec NS``, ``faketime``)."""
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "outbox_relay.operator.cli", "run", *args],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self) -> list[dict[str, Any]]:
        found = []
        for line in self.output().splitlines():
            if line.startswith("{"):
                try:
                    found.append(json.loads(line))
                except ValueError:
                    pass
        return found

    def started(self) -> bool:
        return any(e.get("event") == "relay started" for e in self.events())

    def wait_started(self, timeout_seconds: float = 60) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode} at start:\n{self.output()[-3000:]}")
            if self.started():
                return
            time.sleep(0.05)
        raise AssertionError(f"{self.name} did not start within {timeout_seconds:.0f}s:\n{self.output()[-3000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_exit(self, timeout_seconds: float = 60) -> int:
        return self.proc.wait(timeout=timeout_seconds)

    def terminate(self, timeout_seconds: float = 30) -> int:
        """SIGTERM (graceful hand-off), then the exit code; SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
