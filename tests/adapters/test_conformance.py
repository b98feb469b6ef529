"""Every installed backend adapter honours the adapter contract (adapters/README.md), checked by the kit.

"Installed" means declared in the ``pipekit_train.backends`` entry-point group: a test-only backend registered
in-process (``tests/backends/numpy_linear``, run by its own folder's tests) is left out even when its registration
leaks into this process.
"""

from __future__ import annotations

import importlib.metadata

import pytest

from pipekit_train import available_backends
from pipekit_train.adapters.conformance import CHECKS
from pipekit_train.backends._registry import ENTRY_POINT_GROUP

INSTALLED = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
BACKENDS = [name for name in available_backends() if name in INSTALLED]


def test_the_kit_has_every_documented_check():
    assert len(CHECKS) >= 10 and all(callable(check) for check in CHECKS.values())
    assert "equinox" in BACKENDS


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_adapter_contract(backend, check, tmp_path):
    """Every backend passes the kit: samplers and variational fits its sampler variant (no skips)."""
    CHECKS[check](backend, tmp_path)
