"""Device-resident training data: the arrays go to the device once and each fused chunk slices its own batches.

For an in-memory training set small enough (`DEVICE_RESIDENT_MAX_BYTES`, or an eighth of the device's memory
when the device reports it: the device holds it twice), `ResidentBatches` stands in for the host `BatchIterator`:
the engine asks it for a `DeviceWindow` of ``n`` steps, the backend's compiled chunk calls `DeviceWindow.stacked`
once, before its ``lax.scan`` (or `DeviceWindow.take` for one step), and the host does no work per step at all
(no gather, no stacking, no transfer).

The order of records is the host path's, bit for bit: epoch ``e`` visits ``np.random.default_rng([seed, e])
.permutation(n)`` (`_dataset._Plan.perm`, the very same function). The permutation is drawn on the host once per
epoch (a few hundred microseconds for 16k records, once every few hundred steps), and the rows are put in that
order once per epoch (with the first batches of the next epoch, for a window that crosses into it; on the CPU by
NumPy, elsewhere by a compiled gather on the device); a step's batch is then a contiguous slice ``[b * B, (b + 1)
* B)`` of them in the compiled call. So a batch on the device path holds the same rows as on the host path, and
the data position (`get_state` / `set_state`, ``{"epoch": e, "batch": b}``) means exactly what it means there: a
checkpoint written on one path resumes on the other. The device holds the training set twice: its arrays, and
one epoch (plus a window) of rows in order.

Transforms are per-record operations (`Normalize`, `Cast`, `OneHot`, ...), so they are applied once to the whole
arrays before the upload; a user transform takes the device path only when it says it is per-record
(``per_record = True`` as a class attribute), otherwise the stage falls back to the host path.

Example:
    >>> import numpy as np
    >>> from pipekit_train.data import ArraySource, TrainingDataset
    >>> ds = TrainingDataset(source=ArraySource(arrays={"x": np.arange(12.0).reshape(6, 2)}))
    >>> resident_reason(ds, batch_size=2, backend_ok=True)   # None: the device path is possible
    >>> resident_reason(ds.replace(device_resident=False), batch_size=2, backend_ok=True)
    'TrainingDataset.device_resident is false'
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pipekit import ConfigError

from ._dataset import TrainingDataset
from ._iterator import _Plan, position_index
from ._layout import Flatten, Rename, Reshape, Select
from ._numeric import Cast, Normalize, OneHot
from ._transforms import Transform

__all__ = ["DEVICE_RESIDENT_MAX_BYTES", "DeviceWindow", "ResidentBatches", "resident_reason"]

#: The largest training set (after transforms) that ``device_resident: auto`` puts on the device: 256 MiB, or an
#: eighth of the device's memory when that is smaller and the device reports it (the device holds the set twice:
#: its arrays, and an epoch of rows in training order; so at most a quarter of the memory).
DEVICE_RESIDENT_MAX_BYTES = 256 * 2**20

#: The built-in transforms, all per-record: applying one to the whole arrays equals applying it batch by batch.
_PER_RECORD: tuple[type[Transform], ...] = (Normalize, Cast, OneHot, Select, Rename, Flatten, Reshape)


def _per_record(t: Transform) -> bool:
    # Exact types: a subclass that overrides `apply` may not be per-record any more.
    return type(t) in _PER_RECORD or getattr(type(t), "per_record", False) is True


def _limit_bytes() -> int:
    """`DEVICE_RESIDENT_MAX_BYTES`, or an eighth of the default device's memory when that is smaller."""
    import jax

    limit = DEVICE_RESIDENT_MAX_BYTES
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # a backend without memory statistics (CPU): the fixed threshold
        stats = {}
    total = stats.get("bytes_limit")
    if isinstance(total, int) and total > 0:
        limit = min(limit, total // 8)
    return limit


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes} bytes"


def _resident_arrays(dataset: TrainingDataset) -> dict[str, np.ndarray]:
    """The source's arrays with the (per-record) transforms applied to all records at once."""
    arrays = dataset.arrays()
    for t in dataset.fitted().transforms:
        arrays = t.apply(arrays)
    return arrays


def resident_reason(
    dataset: TrainingDataset, batch_size: int, backend_ok: bool, *, size_check: bool = True
) -> str | None:
    """Why `dataset` cannot (or must not) be device-resident for this stage, or ``None`` when it can.

    `backend_ok` says whether the backend and the stage's topology support it (a step backend with
    `resident_data`, on one device).
    With ``device_resident: auto`` a reason means the host path; with ``true`` it is an error (`check_forced`).
    """
    setting = dataset.device_resident
    if setting is False:
        return "TrainingDataset.device_resident is false"
    if not backend_ok:
        return (
            "the stage's backend or mesh cannot gather batches on the device (its step backend has no "
            "resident_data path, or it trains on a mesh)"
        )
    bad = [type(t).__name__ for t in dataset.transforms if not _per_record(t)]
    if bad:
        return f"transform {bad[0]} must run on the host (it does not declare per_record = True)"
    if dataset.lazy:
        return (
            "the source is read per batch (RandomAccessSource without in_memory); set in_memory: true to hold it "
            "in memory first"
        )
    if dataset.prefetch:
        return f"TrainingDataset.prefetch is {dataset.prefetch}: prefetching is a host-path setting"
    n = dataset.num_records()
    if not dataset.drop_remainder and n % batch_size:
        return (
            f"drop_remainder is false and the {n} records leave a short last batch of {n % batch_size} "
            f"(batch_size {batch_size}); compiled chunks need batches of one size"
        )
    if size_check and setting == "auto":
        spec = dataset.element_spec()
        nbytes = sum(n * math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in spec.values())
        limit = _limit_bytes()
        if nbytes > limit:
            return f"the training set is {_size(nbytes)}, above the {_size(limit)} threshold"
    return None


