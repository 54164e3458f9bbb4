"""``outbox-relay`` command line (typer). Thin: parse, load settings, call the library.

Exit codes: 0 success; 1 a runtime failure (database or broker unreachable, rows
not found); 2 bad configuration or usage; 130 interrupted (Ctrl-C). Errors are one
line on stderr, never a traceback (docs/reference/logs-and-exit-codes.md).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, TypeVar

import typer

from .._version import __version__
from ..config import Settings, parse_duration
from ..core.filters import DeadFilter
from ..core.ordering import OrderingRule
from ..db.claim_cursor import GaugeBounds
from ..db.store import DeadSummary
from .cli_common import (
    AggregateIdOpt,
    AggregateTypeOpt,
    ConfigOpt,
    EventTypeOpt,
    SinceOpt,
    SourceOpt,
    UntilOpt,
)
from .cli_common import errors as _errors
from .cli_common import fail as _fail
from .cli_common import filter_from_options as _filter
from .cli_common import for_source as _for_source
from .cli_common import open_store as _store
from .cli_common import progress as _progress
from .cli_common import settings_from as _settings
from .controls_cli import controls_app
from .operations import (
    CLI_WORDING,
    Action,
    OperatorRuleError,
    change_dead,
    check_dead_change,
    diagnose_aggregate,
    jsonable,
    os_user,
    preview_dead,
    row_states,
)

app = typer.Typer(
    name="outbox-relay",
    help="Deliver a PostgreSQL transactional outbox to Kafka, at least once.",
    add_completion=False,
    pretty_exceptions_enable=False,
)
dead_app = typer.Typer(help="Inspect and repair dead rows.")
app.add_typer(dead_app, name="dead")
aggregate_app = typer.Typer(help="Inspect one aggregate.")
app.add_typer(aggregate_app, name="aggregate")
audit_app = typer.Typer(help="The operators' trail: retries, skips and replays.")
app.add_typer(audit_app, name="audit")
app.add_typer(controls_app)  # replay (controls_cli.py)

T = TypeVar("T")


def _require_subcommand(ctx: typer.Context) -> None:
    """A group run without its subcommand: the usage on stderr, then one line naming the
    choices, exit 2 (as argparse does for a missing sub-command), never a bare help page
    followed by an empty error."""
    if ctx.invoked_subcommand is not None or ctx.resilient_parsing:
        return
    group: Any = ctx.command
    choices = [name for name in group.list_commands(ctx) if not group.get_command(ctx, name).hidden]
    typer.echo(ctx.get_usage(), err=True)
    _fail(f"`{ctx.command_path}` needs a command: one of {', '.join(choices)} (see `{ctx.command_path} --help`)", 2)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"outbox-relay {__version__}")
        raise typer.Exit(0)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    _require_subcommand(ctx)


@dead_app.callback(invoke_without_command=True)
def _dead(ctx: typer.Context) -> None:
    _require_subcommand(ctx)


@aggregate_app.callback(invoke_without_command=True)
def _aggregate(ctx: typer.Context) -> None:
    _require_subcommand(ctx)


@audit_app.callback(invoke_without_command=True)
def _audit(ctx: typer.Context) -> None:
    _require_subcommand(ctx)


# --- run / migrate ---------------------------------------------------------------------
@app.command()
def run(
    workers: Annotated[int | None, typer.Option("--workers", "-w", min=1, help="Worker threads.")] = None,
    config: ConfigOpt = None,
) -> None:
    """Run the relay in the foreground until SIGTERM/SIGINT."""
    settings = _settings(config, relay={"workers": workers} if workers else None)
    from ..runtime.relay import Relay
    from ..sources import uses_sources

    with _errors():
        if uses_sources(settings):  # [sources] or [discovery]: one process for every outbox
            from ..runtime.multi import MultiRelay

            MultiRelay(settings).run_forever()
            return
        relay = Relay(settings)
        relay.run_forever()


@app.command()
def migrate(
    config: ConfigOpt = None,
    no_notify_trigger: Annotated[
        bool, typer.Option("--no-notify-trigger", help="Do not install (and drop) the LISTEN/NOTIFY trigger.")
    ] = False,
    drop_ordering_indexes: Annotated[
        bool,
        typer.Option(
            "--drop-ordering-indexes",
            help="Drop the per-aggregate indexes of ordered delivery (relay.ordered_event_types must be empty).",
        ),
    ] = False,
    source: SourceOpt = None,
    all_sources: Annotated[
        bool, typer.Option("--all-sources", help="Migrate every configured and discovered source, one after the other.")
    ] = False,
    print_sql: Annotated[
        bool,
        typer.Option(
            "--print-sql",
            help="Connect to nothing: print the SQL migrate runs on a database without the table (the whole schema, "
            "with the configured table, relay.on_done, ordering indexes, autovacuum, [partitioning] and "
            "--no-notify-trigger), to "
            "review it or apply it with a migration tool (Flyway, Alembic, Liquibase) in one transaction.",
        ),
    ] = False,
    relay_role: Annotated[
        str | None, typer.Option("--relay", help="With --print-sql: also the GRANTs of the role that runs the relay.")
    ] = None,
    operator_role: Annotated[
        str | None, typer.Option("--operator", help="With --print-sql: also the GRANTs of the operators' role.")
    ] = None,
    writer_role: Annotated[
        str | None, typer.Option("--writer", help="With --print-sql: also the GRANTs of the application's role.")
    ] = None,
    recreate_from_id: Annotated[
        int | None,
        typer.Option(
            "--recreate-from-id",
            min=1,
            help="The outbox table was dropped but its migration record kept: recreate it, its ids starting at N "
            "(above the highest id the dropped table used, so consumers deduplicating by message id take new rows "
            "as new). Does nothing while the table exists.",
        ),
    ] = None,
    convert_to_partitioned: Annotated[
        bool,
        typer.Option(
            "--convert-to-partitioned",
            help="With [partitioning]: make the existing plain outbox partitioned without moving a row (it becomes "
            "the partition of everything before a boundary one partition width ahead; indexes built CONCURRENTLY, "
            "then one short lock). See docs/how-to/partitioned-outbox.md.",
        ),
    ] = False,
) -> None:
    """Create the outbox table, its indexes and the wake-up trigger; bring an existing
    table to this version's indexes (CONCURRENTLY: safe while relays run). Idempotent.
    The ordering indexes are created when relay.ordered_event_types is set; the table's
    mode is set to relay.on_done."""
    settings = _settings(config)
    roles = {"relay": relay_role, "operator": operator_role, "writer": writer_role}
    if print_sql:
        for flag, given in (
            ("--all-sources", all_sources),
            ("--drop-ordering-indexes", drop_ordering_indexes),
            ("--recreate-from-id", recreate_from_id is not None),
            ("--convert-to-partitioned", convert_to_partitioned),
        ):
            if given:
                _fail(f"--print-sql prints the schema of one new table: {flag} does not apply", 2)
        _print_migration_sql(_for_source(settings, source), no_notify_trigger, roles)
        return
    if any(roles.values()):
        _fail("--relay, --operator and --writer go with --print-sql (`outbox-relay grants` prints the grants)", 2)
    if all_sources:
        if source is not None:
            _fail("--source and --all-sources exclude each other", 2)
        if recreate_from_id is not None:
            _fail("--recreate-from-id names one table: use it with --source, not --all-sources", 2)
        if convert_to_partitioned:
            _fail("--convert-to-partitioned changes one table: use it with --source, not --all-sources", 2)
        _migrate_all(settings, config, no_notify_trigger, drop_ordering_indexes)
        return
    settings = _for_source(settings, source)
    ordering = bool(settings.relay.ordered_event_types)
    if drop_ordering_indexes and ordering:
        _fail("--drop-ordering-indexes: relay.ordered_event_types is set, and ordered delivery needs them", 2)
    from ..db.partitions import PartitionLayout

    with _store(settings) as store:
        notes = store.migrate(
            notify_trigger=not no_notify_trigger,
            ordering=ordering,
            on_done=settings.relay.on_done,
            drop_ordering_indexes=drop_ordering_indexes,
            autovacuum={k: str(v) for k, v in settings.database.autovacuum.items()},
            recreate_from_id=recreate_from_id,
            partitioning=PartitionLayout.from_settings(settings),
            convert_to_partitioned=convert_to_partitioned,
        )
    for note in notes:
        typer.echo(f"  {note}")
    typer.echo(f"migrated {settings.database.table}")


def _print_migration_sql(settings: Settings, no_notify_trigger: bool, roles: dict[str, str | None]) -> None:
    """migrate --print-sql: the statements of a fresh installation, then the grants asked for."""
    from ..db.migrations import fresh_install_sql
    from ..db.partitions import PartitionLayout
    from ..db.schema import BASE_INDEXES, ORDERING_INDEXES, TableSql

    ordering = bool(settings.relay.ordered_event_types)
    table = settings.database.table
    try:
        layout = PartitionLayout.from_settings(settings)
        statements = fresh_install_sql(
            TableSql(table),
            on_done=settings.relay.on_done,
            notify_trigger=not no_notify_trigger,
            wanted_indexes=[*BASE_INDEXES, *(ORDERING_INDEXES if ordering else ())],
            autovacuum={k: str(v) for k, v in settings.database.autovacuum.items()},
            partitioning=layout,
        )
    except ValueError as exc:
        _fail(f"database.autovacuum: {exc}", 2)
        raise
    p = settings.partitioning
    header = [
        f"-- outbox-relay {__version__}: what `outbox-relay migrate` runs on a database without {table}",
        f"-- (relay.on_done = {settings.relay.on_done}; ordering indexes: {'yes' if ordering else 'no'}; "
        f"wake-up trigger: {'no' if no_notify_trigger else 'yes'}; "
        + (
            f"partitioned by created_at, partitions of {p.interval}, premake = {p.premake}"
            if layout is not None
            else "a plain table"
        )
        + ").",
        "-- Apply it as the table's owner in ONE transaction (psql --single-transaction -f FILE, or as one",
        "-- migration of your tool): on a database that already has the table it fails at the migration record",
        "-- and changes nothing. A later version's changes are new numbered steps that `outbox-relay migrate`",
        "-- applies; --print-sql prints a fresh installation only.",
    ]
    if layout is not None:
        header += [
            "-- The current partition and those ahead are computed from the clock when the text is applied;",
            "-- later ones are made by the relay's maintenance or `outbox-relay maintain` (a CronJob).",
        ]
    typer.echo("\n".join([*header, *statements]))
    if any(roles.values()):
        typer.echo("\n".join(_grant_lines(settings, roles, before="apply the statements above first")))


def _migrate_all(settings: Settings, config: str | None, no_notify_trigger: bool, drop_ordering_indexes: bool) -> None:
    """migrate --all-sources: every source in turn; one that fails does not stop the others
    (exit 1 at the end naming them)."""
    from ..sources import all_sources

    with _errors():
        names = sorted(all_sources(settings))
    failed: list[str] = []
    for name in names:
        typer.echo(f"source {name}:")
        try:
            migrate(
                config=config,
                no_notify_trigger=no_notify_trigger,
                drop_ordering_indexes=drop_ordering_indexes,
                source=name,
                all_sources=False,
                print_sql=False,
                relay_role=None,
                operator_role=None,
                writer_role=None,
                recreate_from_id=None,
                convert_to_partitioned=False,
            )
        except typer.Exit as exc:
            if exc.exit_code:
                failed.append(name)
    if failed:
        _fail(f"migrate failed for {len(failed)} of {len(names)} sources: {', '.join(failed)}", 1)
    typer.echo(f"migrated {len(names)} sources")


# --- status ----------------------------------------------------------------------------
@app.command()
def status(
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    config: ConfigOpt = None,
    source: SourceOpt = None,
) -> None:
    """Queue depth per status (exact), oldest pending age, expired leases, attempts, blocked aggregates
    (of every source, or of the one named by --source). While vacuum is held back, pending and processing
    are counted from where the relays' claims start (counted_from)."""
    settings = _settings(config)
    from ..sources import uses_sources

    if source is None and uses_sources(settings):
        from .source_cli import status_of_every_source

        status_of_every_source(settings, json_out, lambda name: status(json_out=json_out, config=config, source=name))
        return
    settings = _for_source(settings, source)
    with _store(settings) as store:
        store.require_table()
        # While vacuum is held back, the relays publish where their fast claims start
        # (claim_cursor.py): below it the indexes hold a dead entry for every row
        # delivered since, so the pending and processing figures start there, and the
        # counts get a short budget (done rows have no index: their count reads the
        # table, as large as the horizon is old).
        published = store.published_gauge_bounds()
        stats = store.stats(
            ordered_types=list(settings.relay.ordered_event_types),
            include_depth=False,
            count_cap=settings.metrics.exact_count_limit,
            published=published,
        )
        on_done = store.on_done_mode()
        # Exact counts from each status's partial index; a status whose count runs out
        # of metrics.exact_count_timeout_ms is a lower bound ("≥ N").
        budget_ms = settings.metrics.exact_count_timeout_ms
        if published is not None:
            budget_ms = min(budget_ms, STATUS_UNDER_PRESSURE_BUDGET_MS)
        depth = store.exact_depth(
            budget_ms=budget_ms, first_upto=settings.metrics.exact_count_limit, published=published
        )
        horizon = store.xmin_horizon()
        vacuum = store.vacuum_figures()
        from .pauses import pause_overview

        pauses = pause_overview(
            store,
            count_cap=settings.metrics.exact_count_limit,
            timeout_ms=settings.metrics.exact_count_timeout_ms,
        )
    lower_bounds = [name for name, count in depth.items() if not count.exact]
    doc = {
        "table": settings.database.table,
        "on_done": on_done,
        "queue_depth": {name: count.n for name, count in depth.items()},
        "queue_depth_estimated": lower_bounds,  # statuses whose count is a lower bound
        # Where the pending and processing figures start (vacuum held back: see above);
        # null: from the front of their indexes, exactly.
        "counted_from": _counted_from(published),
        "oldest_pending_age_seconds": round(stats.oldest_pending_age_seconds, 3),
        "expired_leases": stats.expired_leases,
        "attempts": {str(k): v for k, v in sorted(stats.attempts.items())},
        "blocked_aggregates": [{"aggregate_id": a, "dead_id": i} for a, i in stats.blocked_aggregates],
        "xmin_horizon": horizon.as_json(),
        "vacuum": vacuum.as_json(),
        # Stored pauses an operator made (`outbox-relay pause`); the circuit breaker's
        # automatic pause is a state of each relay process, in its metrics and logs.
        "operator_pauses": pauses,
    }
    if json_out:
        typer.echo(json.dumps(doc))
        return
    typer.echo(
        f"outbox {settings.database.table}"
        + ("  (delivered rows are deleted: done counts rows skipped by an operator)" if on_done == "delete" else "")
    )
    typer.echo(f"  {'status':<12}{'rows':>14}")
    for name, count in depth.items():
        note = "  (lower bound: counting ran out of time)" if not count.exact else ""
        typer.echo(f"  {name:<12}{count!s:>14}{note}")
    if published is not None:
        counted = doc["counted_from"]
        typer.echo(
            f"  (vacuum held back: pending counted from available_at {counted['pending_from']['available_at']}"
            + (f", processing from lease_until {counted['processing_from']}" if counted["processing_from"] else "")
            + ", where the relays' claims start; rows below wait for their sweep)"
        )
    typer.echo(f"  oldest pending age   {stats.oldest_pending_age_seconds:.1f}s")
    typer.echo(f"  expired leases       {stats.expired_leases}")
    if stats.attempts:
        attempts = ", ".join(f"{k}: {v}" for k, v in sorted(stats.attempts.items()))
        typer.echo(f"  attempts (pending+processing): {attempts}")
    if settings.relay.ordered_event_types:
        typer.echo(f"  blocked aggregates   {len(stats.blocked_aggregates)}")
        for aggregate, dead_id in stats.blocked_aggregates[:20]:
            typer.echo(f"    {aggregate} blocked by dead row {dead_id}")
    active = pauses["active"]
    if active or pauses["paused_rows"]:
        parked = (
            "not counted in time"
            if pauses["paused_rows"] is None
            else f"{'≥ ' if pauses['paused_rows_capped'] else ''}{pauses['paused_rows']}"
        )
        typer.echo(f"  operator pauses      {len(active)} active, {parked} pending rows parked")
        for p in active:
            typer.echo(
                f"    operator pause {p['id']}: {p['selector']} {p['value']!r} since {p['paused_at']} "
                f"by {p['paused_by']} ({p['paused_from']}): {p['reason']}"
            )
    elif not pauses["migrated"]:
        typer.echo("  operator pauses      none (no pauses table yet: run `outbox-relay migrate`)")
    else:
        typer.echo("  operator pauses      none")
    typer.echo(f"  xmin horizon         {horizon.summary()}")
    note = horizon.note()
    if note:
        typer.echo(f"    {note}")
    for other in horizon.holders[1:]:
        typer.echo(f"    also: {other.describe()} ({other.age_xids} transactions)")
    since = "never" if vacuum.since_vacuum_seconds is None else f"{vacuum.since_vacuum_seconds:.0f}s ago"
    typer.echo(
        f"  vacuum               {vacuum.dead_tuples} dead tuples, heap {_mb(vacuum.heap_bytes)}, "
        f"indexes {_mb(vacuum.index_bytes)}, last vacuum {since}"
    )


