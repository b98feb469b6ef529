"""Crash windows around a checkpoint's commit: a step that committed but never reached the manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tests import _forked

from pipekit_train import Checkpointer, Last, PipekitTrainWarning, run_settings
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


# A real process SIGKILLs itself once the manifest listing step 20 (and no longer step 10, which Last(n=1) drops) is
# written, before step 10 is deleted: the window between the manifest update and the retention's deletions.
KILLED_BEFORE_THE_DELETION = """\
import os, signal, sys
import numpy as np
import pipekit_train.checkpoint._retention as retention
from pipekit_train import Checkpointer, Last

def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
retention.retire = retention._delete_step = killed
with Checkpointer(sys.argv[1], keep=(Last(n=1),), async_save=False) as ckpt:
    for step in (10, 20):
        ckpt.save(step, state={"w": np.full(3, step, np.float32)}, data_iter={"i": step}, meta={})
"""


def test_a_kill_between_the_manifest_and_the_retention_names_that_cause(tmp_path: Path):
    killed = _forked.run(
        [sys.executable, "-c", KILLED_BEFORE_THE_DELETION, str(tmp_path / "ck")],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr.decode()
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert [e["step"] for e in manifest["entries"]] == [20] and manifest["dropping"] == [10]
    assert (tmp_path / "ck" / "10" / "commit_success.txt").exists()
    with pytest.warns(PipekitTrainWarning) as seen:
        ckpt = Checkpointer(tmp_path / "ck", keep=(Last(n=1),), async_save=False)
    (message,) = [str(w.message) for w in seen]
    assert message == (
        f"{tmp_path / 'ck'}: step(s) [10] were dropped by the retention policy (keep) but are still on disk (a stop "
        "after manifest.json was updated, before they were deleted); listed again until keep deletes them (a resumed "
        "run does so once its checkpoint is accepted)"
    )
    with ckpt:
        assert ckpt.steps() == [10, 20] and ckpt.prune() == [10] and ckpt.steps() == [20]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.isdigit()) == ["20"]


def test_a_save_stopped_before_its_manifest_update_is_named_as_such(tmp_path: Path):
    _saved(tmp_path / "ck")
    _forget(tmp_path / "ck", 20)
    with pytest.warns(PipekitTrainWarning, match=r"\[20\] were committed but missing from manifest.json \(a stop right "
                      r"after the save, before the manifest was updated\)"):  # fmt: skip
        Checkpointer(tmp_path / "ck", keep=(Last(n=3),), async_save=False).close()
    (tmp_path / "ck" / "manifest.json").unlink()
    no_manifest = r"\(there was no readable manifest.json: deleted, damaged, or a stop before its first write\)"
    missing = rf"\[10, 20\] were committed but missing from manifest.json {no_manifest}"
    with pytest.warns(PipekitTrainWarning, match=missing):
        Checkpointer(tmp_path / "ck", keep=(Last(n=3),), async_save=False).close()


@pytest.mark.parametrize(("layout", "marker"), [("flat", "commit_success.txt"), ("orbax", "_CHECKPOINT_METADATA")])
def test_restore_latest_names_a_newer_step_whose_commit_marker_is_gone(tmp_path: Path, layout: str, marker: str):
    with Checkpointer(tmp_path / "ck", keep=(Last(n=3),), async_save=False, layout=layout) as ckpt:
        for step in (10, 20):
            ckpt.save(step, state={"w": jnp.full(3, step)}, data_iter={"i": step}, meta={})
    (tmp_path / "ck" / "20" / marker).unlink()
    with (
        Checkpointer(tmp_path / "ck", keep=(Last(n=3),), async_save=False) as ckpt,
        pytest.warns(
            PipekitTrainWarning,
            match=rf"the checkpoint of step 20 in {tmp_path / 'ck'} never committed \(missing {marker}\); "
            r"restoring step 10$",
        ),
    ):
        state, data_iter, _ = ckpt.restore("latest")
    assert data_iter == {"i": 10} and float(state["w"][0]) == 10.0


PIPELINE = """\
pipekit: 1
type: TrainingLoop
name: fit
model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 3, out_size: 1, width_size: 4, depth: 1}}
dataset: {type: TrainingDataset, source: {type: NpzSource, path: DATA}}
loss: {type: MSE}
max_steps: 40
batch_size: 8
progress: false
callbacks: [{type: Checkpoint, every_n_steps: 10, keep: [{type: Last, n: 1}]}]
"""

# Run the pipeline, SIGKILLed by itself once step 40 has committed, before the manifest lists it and before step 30
# is deleted: the crash window between the final commit and the rotation, hit exactly, in a real process.
KILLED_AFTER_THE_LAST_COMMIT = """\
import os, signal, sys
import pipekit
import pipekit_train
import pipekit_train.checkpoint._retention as retention

write = retention._write_manifest
def killed(directory, header, entries):
    if any(e.step == 40 for e in entries):
        os.kill(os.getpid(), signal.SIGKILL)
    write(directory, header, entries)
retention._write_manifest = killed
with pipekit_train.run_settings(run_dir=sys.argv[2], store=False):
    pipekit.loads(open(sys.argv[1]).read()).run()
"""


def test_retention_is_applied_again_when_resuming_after_a_kill_between_the_last_commit_and_the_manifest(
    tmp_path: Path, xla_cache_env: dict[str, str]
):
    import pipekit

    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x[:, :1])
    (tmp_path / "pipe.yaml").write_text(PIPELINE.replace("DATA", str(tmp_path / "data.npz")))
    (tmp_path / "killed.py").write_text(KILLED_AFTER_THE_LAST_COMMIT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **xla_cache_env}
    killed = subprocess.run(
        [sys.executable, "killed.py", "pipe.yaml", "run"], cwd=tmp_path, env=env, capture_output=True, timeout=120
    )
    assert killed.returncode == -9, killed.stderr.decode()
    checkpoints = tmp_path / "run" / "fit" / "checkpoints"
    listed = [e["step"] for e in json.loads((checkpoints / "manifest.json").read_text())["entries"]]
    assert listed == [30] and sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [30, 40]

    with run_settings(run_dir=str(tmp_path / "ref"), store=False):
        reference, _ = pipekit.loads((tmp_path / "pipe.yaml").read_text()).run()
    with (
        run_settings(run_dir=str(tmp_path / "run"), store=False, resume="auto"),
        pytest.warns(PipekitTrainWarning, match=r"step\(s\) \[40\] were committed but missing from manifest.json"),
    ):
        resumed, _ = pipekit.loads((tmp_path / "pipe.yaml").read_text()).run()
    assert resumed.weights_hash() == reference.weights_hash()
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["40"], "Last(n=1) not applied"
    assert [e["step"] for e in json.loads((checkpoints / "manifest.json").read_text())["entries"]] == [40]
