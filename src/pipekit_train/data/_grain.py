"""`RandomAccessSource`: your own Grain data source (or ``grain.MapDataset``) as the records of a dataset.

Grain's random-access protocol is two methods: ``len(source)`` and ``source[i]`` for ``0 <= i < len(source)``
(``grain.sources.RandomAccessDataSource``; ``grain.sources.ArrayRecordDataSource`` and a ``grain.MapDataset`` follow
it). `RandomAccessSource` reads every record once per process, in index order, and stacks each key into one array,
so the dataset's order of records, its batches, its data position and exact resume are those of every other source
(``{"epoch", "batch"}``; ``docs/checkpoints.md``). Each record must be a mapping of equally shaped arrays (or
numbers). The source lives in memory: it cannot be written to YAML, and the stage's artifact records the shapes.

Example:
    >>> import numpy as np
    >>> from pipekit_train.data._grain import RandomAccessSource
    >>> class Squares:
    ...     def __len__(self):
    ...         return 3
    ...     def __getitem__(self, i):
    ...         return {"x": np.float32(i), "y": np.float32(i * i)}
    >>> RandomAccessSource(records=Squares()).load()["y"]
    array([0., 1., 4.], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from pipekit import ConfigError

from ._sources import Arrays, Source, check_arrays

__all__ = ["RandomAccessSource"]

_PROTOCOL = (
    "Grain's random-access protocol (len(source) and source[i], e.g. a grain.MapDataset or ArrayRecordDataSource)"
)


class RandomAccessSource(Source):
    """The records of an object following Grain's random-access protocol, stacked per key.

    Args:
        records: ``len(records)`` and ``records[i]`` (a mapping ``{key: array}``): a Grain data source such as
            ``grain.sources.ArrayRecordDataSource`` (with a parsing ``.map``), a ``grain.MapDataset``, or your own
            class.
    """

    _yaml_serializable: ClassVar[bool] = False

    records: Any

    def validate(self) -> None:
        missing = [m for m in ("__len__", "__getitem__") if not hasattr(type(self.records), m)]
        if missing:
            raise ConfigError(
                f"RandomAccessSource.records must follow {_PROTOCOL}; {type(self.records).__name__} has no "
                f"{' and no '.join(missing)}"
            )

    def load(self) -> Arrays:
        owner = f"RandomAccessSource({type(self.records).__name__})"
        n = len(self.records)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"{owner}: len(records) must be a positive int, got {n!r}")
        first = self.records[0]
        if not isinstance(first, Mapping) or not first:
            raise ConfigError(
                f"{owner}: records[0] must be a mapping {{key: array}} (one record), got {type(first).__name__}"
            )
        keys = list(first)
        columns: dict[str, list[Any]] = {k: [] for k in keys}
        for i in range(n):
            record = first if i == 0 else self.records[i]
            if not isinstance(record, Mapping) or list(record) != keys:
                got = list(record) if isinstance(record, Mapping) else type(record).__name__
                raise ConfigError(f"{owner}: records[{i}] must have the keys {keys} of records[0], got {got}")
            for k in keys:
                columns[k].append(np.asarray(record[k]))
        out: Arrays = {}
        for k, values in columns.items():
            shapes = {v.shape for v in values}
            if len(shapes) > 1:
                raise ConfigError(f"{owner}: {k!r} must have one shape in every record, got {sorted(shapes)}")
            out[k] = np.stack(values)
        return check_arrays(owner, out)

    @classmethod
    def example(cls) -> RandomAccessSource:
        return cls(records=[{"x": np.zeros(2, np.float32), "y": np.int32(i % 2)} for i in range(4)])
