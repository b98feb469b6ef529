"""`Standardize`: fitted on the training split, recorded in the artifact, reused for validation and test, by
`evaluate`, `predict` and `export`, and inverted on the target so results are in the data's units."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train import MAE, MSE, EquinoxModel, TrainingLoop, run_settings
from pipekit_train.checkpoint import Checkpoint
from pipekit_train.data import ArraySource, CsvSource, Standardize, TrainingDataset
from pipekit_train.inference import evaluate, export_model, predict

pytestmark = pytest.mark.xdist_group("standardize")  # one worker: the module fixture trains once


def test_fit_and_apply_per_column():
    x = np.array([[1.0, 10.0, 5.0], [3.0, 30.0, 5.0]], dtype=np.float32)
    fitted = Standardize(keys=("x",)).fit({"x": x})
    assert fitted.statistics == {"x": {"mean": (2.0, 20.0, 5.0), "std": (1.0, 10.0, 1.0)}}  # a constant column: std 1
    np.testing.assert_array_equal(fitted.apply({"x": x})["x"], [[-1, -1, 0], [1, 1, 0]])
    assert pipekit.loads(pipekit.dumps(fitted)) == fitted


def test_an_unfitted_standardize_on_its_own_says_how_it_is_fitted():
    with pytest.raises(ConfigError, match=r"is not fitted: a TrainingLoop fits it on its training dataset"):
        Standardize(keys=("x",)).apply({"x": np.zeros((2, 1))})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keys": ()}, r"Standardize\.keys must name at least one entry"),
        ({"keys": ("x",), "statistics": {"y": {"mean": [0.0], "std": [1.0]}}}, r"no entry for key 'x'"),
        ({"keys": ("x",), "statistics": {"x": {"mean": [0.0], "std": [0.0]}}}, r"std must be finite and > 0"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Standardize(**kwargs)


def test_a_dataset_on_its_own_fits_on_its_records_and_another_takes_those_statistics():
    train = TrainingDataset(
        source=ArraySource(arrays={"x": np.arange(8.0).reshape(4, 2)}), transforms=(Standardize(keys=("x",)),)
    )
    batch = next(train.epoch_batches(4))["x"]
    np.testing.assert_allclose(batch.mean(axis=0), 0, atol=1e-6)
    np.testing.assert_allclose(batch.std(axis=0), 1, atol=1e-6)
    stats = train.fitted().transforms[0].statistics
    other = TrainingDataset(source=ArraySource(arrays={"x": np.ones((2, 2))}), transforms=(Standardize(keys=("x",)),))
    expected = [[(1 - 3) / np.sqrt(5), (1 - 4) / np.sqrt(5)]] * 2  # the first dataset's column means 3 and 4
    np.testing.assert_allclose(next(other.with_statistics(stats).epoch_batches(2))["x"], expected, rtol=1e-6)
    with pytest.raises(ConfigError, match=r"TrainingLoop\.val_dataset: .* standardizes 'x', but the training split"):
        other.with_statistics({}, "TrainingLoop.val_dataset")


def _rows(rng: np.random.Generator, n: int, split: str) -> str:
    area = rng.uniform(40, 160, n)
    price = 100 + 3 * area + rng.normal(0, 5, n)
    return "".join(f"{split},{a:.1f},{p:.1f}\n" for a, p in zip(area, price, strict=True))


def _dataset(path: Path, split: str) -> TrainingDataset:
    source = CsvSource(path=str(path), inputs=("area",), targets=("price",), where={"split": split})
    return TrainingDataset(source=source, transforms=(Standardize(keys=("x", "y")),), shuffle=split == "train")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """A linear-ish regression on prices in the hundreds, trained for 60 steps on standardized data."""
    root = tmp_path_factory.mktemp("standardize")
    rng = np.random.default_rng(0)
    path = root / "prices.csv"
    path.write_text("split,area,price\n" + _rows(rng, 96, "train") + _rows(rng, 32, "test"))
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 1, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=_dataset(path, "train"),
        val_dataset=_dataset(path, "test"),
        test_dataset=_dataset(path, "test"),
        loss=MSE(),
        metrics=(MAE(),),
        optimizer_config={"name": "adam", "lr": 0.03},
        max_steps=60,
        batch_size=16,
        eval_every_n_steps=30,
        progress=False,
    )
    store = root / "store.sqlite"
    with run_settings(run_dir=str(root / "run"), store=str(store)):
        model, artifact = loop.run()
    (root / "test.yaml").write_text(pipekit.dumps(_dataset(path, "test")))
    raw = _dataset(path, "test").arrays()
    np.savez(root / "test.npz", x=raw["x"], y=raw["y"])
    return root, store, model, artifact, path


def test_the_artifact_records_the_training_split_statistics(trained):
    _, _, _, artifact, path = trained
    train = CsvSource(path=str(path), inputs=("area",), targets=("price",), where={"split": "train"}).load()
    stats = artifact.data_statistics
    assert stats["x"]["mean"] == pytest.approx([float(train["x"].astype(np.float64).mean())])
    assert stats["y"]["std"] == pytest.approx([float(train["y"].astype(np.float64).std())])
    assert "statistics" not in artifact.training_pipeline_yaml  # the configuration as written


def _reference(trained) -> tuple[np.ndarray, np.ndarray]:
    """The model's predictions for the raw test rows, brought back to prices by hand, and the raw prices."""
    _, _, model, artifact, path = trained
    raw = CsvSource(path=str(path), inputs=("area",), targets=("price",), where={"split": "test"}).load()
    s = artifact.data_statistics
    x = (raw["x"] - np.float32(s["x"]["mean"][0])) / np.float32(s["x"]["std"][0])
    predicted = np.asarray(model(x)) * np.float32(s["y"]["std"][0]) + np.float32(s["y"]["mean"][0])
    return predicted, raw["y"]


