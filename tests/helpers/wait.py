"""The one bounded wait of the suite: poll a condition until it holds.

A correctness wait, never a timing assertion: ``timeout`` only bounds how long a
broken build takes to fail, so it is generous; the test proceeds as soon as the
condition holds. Use it instead of ``time.sleep`` whenever a test waits for
something to happen (a thread to block, a lease to expire, a row to change)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 90,
    interval: float = 0.1,
    message: str = "condition",
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll until ``predicate()`` is truthy and return that value; AssertionError naming
    ``message`` after ``timeout`` seconds. ``ignoring``: exceptions that count as "not
    yet" (e.g. psycopg.Error while a server restarts)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ignoring:
            value = None  # type: ignore[assignment]
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {message}")
        time.sleep(interval)
