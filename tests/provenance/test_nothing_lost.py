"""A store that can't be written loses nothing: refused before training, or recorded afterwards by
``artifacts import``; a crash between final.json and the store insert is healed by the resume."""

from __future__ import annotations

import json
import os
import re
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
    PipekitTrainWarning,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)
from pipekit_train._jsonio import DamagedFileError
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


# A finished stage whose final.json is lost (deleted or damaged) is never trained and recorded twice ---------------
def _finished(tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    """A finished one-stage run (checkpoints at steps 2 and 3) recorded in a store; its final.json as written."""
    from pipekit_train import Checkpoint, Last

    store = tmp_path / "a.sqlite"
    with run_settings(run_dir=str(tmp_path / "r"), store=str(store)):
        _loop(callbacks=(Checkpoint(every_n_steps=2, keep=(Last(n=2),), async_save=False),)).run()
    stage = tmp_path / "r" / "s"
    return stage, store, json.loads((stage / "final.json").read_text())


def _resume(tmp_path: Path, store: Path) -> Any:
    from pipekit_train import Checkpoint, Last

    with run_settings(run_dir=str(tmp_path / "r"), store=str(store), resume="auto"):
        return _loop(callbacks=(Checkpoint(every_n_steps=2, keep=(Last(n=2),), async_save=False),)).run()[1]


@pytest.mark.parametrize("lost", ["deleted", "deleted-with-artifact.json", "damaged"])
def test_a_lost_final_json_is_restored_from_the_recorded_artifact_not_recorded_twice(tmp_path: Path, lost: str):
    stage, store, final = _finished(tmp_path)
    (recorded,) = ArtifactStore(store).query()
    record = json.loads((stage / "artifact.json").read_text())
    if lost == "damaged":
        (stage / "final.json").write_text((stage / "final.json").read_text().replace('"step": 3', '"step": 2'))
    else:
        (stage / "final.json").unlink()
    if lost == "deleted-with-artifact.json":  # then the store is where the artifact is found
        (stage / "artifact.json").unlink()
    where = re.escape(str(store)) if lost == "deleted-with-artifact.json" else "artifact.json"
    with pytest.warns(
        PipekitTrainWarning,
        match=rf"stage 's': .*final.json is (missing|damaged); restored it from artifact {recorded.artifact_id} "
        rf"\(.*{where}.*: its model is in the run's registry and its last step 3 is the latest checkpoint\)",
    ):
        again = _resume(tmp_path, store)
    assert again.artifact_id == recorded.artifact_id  # not trained again, not recorded twice
    assert [a.artifact_id for a in ArtifactStore(store).query()] == [recorded.artifact_id]
    assert json.loads((stage / "final.json").read_text()) == final
    assert json.loads((stage / "artifact.json").read_text()) == record
    assert len(list(stage.glob("final.json.damaged-*"))) == (lost == "damaged")  # the damaged file is kept


@pytest.mark.parametrize("also", ["model-gone", "checkpoint-moved"])
def test_a_lost_final_json_that_cannot_be_restored_is_refused_naming_the_artifact(tmp_path: Path, also: str):
    stage, store, _ = _finished(tmp_path)
    (recorded,) = ArtifactStore(store).query()
    (stage / "final.json").unlink()
    if also == "model-gone":
        shutil.rmtree(tmp_path / "r" / "models")
        why = r"its model is not in the run's registry \(no model"
    else:  # the last checkpoint is not the stage's end
        (stage / "checkpoints" / "3" / "commit_success.txt").unlink()
        why = r"the latest committed checkpoint in .* is step 2, not its last step 3"
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.name != ".lock")
    with pytest.raises(DamagedFileError) as refused:
        _resume(tmp_path, store)
    message = str(refused.value)
    assert "\n" not in message
    assert re.search(
        rf"final.json is missing, but stage 's' was recorded as finished: artifact {recorded.artifact_id} .*{why}.*"
        r"training it again would record it twice\. Restore final.json from a backup, or train the stage in a new "
        r"run directory \(--run-dir\)$",
        message,
    ), message
    assert [a.artifact_id for a in ArtifactStore(store).query()] == [recorded.artifact_id]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.name != ".lock") == before
