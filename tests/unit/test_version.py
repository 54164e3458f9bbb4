"""The version is written once, in outbox_relay/_version.py: the installed package's
metadata and the image tags of the Kubernetes manifests must all say the same."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import outbox_relay

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def test_installed_metadata_reads_the_version_constant():
    assert version("outbox-relay") == outbox_relay.__version__


def test_kubernetes_manifests_deploy_the_image_of_this_version():
    tags = re.findall(r"image: outbox-relay:(\S+)", (DEPLOY / "deployment.yaml").read_text())
    tags += re.findall(r"image: outbox-relay:(\S+)", (DEPLOY / "migrate-job.yaml").read_text())
    tags += re.findall(r"newTag: (\S+)", (DEPLOY / "kustomization.yaml").read_text())
    assert len(tags) >= 3
    assert set(tags) == {outbox_relay.__version__}
