"""The supervised backends' shared pre-flight (`backends/_shared.py`): a loss's declared target contract, checked on
abstract shapes, an exception in a user's own loss code told apart from a shape mismatch, the factory registry and
the Transfer path walk."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from pipekit import ConfigError, ShapeError
from pipekit_train import TrainingDataset, TrainingLoop
from pipekit_train.adapters.equinox import EquinoxModel
from pipekit_train.adapters.equinox._model import FACTORIES as EQUINOX
from pipekit_train.adapters.keras._model import FACTORIES as KERAS
from pipekit_train.adapters.lightning._model import FACTORIES as LIGHTNING
from pipekit_train.backends._shared import MISSING, FactoryRegistry, resolve_path
from pipekit_train.data import ArraySource
from pipekit_train.losses import MSE, NLL, SAME_SHAPE_FLOATING, Composite, CrossEntropy, Loss
from pipekit_train.stage.preflight import check

X = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
FLOAT_Y = X.sum(axis=1, keepdims=True)  # (32, 1) float32: a regression target
LABELS = (X[:, 0] > 0).astype(np.int32)  # (32,) int32: class indices


def _loop(loss: Loss, y: np.ndarray, out_size: int) -> TrainingLoop:
    return TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": out_size, "width_size": 4, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": X, "y": y})),
        loss=loss,
        optimizer_config={"name": "sgd", "lr": 0.01},
        max_steps=2,
        batch_size=8,
        progress=False,
        name="fit",
    )


@pytest.mark.parametrize(
    "loss,y,out_size,message",
    [
        (CrossEntropy(), FLOAT_Y, 1, r"the model gives 1 logit per example \(predictions float32 of shape \(8, 1\)\)"),
        (CrossEntropy(), FLOAT_Y[:, 0], 10, r"floating targets float32 of shape \(8,\) are not class probabilities"),
        (MSE(), LABELS, 10, r"the targets are int32 of shape \(8,\), not floating values"),
        (MSE(), FLOAT_Y, 10, r"predictions are float32 of shape \(8, 10\) .* would broadcast to \(8, 10\)"),
        (Composite(components=((1.0, MSE()), (1.0, CrossEntropy()))), FLOAT_Y, 1, r"loss CrossEntropy\(\) .*1 logit"),
    ],
    ids=["ce-one-logit-float", "ce-float-labels", "mse-int-labels", "mse-broadcast", "composite-component"],
)
def test_a_loss_whose_target_contract_the_data_breaks_is_refused_in_one_line(loss, y, out_size, message):
    with pytest.raises(ConfigError) as info:
        check(_loop(loss, y, out_size), None, "fit")
    text = str(info.value)
    assert "\n" not in text and "TrainingLoop.target_key 'y'" in text and " takes " in text, text  # loss, key, rule
    assert re.search(message, text), text


@pytest.mark.parametrize(
    "loss,y,out_size",
    [(CrossEntropy(), LABELS, 2), (CrossEntropy(), np.eye(2, dtype=np.float32)[LABELS], 2), (MSE(), FLOAT_Y, 1)],
    ids=["ce-labels", "ce-one-hot", "mse"],
)
def test_losses_whose_contract_the_data_keeps_pass(loss, y, out_size):
    check(_loop(loss, y, out_size), None, "fit")


class Abs(Loss):
    """A user's loss with no declared contract: integer targets are its business."""

    def __call__(self, predicted: Any, target: Any) -> Any:
        return jnp.mean(jnp.abs(predicted - target[:, None]))


class AbsOfFloats(Abs):
    """The same loss declaring a contract: now checked like the built-in ones."""

    targets = SAME_SHAPE_FLOATING


def test_a_user_loss_is_checked_only_when_it_declares_a_contract():
    check(_loop(Abs(), LABELS, 1), None, "fit")
    with pytest.raises(ConfigError, match=r"loss AbsOfFloats\(\) cannot train on .*AbsOfFloats takes floating values"):
        check(_loop(AbsOfFloats(), LABELS, 1), None, "fit")
    assert NLL.targets is SAME_SHAPE_FLOATING and CrossEntropy.targets is not None and Loss.targets is None


class Huber2(Loss):
    """A user's loss with a bug in it (a misspelled attribute)."""

    delta: float = 1.0

    def __call__(self, predicted: Any, target: Any) -> Any:
        return jnp.mean(jnp.abs(predicted - target)) * self.delt  # type: ignore[attr-defined]  # the bug


class Misshaped(Loss):
    """A user's loss that really does compare mismatched shapes."""

    def __call__(self, predicted: Any, target: Any) -> Any:
        return jnp.mean(predicted - jnp.ones((5, 7)))


