"""``outbox-relay replay``: send delivered rows again (operator/replay.py holds the rules).

Registered on the main application by cli.py. Same conventions as every command:
exit 0 success; 1 a runtime failure (database or target unreachable, rows that could
not be sent); 2 bad configuration or usage (including a table that deletes delivered
rows, where nothing can be replayed). Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from ..config import Settings, load_settings
from ..core.filters import FILTER_NAMES, DeadFilter, parse_filter
from ..errors import ConfigError, OutboxRelayError
from .operations import OperatorRuleError, jsonable, os_user
from .replay import (
    CLI_REPLAY_WORDING,
    DEFAULT_CHUNK_ROWS,
    check_replay,
    delete_mode_refusal,
    open_publisher,
    preview_replay,
    replay_delivered,
)

controls_app = typer.Typer(no_args_is_help=True)


def _fail(message: str, code: int) -> None:
    typer.echo(f"outbox-relay: error: {message}", err=True)
    raise typer.Exit(code)


@contextmanager
def _errors() -> Iterator[None]:
    """Our exceptions -> one line and an exit code (as cli.py does)."""
    try:
        yield
    except ConfigError as exc:
        _fail(str(exc), 2)
    except OutboxRelayError as exc:
        _fail(str(exc), 1)


def _settings(config: str | None, source: str | None) -> Settings:
    from ..observability.logs import configure_logging
    from ..sources import source_settings

    with _errors():
        settings = load_settings(config)
        configure_logging(settings.log.level, settings.log.format, secrets=settings.secret_values)
        return source_settings(settings, source)
    raise AssertionError("unreachable")


@contextmanager
def _store(settings: Settings) -> Iterator[Any]:
    from ..db.store import make_store

    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)  # one line per failure, not the pool's retries
    store = make_store(settings, pool_size=2, application_name="outbox-relay-cli")
    with _errors():
        store.open(fail_fast=True)
        try:
            yield store
        finally:
            store.close()


def _filter(store: Any, values: dict[str, Any]) -> DeadFilter:
    """CLI filter options -> DeadFilter; a bad value exits 2 naming the option."""
    try:
        return parse_filter({k: v for k, v in values.items() if v is not None}, store.database_now)
    except ValueError as exc:
        message = str(exc)
        name = message.split(":", 1)[0]
        if name in FILTER_NAMES:
            message = "--" + name.replace("_", "-") + message[len(name) :]
        _fail(message, 2)
        raise  # unreachable


def _progress(total: int) -> Callable[[int], None]:
    """A progress bar on a terminal, nothing otherwise."""
    if not sys.stderr.isatty() or total <= 0:
        return lambda _n: None
    done = [0]

    def update(n: int) -> None:
        done[0] += n
        filled = int(30 * min(done[0], total) / total)
        sys.stderr.write(f"\rreplaying [{'#' * filled}{'.' * (30 - filled)}] {done[0]}/{total}")
        if done[0] >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return update


@controls_app.command("replay")
def replay(
    ids: Annotated[list[int] | None, typer.Argument(help="Delivered row ids.")] = None,
    event_type: Annotated[str | None, typer.Option("--event-type", help="Only this event type.")] = None,
    aggregate_type: Annotated[str | None, typer.Option("--aggregate-type", help="Only this aggregate type.")] = None,
    aggregate_id: Annotated[str | None, typer.Option("--aggregate-id", help="Only this aggregate.")] = None,
    since: Annotated[
        str | None,
        typer.Option("--since", help="Only rows created at or after: a duration ago (2h, 7d) or a timestamp."),
    ] = None,
    until: Annotated[
        str | None, typer.Option("--until", help="Only rows created before: a duration ago (2h, 7d) or a timestamp.")
    ] = None,
    to_topic: Annotated[
        str | None, typer.Option("--to-topic", help="Send every message to this topic instead of the row's own.")
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="Replay at most this many rows (the oldest by id).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only count the rows and show the first few; send nothing.")
    ] = False,
    reason: Annotated[
        str | None, typer.Option("--reason", help="Why (required unless --dry-run; recorded in the audit trail).")
    ] = None,
    chunk_size: Annotated[
        int, typer.Option("--chunk-size", min=1, max=100_000, help="Rows read, sent and acknowledged together.")
    ] = DEFAULT_CHUNK_ROWS,
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    config: Annotated[
        str | None, typer.Option("--config", "-c", help="TOML settings file (or OUTBOX_RELAY_CONFIG).")
    ] = None,
    source: Annotated[
        str | None,
        typer.Option("--source", help="The source (outbox) to work on, by name; needed when several are configured."),
    ] = None,
) -> None:
    """Publish delivered (done) rows again, with the relay's message format plus a
    `replayed` header (the audit id); each ordered aggregate in id order. Live delivery
    goes on undisturbed; no row is changed. Needs relay.on_done = keep."""
    filters = {
        "event_type": event_type,
        "aggregate_type": aggregate_type,
        "aggregate_id": aggregate_id,
        "since": since,
        "until": until,
    }
    given = {k: v for k, v in filters.items() if v is not None}
    try:
        reason, to_topic = check_replay(
            ids=bool(ids),
            filtered=bool(given),
            reason=reason,
            dry_run=dry_run,
            to_topic=to_topic,
            wording=CLI_REPLAY_WORDING,
        )
    except OperatorRuleError as exc:
        _fail(str(exc), 2)
    if limit is not None and ids:
        _fail("--limit applies to a filter, not to ids", 2)
    settings = _settings(config, source)
    budget_ms = settings.metrics.exact_count_timeout_ms
    target = f"topic {to_topic}" if to_topic else "each row's own topic"
    with _store(settings) as store:
        store.require_table()
        if store.on_done_mode() == "delete":
            _fail(delete_mode_refusal(settings.database.table), 2)
        selector = DeadFilter(ids=tuple(dict.fromkeys(ids))) if ids else _filter(store, dict(given, limit=limit))
        with _errors():
            if dry_run:
                preview = preview_replay(store, selector, to_topic=to_topic, budget_ms=budget_ms)
                if json_out:
                    typer.echo(json.dumps(jsonable(dict(preview.as_json(), dry_run=True))))
                    return
                typer.echo(f"dry run: {preview.matched} delivered rows would be replayed to {target}; nothing sent")
                _print_sample(preview.sample, preview.matched.n)
                return
            store.require_replay_audit()
            matched = store.replay_count(selector, budget_ms=budget_ms)
            publisher = open_publisher(settings)
            try:
                result = replay_delivered(
                    store,
                    publisher,
                    settings,
                    selector,
                    to_topic=to_topic,
                    actor=os_user(),
                    source="cli",
                    reason=reason,
                    chunk_size=chunk_size,
                    budget_ms=budget_ms,
                    matched=matched,
                    progress=_progress(matched.n),
                )
            finally:
                publisher.close()
    if json_out:
        typer.echo(json.dumps(result.as_json()))
    else:
        typer.echo(
            f"replayed {result.sent} delivered rows to {target} (audit entry {result.audit_id})"
            + (f"; {result.failed} could not be sent" if result.failed else "")
        )
    if result.failed:
        first_id, why = result.failures[0]
        _fail(f"{result.failed} rows could not be sent (first: id {first_id}: {why})", 1)


def _print_sample(sample: list[dict[str, Any]] | None, matched: int) -> None:
    if sample is None:
        typer.echo("  (sample not available: finding the first rows ran out of time)")
        return
    for row in sample:
        typer.echo(
            f"{row['id']:>10}  {row['event_type']:<24} {row['aggregate_type']}/{row['aggregate_id']}  "
            f"created {row['created_at']:%Y-%m-%d %H:%M:%S}  topic {row['topic'] or '(routed)'}"
        )
    if matched > len(sample):
        typer.echo(f"  … and {matched - len(sample)} more")
