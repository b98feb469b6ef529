"""``--fork`` of a stage whose checkpoints live in its own ``checkpoint_dir`` (not ``STAGE/checkpoints``): the
fork finds them through the stage's recorded configuration. The reference NumPy backend trains (no compile)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from pipekit_train.cli._main import main
from pipekit_train.provenance._store import ArtifactStore

BACKENDS = str(Path(__file__).resolve().parents[1] / "backends")

PIPELINE = """\
pipekit: 1
type: TrainingLoop
name: fit
model_op: {type: NumpyLinear, in_size: 3}
dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}, shuffle: true}
loss: {type: MSE}
optimizer_config: {name: sgd, lr: 0.05, momentum: 0.9}
max_steps: 6
batch_size: 8
progress: false
checkpoint_dir: elsewhere/fit-checkpoints
callbacks: [{type: Checkpoint, every_n_steps: 2, async_save: false, keep: [{type: Last, n: 3}]}]
"""


def test_a_stage_with_its_own_checkpoint_dir_is_forked_from_there(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(BACKENDS)
    import numpy_linear  # noqa: F401  # registers the backend, as --import numpy_linear would

    rng = np.random.default_rng(0)
    x = rng.normal(size=(24, 3)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    (tmp_path / "pipe.yaml").write_text(PIPELINE)
    store = tmp_path / "store.db"
    common = ["--store", str(store)]
    assert main(["run", "pipe.yaml", "--run-dir", "P", *common]) == 0
    assert not (tmp_path / "P" / "fit" / "checkpoints").exists()
    assert sorted(p.name for p in (tmp_path / "elsewhere" / "fit-checkpoints").iterdir() if p.name.isdigit()) == [
        "2", "4", "6"
    ]  # fmt: skip
    # The same checkpoint_dir for the fork would write among the parent's steps: refused before anything runs.
    assert main(["run", "pipe.yaml", "--fork", "P@4", "--run-dir", "X", *common]) == 2
    err = capsys.readouterr().err
    assert "the fork's first stage would write its checkpoints into the parent's folder" in err
    assert "--set checkpoint_dir=PATH" in err and not (tmp_path / "X").exists()
    # Both spellings find the stage's own folder; a fork that changes nothing continues the parent exactly.
    for spec, run_dir in (("P@4", "F"), ("P/fit@2", "G")):
        args = ["--fork", spec, "--run-dir", run_dir, "--set", f"checkpoint_dir={run_dir}-checkpoints", *common]
        assert main(["run", "pipe.yaml", *args]) == 0, capsys.readouterr().err
    records = {Path(a.run_dir).parent.name: a for a in ArtifactStore(store).query()}
    parent, fork = records["P"], records["F"]
    assert fork.fork["step"] == 4 and fork.parent_ids == (parent.artifact_id,)
    assert fork.trained_model_hash == parent.trained_model_hash == records["G"].trained_model_hash
    # A step that is not there names the nearest ones in that folder.
    assert main(["run", "pipe.yaml", "--fork", "P@3", "--run-dir", "H", "--set", "checkpoint_dir=h", *common]) == 2
    assert "no committed checkpoint at step 3; the nearest committed steps: 2, 4" in capsys.readouterr().err
    assert "numpy_linear" in sys.modules
