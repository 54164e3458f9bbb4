"""A third-party publisher installed as a package (entry point group
``outbox_relay.publishers``) runs end to end: `pip install` puts it in a directory of
its own, and a real `outbox-relay run` subprocess selects it by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import ROOT, cli, cli_env
from tests.helpers.db import insert_rows, rows, statuses, wait_for

# Exercises the broker, processes or external tools rather than PostgreSQL's SQL:
# ./dev runs it on the first pass only (see pyproject.toml markers).
pytestmark = pytest.mark.first_pass_only

PLUGIN = ROOT / "tests" / "plugins" / "jsonl_publisher"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("plugin-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(PLUGIN)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert list(site.glob("outbox_relay_jsonl-*.dist-info"))  # installed as a distribution
    return site


def test_entry_point_plugin_drains_rows_end_to_end(pg_dsn, table, store, plugin_site, tmp_path):
    out = tmp_path / "events.jsonl"
    ids = insert_rows(pg_dsn, table, 60)
    bad = insert_rows(pg_dsn, table, 1, event_type="Unwritable")
    env = cli_env(
        pg_dsn,
        table,
        OUTBOX_RELAY_RELAY__PUBLISHER="jsonl",
        OUTBOX_RELAY_RELAY__WORKERS="2",
        OUTBOX_RELAY_METRICS__ENABLED="false",
        OUTBOX_RELAY_JSONL_PATH=str(out),
        PYTHONPATH=os.pathsep.join([str(plugin_site), str(ROOT)]),
    )
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_RELAY_")} | env
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox_relay.operator.cli", "run"],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: statuses(pg_dsn, table) == {"done": 60, "dead": 1} or proc.poll() is not None,
            timeout=60,
            message="rows drained by the plug-in",
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert statuses(pg_dsn, table) == {"done": 60, "dead": 1}
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["id"] for line in lines) == ids  # each row once
    first = next(line for line in lines if line["id"] == ids[0])
    assert first["payload"] == {"seq": 0} and first["headers"]["message_id"] == str(ids[0])
    [dead] = [r for r in rows(pg_dsn, table) if r[0] == bad[0]]
    assert dead[1] == "dead" and "refuses Unwritable" in dead[4]
    started = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any(e.get("event") == "relay started" and e.get("publisher") == "jsonl" for e in started)


def test_unknown_plugin_name_exits_2_naming_it(pg_dsn, table, store):
    result = cli(
        "run",
        env=cli_env(
            pg_dsn, table, OUTBOX_RELAY_RELAY__PUBLISHER="no-such-plugin", OUTBOX_RELAY_METRICS__ENABLED="false"
        ),
    )
    assert result.returncode == 2
    [line] = [x for x in result.stderr.splitlines() if x.strip()]
    assert "'no-such-plugin'" in line and "outbox_relay.publishers" in line
