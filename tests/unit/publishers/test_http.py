"""The HTTP publisher: Retry-After parsing and the classification of responses."""

from __future__ import annotations

from email.utils import formatdate

import httpx
import pytest

from outbox_relay.publisher import (
    Defer,
    PermanentError,
    RetryableError,
)
from outbox_relay.publishers.http import HttpPublisher, parse_retry_after


def test_parse_retry_after():
    assert parse_retry_after(None) is None and parse_retry_after("  ") is None and parse_retry_after("soon") is None
    assert parse_retry_after("120") == 120.0 and parse_retry_after("-1") is None
    assert parse_retry_after("1e9") == 86400.0  # capped at a day
    now = 1_700_000_000.0
    assert parse_retry_after(formatdate(now + 30, usegmt=True), now=now) == pytest.approx(30.0)
    assert parse_retry_after(formatdate(now - 30, usegmt=True), now=now) == 0.0


@pytest.fixture(scope="module")
def http_publisher():
    publisher = HttpPublisher(
        "http://127.0.0.1:9/e", timeout_seconds=1, done_statuses=[409, 404], defer_statuses=[425], defer_seconds=7
    )
    yield publisher
    publisher.close()


@pytest.mark.parametrize(
    ("status", "headers", "body", "kind", "detail"),
    [
        (200, {}, b"", type(None), None),
        (204, {}, b"", type(None), None),
        (409, {}, b"exists", type(None), None),
        (404, {}, b"gone", type(None), None),  # configured as done
        (425, {}, b"too early", Defer, 7.0),
        (425, {"Retry-After": "3"}, b"", Defer, 3.0),
        (429, {"Retry-After": "12"}, b"slow down", RetryableError, 12.0),
        (503, {}, b"<html>\n down \n</html>", RetryableError, None),
        (408, {}, b"", RetryableError, None),
        (400, {}, b"bad field x", PermanentError, None),
        (301, {"Location": "http://elsewhere/"}, b"", PermanentError, None),
    ],
)
def test_http_classification(http_publisher, status, headers, body, kind, detail):
    response = httpx.Response(status, headers=headers, content=body)
    outcome = http_publisher._classify(response, "POST http://127.0.0.1:9/e")
    assert type(outcome) is kind
    if isinstance(outcome, Defer):
        assert outcome.delay == detail
    if isinstance(outcome, RetryableError):
        assert outcome.retry_after_seconds == detail
        assert "\n" not in outcome.reason
    if isinstance(outcome, PermanentError) and status == 400:
        assert outcome.reason == "HTTP 400: bad field x"
