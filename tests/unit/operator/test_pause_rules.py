"""The rules of operator pauses (operator/pauses.py) without a database: what a pause
and a resume must say, in each surface's words, and how a pause is shown."""

from __future__ import annotations

import datetime as dt

import pytest

from outbox_relay.db.schema import PARK_FLOOR_SQL, PARK_SHIFT_HOURS
from outbox_relay.db.store import PauseRow
from outbox_relay.operator.operations import MAX_REASON_CHARS, OperatorRuleError
from outbox_relay.operator.pauses import (
    API_PAUSE_WORDING,
    CLI_PAUSE_WORDING,
    MAX_VALUE_CHARS,
    PauseTarget,
    check_pause,
    check_resume,
    check_resume_reason,
    pause_json,
)

NONE = {"event_type": None, "topic": None, "aggregate_type": None}


def given(**values: str | None) -> dict[str, str | None]:
    return dict(NONE, **values)


def test_a_pause_names_exactly_one_selector_and_says_why():
    assert check_pause(given(event_type=" OrderPlaced "), " migration ", CLI_PAUSE_WORDING) == (
        PauseTarget("event_type", "OrderPlaced"),
        "migration",
    )
    assert check_pause(given(topic="billing"), "r", CLI_PAUSE_WORDING)[0] == PauseTarget("topic", "billing")
    assert check_pause(given(aggregate_type="invoice"), "r", API_PAUSE_WORDING)[0].selector == "aggregate_type"
    for values, reason, needle in (
        (given(), "r", "exactly one of --event-type, --topic or --aggregate-type"),
        (given(event_type="A", topic="t"), "r", "exactly one of"),
        (given(event_type="  "), "r", "non-empty"),
        (given(event_type="x" * (MAX_VALUE_CHARS + 1)), "r", f"at most {MAX_VALUE_CHARS}"),
        (given(event_type="A"), None, "--reason"),
        (given(event_type="A"), "   ", "--reason"),
        (given(event_type="A"), "x" * (MAX_REASON_CHARS + 1), f"at most {MAX_REASON_CHARS}"),
        ({"status": "pending"}, "r", "unknown selector 'status'"),
    ):
        with pytest.raises(OperatorRuleError, match=needle):
            check_pause(values, reason, CLI_PAUSE_WORDING)


def test_errors_use_the_words_of_the_surface_that_asked():
    with pytest.raises(OperatorRuleError, match='"reason"'):
        check_pause(given(event_type="A"), None, API_PAUSE_WORDING)
    with pytest.raises(OperatorRuleError, match='"event_type", "topic" or "aggregate_type"'):
        check_pause(given(), "r", API_PAUSE_WORDING)


def test_a_resume_names_a_pause_by_id_or_by_selector_not_both():
    assert check_resume(7, given(), CLI_PAUSE_WORDING) == (7, None)
    assert check_resume(None, given(topic="t"), CLI_PAUSE_WORDING) == (None, PauseTarget("topic", "t"))
    for pause_id, values, needle in (
        (7, given(topic="t"), "not both"),
        (None, given(), "a pause id or one of"),
        (0, given(), "positive"),
        (None, given(topic="t", event_type="e"), "exactly one of"),
    ):
        with pytest.raises(OperatorRuleError, match=needle):
            check_resume(pause_id, values, CLI_PAUSE_WORDING)


def test_a_resume_reason_is_optional_and_bounded():
    assert check_resume_reason(None, CLI_PAUSE_WORDING) is None
    assert check_resume_reason("  ", CLI_PAUSE_WORDING) is None
    assert check_resume_reason(" done ", CLI_PAUSE_WORDING) == "done"
    with pytest.raises(OperatorRuleError, match=f'"reason" must be at most {MAX_REASON_CHARS}'):
        check_resume_reason("x" * (MAX_REASON_CHARS + 1), API_PAUSE_WORDING)


def test_a_pause_is_shown_as_an_operator_pause():
    at = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    shown = pause_json(PauseRow(3, "event_type", "A", "why", "ops", "cli", at))
    assert shown == {
        "id": 3,
        "kind": "operator",
        "selector": "event_type",
        "value": "A",
        "reason": "why",
        "paused_by": "ops",
        "paused_from": "cli",
        "paused_at": "2026-01-02T03:04:05+00:00",
        "active": True,
        "resumed_at": None,
        "resumed_by": None,
    }
    assert pause_json(PauseRow(3, "topic", "t", "r", "ops", "api", at, at, "lead"))["active"] is False


def test_parking_moves_a_row_beyond_the_floor_and_back_exactly():
    """The shift is whole hours (an exact number of microseconds): any row of this era
    lands beyond the floor, and shifting back gives its time to the microsecond."""
    floor = dt.datetime.fromisoformat(PARK_FLOOR_SQL.split("'")[1])
    shift = dt.timedelta(hours=PARK_SHIFT_HOURS)
    for moment in (dt.datetime(1970, 1, 1, tzinfo=dt.UTC), dt.datetime(2026, 2, 28, 23, 59, 59, 999999, tzinfo=dt.UTC)):
        assert moment + shift > floor
        assert moment + shift - shift == moment
