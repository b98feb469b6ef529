"""A classification from CSV files with class names, as examples/wine/ and docs/datasets.md walk through it:
``run`` (``all_except``, ``skip_rows``, ``class_labels``, `Standardize`), then ``evaluate --data test.csv`` and
``predict --data test.csv -o p.csv``, against scikit-learn's LogisticRegression on the same split. The commands run
in this process (``cli.main``); the pipeline trains once for the module."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parents[2]
WINE = ROOT / "examples" / "wine"
TEST_CSV = "examples/wine/wine_test.csv"

pytestmark = pytest.mark.xdist_group("wine")  # one worker: the module fixture trains once


def _make_data():
    spec = importlib.util.spec_from_file_location("wine_make_data", WINE / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("wine_make_data", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    from pipekit_train import ArtifactStore
    from pipekit_train.cli import main

    root = tmp_path_factory.mktemp("wine")
    store = root / "store.sqlite"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        code = main(["run", "examples/wine/wine.yaml", "--run-dir", str(root / "run"), "--store", str(store)])
    assert code == 0
    (artifact,) = ArtifactStore(store).query()
    return root, store, artifact


def _cli(root: Path, store: Path, *argv: str) -> int:
    from pipekit_train.cli import main

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        return main([*argv, "--store", str(store)])


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_the_committed_csvs_are_what_make_data_writes(tmp_path: Path):
    make_data = _make_data()
    for written in make_data.write(str(tmp_path)):
        assert Path(written).read_bytes() == (WINE / Path(written).name).read_bytes()


def test_the_artifact_records_the_classes_and_columns_fitted_on_the_training_file(trained, capsys):
    root, store, artifact = trained
    stats = artifact.source_statistics
    assert stats["classes"] == ["class_0", "class_1", "class_2"]
    assert len(stats["inputs"]) == 13 and "id" not in stats["inputs"] and "target" not in stats["inputs"]
    assert set(artifact.data_statistics) == {"x"}
    capsys.readouterr()
    assert _cli(root, store, "artifacts", "show", artifact.artifact_id[:12]) == 0
    assert "classes    class_0, class_1, class_2" in capsys.readouterr().out


def test_evaluate_on_the_test_csv_matches_logistic_regression(trained, capsys):
    root, store, artifact = trained
    capsys.readouterr()
    assert _cli(root, store, "evaluate", artifact.artifact_id[:12], "--data", TEST_CSV, "--json") == 0
    evaluation = json.loads(capsys.readouterr().out)
    assert evaluation["records"] == 45
    assert evaluation["metrics"]["accuracy"] == pytest.approx(artifact.final_metrics["test/accuracy"])
    baseline = _make_data().baseline(str(WINE / "wine_train.csv"), str(WINE / "wine_test.csv"))
    assert evaluation["metrics"]["accuracy"] >= baseline - 0.02, (evaluation["metrics"], baseline)


def test_predict_writes_row_class_name_and_one_probability_per_class(trained, tmp_path):
    root, store, artifact = trained
    out = tmp_path / "p.csv"
    assert _cli(root, store, "predict", artifact.artifact_id[:12], "--data", TEST_CSV, "-o", str(out)) == 0
    header, *rows = _rows(out)
    assert header == ["row", "predicted", "p_class_0", "p_class_1", "p_class_2"]
    assert [int(r[0]) for r in rows] == list(range(45))
    p = np.array([[float(v) for v in r[2:]] for r in rows])
    np.testing.assert_allclose(p.sum(axis=1), 1.0, atol=1e-5)
    assert [r[1] for r in rows] == [header[2 + int(k)][2:] for k in p.argmax(axis=1)]
    truth = [r[-1] for r in _rows(WINE / "wine_test.csv")[2:]]
    assert np.mean([r[1] == t for r, t in zip(rows, truth)]) >= 0.95
    npz = tmp_path / "p.npz"  # as before: the raw outputs
    assert _cli(root, store, "predict", artifact.artifact_id[:12], "--data", TEST_CSV, "-o", str(npz)) == 0
    assert np.load(npz)["predictions"].shape == (45, 3)


def test_predict_reads_a_csv_without_the_target_column(trained, tmp_path):
    root, store, artifact = trained
    rows = _rows(WINE / "wine_test.csv")
    path = tmp_path / "unlabelled.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows([rows[0], *(r[:-1] for r in rows[1:7])])
    out = tmp_path / "u.csv"
    assert _cli(root, store, "predict", artifact.artifact_id[:12], "--data", str(path), "-o", str(out)) == 0
    assert len(_rows(out)) == 6
    rows[3] = [*rows[3][:-1], "class_9"]  # a label predict does not read
    with open(path, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)
    assert _cli(root, store, "predict", artifact.artifact_id[:12], "--data", str(path), "-o", str(out)) == 0
    assert len(_rows(out)) == 46


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: [*r[:-1], "class_9"], r"wine_bad\.csv:4, column 'target': class 'class_9' was not in the training"),
        (lambda r: [r[0], "", *r[2:]], r"wine_bad\.csv:4, column 'alcohol': missing value ''; impute it with missing"),
    ],
)
def test_an_unseen_class_or_a_missing_value_is_one_line_naming_file_line_and_column(
    trained, tmp_path, capsys, change, message
):
    root, store, artifact = trained
    rows = _rows(WINE / "wine_test.csv")
    rows[3] = change(rows[3])
    path = tmp_path / "wine_bad.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)
    capsys.readouterr()
    assert _cli(root, store, "evaluate", artifact.artifact_id[:12], "--data", str(path)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and __import__("re").search(message, err), err


def test_a_csv_for_a_stage_that_did_not_read_a_csv_says_what_to_pass(tmp_path):
    from pipekit import ConfigError
    from pipekit_train.inference._evaluate import load_data

    (tmp_path / "t.csv").write_text("a\n1\n")
    with pytest.raises(ConfigError, match=r"--data .*t\.csv: a \.csv file is read with the training stage's CsvSource"):
        load_data(tmp_path / "t.csv", None)
