"""[schema_registry] and kafka.value_format: what is refused at start, where secrets come
from, and the subject of a value (no registry needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from outbox_relay.config import load_settings
from outbox_relay.errors import ConfigError
from outbox_relay.publishers.schema_registry import client_config, subject_name

URL = "http://127.0.0.1:1/apis/ccompat/v7"


def test_default_is_plain_json_without_a_registry() -> None:
    settings = load_settings(None)
    assert settings.kafka.value_format == "json"
    assert settings.schema_registry.auto_register is False
    assert settings.schema_registry.subject_name_strategy == "topic"


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"kafka": {"value_format": "avro"}}, "needs schema_registry.url"),
        (
            {
                "kafka": {"value_format": "avro", "message_format": "cloudevents-structured"},
                "schema_registry": {"url": URL},
            },
            'kafka.message_format = "contract"',
        ),
        ({"schema_registry": {"auto_register": True}}, "not supported yet"),
        ({"schema_registry": {"basic_auth_user": "relay"}}, "go together"),
        ({"schema_registry": {"bearer_token_env": "not a name"}}, "name of an environment variable"),
    ],
)
def test_refused_settings(sections: dict[str, dict[str, object]], expected: str) -> None:
    with pytest.raises(Exception, match=expected):
        load_settings(None, **sections)


def test_password_from_a_file_and_token_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret_file = tmp_path / "password"
    secret_file.write_text("s3cret-pass\n")
    settings = load_settings(
        None,
        kafka={"value_format": "avro"},
        schema_registry={"url": URL, "basic_auth_user": "relay", "basic_auth_password_file": str(secret_file)},
    )
    assert client_config(settings)["basic.auth.user.info"] == "relay:s3cret-pass"
    assert "s3cret-pass" in settings.secret_values
    assert "s3cret-pass" not in repr(settings)

    monkeypatch.setenv("REGISTRY_TOKEN", "tok-123")
    settings = load_settings(
        None, kafka={"value_format": "json-schema"}, schema_registry={"url": URL, "bearer_token_env": "REGISTRY_TOKEN"}
    )
    conf = client_config(settings)
    assert conf["bearer.auth.credentials.source"] == "STATIC_TOKEN" and conf["bearer.auth.token"] == "tok-123"
    assert "tok-123" in settings.secret_values


def test_unreadable_password_file_is_one_line_without_the_secret(tmp_path: Path) -> None:
    settings = load_settings(
        None,
        kafka={"value_format": "avro"},
        schema_registry={"url": URL, "basic_auth_user": "u", "basic_auth_password_file": str(tmp_path / "absent")},
    )
    with pytest.raises(ConfigError, match=r"basic_auth_password_file.*does not exist"):
        client_config(settings)


def test_subject_names() -> None:
    assert subject_name("topic", "orders", "OrderCreated") == "orders-value"
    assert subject_name("record", "orders", "outbox.OrderCreated") == "outbox.OrderCreated"
    assert subject_name("topic-record", "orders", "OrderCreated") == "orders-OrderCreated"
