"""The transactional part of ``migrate``: numbered steps, each applied once per table.

Two kinds of change, and the rule that says which is which:

- A **numbered step** (``STEPS``) changes the table's layout the same way whatever the
  options of the run. It is applied once per outbox table and recorded in the table's
  companion ``<table>_migrations`` (step number, name, time), in the same transaction
  as its change: either both commit or neither. A new layout change is a new step at
  the end of ``STEPS``; a step already released is never edited or renumbered.
- An **every-run step** (``EVERY_RUN``) depends on the options of this run or on
  state that can drift: the table's ``on_done`` mode, the notify trigger on or off,
  per-table storage parameters (fillfactor), keys written by older writers. It runs on
  every migrate and must be idempotent (change nothing when there is nothing to do).
  Indexes are of this kind too, but built outside the transaction (``CONCURRENTLY``)
  by the store.

Steps 1 to ``BASELINE`` describe the layouts migrate made before steps were
recorded. Each checks what exists (or uses ``IF NOT EXISTS``), so on an installation
of such a layout it recognises what is there, changes only what is missing, and is
recorded: after that first run, the record alone decides. A step after ``BASELINE``
runs only on tables recorded up to the step before it and needs no such check.

Concurrency: the store runs ``apply`` under the table's migrate advisory lock (taken
by polling) and inside one transaction with a lock timeout; two migrates of the same
table therefore run one after the other, and the second finds every step recorded.
The record's primary key (the step number) turns a step applied twice into an error.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg import sql

from ..errors import SchemaMissing
from .autovacuum import check_overrides, parse_reloptions, plan
from .partitions import (
    PartitionLayout,
    create_ahead_in_transaction,
    create_default_partition,
    partition_suffix,
    storage_clause,
)
from .schema import FILLFACTOR, TableSql


@dataclass
class MigrationRun:
    """What one migrate run knows while it applies steps: its connection (inside the
    transaction), the table's statements, the run's options, and the operator notes."""

    conn: psycopg.Connection[Any]
    sql: TableSql
    on_done: str
    notify_trigger: bool
    wanted_indexes: Sequence[str]
    autovacuum: Mapping[str, str] = field(default_factory=dict)  # database.autovacuum: the operator's values
    #: migrate --recreate-from-id: recreate a dropped outbox table whose record is kept,
    #: its ids starting here (None: such a table is refused, see apply).
    recreate_from_id: int | None = None
    #: [partitioning]: a table created now is partitioned by range of created_at.
    partitioning: PartitionLayout | None = None
    created: bool = False  # the outbox table did not exist when this run started
    notes: list[str] = field(default_factory=list)

    @property
    def partitioned(self) -> bool:
        """Is the outbox (as it is now, in this transaction) a partitioned table?"""
        return bool(self.one("is_partitioned", {"table": self.sql.regclass_text}))

    def one(self, name: str, params: dict[str, Any] | None = None) -> Any:
        """The first column of the first row of a section, or None."""
        row = self.conn.execute(self.sql.query(name), params).fetchone()
        return row[0] if row else None

    def run(self, name: str) -> None:
        """A section of one or more statements (split on ';' at line ends)."""
        for statement in self.sql.statements(name):
            self.conn.execute(statement)


@dataclass(frozen=True)
class Step:
    number: int
    name: str
    apply: Callable[[MigrationRun], None]


# --- numbered steps (never edit one that was released: add a new one) ----------------


def _create_table(run: MigrationRun) -> None:
    """The outbox table with its fillfactor; on a table created now, the indexes of the
    layout in this transaction (plain CREATE INDEX on an empty table). With
    [partitioning], a table created now is partitioned by range of created_at (the
    same columns; sql/partitions.sql): the choice is made once, when the table is made."""
    partitioned = run.created and run.partitioning is not None
    run.conn.execute(run.sql.query("create_partitioned_table" if partitioned else "create_table"))
    if run.created:
        for key in run.wanted_indexes:
            run.conn.execute(run.sql.index_ddl(key, concurrently=False, partitioned=partitioned))


def _add_dedup_key(run: MigrationRun) -> None:
    # ADD COLUMN IF NOT EXISTS takes an exclusive lock even when the column exists.
    if not run.one("column_exists", {"table": run.sql.regclass_text, "column": "dedup_key"}):
        run.conn.execute(run.sql.query("add_dedup_key"))


def _create_state_table(run: MigrationRun) -> None:
    run.run("create_state_table")
    if not run.one("state_has_on_done", {"state_table": run.sql.regclass_of("relay_state")}):
        run.conn.execute(run.sql.query("add_on_done"))


def _create_audit_table(run: MigrationRun) -> None:
    run.conn.execute(run.sql.query("create_audit_table"))  # who retried/skipped which dead rows, and why


def _create_dedup_keys(run: MigrationRun) -> None:
    run.conn.execute(run.sql.query("create_dedup_keys"))


def _add_autovacuum_applied(run: MigrationRun) -> None:
    """The state table records which autovacuum parameters migrate set, so that an
    operator's own value (or RESET) is told apart from ours and never overwritten."""
    run.conn.execute(run.sql.query("add_autovacuum_applied"))


