"""The batches of a `TrainingDataset`: their order, random access to them on Grain, and `BatchIterator`, the
checkpointable iterator over them.

The order of records is plain data: epoch ``e`` visits the records in
``np.random.default_rng([seed, e]).permutation(n)`` order (the identity when ``shuffle=False``), and batch ``b`` of
epoch ``e`` is one fancy-index gather of ``perm[b*B:(b+1)*B]`` from each array, followed by the transforms on the
whole batch. The batches are a Grain data source with random access by global batch index
``g = e * num_batches + b`` (`_BatchDataset`); with ``prefetch > 0`` it becomes a Grain ``MapDataset`` mapped by
the transforms (Grain is imported only then), and the iterator is Grain's own
``to_iter_dataset(ReadOptions(num_threads=1, prefetch_buffer_size=prefetch))`` over it, and its
``{"next_index": g}`` state is what `BatchIterator.get_state` reports as ``{"epoch": e, "batch": b}``.

With ``prefetch=0`` (the default) `BatchIterator` calls ``_BatchDataset.__getitem__`` (random access; it
keeps the current epoch's permutation) and the transforms itself, skipping the statistics bookkeeping that
Grain's ``.map`` and ``to_iter_dataset`` add to every call. Measured on the 2-core build machine (numpy 2.4,
grain 0.2.18): 32-row batches of ``x: float32 (32,)`` and ``y: int32`` from 32,768 in-memory records, best of 9
passes over an epoch, range over separate runs, µs per batch:

==================================================================  ===========
plain numpy: ``{k: v[perm[s:s + 32]] for k, v in items}``             3.8 - 4.3
`BatchIterator`, ``prefetch=0`` (0.93 - 1.16x plain's batches/s)      3.2 - 4.6
``_BatchDataset`` random access ``ds[g]``                             3.0 - 3.3
``ds[g]`` through one Grain ``.map``                                  3.7 - 4.1
Grain ``to_iter_dataset(ReadOptions(num_threads=0, ...=0))``          7.4 - 8.0
`BatchIterator`, ``prefetch=4`` (Grain thread pool, 1 thread)          18 - 36
==================================================================  ===========

The background thread costs a hand-off per batch, so prefetching pays only when preparing a batch costs more
than that and leaves the GIL (memory-mapped `NpySource` pages, large records, heavy transforms): with a 200 µs
GIL-free producer and a 200 µs consumer, ``prefetch=4`` took 319 µs per batch against 632 µs without.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from pipekit import ConfigError

from ._sources import Arrays
from ._transforms import Batch, Transform

__all__ = ["BatchIterator", "position_index"]

_BLOCK = 8  # batches `BatchIterator` gathers at once without prefetching


# The order of records, and the batches as a Grain MapDataset ---------------------------------------------
class _Plan:
    """Which records form batch `b` of epoch `e`: ``perm(e)[b * batch_size:(b + 1) * batch_size]``."""

    __slots__ = ("batch_size", "identity", "local_batch_size", "n", "per_epoch", "seed", "shard", "shuffle")

    def __init__(
        self, n: int, batch_size: int, per_epoch: int, shuffle: bool, seed: int, shard: tuple[int, int] | None = None
    ) -> None:
        self.n = n
        self.batch_size = batch_size
        self.per_epoch = per_epoch
        self.shuffle = shuffle
        self.seed = seed
        self.identity = None if shuffle else np.arange(n)
        # Several processes (`TrainingDataset.iterator(shard=...)`): process `index` of `count` reads the
        # `index`-th contiguous part of every batch, so together they read exactly the one-process batches.
        self.shard = shard
        self.local_batch_size = batch_size // shard[1] if shard else batch_size

    def local(self, idx: np.ndarray) -> np.ndarray:
        """This process's part of each batch in `idx` (whole batches of `batch_size`; the last may be short)."""
        if self.shard is None:
            return idx
        index, count = self.shard
        parts = []
        for start in range(0, len(idx), self.batch_size):
            rows = idx[start : start + self.batch_size]
            size = len(rows) // count
            parts.append(rows[index * size : (index + 1) * size])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def perm(self, epoch: int) -> np.ndarray:
        if self.identity is not None:
            return self.identity
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)


class _BatchDataset:
    """Random access by global batch index ``g = epoch * per_epoch + batch`` to a gathered batch.

    A Grain data source (``len`` and ``[]``), wrapped by ``grain.MapDataset.source`` only when prefetching: Grain
    imports Orbax and TensorStore with it (about 60 MB and a second of start-up here), which a run without
    prefetching never needs before its first step.
    """

    def __init__(self, arrays: Arrays, plan: _Plan, length: int) -> None:
        self.items = tuple(arrays.items())
        self.plan = plan
        self._length = length
        self._per_epoch = plan.per_epoch
        self._batch_size = plan.batch_size
        self._cached: tuple[int, np.ndarray | None] = (-1, None)  # (epoch, its permutation)

    def __len__(self) -> int:
        return self._length

    def __str__(self) -> str:
        p = self.plan
        return f"_BatchDataset(records={p.n}, batch_size={p.batch_size}, shuffle={p.shuffle}, seed={p.seed})"

    def __getitem__(self, index: int) -> Batch:
        epoch, batch = divmod(index, self._per_epoch)
        return self.gather(epoch, batch, 1)

    def gather(self, epoch: int, batch: int, count: int) -> Batch:
        """Batches ``batch .. batch + count - 1`` of `epoch` as one block of rows: one fancy index per key."""
        cached_epoch, perm = self._cached
        if cached_epoch != epoch or perm is None:
            perm = self.plan.perm(epoch)
            self._cached = (epoch, perm)  # one atomic store, safe with Grain's reader thread
        start = batch * self._batch_size
        idx = self.plan.local(perm[start : start + count * self._batch_size])
        return {k: v[idx] for k, v in self.items}

    def rows(self, index: int) -> tuple[np.ndarray, int]:
        """The source indices of the records in global batch `index`, and its epoch (for random transforms)."""
        epoch, batch = divmod(index, self._per_epoch)
        start = batch * self._batch_size
        cached_epoch, perm = self._cached
        if cached_epoch != epoch or perm is None:
            perm = self.plan.perm(epoch)
            self._cached = (epoch, perm)
        return self.plan.local(perm[start : start + self._batch_size]), epoch


