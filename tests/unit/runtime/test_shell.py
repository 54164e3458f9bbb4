"""The process shell both runtimes share (runtime/shell.py): what used to differ
between the one-source and the many-source process is now the same for both."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from structlog.testing import capture_logs

from outbox_relay.config import Settings, load_settings
from outbox_relay.errors import ConfigError
from outbox_relay.model import Message, Outcome
from outbox_relay.observability.tracing import Tracing
from outbox_relay.publishers.base import Publisher
from outbox_relay.runtime import shell
from outbox_relay.runtime.multi import MultiRelay
from outbox_relay.runtime.relay import Relay

# Nothing listens on port 1: the database is never reached by these tests' relays.
UNREACHABLE_DSN = "postgresql://relay@127.0.0.1:1/outbox?connect_timeout=1"


class RecordingTarget(Publisher):
    """A publisher that delivers everything and records what the shell asks of it."""

    def __init__(self, held_back: str | None = None) -> None:
        self.closed = 0
        self._held_back = held_back

    def publish_batch(
        self, messages: Sequence[Message], *, timeout_seconds: float, cancel: threading.Event | None = None
    ) -> list[Outcome]:
        return [None] * len(messages)

    def held_back(self) -> str | None:
        return self._held_back

    def close(self) -> None:
        self.closed += 1


class ProcessExited(Exception):
    pass


class RecordingTracing(Tracing):
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def busy_port() -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def settings_for(*, metrics: dict[str, Any], sources: bool) -> Settings:
    sections: dict[str, Any] = {
        "database": {"dsn": UNREACHABLE_DSN, "connect_timeout_seconds": 1},
        "metrics": metrics,
        "relay": {"workers": 1, "shutdown_timeout_seconds": 1},
    }
    if sources:
        sections["sources"] = {"a": {"dsn": UNREACHABLE_DSN}}
    return load_settings(**sections)


@pytest.mark.parametrize("sources", [False, True], ids=["database", "sources"])
def test_a_start_that_fails_closes_the_publisher_and_tracing(busy_port: int, sources: bool) -> None:
    settings = settings_for(metrics={"enabled": True, "host": "127.0.0.1", "port": busy_port}, sources=sources)
    target, tracing = RecordingTarget(), RecordingTracing()
    process: Relay | MultiRelay
    if sources:
        process = MultiRelay(settings, publisher=target, tracing=tracing)
    else:
        process = Relay(settings, publisher=target, tracing=tracing)
    with pytest.raises(ConfigError, match=f"metrics.port {busy_port}: cannot listen"):
        process.start()
    assert target.closed >= 1
    assert tracing.closed >= 1


def test_readiness_of_many_sources_asks_whether_the_publisher_holds_back() -> None:
    settings = settings_for(metrics={"enabled": False}, sources=True)
    target = RecordingTarget(held_back="the broker refuses the topic's writes")
    relay = MultiRelay(settings, publisher=target, tracing=RecordingTracing())
    relay.start()
    try:
        assert relay.readiness() == (False, "not ready: the broker refuses the topic's writes")
    finally:
        relay.stop(timeout_seconds=1)
    assert target.closed >= 1


@pytest.mark.parametrize("process", [Relay, MultiRelay])
def test_a_second_signal_is_logged_before_the_process_exits(
    monkeypatch: pytest.MonkeyPatch, process: type[Relay] | type[MultiRelay]
) -> None:
    settings = settings_for(metrics={"enabled": False}, sources=process is MultiRelay)
    relay = process(settings, publisher=RecordingTarget(), tracing=RecordingTracing())
    handlers: dict[int, Any] = {}
    monkeypatch.setattr(shell.signal, "signal", lambda signum, handler: handlers.setdefault(signum, handler))
    exits: list[int] = []

    def exit_now(code: int) -> None:
        exits.append(code)
        raise ProcessExited  # os._exit never returns

    monkeypatch.setattr(shell.os, "_exit", exit_now)
    stops: list[float | None] = []
    monkeypatch.setattr(relay, "stop", lambda timeout_seconds=None: stops.append(timeout_seconds))
    relay.install_signal_handlers()
    with capture_logs() as logs:
        handlers[shell.signal.SIGTERM](shell.signal.SIGTERM, None)
        with pytest.raises(ProcessExited):
            handlers[shell.signal.SIGTERM](shell.signal.SIGTERM, None)
    events = [(entry["event"], entry.get("signal")) for entry in logs]
    assert events == [
        ("signal received: graceful shutdown", "SIGTERM"),
        ("second signal: exiting at once", "SIGTERM"),
    ]
    assert exits == [128 + shell.signal.SIGTERM]
