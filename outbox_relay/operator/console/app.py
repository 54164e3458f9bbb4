"""The operator console: server-rendered pages and the JSON API behind them.

Pages: overview, dead rows (filters, pagination by id, counts per event type and
error), one row, one aggregate, the audit log, plus a preview -> confirm flow for
every retry/skip and for a replay of delivered rows (replay_pages.py), the operator
pauses (pause_pages.py). API:
``GET /api/sources``, ``GET /api/status``, ``GET /api/dead``, ``GET /api/dead/{id}``,
``POST /api/dead/retry|skip``, ``POST /api/replay``, ``GET|POST /api/pauses``,
``POST /api/pauses/{id}/resume``, ``GET /api/audit``. A console
of several sources (sources.py) lists them on its overview and every other page and
API call names one with ``?source=NAME``, carried by every link and form.

Every database call goes through ``OutboxStore`` (bounded by the console's
statement timeout and page size) in Starlette's thread pool; everything rendered is
escaped by Jinja2's autoescape (payloads, errors and ids are attacker-controlled
text), and a strict Content-Security-Policy allows no script at all.

The handlers live by concern: base.py (state and request helpers they share),
security.py (who is asking, wrong-token lockout, origins, login/logout), pages.py (HTML
pages), api.py (JSON API); this module assembles them, with the middleware, into the
ASGI app.
"""

from __future__ import annotations

import datetime as dt
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

from jinja2 import Environment, FileSystemLoader, StrictUndefined, pass_context
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from ...config import Settings
from ...db.store import Count, OutboxStore
from ...errors import DatabaseUnavailable, OutboxRelayError, SchemaMissing
from .api import ConsoleApi
from .auth import LoginThrottle, Principal, Sessions
from .base import BadRequest, NoSuchSource
from .pages import ConsolePages
from .pause_pages import PausePages
from .replay_pages import ReplayPages
from .source_list import SourceBoard
from .sources import ConsoleSources, StoreFactory

