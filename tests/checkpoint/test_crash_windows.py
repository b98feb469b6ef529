"""Crash windows around a checkpoint's commit: a step that committed but never reached the manifest."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import pytest

from pipekit_train import Checkpointer, Last, PipekitTrainWarning
from pipekit_train.checkpoint import list_runs


def _saved(directory: Path) -> None:
    with Checkpointer(directory, keep=(Last(n=3),), async_save=False) as ckpt:
        for step in (10, 20):
            ckpt.save(step, state={"w": jnp.full(3, step)}, data_iter={"i": step}, meta={"run_id": "r", "stage": "s"})


def _forget(directory: Path, step: int) -> None:
    """What a kill between the commit of `step` and the manifest update leaves behind."""
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["entries"] = [e for e in manifest["entries"] if e["step"] != step]
    (directory / "manifest.json").write_text(json.dumps(manifest))


def test_runs_reports_a_committed_step_the_manifest_missed(tmp_path: Path):
    _saved(tmp_path / "ck")
    _forget(tmp_path / "ck", 20)
    (row,) = list_runs(tmp_path)
    assert row["latest_step"] == 20 and row["steps"] == [10, 20]


def test_opening_the_directory_lists_the_step_again_and_says_so(tmp_path: Path):
    _saved(tmp_path / "ck")
    _forget(tmp_path / "ck", 20)
    with pytest.warns(PipekitTrainWarning, match=r"step\(s\) \[20\] were committed but missing from manifest.json"):
        ckpt = Checkpointer(tmp_path / "ck", keep=(Last(n=3),), async_save=False)
    with ckpt:
        assert ckpt.latest_step() == 20
    listed = [e["step"] for e in json.loads((tmp_path / "ck" / "manifest.json").read_text())["entries"]]
    assert listed == [10, 20]


def test_a_damaged_record_of_an_unlisted_step_is_ignored_not_trusted(tmp_path: Path):
    _saved(tmp_path / "ck")
    _forget(tmp_path / "ck", 20)
    record = tmp_path / "ck" / "20" / "meta.json"  # the record, in the default (flat) layout
    record.write_text(record.read_text().replace('"run_id": "r"', '"run_id": "x"'))
    (row,) = list_runs(tmp_path)
    assert row["steps"] == [10]
