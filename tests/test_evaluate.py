"""Evaluate and predict with a trained digits artifact: the recorded test accuracy again, an evaluation record the
store can query by dataset hash, the CLI's one-line errors."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests import _forked

from pipekit_train import (
    Accuracy,
    ArtifactStore,
    CrossEntropy,
    EquinoxModel,
    PrecisionRecallF1,
    RegisteredSource,
    TrainingDataset,
    TrainingLoop,
    evaluate,
    predict,
    run_settings,
)

pytestmark = pytest.mark.xdist_group("evaluate")  # one worker (--dist loadgroup): the module fixture is built once

ROOT = Path(__file__).resolve().parents[1]
TEST_YAML = """\
pipekit: 1
type: TrainingDataset
source: {type: RegisteredSource, name: digits, kwargs: {split: test}}
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict]:
    """A digits classifier trained for 60 steps; its store, artifact id and final metrics."""
    root = tmp_path_factory.mktemp("evaluate")
    digits = TrainingDataset(source=RegisteredSource(name="digits", kwargs={"split": "train"}))
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 64, "out_size": 10, "width_size": 32, "depth": 1}),
        dataset=digits,
        test_dataset=TrainingDataset(source=RegisteredSource(name="digits", kwargs={"split": "test"})),
        loss=CrossEntropy(),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=60,
        batch_size=64,
        eval_batch_size=100,
        metrics=(Accuracy(), PrecisionRecallF1(num_classes=10)),
        progress=False,
    )
    store = root / "store.sqlite"
    with run_settings(run_dir=str(root / "run"), store=str(store)):
        _, artifact = loop.run()
    (root / "test.yaml").write_text(TEST_YAML)
    return root, artifact.artifact_id, artifact.final_metrics


def test_evaluate_reproduces_the_recorded_test_accuracy_and_is_queryable(trained):
    root, artifact_id, final = trained
    result = evaluate(artifact_id[:10], root / "test.yaml", store=str(root / "store.sqlite"), batch_size=37)
    assert result.metrics["accuracy"] == pytest.approx(final["test/accuracy"], abs=1e-12)
    assert result.metrics["f1_macro"] == pytest.approx(final["test/f1_macro"], abs=1e-12)
    test_set = TrainingDataset(source=RegisteredSource(name="digits", kwargs={"split": "test"}))
    assert result.artifact_id == artifact_id and result.records == test_set.num_records() == 359
    data_hash = test_set.content_hash()
    assert result.dataset_hash == data_hash
    with ArtifactStore(str(root / "store.sqlite")) as store:
        found = store.evaluations(dataset_hash=data_hash)
        assert [e["evaluation_id"] for e in found] == [result.evaluation_id]
        assert found[0]["artifact_id"] == artifact_id and found[0]["metrics"]["accuracy"] == result.metrics["accuracy"]
        assert store.evaluations(dataset_hash="sha256:" + "0" * 64) == []
        assert len(store.evaluations(artifact_id=artifact_id[:8], metric="accuracy")) == 1


def test_predict_writes_the_outputs_in_record_order(trained, tmp_path: Path):
    root, artifact_id, _ = trained
    x = RegisteredSource(name="digits", kwargs={"split": "test"}).load()
    np.savez(tmp_path / "x.npz", x=x["x"][:50], y=x["y"][:50])
    out = predict(artifact_id, tmp_path / "x.npz", output=tmp_path / "p.npz", store=str(root / "store.sqlite"))
    assert out.shape == (50, 10)
    with np.load(tmp_path / "p.npz") as saved:
        assert np.array_equal(saved["predictions"], out)


