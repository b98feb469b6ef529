"""Transforms: operators that change a whole batch at once with vectorised numpy.

A batch is ``{key: array}`` with a leading batch axis on every entry. `Transform.apply` maps a batch to a new
batch (never writing into its input), and `Transform.spec` maps per-example ``{key: (shape, dtype)}`` (no batch
axis) the same way without touching data, so `TrainingDataset.element_spec` can report shapes before anything
is compiled. A key a transform needs but the batch lacks is an error naming the transform, the key and the keys
that are there.

Example:
    >>> import numpy as np
    >>> from pipekit_train.data._transforms import OneHot
    >>> OneHot(key="y", num_classes=3).apply({"y": np.array([2, 0])})["y"]
    array([[0., 0., 1.],
           [1., 0., 0.]], dtype=float32)

Random transforms (`GaussianNoise`, `MaskInputs`, the corruptions of a denoising pretext task) draw every value
from a counter-based hash of ``(transform seed, iterator seed, epoch, record index, position in the record)``:
no generator state to checkpoint, the same noise for a record whatever the batch size, prefetching or the point
where a run was resumed, and fresh noise every epoch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from pipekit import ConfigError, Operator, suggestion

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


# Random transforms: noise from a counter-based hash, so resume stays exact -------------------------------------
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 whose outputs look independent for consecutive inputs."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return np.asarray(z ^ (z >> np.uint64(31)))


def hashed_uniform(shape: tuple[int, ...], records: np.ndarray, key: tuple[int, ...], stream: int = 0) -> np.ndarray:
    """Uniform float64 in ``[0, 1)`` of ``(len(records), *shape)``: element ``j`` of row ``i`` is a hash of
    ``(key, stream, records[i], j)`` alone.

    Example:
        >>> a = hashed_uniform((3,), np.array([5, 7]), (0, 1))
        >>> b = hashed_uniform((3,), np.array([7]), (0, 1))   # record 7 gets the same values in any batch
        >>> bool((a[1] == b[0]).all()), a.shape, bool((0 <= a).all() and (a < 1).all())
        (True, (2, 3), True)
    """
    h: np.ndarray = np.asarray(np.uint64(0x5EED))
    with np.errstate(over="ignore"):
        for part in (*key, stream):
            h = _mix(np.asarray(h ^ np.uint64(part & 0xFFFFFFFFFFFFFFFF)) + _GOLDEN)
        rows = _mix(h ^ (np.asarray(records, dtype=np.uint64) * _GOLDEN))
        positions = np.arange(math.prod(shape), dtype=np.uint64) * _GOLDEN
        bits = _mix(rows[:, None] + positions[None, :] + _GOLDEN)
    return ((bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))).reshape(len(records), *shape)


class RandomTransform(Transform, register=False):
    """Abstract: a transform whose randomness is a function of where each record is (see the module docstring).

    Subclasses implement `apply_at`; `apply` (a batch with no known origin) treats the rows as records
    ``0 .. B-1`` of epoch 0 under seed 0, so calling the transform by hand is deterministic too.
    """

    positional: ClassVar[bool] = True

    def apply(self, batch: Batch) -> Batch:
        n = len(next(iter(batch.values()))) if batch else 0
        return self.apply_at(batch, np.arange(n), 0, 0)

    def apply_at(self, batch: Batch, records: np.ndarray, epoch: int, seed: int) -> Batch:
        raise NotImplementedError


def _check_clean_key(op: Operator, key: str, clean_key: str | None) -> None:
    if clean_key is not None and (not clean_key or clean_key == key):
        raise ConfigError(
            f"{type(op).__name__}.clean_key must be null or a new key other than key {key!r} (where the clean "
            f"copy goes, e.g. '{key}_clean'), got {clean_key!r}"
        )


def _corrupt_spec(op: Any, spec: Spec) -> Spec:
    if op.key not in spec:
        raise _missing(op, op.key, spec)
    shape, dtype = spec[op.key]
    if op.clean_key is not None and op.clean_key in spec:
        raise ConfigError(f"{op!r}: clean_key {op.clean_key!r} is already a key of the batch; choose another name")
    out = {**spec, op.key: (shape, _float_dtype(np.dtype(dtype)))}
    if op.clean_key is not None:
        out[op.clean_key] = (shape, dtype)
    return out


class GaussianNoise(RandomTransform):
    """Add Gaussian noise of standard deviation `std` to ``batch[key]`` (a denoising pretext task's input).

    With `clean_key`, the uncorrupted values are kept under that key, so a denoising autoencoder's stage
    sets ``target_key`` to it: it sees the noisy `key` and reconstructs the clean copy. `clip` bounds the noisy
    values (e.g. ``[0.0, 1.0]`` for images scaled to that range). The noise is a hash of
    ``(seed, the iterator's seed, epoch, record, position)``: fresh each epoch, exact on resume.

    Args:
        key: the entry to corrupt (floating; integer inputs become float32).
        std: the noise level, > 0.
        clean_key: where to keep the clean values; null keeps none.
        clip: ``[low, high]`` to clip the noisy values to; null does not clip.
        seed: varies the noise between otherwise equal transforms.
    """

    key: str
    std: float
    clean_key: str | None = None
    clip: tuple[float, float] | None = None
    seed: int = 0

    def validate(self) -> None:
        if not (math.isfinite(self.std) and self.std > 0):
            raise ConfigError(f"GaussianNoise.std must be a finite number > 0, got {self.std!r}")
        if self.clip is not None and (len(self.clip) != 2 or not self.clip[0] < self.clip[1]):
            raise ConfigError(f"GaussianNoise.clip must be [low, high] with low < high, got {list(self.clip)}")
        _check_clean_key(self, self.key, self.clean_key)

    def spec(self, spec: Spec) -> Spec:
        return _corrupt_spec(self, spec)

    def apply_at(self, batch: Batch, records: np.ndarray, epoch: int, seed: int) -> Batch:
        try:
            x = batch[self.key]
        except KeyError:
            raise _missing(self, self.key, batch) from None
        key = (self.seed, seed, epoch)
        u1 = hashed_uniform(x.shape[1:], records, key, stream=0)
        u2 = hashed_uniform(x.shape[1:], records, key, stream=1)
        # Box-Muller: 1 - u1 is in (0, 1], so the log is finite.
        z = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)
        dt = _float_dtype(x.dtype)
        noisy = (x + self.std * z).astype(dt)
        if self.clip is not None:
            np.clip(noisy, self.clip[0], self.clip[1], out=noisy)
        out = {**batch, self.key: noisy}
        if self.clean_key is not None:
            out[self.clean_key] = x
        return out

    @classmethod
    def example(cls) -> GaussianNoise:
        return cls(key="x", std=0.2, clean_key="x_clean", clip=(0.0, 1.0))


class MaskInputs(RandomTransform):
    """Set a random fraction `rate` of the values of ``batch[key]`` to `value` (masking / dropout noise).

    Each value of each record is masked independently with probability `rate`, drawn from the same hash as
    `GaussianNoise`. With `clean_key`, the uncorrupted values are kept under that key (the reconstruction target
    of a denoising autoencoder).

    Args:
        key: the entry to corrupt.
        rate: the probability that a value is masked, in (0, 1).
        value: what a masked value becomes.
        clean_key: where to keep the clean values; null keeps none.
        seed: varies the mask between otherwise equal transforms.
    """

    key: str
    rate: float
    value: float = 0.0
    clean_key: str | None = None
    seed: int = 0

    def validate(self) -> None:
        if not 0.0 < self.rate < 1.0:
            raise ConfigError(f"MaskInputs.rate must be in (0, 1) (the fraction of values masked), got {self.rate!r}")
        _check_clean_key(self, self.key, self.clean_key)

    def spec(self, spec: Spec) -> Spec:
        return _corrupt_spec(self, spec)

    def apply_at(self, batch: Batch, records: np.ndarray, epoch: int, seed: int) -> Batch:
        try:
            x = batch[self.key]
        except KeyError:
            raise _missing(self, self.key, batch) from None
        masked = hashed_uniform(x.shape[1:], records, (self.seed, seed, epoch), stream=2) < self.rate
        dt = _float_dtype(x.dtype)
        out = {**batch, self.key: np.where(masked, dt.type(self.value), x).astype(dt)}
        if self.clean_key is not None:
            out[self.clean_key] = x
        return out

    @classmethod
    def example(cls) -> MaskInputs:
        return cls(key="x", rate=0.25, clean_key="x_clean")
