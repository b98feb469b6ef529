"""Transforms of an entry's values: `Normalize` (a given mean and std), `Cast` (a dtype) and `OneHot` (labels to
one-hot vectors).

Each changes one entry and passes the others through. `Standardize`, whose mean and std are fitted on the training
split, is in ``_standardize.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from pipekit import ConfigError

from ._transforms import Batch, Spec, Transform, _check_dtype, _float_dtype, _missing

__all__ = ["Cast", "Normalize", "OneHot"]


@functools.lru_cache(maxsize=256)
def _norm_constants(mean: Any, std: Any, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(mean, dtype=dtype), np.asarray(std, dtype=dtype)


class Normalize(Transform):
    """``(batch[key] - mean) / std``; a tuple `mean`/`std` applies per channel along the last axis.

    Floating inputs keep their dtype; integer and bool inputs become float32.

    Args:
        key: the entry to normalise.
        mean: a number, or one number per channel.
        std: a positive number, or one per channel.
    """

    key: str
    mean: float | tuple[float, ...]
    std: float | tuple[float, ...]

    def _channels(self) -> int | None:
        sizes = {len(v) for v in (self.mean, self.std) if isinstance(v, tuple)}
        return sizes.pop() if sizes else None

    def validate(self) -> None:
        for name in ("mean", "std"):
            value = getattr(self, name)
            if isinstance(value, tuple) and not value:
                raise ConfigError(f"Normalize.{name} must be a number or a non-empty list of numbers, got []")
        stds = self.std if isinstance(self.std, tuple) else (self.std,)
        if not all(s > 0 for s in stds):
            raise ConfigError(f"Normalize.std must be positive (every channel), got {self.std!r}")
        sizes = {len(v) for v in (self.mean, self.std) if isinstance(v, tuple)}
        if len(sizes) > 1:
            raise ConfigError(
                f"Normalize.mean and Normalize.std must have the same number of channels, got {self.mean!r} "
                f"and {self.std!r}"
            )

    def spec(self, spec: Spec) -> Spec:
        if self.key not in spec:
            raise _missing(self, self.key, spec)
        shape, dtype = spec[self.key]
        channels = self._channels()
        if channels is not None and (not shape or shape[-1] != channels):
            raise ConfigError(
                f"{self!r}: per-channel mean/std has {channels} channels but {self.key!r} has per-example "
                f"shape {shape} (the last axis must be {channels})"
            )
        return {**spec, self.key: (shape, _float_dtype(np.dtype(dtype)))}

    def apply(self, batch: Batch) -> Batch:
        try:
            x = batch[self.key]
        except KeyError:
            raise _missing(self, self.key, batch) from None
        dt = _float_dtype(x.dtype)
        mean, std = _norm_constants(self.mean, self.std, dt.str)
        channels = self._channels()
        if channels is not None and (x.ndim < 2 or x.shape[-1] != channels):
            self.spec({self.key: (x.shape[1:], x.dtype)})  # raises the shape error
        out = np.subtract(x, mean, dtype=dt)
        out /= std
        return {**batch, self.key: out}

    @classmethod
    def example(cls) -> Normalize:
        return cls(key="x", mean=0.5, std=(0.25, 0.5))


class Cast(Transform):
    """``batch[key].astype(dtype)``.

    Args:
        key: the entry to convert.
        dtype: a numpy dtype name, e.g. ``"float32"`` or ``"int32"``.
    """

    key: str
    dtype: str

    def validate(self) -> None:
        _check_dtype("Cast.dtype", self.dtype)

    def spec(self, spec: Spec) -> Spec:
        if self.key not in spec:
            raise _missing(self, self.key, spec)
        return {**spec, self.key: (spec[self.key][0], np.dtype(self.dtype))}

    def apply(self, batch: Batch) -> Batch:
        try:
            x = batch[self.key]
        except KeyError:
            raise _missing(self, self.key, batch) from None
        return {**batch, self.key: x.astype(self.dtype)}

    @classmethod
    def example(cls) -> Cast:
        return cls(key="x", dtype="float16")


@functools.lru_cache(maxsize=64)
def _eye(num_classes: int, dtype: str) -> np.ndarray:
    eye = np.eye(num_classes, dtype=dtype)
    eye.flags.writeable = False
    return eye


class OneHot(Transform):
    """Integer labels ``batch[key]`` in ``[0, num_classes)`` to one-hot vectors (a new trailing axis).

    Args:
        key: the integer entry.
        num_classes: the length of the one-hot axis.
        dtype: the dtype of the one-hot vectors.
    """

    key: str
    num_classes: int
    dtype: str = "float32"

    def validate(self) -> None:
        if self.num_classes < 1:
            raise ConfigError(f"OneHot.num_classes must be a positive int, got {self.num_classes}")
        _check_dtype("OneHot.dtype", self.dtype)

    def _check_integer(self, dtype: np.dtype) -> None:
        if not np.issubdtype(dtype, np.integer):
            raise ConfigError(f"{self!r}: {self.key!r} must hold integer labels, got dtype {dtype}")

    def spec(self, spec: Spec) -> Spec:
        if self.key not in spec:
            raise _missing(self, self.key, spec)
        shape, dtype = spec[self.key]
        self._check_integer(np.dtype(dtype))
        return {**spec, self.key: ((*shape, self.num_classes), np.dtype(self.dtype))}

    def apply(self, batch: Batch) -> Batch:
        try:
            y = batch[self.key]
        except KeyError:
            raise _missing(self, self.key, batch) from None
        self._check_integer(y.dtype)
        if y.size and (y.min() < 0 or y.max() >= self.num_classes):
            raise ConfigError(
                f"{self!r}: labels must be in [0, {self.num_classes}), got values from {y.min()} to {y.max()}"
            )
        return {**batch, self.key: _eye(self.num_classes, self.dtype)[y]}

    @classmethod
    def example(cls) -> OneHot:
        return cls(key="y", num_classes=10)
