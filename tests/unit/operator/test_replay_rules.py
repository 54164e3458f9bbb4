"""The rules of a replay (operator/replay.py) without a database or broker: what a
request must say, what a replayed message looks like, and how a chunk is sent (each
ordered aggregate stops at its first row that fails for good; retryable failures are
sent again)."""

from __future__ import annotations

import pytest

from outbox_relay.core.formats import WireFormat
from outbox_relay.core.ordering import OrderingRule
from outbox_relay.db.store import Count
from outbox_relay.model import Message, MessageFormat, PermanentError, RetryableError
from outbox_relay.operator.operations import OperatorRuleError
from outbox_relay.operator.replay import (
    CLI_REPLAY_WORDING,
    ReplayResult,
    _send_chunk,
    check_replay,
    replay_message,
)
from outbox_relay.publisher import SimplePublisher
from tests.helpers.messages import claimed


def rules(**overrides: object) -> tuple[str | None, str | None]:
    values: dict[str, object] = dict(
        ids=False, filtered=True, reason="why", dry_run=False, to_topic=None, wording=CLI_REPLAY_WORDING
    )
    values.update(overrides)
    return check_replay(**values)  # type: ignore[arg-type]


def test_a_request_names_its_rows_one_way_and_says_why():
    assert rules() == ("why", None)
    assert rules(reason="  spaced  ", to_topic="billing.v2") == ("spaced", "billing.v2")
    assert rules(reason=None, dry_run=True) == (None, None)  # a dry run needs no reason
    for bad, needle in (
        (dict(ids=True, filtered=True), "exactly one of row ids or filters"),
        (dict(ids=False, filtered=False), "exactly one of"),
        (dict(reason=None), "--reason"),
        (dict(reason=" "), "--reason"),
        (dict(reason="x" * 1001), "at most 1000"),
        (dict(to_topic=""), "--to-topic is empty"),
        (dict(to_topic="a b"), "spaces"),
        (dict(to_topic="t" * 250), "at most 249"),
    ):
        with pytest.raises(OperatorRuleError, match=needle):
            rules(**bad)


def test_a_replayed_message_is_the_relays_plus_the_replayed_header():
    row = claimed(id=42, headers='{"tenant": "acme", "replayed": "forged"}')
    ordering = OrderingRule.of(["OrderPaid"])
    message = replay_message(row, WireFormat(), ordering, replay_id=7, to_topic=None)
    assert message.topic == "outbox.order" and message.key == "order-7" and message.order_key == "order-7"
    assert message.headers == [
        ("message_id", "42"),
        ("event_type", "OrderPaid"),
        ("aggregate_type", "order"),
        ("aggregate_id", "order-7"),
        ("tenant", "acme"),
        ("replayed", "7"),  # the row's own "replayed" gives way to the replay's
    ]
    elsewhere = replay_message(row, WireFormat(), ordering, replay_id=7, to_topic="billing.v2")
    assert elsewhere.topic == "billing.v2" and elsewhere.value == message.value
    ce = replay_message(
        claimed(id=43), WireFormat(MessageFormat.CLOUDEVENTS_BINARY), ordering, replay_id=8, to_topic=None
    )
    assert ("ce_id", "43") in ce.headers and ("message_id", "43") in ce.headers and ce.headers[-1] == ("replayed", "8")


class ScriptedPublisher(SimplePublisher):
    """Refuses ids in ``refused`` for good, fails ids in ``flaky`` once, records the rest."""

    def __init__(self, refused: set[int], flaky: set[int]) -> None:
        self.refused = refused
        self.flaky = set(flaky)
        self.sent: list[int] = []

    def publish(self, message: Message) -> None:
        if message.id in self.refused:
            raise PermanentError("refused")
        if message.id in self.flaky:
            self.flaky.discard(message.id)
            raise RetryableError("broker busy")
        self.sent.append(message.id)


def test_a_chunk_stops_an_ordered_aggregate_at_its_failure_and_retries_the_retryable():
    rows = [
        claimed(id=1, aggregate_id="a"),
        claimed(id=2, aggregate_id="a"),  # refused: 3 must not overtake it
        claimed(id=3, aggregate_id="a"),
        claimed(id=4, aggregate_id="b"),  # fails once, then goes out before 5
        claimed(id=5, aggregate_id="b"),
        claimed(id=6, aggregate_id="c", event_type="Unordered"),
    ]
    publisher = ScriptedPublisher(refused={2}, flaky={4})
    result = ReplayResult(matched=Count(6), audit_id=9, to_topic=None)
    stopped: set[str] = set()
    sent = _send_chunk(
        publisher, rows, WireFormat(), OrderingRule.of(["OrderPaid"]), result, stopped, 9, None, timeout_seconds=10
    )
    assert sent == 4 and result.sent == 4 and result.failed == 2
    assert [i for i, _ in result.failures] == [2, 3]
    assert "earlier row of its ordered aggregate" in result.failures[1][1]
    assert publisher.sent == [1, 6, 4, 5]  # b's run waited for 4, then went in order
    assert stopped == {"a"}
    # A later chunk of the same replay sends nothing more of aggregate a.
    later = _send_chunk(
        publisher,
        [claimed(id=7, aggregate_id="a"), claimed(id=8, aggregate_id="b")],
        WireFormat(),
        OrderingRule.of(["OrderPaid"]),
        result,
        stopped,
        9,
        None,
        timeout_seconds=10,
    )
    assert later == 1 and publisher.sent[-1] == 8 and result.failed == 3
