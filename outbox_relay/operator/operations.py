"""Operator actions shared by the CLI and the console: preview, chunked retry/skip with
an audit entry, and what holds an aggregate back.

Bulk changes never hold one long transaction: ``change_dead`` walks the matching
rows in id order, one bounded chunk per short autocommit statement (``SKIP LOCKED``,
so a row someone else is changing is passed over instead of waited for), and every
chunk adds its rows to the operation's audit entry in the same transaction, so the
audit trail stays exact even if the operation is interrupted.
"""

from __future__ import annotations

import datetime as dt
import getpass
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..core.filters import DeadFilter
from ..core.ordering import OrderingRule
from ..db.store import PARKED_FROM, Count, DeadSummary, OutboxStore

Action = Literal["retry", "skip"]
ACTIONS: tuple[Action, ...] = ("retry", "skip")
AUDIT_IDS_KEPT = 1000  # an audit entry lists at most this many ids (and how many there were)


def os_user() -> str:
    """Who runs the CLI, for the audit trail."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no LOGNAME/USER (some containers)
        return "unknown"


def selector_description(selector: DeadFilter) -> dict[str, Any]:
    """How an audit entry records what was asked for: ids, a filter, or everything."""
    if selector.ids is not None:
        ids = list(selector.ids)
        out: dict[str, Any] = {"ids": ids[:AUDIT_IDS_KEPT]}
        if len(ids) > AUDIT_IDS_KEPT:
            out["ids_count"] = len(ids)
        return out
    if not selector.has_conditions():
        return {"all": True, **({"limit": selector.limit} if selector.limit else {})}
    return {"filter": selector.describe()}


def jsonable(value: Any) -> Any:
    """A CLI/console result made JSON-serialisable (timestamps as ISO 8601)."""
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


@dataclass(slots=True)
class Preview:
    """What a retry/skip would change, before changing anything."""

    matched: Count
    summary: DeadSummary | None  # None: grouping ran out of time

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"matched": self.matched.n, "matched_exact": self.matched.exact}
        if self.summary is not None:
            out["by_event_type"] = dict(self.summary.by_event_type)
            out["aggregates"] = self.summary.aggregates
            out["sample_aggregates"] = self.summary.sample_aggregates
        return out


@dataclass(slots=True)
class ChangeResult:
    action: Action
    matched: Count
    changed: int = 0
    changed_ids: list[int] = field(default_factory=list)  # only for an id selection
    audit_id: int | None = None


def preview_dead(store: OutboxStore, selector: DeadFilter, *, budget_ms: int) -> Preview:
    matched = store.dead_count(selector, budget_ms=budget_ms)
    summary = store.dead_summary(selector, timeout_ms=budget_ms) if selector.limit is None else None
    return Preview(matched=matched, summary=summary)


def skip_reason_text(actor: str, reason: str | None) -> str:
    """What a skipped row's last_error says about why it was never published."""
    return f"skipped by {actor}: {reason}" if reason else f"skipped by {actor} (no reason given)"


MAX_REASON_CHARS = 1000


class OperatorRuleError(ValueError):
    """A retry/skip request that breaks one of the operator rules (``check_dead_change``);
    its message is one line, worded with the names the asking surface uses."""


@dataclass(frozen=True, slots=True)
class Wording:
    """How a surface names the inputs of a retry/skip, for the rule's error messages."""

    ids: str
    all_rows: str
    filters: str
    reason: str


CLI_WORDING = Wording(
    ids="dead row ids",
    all_rows="--all",
    filters="filters (--event-type, --aggregate-type, --aggregate-id, --error-contains, --since, --until)",
    reason="--reason",
)
API_WORDING = Wording(ids='"ids": [...]', all_rows='"all": true', filters='"filter": {...}', reason='"reason"')
FORM_WORDING = Wording(ids="scope=ids", all_rows="scope=all", filters="scope=filter", reason="the reason field")


def check_dead_change(
    action: Action, *, ids: bool, all_rows: bool, filtered: bool, reason: str | None, dry_run: bool, wording: Wording
) -> str | None:
    """The rules of every retry/skip, whichever surface asks (CLI, console form, API):

    - exactly one selection: row ids, all dead rows, or a filter (never two: "ids and a
      filter" has no single meaning, and never none: an empty request must not mean all);
    - a skip that changes rows needs a reason (it marks rows done that were never
      published: the audit trail and each row's last_error say why); a dry run needs none;
    - a reason is at most ``MAX_REASON_CHARS`` characters.

    Returns the reason as recorded (stripped; None when none was given), or raises
    ``OperatorRuleError``."""
    if sum((ids, all_rows, filtered)) != 1:
        raise OperatorRuleError(f"give exactly one of {wording.ids}, {wording.all_rows} or {wording.filters}")
    cleaned = reason.strip() if reason else None
    if cleaned and len(cleaned) > MAX_REASON_CHARS:
        raise OperatorRuleError(f"{wording.reason} must be at most {MAX_REASON_CHARS} characters")
    if action == "skip" and not dry_run and not cleaned:
        raise OperatorRuleError(
            f"say why these rows are skipped ({wording.reason}): the reason is recorded "
            "in the audit trail and in each row's last_error"
        )
    return cleaned or None


