"""The console's operator pauses: ``GET /pauses`` (the active pauses of a source, how
many pending rows they hold parked, a form to pause and a button to resume each),
``POST /pauses/apply`` and ``POST /pauses/{id}/resume`` (then the audit log), and the
JSON API ``GET /api/pauses``, ``POST /api/pauses`` (``{"event_type"|"topic"|
"aggregate_type": ..., "reason": ...}``) and ``POST /api/pauses/{id}/resume``
(``{"reason": ...}`` optional). The rules and the parking are operator/pauses.py's,
the same as the CLI's."""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from ..operations import OperatorRuleError
from ..pauses import (
    API_PAUSE_WORDING,
    FORM_PAUSE_WORDING,
    SELECTORS,
    NoSuchPause,
    check_pause,
    check_resume_reason,
    pause,
    pause_overview,
    resume,
)
from .api import ConsoleApi
from .auth import Principal, csrf_ok
from .base import BadRequest
from .sources import ConsoleSource


class PausePages(ConsoleApi):
    """The pause page and API handlers (each behind ``Console._page`` / ``Console._api``)."""

    def _pause_overview(self, src: ConsoleSource) -> dict[str, Any]:
        return pause_overview(
            src.store, count_cap=self.settings.metrics.exact_count_limit, timeout_ms=self.count_budget_ms
        )

    # --- pages ---------------------------------------------------------------------------
    async def pauses_page(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
        return await self._render_pauses(request, who, src, form={}, error=None, status_code=200)

    async def _render_pauses(
        self,
        request: Request,
        who: Principal,
        src: ConsoleSource,
        *,
        form: dict[str, str],
        error: str | None,
        status_code: int,
    ) -> Response:
        overview = await run_in_threadpool(self._pause_overview, src)
        return self.render(
            request,
            who,
            "pauses.html",
            {"overview": overview, "form": form, "error": error, "selectors": SELECTORS},
            status_code,
            src=src,
        )

    def _form_refusal(self, request: Request, who: Principal, values: dict[str, list[str]]) -> str | None:
        if not who.can_act:
            raise BadRequest("the console is read-only: set console.token to enable its actions")
        refusal = self._origin_refusal(request)
        if refusal is None and not csrf_ok(who, (values.get("csrf_token") or [""])[0]):
            refusal = (
                "this form did not come from this console session (missing or wrong CSRF token); "
                "reload the page and try again"
            )
        return refusal

    def _to_audit(self, src: ConsoleSource, audit_id: int) -> Response:
        query = {"done": audit_id, **({"source": src.name} if self.sources.multi else {})}
        return RedirectResponse("/audit?" + urllib.parse.urlencode(query), status_code=303)

    async def pause_apply(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
        values = await self._form(request)
        refusal = self._form_refusal(request, who, values)
        if refusal is not None:
            return self.render(request, who, "error.html", {"title": "Refused", "message": refusal}, 403, src=src)
        form = {name: (values.get(name) or [""])[0] for name in ("selector", "value", "reason")}
        if form["selector"] not in SELECTORS:
            return await self._render_pauses(
                request, who, src, form=form, error="choose what to pause by", status_code=400
            )
        try:
            target, reason = check_pause({form["selector"]: form["value"]}, form["reason"], FORM_PAUSE_WORDING)
        except OperatorRuleError as exc:
            return await self._render_pauses(request, who, src, form=form, error=str(exc), status_code=400)

        def apply() -> int:
            return pause(
                src.store,
                target,
                reason=reason,
                actor=who.user,
                source=who.source,
                max_attempts=src.settings.relay.max_attempts,
            ).audit_id

        try:
            audit_id = await run_in_threadpool(apply)
        except OperatorRuleError as exc:
            return await self._render_pauses(request, who, src, form=form, error=str(exc), status_code=409)
        return self._to_audit(src, audit_id)

    async def resume_apply(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
        values = await self._form(request)
        refusal = self._form_refusal(request, who, values)
        if refusal is not None:
            return self.render(request, who, "error.html", {"title": "Refused", "message": refusal}, 403, src=src)
        pause_id = int(request.path_params["pause_id"])

        def apply() -> int:
            return resume(src.store, pause_id=pause_id, target=None, actor=who.user, source=who.source).audit_id

        try:
            audit_id = await run_in_threadpool(apply)
        except NoSuchPause as exc:
            return await self._render_pauses(request, who, src, form={}, error=str(exc), status_code=404)
        return self._to_audit(src, audit_id)

    # --- JSON API --------------------------------------------------------------------------
    async def _json_doc(self, request: Request) -> dict[str, Any]:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            raise BadRequest("send the request as application/json")
        try:
            doc = json.loads(await self._body(request) or b"{}")
        except ValueError:
            raise BadRequest("the body is not JSON") from None
        if not isinstance(doc, dict):
            raise BadRequest("the body must be an object")
        return doc

    async def api_pauses(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
        overview = await run_in_threadpool(self._pause_overview, src)
        return JSONResponse(dict(overview, source=src.name, table=src.table))

    async def api_pause(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
        refusal = self._act_refusal(request, who)
        if refusal is not None:
            return refusal
        doc = await self._json_doc(request)
        unknown = sorted(set(doc) - {*SELECTORS, "reason"})
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r}")
        reason = doc.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise BadRequest("reason must be text")
        if any(doc.get(name) is not None and not isinstance(doc.get(name), str) for name in SELECTORS):
            raise BadRequest(f"{API_PAUSE_WORDING.selectors} must be text")
        given: dict[str, str | None] = {name: doc.get(name) for name in SELECTORS}
        try:
            target, cleaned = check_pause(given, reason, API_PAUSE_WORDING)
        except OperatorRuleError as exc:
            raise BadRequest(str(exc)) from None

        def apply() -> dict[str, Any]:
            return pause(
                src.store,
                target,
                reason=cleaned,
                actor=who.user,
                source=who.source,
                max_attempts=src.settings.relay.max_attempts,
            ).as_json()

        try:
            return JSONResponse(await run_in_threadpool(apply))
        except OperatorRuleError as exc:  # paused already
            return self._json_error(409, str(exc))

    async def api_resume(self, request: Request, who: Principal) -> Response:
        src = await self._source(request)
        refusal = self._act_refusal(request, who)
        if refusal is not None:
            return refusal
        doc = await self._json_doc(request)
        unknown = sorted(set(doc) - {"reason"})
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r}")
        reason = doc.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise BadRequest("reason must be text")
        try:
            cleaned = check_resume_reason(reason, API_PAUSE_WORDING)
        except OperatorRuleError as exc:
            raise BadRequest(str(exc)) from None
        pause_id = int(request.path_params["pause_id"])

        def apply() -> dict[str, Any]:
            return resume(
                src.store,
                pause_id=pause_id,
                target=None,
                actor=who.user,
                source=who.source,
                reason=cleaned,
            ).as_json()

        try:
            return JSONResponse(await run_in_threadpool(apply))
        except NoSuchPause as exc:
            return self._json_error(404, str(exc))
