"""Sources: operators that produce a dict of equally long numpy arrays (one record per row).

`ArraySource` holds arrays in memory (and so cannot be written to YAML), `NpzSource` and `NpySource` read
files, and `RegisteredSource` calls a function registered with `register_dataset`. The built-in ``digits``
dataset is scikit-learn's bundled 8x8 digits (no network), behind the ``examples`` extra.

Example:
    >>> import numpy as np
    >>> from pipekit_train.data._sources import ArraySource
    >>> ArraySource(arrays={"x": np.zeros((3, 2)), "y": np.arange(3)}).load()["y"]
    array([0, 1, 2])
"""

from __future__ import annotations

import contextlib
import inspect
import os
import zipfile
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, ClassVar

import numpy as np

from pipekit import ConfigError, Operator, field, suggestion

Arrays = dict[str, np.ndarray]

_EXAMPLES_EXTRA = "pip install 'pipekit-train[examples]'"


def check_arrays(owner: str, arrays: Mapping[str, Any]) -> Arrays:
    """`arrays` as numpy arrays, after checking: string keys, at least one axis, equal lengths."""
    if not arrays:
        raise ConfigError(f"{owner} produced no arrays; a source must produce at least one key")
    out: Arrays = {}
    for key, value in arrays.items():
        if not isinstance(key, str):
            raise ConfigError(f"{owner}: array keys must be strings, got {key!r}")
        arr = value if type(value) in (np.ndarray, np.memmap) else np.asarray(value)
        if arr.ndim == 0:
            raise ConfigError(f"{owner}[{key!r}] must have a leading record axis, got a scalar {arr!r}")
        if arr.dtype.kind == "O":
            raise ConfigError(f"{owner}[{key!r}] has dtype object; only numeric, bool and fixed-width dtypes work")
        out[key] = arr
    lengths = {k: len(v) for k, v in out.items()}
    if len(set(lengths.values())) > 1:
        raise ConfigError(f"{owner}: every array must have the same number of records, got lengths {lengths}")
    return out


class Source(Operator, register=False):
    """Abstract: an operator whose `load` returns a dict of equally long numpy arrays.

    A source may have settings fitted on the training split (`CsvSource`'s classes, categories and imputed
    values): `fitted` says whether they are known, `fit` fits them on the source's own records, `fitted_statistics`
    is what a stage records in its artifact (``source_statistics``) and `with_fitted` gives another split (or
    ``evaluate``/``predict``) those recorded values. A source with nothing to fit keeps these defaults.
    """

    @property
    def fitted(self) -> bool:
        """Whether nothing is left to fit (the default: a source with nothing to fit)."""
        return True

    def fit(self) -> Source:
        """This source with its settings fitted on its own records (itself when there is nothing to fit)."""
        return self

    def fitted_statistics(self) -> dict[str, Any] | None:
        """What was fitted, as plain JSON data for the artifact, or ``None`` (nothing fitted)."""
        return None

    def with_fitted(self, statistics: dict[str, Any] | None, owner: str) -> Source:
        """This source with the fitted values `statistics` (another split's `fitted_statistics`), if unfitted."""
        return self

    def files_identity(self) -> Hashable:
        """What makes the files a source reads the same files (their paths and stats), for the per-process cache
        of `TrainingDataset`; ``None`` (the default): its ``path`` field, if any, is stat-ed."""
        return None

    def content_digest(self) -> str | None:
        """A digest of what the source reads beyond its arrays (`TextSource`: its file list and each file's
        sha256), mixed into `TrainingDataset.content_hash`; ``None`` (the default): the arrays alone."""
        return None

    def load(self) -> Arrays:
        """Read the arrays. `TrainingDataset` calls this once per process and caches the result."""
        raise NotImplementedError


class ArraySource(Source):
    """Arrays already in memory, keyed by name. Validated for equal lengths; not writable to YAML.

    Args:
        arrays: ``{key: array}``; array-likes (lists, JAX arrays) are converted to numpy arrays.
    """

    _yaml_serializable: ClassVar[bool] = False

    arrays: dict[str, Any]

    def validate(self) -> None:
        object.__setattr__(self, "arrays", check_arrays("ArraySource.arrays", self.arrays))

    def load(self) -> Arrays:
        return dict(self.arrays)

    @classmethod
    def example(cls) -> ArraySource:
        return cls(arrays={"x": np.arange(6, dtype=np.float32).reshape(3, 2), "y": np.arange(3, dtype=np.int32)})