# status while the relays publish their claims' starts (vacuum held back): the counts'
# time budget, at most (the operator asked for a quick look, not a full count).
STATUS_UNDER_PRESSURE_BUDGET_MS = 500


def _counted_from(bounds: GaugeBounds | None) -> dict[str, Any] | None:
    if bounds is None:
        return None
    due_at, due_id = bounds.due_from
    leases = bounds.leases_from.isoformat() if bounds.leases_from is not None else None
    return {"pending_from": {"available_at": due_at.isoformat(), "id": due_id}, "processing_from": leases}


def _mb(size_bytes: int) -> str:
    return f"{size_bytes / 2**20:.1f} MB"


# --- dead letters ----------------------------------------------------------------------
# The filters of `dead list|retry|skip` (the console's API takes the same names).
ErrorContainsOpt = Annotated[
    str | None, typer.Option("--error-contains", help="Only rows whose last_error contains TEXT (case-insensitive).")
]


def _print_summary(summary: DeadSummary | None, indent: str = "  ") -> None:
    if summary is None:
        typer.echo(f"{indent}(breakdown not available: grouping ran out of time)")
        return
    if summary.by_event_type:
        typer.echo(f"{indent}by event type: " + ", ".join(f"{name} {n}" for name, n in summary.by_event_type))
    if summary.by_error:
        typer.echo(f"{indent}by error:")
        for error, n in summary.by_error:
            typer.echo(f"{indent}  {n:>8}  {error[:120] or '(none)'}")
    sample = ", ".join(summary.sample_aggregates[:5])
    more = ", …" if summary.aggregates > 5 else ""
    typer.echo(f"{indent}aggregates: {summary.aggregates}" + (f" ({sample}{more})" if sample else ""))


