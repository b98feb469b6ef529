"""Random transforms: noise from a counter-based hash of where each value is, so resume stays exact.

Random transforms (`GaussianNoise`, `MaskInputs`, `MaskTokens`: the corruptions of a pretext task) draw every
value from a counter-based hash of ``(transform seed, iterator seed, epoch, record index, position in the
record)``: no generator state to checkpoint, the same noise for a record whatever the batch size, prefetching or
the point where a run was resumed, and fresh noise every epoch.

`RandomTransform` is the base (a transform told where its batch comes from, `Transform.apply_at`); `GaussianNoise`
and `MaskInputs` are the corruptions, `MaskTokens` masked language modelling's; `hashed_uniform` is the hash.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from pipekit import ConfigError, Operator

from ._transforms import Batch, Spec, Transform, _float_dtype, _missing

__all__ = ["GaussianNoise", "MaskInputs", "RandomTransform", "hashed_uniform"]


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


class MaskTokens(RandomTransform):
    """Masked language modelling's input and target: a random fraction `rate` of the tokens of ``batch[key]``
    become `mask_id`, and ``batch[target_key]`` holds the original token at each masked position and `pad_id`
    everywhere else (what `MaskedTokenCrossEntropy` scores). Padding is never masked.

    The mask is drawn from the same hash as `GaussianNoise` (the record, the epoch, the seeds), so a resumed run
    masks exactly as the uninterrupted one. The byte tokenizer has no mask token: give the model one more id
    (``vocab_size: 260``, ``mask_id: 259``).

    Args:
        key: the token ids to mask (integers).
        rate: the probability that a token is masked, in (0, 1).
        mask_id: the id a masked token becomes.
        target_key: where the targets go (a new key).
        pad_id: the padding id: never masked, and the target of every position that is not masked.
        seed: varies the mask between otherwise equal transforms.
    """

    key: str
    rate: float
    mask_id: int
    target_key: str = "y"
    pad_id: int = 258
    seed: int = 0

    def validate(self) -> None:
        if not 0.0 < self.rate < 1.0:
            raise ConfigError(f"MaskTokens.rate must be in (0, 1) (the fraction of tokens masked), got {self.rate!r}")
        if self.mask_id < 0 or self.mask_id == self.pad_id:
            raise ConfigError(
                f"MaskTokens.mask_id must be a token id other than pad_id {self.pad_id}, got {self.mask_id}"
            )
        if self.target_key == self.key:
            raise ConfigError(f"MaskTokens.target_key must differ from key, both are {self.key!r}")

    def spec(self, spec: Spec) -> Spec:
        if self.key not in spec:
            raise _missing(self, self.key, spec)
        shape, dtype = spec[self.key]
        if np.dtype(dtype).kind not in "iu":
            raise ConfigError(f"{self!r}: {self.key!r} holds {np.dtype(dtype)}, not integer token ids")
        return {**spec, self.target_key: (shape, dtype)}

    def apply_at(self, batch: Batch, records: np.ndarray, epoch: int, seed: int) -> Batch:
        try:
            x = batch[self.key]
        except KeyError:
            raise _missing(self, self.key, batch) from None
        masked = (hashed_uniform(x.shape[1:], records, (self.seed, seed, epoch), stream=3) < self.rate) & (
            x != self.pad_id
        )
        pad = np.asarray(self.pad_id, x.dtype)
        return {
            **batch,
            self.key: np.where(masked, np.asarray(self.mask_id, x.dtype), x),
            self.target_key: np.where(masked, x, pad),
        }

    @classmethod
    def example(cls) -> MaskTokens:
        return cls(key="x", rate=0.15, mask_id=259)
