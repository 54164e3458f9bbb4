"""`status` of every source: the one-source status run per source, gathered.

Each source's section is exactly what `status --source NAME` prints (text), or its JSON
document under ``sources.<name>`` (``--json``); a source that cannot be read shows its
error and makes the command exit 1 after the others were shown.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from typing import Any

import typer

from ..config import Settings
from ..errors import OutboxRelayError


def status_of_every_source(settings: Settings, json_out: bool, one: Callable[[str], None]) -> None:
    from ..sources import all_sources

    try:
        names = sorted(all_sources(settings))
    except OutboxRelayError as exc:
        typer.echo(f"outbox-relay: error: {exc}", err=True)
        raise typer.Exit(1) from None
    docs: dict[str, Any] = {}
    failed: list[str] = []
    for name in names:
        out, err = io.StringIO(), io.StringIO()
        code = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                one(name)
            except typer.Exit as exc:
                code = exc.exit_code or 0
        error = err.getvalue().strip().removeprefix("outbox-relay: error: ")
        if code:
            failed.append(name)
        if json_out:
            docs[name] = json.loads(out.getvalue()) if not code and out.getvalue().strip() else {"error": error}
        else:
            typer.echo(f"source {name}")
            text = out.getvalue().rstrip("\n")
            if text:
                typer.echo("\n".join("  " + line for line in text.splitlines()))
            if code:
                typer.echo(f"  error: {error}")
    if json_out:
        typer.echo(json.dumps({"sources": docs}))
    if failed:
        raise typer.Exit(1)
