"""``outbox-relay`` command line (typer). Thin: parse, load settings, call the library.

Exit codes: 0 success; 1 a runtime failure (database or broker unreachable, rows
not found); 2 bad configuration or usage. Errors are one line on stderr, never a
traceback.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, TypeVar

import typer

from .config import Settings, load_settings, parse_duration
from .errors import ConfigError, OutboxRelayError

app = typer.Typer(
    name="outbox-relay",
    help="Deliver a PostgreSQL transactional outbox to Kafka, at least once.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
dead_app = typer.Typer(help="Inspect and repair dead rows.", no_args_is_help=True)
app.add_typer(dead_app, name="dead")

ConfigOpt = Annotated[str | None, typer.Option("--config", "-c", help="TOML settings file (or OUTBOX_RELAY_CONFIG).")]
T = TypeVar("T")


def _fail(message: str, code: int) -> None:
    typer.echo(f"outbox-relay: error: {message}", err=True)
    raise typer.Exit(code)


def _settings(config: str | None, **overrides: Any) -> Settings:
    try:
        settings = load_settings(config, **{k: v for k, v in overrides.items() if v})
    except ConfigError as exc:
        _fail(str(exc), 2)
        raise  # unreachable
    from .logs import configure_logging

    secrets = [settings.database.dsn.get_secret_value()]
    try:
        import psycopg

        password = psycopg.conninfo.conninfo_to_dict(secrets[0]).get("password")
        if password:
            secrets.append(str(password))
    except Exception:
        pass
    if settings.kafka.sasl_password is not None:
        secrets.append(settings.kafka.sasl_password.get_secret_value())
    configure_logging(settings.log.level, settings.log.format, secrets=secrets)
    return settings


@contextmanager
def _errors() -> Iterator[None]:
    """Our exceptions -> one line and an exit code."""
    try:
        yield
    except ConfigError as exc:
        _fail(str(exc), 2)
    except OutboxRelayError as exc:
        _fail(str(exc), 1)


@contextmanager
def _store(settings: Settings) -> Iterator[Any]:
    from .relay import make_store

    # A one-shot command reports a connection failure as one line (see _errors); the
    # pool's own multi-line retry warnings would only repeat it on stderr.
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    store = make_store(settings, pool_size=2, application_name="outbox-relay-cli")
    with _errors():
        store.open()
        try:
            yield store
        finally:
            store.close()


def _progress(total: int, label: str) -> Callable[[int], None]:
    """A progress bar on a terminal, nothing otherwise."""
    if not sys.stderr.isatty() or total <= 0:
        return lambda _n: None
    done = [0]

    def update(n: int) -> None:
        done[0] += n
        width = 30
        filled = int(width * min(done[0], total) / total)
        sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done[0]}/{total}")
        if done[0] >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return update


# --- run / migrate ---------------------------------------------------------------------
@app.command()
def run(
    workers: Annotated[int | None, typer.Option("--workers", "-w", min=1, help="Worker threads.")] = None,
    config: ConfigOpt = None,
) -> None:
    """Run the relay in the foreground until SIGTERM/SIGINT."""
    settings = _settings(config, relay={"workers": workers} if workers else None)
    from .relay import Relay

    with _errors():
        relay = Relay(settings)
        relay.run_forever()


@app.command()
def migrate(
    config: ConfigOpt = None,
    no_notify_trigger: Annotated[bool, typer.Option(
        "--no-notify-trigger", help="Do not install (and drop) the LISTEN/NOTIFY trigger.")] = False,
    drop_ordering_indexes: Annotated[bool, typer.Option(
        "--drop-ordering-indexes",
        help="Drop the per-aggregate indexes of ordered delivery (relay.ordered_event_types must be empty).",
    )] = False,
) -> None:
    """Create the outbox table, its indexes and the wake-up trigger; bring an existing
    table to this version's indexes (CONCURRENTLY: safe while relays run). Idempotent.
    The ordering indexes are created when relay.ordered_event_types is set; the table's
    mode is set to relay.on_done."""
    settings = _settings(config)
    ordering = bool(settings.relay.ordered_event_types)
    if drop_ordering_indexes and ordering:
        _fail("--drop-ordering-indexes: relay.ordered_event_types is set, and ordered delivery needs them", 2)
    with _store(settings) as store:
        notes = store.migrate(notify_trigger=not no_notify_trigger, ordering=ordering,
                              on_done=settings.relay.on_done, drop_ordering_indexes=drop_ordering_indexes)
    for note in notes:
        typer.echo(f"  {note}")
    typer.echo(f"migrated {settings.database.table}")


# --- status ----------------------------------------------------------------------------
@app.command()
def status(
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    config: ConfigOpt = None,
) -> None:
    """Queue depth per status, oldest pending age, expired leases, attempts, blocked aggregates."""
    settings = _settings(config)
    with _store(settings) as store:
        store.require_table()
        stats = store.stats(ordered_types=list(settings.relay.ordered_event_types),
                            count_cap=settings.metrics.exact_count_limit)
        on_done = store.on_done_mode()
    doc = {
        "table": settings.database.table,
        "on_done": on_done,
        "queue_depth": stats.queue_depth,
        "queue_depth_estimated": stats.estimated_statuses,
        "oldest_pending_age_seconds": round(stats.oldest_pending_age_seconds, 3),
        "expired_leases": stats.expired_leases,
        "attempts": {str(k): v for k, v in sorted(stats.attempts.items())},
        "blocked_aggregates": [{"aggregate_id": a, "dead_id": i} for a, i in stats.blocked_aggregates],
    }
    if json_out:
        typer.echo(json.dumps(doc))
        return
    typer.echo(f"outbox {settings.database.table}"
               + ("  (delivered rows are deleted: done counts rows skipped by an operator)"
                  if on_done == "delete" else ""))
    typer.echo(f"  {'status':<12}{'rows':>12}")
    for name, n in stats.queue_depth.items():
        note = "  (estimate)" if name in stats.estimated_statuses else ""
        typer.echo(f"  {name:<12}{n:>12}{note}")
    typer.echo(f"  oldest pending age   {stats.oldest_pending_age_seconds:.1f}s")
    typer.echo(f"  expired leases       {stats.expired_leases}")
    if stats.attempts:
        attempts = ", ".join(f"{k}: {v}" for k, v in sorted(stats.attempts.items()))
        typer.echo(f"  attempts (pending+processing): {attempts}")
    if settings.relay.ordered_event_types:
        typer.echo(f"  blocked aggregates   {len(stats.blocked_aggregates)}")
        for aggregate, dead_id in stats.blocked_aggregates[:20]:
            typer.echo(f"    {aggregate} blocked by dead row {dead_id}")


# --- dead letters ----------------------------------------------------------------------
@dead_app.command("list")
def dead_list(
    json_out: Annotated[bool, typer.Option("--json", help="JSON array output.")] = False,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="At most this many rows.")] = 100,
    event_type: Annotated[str | None, typer.Option("--event-type", help="Only this event type.")] = None,
    aggregate_id: Annotated[str | None, typer.Option("--aggregate-id", help="Only this aggregate.")] = None,
    config: ConfigOpt = None,
) -> None:
    """List dead rows, oldest first."""
    settings = _settings(config)
    with _store(settings) as store:
        store.require_table()
        rows = store.dead_list(limit=limit, event_type=event_type, aggregate_id=aggregate_id)
    if json_out:
        for row in rows:
            row["created_at"] = row["created_at"].isoformat()
        typer.echo(json.dumps(rows))
        return
    if not rows:
        typer.echo("no dead rows")
        return
    for row in rows:
        error = (row["last_error"] or "").replace("\n", " ")
        typer.echo(f"{row['id']:>10}  {row['event_type']:<24} {row['aggregate_type']}/{row['aggregate_id']}  "
                   f"attempts={row['attempts']}  {row['created_at']:%Y-%m-%d %H:%M:%S}  {error[:120]}")


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


def _chunks(ids: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(ids), size):
        yield ids[start:start + size]


@dead_app.command("retry")
def dead_retry(
    ids: Annotated[list[int] | None, typer.Argument(help="Dead row ids.")] = None,
    all_rows: Annotated[bool, typer.Option("--all", help="Every dead row.")] = False,
    chunk_size: Annotated[int, typer.Option("--chunk-size", min=1, help="Rows per transaction.")] = 1000,
    config: ConfigOpt = None,
) -> None:
    """Move dead rows back to pending: attempts 0, due now (last_error kept until the next outcome)."""
    if bool(ids) == all_rows:
        _fail("give dead row ids or --all (not both)", 2)
    settings = _settings(config)
    with _store(settings) as store:
        store.require_table()
        if all_rows:
            update = _progress(store.count_dead(), "retrying")
            total = 0
            while True:
                n = store.dead_retry_all_chunk(chunk_size)
                total += n
                update(n)
                if n < chunk_size:
                    break
            typer.echo(f"retried {total} dead rows")
            return
        id_list = list(dict.fromkeys(ids or []))
        update = _progress(len(id_list), "retrying")
        changed: set[int] = set()
        for chunk in _chunks(id_list, chunk_size):
            changed |= store.dead_retry(chunk)
            update(len(chunk))
        problems = _report_unmatched(store, id_list, changed)
    typer.echo(f"retried {len(changed)} dead rows")
    if problems:
        raise typer.Exit(1)


@dead_app.command("skip")
def dead_skip(
    ids: Annotated[list[int], typer.Argument(help="Dead row ids to mark done without publishing.")],
    reason: Annotated[str, typer.Option("--reason", help="Why (recorded in last_error).")] = "skipped by operator",
    config: ConfigOpt = None,
) -> None:
    """Mark dead rows done deliberately (unblocks an ordered aggregate). Nothing is published."""
    settings = _settings(config)
    id_list = list(dict.fromkeys(ids))
    with _store(settings) as store:
        store.require_table()
        changed: set[int] = set()
        update = _progress(len(id_list), "skipping")
        for chunk in _chunks(id_list, 1000):
            changed |= store.dead_skip(chunk, f"skipped: {reason}")
            update(len(chunk))
        problems = _report_unmatched(store, id_list, changed)
    typer.echo(f"skipped {len(changed)} dead rows")
    if problems:
        raise typer.Exit(1)


# --- retention -------------------------------------------------------------------------
@app.command()
def purge(
    older_than: Annotated[str, typer.Option("--older-than", help="Age of done rows to delete: 30s, 15m, 12h, 7d.")],
    chunk_size: Annotated[int, typer.Option(
        "--chunk-size", min=1, help="Rows looked at (in id order) per delete transaction.")] = 5000,
    config: ConfigOpt = None,
) -> None:
    """Delete done rows older than DURATION, in bounded chunks (no long transaction, no table lock)."""
    try:
        seconds = parse_duration(older_than)
    except ValueError as exc:
        _fail(f"--older-than: {exc}", 2)
        raise
    settings = _settings(config)
    with _store(settings) as store:
        store.require_table()
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
    typer.echo(f"purged {removed} done rows older than {older_than}"
               + (f" and {keys} dedup keys" if keys else ""))


# --- demo ------------------------------------------------------------------------------
@app.command()
def demo(
    events: Annotated[int, typer.Option("--events", min=1, help="Sample events to write.")] = 5000,
    workers: Annotated[int, typer.Option("--workers", min=1, help="Relay worker threads.")] = 4,
) -> None:
    """Embedded PostgreSQL + embedded broker: write events, relay them, read them back."""
    from .demo import run_demo

    with _errors():
        code = run_demo(events=events, workers=workers)
    raise typer.Exit(code)


def main() -> None:
    try:
        result = app(standalone_mode=False)
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
