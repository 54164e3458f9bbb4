"""The rules of every retry/skip (``check_dead_change``), the one function the CLI, the
console form and the API all call."""

from __future__ import annotations

import datetime as dt

import pytest

from outbox_relay.core.ordering import OrderingRule
from outbox_relay.operator.operations import (
    API_WORDING,
    CLI_WORDING,
    FORM_WORDING,
    MAX_REASON_CHARS,
    OperatorRuleError,
    blocking_head,
    check_dead_change,
    diagnose_aggregate,
    row_states,
)

SELECTIONS = {
    "ids": dict(ids=True, all_rows=False, filtered=False),
    "all": dict(ids=False, all_rows=True, filtered=False),
    "filter": dict(ids=False, all_rows=False, filtered=True),
}


@pytest.mark.parametrize(
    ("action", "selection", "reason", "dry_run", "recorded"),
    [
        ("retry", "ids", None, False, None),
        ("retry", "all", "  replay after the fix  ", False, "replay after the fix"),
        ("retry", "filter", "", True, None),
        ("skip", "ids", "OPS-7", False, "OPS-7"),
        ("skip", "filter", " duplicate ", False, "duplicate"),
        ("skip", "all", None, True, None),  # a dry run changes nothing: no reason needed
        ("skip", "ids", "x" * MAX_REASON_CHARS, False, "x" * MAX_REASON_CHARS),
    ],
)
def test_allowed_requests_return_the_reason_as_recorded(action, selection, reason, dry_run, recorded):
    assert (
        check_dead_change(action, **SELECTIONS[selection], reason=reason, dry_run=dry_run, wording=CLI_WORDING)
        == recorded
    )


@pytest.mark.parametrize(
    ("ids", "all_rows", "filtered"),
    [(False, False, False), (True, True, False), (True, False, True), (False, True, True), (True, True, True)],
)
@pytest.mark.parametrize("wording", [CLI_WORDING, API_WORDING, FORM_WORDING])
def test_a_request_selects_by_exactly_one_of_ids_all_or_a_filter(ids, all_rows, filtered, wording):
    with pytest.raises(OperatorRuleError) as refused:
        check_dead_change(
            "retry", ids=ids, all_rows=all_rows, filtered=filtered, reason="r", dry_run=False, wording=wording
        )
    message = str(refused.value)
    assert "exactly one" in message and wording.ids in message and wording.all_rows in message
    assert "\n" not in message


@pytest.mark.parametrize("reason", [None, "", "   "])
@pytest.mark.parametrize("wording", [CLI_WORDING, API_WORDING, FORM_WORDING])
def test_a_skip_that_changes_rows_needs_a_reason_on_every_surface(reason, wording):
    with pytest.raises(OperatorRuleError, match="say why") as refused:
        check_dead_change(
            "skip", ids=True, all_rows=False, filtered=False, reason=reason, dry_run=False, wording=wording
        )
    assert wording.reason in str(refused.value)


def test_a_reason_longer_than_the_limit_is_refused_not_cut():
    with pytest.raises(OperatorRuleError, match=str(MAX_REASON_CHARS)):
        check_dead_change(
            "retry",
            ids=True,
            all_rows=False,
            filtered=False,
            reason="x" * (MAX_REASON_CHARS + 1),
            dry_run=False,
            wording=API_WORDING,
        )


def test_aggregate_diagnosis_uses_the_claims_ordering_rule():
    # `aggregate show` and the console's aggregate page judge rows with OrderingRule:
    # with named ordered types, an aggregate mixes ordered and unordered rows.
    now = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)

    def row(id_: int, event_type: str, status: str) -> dict[str, object]:
        return {
            "id": id_,
            "event_type": event_type,
            "status": status,
            "attempts": 5,
            "database_now": now,
            "lease_expired": False,
            "not_due": False,
            "lease_until": None,
            "lease_owner": None,
            "available_at": now,
        }

    rows = [
        row(1, "Note", "pending"),
        row(2, "Paid", "dead"),
        row(3, "Note", "dead"),
        row(4, "Paid", "pending"),
        row(5, "Paid", "dead"),
    ]
    named = OrderingRule.of(["Paid"])
    assert row_states(rows, named) == [
        "due: the next claim takes it",
        "dead",
        "dead",
        "waits behind head 2",
        "dead (behind head 2)",
    ]
    assert blocking_head(rows, named) == 2
    assert diagnose_aggregate(rows, named, max_attempts=5).startswith(
        "blocked by dead head 2 (Paid): retry it (`outbox-relay dead retry 2`)"
    )
    assert diagnose_aggregate(rows, named, max_attempts=5).endswith("; 2 ordered row(s) wait behind it")
    star = OrderingRule.of(["*"])
    assert row_states(rows, star) == [
        "due: the next claim takes it",
        "dead (behind head 1)",
        "dead (behind head 1)",
        "waits behind head 1",
        "dead (behind head 1)",
    ]
    assert blocking_head(rows, star) is None
    assert diagnose_aggregate(rows, star, max_attempts=5) == (
        "head 1 is due: the next claim takes it; 4 ordered row(s) wait behind it"
    )
    unordered = OrderingRule.of([])
    assert row_states(rows, unordered)[1:3] == ["dead", "dead"] and blocking_head(rows, unordered) is None
    assert diagnose_aggregate(rows, unordered, max_attempts=5).startswith("not ordered")
