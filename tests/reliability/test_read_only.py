"""Read-only targets are refused before training, in one line naming them: the run directory, the stage's checkpoint
directory, the model folder and the artifact store.

Root ignores file permissions, so a read-only folder here is a read-only bind mount when the machine allows it
(``mount --bind`` + ``remount,ro``), else a regular file where the folder should be (nothing can be created in it
either).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipekit_train import (
    MSE,
    ArraySource,
    ArtifactStoreError,
    Callback,
    Checkpoint,
    EquinoxModel,
    Last,
    TrainingDataset,
    TrainingLoop,
    run_settings,
)
from pipekit_train._lock import DirectoryNotWritableError

X = np.random.default_rng(1).normal(size=(32, 3)).astype(np.float32)
STEPS: list[int] = []


class CountSteps(Callback, register=False):
    def on_step_end(self, ctx: Any, metrics: Any) -> None:
        STEPS.append(ctx.step)

    def fingerprint(self) -> None:
        return None


def _loop(*extra: Callback, **fields: Any) -> TrainingLoop:
    return TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 4, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": X, "y": X[:, :1]})),
        loss=MSE(),
        max_steps=4,
        batch_size=8,
        progress=False,
        name="fit",
        callbacks=(Checkpoint(every_n_steps=2, keep=(Last(n=1),), async_save=False), CountSteps(), *extra),
        **fields,
    )


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """`make(path)`: makes `path` an unwritable folder (a read-only mount, else a regular file where it should be)."""
    mounts: list[Path] = []
    can_mount = shutil.which("mount") is not None

    def make(path: Path) -> Path:
        nonlocal can_mount
        if can_mount:
            source = tmp_path / f"ro-source-{len(mounts)}"
            source.mkdir()
            path.mkdir(parents=True, exist_ok=True)
            bind = subprocess.run(["mount", "--bind", str(source), str(path)], capture_output=True)
            if bind.returncode == 0:
                mounts.append(path)
                if subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], capture_output=True).returncode == 0:
                    return path
            can_mount = False
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("a regular file where a folder should be: nothing can be created in it\n")
        return path

    yield make
    for path in reversed(mounts):
        if subprocess.run(["umount", str(path)]).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)  # busy: detach it now, free it when unused


def _refused(match: str, error: type[Exception] = DirectoryNotWritableError, **settings: Any) -> str:
    STEPS.clear()
    with run_settings(**settings), pytest.raises(error, match=match) as refused:
        _loop().run()
    assert STEPS == [], "refused only after training"
    message = str(refused.value)
    assert "\n" not in message and "nothing was trained" in message, message
    return message


def test_a_read_only_run_directory_is_refused_before_training(tmp_path: Path, read_only: Callable[[Path], Path]):
    run_dir = read_only(tmp_path / "run")
    _refused(rf"run directory {run_dir} (cannot be|is a file)", run_dir=str(run_dir), store=False)


def test_a_read_only_store_is_refused_before_training_and_writes_nothing(
    tmp_path: Path, read_only: Callable[[Path], Path]
):
    store = read_only(tmp_path / "store") / "artifacts.sqlite"
    match = r"the artifact store .*artifacts.sqlite cannot be written"
    _refused(match, ArtifactStoreError, run_dir=str(tmp_path / "run"), store=str(store))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("target", ["checkpoints", "models"])
def test_a_read_only_checkpoint_or_model_folder_is_refused_before_training(
    tmp_path: Path, read_only: Callable[[Path], Path], target: str
):
    where = tmp_path / "run" / ("fit" if target == "checkpoints" else "") / target
    path = read_only(where)
    what = "checkpoint directory" if target == "checkpoints" else "model folder"
    _refused(rf"stage 'fit': the {what} .*{path.parent.name}", run_dir=str(tmp_path / "run"), store=False)


def test_the_cli_refuses_a_read_only_run_directory_in_one_line(
    tmp_path: Path, read_only: Callable[[Path], Path], capsys: pytest.CaptureFixture[str]
):
    from pipekit_train.cli._main import main

    np.savez(tmp_path / "data.npz", x=X, y=X[:, :1])
    (tmp_path / "pipe.yaml").write_text(
        "pipekit: 1\n"
        "type: TrainingLoop\n"
        "model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 3, out_size: 1, width_size: 4, depth: 1}}\n"
        "dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}\n"
        "loss: {type: MSE}\n"
        "max_steps: 4\n"
        "batch_size: 8\n"
    )
    run_dir = read_only(tmp_path / "run")
    code = main(["run", "pipe.yaml", "--run-dir", str(run_dir), "--no-store"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and str(run_dir) in err[0], err
    assert "Traceback" not in err[0]


def test_a_read_only_register_model_registry_is_refused_in_pre_flight(
    tmp_path: Path, read_only: Callable[[Path], Path]
):
    from pipekit_train import RegisterModel
    from pipekit_train.stage import check_pipeline

    registry = read_only(tmp_path / "registry")
    loop = _loop(RegisterModel(registry=str(registry)))
    where = re.escape(str(registry))
    match = rf"stage 'fit': the model registry of RegisterModel {where} (cannot be|is a file).*RegisterModel\.registry"
    with pytest.raises(DirectoryNotWritableError, match=match):  # `pipekit-train validate` says it too
        check_pipeline(loop)
    STEPS.clear()
    with run_settings(run_dir=str(tmp_path / "run"), store=False), pytest.raises(DirectoryNotWritableError) as refused:
        loop.run()
    assert STEPS == [] and not (tmp_path / "run").exists(), "refused only after training"
    assert "\n" not in str(refused.value) and "nothing was trained" in str(refused.value)
