"""The list of sources of the console: parsing its parameters (one-line refusals),
filtering, sorting worst first and paging, and the board that holds every source's
figures and reads them again in the background."""

from __future__ import annotations

import datetime as dt
import re
import threading

import pytest

from outbox_relay.db.store import Count
from outbox_relay.operator.console.source_list import SourceBoard, SourceFigures, SourceQuery

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def figures(name: str, pending: int = 0, dead: int = 0, age: float = 0.0) -> SourceFigures:
    depth = {"pending": Count(pending), "processing": Count(0), "dead": Count(dead)}
    return SourceFigures(name, "public.outbox", depth, age, None, NOW)


def down(name: str) -> SourceFigures:
    return SourceFigures(name, "public.outbox", None, None, "connection refused", NOW)


def parse(**params: str | list[str]) -> SourceQuery:
    return SourceQuery.parse({k: v if isinstance(v, list) else [v] for k, v in params.items()})


LIST = [
    figures("a", pending=3, dead=1, age=30),
    figures("b", pending=0, dead=4),
    figures("c", pending=9, dead=0, age=10),
    down("d"),
    figures("e", pending=3, dead=1, age=30),
]


def names(query: SourceQuery) -> list[str]:
    return [item.name for item in query.select(LIST)[0]]


def test_defaults_sort_by_oldest_pending_worst_first_unknown_first():
    query = parse()
    assert (query.sort, query.order, query.page, query.limit) == ("age", "desc", 1, 50)
    assert names(query) == ["d", "a", "e", "c", "b"]  # ties by name; d's figures are unknown


def test_each_sort_and_ascending_puts_the_unknown_last():
    assert names(parse(sort="dead")) == ["d", "b", "a", "e", "c"]
    assert names(parse(sort="backlog")) == ["d", "c", "a", "e", "b"]
    assert names(parse(sort="backlog", order="asc")) == ["b", "a", "e", "c", "d"]
    assert names(parse(sort="name")) == ["a", "b", "c", "d", "e"]
    assert names(parse(sort="name", order="desc")) == ["e", "d", "c", "b", "a"]


def test_sources_not_read_yet_come_last_either_way():
    with_unread = [*LIST, SourceFigures("0-new", None, None, None, "not read yet", None)]
    assert [i.name for i in parse().select(with_unread)[0]] == ["d", "a", "e", "c", "b", "0-new"]
    assert [i.name for i in parse(order="asc").select(with_unread)[0]] == ["b", "c", "a", "e", "d", "0-new"]


def test_filters_by_name_and_states_together():
    assert names(parse(q="C")) == ["c"]
    assert names(parse(state="unready")) == ["d"]
    assert names(parse(state="ready", sort="name")) == ["a", "b", "c", "e"]
    assert names(parse(state="dead,backlog", sort="name")) == ["a", "e"]
    assert names(parse(state=["dead", "backlog"], sort="name")) == ["a", "e"]


def test_pages_and_counts_the_matches():
    query = parse(limit="2", page="2", sort="name")
    assert query.select(LIST) == (LIST[2:4], 5)
    assert parse(limit="2", page="9").select(LIST) == ([], 5)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"page": "0"}, "page: 0 is out of range (1..1000000)"),
        ({"limit": "500"}, "limit: 500 is out of range (1..200)"),
        ({"limit": "ten"}, "limit: 'ten' is not a whole number"),
        ({"sort": "size"}, "sort: 'size' is not one of age, backlog, dead, name"),
        ({"order": "up"}, "order: 'up' is not one of desc, asc"),
        ({"state": "stuck"}, "state: 'stuck' is not one of ready, unready, dead, backlog"),
        ({"state": "ready,unready"}, "state: a source is either ready or unready, not both"),
        ({"sort": ["dead", "age"]}, "sort: give it once"),
        ({"source": "x"}, "unknown parameter 'source' (the list takes: q, state, sort, order, page, limit)"),
    ],
)
def test_refusals_are_one_line(params, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$") as refused:
        parse(**params)
    assert "\n" not in str(refused.value)


def test_links_leave_the_defaults_out():
    assert parse().link(page=2) == {"q": "", "state": [], "sort": None, "order": None, "page": 2, "limit": None}
    assert parse(sort="dead", q="x").link(order="asc") == {
        "q": "x",
        "state": [],
        "sort": "dead",
        "order": "asc",
        "page": None,
        "limit": None,
    }


def test_the_board_answers_from_what_it_holds_while_a_round_runs():
    served = ["a", "b"]
    reads: list[str] = []
    gate = threading.Event()
    gate.set()

    def read(name: str) -> SourceFigures:
        gate.wait(10)
        reads.append(name)
        if name == "b":
            raise RuntimeError("surprise")
        return figures(name, dead=len(reads))

    board = SourceBoard(lambda: list(served), read, refresh_seconds=3600, workers=1)
    try:
        first = board.view()  # waits for the first round
        assert [(i.name, i.count("dead"), i.problem) for i in first.items] == [
            ("a", 1, None),
            ("b", None, "could not be read: RuntimeError"),
        ]
        assert board.view().items == first.items and reads == ["a", "b"]  # fresh: nothing read

        # A new source makes the next request start a round; it is answered meanwhile.
        gate.clear()
        served.append("c")
        during = board.view()
        assert during.refreshing and [i.problem for i in during.items][2] == "not read yet"
        assert during.oldest_read_at is None
        gate.set()
        board._round.join(10)  # type: ignore[union-attr]
        assert [i.name for i in board.view().items if i.ready] == ["a", "c"]

        board.refresh_source("a")
        assert board.view().items[0].count("dead") == len(reads)
    finally:
        board.close()
