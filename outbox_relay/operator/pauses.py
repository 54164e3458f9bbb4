"""Operator pauses: hold back the delivery of some rows of an outbox, then resume it.
The rules shared by the CLI (`outbox-relay pause|resume|pauses`), the console's pause
page and its JSON API.

A pause selects rows by exactly one of event type, topic (the row's ``topic`` column)
or aggregate type, and is stored in the outbox's pauses table (migration step 9), so
every relay of that outbox honours it at its next claim: the claim statements read the
active pauses and take no row they match. A pause then *parks* the matching pending
rows (their available_at moves about 1000 years forward, exactly reversibly; attempts
and lease_version untouched), so that however many are held back the claim never reads
them; rows that become due later (inserted after the pause, or a failed delivery
rescheduled) are parked by the claim that meets them. A resume ends the pause and
gives the parked rows their original available_at back: they come due in their old
order. Rows in flight when the pause is made are delivered; rows whose lease had
expired (their relay died) are parked as pending rows, fenced by a new lease_version.

Ordered aggregates (relay.ordered_event_types): a paused row of an ordered event type
that is its aggregate's head holds the whole aggregate back (its later ordered rows,
of every event type, wait behind it as they would behind a row in retry backoff), so
no later row overtakes a paused one. Unordered rows of the aggregate are not held back.

Told apart from the circuit breaker's automatic pause: that one is a state of one
relay process (the broker is failing), not stored, shown as
``outbox_relay_circuit_breaker_open`` and logged as "circuit breaker"; an operator
pause is stored, shown by `status`, the console and ``outbox_relay_operator_pauses``
/ ``outbox_relay_paused_rows``, and logged as "operator pause".
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ..db.store import ChunkStep, OutboxStore, PauseRow
from .operations import MAX_REASON_CHARS, OperatorRuleError

Selector = Literal["event_type", "topic", "aggregate_type"]
SELECTORS: tuple[Selector, ...] = ("event_type", "topic", "aggregate_type")
MAX_VALUE_CHARS = 1000
DEFAULT_CHUNK_ROWS = 5000


@dataclass(frozen=True, slots=True)
class PauseWording:
    """How a surface names the inputs of a pause/resume, for the rules' error messages."""

    selectors: str
    reason: str
    pause_id: str


CLI_PAUSE_WORDING = PauseWording(
    selectors="--event-type, --topic or --aggregate-type", reason="--reason", pause_id="a pause id"
)
API_PAUSE_WORDING = PauseWording(
    selectors='"event_type", "topic" or "aggregate_type"', reason='"reason"', pause_id='"id"'
)
FORM_PAUSE_WORDING = PauseWording(selectors="a selector and its value", reason="the reason field", pause_id="a pause")


@dataclass(frozen=True, slots=True)
class PauseTarget:
    """What a pause holds back: one selector and its value."""

    selector: Selector
    value: str

    def describe(self) -> str:
        return f"{self.selector.replace('_', ' ')} {self.value!r}"

    def as_json(self) -> dict[str, str]:
        return {self.selector: self.value}


def check_pause_target(given: dict[str, str | None], wording: PauseWording) -> PauseTarget:
    """The one selector a pause (or a resume by selector) names: exactly one of
    event_type, topic or aggregate_type, a non-empty value of at most
    ``MAX_VALUE_CHARS`` characters. Raises ``OperatorRuleError``."""
    named = {k: v for k, v in given.items() if v is not None}
    unknown = set(named) - set(SELECTORS)
    if unknown:
        raise OperatorRuleError(f"unknown selector {sorted(unknown)[0]!r}: use {wording.selectors}")
    if len(named) != 1:
        raise OperatorRuleError(f"give exactly one of {wording.selectors}")
    ((selector, value),) = named.items()
    value = value.strip() if isinstance(value, str) else value
    if not isinstance(value, str) or not value:
        raise OperatorRuleError(f"{selector.replace('_', ' ')} must be a non-empty text")
    if len(value) > MAX_VALUE_CHARS:
        raise OperatorRuleError(f"{selector.replace('_', ' ')} must be at most {MAX_VALUE_CHARS} characters")
    return PauseTarget(selector, value)  # type: ignore[arg-type]  # checked against SELECTORS above


def check_pause(given: dict[str, str | None], reason: str | None, wording: PauseWording) -> tuple[PauseTarget, str]:
    """The rules of every pause, whichever surface asks: exactly one selector
    (``check_pause_target``) and a reason (a pause holds back events other teams wait
    for: the audit trail and `status` say why), at most ``MAX_REASON_CHARS``."""
    target = check_pause_target(given, wording)
    cleaned = reason.strip() if reason else ""
    if not cleaned:
        raise OperatorRuleError(f"say why delivery is paused ({wording.reason}): `status` and the audit trail show it")
    if len(cleaned) > MAX_REASON_CHARS:
        raise OperatorRuleError(f"{wording.reason} must be at most {MAX_REASON_CHARS} characters")
    return target, cleaned


def check_resume(
    pause_id: int | None, given: dict[str, str | None], wording: PauseWording
) -> tuple[int | None, PauseTarget | None]:
    """A resume names either a pause by its id or the selector it was made with, not both."""
    named = {k: v for k, v in given.items() if v is not None}
    if pause_id is not None and named:
        raise OperatorRuleError(f"give {wording.pause_id} or {wording.selectors}, not both")
    if pause_id is not None:
        if pause_id <= 0:
            raise OperatorRuleError(f"{wording.pause_id} must be a positive integer")
        return pause_id, None
    if not named:
        raise OperatorRuleError(f"give {wording.pause_id} or one of {wording.selectors}")
    return None, check_pause_target(given, wording)