def change_dead(
    store: OutboxStore,
    action: Action,
    selector: DeadFilter,
    *,
    actor: str,
    source: str,
    reason: str | None,
    chunk_size: int = 1000,
    budget_ms: int = 10_000,
    matched: Count | None = None,
    progress: Callable[[int], None] | None = None,
    keep_ids: bool = False,
) -> ChangeResult:
    """Retry or skip the dead rows ``selector`` matches, chunk by chunk, audited.

    ``matched``: a count already made (e.g. by a preview); counted here otherwise.
    ``progress(n)`` is called after each chunk with the rows it changed.
    """
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}")
    store.require_audit_table()
    if matched is None:
        matched = store.dead_count(selector, budget_ms=budget_ms)
    audit_id = store.audit_begin(
        actor=actor,
        source=source,
        action=action,
        selector=selector_description(selector),
        rows_matched=matched.n if matched.exact else None,
        reason=reason,
    )
    result = ChangeResult(action=action, matched=matched, audit_id=audit_id)
    reason_text = skip_reason_text(actor, reason) if action == "skip" else None
    after_id = 0
    try:
        while True:
            size = chunk_size
            if selector.limit is not None:
                size = min(size, selector.limit - result.changed)
                if size <= 0:
                    break
            ids = store.dead_change_chunk(
                action, selector, after_id=after_id, chunk=size, audit_id=audit_id, reason=reason_text
            )
            result.changed += len(ids)
            if keep_ids:
                result.changed_ids.extend(ids)
            if progress is not None:
                progress(len(ids))
            if len(ids) < size:
                break
            after_id = ids[-1]
    finally:
        store.audit_finish(audit_id)
    return result


# --- what holds an aggregate back -------------------------------------------------------
# Which rows are ordered is decided by ``OrderingRule.is_ordered``, the rule the claim uses.
def _ago(moment: dt.datetime, now: dt.datetime) -> str:
    seconds = (moment - now).total_seconds()
    return f"in {seconds:.0f}s" if seconds >= 0 else f"{-seconds:.0f}s ago"


def row_state(row: dict[str, Any]) -> str:
    """One row's state in words (pending rows: due or not; processing: lease)."""
    now = row["database_now"]
    if row["status"] == "dead":
        return "dead"
    if row["status"] == "processing":
        if row["lease_expired"]:
            return f"lease expired {_ago(row['lease_until'], now)} ({row['lease_owner']}): will be claimed again"
        return f"in flight: {row['lease_owner']}, lease ends {_ago(row['lease_until'], now)}"
    if row["not_due"] and row["available_at"] >= PARKED_FROM:
        return "paused by an operator: parked until `outbox-relay resume` (see `outbox-relay pauses`)"
    if row["not_due"]:
        return f"not yet due: {_ago(row['available_at'], now)}"
    return "due: the next claim takes it"


def row_states(rows: list[dict[str, Any]], ordering: OrderingRule) -> list[str]:
    """Each row's state; an ordered row behind its aggregate's head waits for that head."""
    head_id: int | None = None
    states = []
    for row in rows:
        ordered = ordering.is_ordered(row["event_type"])
        if ordered and head_id is None:
            head_id = row["id"]
            states.append(row_state(row))
        elif ordered and row["status"] == "pending":
            states.append(f"waits behind head {head_id}")
        elif ordered and row["status"] == "dead":
            states.append(f"dead (behind head {head_id})")
        else:
            states.append(row_state(row))
    return states


def blocking_head(rows: list[dict[str, Any]], ordering: OrderingRule) -> int | None:
    """The id of the aggregate's dead head, if that is what blocks it."""
    ordered = [r for r in rows if ordering.is_ordered(r["event_type"])]
    return ordered[0]["id"] if ordered and ordered[0]["status"] == "dead" else None


def diagnose_aggregate(rows: list[dict[str, Any]], ordering: OrderingRule, *, max_attempts: int) -> str:
    """What decides when this aggregate's unfinished rows move on, in one sentence."""
    if not rows:
        return "nothing unfinished: every row of this aggregate is done (or purged)"
    ordered = [r for r in rows if ordering.is_ordered(r["event_type"])]
    if not ordered:
        return (
            "not ordered: none of these event types is in relay.ordered_event_types, "
            "so each row is delivered on its own (see each row's state)"
        )
    head = ordered[0]
    waiting = len(ordered) - 1
    behind = f"; {waiting} ordered row(s) wait behind it" if waiting else ""
    now = head["database_now"]
    if head["status"] == "dead":
        return (
            f"blocked by dead head {head['id']} ({head['event_type']}): retry it "
            f"(`outbox-relay dead retry {head['id']}`) or skip it (`outbox-relay dead skip {head['id']} "
            f"--reason ...`){behind}"
        )
    if head["status"] == "processing":
        if head["lease_expired"]:
            fate = (
                "goes dead at the next claim (attempts used up)"
                if head["attempts"] >= max_attempts
                else "the next claim takes it again"
            )
            return f"head {head['id']} lost its lease {_ago(head['lease_until'], now)}: {fate}{behind}"
        return (
            f"head {head['id']} is in flight ({head['lease_owner']}, lease ends "
            f"{_ago(head['lease_until'], now)}){behind}"
        )
    if head["not_due"] and head["available_at"] >= PARKED_FROM:
        return (
            f"head {head['id']} ({head['event_type']}) is paused by an operator: parked until "
            f"`outbox-relay resume` (see `outbox-relay pauses`){behind}"
        )
    if head["not_due"]:
        return (
            f"head {head['id']} is not yet due (retry backoff or delay): due "
            f"{_ago(head['available_at'], now)}, attempts {head['attempts']}/{max_attempts}{behind}"
        )
    return f"head {head['id']} is due: the next claim takes it{behind}"
