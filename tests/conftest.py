"""Shared test setup: JAX on CPU, quiet progress, runs written under a temporary directory."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest


@pytest.fixture(autouse=True)
def _isolated_run_dirs(tmp_path, monkeypatch):
    """Each test writes runs, artifact stores and model registries under its own tmp dir."""
    monkeypatch.setenv("PIPEKIT_ARTIFACT_STORE", str(tmp_path / "store" / "artifacts.sqlite"))
    monkeypatch.setenv("PIPEKIT_MODEL_REGISTRY", str(tmp_path / "models"))
    monkeypatch.chdir(tmp_path)
    yield