HERE = Path(__file__).resolve().parent
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
SECURITY_HEADERS = [
    # No script may run at all: the console needs none, and a payload that slipped
    # past escaping still could not execute.
    (
        b"content-security-policy",
        b"default-src 'none'; style-src 'self'; img-src 'self'; "
        b"form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    # same-origin, not no-referrer: with no-referrer browsers send "Origin: null" on
    # form posts, and the origin check of actions needs the real one.
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]


Handler = Callable[[Request, Principal], Awaitable[Response]]  # a page or API call of a known caller
Endpoint = Callable[[Request], Awaitable[Response]]


def _utc(value: dt.datetime | None) -> str:
    if value is None:
        return ""
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _age(seconds: float | None) -> str:
    """An age for people: 42 s, 3 min 5 s, 2 h 10 min, 3 d 4 h."""
    if seconds is None:
        return "?"
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    if whole < 86_400:
        return f"{whole // 3600} h {whole % 3600 // 60} min"
    return f"{whole // 86_400} d {whole % 86_400 // 3600} h"


def _num(value: int | Count | None) -> str:
    if value is None:
        return "?"
    if isinstance(value, Count):
        return f"{value.n:,}" if value.exact else f"\u2265 {value.n:,}"
    return f"{value:,}"


@pass_context
def _query(context: Any, **params: Any) -> str:
    """A link's query string; it names the page's source when the console serves several."""
    source = context.get("source")
    if source:
        params = {"source": source, **params}
    return urllib.parse.urlencode([(k, v) for k, v in params.items() if v not in (None, "", [])], doseq=True)


class _Guard:
    """Pure ASGI middleware: security headers on every response and, for a console
    without a token, only loopback Host names (so a web page cannot read the open
    console through DNS rebinding)."""

    def __init__(self, app: ASGIApp, *, check_host: bool, bind_host: str) -> None:
        self.app = app
        self.check_host = check_host
        self.allowed = LOOPBACK_HOSTS | ({bind_host} if bind_host not in ("0.0.0.0", "::", "") else set())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.check_host:
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name not in self.allowed:
                response = Response(
                    "unexpected Host header: a console without console.token answers only loopback names\n",
                    status_code=400,
                    media_type="text/plain",
                )
                await response(scope, receive, send)
                return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + SECURITY_HEADERS
            await send(message)

        await self.app(scope, receive, send_with_headers)


class Console(ConsolePages, ReplayPages, PausePages, ConsoleApi):
    """One console process: settings, a store, sessions, templates, routes."""

    def __init__(self, settings: Settings, sources: ConsoleSources) -> None:
        self.settings = settings
        self.sources = sources
        self.board = SourceBoard(
            sources.names, self._read_source, refresh_seconds=settings.console.sources_refresh_seconds
        )
        token = settings.console.token.get_secret_value() if settings.console.token else None
        self.sessions = Sessions(token or None, lifetime_seconds=settings.console.session_hours * 3600)
        self.throttle = LoginThrottle(settings.console.login_max_failures, settings.console.login_lockout_seconds)
        # Counting never takes longer than one console statement may.
        self.count_budget_ms = min(settings.console.statement_timeout_ms, settings.metrics.exact_count_timeout_ms)
        self.env = Environment(
            loader=FileSystemLoader(str(HERE / "templates")),
            autoescape=True,
            undefined=StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters["utc"] = _utc
        self.env.filters["num"] = _num
        self.env.filters["age"] = _age
        self.env.filters["quote"] = lambda text: urllib.parse.quote(str(text), safe="")
        self.env.globals["qs"] = _query

    def close(self) -> None:
        """Stop reading figures and close every source's store."""
        self.board.close()
        self.sources.close()

    # --- plumbing ------------------------------------------------------------------------
    def app(self) -> ASGIApp:
        page = self._page
        api = self._api
        routes = [
            Route("/", page(self.overview)),
            Route("/dead", page(self.dead_rows)),
            Route("/dead/preview", page(self.dead_preview)),
            Route("/dead/apply", page(self.dead_apply), methods=["POST"]),
            Route("/replay", page(self.replay_page)),
            Route("/replay/apply", page(self.replay_apply), methods=["POST"]),
            Route("/pauses", page(self.pauses_page)),
            Route("/pauses/apply", page(self.pause_apply), methods=["POST"]),
            Route("/pauses/{pause_id:int}/resume", page(self.resume_apply), methods=["POST"]),
            Route("/rows/{row_id:int}", page(self.row_page)),
            Route("/aggregates/{aggregate_id:path}", page(self.aggregate_page)),
            Route("/audit", page(self.audit_page)),
            Route("/login", self.login_page, methods=["GET"]),
            Route("/login", self.login_submit, methods=["POST"]),
            Route("/logout", page(self.logout), methods=["POST"]),
            Route("/api/sources", api(self.api_sources)),
            Route("/api/status", api(self.api_status)),
            Route("/api/dead", api(self.api_dead)),
            Route("/api/dead/{row_id:int}", api(self.api_dead_row)),
            Route("/api/dead/retry", api(self.api_retry), methods=["POST"]),
            Route("/api/dead/skip", api(self.api_skip), methods=["POST"]),
            Route("/api/replay", api(self.api_replay), methods=["POST"]),
            Route("/api/pauses", api(self.api_pauses)),
            Route("/api/pauses", api(self.api_pause), methods=["POST"]),
            Route("/api/pauses/{pause_id:int}/resume", api(self.api_resume), methods=["POST"]),
            Route("/api/audit", api(self.api_audit)),
            Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
        ]
        starlette = Starlette(routes=routes)
        guarded: ASGIApp = _Guard(starlette, check_host=self.sessions.read_only, bind_host=self.settings.console.host)
        proxies = self.settings.console.forwarded_allow_ips
        if not proxies:
            return guarded
        # Outermost, so everything behind it (the Secure flag, the login throttle) sees
        # the scheme and client address a trusted proxy reported; anyone else's
        # X-Forwarded-* headers are ignored.
        # (uvicorn types its middleware with its own, narrower ASGI types: same protocol.)
        return cast(ASGIApp, ProxyHeadersMiddleware(cast(Any, guarded), trusted_hosts=list(proxies)))

    def _page(self, handler: Handler) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            who = self._principal(request)
            if isinstance(who, Response):
                return who
            if who is None:
                target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
                return RedirectResponse("/login?" + urllib.parse.urlencode({"next": target}), status_code=303)
            try:
                return await handler(request, who)
            except NoSuchSource as exc:
                return self.render(request, who, "error.html", {"title": "No such source", "message": str(exc)}, 404)
            except BadRequest as exc:
                return self.render(request, who, "error.html", {"title": "Not possible", "message": str(exc)}, 400)
            except OutboxRelayError as exc:
                code = 503 if isinstance(exc, (DatabaseUnavailable, SchemaMissing)) else 500
                return self.render(request, who, "error.html", {"title": "Database problem", "message": str(exc)}, code)

        return endpoint

    def _api(self, handler: Handler) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            who = self._principal(request)
            if isinstance(who, Response):
                return who
            if who is None:
                return self._json_error(401, "authentication required: Authorization: Bearer <console.token>")
            try:
                return await handler(request, who)
            except NoSuchSource as exc:
                return self._json_error(404, str(exc))
            except BadRequest as exc:
                return self._json_error(400, str(exc))
            except OutboxRelayError as exc:
                code = 503 if isinstance(exc, (DatabaseUnavailable, SchemaMissing)) else 500
                return self._json_error(code, str(exc))

        return endpoint


def create_app(
    settings: Settings,
    store: OutboxStore | None = None,
    *,
    source_name: str | None = None,
    store_factory: StoreFactory | None = None,
) -> ASGIApp:
    """The console's ASGI application: on one opened ``store`` (the source
    ``source_name``, ``default`` unless named), or, without a store, on every source
    of ``[sources]``/``[discovery]``, each opened by ``store_factory`` on first use."""
    return Console(settings, ConsoleSources(settings, store=store, name=source_name, store_factory=store_factory)).app()
