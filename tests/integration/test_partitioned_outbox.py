"""A time-partitioned outbox ([partitioning]) against a real PostgreSQL (and Apache
Kafka where rows are delivered): partitions made ahead, the default partition's
gauge, retention by dropping partitions that hold nothing to handle, DDL under a
short lock_timeout while another transaction holds the table, and a drop while a
relay drains and a writer writes."""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from outbox_relay import enqueue
from outbox_relay.db.partitions import PartitionLayout, create_partition, partition_storage, range_start
from outbox_relay.db.store import FinalizeItem, OutboxStore
from outbox_relay.observability.metrics import RelayMetrics
from outbox_relay.runtime.partition_maintenance import PartitionMaintenance
from outbox_relay.runtime.relay import Relay
from tests.helpers.cli import cli, cli_env
from tests.helpers.db import ON_DONE, make_row, run_sql, wait_for

HOUR = 3600


def layout(**overrides: object) -> PartitionLayout:
    values: dict[str, object] = dict(
        interval_seconds=HOUR,
        premake=3,
        retention_seconds=24 * HOUR,
        lock_timeout_ms=300,
        ddl_attempts=3,
        storage=partition_storage({}),
    )
    values.update(overrides)
    return PartitionLayout(**values)  # type: ignore[arg-type]


@pytest.fixture
def pstore(pg_dsn: str, table: str) -> Iterator[OutboxStore]:
    s = OutboxStore(pg_dsn, table, pool_size=8)
    s.open()
    s.migrate(on_done=ON_DONE, partitioning=layout())
    try:
        yield s
    finally:
        s.close()


def sample(metrics: RelayMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


def old_partition(dsn: str, store: OutboxStore, days_ago: float, hours: int = 1) -> tuple[str, datetime]:
    """Attach a partition of an hour ``days_ago`` back (as maintenance once made it); its name and start."""
    start = range_start(datetime.now(UTC) - timedelta(days=days_ago), HOUR)
    name = store.sql.partition_name("p" + start.strftime("%Y%m%d%H"))
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        create_partition(conn, store.sql, layout(), name, start, start + timedelta(hours=hours))
    return name, start


def insert_at(dsn: str, table: str, created_at: datetime, status: str = "done") -> int:
    [(row_id,)] = run_sql(
        dsn,
        table,
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, created_at, status, done_at, last_error) "
        "VALUES ('order', 'a', 'E', '{{}}', %s, %s, CASE WHEN %s = 'done' THEN now() END, "
        "CASE WHEN %s = 'dead' THEN 'boom' END) RETURNING id",
        (created_at, status, status, status),
    )
    return int(row_id)


def names(store: OutboxStore) -> list[str]:
    return [p.name for p in store.partitions()]


def test_migrate_creates_the_current_partition_those_ahead_and_a_default(pg_dsn, table, pstore):
    parts = pstore.partitions()
    ranged = [p for p in parts if not p.is_default]
    assert sum(p.is_default for p in parts) == 1
    assert len(ranged) == 4  # the current hour and premake = 3 after it
    now = datetime.now(UTC)
    assert ranged[0].from_at is not None and ranged[0].from_at <= now < ranged[0].to_at  # type: ignore[operator]
    for before, after in itertools.pairwise(ranged):
        assert before.to_at == after.from_at
    # Every partition has the claim's partial indexes (made on the parent) and the queue's fillfactor.
    schema = table.split(".")[0]
    for part in parts:
        [(n_indexes,)] = run_sql(
            pg_dsn,
            table,
            "SELECT count(*) FROM pg_indexes WHERE schemaname = %s AND tablename = %s "
            "AND (indexdef LIKE '%%WHERE (status = ''pending''::text)' OR indexdef LIKE '%%WHERE (status = "
            "''processing''::text)')",
            (schema, part.name),
        )
        assert n_indexes == 2, part.name
        [(options,)] = run_sql(
            pg_dsn, table, "SELECT reloptions FROM pg_class WHERE oid = %s::regclass", (f'"{schema}"."{part.name}"',)
        )
        assert "fillfactor=50" in options
    # migrate again: nothing to do; maintain: nothing to create either.
    pstore.migrate(on_done=ON_DONE, partitioning=layout())
    result = pstore.maintain_partitions(layout())
    assert result.ok and result.created == [] and result.dropped == [] and result.partitions == 5


