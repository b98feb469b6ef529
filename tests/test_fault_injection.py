"""Fault injection: damage one file a finished run wrote, then resume / restore / load / show it.

Each case copies one tiny trained run (two committed checkpoints, a registered model, an artifact store), damages
one file (truncated, one bit flipped, deleted, garbage, valid JSON of the wrong shape) and asserts that the command
reading it either fails with one line that names the file (exit code 1, no traceback) or recovers bitwise (the same
final weights as the undamaged run) -- never silently succeeds with something else. The commands that train run
in this process (`_cli_here`), ``artifacts show`` in a real one.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import warnings
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.xdist_group("fault-injection")  # one worker: the module fixture is built once

PIPELINE = """\
pipekit: 1
type: Sequential
stages:
- type: TrainingLoop
  name: fit
  model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 8, depth: 1}}
  dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}
  loss: {type: MSE}
  optimizer_config: {name: adam, lr: 1e-2}
  max_steps: 6
  batch_size: 8
  log_every_n_steps: 2
  callbacks:
  - {type: Checkpoint, every_n_steps: 3, async_save: false, keep: [{type: Last, n: 2}]}
"""


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``pipekit-train ARGS`` run by a real process (for the commands that need no JAX: cheap to start)."""
    return subprocess.run(
        [sys.executable, "-m", "pipekit_train.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def _cli_here(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``pipekit-train ARGS`` run in this process (``cli.main``: the command's whole path but the interpreter's start),
    reported as a finished process would be: its exit code, stdout, and stderr with the warnings it printed.

    The commands that train (run, resume) run here: a fresh process would import JAX and load or compile the step
    programs again for each case, most of this module's time, and the process boundary is not what these cases test
    (``python -m pipekit_train.cli`` is ``sys.exit(main())``; the installed command's one-line errors are tested in
    tests/cli/test_main.py). Warnings are shown as the command line shows them, not raised as the test settings do:
    ``error::PipekitTrainWarning`` would turn a repair that warns into a failure of the command.
    """
    from pipekit_train.cli._main import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with warnings.catch_warnings(record=True) as shown, redirect_stdout(out), redirect_stderr(err):
            warnings.simplefilter("default")
            code = main(list(args))
    finally:
        os.chdir(here)
    printed = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in shown)
    return subprocess.CompletedProcess(["pipekit-train", *args], code, out.getvalue(), printed + err.getvalue())


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    np.savez(root / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    (root / "pipe.yaml").write_text(PIPELINE)
    out = _cli_here("run", "pipe.yaml", "--run-dir", "run", "--store", "store.sqlite", cwd=root)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (root / "run/fit/checkpoints").iterdir() if p.is_dir()) == ["3", "6"]
    return root


@pytest.fixture
def work(trained: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "w"
    shutil.copytree(trained, dest)
    (dest / "run/.lock").unlink(missing_ok=True)
    return dest


def _final_hash(root: Path) -> str:
    return json.loads((root / "run/fit/final.json").read_text())["model_uri"].split("?")[0]


# Damage ----------------------------------------------------------------------------------------------------
def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _delete(path: Path) -> None:
    path.unlink()


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x00\xffnot what was written\x9c" * 8)


def _wrong_shape(path: Path) -> None:
    path.write_text('["valid", "JSON", "of the wrong shape"]\n')


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncate": _truncate,
    "flip": _flip,
    "delete": _delete,
    "garbage": _garbage,
    "wrong-shape": _wrong_shape,
}


def _registry_file(name: str) -> Callable[[Path], Path]:
    return lambda root: next((root / "run/models/sha256").iterdir()) / name


def _assert_detected_or_recovered(
    out: subprocess.CompletedProcess[str], names: tuple[str, ...], expected: str, root: Path
):
    assert "Traceback" not in out.stderr, out.stderr
    if out.returncode == 0:
        assert _final_hash(root) == expected, "exit 0 with other weights: a silent failure"
        print(f"OUTCOME {names[0]}: recovered")
        return
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, out.stderr
    assert any(name in errors[0] for name in names), errors[0]
    print(f"OUTCOME {names[0]}: detected")


# A finished run resumed: run.json, final.json, artifact.json, the registered model ------------------------
# One damage per file through the CLI; tests/reliability/test_corruption_matrix.py tries the others in-process.
FINISHED = [
    ("run.json", lambda r: r / "run/run.json", ("flip",)),
    ("final.json", lambda r: r / "run/fit/final.json", ("truncate",)),
    ("artifact.json", lambda r: r / "run/fit/artifact.json", ("garbage",)),
    ("meta.json", _registry_file("meta.json"), ("wrong-shape",)),
    ("weights.npz", _registry_file("weights.npz"), ("flip",)),
]


@pytest.mark.parametrize(
    "name,where,damage",
    [pytest.param(name, where, damage) for name, where, damages in FINISHED for damage in damages],
    ids=[f"{name}-{damage}" for name, _, damages in FINISHED for damage in damages],
)
def test_resume_of_a_finished_run(work: Path, name: str, where: Callable[[Path], Path], damage: str):
    expected = _final_hash(work)
    path = where(work)
    DAMAGE[damage](path)
    out = _cli_here("run", "pipe.yaml", "--run-dir", "run", "--resume", "auto", "--no-store", cwd=work)
    _assert_detected_or_recovered(out, (name, str(path.relative_to(work))), expected, work)


# An interrupted run resumed from its checkpoints (final.json gone: it stopped after the last commit) --------
CHECKPOINT = [  # the default (flat) layout; the matrix also covers the orbax one
    ("meta.json", lambda r: r / "run/fit/checkpoints/6/meta.json", ("wrong-shape",)),
    ("commit_success.txt", lambda r: r / "run/fit/checkpoints/6/commit_success.txt", ("delete",)),
    ("state.bin", lambda r: r / "run/fit/checkpoints/6/state.bin", ("flip",)),
    ("manifest.json", lambda r: r / "run/fit/checkpoints/manifest.json", ("garbage",)),
]


@pytest.mark.parametrize(
    "name,where,damage",
    [(name, where, damage) for name, where, damages in CHECKPOINT for damage in damages],
    ids=[f"{name}-{damage}" for name, _, damages in CHECKPOINT for damage in damages],
)
def test_resume_from_a_damaged_checkpoint(work: Path, name: str, where: Callable[[Path], Path], damage: str):
    expected = _final_hash(work)
    for end in ("final.json", "artifact.json"):  # as if stopped before the stage recorded its end
        (work / "run/fit" / end).unlink()
    path = where(work)
    DAMAGE[damage](path)
    out = _cli_here("run", "pipe.yaml", "--run-dir", "run", "--resume", "auto", "--no-store", cwd=work)
    names = (name, str(path.relative_to(work)), "checkpoints/6")
    _assert_detected_or_recovered(out, names, expected, work)


# load_model on a damaged registry entry (in-process) -------------------------------------------------------
@pytest.mark.parametrize(
    "name,damage",
    [
        ("meta.json", "truncate"),
        ("meta.json", "wrong-shape"),
        ("weights.npz", "flip"),
        ("weights.npz", "garbage"),
        ("architecture.yaml", "flip"),
        ("architecture.yaml", "delete"),
    ],
)
def test_load_model_of_a_damaged_entry_names_the_file(work: Path, name: str, damage: str):
    from pipekit_train.provenance import ModelRegistryError, load_model

    final = json.loads((work / "run/fit/final.json").read_text())
    uri = final["model_uri"].split("?")[0]
    path = _registry_file(name)(work)
    DAMAGE[damage](path)
    with pytest.raises(ModelRegistryError) as info:
        load_model(uri, work / "run/models")
    assert str(path) in str(info.value) or (damage == "delete" and name in str(info.value))


# artifacts show on a damaged store -------------------------------------------------------------------------
def _flip_dataset_hash(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        artifact_id, record = conn.execute("SELECT artifact_id, record FROM artifacts").fetchone()
        data = json.loads(record)
        at = record.index(data["dataset_hash"]) + 10
        conn.execute(
            "UPDATE artifacts SET record = ? WHERE artifact_id = ?",
            (record[:at] + chr(ord(record[at]) ^ 1) + record[at + 1 :], artifact_id),
        )


def _checkpointed(path: Path) -> Path:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path


@pytest.mark.parametrize("damage", ["record-bit", "truncate", "garbage", "delete"])
def test_artifacts_show_on_a_damaged_store(work: Path, damage: str):
    store = work / "store.sqlite"
    artifact_id = json.loads((work / "run/fit/artifact.json").read_text())["artifact_id"]
    if damage == "record-bit":
        _flip_dataset_hash(store)
    else:
        DAMAGE[damage](_checkpointed(store))
    out = _cli("artifacts", "show", artifact_id[:12], "--store", "store.sqlite", cwd=work)
    # A store that is not there is a path to correct (2); one that is there but damaged is a failure (1).
    code = 2 if damage == "delete" else 1
    assert out.returncode == code and out.stdout == "" and "Traceback" not in out.stderr, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "store.sqlite" in lines[0], out.stderr
    if damage == "record-bit":
        assert artifact_id in lines[0] and "artifacts import" in lines[0]