def test_an_error_in_a_users_loss_code_is_reported_as_that_error_at_the_users_line():
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if "self.delt" in text)
    with pytest.raises(ConfigError) as info:
        check(_loop(Huber2(), FLOAT_Y, 1), None, "fit")
    assert not isinstance(info.value, ShapeError)
    text = str(info.value)
    assert re.search(
        rf"raised AttributeError at \S*test_shared\.py:{line}: 'Huber2' object has no attribute 'delt'", text
    )
    assert "cannot compare" not in text and isinstance(info.value.__cause__, AttributeError)  # --debug shows it
    # a real shape mismatch in a user's loss stays a shape error, with the user's line
    with pytest.raises(ShapeError, match=r"cannot compare the model's predictions .* \(at .*test_shared\.py:\d+\)"):
        check(_loop(Misshaped(), FLOAT_Y, 1), None, "fit")


def test_debug_shows_the_users_line(tmp_path: Path):
    np.savez(tmp_path / "data.npz", x=X, y=FLOAT_Y)
    (tmp_path / "my_losses.py").write_text(
        "import jax.numpy as jnp\nfrom pipekit_train.losses import Loss\n\n\nclass Huber2(Loss):\n"
        "    delta: float = 1.0\n\n    def __call__(self, predicted, target):\n"
        "        return jnp.mean(jnp.abs(predicted - target)) * self.delt\n"
    )
    (tmp_path / "pipe.yaml").write_text(
        "pipekit: 1\ntype: TrainingLoop\n"
        "model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 4, depth: 1}}\n"
        "dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}\n"
        "loss: {type: Huber2}\nmax_steps: 2\nbatch_size: 8\n"
    )
    command = [sys.executable, "-m", "pipekit_train.cli", "validate", "pipe.yaml", "--import", "my_losses"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    plain = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert plain.returncode == 2 and plain.stderr.count("\n") == 1, plain.stderr
    assert "raised AttributeError at my_losses.py:9: 'Huber2' object has no attribute 'delt'" in plain.stderr
    debug = subprocess.run([*command, "--debug"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert 'my_losses.py", line 9, in __call__' in debug.stderr and "self.delt" in debug.stderr, debug.stderr


class Node:
    def __init__(self, **children):
        self.children = children


def _walk(root, path, steps):
    return resolve_path(
        root,
        steps,
        path,
        "target",
        child=lambda node, name: node.children.get(name, MISSING),
        names=lambda node: sorted(node.children),
    )


def test_resolve_path_walks_names_and_indices_and_names_what_is_missing():
    leaf = Node()
    root = Node(encoder=Node(layers=[Node(), leaf]), head=Node())
    assert _walk(root, "encoder.layers[1]", ["encoder", "layers", 1]) is leaf
    with pytest.raises(ConfigError, match=r"at <root> has no sub-layer 'encodr' \(did you mean 'encoder'\?\); it has"):
        _walk(root, "encodr", ["encodr"])
    with pytest.raises(ConfigError, match=r"path 'encoder.layers\[5\]' not found in the target model: .*length 2"):
        _walk(root, "encoder.layers[5]", ["encoder", "layers", 5])


def test_the_three_supervised_backends_share_one_registry_type_and_the_builtin_zoo():
    for registry in (EQUINOX, KERAS, LIGHTNING):
        assert isinstance(registry, FactoryRegistry)
        assert {"mlp", "cnn", "autoencoder", "classifier"} <= set(registry.names())
        with pytest.raises(ConfigError, match=rf"{registry.owner}.factory 'mpl' is not a registered .*'mlp'"):
            registry.get("mpl")
        with pytest.raises(ConfigError, match="activation must be one of"):
            registry.check_kwargs("mlp", {"in_size": 2, "out_size": 1, "activation": "rleu"})


def test_a_registry_refuses_another_factory_under_a_taken_name():
    registry = FactoryRegistry("ToyModel", "toy factory", "pipekit_train.backends._shared")

    def one(size: int): ...

    registry.register("one", "register_toy")(one)
    registry.register("one", "register_toy")(one)  # the same function again: a no-op
    with pytest.raises(ConfigError, match="toy factory 'one' is already registered by"):
        registry.register("one", "register_toy")(lambda size: None)
    with pytest.raises(ConfigError, match=r"register_toy\('two'\): expected a function"):
        registry.register("two", "register_toy")(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"ToyModel.kwargs: factory 'one' has no parameter 'sise'"):
        registry.check_kwargs("one", {"sise": 1})
