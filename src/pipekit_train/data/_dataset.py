"""`TrainingDataset`: a source, whole-batch transforms and how to iterate them, as one operator.

It reads its source's arrays once per process (cached by value), works out the shapes after the transforms
without reading a batch (`TrainingDataset.element_spec`), fits an unfitted `Standardize` on its own records
(`TrainingDataset.fitted`), hashes its content for provenance and resume (`TrainingDataset.content_hash`) and makes
the batch iterators: the order of the records, the batches on Grain and the iterator's checkpointable state are in
``_iterator.py``.

Example:
    >>> import numpy as np
    >>> from pipekit_train.data._dataset import TrainingDataset
    >>> from pipekit_train.data._sources import ArraySource
    >>> ds = TrainingDataset(source=ArraySource(arrays={"x": np.arange(10.0), "y": np.arange(10)}))
    >>> it = ds.iterator(batch_size=4, seed=0)
    >>> next(it)["y"].shape, ds.num_batches(4), it.get_state()
    ((4,), 2, {'epoch': 0, 'batch': 1})
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Literal

import numpy as np

import pipekit
from pipekit import ConfigError, Operator

from ._iterator import BatchIterator, _BatchDataset, _Plan
from ._numeric import OneHot
from ._sources import Arrays, RegisteredSource, Source
from ._standardize import fit_statistics, with_statistics
from ._transforms import Batch, Spec, Transform

__all__ = ["TrainingDataset"]

_HASH_CHUNK_BYTES = 1 << 24


# Per-process caches keyed by operator value -----------------------------------------------------------------
class _Memo:
    """A per-process cache keyed by an operator's value, with a fast path for the very same object.

    Hashing an operator that holds arrays (`ArraySource`) hashes their bytes, so repeated calls on one object
    look it up by identity first (a weak reference, so a dead object's id is never mistaken for a live one).
    A ``None`` key caches by identity only, so in-memory arrays are not kept alive after their dataset.
    """

    def __init__(self) -> None:
        self._by_value: dict[Hashable, Any] = {}
        self._by_id: dict[int, tuple[weakref.ref[Any], Any]] = {}
        self._lock = threading.Lock()

    def get(self, owner: object, key: Hashable | None, compute: Callable[[], Any]) -> Any:
        oid = id(owner)
        hit = self._by_id.get(oid)
        if hit is not None and hit[0]() is owner:
            return hit[1]
        with self._lock:
            if key is None:
                value = compute()
            else:
                try:
                    value = self._by_value[key]
                except KeyError:
                    value = self._by_value[key] = compute()
            by_id = self._by_id
            by_id[oid] = (weakref.ref(owner, lambda _ref: by_id.pop(oid, None)), value)
        return value


_ARRAYS = _Memo()
_HASHES = _Memo()
_FITTED = _Memo()
_SOURCES = _Memo()


def _file_identity(source: object) -> Hashable:
    """What makes a file source's value mean the same data: its resolved path and the file's stat.

    A relative ``path`` resolves against the working directory, so ``data.npz`` in two directories (or a file
    rewritten in place) must not share a cache entry.
    """
    if isinstance(source, Source):
        files = source.files_identity()
        if files is not None:
            return files
    path = getattr(source, "path", None)
    if not isinstance(path, str) or not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return os.path.abspath(path)
    return (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)


def _read_only(arrays: Arrays) -> Arrays:
    """Read-only views, so the cached arrays cannot be changed through `TrainingDataset.arrays`."""
    out: Arrays = {}
    for key, value in arrays.items():
        if isinstance(value, np.ndarray) and value.flags.writeable:
            value = value.view()
            value.flags.writeable = False
        out[key] = value
    return out


def _positive_int(where: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{where}: {name} must be a positive int, got {value!r}")
    return int(value)


# The operator -------------------------------------------------------------------------------------------------
class TrainingDataset(Operator):
    """A source, transforms applied to whole batches, and how to iterate: shuffled epochs of fixed-size batches.

    Args:
        source: the `Source` of the records (`ArraySource`, `NpzSource`, `NpySource`, `RegisteredSource`).
        transforms: `Transform` operators applied in order to each batch.
        shuffle: visit each epoch in a fresh permutation (from the iterator's seed and the epoch); else in order.
        drop_remainder: drop the last, short batch of each epoch in `iterator` (`epoch_batches` always keeps it).
        prefetch: batches Grain prepares ahead in a background thread; 0 prepares each batch when asked.
        device_resident: ``auto`` puts a training set below the threshold (`pipekit_train.data._device`: 256 MiB,
            or an eighth of the device's memory) on the device once and slices each step's batch inside the
            compiled call from the epoch's rows in order, when the backend supports it; ``true`` insists (an error
            says why it cannot), ``false`` always uses the host path. The batches are the same either way
            (docs/performance.md).
    """

    source: Source
    transforms: tuple[Transform, ...] = ()
    shuffle: bool = True
    drop_remainder: bool = True
    prefetch: int = 0
    device_resident: bool | Literal["auto"] = "auto"

    def validate(self) -> None:
        if self.prefetch < 0:
            raise ConfigError(f"TrainingDataset.prefetch must be a non-negative int, got {self.prefetch}")

    @classmethod
    def example(cls) -> TrainingDataset:
        return cls(
            source=RegisteredSource(name="digits", kwargs={"label_fraction": 0.1}),
            transforms=(OneHot(key="y", num_classes=10),),
            drop_remainder=False,
            prefetch=2,
        )

    def arrays(self) -> Arrays:
        """The source's arrays (before transforms), read-only, loaded once per process and cached.

        File and registered sources are cached by value, so equal datasets share one copy; an in-memory source
        (`ArraySource`) already holds its arrays and is cached only while it lives.
        """
        source = self.source
        key = (source, _file_identity(source)) if type(source)._yaml_serializable else None
        return dict(_ARRAYS.get(source, key, lambda: _read_only(source.load())))

    @property
    def lazy(self) -> bool:
        """Whether the source is read per batch (`RandomAccessSource`) rather than held in memory."""
        return any(not isinstance(v, np.ndarray) for v in self.arrays().values())  # `RecordColumn`s

    def num_records(self) -> int:
        """The number of records in the source."""
        return len(next(iter(self.arrays().values())))

    def element_spec(self) -> Spec:
        """``{key: (per_example_shape, dtype)}`` after the transforms, worked out without reading a batch."""
        spec: Spec = {k: (tuple(v.shape[1:]), v.dtype) for k, v in self.arrays().items()}
        for t in self.transforms:
            spec = t.spec(spec)
        return spec

    def num_batches(self, batch_size: int) -> int:
        """Batches per epoch of `iterator` (`drop_remainder` drops the short last one)."""
        batch_size = _positive_int("TrainingDataset.num_batches", "batch_size", batch_size)
        n = self.num_records()
        if not self.drop_remainder:
            return math.ceil(n / batch_size)
        if batch_size > n:
            raise ConfigError(
                f"TrainingDataset: batch_size {batch_size} is larger than the {n} records, so drop_remainder=True "
                f"leaves no batch at all; use a batch_size of at most {n} or drop_remainder=False"
            )
        return n // batch_size

    def iterator(self, batch_size: int, seed: int, shard: tuple[int, int] | None = None) -> BatchIterator:
        """An endless `BatchIterator`: epoch after epoch, each in ``default_rng([seed, epoch])`` order.

        `shard` ``(index, count)``: read only the `index`-th of `count` equal contiguous parts of every batch (one
        process of a multi-process run; `batch_size` stays the global batch and must split evenly).
        """
        batch_size = _positive_int("TrainingDataset.iterator", "batch_size", batch_size)
        if shard is not None and (not 0 <= shard[0] < shard[1] or batch_size % shard[1]):
            raise ConfigError(
                f"TrainingDataset.iterator: shard {shard!r} must be (index, count) with 0 <= index < count and count "
                f"dividing batch_size {batch_size}"
            )
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError(f"TrainingDataset.iterator: seed must be a non-negative int, got {seed!r}")
        per_epoch = self.num_batches(batch_size)
        if per_epoch == 0:
            raise ConfigError("TrainingDataset.iterator: the source has no records, so there is nothing to iterate")
        arrays = self.arrays()
        plan = _Plan(self.num_records(), batch_size, per_epoch, self.shuffle, int(seed), shard)
        return BatchIterator(_BatchDataset(arrays, plan, sys.maxsize), self.fitted().transforms, self.prefetch)

    def epoch_batches(self, batch_size: int) -> Iterator[Batch]:
        """One pass in record order, without shuffling, keeping the short last batch (for evaluation)."""
        batch_size = _positive_int("TrainingDataset.epoch_batches", "batch_size", batch_size)
        n = self.num_records()
        per_epoch = math.ceil(n / batch_size)
        ds = _BatchDataset(self.arrays(), _Plan(n, batch_size, per_epoch, False, 0), per_epoch)
        return self._ordered(ds)

    def _ordered(self, ds: _BatchDataset) -> Iterator[Batch]:
        transforms = self.fitted().transforms
        fns = tuple(t.apply for t in transforms)
        for index in range(len(ds)):
            batch = ds[index]
            if any(t.positional for t in transforms):
                rows, _ = ds.rows(index)
                for t in transforms:
                    batch = t.apply_at(batch, rows, 0, 0)
                yield batch
                continue
            for fn in fns:
                batch = fn(batch)
            yield batch

    def fitted(self) -> TrainingDataset:
        """This dataset with its source fitted on its own records (`Source.fit`: a `CsvSource`'s classes,
        categories and imputed values) and every unfitted `Standardize` fitted on them (itself when nothing is
        left to fit).

        A `TrainingLoop` fits its training dataset this way and gives the same statistics to its validation and
        test datasets (`with_statistics`, `with_source_statistics`). Computed once per process for equal datasets.
        """
        from ._standardize import Standardize

        ds = self
        serializable = type(self.source)._yaml_serializable
        if not self.source.fitted:
            key = (self.source, _file_identity(self.source)) if serializable else None
            ds = self.replace(source=_SOURCES.get(self.source, key, self.source.fit))
        if not any(isinstance(t, Standardize) and not t.fitted for t in ds.transforms):
            return ds
        fit_key = (ds.source, _file_identity(ds.source), ds.transforms) if serializable else None
        fitted = _FITTED.get(ds, fit_key, lambda: fit_statistics(ds.arrays(), ds.transforms))
        return ds.replace(transforms=fitted)

    def with_source_statistics(
        self, statistics: dict[str, Any] | None, owner: str = "TrainingDataset"
    ) -> TrainingDataset:
        """This dataset with an unfitted source given `statistics` (the training split's `Source.fitted_statistics`,
        as a stage's artifact records them in ``source_statistics``); itself when there are none."""
        if not statistics or self.source.fitted:
            return self
        return self.replace(source=self.source.with_fitted(statistics, owner))

    def with_statistics(self, statistics: dict[str, Any], owner: str = "TrainingDataset") -> TrainingDataset:
        """This dataset with every unfitted `Standardize` given `statistics` (``{key: {"mean", "std"}}``, those
        fitted on a training split); a key without statistics is a `ConfigError` naming `owner`."""
        return self.replace(transforms=with_statistics(self.transforms, statistics, owner))

    def content_hash(self) -> str:
        """``"sha256:<hex>"`` of the keys, dtypes, shapes and bytes of the arrays and the transforms' YAML.

        Computed once per process; the same on every machine for the same data and transforms (bytes are
        hashed little-endian and C-ordered). Shuffling, batching and prefetching do not change it.
        """
        key = (
            (self.source, _file_identity(self.source), self.transforms)
            if type(self.source)._yaml_serializable
            else None
        )
        return str(_HASHES.get(self, key, self._compute_hash))

    def _compute_hash(self) -> str:
        h = hashlib.sha256(b"pipekit-train dataset v1\n")
        for key, value in sorted(self.arrays().items()):
            dtype = value.dtype if value.dtype.byteorder == "|" else value.dtype.newbyteorder("<")
            header = {"key": key, "dtype": dtype.str, "shape": list(value.shape)}
            h.update(json.dumps(header, sort_keys=True).encode() + b"\n")
            rows = max(1, _HASH_CHUNK_BYTES // max(1, value.itemsize * math.prod(value.shape[1:])))
            for start in range(0, len(value), rows):
                chunk = np.ascontiguousarray(value[start : start + rows], dtype=dtype)
                h.update(chunk.tobytes())
        for t in self.transforms:
            text = pipekit.dumps(t).encode()
            h.update(b"transform %d\n" % len(text) + text)
        digest = self.source.content_digest()
        if digest is not None:  # only then: the hashes of the other sources stay what they were
            h.update(b"source " + digest.encode())
        return "sha256:" + h.hexdigest()
