"""Encrypted and authenticated connections, with certificates made by the test.

Database: a PostgreSQL 15 server of the test's own with ``ssl = on`` and a certificate
signed by a throwaway CA; TCP connections without TLS are rejected (pg_hba) and the
relay's role logs in with a SCRAM password. The relay on ``sslmode=verify-full`` +
``sslrootcert`` migrates and drains over TLS (checked in ``pg_stat_ssl``); a CA that
did not sign the server's certificate, or a wrong password, fails at start-up with
exit 1 and one error line naming the database, never the password.

Broker: tansu 0.6 does not serve TLS (``--cert``/``--key`` are parsed, the acceptor is
never used) and its only storage engine in this build keeps no SCRAM credentials, so
every SASL login is refused. So: mutual TLS is tested through a TLS-terminating proxy
in front of the broker (real handshakes; the client certificate's key is encrypted,
so ``kafka.ssl_key_password`` must reach librdkafka); a wrong CA, TLS against the plain
listener and a refused SASL login each fail at start-up with exit 1 and one error line
naming the Kafka cluster, never the password.
"""

from __future__ import annotations

import json
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from outbox_relay._embedded.embedded import EmbeddedBroker, free_port, read_messages
from tests.helpers.certs import TestCA
from tests.helpers.cli import cli, cli_env
from tests.helpers.db import insert_rows, statuses, wait_for
from tests.helpers.pg_cluster import PgServer, TempServers, chown_to_server_user, ssl_missing_reason
from tests.helpers.relay_process import RelayProcess, relay_env
from tests.helpers.tls_proxy import TlsProxy

DB_PASSWORD = "db-Pa55word-" + uuid.uuid4().hex[:8]
KEY_PASSWORD = "key-Pa55word-" + uuid.uuid4().hex[:8]
SASL_PASSWORD = "sasl-Pa55word-" + uuid.uuid4().hex[:8]
FAST_FAIL = {"OUTBOX_RELAY_DATABASE__CONNECT_TIMEOUT_SECONDS": "1"}


def error_lines(result: Any) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("outbox-relay: error:")]


def assert_fails_at_start(result: Any, *, side: str, secrets: tuple[str, ...]) -> str:
    """Exit 1; exactly one error line, the last one, naming ``side``; no secret anywhere."""
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    lines = error_lines(result)
    assert len(lines) == 1, lines
    assert result.stderr.strip().splitlines()[-1] == lines[0]
    assert side in lines[0], lines[0]
    for secret in secrets:
        assert secret not in result.stdout + result.stderr
    print("\nstart-up failure line:", lines[0])  # visible with pytest -s
    return lines[0]


# --- database ------------------------------------------------------------------------
@dataclass
class TlsDatabase:
    server: PgServer
    ca: TestCA
    other_ca: TestCA

    def dsn(self, *, password: str = DB_PASSWORD, rootcert: Path | None = None) -> str:
        return (
            f"host=127.0.0.1 port={self.server.port} dbname=postgres user=app password={password} "
            f"sslmode=verify-full sslrootcert={rootcert or self.ca.cert_path}"
        )


@pytest.fixture(scope="module")
def tls_database(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsDatabase]:
    missing = ssl_missing_reason()
    if missing:
        pytest.skip(missing)
    certs = tmp_path_factory.mktemp("pg-certs")
    ca, other_ca = TestCA(certs, "db"), TestCA(certs, "other")
    with TempServers() as servers:
        server = servers.server("tls")
        pair = ca.issue("postgres-server", ip_addresses=("127.0.0.1",), file_stem="server")
        server.initdb(
            hba=[
                "hostssl all postgres 127.0.0.1/32 trust",  # the test's own admin connections
                "hostssl all all 127.0.0.1/32 scram-sha-256",
                "host all all 127.0.0.1/32 reject",  # no plaintext TCP at all
            ]
        )
        tls_dir = server.home / "tls"
        tls_dir.mkdir()
        for source in (pair.cert_path, pair.key_path):
            target = tls_dir / source.name
            target.write_bytes(source.read_bytes())
            target.chmod(0o600)
            chown_to_server_user(target)
        chown_to_server_user(tls_dir)
        server.configure(
            {
                "ssl": "on",
                "ssl_cert_file": str(tls_dir / pair.cert_path.name),
                "ssl_key_file": str(tls_dir / pair.key_path.name),
            }
        )
        server.start()
        server.execute(f"CREATE ROLE app LOGIN PASSWORD '{DB_PASSWORD}'")
        server.execute("CREATE SCHEMA app AUTHORIZATION app")
        yield TlsDatabase(server, ca, other_ca)