def test_maintain_creates_ahead_as_time_goes_by(pg_dsn, table, pstore):
    before = set(names(pstore))
    result = pstore.maintain_partitions(layout(premake=6))
    assert result.ok and len(result.created) == 3
    assert set(names(pstore)) == before | set(result.created)
    # enqueue() and a claim go through the parent as before.
    with psycopg.connect(pg_dsn) as conn:
        row_id = enqueue(conn, aggregate_type="order", aggregate_id="a", event_type="E", payload={}, table=table)
    claimed = pstore.claim(owner="w", batch=10, lease_seconds=30, max_attempts=5)
    assert [c.id for c in claimed.rows] == [row_id]


def test_rows_in_the_default_partition_raise_the_gauge(pg_dsn, table, pstore):
    metrics = RelayMetrics()
    service = PartitionMaintenance(pstore, layout(), metrics, interval_seconds=60)
    service.step()
    assert sample(metrics, "outbox_relay_table_partition_default_rows") == 0
    assert sample(metrics, "outbox_relay_table_partitions") == 5
    assert sample(metrics, "outbox_relay_table_partition_maintenance_ok") == 1
    far = datetime.now(UTC) + timedelta(days=30)  # no partition covers it
    insert_at(pg_dsn, table, far, status="pending")
    insert_at(pg_dsn, table, far + timedelta(hours=1), status="pending")
    service.step()
    assert sample(metrics, "outbox_relay_table_partition_default_rows") == 2
    assert pstore.default_partition_rows() == 2
    assert metrics.registry.get_sample_value("outbox_relay_table_partition_maintenance_total", {"result": "ok"}) == 2


def test_default_rows_of_a_range_make_its_creation_fail_and_say_so(pg_dsn, table, pstore):
    """A row in the default partition whose created_at falls into a range maintenance is
    about to create: ATTACH refuses (the row would be in the wrong partition), the round
    reports it, nothing is lost and the other partitions are still made."""
    ahead = datetime.now(UTC) + timedelta(hours=5, minutes=1)
    row_id = insert_at(pg_dsn, table, ahead, status="pending")
    result = pstore.maintain_partitions(layout(premake=6))
    assert not result.ok
    assert len(result.failed) == 1 and "default partition" in result.failed[0]
    assert len(result.created) == 2
    assert run_sql(pg_dsn, table, "SELECT status FROM {t} WHERE id = %s", (row_id,)) == [("pending",)]


def test_expired_partitions_are_dropped_unless_they_hold_pending_or_dead_rows(pg_dsn, table, pstore):
    done_only, done_start = old_partition(pg_dsn, pstore, days_ago=3)
    with_pending, pending_start = old_partition(pg_dsn, pstore, days_ago=3 - 1 / 24)
    with_dead, dead_start = old_partition(pg_dsn, pstore, days_ago=3 - 2 / 24)
    young, young_start = old_partition(pg_dsn, pstore, days_ago=0.5)  # inside the retention
    for start in (done_start, pending_start, dead_start, young_start):
        insert_at(pg_dsn, table, start + timedelta(minutes=5), status="done")
    pending_id = insert_at(pg_dsn, table, pending_start + timedelta(minutes=6), status="pending")
    dead_id = insert_at(pg_dsn, table, dead_start + timedelta(minutes=6), status="dead")

    result = pstore.maintain_partitions(layout())
    assert result.ok, result.failed
    assert result.dropped == [done_only]
    assert len(result.kept) == 2
    assert any(with_dead in k and "1 dead rows" in k for k in result.kept)
    assert any(with_pending in k and "to deliver" in k for k in result.kept)
    assert set(names(pstore)) >= {with_pending, with_dead, young}
    assert done_only not in names(pstore)

    # The dead row is handled (skipped), the pending one delivered: both partitions go next round.
    assert pstore.dead_skip([dead_id], reason="handled") == {dead_id}
    claimed = pstore.claim(owner="w", batch=10, lease_seconds=30, max_attempts=5)
    assert [c.id for c in claimed.rows] == [pending_id]
    assert pstore.finalize([FinalizeItem(c.id, c.lease_version, "done") for c in claimed.rows]) == {pending_id}
    result = pstore.maintain_partitions(layout())
    assert sorted(result.dropped) == sorted([with_pending, with_dead]) and result.kept == []
    assert young in names(pstore)


