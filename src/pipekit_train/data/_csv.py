"""`CsvSource`: the columns of a CSV file as an input array and a target array, without writing code.

Read with Python's ``csv`` module (no pandas): the header names the columns, `inputs` and `targets` pick them
(names, glob patterns or ``{all_except: [...]}``), `where` keeps the rows whose columns hold given values (a
``split`` or ``city`` column), and `fractions` with `seed` cut what is left into named splits by a seeded
permutation (every split of one file and seed is disjoint, and together they cover every row). Rows come back in
file order. Class labels, categorical columns and imputed missing values are fitted on the training split
(``_tabular.py``).

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
from typing import Any

import numpy as np

from pipekit import ConfigError, field, suggestion

from ._sources import Arrays, Source, _check_file, check_arrays
from ._tabular import (
    STRATEGIES,
    Lines,
    encode_classes,
    encode_inputs,
    fit_table,
    is_pattern,
    number,
    resolve_categorical,
    resolve_inputs,
)
from ._transforms import _check_dtype

__all__ = ["CsvSource"]


class CsvSource(Source):
    """Columns of a CSV file: `inputs` as ``input_key`` (records x features), `targets` as ``target_key``.

    Relative paths are read from the working directory, like every file source. Each value must parse as a
    number of its dtype; a malformed cell, a missing one (empty, ``NA``, ``NaN``, ``?``, ...) without `missing`,
    an unseen class or an unseen category is an error naming the file, the line and the column.

    What depends on the data (the columns a pattern or `all_except` picks, the `classes`, the categories of each
    `categorical` column, the mean or median that fills a missing cell) is fitted on the training split: a
    `TrainingLoop` fits its training dataset's source, gives its validation and test sources the same values and
    records them in the artifact (``source_statistics``), and ``evaluate`` and ``predict`` read new files with
    them. A source used on its own fits on its own rows.

    Args:
        path: the CSV file.
        inputs: the input columns, in order: names and glob patterns (``[f*, age]``; a pattern matches in header
            order), or ``{all_except: [id]}``: every column but those. A pattern or `all_except` never picks a
            target or a `where` column. They become ``input_key`` of shape ``(records, features)``.
        targets: the target columns; ``target_key`` has shape ``(records, len(targets))``, or ``(records,)`` for
            one integer column or `class_labels`. Empty: no targets.
        input_key: the key of the inputs.
        target_key: the key of the targets.
        dtype: the inputs' numpy dtype.
        target_dtype: the targets' numpy dtype (an integer dtype for class labels given as indices).
        header: whether the first row (after `skip_rows`) names the columns; without one, name them in `columns`.
        columns: the column names of a file without a header row (ignored with a header).
        delimiter: the one-character field separator.
        skip_rows: lines to skip before the header (scikit-learn's CSVs have a count line first).
        where: keep only rows whose column holds this value (compared as text), e.g. ``{city: A, split: train}``.
        split: with `fractions`, the named part of the rows `where` kept.
        fractions: ``{name: fraction}`` summing to 1: the rows `where` kept, cut by a permutation from `seed`.
        seed: the permutation's seed (non-negative).
        class_labels: the one target column holds class labels (names such as ``class_0``, or integers): they
            become class indices ``0..K-1`` into the sorted classes of the training split (int32, or an integer
            `target_dtype`). ``predict`` writes the class names back.
        categorical: input columns (names or patterns) holding categories: each becomes one 0/1 column per
            category of the training split, in sorted order. An unseen category is refused.
        missing: ``{strategy: mean | median | constant, value: V}``: fill a missing numeric input cell with the
            training split's mean or median of its column, or with `value` (a missing category: all zeros).
            Empty (the default): a missing cell is refused. Targets are never imputed.
        statistics: the fitted values (``inputs``, ``features``, ``classes``, ``categories``, ``fill``); leave it
            out to fit them on the training split (the usual case).
    """

    path: str
    inputs: tuple[str, ...] | dict[str, tuple[str, ...]]
    targets: tuple[str, ...] = ()
    input_key: str = "x"
    target_key: str = "y"
    dtype: str = "float32"
    target_dtype: str = "float32"
    header: bool = True
    columns: tuple[str, ...] = ()
    delimiter: str = ","
    skip_rows: int = 0
    where: dict[str, str] = field(default_factory=dict)
    split: str | None = None
    fractions: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    class_labels: bool = False
    categorical: tuple[str, ...] = ()
    missing: dict[str, str | float] = field(default_factory=dict)
    statistics: dict[str, Any] | None = None

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("CsvSource.path must be a non-empty path to a CSV file, got ''")
        if isinstance(self.inputs, dict):
            if list(self.inputs) != ["all_except"]:
                extra = next(k for k in self.inputs if k != "all_except")
                raise ConfigError(
                    f"CsvSource.inputs: {extra!r} is not a selection{suggestion(extra, ['all_except'])}; give a list "
                    "of columns (names or glob patterns) or {all_except: [columns]}"
                )
        elif not self.inputs:
            raise ConfigError("CsvSource.inputs must name at least one column, got []")
        for name in ("inputs", "targets", "categorical"):
            cols = getattr(self, name)
            cols = cols["all_except"] if isinstance(cols, dict) else cols
            if len(set(cols)) != len(cols):
                raise ConfigError(f"CsvSource.{name} must not repeat a column, got {list(cols)}")
        if self.skip_rows < 0:
            raise ConfigError(f"CsvSource.skip_rows must be a non-negative int, got {self.skip_rows}")
        if self.class_labels and len(self.targets) != 1:
            raise ConfigError(
                f"CsvSource.class_labels needs exactly one target column (the labels), got targets {list(self.targets)}"
            )
        if self.class_labels and np.dtype(self.target_dtype).kind == "f" and self.target_dtype != "float32":
            raise ConfigError(
                f"CsvSource.target_dtype must be an integer dtype with class_labels, got {self.target_dtype}"
            )
        self._validate_missing()
        if self.statistics is not None:
            unknown = sorted(set(self.statistics) - {"inputs", "features", "classes", "categories", "fill"})
            if unknown:
                raise ConfigError(
                    f"CsvSource.statistics has unknown entries {unknown}; it holds inputs, features, classes, "
                    "categories and fill (fitted on the training split)"
                )
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

    def _validate_missing(self) -> None:
        if not self.missing:
            return
        unknown = [k for k in self.missing if k not in ("strategy", "value")]
        if unknown:
            raise ConfigError(
                f"CsvSource.missing: {unknown[0]!r} is not a setting{suggestion(unknown[0], ['strategy', 'value'])}; "
                "give {strategy: mean | median | constant, value: V}"
            )
        strategy = self.missing.get("strategy")
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"CsvSource.missing.strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}"
                f"{suggestion(str(strategy), STRATEGIES)}"
            )
        value = self.missing.get("value")
        if strategy == "constant" and (isinstance(value, (bool, str)) or value is None):
            raise ConfigError(f"CsvSource.missing.value must be a number with strategy constant, got {value!r}")
        if strategy != "constant" and "value" in self.missing:
            raise ConfigError(f"CsvSource.missing.value is for strategy constant only, got strategy {strategy!r}")

    def _needs_fit(self) -> bool:
        patterns = isinstance(self.inputs, dict) or any(is_pattern(c) for c in self.inputs)
        return (
            patterns
            or self.class_labels
            or bool(self.categorical)
            or self.missing.get("strategy") in ("mean", "median")
        )

    @property
    def fitted(self) -> bool:
        """Whether nothing is left to fit on the training split (`statistics` given, or nothing to fit)."""
        return self.statistics is not None or not self._needs_fit()

    def fit(self) -> CsvSource:
        """This source with `statistics` fitted on its own rows (itself when there is nothing to fit)."""
        if self.fitted:
            return self
        return self.replace(statistics=self._fit(*self._rows()))

    def fitted_statistics(self) -> dict[str, Any] | None:
        return None if self.statistics is None else dict(self.statistics)

    def with_fitted(self, statistics: dict[str, Any] | None, owner: str) -> CsvSource:
        if self.fitted or not statistics:
            return self
        if self.class_labels and "classes" not in statistics:
            raise ConfigError(
                f"{owner}: CsvSource.class_labels needs the training split's classes, but it recorded none; read "
                "the training data with class_labels: true too"
            )
        return self.replace(statistics=dict(statistics))

    def header_names(self) -> list[str]:
        """The column names: the header row's (after `skip_rows`), or `columns`."""
        return self._rows()[0]

    def _fit(self, names: list[str], lines: Lines) -> dict[str, Any]:
        inputs = self._inputs(names)
        return fit_table(
            self.path,
            names,
            lines,
            inputs=inputs,
            categorical=resolve_categorical(self.categorical, inputs),
            strategy=self.missing.get("strategy"),  # type: ignore[arg-type]
            class_column=self.targets[0] if self.class_labels else None,
        )

    def _inputs(self, names: list[str]) -> list[str]:
        return resolve_inputs(self.inputs, names, (*self.targets, *self.where), self.path)

    def _index(self, names: list[str], column: str, field_name: str) -> int:
        if column in names:
            return names.index(column)
        raise ConfigError(
            f"CsvSource.{field_name}: column {column!r} is not in the header of {self.path!r}"
            f"{suggestion(column, names)}; its columns: {', '.join(names) or '(none)'}"
        )

    def _rows(self) -> tuple[list[str], Lines]:
        """The column names and the kept rows (after `where` and `split`), each with its line in the file."""
        _check_file("CsvSource.path", self.path)
        try:
            with open(self.path, newline="", encoding="utf-8-sig") as f:
                rows = list(csv.reader(f, delimiter=self.delimiter))
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            raise ConfigError(f"CsvSource.path: cannot read {self.path!r} as CSV text: {e}") from None
        rows = rows[self.skip_rows :]
        first_line = 1 + self.skip_rows
        if self.header:
            if not rows:
                raise ConfigError(f"CsvSource.path: {self.path!r} is empty; it needs a header row")
            names = [n.strip() for n in rows[0]]
            rows, first_line = rows[1:], first_line + 1
        else:
            names = list(self.columns)
        lines = [(first_line + i, r) for i, r in enumerate(rows) if any(c.strip() for c in r)]  # blank lines skipped
        for line, r in lines:
            if len(r) != len(names):
                raise ConfigError(
                    f"CsvSource: {self.path}:{line} has {len(r)} fields but the header names {len(names)} columns"
                    + (" (a line before the header? skip it with skip_rows: N)" if line == first_line else "")
                )
        for column, value in self.where.items():
            i = self._index(names, column, "where")
            lines = [(line, r) for line, r in lines if r[i].strip() == str(value)]
        return names, self._split(lines)

    def load(self) -> Arrays:
        names, lines = self._rows()
        for column in self.targets:
            self._index(names, column, "targets")
        stats = self.statistics
        if stats is None and self._needs_fit():
            stats = self._fit(names, lines)  # a source on its own fits on its own rows
        stats = stats or {}
        inputs = list(stats["inputs"]) if "inputs" in stats else self._inputs(names)
        for column in inputs:
            self._index(names, column, "inputs")
        x = encode_inputs(
            self.path,
            names,
            lines,
            inputs=inputs,
            categories=stats.get("categories", {}),
            missing=self.missing,
            fill=stats.get("fill", {}),
            dtype=np.dtype(self.dtype),
        )
        out: Arrays = {self.input_key: x}
        if self.class_labels:
            dt = np.dtype(self.target_dtype) if np.dtype(self.target_dtype).kind in "iu" else np.dtype("int32")
            out[self.target_key] = encode_classes(self.path, names, lines, self.targets[0], stats["classes"], dt)
        elif self.targets:
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
                out[row, j] = number(self.path, line, column, r[i].strip(), dt)
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
