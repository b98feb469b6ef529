"""`RandomAccessSource`: your own Grain data source (or ``grain.MapDataset``) as the records of a dataset.

Grain's random-access protocol is two methods: ``len(source)`` and ``source[i]`` for ``0 <= i < len(source)``
(``grain.sources.RandomAccessDataSource``; ``grain.sources.ArrayRecordDataSource`` and a ``grain.MapDataset`` follow
it; ``__getitems__`` for a list of indices is used when the source has it). By default `RandomAccessSource` reads
lazily: record 0 tells each key's per-record shape and dtype, and each batch reads only its own records
(`RecordColumn`), so a source far larger than memory trains; the order of records, the batches, the data position
and exact resume are those of every other source (``{"epoch", "batch"}``; ``docs/checkpoints.md``). Reading the
whole source happens only where the whole source is the point: the data hash in the artifact, pre-flight's NaN
check, and fitting a `Standardize` (the keys it standardizes), each streamed in chunks. ``in_memory=True`` reads every
record once, in index order, and stacks each key (faster batches for a source that fits in memory). Each record must
be a mapping of equally shaped arrays (or numbers). The source cannot be written to YAML.

Example:
    >>> import numpy as np
    >>> from pipekit_train.data._grain import RandomAccessSource
    >>> class Squares:
    ...     def __len__(self):
    ...         return 3
    ...     def __getitem__(self, i):
    ...         return {"x": np.float32(i), "y": np.float32(i * i)}
    >>> column = RandomAccessSource(records=Squares()).load()["y"]
    >>> column.shape, column[np.array([2, 0])]
    ((3,), array([4., 0.], dtype=float32))
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from pipekit import ConfigError

from ._sources import Arrays, Source, check_arrays

__all__ = ["RandomAccessSource", "RecordColumn"]

_PROTOCOL = (
    "Grain's random-access protocol (len(source) and source[i], e.g. a grain.MapDataset or ArrayRecordDataSource)"
)


def _record(owner: str, record: Any, index: int, keys: list[str] | None) -> Mapping[str, Any]:
    if not isinstance(record, Mapping) or not record:
        raise ConfigError(
            f"{owner}: records[{index}] must be a mapping {{key: array}} (one record), got {type(record).__name__}"
        )
    if keys is not None and list(record) != keys:
        raise ConfigError(f"{owner}: records[{index}] must have the keys {keys} of records[0], got {list(record)}")
    return record


class _Reader:
    """Reads records by index for every `RecordColumn` of one source; the last block read is shared by the keys.

    `_BatchDataset.gather` indexes each key with the same index array, so the records of a batch are read once
    (not once per key). A lock keeps Grain's prefetch thread and the training thread from interleaving.
    """

    def __init__(self, owner: str, records: Any, n: int, spec: dict[str, tuple[tuple[int, ...], np.dtype[Any]]]):
        self.owner = owner
        self.records = records
        self.n = n
        self.spec = spec
        self.keys = list(spec)
        self.reads = 0  # records read so far (tests count them)
        self._lock = threading.Lock()
        self._last: tuple[Any, dict[str, np.ndarray]] | None = None

    def take(self, index: Any) -> dict[str, np.ndarray]:
        with self._lock:
            last = self._last
            if last is not None and last[0] is index:
                return last[1]
            rows = self._rows(index)
            block = self._read(rows)
            self._last = (index, block)  # holds `index`, so its id is not reused while cached
            return block

    def _rows(self, index: Any) -> np.ndarray:
        if isinstance(index, slice):
            return np.arange(self.n)[index]
        rows = np.asarray(index)
        if rows.dtype.kind not in "iu":
            raise TypeError(f"{self.owner}: records are read by integer indices or a slice, got {rows.dtype}")
        rows = np.where(rows < 0, rows + self.n, rows)
        if rows.size and (rows.min() < 0 or rows.max() >= self.n):
            raise IndexError(f"{self.owner}: index out of range for {self.n} records")
        return rows

    def _read(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        flat = [int(i) for i in rows.reshape(-1)]
        getitems = getattr(self.records, "__getitems__", None)
        got = list(getitems(flat)) if getitems is not None and flat else [self.records[i] for i in flat]
        self.reads += len(flat)
        out: dict[str, np.ndarray] = {}
        for key, (shape, dtype) in self.spec.items():
            column = np.empty((len(flat), *shape), dtype)
            for j, (i, record) in enumerate(zip(flat, got)):
                value = np.asarray(_record(self.owner, record, i, self.keys)[key])
                if value.shape != shape:
                    raise ConfigError(
                        f"{self.owner}: {key!r} must have one shape in every record: records[0] has {shape}, "
                        f"records[{i}] has {value.shape}"
                    )
                column[j] = value
            out[key] = column.reshape(*rows.shape, *shape)
        return out


class RecordColumn:
    """One key of a lazily read source, as much of an array as a dataset needs: ``len``, ``shape``, ``dtype``,
    ``itemsize``, ``ndim`` and indexing by integer arrays or slices, which reads only those records.

    ``np.asarray(column)`` reads every record (the whole column in memory).
    """

    def __init__(self, reader: _Reader, key: str) -> None:
        self._reader = reader
        self.key = key
        shape, dtype = reader.spec[key]
        self.shape: tuple[int, ...] = (reader.n, *shape)
        self.dtype: np.dtype[Any] = dtype
        self.ndim = len(self.shape)
        self.itemsize = dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> np.ndarray:
        if isinstance(index, (int, np.integer)):
            return np.asarray(self._reader.take(np.asarray([index]))[self.key][0])
        return self._reader.take(index)[self.key]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[slice(None)]
        return whole if dtype is None else whole.astype(dtype)

    def __repr__(self) -> str:
        return f"RecordColumn({self.key!r}, shape={self.shape}, dtype={self.dtype}, of {self._reader.owner})"


class RandomAccessSource(Source):
    """The records of an object following Grain's random-access protocol, read lazily per batch (or stacked).

    Args:
        records: ``len(records)`` and ``records[i]`` (a mapping ``{key: array}``): a Grain data source such as
            ``grain.sources.ArrayRecordDataSource`` (with a parsing ``.map``), a ``grain.MapDataset``, or your own
            class.
        in_memory: read every record once and stack each key into one array (faster batches; the source must fit
            in memory); by default each batch reads only its own records.
    """

    _yaml_serializable: ClassVar[bool] = False

    records: Any
    in_memory: bool = False

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
        first = _record(owner, self.records[0], 0, None)
        spec = {}
        for key, value in first.items():
            if not isinstance(key, str):
                raise ConfigError(f"{owner}: record keys must be strings, got {key!r}")
            value = np.asarray(value)
            if value.dtype.kind == "O":
                raise ConfigError(f"{owner}[{key!r}] has dtype object; only numeric, bool and fixed-width dtypes work")
            spec[key] = (value.shape, value.dtype)
        reader = _Reader(owner, self.records, n, spec)
        if self.in_memory:
            return check_arrays(owner, reader.take(slice(None)))
        return {key: RecordColumn(reader, key) for key in spec}  # type: ignore[misc]

    @classmethod
    def example(cls) -> RandomAccessSource:
        return cls(records=[{"x": np.zeros(2, np.float32), "y": np.int32(i % 2)} for i in range(4)])
