"""Per-table autovacuum settings for a queue table, as ``migrate`` applies them.

PostgreSQL's autovacuum defaults suit ordinary tables: vacuum once 20 % of the rows
are dead (``autovacuum_vacuum_scale_factor = 0.2``), throttled by a cost delay. A
queue table turns every event into dead row versions within seconds (the pending
version when it is claimed, the processing version when it is finalized), and a
keep-mode outbox holds millions of done rows, so 20 % of it is millions of dead
versions before vacuum starts. So ``migrate`` sets, on the outbox only:

- ``autovacuum_vacuum_scale_factor = 0`` and ``autovacuum_vacuum_threshold = 1000``:
  vacuum after a fixed number of dead versions, whatever the table's size;
- ``autovacuum_vacuum_cost_delay = 0``: the outbox's vacuum is not throttled (its
  working set is small and hot: the pages of recent events).

Analyze and insert-driven vacuum stay on PostgreSQL's defaults: every row is updated
soon after its insert, so the dead-version trigger above already fires, and the
claim's plans do not depend on fresh statistics (see delivery.sql "statement_settings").

Who decides: a key in ``database.autovacuum`` is the operator's value and is applied by
every ``migrate`` (the value ``"default"`` removes the parameter: PostgreSQL's default
then applies). A built-in value is applied only where the table has no value of its
own, or still has the one migrate set last time (recorded in the state table), so an
operator's own ``ALTER TABLE ... SET (...)`` is never overwritten, and a parameter an
operator RESET stays reset.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..config import check_autovacuum_overrides

#: What migrate sets on the outbox unless the operator decides otherwise.
QUEUE_AUTOVACUUM: dict[str, str] = {
    "autovacuum_vacuum_scale_factor": "0",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_vacuum_cost_delay": "0",
}
#: ``database.autovacuum`` value meaning "PostgreSQL's default" (the parameter is reset).
POSTGRES_DEFAULT = "default"
#: Recorded for a parameter the operator reset after migrate had set it: left alone.
OPERATOR_RESET = ""

# Validated where the setting is read (config.py); migrate validates again.
check_overrides = check_autovacuum_overrides


@dataclass(frozen=True, slots=True)
class Change:
    parameter: str
    value: str | None  # None: RESET
    why: str


def plan(
    current: Mapping[str, str], applied: Mapping[str, str], overrides: Mapping[str, str]
) -> tuple[list[Change], dict[str, str], list[str]]:
    """What migrate changes on the table: (changes, the new record of what migrate set,
    notes on values kept). ``current``: the table's own autovacuum parameters;
    ``applied``: what migrate recorded last time; ``overrides``: ``database.autovacuum``."""
    changes: list[Change] = []
    record = dict(applied)
    kept: list[str] = []
    for name in sorted(set(QUEUE_AUTOVACUUM) | set(overrides)):
        have = current.get(name)
        if name in overrides:  # the operator's configured value: always
            want = overrides[name]
            if want == POSTGRES_DEFAULT:
                if have is not None:
                    changes.append(Change(name, None, "database.autovacuum says default"))
                record.pop(name, None)
            else:
                if have != want:
                    changes.append(Change(name, want, "database.autovacuum"))
                record[name] = want
            continue
        want = QUEUE_AUTOVACUUM[name]
        last = applied.get(name)
        if last == OPERATOR_RESET:
            continue  # reset by an operator after migrate had set it: theirs
        if have is None and last is not None:
            record[name] = OPERATOR_RESET
            kept.append(f"{name} (reset by an operator: left at PostgreSQL's default)")
            continue
        if have is None or have == last:
            if have != want:
                changes.append(Change(name, want, "queue table default"))
            record[name] = want
        else:
            record.pop(name, None)
            kept.append(f"{name} = {have} (the table's own value, kept)")
    return changes, record, kept


def parse_reloptions(reloptions: list[str] | None) -> dict[str, str]:
    """pg_class.reloptions ("name=value" strings) -> {name: value}."""
    out: dict[str, str] = {}
    for option in reloptions or []:
        name, _, value = option.partition("=")
        out[name] = value
    return out
