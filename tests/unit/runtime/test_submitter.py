"""The Submitter (submitter.py): one thread, first in first out, every result or
exception handed back to the worker that handed the work over."""

from __future__ import annotations

import threading

import pytest

from outbox_relay.runtime.submitter import Submitter


def test_work_runs_on_one_thread_in_the_order_it_was_handed_over():
    submitter = Submitter()
    seen: list[tuple[int, str]] = []
    try:
        futures = [
            submitter.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i) for i in range(50)
        ]
        assert [f.result(timeout=5) for f in futures] == list(range(50))
    finally:
        submitter.close()
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"submit"}
    assert not submitter.is_alive()


def test_an_exception_comes_back_with_the_future_and_the_thread_goes_on():
    submitter = Submitter()
    try:

        def boom() -> None:
            raise ValueError("bad batch")

        failed = submitter.submit(boom)
        with pytest.raises(ValueError, match="bad batch"):
            failed.result(timeout=5)
        assert submitter.submit(lambda: 42).result(timeout=5) == 42
    finally:
        submitter.close()


def test_close_finishes_what_was_handed_over():
    submitter = Submitter()
    release = threading.Event()
    first = submitter.submit(lambda: release.wait(5))
    second = submitter.submit(lambda: "done")
    threading.Timer(0.1, release.set).start()
    submitter.close()
    assert first.result(timeout=0) is True and second.result(timeout=0) == "done"
