"""The SQL of ``sql/*.sql`` (one file per job), loaded once, bound to one outbox table.

Identifiers (table, index, trigger, function names) are composed with
``psycopg.sql.Identifier`` so a configured table name is always quoted and can
never be concatenated into a statement.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cached_property
from importlib import resources

from psycopg import sql

_SECTION_RE = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
# A role name for `outbox-relay grants`: a plain identifier, always sent quoted. Anything
# else (quotes, spaces, semicolons) is refused rather than escaped: it is a mistake.
ROLE_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}\Z")
GRANT_KINDS = ("relay", "operator", "writer")


# The files of sql/ whose sections are loaded; a section name is unique across them.
SQL_FILES: tuple[str, ...] = (
    "schema.sql",
    "migrations.sql",
    "delivery.sql",
    "monitoring.sql",
    "operator.sql",
    "write.sql",
    "inbox.sql",
    "grants.sql",
    "pauses.sql",
    "discovery.sql",
    "partitions.sql",
)


def _load_sections() -> dict[str, str]:
    sections: dict[str, str] = {}
    for file_name in SQL_FILES:
        text = resources.files(__package__).joinpath("sql", file_name).read_text(encoding="utf-8")
        matches = list(_SECTION_RE.finditer(text))
        for match, following in zip(matches, [*matches[1:], None], strict=True):
            end = following.start() if following else len(text)
            name = match.group(1)
            if name in sections:
                raise RuntimeError(f"SQL section {name!r} is defined twice (sql/{file_name})")
            sections[name] = text[match.end() : end].strip()
    return sections


QUERIES: dict[str, str] = _load_sections()


def _strip_comments(text: str) -> str:
    """Without its whole-line ``--`` comments: they stay in the .sql files for the reader
    but are not sent with every statement (psycopg would also parse them for
    placeholders)."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--")).strip()


# The claim's row lock (delivery.sql "claim" {row_lock}); a lockless claim leaves it out.
CLAIM_ROW_LOCK = "FOR UPDATE SKIP LOCKED"

#: The statements as sent to the server.
EXECUTABLE: dict[str, str] = {name: _strip_comments(body) for name, body in QUERIES.items()}

# Index layout (the DDL is in sql/schema.sql, section "index_<key>"; the index is named
# "<table>_<key>_idx"). Every index costs WAL on each insert or update that enters it,
# so an index exists only where a statement of this layout reads it.
# pending: the claim, the backlog gauges; processing: reclaim, reap, expired leases,
# the backlog gauges; dead: dead-letter listing and retry --all; dedup_key: partial,
# only rows enqueued with a key enter it.
BASE_INDEXES: tuple[str, ...] = ("pending", "processing", "dead", "dedup_key")
# Only where relay.ordered_event_types is set: the ordered claim and the blocked gauge.
ORDERING_INDEXES: tuple[str, ...] = ("aggregate_active", "aggregate_dead")
# Created by earlier versions, read by none of today's statements: migrate drops them.
# aggregate: replaced by the two ordering indexes, which leave dead rows out; unfinished_created and
# done: the gauges read the claim's indexes and purge walks the primary key (fewer indexes to write per row).
OBSOLETE_INDEXES: tuple[str, ...] = ("aggregate", "unfinished_created", "done")
# Operator pauses park a pending row by moving its available_at forward by PARK_SHIFT
# (whole hours: an exact number of microseconds, undone exactly by resume); a pending
# row at or after PARK_FLOOR is a parked one (sql/pauses.sql).
PARK_SHIFT_HOURS = 8_766_000  # about 1000 years
PARK_SHIFT_SQL = f"make_interval(hours => {PARK_SHIFT_HOURS})"
PARK_FLOOR_SQL = "'2900-01-01 00:00:00+00'::timestamptz"
# New pages are filled to half (see sql/schema.sql, set_fillfactor).
FILLFACTOR = 50


def _short(name: str, suffix: str) -> str:
    """Identifier of at most 63 bytes (PostgreSQL's NAMEDATALEN - 1), stable per table."""
    candidate = f"{name}_{suffix}"
    if len(candidate.encode()) <= 63:
        return candidate
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{name[: 63 - len(suffix) - 10]}_{digest}_{suffix}"


#: Public name of _short for the modules that name partitions and their indexes.
short_name = _short


