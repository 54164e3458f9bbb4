"""``outbox-relay replay``: send delivered rows again (operator/replay.py holds the rules);
``outbox-relay pause``, ``resume`` and ``pauses``: operator pauses (operator/pauses.py).

Registered on the main application by cli.py. Same conventions as every command:
exit 0 success; 1 a runtime failure (database or target unreachable, rows that could
not be sent); 2 bad configuration or usage (including a table that deletes delivered
rows, where nothing can be replayed). Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from ..core.filters import DeadFilter
from .cli_common import (
    AggregateIdOpt,
    AggregateTypeOpt,
    ConfigOpt,
    EventTypeOpt,
    SinceOpt,
    SourceOpt,
    UntilOpt,
    errors,
    fail,
    filter_from_options,
    for_source,
    open_store,
    progress,
    settings_from,
)
from .operations import OperatorRuleError, jsonable, os_user
from .pauses import CLI_PAUSE_WORDING, check_pause, check_resume, check_resume_reason, pause, pause_json, resume
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


@controls_app.command("replay")
def replay(
    ids: Annotated[list[int] | None, typer.Argument(help="Delivered row ids.")] = None,
    event_type: EventTypeOpt = None,
    aggregate_type: AggregateTypeOpt = None,
    aggregate_id: AggregateIdOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
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
    config: ConfigOpt = None,
    source: SourceOpt = None,
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
        fail(str(exc), 2)
    if limit is not None and ids:
        fail("--limit applies to a filter, not to ids", 2)
    settings = for_source(settings_from(config), source)
    budget_ms = settings.metrics.exact_count_timeout_ms
    target = f"topic {to_topic}" if to_topic else "each row's own topic"
    with open_store(settings) as store:
        store.require_table()
        if store.on_done_mode() == "delete":
            fail(delete_mode_refusal(settings.database.table), 2)
        selector = (
            DeadFilter(ids=tuple(dict.fromkeys(ids))) if ids else filter_from_options(store, **given, limit=limit)
        )
        with errors():
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
                    progress=progress(matched.n, "replaying"),
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
        fail(f"{result.failed} rows could not be sent (first: id {first_id}: {why})", 1)


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


# --- operator pauses (operator/pauses.py holds the rules) -------------------------------
PauseEventTypeOpt = Annotated[str | None, typer.Option("--event-type", help="Rows of this event type.")]
PauseTopicOpt = Annotated[
    str | None, typer.Option("--topic", help="Rows whose topic column is this topic (not rows routed by settings).")
]
PauseAggregateTypeOpt = Annotated[str | None, typer.Option("--aggregate-type", help="Rows of this aggregate type.")]


@controls_app.command("pause")
def pause_command(
    event_type: PauseEventTypeOpt = None,
    topic: PauseTopicOpt = None,
    aggregate_type: PauseAggregateTypeOpt = None,
    reason: Annotated[
        str | None, typer.Option("--reason", help="Why (required; shown by status and recorded in the audit trail).")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    config: ConfigOpt = None,
    source: SourceOpt = None,
) -> None:
    """Hold back the delivery of the rows of one event type, topic or aggregate type (of
    one source) until `outbox-relay resume`: every relay's next claim takes none of them.
    Pending rows are parked (attempts kept); rows in flight are delivered. In an ordered
    aggregate a paused row holds back the ordered rows behind it."""
    try:
        target, why = check_pause(
            {"event_type": event_type, "topic": topic, "aggregate_type": aggregate_type}, reason, CLI_PAUSE_WORDING
        )
    except OperatorRuleError as exc:
        fail(str(exc), 2)
    settings = for_source(settings_from(config), source)
    with open_store(settings) as store, errors():
        try:
            result = pause(
                store,
                target,
                reason=why,
                actor=os_user(),
                source="cli",
                max_attempts=settings.relay.max_attempts,
            )
        except OperatorRuleError as exc:
            fail(str(exc), 1)
    if json_out:
        typer.echo(json.dumps(result.as_json()))
        return
    typer.echo(
        f"paused {target.describe()} (pause {result.pause.id}, audit entry {result.audit_id}): "
        f"{result.rows_parked} pending rows parked; resume with `outbox-relay resume {result.pause.id}`"
    )


@controls_app.command("resume")
def resume_command(
    pause_id: Annotated[int | None, typer.Argument(help="The id of the pause (see `outbox-relay pauses`).")] = None,
    event_type: PauseEventTypeOpt = None,
    topic: PauseTopicOpt = None,
    aggregate_type: PauseAggregateTypeOpt = None,
    reason: Annotated[str | None, typer.Option("--reason", help="Why (optional; recorded in the audit trail).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    config: ConfigOpt = None,
    source: SourceOpt = None,
) -> None:
    """End a pause, by its id or by the selector it was made with: its parked rows get
    their original available_at back and are delivered in their old order (rows another
    active pause matches stay parked)."""
    try:
        found_id, target = check_resume(
            pause_id, {"event_type": event_type, "topic": topic, "aggregate_type": aggregate_type}, CLI_PAUSE_WORDING
        )
        cleaned = check_resume_reason(reason, CLI_PAUSE_WORDING)
    except OperatorRuleError as exc:
        fail(str(exc), 2)
    settings = for_source(settings_from(config), source)
    with open_store(settings) as store, errors():
        try:
            result = resume(
                store,
                pause_id=found_id,
                target=target,
                actor=os_user(),
                source="cli",
                reason=cleaned,
            )
        except OperatorRuleError as exc:
            fail(str(exc), 1)
    if json_out:
        typer.echo(json.dumps(result.as_json()))
        return
    ended = result.pause
    typer.echo(
        f"resumed {ended.selector.replace('_', ' ')} {ended.value!r} (pause {ended.id}, audit entry "
        f"{result.audit_id}): {result.rows_unparked} parked rows are due again"
    )


@controls_app.command("pauses")
def pauses_command(
    include_resumed: Annotated[
        bool, typer.Option("--all", help="Also the pauses already resumed (newest first).")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    config: ConfigOpt = None,
    source: SourceOpt = None,
) -> None:
    """The operator pauses of one source: the active ones (and, with --all, the ended ones)."""
    settings = for_source(settings_from(config), source)
    with open_store(settings) as store, errors():
        store.require_pauses_table()
        found = store.pauses(include_resumed=include_resumed)
    if json_out:
        typer.echo(json.dumps([pause_json(p) for p in found]))
        return
    if not found:
        typer.echo("no operator pause" + ("" if include_resumed else " is active"))
        return
    for p in found:
        state = "active" if p.resumed_at is None else f"resumed {p.resumed_at:%Y-%m-%d %H:%M:%S} by {p.resumed_by}"
        typer.echo(
            f"{p.id:>6}  {p.selector:<15} {p.value:<24} since {p.paused_at:%Y-%m-%d %H:%M:%S} by {p.paused_by} "
            f"({p.paused_from})  {state}  reason: {p.reason}"
        )