class NpzSource(Source):
    """The arrays of one ``.npz`` file (read with ``allow_pickle=False``).

    Args:
        path: the ``.npz`` file.
        keys: the keys to read, in this order; empty reads every key in the file.
    """

    path: str
    keys: tuple[str, ...] = ()

    def validate(self) -> None:
        if not self.path:
            raise ConfigError("NpzSource.path must be a non-empty path to a .npz file, got ''")

    def load(self) -> Arrays:
        _check_file("NpzSource.path", self.path)
        with _readable("NpzSource.path", self.path), np.load(self.path, allow_pickle=False) as npz:
            available = list(npz.files)
            keys = self.keys or tuple(available)
            out: Arrays = {}
            for key in keys:
                if key not in npz.files:
                    raise ConfigError(
                        f"NpzSource.keys: {key!r} is not in {self.path!r}{suggestion(key, available)}; "
                        f"keys in the file: {', '.join(available) or '(none)'}"
                    )
                out[key] = npz[key]
        return check_arrays(f"NpzSource({self.path!r})", out)

    @classmethod
    def example(cls) -> NpzSource:
        return cls(path="data/train.npz", keys=("x", "y"))


def _check_file(what: str, path: str) -> None:
    """A `ConfigError` naming `what` unless `path` is a file (relative paths are read from the working directory)."""
    if os.path.isfile(path):
        return
    if os.path.isdir(path):
        raise ConfigError(f"{what}: {path!r} is a directory, not a file")
    where = "" if os.path.isabs(path) else f" (relative paths are read from the working directory {os.getcwd()})"
    raise ConfigError(f"{what}: file not found: {path!r}{where}")


def _looks_like_numpy(path: str) -> bool:
    """Whether `path` starts like a .npz (a zip archive) or a .npy file."""
    with open(path, "rb") as f:
        head = f.read(6)
    return head.startswith((b"\x93NUMPY", b"PK\x03\x04"))


@contextlib.contextmanager
def _readable(what: str, path: str) -> Iterator[None]:
    """Turn numpy's errors for a file that is not plain numeric arrays into one `ConfigError` naming `what`."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as e:
        if "allow_pickle" in str(e) and not _looks_like_numpy(path):
            raise ConfigError(f"{what}: {path!r} is not a .npz or .npy file (numpy cannot read it)") from None
        if "allow_pickle" in str(e):
            raise ConfigError(
                f"{what}: {path!r} holds object arrays (pickled Python objects), which are never loaded; "
                "save plain numeric arrays (np.asarray(x, dtype=...))"
            ) from None
        raise ConfigError(f"{what}: cannot read {path!r} as numpy arrays: {e}") from None
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{what}: cannot read {path!r} as numpy arrays: {e}") from None


class NpySource(Source):
    """One ``.npy`` file per key (read with ``allow_pickle=False``), memory-mapped by default.

    Args:
        paths: ``{key: path}``.
        mmap: memory-map the files read-only (batches are gathered from disk pages) instead of reading them.
    """

    paths: dict[str, str]
    mmap: bool = True

    def validate(self) -> None:
        if not self.paths:
            raise ConfigError("NpySource.paths must map at least one key to a .npy file, got {}")

    def load(self) -> Arrays:
        out: Arrays = {}
        for key, path in self.paths.items():
            _check_file(f"NpySource.paths[{key!r}]", path)
            with _readable(f"NpySource.paths[{key!r}]", path):
                out[key] = np.load(path, mmap_mode="r" if self.mmap else None, allow_pickle=False)
        return check_arrays("NpySource", out)

    @classmethod
    def example(cls) -> NpySource:
        return cls(paths={"x": "data/x.npy", "y": "data/y.npy"}, mmap=False)


# Registered datasets ---------------------------------------------------------------------------------------
_DATASETS: dict[str, Callable[..., Mapping[str, Any]]] = {}


def register_dataset(name: str) -> Callable[[Callable[..., Mapping[str, Any]]], Callable[..., Mapping[str, Any]]]:
    """Register ``fn(**kwargs) -> {key: array}`` as the dataset `name` that `RegisteredSource` can name.

    Returns a decorator that returns `fn` unchanged. Registering another function under a taken name is an
    error (re-registering the same function, as a module reload does, is fine).

    Example:
        >>> import numpy as np
        >>> from pipekit_train.data._sources import RegisteredSource, register_dataset
        >>> @register_dataset("squares")
        ... def squares(n=4):
        ...     x = np.arange(n, dtype=np.float32)
        ...     return {"x": x, "y": x**2}
        >>> RegisteredSource(name="squares", kwargs={"n": 3}).load()["y"]
        array([0., 1., 4.], dtype=float32)
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"register_dataset: name must be a non-empty string, got {name!r}")

    def decorator(fn: Callable[..., Mapping[str, Any]]) -> Callable[..., Mapping[str, Any]]:
        old = _DATASETS.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ConfigError(
                f"register_dataset: {name!r} is already registered by {old.__module__}.{old.__qualname__}"
            )
        _DATASETS[name] = fn
        return fn

    return decorator


