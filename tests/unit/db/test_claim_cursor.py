"""DueCursor: where fast claims start, and when a full claim comes round (fake clock)."""

from __future__ import annotations

import datetime as dt
import itertools

from outbox_relay.db.claim_cursor import ClaimOutcome, ClaimPlan, DueCursor, WritersLook

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def key(seconds: float, row_id: int) -> tuple[dt.datetime, int]:
    return (T0 + dt.timedelta(seconds=seconds), row_id)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_first_claim_is_full_then_fast_claims_start_at_the_lowest_key_of_the_window() -> None:
    clock = Clock()
    cursor = DueCursor(
        lag_seconds=2.0, rescan_min_seconds=1.0, rescan_max_seconds=30.0, fast_above_seconds=0.0, clock=clock
    )
    plan = cursor.begin()
    assert plan.full and plan.start is None
    cursor.end(plan, [ClaimOutcome(lowest=key(0, 10))], 0.005)
    clock.now += 0.1
    fast = cursor.begin()
    assert not fast.full and fast.start == key(0, 10)
    cursor.end(fast, [ClaimOutcome(lowest=key(1, 20))], 0.001)
    clock.now += 0.5
    cursor.end(cursor.begin(), [ClaimOutcome(lowest=key(2, 30))], 0.001)
    assert cursor.start_key() == key(0, 10)  # still in the window
    clock.now += 1.8  # the first entry leaves the window: it is the anchor no more
    assert cursor.start_key() == key(1, 20)
    clock.now += 10  # idle: the newest entry older than the window stays the start
    assert cursor.start_key() == key(2, 30)


def test_a_late_row_found_by_a_sweep_step_is_taken_by_the_same_range_again_at_once() -> None:
    """Under pressure the full claim is a sweep step; the rows it finds do not pull the
    fast claims' start back (they would walk every dead entry above them): the same
    range is read again at once, until it yields nothing."""
    clock = Clock()
    cursor = DueCursor(lag_seconds=2.0, rescan_min_seconds=1.0, fast_above_seconds=0.0, clock=clock)
    cursor.end(cursor.begin(), [ClaimOutcome(lowest=key(10, 100))], 0.005)
    clock.now += 5
    plan = cursor.begin()
    assert plan.full and plan.sweep and plan.until == key(10, 100) and plan.start == key(9, 0)
    found = ClaimOutcome(lowest=key(9.5, 50), claimed=1, leases_exhausted=True)  # a row committed late
    cursor.end(plan, [found], 0.005)
    assert cursor.start_key() == key(10, 100)
    again = cursor.begin()
    assert again.sweep and (again.start, again.until) == (plan.start, plan.until)
    cursor.end(again, [ClaimOutcome(leases_exhausted=True)], 0.005)
    assert not cursor.begin().full  # nothing more there: the next step after its interval


def test_full_claims_come_round_less_often_when_they_are_expensive() -> None:
    clock = Clock()
    cursor = DueCursor(
        lag_seconds=2.0, rescan_min_seconds=1.0, rescan_max_seconds=30.0, full_cost_share=0.1, clock=clock
    )
    for _ in range(3):  # cheap full claims: every claim is a full one
        plan = cursor.begin()
        assert plan.full
        cursor.end(plan, [ClaimOutcome(lowest=key(0, 1))], 0.004)
    plan = cursor.begin()
    assert plan.full
    cursor.end(plan, [], 0.004)
    for i in range(3):  # three in a row take 0.8 s: the next full one after 8 s
        clock.now += 100
        plan = cursor.begin()
        assert plan.full
        cursor.end(plan, [ClaimOutcome(lowest=key(-1 - i, 1))], 0.8)  # each found a late row
    clock.now += 5
    assert not cursor.begin().full
    clock.now += 3.5
    assert cursor.begin().full
    # Only one full claim at a time: the other workers go on with fast claims.
    assert not cursor.begin().full


def test_a_failed_full_claim_is_retried_by_the_next_claim() -> None:
    clock = Clock()
    cursor = DueCursor(rescan_min_seconds=1.0, fast_above_seconds=0.0, clock=clock)
    cursor.end(cursor.begin(), [ClaimOutcome(lowest=key(0, 1))], 0.001)
    clock.now += 100
    plan = cursor.begin()
    assert plan.full
    cursor.failed(plan, 0.01)  # quickly: a connection lost
    assert cursor.begin().full


