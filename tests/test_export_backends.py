"""``export`` beyond Equinox: every JAX backend's model exports (Keras through its stateless call, NumPyro's and
BlackJAX's posterior-predictive mean), the file gives what the model operator gives; torch is refused in one line.
A trained model of every installed backend goes through the same check in the conformance kit
(``round_trips_the_model_registry``, tests/adapters/test_conformance.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipekit_train import LocalModelRegistry
from pipekit_train.backends import backends_with
from pipekit_train.inference import ExportError, export_model


def _exported(model: Any, tmp_path: Path, shape: tuple[int, ...], batch: int) -> Any:
    """Store `model` in a registry, export it by URI with `shape`, and load the file back with JAX alone."""
    import jax

    registry = LocalModelRegistry(str(tmp_path / "models"))
    uri = str(registry.locator(registry.put(model)))
    out = tmp_path / "m.jaxexport"
    record = export_model(uri, out, input_shape=shape, batch=batch, store=tmp_path / "none.sqlite")
    assert record["backend"] == model.backend and record["weights_hash"] == model.weights_hash()
    return jax.export.deserialize(bytearray(out.read_bytes()))


def test_a_keras_model_exports_and_the_file_predicts_what_the_model_does(tmp_path: Path):
    if importlib.util.find_spec("keras") is None:
        pytest.skip("the keras extra is not installed")
    from pipekit_train.adapters.keras import KerasModel

    op = KerasModel(factory="mlp", kwargs={"in_size": 4, "out_size": 2, "width_size": 8, "depth": 1})
    model = op.bind(op.build(0))
    x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    exported = _exported(model, tmp_path, (4,), batch=3)
    np.testing.assert_allclose(np.asarray(exported.call(x)), np.asarray(model(x)), rtol=1e-6, atol=1e-6)


def test_a_numpyro_mcmc_posterior_exports_its_posterior_predictive_mean(tmp_path: Path):
    pytest.importorskip("numpyro")
    from pipekit_train.adapters.numpyro import NumpyroModel, Posterior

    rng = np.random.default_rng(1)  # 2 chains of 25 draws, as a sampler leaves them
    draws = {"w": rng.normal(size=(2, 25, 2)), "b": rng.normal(size=(2, 25)), "sigma": rng.uniform(0.1, 1, (2, 25))}
    model = NumpyroModel(model="linear_regression").bind(Posterior({k: v.astype(np.float32) for k, v in draws.items()}))
    x = np.array([[1.0, 2.0], [-1.0, 0.5]], np.float32)
    exported = _exported(model, tmp_path, (2,), batch=2)
    np.testing.assert_allclose(np.asarray(exported.call(x)), np.asarray(model(x)), rtol=1e-5, atol=1e-5)
    mean = (x @ draws["w"].reshape(-1, 2).T + draws["b"].reshape(-1)).mean(axis=1)
    np.testing.assert_allclose(np.asarray(exported.call(x)), mean, atol=0.6)  # around the mean of x @ w + b


def test_every_jax_backend_declares_export_and_torch_is_refused_in_one_line(tmp_path: Path):
    able = set(backends_with("export"))
    assert {"equinox", "keras", "numpyro-mcmc", "numpyro-svi", "blackjax"} <= able
    assert "lightning" not in able
    pytest.importorskip("torch")
    from pipekit_train.adapters.lightning import TorchModel

    op = TorchModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1})
    registry = LocalModelRegistry(str(tmp_path / "models"))
    uri = str(registry.locator(registry.put(op.bind(op.build(0)))))
    with pytest.raises(ExportError) as info:
        export_model(uri, tmp_path / "t.jaxexport", input_shape=(4,), store=tmp_path / "none.sqlite")
    message = str(info.value)
    assert "\n" not in message
    assert "cannot export TorchModel (backend 'lightning'): a TorchModel runs PyTorch, not JAX" in message
    assert "torch.export" in message and "keras" in message