@dead_app.command("list")
def dead_list(
    json_out: Annotated[bool, typer.Option("--json", help="JSON array output.")] = False,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="At most this many rows.")] = 100,
    after_id: Annotated[int, typer.Option("--after-id", min=0, help="Rows with a larger id (next page).")] = 0,
    event_type: EventTypeOpt = None,
    aggregate_type: AggregateTypeOpt = None,
    aggregate_id: AggregateIdOpt = None,
    error_contains: ErrorContainsOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    config: ConfigOpt = None,
    source: SourceOpt = None,
) -> None:
    """List dead rows in id order, then how many match (exactly) by event type, error and aggregate."""
    settings = _for_source(_settings(config), source)
    budget_ms = settings.metrics.exact_count_timeout_ms
    with _store(settings) as store:
        store.require_table()
        selector = _filter(
            store,
            event_type=event_type,
            aggregate_type=aggregate_type,
            aggregate_id=aggregate_id,
            error_contains=error_contains,
            since=since,
            until=until,
        )
        with _errors():
            rows = store.dead_page(selector, after_id=after_id, limit=limit)
            if json_out:
                typer.echo(json.dumps([jsonable(row) for row in rows]))
                return
            matched = store.dead_count(selector, budget_ms=budget_ms)
            summary = store.dead_summary(selector, timeout_ms=budget_ms) if matched.n else None
    if not rows:
        typer.echo(
            "no dead rows"
            if not selector.has_conditions() and not after_id
            else "no dead rows match" + (f" after id {after_id}" if after_id else "")
        )
        return
    for row in rows:
        error = (row["last_error"] or "").replace("\n", " ")
        typer.echo(
            f"{row['id']:>10}  {row['event_type']:<24} {row['aggregate_type']}/{row['aggregate_id']}  "
            f"attempts={row['attempts']}  {row['created_at']:%Y-%m-%d %H:%M:%S}  {error[:120]}"
        )
    typer.echo(
        f"{matched} dead rows match; showing {len(rows)}"
        + (f" (next page: --after-id {rows[-1]['id']})" if len(rows) == limit else "")
    )
    _print_summary(summary)


