"""Every implemented backend adapter honours the adapter contract (adapters/README.md)."""

from __future__ import annotations

import pytest

from pipekit_train import available_backends
from pipekit_train.adapters.conformance import CHECKS


@pytest.mark.parametrize("check", sorted(CHECKS))
@pytest.mark.parametrize("backend", available_backends())
def test_adapter_contract(backend, check, tmp_path):
    CHECKS[check](backend, tmp_path)
