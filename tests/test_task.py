"""`TrainingLoop(task=...)`: a backend-native `TrainTask` trains in place of a `Loss`."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipekit
from pipekit import ConfigError, ShapeError
from pipekit_train import (
    MSE,
    ArraySource,
    EquinoxModel,
    NpzSource,
    TrainingDataset,
    TrainingLoop,
    read_jsonl,
    run_settings,
)
from pipekit_train.adapters.equinox import TrainTask, make_task

MLP = EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1})


def _data(seed: int = 0, n: int = 64) -> TrainingDataset:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32) + 0.3).astype(np.float32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": y}))


def _loop(**kw) -> TrainingLoop:
    base = dict(
        model_op=MLP,
        dataset=_data(),
        optimizer_config={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        max_steps=40,
        batch_size=16,
        log_every_n_steps=10,
        seed=3,
        progress=False,
    )
    base.update(kw)
    return TrainingLoop(**base)


def _weights(module) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(eqx.filter(module, eqx.is_array))]


class Regression(TrainTask):
    """A custom task: weighted squared error plus an extra metric the plain `MSE` path does not log."""

    weight: float = 1.0

    def loss_fn(self, model, batch, key):
        predicted = jax.vmap(model)(batch["x"])
        loss = self.weight * jnp.mean((predicted - batch["y"]) ** 2)
        return loss, {"loss": loss, "mae": jnp.mean(jnp.abs(predicted - batch["y"]))}


class Weighted(TrainTask):
    """A task holding an array: the weight of each output (like class weights, or a frozen teacher)."""

    weights: jax.Array

    def loss_fn(self, model, batch, key):
        predicted = jax.vmap(model)(batch["x"])
        return jnp.mean(self.weights * (predicted - batch["y"]) ** 2), {"weighted": jnp.sum(self.weights)}


def test_a_custom_task_trains_and_its_metrics_are_logged(tmp_path):
    loop = _loop(task=Regression(), loss=None, val_dataset=_data(seed=1), eval_every_n_steps=20)
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        model, artifact = loop.run()
    records = read_jsonl(tmp_path / "run" / "stage0" / "metrics.jsonl")
    train = [r for r in records if r["type"] == "metrics" and r["context"] == "train"]
    val = [r for r in records if r["type"] == "metrics" and r["context"] == "validate"]
    assert [r["step"] for r in train] == [10, 20, 30, 40] and [r["step"] for r in val] == [20, 40]
    assert all("mae" in r and "loss" in r for r in train + val)
    assert train[-1]["loss"] < train[0]["loss"] / 2
    assert artifact.final_metrics["validate/mae"] == pytest.approx(val[-1]["mae"])
    assert records[-1]["type"] == "finish" and records[-1]["status"] == "completed"
    assert model(np.zeros((2, 4), np.float32)).shape == (2, 1)


@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_the_task_of_a_loss_trains_bitwise_like_the_loss(steps_per_call):
    """`make_task(MSE())` is the loss path written as a task: the same keys, the same ops, the same weights."""
    with run_settings(store=False):
        by_loss, _ = _loop(loss=MSE(), steps_per_call=steps_per_call).run()
        by_task, _ = _loop(task=make_task(MSE()), loss=None, steps_per_call=steps_per_call).run()
    for a, b in zip(_weights(by_loss.module), _weights(by_task.module), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_task_without_a_loss_metric_logs_its_scalar_as_loss(tmp_path):
    loop = _loop(task=Weighted(weights=jnp.ones(1)), loss=None, max_steps=10)
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        _, artifact = loop.run()
    assert set(artifact.final_metrics) >= {"train/loss", "train/weighted"}
    assert np.isfinite(artifact.final_metrics["train/loss"])


def test_a_tasks_arrays_are_inputs_of_the_step_not_stale_constants():
    """Two tasks of one structure with different arrays train differently: each run sees its own arrays."""
    with run_settings(store=False):
        trained, _ = _loop(task=Weighted(weights=jnp.ones(1)), max_steps=5).run()
        frozen, _ = _loop(task=Weighted(weights=jnp.zeros(1)), max_steps=5).run()  # zero loss: nothing moves
    initial = _weights(MLP.build(jax.random.split(jax.random.key(3))[0]))  # the loop's init key
    assert any(not np.array_equal(a, b) for a, b in zip(_weights(trained.module), initial))
    for a, b in zip(_weights(frozen.module), initial, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_new_task_of_the_same_structure_compiles_nothing_new():
    from pipekit_train.adapters.equinox._steps import CompileCounter

    model = EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 7, "depth": 1})
    one, half = Weighted(weights=np.ones(1, np.float32)), Weighted(weights=np.full(1, 0.5, np.float32))
    with run_settings(store=False):
        with CompileCounter() as first:
            _loop(model_op=model, task=one, max_steps=3).run()
        with CompileCounter() as second:
            _loop(model_op=model, task=half, max_steps=3, seed=4).run()
    assert first.count > 0
    assert second.count == 0


def test_a_task_is_python_only():
    loop = _loop(task=Regression(), loss=None, dataset=TrainingDataset(source=NpzSource(path="train.npz")))
    with pytest.raises(ConfigError, match=r"task: Regression values cannot be written to YAML"):
        pipekit.dumps(loop)


def test_a_loss_or_a_task_is_required():
    with pytest.raises(ConfigError, match=r"TrainingLoop needs a `loss` \(or a backend-native `task`\); both are null"):
        _loop(loss=None, task=None)


def test_validate_traces_the_task_before_compiling():
    from pipekit_train.stage.preflight import check_pipeline

    loop = _loop(task=make_task(MSE(), target_key="label"), loss=None)
    with pytest.raises(ShapeError, match=r"TrainingLoop.task LossTask.loss_fn fails on a batch"):
        check_pipeline(loop)
