"""Wakeup: who sleeps, who polls and who a notification wakes (runtime/wakeup.py).

Real threads on the real condition variable; every wait is bounded, and what is
asserted is who woke and how often, never how fast."""

from __future__ import annotations

import threading
import time

from outbox_relay.runtime import wakeup as wakeup_module
from outbox_relay.runtime.wakeup import COALESCE_SECONDS, Wakeup


def sleeper(wakeup: Wakeup, key: int, woken: list[int], **kwargs: float) -> threading.Thread:
    def run() -> None:
        wakeup.idle_wait(key, **kwargs)  # type: ignore[arg-type]
        woken.append(key)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


def test_a_notification_wakes_one_sleeping_worker_not_all():
    wakeup = Wakeup()
    wakeup.listening = True
    woken: list[int] = []
    threads = [sleeper(wakeup, k, woken, poll_seconds=60, listening_poll_seconds=60) for k in range(3)]
    time.sleep(0.05)
    wakeup.notified()
    assert wait_until(lambda: len(woken) == 1)
    time.sleep(0.1)
    assert len(woken) == 1
    wakeup.wake_all()  # a stop wakes everyone
    for thread in threads:
        thread.join(timeout=5)
    assert sorted(woken) == [0, 1, 2]


def test_no_worker_is_woken_while_one_is_active_and_the_active_one_looks_again():
    wakeup = Wakeup()
    wakeup.listening = True
    woken: list[int] = []
    thread = sleeper(wakeup, 1, woken, poll_seconds=60, listening_poll_seconds=60)
    time.sleep(0.05)
    notices = wakeup.begin_cycle(0)  # worker 0 claims
    wakeup.notified()  # a row committed meanwhile: worker 0 will take it
    time.sleep(0.1)
    assert woken == []
    assert wakeup.end_cycle(0, notices) is False  # it must claim again, not sleep
    notices = wakeup.begin_cycle(0)
    assert wakeup.end_cycle(0, notices) is True  # nothing new: it may sleep
    wakeup.wake_all()
    thread.join(timeout=5)


def test_a_notification_wakes_another_worker_when_the_active_one_is_slow():
    wakeup = Wakeup()
    wakeup.listening = True
    woken: list[int] = []
    thread = sleeper(wakeup, 1, woken, poll_seconds=60, listening_poll_seconds=60)
    time.sleep(0.05)
    wakeup.begin_cycle(0)
    time.sleep(COALESCE_SECONDS * 2)  # worker 0 is still publishing
    wakeup.notified()
    thread.join(timeout=5)
    assert woken == [1]


def test_while_listening_one_worker_polls_for_the_process():
    """Three workers that go back to sleep after each wake-up, as idle workers do: the
    process polls about once per interval, not three times."""
    wakeup = Wakeup()
    wakeup.listening = True
    polls: list[int] = []
    stop = threading.Event()

    def worker(key: int) -> None:
        while not stop.is_set():
            wakeup.idle_wait(key, poll_seconds=0.01, listening_poll_seconds=0.2)
            if not stop.is_set():
                polls.append(key)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(3)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    time.sleep(1.5)
    stop.set()
    seconds = time.monotonic() - started
    wakeup.wake_all()
    for thread in threads:
        thread.join(timeout=5)
    assert 1 <= len(polls) <= seconds / (0.75 * 0.2) + 1, (len(polls), seconds)


def test_without_listening_every_worker_polls():
    wakeup = Wakeup()
    woken: list[int] = []
    threads = [sleeper(wakeup, k, woken, poll_seconds=0.05, listening_poll_seconds=60) for k in range(3)]
    for thread in threads:
        thread.join(timeout=5)
    assert sorted(woken) == [0, 1, 2]


def test_losing_the_listen_connection_turns_every_sleeper_into_a_poller():
    wakeup = Wakeup()
    wakeup.listening = True
    woken: list[int] = []
    threads = [sleeper(wakeup, k, woken, poll_seconds=0.05, listening_poll_seconds=60) for k in range(3)]
    time.sleep(0.1)
    assert woken == []
    wakeup.listening = False
    for thread in threads:
        thread.join(timeout=5)
    assert sorted(woken) == [0, 1, 2]


def test_a_rescheduled_row_brings_the_poll_forward():
    wakeup = Wakeup()
    wakeup.listening = True
    woken: list[int] = []
    thread = sleeper(wakeup, 0, woken, poll_seconds=60, listening_poll_seconds=60)
    time.sleep(0.05)
    wakeup.rescheduled([0.05])  # a row this process released is due in 50 ms
    thread.join(timeout=5)
    assert woken == [0]


def test_every_rescheduled_due_time_brings_a_poll_not_only_the_earliest():
    # Rows deferred one after another (a rate limit) come due one after another: the
    # sentry wakes at each due time, not at the earliest and then the idle poll.
    wakeup = Wakeup()
    wakeup.listening = True
    wakeup.rescheduled([0.05, 0.3, 0.3])
    wakes: list[float] = []
    started = time.monotonic()
    for _ in range(2):
        woken_by_notification = wakeup.idle_wait(0, poll_seconds=60, listening_poll_seconds=60)
        assert not woken_by_notification
        wakes.append(time.monotonic() - started)
    assert 0.04 <= wakes[0] < 0.3 <= wakes[1] < 30, wakes
    # Both due times are spent: the next wait lasts until the idle poll (or a new due time).
    wakeup.rescheduled([0.05])
    wakeup.idle_wait(0, poll_seconds=60, listening_poll_seconds=60)
    assert time.monotonic() - started < 30


