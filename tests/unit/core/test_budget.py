"""The in-flight byte budget (outbox_relay.core.budget): reservations, the empty-budget
exception for a single large row, waiting and stopping."""

from __future__ import annotations

import threading

from outbox_relay.core.budget import ByteBudget
from tests.helpers.wait import wait_for


class Gauge:
    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = value


def test_reservations_resize_and_release():
    gauge = Gauge()
    budget = ByteBudget(100, gauge)
    assert budget.try_reserve(60) and budget.used_bytes == 60 and gauge.value == 60
    assert not budget.try_reserve(50)  # 110 > 100
    budget.resize(60, 30)  # the claim returned less than reserved
    assert budget.try_reserve(50) and budget.used_bytes == 80
    budget.release(30)
    budget.release(50)
    assert budget.used_bytes == 0 and gauge.value == 0


def test_an_empty_budget_grants_any_size_so_one_huge_row_can_pass():
    budget = ByteBudget(100)
    assert budget.try_reserve(1_000)
    assert not budget.try_reserve(1)
    budget.release(1_000)
    assert budget.try_reserve(1)


def test_reserve_waits_for_a_release_and_stops_on_request():
    budget = ByteBudget(100)
    assert budget.try_reserve(90)
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(budget.reserve(50, threading.Event())))
    waiter.start()
    wait_for(lambda: budget.waits == 1, timeout=10, message="the reserve to block")
    assert got == []  # still waiting
    budget.release(90)
    waiter.join(5)
    assert got == [True] and budget.used_bytes == 50
    stop = threading.Event()
    stop.set()
    assert budget.reserve(80, stop) is False  # 130 > 100 and asked to stop


def test_breaker_waits_longer_for_each_trip_without_a_delivery_in_between():
    from outbox_relay.core.breaker import CircuitBreaker

    breaker = CircuitBreaker(lambda: True, initial_backoff=0.001, max_backoff=0.004)
    delays = []
    for _ in range(4):
        breaker.trip("refused")
        delays.append(breaker.first_probe_delay())
        assert breaker.wait_closed(5)  # the probe answers: closed again
    assert delays == [0.001, 0.002, 0.004, 0.004]  # doubling, capped
    breaker.record_delivery()
    breaker.trip("refused")
    assert breaker.first_probe_delay() == 0.001
    assert breaker.wait_closed(5)
