"""`outbox-relay replay` and the console's replay on a real PostgreSQL and Apache Kafka:
a time range of delivered rows replayed into another topic (every message_id once,
marked `replayed` with the audit id, each aggregate in id order), a dry run that
sends and changes nothing, the refusal of a table that deletes delivered rows, the
console's dry run then confirm over real HTTP, and a replay beside a running relay
that leaves live delivery undisturbed.

Replay needs delivered rows kept (relay.on_done = keep): every table here is migrated
in the mode each test needs, whatever the suite's mode."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from outbox_relay.config import load_settings
from outbox_relay.core.filters import DeadFilter
from outbox_relay.db.store import OutboxStore
from outbox_relay.runtime.relay import Relay
from tests.helpers.cli import cli, cli_env
from tests.helpers.console import quoted, running_console
from tests.helpers.db import insert_rows
from tests.helpers.wait import wait_for

pytestmark = pytest.mark.timeout(300)
TOKEN = "replay-console-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def migrate(dsn: str, table: str, on_done: str) -> None:
    store = OutboxStore(dsn, table, pool_size=2)
    store.open()
    try:
        store.migrate(on_done=on_done)
    finally:
        store.close()


@pytest.fixture
def keep_table(pg_dsn: str, table: str) -> str:
    migrate(pg_dsn, table, "keep")
    return table


def seed_done(
    dsn: str,
    table: str,
    n: int,
    *,
    created_ago_seconds: float,
    aggregate_type: str = "order",
    aggregates: int = 50,
    status: str = "done",
    last_error: str | None = None,
    event_type: str = "OrderPlaced",
) -> list[int]:
    """n rows as a relay leaves them once delivered (done, done_at set, no last_error),
    created ``created_ago_seconds`` ago, spread over ``aggregates`` aggregates."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            f"""INSERT INTO {quoted(table)} (aggregate_type, aggregate_id, event_type, payload, status, attempts,
                                            lease_version, last_error, created_at, done_at)
                SELECT %(atype)s, %(atype)s || '-' || (g %% %(aggs)s), %(etype)s, jsonb_build_object('seq', g),
                       %(status)s, 1, 1, %(err)s, now() - make_interval(secs => %(ago)s),
                       CASE WHEN %(status)s = 'done' THEN now() END
                FROM generate_series(1, %(n)s) AS g
                RETURNING id""",
            {
                "atype": aggregate_type,
                "aggs": aggregates,
                "etype": event_type,
                "status": status,
                "err": last_error,
                "ago": created_ago_seconds,
                "n": n,
            },
        ).fetchall()
    return sorted(int(r[0]) for r in found)


def snapshot(dsn: str, table: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            f"SELECT id, status, attempts, lease_version, done_at, last_error FROM {quoted(table)} ORDER BY id"
        ).fetchall()


def create_topic(bootstrap: str, topic: str, partitions: int = 4) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)]).values():
        future.result(timeout=30)


def topic_size(bootstrap: str, topic: str) -> int:
    """Messages in ``topic`` now, from its partitions' watermarks (exact, nothing consumed)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "size-" + uuid.uuid4().hex[:6], "log_level": 3})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        total = 0
        for p in partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            total += high - low
        return total
    finally:
        consumer.close()


