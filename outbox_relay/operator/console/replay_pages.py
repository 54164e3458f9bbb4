"""The console's replay pages: ``GET /replay`` (the filter form, and with a filter the
dry run's preview and a confirm form asking for a reason) and ``POST /replay/apply``
(the replay, then the audit log). The rules and the sending are operator/replay.py's,
the same as the CLI's and ``POST /api/replay``'s."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from ...core.filters import DeadFilter
from ..operations import OperatorRuleError
from ..replay import (
    CONSOLE_MAX_REPLAY_ROWS,
    ReplayWording,
    check_replay,
    check_to_topic,
    delete_mode_refusal,
    open_publisher,
    preview_replay,
    replay_delivered,
)
from .auth import Principal, csrf_ok
from .base import BadRequest
from .security import ConsoleSecurity
from .sources import ConsoleSource

REPLAY_FILTERS = ("event_type", "aggregate_type", "aggregate_id", "since", "until", "limit")
FORM_REPLAY_WORDING = ReplayWording(
    ids="row ids", filters="a filter", reason="the reason field", to_topic="the target topic"
)


class ReplayPages(ConsoleSecurity):
    """The replay page handlers (each behind ``Console._page``)."""

    def _replay_selector(self, src: ConsoleSource, values: Mapping[str, list[str]]) -> DeadFilter | None:
        """The form's filter; None when it has no condition (nothing to preview yet)."""
        selector = self._filter(src, {name: (values.get(name) or [""])[0] for name in REPLAY_FILTERS})
        return selector if selector.has_conditions() else None

    async def replay_page(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
        values = {k: request.query_params.getlist(k) for k in request.query_params}
        return await self._render_replay(request, who, src, values, error=None, status_code=200)

    async def _render_replay(
        self,
        request: Request,
        who: Principal,
        src: ConsoleSource,
        values: Mapping[str, list[str]],
        *,
        error: str | None,
        status_code: int,
    ) -> Response:
        form = {name: (values.get(name) or [""])[0] for name in (*REPLAY_FILTERS, "to_topic", "reason")}
        try:
            to_topic = check_to_topic(form["to_topic"] or None, FORM_REPLAY_WORDING)
        except OperatorRuleError as exc:
            raise BadRequest(str(exc)) from None

        def load() -> dict[str, Any]:
            if src.store.on_done_mode() == "delete":
                return {"refusal": delete_mode_refusal(src.table), "selector": None, "preview": None}
            selector = self._replay_selector(src, values)
            if selector is None:
                return {"refusal": None, "selector": None, "preview": None}
            preview = preview_replay(src.store, selector, to_topic=to_topic, budget_ms=self.count_budget_ms)
            return {"refusal": None, "selector": selector, "preview": preview}

        data = await run_in_threadpool(load)
        selector: DeadFilter | None = data["selector"]
        hidden = [(k, str(v)) for k, v in selector.describe().items()] if selector is not None else []  # absolute times
        if to_topic:
            hidden.append(("to_topic", to_topic))
        return self.render(
            request,
            who,
            "replay.html",
            dict(
                data,
                form=form,
                hidden=hidden,
                error=error,
                too_many=data["preview"] is not None and data["preview"].matched.n > CONSOLE_MAX_REPLAY_ROWS,
                max_rows=CONSOLE_MAX_REPLAY_ROWS,
            ),
            status_code,
            src=src,
        )

    async def replay_apply(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
        values = await self._form(request)
        if not who.can_act:
            raise BadRequest("the console is read-only: set console.token to enable its actions")
        refusal = self._origin_refusal(request)
        if refusal is None and not csrf_ok(who, (values.get("csrf_token") or [""])[0]):
            refusal = (
                "this form did not come from this console session (missing or wrong CSRF token); "
                "reload the page and try again"
            )
        if refusal is not None:
            return self.render(request, who, "error.html", {"title": "Refused", "message": refusal}, 403, src=src)
        form_filters = {name: (values.get(name) or [""])[0] for name in REPLAY_FILTERS}
        try:
            reason, to_topic = check_replay(
                ids=False,
                filtered=any(v for k, v in form_filters.items() if k != "limit"),
                reason=(values.get("reason") or [""])[0],
                dry_run=False,
                to_topic=(values.get("to_topic") or [""])[0] or None,
                wording=FORM_REPLAY_WORDING,
            )
        except OperatorRuleError as exc:
            return await self._render_replay(request, who, src, values, error=str(exc), status_code=400)

        def apply() -> int:
            if src.store.on_done_mode() == "delete":
                raise BadRequest(delete_mode_refusal(src.table))
            selector = self._replay_selector(src, values)
            assert selector is not None  # check_replay refused an empty filter
            src.store.require_replay_audit()
            matched = src.store.replay_count(selector, budget_ms=self.count_budget_ms)
            if not matched.exact or matched.n > CONSOLE_MAX_REPLAY_ROWS:
                raise BadRequest(
                    f"{matched} rows match: the console replays at most {CONSOLE_MAX_REPLAY_ROWS} "
                    "at once; narrow the filter, give a limit, or use `outbox-relay replay`"
                )
            publisher = open_publisher(src.settings)
            try:
                result = replay_delivered(
                    src.store,
                    publisher,
                    src.settings,
                    selector,
                    to_topic=to_topic,
                    actor=who.user,
                    source=who.source,
                    reason=reason,
                    chunk_size=self.settings.console.chunk_size,
                    budget_ms=self.count_budget_ms,
                    matched=matched,
                )
            finally:
                publisher.close()
            return result.audit_id

        audit_id = await run_in_threadpool(apply)
        query = {"done": audit_id, **({"source": src.name} if self.sources.multi else {})}
        return RedirectResponse("/audit?" + urllib.parse.urlencode(query), status_code=303)
