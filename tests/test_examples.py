"""The example pipelines load, round-trip through YAML and pass `validate` (training them is `make demo`); the
house-price example runs end to end with a few steps."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import numpy as np
import pytest

import pipekit
from pipekit_train.stage.preflight import check_pipeline

ROOT = Path(__file__).parent.parent
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))
HOUSES = ROOT / "examples" / "houses"


def _import_example_modules(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the example's README imports with ``--import``: the house-price example's custom loss."""
    if path.parent == HOUSES:
        monkeypatch.syspath_prepend(str(HOUSES))
        importlib.import_module("house_loss")
    if path.name.endswith("_flax.yaml"):
        pytest.importorskip("flax")
        import pipekit_train

        if "flax" not in pipekit_train.available_backends():  # installed metadata older than the flax entry points
            pipekit_train.register_backend("flax", "pipekit_train.adapters.flax:backend")
            importlib.import_module("pipekit_train.adapters.flax")  # the FlaxModel operator type


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_round_trips_and_validates(path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(ROOT)  # examples name their data relative to the repository root
    _import_example_modules(path, monkeypatch)
    op = pipekit.load(path)
    assert pipekit.loads(pipekit.dumps(op)) == op
    if type(op).__name__ == "TrainingDataset":  # a data file for `evaluate --data` / `predict --data`
        assert op.num_records() > 0
        return
    if type(op).__name__ == "Sweep":  # every trial pre-flighted, its pipeline file read relative to it
        from pipekit_train.sweep import load_sweep
        from pipekit_train.sweep._plan import preflight

        sweep = load_sweep(str(path))
        assert len(preflight(sweep, sweep.pipeline)) > 0
        assert "training stage" in check_pipeline(sweep.pipeline)
        return
    assert "training stage" in check_pipeline(op)


def test_demo_pipeline_threads_pretrain_into_finetune():
    op = pipekit.load(ROOT / "examples/digits/pretrain_finetune.yaml")
    pretrain, finetune = op.stages
    assert finetune.transfer.paths == {"encoder": "encoder"}
    assert finetune.dataset.source.kwargs["label_fraction"] == 0.1
    # A denoising autoencoder: noisy images in `x`, the clean ones in `x_clean` as the target (docs/recipes.md).
    assert pretrain.target_key == "x_clean" and type(pretrain.dataset.transforms[0]).__name__ == "GaussianNoise"


def test_houses_csv_is_what_make_data_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(HOUSES))
    make_data = importlib.import_module("make_data")
    monkeypatch.setattr(make_data, "HERE", str(tmp_path))
    make_data.main()
    assert (tmp_path / "houses.csv").read_bytes() == (HOUSES / "houses.csv").read_bytes()


def test_houses_example_runs_evaluates_and_predicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """The README's commands, with a few steps per stage: the custom loss comes from ``--import``, and evaluate,
    predict and the stage's own test metrics agree, in thousands (the data's units), not standard units. The
    commands run in this process (``cli.main``): `house_loss` is found on the path as the README's PYTHONPATH finds
    it (tests/cli/test_imports.py runs ``--import`` in real processes)."""
    from pipekit_train import ArtifactStore
    from pipekit_train.cli import main

    store = tmp_path / "houses.sqlite"
    monkeypatch.syspath_prepend(str(HOUSES))
    monkeypatch.chdir(ROOT)
    steps = ["--set", "stages.0.max_steps=60", "--set", "stages.1.max_steps=30"]
    steps += [f"--set=stages.{i}.{f}=10" for i in (0, 1) for f in ("eval_every_n_steps", "log_every_n_steps")]
    command = ["run", "examples/houses/houses.yaml", "--import", "house_loss"]
    code = main([*command, "--run-dir", str(tmp_path / "run"), "--store", str(store), *steps])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    finetune = next(a for a in ArtifactStore(store).query() if a.stage == "finetune")
    stats = finetune.data_statistics
    assert set(stats) == {"x", "y"} and 400 < stats["y"]["mean"][0] < 900  # city B's training prices, thousands
    out = tmp_path / "pred.npz"
    data = "examples/houses/test_b.yaml"
    prefix = finetune.artifact_id[:12]
    assert main(["evaluate", prefix, "--data", data, "--metric", "MAE", "--store", str(store), "--json"]) == 0
    assert main(["predict", prefix, "--data", data, "--output", str(out), "--store", str(store)]) == 0
    predictions = np.load(out)["predictions"][:, 0]
    prices = pipekit.load(data).arrays()["y"][:, 0]
    mae = float(np.mean(np.abs(predictions - prices)))
    # The stage's test split is test_b.yaml's rows: its test/mae, evaluate's and the predictions' agree.
    assert finetune.final_metrics["test/mae"] == pytest.approx(mae, rel=1e-4)
    evaluation = ArtifactStore(store).evaluations(artifact_id=finetune.artifact_id)[0]
    assert evaluation["metrics"]["mae"] == pytest.approx(mae, rel=1e-4)
    assert mae < 0.5 * float(np.std(prices))  # learned something, in thousands
    assert re.search(r"test/mae", printed.out + printed.err)
