"""`CsvSource` on a table as a data scientist has it: class names, `all_except` and patterns, a count line before
the header, missing values and categories, fitted on the training split; every refused cell one line naming the
file, the line and the column."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train import TrainingDataset
from pipekit_train.data import CsvSource, Standardize

TABLE = """\
3,4,setosa,versicolor
id,f1,f2,color,split,label
1,1.0,10,red,train,b
2,2.0,,blue,train,a
3,,30,red,train,c
4,4.0,40,blue,train,a
5,5.0,50,green,test,b
"""


@pytest.fixture
def table(tmp_path: Path) -> str:
    path = tmp_path / "t.csv"
    path.write_text(TABLE)
    return str(path)


def _source(path: str, **kwargs) -> CsvSource:
    settings = {
        "skip_rows": 1,
        "inputs": ("f1",),
        "targets": ("label",),
        "where": {"split": "train"},
        "class_labels": True,
    }
    return CsvSource(path=path, **{**settings, **kwargs})


def test_class_names_become_indices_of_the_sorted_training_classes(table):
    source = _source(table, missing={"strategy": "mean"}).fit()
    assert source.statistics["classes"] == ["a", "b", "c"]
    assert source.load()["y"].tolist() == [1, 0, 2, 0] and source.load()["y"].dtype == np.int32
    numbers = CsvSource(path=table, skip_rows=1, inputs=("f1",), targets=("id",), class_labels=True)
    assert numbers.fit().statistics["classes"] == ["1", "2", "3", "4", "5"]  # integers sort as numbers


def test_an_unseen_class_is_one_line_naming_file_line_and_column(table):
    fitted = _source(table, class_labels=True).fit().fitted_statistics()
    test = _source(table, class_labels=True, where={"split": "test"}, missing={"strategy": "constant", "value": 0})
    with pytest.raises(ConfigError, match=r"t\.csv:7, column 'label': class 'b' was not in the training split") as e:
        test.replace(statistics={**fitted, "classes": ["a", "c"]}).load()
    assert "\n" not in str(e.value) and "its classes: a, c" in str(e.value)


def test_all_except_and_patterns_pick_columns_but_never_targets_or_where_columns(table):
    every = _source(table, inputs={"all_except": ["id", "color"]}, missing={"strategy": "mean"}).fit()
    assert every.statistics["inputs"] == ["f1", "f2"]
    pattern = _source(table, inputs=("f*",), missing={"strategy": "mean"}).fit()
    assert pattern.statistics["inputs"] == ["f1", "f2"] and pattern.load()["x"].shape == (4, 2)
    with pytest.raises(ConfigError, match=r"CsvSource\.inputs: pattern 'g\*' matches no column of .*its columns"):
        _source(table, inputs=("g*",)).load()
    with pytest.raises(ConfigError, match=r"inputs\.all_except: column 'idd' .*\(did you mean 'id'\?\)"):
        _source(table, inputs={"all_except": ["idd"]}).load()
    with pytest.raises(ConfigError, match=r"CsvSource\.inputs: 'all_exept' is not a selection \(did you mean"):
        _source(table, inputs={"all_exept": ["id"]})


def test_skip_rows_skips_a_count_line_and_line_numbers_stay_the_files(table):
    with pytest.raises(ConfigError, match=r"t\.csv:2 has 6 fields .* \(a line before the header\? skip it with"):
        CsvSource(path=table, inputs=("f1",)).load()  # the count line read as the header
    with pytest.raises(ConfigError, match=r"t\.csv:5, column 'f1': missing value ''"):
        _source(table).load()


def test_a_missing_value_is_refused_with_file_line_and_column_by_default(table):
    with pytest.raises(ConfigError, match=r"t\.csv:4, column 'f2': missing value ''; impute it with missing") as e:
        _source(table, inputs=("f2",)).load()
    assert "\n" not in str(e.value)
    with pytest.raises(
        ConfigError, match=r"u\.csv:3, column 'y': missing target value '' \(targets are never imputed\)"
    ):
        (Path(table).parent / "u.csv").write_text("a,y\n1,2\n2,\n")
        CsvSource(path=str(Path(table).parent / "u.csv"), inputs=("a",), targets=("y",), skip_rows=0).load()


@pytest.mark.parametrize(
    ("missing", "fill_f1", "fill_f2"),
    [
        ({"strategy": "mean"}, 7 / 3, 80 / 3),
        ({"strategy": "median"}, 2.0, 30.0),
        ({"strategy": "constant", "value": -1}, -1, -1),
    ],
)
def test_missing_values_are_imputed_from_the_training_split(table, missing, fill_f1, fill_f2):
    source = _source(table, inputs=("f1", "f2"), missing=missing).fit()
    x = source.load()["x"]
    assert x[2, 0] == pytest.approx(fill_f1) and x[1, 1] == pytest.approx(fill_f2)
    # another split takes the training split's fill values, not its own
    test = _source(table, inputs=("f1", "f2"), missing=missing, where={"split": "test"})
    assert test.with_fitted(source.fitted_statistics(), "test").load()["x"].tolist() == [[5.0, 50.0]]


def test_categories_are_one_hot_columns_fitted_on_the_training_split(table):
    source = _source(table, inputs=("f2", "color"), categorical=("color",), missing={"strategy": "mean"}).fit()
    assert source.statistics["categories"] == {"color": ["blue", "red"]}
    assert source.statistics["features"] == ["f2", "color=blue", "color=red"]
    np.testing.assert_array_equal(source.load()["x"][:, 1:], [[0, 1], [1, 0], [0, 1], [1, 0]])
    test = source.replace(where={"split": "test"})
    with pytest.raises(ConfigError, match=r"t\.csv:7, column 'color': category 'green' was not in the training") as e:
        test.load()
    assert "\n" not in str(e.value) and "its categories: blue, red" in str(e.value)
    with pytest.raises(
        ConfigError, match=r"column 'color': 'red' is not a float32 number; a column of categories goes in categorical"
    ):
        _source(table, inputs=("color",)).load()


def test_a_missing_category_is_all_zeros_when_imputing(tmp_path: Path):
    path = tmp_path / "c.csv"
    path.write_text("c,y\nx,1\n,2\ny,3\n")
    source = CsvSource(path=str(path), inputs=("c",), targets=("y",), categorical=("c",), missing={"strategy": "mean"})
    assert source.load()["x"].tolist() == [[1, 0], [0, 0], [0, 1]]
    with pytest.raises(ConfigError, match=r"c\.csv:3, column 'c': missing value"):
        source.replace(missing={}).load()


def test_a_dataset_fits_its_source_and_gives_another_split_its_values(table):
    def dataset(split: str) -> TrainingDataset:
        source = _source(table, where={"split": split}, class_labels=True, missing={"strategy": "mean"})
        return TrainingDataset(source=source, transforms=(Standardize(keys=("x",)),))

    train = dataset("train").fitted()
    assert train.source.fitted and train.transforms[0].fitted
    test = dataset("test").with_source_statistics(train.source.fitted_statistics(), "test")
    assert test.arrays()["y"].tolist() == [1]  # 'b' is index 1 of the training classes, not 0 of its own
    assert dataset("test").arrays()["y"].tolist() == [0]  # on its own, a split fits on its own rows


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"targets": ("a", "b"), "class_labels": True}, r"class_labels needs exactly one target column"),
        (
            {"missing": {"strategy": "maen"}},
            r"missing\.strategy must be one of .*\(did you mean 'mean' or 'median'\?\)",
        ),
        ({"missing": {"strategy": "constant"}}, r"missing\.value must be a number with strategy constant"),
        ({"missing": {"strategy": "mean", "valeu": 1}}, r"'valeu' is not a setting \(did you mean 'value'\?\)"),
        ({"skip_rows": -1}, r"CsvSource\.skip_rows must be a non-negative int, got -1"),
        ({"statistics": {"clases": []}}, r"CsvSource\.statistics has unknown entries \['clases'\]"),
    ],
)
def test_bad_settings_are_refused_when_built(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CsvSource(path="x.csv", inputs=("a",), **kwargs)


def test_the_new_settings_round_trip_through_yaml(table):
    source = _source(
        table, inputs={"all_except": ["id"]}, class_labels=True, categorical=("col*",), missing={"strategy": "median"}
    )
    assert pipekit.loads(pipekit.dumps(source)) == source
    assert pipekit.loads(pipekit.dumps(source.fit())) == source.fit()


def test_crossentropys_hint_for_float_labels_names_target_dtype_and_class_labels(table):
    from pipekit_train.losses._targets import CLASS_TARGETS

    y = CsvSource(path=table, skip_rows=1, inputs=("id",), targets=("id",)).load()["y"]  # float32, (records, 1)
    problem = CLASS_TARGETS.check(np.zeros((len(y), 3), np.float32), y)
    assert "target_dtype: int32" in problem and "class_labels: true" in problem
