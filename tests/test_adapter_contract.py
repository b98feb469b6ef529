"""Every implemented backend adapter honours the adapter contract (adapters/README.md)."""

from __future__ import annotations

import pytest

from pipekit_train._loop import _IMPLEMENTED_BACKENDS
from pipekit_train.adapters.conformance import CHECKS


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("backend", _IMPLEMENTED_BACKENDS)
def test_adapter_contract(backend, check, tmp_path):
    CHECKS[check](backend, tmp_path)
