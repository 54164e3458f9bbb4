"""[[limits]]: the token bucket's arithmetic, the settings, and the wrapper that holds
messages for their tokens, defers the ones that would wait too long (attempt
refunded) and pauses a bucket on a throttled answer with Retry-After."""

from __future__ import annotations

import threading
import time

import pytest

from outbox_relay.config import load_settings
from outbox_relay.core.rate_limit import LimitRule, RateLimits, TokenBucket
from outbox_relay.errors import ConfigError
from outbox_relay.model import Defer, Message, NotDelivered, Outcome, PublisherObserver, RetryableError
from outbox_relay.publishers.base import (
    RATE_LIMIT_MAX_WAIT_SECONDS,
    RateLimitedPublisher,
    SimplePublisher,
    load_publisher,
    with_rate_limits,
)


def test_bucket_gives_the_burst_then_one_token_per_interval():
    bucket = TokenBucket(10.0, 3, now=100.0)
    assert [bucket.reserve(100.0, 1.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.reserve(100.0, 1.0) == pytest.approx(0.1)
    assert bucket.reserve(100.0, 1.0) == pytest.approx(0.2)  # booked behind the previous one
    assert bucket.wait_for(100.0) == pytest.approx(0.3) and bucket.wait_for(100.0, ahead=2) == pytest.approx(0.5)
    assert bucket.reserve(100.0, 0.25) is None  # too long a wait: nothing booked
    assert bucket.reserve(100.0, 0.3) == pytest.approx(0.3)
    # a quiet spell refills up to the burst, never beyond
    assert bucket.wait_for(200.0) == 0.0
    assert [bucket.reserve(200.0, 0.0) for _ in range(4)] == [0.0, 0.0, 0.0, None]


def test_bucket_rate_over_a_long_run_is_the_configured_rate():
    bucket = TokenBucket(50.0, 5, now=0.0)
    now, sent = 0.0, 0
    while now < 10.0:  # a caller asking every millisecond, never waiting
        if bucket.reserve(now, 0.0) is not None:
            sent += 1
        now += 0.001
    assert 5 + 50 * 10 - 2 <= sent <= 5 + 50 * 10


def test_back_off_pauses_the_bucket_for_the_retry_after():
    bucket = TokenBucket(10.0, 5, now=0.0)
    bucket.back_off(0.0, 2.0)
    assert bucket.reserve(0.0, 1.0) is None
    assert bucket.reserve(0.0, 5.0) == pytest.approx(2.1)  # empty after the pause: one interval more
    assert bucket.reserve(3.0, 0.0) is not None  # refilled from the pause's end


def test_rules_match_topic_or_host_and_refuse_duplicates():
    limits = RateLimits([LimitRule("topic", "orders", 5, 1), LimitRule("host", "API.example.com", 2, 1)], now=0.0)
    assert limits.match({"topic": "orders"})[0].destination == "topic:orders"
    assert limits.match({"topic": "orders", "host": "api.example.COM"})[0].destination == "host:API.example.com"
    assert limits.match({"topic": "other", "host": "elsewhere"}) is None
    with pytest.raises(ValueError, match="two limits"):
        RateLimits([LimitRule("topic", "a", 1, 1), LimitRule("topic", "a", 2, 1)], now=0.0)


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ([{"rate_per_second": 5}], "exactly one of topic or host"),
        ([{"topic": "a", "host": "b", "rate_per_second": 5}], "exactly one of topic or host"),
        ([{"topic": "a", "rate_per_second": 0}], "rate_per_second"),
        ([{"topic": "a", "rate_per_second": 5, "burst": 0}], "burst"),
        ([{"topic": "a", "rate_per_second": 5}, {"topic": "a", "rate_per_second": 6}], "a second limit"),
        ([{"host": "h", "rate_per_second": 5}], 'relay.publisher = "http" only'),
    ],
)
def test_bad_limits_are_one_line_errors(limits, expected):
    with pytest.raises(ConfigError) as info:
        load_settings(None, limits=limits)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_limits_from_a_toml_array_of_tables(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[[limits]]\ntopic = "orders"\nrate_per_second = 50\nburst = 10\n')
    settings = load_settings(path)
    assert [(x.topic, x.rate_per_second, x.burst) for x in settings.limits] == [("orders", 50.0, 10)]


class Recording(SimplePublisher):
    """Publishes into a list with the time each message was handed over; answers by topic."""

    def __init__(self, answers: dict[str, Outcome] | None = None) -> None:
        self.sent: list[tuple[float, int]] = []
        self.answers = answers or {}

    def publish(self, message: Message) -> None:
        self.sent.append((time.monotonic(), message.id))
        answer = self.answers.get(message.topic)
        if answer is not None:
            raise answer


class Waits(PublisherObserver):
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.lock = threading.Lock()

    def rate_limit_waited(self, destination: str, seconds: float) -> None:
        with self.lock:
            self.seconds[destination] = self.seconds.get(destination, 0.0) + seconds


def msg(i: int, topic: str, order_key: str | None = None) -> Message:
    return Message(i, topic, "k", "{}", [], "order", f"a{i}", "E", order_key=order_key)


def limited(inner: SimplePublisher, rate: float, burst: int, topic: str = "slow") -> RateLimitedPublisher:
    publisher = with_rate_limits(inner, RateLimits([LimitRule("topic", topic, rate, burst)], now=time.monotonic()))
    assert isinstance(publisher, RateLimitedPublisher)
    return publisher


def test_limited_messages_are_paced_and_the_others_go_at_once():
    inner = Recording()
    publisher = limited(inner, rate=20.0, burst=2)
    waits = Waits()
    publisher.observer = waits
    assert inner.observer is waits and publisher.name == inner.name and publisher.pipelines == inner.pipelines
    batch = [msg(i, "slow" if i % 2 else "fast") for i in range(12)]  # 6 slow, 6 fast
    start = time.monotonic()
    outcomes = publisher.publish_batch(batch, timeout_seconds=8.0)
    assert outcomes == [None] * 12
    at = {message_id: when - start for when, message_id in inner.sent}
    assert all(at[i] < 0.1 for i in range(0, 12, 2))  # unlimited: not held
    slow = sorted(at[i] for i in range(1, 12, 2))
    # burst of 2, then one every 50 ms: the sixth goes 4 intervals after the start
    assert slow[1] < 0.1 and slow[5] == pytest.approx(0.2, abs=0.08)
    assert waits.seconds["topic:slow"] == pytest.approx(0.05 + 0.10 + 0.15 + 0.20, abs=0.01)


def test_messages_beyond_the_batch_wait_are_deferred_and_so_is_the_rest_of_their_run():
    inner = Recording()
    publisher = limited(inner, rate=10.0, burst=1)
    batch = [msg(i, "slow") for i in range(30)] + [msg(100, "slow", "agg"), msg(101, "fast", "agg")]
    outcomes = publisher.publish_batch(batch, timeout_seconds=8.0)
    sent = {message_id for _, message_id in inner.sent}
    booked = 1 + int(RATE_LIMIT_MAX_WAIT_SECONDS * 10)  # the burst, then what fits in the wait
    assert sent == set(range(booked))
    deferred = [o for o in outcomes if isinstance(o, Defer)]
    assert len(deferred) == 32 - booked
    assert all("rate limit of topic:slow" in o.reason for o in deferred)
    delays = [o.delay for o in outcomes[booked:30]]
    assert delays == sorted(delays) and delays[0] > 0  # staggered, so they come back one by one
    # the fast message of an ordered run waits with its deferred predecessor
    assert isinstance(outcomes[31], Defer) and 101 not in sent


def test_a_throttled_answer_with_retry_after_pauses_the_bucket():
    inner = Recording({"slow": RetryableError("HTTP 429: slow down", retry_after_seconds=30, throttled=True)})
    publisher = limited(inner, rate=100.0, burst=5)
    first = publisher.publish_batch([msg(1, "slow")], timeout_seconds=8.0)
    assert isinstance(first[0], RetryableError) and first[0].throttled
    second = publisher.publish_batch([msg(2, "slow"), msg(3, "fast")], timeout_seconds=8.0)
    assert isinstance(second[0], Defer) and second[1] is None
    assert [message_id for _, message_id in inner.sent] == [1, 3]


def test_abort_releases_messages_still_waiting_for_a_token():
    inner = Recording()
    publisher = limited(inner, rate=2.0, burst=1)
    timer = threading.Timer(0.2, publisher.abort)
    timer.start()
    outcomes = publisher.publish_batch([msg(1, "slow"), msg(2, "slow"), msg(3, "slow")], timeout_seconds=20.0)
    timer.join()
    assert outcomes[0] is None
    assert all(isinstance(o, NotDelivered) and "shutting down" in o.reason for o in outcomes[1:])


def test_load_publisher_wraps_only_when_limits_are_configured(tmp_path):
    plain = load_settings(None, relay={"publisher": "http"}, http={"url_template": "http://127.0.0.1:9/e"})
    with_limits = load_settings(
        None,
        relay={"publisher": "http"},
        http={"url_template": "http://127.0.0.1:9/e"},
        limits=[{"host": "127.0.0.1", "rate_per_second": 5}],
    )
    unwrapped, wrapped = load_publisher(plain), load_publisher(with_limits)
    try:
        assert not isinstance(unwrapped, RateLimitedPublisher)
        assert isinstance(wrapped, RateLimitedPublisher) and wrapped.can_probe and wrapped.name == "http"
        assert wrapped.limit_keys(msg(1, "t")) == {"topic": "t", "host": "127.0.0.1"}
    finally:
        unwrapped.close()
        wrapped.close()