def test_a_full_claim_that_ran_out_of_time_comes_again_after_its_interval() -> None:
    clock = Clock()
    cursor = DueCursor(rescan_min_seconds=1.0, rescan_max_seconds=30.0, fast_above_seconds=0.1, clock=clock)
    for _ in range(3):  # three slow full claims: fast claims in use
        cursor.end(cursor.begin(), [ClaimOutcome(lowest=key(0, 1))], 0.5)
        clock.now += 100
    plan = cursor.begin()
    assert plan.full
    clock.now += 10
    cursor.failed(plan, 10.0)  # its statement timeout
    clock.now += 1
    assert not cursor.begin().full  # not again at once
    clock.now += 30
    assert cursor.begin().full  # after the longest interval


def test_fast_claims_start_the_processing_index_where_no_live_lease_was_left() -> None:
    clock = Clock()
    cursor = DueCursor(rescan_min_seconds=1.0, lease_margin_seconds=1.0, fast_above_seconds=0.0, clock=clock)
    plan = cursor.begin()
    assert plan.full and plan.leases_from is None
    cursor.end(
        plan, [ClaimOutcome(lowest=key(0, 1), database_now=T0 + dt.timedelta(seconds=50), leases_exhausted=True)], 0.001
    )
    fast = cursor.begin()
    assert not fast.full and fast.leases_from == T0 + dt.timedelta(seconds=49)
    # A scan cut by its LIMIT leaves expired leases behind: the start stays.
    cursor.end(fast, [ClaimOutcome(database_now=T0 + dt.timedelta(seconds=60), leases_exhausted=False)], 0.001)
    assert cursor.begin().leases_from == T0 + dt.timedelta(seconds=49)


def test_fast_claims_look_for_expired_leases_once_per_interval_and_at_once_while_some_are_left() -> None:
    clock = Clock()
    cursor = DueCursor(rescan_min_seconds=3600, lease_scan_interval_seconds=1.0, fast_above_seconds=0.0, clock=clock)
    first = cursor.begin()
    assert first.full and first.lease_scan  # a full claim always looks
    cursor.end(first, [ClaimOutcome(lowest=key(0, 1), leases_exhausted=True)], 0.001)
    clock.now += 0.1
    plans = []
    for _ in range(5):  # within the interval: no lease scan
        plan = cursor.begin()
        plans.append(plan.lease_scan)
        cursor.end(plan, [ClaimOutcome(lowest=key(1, 2))], 0.001)
        clock.now += 0.1
    assert plans == [False] * 5
    clock.now += 0.5  # the interval has passed: one claim looks, the next does not
    looking = cursor.begin()
    assert looking.lease_scan and not cursor.begin().lease_scan
    # It found more expired leases than its LIMIT: the next claims look too, until one
    # finds fewer.
    cursor.end(looking, [ClaimOutcome(lowest=key(2, 3), leases_exhausted=False)], 0.001)
    again = cursor.begin()
    assert again.lease_scan
    cursor.end(again, [ClaimOutcome(lowest=key(2, 4), leases_exhausted=True)], 0.001)
    assert not cursor.begin().lease_scan


def test_a_claim_without_a_lease_scan_never_moves_the_processing_index_start() -> None:
    clock = Clock()
    cursor = DueCursor(rescan_min_seconds=3600, lease_margin_seconds=1.0, fast_above_seconds=0.0, clock=clock)
    cursor.end(cursor.begin(), [ClaimOutcome(lowest=key(0, 1), database_now=T0, leases_exhausted=True)], 0.001)
    clock.now += 0.1
    plan = cursor.begin()
    assert not plan.lease_scan
    # The store reports leases_exhausted only for a statement whose lease scan ran.
    cursor.end(plan, [ClaimOutcome(lowest=key(1, 2), database_now=T0 + dt.timedelta(seconds=50))], 0.001)
    assert cursor.begin().leases_from == T0 - dt.timedelta(seconds=1)


