"""`extend` of a Flax stage: a constant rate continues exactly; a cosine schedule that ended continues as a
recorded new segment (the `schedule_segment` capability), its rates those of the schedule over the new steps."""

from __future__ import annotations

import json

import numpy as np
import pytest

import pipekit_train
from pipekit_train import Checkpoint, Last, TrainingLoop, run_settings
from pipekit_train.data import NpzSource, TrainingDataset
from pipekit_train.losses import MSE
from pipekit_train.stage import extend

pytest.importorskip("flax")
if "flax" not in pipekit_train.available_backends():  # installed metadata older than the flax entry point
    pipekit_train.register_backend("flax", "pipekit_train.adapters.flax:backend")


def _loop(max_steps: int, **optimizer) -> TrainingLoop:
    from pipekit_train.adapters.flax import FlaxModel

    return TrainingLoop(
        model_op=FlaxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=TrainingDataset(source=NpzSource(path="xy.npz"), shuffle=True),
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 1e-2, **optimizer},
        backend="flax",
        batch_size=16,
        max_steps=max_steps,
        log_every_n_steps=4,
        callbacks=(Checkpoint(every_n_steps=8, keep=(Last(n=1),), async_save=False),),
        progress=False,
        seed=0,
        name="fit",
    )


def test_a_flax_stage_extends_exactly_or_as_a_new_schedule_segment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x = np.random.default_rng(1).normal(size=(64, 3)).astype(np.float32)
    np.savez("xy.npz", x=x, y=x @ np.array([[1.0], [-2.0], [0.5]], np.float32))
    # A constant rate: 12 steps extended by 8 are the 20-step stage's weights, bitwise.
    with run_settings(run_dir=str(tmp_path / "c"), store=False):
        _loop(12).run()
    extended, _ = extend(str(tmp_path / "c"), "fit", 8, store=False)
    with run_settings(run_dir=str(tmp_path / "long"), store=False):
        longer, _ = _loop(20).run()
    assert extended.weights_hash() == longer.weights_hash()
    # A cosine over max_steps ended with the stage: continued as a new segment over the 8 new steps.
    run = tmp_path / "cos"
    with run_settings(run_dir=str(run), store=False):
        _loop(12, schedule="warmup_cosine").run()
    model, artifact = extend(str(run), "fit", 8, store=False, new_segment=True)
    assert artifact.user["extension"]["new_segment"] is True and artifact.user["extension"]["exact"] is False
    records = [json.loads(line) for line in (run / "fit-extend1" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if r.get("context") == "train" and "lr" in r]
    assert lrs == [pytest.approx(5e-3, rel=1e-5), 0.0]  # halfway through the new segment at 16, its end at 20
    ended = json.loads((run / "fit" / "artifact.json").read_text())["trained_model_hash"]
    assert model.weights_hash() != ended
