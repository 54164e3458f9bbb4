"""What every console handler shares: the console's state, the request-reading helpers
(body, form, filter, page size, whole-number parameters), rendering a page or a JSON
error, and the status figures the overview page and ``GET /api/status`` both show.

The handlers themselves are mixed in on top of :class:`ConsoleBase` by concern
(security.py, pages.py, api.py); app.py assembles them into the ``Console``.
"""

from __future__ import annotations

import datetime as dt
import urllib.parse
from collections.abc import Mapping
from typing import Any

from jinja2 import Environment
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse

from ...config import Settings
from ...core.filters import DeadFilter, parse_filter
from ...db.store import STATUSES, Count
from ...errors import OutboxRelayError
from ..pauses import pause_overview
from .auth import LoginThrottle, Principal, Sessions, retry_after_header
from .source_list import LISTED_STATUSES, SourceBoard, SourceFigures, SourceQuery
from .sources import ConsoleSource, ConsoleSources, SourceNotNamed, SourceUnknown

MAX_BODY_BYTES = 1_000_000
MAX_IDS = 100_000


class BadRequest(Exception):
    """Input the console refuses; the message is shown to the caller (400)."""


class NoSuchSource(BadRequest):
    """``?source=`` names no source this console serves (404)."""


class ConsoleBase:
    """The state of one console process (set by ``Console.__init__``) and the helpers
    its pages and API calls share."""

    settings: Settings
    sources: ConsoleSources
    board: SourceBoard
    sessions: Sessions
    throttle: LoginThrottle
    count_budget_ms: int
    env: Environment

    @staticmethod
    def _json_error(code: int, message: str, *, retry_after: float | None = None) -> JSONResponse:
        headers = {"WWW-Authenticate": 'Bearer realm="outbox-relay console"'} if code == 401 else {}
        if retry_after is not None:
            headers["Retry-After"] = retry_after_header(retry_after)
        return JSONResponse({"error": message}, status_code=code, headers=headers or None)

    async def _source(self, request: Request) -> ConsoleSource:
        """The source the request names with ``?source=NAME`` (opened off the event loop)."""
        try:
            return await run_in_threadpool(self.sources.get, request.query_params.get("source"))
        except SourceNotNamed as exc:
            raise BadRequest(str(exc)) from None
        except SourceUnknown as exc:
            raise NoSuchSource(str(exc)) from None

    def render(
        self,
        request: Request,
        who: Principal,
        template: str,
        context: Mapping[str, Any],
        status_code: int = 200,
        *,
        src: ConsoleSource | None = None,
    ) -> HTMLResponse:
        """A page; ``src``: the source it shows (its name is carried by every link and
        form of the page when the console serves several)."""
        named = src.name if src is not None and self.sources.multi else None
        html = self.env.get_template(template).render(
            table=src.table if src is not None else "",
            source=named,
            sq="?" + urllib.parse.urlencode({"source": named}) if named else "",
            multi=self.sources.multi,
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

    @staticmethod
    def _filter(src: ConsoleSource, values: Mapping[str, Any]) -> DeadFilter:
        try:
            return parse_filter(values, src.store.database_now)
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

    def _status_data(self, src: ConsoleSource) -> dict[str, Any]:
        s = self.settings
        store = src.store
        stats = store.stats(
            ordered_types=src.ordered_types,
            include_depth=False,
            count_cap=s.metrics.exact_count_limit,
            timeout_ms=s.console.statement_timeout_ms,
        )
        depth = store.exact_depth(budget_ms=self.count_budget_ms, first_upto=s.metrics.exact_count_limit)
        # Done rows have no index: the rate reads the table, so it gets a short timeout
        # (and the page says so when that runs out) rather than slowing every overview.
        buckets = store.published_per_bucket(timeout_ms=min(1000, self.count_budget_ms))
        horizon = store.xmin_horizon(timeout_ms=s.console.statement_timeout_ms)
        src.horizon_clock.apply(horizon.holders)
        vacuum = store.vacuum_figures(timeout_ms=s.console.statement_timeout_ms)
        pauses = pause_overview(store, count_cap=s.metrics.exact_count_limit, timeout_ms=self.count_budget_ms)
        return {
            "operator_pauses": pauses,
            "depth": depth,
            "stats": stats,
            "buckets": buckets,
            "horizon": horizon,
            "vacuum": vacuum,
            "horizon_warn_seconds": s.metrics.xmin_horizon_warn_seconds,
            "published_last_hour": sum(buckets) if buckets is not None else None,
            "ordered": bool(src.ordered_types),
            "statuses": STATUSES,
        }

    def _read_source(self, name: str) -> SourceFigures:
        """One source's figures for the list of sources: one read-only snapshot (the
        relay's own gauge query: depth per status, counted up to the exact-count cap,
        and the oldest pending row's age), or why its database did not answer."""
        now = dt.datetime.now(dt.UTC)
        try:
            src = self.sources.get(name)
        except SourceUnknown as exc:  # a discovered database dropped since it was listed
            return SourceFigures(name, None, None, None, str(exc), now)
        except OutboxRelayError as exc:
            return SourceFigures(name, None, None, None, str(exc), now)
        try:
            stats = src.store.stats(
                include_depth=True,
                count_cap=self.settings.metrics.exact_count_limit,
                timeout_ms=self.settings.console.statement_timeout_ms,
            )
        except OutboxRelayError as exc:
            return SourceFigures(name, src.table, None, None, src.store.redact(str(exc)), now)
        depth = {s: Count(stats.queue_depth[s], s not in stats.estimated_statuses) for s in LISTED_STATUSES}
        return SourceFigures(name, src.table, depth, stats.oldest_pending_age_seconds, None, now)

    def _source_list(self, params: Mapping[str, list[str]], *, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        """The page of the list of sources ``params`` ask for (blocking: the first call
        waits for the first round of figures)."""
        try:
            query = SourceQuery.parse(params, allowed_extra=extra)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        view = self.board.view()
        items, matched = query.select(view.items)
        pages = max(1, -(-matched // query.limit))
        return {
            "query": query,
            "items": items,
            "matched": matched,
            "served": len(view.items),
            "pages": pages,
            "oldest_read_at": view.oldest_read_at,
            "refreshing": view.refreshing,
            "refresh_seconds": self.board.refresh_seconds,
            "now": dt.datetime.now(dt.UTC),
        }
