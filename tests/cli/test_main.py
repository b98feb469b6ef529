"""The `pipekit-train` command line, run as a real subprocess on a tiny pipeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests import _forked

TINY = """\
pipekit: 1
type: Sequential
stages:
- type: TrainingLoop
  name: fit
  model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 8, depth: 1}}
  dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}
  val_dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}, shuffle: false}
  loss: {type: MSE}
  optimizer_config: {name: adam, lr: 1e-2}
  max_steps: 20
  batch_size: 8
  eval_every_n_steps: 10
  log_every_n_steps: 5
"""


def _cli(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return _forked.run(
        [sys.executable, "-m", "pipekit_train.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu", **_XLA_CACHE},
    )


_XLA_CACHE: dict[str, str] = {}


@pytest.fixture(autouse=True, scope="module")
def _xla_cache(xla_cache_env: dict[str, str]) -> None:
    """The processes share the run's persistent compilation cache (tests/conftest.py): one compiles, the rest load."""
    _XLA_CACHE.update(xla_cache_env)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    (tmp_path / "pipe.yaml").write_text(TINY)
    return tmp_path


def test_run_trains_records_and_summarises(workdir: Path):
    out = _cli("run", "pipe.yaml", "--run-dir", "runs/a", "--store", "store.sqlite", cwd=workdir)
    assert out.returncode == 0, out.stderr
    assert "Summary" in out.stdout and "fit" in out.stdout and "runs/a" in out.stdout
    assert "pipekit-train artifacts lineage" in out.stdout
    records = [json.loads(line) for line in (workdir / "runs/a/fit/metrics.jsonl").read_text().splitlines()]
    assert records[-1]["type"] == "finish" and records[-1]["status"] == "completed"
    listing = _cli("artifacts", "list", "--store", "store.sqlite", "--json", cwd=workdir)
    assert listing.returncode == 0, listing.stderr
    rows = json.loads(listing.stdout)
    assert len(rows) == 1 and rows[0]["stage"] == "fit"


def test_set_overrides_and_print_config(workdir: Path):
    out = _cli(
        "run", "pipe.yaml", "--set", "stages.0.max_steps=7", "--set", "stages[0].seed=5", "--print-config", cwd=workdir
    )
    assert out.returncode == 0, out.stderr
    assert "max_steps: 7" in out.stdout and "seed: 5" in out.stdout


def test_validate_checks_without_training(workdir: Path):
    out = _cli("validate", "pipe.yaml", cwd=workdir)
    assert out.returncode == 0, out.stderr
    assert "ok (1 training stage, 20 steps in all)" in out.stdout
    assert not (workdir / "runs").exists()


def test_bad_input_is_one_line_and_exit_code_2_from_the_installed_command(workdir: Path):
    """The corpus (test_error_corpus.py) runs in-process; this is the same path through a real process."""
    (workdir / "pipe.yaml").write_text(TINY.replace("max_steps: 20", "max_step: 20"))
    out = _cli("validate", "pipe.yaml", cwd=workdir)
    assert out.returncode == 2
    lines = [line for line in out.stderr.strip().splitlines() if line]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(
        "pipekit-train: error: pipe.yaml:11:3: TrainingLoop has no field 'max_step' (did you mean 'max_steps'?)"
    )
    debug = _cli("validate", "pipe.yaml", "--debug", cwd=workdir)
    assert debug.returncode == 2 and debug.stderr.startswith("Traceback") and lines[0] in debug.stderr


def test_bad_override_and_existing_run_dir(workdir: Path):
    out = _cli("run", "pipe.yaml", "--set", "stages.0.max_stepz=3", cwd=workdir)
    assert out.returncode == 2 and "did you mean 'stages.0.max_steps'" not in out.stderr
    assert "did you mean 'max_steps'" in out.stderr
    (workdir / "runs/b").mkdir(parents=True)
    (workdir / "runs/b/run.json").write_text('{"run_id": "r1"}')
    out = _cli("run", "pipe.yaml", "--run-dir", "runs/b", "--no-store", cwd=workdir)
    assert out.returncode == 2 and "already holds run 'r1'" in out.stderr


def test_help_reads_well(workdir: Path):
    out = _cli("--help", cwd=workdir)
    assert out.returncode == 0
    for word in ("run", "validate", "artifacts"):
        assert word in out.stdout


def test_reproduce_reruns_the_recorded_pipeline_and_refuses_changed_data(workdir: Path):
    out = _cli("run", "pipe.yaml", "--run-dir", "runs/a", "--store", "s.sqlite", cwd=workdir)
    assert out.returncode == 0, out.stderr
    artifact_id = json.loads(_cli("artifacts", "list", "--store", "s.sqlite", "--json", cwd=workdir).stdout)[0][
        "artifact_id"
    ]
    again = _cli("reproduce", artifact_id[:10], "--store", "s.sqlite", "--run-dir", "runs/b", cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert "trained weights match the recorded ones" in again.stdout
    x = np.zeros((40, 4), np.float32)
    np.savez(workdir / "data.npz", x=x, y=x[:, :1])
    changed = _cli("reproduce", artifact_id, "--store", "s.sqlite", "--run-dir", "runs/c", cwd=workdir)
    assert changed.returncode == 2
    assert "the training data of stage 'fit' changed" in changed.stderr


def test_the_run_summary_has_columns_for_the_metrics_the_stages_logged(capsys):
    """A regression's summary once had "val acc" and "test acc" columns of dashes and no column for its MAE."""
    from pipekit_train.cli._main import _print_summary
    from pipekit_train.provenance._artifact import TrainingArtifact

    regression = TrainingArtifact(
        artifact_id="abc123",
        stage="houses",
        final_metrics={"train/loss": 0.5, "test/loss": 0.25, "test/mae": 0.375, "test/rmse": 0.5, "time/step_s": 0.01},
    )
    _print_summary(regression, False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split() == [
        "stage",
        "steps",
        "train",
        "loss",
        "test",
        "loss",
        "test",
        "mae",
        "test",
        "rmse",
        "artifact",
    ]
    assert lines[4].split() == ["houses", "0.5000", "0.2500", "0.3750", "0.5000", "abc123"]
    classifier = regression.replace(final_metrics={"train/loss": 0.5, "validate/loss": 0.4, "validate/accuracy": 0.9})
    _print_summary(classifier, False)
    header = capsys.readouterr().out.splitlines()[2]
    assert "val acc" in header and "test" not in header and "mae" not in header


def test_the_lineage_hint_names_the_store_it_was_recorded_in(capsys):
    """`run`/`launch ... --store S` printed `pipekit-train artifacts lineage ID`, which looked in the default store."""
    from pipekit_train.cli._main import _print_summary
    from pipekit_train.provenance._artifact import TrainingArtifact

    artifact = TrainingArtifact(artifact_id="abc123def456789", final_metrics={"train/loss": 0.5})
    _print_summary(artifact, "my runs/store.sqlite")
    assert capsys.readouterr().out.splitlines()[-1] == (
        "lineage:       pipekit-train artifacts lineage abc123def456 --store 'my runs/store.sqlite'"
    )
    _print_summary(artifact, None)  # the default store: the hint needs no flag
    assert capsys.readouterr().out.splitlines()[-1].endswith("artifacts lineage abc123def456")
