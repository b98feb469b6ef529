"""`DataFile`: a model's data as named values of any shape, in one file (Stan's and posteriordb's JSON, or an
``.npz``), as one record.

Stan data is named scalars and arrays of different lengths (``N``, ``J``, group-level and record-level arrays),
which cannot share a record axis. A `DataFile` is therefore one record holding every value: `load` gives each name
its value with a leading axis of length 1, so a `TrainingDataset` iterates, transforms and hashes it like any
source (the content hash covers every value), and a sampler stage hands each name, without the leading axis, to
the model as a keyword argument (``pipekit_train.adapters.bayes.full_data``).

Example:
    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "schools.json")
    >>> with open(path, "w") as f:
    ...     json.dump({"J": 2, "y": [28, 8], "sigma": [15.0, 10.0]}, f)
    >>> {k: (v.shape, v.dtype.kind) for k, v in DataFile(path=path).values().items()}
    {'J': ((), 'i'), 'y': ((2,), 'i'), 'sigma': ((2,), 'f')}
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from pipekit import ConfigError, suggestion

from ._sources import Arrays, Source, _check_file, _readable

__all__ = ["DataFile"]


class DataFile(Source):
    """Named values of any shape from one file: the model's data as a whole, as one record.

    Args:
        path: a ``.json`` file in Stan's / posteriordb's data format (an object of names to numbers or rectangular
            nested lists of numbers; integers stay integers) or an ``.npz`` of named arrays (read with
            ``allow_pickle=False``).
        keys: the names to read; empty reads every name in the file.

    `load` gives every value a leading axis of length 1 (one record); `values` gives them as in the file.
    """

    path: str
    keys: tuple[str, ...] = ()

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("DataFile.path must be a non-empty path to a .json or .npz file, got ''")
        if not self.path.endswith((".json", ".npz")):
            raise ConfigError(f"DataFile.path must name a .json (Stan's data format) or .npz file, got {self.path!r}")

    def values(self) -> Arrays:
        """The file's values by name, each with its own shape (a scalar is a 0-d array)."""
        _check_file("DataFile.path", self.path)
        found = _read_json(self.path) if self.path.endswith(".json") else _read_npz(self.path)
        available = list(found)
        if not available:
            raise ConfigError(f"DataFile.path: {self.path!r} holds no values")
        out: Arrays = {}
        for key in self.keys or tuple(available):
            if key not in found:
                raise ConfigError(
                    f"DataFile.keys: {key!r} is not in {self.path!r}{suggestion(key, available)}; "
                    f"names in the file: {', '.join(available)}"
                )
            out[key] = found[key]
        return out

    def load(self) -> Arrays:
        """`values`, each with a leading record axis of length 1."""
        return {k: v[None] for k, v in self.values().items()}

    @classmethod
    def example(cls) -> DataFile:
        return cls(path="data/eight_schools.json")


def _read_npz(path: str) -> Arrays:
    with _readable("DataFile.path", path), np.load(path, allow_pickle=False) as npz:
        out = {k: npz[k] for k in npz.files}
    for key, arr in out.items():
        if arr.dtype.kind not in "biuf":
            raise ConfigError(f"DataFile {path!r}: {key!r} has dtype {arr.dtype}; only numbers and booleans work")
    return out


def _read_json(path: str) -> Arrays:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"DataFile.path: cannot read {path!r} as JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(
            f"DataFile {path!r} must hold a JSON object of names to values (Stan's data format), got a "
            f"{type(doc).__name__}"
        )
    return {str(k): _json_value(path, str(k), v) for k, v in doc.items()}


def _json_value(path: str, key: str, value: Any) -> np.ndarray:
    """A JSON value as an array: integers (all of them) as int64, otherwise float64; rectangular lists only."""
    where = f"DataFile {path!r}: {key!r}"

    def leaves(v: Any) -> list[Any]:
        return [x for item in v for x in leaves(item)] if isinstance(v, list) else [v]

    flat = leaves(value)
    for x in flat:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise ConfigError(f"{where} holds {x!r}; values must be numbers or (nested) lists of numbers")
    ints = all(isinstance(x, int) for x in flat)
    try:
        arr = np.array(value, dtype=np.int64 if ints else np.float64)
    except (ValueError, OverflowError):
        raise ConfigError(
            f"{where} is not a rectangular array of numbers (nested lists of different lengths, or a number too large)"
        ) from None
    if arr.size != len(flat) or (arr.size == 0 and math.prod(arr.shape) != 0):
        raise ConfigError(f"{where} is not a rectangular array of numbers (nested lists of different lengths)")
    return arr