def test_validation_test_evaluate_and_predict_are_in_the_datas_units(trained):
    root, store, _, artifact, _ = trained
    predicted, prices = _reference(trained)
    mae = float(np.mean(np.abs(predicted - prices)))
    assert mae < 0.3 * float(prices.std())  # in price units, and it learned
    assert artifact.final_metrics["validate/mae"] == pytest.approx(mae, rel=1e-5)
    assert artifact.final_metrics["test/mae"] == pytest.approx(mae, rel=1e-5)
    for data in ("test.yaml", "test.npz"):  # a dataset that standardizes x itself, and raw arrays
        evaluation = evaluate(artifact.artifact_id, root / data, store=store, record=False)
        assert evaluation.metrics["mae"] == pytest.approx(mae, rel=1e-5), data
        np.testing.assert_allclose(predict(artifact.artifact_id, root / data, store=store), predicted, rtol=1e-5)


def test_the_exported_function_takes_and_gives_the_datas_units(trained):
    root, store, _, artifact, path = trained
    predicted, _ = _reference(trained)
    provenance = export_model(artifact.artifact_id, root / "m.jaxexport", symbolic_batch=True, store=store)
    assert provenance["data_statistics"] == artifact.data_statistics
    import jax

    exported = jax.export.deserialize(bytearray((root / "m.jaxexport").read_bytes()))
    raw = CsvSource(path=str(path), inputs=("area",), where={"split": "test"}).load()["x"]
    np.testing.assert_allclose(np.asarray(exported.call(raw)), predicted, rtol=1e-5)


def test_a_stage_with_standardize_resumes_bitwise(tmp_path, interrupted_and_resumed):
    rng = np.random.default_rng(1)
    path = tmp_path / "p.csv"
    path.write_text("split,area,price\n" + _rows(rng, 64, "train"))
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 1, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=_dataset(path, "train"),
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=10,
        batch_size=16,
        progress=False,
        callbacks=(Checkpoint(every_n_steps=4, async_save=False),),
    )
    reference, resumed = interrupted_and_resumed(loop, crash_at=7)
    assert resumed.weights_hash() == reference.weights_hash()
