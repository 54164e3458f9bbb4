"""What keeps vacuum from cleaning the outbox, and how vacuum keeps up.

A queue table lives by vacuum: every delivered event leaves dead row versions (and
dead entries in the claim's indexes) that only vacuum removes, and vacuum removes
nothing newer than the oldest xmin horizon of the database. One long transaction, a
forgotten prepared transaction or a replication slot fed by a standby's
``hot_standby_feedback`` holds that horizon back; the table and its indexes then grow
for as long as it stays. This module names the holder (sql/monitoring.sql
``xmin_horizon_holders``) for the gauge ``outbox_relay_xmin_horizon_age_seconds``,
``status``, the console and the warning log line, and reads the table's vacuum figures
(``vacuum_figures``).

Ages are seconds since the holder began: a backend's transaction start, a prepared
transaction's PREPARE. A replication slot (and a walsender without one) records no
time: a long-running process (relay, console) counts from when it first saw the slot
at its current xmin, a lower bound; a one-shot ``status`` says the age is unknown.
Without ``pg_read_all_stats`` (or ``pg_monitor``) PostgreSQL hides other roles'
transaction start times: when such a session holds the horizon the age is unknown
(the gauge is NaN, ``status`` says what to grant), never 0.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

NOT_VISIBLE_HINT = (
    "not visible: another role's session holds the horizon and this role may not read "
    "its transaction start; grant pg_read_all_stats (or pg_monitor) to this role "
    "(`outbox-relay grants` prints it)"
)


@dataclass(slots=True)
class XminHolder:
    """One backend, prepared transaction or replication slot holding the horizon back."""

    kind: str  # backend | prepared | slot
    horizon_xid: str
    age_xids: int
    age_seconds: float | None  # None: unknown (a slot; a hidden backend)
    age_is_lower_bound: bool = False  # counted from when this process first saw it
    visible: bool = True
    pid: int | None = None
    user: str | None = None
    application_name: str | None = None
    state: str | None = None
    backend_type: str | None = None
    xact_start: dt.datetime | None = None
    prepared_at: dt.datetime | None = None
    gid: str | None = None
    slot_name: str | None = None
    slot_type: str | None = None
    slot_active: bool | None = None

    def describe(self) -> str:
        """One line for a human: what it is and how to end it."""
        if self.kind == "prepared":
            return f"prepared transaction gid={self.gid!r} owner={self.user} prepared at {_iso(self.prepared_at)}"
        if self.kind == "slot":
            active = f"active, walsender pid {self.pid}" if self.slot_active else "inactive"
            return f"replication slot {self.slot_name!r} ({self.slot_type}, {active}) xmin {self.horizon_xid}"
        if not self.visible:
            return (
                f"backend pid {self.pid} (user {self.user}, application {self.application_name!r}; {NOT_VISIBLE_HINT})"
            )
        what = "walsender (standby hot_standby_feedback)" if self.backend_type == "walsender" else "backend"
        return (
            f"{what} pid {self.pid} user {self.user} application {self.application_name!r} state {self.state} "
            f"transaction started {_iso(self.xact_start)}"
        )

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "age_seconds": _round(self.age_seconds),
            "age_is_lower_bound": self.age_is_lower_bound,
            "age_xids": self.age_xids,
            "horizon_xid": self.horizon_xid,
        }
        if self.kind == "backend":
            out.update(
                pid=self.pid,
                user=self.user,
                application_name=self.application_name,
                state=self.state,
                backend_type=self.backend_type,
                xact_start=_iso(self.xact_start),
                visible=self.visible,
            )
        elif self.kind == "prepared":
            out.update(gid=self.gid, owner=self.user, prepared_at=_iso(self.prepared_at))
        else:
            out.update(slot_name=self.slot_name, slot_type=self.slot_type, active=self.slot_active, active_pid=self.pid)
        return out


@dataclass(slots=True)
class XminHorizon:
    """The oldest holder (``holders[0]``) and the others, oldest first."""

    holders: list[XminHolder] = field(default_factory=list)

    @property
    def holder(self) -> XminHolder | None:
        return self.holders[0] if self.holders else None

    @property
    def age_seconds(self) -> float:
        """The gauge: 0 when nothing holds the horizon, NaN when the oldest holder's age
        cannot be seen (never a reassuring 0 for what is hidden)."""
        holder = self.holder
        if holder is None:
            return 0.0
        return float("nan") if holder.age_seconds is None else holder.age_seconds

    def note(self) -> str | None:
        holder = self.holder
        if holder is None:
            return None
        if not holder.visible:
            return NOT_VISIBLE_HINT
        if holder.age_seconds is None:
            return "age unknown: a replication slot records no time (its age in transactions is shown)"
        if holder.age_is_lower_bound:
            return "age counted from when this process first saw the slot at this xmin (a lower bound)"
        return None

    def as_json(self) -> dict[str, Any]:
        holder = self.holder
        age = self.age_seconds
        return {
            "age_seconds": None if math.isnan(age) else round(age, 1),
            "age_xids": holder.age_xids if holder else 0,
            "holder": holder.as_json() if holder else None,
            "note": self.note(),
            "others": [h.as_json() for h in self.holders[1:]],
        }

    def summary(self) -> str:
        """One line for `status` and the console."""
        holder = self.holder
        if holder is None:
            return "nothing holds it back"
        age = "unknown" if holder.age_seconds is None else f"{holder.age_seconds:.0f}s"
        if holder.age_is_lower_bound:
            age = "at least " + age
        return f"{age} ({holder.age_xids} transactions) held by {holder.describe()}"


@dataclass(slots=True)
class VacuumFigures:
    dead_tuples: int
    live_tuples: int
    heap_bytes: int
    index_bytes: int
    since_vacuum_seconds: float | None  # None: never vacuumed
    vacuums: int

    def as_json(self) -> dict[str, Any]:
        return {
            "dead_tuples": self.dead_tuples,
            "live_tuples": self.live_tuples,
            "heap_bytes": self.heap_bytes,
            "index_bytes": self.index_bytes,
            "since_vacuum_seconds": _round(self.since_vacuum_seconds),
            "vacuums": self.vacuums,
        }


def holders_from_rows(rows: list[dict[str, Any]]) -> list[XminHolder]:
    """sql/monitoring.sql ``xmin_horizon_holders`` rows -> holders (ages as the database gave them)."""
    return [
        XminHolder(
            kind=str(r["kind"]),
            horizon_xid=str(r["horizon_xid"]),
            age_xids=int(r["age_xids"]),
            age_seconds=float(r["held_seconds"]) if r["held_seconds"] is not None else None,
            visible=bool(r["visible"]),
            pid=r["pid"],
            user=r["user_name"],
            application_name=r["application_name"],
            state=r["state"],
            backend_type=r["backend_type"],
            xact_start=r["xact_start"],
            prepared_at=r["prepared_at"],
            gid=r["gid"],
            slot_name=r["slot_name"],
            slot_type=r["slot_type"],
            slot_active=r["slot_active"],
        )
        for r in rows
    ]


class HorizonClock:
    """First-seen times of holders that record no time of their own (slots, walsenders),
    kept by a long-running process: their age is counted from when it first saw them
    at their current xmin (a lower bound). Thread-safe."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._first_seen: dict[tuple[str, str, str], float] = {}
        self._lock = threading.Lock()

    def apply(self, holders: list[XminHolder]) -> list[XminHolder]:
        now = self._clock()
        seen: dict[tuple[str, str, str], float] = {}
        with self._lock:
            for holder in holders:
                if holder.age_seconds is not None or not holder.visible:
                    continue
                key = (holder.kind, str(holder.slot_name or holder.pid), holder.horizon_xid)
                first = self._first_seen.get(key, now)
                seen[key] = first
                holder.age_seconds = now - first
                holder.age_is_lower_bound = True
            self._first_seen = seen  # forget holders that went away or moved on
        return holders


