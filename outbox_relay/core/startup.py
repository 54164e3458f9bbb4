"""The error a start-up gives up with: every dependency still down, in one line.

``relay.startup_timeout_seconds`` bounds how long ``run`` waits for what it needs. When
it runs out, the operator must learn everything that is still missing at once (the
database *and* the broker), not one of them now and the next after another restart.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import BrokerUnavailable, DatabaseUnavailable, OutboxRelayError, SchemaMissing

#: The order dependencies are named in, and the words that introduce each one.
DEPENDENCY_LABELS = {"database": "database", "target": "broker"}


def startup_gave_up(problems: Mapping[str, str], timeout_seconds: float) -> OutboxRelayError:
    """``problems`` maps "database" and/or "target" (the publisher's broker or endpoint)
    to why each is not ready. The error's type is the database's when it is among them
    (``SchemaMissing`` for a table that is not there), else the broker's; the message
    names every one, each problem collapsed to one line."""
    if not problems:
        raise ValueError("startup_gave_up needs at least one problem")
    ordered = sorted(problems.items(), key=lambda item: list(DEPENDENCY_LABELS).index(item[0]))
    parts = [f"{DEPENDENCY_LABELS[name]}: {' '.join(problem.split())}" for name, problem in ordered]
    down = " and ".join(DEPENDENCY_LABELS[name] for name, _ in ordered)
    message = (
        f"not ready within relay.startup_timeout_seconds ({timeout_seconds:g} s), "
        f"{down} still down: " + "; ".join(parts)
    )
    database = problems.get("database")
    if database is None:
        return BrokerUnavailable(message)
    if database.startswith("table "):
        return SchemaMissing(message)
    return DatabaseUnavailable(message)
