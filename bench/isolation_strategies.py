"""How to find the bad messages of a refused record batch: four strategies side by side.

On the embedded tansu broker validating a topic against a JSON schema, ``--messages``
messages (``--bad`` of them violating the schema) are judged with each strategy, in
one run, on the same broker; printed: seconds to the last verdict, produce requests
sent, and whether every verdict was right (bad ones refused, good ones accepted):

- ``singles``: one message per record batch (``batch.num.messages=1``, ``linger.ms=0``),
  all produced at once, non-idempotent, acks=all: what ``kafka_isolation`` does;
- ``singles-idempotent``: the same with ``enable.idempotence=true``: after the first
  refusal librdkafka bumps the producer epoch, which tansu 0.6 cannot do (no KIP-360)
  and fences the producer: the later good messages get PRODUCER_FENCED;
- ``one-at-a-time``: produce one message, wait for its report, then the next;
- ``bisect``: produce the set as one batch (``linger.ms`` high, flush); if refused,
  split it in halves and try each half, down to single messages.

    .venv/bin/python bench/isolation_strategies.py --messages 1000 --bad 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import emit, say
from confluent_kafka import KafkaError, Producer

from outbox_relay._embedded.embedded import EmbeddedBroker

SCHEMA = {
    "type": "object",
    "properties": {"value": {"type": "object", "properties": {"amount": {"type": "integer"}}, "required": ["amount"]}},
}


class Verdicts:
    def __init__(self) -> None:
        self.errors: dict[int, KafkaError | None] = {}
        self.requests = 0

    def callback(self, index: int) -> Callable[[KafkaError | None, Any], None]:
        def on_delivery(err: KafkaError | None, _msg: Any) -> None:
            self.errors[index] = err

        return on_delivery


def _producer(bootstrap: str, **overrides: Any) -> Producer:
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "acks": "all",
        "log_level": 0,
        "enable.idempotence": False,
        "linger.ms": 0,
        "batch.num.messages": 1,
        "max.in.flight.requests.per.connection": 5,
        "message.timeout.ms": 20_000,
    }
    conf.update(overrides)
    producer = Producer(conf)
    producer.list_topics(timeout=10)  # connect before the clock starts
    return producer


def singles(bootstrap: str, topic: str, values: Sequence[bytes], idempotent: bool = False) -> Verdicts:
    verdicts = Verdicts()
    producer = _producer(bootstrap, **({"enable.idempotence": True} if idempotent else {}))
    for i, value in enumerate(values):
        producer.produce(topic, value=value, key=b"k", on_delivery=verdicts.callback(i))
        verdicts.requests += 1
    producer.flush(60)
    return verdicts


def one_at_a_time(bootstrap: str, topic: str, values: Sequence[bytes]) -> Verdicts:
    verdicts = Verdicts()
    producer = _producer(bootstrap)
    for i, value in enumerate(values):
        producer.produce(topic, value=value, key=b"k", on_delivery=verdicts.callback(i))
        verdicts.requests += 1
        producer.flush(20)
    return verdicts


def bisect(bootstrap: str, topic: str, values: Sequence[bytes]) -> Verdicts:
    verdicts = Verdicts()
    producer = _producer(bootstrap, **{"linger.ms": 1000, "batch.num.messages": 100_000})
    todo: list[list[int]] = [list(range(len(values)))]
    while todo:
        group = todo.pop()
        round_errors: dict[int, KafkaError | None] = {}

        def record(index: int, errors: dict[int, KafkaError | None]) -> Callable[[KafkaError | None, Any], None]:
            return lambda error, _msg: errors.__setitem__(index, error)

        for i in group:
            producer.produce(topic, value=values[i], key=b"k", on_delivery=record(i, round_errors))
        verdicts.requests += 1  # one key, one partition: one record batch per round
        producer.flush(20)
        if all(err is None for err in round_errors.values()) or len(group) == 1:
            verdicts.errors.update(round_errors)
        else:
            half = len(group) // 2
            todo += [group[half:], group[:half]]
    return verdicts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--bad", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    step = args.messages / max(1, args.bad)
    bad = {int(step * k + step / 2) for k in range(args.bad)}
    values = [json.dumps({"amount": "x" if i in bad else i}).encode() for i in range(args.messages)]
    strategies: dict[str, Callable[[str, str, Sequence[bytes]], Verdicts]] = {
        "singles": singles,
        "singles-idempotent": lambda b, t, v: singles(b, t, v, idempotent=True),
        "one-at-a-time": one_at_a_time,
        "bisect": bisect,
    }
    report: dict[str, Any] = {"messages": args.messages, "bad": len(bad), "strategies": {}}
    with tempfile.TemporaryDirectory(prefix="outbox-relay-strategies-") as tmp:
        schema_dir = Path(tmp) / "schema"
        schema_dir.mkdir()
        for name in strategies:
            (schema_dir / f"strategy-{name}.json").write_text(json.dumps(SCHEMA))
        say("starting the embedded tansu broker with a schema registry ...")
        with EmbeddedBroker(log_file=Path(tmp) / "broker.log", schema_dir=schema_dir) as broker:
            for name, strategy in strategies.items():
                say(f"{name} ...")
                started = time.monotonic()
                verdicts = strategy(broker.bootstrap_servers, f"strategy-{name}", values)
                seconds = time.monotonic() - started
                wrong = sum(
                    1
                    for i in range(args.messages)
                    if (verdicts.errors.get(i, KafkaError(KafkaError._MSG_TIMED_OUT)) is None) == (i in bad)
                )
                codes: dict[str, int] = {}
                for err in verdicts.errors.values():
                    if err is not None:
                        codes[err.name()] = codes.get(err.name(), 0) + 1
                report["strategies"][name] = {
                    "seconds": round(seconds, 3),
                    "requests": verdicts.requests,
                    "wrong_verdicts": wrong,
                    "errors": codes,
                }
    lines = [
        f"{args.messages} messages, {len(bad)} violate the schema (tansu, one partition)",
        f"{'strategy':<20} {'seconds':>8} {'requests':>9} {'wrong':>6}  errors",
    ]
    for name, r in report["strategies"].items():
        lines.append(f"{name:<20} {r['seconds']:8.3f} {r['requests']:9d} {r['wrong_verdicts']:6d}  {r['errors']}")
    emit(report, lines, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
