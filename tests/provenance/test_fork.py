"""Forks: ``run --fork RUN_DIR@STEP`` starts a new run from a committed checkpoint of another (weights, optimizer
state, data position) under a changed configuration; the artifact records the lineage edge; ``reproduce`` of the
fork retrains the parent, then the fork, bitwise.

The commands run in this process (``cli.main``): a process boundary is not what is tested here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipekit_train.cli._main import main
from pipekit_train.provenance._store import ArtifactStore

PIPELINE = """\
pipekit: 1
type: TrainingLoop
name: fit
model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 8, depth: 1}}
dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}, shuffle: true}
loss: {type: MSE}
optimizer_config: {name: adam, lr: 0.01}
max_steps: 6
batch_size: 8
progress: false
callbacks: [{type: Checkpoint, every_n_steps: 2, async_save: false, keep: [{type: Last, n: 3}]}]
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    (tmp_path / "pipe.yaml").write_text(PIPELINE)
    return tmp_path


def _last(store: ArtifactStore, run_dir: Path):
    """The one artifact the run in `run_dir` recorded (found by its run directory, not by the store's time order:
    two records made within the same instant tie)."""
    mine = [a for a in store.query() if a.run_dir and Path(a.run_dir).resolve().is_relative_to(run_dir.resolve())]
    assert len(mine) == 1, f"expected one artifact recorded for {run_dir}, got {len(mine)}"
    return mine[0]


def test_fork_changes_lr_records_the_edge_and_reproduces_bitwise(project: Path, capsys):
    store = ArtifactStore(project / "s.sqlite")
    common = ["--store", str(store.path)]
    assert main(["run", "pipe.yaml", "--run-dir", "P", *common]) == 0
    parent = _last(store, project / "P")

    # A fork that changes nothing continues the parent exactly: the same weights, bitwise.
    assert main(["run", "pipe.yaml", "--fork", "P@4", "--run-dir", "same", *common]) == 0
    same = _last(store, project / "same")
    assert same.trained_model_hash == parent.trained_model_hash
    assert same.fork["config_diff"] == "" and same.parent_ids == (parent.artifact_id,)

    # Refused before training: a place that is not RUN_DIR@STEP, with --resume auto, a step with no committed
    # checkpoint (naming the nearest); when the checkpoint is read: a changed model.
    capsys.readouterr()
    assert main(["run", "pipe.yaml", "--fork", "P", "--run-dir", "bad", *common]) == 2
    assert "--fork 'P': expected RUN_DIR@STEP or RUN_DIR/STAGE@STEP" in capsys.readouterr().err
    assert main(["run", "pipe.yaml", "--fork", "P@4", "--run-dir", "P", "--resume", "auto", *common]) == 2
    assert "--fork starts a new run" in capsys.readouterr().err
    assert main(["run", "pipe.yaml", "--fork", "P@3", "--run-dir", "bad", *common]) != 0
    err = capsys.readouterr().err
    assert "no committed checkpoint at step 3; the nearest committed steps: 2, 4" in err, err
    args = ["--set", "model_op.kwargs.width_size=16", "--run-dir", "wide"]
    assert main(["run", "pipe.yaml", "--fork", "P@4", *args, *common]) != 0
    err = capsys.readouterr().err
    assert "does not fit stage 'fit' (shape of " in err and "this model (16, 4), and 8 more)" in err, err
    assert "not the model's structure" in err and len(err.strip().splitlines()) == 1, err

    # The fork with another learning rate: its own weights, the edge (parent, step, config diff) recorded.
    args = ["--set", "optimizer_config.lr=0.05", "--run-dir", "F"]
    assert main(["run", "pipe.yaml", "--fork", str(project / "P" / "fit") + "@4", *args, *common]) == 0
    fork = _last(store, project / "F")
    assert fork.trained_model_hash != parent.trained_model_hash
    assert fork.parent_ids == (parent.artifact_id,)
    edge = fork.fork
    assert (edge["run_dir"], edge["stage"], edge["step"]) == (str(project / "P"), "fit", 4)
    assert edge["parent_artifact"] == parent.artifact_id
    changed = [x for x in edge["config_diff"].splitlines() if x[:1] in "+-" and x[:3] not in ("+++", "---")]
    assert [x.replace(" ", "") for x in changed] == ["-lr:0.01", "+lr:0.05"], edge["config_diff"]
    assert fork.backend_info["steps"] == 6

    capsys.readouterr()
    assert main(["artifacts", "lineage", fork.artifact_id[:12], "--store", str(store.path)]) == 0
    out = capsys.readouterr().out
    assert f"{parent.artifact_id[:12]}  fit" in out and "(fork of fit@4)" in out
    assert (
        f"fork {fork.artifact_id[:12]}: started from {project / 'P'}/fit@4 (artifact {parent.artifact_id[:12]})" in out
    )
    assert [x.strip() for x in out.splitlines() if "lr:" in x] == [x.strip() for x in changed]

    # reproduce retrains the parent, then the fork from the new parent's step-4 checkpoint: bitwise.
    assert main(["reproduce", fork.artifact_id[:12], "--run-dir", "again", *common]) == 0
    out = capsys.readouterr().out
    assert f"reproducing the parent {parent.artifact_id[:12]} of fork {fork.artifact_id[:12]} first" in out
    assert f"trained weights match the recorded ones ({fork.trained_model_hash})" in out, out
    again = _last(store, project / "again")
    assert again.fork["step"] == 4 and again.fork["run_dir"] == str(project / "again.parent")
    assert again.fork["config_diff"] == edge["config_diff"]
