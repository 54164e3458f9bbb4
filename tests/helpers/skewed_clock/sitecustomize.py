"""A Python process whose wall clock is off: on PYTHONPATH, Python imports this at
start-up and, when ``SKEWED_CLOCK_OFFSET_SECONDS`` is set, shifts
``time.time()`` and ``time.time_ns()`` by that many seconds (monotonic clocks untouched,
as on a host whose clock is wrong).

Why not libfaketime for a relay: it fakes the clock under librdkafka too, whose timed
waits then disagree with the kernel's (a producer under ``faketime +1h`` never gets
its metadata; Python's ``time.sleep`` fails with EINVAL under an offset). The relay's
own decisions are made in Python and SQL, so this is where a skew would show; the
one-shot CLI commands, which run no librdkafka, are tested under real ``faketime``.
"""

from __future__ import annotations

import os
import time

_offset_seconds = float(os.environ.get("SKEWED_CLOCK_OFFSET_SECONDS") or 0)
if _offset_seconds:
    _real_time, _real_time_ns = time.time, time.time_ns
    _offset_ns = int(_offset_seconds * 1_000_000_000)

    def _skewed_time() -> float:
        return _real_time() + _offset_seconds

    def _skewed_time_ns() -> int:
        return _real_time_ns() + _offset_ns

    time.time = _skewed_time
    time.time_ns = _skewed_time_ns
