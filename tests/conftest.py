"""Shared test setup: JAX on CPU, quiet progress, runs written under a temporary directory."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest


@pytest.fixture(autouse=True)
def _isolated_run_dirs(tmp_path, monkeypatch):
    """Each test writes runs, artifact stores and model registries under its own tmp dir."""
    monkeypatch.setenv("PIPEKIT_ARTIFACT_STORE", str(tmp_path / "store" / "artifacts.sqlite"))
    monkeypatch.setenv("PIPEKIT_MODEL_REGISTRY", str(tmp_path / "models"))
    monkeypatch.chdir(tmp_path)
    yield


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Make ``--dist loadgroup`` honour ``xdist_group`` marks again.

    pytest-xdist 3.8 groups tests by appending ``@<group>`` to ``item._nodeid``, which pytest 9.2 no longer reads
    (a node's id lives in ``item._id``), so every ``xdist_group`` mark was silently ignored and the module fixtures
    of a group were built once per worker. This does what xdist means to; it is a no-op when xdist already did it or
    when tests run without ``--dist loadgroup``.
    """
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import NodeId

    for item in items:
        if not hasattr(item, "_id"):
            continue
        names = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
        )
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix):
            item._id = NodeId.parse(item.nodeid + suffix)
