"""The Equinox primitives: the synthesised task, the reference train_step, and Orbax save/restore."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from pipekit import ConfigError, ShapeError
from pipekit_train.adapters.equinox import EquinoxModel
from pipekit_train.adapters.equinox._primitives import (
    TrainState,
    TrainTask,
    check_task,
    init_state,
    make_task,
    restore_state,
    save_state,
    task_loss,
    train_step,
)
from pipekit_train.backends._optax import build_optimizer
from pipekit_train.backends._optax_schedule import get_lr_scale, set_lr_scale
from pipekit_train.losses._builtin import MSE, CrossEntropy
from pipekit_train.losses._composite import Composite
from pipekit_train.losses._loss import Loss


def _regression(n=64):
    x = jax.random.normal(jax.random.key(1), (n, 3))
    y = (x @ jnp.array([1.0, -2.0, 0.5]))[:, None] + 0.3
    return {"x": x, "y": y}


def _mlp():
    op = EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 16, "depth": 1})
    return op.build(jax.random.key(0))


class _CountingMSE(Loss, register=False):
    """An MSE that counts how often it is traced (test-only, not registered; the count is a class attribute
    because a loss is a frozen value)."""

    calls: ClassVar[int] = 0

    def __call__(self, predicted, target):
        type(self).calls += 1
        return jnp.mean((predicted - target) ** 2)


def _bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def test_train_step_decreases_the_loss_and_compiles_once():
    batch = _regression()
    opt = build_optimizer({"name": "adam", "lr": 0.02}, max_steps=200)
    loss = _CountingMSE()
    _CountingMSE.calls = 0
    task = make_task(loss)
    state = init_state(_mlp(), opt)
    assert state.step.dtype == jnp.int32 and int(state.step) == 0
    key = jax.random.key(2)
    losses = []
    for _ in range(150):
        key, sub = jax.random.split(key)
        state, metrics = train_step(state, batch, sub, task, opt)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 150
    assert losses[-1] < 0.05 * losses[0]
    assert loss.calls == 1  # traced once: the step counter and the key are arrays, the task is static


def test_train_step_is_pure():
    batch = _regression()
    opt = build_optimizer({"name": "sgd", "lr": 0.1}, max_steps=10)
    task = make_task(MSE())
    state = init_state(_mlp(), opt)
    before = _bits(state)
    new, _ = train_step(state, batch, jax.random.key(0), task, opt)
    assert _bits(state) == before
    assert _bits(new) != before
    again, _ = train_step(state, batch, jax.random.key(0), task, opt)
    assert _bits(again) == _bits(new)


def test_task_metrics_hold_loss_and_aux_terms():
    op = EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 4, "width_size": 8, "depth": 1})
    model = op.build(0)
    batch = {"image": jnp.ones((5, 3)), "label": jnp.array([0, 1, 2, 3, 0])}
    task = make_task(Composite(components=((2.0, CrossEntropy()),)), input_key="image", target_key="label")
    value, metrics = task.loss_fn(model, batch, jax.random.key(0))
    assert set(metrics) == {"loss", "CrossEntropy_0", "CrossEntropy_0/accuracy"}
    ce, aux = CrossEntropy()(op.bind(model)(batch["image"]), batch["label"])
    np.testing.assert_allclose(value, 2.0 * ce, rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], value)
    np.testing.assert_allclose(metrics["CrossEntropy_0/accuracy"], aux["accuracy"])
    np.testing.assert_allclose(metrics["CrossEntropy_0"], ce, rtol=1e-6)


class _Noisy(eqx.Module):
    """Returns one normal draw from its key, so the keys an example sees are visible."""

    scale: jax.Array

    def __call__(self, x, *, key=None):
        noise = jnp.zeros(()) if key is None else jax.random.normal(key, ())
        return self.scale * (x[0] + noise)


class _Capture(Loss, register=False):
    """An MSE that keeps the predictions it was called with."""

    seen: ClassVar[dict] = {}

    def __call__(self, predicted, target):
        self.seen["p"] = predicted
        return jnp.mean((predicted - target) ** 2)


def test_each_example_gets_its_own_key_and_a_none_key_is_passed_through():
    model = _Noisy(jnp.ones(()))
    batch = {"x": jnp.zeros((4, 1)), "y": jnp.zeros(4)}
    seen = _Capture.seen
    task = make_task(_Capture())
    key = jax.random.key(7)
    task.loss_fn(model, batch, key)
    expected = jax.vmap(lambda k: jax.random.normal(k, ()))(jax.random.split(key, 4))
    np.testing.assert_allclose(seen["p"], expected, rtol=1e-6)
    assert len(set(np.asarray(seen["p"]).tolist())) == 4
    task.loss_fn(model, batch, None)
    np.testing.assert_array_equal(seen["p"], 0.0)
    # raw uint32 keys work as well as typed keys
    task.loss_fn(model, batch, jax.random.PRNGKey(7))
    assert seen["p"].shape == (4,)


def test_autoencoder_task_uses_the_input_as_target():
    op = EquinoxModel(factory="autoencoder", kwargs={"in_size": 6, "latent_size": 2, "hidden": [4]})
    opt = build_optimizer({"lr": 0.01}, max_steps=5)
    state = init_state(op.build(0), opt)
    state, metrics = train_step(
        state, {"x": jnp.ones((3, 6))}, jax.random.key(0), make_task(MSE(), target_key="x"), opt
    )
    assert np.isfinite(float(metrics["loss"]))


def test_task_errors():
    model = _mlp()
    batch = _regression(4)
    with pytest.raises(ShapeError, match=r"MSE\(reduction='none'\) returned shape \(4, 1\); a training loss must be"):
        make_task(MSE(reduction="none")).loss_fn(model, batch, jax.random.key(0))
    with pytest.raises(ShapeError, match=r"MSE: predicted shape \(4, 1\) != target shape \(4,\)"):
        make_task(MSE()).loss_fn(model, {"x": batch["x"], "y": batch["y"][:, 0]}, jax.random.key(0))
    with pytest.raises(TypeError, match=r"make_task: loss must be a Loss .*, got 3"):
        make_task(3)
    with pytest.raises(TypeError, match=r"make_task: loss must be a Loss \(an instance of a pipekit_train.Loss sub"):
        make_task(lambda p, t: jnp.mean((p - t) ** 2))  # a plain function is not a Loss: subclass Loss
    with pytest.raises(TypeError, match="abstract"):
        TrainTask()


class _Returns(TrainTask):
    """A task that returns whatever it is given, to test the checks on a task's output."""

    out: object = eqx.field(static=True)

    def loss_fn(self, model, batch, key):
        return self.out(batch)