def read_topic(bootstrap: str, topic: str, expected: int, timeout: float = 90.0) -> list[dict[str, Any]]:
    """Every message of ``topic`` (``expected`` of them), in offset order per partition:
    partition, key, message_id, the other headers."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "replay-" + uuid.uuid4().hex[:6],
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "log_level": 3,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        found: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while len(found) < expected and time.monotonic() < deadline:
            for record in consumer.consume(1000, timeout=0.5):
                if record.error():
                    continue
                headers = {k: v.decode() for k, v in record.headers() or []}
                found.append(
                    {
                        "partition": record.partition(),
                        "key": record.key().decode(),
                        "message_id": int(headers["message_id"]),
                        "headers": headers,
                    }
                )
        return found
    finally:
        consumer.close()


def assert_aggregates_in_id_order(messages: list[dict[str, Any]]) -> None:
    """Per partition in offset order, each aggregate's (key's) ids only grow."""
    last: dict[str, int] = defaultdict(int)
    for m in messages:
        assert m["message_id"] > last[m["key"]], (m["key"], last[m["key"]], m["message_id"])
        last[m["key"]] = m["message_id"]


def run_cli(*args: str, env: dict[str, str]) -> str:
    proc = cli(*args, env=env, timeout=240)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    return proc.stdout


def one_line_error(*args: str, env: dict[str, str], code: int) -> str:
    proc = cli(*args, env=env)
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_replay_a_time_range_of_ten_thousand_rows_into_another_topic(pg_dsn, keep_table, broker, topic_prefix):
    table = keep_table
    target = f"{topic_prefix}.new-consumer"
    create_topic(broker.bootstrap_servers, target)
    in_range = seed_done(pg_dsn, table, 10_000, created_ago_seconds=2 * 3600)
    seed_done(pg_dsn, table, 300, created_ago_seconds=5 * 3600)  # before the range
    seed_done(pg_dsn, table, 200, created_ago_seconds=60)  # after it
    # In the range but never published: skipped by an operator, or not yet delivered.
    seed_done(pg_dsn, table, 30, created_ago_seconds=2 * 3600, last_error="skipped by ops: bad payload")
    seed_done(pg_dsn, table, 20, created_ago_seconds=2 * 3600, status="pending")
    before = snapshot(pg_dsn, table)
    env = cli_env(pg_dsn, table, broker.bootstrap_servers)

    out = run_cli(
        "replay", "--since", "3h", "--until", "1h", "--to-topic", target, "--reason", "backfill billing", "--json",
        env=env,
    )  # fmt: skip
    result = json.loads(out)
    assert (result["matched"], result["sent"], result["failed"], result["to_topic"]) == (10_000, 10_000, 0, target)
    audit_id = result["audit_id"]

    assert topic_size(broker.bootstrap_servers, target) == 10_000  # nothing more than the range, nothing twice
    messages = read_topic(broker.bootstrap_servers, target, 10_000)
    assert sorted(m["message_id"] for m in messages) == in_range  # every message_id once
    assert {m["headers"]["replayed"] for m in messages} == {str(audit_id)}
    assert {m["headers"]["event_type"] for m in messages} == {"OrderPlaced"}  # the relay's own headers kept
    assert_aggregates_in_id_order(sorted(messages, key=lambda m: m["partition"]))
    assert snapshot(pg_dsn, table) == before  # no row changed

    [entry] = json.loads(run_cli("audit", "list", "--json", env=env))
    assert (entry["action"], entry["source"], entry["reason"]) == ("replay", "cli", "backfill billing")
    assert entry["selector"]["to_topic"] == target and entry["rows_failed"] == 0
    assert set(entry["selector"]["filter"]) == {"since", "until"}
    assert (entry["rows_matched"], entry["rows_changed"]) == (10_000, 10_000) and entry["finished_at"]


def test_a_walk_step_looks_at_each_row_of_its_window_once_on_a_table_never_analyzed(pg_dsn, keep_table):
    """A step of the walk is linear in its window whatever the planner believes: on a
    table without statistics (just filled, autovacuum not yet by) the window is never
    joined back row by row, which a nested loop would make quadratic."""
    seed_done(pg_dsn, keep_table, 10_000, created_ago_seconds=2 * 3600)
    store = OutboxStore(pg_dsn, keep_table, pool_size=2)
    store.open()
    try:
        params = dict(DeadFilter().sql_params(), after_id=0, upto_id=10**9, chunk=1000, window=10_000)
        with psycopg.connect(pg_dsn) as conn:
            analyzed = conn.execute(
                "SELECT coalesce(last_analyze, last_autoanalyze) FROM pg_stat_user_tables WHERE relid = %s::regclass",
                (keep_table,),
            ).fetchone()
            plan = "\n".join(
                r[0]
                for r in conn.execute(
                    psycopg.sql.SQL("EXPLAIN (ANALYZE, TIMING OFF) ") + store.sql.query("replay_walk"), params
                ).fetchall()
            )
        step = store.replay_step(DeadFilter(), after_id=0, upto_id=10**9, chunk=1000, window=10_000)
    finally:
        store.close()
    assert analyzed is not None and analyzed[0] is None, "the table was analyzed: the case is not the one tested"
    assert "Join Filter" not in plan, plan
    removed = [int(n) for n in re.findall(r"Rows Removed by \w+(?: \w+)?: (\d+)", plan)]
    assert sum(removed) <= 10_000, plan
    assert len(step.rows) == 1000 and not step.finished


def test_dry_run_counts_and_samples_and_sends_nothing(pg_dsn, keep_table, broker, topic_prefix):
    table = keep_table
    target = f"{topic_prefix}.dry"
    create_topic(broker.bootstrap_servers, target)
    ids = seed_done(pg_dsn, table, 30, created_ago_seconds=600, aggregate_type="invoice")
    seed_done(pg_dsn, table, 5, created_ago_seconds=600, aggregate_type="order")
    before = snapshot(pg_dsn, table)
    env = cli_env(pg_dsn, table, broker.bootstrap_servers)

    out = run_cli("replay", "--aggregate-type", "invoice", "--to-topic", target, "--dry-run", env=env)
    assert f"dry run: 30 delivered rows would be replayed to topic {target}; nothing sent" in out
    sample_ids = [int(line.split()[0]) for line in out.splitlines()[1:] if line.split() and line.split()[0].isdigit()]
    assert sample_ids == ids[:10]  # the first ten as a sample
    assert "… and 20 more" in out
    doc = json.loads(run_cli("replay", str(ids[0]), str(ids[1]), "--dry-run", "--json", env=env))
    assert (doc["matched"], doc["dry_run"], doc["to_topic"]) == (2, True, None)
    assert [r["id"] for r in doc["sample"]] == ids[:2]

    assert topic_size(broker.bootstrap_servers, target) == 0
    assert snapshot(pg_dsn, table) == before
    assert json.loads(run_cli("audit", "list", "--json", env=env)) == []

    # The rules: a reason to send, one selection, a plausible topic.
    assert "--reason" in one_line_error("replay", "--aggregate-type", "invoice", env=env, code=2)
    assert "exactly one of" in one_line_error("replay", env=env, code=2)
    assert "exactly one of" in one_line_error("replay", "1", "--event-type", "X", "--reason", "r", env=env, code=2)
    assert "--to-topic" in one_line_error(
        "replay", "--event-type", "X", "--to-topic", "a b", "--dry-run", env=env, code=2
    )
    assert "--since" in one_line_error("replay", "--since", "yesterday", "--dry-run", env=env, code=2)
    assert topic_size(broker.bootstrap_servers, target) == 0


def test_a_tombstone_stays_a_tombstone_and_a_rows_partition_its_own_topics_only(
    pg_dsn, keep_table, broker, topic_prefix
):
    """A replayed tombstone is its key with a null value again; a row's own partition is
    kept on its own topic and left to the partitioner on another."""
    table = keep_table
    own, other = f"{topic_prefix}.own", f"{topic_prefix}.other"
    create_topic(broker.bootstrap_servers, own, partitions=4)
    create_topic(broker.bootstrap_servers, other, partitions=1)
    [tomb] = seed_done(pg_dsn, table, 1, created_ago_seconds=60)
    [placed] = seed_done(pg_dsn, table, 1, created_ago_seconds=60)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE {quoted(table)} SET topic = %s", (own,))
        conn.execute(f"UPDATE {quoted(table)} SET tombstone = true, payload = 'null' WHERE id = %s", (tomb,))
        conn.execute(f"UPDATE {quoted(table)} SET partition = 3 WHERE id = %s", (placed,))
    env = cli_env(pg_dsn, table, broker.bootstrap_servers)

    run_cli("replay", str(tomb), str(placed), "--reason", "rebuild", env=env)
    run_cli("replay", str(tomb), str(placed), "--to-topic", other, "--reason", "new consumer", env=env)
    trail = run_cli("audit", "list", env=env).splitlines()
    assert len(trail) == 2 and all(" replay " in line and "matched 2, 2 sent " in line for line in trail), trail

    for topic in (own, other):
        consumer = Consumer(
            {"bootstrap.servers": broker.bootstrap_servers, "group.id": "tomb-" + uuid.uuid4().hex[:6], "log_level": 3}
        )
        try:
            parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
            consumer.assign([TopicPartition(topic, p, 0) for p in parts])
            got: dict[int, Any] = {}
            deadline = time.monotonic() + 60
            while len(got) < 2 and time.monotonic() < deadline:
                for record in consumer.consume(10, timeout=0.5):
                    if not record.error():
                        got[int(dict(record.headers())["message_id"])] = record
        finally:
            consumer.close()
        assert set(got) == {tomb, placed}, topic
        assert got[tomb].value() is None and got[tomb].key() is not None  # a delete on a compacted topic
        assert got[placed].value() is not None
        assert got[placed].partition() == (3 if topic == own else 0)


def test_a_row_encoded_by_its_writer_is_replayed_as_the_same_bytes(pg_dsn, keep_table, broker, topic_prefix):
    table = keep_table
    topic = f"{topic_prefix}.raw"
    create_topic(broker.bootstrap_servers, topic, partitions=1)
    encoded = b"\x00\x00\x00\x00\x05\xff\xfe raw"
    [raw] = seed_done(pg_dsn, table, 1, created_ago_seconds=60)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            f"UPDATE {quoted(table)} SET topic = %s, payload = 'null', payload_bytes = %s WHERE id = %s",
            (topic, encoded, raw),
        )
    run_cli("replay", str(raw), "--reason", "rebuild", env=cli_env(pg_dsn, table, broker.bootstrap_servers))
    consumer = Consumer(
        {"bootstrap.servers": broker.bootstrap_servers, "group.id": "raw-" + uuid.uuid4().hex[:6], "log_level": 3}
    )
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        records: list[Any] = []
        deadline = time.monotonic() + 60
        while not records and time.monotonic() < deadline:
            records = [r for r in consumer.consume(10, timeout=0.5) if not r.error()]
    finally:
        consumer.close()
    assert [r.value() for r in records] == [encoded]
    assert dict(records[0].headers())["message_id"] == str(raw).encode()


def test_delete_mode_refuses_in_one_line(pg_dsn, table, broker):
    migrate(pg_dsn, table, "delete")
    env = cli_env(pg_dsn, table, broker.bootstrap_servers)
    line = one_line_error("replay", "--since", "1h", "--reason", "r", env=env, code=2)
    assert "delivered rows" in line and "nothing can be replayed" in line
    line = one_line_error("replay", "--since", "1h", "--dry-run", env=env, code=2)
    assert "nothing can be replayed" in line


@pytest.fixture
def console_url(pg_dsn: str, keep_table: str, broker: Any, topic_prefix: str) -> Iterator[str]:
    settings = load_settings(
        None,
        database={"dsn": pg_dsn, "table": keep_table},
        kafka={"bootstrap_servers": broker.bootstrap_servers, "topic_template": topic_prefix + ".{aggregate_type}"},
        console={"host": "127.0.0.1", "port": 0, "token": TOKEN},
        log={"level": "WARNING", "format": "json"},
    )
    with running_console(settings) as url:
        yield url


def test_console_replay_dry_run_then_confirm(console_url, pg_dsn, keep_table, broker, topic_prefix):
    table = keep_table
    target = f"{topic_prefix}.console"
    create_topic(broker.bootstrap_servers, target)
    ids = seed_done(pg_dsn, table, 40, created_ago_seconds=600, event_type="InvoiceSent", aggregates=4)
    seed_done(pg_dsn, table, 10, created_ago_seconds=600, event_type="Other")
    before = snapshot(pg_dsn, table)
    body: dict[str, Any] = {"filter": {"event_type": "InvoiceSent"}, "to_topic": target}
    with httpx.Client(base_url=console_url, headers=BEARER, timeout=120) as http:
        dry = http.post("/api/replay", json=dict(body, dry_run=True))
        assert dry.status_code == 200, dry.text
        doc = dry.json()
        assert (doc["matched"], doc["dry_run"], doc["sent"]) == (40, True, 0)
        assert [r["id"] for r in doc["sample"]] == ids[:10]
        assert topic_size(broker.bootstrap_servers, target) == 0 and snapshot(pg_dsn, table) == before

        refused = http.post("/api/replay", json=body)  # no reason
        assert refused.status_code == 400 and '"reason"' in refused.json()["error"]
        assert (
            http.post("/api/replay", json=dict(body, reason="r"), headers={"Authorization": "Bearer no"}).status_code
            == 403
        )

        done = http.post("/api/replay", json=dict(body, reason="the invoice consumer starts today"))
        assert done.status_code == 200, done.text
        result = done.json()
        assert (result["matched"], result["sent"], result["failed"], result["dry_run"]) == (40, 40, 0, False)
        [entry] = http.get("/api/audit").json()["entries"]
        assert (entry["id"], entry["action"], entry["source"]) == (result["audit_id"], "replay", "api")
        assert entry["selector"] == {"filter": {"event_type": "InvoiceSent"}, "to_topic": target}
        assert (entry["rows_matched"], entry["rows_changed"], entry["rows_failed"]) == (40, 40, 0)

    messages = read_topic(broker.bootstrap_servers, target, 40)
    assert sorted(m["message_id"] for m in messages) == ids
    assert {m["headers"]["replayed"] for m in messages} == {str(result["audit_id"])}
    assert snapshot(pg_dsn, table) == before


def test_console_pages_preview_then_confirm_with_a_reason(console_url, pg_dsn, keep_table, broker, topic_prefix):
    table = keep_table
    target = f"{topic_prefix}.pages"
    create_topic(broker.bootstrap_servers, target)
    ids = seed_done(pg_dsn, table, 25, created_ago_seconds=600, aggregate_type="shipment", aggregates=5)
    seed_done(pg_dsn, table, 5, created_ago_seconds=600, aggregate_type="order")
    before = snapshot(pg_dsn, table)
    with httpx.Client(base_url=console_url, follow_redirects=False, timeout=120) as http:
        assert http.post("/login", data={"name": "alice", "token": TOKEN}).status_code == 303
        empty = http.get("/replay")
        assert empty.status_code == 200 and 'id="replay-filters"' in empty.text and "preview-count" not in empty.text

        preview = http.get("/replay", params={"aggregate_type": "shipment", "to_topic": target})
        assert preview.status_code == 200
        assert "25</strong> delivered rows would be" in preview.text and target in preview.text
        assert f">{ids[0]}<" in preview.text  # the sample
        assert topic_size(broker.bootstrap_servers, target) == 0 and snapshot(pg_dsn, table) == before
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', preview.text).group(1)
        form = {"aggregate_type": "shipment", "to_topic": target, "csrf_token": csrf}
        assert http.post("/replay/apply", data=dict(form, csrf_token="forged", reason="r")).status_code == 403
        no_reason = http.post("/replay/apply", data=dict(form, reason=" "))
        assert no_reason.status_code == 400 and "say why" in no_reason.text
        assert topic_size(broker.bootstrap_servers, target) == 0

        done = http.post("/replay/apply", data=dict(form, reason="the shipping consumer starts over"))
        assert done.status_code == 303 and done.headers["location"].startswith("/audit?done=")
        audit_id = int(done.headers["location"].split("=")[1])
        audit_page = http.get(done.headers["location"])
        assert "alice" in audit_page.text and "the shipping consumer starts over" in audit_page.text
        assert "replay" in audit_page.text

    messages = read_topic(broker.bootstrap_servers, target, 25)
    assert sorted(m["message_id"] for m in messages) == ids
    assert {m["headers"]["replayed"] for m in messages} == {str(audit_id)}
    assert_aggregates_in_id_order(sorted(messages, key=lambda m: m["partition"]))
    assert snapshot(pg_dsn, table) == before


def test_replay_beside_a_running_relay_leaves_live_delivery_alone(
    make_settings, pg_dsn, keep_table, broker, topic_prefix
):
    table = keep_table
    topic = f"{topic_prefix}.order"  # the rows' own topic: replayed and live messages share it
    create_topic(broker.bootstrap_servers, topic)
    replayed_ids = seed_done(pg_dsn, table, 3000, created_ago_seconds=2 * 3600, aggregates=20)
    settings = make_settings(relay={"workers": 2, "on_done": "keep", "batch_size": 100})
    relay = Relay(settings)
    relay.start()
    live_ids: list[int] = []
    stop_writing = threading.Event()

    def write_live() -> None:
        for _ in range(40):  # bounded: 40 x 50 rows over about 4 s
            if stop_writing.is_set():
                return
            live_ids.extend(insert_rows(pg_dsn, table, 50, aggregates=20))
            time.sleep(0.1)

    writer = threading.Thread(target=write_live, name="live-writer")
    try:
        writer.start()
        env = cli_env(
            pg_dsn,
            table,
            broker.bootstrap_servers,
            OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE=topic_prefix + ".{aggregate_type}",
        )
        env.pop("OUTBOX_RELAY_RELAY__ON_DONE", None)
        out = json.loads(
            run_cli(
                "replay", "--since", "3h", "--until", "1h", "--chunk-size", "500", "--reason", "r", "--json", env=env
            )
        )
        assert (out["sent"], out["failed"]) == (3000, 0)
        writer.join(timeout=60)
        wait_for(
            lambda: _done_count(pg_dsn, table, live_ids) == len(live_ids),
            timeout=120,
            interval=0.5,
            message="every live row delivered",
        )
    finally:
        stop_writing.set()
        writer.join(timeout=60)
        relay.stop()
    assert len(live_ids) == 2000

    messages = read_topic(broker.bootstrap_servers, topic, 5000)
    assert topic_size(broker.bootstrap_servers, topic) == 5000
    live = Counter(m["message_id"] for m in messages if "replayed" not in m["headers"])
    replayed = Counter(m["message_id"] for m in messages if "replayed" in m["headers"])
    assert sorted(live) == sorted(live_ids) and set(live.values()) == {1}  # each live row once, unmarked
    assert sorted(replayed) == replayed_ids and set(replayed.values()) == {1}
    assert {m["headers"]["replayed"] for m in messages if "replayed" in m["headers"]} == {str(out["audit_id"])}
    # Each aggregate's replayed events in id order, and its live ones in id order, interleaved.
    by_partition = sorted(messages, key=lambda m: m["partition"])
    assert_aggregates_in_id_order([m for m in by_partition if "replayed" in m["headers"]])
    assert_aggregates_in_id_order([m for m in by_partition if "replayed" not in m["headers"]])


def _done_count(dsn: str, table: str, ids: list[int]) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT count(*) FROM {quoted(table)} WHERE id = ANY(%s) AND status = 'done'", (list(ids),)
        ).fetchone()
        return int(row[0]) if row else 0


def test_the_operator_role_of_grants_may_replay(pg_dsn, keep_table, broker, topic_prefix):
    """The operator grants (`outbox-relay grants --operator`) are enough to replay: read
    delivered rows, record the replay in the audit trail and its outcome."""
    table = keep_table
    role = "t_replay_op_" + uuid.uuid4().hex[:8]
    target = f"{topic_prefix}.as-operator"
    create_topic(broker.bootstrap_servers, target, partitions=1)
    ids = seed_done(pg_dsn, table, 12, created_ago_seconds=600)
    with psycopg.connect(pg_dsn, autocommit=True) as owner:
        owner.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        printed = cli("grants", "--operator", role, env=cli_env(pg_dsn, table))
        assert printed.returncode == 0, printed.stderr
        with psycopg.connect(pg_dsn, autocommit=True) as owner:
            for line in printed.stdout.splitlines():
                if line.startswith("GRANT "):
                    owner.execute(line)
        as_operator = psycopg.conninfo.make_conninfo(pg_dsn, user=role)
        env = cli_env(as_operator, table, broker.bootstrap_servers)
        out = json.loads(run_cli("replay", "--since", "1h", "--to-topic", target, "--reason", "r", "--json", env=env))
        assert (out["sent"], out["failed"]) == (12, 0)
        [entry] = json.loads(run_cli("audit", "list", "--json", env=env))
        assert (entry["action"], entry["rows_changed"], entry["rows_failed"]) == ("replay", 12, 0)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as owner:
            owner.execute(f'DROP OWNED BY "{role}"')
            owner.execute(f'DROP ROLE "{role}"')
    assert sorted(m["message_id"] for m in read_topic(broker.bootstrap_servers, target, 12)) == ids
