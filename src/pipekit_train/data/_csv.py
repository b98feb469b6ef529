"""`CsvSource`: the columns of a CSV file as an input array and a target array, without writing code.

Read with Python's ``csv`` module (no pandas): the header names the columns, `inputs` and `targets` pick them,
`where` keeps the rows whose columns hold given values (a ``split`` or ``city`` column), and `fractions` with
`seed` cut what is left into named splits by a seeded permutation (every split of one file and seed is disjoint,
and together they cover every row). Rows come back in file order.

Example:
    >>> import os, tempfile
    >>> from pipekit_train.data._csv import CsvSource
    >>> path = os.path.join(tempfile.mkdtemp(), "h.csv")
    >>> _ = open(path, "w").write("area,rooms,price\\n50,2,100\\n80,3,160\\n")
    >>> arrays = CsvSource(path=path, inputs=("area", "rooms"), targets=("price",)).load()
    >>> arrays["x"], arrays["y"]
    (array([[50.,  2.],
           [80.,  3.]], dtype=float32), array([[100.],
           [160.]], dtype=float32))
"""

from __future__ import annotations

import csv
import math

import numpy as np

from pipekit import ConfigError, field, suggestion

from ._sources import Arrays, Source, _check_file, check_arrays
from ._transforms import _check_dtype

__all__ = ["CsvSource"]