def _add_record_columns(run: MigrationRun) -> None:
    """``tombstone`` and ``partition``: a row may ask for a null value (a delete on a
    compacted topic) and for its partition."""
    run.conn.execute(run.sql.query("add_record_columns"))


def _add_audit_replay(run: MigrationRun) -> None:
    """The audit trail's action may also be ``replay`` (delivered rows sent again), and
    it records the rows a replay could not send (``rows_failed``)."""
    audit = run.sql.audit_regclass_text
    for (name,) in run.conn.execute(run.sql.query("audit_action_checks"), {"audit_table": audit}).fetchall():
        run.conn.execute(run.sql.query("drop_audit_check", constraint=sql.Identifier(name)))
    run.conn.execute(
        run.sql.query("add_audit_replay_check", constraint=sql.Identifier(run.sql.audit_action_check_name))
    )
    run.conn.execute(run.sql.query("add_audit_rows_failed"))


def _create_pauses(run: MigrationRun) -> None:
    """Operator pauses (sql/pauses.sql): their table, and the audit trail's action may
    also be ``pause`` or ``resume``."""
    run.run("create_pauses")
    audit = run.sql.audit_regclass_text
    for (name,) in run.conn.execute(run.sql.query("audit_action_checks"), {"audit_table": audit}).fetchall():
        run.conn.execute(run.sql.query("drop_audit_check", constraint=sql.Identifier(name)))
    run.conn.execute(run.sql.query("add_audit_pause_check", constraint=sql.Identifier(run.sql.audit_action_check_name)))


def _add_payload_bytes(run: MigrationRun) -> None:
    """``payload_bytes``: a row already encoded by its writer carries the value to
    publish as it is (``enqueue(payload_bytes=...)``)."""
    run.conn.execute(run.sql.query("add_payload_bytes"))


def _add_gauge_bounds(run: MigrationRun) -> None:
    """``gauge_bounds``: where the relays' fast claims start while vacuum is held back,
    so that ``status`` in its own process starts its counts there too."""
    run.conn.execute(run.sql.query("add_gauge_bounds"))


STEPS: tuple[Step, ...] = (
    Step(1, "create_table", _create_table),
    Step(2, "add_dedup_key", _add_dedup_key),
    Step(3, "create_state_table", _create_state_table),
    Step(4, "create_audit_table", _create_audit_table),
    Step(5, "create_dedup_keys", _create_dedup_keys),
    Step(6, "add_autovacuum_applied", _add_autovacuum_applied),
    Step(7, "add_record_columns", _add_record_columns),
    Step(8, "add_audit_replay", _add_audit_replay),
    Step(9, "create_pauses", _create_pauses),
    Step(10, "add_payload_bytes", _add_payload_bytes),
    Step(11, "add_gauge_bounds", _add_gauge_bounds),
)
#: The last step of the layouts made before steps were recorded (see the module docstring).
BASELINE = 5


# --- every-run steps (idempotent, depend on the run's options) -----------------------


def _fillfactor(run: MigrationRun) -> None:
    """A table without a fillfactor of its own gets the layout's (an operator's own
    value is kept); a table created now has it from its DDL."""
    if run.partitioned:
        return  # no storage of its own: each partition gets it when created (partitions.py)
    if run.one("table_fillfactor", {"table": run.sql.regclass_text}) is None:
        run.conn.execute(run.sql.query("set_fillfactor"))
        run.notes.append(
            f"set fillfactor {FILLFACTOR} (new rows leave room for their claim and finalize on the same page)"
        )


