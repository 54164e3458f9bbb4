"""Which dead rows an operator means: ``DeadFilter``, shared by the CLI and the console.

A filter is parsed once from text (CLI options, query parameters, JSON) into values
that are always sent to PostgreSQL as bound parameters (see "dead_filter" in
db/sql/operator.sql), never formatted into SQL. Relative times (``--since 2h``) are resolved
once against the database's clock, so every chunk of a bulk change and the audit
entry see the same absolute bounds.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..config import parse_duration

# The filter names of the CLI (--event-type …) and of the console's JSON API (event_type …).
FILTER_NAMES = ("event_type", "aggregate_type", "aggregate_id", "error_contains", "since", "until", "limit")
MAX_TEXT_CHARS = 1000  # a longer filter value is a mistake (or an attack), not a query


@dataclass(frozen=True, slots=True)
class DeadFilter:
    """Dead rows matching every condition that is set (None = any)."""

    ids: tuple[int, ...] | None = None
    event_type: str | None = None
    aggregate_type: str | None = None
    aggregate_id: str | None = None
    error_contains: str | None = None
    since: dt.datetime | None = None  # created_at >= since
    until: dt.datetime | None = None  # created_at < until
    limit: int | None = None  # at most this many rows (the oldest by id)

    def has_conditions(self) -> bool:
        """True if anything but ``limit`` narrows the rows (else: every dead row)."""
        return any(getattr(self, f.name) is not None for f in fields(self) if f.name != "limit")

    def sql_params(self) -> dict[str, Any]:
        """The bound parameters of the "dead_filter" predicate."""
        return {
            "ids": list(self.ids) if self.ids is not None else None,
            "event_type": self.event_type,
            "aggregate_type": self.aggregate_type,
            "aggregate_id": self.aggregate_id,
            "error_contains": self.error_contains,
            "since": self.since,
            "until": self.until,
        }

    def describe(self) -> dict[str, Any]:
        """The conditions that are set, JSON-ready (audit entries, API answers)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "ids":
                continue
            out[f.name] = value.isoformat() if isinstance(value, dt.datetime) else value
        return out


def parse_time_bound(text: str, now: Callable[[], dt.datetime]) -> dt.datetime:
    """``2h`` (that long ago, by the database's clock) or an ISO 8601 date/time.

    A time without a zone is UTC (the database stores timestamptz).
    """
    text = text.strip()
    try:
        seconds = parse_duration(text)
    except ValueError:
        pass
    else:
        return now() - dt.timedelta(seconds=seconds)
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"invalid time {text!r}: use a duration ago (30m, 2h, 7d) or a timestamp (2025-01-31T12:00:00+00:00)"
        ) from None
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


def parse_filter(values: Mapping[str, Any], now: Callable[[], dt.datetime]) -> DeadFilter:
    """Build a filter from text values keyed by FILTER_NAMES (empty = not set).

    Raises ValueError with a message naming the offending filter.
    """
    unknown = sorted(set(values) - set(FILTER_NAMES))
    if unknown:
        raise ValueError(f"unknown filter {unknown[0]!r} (filters: {', '.join(FILTER_NAMES)})")
    parsed: dict[str, Any] = {}
    for name in FILTER_NAMES:
        raw = values.get(name)
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            continue
        if name == "limit":
            try:
                limit = int(raw)
            except (TypeError, ValueError):
                raise ValueError(f"limit: {raw!r} is not a whole number") from None
            if limit < 1:
                raise ValueError("limit: must be at least 1")
            parsed[name] = limit
            continue
        if not isinstance(raw, str):
            raise ValueError(f"{name}: expected text, got {type(raw).__name__}")
        if len(raw) > MAX_TEXT_CHARS:
            raise ValueError(f"{name}: longer than {MAX_TEXT_CHARS} characters")
        if name in ("since", "until"):
            try:
                parsed[name] = parse_time_bound(raw, now)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        else:
            parsed[name] = raw
    result = DeadFilter(**parsed)
    if result.since and result.until and result.since >= result.until:
        raise ValueError("since must be before until")
    return result
