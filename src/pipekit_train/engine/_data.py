"""The training batches a stage draws: device-resident (`pipekit_train.data._device.ResidentBatches`: a chunk
slices its own batches on the device) where the dataset and the backend allow it, else the dataset's host iterator
(several processes: each reads its rows of every global batch); and what the engine's plan reads of the dataset
(the bytes of a batch, the batches of an epoch)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..scale._distributed import local_rows

if TYPE_CHECKING:
    from ..backends._contract import StepBackend


def training_batches(loop: Any, backend: StepBackend, chunk_size: int) -> tuple[Any, bool]:
    """The iterator of `loop`'s training batches, and whether it is device-resident (chunks of `chunk_size`)."""
    shard = local_rows()  # several processes: each reads its rows of every global batch
    iterator = resident_data(loop, backend, chunk_size, shard is None)
    if iterator is not None:
        return iterator, True
    iterator = (
        loop.dataset.iterator(loop.batch_size, loop.seed, shard=shard)
        if shard
        else loop.dataset.iterator(loop.batch_size, loop.seed)
    )
    return iterator, False


def resident_data(loop: Any, backend: StepBackend, chunk_size: int, single_process: bool) -> Any:
    """The device-resident training data (`pipekit_train.data._device.ResidentBatches`), or ``None``."""
    dataset = loop.dataset
    setting = getattr(dataset, "device_resident", False)
    if setting is False:
        return None
    backend_ok = backend.resident_data() and single_process
    if not backend_ok and setting is not True:  # `auto` where it is not possible: the host path, quietly
        return None
    from ..data._device import ResidentBatches, check_forced, resident_reason

    reason = resident_reason(dataset, loop.batch_size, backend_ok)
    check_forced(dataset, reason)
    if reason is not None:
        return None
    return ResidentBatches(dataset, loop.batch_size, loop.seed, chunk_size)


def batch_bytes(loop: Any) -> int:
    """Bytes of one training batch on the host after the transforms (0 when the dataset cannot say)."""
    try:
        spec = loop.dataset.element_spec()
    except Exception:  # a dataset without a spec: no byte cap on fusion
        return 0
    record: int = sum(int(math.prod(shape)) * int(np.dtype(dtype).itemsize) for shape, dtype in spec.values())
    return int(loop.batch_size) * record


def data_steps_per_epoch(loop: Any) -> int | None:
    """Batches per epoch of the training set, for `epoch` when `steps_per_epoch` is unset (``None``: unknown)."""
    num_batches = getattr(loop.dataset, "num_batches", None)
    if num_batches is None:
        return None
    try:
        return int(num_batches(loop.batch_size)) or None
    except Exception:  # a dataset that cannot say: records keep epoch 0, as before
        return None
