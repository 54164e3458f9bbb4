"""enqueue()'s tombstone, partition and payload_bytes arguments are checked before anything is written."""

from __future__ import annotations

from typing import Any

import pytest

from outbox_relay import enqueue


def call(**extra: Any) -> None:
    extra.setdefault("payload", None)
    enqueue(None, aggregate_type="customer", aggregate_id="c-1", event_type="CustomerErased", **extra)  # type: ignore[arg-type]


def test_a_tombstone_carries_no_payload():
    with pytest.raises(ValueError, match="a tombstone carries no payload: pass payload=None"):
        call(tombstone=True, payload={"name": "x"})


@pytest.mark.parametrize("partition", [-1, 1.5, "2", True])
def test_a_partition_is_an_int_of_zero_or_more(partition):
    with pytest.raises(ValueError, match="partition must be an int of 0 or more"):
        call(partition=partition, payload={})


@pytest.mark.parametrize(
    ("extra", "error", "text"),
    [
        ({"payload_bytes": "text, not bytes"}, TypeError, "payload_bytes must be bytes, not str"),
        ({"payload_bytes": b"\x01", "payload": {"a": 1}}, ValueError, "pass payload=None with it"),
        ({"payload_bytes": b"\x01", "tombstone": True}, ValueError, "exclude each other"),
    ],
)
def test_payload_bytes_is_the_value_alone(extra, error, text):
    with pytest.raises(error, match=text):
        call(**extra)
