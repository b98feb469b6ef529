"""The ``numpy-linear`` backend, which lives only in this folder, passes the whole conformance kit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import numpy_linear
import pipekit
from pipekit_train import MSE, ArraySource, CrossEntropy, TrainingDataset, TrainingLoop
from pipekit_train.adapters.conformance import CHECKS
from pipekit_train.stage.preflight import check

BACKENDS = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_conformance(check, tmp_path):
    CHECKS[check](numpy_linear.NAME, tmp_path)


def test_importing_the_backend_does_not_import_jax():
    code = (
        f"import sys; sys.path.insert(0, {str(BACKENDS)!r}); import numpy_linear, pipekit_train; "
        "assert 'numpy-linear' in pipekit_train.available_backends(); "
        "loaded = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')); "
        "assert not loaded, loaded"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _loop(**overrides):
    x = np.ones((8, 3), np.float32)
    fields = dict(
        model_op=numpy_linear.NumpyLinear(in_size=3),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": x, "y": x[:, :1]})),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 0.1},
        max_steps=2,
        batch_size=4,
        backend="numpy-linear",
        progress=False,
    )
    fields.update(overrides)
    return TrainingLoop(**fields)


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        ({"loss": CrossEntropy()}, r"MSE\(\) only"),
        ({"optimizer_config": {"name": "adam", "lr": 0.1}}, "optimizer_config.name"),
        ({"grad_clip_norm": 1.0}, "grad_clip_norm"),
        ({"model_op": numpy_linear.NumpyLinear(in_size=5)}, r"shape \(5,\)"),
    ],
)
def test_preflight_refuses_what_the_backend_cannot_honour(overrides, refused):
    loop = _loop(**overrides)
    with pytest.raises(pipekit.PipekitError, match=refused) as info:  # a ConfigError or a ShapeError
        check(loop, None, "stage0")
    assert "numpy-linear" in str(info.value)


def test_the_model_round_trips_through_yaml_and_its_weights():
    op = numpy_linear.backend.example_model(3, 2)
    bound = op.bind(op.build(7))
    assert pipekit.loads(pipekit.dumps(op)) == op
    assert bound.with_weights(bound.weights()).weights_hash() == bound.weights_hash()
    assert bound(np.ones((5, 3))).shape == (5, 2)


def test_the_kit_catches_a_resume_that_forgets_the_optimizer_state(monkeypatch, tmp_path):
    backend = numpy_linear.NumpyLinearBackend
    monkeypatch.setattr(backend, "state_tree", backend.weights_tree)  # momentum left out of checkpoints
    monkeypatch.setattr(backend, "load_state_tree", backend.load_weights_tree)
    with pytest.raises(AssertionError, match="numpy-linear: the weights resumed from step 15"):
        CHECKS["resumes_exactly"](numpy_linear.NAME, tmp_path)


def test_the_kit_needs_the_adapters_example_model(monkeypatch, tmp_path):
    monkeypatch.delattr(numpy_linear.NumpyLinearBackendSpec, "example_model")  # the default: no example
    with pytest.raises(AssertionError, match=r"numpy-linear: .* has no example_model"):
        CHECKS["returns_a_trained_model"](numpy_linear.NAME, tmp_path)
