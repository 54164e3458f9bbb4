"""Who is asking: the console's token check, login sessions and CSRF tokens.

- ``console.token`` set: every page and API call needs it, either as
  ``Authorization: Bearer <token>`` (scripts) or through a login session (browsers:
  an HttpOnly, SameSite=Strict cookie naming a server-side session). Actions from a
  session also need the session's CSRF token (a hidden form field, or the
  ``X-CSRF-Token`` header for the JSON API).
- ``console.token`` unset: read-only; pages and GET calls are open (bound to the
  loopback interface by default), every action is refused.

Sessions live in this process's memory: restarting the console logs everyone out.

Wrong tokens are throttled per client address (:class:`LoginThrottle`): after
``console.login_max_failures`` of them the address is locked out for
``console.login_lockout_seconds``, twice as long after each further wrong token; while
locked out its token checks are answered 429 without looking at the token at all.
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

COOKIE_NAME = "outbox_relay_console"
MAX_SESSIONS = 1000  # the oldest session is dropped beyond this (bounded memory)
MAX_USER_CHARS = 100
MAX_THROTTLED_CLIENTS = 10_000  # addresses with recent wrong tokens kept; the stalest is dropped beyond this
LOCKOUT_CAP_SECONDS = 3600.0  # the doubling lockout stops growing here (or at the first lockout, if longer)
FORGET_AFTER_SECONDS = 3600.0  # an address's wrong tokens are forgotten this long after its last lockout ends


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
        session = Session(
            id=secrets.token_urlsafe(32),
            user=clean_user(user) or "operator",
            csrf_token=secrets.token_urlsafe(32),
            expires_at=time.monotonic() + self._lifetime,
        )
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


def client_key(host: str | None) -> str:
    """What the throttle counts per: the address, or an IPv6 client's /64 (one host
    usually owns a whole /64, and could otherwise pick a new address per guess)."""
    if not host:
        return "unknown"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


@dataclass(slots=True)
class _Failures:
    count: int = 0
    locked_until: float = 0.0  # time.monotonic(); in the past = not locked out
    refusal_logged: bool = False  # the first refused attempt of a lockout is logged, the rest are not


@dataclass(frozen=True, slots=True)
class Failure:
    """What one wrong token did to its client's record."""

    failures: int  # wrong tokens from this client since its record was last cleared
    locked_for_seconds: float  # the lockout it started (0: none yet)


class LoginThrottle:
    """Wrong-token accounting per client (see the module docstring).

    Callers check :meth:`retry_after` before comparing a token and report a wrong one
    with :meth:`failed` without awaiting in between, so concurrent guesses from one
    client cannot all slip through before the first is counted. A right token does not
    wipe the count: a guesser sharing an address with a working script (NAT, a proxy
    not listed in console.forwarded_allow_ips) must not get a fresh allowance from the
    script's calls. Wrong tokens are forgotten an hour after the last lockout ended (or
    the last wrong token, if none).
    """

    def __init__(
        self,
        max_failures: int,
        lockout_seconds: float,
        *,
        max_clients: int = MAX_THROTTLED_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_failures = max_failures
        self._lockout = lockout_seconds
        self._cap = max(LOCKOUT_CAP_SECONDS, lockout_seconds)
        self._max_clients = max_clients
        self._clock = clock
        self._lock = threading.Lock()
        self._clients: OrderedDict[str, _Failures] = OrderedDict()

    def retry_after(self, client: str) -> tuple[float, bool] | None:
        """None if the client may try a token now; else (seconds it must wait, whether
        this is the first refusal of its lockout: the one worth logging)."""
        now = self._clock()
        with self._lock:
            record = self._clients.get(client)
            if record is None:
                return None
            if record.locked_until <= now:
                if now - record.locked_until >= FORGET_AFTER_SECONDS:
                    del self._clients[client]
                return None
            first = not record.refusal_logged
            record.refusal_logged = True
            return record.locked_until - now, first

    def failed(self, client: str) -> Failure:
        now = self._clock()
        with self._lock:
            record = self._clients.pop(client, None)
            if record is None or (record.locked_until <= now and now - record.locked_until >= FORGET_AFTER_SECONDS):
                record = _Failures()
            record.count += 1
            self._clients[client] = record  # most recently failed last
            while len(self._clients) > self._max_clients:
                self._clients.popitem(last=False)
            beyond = record.count - self._max_failures
            if beyond < 0:
                record.locked_until = now
                return Failure(record.count, 0.0)
            lockout = min(self._cap, self._lockout * 2.0 ** min(beyond, 64))
            record.locked_until = now + lockout
            record.refusal_logged = False
            return Failure(record.count, lockout)


def retry_after_header(seconds: float) -> str:
    """Retry-After in whole seconds, never telling the client to come back too early."""
    return str(max(1, math.ceil(seconds)))