def _autovacuum(run: MigrationRun) -> None:
    """The queue table's autovacuum parameters (autovacuum.py decides, this writes):
    the operator's database.autovacuum values, the queue defaults for the rest, and
    never over a value the table got from someone else."""
    if run.partitioned:
        return  # set on each partition when it is created (partitions.partition_storage)
    row = run.conn.execute(run.sql.query("autovacuum_state"), {"table": run.sql.regclass_text}).fetchone()
    current = parse_reloptions(row[0] if row else None)
    applied = {str(k): str(v) for k, v in ((row[1] if row else None) or {}).items()}
    changes, record, kept = plan(current, applied, check_overrides(run.autovacuum))
    for change in changes:
        parameter = sql.SQL(change.parameter)  # validated by check_overrides / QUEUE_AUTOVACUUM
        if change.value is None:
            run.conn.execute(run.sql.query("reset_storage_parameter", parameter=parameter))
        else:
            run.conn.execute(
                run.sql.query("set_storage_parameter", parameter=parameter, value=sql.Literal(change.value))
            )
    if record != applied:
        run.conn.execute(run.sql.query("set_autovacuum_applied"), {"applied": json.dumps(record)})
    run.notes += [f"kept {k}" for k in kept]
    if changes and not run.created:
        run.notes.append(
            "autovacuum: "
            + ", ".join(
                f"{c.parameter} = {c.value}" if c.value is not None else f"{c.parameter} reset" for c in changes
            )
            + " (a queue table: see the MVCC pressure page of the documentation)"
        )


def _on_done_mode(run: MigrationRun) -> None:
    if run.one("set_on_done", {"on_done": run.on_done}):
        run.notes.append(
            "finalize now deletes delivered rows (relay.on_done = delete); done rows kept so far stay until purge"
            if run.on_done == "delete"
            else "finalize now keeps delivered rows as done (relay.on_done = keep)"
        )


def _backfill_dedup_keys(run: MigrationRun) -> None:
    """Keys of rows written by an enqueue() older than the key table."""
    run.conn.execute(run.sql.query("backfill_dedup_keys"))


def _notify_trigger(run: MigrationRun) -> None:
    if run.notify_trigger:
        run.conn.execute(run.sql.query("create_notify_function"))
        exists = run.one(
            "notify_trigger_exists", {"table": run.sql.regclass_text, "trigger": run.sql.notify_trigger_name}
        )
        if not exists:  # creating a trigger locks the table against writers: only when missing
            run.conn.execute(run.sql.query("create_notify_trigger"))
    else:
        run.run("drop_notify_trigger")


def _partitions(run: MigrationRun) -> None:
    """[partitioning]: the default partition, and on a table created now the current
    partition and those ahead (later ones are maintenance's: partitions.py). Notes when
    the setting and the table disagree."""
    partitioned = run.partitioned
    if run.partitioning is None:
        if partitioned:
            run.notes.append(
                "the table is partitioned but [partitioning] is not set: no partition is created ahead, new rows "
                "will land in the default partition; set [partitioning] as when the table was created"
            )
        return
    if not partitioned:
        run.notes.append(
            "[partitioning] is set but the table is not partitioned (it existed before): it stays as it is; "
            "converting it is not automated yet (docs/how-to/partitioned-outbox.md)"
        )
        return
    if create_default_partition(run.conn, run.sql, run.partitioning):
        run.notes.append(f"created default partition {run.sql.partition_name('default')}")
    if run.created:
        made = create_ahead_in_transaction(run.conn, run.sql, run.partitioning)
        run.notes.append(f"created {len(made)} partitions ({made[0]} to {made[-1]})")


EVERY_RUN: tuple[Callable[[MigrationRun], None], ...] = (
    _partitions,
    _fillfactor,
    _autovacuum,
    _on_done_mode,
    _backfill_dedup_keys,
    _notify_trigger,
)


