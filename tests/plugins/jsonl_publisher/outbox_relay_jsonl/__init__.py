"""An example publisher plug-in: every message becomes one JSON line in a file.

The file is ``$OUTBOX_RELAY_JSONL_PATH``; each line holds the message id, topic, key,
headers and the payload. Writes are flushed and fsynced before the batch reports
success, so a row is ``done`` only once its line is on disk.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import IO, Any

from outbox_relay import Message, Publisher
from outbox_relay.publisher import Outcome, PermanentError


class JsonLinesPublisher(Publisher):
    name = "jsonl"

    def __init__(self, settings: Any) -> None:
        self.path = os.environ["OUTBOX_RELAY_JSONL_PATH"]
        self._file: IO[str] | None = None
        self._lock = threading.Lock()

    def describe_target(self) -> str:
        return f"the file {self.path}"

    def start(self) -> None:
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def publish_batch(
        self, messages: Sequence[Message], *, timeout_seconds: float, cancel: threading.Event | None = None
    ) -> list[Outcome]:
        assert self._file is not None, "start() first"
        outcomes: list[Outcome] = []
        with self._lock:
            for message in messages:
                if message.event_type == "Unwritable":
                    outcomes.append(PermanentError("the jsonl plug-in refuses Unwritable events"))
                    continue
                self._file.write(
                    json.dumps(
                        {
                            "id": message.id,
                            "topic": message.topic,
                            "key": message.key,
                            "headers": dict(message.headers),
                            "payload": json.loads(message.value),
                        }
                    )
                    + "\n"
                )
                outcomes.append(None)
            self._file.flush()
            os.fsync(self._file.fileno())
        return outcomes

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
