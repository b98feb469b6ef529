"""The newest checkpoint never committed (a crash during its save): the resume says which step it skips and why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipekit_train import (
    MSE,
    ArraySource,
    Callback,
    Checkpoint,
    EquinoxModel,
    Last,
    PipekitTrainWarning,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)

X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)


class StopAt(Callback, register=False):
    step: int = 12

    def on_step_end(self, ctx: Any, metrics: Any) -> None:
        if ctx.step == self.step:
            ctx.request_stop("test")

    def fingerprint(self) -> None:
        return None


def _loop(*callbacks: Callback) -> TrainingLoop:
    return TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 4, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": X, "y": X[:, :1]})),
        loss=MSE(),
        max_steps=20,
        batch_size=8,
        progress=False,
        name="s",
        callbacks=(Checkpoint(every_n_steps=4, keep=(Last(n=5),), async_save=False), *callbacks),
    )


def test_an_uncommitted_newest_step_is_named_set_aside_and_rewritten(tmp_path: Path):
    with run_settings(run_dir=str(tmp_path / "r"), store=False):
        full, _ = _loop().run()
    with run_settings(run_dir=str(tmp_path / "p"), store=False):
        _loop(StopAt()).run()
    checkpoints = tmp_path / "p" / "s" / "checkpoints"
    (checkpoints / "12" / "commit_success.txt").unlink()  # as if killed while step 12 was being deleted
    with (
        run_settings(run_dir=str(tmp_path / "p"), store=False, resume="auto"),
        pytest.warns(
            PipekitTrainWarning,
            match=r"checkpoint of step 12 .* never committed \(missing commit_success.txt\); "
            r"resuming from step 8",
        ),
    ):
        resumed, _ = _loop().run()
    assert resumed.weights_hash() == full.weights_hash()
    assert [p.name for p in checkpoints.glob("12.uncommitted-*")]
