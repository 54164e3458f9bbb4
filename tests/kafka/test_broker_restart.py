"""A broker killed (SIGKILL) mid-drain and started again on its data directory.

Apache Kafka keeps its log on disk: every message it acknowledged before the kill is
served after the restart, so every row the relay finalized as delivered is readable.
The test also counts the DUPLICATE_SEQUENCE_NUMBER answers the relay refused to take as
deliveries (``KafkaPublisher.duplicate_sequence_acks``): a workaround for a broker that
consumed a producer sequence without storing the batch (tansu on S3). Kafka writes the
producer state with the batch, so the count is expected to stay 0 here; the re-publish
is harmless either way.
"""

from __future__ import annotations

import collections
import time

import pytest

from outbox_relay.embedded import read_messages
from outbox_relay.relay import Relay
from tests.helpers.db import insert_rows, statuses, wait_for
from tests.kafka.conftest import sample

pytestmark = [pytest.mark.first_pass_only, pytest.mark.timeout(300)]

ROWS = 3000


def test_killed_broker_restarted_on_its_data_serves_every_acknowledged_message(own_broker, make_settings, store,
                                                                               pg_dsn, table, topic_prefix,
                                                                               record_property):
    if not hasattr(own_broker, "create_topic"):
        pytest.skip("needs the embedded Apache Kafka broker")
    topic = f"{topic_prefix}.order"
    own_broker.create_topic(topic, partitions=3)
    ids = insert_rows(pg_dsn, table, ROWS, aggregates=50)
    settings = make_settings(kafka={"bootstrap_servers": own_broker.bootstrap_servers, "topic_template": topic},
                             relay={"workers": 4, "batch_size": 100, "lease_seconds": 10,
                                    "backoff_base_seconds": 0.1, "backoff_cap_seconds": 1, "max_attempts": 50})
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: statuses(pg_dsn, table).get("done", 0) >= ROWS // 5, timeout=120, message="a fifth done")
        own_broker.kill()
        done_before_restart = statuses(pg_dsn, table).get("done", 0)
        killed_at = time.monotonic()
        own_broker.start()
        restarted_seconds = time.monotonic() - killed_at
        wait_for(lambda: statuses(pg_dsn, table).get("done") == ROWS, timeout=180, interval=0.2,
                 message="every row delivered after the restart")
        all_done_seconds = time.monotonic() - killed_at
    finally:
        relay.stop()
    assert sample(relay, "outbox_relay_published_total", {"outcome": "dead"}) == 0
    wanted = set(ids)
    # ``expected`` counts messages, duplicates included: stop on the ids instead.
    messages = read_messages(own_broker.bootstrap_servers, [topic], expected=10 * ROWS, timeout=120, partitions=3,
                             stop_when=lambda out: wanted <= {int(m["headers"]["message_id"]) for m in out})
    seen = collections.Counter(int(m["headers"]["message_id"]) for m in messages)
    assert wanted - set(seen) == set(), "acknowledged messages missing after the restart"
    duplicates = sum(count - 1 for count in seen.values())
    dupseq = relay.publisher.duplicate_sequence_acks  # type: ignore[attr-defined]
    for name, value in (("done_before_restart", done_before_restart), ("duplicates", duplicates),
                        ("duplicate_sequence_acks", dupseq), ("broker_restart_seconds", round(restarted_seconds, 1)),
                        ("seconds_from_kill_to_all_delivered", round(all_done_seconds, 1))):
        record_property(name, value)
    print(f"\n[kafka] SIGKILL after {done_before_restart} rows done; broker back in {restarted_seconds:.1f}s; all "
          f"{ROWS} delivered {all_done_seconds:.1f}s after the kill; {duplicates} duplicates; "
          f"DUPLICATE_SEQUENCE_NUMBER answers refused as proof: {dupseq}")
