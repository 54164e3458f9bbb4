"""The console's wrong-token throttle as a pure piece, on a clock the test moves: the
lockout's start, doubling, cap and forgetting, and what a client is counted as.
(Over real HTTP: tests/integration/test_console_api.py.)"""

from __future__ import annotations

import pytest

from outbox_relay.operator.console.auth import (
    FORGET_AFTER_SECONDS,
    LOCKOUT_CAP_SECONDS,
    Failure,
    LoginThrottle,
    client_key,
    retry_after_header,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_lockout_starts_at_the_limit_and_doubles_up_to_the_cap():
    clock = Clock()
    throttle = LoginThrottle(3, 30.0, clock=clock)
    assert [throttle.failed("a") for _ in range(2)] == [Failure(1, 0.0), Failure(2, 0.0)]
    assert throttle.retry_after("a") is None
    assert throttle.failed("a") == Failure(3, 30.0)
    # Locked out: the first refusal is the one worth logging, the next ones are not.
    assert throttle.retry_after("a") == (30.0, True)
    clock.now += 10
    assert throttle.retry_after("a") == (20.0, False)
    assert throttle.retry_after("b") is None  # per client
    lockouts = []
    for _ in range(10):
        clock.now += lockouts[-1] if lockouts else 20.0
        assert throttle.retry_after("a") is None
        lockouts.append(throttle.failed("a").locked_for_seconds)
    assert lockouts[:6] == [60.0, 120.0, 240.0, 480.0, 960.0, 1920.0]
    assert lockouts[6:] == [LOCKOUT_CAP_SECONDS] * 4
    assert throttle.retry_after("a") == (LOCKOUT_CAP_SECONDS, True)  # a new lockout logs its first refusal again


def test_a_first_lockout_longer_than_the_cap_is_kept():
    throttle = LoginThrottle(1, 2 * LOCKOUT_CAP_SECONDS, clock=Clock())
    assert throttle.failed("a").locked_for_seconds == 2 * LOCKOUT_CAP_SECONDS


def test_wrong_tokens_are_forgotten_an_hour_after_the_last_lockout():
    clock = Clock()
    throttle = LoginThrottle(2, 30.0, clock=clock)
    throttle.failed("a")
    clock.now += FORGET_AFTER_SECONDS - 1
    assert throttle.failed("a") == Failure(2, 30.0)  # not forgotten yet
    clock.now += 30 + FORGET_AFTER_SECONDS - 1
    assert throttle.failed("a") == Failure(3, 60.0)
    clock.now += 60 + FORGET_AFTER_SECONDS
    assert throttle.retry_after("a") is None
    assert throttle.failed("a") == Failure(1, 0.0)  # a fresh allowance


def test_memory_is_bounded_by_dropping_the_stalest_client():
    throttle = LoginThrottle(1, 30.0, max_clients=2, clock=Clock())
    for client in ("a", "b", "c"):
        throttle.failed(client)
    assert throttle.retry_after("a") is None
    assert throttle.retry_after("b") is not None and throttle.retry_after("c") is not None


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("198.51.100.7", "198.51.100.7"),
        ("2001:db8::1", "2001:db8::/64"),
        ("2001:db8::ffff:1", "2001:db8::/64"),
        ("2001:db8:0:1::1", "2001:db8:0:1::/64"),
        ("::ffff:198.51.100.7", "198.51.100.7"),
        ("", "unknown"),
        (None, "unknown"),
    ],
)
def test_client_key(host, key):
    assert client_key(host) == key


def test_retry_after_never_says_too_early():
    assert [retry_after_header(s) for s in (0.01, 1.0, 1.2, 599.9)] == ["1", "1", "2", "600"]
