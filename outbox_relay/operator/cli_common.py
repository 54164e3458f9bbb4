"""What every command of the command line shares: the one-line error and its exit code,
settings and store opening, the filter options of row selections and the progress bar.
cli.py and controls_cli.py both build on it (neither imports the other's helpers)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, NoReturn

import typer

from ..config import Settings, load_settings
from ..core.filters import FILTER_NAMES, DeadFilter, parse_filter
from ..errors import ConfigError, OutboxRelayError

ConfigOpt = Annotated[str | None, typer.Option("--config", "-c", help="TOML settings file (or OUTBOX_RELAY_CONFIG).")]
SourceOpt = Annotated[
    str | None,
    typer.Option("--source", help="The source (outbox) to work on, by name; needed when several are configured."),
]
# The filters of row selections (`dead list|retry|skip`, `replay`; the console's API
# takes the same names).
EventTypeOpt = Annotated[str | None, typer.Option("--event-type", help="Only this event type.")]
AggregateTypeOpt = Annotated[str | None, typer.Option("--aggregate-type", help="Only this aggregate type.")]
AggregateIdOpt = Annotated[str | None, typer.Option("--aggregate-id", help="Only this aggregate.")]
SinceOpt = Annotated[
    str | None, typer.Option("--since", help="Only rows created at or after: a duration ago (2h, 7d) or a timestamp.")
]
UntilOpt = Annotated[
    str | None, typer.Option("--until", help="Only rows created before: a duration ago (2h, 7d) or a timestamp.")
]


def fail(message: str, code: int) -> NoReturn:
    """One line on stderr, then exit ``code`` (1 a runtime failure, 2 usage)."""
    typer.echo(f"outbox-relay: error: {message}", err=True)
    raise typer.Exit(code)


@contextmanager
def errors() -> Iterator[None]:
    """Our exceptions -> one line and an exit code."""
    try:
        yield
    except ConfigError as exc:
        fail(str(exc), 2)
    except OutboxRelayError as exc:
        fail(str(exc), 1)


def settings_from(config: str | None, **overrides: Any) -> Settings:
    """The settings (a bad file or value exits 2), with logging configured from them."""
    try:
        settings = load_settings(config, **{k: v for k, v in overrides.items() if v})
    except ConfigError as exc:
        fail(str(exc), 2)
    from ..observability.logs import configure_logging

    configure_logging(settings.log.level, settings.log.format, secrets=settings.secret_values)
    return settings


def for_source(settings: Settings, source: str | None) -> Settings:
    """The settings of the source named by --source (sources.py)."""
    from ..sources import source_settings

    with errors():
        return source_settings(settings, source)
    raise AssertionError("unreachable")


@contextmanager
def open_store(settings: Settings) -> Iterator[Any]:
    from ..db.store import make_store

    # A one-shot command reports a connection failure as one line (see errors); the
    # pool's own multi-line retry warnings would only repeat it on stderr.
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    store = make_store(settings, pool_size=2, application_name="outbox-relay-cli")
    with errors():
        store.open(fail_fast=True)
        try:
            yield store
        finally:
            store.close()


def progress(total: int, label: str) -> Callable[[int], None]:
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


def filter_from_options(store: Any, **values: Any) -> DeadFilter:
    """CLI filter options -> DeadFilter; a bad value exits 2 naming the option."""
    try:
        return parse_filter({k: v for k, v in values.items() if v is not None}, store.database_now)
    except ValueError as exc:
        message = str(exc)
        name = message.split(":", 1)[0]
        if name in FILTER_NAMES:  # "since: ..." -> "--since: ..."
            message = "--" + name.replace("_", "-") + message[len(name) :]
        fail(message, 2)
