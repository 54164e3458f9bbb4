"""The console's JSON API: ``GET /api/sources`` (filtered, sorted and paged:
source_list.py), ``GET /api/status``, ``GET /api/dead``, ``GET /api/dead/{id}``,
``POST /api/dead/retry|skip``, ``POST /api/replay``, ``GET /api/audit``; every call but the first takes
``?source=NAME`` (required when the console serves several)."""

from __future__ import annotations

import json
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...core.filters import FILTER_NAMES, DeadFilter
from ...db.store import Count
from ..operations import (
    API_WORDING,
    Action,
    OperatorRuleError,
    change_dead,
    check_dead_change,
    jsonable,
    preview_dead,
)
from ..replay import (
    API_REPLAY_WORDING,
    CONSOLE_MAX_REPLAY_ROWS,
    check_replay,
    delete_mode_refusal,
    open_publisher,
    preview_replay,
    replay_delivered,
)
from .auth import Principal, csrf_ok
from .base import MAX_IDS, BadRequest
from .security import ConsoleSecurity

API_SELECTIONS = ("ids", "filter", "all")  # the fields of a retry/skip body that select rows


class ConsoleApi(ConsoleSecurity):
    """The JSON API handlers (each behind ``Console._api``)."""

    async def api_sources(self, request: Request, who: Principal) -> Response:
        params = {k: request.query_params.getlist(k) for k in request.query_params}
        listed = await run_in_threadpool(self._source_list, params)
        query = listed["query"]
        now = listed["now"]
        oldest = listed["oldest_read_at"]
        return JSONResponse(
            {
                "sources": [item.as_json(now) for item in listed["items"]],
                "total": listed["matched"],
                "served": listed["served"],
                "page": query.page,
                "pages": listed["pages"],
                "limit": query.limit,
                "q": query.q,
                "state": list(query.states),
                "sort": query.sort,
                "order": query.order,
                "figures_read_at": oldest.isoformat() if oldest is not None else None,
                "refresh_seconds": listed["refresh_seconds"],
                "refreshing": listed["refreshing"],
            }
        )

    async def api_status(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
        data = await run_in_threadpool(self._status_data, src)
        stats = data["stats"]
        depth: dict[str, Count] = data["depth"]
        return JSONResponse(
            {
                "source": src.name,
                "table": src.table,
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
                "operator_pauses": data["operator_pauses"],
            }
        )

    async def api_dead(self, request: Request, who: Principal) -> Response:
        params = request.query_params
        unknown = sorted(set(params) - set(FILTER_NAMES) - {"after_id", "source"})
        if unknown:
            raise BadRequest(f"unknown parameter {unknown[0]!r} (filters: {', '.join(FILTER_NAMES)}, after_id, source)")
        src = await self._source(request)
        values = {name: params.get(name) for name in FILTER_NAMES if name != "limit"}
        page_size = self._page_size(params.get("limit"))
        after_id = self._int_param(params.get("after_id"), "after_id") or 0

        def load() -> dict[str, Any]:
            selector = self._filter(src, values)
            rows = src.store.dead_page(selector, after_id=after_id, limit=page_size)
            matched = src.store.dead_count(selector, budget_ms=self.count_budget_ms)
            summary = src.store.dead_summary(selector, timeout_ms=self.count_budget_ms) if matched.n else None
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
        src = await self._source(request)
        row_id = int(request.path_params["row_id"])
        row = await run_in_threadpool(src.store.row_detail, row_id)
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
        src = await self._source(request)
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
            selector_ = self._filter(src, selector) if isinstance(selector, dict) else selector
            if dry_run:
                preview = preview_dead(src.store, selector_, budget_ms=budget_ms)
                return dict(preview.as_json(), changed=0, dry_run=True)
            result = change_dead(
                src.store,
                action,
                selector_,
                actor=who.user,
                source=who.source,
                reason=reason,
                chunk_size=self.settings.console.chunk_size,
                budget_ms=budget_ms,
            )
            self.board.refresh_source(src.name)  # the list of sources shows the change at once
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

    async def api_replay(self, request: Request, who: Principal) -> Response:
        """Replay delivered rows (operator/replay.py): ``{"ids": [...]}`` or ``{"filter":
        {...}}``, ``"to_topic"``, ``"dry_run"``, ``"reason"`` (required unless a dry run)."""
        src = await self._source(request)
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            return self._json_error(415, "send the request as application/json")
        try:
            doc = json.loads(await self._body(request))
        except ValueError:
            raise BadRequest("the body is not JSON") from None
        if not isinstance(doc, dict):
            raise BadRequest('the body must be an object: {"ids": [...]} or {"filter": {...}}')
        unknown = sorted(set(doc) - {"ids", "filter", "to_topic", "dry_run", "reason"})
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r}")
        dry_run = doc.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise BadRequest("dry_run must be true or false")
        if not dry_run:
            refusal = self._act_refusal(request, who)
            if refusal is not None:
                return refusal
        reason, to_topic = doc.get("reason"), doc.get("to_topic")
        if reason is not None and not isinstance(reason, str):
            raise BadRequest("reason must be text")
        if to_topic is not None and not isinstance(to_topic, str):
            raise BadRequest("to_topic must be text")
        try:
            reason, to_topic = check_replay(
                ids=doc.get("ids") is not None,
                filtered=doc.get("filter") is not None,
                reason=reason,
                dry_run=dry_run,
                to_topic=to_topic,
                wording=API_REPLAY_WORDING,
            )
        except OperatorRuleError as exc:
            raise BadRequest(str(exc)) from None
        flt = doc.get("filter")
        if isinstance(flt, dict):
            if "error_contains" in flt:
                raise BadRequest("error_contains does not apply to delivered rows")
            if not any(v not in (None, "") for k, v in flt.items() if k != "limit"):
                raise BadRequest("the filter is empty: give at least one condition (a time range, an event type…)")
        selector = self._api_selector(doc)
        budget_ms = self.count_budget_ms

        def run() -> dict[str, Any]:
            if src.store.on_done_mode() == "delete":
                raise BadRequest(delete_mode_refusal(src.table))
            selector_ = self._filter(src, selector) if isinstance(selector, dict) else selector
            if dry_run:
                preview = preview_replay(src.store, selector_, to_topic=to_topic, budget_ms=budget_ms)
                answer: dict[str, Any] = jsonable(dict(preview.as_json(), sent=0, dry_run=True))
                return answer
            src.store.require_replay_audit()
            matched = src.store.replay_count(selector_, budget_ms=budget_ms)
            if not matched.exact or matched.n > CONSOLE_MAX_REPLAY_ROWS:
                raise BadRequest(
                    f"{matched} rows match: the console replays at most {CONSOLE_MAX_REPLAY_ROWS} "
                    "per request; narrow the filter, give a limit, or use `outbox-relay replay`"
                )
            publisher = open_publisher(src.settings)
            try:
                result = replay_delivered(
                    src.store,
                    publisher,
                    src.settings,
                    selector_,
                    to_topic=to_topic,
                    actor=who.user,
                    source=who.source,
                    reason=reason,
                    chunk_size=self.settings.console.chunk_size,
                    budget_ms=budget_ms,
                    matched=matched,
                )
            finally:
                publisher.close()
            return result.as_json()

        return JSONResponse(await run_in_threadpool(run))

    def _act_refusal(self, request: Request, who: Principal) -> Response | None:
        """Why this caller may not change anything now (read-only console, foreign
        origin, missing CSRF token of a session), or None."""
        if not who.can_act:
            return self._json_error(403, "the console is read-only: set console.token to enable its actions")
        refusal = self._origin_refusal(request)
        if refusal is not None:
            return self._json_error(403, refusal)
        if not csrf_ok(who, request.headers.get("x-csrf-token")):
            return self._json_error(403, "missing or wrong X-CSRF-Token for this session")
        return None

    async def api_audit(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
        page_size = self._page_size(request.query_params.get("limit"))
        before_id = self._int_param(request.query_params.get("before_id"), "before_id")

        def load() -> dict[str, Any]:
            src.store.require_audit_table()
            entries = src.store.audit_list(limit=page_size, before_id=before_id)
            return {
                "entries": jsonable(entries),
                "next_before_id": entries[-1]["id"] if len(entries) == page_size else None,
            }

        return JSONResponse(await run_in_threadpool(load))
