"""Encoding a table's cells with settings fitted on the training split: which columns are inputs (names, glob
patterns, ``{all_except: [...]}``), class labels to class indices, categories to one-hot columns, and missing
values refused or imputed.

`CsvSource` reads the cells; `fit_table` turns the training split's cells into plain JSON statistics (the input
columns, the classes, the categories of each categorical column, the value that fills a missing cell) and
`encode_inputs` / `encode_classes` turn any split's cells into arrays with them, so that validation, test,
``evaluate`` and ``predict`` encode exactly as training did. Every refused cell is one line naming the file, the
line and the column.

Example:
    >>> from pipekit_train.data._tabular import class_order, resolve_inputs
    >>> class_order(["b", "a", "b"]), class_order(["10", "9"])
    (['a', 'b'], ['9', '10'])
    >>> resolve_inputs({"all_except": ("id",)}, ["id", "f1", "f2", "label"], ("label",), "t.csv")
    ['f1', 'f2']
"""

from __future__ import annotations

import fnmatch
import statistics as _stats
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from pipekit import ConfigError, suggestion

__all__ = [
    "MISSING",
    "STRATEGIES",
    "class_order",
    "encode_classes",
    "encode_inputs",
    "fit_table",
    "is_pattern",
    "number",
    "resolve_categorical",
    "resolve_inputs",
]

#: The cell texts (after stripping spaces) that mean "no value".
MISSING = frozenset({"", "NA", "N/A", "NaN", "nan", "null", "NULL", "None", "?"})

#: How `CsvSource.missing` fills a missing numeric cell.
STRATEGIES = ("mean", "median", "constant")

#: ``(line number in the file, the row's cells)`` for each kept row.
Lines = list[tuple[int, list[str]]]

_MSG_MISSING = (
    "CsvSource: {path}:{line}, column {column!r}: missing value {text!r}; impute it with "
    "missing: {{strategy: mean}} (or median, or constant with a value), fitted on the training split"
)


def is_pattern(name: str) -> bool:
    """Whether a column entry is a glob pattern (``f*``, ``x[0-9]``) rather than a name."""
    return any(c in name for c in "*?[")


def _not_in_header(field: str, column: str, names: Sequence[str], path: str) -> ConfigError:
    return ConfigError(
        f"CsvSource.{field}: column {column!r} is not in the header of {path!r}"
        f"{suggestion(column, names)}; its columns: {', '.join(names) or '(none)'}"
    )


def resolve_inputs(
    spec: Sequence[str] | Mapping[str, Sequence[str]], names: Sequence[str], excluded: Iterable[str], path: str
) -> list[str]:
    """The input columns `spec` names among the header `names`, in order, each once.

    `spec` is a list of names and glob patterns (a pattern matches in header order and never matches a column of
    `excluded`: the targets and the ``where`` columns), or ``{all_except: [...]}``: every column but those and
    `excluded`.
    """
    skip = set(excluded)
    if isinstance(spec, Mapping):
        dropped = list(spec.get("all_except", ()))
        for column in dropped:
            if column not in names:
                raise _not_in_header("inputs.all_except", column, names, path)
        chosen = [n for n in names if n not in skip and n not in dropped]
        if not chosen:
            raise ConfigError(
                f"CsvSource.inputs: {{all_except: {dropped}}} leaves no input column in {path!r} (its columns: "
                f"{', '.join(names)}; the targets and the where columns are never inputs)"
            )
        return chosen
    out: list[str] = []
    for entry in spec:
        if is_pattern(entry):
            hits = [n for n in fnmatch.filter(names, entry) if n not in skip]
            if not hits:
                raise ConfigError(
                    f"CsvSource.inputs: pattern {entry!r} matches no column of {path!r} (the targets and the where "
                    f"columns excepted); its columns: {', '.join(names)}"
                )
        elif entry not in names:
            raise _not_in_header("inputs", entry, names, path)
        else:
            hits = [entry]
        out.extend(h for h in hits if h not in out)
    return out


def resolve_categorical(patterns: Sequence[str], inputs: Sequence[str]) -> list[str]:
    """The input columns `patterns` (names or glob patterns) name, in input order."""
    chosen: set[str] = set()
    for entry in patterns:
        hits = fnmatch.filter(inputs, entry) if is_pattern(entry) else [entry] if entry in inputs else []
        if not hits:
            what = "pattern" if is_pattern(entry) else "column"
            raise ConfigError(
                f"CsvSource.categorical: {what} {entry!r} is not an input column{suggestion(entry, inputs)}; the "
                f"inputs: {', '.join(inputs)}"
            )
        chosen.update(hits)
    return [c for c in inputs if c in chosen]


def class_order(values: Iterable[str]) -> list[str]:
    """The distinct class labels, sorted: as numbers when every label is an integer, else as text."""
    distinct = set(values)
    try:
        return sorted(distinct, key=int)
    except ValueError:
        return sorted(distinct)


def _cells(names: Sequence[str], lines: Lines, column: str) -> list[tuple[int, str]]:
    i = list(names).index(column)
    return [(line, r[i].strip()) for line, r in lines]


def _number(path: str, line: int, column: str, text: str, dt: np.dtype, hint: str = "") -> float | int:
    try:
        return int(text) if dt.kind in "iu" else float(text)
    except (ValueError, OverflowError):
        raise ConfigError(
            f"CsvSource: {path}:{line}, column {column!r}: {text!r} is not a {dt.name} number{hint}"
        ) from None


