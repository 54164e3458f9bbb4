"""Acknowledgements that were DUPLICATE_SEQUENCE_NUMBER answers are no proof of delivery
(KafkaPublisher.duplicate_sequence_ack): librdkafka reports such a record batch as
delivered, its first message without an offset and the next ones at 0, 1, 2, ..."""

from __future__ import annotations

from outbox_relay.publisher import RetryableError
from outbox_relay.publishers.kafka import UNPROVEN_ACK, KafkaPublisher, _BatchWaiter


class Report:
    """What a delivery report's message answers (confluent_kafka.Message's partition/offset)."""

    def __init__(self, partition: int, offset: int | None) -> None:
        self._partition, self._offset = partition, offset

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int | None:
        return self._offset


def _publisher() -> KafkaPublisher:
    return KafkaPublisher({"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 1000, "message.max.bytes": 1000})


def test_a_duplicate_sequence_batch_is_recognised_from_its_offsets():
    pub = _publisher()
    # A DUPLICATE_SEQUENCE_NUMBER batch of three on partition 1: offsets None (-1), 0, 1.
    assert [pub.duplicate_sequence_ack(0, Report(1, o)) for o in (None, 0, 1)] == [True, True, True]
    # The next real batch on that partition continues at its real offset: a real ack.
    assert pub.duplicate_sequence_ack(0, Report(1, 5120)) is False
    assert pub.duplicate_sequence_ack(0, Report(1, 2)) is False  # the run ended with it
    assert pub.duplicate_sequence_acks == 3


def test_other_partitions_and_producer_generations_are_not_part_of_a_run():
    pub = _publisher()
    assert pub.duplicate_sequence_ack(0, Report(0, -1)) is True
    assert pub.duplicate_sequence_ack(0, Report(2, 0)) is False  # another partition
    assert pub.duplicate_sequence_ack(1, Report(0, 0)) is False  # a newer producer
    assert pub.duplicate_sequence_ack(0, Report(0, 0)) is True  # the run goes on


def test_real_acknowledgements_are_success():
    pub = _publisher()
    assert not any(pub.duplicate_sequence_ack(0, Report(0, o)) for o in (0, 1, 2, 100, 101))


def test_the_batch_waiter_turns_a_duplicate_sequence_ack_into_a_retry():
    pub = _publisher()
    waiter = _BatchWaiter(4, pub, [0.0] * 4, generation=3)
    waiter.on_delivery(0, None, Report(0, 40))  # a real ack
    waiter.on_delivery(1, None, Report(0, None))  # first of a DUPLICATE_SEQUENCE_NUMBER batch
    waiter.on_delivery(2, None, Report(0, 0))
    waiter.on_delivery(3, None, Report(0, 1))
    assert waiter.done.is_set()
    assert waiter.outcomes[0] is None
    for outcome in waiter.outcomes[1:]:
        assert isinstance(outcome, RetryableError) and not outcome.transport
        assert str(outcome) == UNPROVEN_ACK