def step_cost(plan: ClaimPlan, dense_from: dt.datetime, seconds_per_key_second: float = 0.02) -> float:
    """A model of a held horizon: the dead entries of every row delivered since
    ``dense_from`` lie in both indexes; a step costs 1 ms plus its share of them."""
    assert plan.sweep and plan.until is not None
    low = plan.start[0] if plan.start is not None else dt.datetime.min.replace(tzinfo=dt.UTC)
    overlap = (plan.until[0] - max(low, dense_from)).total_seconds()
    return 0.001 + seconds_per_key_second * max(0.0, overlap)


def run_pass(
    cursor: DueCursor, clock: Clock, dense_from: dt.datetime, found: bool = False
) -> tuple[float, list[ClaimPlan]]:
    """Fast claims a second apart (each claiming the newest key) until the sweep steps
    come, then one pass to the front, each step ended at the clock its cost says:
    (seconds waited for the pass's first step, its steps)."""
    waited = 0.0
    while not (plan := cursor.begin()).sweep:
        cursor.end(plan, [ClaimOutcome(lowest=key(clock.now, 2))], 0.001)
        clock.now += 1
        waited += 1
    steps = [plan]
    while True:
        cost = step_cost(plan, dense_from)
        clock.now += cost
        rows = 1 if found and len(steps) == 1 else 0
        cursor.end(plan, [ClaimOutcome(claimed=rows, server_seconds=cost, leases_exhausted=True)], cost)
        if plan.start is None and not rows:
            return waited, steps
        while not (plan := cursor.begin()).sweep:
            cursor.end(plan, [ClaimOutcome(lowest=key(clock.now, 2))], 0.001)
            clock.now += 0.5
        steps.append(plan)


def slow_cursor(clock: Clock, **settings: float) -> DueCursor:
    """Fast claims in use from the start (as under a held horizon), after one full claim."""
    cursor = DueCursor(lag_seconds=0.25, fast_above_seconds=0.0, clock=clock, **settings)  # type: ignore[arg-type]
    first = cursor.begin()
    assert first.full and not first.sweep and first.start is None
    cursor.end(
        first,
        [ClaimOutcome(lowest=key(clock.now, 1), database_now=key(clock.now - 1, 0)[0], leases_exhausted=True)],
        0.001,
    )
    return cursor


def test_a_sweep_pass_covers_everything_below_the_fast_starts_in_steps_of_bounded_cost() -> None:
    clock = Clock()
    clock.now = 10_000.0
    cursor = slow_cursor(clock, rescan_min_seconds=0.0, rescan_max_seconds=30.0, sweep_step_seconds=0.5)
    dense_from = key(clock.now - 3600, 0)[0]  # an hour of dead entries: 72 s for a full claim from the front
    for _ in range(3):
        leases_top = cursor.gauge_bounds().leases_from  # type: ignore[union-attr]
        _, steps = run_pass(cursor, clock, dense_from)
        fast_start = steps[0].fast_start  # where fast claims started when the pass began
        assert fast_start is not None and leases_top is not None
        # Contiguous ranges from the fast claims' starts down to the front of both indexes.
        assert steps[0].until == fast_start and steps[0].leases_until == leases_top
        for upper, lower in itertools.pairwise(steps):
            assert upper.start is not None
            assert lower.until == upper.start
            assert lower.leases_until == min(upper.leases_from, leases_top)  # type: ignore[type-var]
        assert steps[-1].start is None and steps[-1].leases_from is None
        costs = [step_cost(step, dense_from) for step in steps]
        assert max(costs[2:]) < 0.8, costs  # about the target once the width is learned
        assert len(steps) < 250
    assert cursor.sweep.passes == 3 and cursor.fast_claims_in_use()
    # The next pass starts with the width learned at the top: no step far above the target.
    assert max(step_cost(step, dense_from) for step in run_pass(cursor, clock, dense_from)[1]) < 0.8


