"""Helpers of the operator-console tests: seed dead rows straight into a table, and
serve the console's real ASGI app over real HTTP (uvicorn in a thread)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from outbox_relay.config import Settings, load_settings
from tests.helpers.db import row_states as row_states  # re-exported: the console tests read row states here


def quoted(table: str) -> str:
    schema, name = table.split(".")
    return f'"{schema}"."{name}"'


def seed_dead(
    dsn: str,
    table: str,
    n: int,
    *,
    event_type: str = "PaymentCaptured",
    aggregate_type: str = "payment",
    aggregate_prefix: str = "pay-",
    aggregates: int = 10,
    last_error: str = "retries exhausted: UNKNOWN_TOPIC_OR_PART",
    payload: dict[str, Any] | None = None,
    attempts: int | None = None,
    age_seconds: float = 0.0,
    status: str = "dead",
) -> list[int]:
    """Insert n rows in one statement (status dead by default, attempts used up); their ids, ascending."""
    if attempts is None:
        attempts = 12 if status == "dead" else 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = [
            r[0]
            for r in conn.execute(
                f"INSERT INTO {quoted(table)} (aggregate_type, aggregate_id, event_type, payload, status, attempts,"
                " last_error, created_at)"
                " SELECT %(at)s, %(prefix)s || (g %% %(aggs)s), %(et)s, %(payload)s::jsonb, %(status)s, %(attempts)s,"
                "        %(err)s, now() - make_interval(secs => %(age)s)"
                " FROM generate_series(1, %(n)s) AS g RETURNING id",
                {
                    "at": aggregate_type,
                    "prefix": aggregate_prefix,
                    "aggs": aggregates,
                    "et": event_type,
                    "payload": json.dumps(payload or {"amount": 100}),
                    "status": status,
                    "attempts": attempts,
                    "err": last_error if status == "dead" else None,
                    "age": age_seconds,
                    "n": n,
                },
            ).fetchall()
        ]
    return sorted(ids)


def console_settings(dsn: str, table: str, *, token: str | None = None, **console: Any) -> Settings:
    section: dict[str, Any] = {"host": "127.0.0.1", "port": 0, **console}
    if token is not None:
        section["token"] = token
    return load_settings(
        None, database={"dsn": dsn, "table": table}, console=section, log={"level": "WARNING", "format": "json"}
    )


@contextmanager
def running_console(settings: Settings) -> Iterator[str]:
    """The console app served by uvicorn on a free loopback port; yields its base URL."""
    import uvicorn

    from outbox_relay.operator.console.app import Console
    from outbox_relay.operator.console.server import (
        make_console_store,
        make_source_console_store,
        uvicorn_config,
    )
    from outbox_relay.operator.console.sources import ConsoleSources
    from outbox_relay.sources import uses_sources

    # Several sources: served whole, each source's store opened on first use (as the
    # `outbox-relay console` command does without --source).
    store = None if uses_sources(settings) else make_console_store(settings)
    if store is not None:
        store.open()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # create_app's parts, so the test can close every store the console opened.
    console = Console(settings, ConsoleSources(settings, store=store, store_factory=make_source_console_store))
    server = uvicorn.Server(uvicorn_config(console.app()))  # configured as `outbox-relay console` does
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("console did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        console.close()  # the sources' stores (and the single store, which it holds)


@contextmanager
def console_process(dsn: str | None, table: str | None, **env: str) -> Iterator[tuple[str, list[str]]]:
    """The real `outbox-relay console --port 0` as a subprocess with JSON log lines;
    ``env`` adds OUTBOX_RELAY_* variables (``dsn``/``table`` None: no [database]).
    Yields its base URL and the list its stderr lines are collected in (complete once
    the block is left)."""
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")}
    if dsn is not None:  # None: the sources come from env (OUTBOX_RELAY_SOURCES__<NAME>__DSN ...)
        environ["OUTBOX_RELAY_DATABASE__DSN"] = dsn
    if table is not None:
        environ["OUTBOX_RELAY_DATABASE__TABLE"] = table
    environ.update({"OUTBOX_RELAY_LOG__FORMAT": "json", **env})
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox_relay.operator.cli", "console", "--port", "0"],
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    started = threading.Event()
    url: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if not started.is_set() and '"console listening"' in line:  # the start-up line names the url
                url.append(json.loads(line)["url"].rstrip("/"))
                started.set()
        started.set()  # ended without starting

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        started.wait(timeout=60)
        if not url:
            raise AssertionError("console did not start: " + "".join(lines))
        yield url[0], lines
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
