"""Plug-in publishers loaded by reference (``relay.publisher = "tests.helpers.custom_publisher:make"``).

- ``make(settings)`` -> a ``SimplePublisher`` subclass recording every message in
  ``RECEIVED``; rows of event type ``Poison`` are refused permanently and rows of
  event type ``NotYet`` are deferred, so the plug-in's outcomes are visible too.
- ``make_plain(settings)`` -> an object with only ``publish(message)`` (no base class),
  which the relay wraps itself.
- ``not_a_publisher(settings)`` -> an object with neither ``publish`` nor ``publish_batch``.
"""

from __future__ import annotations

import threading
from typing import Any

from outbox_relay.publisher import Defer, Message, PermanentError, SimplePublisher

RECEIVED: list[Message] = []
SETTINGS_SEEN: list[Any] = []
_LOCK = threading.Lock()


def reset() -> None:
    with _LOCK:
        RECEIVED.clear()
        SETTINGS_SEEN.clear()


class RecordingPublisher(SimplePublisher):
    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.closed = False

    def publish(self, message: Message) -> None:
        if message.event_type == "Poison":
            raise PermanentError("custom publisher refuses poison")
        if message.event_type == "NotYet":
            raise Defer(3600, "custom publisher says not yet")
        with _LOCK:
            RECEIVED.append(message)

    def close(self) -> None:
        self.closed = True


def make(settings: Any) -> RecordingPublisher:
    with _LOCK:
        SETTINGS_SEEN.append(settings)
    return RecordingPublisher(settings)


class PlainPublisher:
    def publish(self, message: Message) -> None:
        with _LOCK:
            RECEIVED.append(message)


def make_plain(settings: Any) -> PlainPublisher:
    return PlainPublisher()


def not_a_publisher(settings: Any) -> object:
    return object()