@dataclass(frozen=True)
class TableSql:
    """Statements of sql/*.sql with the identifiers of one outbox table filled in."""

    table: str  # "outbox" or "schema.outbox", validated by config

    @cached_property
    def schema_name(self) -> str | None:
        return self.table.split(".")[0] if "." in self.table else None

    @cached_property
    def table_name(self) -> str:
        return self.table.split(".")[-1]

    @cached_property
    def ident(self) -> sql.Identifier:
        return sql.Identifier(*self.table.split("."))

    def _qualified(self, name: str) -> sql.Identifier:
        return sql.Identifier(self.schema_name, name) if self.schema_name else sql.Identifier(name)

    @cached_property
    def channel(self) -> str:
        """LISTEN/NOTIFY channel of this table."""
        return _short("outbox_relay_" + self.table.replace(".", "_"), "wake")

    @cached_property
    def regclass_text(self) -> str:
        """The table as text for to_regclass(): quoted parts, so case is kept."""
        return ".".join('"' + part + '"' for part in self.table.split("."))

    def regclass_of(self, suffix: str) -> str:
        """A companion table of this one ("relay_state", "dedup_keys") as to_regclass() text."""
        name = '"' + _short(self.table_name, suffix) + '"'
        return f'"{self.schema_name}".{name}' if self.schema_name else name

    @cached_property
    def audit_regclass_text(self) -> str:
        """The audit table (operator retry/skip trail) as text for to_regclass()."""
        audit = _short(self.table_name, "audit")
        return ".".join('"' + part + '"' for part in ([self.schema_name] if self.schema_name else []) + [audit])

    @cached_property
    def audit_action_check_name(self) -> str:
        """The CHECK constraint of the audit table's action column (what may be recorded)."""
        return _short(self.table_name, "audit_action_check")

    @cached_property
    def pauses_regclass_text(self) -> str:
        """The operator pauses table (sql/pauses.sql) as text for to_regclass()."""
        return self.regclass_of("pauses")

    @cached_property
    def notify_trigger_name(self) -> str:
        return _short(self.table_name, "notify_trg")

    @cached_property
    def _names(self) -> dict[str, sql.Composable]:
        base = self.table_name
        return {
            "table": self.ident,
            **{
                f"idx_{key}": sql.Identifier(self.index_name(key))
                for key in (*BASE_INDEXES, *ORDERING_INDEXES, *OBSOLETE_INDEXES)
            },
            "schema": sql.Identifier(self.schema_name or "public"),
            "state_table": self._qualified(_short(base, "relay_state")),
            "dedup_keys": self._qualified(_short(base, "dedup_keys")),
            "migrations_table": self._qualified(_short(base, "migrations")),
            "fn_notify": self._qualified(_short(base, "notify_fn")),
            "trg_notify": sql.Identifier(self.notify_trigger_name),
            "channel_literal": sql.Literal(self.channel),
            "fillfactor": sql.Literal(FILLFACTOR),
            "strict": sql.SQL(""),
            # Operator console / CLI: the audit trail and the one dead-row filter both use.
            "audit_table": self._qualified(_short(base, "audit")),
            "dead_filter": sql.SQL(_strip_comments(QUERIES["dead_filter"])),
            "done_filter": sql.SQL(_strip_comments(QUERIES["done_filter"])),  # a replay's rows
            # Operator pauses (sql/pauses.sql): the table, the active pauses as arrays (a
            # CTE of the claims), and how a paused pending row is parked.
            "pauses_table": self._qualified(_short(base, "pauses")),
            "idx_pauses_active": sql.Identifier(_short(base, "pauses_active_idx")),
            "paused_selectors": sql.SQL(_strip_comments(QUERIES["paused_selectors"])).format(
                pauses_table=self._qualified(_short(base, "pauses"))
            ),
            "park_floor": sql.SQL(PARK_FLOOR_SQL),
            "park_shift": sql.SQL(PARK_SHIFT_SQL),
            # Where the claim's index scans start (claim_cursor.py); the store passes
            # parameters, any other caller gets the claim from the front of both indexes.
            "due_bound": sql.SQL("true"),
            "leases_bound": sql.SQL("true"),
            "lease_scan": sql.SQL("true"),
            "writers_look": sql.SQL(
                "SELECT NULL::timestamptz AS since, NULL::text AS long_writers, NULL::bigint AS looked_at_us"
            ),
            "claim_report": sql.SQL(""),
            # The claim's row lock (delivery.sql "claim"); the store's lockless claim leaves it out.
            "row_lock": sql.SQL(CLAIM_ROW_LOCK),
            # enqueue(tombstone=..., partition=...): the record columns, only when asked for.
            "record_columns": sql.SQL(""),
            "record_values": sql.SQL(""),
            # The checks of a partitioned outbox (sql/partitions.sql), named as PostgreSQL names a plain table's.
            "status_check": sql.Identifier(_short(base, "status_check")),
            "lease_check": sql.Identifier(_short(base, "check")),
        }

    def index_name(self, key: str) -> str:
        """Name of one of the layout's indexes (unqualified: an index lives in its table's schema)."""
        return _short(self.table_name, f"{key}_idx")

    def index_ddl(self, key: str, *, concurrently: bool, partitioned: bool = False) -> sql.Composed:
        """``partitioned``: the index on a partitioned outbox (the dedup index is then not
        unique: see sql/partitions.sql, index_dedup_key_partitioned)."""
        section = "index_dedup_key_partitioned" if partitioned and key == "dedup_key" else "index_" + key
        return sql.SQL(_strip_comments(QUERIES[section])).format(
            **self._names, concurrently=sql.SQL("CONCURRENTLY" if concurrently else "")
        )

    def partitioned_index_ddl(self, key: str, *, partition: str | None) -> sql.Composed:
        """Building a missing index of a partitioned outbox without blocking writers:
        ``partition`` None, the invalid index on the partitioned table alone (ON ONLY);
        else the same index built CONCURRENTLY on one partition, named after it."""
        section = "index_dedup_key_partitioned" if key == "dedup_key" else "index_" + key
        if partition is None:
            target: sql.Composable = sql.SQL("ONLY ") + self.ident
            name = sql.Identifier(self.index_name(key))
            concurrently = ""
        else:
            target = self.partition_ident(partition)
            name = sql.Identifier(_short(partition, f"{key}_idx"))
            concurrently = "CONCURRENTLY"
        return sql.SQL(_strip_comments(QUERIES[section])).format(
            **dict(self._names, table=target, **{f"idx_{key}": name}), concurrently=sql.SQL(concurrently)
        )

    def partition_index_name(self, partition: str, key: str) -> str:
        return _short(partition, f"{key}_idx")

    def drop_index(self, key: str, *, concurrently: bool) -> sql.Composed:
        return sql.SQL(QUERIES["drop_index"]).format(
            index=self._qualified(self.index_name(key)), concurrently=sql.SQL("CONCURRENTLY" if concurrently else "")
        )

    def query(self, name: str, *, strict: bool = False, **extra: sql.Composable) -> sql.Composed:
        """``extra``: further placeholders of this one statement, e.g. status=sql.Literal("dead")."""
        names = dict(self._names, **extra)
        if strict:
            names["strict"] = sql.SQL("AND o.lease_until > now()")
        return sql.SQL(EXECUTABLE[name]).format(**names)

    def partition_ident(self, name: str) -> sql.Identifier:
        """A partition of this table (it lives in the table's schema)."""
        return self._qualified(name)

    def partition_name(self, suffix: str) -> str:
        """Name of a partition: the table's name and a suffix (``default``, ``p2026120300``)."""
        return _short(self.table_name, suffix)

    def partition_query(self, name: str, partition: str, **extra: sql.Composable) -> sql.Composed:
        """A statement of sql/partitions.sql on one partition (its unqualified name)."""
        return self.query(name, strict=False, partition=self.partition_ident(partition), **extra)

    def grants(self, kind: str, role: str, *, database: str | None = None) -> list[sql.Composed]:
        """GRANT statements (sql/grants.sql ``grant_<kind>``) for a role of one kind:
        ``relay`` (run), ``operator`` (status, dead, purge) or ``writer`` (enqueue).
        ``database`` adds CONNECT."""
        if kind not in GRANT_KINDS:
            raise ValueError(f"unknown role kind {kind!r}: use one of {', '.join(GRANT_KINDS)}")
        if not ROLE_NAME_RE.match(role):
            raise ValueError(
                f"invalid role name {role!r}: use letters, digits and underscores "
                "(at most 63, not starting with a digit)"
            )
        names: dict[str, sql.Composable] = dict(self._names)
        names["role"] = sql.Identifier(role)
        statements: list[sql.Composed] = []
        if database:
            names["database"] = sql.Identifier(database)
            statements += self.statements("grant_connect", names)
        statements += self.statements(f"grant_{kind}", names)
        return statements

    def statements(self, name: str, names: dict[str, sql.Composable] | None = None) -> list[sql.Composed]:
        """A multi-statement section split on ';' at line ends (DDL sections)."""
        body = QUERIES[name]
        parts = [p.strip() for p in re.split(r";\s*\n", body) if p.strip()]
        values = self._names if names is None else names
        return [sql.SQL(_strip_comments(p)).format(**values) for p in parts]
