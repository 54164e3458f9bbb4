"""Token buckets for ``[[limits]]``: at most ``rate_per_second`` messages per second to
one destination (a Kafka topic, an HTTP host), with bursts of up to ``burst``.

A bucket hands out *reservations*: ``reserve`` says how long the caller must wait
before sending, and books the token at once, so concurrent workers queue behind each
other instead of all waking up at the same instant. A message whose wait would exceed
what its batch can afford is not booked; the caller defers its row (attempt refunded)
and ``wait_for`` says when asking again makes sense.

The state is per process: N relay processes send up to N times the configured rate
(sharing one bucket through the database is not implemented). Pure arithmetic on a
monotonic clock the caller passes in, so every rule is tested without sleeping.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class TokenBucket:
    """``rate_per_second`` tokens a second, at most ``burst`` saved up. Thread-safe."""

    def __init__(self, rate_per_second: float, burst: int, *, now: float) -> None:
        if rate_per_second <= 0:
            raise ValueError("rate_per_second must be positive")
        if burst < 1:
            raise ValueError("burst must be at least 1")
        self.rate_per_second = float(rate_per_second)
        self.burst = int(burst)
        self._lock = threading.Lock()
        # Tokens available at ``_updated``; negative = that many already booked ahead.
        self._tokens = float(burst)
        self._updated = now
        self._paused_until = now  # a target's Retry-After: nothing is handed out before it

    def _refill(self, now: float) -> None:
        start = max(self._updated, self._paused_until)
        if now > start:
            self._tokens = min(float(self.burst), self._tokens + (now - start) * self.rate_per_second)
        self._updated = max(self._updated, now)

    def _wait_for_next(self, now: float) -> float:
        """Seconds from ``now`` until one more token is free (0 if one is)."""
        paused = max(0.0, self._paused_until - now)
        if self._tokens >= 1.0:
            return paused
        return paused + (1.0 - self._tokens) / self.rate_per_second

    def reserve(self, now: float, max_wait_seconds: float) -> float | None:
        """Book one token and return how long to wait before using it, or None (nothing
        booked) if that wait would be longer than ``max_wait_seconds``."""
        with self._lock:
            self._refill(now)
            wait = self._wait_for_next(now)
            if wait > max_wait_seconds:
                return None
            self._tokens -= 1.0
            return wait

    def wait_for(self, now: float, ahead: int = 0) -> float:
        """Seconds until a token would be free for the ``ahead``-th caller after the next
        (0 = the next one), without booking anything."""
        with self._lock:
            self._refill(now)
            return self._wait_for_next(now) + ahead / self.rate_per_second

    def paused_for(self, now: float) -> float:
        """Seconds the destination still asked to be left alone (0: not paused)."""
        with self._lock:
            return max(0.0, self._paused_until - now)

    def back_off(self, now: float, seconds: float) -> None:
        """The destination asked to be left alone for ``seconds`` (HTTP 429 with
        Retry-After): hand out nothing before then, and start again from an empty bucket."""
        with self._lock:
            self._refill(now)
            self._paused_until = max(self._paused_until, now + max(0.0, seconds))
            self._tokens = min(self._tokens, 0.0)


@dataclass(frozen=True, slots=True)
class LimitRule:
    """One ``[[limits]]`` entry: messages whose ``kind`` (``topic`` or ``host``) equals ``value``."""

    kind: str
    value: str
    rate_per_second: float
    burst: int

    @property
    def destination(self) -> str:
        """The metric label: ``topic:<name>`` or ``host:<name>``."""
        return f"{self.kind}:{self.value}"


class RateLimits:
    """The buckets of every configured limit, and which one a message falls under."""

    def __init__(self, rules: Sequence[LimitRule], *, now: float) -> None:
        self.rules = tuple(rules)
        self._by_key: dict[tuple[str, str], tuple[LimitRule, TokenBucket]] = {}
        for rule in self.rules:
            key = (rule.kind, rule.value.lower() if rule.kind == "host" else rule.value)
            if key in self._by_key:
                raise ValueError(f"two limits for {rule.destination}")
            self._by_key[key] = (rule, TokenBucket(rule.rate_per_second, rule.burst, now=now))

    def match(self, keys: Mapping[str, str]) -> tuple[LimitRule, TokenBucket] | None:
        """The limit for a message described by ``keys`` (``{"topic": ..., "host": ...}``);
        a host limit wins over a topic limit when both match."""
        for kind in ("host", "topic"):
            value = keys.get(kind)
            if value is None:
                continue
            found = self._by_key.get((kind, value.lower() if kind == "host" else value))
            if found is not None:
                return found
        return None
