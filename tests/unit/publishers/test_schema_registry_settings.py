"""[schema_registry] and kafka.value_format: what is refused at start, where secrets come
from, and the subject of a value (no registry needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from outbox_relay.config import load_settings
from outbox_relay.errors import ConfigError
from outbox_relay.publishers.schema_registry import client_config, read_schema_files, subject_name

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


def _schema_files_settings(files: dict[str, str]) -> object:
    return load_settings(None, kafka={"value_format": "avro"}, schema_registry={"url": URL, "schema_files": files})


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("missing.avsc", None, "does not exist or is not readable"),
        ("order.txt", "{}", "ends in none of .avsc, .json, .proto"),
    ],
)
def test_schema_files_refused_by_the_settings(tmp_path: Path, name: str, content: str | None, expected: str) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as refused:
        _schema_files_settings({"orders-value": str(path)})
    line = str(refused.value)
    assert expected in line and "orders-value" in line and "\n" not in line


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("order.avsc", '{"type": "record", "name": ', "is not JSON"),
        ("order.json", "", "is empty"),
        ("order.proto", "  \n", "is empty"),
    ],
)
def test_schema_files_that_cannot_be_registered_are_one_line(
    tmp_path: Path, name: str, content: str, expected: str
) -> None:
    path = tmp_path / name
    path.write_text(content)
    settings = _schema_files_settings({"orders-value": str(path)})
    with pytest.raises(ConfigError) as refused:
        read_schema_files(settings.schema_registry.schema_files)  # type: ignore[attr-defined]
    line = str(refused.value)
    assert expected in line and str(path) in line and "orders-value" in line and "\n" not in line


def test_schema_files_need_a_registry_value_format(tmp_path: Path) -> None:
    path = tmp_path / "order.avsc"
    path.write_text('{"type": "string"}')
    with pytest.raises(ConfigError, match="registers schemas only for the value formats"):
        load_settings(None, schema_registry={"url": URL, "schema_files": {"orders-value": str(path)}})
    read = read_schema_files({"orders-value": str(path)})
    assert [(f.subject, f.schema_type, f.text) for f in read] == [("orders-value", "AVRO", '{"type": "string"}')]