def test_sweep_passes_that_find_nothing_come_round_less_and_less_often() -> None:
    clock = Clock()
    cursor = slow_cursor(clock, rescan_min_seconds=1.0, rescan_max_seconds=10.0, rescan_quiet_max_seconds=300.0)
    dense_from = key(clock.now - 100, 0)[0]
    for _ in range(3):  # passes that find a late row: the next pass after 10 s (rescan_max)
        run_pass(cursor, clock, dense_from, found=True)
    waits = [run_pass(cursor, clock, dense_from)[0] for _ in range(8)]
    assert waits[:6] == [10, 20, 40, 80, 160, 300], waits  # doubled, up to the quiet maximum
    assert waits[6:] == [300, 300]
    run_pass(cursor, clock, dense_from, found=True)  # a late row: back to 10 s at once
    assert run_pass(cursor, clock, dense_from)[0] == 10


def test_a_cheap_sweep_pass_brings_back_full_claims_from_the_front() -> None:
    clock = Clock()
    cursor = DueCursor(lag_seconds=0.25, fast_above_seconds=0.1, rescan_min_seconds=1.0, clock=clock)
    for _ in range(3):  # three slow full claims: fast claims in use
        plan = cursor.begin()
        assert plan.full and not plan.sweep
        cursor.end(plan, [ClaimOutcome(lowest=key(clock.now, 1))], 0.5)
        clock.now += 100
    assert cursor.fast_claims_in_use()
    run_pass(cursor, clock, key(clock.now - 600, 0)[0])  # horizon still held: 12 s of dead entries
    assert cursor.fast_claims_in_use()
    # Early in a hold a pass may take less than fast_above_seconds in all (40 ms here),
    # but a step that walked dead entries is slow for a claim: no switch back.
    run_pass(cursor, clock, key(clock.now - 2, 0)[0])
    assert cursor.fast_claims_in_use()
    run_pass(cursor, clock, key(clock.now + 10**6, 0)[0])  # vacuum has removed them: ~1 ms a step
    assert not cursor.fast_claims_in_use()
    plan = cursor.begin()
    assert plan.full and not plan.sweep and plan.start is None


def test_a_sweep_step_that_ran_out_of_time_is_tried_again_narrower() -> None:
    clock = Clock()
    cursor = slow_cursor(clock, rescan_min_seconds=1.0, rescan_max_seconds=30.0)
    clock.now += 2
    plan = cursor.begin()
    assert plan.sweep and plan.start is not None and plan.until is not None
    cursor.failed(plan, 0.01)  # lost quickly: the same step at once
    quick = cursor.begin()
    assert quick.sweep and (quick.start, quick.until) == (plan.start, plan.until)
    cursor.failed(quick, 10.0)  # its statement timeout: after its interval, narrower
    assert not cursor.begin().sweep
    clock.now += 30
    narrower = cursor.begin()
    assert narrower.sweep and narrower.until == plan.until
    assert narrower.start is not None and narrower.start > plan.start


def test_small_full_claims_that_take_tens_of_milliseconds_switch_to_fast_claims_large_ones_do_not() -> None:
    def after_three(elapsed: float, rows: int, server_seconds: float | None = None) -> bool:
        clock = Clock()
        cursor = DueCursor(rescan_min_seconds=1.0, fast_above_seconds=0.1, clock=clock)
        for _ in range(3):
            clock.now += 100
            plan = cursor.begin()
            assert plan.full
            outcome = ClaimOutcome(lowest=key(0, 1), server_seconds=server_seconds)
            cursor.end(plan, [outcome], elapsed, claimed_rows=rows)
        return cursor.fast_claims_in_use()

    assert after_three(0.040, 40)  # 40 rows in 40 ms: walking dead entries
    assert after_three(0.030, 0)  # an empty claim of 30 ms
    assert not after_three(0.030, 1000)  # 1 000 rows in 30 ms: a large batch, no pressure
    assert not after_three(0.002, 40)  # the usual small claim
    assert after_three(0.150, 1000)  # anything over fast_above_seconds
    # Judged by the statement's time in the server when known: a busy client machine
    # (40 ms from call to answer, 1 ms in the server) is no sign of dead entries.
    assert not after_three(0.040, 40, server_seconds=0.001)
    assert after_three(0.045, 40, server_seconds=0.040)


