"""What every console handler shares: the console's state, the request-reading helpers
(body, form, filter, page size, whole-number parameters), rendering a page or a JSON
error, and the status figures the overview page and ``GET /api/status`` both show.

The handlers themselves are mixed in on top of :class:`ConsoleBase` by concern
(security.py, pages.py, api.py); app.py assembles them into the ``Console``.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import Any

from jinja2 import Environment
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse

from ...config import Settings
from ...core.filters import DeadFilter, parse_filter
from ...core.ordering import OrderingRule
from ...db.store import STATUSES, OutboxStore
from ...db.vacuum_health import HorizonClock
from .auth import LoginThrottle, Principal, Sessions, retry_after_header

MAX_BODY_BYTES = 1_000_000
MAX_IDS = 100_000


class BadRequest(Exception):
    """Input the console refuses; the message is shown to the caller (400)."""


class ConsoleBase:
    """The state of one console process (set by ``Console.__init__``) and the helpers
    its pages and API calls share."""

    settings: Settings
    store: OutboxStore
    sessions: Sessions
    throttle: LoginThrottle
    ordered_types: list[str]
    ordering: OrderingRule
    count_budget_ms: int
    horizon_clock: HorizonClock
    env: Environment

    @staticmethod
    def _json_error(code: int, message: str, *, retry_after: float | None = None) -> JSONResponse:
        headers = {"WWW-Authenticate": 'Bearer realm="outbox-relay console"'} if code == 401 else {}
        if retry_after is not None:
            headers["Retry-After"] = retry_after_header(retry_after)
        return JSONResponse({"error": message}, status_code=code, headers=headers or None)

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
