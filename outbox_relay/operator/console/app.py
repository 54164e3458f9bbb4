"""The operator console: server-rendered pages and the JSON API behind them.

Pages: overview, dead rows (filters, pagination by id, counts per event type and
error), one row, one aggregate, the audit log, plus a preview -> confirm flow for
every retry/skip. API: ``GET /api/status``, ``GET /api/dead``, ``GET /api/dead/{id}``,
``POST /api/dead/retry|skip``, ``GET /api/audit`` (names fixed by the design's
contract additions).

Every database call goes through ``OutboxStore`` (bounded by the console's
statement timeout and page size) in Starlette's thread pool; everything rendered is
escaped by Jinja2's autoescape (payloads, errors and ids are attacker-controlled
text), and a strict Content-Security-Policy allows no script at all.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, cast

import structlog
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from ...config import Settings
from ...core.filters import FILTER_NAMES, DeadFilter, parse_filter
from ...core.ordering import OrderingRule
from ...db.store import STATUSES, Count, OutboxStore
from ...db.vacuum_health import HorizonClock
from ...errors import DatabaseUnavailable, OutboxRelayError, SchemaMissing
from ..operations import (
    API_WORDING,
    FORM_WORDING,
    Action,
    OperatorRuleError,
    blocking_head,
    change_dead,
    check_dead_change,
    diagnose_aggregate,
    jsonable,
    preview_dead,
    row_states,
    selector_description,
)
from .auth import (
    COOKIE_NAME,
    LoginThrottle,
    Principal,
    Sessions,
    clean_user,
    client_key,
    csrf_ok,
    retry_after_header,
)

log = structlog.get_logger("outbox_relay.console")

HERE = Path(__file__).resolve().parent
MAX_BODY_BYTES = 1_000_000
MAX_IDS = 100_000
API_SELECTIONS = ("ids", "filter", "all")  # the fields of a retry/skip body that select rows
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


class BadRequest(Exception):
    """Input the console refuses; the message is shown to the caller (400)."""


def _utc(value: dt.datetime | None) -> str:
    if value is None:
        return ""
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _num(value: int | Count | None) -> str:
    if value is None:
        return "?"
    if isinstance(value, Count):
        return f"{value.n:,}" if value.exact else f"\u2265 {value.n:,}"
    return f"{value:,}"


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


class Console:
    """One console process: settings, a store, sessions, templates, routes."""

    def __init__(self, settings: Settings, store: OutboxStore) -> None:
        self.settings = settings
        self.store = store
        token = settings.console.token.get_secret_value() if settings.console.token else None
        self.sessions = Sessions(token or None, lifetime_seconds=settings.console.session_hours * 3600)
        self.throttle = LoginThrottle(settings.console.login_max_failures, settings.console.login_lockout_seconds)
        self.ordered_types = list(settings.relay.ordered_event_types)
        self.ordering = OrderingRule.of(self.ordered_types)
        # Counting never takes longer than one console statement may.
        self.count_budget_ms = min(settings.console.statement_timeout_ms, settings.metrics.exact_count_timeout_ms)
        # A slot records no time: the console counts from when it first saw one (a lower bound).
        self.horizon_clock = HorizonClock()
        self.env = Environment(
            loader=FileSystemLoader(str(HERE / "templates")),
            autoescape=True,
            undefined=StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters["utc"] = _utc
        self.env.filters["num"] = _num
        self.env.filters["quote"] = lambda text: urllib.parse.quote(str(text), safe="")
        self.env.globals["qs"] = lambda **kw: urllib.parse.urlencode(
            [(k, v) for k, v in kw.items() if v not in (None, "", [])], doseq=True
        )

    # --- plumbing ------------------------------------------------------------------------
    def app(self) -> ASGIApp:
        page = self._page
        api = self._api
        routes = [
            Route("/", page(self.overview)),
            Route("/dead", page(self.dead_rows)),
            Route("/dead/preview", page(self.dead_preview)),
            Route("/dead/apply", page(self.dead_apply), methods=["POST"]),
            Route("/rows/{row_id:int}", page(self.row_page)),
            Route("/aggregates/{aggregate_id:path}", page(self.aggregate_page)),
            Route("/audit", page(self.audit_page)),
            Route("/login", self.login_page, methods=["GET"]),
            Route("/login", self.login_submit, methods=["POST"]),
            Route("/logout", page(self.logout), methods=["POST"]),
            Route("/api/status", api(self.api_status)),
            Route("/api/dead", api(self.api_dead)),
            Route("/api/dead/{row_id:int}", api(self.api_dead_row)),
            Route("/api/dead/retry", api(self.api_retry), methods=["POST"]),
            Route("/api/dead/skip", api(self.api_skip), methods=["POST"]),
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

    def _principal(self, request: Request) -> Principal | Response | None:
        """The caller, a rejection (401/403), or None: not logged in."""
        if self.sessions.read_only:
            return Principal(user="anonymous", source="read-only", can_act=False)
        auth = request.headers.get("authorization")
        if auth is not None:
            scheme, _, value = auth.partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                return self._json_error(401, "use Authorization: Bearer <console.token>")
            client = self._client(request)
            wait = self._locked_out(client, via="bearer")
            if wait is not None:
                return self._json_error(
                    429, "too many wrong tokens from your address: try again later", retry_after=wait
                )
            if not self.sessions.token_matches(value.strip()):
                self._wrong_token(client, via="bearer", user=clean_user(request.headers.get("x-outbox-relay-user", "")))
                return self._json_error(403, "wrong token")
            user = clean_user(request.headers.get("x-outbox-relay-user", "")) or "api"
            return Principal(user=user, source="api", can_act=True)
        session = self.sessions.get(request.cookies.get(COOKIE_NAME))
        if session is not None:
            return Principal(user=session.user, source="console", can_act=True, csrf_token=session.csrf_token)
        return None

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
            except BadRequest as exc:
                return self._json_error(400, str(exc))
            except OutboxRelayError as exc:
                code = 503 if isinstance(exc, (DatabaseUnavailable, SchemaMissing)) else 500
                return self._json_error(code, str(exc))

        return endpoint

    @staticmethod
    def _json_error(code: int, message: str, *, retry_after: float | None = None) -> JSONResponse:
        headers = {"WWW-Authenticate": 'Bearer realm="outbox-relay console"'} if code == 401 else {}
        if retry_after is not None:
            headers["Retry-After"] = retry_after_header(retry_after)
        return JSONResponse({"error": message}, status_code=code, headers=headers or None)

    # --- wrong tokens --------------------------------------------------------------------
    @staticmethod
    def _client(request: Request) -> tuple[str, str]:
        """(the client's address, what the throttle counts per). Behind a proxy listed in
        console.forwarded_allow_ips the address is the one the proxy reported."""
        host = request.client.host if request.client else ""
        return host or "unknown", client_key(host)

    def _locked_out(self, client: tuple[str, str], *, via: str) -> float | None:
        """Seconds the client must still wait before its next token is checked, or None."""
        refused = self.throttle.retry_after(client[1])
        if refused is None:
            return None
        wait, first = refused
        if first:  # one line per lockout: refused attempts are not counted or logged one by one
            log.warning(
                "console login refused: locked out after wrong tokens",
                client=client[0],
                client_key=client[1],
                via=via,
                retry_after_seconds=math.ceil(wait),
            )
        return wait

    def _wrong_token(self, client: tuple[str, str], *, via: str, user: str) -> None:
        """Count and log a wrong token (never the token itself)."""
        failure = self.throttle.failed(client[1])
        log.warning(
            "console login failed: wrong token",
            client=client[0],
            client_key=client[1],
            via=via,
            user=user or None,
            failures=failure.failures,
            locked_out_seconds=round(failure.locked_for_seconds, 3) or None,
        )

    def render(
        self, request: Request, who: Principal, template: str, context: Mapping[str, Any], status_code: int = 200
    ) -> HTMLResponse:
        html = self.env.get_template(template).render(
            table=self.settings.database.table,
            who=who,
            read_only=self.sessions.read_only,
            path=request.url.path,
            **context,
        )
        return HTMLResponse(html, status_code=status_code)

    @staticmethod
    def _origin_refusal(request: Request) -> str | None:
        """An Origin header, when the browser sends one, must be this console: why not, or None."""
        origin = request.headers.get("origin")
        if origin is None:  # not a browser, or a same-origin GET-style navigation
            return None
        host = request.headers.get("host", "")
        if urllib.parse.urlsplit(origin).netloc == host:  # "null" never matches
            return None
        return (
            f"the request comes from {origin!r}, not from this console (Host: {host!r}); behind a reverse "
            "proxy, have it pass on the Host the browser used (nginx: proxy_set_header Host $host)"
        )

    async def _form(self, request: Request) -> dict[str, list[str]]:
        body = await self._body(request)
        try:
            return urllib.parse.parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=MAX_IDS + 50)
        except (UnicodeDecodeError, ValueError) as exc:
            raise BadRequest(f"unreadable form: {exc}") from None

    @staticmethod
    async def _body(request: Request) -> bytes:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise BadRequest(f"request body larger than {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _filter(self, values: Mapping[str, Any]) -> DeadFilter:
        try:
            return parse_filter(values, self.store.database_now)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    def _page_size(self, raw: str | None) -> int:
        if not raw:
            return self.settings.console.page_size
        try:
            size = int(raw)
        except ValueError:
            raise BadRequest(f"limit: {raw!r} is not a whole number") from None
        return max(1, min(size, 500))

    @staticmethod
    def _int_param(raw: str | None, name: str) -> int | None:
        if raw in (None, ""):
            return None
        try:
            return int(raw)
        except ValueError:
            raise BadRequest(f"{name}: {raw!r} is not a whole number") from None

    # --- pages ---------------------------------------------------------------------------
    async def overview(self, request: Request, who: Principal) -> Response:
        data = await run_in_threadpool(self._status_data)
        return self.render(request, who, "overview.html", data)

    def _status_data(self) -> dict[str, Any]:
        s = self.settings
        stats = self.store.stats(
            ordered_types=self.ordered_types,
            include_depth=False,
            count_cap=s.metrics.exact_count_limit,
            timeout_ms=s.console.statement_timeout_ms,
        )
        depth = self.store.exact_depth(budget_ms=self.count_budget_ms, first_upto=s.metrics.exact_count_limit)
        # Done rows have no index: the rate reads the table, so it gets a short timeout
        # (and the page says so when that runs out) rather than slowing every overview.
        buckets = self.store.published_per_bucket(timeout_ms=min(1000, self.count_budget_ms))
        horizon = self.store.xmin_horizon(timeout_ms=s.console.statement_timeout_ms)
        self.horizon_clock.apply(horizon.holders)
        vacuum = self.store.vacuum_figures(timeout_ms=s.console.statement_timeout_ms)
        return {
            "depth": depth,
            "stats": stats,
            "buckets": buckets,
            "horizon": horizon,
            "vacuum": vacuum,
            "horizon_warn_seconds": s.metrics.xmin_horizon_warn_seconds,
            "published_last_hour": sum(buckets) if buckets is not None else None,
            "ordered": bool(self.ordered_types),
            "statuses": STATUSES,
        }

    async def dead_rows(self, request: Request, who: Principal) -> Response:
        params = request.query_params
        values = {name: params.get(name) for name in FILTER_NAMES if name != "limit"}
        page_size = self._page_size(params.get("limit"))
        after_id = self._int_param(params.get("after"), "after") or 0

        def load() -> dict[str, Any]:
            selector = self._filter(values)
            rows = self.store.dead_page(selector, after_id=after_id, limit=page_size)
            matched = self.store.dead_count(selector, budget_ms=self.count_budget_ms)
            summary = self.store.dead_summary(selector, timeout_ms=self.count_budget_ms) if matched.n else None
            return {"selector": selector, "rows": rows, "matched": matched, "summary": summary}

        data = await run_in_threadpool(load)
        filters = {k: v for k, v in values.items() if v}
        rows = data["rows"]
        next_after = rows[-1]["id"] if len(rows) == page_size else None
        return self.render(
            request,
            who,
            "dead.html",
            dict(
                data,
                filters=filters,
                page_size=page_size,
                after_id=after_id,
                next_after=next_after,
                has_conditions=data["selector"].has_conditions(),
            ),
        )

    def _selection(self, values: Mapping[str, list[str]]) -> tuple[str, DeadFilter]:
        """scope=ids (id=…), scope=filter (filter fields) or scope=all -> a selector."""
        scope = (values.get("scope") or [""])[0]
        if scope == "ids":
            raw_ids = values.get("id") or []
            if not raw_ids:
                raise BadRequest("select at least one row")
            try:
                ids = tuple(dict.fromkeys(int(i) for i in raw_ids))
            except ValueError:
                raise BadRequest("row ids must be whole numbers") from None
            return scope, DeadFilter(ids=ids)
        if scope in ("filter", "all"):
            selector = self._filter({name: (values.get(name) or [""])[0] for name in FILTER_NAMES})
            if scope == "filter" and not selector.has_conditions():
                raise BadRequest("the filter is empty: use scope=all to mean every dead row")
            if scope == "all" and selector.has_conditions():
                raise BadRequest("scope=all takes no filter")
            return scope, selector
        raise BadRequest("scope must be ids, filter or all")

    @staticmethod
    def _action(raw: str | None) -> Action:
        if raw == "retry":
            return "retry"
        if raw == "skip":
            return "skip"
        raise BadRequest("action must be retry or skip")

    async def dead_preview(self, request: Request, who: Principal) -> Response:
        values = {k: request.query_params.getlist(k) for k in request.query_params}
        action = self._action((values.get("action") or [""])[0])
        return await self._render_preview(request, who, action, values, error=None, status_code=200)

    async def _render_preview(
        self,
        request: Request,
        who: Principal,
        action: Action,
        values: Mapping[str, list[str]],
        *,
        error: str | None,
        status_code: int,
    ) -> Response:
        def load() -> dict[str, Any]:
            scope, selector = self._selection(values)
            preview = preview_dead(self.store, selector, budget_ms=self.count_budget_ms)
            not_dead: dict[int, str] = {}
            if selector.ids is not None:
                found = self.store.statuses(list(selector.ids))
                not_dead = {i: found.get(i, "no such row") for i in selector.ids if found.get(i) != "dead"}
            return {"scope": scope, "selector": selector, "preview": preview, "not_dead": not_dead}

        data = await run_in_threadpool(load)
        selector: DeadFilter = data["selector"]
        hidden: list[tuple[str, str]] = [("action", action), ("scope", data["scope"])]
        hidden += [("id", str(i)) for i in selector.ids or ()]
        hidden += [(k, str(v)) for k, v in selector.describe().items()]  # absolute times, not "2h"
        return self.render(
            request,
            who,
            "preview.html",
            dict(
                data,
                action=action,
                hidden=hidden,
                error=error,
                described=selector_description(selector),
                reason=(values.get("reason") or [""])[0],
            ),
            status_code,
        )

    async def dead_apply(self, request: Request, who: Principal) -> Response:
        values = await self._form(request)
        action = self._action((values.get("action") or [""])[0])
        if not who.can_act:
            raise BadRequest("the console is read-only: set console.token to enable retry and skip")
        refusal = self._origin_refusal(request)
        if refusal is None and not csrf_ok(who, (values.get("csrf_token") or [""])[0]):
            refusal = (
                "this form did not come from this console session (missing or wrong CSRF token); "
                "reload the page and try again"
            )
        if refusal is not None:
            return self.render(request, who, "error.html", {"title": "Refused", "message": refusal}, 403)
        scope = (values.get("scope") or [""])[0]
        try:
            reason = check_dead_change(
                action,
                ids=scope == "ids",
                all_rows=scope == "all",
                filtered=scope == "filter",
                reason=(values.get("reason") or [""])[0],
                dry_run=False,
                wording=FORM_WORDING,
            )
        except OperatorRuleError as exc:
            return await self._render_preview(request, who, action, values, error=str(exc), status_code=400)

        def apply() -> int | None:
            _scope, selector = self._selection(values)
            result = change_dead(
                self.store,
                action,
                selector,
                actor=who.user,
                source=who.source,
                reason=reason,
                chunk_size=self.settings.console.chunk_size,
                budget_ms=self.count_budget_ms,
            )
            return result.audit_id

        audit_id = await run_in_threadpool(apply)
        return RedirectResponse(f"/audit?done={audit_id}", status_code=303)

    async def row_page(self, request: Request, who: Principal) -> Response:
        row_id = int(request.path_params["row_id"])
        row = await run_in_threadpool(self.store.row_detail, row_id)
        if row is None:
            return self.render(
                request,
                who,
                "error.html",
                {"title": "No such row", "message": f"row {row_id} does not exist (purged?)"},
                404,
            )
        return self.render(request, who, "row.html", {"row": row})

    async def aggregate_page(self, request: Request, who: Principal) -> Response:
        aggregate_id = str(request.path_params["aggregate_id"])
        found, total = await run_in_threadpool(
            self.store.aggregate_rows, aggregate_id, limit=self.settings.console.page_size * 4
        )
        verdict = diagnose_aggregate(found, self.ordering, max_attempts=self.settings.relay.max_attempts)
        states = row_states(found, self.ordering)
        rows = [
            dict(r, state=state, ordered=self.ordering.is_ordered(r["event_type"]))
            for r, state in zip(found, states, strict=True)
        ]
        return self.render(
            request,
            who,
            "aggregate.html",
            {
                "aggregate_id": aggregate_id,
                "rows": rows,
                "total": total,
                "verdict": verdict,
                "dead_head": blocking_head(found, self.ordering),
            },
        )

    async def audit_page(self, request: Request, who: Principal) -> Response:
        before_id = self._int_param(request.query_params.get("before"), "before")
        done = self._int_param(request.query_params.get("done"), "done")
        page_size = self.settings.console.page_size

        def load() -> list[dict[str, Any]]:
            self.store.require_audit_table()
            return self.store.audit_list(limit=page_size, before_id=before_id)

        entries = await run_in_threadpool(load)
        next_before = entries[-1]["id"] if len(entries) == page_size else None
        return self.render(
            request,
            who,
            "audit.html",
            {
                "entries": entries,
                "next_before": next_before,
                "done": done,
                "before_id": before_id,
                "json": lambda value: json.dumps(value, ensure_ascii=False),
            },
        )

    async def login_page(self, request: Request) -> Response:
        who = Principal(user="", source="anonymous", can_act=False)
        if self.sessions.read_only:
            return RedirectResponse("/", status_code=303)
        target = self._next(request.query_params.get("next"))
        return self.render(request, who, "login.html", {"error": None, "next": target, "name": ""})

    async def login_submit(self, request: Request) -> Response:
        who = Principal(user="", source="anonymous", can_act=False)
        if self.sessions.read_only:
            return RedirectResponse("/", status_code=303)
        try:
            values = await self._form(request)
        except BadRequest as exc:
            return self.render(request, who, "error.html", {"title": "Not possible", "message": str(exc)}, 400)
        name = clean_user((values.get("name") or [""])[0])
        target = self._next((values.get("next") or [""])[0])
        context = {"next": target, "name": name}
        if not name:
            return self.render(
                request,
                who,
                "login.html",
                dict(context, error="enter your name (it is recorded with every action)"),
                401,
            )
        client = self._client(request)
        wait = self._locked_out(client, via="form")
        if wait is not None:  # the token is not even looked at
            page = self.render(
                request,
                who,
                "login.html",
                dict(
                    context, error=f"too many wrong tokens from your address: try again in {retry_after_header(wait)} s"
                ),
                429,
            )
            page.headers["Retry-After"] = retry_after_header(wait)
            return page
        session = self.sessions.login(name, (values.get("token") or [""])[0])
        if session is None:
            self._wrong_token(client, via="form", user=name)
            return self.render(request, who, "login.html", dict(context, error="wrong token"), 401)
        log.info("console login", user=session.user, client=client[0])
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            COOKIE_NAME,
            session.id,
            max_age=int(self.sessions.lifetime_seconds),
            path="/",
            httponly=True,
            samesite="strict",
            secure=self._secure_cookie(request),
        )
        return response

    def _secure_cookie(self, request: Request) -> bool:
        """console.cookie_secure: "always", or "auto" = the request came over https (the
        scheme uvicorn saw, or a trusted proxy's X-Forwarded-Proto)."""
        return self.settings.console.cookie_secure == "always" or request.url.scheme == "https"

    async def logout(self, request: Request, who: Principal) -> Response:
        values = await self._form(request)
        if who.source == "console" and csrf_ok(who, (values.get("csrf_token") or [""])[0]):
            self.sessions.logout(request.cookies.get(COOKIE_NAME))
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(
            COOKIE_NAME, path="/", httponly=True, samesite="strict", secure=self._secure_cookie(request)
        )
        return response

    @staticmethod
    def _next(raw: str | None) -> str:
        """Only a path on this console (never another site) after logging in."""
        if raw and raw.startswith("/") and not raw.startswith("//") and "\\" not in raw and raw.isprintable():
            return raw
        return "/"

    # --- JSON API --------------------------------------------------------------------------
    async def api_status(self, request: Request, who: Principal) -> Response:
        data = await run_in_threadpool(self._status_data)
        stats = data["stats"]
        depth: dict[str, Count] = data["depth"]
        return JSONResponse(
            {
                "table": self.settings.database.table,
                "queue_depth": {name: c.n for name, c in depth.items()},
                "queue_depth_estimated": [name for name, c in depth.items() if not c.exact],
                "oldest_pending_age_seconds": round(stats.oldest_pending_age_seconds, 3),
                "expired_leases": stats.expired_leases,
                "attempts": {str(k): v for k, v in sorted(stats.attempts.items())},
                "blocked_aggregates": [{"aggregate_id": a, "dead_id": i} for a, i in stats.blocked_aggregates],
                "published_last_hour": data["published_last_hour"],
                "published_per_5min": data["buckets"],
                "xmin_horizon": data["horizon"].as_json(),
                "vacuum": data["vacuum"].as_json(),
            }
        )

    async def api_dead(self, request: Request, who: Principal) -> Response:
        params = request.query_params
        unknown = sorted(set(params) - set(FILTER_NAMES) - {"after_id"})
        if unknown:
            raise BadRequest(f"unknown parameter {unknown[0]!r} (filters: {', '.join(FILTER_NAMES)}, after_id)")
        values = {name: params.get(name) for name in FILTER_NAMES if name != "limit"}
        page_size = self._page_size(params.get("limit"))
        after_id = self._int_param(params.get("after_id"), "after_id") or 0

        def load() -> dict[str, Any]:
            selector = self._filter(values)
            rows = self.store.dead_page(selector, after_id=after_id, limit=page_size)
            matched = self.store.dead_count(selector, budget_ms=self.count_budget_ms)
            summary = self.store.dead_summary(selector, timeout_ms=self.count_budget_ms) if matched.n else None
            return {
                "rows": jsonable(rows),
                "matched": matched.n,
                "matched_exact": matched.exact,
                "next_after_id": rows[-1]["id"] if len(rows) == page_size else None,
                "by_event_type": dict(summary.by_event_type) if summary else None,
                "by_error": [{"error": e, "rows": n} for e, n in summary.by_error] if summary else None,
                "aggregates": summary.aggregates if summary else None,
            }

        return JSONResponse(await run_in_threadpool(load))

    async def api_dead_row(self, request: Request, who: Principal) -> Response:
        row_id = int(request.path_params["row_id"])
        row = await run_in_threadpool(self.store.row_detail, row_id)
        if row is None:
            return self._json_error(404, f"row {row_id} does not exist")
        row.pop("database_now", None)
        row["payload"] = json.loads(row["payload"])
        row["headers"] = json.loads(row["headers"]) if row["headers"] is not None else None
        return JSONResponse(jsonable(row))

    async def api_retry(self, request: Request, who: Principal) -> Response:
        return await self._api_change(request, who, "retry")

    async def api_skip(self, request: Request, who: Principal) -> Response:
        return await self._api_change(request, who, "skip")

    async def _api_change(self, request: Request, who: Principal, action: Action) -> Response:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            # Also what keeps a cross-site HTML form from posting here.
            return self._json_error(415, "send the request as application/json")
        try:
            doc = json.loads(await self._body(request))
        except ValueError:
            raise BadRequest("the body is not JSON") from None
        if not isinstance(doc, dict):
            raise BadRequest('the body must be an object: {"ids": [...]} or {"filter": {...}}')
        unknown = sorted(set(doc) - {"ids", "filter", "all", "dry_run", "reason"})
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r}")
        dry_run = doc.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise BadRequest("dry_run must be true or false")
        if not dry_run:
            if not who.can_act:
                return self._json_error(403, "the console is read-only: set console.token to enable retry and skip")
            refusal = self._origin_refusal(request)
            if refusal is not None:
                return self._json_error(403, refusal)
            if not csrf_ok(who, request.headers.get("x-csrf-token")):
                return self._json_error(403, "missing or wrong X-CSRF-Token for this session")
        reason = doc.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise BadRequest("reason must be text")
        given = {k for k in API_SELECTIONS if doc.get(k) not in (None, False)}
        try:
            reason = check_dead_change(
                action,
                ids="ids" in given,
                all_rows="all" in given,
                filtered="filter" in given,
                reason=reason,
                dry_run=dry_run,
                wording=API_WORDING,
            )
        except OperatorRuleError as exc:
            raise BadRequest(str(exc)) from None
        selector = self._api_selector(doc)
        budget_ms = self.count_budget_ms

        def run() -> dict[str, Any]:
            selector_ = self._filter(selector) if isinstance(selector, dict) else selector
            if dry_run:
                preview = preview_dead(self.store, selector_, budget_ms=budget_ms)
                return dict(preview.as_json(), changed=0, dry_run=True)
            result = change_dead(
                self.store,
                action,
                selector_,
                actor=who.user,
                source=who.source,
                reason=reason,
                chunk_size=self.settings.console.chunk_size,
                budget_ms=budget_ms,
            )
            return {
                "matched": result.matched.n,
                "matched_exact": result.matched.exact,
                "changed": result.changed,
                "dry_run": False,
                "audit_id": result.audit_id,
            }

        return JSONResponse(await run_in_threadpool(run))

    @staticmethod
    def _api_selector(doc: dict[str, Any]) -> DeadFilter | dict[str, Any]:
        """{"ids": [...]}, {"filter": {...}} or {"all": true}: exactly one (check_dead_change
        has refused any other request)."""
        given = [k for k in API_SELECTIONS if doc.get(k) not in (None, False)]
        if given[0] == "ids":
            ids = doc["ids"]
            if (
                not isinstance(ids, list)
                or not ids
                or len(ids) > MAX_IDS
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
            ):
                raise BadRequest(f'"ids" must be a non-empty list of at most {MAX_IDS} integers')
            return DeadFilter(ids=tuple(dict.fromkeys(ids)))
        if given[0] == "all":
            if doc["all"] is not True:
                raise BadRequest('"all" must be true')
            return {}
        flt = doc["filter"]
        if not isinstance(flt, dict):
            raise BadRequest('"filter" must be an object')
        conditions = {k: v for k, v in flt.items() if k != "limit" and v not in (None, "")}
        if not conditions:
            raise BadRequest('the filter is empty: send "all": true to mean every dead row')
        return dict(flt)

    async def api_audit(self, request: Request, who: Principal) -> Response:
        page_size = self._page_size(request.query_params.get("limit"))
        before_id = self._int_param(request.query_params.get("before_id"), "before_id")

        def load() -> dict[str, Any]:
            self.store.require_audit_table()
            entries = self.store.audit_list(limit=page_size, before_id=before_id)
            return {
                "entries": jsonable(entries),
                "next_before_id": entries[-1]["id"] if len(entries) == page_size else None,
            }

        return JSONResponse(await run_in_threadpool(load))


def create_app(settings: Settings, store: OutboxStore) -> ASGIApp:
    """The console's ASGI application on an opened store."""
    return Console(settings, store).app()