def test_task_loss_checks_the_output_and_adds_the_loss_metric():
    batch = {"x": jnp.ones((4, 3))}
    value, metrics = task_loss(_Returns(lambda b: (jnp.sum(b["x"]), {"mae": 1.0})), None, batch, None)
    assert float(value) == 12.0 and set(metrics) == {"mae", "loss"} and metrics["loss"] is value
    _, metrics = task_loss(_Returns(lambda b: (jnp.sum(b["x"]), {"loss": 7.0})), None, batch, None)
    assert metrics == {"loss": 7.0}  # the task's own "loss" wins
    with pytest.raises(TypeError, match=r"_Returns.loss_fn must return \(scalar loss, metrics dict\), got ArrayImpl"):
        task_loss(_Returns(lambda b: jnp.sum(b["x"])), None, batch, None)
    with pytest.raises(TypeError, match=r"must return \(scalar loss, metrics dict\), got a tuple of 3"):
        task_loss(_Returns(lambda b: (1.0, {}, 2.0)), None, batch, None)
    with pytest.raises(ShapeError, match=r"_Returns.loss_fn returned a loss of shape \(4,\); a training loss must"):
        task_loss(_Returns(lambda b: (jnp.sum(b["x"], axis=1), {})), None, batch, None)


def test_check_task_traces_abstract_values_and_names_the_task():
    model = eqx.filter_eval_shape(_mlp)
    batch = {"x": jax.ShapeDtypeStruct((8, 3), jnp.float32), "y": jax.ShapeDtypeStruct((8, 1), jnp.float32)}
    check_task(make_task(MSE()), model, batch)  # nothing runs, nothing raises
    with pytest.raises(ConfigError, match=r"TrainingLoop.task must be a TrainTask .*, got MSE\(\)"):
        check_task(MSE(), model, batch)
    wrong = {"x": batch["x"], "y": jax.ShapeDtypeStruct((8,), jnp.float32)}
    with pytest.raises(
        ShapeError,
        match=r"TrainingLoop.task LossTask.loss_fn fails on a batch of shapes "
        r"\{'x': \(8, 3\), 'y': \(8,\)\}: MSE: predicted shape \(8, 1\) != target shape \(8,\)",
    ):
        check_task(make_task(MSE()), model, wrong)
    with pytest.raises(ShapeError, match=r"fails on a batch .*KeyError|fails on a batch .*'label'"):
        check_task(make_task(MSE(), target_key="label"), model, batch)


def test_save_restore_round_trip_bitwise(tmp_path):
    batch = _regression()
    opt = build_optimizer({"name": "adamw", "schedule": "warmup_cosine", "warmup_steps": 2}, max_steps=20, accum=2)
    task = make_task(MSE())
    state = init_state(_mlp(), opt)
    for i in range(5):
        state, _ = train_step(state, batch, jax.random.key(i), task, opt)
    state = eqx.tree_at(lambda s: s.opt_state, state, set_lr_scale(state.opt_state, 0.5))
    template = init_state(
        EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 16, "depth": 1}).build(9), opt
    )
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        save_state(mngr, state, 5)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [5]
        restored = restore_state(mngr, template, 5)
    assert isinstance(restored, TrainState)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert _bits(restored) == _bits(state)
    assert int(restored.step) == 5 and restored.step.dtype == jnp.int32
    assert get_lr_scale(restored.opt_state) == 0.5
    # resuming from the restored state continues exactly as the original run would
    a, b = state, restored
    for i in range(5, 8):
        a, ma = train_step(a, batch, jax.random.key(i), task, opt)
        b, mb = train_step(b, batch, jax.random.key(i), task, opt)
        assert float(ma["loss"]) == float(mb["loss"])
    assert _bits(a) == _bits(b)
