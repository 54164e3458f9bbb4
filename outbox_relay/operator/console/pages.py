"""The console's HTML pages: overview, dead rows, the preview -> confirm flow of a
retry/skip, one row, one aggregate and the audit log."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Mapping
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from ...core.filters import FILTER_NAMES, DeadFilter
from ..operations import (
    FORM_WORDING,
    Action,
    OperatorRuleError,
    blocking_head,
    change_dead,
    check_dead_change,
    diagnose_aggregate,
    preview_dead,
    row_states,
    selector_description,
)
from .auth import Principal, csrf_ok
from .base import BadRequest
from .security import ConsoleSecurity
from .sources import ConsoleSource


class ConsolePages(ConsoleSecurity):
    """The page handlers (each behind ``Console._page``)."""

    async def overview(self, request: Request, who: Principal) -> Response:
        if self.sources.multi and not request.query_params.get("source"):
            params = {k: request.query_params.getlist(k) for k in request.query_params if k != "source"}
            listed = await run_in_threadpool(self._source_list, params)
            return self.render(request, who, "sources.html", listed)
        src = await self._source(request)
        data = await run_in_threadpool(self._status_data, src)
        return self.render(request, who, "overview.html", data, src=src)

    async def dead_rows(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
        params = request.query_params
        values = {name: params.get(name) for name in FILTER_NAMES if name != "limit"}
        page_size = self._page_size(params.get("limit"))
        after_id = self._int_param(params.get("after"), "after") or 0

        def load() -> dict[str, Any]:
            selector = self._filter(src, values)
            rows = src.store.dead_page(selector, after_id=after_id, limit=page_size)
            matched = src.store.dead_count(selector, budget_ms=self.count_budget_ms)
            summary = src.store.dead_summary(selector, timeout_ms=self.count_budget_ms) if matched.n else None
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
            src=src,
        )

    def _selection(self, src: ConsoleSource, values: Mapping[str, list[str]]) -> tuple[str, DeadFilter]:
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
            selector = self._filter(src, {name: (values.get(name) or [""])[0] for name in FILTER_NAMES})
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
        src = await self._source(request)
        values = {k: request.query_params.getlist(k) for k in request.query_params}
        action = self._action((values.get("action") or [""])[0])
        return await self._render_preview(request, who, src, action, values, error=None, status_code=200)

    async def _render_preview(
        self,
        request: Request,
        who: Principal,
        src: ConsoleSource,
        action: Action,
        values: Mapping[str, list[str]],
        *,
        error: str | None,
        status_code: int,
    ) -> Response:
        def load() -> dict[str, Any]:
            scope, selector = self._selection(src, values)
            preview = preview_dead(src.store, selector, budget_ms=self.count_budget_ms)
            not_dead: dict[int, str] = {}
            if selector.ids is not None:
                found = src.store.statuses(list(selector.ids))
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
            src=src,
        )

    async def dead_apply(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
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
            return self.render(request, who, "error.html", {"title": "Refused", "message": refusal}, 403, src=src)
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
            return await self._render_preview(request, who, src, action, values, error=str(exc), status_code=400)

        def apply() -> int | None:
            _scope, selector = self._selection(src, values)
            result = change_dead(
                src.store,
                action,
                selector,
                actor=who.user,
                source=who.source,
                reason=reason,
                chunk_size=self.settings.console.chunk_size,
                budget_ms=self.count_budget_ms,
            )
            self.board.refresh_source(src.name)  # the list of sources shows the change at once
            return result.audit_id

        audit_id = await run_in_threadpool(apply)
        query = {"done": audit_id, **({"source": src.name} if self.sources.multi else {})}
        return RedirectResponse("/audit?" + urllib.parse.urlencode(query), status_code=303)

    async def row_page(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
        row_id = int(request.path_params["row_id"])
        row = await run_in_threadpool(src.store.row_detail, row_id)
        if row is None:
            return self.render(
                request,
                who,
                "error.html",
                {"title": "No such row", "message": f"row {row_id} does not exist (purged?)"},
                404,
                src=src,
            )
        return self.render(request, who, "row.html", {"row": row}, src=src)

    async def aggregate_page(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
        aggregate_id = str(request.path_params["aggregate_id"])
        found, total = await run_in_threadpool(
            src.store.aggregate_rows, aggregate_id, limit=self.settings.console.page_size * 4
        )
        verdict = diagnose_aggregate(found, src.ordering, max_attempts=src.settings.relay.max_attempts)
        states = row_states(found, src.ordering)
        rows = [
            dict(r, state=state, ordered=src.ordering.is_ordered(r["event_type"]))
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
                "dead_head": blocking_head(found, src.ordering),
            },
            src=src,
        )

    async def audit_page(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
        before_id = self._int_param(request.query_params.get("before"), "before")
        done = self._int_param(request.query_params.get("done"), "done")
        page_size = self.settings.console.page_size

        def load() -> list[dict[str, Any]]:
            src.store.require_audit_table()
            return src.store.audit_list(limit=page_size, before_id=before_id)

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
            src=src,
        )