def _forget_dropped_table(run: MigrationRun, done: set[int]) -> None:
    """The record lists steps but the outbox table is gone (dropped by hand, its record
    kept). Recreating it is safe only with ids after every id the dropped table used: a
    new table would count from 1 again, and a consumer that deduplicates by message id
    (the inbox) would skip each new row whose id an old one had. Only the operator
    knows that bound, so migrate recreates the table only when given it."""
    if run.recreate_from_id is None:
        raise SchemaMissing(
            f"table {run.sql.regclass_text} does not exist but {run.sql.regclass_of('migrations')} records "
            f"{len(done)} migration steps applied to it (the table was dropped, its record kept): recreate it "
            "with `outbox-relay migrate --recreate-from-id N`, N above the highest id the dropped table used "
            "(the last message_id your consumers saw; 1 if no consumer deduplicates by message id)"
        )
    run.conn.execute(run.sql.query("forget_migrations"))


def apply(run: MigrationRun) -> list[int]:
    """Bring the table up to the last step, then run the every-run steps; returns the
    numbers of the steps applied now. The caller holds the advisory lock and the
    transaction (with its lock timeout)."""
    conn, table_sql, steps = run.conn, run.sql, STEPS
    # CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema
    # exists: an owner that owns only its schema must still migrate.
    if table_sql.schema_name and not run.one("schema_exists", {"schema": '"' + table_sql.schema_name + '"'}):
        conn.execute(table_sql.query("create_schema"))
    run.created = not run.one("table_exists", {"table": table_sql.regclass_text})
    conn.execute(table_sql.query("create_migrations_table"))
    done = {int(row[0]) for row in conn.execute(table_sql.query("migrations_applied")).fetchall()}
    recreated = run.created and bool(done)
    if recreated:
        _forget_dropped_table(run, done)
        done = set()
    applied: list[int] = []
    for step in steps:
        if step.number in done:
            continue
        step.apply(run)
        conn.execute(table_sql.query("record_migration"), {"step": step.number, "name": step.name})
        applied.append(step.number)
    if recreated:
        assert run.recreate_from_id is not None  # _forget_dropped_table refused otherwise
        conn.execute(table_sql.query("restart_ids", first_id=sql.Literal(run.recreate_from_id)))
        conn.execute(table_sql.query("forget_autovacuum_applied"))
        run.notes.append(
            f"recreated {table_sql.regclass_text} (dropped; its migration record was kept), "
            f"ids from {run.recreate_from_id}"
        )
    if applied and not run.created and done:
        run.notes.append(
            "applied migration steps " + ", ".join(f"{s.number:04d} {s.name}" for s in steps if s.number in applied)
        )
    for every_run in EVERY_RUN:
        every_run(run)
    return applied


# --- the SQL of a fresh installation, for migration tools (migrate --print-sql) --------


def _render(statement: sql.Composable, params: Mapping[str, Any] | None = None) -> str:
    """One statement as text, its parameters written in as literals."""
    text = statement.as_string(None)
    if params is not None:
        for name, value in params.items():
            text = text.replace(f"%({name})s", sql.Literal(value).as_string(None))
        text = text.replace("%%", "%")
    return text.strip() + ";"