def _at(transform: Transform, ds: _BatchDataset, index: int, batch: Batch) -> Batch:
    """`transform` on Grain's batch `index` (for ``map_with_index``), told where the batch comes from."""
    rows, epoch = ds.rows(index)
    return transform.apply_at(batch, rows, epoch, ds.plan.seed)


def position_index(state: Any, per_epoch: int, owner: str) -> int:
    """The flat batch index of a data position ``{"epoch": e, "batch": b}``, checked: one-line `ConfigError`s
    naming `owner`'s ``set_state``, the rule and the value (a position from another batch size or dataset)."""
    if not isinstance(state, dict) or set(state) != {"epoch", "batch"}:
        raise ConfigError(f"{owner}.set_state expects {{'epoch': int, 'batch': int}}, got {state!r}")
    epoch, batch = state["epoch"], state["batch"]
    for name, value in (("epoch", epoch), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{owner}.set_state: {name} must be a non-negative int, got {value!r}")
    if batch >= per_epoch:
        raise ConfigError(
            f"{owner}.set_state: batch must be below the {per_epoch} batches per epoch, got {batch}; "
            "was the state saved with another batch_size or dataset?"
        )
    return int(epoch * per_epoch + batch)


class BatchIterator:
    """An endless, checkpointable iterator of batches over epochs (like Grain's ``DatasetIterator``).

    Made by `TrainingDataset.iterator`. `get_state` is a small JSON dict ``{"epoch": e, "batch": b}`` naming
    the next batch; `set_state` makes the next batch exactly the one that would have come. With prefetching, call
    `close` (or use ``with``) to stop the background thread early.
    """

    def __init__(self, dataset: _BatchDataset, transforms: tuple[Transform, ...], prefetch: int) -> None:
        self._ds = dataset
        self._fns = tuple(t.apply for t in transforms)
        # Random transforms (`Transform.positional`) are told which records, epoch and seed each batch is.
        self._positional = transforms if any(t.positional for t in transforms) else None
        self._per_epoch = dataset.plan.per_epoch
        self._next = 0  # the global index (epoch * per_epoch + batch) of the next batch
        self._ready: list[Batch] = []  # gathered batches not handed out yet, the next one last
        self._grain: Any = None
        if prefetch:
            import grain

            mapped = grain.MapDataset.source(dataset)
            for t in transforms:
                mapped = mapped.map_with_index(functools.partial(_at, t, dataset)) if t.positional else mapped.map(t)
            options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)
            self._grain = iter(mapped.to_iter_dataset(options))

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Batch:
        if self._grain is not None:
            return next(self._grain)  # type: ignore[no-any-return]
        ready = self._ready
        if not ready:
            self._gather_block()
        batch = ready.pop()
        if self._positional is not None:
            rows, epoch = self._ds.rows(self._next)
            for t in self._positional:
                batch = t.apply_at(batch, rows, epoch, self._ds.plan.seed)
        else:
            for fn in self._fns:
                batch = fn(batch)
        self._next += 1
        return batch

    def _gather_block(self) -> None:
        """Gather the next `_BLOCK` batches (never past the epoch's end) with one fancy index per key.

        Numpy's fancy indexing costs about a microsecond per call whatever the size, as much as gathering a
        small batch itself; gathering a block and handing out row slices (views) of it halves the cost per batch.
        """
        epoch, batch = divmod(self._next, self._per_epoch)
        count = min(_BLOCK, self._per_epoch - batch)
        block = self._ds.gather(epoch, batch, count)
        size = self._ds.plan.local_batch_size
        self._ready[:] = [{k: v[i * size : (i + 1) * size] for k, v in block.items()} for i in reversed(range(count))]

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.get_state()["epoch"]

    @property
    def batch_size(self) -> int:
        """The number of records per batch (the last batch of an epoch can be shorter without drop_remainder)."""
        return self._ds.plan.batch_size

    def get_state(self) -> dict[str, int]:
        """``{"epoch": e, "batch": b}``: the next batch is batch `b` of epoch `e`."""
        index = self._grain.get_state()["next_index"] if self._grain is not None else self._next
        epoch, batch = divmod(int(index), self._per_epoch)
        return {"epoch": epoch, "batch": batch}

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume so that the next batch is batch ``state["batch"]`` of epoch ``state["epoch"]``."""
        index = position_index(state, self._per_epoch, "BatchIterator")
        if self._grain is not None:
            self._grain.set_state({"next_index": index})
        else:
            self._next = index
            self._ready = []

    def close(self) -> None:
        """Stop the prefetch thread, if any. The iterator cannot prefetch after this."""
        if self._grain is not None:
            self._grain.close()

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = self.get_state()
        plan = self._ds.plan
        return (
            f"BatchIterator(batch_size={plan.batch_size}, seed={plan.seed}, epoch={state['epoch']}, "
            f"batch={state['batch']})"
        )
