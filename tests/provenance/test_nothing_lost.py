"""A store that can't be written loses nothing: refused before training, or recorded afterwards by
``artifacts import``; a crash between final.json and the store insert is healed by the resume."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipekit_train import (
    MSE,
    ArraySource,
    ArtifactStore,
    ArtifactStoreError,
    Callback,
    EquinoxModel,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)
from pipekit_train.cli import main


def _loop(**overrides: Any) -> TrainingLoop:
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    fields: dict[str, Any] = dict(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 4, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": x, "y": x[:, :1]})),
        loss=MSE(),
        max_steps=3,
        batch_size=8,
        progress=False,
        name="s",
    )
    fields.update(overrides)
    return TrainingLoop(**fields)


def test_a_store_that_cannot_be_written_is_refused_before_training(tmp_path: Path):
    (tmp_path / "not-a-dir").write_text("a file where the store's folder should be")
    with (
        run_settings(run_dir=str(tmp_path / "r"), store=str(tmp_path / "not-a-dir" / "a.sqlite")),
        pytest.raises(ArtifactStoreError, match=r"cannot be written .*; nothing was trained"),
    ):
        _loop().run()
    assert not (tmp_path / "r").exists()


class BreakStore(Callback, register=False):
    """Makes the store's folder unusable once training is over (a disk unmounted, a permission changed)."""

    folder: str = ""

    def on_train_end(self, ctx: Any) -> None:
        shutil.move(self.folder, self.folder + ".away")
        Path(self.folder).write_text("no longer a folder")

    def fingerprint(self) -> None:
        return None


def test_a_store_failing_after_training_loses_nothing_and_import_records_it(tmp_path: Path, capsys):
    folder = tmp_path / "store"
    store_path = folder / "a.sqlite"
    with (
        run_settings(run_dir=str(tmp_path / "r"), store=str(store_path)),
        pytest.raises(
            ArtifactStoreError, match=r"stage 's' finished .* record it afterwards with pipekit-train artifacts import"
        ),
    ):
        _loop(callbacks=(BreakStore(folder=str(folder)),)).run()
    assert (tmp_path / "r" / "s" / "final.json").exists() and (tmp_path / "r" / "s" / "artifact.json").exists()
    os.remove(folder)
    shutil.move(str(folder) + ".away", folder)
    assert main(["artifacts", "import", str(tmp_path / "r"), "--store", str(store_path)]) == 0
    assert "1 artifact(s)" in capsys.readouterr().out
    (recorded,) = ArtifactStore(store_path).query()
    assert recorded.stage == "s" and recorded.status == "completed"
    assert main(["artifacts", "import", str(tmp_path / "r"), "--store", str(store_path)]) == 0  # idempotent
    assert len(ArtifactStore(store_path).query()) == 1


def test_a_finished_stage_missing_from_the_store_is_recorded_by_the_resume(tmp_path: Path):
    # As if the process died after final.json and before the store insert.
    with run_settings(run_dir=str(tmp_path / "r"), store=False):
        _, artifact = _loop().run()
    store_path = tmp_path / "a.sqlite"
    with run_settings(run_dir=str(tmp_path / "r"), store=str(store_path), resume="auto"):
        _, again = _loop().run()
    assert again.artifact_id == artifact.artifact_id  # not trained, not recorded twice
    assert [a.artifact_id for a in ArtifactStore(store_path).query()] == [artifact.artifact_id]