def check_forced(dataset: TrainingDataset, reason: str | None) -> None:
    """With ``device_resident: true``, a reason the device path is impossible is an error naming it."""
    if dataset.device_resident is True and reason is not None:
        raise ConfigError(
            f"TrainingDataset.device_resident is true but the training set cannot be device-resident: {reason}; "
            "set device_resident: auto (or false) to use the host path"
        )


class DeviceWindow:
    """The batches of ``n`` consecutive steps as device data: what a fused chunk receives instead of batches.

    A JAX pytree: the training set's rows in the order the epochs the window touches visit them (`ResidentBatches`
    gathers them once per epoch), and the first batch's index in them; the batch size is static. Batch ``b`` of
    the window is rows ``[(first + b) * B, (first + b + 1) * B)``: a contiguous slice, so every window of a stage
    has the same structure (the compiled chunk is reused) and a batch costs a slice, not a gather, inside the
    compiled call. `take` and `stacked` are called inside the compiled chunk.
    """

    __slots__ = ("arrays", "batch_size", "first")

    def __init__(self, arrays: dict[str, Any], first: Any, batch_size: int) -> None:
        self.arrays = arrays
        self.first = first
        self.batch_size = batch_size

    def stacked(self, n: int) -> dict[str, Any]:
        """The window's `n` batches stacked (leading axis `n`): one slice of ``n * B`` rows, before the chunk's
        ``lax.scan`` (a gather from the whole training set inside the loop body made a small MLP's step 2-3x
        slower)."""
        import jax

        start = self.first * self.batch_size
        size = n * self.batch_size
        return {
            k: jax.lax.dynamic_slice_in_dim(v, start, size).reshape(n, self.batch_size, *v.shape[1:])
            for k, v in self.arrays.items()
        }

    def take(self, i: Any) -> dict[str, Any]:
        """Batch `i` of the window (a traced int): its ``B`` rows, sliced.

        A slice, not a gather of the batch's rows from the whole training set: on the CPU XLA splits such a gather
        over its threads, and a one-step call of the small bench MLP took 130 µs with it against 68 µs with the
        slice (the same as a batch passed in). The rows are the same, so the weights are bitwise the host path's
        (tests/data/test_device_resident.py).
        """
        import jax

        start = (self.first + i) * self.batch_size
        return {k: jax.lax.dynamic_slice_in_dim(v, start, self.batch_size) for k, v in self.arrays.items()}

    def tree_flatten(self) -> tuple[tuple[Any, ...], int]:
        return (self.arrays, self.first), self.batch_size

    @classmethod
    def tree_unflatten(cls, batch_size: int, children: tuple[Any, ...]) -> DeviceWindow:
        arrays, first = children
        return cls(arrays, first, batch_size)


def _rows(arrays: dict[str, Any], index: Any) -> dict[str, Any]:
    """``{k: v[index]}``: the rows `index` names, gathered on the device (one compiled program per shape)."""
    return {k: v[index] for k, v in arrays.items()}


_GATHER: list[Any] = []


def _gather(arrays: dict[str, Any], index: Any) -> dict[str, Any]:
    if not _GATHER:
        import jax

        _GATHER.append(jax.jit(_rows))
    out: dict[str, Any] = _GATHER[0](arrays, index)
    return out


_REGISTERED: list[bool] = []


def _register() -> None:
    """Make `DeviceWindow` a JAX pytree, once, when the first one is needed (this module does not import JAX)."""
    if not _REGISTERED:
        import jax

        jax.tree_util.register_pytree_node(DeviceWindow, DeviceWindow.tree_flatten, DeviceWindow.tree_unflatten)
        _REGISTERED.append(True)