def look(seconds: float, *writers: tuple[int, float]) -> WritersLook:
    """A look for open writers at T0 + seconds that saw these (pid, started at T0 + s) long writers."""
    return WritersLook(
        looked_at=T0 + dt.timedelta(seconds=seconds),
        long_writers=frozenset((pid, T0 + dt.timedelta(seconds=started)) for pid, started in writers),
    )


def fast_cursor(clock: Clock) -> DueCursor:
    """Fast claims from the start; no full claim after the first for an hour."""
    cursor = DueCursor(
        lag_seconds=0.1, rescan_min_seconds=3600, rescan_max_seconds=3600, fast_above_seconds=0.0, clock=clock
    )
    first = cursor.begin()
    assert first.full
    cursor.end(first, [ClaimOutcome(lowest=key(100, 1000))], 0.001)
    return cursor


def test_a_long_writer_seen_open_then_gone_gets_one_catch_up_claim_from_its_start() -> None:
    clock = Clock()
    cursor = fast_cursor(clock)
    for i in range(3):  # a writer open since T0 + 40 s (long: older than writers_within_seconds)
        clock.now += 0.05
        plan = cursor.begin()
        assert not plan.full and plan.start == key(100, 1000) and plan.catch_up_from is None
        cursor.end(plan, [ClaimOutcome(writers_look=look(101 + i, (7, 40)))], 0.001)
    clock.now += 0.05
    assert not cursor.catch_up_pending()
    plan = cursor.begin()
    cursor.end(plan, [ClaimOutcome(writers_look=look(104))], 0.001)  # no longer open: committed or rolled back
    assert cursor.catch_up_pending()
    catch_up = cursor.begin()
    assert not catch_up.full and catch_up.start == key(40, 0) and catch_up.catch_up_from == key(40, 0)[0]
    assert cursor.catch_up_claims == 1 and not cursor.catch_up_pending()
    # What it claimed (the writer's rows) enters the window: the next fast claims drain from there.
    cursor.end(catch_up, [ClaimOutcome(lowest=key(40, 5000), writers_look=look(105))], 0.02)
    drain = cursor.begin()
    assert not drain.full and drain.catch_up_from is None and drain.start == key(40, 5000)
    cursor.end(drain, [ClaimOutcome(lowest=key(40, 6000))], 0.001)
    clock.now += 1  # drained, the window moves on; no second catch-up, no full claim
    cursor.end(cursor.begin(), [ClaimOutcome(lowest=key(106, 9000))], 0.001)
    clock.now += 1
    assert cursor.begin().start == key(106, 9000)
    assert cursor.full_claims == 1 and cursor.catch_up_claims == 1


def test_a_writer_still_open_and_claims_without_a_look_never_send_a_catch_up() -> None:
    clock = Clock()
    cursor = fast_cursor(clock)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(101, (7, 40), (8, 50)))], 0.001)
    for i in range(5):
        clock.now += 0.01
        cursor.end(cursor.begin(), [ClaimOutcome(lowest=key(101 + i, 2000 + i))], 0.001)  # no look this time
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(102, (8, 50), (7, 40)))], 0.001)
    assert not cursor.catch_up_pending()
    assert cursor.begin().catch_up_from is None


def test_the_catch_up_starts_at_the_earliest_of_the_writers_that_ended() -> None:
    clock = Clock()
    cursor = fast_cursor(clock)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(101, (7, 40), (8, 30), (9, 60)))], 0.001)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(102, (9, 60)))], 0.001)  # 7 and 8 ended
    assert cursor.begin().start == key(30, 0)
    # The same pid in a new transaction (a new start) is another writer: the old one ended.
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(103, (9, 70)))], 0.001)
    assert cursor.begin().start == key(60, 0)


def test_a_look_taken_before_the_last_one_applied_is_ignored() -> None:
    """Two claims look at about the same time; the older look (taken before the writer
    first wrote) ends last: it must not make the cursor forget the writer still open."""
    clock = Clock()
    cursor = fast_cursor(clock)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(102, (7, 40)))], 0.001)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(101.99))], 0.001)  # stale: ignored
    assert not cursor.catch_up_pending()
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(102.04))], 0.001)  # a newer one: ended
    assert cursor.catch_up_pending()
    assert cursor.begin().start == key(40, 0)  # its catch-up
    # The server's clock set back an hour: looks go on being applied.
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(102.1 - 3600, (8, 50)))], 0.001)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(102.2 - 3600))], 0.001)
    assert cursor.begin().start == key(50, 0)  # a writer seen after the step, ended