def test_a_drop_waits_at_most_lock_timeout_per_attempt_and_writers_are_never_blocked_longer(pg_dsn, table, pstore):
    """Another transaction holds a lock on the outbox: the DETACH gives up after the
    lock_timeout (300 ms), backs off and retries; a writer inserting meanwhile waits at
    most about one lock_timeout (it queues behind the waiting DDL, never behind the long
    transaction). Once the long transaction ends, the retry drops the partition."""
    name, start = old_partition(pg_dsn, pstore, days_ago=3)
    insert_at(pg_dsn, table, start + timedelta(minutes=1), status="done")
    holder = psycopg.connect(pg_dsn)
    holder.execute(psycopg.sql.SQL("SELECT count(*) FROM {}").format(pstore.sql.ident))  # holds ACCESS SHARE
    waits: list[float] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            while not stop.is_set() and len(waits) < 2000:
                began = time.monotonic()
                try:
                    enqueue(conn, aggregate_type="order", aggregate_id="w", event_type="E", payload={}, table=table)
                except BaseException as exc:
                    errors.append(exc)
                    return
                waits.append(time.monotonic() - began)
                time.sleep(0.01)

    thread = threading.Thread(target=writer)
    thread.start()
    outcome: list[object] = []
    maintainer = threading.Thread(
        target=lambda: outcome.append(pstore.maintain_partitions(layout(ddl_attempts=40, lock_timeout_ms=300)))
    )
    try:
        time.sleep(0.3)
        maintainer.start()
        time.sleep(3.5)  # several attempts time out while the holder stays
        assert maintainer.is_alive()
    finally:
        holder.rollback()
        holder.close()
        maintainer.join(timeout=60)
        stop.set()
        thread.join(timeout=30)
    assert not errors
    [result] = outcome
    assert result.dropped == [name], result  # type: ignore[attr-defined]
    assert len(waits) > 20
    # One lock_timeout (0.3 s) plus scheduling slack on a shared machine; a writer queued
    # behind the long transaction itself would have waited its 3.5 s.
    assert max(waits) < 0.3 + 1.2, max(waits)
    # ... and writers did queue behind a waiting DETACH (the case the lock_timeout bounds).
    assert max(waits) > 0.1, max(waits)
    [(n,)] = run_sql(pg_dsn, table, "SELECT count(*) FROM {t} WHERE aggregate_id = 'w'")
    assert n == len(waits)


def test_a_drop_while_a_relay_drains_and_a_writer_writes_loses_nothing(make_settings, pg_dsn, table, pstore):
    names_before = names(pstore)
    expired = [old_partition(pg_dsn, pstore, days_ago=3 + i / 24) for i in range(3)]
    for _name, start in expired:
        for minute in range(5):
            insert_at(pg_dsn, table, start + timedelta(minutes=minute), status="done")
    settings = make_settings(
        partitioning={
            "interval": "1 hour",
            "premake": 3,
            "retention": "1d",
            "maintain_interval_seconds": 0.5,
            "lock_timeout_ms": 300,
        },
        relay={"workers": 2, "batch_size": 50},
    )
    written: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        with psycopg.connect(pg_dsn) as conn:
            for i in range(600):
                if stop.is_set():
                    return
                try:
                    with conn.transaction():
                        written.append(
                            enqueue(
                                conn,
                                aggregate_type="order",
                                aggregate_id=f"a{i % 7}",
                                event_type="E",
                                payload={"i": i},
                                table=table,
                            )
                        )
                except BaseException as exc:
                    errors.append(exc)
                    return
                time.sleep(0.005)

    relay = Relay(settings)
    relay.start()
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        wait_for(
            lambda: not any(n in names(pstore) for n, _ in expired), timeout=60, message="expired partitions dropped"
        )
        thread.join(timeout=60)
        assert not errors
        ids = list(written)

        def delivered() -> bool:
            rows = run_sql(pg_dsn, table, "SELECT count(*) FROM {t} WHERE id = ANY(%s) AND status <> 'done'", (ids,))
            if ON_DONE == "delete":
                return (
                    rows[0][0] == 0
                    and run_sql(pg_dsn, table, "SELECT count(*) FROM {t} WHERE id = ANY(%s)", (ids,))[0][0] == 0
                )
            gone = run_sql(pg_dsn, table, "SELECT count(*) FROM {t} WHERE id = ANY(%s)", (ids,))[0][0]
            return rows[0][0] == 0 and gone == len(ids)

        wait_for(delivered, timeout=90, message="every written row delivered")
    finally:
        stop.set()
        thread.join(timeout=30)
        relay.stop()
    assert len(written) == 600
    assert set(names_before) <= set(names(pstore))
    assert relay.metrics.registry.get_sample_value("outbox_relay_table_partition_maintenance_ok") == 1


