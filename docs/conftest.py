"""Doctest setup for the guides: each guide runs in its own temporary directory, with `tmp_path` available."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(autouse=True)
def _guide_namespace(doctest_namespace, tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEKIT_ARTIFACT_STORE", str(tmp_path / "artifacts.sqlite"))
    monkeypatch.setenv("PIPEKIT_MODEL_REGISTRY", str(tmp_path / "models"))
    monkeypatch.chdir(tmp_path)
    doctest_namespace["tmp_path"] = tmp_path