def _report_unmatched(store: Any, ids: list[int], changed: set[int]) -> int:
    missing = [i for i in ids if i not in changed]
    if not missing:
        return 0
    statuses = store.statuses(missing)
    for row_id in missing:
        if row_id not in statuses:
            typer.echo(f"outbox-relay: id {row_id}: no such row", err=True)
        else:
            typer.echo(f"outbox-relay: id {row_id}: not dead (status {statuses[row_id]})", err=True)
    return len(missing)


def _dead_change(
    action: Action,
    ids: list[int] | None,
    all_rows: bool,
    limit: int | None,
    dry_run: bool,
    reason: str | None,
    chunk_size: int,
    config: str | None,
    filters: dict[str, Any],
    source: str | None = None,
) -> None:
    """Shared body of `dead retry` and `dead skip`: ids, --all or a filter; dry run or
    chunked change with an audit entry."""
    given_filters = {k: v for k, v in filters.items() if v is not None}
    try:
        reason = check_dead_change(
            action,
            ids=bool(ids),
            all_rows=all_rows,
            filtered=bool(given_filters),
            reason=reason,
            dry_run=dry_run,
            wording=CLI_WORDING,
        )
    except OperatorRuleError as exc:
        _fail(str(exc), 2)
    if limit is not None and ids:
        _fail("--limit applies to --all or a filter, not to ids", 2)
    past = {"retry": "retried", "skip": "skipped"}[action]
    settings = _for_source(_settings(config), source)
    budget_ms = settings.metrics.exact_count_timeout_ms
    with _store(settings) as store:
        store.require_table()
        id_list = list(dict.fromkeys(ids or []))
        if id_list:
            selector = DeadFilter(ids=tuple(id_list))
        else:
            selector = _filter(store, **given_filters, limit=limit)
        with _errors():
            if dry_run:
                preview = preview_dead(store, selector, budget_ms=budget_ms)
                typer.echo(f"dry run: {preview.matched} dead rows would be {past}; nothing changed")
                if preview.matched.n and selector.limit is None:
                    _print_summary(preview.summary)
                problems = 0
                if id_list:
                    dead = {i for i, st in store.statuses(id_list).items() if st == "dead"}
                    problems = _report_unmatched(store, id_list, dead)
                if problems:
                    raise typer.Exit(1)
                return
            matched = store.dead_count(selector, budget_ms=budget_ms)
            result = change_dead(
                store,
                action,
                selector,
                actor=os_user(),
                source="cli",
                reason=reason,
                chunk_size=chunk_size,
                budget_ms=budget_ms,
                matched=matched,
                progress=_progress(matched.n, {"retry": "retrying", "skip": "skipping"}[action]),
                keep_ids=bool(id_list),
            )
            problems = _report_unmatched(store, id_list, set(result.changed_ids)) if id_list else 0
    typer.echo(f"{past} {result.changed} dead rows (audit entry {result.audit_id})")
    if problems:
        raise typer.Exit(1)


