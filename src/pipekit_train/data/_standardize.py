"""`Standardize`: ``(value - mean) / std`` per column, with the mean and std fitted on the training split.

A `Standardize` without `statistics` is *unfitted*. A `TrainingLoop` fits it once per stage on its training
dataset (`fit_statistics`: every record, in record order, through the transforms before it; the same bytes give
the same statistics on every run, so resume and the data position are untouched) and applies those statistics to
its validation and test datasets too (`with_statistics`). The artifact records them (``data_statistics``), and
``evaluate``, ``predict`` and ``export`` apply them again, inverting them on the target so that metrics and
predictions come back in the user's units (`invert`). A `TrainingDataset` used on its own fits an unfitted
`Standardize` on its own records.

Example:
    >>> import numpy as np
    >>> from pipekit_train.data._standardize import Standardize
    >>> fitted = Standardize(keys=("x",)).fit({"x": np.array([[1.0], [3.0]], dtype=np.float32)})
    >>> fitted.statistics
    {'x': {'mean': (2.0,), 'std': (1.0,)}}
    >>> fitted.apply({"x": np.array([[5.0]], dtype=np.float32)})["x"]
    array([[3.]], dtype=float32)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from pipekit import ConfigError

from ._transforms import Batch, Spec, Transform, _float_dtype, _missing

__all__ = ["Standardize", "fit_statistics", "invert", "statistics_of", "with_statistics"]

Statistics = dict[str, dict[str, tuple[float, ...]]]

#: A column whose standard deviation is below this (a constant column) is divided by 1 instead.
_TINY = 1e-12


class Standardize(Transform):
    """``(batch[key] - mean) / std`` per column (the last axis) for each of `keys`, fitted on the training split.

    Floating entries keep their dtype; integer and bool entries become float32. A column with (almost) no spread
    is only centred (its std is recorded as 1). Standardizing the target key makes the model learn in standard
    units; ``evaluate`` and ``predict`` (and the stage's whole-split `metrics`) invert it, so results are in the
    units of the data.

    Args:
        keys: the entries to standardize, e.g. ``[x]`` or ``[x, y]``.
        statistics: ``{key: {mean: [...], std: [...]}}`` (one number per column); leave it out to fit them on the
            training split (the usual case). Given, they are used as they are.
    """

    per_record: ClassVar[bool] = True  # once fitted, applying it to all records equals applying it per batch

    keys: tuple[str, ...]
    statistics: dict[str, dict[str, tuple[float, ...]]] | None = None

    def validate(self) -> None:
        if not self.keys:
            raise ConfigError("Standardize.keys must name at least one entry to standardize, got []")
        if len(set(self.keys)) != len(self.keys):
            raise ConfigError(f"Standardize.keys must not repeat a key, got {list(self.keys)}")
        if self.statistics is None:
            return
        for key in self.keys:
            if key not in self.statistics:
                raise ConfigError(f"Standardize.statistics has no entry for key {key!r}; it must have one per key")
            stats = self.statistics[key]
            if set(stats) != {"mean", "std"}:
                raise ConfigError(f"Standardize.statistics[{key!r}] must be {{mean: [...], std: [...]}}, got {stats!r}")
            mean, std = stats["mean"], stats["std"]
            if not mean or len(mean) != len(std):
                raise ConfigError(
                    f"Standardize.statistics[{key!r}]: mean and std need one number per column each, got {stats!r}"
                )
            if not all(math.isfinite(s) and s > 0 for s in std) or not all(math.isfinite(m) for m in mean):
                raise ConfigError(f"Standardize.statistics[{key!r}]: std must be finite and > 0, got {list(std)}")

    @property
    def fitted(self) -> bool:
        """Whether the statistics are known."""
        return self.statistics is not None

    def fit(self, arrays: Mapping[str, np.ndarray]) -> Standardize:
        """This transform with statistics computed from every record of `arrays` (float64 sums, so the order of
        records changes nothing beyond rounding, and equal arrays give equal statistics)."""
        stats: Statistics = {}
        for key in self.keys:
            if key not in arrays:
                raise _missing(self, key, arrays)
            x = np.asarray(arrays[key], dtype=np.float64)
            if len(x) == 0:
                raise ConfigError(f"{self!r}: cannot fit on {key!r}: the training split has no records")
            cols = x.reshape(len(x), -1) if x.ndim > 1 else x.reshape(-1, 1)
            mean = cols.mean(axis=0)
            std = cols.std(axis=0)
            std = np.where(std < _TINY, 1.0, std)
            if not (np.isfinite(mean).all() and np.isfinite(std).all()):
                raise ConfigError(f"{self!r}: {key!r} holds NaN or infinite values; its statistics are not finite")
            stats[key] = {"mean": tuple(float(v) for v in mean), "std": tuple(float(v) for v in std)}
        return self.replace(statistics=stats)

    def _constants(self, key: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.statistics is None:
            raise ConfigError(
                f"{self!r} is not fitted: a TrainingLoop fits it on its training dataset (or call "
                "TrainingDataset.fitted()); evaluate and predict take the statistics from the artifact"
            )
        stats = self.statistics[key]
        columns = len(stats["mean"])
        per_example = math.prod(x.shape[1:])
        if per_example != columns:
            raise ConfigError(
                f"{self!r}: {key!r} has {per_example} values per record but the statistics have {columns} columns"
            )
        dt = _float_dtype(x.dtype)
        shape = x.shape[1:] or (1,)
        mean = np.asarray(stats["mean"], dtype=dt).reshape(shape if x.ndim > 1 else ())
        std = np.asarray(stats["std"], dtype=dt).reshape(shape if x.ndim > 1 else ())
        return mean, std

    def spec(self, spec: Spec) -> Spec:
        out = dict(spec)
        for key in self.keys:
            if key not in spec:
                raise _missing(self, key, spec)
            shape, dtype = spec[key]
            out[key] = (shape, _float_dtype(np.dtype(dtype)))
        return out

    def apply(self, batch: Batch) -> Batch:
        out = dict(batch)
        for key in self.keys:
            if key not in batch:
                raise _missing(self, key, batch)
            x = batch[key]
            mean, std = self._constants(key, x)
            value = np.subtract(x, mean, dtype=_float_dtype(x.dtype))
            value /= std
            out[key] = value
        return out

    @classmethod
    def example(cls) -> Standardize:
        return cls(keys=("x", "y"))


def statistics_of(transforms: Sequence[Transform]) -> Statistics:
    """``{key: {"mean", "std"}}`` of the fitted `Standardize` transforms among `transforms` (empty if none)."""
    out: Statistics = {}
    for t in transforms:
        if isinstance(t, Standardize) and t.statistics is not None:
            out.update({k: t.statistics[k] for k in t.keys})
    return out


def fit_statistics(arrays: Mapping[str, np.ndarray], transforms: Sequence[Transform]) -> tuple[Transform, ...]:
    """`transforms` with each unfitted `Standardize` fitted on all of `arrays` passed through the ones before it.

    Random transforms before a `Standardize` see the records as record ``i`` of epoch 0 under seed 0, so the fit is
    a function of the data alone.
    """
    if not any(isinstance(t, Standardize) and not t.fitted for t in transforms):
        return tuple(transforms)
    # A lazily read source (`RandomAccessSource`) is read whole for the fit, then dropped.
    batch: Batch = {k: v if isinstance(v, np.ndarray) else np.asarray(v) for k, v in arrays.items()}
    n = len(next(iter(batch.values()))) if batch else 0
    out: list[Transform] = []
    for t in transforms:
        if isinstance(t, Standardize) and not t.fitted:
            t = t.fit(batch)
        out.append(t)
        batch = t.apply_at(batch, np.arange(n), 0, 0)
    return tuple(out)


def with_statistics(transforms: Sequence[Transform], stats: Mapping[str, Any], owner: str) -> tuple[Transform, ...]:
    """`transforms` with each unfitted `Standardize` given the statistics `stats` holds for its keys (those fitted
    on a training split); a key `stats` lacks is a `ConfigError` naming `owner`."""
    out: list[Transform] = []
    for t in transforms:
        if isinstance(t, Standardize) and not t.fitted:
            missing = [k for k in t.keys if k not in stats]
            if missing:
                raise ConfigError(
                    f"{owner}: {t!r} standardizes {missing[0]!r}, but the training split recorded statistics only "
                    f"for {sorted(stats) or '(none)'}; standardize the same keys as the training dataset"
                )
            t = t.replace(statistics={k: _plain(stats[k]) for k in t.keys})
        out.append(t)
    return tuple(out)


def _plain(stats: Mapping[str, Any]) -> dict[str, tuple[float, ...]]:
    return {"mean": tuple(float(v) for v in stats["mean"]), "std": tuple(float(v) for v in stats["std"])}


def _broadcast(stats: Mapping[str, Any], values: Any) -> tuple[np.ndarray, np.ndarray]:
    """The mean and std of `stats` in `values`' float dtype, shaped to broadcast along its last axis."""
    dtype = values.dtype if np.issubdtype(values.dtype, np.floating) else np.float32
    mean = np.asarray(stats["mean"], dtype=dtype)
    std = np.asarray(stats["std"], dtype=dtype)
    if (values.ndim <= 1 or values.shape[-1] != len(mean)) and mean.size == 1:
        mean, std = mean.reshape(()), std.reshape(())
    return mean, std


def invert(stats: Mapping[str, Any], key: str, values: Any) -> Any:
    """``values * std + mean`` with the statistics of `key` (back to the data's units); `values` unchanged when
    `key` has none. Works on numpy and JAX arrays (the constants broadcast along the last axis)."""
    if key not in stats:
        return values
    mean, std = _broadcast(stats[key], values)
    return values * std + mean


def standardize(stats: Mapping[str, Any], key: str, values: Any) -> Any:
    """``(values - mean) / std`` with the statistics of `key`; `values` unchanged when `key` has none."""
    if key not in stats:
        return values
    mean, std = _broadcast(stats[key], values)
    return (values - mean) / std
