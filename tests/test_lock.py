"""One writer per run directory: a second process is refused, naming the first; a dead holder frees it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipekit_train import MSE, ArraySource, EquinoxModel, Last, TrainingDataset, TrainingLoop, run_settings
from pipekit_train._lock import RunDirectoryBusyError, run_dir_lock

HOLD = """
import sys, time, pathlib
from pipekit_train._lock import run_dir_lock
with run_dir_lock(sys.argv[1]):
    pathlib.Path(sys.argv[2]).touch()
    time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path: Path):
    """A separate process holding the lock of tmp_path/run until it is killed."""
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run"), str(ready)])
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the holder did not start"
        time.sleep(0.05)
    yield proc
    proc.kill()
    proc.wait()


def _loop(source: Any = None) -> TrainingLoop:
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    return TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 4, "depth": 1}),
        dataset=TrainingDataset(source=source or ArraySource(arrays={"x": x, "y": x[:, :1]})),
        loss=MSE(),
        max_steps=3,
        batch_size=8,
        progress=False,
    )


def test_a_second_process_is_refused_naming_the_holder(tmp_path: Path, holder: subprocess.Popen):
    busy = pytest.raises(RunDirectoryBusyError, match=rf"run directory .*run is in use by PID {holder.pid} on ")
    with busy, run_dir_lock(tmp_path / "run"):
        pass


def test_a_run_into_a_busy_directory_is_refused_before_writing_anything(tmp_path: Path, holder: subprocess.Popen):
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    with run_settings(run_dir=str(tmp_path / "run"), store=False), pytest.raises(RunDirectoryBusyError):
        _loop().run()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before == [".lock"]


def test_a_killed_holder_releases_the_lock(tmp_path: Path, holder: subprocess.Popen):
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with run_dir_lock(tmp_path / "run"):
        pass  # the kernel released the dead process's lock


def test_the_lock_is_reentrant_within_a_process(tmp_path: Path):
    with run_dir_lock(tmp_path / "r"), run_dir_lock(tmp_path / "r"):
        pass
    with run_dir_lock(tmp_path / "r"):
        pass


def _checkpoints(directory: Path) -> None:
    import jax.numpy as jnp

    from pipekit_train import Checkpointer

    with Checkpointer(directory, keep=(Last(n=2),), async_save=False) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state={"w": jnp.full((2,), float(step))}, data_iter={}, meta={})


def test_average_into_a_busy_run_directory_is_refused_naming_the_holder(
    tmp_path: Path, holder: subprocess.Popen, capsys: pytest.CaptureFixture[str]
):
    from pipekit_train.cli._main import main

    _checkpoints(tmp_path / "src")
    (tmp_path / "run" / "run.json").write_text('{"run_id": "r"}\n')
    assert main(["average", str(tmp_path / "src"), "--last", "2", "-o", str(tmp_path / "run" / "avg")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"is in use by PID {holder.pid}" in err[0], err
    assert not (tmp_path / "run" / "avg").exists()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert main(["average", str(tmp_path / "src"), "--last", "2", "-o", str(tmp_path / "run" / "avg")]) == 0
    assert (tmp_path / "run" / "avg" / "2").is_dir()


def test_reproduce_into_a_busy_run_directory_is_refused_naming_the_holder(
    tmp_path: Path, holder: subprocess.Popen, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    from pipekit_train import NpzSource
    from pipekit_train.cli._main import main

    monkeypatch.chdir(tmp_path)
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x[:, :1])
    loop = _loop(NpzSource(path="data.npz"))
    with run_settings(run_dir=str(tmp_path / "first"), store=str(tmp_path / "store.sqlite")):
        _, artifact = loop.run()
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    code = main(["reproduce", artifact.artifact_id, "--store", "store.sqlite", "--run-dir", str(tmp_path / "run")])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code != 0 and len(err) == 1 and f"is in use by PID {holder.pid}" in err[0], err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before
