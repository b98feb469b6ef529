"""Transforms of the batch's layout: which entries it holds and under which names (`Select`, `Rename`), and the
shape of each example (`Flatten`, `Reshape`). The values themselves are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pipekit import ConfigError

from ._transforms import Batch, Spec, Transform, _missing

__all__ = ["Flatten", "Rename", "Reshape", "Select"]


class Select(Transform):
    """Keep only `keys`, in that order.

    Args:
        keys: the entries to keep.
    """

    keys: tuple[str, ...]

    def validate(self) -> None:
        if not self.keys:
            raise ConfigError("Select.keys must name at least one key, got []")
        if len(set(self.keys)) != len(self.keys):
            raise ConfigError(f"Select.keys must not repeat a key, got {list(self.keys)}")

    def _pick(self, mapping: Mapping[str, Any]) -> dict[str, Any]:
        try:
            return {k: mapping[k] for k in self.keys}
        except KeyError:
            key = next(k for k in self.keys if k not in mapping)
            raise _missing(self, key, mapping) from None

    def spec(self, spec: Spec) -> Spec:
        return self._pick(spec)

    def apply(self, batch: Batch) -> Batch:
        return self._pick(batch)

    @classmethod
    def example(cls) -> Select:
        return cls(keys=("x", "y"))


class Rename(Transform):
    """Rename entries: ``{old: new}``. Other entries pass through; overwriting one is an error.

    Args:
        mapping: ``{old_key: new_key}``.
    """

    mapping: dict[str, str]

    def validate(self) -> None:
        if not self.mapping:
            raise ConfigError("Rename.mapping must rename at least one key, got {}")
        if len(set(self.mapping.values())) != len(self.mapping):
            raise ConfigError(f"Rename.mapping must not send two keys to the same name, got {self.mapping}")

    def _rename(self, mapping: Mapping[str, Any]) -> dict[str, Any]:
        for old in self.mapping:
            if old not in mapping:
                raise _missing(self, old, mapping)
        out = {self.mapping.get(k, k): v for k, v in mapping.items()}
        if len(out) != len(mapping):
            clash = sorted(k for k in self.mapping.values() if k in mapping and k not in self.mapping)
            raise ConfigError(f"{self!r} would overwrite existing key(s) {clash}; rename or Select them first")
        return out

    def spec(self, spec: Spec) -> Spec:
        return self._rename(spec)

    def apply(self, batch: Batch) -> Batch:
        return self._rename(batch)

    @classmethod
    def example(cls) -> Rename:
        return cls(mapping={"y": "label"})


class Flatten(Transform):
    """Flatten each example of ``batch[key]`` to one axis: ``(B, 8, 8) -> (B, 64)``.

    Args:
        key: the entry to flatten.
    """

    key: str

    def spec(self, spec: Spec) -> Spec:
        if self.key not in spec:
            raise _missing(self, self.key, spec)
        shape, dtype = spec[self.key]
        return {**spec, self.key: ((math.prod(shape),), dtype)}

    def apply(self, batch: Batch) -> Batch:
        try:
            x = batch[self.key]
        except KeyError:
            raise _missing(self, self.key, batch) from None
        return {**batch, self.key: x.reshape(len(x), -1)}

    @classmethod
    def example(cls) -> Flatten:
        return cls(key="x")


class Reshape(Transform):
    """Reshape each example of ``batch[key]`` to `shape` (the batch axis stays); one entry may be ``-1``.

    Args:
        key: the entry to reshape.
        shape: the per-example shape, e.g. ``[8, 8, 1]``.
    """

    key: str
    shape: tuple[int, ...]

    def validate(self) -> None:
        if any(d == 0 or d < -1 for d in self.shape) or list(self.shape).count(-1) > 1:
            raise ConfigError(f"Reshape.shape must hold positive sizes and at most one -1, got {list(self.shape)}")

    def _out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        size = math.prod(shape)
        known = math.prod(d for d in self.shape if d != -1)
        if -1 in self.shape and size % known == 0:
            return tuple(size // known if d == -1 else d for d in self.shape)
        if -1 not in self.shape and size == known:
            return self.shape
        raise ConfigError(
            f"{self!r}: cannot reshape {self.key!r} with per-example shape {shape} ({size} values) "
            f"to {list(self.shape)}"
        )

    def spec(self, spec: Spec) -> Spec:
        if self.key not in spec:
            raise _missing(self, self.key, spec)
        shape, dtype = spec[self.key]
        return {**spec, self.key: (self._out_shape(tuple(shape)), dtype)}

    def apply(self, batch: Batch) -> Batch:
        try:
            x = batch[self.key]
        except KeyError:
            raise _missing(self, self.key, batch) from None
        try:
            out = x.reshape((len(x), *self.shape))
        except ValueError:
            self._out_shape(x.shape[1:])  # raises the error that names the transform
            raise
        return {**batch, self.key: out}

    @classmethod
    def example(cls) -> Reshape:
        return cls(key="x", shape=(8, 8, 1))