LimitChangeOpt = Annotated[
    int | None, typer.Option("--limit", min=1, help="Change at most this many rows (the oldest by id).")
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Only say how many rows (and which) would change.")]
ChunkOpt = Annotated[int, typer.Option("--chunk-size", min=1, help="Rows per transaction.")]


@dead_app.command("retry")
def dead_retry(
    ids: Annotated[list[int] | None, typer.Argument(help="Dead row ids.")] = None,
    all_rows: Annotated[bool, typer.Option("--all", help="Every dead row.")] = False,
    event_type: EventTypeOpt = None,
    aggregate_type: AggregateTypeOpt = None,
    aggregate_id: AggregateIdOpt = None,
    error_contains: ErrorContainsOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    limit: LimitChangeOpt = None,
    dry_run: DryRunOpt = False,
    reason: Annotated[str | None, typer.Option("--reason", help="Why (recorded in the audit trail).")] = None,
    chunk_size: ChunkOpt = 1000,
    config: ConfigOpt = None,
    source: SourceOpt = None,
) -> None:
    """Move dead rows back to pending: attempts 0, due now (last_error kept until the next outcome)."""
    _dead_change(
        "retry",
        ids,
        all_rows,
        limit,
        dry_run,
        reason,
        chunk_size,
        config,
        {
            "event_type": event_type,
            "aggregate_type": aggregate_type,
            "aggregate_id": aggregate_id,
            "error_contains": error_contains,
            "since": since,
            "until": until,
        },
        source,
    )


@dead_app.command("skip")
def dead_skip(
    ids: Annotated[list[int] | None, typer.Argument(help="Dead row ids to mark done without publishing.")] = None,
    all_rows: Annotated[bool, typer.Option("--all", help="Every dead row.")] = False,
    event_type: EventTypeOpt = None,
    aggregate_type: AggregateTypeOpt = None,
    aggregate_id: AggregateIdOpt = None,
    error_contains: ErrorContainsOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    limit: LimitChangeOpt = None,
    dry_run: DryRunOpt = False,
    reason: Annotated[
        str | None,
        typer.Option(
            "--reason", help="Why (required unless --dry-run; recorded in last_error and in the audit trail)."
        ),
    ] = None,
    chunk_size: ChunkOpt = 1000,
    config: ConfigOpt = None,
    source: SourceOpt = None,
) -> None:
    """Mark dead rows done deliberately (unblocks an ordered aggregate). Nothing is published."""
    _dead_change(
        "skip",
        ids,
        all_rows,
        limit,
        dry_run,
        reason,
        chunk_size,
        config,
        {
            "event_type": event_type,
            "aggregate_type": aggregate_type,
            "aggregate_id": aggregate_id,
            "error_contains": error_contains,
            "since": since,
            "until": until,
        },
        source,
    )


# --- aggregates and the audit trail ----------------------------------------------------
@aggregate_app.command("show")
def aggregate_show(
    aggregate_id: Annotated[str, typer.Argument(help="The aggregate_id.")],
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, max=10_000, help="At most this many rows.")] = 100,
    config: ConfigOpt = None,
    source: SourceOpt = None,
) -> None:
    """An aggregate's unfinished rows in id order, and what holds it back."""
    settings = _for_source(_settings(config), source)
    ordering = OrderingRule.of(settings.relay.ordered_event_types)
    with _store(settings) as store:
        store.require_table()
        with _errors():
            found, total = store.aggregate_rows(aggregate_id, limit=limit)
    verdict = diagnose_aggregate(found, ordering, max_attempts=settings.relay.max_attempts)
    states = row_states(found, ordering)
    if json_out:
        typer.echo(
            json.dumps(
                {
                    "aggregate_id": aggregate_id,
                    "unfinished": total,
                    "diagnosis": verdict,
                    "rows": [
                        jsonable(
                            {k: v for k, v in row.items() if k not in ("database_now",)}
                            | {"ordered": ordering.is_ordered(row["event_type"]), "state": state}
                        )
                        for row, state in zip(found, states, strict=True)
                    ],
                }
            )
        )
        return
    shown = f" (showing {len(found)})" if total > len(found) else ""
    typer.echo(f"aggregate {aggregate_id}: {total} unfinished rows{shown}")
    typer.echo(f"  {verdict}")
    for row, state in zip(found, states, strict=True):
        mark = "ordered" if ordering.is_ordered(row["event_type"]) else "unordered"
        error = (row["last_error"] or "").replace("\n", " ")[:80]
        typer.echo(
            f"{row['id']:>10}  {row['event_type']:<24} {row['status']:<10} {mark:<9} "
            f"attempts={row['attempts']}  {state}" + (f"  last_error: {error}" if error else "")
        )