def test_a_catch_up_claim_that_failed_quickly_is_sent_again_by_the_next_claim() -> None:
    clock = Clock()
    cursor = fast_cursor(clock)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(101, (7, 40)))], 0.001)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(102))], 0.001)
    catch_up = cursor.begin()
    assert catch_up.start == key(40, 0)
    cursor.failed(catch_up, 0.01)  # a connection lost
    assert cursor.catch_up_pending()
    again = cursor.begin()
    assert again.start == key(40, 0)
    cursor.failed(again, 10.0)  # its statement timeout: not again, left to the full claims
    assert not cursor.catch_up_pending()
    assert cursor.begin().start == key(100, 1000)


def test_no_catch_up_when_fast_claims_already_start_below_the_writers_rows() -> None:
    clock = Clock()
    cursor = fast_cursor(clock)  # fast claims start at T0 + 100 s
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(101, (7, 150)))], 0.001)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(102))], 0.001)
    plan = cursor.begin()
    assert plan.start == key(100, 1000) and plan.catch_up_from is None
    assert cursor.catch_up_claims == 0 and not cursor.catch_up_pending()


def test_the_look_threshold_is_the_cursors_setting() -> None:
    clock = Clock()
    cursor = DueCursor(writers_within_seconds=1.5, rescan_min_seconds=3600, fast_above_seconds=0.0, clock=clock)
    cursor.end(cursor.begin(), [ClaimOutcome(lowest=key(0, 1))], 0.001)
    plan = cursor.begin()
    assert not plan.full and plan.writers_check and plan.writers_within_seconds == 1.5


def test_the_long_writers_the_claim_reports_are_read_to_the_microsecond() -> None:
    from outbox_relay.db.delivery import parse_long_writers

    started = dt.datetime(2026, 12, 3, 8, 40, 1, 123457, tzinfo=dt.UTC)
    started_us = (started - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1)
    assert parse_long_writers(f"4242:{started_us},17:{started_us - 1}") == {
        (4242, started),
        (17, started - dt.timedelta(microseconds=1)),
    }
    assert parse_long_writers("") == frozenset()


def test_a_full_claim_takes_over_a_pending_catch_up_while_every_claim_is_full() -> None:
    """While full claims are cheap every claim reads from the front: no catch-up after
    one (nor a second claim for it)."""
    clock = Clock()
    cursor = DueCursor(lag_seconds=0.1, clock=clock)  # fast_above_seconds 0.1: these claims are cheap
    cursor.end(cursor.begin(), [ClaimOutcome(lowest=key(100, 1000))], 0.001)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(101, (7, 40)))], 0.001)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(102))], 0.001)
    assert cursor.catch_up_pending()
    full = cursor.begin()
    assert full.full and full.catch_up_from == key(40, 0)[0]
    assert not cursor.catch_up_pending()
    cursor.failed(full, 0.01)  # lost quickly: the next claim (full again) covers it
    assert cursor.catch_up_pending()
    again = cursor.begin()
    assert again.full and again.catch_up_from == key(40, 0)[0]
    cursor.end(again, [ClaimOutcome(lowest=key(40, 5000))], 0.001)
    assert not cursor.catch_up_pending() and cursor.catch_up_claims == 0


