"""AggregateBounds: the fast ordered claims' per-aggregate bounds and visited set."""

from __future__ import annotations

from outbox_relay.db.ordered_bounds import AggregateBounds


def test_a_bound_only_moves_up_and_never_past_a_dead_row() -> None:
    bounds = AggregateBounds()
    assert bounds.bound("x") == 0  # never seen: from the aggregate's front
    bounds.discovered(["x"])
    ticket, visit = bounds.to_visit(10)
    assert visit == [("x", 0)]
    bounds.looked(ticket, "x", 40, False)  # first unfinished row 40, nothing dead below it
    assert bounds.bound("x") == 40
    bounds.looked(ticket, "x", 90, True)  # a dead row below the first unfinished 90: kept
    assert bounds.bound("x") == 40
    bounds.looked(ticket, "x", 70, False)
    assert bounds.bound("x") == 70
    bounds.looked(ticket, "x", 30, False)  # an older look (another worker's): kept at 70
    assert bounds.bound("x") == 70


def test_an_aggregate_found_idle_leaves_the_visited_set_but_keeps_its_bound() -> None:
    bounds = AggregateBounds()
    assert bounds.heads_claimed([("x", 7), ("y", 9)]) == 2
    assert bounds.heads_claimed([("x", 8)]) == 0  # visited already
    ticket, visit = bounds.to_visit(10)
    assert sorted(visit) == [("x", 8), ("y", 9)]
    bounds.looked(ticket, "x", None, False)
    assert bounds.visited_count() == 1 and bounds.bound("x") == 8


def test_a_look_that_began_before_a_discovery_does_not_drop_what_it_found() -> None:
    bounds = AggregateBounds()
    bounds.discovered(["x"])
    ticket, _ = bounds.to_visit(10)  # this look's statement may not see the row found next
    bounds.discovered(["x"])  # a pending row found by a discovery that ran meanwhile
    bounds.looked(ticket, "x", None, False)
    assert bounds.visited_count() == 1
    later, _ = bounds.to_visit(10)
    bounds.looked(later, "x", None, False)
    assert bounds.visited_count() == 0


def test_visits_go_round_robin_and_the_sets_are_capped() -> None:
    bounds = AggregateBounds(max_known=3, max_visited=3)
    bounds.discovered(["a", "b", "c", "d"])  # "a" is left to the full claims
    _, first = bounds.to_visit(2)
    _, second = bounds.to_visit(2)
    assert [a for a, _ in first] == ["b", "c"] and [a for a, _ in second] == ["d", "b"]
    for name, bound in (("a", 1), ("b", 2), ("c", 3), ("d", 4)):
        bounds.proven(name, bound)
    assert bounds.bound("a") == 0 and bounds.bound("d") == 4  # least recently used out
