"""A DUPLICATE_SEQUENCE_NUMBER answer is no proof of delivery (bench/soak.py; docs/benchmarks/tansu-2core.md, "Soak").

tansu 0.6 on S3 advances an idempotent producer's sequence (in its ``meta.json``)
before it stores the record batch. Killed in between, it has consumed the sequence
without the data; when the producer sends the batch again to the restarted broker,
the broker answers DUPLICATE_SEQUENCE_NUMBER, and librdkafka reports every message of
the batch as delivered. The soak lost 101 and 141 such rows. This test puts the real
broker in that state without the race (the stored sequence advanced past the next
batch) and checks that the relay's publisher does not take that answer as a delivery,
and that sending the messages again stores them.
"""

from __future__ import annotations

import json
import uuid

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from outbox_relay._embedded.embedded import read_messages
from outbox_relay.publisher import Message, RetryableError
from outbox_relay.publishers.kafka import UNPROVEN_ACK, from_settings

# Exercises the broker rather than PostgreSQL's SQL: ./dev runs it on the first pass only.
pytestmark = pytest.mark.first_pass_only

boto3 = pytest.importorskip("boto3")  # moto[server] brings it (test extra)


def _messages(topic: str, ids: range) -> list[Message]:
    return [
        Message(
            id=i,
            topic=topic,
            key="k",
            value=json.dumps({"n": i}),
            headers=[("message_id", str(i))],
            aggregate_type="a",
            aggregate_id="k",
            event_type="E",
        )
        for i in ids
    ]


def test_a_duplicate_sequence_answer_for_a_batch_the_broker_never_stored_is_not_a_delivery(
    make_settings, tansu_durable_broker
):
    durable_broker = tansu_durable_broker  # tansu's S3 storage: its producer sequences are an object
    storage = durable_broker.storage
    assert storage is not None
    topic = "dupseq-" + uuid.uuid4().hex[:8]
    admin = AdminClient({"bootstrap.servers": durable_broker.bootstrap_servers})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])[topic].result(timeout=30)
    publisher = from_settings(
        make_settings(kafka={"bootstrap_servers": durable_broker.bootstrap_servers, "linger_ms": 50})
    )
    publisher.start()
    try:
        first = publisher.publish_batch(_messages(topic, range(1, 6)), timeout_seconds=20)
        assert first == [None] * 5

        # The crash window, without the race: the broker has recorded the producer's
        # next sequence numbers (for 3 messages) but stored no batch for them.
        s3 = boto3.client(
            "s3",
            endpoint_url=storage.endpoint,
            region_name="eu-west-2",
            aws_access_key_id="outbox-relay-test",
            aws_secret_access_key="outbox-relay-test",
        )
        key = "clusters/tansu_cluster/meta.json"
        meta = json.loads(s3.get_object(Bucket=storage.bucket, Key=key)["Body"].read())
        bumped = 0
        for producer in meta["producers"].values():
            for epochs in producer["sequences"].values():
                if topic in epochs:
                    epochs[topic]["0"] += 3
                    bumped += 1
        assert bumped == 1, meta
        s3.put_object(Bucket=storage.bucket, Key=key, Body=json.dumps(meta).encode())

        second = publisher.publish_batch(_messages(topic, range(6, 9)), timeout_seconds=20)
        # librdkafka reported these as delivered (a DUPLICATE_SEQUENCE_NUMBER answer):
        # the publisher must not, or the relay would finalize rows that are nowhere.
        assert all(isinstance(o, RetryableError) and str(o) == UNPROVEN_ACK for o in second), second
        assert publisher.duplicate_sequence_acks == 3

        # What the worker does after the retry's backoff: publish them again.
        third = publisher.publish_batch(_messages(topic, range(6, 9)), timeout_seconds=20)
        assert third == [None] * 3
    finally:
        publisher.close()
    stored = read_messages(durable_broker.bootstrap_servers, [topic], expected=8, timeout=60)
    assert sorted(int(m["headers"]["message_id"]) for m in stored) == list(range(1, 9))