def test_a_slow_full_claim_leaves_a_pending_catch_up_to_the_next_fast_claim() -> None:
    """While full claims are slow, one due when a long writer ends would reach its rows
    only after walking the dead entries from the front (or never, if it runs out of its
    statement timeout): the catch-up stays, and the next fast claim starts at the
    writer's start while the full claim runs. (A cursor without the sweep, as the
    ordered claims' is: with it the full claim is a sweep step, see below.)"""
    clock = Clock()
    cursor = DueCursor(
        lag_seconds=0.1,
        rescan_min_seconds=1.0,
        rescan_max_seconds=1.0,
        fast_above_seconds=0.0,
        sweep=False,
        clock=clock,
    )
    cursor.end(cursor.begin(), [ClaimOutcome(lowest=key(100, 1000))], 0.001)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(101, (7, 40)))], 0.001)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(102))], 0.001)
    assert cursor.catch_up_pending()
    clock.now += 2  # a full claim is due
    full = cursor.begin()
    assert full.full and full.catch_up_from is None
    assert cursor.catch_up_pending()
    catch_up = cursor.begin()  # another worker, while the full claim runs
    assert not catch_up.full and catch_up.start == key(40, 0) and catch_up.catch_up_from == key(40, 0)[0]
    assert cursor.catch_up_claims == 1 and not cursor.catch_up_pending()
    cursor.end(catch_up, [ClaimOutcome(lowest=key(40, 5000))], 0.001)
    cursor.failed(full, 10.0)  # the full claim ran out of its statement timeout: nothing lost
    assert not cursor.catch_up_pending()
    assert cursor.begin().start == key(40, 5000)


def test_a_sweep_step_leaves_a_pending_catch_up_to_the_next_fast_claim() -> None:
    """A sweep step reads one range below the fast start only: the catch-up from the
    ended writer's start is still the next fast claim."""
    clock = Clock()
    cursor = DueCursor(
        lag_seconds=0.1, rescan_min_seconds=1.0, rescan_max_seconds=1.0, fast_above_seconds=0.0, clock=clock
    )
    cursor.end(cursor.begin(), [ClaimOutcome(lowest=key(100, 1000))], 0.001)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(101, (7, 40)))], 0.001)
    cursor.end(cursor.begin(), [ClaimOutcome(writers_look=look(102))], 0.001)
    assert cursor.catch_up_pending()
    clock.now += 2  # a sweep step is due
    step = cursor.begin()
    assert step.sweep and step.catch_up_from is None
    assert cursor.catch_up_pending()
    catch_up = cursor.begin()
    assert not catch_up.full and catch_up.start == key(40, 0) and cursor.catch_up_claims == 1


def test_the_gauge_bounds_are_published_only_while_fast_claims_are_in_use_and_withdrawn_once() -> None:
    clock = Clock()
    cursor = DueCursor(lag_seconds=0.25, fast_above_seconds=0.1, rescan_min_seconds=1.0, clock=clock)
    cursor.end(cursor.begin(), [ClaimOutcome(lowest=key(0, 1))], 0.001)
    assert cursor.bounds_to_publish() == (False, None)  # full claims cheap: nothing written
    for _ in range(3):  # three slow full claims: fast claims in use
        cursor.end(cursor.begin(), [ClaimOutcome(lowest=key(clock.now, 1))], 0.5)
        clock.now += 100
    publish, bounds = cursor.bounds_to_publish()
    assert publish and bounds is not None and bounds.due_from == cursor.start_key()
    clock.now += 1
    assert cursor.bounds_to_publish() == (False, None)  # not again within the interval
    clock.now += 5
    assert cursor.bounds_to_publish()[0]
    dense_from = key(clock.now + 10**6, 0)[0]
    run_pass(cursor, clock, dense_from)  # a cheap pass: vacuum has caught up
    assert not cursor.fast_claims_in_use()
    assert cursor.bounds_to_publish() == (True, None)  # withdrawn, once
    assert cursor.bounds_to_publish() == (False, None)


def test_a_step_cancelled_by_its_own_timeout_is_tried_narrower_however_quick() -> None:
    clock = Clock()
    cursor = slow_cursor(clock, rescan_min_seconds=1.0, rescan_max_seconds=30.0, sweep_step_seconds=0.01)
    clock.now += 2
    plan = cursor.begin()
    assert plan.sweep and plan.statement_timeout_ms == 40 and plan.start is not None
    cursor.failed(plan, 0.04, timed_out=True)
    assert cursor.sweep_timeouts == 1
    clock.now += 30
    narrower = cursor.begin()
    assert narrower.sweep and narrower.until == plan.until
    assert narrower.start is not None and narrower.start > plan.start