def fresh_install_sql(
    table_sql: TableSql,
    *,
    on_done: str,
    notify_trigger: bool,
    wanted_indexes: Sequence[str],
    autovacuum: Mapping[str, str],
    partitioning: PartitionLayout | None = None,
) -> list[str]:
    """The statements ``migrate`` runs on a database without the table, in its order:
    the schema, the record, every numbered step as it creates a new table (indexes built
    in the same transaction: the table is empty), the steps recorded, then the
    every-run steps as they come out on a new table. Nothing is read from a database.
    The same named sections as ``apply``; tests/acceptance/test_migrate_cli.py checks
    that a database set up from this text is one ``migrate`` has nothing to do on.
    ``partitioning``: the partitioned layout, with its default partition and the
    partitions ahead computed when the text is applied (not when it is printed)."""
    if on_done not in ("keep", "delete"):
        raise ValueError(f"on_done must be 'keep' or 'delete', not {on_done!r}")
    out: list[str] = []
    if table_sql.schema_name:
        out.append(_render(table_sql.query("create_schema")))
    out.append(_render(table_sql.query("create_migrations_table")))
    # Step 1 on a new table: the table (with its fillfactor) and the layout's indexes.
    partitioned = partitioning is not None
    out.append(_render(table_sql.query("create_partitioned_table" if partitioned else "create_table")))
    out += [_render(table_sql.index_ddl(key, concurrently=False, partitioned=partitioned)) for key in wanted_indexes]
    # Step 2 adds dedup_key to older tables: a new table has it. Step 3: the state table
    # (created with its on_done column). Steps 4 to 6: the companion tables and columns.
    out += [_render(statement) for statement in table_sql.statements("create_state_table")]
    # Steps 8 (add_audit_replay) and 9 (create_pauses) replace the audit table's action
    # check with one that also allows 'replay', then 'pause' and 'resume', under its own
    # name: a new table is created with the last one.
    audit = _render(table_sql.query("create_audit_table"))
    old_check = "CHECK (action IN ('retry', 'skip'))"
    if audit.count(old_check) != 1:
        raise AssertionError("create_audit_table's action check changed: update fresh_install_sql")
    new_check = _render(
        table_sql.query("add_audit_pause_check", constraint=sql.Identifier(table_sql.audit_action_check_name))
    )
    out.append(audit.replace(old_check, new_check[new_check.index("CONSTRAINT") :].rstrip(";")))
    out.append(_render(table_sql.query("create_dedup_keys")))
    out.append(_render(table_sql.query("add_autovacuum_applied")))
    # Step 7: the record columns; step 8: the audit's rows_failed.
    out.append(_render(table_sql.query("add_record_columns")))
    out.append(_render(table_sql.query("add_audit_rows_failed")))
    # Step 9: the operator pauses table (its audit check is above); step 10: payload_bytes.
    out += [_render(statement) for statement in table_sql.statements("create_pauses")]
    out.append(_render(table_sql.query("add_payload_bytes")))
    out.append(_render(table_sql.query("add_gauge_bounds")))  # step 11
    out += [_render(table_sql.query("record_migration"), {"step": step.number, "name": step.name}) for step in STEPS]
    # Every-run steps on a new table: the partitions (a partitioned table), the
    # autovacuum parameters and their record (a plain table: a partitioned one has no
    # storage, each partition gets them), the mode, the wake-up trigger (the fillfactor
    # is in the table's DDL, no key to backfill).
    changes, record, _kept = plan({}, {}, check_overrides(autovacuum))
    if partitioning is not None:
        out += _partitions_sql(table_sql, partitioning)
        changes, record = [], {}
    for change in changes:
        parameter = sql.SQL(change.parameter)  # validated by check_overrides / QUEUE_AUTOVACUUM
        if change.value is not None:
            out.append(
                _render(table_sql.query("set_storage_parameter", parameter=parameter, value=sql.Literal(change.value)))
            )
    if record:
        out.append(_render(table_sql.query("set_autovacuum_applied"), {"applied": json.dumps(record)}))
    if on_done != "keep":  # the state table's default mode is keep
        out.append(_render(table_sql.query("set_on_done"), {"on_done": on_done}))
    if notify_trigger:
        out.append(_render(table_sql.query("create_notify_function")))
        out.append(_render(table_sql.query("create_notify_trigger")))
    return out


def _partitions_sql(table_sql: TableSql, layout: PartitionLayout) -> list[str]:
    """A new partitioned outbox's default partition, then the current partition and
    ``premake`` after it, from the clock of the transaction that applies the text."""
    default = _render(
        table_sql.partition_query(
            "create_default_partition", table_sql.partition_name("default"), storage=storage_clause(layout)
        )
    )
    # A partition's name is the table's (shortened to fit with a suffix of this length)
    # and its start: the suffix's length depends on the width only.
    sample = partition_suffix(datetime(2000, 1, 1, tzinfo=UTC), layout.interval_seconds)
    prefix = table_sql.partition_name(sample)[: -len(sample)] + "p"
    name_format = "YYYYMMDDHH24" if len(sample) == len("p2000010100") else "YYYYMMDDHH24MI"
    ahead = table_sql.query(
        "create_partitions_ahead_at_apply",
        width_seconds=sql.Literal(layout.interval_seconds),
        premake=sql.Literal(layout.premake),
        name_prefix=sql.Literal(prefix),
        name_format=sql.Literal(name_format),
        schema=sql.Literal(table_sql.schema_name or ""),
        table_text=sql.Literal(table_sql.ident.as_string(None)),
        storage=sql.Literal(storage_clause(layout).as_string(None)),
    )
    return [default, _render(ahead, {})]