def _cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _forked.run(
        [sys.executable, "-m", "pipekit_train.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
    )


@pytest.mark.slow
def test_the_cli_evaluates_and_refuses_bad_input_in_one_line(trained, xla_cache_env):
    root, artifact_id, final = trained
    store = str(root / "store.sqlite")
    # The run's persistent XLA cache (tests/conftest.py): a process that loads a program another compiled runs it
    # bit for bit, and a refusal reads nothing from it.
    done = _cli("evaluate", artifact_id, "--data", "test.yaml", "--store", store, "--json", cwd=root, env=xla_cache_env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["metrics"]["accuracy"] == pytest.approx(final["test/accuracy"], abs=1e-12)
    bad = _cli(
        "evaluate",
        artifact_id,
        "--data",
        "test.yaml",
        "--store",
        store,
        "--metric",
        "Acuracy",
        cwd=root,
        env=xla_cache_env,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "did you mean 'Accuracy'" in bad.stderr
    listed = _cli("evaluations", "--store", store, "--metric", "accuracy", cwd=root, env=xla_cache_env)
    assert listed.returncode == 0 and artifact_id[:12] in listed.stdout


def test_data_must_be_npz_csv_or_a_yaml_training_dataset(tmp_path: Path):
    from pipekit import ConfigError
    from pipekit_train.inference._evaluate import load_data

    with pytest.raises(ConfigError, match=r"--data test.parquet: expected an .npz file, a .csv file or a .yaml file"):
        load_data("test.parquet")
    (tmp_path / "loss.yaml").write_text("pipekit: 1\ntype: MSE\n")
    with pytest.raises(ConfigError, match=r"loss.yaml: the file must hold a TrainingDataset .*got MSE"):
        load_data(tmp_path / "loss.yaml")


def test_a_version_3_store_gains_the_evaluation_tables_and_keeps_its_records(tmp_path: Path):
    import sqlite3

    from pipekit_train import TrainingArtifact
    from pipekit_train.provenance._schema import MIGRATIONS, SCHEMA_VERSION

    path = tmp_path / "v3.sqlite"
    old = TrainingArtifact(artifact_id="0ld00001", run_id="r", final_metrics={"test/accuracy": 0.9})
    ArtifactStore(str(path)).record(old)
    with sqlite3.connect(path) as conn:  # take it back to what a version 3 store was
        conn.execute("DROP TABLE evaluation_metrics")
        conn.execute("DROP TABLE evaluations")
        conn.execute("DROP TABLE blobs")  # version 5's stored code
        conn.execute("DROP TABLE locks")  # version 6's dependency locks, kept once
        conn.execute("ALTER TABLE artifacts DROP COLUMN lock_digest")
        conn.execute("UPDATE schema_version SET version = 3")
        before = conn.execute("SELECT record, digest FROM artifacts").fetchall()
    assert SCHEMA_VERSION == len(MIGRATIONS) == 6  # 4: the evaluation tables; 5: stored code (blobs); 6: locks
    store = ArtifactStore(str(path))
    assert store.schema_version() == 6 and store.evaluations() == []
    assert store.get("0ld0") == old
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT record, digest FROM artifacts").fetchall() == before


USER_MODULE = """\
import jax.numpy as jnp
from pipekit_train import Loss


class DayOneHuber(Loss):
    delta: float = 1.0

    def __call__(self, predicted, target):
        err = jnp.abs(predicted - target)
        quad = jnp.minimum(err, self.delta)
        return jnp.mean(0.5 * quad**2 + self.delta * (err - quad)), {"max_err": jnp.max(err)}
"""

USER_TRAINING = """\
import sys
import numpy as np
import day_one_loss
from pipekit_train import MAE, RMSE, EquinoxModel, NpzSource, TrainingDataset, TrainingLoop, run_settings
from pipekit_train.cli._imports import module_record

x = np.random.default_rng(0).normal(size=(48, 2)).astype(np.float32)
np.savez("data.npz", x=x, y=x[:, :1] - x[:, 1:])
data = TrainingDataset(source=NpzSource(path="data.npz"))
ids = []
for metrics in ((MAE(), RMSE()), ()):
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 2, "out_size": 1, "width_size": 4, "depth": 1}),
        dataset=data, test_dataset=data.replace(shuffle=False), loss=day_one_loss.DayOneHuber(delta=0.5),
        metrics=metrics, optimizer_config={"name": "sgd", "lr": 0.05}, max_steps=4, batch_size=16, progress=False,
    )
    # The first records no imports (as from a notebook), the second its module (as `run --import` does).
    imports = (module_record("day_one_loss", day_one_loss),) if ids else ()
    with run_settings(run_dir=f"run{len(ids)}", store="store.sqlite", imports=imports):
        _, artifact = loop.run()
    ids.append(artifact.artifact_id)
    print(artifact.artifact_id, *(f"{k}={v!r}" for k, v in artifact.final_metrics.items() if k.startswith("test/")))
"""


@pytest.mark.slow
def test_evaluate_and_predict_load_the_users_module_and_default_to_the_stages_metrics(tmp_path: Path, xla_cache_env):
    """A stage with a user's loss (and MAE, RMSE): evaluate found "no TrainingLoop.metrics" because its YAML names a
    type nobody imported. --import, $PIPEKIT_IMPORT and the artifact's recorded imports all load it; a stage without
    metrics evaluates its loss, as the stage logged test/loss; predict records what it predicted from.

    Five fresh processes (a fresh process is what does not know the user's module), sharing the run's persistent XLA
    cache: the evaluations load the programs the first one compiled, bit for bit."""
    (tmp_path / "day_one_loss.py").write_text(USER_MODULE)
    trained = subprocess.run(
        [sys.executable, "-c", USER_TRAINING],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            "JAX_PLATFORMS": "cpu",
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": f"{ROOT / 'src'}:{tmp_path}",
            **xla_cache_env,
        },
    )
    assert trained.returncode == 0, trained.stderr
    recorded = {}
    for line in trained.stdout.splitlines():
        aid, *pairs = line.split()
        recorded[aid] = {k: float(v) for k, v in (p.split("=") for p in pairs)}
    with_metrics, without = list(recorded)

    plain = _cli(
        "evaluate", with_metrics, "--data", "data.npz", "--store", "store.sqlite", cwd=tmp_path, env=xla_cache_env
    )
    assert plain.returncode == 2 and "Traceback" not in plain.stderr and len(plain.stderr.strip().splitlines()) == 1
    assert "DayOneHuber" in plain.stderr and "--import MODULE" in plain.stderr

    store = "store.sqlite"
    done = _cli(
        "evaluate",
        with_metrics,
        "--data",
        "data.npz",
        "--store",
        store,
        "--json",
        "--import",
        "day_one_loss",
        cwd=tmp_path,
        env=xla_cache_env,
    )
    assert done.returncode == 0, done.stderr
    metrics = json.loads(done.stdout)["metrics"]
    expected = recorded[with_metrics]
    assert set(metrics) == {"loss", "loss/max_err", "mae", "rmse"}
    for name in ("loss", "mae", "rmse"):
        assert metrics[name] == pytest.approx(expected[f"test/{name}"], rel=1e-6), name

    # `without` (no TrainingLoop.metrics) recorded its import: evaluate finds the module alone, scores the loss
    recorded_done = _cli(
        "evaluate", without, "--data", "data.npz", "--store", store, "--json", cwd=tmp_path, env=xla_cache_env
    )
    assert recorded_done.returncode == 0, recorded_done.stderr
    assert "re-imported the recorded module(s) day_one_loss" in recorded_done.stderr
    result = json.loads(recorded_done.stdout)
    assert set(result["metrics"]) == {"loss", "loss/max_err"}
    assert result["metrics"]["loss"] == pytest.approx(recorded[without]["test/loss"], rel=1e-6)

    env = {**xla_cache_env, "PIPEKIT_IMPORT": "day_one_loss"}
    predicted = _cli(
        "predict", with_metrics, "--data", "data.npz", "-o", "p.npz", "--store", store, cwd=tmp_path, env=env
    )
    assert predicted.returncode == 0, predicted.stderr
    with ArtifactStore(str(tmp_path / store)) as s:
        found = s.evaluations(artifact_id=with_metrics)
    assert [(e["kind"], e["artifact_id"], e["output"]) for e in found] == [
        ("evaluation", with_metrics, None),
        ("prediction", with_metrics, "p.npz"),
    ]
    prediction = found[-1]
    with np.load(tmp_path / "p.npz") as saved:
        digest = hashlib.sha256(saved["predictions"].tobytes()).hexdigest()
    assert prediction["records"] == 48 and prediction["metrics"] == {}
    assert prediction["output_hash"] == f"sha256:{digest}" and prediction["dataset_hash"] == result["dataset_hash"]
