"""relay.finalize_synchronous_commit: a claim always commits durably (a claim lost in a
server crash could hand its fencing token out again), a finalize does not wait for its
WAL flush unless the setting is "on". Seen from inside the server: a trigger on the
outbox records the synchronous_commit in force in each transaction that changes a row's
status, as the relay's own claims and finalizes run it."""

from __future__ import annotations

import pytest

from outbox_relay.runtime.relay import Relay
from tests.helpers.db import insert_rows, run_sql, statuses, wait_for

ROWS = 12


def _record_commit_modes(pg_dsn: str, table: str) -> str:
    """A side table and a trigger: one row per status change, with the transaction's
    synchronous_commit. Returns the side table's name."""
    schema = table.split(".")[0]
    log = f"{schema}.commit_modes"
    run_sql(pg_dsn, log, "CREATE TABLE {t} (id bigint, status text, synchronous_commit text)")
    run_sql(
        pg_dsn,
        table,
        f"""CREATE FUNCTION "{schema}".record_commit_mode() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO "{schema}".commit_modes VALUES (NEW.id, NEW.status, current_setting('synchronous_commit'));
                RETURN NEW;
            END $$""",
    )
    run_sql(
        pg_dsn,
        table,
        f"""CREATE TRIGGER record_commit_mode AFTER UPDATE OF status ON {{t}}
            FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
            EXECUTE FUNCTION "{schema}".record_commit_mode()""",
    )
    return log


@pytest.mark.parametrize(("setting", "finalize_mode"), [(None, "off"), ("on", "on")])
def test_claims_commit_durably_and_finalizes_follow_the_setting(
    make_settings, store, pg_dsn, table, setting, finalize_mode
):
    log = _record_commit_modes(pg_dsn, table)
    insert_rows(pg_dsn, table, ROWS, aggregates=3)
    relay_settings = {} if setting is None else {"finalize_synchronous_commit": setting}
    relay = Relay(make_settings(relay=relay_settings))  # None: the default
    relay.start()
    try:
        wait_for(lambda: statuses(pg_dsn, table) == {"done": ROWS}, timeout=60, message="every row delivered")
    finally:
        relay.stop()
    seen = run_sql(pg_dsn, log, "SELECT status, synchronous_commit, count(*) FROM {t} GROUP BY 1, 2 ORDER BY 1, 2")
    modes = {(status, mode): int(n) for status, mode, n in seen}
    # Every row was claimed (durably) and finalized once, in the mode the setting names.
    assert modes == {("processing", "on"): ROWS, ("done", finalize_mode): ROWS}