@audit_app.command("list")
def audit_list(
    json_out: Annotated[bool, typer.Option("--json", help="JSON array output.")] = False,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, max=10_000, help="At most this many entries.")] = 50,
    before_id: Annotated[int | None, typer.Option("--before-id", min=1, help="Older entries (next page).")] = None,
    config: ConfigOpt = None,
    source: SourceOpt = None,
) -> None:
    """Every retry, skip, replay, pause and resume by an operator (CLI, console or API), newest first."""
    settings = _for_source(_settings(config), source)
    with _store(settings) as store:
        store.require_table()
        store.require_audit_table()
        entries = store.audit_list(limit=limit, before_id=before_id)
    if json_out:
        typer.echo(json.dumps([jsonable(e) for e in entries]))
        return
    if not entries:
        typer.echo("no audit entries")
        return
    for e in entries:
        done = {"replay": "sent", "pause": "parked", "resume": "unparked"}.get(e["action"], "changed")
        failed = f", {e['rows_failed']} not sent" if e.get("rows_failed") else ""
        state = f"{e['rows_changed']} {done}{failed}" + (
            "" if e["finished_at"] else " (unfinished: interrupted or running)"
        )
        matched = "?" if e["rows_matched"] is None else e["rows_matched"]
        typer.echo(
            f"{e['id']:>6}  {e['started_at']:%Y-%m-%d %H:%M:%S%z}  {e['action']:<6} {e['source']}:{e['actor']}  "
            f"{json.dumps(e['selector'])}  matched {matched}, {state}  reason: {e['reason'] or 'none given'}"
        )


