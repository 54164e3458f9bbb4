from pathlib import Path

from outbox_relay.config_reference import BEGIN, END, render_block

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_configuration_reference_is_current():
    text = README.read_text(encoding="utf-8")
    assert BEGIN in text and END in text
    current = text[text.index(BEGIN): text.index(END) + len(END)]
    assert current == render_block(), "run: python -m outbox_relay.config_reference --write"


def test_reference_lists_every_contract_setting():
    block = render_block()
    for env in ("OUTBOX_RELAY_DATABASE__DSN", "OUTBOX_RELAY_DATABASE__TABLE", "OUTBOX_RELAY_KAFKA__BOOTSTRAP_SERVERS",
                "OUTBOX_RELAY_KAFKA__TOPIC_TEMPLATE", "OUTBOX_RELAY_RELAY__WORKERS", "OUTBOX_RELAY_RELAY__BATCH_SIZE",
                "OUTBOX_RELAY_RELAY__LEASE_SECONDS", "OUTBOX_RELAY_RELAY__MAX_ATTEMPTS",
                "OUTBOX_RELAY_RELAY__ORDERED_EVENT_TYPES", "OUTBOX_RELAY_METRICS__PORT"):
        assert f"`{env}`" in block


def test_config_example_is_current_and_loads(tmp_path, monkeypatch):
    import tomllib

    from outbox_relay.config import load_settings
    from outbox_relay.config_reference import example_toml

    example = README.parent / "config.example.toml"
    assert example.read_text(encoding="utf-8") == example_toml(), "run: python -m outbox_relay.config_reference --example"
    # Uncommenting every line gives a valid file equal to the defaults.
    import re

    setting = re.compile(r"^# [a-z_]+ = ")
    uncommented = "\n".join(line[2:] if setting.match(line) and "..." not in line else line
                            for line in example.read_text().splitlines())
    path = tmp_path / "all.toml"
    path.write_text(uncommented)
    tomllib.loads(uncommented)
    for key in list(__import__("os").environ):
        if key.startswith("OUTBOX_RELAY_"):
            monkeypatch.delenv(key)
    settings = load_settings(path)
    assert settings.relay.batch_size == 1000 and settings.metrics.port == 9464
