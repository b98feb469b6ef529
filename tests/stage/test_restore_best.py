"""`restore_best`: the stage returns the best checkpoint's weights, and records that step's metrics.

The artifact's `final_metrics` (what the summary prints, sweeps optimise and ``artifacts query`` ranks by) describe
the model the stage returns and registers; `restored` names the step and keeps the last step's metrics.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tests.stage.test_stop_path import _X, _Y, CALLBACKS, TermAt, _loop, _run

from pipekit_train import NpzSource, TrainingDataset
from pipekit_train.inference import evaluate
from pipekit_train.provenance import ArtifactStore

pytestmark = pytest.mark.xdist_group("stop-path")


def test_evaluate_of_a_restored_artifact_gives_its_recorded_validation_metrics(tmp_path, capsys):
    np.savez(tmp_path / "train.npz", x=_X[:128], y=_Y[:128])
    np.savez(tmp_path / "val.npz", x=_X[128:192], y=_Y[128:192])
    loop = _loop("equinox", CALLBACKS["all"]).replace(
        dataset=TrainingDataset(source=NpzSource(path=str(tmp_path / "train.npz"))),
        val_dataset=TrainingDataset(source=NpzSource(path=str(tmp_path / "val.npz"))),
    )
    loop = loop.replace(callbacks=tuple(c for c in loop.callbacks if not isinstance(c, TermAt)))  # YAML-able
    _, returned = _run(loop, tmp_path / "run")
    artifact = json.loads((tmp_path / "run" / "stage0" / "artifact.json").read_text())
    restored, metrics = artifact["restored"], artifact["final_metrics"]
    manifest = json.loads((tmp_path / "run" / "stage0" / "checkpoints" / "manifest.json").read_text())
    best = min((e for e in manifest["entries"] if e["score"] is not None), key=lambda e: (e["score"], e["step"]))
    # The best checkpoint is not the last step's here, so the two sets of metrics differ.
    assert restored["from"] == "best" and restored["step"] == best["step"] != restored["last_step"] == 48
    assert metrics["validate/loss"] == best["score"] == restored["score"]
    assert restored["last_metrics"]["validate/loss"] != metrics["validate/loss"]
    assert returned.final_metrics == metrics
    # The registered model, evaluated on the validation split, scores what the artifact says.
    store = ArtifactStore(str(tmp_path / "run" / "store.sqlite"))
    evaluation = evaluate(artifact["artifact_id"], tmp_path / "val.npz", batch_size=16, store=store)
    for name in ("loss", "accuracy"):
        assert evaluation.metrics[name] == pytest.approx(metrics[f"validate/{name}"], rel=1e-6, abs=1e-7), name
    # What the store ranks by is the returned model's score.
    with store:
        recorded = store.get(artifact["artifact_id"])
    assert recorded.final_metrics["validate/loss"] == best["score"]
    assert recorded.restored == restored
    # `artifacts show` says which step the metrics are.
    from pipekit_train.cli._main import main

    assert main(["artifacts", "show", artifact["artifact_id"], "--store", str(tmp_path / "run" / "store.sqlite")]) == 0
    shown = capsys.readouterr().out
    assert f"restored   the best checkpoint, step {best['step']}, validate/loss" in shown