# --- the operator console --------------------------------------------------------------
@app.command()
def console(
    host: Annotated[
        str | None, typer.Option("--host", help="Address to bind (default console.host, 127.0.0.1).")
    ] = None,
    port: Annotated[
        int | None,
        typer.Option("--port", min=0, max=65535, help="Port (default console.port, 9465; 0 = any free port)."),
    ] = None,
    config: ConfigOpt = None,
    source: SourceOpt = None,
) -> None:
    """Serve the operator console (web pages + JSON API) until SIGTERM/SIGINT."""
    overrides: dict[str, Any] = {}
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    from ..sources import uses_sources

    settings = _settings(config, console=overrides or None)
    # Without --source, a configuration of several sources is served whole: the
    # overview lists them and every page names one (?source=NAME).
    all_sources = source is None and uses_sources(settings)
    if not all_sources:
        settings = _for_source(settings, source)
    try:
        from .console.server import serve
    except ImportError as exc:
        _fail(f"the console needs the `console` extra: pip install 'outbox-relay[console]' ({exc})", 1)
        raise
    with _errors():
        serve(settings, source_name=source, all_sources=all_sources)


# --- retention -------------------------------------------------------------------------
@app.command()
def purge(
    older_than: Annotated[str, typer.Option("--older-than", help="Age of done rows to delete: 30s, 15m, 12h, 7d.")],
    chunk_size: Annotated[
        int, typer.Option("--chunk-size", min=1, help="Rows looked at (in id order) per delete transaction.")
    ] = 5000,
    config: ConfigOpt = None,
    source: SourceOpt = None,
) -> None:
    """Delete done rows older than DURATION, in bounded chunks (no long transaction, no table lock)."""
    try:
        seconds = parse_duration(older_than)
    except ValueError as exc:
        _fail(f"--older-than: {exc}", 2)
        raise
    settings = _for_source(_settings(config), source)
    with _store(settings) as store:
        store.require_table()
        if store.is_partitioned():
            _fail(
                f"purge: {settings.database.table} is partitioned: its retention is partitioning.retention, applied "
                "by dropping whole partitions (`outbox-relay maintain`, and every running relay)",
                2,
            )
        update = _progress(store.count_purgeable(seconds) if sys.stderr.isatty() else 0, "purging")
        removed = 0
        after: int | None = 0
        while after is not None:  # chunks of the table in id order, each its own transaction
            n, after = store.purge_chunk(seconds, chunk_size, after)
            removed += n
            update(n)
        keys = 0
        key_after: str | None = ""
        while key_after is not None:  # dedup keys whose row is gone (delivered and deleted, or purged)
            n, key_after = store.purge_dedup_keys_chunk(seconds, chunk_size, key_after)
            keys += n
    typer.echo(f"purged {removed} done rows older than {older_than}" + (f" and {keys} dedup keys" if keys else ""))


