"""Who is asking, over HTTP: the token check of every request (bearer header or login
session), the wrong-token lockout around it, the Origin check of actions, and the
login/logout pages that open and close a session.

The pieces without HTTP (sessions, the throttle, CSRF comparison) are in auth.py.
"""

from __future__ import annotations

import math
import urllib.parse

import structlog
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from .auth import COOKIE_NAME, Principal, clean_user, client_key, csrf_ok, retry_after_header
from .base import BadRequest, ConsoleBase

log = structlog.get_logger("outbox_relay.console")


class ConsoleSecurity(ConsoleBase):
    """The caller of each request, wrong tokens, origins, login and logout."""

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