class HorizonWarning:
    """One warning log line when the horizon's age crosses the threshold, one info line
    when it is back below; nothing in between (the gauge and the alert carry the rest)."""

    def __init__(self, threshold_seconds: float, logger: Any) -> None:
        self._threshold = threshold_seconds
        self._log = logger
        self._above = False

    def observe(self, horizon: XminHorizon, *, table: str) -> None:
        age = horizon.age_seconds
        holder = horizon.holder
        if self._threshold <= 0:
            return
        above = holder is not None and (math.isnan(age) or age >= self._threshold)
        if above and not self._above:
            assert holder is not None
            self._log.warning(
                "the xmin horizon is old: vacuum cannot remove the outbox's dead rows, the table and its "
                "indexes grow until the holder ends",
                table=table,
                age_seconds=None if math.isnan(age) else round(age, 1),
                age_xids=holder.age_xids,
                threshold_seconds=self._threshold,
                holder=holder.describe(),
                **_holder_fields(holder),
                runbook="docs/how-to/vacuum-runbook.md",
            )
        elif not above and self._above:
            self._log.info(
                "the xmin horizon is recent again", table=table, age_seconds=None if math.isnan(age) else round(age, 1)
            )
        self._above = above


def _holder_fields(holder: XminHolder) -> dict[str, Any]:
    if holder.kind == "backend":
        return {
            "holder_pid": holder.pid,
            "holder_user": holder.user,
            "holder_application_name": holder.application_name,
            "holder_state": holder.state,
        }
    if holder.kind == "prepared":
        return {"holder_gid": holder.gid}
    return {"holder_slot": holder.slot_name}


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _round(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else round(value, 1)