@app.command()
def maintain(
    config: ConfigOpt = None,
    source: SourceOpt = None,
) -> None:
    """A partitioned outbox ([partitioning]): create the partitions ahead, drop those
    older than partitioning.retention that hold no pending, processing or dead row, and
    purge the dedup keys older than it. For a CronJob; a running relay does the same
    every partitioning.maintain_interval_seconds. Exit 1 when a DDL could not run."""
    from ..db.partitions import PartitionLayout

    settings = _for_source(_settings(config), source)
    layout = PartitionLayout.from_settings(settings)
    if layout is None:
        _fail("maintain: [partitioning] is not set (partitioning.interval): there is nothing to maintain", 2)
        raise AssertionError("unreachable")
    with _store(settings) as store:
        store.require_table()
        result = store.maintain_partitions(layout)
    if result.skipped:
        typer.echo(f"maintain: skipped, {result.skipped}")
        return
    for line in result.lines():
        typer.echo(f"  {line}")
    typer.echo(
        f"maintained {settings.database.table}: {result.partitions} partitions, {len(result.created)} created, "
        f"{len(result.dropped)} dropped, {len(result.kept)} kept past the retention"
    )
    if not result.ok:
        _fail(f"maintain: {len(result.failed)} partition changes failed (the next run retries them)", 1)


# --- least privilege -------------------------------------------------------------------
_GRANT_HELP = {
    "relay": "outbox-relay run",
    "operator": "outbox-relay status, dead list|retry|skip, replay, pause|resume, purge",
    "writer": "the application's enqueue() (insert only)",
}


@app.command()
def grants(
    relay_role: Annotated[str | None, typer.Option("--relay", help="Role that runs `outbox-relay run`.")] = None,
    operator_role: Annotated[
        str | None, typer.Option("--operator", help="Role of the operators (status, dead, purge).")
    ] = None,
    writer_role: Annotated[
        str | None, typer.Option("--writer", help="Role the application writes the outbox with (enqueue).")
    ] = None,
    config: ConfigOpt = None,
    source: SourceOpt = None,
) -> None:
    """Print the GRANT statements each role needs on the configured table (no role given:
    all three, named outbox_relay, outbox_operator, outbox_writer). Only `migrate` needs
    the table's owner. Nothing is executed: pipe the output to psql as the owner."""
    settings = _for_source(_settings(config), source)
    roles: dict[str, str | None] = {"relay": relay_role, "operator": operator_role, "writer": writer_role}
    if not any(roles.values()):
        roles = {kind: f"outbox_{kind}" for kind in roles}
    typer.echo("\n".join(_grant_lines(settings, roles)))


def _grant_lines(
    settings: Settings,
    roles: dict[str, str | None],
    before: str = "run `outbox-relay migrate` as the table's owner first",
) -> list[str]:
    """The GRANT statements of each role given (kind -> role), with a comment per role."""
    from psycopg import sql

    from ..db.schema import TableSql

    try:
        import psycopg

        database = psycopg.conninfo.conninfo_to_dict(settings.database.dsn.get_secret_value()).get("dbname")
    except Exception:
        database = None
    table_sql = TableSql(settings.database.table)
    where = "" if "." in settings.database.table else " (unqualified: schema public assumed)"
    lines = [f"-- outbox-relay grants for {settings.database.table}{where}; {before}"]
    for kind, role in roles.items():
        if not role:
            continue
        try:
            statements = table_sql.grants(kind, role, database=str(database) if database else None)
        except ValueError as exc:
            _fail(f"--{kind}: {exc}", 2)
            raise
        lines.append(f"-- {kind} role {role}: {_GRANT_HELP[kind]}")
        lines += [" ".join(statement.as_string(None).split()) + ";" for statement in statements]
        if kind in ("relay", "operator"):
            lines.append(
                f"-- {kind} role {role}: read other sessions' transaction start, so the xmin horizon "
                "gauge and `status` can name what holds vacuum back (without it they say what they "
                "cannot see)"
                + (", and claims under MVCC pressure take a late writer's rows at once" if kind == "relay" else "")
                + "; needs a superuser, or ADMIN on pg_read_all_stats"
            )
            lines += [
                " ".join(statement.as_string(None).split()) + ";"
                for statement in table_sql.statements("grant_read_all_stats", {"role": sql.Identifier(role)})
            ]
    return lines


# --- demo ------------------------------------------------------------------------------
@app.command()
def demo(
    events: Annotated[int, typer.Option("--events", min=1, help="Sample events to write.")] = 5000,
    workers: Annotated[int, typer.Option("--workers", min=1, help="Relay worker threads.")] = 4,
) -> None:
    """Embedded PostgreSQL + embedded broker: write events, relay them, read them back."""
    from .._embedded.demo import run_demo

    with _errors():
        code = run_demo(events=events, workers=workers)
    raise typer.Exit(code)


def main() -> None:
    try:
        result = app(standalone_mode=False, prog_name="outbox-relay")
    except KeyboardInterrupt:
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as exc:
        # Usage errors of the (vendored) click layer carry format_message/exit_code:
        # print them as one line, exit 2. Anything else is a bug and keeps its traceback.
        if not (hasattr(exc, "format_message") and hasattr(exc, "exit_code")):
            raise
        message = " ".join(str(exc.format_message()).split())
        typer.echo(f"outbox-relay: error: {message} (see --help)", err=True)
        sys.exit(exc.exit_code or 2)
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    main()
