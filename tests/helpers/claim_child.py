"""Child process for the SIGKILL test (a killed claimer's rows come back after its lease):
claim one row, report it, then hang.

Usage: python claim_child.py DSN TABLE

It claims exactly one row through ``OutboxStore.claim`` (autocommit pool connections;
the claim transaction commits before ``claim`` returns), prints the claim as one JSON
line on stdout, flushes, and then sleeps until it is killed. The parent only sends
SIGKILL after reading that line, so the kill hits abandoned *committed* work, not a
claim that would simply roll back.
"""

from __future__ import annotations

import json
import os
import sys
import time

from outbox_relay.db.store import OutboxStore


def main() -> None:
    dsn, table = sys.argv[1], sys.argv[2]
    store = OutboxStore(dsn, table, pool_size=1)
    store.open()
    result = store.claim(owner=f"child:{os.getpid()}", batch=1, lease_seconds=30, max_attempts=3)
    print(
        json.dumps([{"id": c.id, "lease_version": c.lease_version, "attempts": c.attempts} for c in result.rows]),
        flush=True,
    )
    while True:  # never finalizes: the parent kills us here
        time.sleep(60)


if __name__ == "__main__":
    main()