class CsvSource(Source):
    """Columns of a CSV file: `inputs` as ``input_key`` (records x columns), `targets` as ``target_key``.

    Relative paths are read from the working directory, like every file source. Each value must parse as a
    number of its dtype; an empty or malformed cell is an error naming the file, the line and the column.

    Args:
        path: the CSV file.
        inputs: the input columns, in order; they become ``input_key`` of shape ``(records, len(inputs))``.
        targets: the target columns; ``target_key`` has shape ``(records, len(targets))``, or ``(records,)`` for
            one integer column (class labels). Empty: no targets.
        input_key: the key of the inputs.
        target_key: the key of the targets.
        dtype: the inputs' numpy dtype.
        target_dtype: the targets' numpy dtype (an integer dtype for class labels).
        header: whether the first row names the columns; without one, name them in `columns`.
        columns: the column names of a file without a header row (ignored with a header).
        delimiter: the one-character field separator.
        where: keep only rows whose column holds this value (compared as text), e.g. ``{city: A, split: train}``.
        split: with `fractions`, the named part of the rows `where` kept.
        fractions: ``{name: fraction}`` summing to 1: the rows `where` kept, cut by a permutation from `seed`.
        seed: the permutation's seed (non-negative).
    """

    path: str
    inputs: tuple[str, ...]
    targets: tuple[str, ...] = ()
    input_key: str = "x"
    target_key: str = "y"
    dtype: str = "float32"
    target_dtype: str = "float32"
    header: bool = True
    columns: tuple[str, ...] = ()
    delimiter: str = ","
    where: dict[str, str] = field(default_factory=dict)
    split: str | None = None
    fractions: dict[str, float] = field(default_factory=dict)
    seed: int = 0

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("CsvSource.path must be a non-empty path to a CSV file, got ''")
        if not self.inputs:
            raise ConfigError("CsvSource.inputs must name at least one column, got []")
        for name in ("inputs", "targets"):
            cols = getattr(self, name)
            if len(set(cols)) != len(cols):
                raise ConfigError(f"CsvSource.{name} must not repeat a column, got {list(cols)}")
        if self.input_key == self.target_key:
            raise ConfigError(f"CsvSource.input_key and target_key must differ, both are {self.input_key!r}")
        _check_dtype("CsvSource.dtype", self.dtype)
        _check_dtype("CsvSource.target_dtype", self.target_dtype)
        if len(self.delimiter) != 1:
            raise ConfigError(f"CsvSource.delimiter must be one character, got {self.delimiter!r}")
        if not self.header and not self.columns:
            raise ConfigError("CsvSource.columns must name the columns of a file without a header (header: false)")
        if self.seed < 0:
            raise ConfigError(f"CsvSource.seed must be a non-negative int, got {self.seed}")
        if self.fractions:
            bad = {k: v for k, v in self.fractions.items() if not (math.isfinite(v) and 0 < v <= 1)}
            if bad:
                raise ConfigError(f"CsvSource.fractions must each be in (0, 1], got {bad}")
            total = sum(self.fractions.values())
            if abs(total - 1.0) > 1e-9:
                raise ConfigError(f"CsvSource.fractions must sum to 1, got {total:g} from {self.fractions}")
            if self.split is None:
                raise ConfigError(
                    f"CsvSource.split must name one of the fractions ({', '.join(self.fractions)}) to keep, got null"
                )
            if self.split not in self.fractions:
                raise ConfigError(
                    f"CsvSource.split {self.split!r} is not one of the fractions"
                    f"{suggestion(self.split, self.fractions)}; they are {', '.join(self.fractions)}"
                )
        elif self.split is not None:
            raise ConfigError(
                f"CsvSource.split {self.split!r} needs fractions (e.g. {{train: 0.8, test: 0.2}}); to keep the rows "
                f"of a split column, use where: {{split: {self.split}}}"
            )

    def _index(self, names: list[str], column: str, field_name: str) -> int:
        if column in names:
            return names.index(column)
        raise ConfigError(
            f"CsvSource.{field_name}: column {column!r} is not in the header of {self.path!r}"
            f"{suggestion(column, names)}; its columns: {', '.join(names) or '(none)'}"
        )

    def load(self) -> Arrays:
        _check_file("CsvSource.path", self.path)
        try:
            with open(self.path, newline="", encoding="utf-8-sig") as f:
                rows = list(csv.reader(f, delimiter=self.delimiter))
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            raise ConfigError(f"CsvSource.path: cannot read {self.path!r} as CSV text: {e}") from None
        first_line = 1
        if self.header:
            if not rows:
                raise ConfigError(f"CsvSource.path: {self.path!r} is empty; it needs a header row")
            names = [n.strip() for n in rows[0]]
            rows, first_line = rows[1:], 2
        else:
            names = list(self.columns)
        lines = [(first_line + i, r) for i, r in enumerate(rows) if any(c.strip() for c in r)]  # blank lines skipped
        for line, r in lines:
            if len(r) != len(names):
                raise ConfigError(
                    f"CsvSource: {self.path}:{line} has {len(r)} fields but the header names {len(names)} columns"
                )
        for column, value in self.where.items():
            i = self._index(names, column, "where")
            lines = [(line, r) for line, r in lines if r[i].strip() == str(value)]
        lines = self._split(lines)
        x = self._parse(names, lines, self.inputs, "inputs", np.dtype(self.dtype))
        out: Arrays = {self.input_key: x}
        if self.targets:
            y = self._parse(names, lines, self.targets, "targets", np.dtype(self.target_dtype))
            if len(self.targets) == 1 and np.issubdtype(y.dtype, np.integer):
                y = y[:, 0]
            out[self.target_key] = y
        return check_arrays(f"CsvSource({self.path!r})", out)

    def _split(self, lines: list[tuple[int, list[str]]]) -> list[tuple[int, list[str]]]:
        if not self.fractions or self.split is None:
            return lines
        n = len(lines)
        perm = np.random.default_rng([self.seed, n]).permutation(n)
        names = list(self.fractions)
        bounds = np.round(np.cumsum([self.fractions[k] for k in names]) * n).astype(int)
        start = int(bounds[names.index(self.split) - 1]) if names.index(self.split) else 0
        chosen = np.sort(perm[start : int(bounds[names.index(self.split)])])
        return [lines[i] for i in chosen]

    def _parse(
        self, names: list[str], lines: list[tuple[int, list[str]]], columns: tuple[str, ...], what: str, dt: np.dtype
    ) -> np.ndarray:
        idx = [self._index(names, c, what) for c in columns]
        out = np.empty((len(lines), len(idx)), dtype=dt)
        for j, (i, column) in enumerate(zip(idx, columns, strict=True)):
            for row, (line, r) in enumerate(lines):
                text = r[i].strip()
                try:
                    out[row, j] = int(text) if dt.kind in "iu" else float(text)
                except (ValueError, OverflowError):
                    raise ConfigError(
                        f"CsvSource: {self.path}:{line}, column {column!r}: {text!r} is not a {dt.name} number"
                    ) from None
        return out

    @classmethod
    def example(cls) -> CsvSource:
        return cls(
            path="data/houses.csv",
            inputs=("area", "rooms"),
            targets=("price",),
            where={"city": "A"},
            split="train",
            fractions={"train": 0.8, "test": 0.2},
        )
