"""Run the console: open a store bounded by the console's statement timeout, build the
app, serve it with uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

import ipaddress
import socket

import structlog
import uvicorn
from starlette.types import ASGIApp

from ...config import Settings
from ...db.store import OutboxStore
from .app import create_app

log = structlog.get_logger("outbox_relay.console")


def make_console_store(settings: Settings, *, pool_size: int = 4) -> OutboxStore:
    return OutboxStore(
        settings.database.dsn.get_secret_value(),
        settings.database.table,
        pool_size=pool_size,
        connect_timeout_seconds=settings.database.connect_timeout_seconds,
        statement_timeout_ms=settings.console.statement_timeout_ms,  # bounds every console query
        application_name="outbox-relay-console",
        # The console holds no session (no LISTEN, transaction-scoped locks only), so a
        # transaction pooler serves it like the relay's own statements.
        transaction_pooler=settings.database.transaction_pooler,
        pool_max_idle_seconds=settings.database.pool_max_idle_seconds,
    )


def uvicorn_config(app: ASGIApp) -> uvicorn.Config:
    """How the console's app is served (the tests serve it the same way). uvicorn's own
    proxy-header handling stays off: the app applies console.forwarded_allow_ips itself,
    so uvicorn's FORWARDED_ALLOW_IPS environment default (trust 127.0.0.1) cannot make
    a local process's X-Forwarded-* headers count."""
    return uvicorn.Config(
        app, log_level="warning", access_log=False, server_header=False, proxy_headers=False, lifespan="off"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_source_console_store(settings: Settings) -> OutboxStore:
    # One of many sources: a small pool each (a console serves a few people, not a load).
    return make_console_store(settings, pool_size=2)


def serve(settings: Settings, *, source_name: str | None = None, all_sources: bool = False) -> None:
    """Serve one source (``settings`` are that source's, ``source_name`` its name) or,
    with ``all_sources``, every source of ``[sources]``/``[discovery]`` (each opened on
    first use, a source whose database is down shown as such rather than failing the
    console's start)."""
    c = settings.console
    store = None if all_sources else make_console_store(settings)
    try:
        if store is not None:
            store.open()
            store.require_table()
        if c.token is None and not _is_loopback(c.host):
            log.warning(
                "console without console.token on a non-loopback address: read-only, and it answers "
                "only requests addressed to a loopback name or to this address; set console.token "
                "to use it from elsewhere",
                host=c.host,
            )
        elif (
            c.token is not None and not _is_loopback(c.host) and not c.forwarded_allow_ips and c.cookie_secure == "auto"
        ):
            log.warning(
                "console on a non-loopback address serves plain http: the token and the session cookie "
                "cross the network unencrypted unless a TLS-terminating proxy is in front; list it in "
                "console.forwarded_allow_ips (then the cookie is Secure) or set console.cookie_secure "
                '= "always"',
                host=c.host,
            )
        # Bind first, so the port (also when 0 = any free one) is known before serving.
        family = socket.AF_INET6 if ":" in c.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((c.host, c.port))
        except OSError as exc:
            sock.close()
            from ...errors import ConfigError

            raise ConfigError(f"console.port: cannot listen on {c.host}:{c.port}: {exc.strerror}") from None
        # Listening before the start-up line: a client that reads the url from it and
        # connects at once is queued until uvicorn accepts, never refused.
        sock.listen(2048)
        port = sock.getsockname()[1]
        shown = f"[{c.host}]" if ":" in c.host else c.host
        mode = "read-only (no console.token)" if c.token is None else "token required"
        # Scripts and tests read the url from this line (also when port 0 chose one).
        log.info("console listening", url=f"http://{shown}:{port}/", mode=mode)
        app = create_app(settings, store, source_name=source_name, store_factory=make_source_console_store)
        uvicorn.Server(uvicorn_config(app)).run(sockets=[sock])
    finally:
        if store is not None:
            store.close()