_CATEGORICAL_HINT = "; a column of categories goes in categorical: [...] (one-hot encoded)"


def fit_table(
    path: str,
    names: Sequence[str],
    lines: Lines,
    *,
    inputs: Sequence[str],
    categorical: Sequence[str],
    strategy: str | None,
    class_column: str | None,
) -> dict[str, Any]:
    """The statistics of the training split's cells, as plain JSON data: ``inputs`` (the columns), ``features``
    (the encoded columns' names, ``color=red`` for a one-hot column), ``categories`` (``{column: [sorted
    values]}``), ``fill`` (``{column: mean or median}`` for `strategy` ``mean``/``median``) and ``classes`` (the
    sorted class labels of `class_column`)."""
    out: dict[str, Any] = {"inputs": list(inputs)}
    categories: dict[str, list[str]] = {}
    for column in categorical:
        seen = sorted({v for _, v in _cells(names, lines, column) if v not in MISSING})
        if not seen:
            raise ConfigError(f"CsvSource.categorical: column {column!r} has no values in the training split of {path}")
        categories[column] = seen
    if categories:
        out["categories"] = categories
    out["features"] = [f for c in inputs for f in ([f"{c}={v}" for v in categories[c]] if c in categories else [c])]
    if strategy in ("mean", "median"):
        fill: dict[str, float] = {}
        for column in inputs:
            if column in categories:
                continue
            values = [
                float(_number(path, line, column, v, np.dtype("float64"), _CATEGORICAL_HINT))
                for line, v in _cells(names, lines, column)
                if v not in MISSING
            ]
            if not values:
                raise ConfigError(
                    f"CsvSource.missing: column {column!r} has no values in the training split of {path} to take "
                    f"its {strategy} from"
                )
            fill[column] = float(np.mean(values)) if strategy == "mean" else float(_stats.median(values))
        out["fill"] = fill
    if class_column is not None:
        labels = []
        for line, v in _cells(names, lines, class_column):
            if v in MISSING:
                raise ConfigError(f"CsvSource: {path}:{line}, column {class_column!r}: missing class label {v!r}")
            labels.append(v)
        out["classes"] = class_order(labels)
    return out


def encode_inputs(
    path: str,
    names: Sequence[str],
    lines: Lines,
    *,
    inputs: Sequence[str],
    categories: Mapping[str, Sequence[str]],
    missing: Mapping[str, Any],
    fill: Mapping[str, float],
    dtype: np.dtype,
) -> np.ndarray:
    """The input columns as one ``(records, features)`` array: numbers as they are (a missing cell refused, or
    filled by `missing`'s strategy), each categorical column as one-hot columns of its fitted `categories` (an
    unseen category refused; a missing one, with `missing` set, all zeros)."""
    strategy = missing.get("strategy")
    blocks = []
    for column in inputs:
        cells = _cells(names, lines, column)
        if column in categories:
            cats = list(categories[column])
            index = {v: j for j, v in enumerate(cats)}
            block = np.zeros((len(cells), len(cats)), dtype=dtype)
            for row, (line, v) in enumerate(cells):
                if v in MISSING:
                    if strategy is None:
                        raise ConfigError(_MSG_MISSING.format(path=path, line=line, column=column, text=v))
                    continue  # no category: all zeros
                j = index.get(v)
                if j is None:
                    raise ConfigError(
                        f"CsvSource: {path}:{line}, column {column!r}: category {v!r} was not in the training split"
                        f"{suggestion(v, cats)}; its categories: {', '.join(cats)} (an unseen category is refused)"
                    )
                block[row, j] = 1
        else:
            block = np.empty((len(cells), 1), dtype=dtype)
            for row, (line, v) in enumerate(cells):
                if v in MISSING:
                    if strategy is None:
                        raise ConfigError(_MSG_MISSING.format(path=path, line=line, column=column, text=v))
                    block[row, 0] = missing["value"] if strategy == "constant" else fill[column]
                else:
                    block[row, 0] = _number(path, line, column, v, dtype, _CATEGORICAL_HINT)
        blocks.append(block)
    return np.concatenate(blocks, axis=1) if blocks else np.zeros((len(lines), 0), dtype=dtype)


def encode_classes(
    path: str, names: Sequence[str], lines: Lines, column: str, classes: Sequence[str], dtype: np.dtype
) -> np.ndarray:
    """The class labels of `column` as indices into `classes` (a label not among them refused)."""
    index = {v: i for i, v in enumerate(classes)}
    out = np.empty(len(lines), dtype=dtype)
    for row, (line, v) in enumerate(_cells(names, lines, column)):
        i = index.get(v)
        if i is None:
            what = "missing class label" if v in MISSING else f"class {v!r} was not in the training split"
            raise ConfigError(
                f"CsvSource: {path}:{line}, column {column!r}: {what}{suggestion(v, classes)}; its classes: "
                f"{', '.join(classes)}"
            )
        out[row] = i
    return out


def number(path: str, line: int, column: str, text: str, dt: np.dtype) -> float | int:
    """One cell as a number of `dt`, or one line naming the file, the line and the column."""
    if text in MISSING:
        raise ConfigError(
            f"CsvSource: {path}:{line}, column {column!r}: missing target value {text!r} (targets are never imputed)"
        )
    return _number(path, line, column, text, dt)