def test_purge_refuses_a_partitioned_table_and_maintain_runs_from_the_cli(pg_dsn, table, pstore, tmp_path):
    config = tmp_path / "relay.toml"
    config.write_text(
        f'[database]\ndsn = "{pg_dsn}"\ntable = "{table}"\n[relay]\non_done = "{ON_DONE}"\n'
        '[partitioning]\ninterval = "1 hour"\npremake = 5\nretention = "1d"\n'
    )
    purge = cli("purge", "--older-than", "1d", "--config", str(config))
    assert purge.returncode == 2
    assert "partitioning.retention" in purge.stderr and "Traceback" not in purge.stderr
    maintain = cli("maintain", "--config", str(config))
    assert maintain.returncode == 0, maintain.stderr
    assert "created partition" in maintain.stdout and "7 partitions" in maintain.stdout


def test_maintain_refuses_a_plain_table(pg_dsn, table, store, tmp_path):
    config = tmp_path / "relay.toml"
    config.write_text(
        f'[database]\ndsn = "{pg_dsn}"\ntable = "{table}"\n[relay]\non_done = "{ON_DONE}"\n'
        '[partitioning]\ninterval = "1 day"\n'
    )
    maintain = cli("maintain", "--config", str(config))
    assert maintain.returncode == 2
    assert "is not partitioned" in maintain.stderr and "Traceback" not in maintain.stderr
    migrate = cli("migrate", "--config", str(config))
    assert migrate.returncode == 0 and "converting it is not automated yet" in migrate.stdout


def test_dedup_keys_on_a_partitioned_outbox(pg_dsn, table, pstore):
    with psycopg.connect(pg_dsn) as conn:
        first = enqueue(
            conn, aggregate_type="o", aggregate_id="a", event_type="E", payload={}, table=table, dedup_key="k1"
        )
        again = enqueue(
            conn, aggregate_type="o", aggregate_id="a", event_type="E", payload={}, table=table, dedup_key="k1"
        )
    assert int(again) == int(first) and again.duplicate  # type: ignore[attr-defined]
    make_row(pg_dsn, table)


