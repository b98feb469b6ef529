"""`CsvSource`: columns and rows of a CSV file as arrays, with one-line errors naming the file, line and column."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train.data import CsvSource

CSV = """\
city,split,area,rooms,price,kind
A,train,50,2,100.5,0
A,test,80,3,160,1
B,train,60,2,90,0

A,train,70,4,150,2
"""


@pytest.fixture
def csv_path(tmp_path: Path) -> str:
    path = tmp_path / "houses.csv"
    path.write_text(CSV)
    return str(path)


def test_columns_become_input_and_target_arrays_in_file_order(csv_path):
    arrays = CsvSource(path=csv_path, inputs=("area", "rooms"), targets=("price",)).load()
    assert arrays["x"].dtype == np.float32 and arrays["x"].shape == (4, 2)
    np.testing.assert_array_equal(arrays["x"][:, 0], [50, 80, 60, 70])  # the blank line is skipped
    np.testing.assert_array_equal(arrays["y"], np.array([[100.5], [160], [90], [150]], dtype=np.float32))


def test_one_integer_target_column_is_a_label_vector(csv_path):
    arrays = CsvSource(path=csv_path, inputs=("area",), targets=("kind",), target_dtype="int32").load()
    assert arrays["y"].dtype == np.int32 and arrays["y"].tolist() == [0, 1, 0, 2]


def test_where_keeps_the_rows_whose_columns_hold_the_values(csv_path):
    arrays = CsvSource(path=csv_path, inputs=("area",), where={"city": "A", "split": "train"}).load()
    assert arrays["x"][:, 0].tolist() == [50, 70] and set(arrays) == {"x"}


def test_fractions_cut_disjoint_splits_that_cover_every_row(tmp_path: Path):
    path = tmp_path / "n.csv"
    path.write_text("v\n" + "".join(f"{i}\n" for i in range(100)))
    fractions = {"train": 0.7, "val": 0.1, "test": 0.2}
    parts = {
        s: CsvSource(path=str(path), inputs=("v",), split=s, fractions=fractions, seed=3).load()["x"][:, 0]
        for s in fractions
    }
    assert [len(p) for p in parts.values()] == [70, 10, 20]
    assert sorted(np.concatenate(list(parts.values())).tolist()) == list(range(100))
    again = CsvSource(path=str(path), inputs=("v",), split="test", fractions=fractions, seed=3).load()["x"][:, 0]
    other = CsvSource(path=str(path), inputs=("v",), split="test", fractions=fractions, seed=4).load()["x"][:, 0]
    assert again.tolist() == parts["test"].tolist() and other.tolist() != again.tolist()
    assert list(parts["train"]) == sorted(parts["train"])  # file order within a split


def test_a_file_without_a_header_names_its_columns(tmp_path: Path):
    path = tmp_path / "h.tsv"
    path.write_text("1\t2\n3\t4\n")
    src = CsvSource(path=str(path), header=False, columns=("a", "b"), inputs=("b",), delimiter="\t")
    assert src.load()["x"][:, 0].tolist() == [2, 4]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"inputs": ("area", "room")},
            r"CsvSource\.inputs: column 'room' is not in the header of .*houses\.csv' "
            r"\(did you mean 'rooms'\?\); its columns: city, split, area, rooms, price, kind",
        ),
        ({"inputs": ("area",), "targets": ("prise",)}, r"CsvSource\.targets: column 'prise' .*did you mean 'price'"),
        ({"inputs": ("area",), "where": {"town": "A"}}, r"CsvSource\.where: column 'town' is not in the header"),
        ({"inputs": ("city",)}, r"houses\.csv:2, column 'city': 'A' is not a float32 number"),
        ({"inputs": ("area",), "targets": ("price",), "target_dtype": "int32"}, r"houses\.csv:2, column 'price'"),
    ],
)
def test_a_bad_column_or_value_is_one_line_naming_it(csv_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CsvSource(path=csv_path, **kwargs).load()


def test_a_ragged_row_names_its_line(tmp_path: Path):
    path = tmp_path / "r.csv"
    path.write_text("a,b\n1,2\n3\n")
    with pytest.raises(ConfigError, match=r"r\.csv:3 has 1 fields but the header names 2 columns"):
        CsvSource(path=str(path), inputs=("a",)).load()


def test_a_missing_file_names_the_field_and_the_working_directory(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"CsvSource\.path: file not found: 'nope\.csv' \(relative paths are read"):
        CsvSource(path="nope.csv", inputs=("a",)).load()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"inputs": ()}, r"CsvSource\.inputs must name at least one column"),
        ({"inputs": ("a", "a")}, r"CsvSource\.inputs must not repeat a column"),
        ({"inputs": ("a",), "delimiter": ";;"}, r"CsvSource\.delimiter must be one character, got ';;'"),
        ({"inputs": ("a",), "header": False}, r"CsvSource\.columns must name the columns"),
        ({"inputs": ("a",), "split": "train"}, r"CsvSource\.split 'train' needs fractions .*where: \{split: train\}"),
        ({"inputs": ("a",), "split": "trian", "fractions": {"train": 0.5, "test": 0.5}}, r"did you mean 'train'"),
        ({"inputs": ("a",), "split": "train", "fractions": {"train": 0.5, "test": 0.6}}, r"must sum to 1, got 1\.1"),
        ({"inputs": ("a",), "dtype": "flaot32"}, r"CsvSource\.dtype must be a numpy dtype name"),
    ],
)
def test_bad_settings_are_refused_when_built(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CsvSource(path="x.csv", **kwargs)


def test_it_round_trips_through_yaml(csv_path):
    src = CsvSource(path=csv_path, inputs=("area",), targets=("price",), where={"city": "A"})
    assert pipekit.loads(pipekit.dumps(src)) == src
