"""Configuration: typos named with the closest setting, what kafka.extra may not override, secrets, names."""

from __future__ import annotations

import pytest

from outbox_relay.config import check_environment, load_settings
from outbox_relay.errors import ConfigError


@pytest.mark.parametrize(
    ("variable", "expected"),
    [
        ("OUTBOX_RELAY_KAFKAA__BOOTSTRAP_SERVERS", "did you mean OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS?"),
        ("OUTBOX_RELAY_RELAYY__WORKERS", "did you mean OUTBOX_RELAY_RELAY__WORKERS?"),
        ("OUTBOX_RELAY_RELAY__WORKRS", "did you mean OUTBOX_RELAY_RELAY__WORKERS?"),
        ("OUTBOX_RELAY_ZZZ__Q", "there is no settings section 'zzz'"),
    ],
)
def test_unknown_environment_variables_are_refused(variable, expected):
    with pytest.raises(ConfigError) as info:
        check_environment({variable: "x"})
    assert variable in str(info.value) and expected in str(info.value)


def test_variables_that_are_not_settings_are_left_alone():
    check_environment(
        {
            "OUTBOX_RELAY_CONFIG": "/x.toml",
            "OUTBOX_RELAY_TEST_DSN": "postgresql://",
            "OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS": "k:9092",
            "OUTBOX_RELAY_kafka__linger_ms": "3",
            "OTHER__THING": "x",
        }
    )


def test_unknown_toml_section_and_key_name_the_closest(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[relayy]\nworkers = 3\n[kafka]\nbootstrap_server = "x"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    text = str(info.value)
    assert "unknown settings section [relayy]; did you mean [relay]?" in text
    assert "kafka.bootstrap_server: unknown setting; did you mean kafka.bootstrap_servers?" in text
    assert "\n" not in text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[database]\ndsn = "host=db\ntable = "outbox"\n', ", line 2, column 15: not valid TOML: Illegal character"),
        ("[relay]\nworkers = 3\n[relay]\n", ", line 3, column 7: not valid TOML: Cannot declare"),
        ("[kafka]\nbootstrap_servers = [\n", " is not valid TOML: "),
    ],
)
def test_a_broken_toml_file_is_named_with_its_line_and_column(tmp_path, text, expected):
    path = tmp_path / "broken.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    message = str(info.value)
    assert message.startswith(f"config file {str(path)!r}")
    assert expected in message
    assert "\n" not in message
    assert "host=db" not in message  # the file's content (a DSN, a password) is never echoed


def test_a_toml_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[relay]\nlease_owner = "caf\xe9"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert str(info.value) == f"config file {str(path)!r} is not UTF-8 text (byte 26): TOML files are UTF-8"


@pytest.mark.parametrize(
    "name", ["enable.idempotence", "acks", "message.timeout.ms", "delivery.timeout.ms", "message.max.bytes"]
)
def test_kafka_extra_cannot_override_what_the_guarantees_rest_on(name):
    with pytest.raises(ConfigError) as info:
        load_settings(None, kafka={"extra": {name: "1"}})
    assert f"'{name}' cannot be set through kafka.extra" in str(info.value)


def test_the_partitioner_defaults_to_the_java_producers_placement():
    from outbox_relay.publishers.kafka import producer_config

    assert producer_config(load_settings(None))["partitioner"] == "murmur2_random"
    chosen = load_settings(None, kafka={"partitioner": "fnv1a_random"})
    assert producer_config(chosen)["partitioner"] == "fnv1a_random"


def test_a_partitioner_in_kafka_extra_wins_or_conflicts_clearly():
    from outbox_relay.publishers.kafka import producer_config

    passed = load_settings(None, kafka={"extra": {"partitioner": "consistent_random"}})
    assert producer_config(passed)["partitioner"] == "consistent_random"
    same = load_settings(None, kafka={"partitioner": "murmur2", "extra": {"partitioner": "murmur2"}})
    assert producer_config(same)["partitioner"] == "murmur2"
    with pytest.raises(ConfigError) as info:
        load_settings(None, kafka={"partitioner": "murmur2_random", "extra": {"partitioner": "consistent_random"}})
    assert "kafka.partitioner (murmur2_random) and kafka.extra.partitioner (consistent_random) disagree" in str(
        info.value
    )
    with pytest.raises(ConfigError) as info:
        load_settings(None, kafka={"extra": {"partitioner": "murmur3"}})
    assert "kafka.extra.partitioner 'murmur3' is not one of librdkafka's" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_settings(None, kafka={"partitioner": "crc32"})
    assert "kafka.partitioner" in str(info.value)


def test_secrets_given_through_kafka_extra_are_scrubbed():
    settings = load_settings(
        None,
        kafka={
            "extra": {
                "sasl.oauthbearer.client.secret": "oauth-s3cret",
                "ssl.keystore.password": "ks-s3cret",
                "linger.ms": "7",
            }
        },
    )
    secrets = settings.secret_values
    assert "oauth-s3cret" in secrets and "ks-s3cret" in secrets and "7" not in secrets


@pytest.mark.parametrize("name", ["outbox\n", "app.outbox\n", "outbox;", "a b"])
def test_table_and_role_names_refuse_a_trailing_newline_and_other_junk(name):
    from outbox_relay.db.schema import ROLE_NAME_RE

    with pytest.raises(ConfigError):
        load_settings(None, database={"table": name})
    assert not ROLE_NAME_RE.match(name.split(".")[-1])
