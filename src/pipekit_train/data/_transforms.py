"""Transforms: operators that change a whole batch at once with vectorised numpy (the `Transform` base).

A batch is ``{key: array}`` with a leading batch axis on every entry. `Transform.apply` maps a batch to a new
batch (never writing into its input), and `Transform.spec` maps per-example ``{key: (shape, dtype)}`` (no batch
axis) the same way without touching data, so `TrainingDataset.element_spec` can report shapes before anything
is compiled. A key a transform needs but the batch lacks is an error naming the transform, the key and the keys
that are there.

Example:
    >>> import numpy as np
    >>> from pipekit_train.data import OneHot
    >>> OneHot(key="y", num_classes=3).apply({"y": np.array([2, 0])})["y"]
    array([[0., 0., 1.],
           [1., 0., 0.]], dtype=float32)

The transforms themselves, by family: values (``_numeric.py``: `Normalize`, `Cast`, `OneHot`; ``_standardize.py``:
`Standardize`, fitted on the training split), the batch's entries and shapes (``_layout.py``: `Select`, `Rename`,
`Flatten`, `Reshape`) and noise (``_noise.py``: `RandomTransform`, `GaussianNoise`, `MaskInputs`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from pipekit import ConfigError, Operator, suggestion

__all__ = ["Batch", "Spec", "Transform"]

Batch = dict[str, np.ndarray]
Spec = dict[str, tuple[tuple[int, ...], np.dtype]]


def _missing(op: Operator, key: str, available: Mapping[str, Any]) -> ConfigError:
    keys = list(available)
    return ConfigError(
        f"{op!r}: key {key!r} is not in the batch{suggestion(key, keys)}; available keys: {', '.join(keys) or '(none)'}"
    )


def _check_dtype(owner: str, value: str) -> np.dtype:
    try:
        dt = np.dtype(value)
    except TypeError:
        raise ConfigError(f"{owner} must be a numpy dtype name such as 'float32' or 'int32', got {value!r}") from None
    if dt.kind == "O":
        raise ConfigError(f"{owner} must be a numeric or bool dtype, got {value!r}")
    return dt


class Transform(Operator, register=False):
    """Abstract: a whole-batch transform. Calling it is `apply`, so it is also a plain callable."""

    #: True for transforms whose output depends on where the batch comes from (`RandomTransform`): the dataset
    #: then calls `apply_at` with the records' indices, the epoch and the iterator's seed.
    positional: ClassVar[bool] = False

    def apply(self, batch: Batch) -> Batch:
        """The transformed batch (a new dict; input arrays are never written)."""
        raise NotImplementedError

    def apply_at(self, batch: Batch, records: np.ndarray, epoch: int, seed: int) -> Batch:
        """`apply` for the batch made of `records` (source indices) in `epoch` of an iterator seeded `seed`.

        Deterministic transforms ignore where the batch comes from; `RandomTransform` draws from it.
        """
        return self.apply(batch)

    def spec(self, spec: Spec) -> Spec:
        """The per-example ``{key: (shape, dtype)}`` that `apply` produces from one shaped like `spec`."""
        raise NotImplementedError

    def __call__(self, batch: Batch) -> Batch:
        return self.apply(batch)


def _float_dtype(dt: np.dtype) -> np.dtype:
    return dt if np.issubdtype(dt, np.floating) else np.dtype(np.float32)
