"""Backends by name: entry points, in-process registration, and the errors for names that don't resolve."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import pipekit_train
from pipekit import ConfigError
from pipekit_train import ArraySource, BackendError, EquinoxModel, TrainingDataset, TrainingLoop, register_backend
from pipekit_train.backends import Backend, LazyBackend
from pipekit_train.backends._registry import _REGISTERED, available_backends, get_backend


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
    backend = get_backend("equinox")
    assert isinstance(backend, Backend) and backend.name == "equinox"
    assert type(backend).__module__ == "pipekit_train.adapters.equinox"
    assert backend.info()["backend"] == "equinox"
    assert {"weights", "transfer", "mesh"} <= backend.capabilities


def test_a_misspelled_backend_suggests_the_nearest():
    with pytest.raises(BackendError, match=r"TrainingLoop.backend 'equinx' is not a registered backend \(did you mean"):
        _loop(backend="equinx")


class _Scratch(LazyBackend):
    name = "scratch"
    requires = ("a_package_that_is_not_there",)
    extra = "scratch-extra"
    impl = "scratch_adapter"


def test_register_backend_in_process_and_its_checks(scratch_backend):
    module = types.ModuleType("scratch_adapter")
    sys.modules["scratch_adapter"] = module
    register_backend("scratch", "scratch_adapter")
    assert "scratch" in available_backends()
    with pytest.raises(BackendError, match=r"module scratch_adapter has no `backend` object"):
        get_backend("scratch")
    with pytest.raises(
        BackendError,
        match=r"object is not a pipekit_train.backends.Backend; subclass it \(its abstract methods check, ",
    ):
        register_backend("scratch", object())
    module.backend = scratch = _Scratch()
    register_backend("scratch", "scratch_adapter:backend")
    with pytest.raises(BackendError, match=r"needs the 'a_package_that_is_not_there' package.*\[scratch-extra\]"):
        get_backend("scratch")
    scratch.requires = ("numpy",)
    register_backend("scratch", module)  # a module holding `backend`
    assert get_backend("scratch") is module.backend
    scratch.capabilities = frozenset({"teleport"})
    register_backend("scratch", module.backend)
    with pytest.raises(BackendError, match=r"unknown capabilities \['teleport'\]"):
        get_backend("scratch")
    with pytest.raises(BackendError, match=r"the name must be letters"):
        register_backend("bad name", module.backend)


def test_a_model_of_another_backend_is_refused(scratch_backend):
    register_backend("scratch", _Scratch())
    with pytest.raises(ConfigError, match=r"a model of backend 'equinox', but TrainingLoop.backend is 'scratch'"):
        _loop(backend="scratch")