def test_due_times_are_rounded_to_a_grid_so_rows_due_together_cost_one_poll():
    wakeup = Wakeup()
    wakeup.rescheduled([1.0 + k * 0.001 for k in range(10)])  # ten rows due within 10 ms
    assert len(wakeup._due_times) <= 2


def test_a_woken_worker_lingers_only_while_notifications_come_fast():
    wakeup = Wakeup()
    assert wakeup.linger_seconds(0.01) == 0.0  # nothing heard yet
    for _ in range(20):
        wakeup.notified()  # back to back: far more than two per linger
    assert wakeup.linger_seconds(0.01) == 0.01
    slow = Wakeup()
    for _ in range(4):
        slow.notified()
        time.sleep(0.03)  # a row every 30 ms: alone in its claim anyway
    assert slow.linger_seconds(0.01) == 0.0


def test_idle_wait_says_whether_a_notification_woke_it():
    wakeup = Wakeup()
    wakeup.listening = True
    results: list[bool] = []
    thread = threading.Thread(
        target=lambda: results.append(wakeup.idle_wait(0, poll_seconds=60, listening_poll_seconds=60)), daemon=True
    )
    thread.start()
    time.sleep(0.05)
    wakeup.notified()
    thread.join(timeout=5)
    assert results == [True]
    assert wakeup.idle_wait(0, poll_seconds=0.01, listening_poll_seconds=0.01) is False  # its poll


def test_of_two_active_workers_with_small_claims_one_steps_aside(monkeypatch):
    """One claimer is enough while claims are not full: the first to ask steps aside
    (stops being active, so it sleeps), the other goes on; alone, nobody steps aside."""
    monkeypatch.setattr(wakeup_module, "COALESCE_SECONDS", 600.0)  # however slow this machine is
    wakeup = Wakeup()
    wakeup.begin_cycle(0)
    wakeup.begin_cycle(1)
    assert wakeup.step_aside(0) is True
    assert wakeup.step_aside(1) is False  # worker 0 no longer counts as active
    assert wakeup.step_aside(1) is False


def test_a_worker_busy_for_longer_than_the_coalescing_window_does_not_count():
    """A worker stuck in a slow publish is not the claimer the others can rely on."""
    wakeup = Wakeup()
    wakeup.begin_cycle(1)
    time.sleep(COALESCE_SECONDS * 2)
    wakeup.begin_cycle(0)
    assert wakeup.step_aside(0) is False


def _ask_at_once(wakeup: Wakeup, keys: range) -> dict[int, bool]:
    barrier = threading.Barrier(len(keys))
    answers: dict[int, bool] = {}

    def ask(key: int) -> None:
        barrier.wait(timeout=5)
        answers[key] = wakeup.step_aside(key)

    threads = [threading.Thread(target=ask, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=5)
    return answers


def test_steps_aside_are_decided_one_at_a_time(monkeypatch):
    """Many workers asking at once: exactly one goes on claiming."""
    monkeypatch.setattr(wakeup_module, "COALESCE_SECONDS", 600.0)
    for _ in range(50):
        wakeup = Wakeup()
        for key in range(4):
            wakeup.begin_cycle(key)
        answers = _ask_at_once(wakeup, range(4))
        assert sorted(answers.values()) == [False, True, True, True]


def test_a_notification_wakes_the_worker_that_holds_a_finalize_before_an_older_sleeper():
    # The finalize it holds rides in the claim the notification brings (Worker._idle_wait).
    wakeup = Wakeup()
    wakeup.listening = True
    woken: list[int] = []
    older = sleeper(wakeup, 0, woken, poll_seconds=60, listening_poll_seconds=60)
    time.sleep(0.05)
    results: list[bool] = []
    holder = threading.Thread(
        target=lambda: results.append(
            wakeup.idle_wait(1, poll_seconds=60, listening_poll_seconds=60, until=time.monotonic() + 30)
        ),
        daemon=True,
    )
    holder.start()
    assert wait_until(lambda: 1 in wakeup._holders)
    wakeup.notified()
    holder.join(timeout=5)
    assert results == [True]
    time.sleep(0.05)
    assert woken == []  # the older sleeper slept on
    wakeup.wake_all()
    older.join(timeout=5)


def test_a_holder_whose_hold_ends_leaves_a_notification_to_the_others():
    wakeup = Wakeup()
    wakeup.listening = True
    # Its hold ends before anything happens: it returns without being woken, still a sleeper.
    assert wakeup.idle_wait(0, poll_seconds=60, listening_poll_seconds=60, until=time.monotonic() + 0.05) is False
    assert not wakeup._holders and 0 not in wakeup._active
    woken: list[int] = []
    other = sleeper(wakeup, 1, woken, poll_seconds=60, listening_poll_seconds=60)
    time.sleep(0.05)
    wakeup.notified()  # nobody is active and nobody holds: the other sleeper is woken
    other.join(timeout=5)
    assert woken == [1]
