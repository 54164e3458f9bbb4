"""Signed webhooks (Standard Webhooks) through the real claim -> publish -> finalize
path, received by the suite's real HTTP server and verified with the reference
library (standardwebhooks), not with the relay's own code."""

from __future__ import annotations

import base64
import secrets
import time

import psycopg
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from outbox_relay import enqueue
from outbox_relay.observability.metrics import RelayMetrics
from outbox_relay.publishers.http import HttpPublisher
from outbox_relay.runtime.worker import Worker, WorkerConfig
from tests.helpers.cli import ROOT, cli, cli_env
from tests.helpers.db import insert_rows
from tests.helpers.http_target import HttpTarget, Recorded, Step

pytestmark = pytest.mark.first_pass_only


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


@pytest.fixture
def target():
    with HttpTarget() as t:
        yield t


def signed_settings(make_settings, target: HttpTarget, **http):
    return make_settings(
        relay={"publisher": "http", "backoff_base_seconds": 0.05, "backoff_cap_seconds": 0.2},
        http={"url_template": f"{target.base_url}/hooks/{{event_type}}", **http},
    )


def worker_for(settings, store, publisher) -> Worker:
    return Worker(0, store, publisher, WorkerConfig.from_settings(settings, publisher, owner="test"), RelayMetrics())


def verified(secret: str, request: Recorded) -> object:
    """The payload if the request's signature verifies with ``secret`` (raises otherwise)."""
    return Webhook(secret).verify(request.body, request.headers)


def test_every_request_is_signed_and_verifies_with_the_reference_library(
    make_settings, store, pg_dsn, table, target, tmp_path
):
    secret = new_secret()
    secret_file = tmp_path / "webhook-secret"
    secret_file.write_text(secret + "\n")
    settings = signed_settings(make_settings, target, signing_secret_files=[str(secret_file)])
    with psycopg.connect(pg_dsn) as conn, conn.transaction():
        special = int(
            enqueue(
                conn,
                aggregate_type="order",
                aggregate_id="a-1",
                event_type="OrderPaid",
                payload={"amount": 12, "note": "ü ✓", "nested": {"x": [1, 2]}},
                table=table,
            )
        )
    rows = [special, *insert_rows(pg_dsn, table, 20, event_type="OrderCreated")]
    publisher = HttpPublisher.from_settings(settings)
    try:
        before = int(time.time())
        assert worker_for(settings, store, publisher).run_once().done == len(rows)
        after = int(time.time())
    finally:
        publisher.close()

    for row in rows:
        [request] = target.requests_for(row)
        assert request.headers["webhook-id"] == str(row) == request.headers["x-outbox-message-id"]
        assert before <= int(request.headers["webhook-timestamp"]) <= after
        assert len(request.headers["webhook-signature"].split(" ")) == 1
        payload = verified(secret, request)
        if row == special:
            assert payload == {"amount": 12, "note": "ü ✓", "nested": {"x": [1, 2]}}
        with pytest.raises(WebhookVerificationError):
            verified(new_secret(), request)


def test_rotation_two_secrets_two_signatures_both_valid(make_settings, store, pg_dsn, table, target, tmp_path):
    current, previous = new_secret(), new_secret()
    (tmp_path / "current").write_text(current)
    env_name = "OUTBOX_TEST_PREVIOUS_WEBHOOK_SECRET"
    settings = signed_settings(
        make_settings, target, signing_secret_files=[str(tmp_path / "current")], signing_secrets_env=env_name
    )
    rows = insert_rows(pg_dsn, table, 5, event_type="OrderCreated")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(env_name, previous)
        publisher = HttpPublisher.from_settings(settings)
    try:
        assert worker_for(settings, store, publisher).run_once().done == len(rows)
    finally:
        publisher.close()
    for row in rows:
        [request] = target.requests_for(row)
        signatures = request.headers["webhook-signature"].split(" ")
        assert len(signatures) == 2
        # each signature on its own verifies with its own secret, and only with it
        for signature, secret, other in [(signatures[0], current, previous), (signatures[1], previous, current)]:
            alone = {**request.headers, "webhook-signature": signature}
            Webhook(secret).verify(request.body, alone)
            with pytest.raises(WebhookVerificationError):
                Webhook(other).verify(request.body, alone)
        # a receiver that knows either secret accepts the request as sent
        verified(current, request)
        verified(previous, request)


def test_retry_keeps_the_webhook_id_and_signs_each_attempt(make_settings, store, pg_dsn, table, target, tmp_path):
    secret = new_secret()
    (tmp_path / "k").write_text(secret)
    settings = signed_settings(make_settings, target, signing_secret_files=[str(tmp_path / "k")])
    [row] = insert_rows(pg_dsn, table, 1, event_type="Flaky")
    target.script_id(row, Step(503), Step(200))
    publisher = HttpPublisher.from_settings(settings)
    try:
        worker = worker_for(settings, store, publisher)
        assert worker.run_once().retried == 1
        time.sleep(1.1)  # the next attempt is sent in a later second: its own timestamp
        assert worker.run_once().done == 1
    finally:
        publisher.close()
    first, second = target.requests_for(row)
    assert first.headers["webhook-id"] == second.headers["webhook-id"] == str(row)
    assert int(second.headers["webhook-timestamp"]) > int(first.headers["webhook-timestamp"])
    assert first.headers["webhook-signature"] != second.headers["webhook-signature"]
    verified(secret, first)
    verified(secret, second)


@pytest.mark.parametrize("problem", ["missing", "directory", "malformed"])
def test_unusable_secret_file_is_a_one_line_startup_error_without_its_content(pg_dsn, table, tmp_path, problem):
    secret = new_secret()
    path = tmp_path / "webhook-secret"
    expected = {
        "missing": "does not exist",
        "directory": "cannot be read",
        "malformed": "must start with whsec_",
    }[problem]
    if problem == "directory":
        path.mkdir()
    elif problem == "malformed":
        path.write_text(secret.removeprefix("whsec_") + "\n")
    env = cli_env(
        pg_dsn,
        table,
        OUTBOX_RELAY_RELAY__PUBLISHER="http",
        OUTBOX_RELAY_METRICS__ENABLED="false",
        OUTBOX_RELAY_HTTP__URL_TEMPLATE="http://127.0.0.1:1/e/{event_type}",
        OUTBOX_RELAY_HTTP__SIGNING_SECRET_FILES=f'["{path}"]',
        PYTHONPATH=str(ROOT),
    )
    proc = cli("run", env=env, timeout=60)
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("outbox-relay: error: http.signing_secret_files: ")
    assert str(path) in lines[0] and expected in lines[0], lines[0]
    assert secret.removeprefix("whsec_")[:12] not in proc.stderr + proc.stdout