class ResidentBatches:
    """The device path's stand-in for `BatchIterator`: the same position and state, windows instead of batches.

    Args:
        dataset: the training set (its arrays are uploaded once, transforms applied).
        batch_size: records per step.
        seed: the iterator seed (the permutation of epoch ``e`` is ``default_rng([seed, e])``'s).
        max_steps_per_window: the longest window the engine will ask for; fixes how many epochs' permutations
            a window carries (so every window has one shape).
    """

    def __init__(self, dataset: TrainingDataset, batch_size: int, seed: int, max_steps_per_window: int) -> None:
        import jax

        _register()
        n = dataset.num_records()
        self._per_epoch = dataset.num_batches(batch_size)
        self._plan = _Plan(n, batch_size, self._per_epoch, dataset.shuffle, int(seed))
        self._arrays = {k: jax.device_put(np.ascontiguousarray(v)) for k, v in _resident_arrays(dataset).items()}
        # A window of `w` steps starts in some epoch `e` at a batch below `per_epoch` and ends at most `w - 1` batches
        # later: the rows of epoch `e` in its order and of the first `w - 1` batches after it cover every window
        # starting in `e` (with `w` above `per_epoch`, of several epochs after it).
        self._window = max(1, max_steps_per_window)
        self._epochs = 1 + math.ceil((self._window - 1) / self._per_epoch)
        self._next = 0  # the global batch index (epoch * per_epoch + batch) of the next step
        # (epoch, the rows of the windows starting in it, in their order, on the device)
        self._ordered: tuple[int, dict[str, Any] | None] = (-1, None)
        self._perms: dict[int, np.ndarray] = {}  # the permutations of the epochs the ordered rows cover
        self.nbytes = sum(int(a.nbytes) for a in self._arrays.values())
        self._on_cpu = all(d.platform == "cpu" for a in self._arrays.values() for d in a.devices())

    def _ordered_rows(self, epoch: int) -> dict[str, Any]:
        """The rows of the windows starting in `epoch`, in the order they train: epoch `epoch`'s batches, then the
        first ``window - 1`` batches after it. Gathered once per epoch (on the CPU by NumPy, elsewhere by a
        compiled gather on the device) in the order of the permutations drawn on the host (`_Plan.perm`, as the
        host path draws them); one shape for every epoch of the stage."""
        import jax

        first, ordered = self._ordered
        if first == epoch and ordered is not None:
            return ordered
        self._ordered = (-1, None)  # the previous epoch's rows are freed before the next are gathered
        size = self._plan.batch_size
        used = self._per_epoch * size  # a last short batch is dropped (drop_remainder), as on the host path
        # An epoch's permutation is drawn once: the windows starting in the next epoch need it again.
        perms = {e: self._perms.get(e) for e in range(epoch, epoch + self._epochs)}
        self._perms = {e: p if p is not None else self._plan.perm(e)[:used] for e, p in perms.items()}
        index = np.concatenate(list(self._perms.values()))
        index = index[: (self._per_epoch + self._window - 1) * size].astype(np.int32)
        if self._on_cpu:
            # The CPU device's arrays are host memory: NumPy gathers the rows as fast as XLA (a millisecond for the
            # bench's 2 MiB set), and compiles nothing (the compiled gather's first call took 150 ms).
            # (`np.take`: the same rows as ``v[index]`` in a third of the time.)
            rows = {k: jax.device_put(np.take(np.asarray(v), index, axis=0)) for k, v in self._arrays.items()}
        else:
            rows = _gather(self._arrays, jax.device_put(index))
        self._ordered = (epoch, rows)
        return rows

    def window(self, steps: int) -> DeviceWindow:
        """The next `steps` batches as a `DeviceWindow`; the position moves past them."""
        if not 1 <= steps <= self._window:  # a longer window would slice past the ordered rows (a slice clamps)
            raise ValueError(f"ResidentBatches.window: {steps} steps, but windows of 1 to {self._window} were planned")
        epoch, batch = divmod(self._next, self._per_epoch)
        window = DeviceWindow(self._ordered_rows(epoch), np.int32(batch), self._plan.batch_size)
        self._next += steps
        return window

    def __next__(self) -> dict[str, np.ndarray]:
        """One batch on the host, as the host path would gather it (for tests and debugging; not the fast path)."""
        epoch, batch = divmod(self._next, self._per_epoch)
        size = self._plan.batch_size
        idx = self._plan.perm(epoch)[batch * size : (batch + 1) * size]
        self._next += 1
        return {k: np.asarray(v)[idx] for k, v in self._arrays.items()}

    @property
    def batch_size(self) -> int:
        return self._plan.batch_size

    def get_state(self) -> dict[str, int]:
        """``{"epoch": e, "batch": b}``: the next step trains on batch `b` of epoch `e` (as `BatchIterator`)."""
        epoch, batch = divmod(self._next, self._per_epoch)
        return {"epoch": epoch, "batch": batch}

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (checked like `BatchIterator.set_state`)."""
        self._next = position_index(state, self._per_epoch, "ResidentBatches")

    def close(self) -> None:
        """Nothing to stop (no thread); drops the ordered rows' references."""
        self._ordered = (-1, None)

    def __repr__(self) -> str:
        state = self.get_state()
        return (
            f"ResidentBatches(batch_size={self._plan.batch_size}, seed={self._plan.seed}, epoch={state['epoch']}, "
            f"batch={state['batch']}, bytes={self.nbytes})"
        )
