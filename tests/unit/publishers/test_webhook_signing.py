"""Standard Webhooks signing of the HTTP publisher: the signature scheme checked by the
reference library (standardwebhooks), the secrets' sources and their errors, and that
no secret shows in repr, str, errors or the scrubbed log values."""

from __future__ import annotations

import base64
import os
import secrets

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from outbox_relay.config import HttpPublisherSettings, load_settings
from outbox_relay.errors import ConfigError
from outbox_relay.publishers.http import HttpPublisher, WebhookSigner


def new_secret(size_bytes: int = 32) -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(size_bytes)).decode()


def test_signature_verifies_with_the_reference_library_and_covers_id_timestamp_and_body():
    secret = new_secret()
    body = '{"amount": 12, "note": "ü"}'.encode()
    timestamp = int(__import__("time").time())
    headers = WebhookSigner([secret]).headers("42", timestamp, body)
    assert headers["webhook-id"] == "42" and headers["webhook-timestamp"] == str(timestamp)
    assert headers["webhook-signature"].startswith("v1,") and " " not in headers["webhook-signature"]
    assert Webhook(secret).verify(body, headers) == {"amount": 12, "note": "ü"}
    # Any change to what is covered breaks it.
    for tampered_body, tampered_headers in [
        (body + b" ", headers),
        (body, {**headers, "webhook-id": "43"}),
        (body, {**headers, "webhook-timestamp": str(timestamp + 1)}),
    ]:
        with pytest.raises(WebhookVerificationError):
            Webhook(secret).verify(tampered_body, tampered_headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(body, headers)


def test_two_secrets_give_two_signatures_each_valid_with_its_own_key():
    first, second = new_secret(), new_secret(64)
    body = b'{"n":1}'
    headers = WebhookSigner([first, second]).headers("7", int(__import__("time").time()), body)
    signatures = headers["webhook-signature"].split(" ")
    assert len(signatures) == 2
    for signature, secret in zip(signatures, [first, second], strict=True):
        Webhook(secret).verify(body, {**headers, "webhook-signature": signature})
    with pytest.raises(WebhookVerificationError):  # each signature is its key's only
        Webhook(first).verify(body, {**headers, "webhook-signature": signatures[1]})


def test_a_webhook_id_with_a_dot_is_refused():
    with pytest.raises(ValueError, match="must not contain"):
        WebhookSigner([new_secret()]).headers("1.2", 0, b"{}")


@pytest.mark.parametrize(
    ("secret", "expected"),
    [
        ("c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0", "must start with whsec_"),
        ("whsec_not*base64!", "not valid base64"),
        ("whsec_" + base64.b64encode(b"x" * 16).decode(), "16 bytes"),
        ("whsec_" + base64.b64encode(b"x" * 65).decode(), "65 bytes"),
    ],
)
def test_malformed_secrets_are_refused_without_quoting_them(secret, expected):
    with pytest.raises(ConfigError) as info:
        WebhookSigner([secret])
    message = str(info.value)
    assert expected in message and "\n" not in message
    assert secret.removeprefix("whsec_") not in message


def test_secrets_come_from_files_and_an_environment_variable(tmp_path):
    first, second, third = new_secret(), new_secret(), new_secret()
    (tmp_path / "a").write_text(f"  {first}\n")
    settings = HttpPublisherSettings(signing_secret_files=[str(tmp_path / "a")], signing_secrets_env="HOOK_KEYS")
    found = settings.signing_secrets({"HOOK_KEYS": f"{second} {third}"})
    assert [s.get_secret_value() for s in found] == [first, second, third]
    # The settings hold names only: no secret in their repr or str.
    for text in (repr(settings), str(settings), repr(found), repr(WebhookSigner([first])), str(WebhookSigner([first]))):
        assert first not in text and first.removeprefix("whsec_") not in text


def test_a_secret_cannot_be_written_in_the_configuration(tmp_path):
    path = tmp_path / "c.toml"
    secret = new_secret()
    path.write_text(f'[http]\nsigning_secret = "{secret}"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert "signing_secret" in str(info.value) and secret not in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_settings(None, http={"signing_secrets_env": secret})
    assert "name of an environment variable" in str(info.value) and secret not in str(info.value)


def test_missing_unreadable_or_malformed_sources_are_one_line_errors_without_the_content(tmp_path):
    secret = new_secret()
    cases = {
        "missing": (HttpPublisherSettings(signing_secret_files=[str(tmp_path / "nope")]), "does not exist"),
        "directory": (HttpPublisherSettings(signing_secret_files=[str(tmp_path)]), "cannot be read"),
        "env unset": (HttpPublisherSettings(signing_secrets_env="NO_SUCH_HOOK_KEYS_VARIABLE"), "not set or empty"),
    }
    (tmp_path / "two").write_text(f"{secret}\n{secret}\n")
    cases["two in a file"] = (HttpPublisherSettings(signing_secret_files=[str(tmp_path / "two")]), "exactly one")
    (tmp_path / "bad").write_text(secret[: len("whsec_") + 10] + "!!\n")
    cases["malformed"] = (HttpPublisherSettings(signing_secret_files=[str(tmp_path / "bad")]), "not valid base64")
    for name, (settings, expected) in cases.items():
        with pytest.raises(ConfigError) as info:
            settings.signing_secrets({})
        message = str(info.value)
        assert expected in message, (name, message)
        assert "\n" not in message and secret[len("whsec_") : len("whsec_") + 10] not in message, name


def test_publisher_signs_only_when_configured_and_reserves_the_webhook_headers(tmp_path):
    (tmp_path / "k").write_text(new_secret())
    settings = load_settings(
        None,
        relay={"publisher": "http"},
        http={"url_template": "http://127.0.0.1:9/e", "signing_secret_files": [str(tmp_path / "k")]},
        metrics={"enabled": False},
    )
    publisher = HttpPublisher.from_settings(settings)
    try:
        assert publisher.signer is not None and publisher.signer.key_count == 1
    finally:
        publisher.close()
    unsigned = HttpPublisher("http://127.0.0.1:9/e", timeout_seconds=1, headers={"webhook-id": "static"})
    try:
        assert unsigned.signer is None
    finally:
        unsigned.close()
    with pytest.raises(ConfigError, match="may not set 'webhook-id'"):
        HttpPublisher(
            "http://127.0.0.1:9/e",
            timeout_seconds=1,
            headers={"webhook-id": "static"},
            signer=WebhookSigner([new_secret()]),
        )


def test_signing_secrets_are_scrubbed_from_logs(tmp_path, monkeypatch):
    in_file, in_env = new_secret(), new_secret()
    (tmp_path / "k").write_text(in_file)
    monkeypatch.setenv("HOOK_KEYS_FOR_SCRUBBING", in_env)
    settings = load_settings(
        None, http={"signing_secret_files": [str(tmp_path / "k")], "signing_secrets_env": "HOOK_KEYS_FOR_SCRUBBING"}
    )
    scrubbed = settings.secret_values
    for secret in (in_file, in_env):
        assert secret in scrubbed and secret.removeprefix("whsec_") in scrubbed
    assert os.environ["HOOK_KEYS_FOR_SCRUBBING"] not in repr(settings)
