"""A claimed row and a message in one line each, for unit tests of the pieces that read them."""

from __future__ import annotations

import datetime as dt

from outbox_relay.model import Claimed, Message


def message(i: int, key: str | None = None, event_type: str = "E") -> Message:
    return Message(
        id=i,
        topic="t",
        key="k",
        value="{}",
        headers=[("message_id", str(i))],
        aggregate_type="order",
        aggregate_id=key or f"agg-{i}",
        event_type=event_type,
        order_key=key,
    )


def claimed(**overrides: object) -> Claimed:
    values: dict[str, object] = dict(
        id=42,
        lease_version=3,
        attempts=2,
        aggregate_type="order",
        aggregate_id="order-7",
        event_type="OrderPaid",
        payload='{"a": 1}',
        topic=None,
        headers=None,
        created_at=dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
    )
    values.update(overrides)
    return Claimed(**values)  # type: ignore[arg-type]
