"""Non-finite weights are never committed to a checkpoint nor registered as a stage's final model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipekit import ConfigError
from pipekit_train import (
    MSE,
    ArraySource,
    Checkpoint,
    EquinoxModel,
    Last,
    NonFiniteWeightsError,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)


def _loop(**overrides) -> TrainingLoop:
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    fields = dict(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 4, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": x, "y": 100 * x[:, :1]})),
        loss=MSE(),
        # The loss of step 1 is finite (it is computed before the update); the update overflows the weights.
        optimizer_config={"name": "sgd", "lr": 1e38},
        max_steps=1,
        batch_size=8,
        progress=False,
        name="s",
    )
    fields.update(overrides)
    return TrainingLoop(**fields)


def test_overflowing_final_weights_are_not_registered(tmp_path: Path):
    with (
        run_settings(run_dir=str(tmp_path / "r"), store=False),
        pytest.raises(NonFiniteWeightsError, match=r"stage 's': the final weights at .* are not finite \(step 1\)"),
    ):
        _loop().run()
    assert not (tmp_path / "r" / "s" / "final.json").exists()
    assert not (tmp_path / "r" / "models").exists()


def test_a_checkpoint_never_holds_non_finite_weights(tmp_path: Path):
    ckpt = Checkpoint(every_n_steps=1, keep=(Last(n=2),), async_save=False)
    with (
        run_settings(run_dir=str(tmp_path / "r"), store=False),
        pytest.raises(NonFiniteWeightsError, match=r"not finite at step 1; no checkpoint was written for that step"),
    ):
        _loop(callbacks=(ckpt,)).run()
    assert not list((tmp_path / "r" / "s" / "checkpoints").glob("1"))


def test_training_on_regardless_is_the_users_choice(tmp_path: Path):
    with run_settings(run_dir=str(tmp_path / "r"), store=False):
        model, _ = _loop(stop_on_nonfinite=False).run()
    assert not all(np.isfinite(a).all() for a in model.weights().values())


@pytest.mark.parametrize("role", ["dataset", "val_dataset"])
def test_nan_in_the_data_is_refused_before_training(tmp_path: Path, role: str):
    from pipekit_train.stage.preflight import check_pipeline

    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    x[17, 1] = np.nan
    data = TrainingDataset(source=ArraySource(arrays={"x": x, "y": x[:, :1]}))
    loop = _loop(optimizer_config={"name": "sgd", "lr": 0.01}, **{role: data})
    with pytest.raises(
        ConfigError, match=rf"TrainingLoop.{role}: 'x' holds 1 NaN or infinite value\(s\) \(the first in record 17\)"
    ):
        check_pipeline(loop)
    with run_settings(run_dir=str(tmp_path / "r"), store=False), pytest.raises(ConfigError):
        loop.run()
    assert not (tmp_path / "r").exists()  # a failed pre-flight claims nothing