@pytest.mark.timeout(120)
def test_relay_on_verify_full_migrates_and_drains_over_tls(
    tls_database: TlsDatabase, broker: Any, tmp_path: Path
) -> None:
    dsn = tls_database.dsn()
    topic_prefix = "tls" + uuid.uuid4().hex[:8]
    migrated = cli("migrate", env=cli_env(dsn, "app.outbox"))
    assert migrated.returncode == 0, migrated.stderr
    env = relay_env(
        OUTBOX_RELAY_DATABASE__DSN=dsn,
        OUTBOX_RELAY_DATABASE__TABLE="app.outbox",
        OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS=broker.bootstrap_servers,
        OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE=topic_prefix + ".{aggregate_type}",
        OUTBOX_RELAY_RELAY__POLL_INTERVAL_SECONDS="0.2",
    )
    relay = RelayProcess("relay-pg-tls", env, tmp_path)
    try:
        relay.wait_started()
        ids = insert_rows(dsn, "app.outbox", 30)
        wait_for(lambda: statuses(dsn, "app.outbox") == {"done": 30}, timeout=60, message="rows done over TLS")
        encrypted = tls_database.server.execute(
            "SELECT s.ssl, s.version FROM pg_stat_ssl AS s JOIN pg_stat_activity AS a USING (pid) "
            "WHERE a.application_name = 'outbox-relay' AND a.usename = 'app'"
        )
        assert encrypted and all(ssl for ssl, _version in encrypted), encrypted
        assert relay.terminate() == 0
    finally:
        relay.kill()
    assert DB_PASSWORD not in relay.output()
    delivered = read_messages(broker.bootstrap_servers, [f"{topic_prefix}.order"], expected=len(ids), timeout=30)
    assert {int(m["headers"]["message_id"]) for m in delivered} == set(ids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mistake", ["wrong CA", "wrong password"])
def test_database_certificate_or_password_mistake_fails_at_start(tls_database: TlsDatabase, mistake: str) -> None:
    wrong_password = "not-" + DB_PASSWORD
    if mistake == "wrong CA":
        dsn, expected = tls_database.dsn(rootcert=tls_database.other_ca.cert_path), "certificate verify failed"
    else:
        dsn, expected = tls_database.dsn(password=wrong_password), "password authentication failed"
    result = cli("run", env=cli_env(dsn, "app.outbox", "127.0.0.1:1", **FAST_FAIL), timeout=60)
    line = assert_fails_at_start(result, side="database", secrets=(DB_PASSWORD, wrong_password))
    assert expected in line


# --- broker --------------------------------------------------------------------------
@dataclass
class TlsBroker:
    proxy: TlsProxy
    ca: TestCA
    other_ca: TestCA
    client_cert: Path
    client_key: Path

    def client_config(self) -> dict[str, str]:
        return {
            "security.protocol": "ssl",
            "ssl.ca.location": str(self.ca.cert_path),
            "ssl.certificate.location": str(self.client_cert),
            "ssl.key.location": str(self.client_key),
            "ssl.key.password": KEY_PASSWORD,
        }


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsBroker]:
    """The broker behind a proxy that requires a client certificate (mutual TLS)."""
    certs = tmp_path_factory.mktemp("kafka-certs")
    ca, other_ca = TestCA(certs, "kafka"), TestCA(certs, "kafka-other")
    server = ca.issue("kafka-broker", ip_addresses=("127.0.0.1",), file_stem="broker")
    client = ca.issue("outbox-relay", client=True, key_password=KEY_PASSWORD, file_stem="relay-client")
    proxy_port = free_port()
    with (
        EmbeddedBroker(log_file=certs / "broker.log", advertised_port=proxy_port) as broker,
        TlsProxy(
            broker.port, cert=server.cert_path, key=server.key_path, client_ca=ca.cert_path, port=proxy_port
        ) as proxy,
    ):
        yield TlsBroker(proxy, ca, other_ca, client.cert_path, client.key_path)


