"""`init_from: DIR@average(last=N)`: a stage starts from the mean of a run's last N checkpoints."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest

from pipekit_train import (
    MSE,
    ArraySource,
    Checkpoint,
    CheckpointError,
    EquinoxModel,
    Last,
    ParamGroup,
    TrainingDataset,
    TrainingLoop,
    average_checkpoints,
    run_settings,
)
from pipekit_train.optim._recipes import param_path


def _loop(**kw) -> TrainingLoop:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    base = dict(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": x, "y": x[:, :1]})),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 0.1},
        max_steps=6,
        batch_size=16,
        log_every_n_steps=2,
        progress=False,
    )
    base.update(kw)
    return TrainingLoop(**base)


def _by_path(tree) -> dict[str, np.ndarray]:
    """Leaves by dotted path, sorted (a checkpoint's tree is a dict of the module's fields)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return dict(sorted((param_path(p), np.asarray(x)) for p, x in flat))


def test_init_from_average_of_the_last_three_checkpoints(tmp_path):
    with run_settings(run_dir=str(tmp_path / "src"), store=False):
        _loop(callbacks=(Checkpoint(every_n_steps=2, keep=(Last(n=3),), async_save=False),), name="fit").run()
    checkpoints = tmp_path / "src" / "fit" / "checkpoints"
    expected = average_checkpoints(checkpoints, [2, 4, 6])["params"]
    # Everything frozen: the stage's final weights are exactly the weights it started from.
    frozen = (ParamGroup(pattern="*", frozen=True),)
    start = _loop(init_from=f"{tmp_path / 'src' / 'fit'}@average(last=3)", param_groups=frozen, max_steps=2)
    with run_settings(run_dir=str(tmp_path / "dst"), store=False):
        model, _ = start.run()
    ours = _by_path(eqx.filter(model.module, eqx.is_inexact_array))
    theirs = _by_path(expected)
    assert list(ours) == list(theirs) == ["layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"]
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])
    last = _by_path(average_checkpoints(checkpoints, [6])["params"])
    assert not all(np.array_equal(last[n], theirs[n]) for n in theirs)  # the mean, not just the newest

    bad = start.replace(init_from=f"{tmp_path / 'src' / 'fit'}@avrage(last=3)")
    with (
        run_settings(run_dir=str(tmp_path / "bad"), store=False),
        pytest.raises(CheckpointError, match=r"'avrage\(last=3\)' is not a checkpoint choice; write DIR, DIR@best"),
    ):
        bad.run()
