"""Authentication and authorization on the broker itself (Apache Kafka, not a proxy).

One broker for the module: its client listener is SASL_SSL (TLS with a throwaway
CA's certificate, then a SCRAM-SHA-512 login), the user created when its storage was
formatted (``kafka-storage format --add-scram``, Kafka's own tool), ACLs by
``kafka-acls`` (``org.apache.kafka.tools.AclCommand``) and enforced by KRaft's
``StandardAuthorizer``. The tests administer it through its internal plaintext
listener (a super user).

- the relay delivers over TLS + SCRAM, and what it wrote is read back;
- a wrong password, or a broker certificate from another CA, fails ``run`` at start-up
  with exit 1 and one error line, and no password anywhere in the output;
- an ACL denying writes to one topic (TOPIC_AUTHORIZATION_FAILED): that topic's rows
  wait (never ``dead``, attempts refunded), ``/readyz`` and
  ``outbox_relay_topic_authorization_failures_total`` name the topic, the other
  topic's rows are delivered, and once the ACL is fixed the waiting rows are delivered.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from outbox_relay.embedded import read_messages
from outbox_relay.embedded_kafka import KafkaBroker, run_tool
from outbox_relay.relay import Relay
from tests.helpers.certs import TestCA
from tests.helpers.cli import cli, cli_env
from tests.helpers.db import insert_rows, rows, statuses, wait_for
from tests.kafka.conftest import sample

pytestmark = [pytest.mark.first_pass_only, pytest.mark.timeout(300)]

USER = "outbox-relay"
PASSWORD = "scram-Pa55word-" + uuid.uuid4().hex[:8]


@dataclass
class SecureBroker:
    node: KafkaBroker
    ca: TestCA
    other_ca: TestCA

    def acl(self, *args: str) -> None:
        """kafka-acls against the internal (super user) listener."""
        run_tool("org.apache.kafka.tools.AclCommand",
                 ["--bootstrap-server", self.node.internal_bootstrap_servers, *args])

    def kafka_settings(self, *, password: str = PASSWORD, ca: Path | None = None) -> dict[str, Any]:
        return {"bootstrap_servers": self.node.bootstrap_servers, "security_protocol": "sasl_ssl",
                "ssl_ca_location": str(ca or self.ca.cert_path), "sasl_mechanism": "SCRAM-SHA-512",
                "sasl_username": USER, "sasl_password": password}


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    certs = tmp_path_factory.mktemp("kafka-certs")
    ca, other_ca = TestCA(certs, "kafka"), TestCA(certs, "other")
    # Unencrypted key: Java 17 cannot read a PBES2-encrypted PKCS#8 key (what OpenSSL and
    # cryptography write): "PBES2 SecretKeyFactory not available". The file is mode 0600.
    server = ca.issue("localhost", file_stem="broker")
    # A PEM key store is one file: the PKCS#8 key, then the certificate chain.
    keystore = certs / "broker-keystore.pem"
    keystore.write_bytes(server.key_path.read_bytes() + server.cert_path.read_bytes())
    keystore.chmod(0o600)
    node = KafkaBroker(
        log_file=certs / "broker.log", client_protocol="SASL_SSL", scram_users={USER: PASSWORD},
        properties={
            "listener.name.client.ssl.keystore.type": "PEM",
            "listener.name.client.ssl.keystore.location": str(keystore),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            # The internal and controller listeners are plaintext: their principal.
            "super.users": "User:ANONYMOUS",
            "allow.everyone.if.no.acl.found": "false",
        })
    node.start()
    secure = SecureBroker(node, ca, other_ca)
    try:
        secure.acl("--add", "--allow-principal", f"User:{USER}", "--operation", "Write", "--operation", "Describe",
                   "--topic", "*")
        yield secure
    finally:
        node.kill()
        node.remove()


def _error_lines(result: Any) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("outbox-relay: error:")]


def test_relay_delivers_over_tls_and_scram(secure_broker, make_settings, store, pg_dsn, table, topic_prefix):
    topic = f"{topic_prefix}.order"
    secure_broker.node.create_topic(topic, partitions=2)
    settings = make_settings(kafka={**secure_broker.kafka_settings(), "topic_template": topic})
    ids = insert_rows(pg_dsn, table, 50)
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: statuses(pg_dsn, table) == {"done": 50}, timeout=90, message="rows over TLS + SCRAM")
    finally:
        relay.stop()
    read = read_messages(secure_broker.node.internal_bootstrap_servers, [topic], expected=50, timeout=60,
                         partitions=2)
    assert {int(m["headers"]["message_id"]) for m in read} == set(ids)


@pytest.mark.parametrize("mistake", ["wrong password", "another CA"])
def test_login_or_certificate_mistake_fails_at_start_without_the_password(secure_broker, store, pg_dsn, table,
                                                                          mistake):
    wrong = "not-" + PASSWORD
    kafka = secure_broker.kafka_settings(password=wrong) if mistake == "wrong password" else \
        secure_broker.kafka_settings(ca=secure_broker.other_ca.cert_path)
    env = cli_env(pg_dsn, table, kafka.pop("bootstrap_servers"),
                  OUTBOX_RELAY_DATABASE__CONNECT_TIMEOUT_SECONDS="1",
                  **{f"OUTBOX_RELAY_KAFKA__{key.upper()}": str(value) for key, value in kafka.items()})
    result = cli("run", env=env, timeout=90)
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    lines = _error_lines(result)
    assert len(lines) == 1 and result.stderr.strip().splitlines()[-1] == lines[0], lines
    assert "Kafka cluster" in lines[0], lines[0]
    expected = "SASL authentication" if mistake == "wrong password" else "certificate"
    assert expected in lines[0], lines[0]
    for secret in (PASSWORD, wrong):
        assert secret not in result.stdout + result.stderr
    print(f"\n[kafka] {mistake}: {lines[0]}")


def test_acl_denying_one_topic_holds_its_rows_back_without_killing_them(secure_broker, make_settings, store,
                                                                        pg_dsn, table, topic_prefix,
                                                                        record_property):
    allowed, forbidden = f"{topic_prefix}.allowed", f"{topic_prefix}.forbidden"
    for topic in (allowed, forbidden):
        secure_broker.node.create_topic(topic, partitions=1)
    deny = ["--deny-principal", f"User:{USER}", "--operation", "Write", "--topic", forbidden]
    secure_broker.acl("--add", *deny)
    settings = make_settings(kafka={**secure_broker.kafka_settings(),
                                    "topic_template": topic_prefix + ".{aggregate_type}"},
                             relay={"workers": 2, "max_attempts": 2})
    good = insert_rows(pg_dsn, table, 30, aggregate_type="allowed")
    held = insert_rows(pg_dsn, table, 10, aggregate_type="forbidden")
    relay = Relay(settings)
    relay.start()
    try:
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 30, timeout=90, message="the allowed topic's rows")
        wait_for(lambda: sample(relay, "outbox_relay_topic_authorization_failures_total", {"topic": forbidden}) > 0,
                 timeout=60, message="the refusal counted")
        ready, why = relay.readiness()
        assert not ready and forbidden in why and "TOPIC_AUTHORIZATION_FAILED" in why, why
        # More deferrals than max_attempts would allow retries: still not dead.
        time.sleep(20)
        by_id = {r[0]: r for r in rows(pg_dsn, table)}
        for i in held:
            assert by_id[i][1] == "pending" and by_id[i][2] == 0, by_id[i]
            assert "TOPIC_AUTHORIZATION_FAILED" in by_id[i][4], by_id[i][4]
        fixed_at = time.monotonic()
        secure_broker.acl("--remove", "--force", *deny)
        wait_for(lambda: statuses(pg_dsn, table).get("done") == 40, timeout=120, message="held rows after the fix")
        record_property("seconds_from_acl_fixed_to_delivered", round(time.monotonic() - fixed_at, 1))
        wait_for(lambda: relay.readiness()[0], timeout=60, message="ready again")
    finally:
        relay.stop()
    assert sample(relay, "outbox_relay_published_total", {"outcome": "dead"}) == 0
    for topic, ids in ((allowed, good), (forbidden, held)):
        read = read_messages(secure_broker.node.internal_bootstrap_servers, [topic], expected=len(ids), timeout=60,
                             partitions=1)
        assert {int(m["headers"]["message_id"]) for m in read} == set(ids)