def kafka_tls_env(tls: TlsBroker, *, ca: Path) -> dict[str, str]:
    return {
        "OUTBOX_RELAY_KAFKA__SECURITY_PROTOCOL": "ssl",
        "OUTBOX_RELAY_KAFKA__SSL_CA_LOCATION": str(ca),
        "OUTBOX_RELAY_KAFKA__SSL_CERTIFICATE_LOCATION": str(tls.client_cert),
        "OUTBOX_RELAY_KAFKA__SSL_KEY_LOCATION": str(tls.client_key),
        "OUTBOX_RELAY_KAFKA__SSL_KEY_PASSWORD": KEY_PASSWORD,
    }


@pytest.mark.timeout(120)
def test_relay_delivers_over_mutual_tls(
    pg_dsn: str, table: str, store: Any, tls_broker: TlsBroker, tmp_path: Path
) -> None:
    topic_prefix = "mtls" + uuid.uuid4().hex[:8]
    env = relay_env(
        **cli_env(
            pg_dsn,
            table,
            tls_broker.proxy.bootstrap_servers,
            OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE=topic_prefix + ".{aggregate_type}",
            OUTBOX_RELAY_RELAY__POLL_INTERVAL_SECONDS="0.2",
            **kafka_tls_env(tls_broker, ca=tls_broker.ca.cert_path),
        )
    )
    handshakes_before = tls_broker.proxy.connections
    relay = RelayProcess("relay-mtls", env, tmp_path)
    try:
        relay.wait_started()
        ids = insert_rows(pg_dsn, table, 30)
        wait_for(lambda: statuses(pg_dsn, table) == {"done": 30}, timeout=60, message="rows done over mutual TLS")
        assert relay.terminate() == 0
    finally:
        relay.kill()
    assert tls_broker.proxy.connections > handshakes_before
    assert KEY_PASSWORD not in relay.output()
    delivered = read_messages(
        tls_broker.proxy.bootstrap_servers,
        [f"{topic_prefix}.order"],
        expected=len(ids),
        timeout=30,
        client_config=tls_broker.client_config(),
    )
    assert {int(m["headers"]["message_id"]) for m in delivered} == set(ids)


@pytest.mark.timeout(120)
def test_broker_certificate_from_another_ca_fails_at_start(
    pg_dsn: str, table: str, store: Any, tls_broker: TlsBroker
) -> None:
    env = cli_env(
        pg_dsn,
        table,
        tls_broker.proxy.bootstrap_servers,
        **FAST_FAIL,
        **kafka_tls_env(tls_broker, ca=tls_broker.other_ca.cert_path),
    )
    result = cli("run", env=env, timeout=60)
    line = assert_fails_at_start(result, side="Kafka cluster", secrets=(KEY_PASSWORD,))
    assert "certificate verify failed" in line


def assert_names_the_tls_handshake(result: Any, line: str) -> None:
    """The error line, and the start-up wait's log lines before it, say the TLS handshake failed."""
    assert "the TLS handshake failed (kafka.security_protocol = ssl: is the listener plaintext?)" in line, line
    waits = [
        json.loads(text)
        for text in result.stderr.splitlines()
        if text.startswith("{") and "waiting for dependencies" in text
    ]
    assert waits and "the TLS handshake failed" in waits[-1]["target"], result.stderr[-2000:]


@pytest.mark.timeout(120)
def test_tls_against_a_plaintext_listener_fails_at_start(
    pg_dsn: str, table: str, store: Any, tls_broker: TlsBroker
) -> None:
    """tansu's plain listener never answers a TLS ClientHello (it waits for the rest of
    a 'frame'): a connection that never completes its handshake, which the relay waits
    for like a broker that is not up yet; relay.startup_timeout_seconds bounds the wait.
    librdkafka gives up on the handshake after socket.connection.setup.timeout.ms
    (30 s by default, 1 s here) and the wait names the TLS handshake from then on."""
    plain = f"127.0.0.1:{tls_broker.proxy.target_port}"
    env = cli_env(
        pg_dsn,
        table,
        plain,
        **FAST_FAIL,
        **kafka_tls_env(tls_broker, ca=tls_broker.ca.cert_path),
        OUTBOX_RELAY_KAFKA__EXTRA='{"socket.connection.setup.timeout.ms": "1000"}',
        OUTBOX_RELAY_RELAY__STARTUP_TIMEOUT_SECONDS="6",
    )
    result = cli("run", env=env, timeout=60)
    line = assert_fails_at_start(result, side="Kafka cluster", secrets=(KEY_PASSWORD,))
    assert plain in line
    assert_names_the_tls_handshake(result, line)
    assert f": ssl://{plain}/bootstrap: Connection setup timed out in state SSL_HANDSHAKE" in line  # librdkafka's words


