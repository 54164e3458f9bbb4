"""The Apache Kafka launcher's pure parts: no Java started here."""

from __future__ import annotations

import base64

from outbox_relay._embedded.kafka import KafkaBroker, KafkaCluster, classpath_cache_file, new_cluster_id


def test_cluster_ids_decode_to_16_bytes_and_never_look_like_an_option():
    for _ in range(500):
        cluster_id = new_cluster_id()
        assert not cluster_id.startswith("-")
        assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16


def test_a_cluster_shares_its_id_and_voters_and_sizes_replication(tmp_path):
    cluster = KafkaCluster(3, base_dir=tmp_path)
    props = [node.server_properties() for node in cluster.nodes]
    assert len({node.cluster_id for node in cluster.nodes}) == 1
    assert len({p["controller.quorum.voters"] for p in props}) == 1
    assert props[0]["controller.quorum.voters"].count("@127.0.0.1:") == 3
    assert {p["node.id"] for p in props} == {"1", "2", "3"}
    for p in props:
        assert p["default.replication.factor"] == "3" and p["min.insync.replicas"] == "2"
        assert p["offsets.topic.replication.factor"] == "3" and p["process.roles"] == "broker,controller"


def test_a_sasl_listener_gets_scram_and_properties_override_the_defaults(tmp_path):
    node = KafkaBroker(
        data_dir=tmp_path,
        client_protocol="sasl_ssl",
        scram_users={"u": "p"},
        properties={"num.io.threads": 4, "auto.create.topics.enable": "false"},
    )
    props = node.server_properties()
    assert props["listener.security.protocol.map"].startswith("CLIENT:SASL_SSL,INTERNAL:PLAINTEXT")
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["num.io.threads"] == "4" and props["auto.create.topics.enable"] == "false"
    assert props["min.insync.replicas"] == "1" and node.bootstrap_servers == f"127.0.0.1:{node.port}"


def test_the_classpath_cache_is_named_after_the_kafka_version(monkeypatch, tmp_path):
    monkeypatch.delenv("OUTBOX_RELAY_KAFKA_CLASSPATH_FILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert classpath_cache_file() == tmp_path / "outbox-relay" / "kafka-4.4.0.classpath"
