"""Backends by name: entry points, in-process registration, and the errors for names that don't resolve."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import pipekit_train
from pipekit import ConfigError
from pipekit_train import ArraySource, BackendError, EquinoxModel, TrainingDataset, TrainingLoop, register_backend
from pipekit_train.backends._registry import _BACKEND_MODULES, _REGISTERED, available_backends, get_backend


def _loop(**overrides):
    x = np.zeros((8, 4), np.float32)
    fields = dict(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 4, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": x, "y": x[:, :1]})),
        loss=pipekit_train.MSE(),
        max_steps=2,
        progress=False,
    )
    fields.update(overrides)
    return TrainingLoop(**fields)


@pytest.fixture
def scratch_backend():
    """Registrations made by a test are taken back after it."""
    before = dict(_REGISTERED)
    yield
    _REGISTERED.clear()
    _REGISTERED.update(before)
    for name in [m for m in sys.modules if m.startswith("scratch_adapter")]:
        del sys.modules[name]


def test_equinox_is_registered_through_its_entry_point():
    assert "equinox" in available_backends()
    adapter = get_backend("equinox")
    assert adapter.__name__ == "pipekit_train.adapters.equinox"
    assert adapter.backend_info()["backend"] == "equinox"


def test_a_misspelled_backend_suggests_the_nearest():
    with pytest.raises(BackendError, match=r"TrainingLoop.backend 'equinx' is not a registered backend \(did you mean"):
        _loop(backend="equinx")


def test_a_known_backend_that_is_not_installed_names_its_extra(scratch_backend):
    missing = [name for name in _BACKEND_MODULES if name not in available_backends()]
    if not missing:
        pytest.skip("every backend the project knows is installed here")
    name = missing[0]
    with pytest.raises(BackendError, match=rf"'{name}' is a backend pipekit-train knows.*pip install 'pipekit-train\["):
        _loop(backend=name)


def test_register_backend_in_process_and_its_checks(scratch_backend):
    adapter = types.ModuleType("scratch_adapter")
    sys.modules["scratch_adapter"] = adapter
    register_backend("scratch", "scratch_adapter")
    assert "scratch" in available_backends()
    with pytest.raises(BackendError, match=r"adapter scratch_adapter does not implement preflight, run, backend_info"):
        get_backend("scratch")
    adapter.preflight = adapter.run = adapter.backend_info = lambda *a: None
    adapter.REQUIRES = ("a_package_that_is_not_there",)
    with pytest.raises(BackendError, match=r"needs the 'a_package_that_is_not_there' package.*pip install"):
        get_backend("scratch")
    adapter.REQUIRES = ("numpy",)
    assert get_backend("scratch") is adapter
    with pytest.raises(BackendError, match=r"the name must be letters"):
        register_backend("bad name", adapter)


def test_a_model_of_another_backend_is_refused(scratch_backend):
    register_backend("scratch", types.ModuleType("scratch_adapter"))
    with pytest.raises(ConfigError, match=r"a model of backend 'equinox', but TrainingLoop.backend is 'scratch'"):
        _loop(backend="scratch")