@pytest.mark.timeout(120)
def test_tls_against_a_listener_that_hangs_up_fails_at_start(
    pg_dsn: str, table: str, store: Any, tls_broker: TlsBroker
) -> None:
    """Apache Kafka's plaintext listener reads a TLS ClientHello as an oversized request
    and closes the connection: librdkafka reports 'SSL handshake failed: Disconnected'
    at once, and the wait names the TLS handshake."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        stop = threading.Event()

        def hang_up() -> None:
            listener.settimeout(0.2)
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(2)
                    try:
                        conn.recv(4096)  # the ClientHello
                    except OSError:
                        pass

        server = threading.Thread(target=hang_up, daemon=True)
        server.start()
        plain = f"127.0.0.1:{listener.getsockname()[1]}"
        env = cli_env(
            pg_dsn,
            table,
            plain,
            **FAST_FAIL,
            **kafka_tls_env(tls_broker, ca=tls_broker.ca.cert_path),
            OUTBOX_RELAY_RELAY__STARTUP_TIMEOUT_SECONDS="6",
        )
        try:
            result = cli("run", env=env, timeout=60)
        finally:
            stop.set()
            server.join(timeout=5)
    line = assert_fails_at_start(result, side="Kafka cluster", secrets=(KEY_PASSWORD,))
    assert plain in line
    assert_names_the_tls_handshake(result, line)
    assert "SSL handshake failed: Disconnected" in line or "Disconnected: SSL connection closed by peer" in line


@pytest.mark.timeout(120)
def test_refused_sasl_login_fails_at_start_without_the_password(
    pg_dsn: str, table: str, store: Any, tmp_path: Path
) -> None:
    with EmbeddedBroker(log_file=tmp_path / "broker.log", authentication=True) as broker:
        env = cli_env(
            pg_dsn,
            table,
            broker.bootstrap_servers,
            **FAST_FAIL,
            OUTBOX_RELAY_KAFKA__SECURITY_PROTOCOL="sasl_plaintext",
            OUTBOX_RELAY_KAFKA__SASL_MECHANISM="SCRAM-SHA-512",
            OUTBOX_RELAY_KAFKA__SASL_USERNAME="outbox-relay",
            OUTBOX_RELAY_KAFKA__SASL_PASSWORD=SASL_PASSWORD,
        )
        result = cli("run", env=env, timeout=60)
    line = assert_fails_at_start(result, side="Kafka cluster", secrets=(SASL_PASSWORD,))
    assert "SASL authentication" in line


def test_tls_settings_reach_librdkafka(tmp_path: Path) -> None:
    """producer_config() maps every kafka.ssl_* setting; librdkafka itself loads the
    files (a file that is not a certificate is refused by the client at creation)."""
    from confluent_kafka import KafkaException, Producer

    from outbox_relay.config import load_settings
    from outbox_relay.publishers.kafka import producer_config

    ca = TestCA(tmp_path, "cfg")
    client = ca.issue("client", client=True, key_password=KEY_PASSWORD, file_stem="client")
    settings = load_settings(
        None,
        kafka={
            "security_protocol": "ssl",
            "ssl_ca_location": str(ca.cert_path),
            "ssl_certificate_location": str(client.cert_path),
            "ssl_key_location": str(client.key_path),
            "ssl_key_password": KEY_PASSWORD,
        },
    )
    conf = producer_config(settings)
    assert {k: conf[k] for k in conf if k.startswith("ssl.")} == {
        "ssl.ca.location": str(ca.cert_path),
        "ssl.certificate.location": str(client.cert_path),
        "ssl.key.location": str(client.key_path),
        "ssl.key.password": KEY_PASSWORD,
    }
    assert KEY_PASSWORD not in repr(settings) and KEY_PASSWORD not in json.dumps(settings.model_dump(mode="json"))
    conf["log_level"] = 0  # nothing listens on the default bootstrap address: no connect noise
    Producer(conf).flush(0)  # loads CA, certificate and the encrypted key
    not_a_cert = tmp_path / "garbage.pem"
    not_a_cert.write_text("not a certificate\n")
    with pytest.raises(KafkaException, match=r"ssl\.ca\.location"):
        Producer({**conf, "ssl.ca.location": str(not_a_cert)})
    with pytest.raises(KafkaException):
        Producer({**conf, "ssl.key.password": "wrong"})