def test_status_and_vacuum_figures_read_the_partitions(pg_dsn, table, pstore):
    for _ in range(3):
        make_row(pg_dsn, table)
    make_row(pg_dsn, table, status="dead", last_error="boom")
    figures = pstore.vacuum_figures()
    assert figures.heap_bytes > 0 and figures.index_bytes > 0
    env = cli_env(pg_dsn, table)
    status = cli("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    depth = json.loads(status.stdout)["queue_depth"]
    assert depth["pending"] == 3 and depth["dead"] == 1
    listed = cli("dead", "list", "--json", env=env)
    assert listed.returncode == 0 and len(json.loads(listed.stdout)) == 1


def test_delete_mode_works_on_a_partitioned_outbox(pg_dsn, table):
    """relay.on_done = delete is allowed: the finalize deletes by id across partitions
    (the partitions then empty themselves, and maintenance drops them all the same)."""
    store = OutboxStore(pg_dsn, table, pool_size=2)
    store.open()
    try:
        store.migrate(on_done="delete", partitioning=layout())
        ids = [make_row(pg_dsn, table) for _ in range(3)]
        claimed = store.claim(owner="w", batch=10, lease_seconds=30, max_attempts=5).rows
        assert sorted(c.id for c in claimed) == ids
        assert store.finalize([FinalizeItem(c.id, c.lease_version, "done") for c in claimed]) == set(ids)
        assert run_sql(pg_dsn, table, "SELECT count(*) FROM {t}") == [(0,)]
    finally:
        store.close()


def test_convert_a_plain_outbox_in_use_without_moving_a_row(pg_dsn, table, store, tmp_path):
    """migrate --convert-to-partitioned on a plain table holding rows of every status,
    granted to a writer role, with a writer inserting throughout: the table becomes the
    partition of everything before the boundary, every row keeps its id and state, a
    claimed row's fenced finalize still lands, ids continue, and the writer never fails."""
    done = make_row(pg_dsn, table, status="done")
    dead = make_row(pg_dsn, table, status="dead", last_error="boom")
    pending = make_row(pg_dsn, table)
    [claimed] = store.claim(owner="w", batch=10, lease_seconds=60, max_attempts=5).rows
    assert claimed.id == pending
    role = "conv_writer_" + table.split(".")[0][2:]
    schema = table.split(".")[0]
    run_sql(pg_dsn, table, f'CREATE ROLE "{role}"')
    run_sql(pg_dsn, table, f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"')
    run_sql(pg_dsn, table, f'GRANT SELECT, INSERT ON {{t}} TO "{role}"')
    before_ids = [r[0] for r in run_sql(pg_dsn, table, "SELECT id FROM {t} ORDER BY id")]
    [(filenode,)] = run_sql(pg_dsn, table, "SELECT pg_relation_filenode(%s::regclass)", (table,))

    written: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for _ in range(3000):
                if stop.is_set():
                    return
                try:
                    written.append(
                        enqueue(conn, aggregate_type="order", aggregate_id="c", event_type="E", payload={}, table=table)
                    )
                except BaseException as exc:
                    errors.append(exc)
                    return
                time.sleep(0.005)

    config = tmp_path / "relay.toml"
    config.write_text(
        f'[database]\ndsn = "{pg_dsn}"\ntable = "{table}"\n[relay]\non_done = "{ON_DONE}"\n'
        '[partitioning]\ninterval = "1 hour"\npremake = 2\nretention = "1d"\n'
    )
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        time.sleep(0.3)
        converted = cli("migrate", "--convert-to-partitioned", "--config", str(config))
        time.sleep(0.3)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert converted.returncode == 0, converted.stderr
    assert "converted" in converted.stdout
    assert not errors
    assert store.is_partitioned()
    parts = store.partitions()
    before = [p for p in parts if p.name.endswith("p_before")]
    assert len(before) == 1 and before[0].from_at is None
    assert sum(p.is_default for p in parts) == 1
    # The same heap, not a copy; and ATTACH found a match for every index (built none).
    part = f"{schema}.{before[0].name}"
    assert run_sql(pg_dsn, table, "SELECT pg_relation_filenode(%s::regclass)", (part,)) == [(filenode,)]
    [(pending_indexes,)] = run_sql(
        pg_dsn,
        table,
        "SELECT count(*) FROM pg_indexes WHERE schemaname = %s AND tablename = %s "
        "AND indexdef LIKE '%%WHERE (status = ''pending''::text)'",
        (schema, before[0].name),
    )
    assert pending_indexes == 1
    # Every row, old and new, is there once with its state.
    ids = [r[0] for r in run_sql(pg_dsn, table, "SELECT id FROM {t} ORDER BY id")]
    assert ids == sorted(before_ids + written) and len(set(ids)) == len(ids)
    assert run_sql(pg_dsn, table, "SELECT status FROM {t} WHERE id = ANY(%s) ORDER BY id", ([done, dead],)) == [
        ("done",),
        ("dead",),
    ]
    # The lease taken before the conversion still fences the finalize.
    assert store.finalize([FinalizeItem(claimed.id, claimed.lease_version, "done")]) == {pending}
    # Ids continue after the highest one; privileges followed the name.
    with psycopg.connect(pg_dsn) as conn:
        new_id = enqueue(conn, aggregate_type="order", aggregate_id="c", event_type="E", payload={}, table=table)
    assert new_id > max(ids)
    [(can_insert,)] = run_sql(pg_dsn, table, "SELECT has_table_privilege(%s, %s::regclass, 'INSERT')", (role, table))
    assert can_insert
    # Maintenance makes the partitions after the boundary; converting again changes nothing.
    assert store.maintain_partitions(layout(premake=3)).ok
    again = cli("migrate", "--convert-to-partitioned", "--config", str(config))
    assert again.returncode == 0 and "partitioned already" in again.stdout
    run_sql(pg_dsn, table, f'DROP OWNED BY "{role}"')
    run_sql(pg_dsn, table, f'DROP ROLE "{role}"')


def test_migrate_from_the_cli_creates_a_partitioned_outbox_and_print_sql_prints_it(pg_dsn, table, tmp_path):
    config = tmp_path / "relay.toml"
    config.write_text(
        f'[database]\ndsn = "{pg_dsn}"\ntable = "{table}"\n[relay]\non_done = "{ON_DONE}"\n'
        '[partitioning]\ninterval = "1 day"\npremake = 2\nretention = "7d"\n'
    )
    migrated = cli("migrate", "--config", str(config))
    assert migrated.returncode == 0, migrated.stderr
    assert "created default partition" in migrated.stdout and "created 3 partitions" in migrated.stdout
    [(kind,)] = run_sql(pg_dsn, table, "SELECT relkind::text FROM pg_class WHERE oid = %s::regclass", (table,))
    assert kind == "p"
    again = cli("migrate", "--config", str(config))
    assert again.returncode == 0 and "created" not in again.stdout
    # The printed layout is the partitioned one (tests/acceptance/test_migrate_cli.py applies it).
    printed = cli("migrate", "--print-sql", "--config", str(config))
    assert printed.returncode == 0, printed.stderr
    assert "PARTITION BY RANGE (created_at)" in printed.stdout and "FOR i IN 0..2 LOOP" in printed.stdout


def test_ordering_indexes_added_later_are_built_partition_by_partition(pg_dsn, table, pstore):
    """relay.ordered_event_types set after the table was made: migrate builds the ordering
    indexes on a partitioned outbox without a plain CREATE INDEX (which would block
    writers): ON ONLY the table, CONCURRENTLY on each partition, then attached; the
    index is valid once every partition's is, and the ordered claim uses it."""
    first = make_row(pg_dsn, table, aggregate_id="a")
    make_row(pg_dsn, table, aggregate_id="a")
    insert_at(pg_dsn, table, datetime.now(UTC) + timedelta(days=30), status="pending")  # in the default partition
    assert pstore.missing_ordering_indexes()
    notes = pstore.migrate(on_done=ON_DONE, ordering=True, partitioning=layout())
    assert any("created index" in n for n in notes)
    assert pstore.missing_ordering_indexes() == []
    assert pstore.migrate(on_done=ON_DONE, ordering=True, partitioning=layout()) == []  # nothing left to do
    schema = table.split(".")[0]
    for part in pstore.partitions():
        [(n,)] = run_sql(
            pg_dsn,
            table,
            "SELECT count(*) FROM pg_indexes WHERE schemaname = %s AND tablename = %s AND indexdef LIKE "
            "'%%(aggregate_id, id)%%'",
            (schema, part.name),
        )
        assert n == 2, part.name
    claimed = pstore.claim(owner="w", batch=10, lease_seconds=30, max_attempts=5, ordered_types=["*"]).rows
    assert first in [c.id for c in claimed] and len([c for c in claimed if c.aggregate_id == "a"]) == 1
    # A partition made afterwards gets the index when it is attached.
    assert pstore.maintain_partitions(layout(premake=5)).ok
    assert pstore.missing_ordering_indexes() == []


def test_a_process_serving_many_sources_maintains_each_partitioned_one(pg_dsn, table, pstore, broker, topic_prefix):
    """[sources.*] with [partitioning]: the one process maintains every source whose table
    is partitioned (expired partitions dropped in each) and skips a plain one."""
    from outbox_relay.config import load_settings
    from outbox_relay.runtime.multi import MultiRelay

    other_schema = "t_" + uuid.uuid4().hex[:12]
    plain_schema = "t_" + uuid.uuid4().hex[:12]
    run_sql(pg_dsn, table, f'CREATE SCHEMA "{other_schema}"')
    run_sql(pg_dsn, table, f'CREATE SCHEMA "{plain_schema}"')
    other, plain = f"{other_schema}.outbox", f"{plain_schema}.outbox"
    relay = None
    other_store = OutboxStore(pg_dsn, other, pool_size=2)
    plain_store = OutboxStore(pg_dsn, plain, pool_size=2)
    other_store.open()
    plain_store.open()
    try:
        other_store.migrate(on_done=ON_DONE, partitioning=layout())
        plain_store.migrate(on_done=ON_DONE)
        expired = [old_partition(pg_dsn, s, days_ago=3)[0] for s in (pstore, other_store)]
        settings = load_settings(
            None,
            kafka={"bootstrap_servers": broker.bootstrap_servers, "topic_template": topic_prefix + ".{aggregate_type}"},
            relay={"workers": 1, "lease_seconds": 10, "poll_interval_seconds": 0.2, "on_done": ON_DONE},
            metrics={"enabled": False},
            log={"level": "WARNING", "format": "json"},
            partitioning={"interval": "1 hour", "premake": 3, "retention": "1d", "maintain_interval_seconds": 0.5},
            sources={
                "one": {"dsn": pg_dsn, "table": table},
                "two": {"dsn": pg_dsn, "table": other},
                "plain": {"dsn": pg_dsn, "table": plain},
            },
        )
        relay = MultiRelay(settings)
        relay.start()
        wait_for(
            lambda: expired[0] not in names(pstore) and expired[1] not in names(other_store),
            timeout=60,
            message="expired partitions of both partitioned sources dropped",
        )
        assert not plain_store.is_partitioned()
    finally:
        if relay is not None:
            relay.stop(timeout_seconds=5)
        other_store.close()
        plain_store.close()
        run_sql(pg_dsn, table, f'DROP SCHEMA "{other_schema}" CASCADE')
        run_sql(pg_dsn, table, f'DROP SCHEMA "{plain_schema}" CASCADE')


def test_the_relays_maintenance_on_a_plain_table_says_so_and_goes_on(store):
    metrics = RelayMetrics()
    service = PartitionMaintenance(store, layout(), metrics, interval_seconds=60)
    service.step()  # no exception: a warning line, the error counted
    assert metrics.registry.get_sample_value("outbox_relay_table_partition_maintenance_total", {"result": "error"}) == 1
    assert metrics.registry.get_sample_value("outbox_relay_table_partition_maintenance_ok") == 0


def test_minute_partitions_are_made_ahead_named_to_the_minute_and_dropped_past_the_retention(pg_dsn, table):
    minutes = layout(interval_seconds=300, premake=4, retention_seconds=600)
    with OutboxStore(pg_dsn, table, pool_size=2) as store:
        store.migrate(on_done=ON_DONE, partitioning=minutes)
        ranged = [p for p in store.partitions() if not p.is_default]
        assert len(ranged) == 5  # the current 5 minutes and premake = 4 after them
        for part in ranged:
            assert part.from_at is not None and part.to_at is not None
            assert part.to_at - part.from_at == timedelta(minutes=5) and part.from_at.minute % 5 == 0
            assert part.name.endswith("_p" + part.from_at.strftime("%Y%m%d%H%M"))
        assert [p.name for p in ranged] == sorted(p.name for p in ranged)
        # A 5-minute partition 20 minutes back holding delivered rows: past the 10-minute retention.
        start = range_start(datetime.now(UTC) - timedelta(minutes=20), 300)
        old = store.sql.partition_name("p" + start.strftime("%Y%m%d%H%M"))
        with psycopg.connect(pg_dsn, autocommit=True) as conn, conn.transaction():
            create_partition(conn, store.sql, minutes, old, start, start + timedelta(minutes=5))
        row_id = insert_at(pg_dsn, table, start + timedelta(minutes=1))
        assert row_id > 0
        result = store.maintain_partitions(minutes)
        assert result.ok and result.dropped == [old]
        assert old not in names(store) and len([p for p in store.partitions() if not p.is_default]) == 5