def _lookup_dataset(name: str) -> Callable[..., Mapping[str, Any]]:
    fn = _DATASETS.get(name)
    if fn is None:
        raise ConfigError(
            f"RegisteredSource.name {name!r} is not a registered dataset{suggestion(name, _DATASETS)}; "
            f"registered datasets: {', '.join(sorted(_DATASETS))}"
        )
    return fn


class RegisteredSource(Source):
    """The arrays a function registered with `register_dataset` returns for `kwargs`.

    The name and the keyword names are checked when the source is built (a YAML typo fails at load time).

    Args:
        name: the registered dataset name, e.g. ``"digits"``.
        kwargs: keyword arguments for the dataset function.
    """

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        fn = _lookup_dataset(self.name)
        params = inspect.signature(fn).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return
        allowed = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for key in self.kwargs:
            if key not in allowed:
                raise ConfigError(
                    f"RegisteredSource.kwargs: dataset {self.name!r} has no argument {key!r}"
                    f"{suggestion(key, allowed)}; its arguments: {', '.join(allowed) or '(none)'}"
                )

    def load(self) -> Arrays:
        return check_arrays(f"dataset {self.name!r}", _lookup_dataset(self.name)(**self.kwargs))

    @classmethod
    def example(cls) -> RegisteredSource:
        return cls(name="digits", kwargs={"split": "test", "label_fraction": 0.5, "seed": 1})


# The built-in `digits` dataset --------------------------------------------------------------------------------
_SPLITS = ("train", "val", "test", "all")


@register_dataset("digits")
def digits(
    split: str = "train",
    test_fraction: float = 0.2,
    label_fraction: float = 1.0,
    seed: int = 0,
    val_fraction: float = 0.0,
) -> dict[str, np.ndarray]:
    """scikit-learn's bundled 8x8 digits: ``{"x": float32 (N, 64) in [0, 1], "y": int32 (N,)}``.

    The 1797 images are split per class (stratified) into train and test by `seed`; `label_fraction` keeps that
    fraction of each class of the split (at least one record per class), also from `seed`. Smaller fractions
    keep subsets of larger ones, and the test split does not depend on `label_fraction`. Records come back in
    their original order.

    Args:
        split: ``"train"``, ``"val"``, ``"test"`` or ``"all"`` (the fractions are then ignored).
        test_fraction: the fraction of each class held out as the test split, in (0, 1).
        val_fraction: the fraction of each class held out (from what the test split leaves) as the validation
            split, in [0, 1); ``split: val`` needs it above 0. The train split is what remains.
        label_fraction: the fraction of the split to keep, in (0, 1].
        seed: a non-negative int choosing the split and the kept records.
    """
    if split not in _SPLITS:
        raise ConfigError(f"digits: split must be one of {', '.join(map(repr, _SPLITS))}, got {split!r}")
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) or not 0 < test_fraction < 1:
        raise ConfigError(f"digits: test_fraction must be a number in (0, 1), got {test_fraction!r}")
    if isinstance(label_fraction, bool) or not isinstance(label_fraction, (int, float)) or not 0 < label_fraction <= 1:
        raise ConfigError(f"digits: label_fraction must be a number in (0, 1], got {label_fraction!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"digits: seed must be a non-negative int, got {seed!r}")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ConfigError(f"digits: val_fraction must be a number in [0, 1), got {val_fraction!r}")
    if test_fraction + val_fraction >= 1:
        raise ConfigError(f"digits: test_fraction + val_fraction must be below 1, got {test_fraction} + {val_fraction}")
    if split == "val" and val_fraction == 0:
        raise ConfigError("digits: split 'val' needs val_fraction > 0 (for example val_fraction: 0.1)")
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError(f"the 'digits' dataset needs scikit-learn: {_EXAMPLES_EXTRA}") from None
    bunch = load_digits()
    x = (np.asarray(bunch.data, dtype=np.float32) / np.float32(16.0)).astype(np.float32)
    y = np.asarray(bunch.target, dtype=np.int32)
    split_rng = np.random.default_rng([seed, 0])
    keep_rng = np.random.default_rng([seed, 1])
    chosen: list[np.ndarray] = []
    for cls in np.unique(y):
        members = split_rng.permutation(np.flatnonzero(y == cls))
        n_test = round(len(members) * test_fraction)
        n_val = round(len(members) * val_fraction)
        part = {
            "test": members[:n_test],
            "val": members[n_test : n_test + n_val],
            "train": members[n_test + n_val :],
            "all": members,
        }[split]
        part = keep_rng.permutation(part)
        n_keep = max(1, round(len(part) * label_fraction)) if len(part) else 0
        chosen.append(part[:n_keep])
    idx = np.sort(np.concatenate(chosen))
    return {"x": x[idx], "y": y[idx]}
