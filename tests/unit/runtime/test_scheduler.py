"""The source scheduler: round-robin among due sources, idle and failure rules, retired
sources, the fresh lane."""

from __future__ import annotations

from outbox_relay.runtime.scheduler import SourceScheduler


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_due_sources_are_taken_round_robin_and_a_busy_one_keeps_idle_workers():
    s = SourceScheduler(clock=Clock())
    for name in ("busy", "quiet"):
        s.add(name)
    s.probes_due()
    s.probed("busy", has_work=True)
    assert [s.next_due(0)[0] for _ in range(3)] == ["busy", "busy", "busy"]  # alone: every worker takes it
    s.probed("quiet", has_work=True)
    picks = [s.next_due(0)[0] for _ in range(4)]
    # Just due, never claimed since: taken by the next worker, then round-robin.
    assert picks == ["quiet", "busy", "quiet", "busy"]


def test_a_short_claim_makes_a_source_idle_unless_it_was_marked_due_again():
    clock = Clock()
    s = SourceScheduler(clock=clock, probe_min_seconds=0.1, probe_max_seconds=1.0)
    s.add("a")
    s.probes_due()
    s.probed("a", has_work=True)
    _name, epoch = s.next_due(0)
    s.mark_due(["a"])  # a newer signal arrives while the claim runs
    s.claimed("a", epoch, rows=3, batch_size=100)
    assert s.due_count() == 1
    _name, epoch = s.next_due(0)
    s.claimed("a", epoch, rows=3, batch_size=100)
    assert s.due_count() == 0 and s.next_due(0) is None
    # Idle: probed again after probe_min, then backing off to probe_max.
    assert s.probes_due() == []
    clock.now += 0.1
    assert s.probes_due() == ["a"]
    delays = []
    for _ in range(6):
        s.probed("a", has_work=False)
        delays.append(s.state("a").probe_delay)
        clock.now += 5
        assert s.probes_due() == ["a"]
    assert delays[0] == 0.2 and delays[-1] == 1.0


def test_a_failing_source_leaves_the_ring_and_backs_off_alone():
    clock = Clock()
    s = SourceScheduler(clock=clock, error_cap_seconds=30)
    s.add("down")
    s.add("up")
    s.probes_due()
    s.probed("up", has_work=True)
    s.probed("down", has_work=True)
    name, _epoch = s.next_due(0)
    assert name == "up"
    name, _epoch = s.next_due(0)
    assert name == "down"
    delay = s.failed("down", "connection refused")
    assert 0.1 <= delay <= 30.1
    assert not s.state("down").ready and s.state("up").ready
    assert [s.next_due(0)[0] for _ in range(3)] == ["up", "up", "up"]
    s.mark_due(["down"])  # no signal brings a failing source back before its probe
    assert s.due_count() == 1
    clock.now += 31
    assert s.probes_due() == ["down"]
    s.probed("down", has_work=True)
    assert s.state("down").ready and s.due_count() == 2


def test_a_retired_source_is_never_handed_out_and_its_batches_are_awaited():
    s = SourceScheduler(clock=Clock())
    s.add("gone")
    s.probes_due()
    s.probed("gone", has_work=True)
    _name, _ = s.next_due(0)
    state = s.retire("gone")
    assert state is not None and s.next_due(0) is None
    assert state.active == 1
    s.done("gone")  # by name, as a worker finishing the batch does
    assert s.wait_inactive("gone", state, timeout=0)


def test_the_fresh_lane_takes_only_just_due_sources_and_active_sources_are_probed_sooner():
    clock = Clock()
    s = SourceScheduler(clock=clock, probe_min_seconds=0.05, probe_max_seconds=1.0)
    for name in ("busy", "quiet"):
        s.add(name)
    s.probes_due()
    s.probed("busy", has_work=True)
    assert s.next_due(0)[0] == "busy"  # claimed since: no longer fresh
    assert s.next_fresh(0) is None
    s.probed("quiet", has_work=True)
    name, epoch = s.next_fresh(0)
    assert name == "quiet" and s.next_fresh(0) is None
    s.claimed("quiet", epoch, rows=1, batch_size=100)  # a short claim with a row: idle, recently active
    delays = []
    for _ in range(5):
        clock.now += 1.5
        assert s.probes_due() == ["quiet"]
        s.probed("quiet", has_work=False)
        delays.append(s.state("quiet").probe_delay)
    assert delays == [0.1, 0.2, 0.25, 0.25, 0.25]  # a quarter of probe_max while recently active
    clock.now += 10
    s.probes_due()
    s.probed("quiet", has_work=False)
    assert s.state("quiet").probe_delay == 0.5  # quiet for long: the full back-off again
