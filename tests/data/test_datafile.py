"""`DataFile`: Stan's JSON data format and an `.npz` of named values of any shape, as one record of a
`TrainingDataset` (hashed by content), and its one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train.data import DataFile, TrainingDataset

SCHOOLS = {"J": 8, "y": [28, 8, -3, 7, -1, 1, 18, 12], "sigma": [15.0, 10, 16, 11, 9, 11, 10, 18]}


def _json(tmp_path: Path, doc: object, name: str = "d.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_stan_json_scalars_and_arrays_of_any_shape_are_one_record(tmp_path: Path) -> None:
    path = _json(tmp_path, {**SCHOOLS, "x": [[1, 2, 3], [4, 5, 6]], "empty": []})
    source = DataFile(path=path)
    values = source.values()
    assert values["J"].shape == () and values["J"].dtype == np.int64 and int(values["J"]) == 8
    assert values["y"].dtype == np.int64 and values["sigma"].dtype == np.float64  # one float makes the array float
    assert values["x"].shape == (2, 3) and values["empty"].shape == (0,)
    dataset = TrainingDataset(source=source, shuffle=False)
    assert dataset.num_records() == 1 and dataset.element_spec()["x"][0] == (2, 3)
    batch = next(iter(dataset.epoch_batches(1)))
    assert np.array_equal(batch["sigma"][0], SCHOOLS["sigma"])
    assert pipekit.loads(pipekit.dumps(source)) == source  # a YAML source: {type: DataFile, path: ...}
    assert DataFile(path=path, keys=("y",)).values().keys() == {"y"}


def test_npz_of_named_arrays_of_any_shape(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, N=np.int64(3), x=np.zeros((3, 2), np.float32), g=np.arange(5))
    values = DataFile(path=str(path)).values()
    assert values["N"].shape == () and values["x"].shape == (3, 2) and values["g"].shape == (5,)


def test_the_hash_is_the_files_content(tmp_path: Path) -> None:
    a = TrainingDataset(source=DataFile(path=_json(tmp_path, SCHOOLS, "a.json")))
    b = TrainingDataset(source=DataFile(path=_json(tmp_path, SCHOOLS, "b.json")))
    c = TrainingDataset(source=DataFile(path=_json(tmp_path, {**SCHOOLS, "y": [0] * 8}, "c.json")))
    assert a.content_hash() == b.content_hash() != c.content_hash()


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ([1, 2], r"must hold a JSON object of names to values .* got a list"),
        ({"y": [1, [2]]}, r"'y' is not a rectangular array"),
        ({"y": [[1, 2], [3]]}, r"'y' is not a rectangular array"),
        ({"y": ["a"]}, r"'y' holds 'a'; values must be numbers"),
        ({"y": True}, r"'y' holds True"),
    ],
)
def test_bad_json_is_one_line_naming_the_file_and_the_name(tmp_path: Path, doc: object, match: str) -> None:
    path = _json(tmp_path, doc)
    with pytest.raises(ConfigError, match=match) as info:
        DataFile(path=path).values()
    assert f"DataFile {path!r}" in str(info.value)


def test_refusals_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"DataFile.path must name a .json \(Stan's data format\) or .npz file"):
        DataFile(path="data.csv")
    with pytest.raises(ConfigError, match=r"DataFile.path: file not found: 'missing.json'"):
        DataFile(path="missing.json").values()
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match=r"DataFile.path: cannot read .*bad.json' as JSON"):
        DataFile(path=str(bad)).values()
    with pytest.raises(ConfigError, match=r"DataFile.keys: 'sigm' is not in .* \(did you mean 'sigma'\?\)"):
        DataFile(path=_json(tmp_path, SCHOOLS), keys=("sigm",)).values()
