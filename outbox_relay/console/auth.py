"""Who is asking: the console's token check, login sessions and CSRF tokens.

- ``console.token`` set: every page and API call needs it, either as
  ``Authorization: Bearer <token>`` (scripts) or through a login session (browsers:
  an HttpOnly, SameSite=Strict cookie naming a server-side session). Actions from a
  session also need the session's CSRF token (a hidden form field, or the
  ``X-CSRF-Token`` header for the JSON API).
- ``console.token`` unset: read-only; pages and GET calls are open (bound to the
  loopback interface by default), every action is refused.

Sessions live in this process's memory: restarting the console logs everyone out.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

COOKIE_NAME = "outbox_relay_console"
MAX_SESSIONS = 1000  # the oldest session is dropped beyond this (bounded memory)
MAX_USER_CHARS = 100


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller of one request."""

    user: str  # recorded in the audit trail
    source: str  # "console" (browser session), "api" (bearer token) or "read-only"
    can_act: bool
    csrf_token: str | None = None  # the session's, for forms; None for bearer calls


@dataclass(slots=True)
class Session:
    id: str
    user: str
    csrf_token: str
    expires_at: float


class Sessions:
    """Login sessions of one console process."""

    def __init__(self, token: str | None, *, lifetime_seconds: float) -> None:
        self._token = token
        self._lifetime = lifetime_seconds
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    @property
    def read_only(self) -> bool:
        return self._token is None

    def token_matches(self, candidate: str) -> bool:
        """Constant-time comparison, so the token cannot be guessed byte by byte."""
        if self._token is None:
            return False
        return hmac.compare_digest(candidate.encode("utf-8"), self._token.encode("utf-8"))

    def login(self, user: str, candidate: str) -> Session | None:
        if not self.token_matches(candidate):
            return None
        session = Session(id=secrets.token_urlsafe(32), user=clean_user(user) or "operator",
                          csrf_token=secrets.token_urlsafe(32), expires_at=time.monotonic() + self._lifetime)
        with self._lock:
            self._sessions[session.id] = session
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return None
            if session.expires_at < time.monotonic():
                del self._sessions[session_id]
                return None
            return session

    def logout(self, session_id: str | None) -> None:
        if session_id:
            with self._lock:
                self._sessions.pop(session_id, None)

    @property
    def lifetime_seconds(self) -> float:
        return self._lifetime


def clean_user(text: str) -> str:
    """A display name for the audit trail: printable, one line, bounded."""
    printable = "".join(ch for ch in text if ch.isprintable()).strip()
    return printable[:MAX_USER_CHARS]


def csrf_ok(principal: Principal, submitted: str | None) -> bool:
    """A session's action must carry its CSRF token; bearer calls carry no cookie to abuse."""
    if principal.source == "api":
        return True
    if principal.csrf_token is None or not submitted:
        return False
    return hmac.compare_digest(principal.csrf_token.encode(), submitted.encode())