def check_resume_reason(reason: str | None, wording: PauseWording) -> str | None:
    """A resume's reason is optional; as recorded: stripped, None when empty, at most
    ``MAX_REASON_CHARS``."""
    cleaned = reason.strip() if reason else ""
    if len(cleaned) > MAX_REASON_CHARS:
        raise OperatorRuleError(f"{wording.reason} must be at most {MAX_REASON_CHARS} characters")
    return cleaned or None


@dataclass(slots=True)
class PauseResult:
    pause: PauseRow
    audit_id: int
    rows_parked: int = 0
    rows_unparked: int = 0
    resumed: bool = False

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pause": pause_json(self.pause), "audit_id": self.audit_id}
        if self.resumed:
            out["rows_unparked"] = self.rows_unparked
        else:
            out["rows_parked"] = self.rows_parked
        return out


def pause_json(pause: PauseRow) -> dict[str, Any]:
    """A pause as the CLI's --json, `status --json` and the console API show it."""
    return {
        "id": pause.id,
        "kind": "operator",  # never the circuit breaker's (not stored, per process)
        "selector": pause.selector,
        "value": pause.value,
        "reason": pause.reason,
        "paused_by": pause.paused_by,
        "paused_from": pause.paused_from,
        "paused_at": pause.paused_at.isoformat(),
        "active": pause.resumed_at is None,
        "resumed_at": pause.resumed_at.isoformat() if pause.resumed_at else None,
        "resumed_by": pause.resumed_by,
    }


class AlreadyPaused(OperatorRuleError):
    """The same selector and value is paused already."""


class NoSuchPause(OperatorRuleError):
    """No active pause with that id or selector."""


def _walk(step: Callable[[tuple[dt.datetime, int] | None], ChunkStep], progress: Callable[[int], None] | None) -> int:
    moved = 0
    after: tuple[dt.datetime, int] | None = None
    while True:
        result = step(after)
        moved += result.moved
        if progress is not None and result.moved:
            progress(result.moved)
        if result.finished:
            return moved
        after = result.after


def pause(
    store: OutboxStore,
    target: PauseTarget,
    *,
    reason: str,
    actor: str,
    source: str,
    max_attempts: int,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    progress: Callable[[int], None] | None = None,
) -> PauseResult:
    """Record the pause (every relay's next claim honours it), audit it, then park the
    matching pending rows chunk by chunk, and the matching rows whose lease expired
    with attempts left (below ``max_attempts``, relay.max_attempts) as pending rows
    (rows_changed of the audit entry: rows parked)."""
    store.require_pauses_table()
    store.require_audit_table()
    row = store.pause_insert(selector=target.selector, value=target.value, reason=reason, actor=actor, source=source)
    if row is None:
        raise AlreadyPaused(f"{target.describe()} is paused already (see `outbox-relay pauses`)")
    audit_id = store.audit_begin(
        actor=actor,
        source=source,
        action="pause",
        selector=dict(target.as_json(), pause_id=row.id),
        rows_matched=None,
        reason=reason,
    )
    result = PauseResult(pause=row, audit_id=audit_id)
    try:
        result.rows_parked = _walk(
            lambda after: store.park_chunk(
                selector=target.selector, value=target.value, after=after, chunk=chunk_size, audit_id=audit_id
            ),
            progress,
        )
        result.rows_parked += _walk(
            lambda _after: store.park_expired_chunk(
                selector=target.selector,
                value=target.value,
                max_attempts=max_attempts,
                chunk=chunk_size,
                audit_id=audit_id,
            ),
            progress,
        )
    finally:
        store.audit_finish(audit_id)
    return result


def resume(
    store: OutboxStore,
    *,
    pause_id: int | None,
    target: PauseTarget | None,
    actor: str,
    source: str,
    reason: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_ROWS,
    progress: Callable[[int], None] | None = None,
) -> PauseResult:
    """End the pause (by id or selector), audit it, then give its parked rows their
    original available_at back, chunk by chunk (rows another active pause still matches
    stay parked)."""
    store.require_pauses_table()
    store.require_audit_table()
    ended = store.pause_end(
        actor=actor,
        pause_id=pause_id,
        selector=target.selector if target else None,
        value=target.value if target else None,
    )
    if ended is None:
        what = f"pause {pause_id}" if pause_id is not None else (target.describe() if target else "")
        raise NoSuchPause(f"no active pause of {what} (see `outbox-relay pauses`)")
    audit_id = store.audit_begin(
        actor=actor,
        source=source,
        action="resume",
        selector={ended.selector: ended.value, "pause_id": ended.id},
        rows_matched=None,
        reason=reason,
    )
    result = PauseResult(pause=ended, audit_id=audit_id, resumed=True)
    try:
        result.rows_unparked = _walk(
            lambda after: store.unpark_chunk(
                selector=ended.selector, value=ended.value, after=after, chunk=chunk_size, audit_id=audit_id
            ),
            progress,
        )
    finally:
        store.audit_finish(audit_id)
    return result


def pause_overview(store: OutboxStore, *, count_cap: int, timeout_ms: int | None = None) -> dict[str, Any]:
    """The active operator pauses of one outbox and how many pending rows are parked
    (a lower bound when it reaches ``count_cap``), for `status`, the console and the API.
    A table that migrate has not given a pauses table yet has none."""
    if not store.pauses_table_exists():
        return {"active": [], "paused_rows": 0, "paused_rows_capped": False, "migrated": False}
    active = store.pauses()
    parked = store.paused_rows(count_cap=count_cap, timeout_ms=timeout_ms)
    return {
        "active": [pause_json(p) for p in active],
        "paused_rows": parked,
        "paused_rows_capped": parked is not None and parked >= count_cap,  # None: not counted within the budget
        "migrated": True,
    }
