"""The generated references (docs/reference/cli.md, configuration.md, metrics.md and
config.example.toml) are regenerated in memory from the code and must equal the files:
a setting, command or metric changed without `python scripts/gen_reference.py` fails
here, naming the page."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from outbox_relay.config import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _load_generator() -> ModuleType:
    # scripts/ is not a package (the generator stays outside the runtime package).
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


@pytest.mark.parametrize("relative", sorted(gen.PAGES))
def test_generated_page_is_current(relative: str) -> None:
    path = ROOT / relative
    assert path.exists(), f"{relative} is missing: run python scripts/gen_reference.py"
    assert path.read_text(encoding="utf-8") == gen.PAGES[relative](), (
        f"{relative} is stale: run python scripts/gen_reference.py"
    )


def test_stale_pages_names_a_page_that_differs(tmp_path: Path) -> None:
    """The check `./dev docs` runs reports a page edited by hand (or left behind)."""
    for relative, render in gen.PAGES.items():
        target = tmp_path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render(), encoding="utf-8")
    assert gen.stale_pages(tmp_path) == []
    edited = tmp_path / "docs/reference/metrics.md"
    edited.write_text(edited.read_text(encoding="utf-8").replace("counter", "gauge", 1), encoding="utf-8")
    (tmp_path / "docs/reference/cli.md").unlink()
    assert gen.stale_pages(tmp_path) == ["docs/reference/cli.md", "docs/reference/metrics.md"]


def test_configuration_reference_lists_every_setting_with_its_variable() -> None:
    page = gen.configuration_reference()
    for section_name, section_field in Settings.model_fields.items():
        model = section_field.annotation
        if section_name == "sources":  # dict[str, SourceSettings]: one section per named source
            from outbox_relay.source_config import SourceSettings

            for name in SourceSettings.model_fields:
                assert f"| `sources.<name>.{name}` | `OUTBOX_RELAY_SOURCES__<NAME>__{name.upper()}` |" in page
            continue
        if section_name == "limits":  # list[RateLimitSettings]: [[limits]], set as a whole (OUTBOX_RELAY_LIMITS)
            from outbox_relay.config import RateLimitSettings

            assert "OUTBOX_RELAY_LIMITS=" in page
            for name in RateLimitSettings.model_fields:
                assert f"| `limits[].{name}` |" in page
            continue
        assert isinstance(model, type)
        for name in model.model_fields:
            env = f"OUTBOX_RELAY_{section_name.upper()}__{name.upper()}"
            assert f"| `{section_name}.{name}` | `{env}` |" in page


def test_cli_reference_lists_every_command_and_option() -> None:
    page = gen.cli_reference()
    for command in (
        "run",
        "migrate",
        "status",
        "dead list",
        "dead retry",
        "dead skip",
        "aggregate show",
        "audit list",
        "console",
        "purge",
        "grants",
        "demo",
    ):
        assert f"## `outbox-relay {command}`" in page
    for option in (
        "`--workers`",
        "`--no-notify-trigger`",
        "`--drop-ordering-indexes`",
        "`--older-than`",
        "`--dry-run`",
        "`--error-contains`",
        "`--reason`",
        "`--chunk-size`",
    ):
        assert option in page


def test_metrics_reference_names_every_registered_series() -> None:
    page = gen.metrics_reference()
    series = gen.exported_series()
    assert "outbox_relay_published_total" in series and "outbox_relay_claim_batch_size_bucket" in series
    for name in series:
        assert f"`{name}`" in page
    published = next(m for m in gen.registry_metrics() if m["name"] == "outbox_relay_published")
    assert published["type"] == "counter" and published["labels"] == ["outcome"]


METRIC_TOKEN = re.compile(r"\boutbox_relay_[a-z0-9_]*[a-z0-9]\b")
# Names that look like metrics but are not: a table migrate creates beside an outbox
# named "outbox", and the example plug-in package of the publisher tutorial.
NOT_METRICS = {"outbox_relay_state", "outbox_relay_jsonl"}


def test_every_metric_the_documentation_names_exists() -> None:
    """Hand-written pages (and the README) may only name metrics the relay exports."""
    series = gen.exported_series()
    names = series | {m["name"] for m in gen.registry_metrics()}
    pages = [*DOCS.rglob("*.md"), ROOT / "README.md"]
    for page in pages:
        for token in METRIC_TOKEN.findall(page.read_text(encoding="utf-8")):
            if token in NOT_METRICS:
                continue
            assert token in names, f"{page.relative_to(ROOT)} names {token}, which the relay does not export"


def test_config_example_loads_to_the_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    example = gen.example_toml()
    setting = re.compile(r"^# [a-z_]+ = ")
    uncommented = "\n".join(
        line[2:] if setting.match(line) and "..." not in line else line for line in example.splitlines()
    )
    tomllib.loads(uncommented)
    path = tmp_path / "all.toml"
    path.write_text(uncommented, encoding="utf-8")
    for key in list(os.environ):
        if key.startswith("OUTBOX_RELAY_"):
            monkeypatch.delenv(key)
    settings = load_settings(path)
    assert settings.relay.batch_size == 1000 and settings.metrics.port == 9464


def test_readme_links_point_at_files_that_exist() -> None:
    """README.md links the manual's pages by their path in the repository (readable on
    any Git host and in a clone): every relative target must be a file or folder that
    exists, every other target absolute or an anchor."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)", text) + re.findall(r"""<img[^>]+src=["']([^"']+)""", text)
    relative = [t.split("#", 1)[0] for t in targets if not t.startswith(("https://", "http://", "#"))]
    assert relative, "README.md links no page of the manual"
    missing = [t for t in relative if not (ROOT / t).exists()]
    assert missing == [], f"README.md links files that do not exist: {missing}"
