"""Models as operators: the backend-neutral `ModelOp` and `Transfer` (which weights move between stages).

An operator's fields describe the *architecture*; the weights are bound separately (`ModelOp.bind`) and are never
a field, so they never reach YAML and operator equality is architecture equality. Each backend supplies its model
operators (`EquinoxModel` in `pipekit_train.adapters.equinox`, ...) by implementing the few methods below; the
training core, the checkpoints and the model registry use only these.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from pipekit import ConfigError, Operator, PipekitError, field, suggestion

__all__ = ["ACTIVATION_NAMES", "ModelOp", "Transfer", "check_activation", "check_factory_kwargs", "weights_digest"]

#: The activations the built-in factories of the Keras and Lightning backends accept, by name (the names of the
#: Equinox backend's `ACTIVATIONS`), so one pipeline file builds the same network on every backend.
ACTIVATION_NAMES = ("relu", "gelu", "tanh", "silu", "identity")


def check_activation(name: Any) -> str:
    """`name` if it is one of `ACTIVATION_NAMES`; else a `ConfigError` with the closest name."""
    if name not in ACTIVATION_NAMES:
        raise ConfigError(
            f"activation must be one of {', '.join(ACTIVATION_NAMES)}, got {name!r}"
            f"{suggestion(str(name), list(ACTIVATION_NAMES))}"
        )
    return str(name)


def weights_digest(arrays: Mapping[str, Any]) -> str:
    """``"sha256:<hex>"`` over each array's name, shape, dtype and bytes, in the mapping's order."""
    digest = hashlib.sha256()
    for name, leaf in arrays.items():
        host = np.asarray(leaf)
        digest.update(f"{name}|{host.shape}|{host.dtype.name};".encode())
        digest.update(np.ascontiguousarray(host).tobytes())
    return f"sha256:{digest.hexdigest()}"


def check_factory_kwargs(
    owner: str, factory: str, params: Sequence[inspect.Parameter], kwargs: Mapping[str, Any]
) -> None:
    """Refuse `kwargs` a model factory cannot take (with the nearest name) or lacks, naming `owner` (the operator).

    `params` are the factory's parameters that `kwargs` fill (without the key a factory may take first).
    """
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for name in kwargs:
        if name not in accepted:
            raise ConfigError(
                f"{owner}.kwargs: factory {factory!r} has no parameter {name!r}"
                f"{suggestion(name, accepted)}; it accepts: {', '.join(accepted)}"
            )
    required = [p.name for p in params if p.name in accepted and p.default is p.empty]
    missing = [n for n in required if n not in kwargs]
    if missing:
        raise ConfigError(
            f"{owner}.kwargs: factory {factory!r} needs {', '.join(repr(m) for m in missing)}; "
            f"required: {', '.join(required)}; it accepts: {', '.join(accepted)}"
        )


class ModelOp(Operator, register=False):
    """A model architecture as an operator, optionally bound to weights.

    A backend's model operator sets `backend` and implements `build`, `weights`, `with_weights` and ``__call__``
    (and, where it can, `check_bind`, `check_input`, `inference_function`, `factory_name`, `export_formats` and
    `export`). Weights are bound with `bind` and live on a private attribute, not a field: they never reach YAML,
    and ``==`` / ``hash`` compare architectures only.

    Copies: `bind` returns a bound copy; ``copy.copy`` / ``copy.deepcopy`` keep the binding (the arrays are
    immutable, so they are shared, not duplicated); `replace` and YAML loading return **unbound** operators,
    because weights belong to one architecture and a changed field may no longer fit them: rebind explicitly
    with ``op.replace(...).bind(op.module)`` when they do.
    """

    #: The `TrainingLoop.backend` that trains this kind of model.
    backend: ClassVar[str] = ""

    def build(self, key: Any) -> Any:
        """A freshly initialised model of the backend's framework; `key` is a PRNG key or an int seed."""
        raise NotImplementedError(f"{type(self).__name__}.build")

    @property
    def module(self) -> Any:
        """The bound framework model, or ``None`` when no weights are bound."""
        return self.__dict__.get("_module")

    def check_bind(self, module: Any) -> None:
        """Raise `pipekit.ShapeError` (or `pipekit.ConfigError`) when `module` does not fit this architecture."""

    def bind(self, module: Any, *, check: bool = True) -> ModelOp:
        """A copy of this operator bound to `module` (this operator is unchanged); `check` runs `check_bind`."""
        if check:
            self.check_bind(module)
        new = copy.copy(self)
        object.__setattr__(new, "_module", module)
        return new

    def replace(self, **changes: Any) -> Any:
        """A copy with some fields changed. The copy is unbound: see the class docstring."""
        return super().replace(**changes)

    def require_module(self, what: str) -> Any:
        """The bound framework model; a `pipekit.PipekitError` naming `what` needed it when none is bound."""
        module = self.module
        if module is None:
            raise PipekitError(
                f"{self!r}.{what}: no weights are bound; use op.bind(op.build(key)) or the model a TrainingLoop "
                "returned (replace() and YAML loading give unbound operators)"
            )
        return module

    def weights(self) -> dict[str, np.ndarray]:
        """The bound weights as host arrays by path, in a fixed order (what the registry stores and hashes)."""
        raise NotImplementedError(f"{type(self).__name__}.weights")

    def with_weights(self, arrays: Mapping[str, np.ndarray]) -> ModelOp:
        """A copy of this operator bound to `arrays` (as `weights` returns them); a mismatch raises ShapeError."""
        raise NotImplementedError(f"{type(self).__name__}.with_weights")

    def weights_hash(self) -> str:
        """``"sha256:<hex>"`` over the bound arrays' paths, shapes, dtypes and bytes."""
        self.require_module("weights_hash")
        return weights_digest(self.weights())

    def num_params(self) -> int:
        """How many numbers the bound weights hold."""
        return int(sum(np.size(a) for a in self.weights().values()))

    def check_input(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """The output shape(s) for one example of `shape` and `dtype`, without running the model, or ``None``
        when the backend cannot tell; a `pipekit.ShapeError` when the example does not fit."""
        return None

    def __call__(self, x: Any) -> Any:
        """The bound model's predictions for a batch `x` (leading axis: examples)."""
        raise NotImplementedError(f"{type(self).__name__}.__call__")

    def inference_function(self) -> Any:
        """``predict(x)``: the bound model's predictions for a batch in inference mode (no dropout), as a function
        ``jax.jit`` and ``jax.export`` can trace, the weights closed over. Backends without one raise
        `NotImplementedError` (such models cannot be exported)."""
        raise NotImplementedError(f"{type(self).__name__}.inference_function")

    def export_formats(self) -> tuple[str, ...]:
        """The file formats `export` writes, besides ``jaxexport`` (which every model with an
        `inference_function` has): e.g. ``("arviz",)`` for a sampler's posterior. Empty by default."""
        return ()

    def export(self, fmt: str, path: str, *, attrs: Mapping[str, str], stage_dir: str | None = None) -> dict[str, Any]:
        """Write the bound model as `fmt` (one of `export_formats`) to `path`, with the provenance `attrs` (strings
        by name, see `pipekit_train.inference.provenance_attrs`) in the file; `stage_dir` is the folder of the
        stage that trained it, for what the stage wrote beside its checkpoints, or ``None``. Returns what was
        written: ``{"path": ..., "summary": "<one line>"}``. ``pipekit-train export --format FMT`` calls it."""
        raise PipekitError(
            f"{type(self).__name__} (backend {self.backend!r}) cannot be exported as {fmt!r}; "
            f"it exports as: {', '.join(('jaxexport', *self.export_formats()))}"
        )

    def compare(self, entries: Sequence[tuple[str, ModelOp, str | None]], criterion: str) -> dict[str, Any]:
        """Compare the bound models `entries` (``(label, model, stage_dir)``: this model among them, each with the
        folder of the stage that trained it) by `criterion` (``"loo"``: expected log predictive density by
        leave-one-out cross-validation). Returns ``{"text": the table, "rows": {label: {metric: number}},
        "warnings": [...]}``. ``pipekit-train artifacts compare --loo`` calls it on the first model. Default: refused
        (a model without a likelihood of its data cannot be compared so)."""
        raise PipekitError(
            f"{type(self).__name__} (backend {self.backend!r}) cannot be compared by {criterion!r}: it records no "
            "pointwise log-likelihood of its data (a posterior of numpyro-mcmc or blackjax does)"
        )

    def predict_draws(self, data: str, path: str, *, attrs: Mapping[str, str], seed: int = 0) -> dict[str, Any]:
        """Write draws of the bound model's predictive distribution for the inputs in the file `data` to `path`,
        with the provenance `attrs` (a sampler's posterior: posterior-predictive draws, as ArviZ netCDF). Returns
        ``{"path", "summary"}``. ``pipekit-train predict ID --data FILE -o OUT.nc`` calls it. Default: refused (a
        model whose predictions are not draws writes them with ``-o OUT.npz``)."""
        raise PipekitError(
            f"{type(self).__name__} (backend {self.backend!r}) has no predictive draws to write to {path!r}; "
            "write its predictions to an .npz or a .csv"
        )

    def factory_name(self) -> str | None:
        """The registered factory that builds this architecture (``"mlp"``), by which converters between backends
        are found (`pipekit_train.backends.register_converter`); ``None`` (the default) for a model that is not
        built by a named factory."""
        return None


# Transfer -------------------------------------------------------------------------------------------------
_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*|\[\d+\])*")
_STEP = re.compile(r"\.?([A-Za-z_]\w*)|\[(\d+)\]")


def parse_path(path: str) -> list[str | int]:
    """``"encoder.layers[1]"`` → ``["encoder", "layers", 1]``; a `pipekit.ConfigError` for anything else."""
    if not isinstance(path, str) or not _PATH.fullmatch(path):
        raise ConfigError(
            f"Transfer.paths: {path!r} is not an attribute path; write it like 'encoder', 'layers[0]' "
            "or 'encoder.layers[1].weight'"
        )
    return [name if name else int(index) for name, index in _STEP.findall(path)]


class Transfer(Operator):
    """Which sub-trees of the previous stage's model (e.g. a trained autoencoder) go into this stage's fresh model.

    The backend applies it (the Equinox adapter with `pipekit_train.adapters.equinox.apply_transfer`).

    Args:
        paths: ``{target_path: source_path}``. Keys are attribute paths in the *target* model and values are
            paths in the *source* model, so each target part receives exactly one source (``encoder``,
            ``layers[0]``, ``encoder.layers[1]``). Empty (the default, ``Transfer()``) copies nothing: the
            target keeps its fresh weights, which is how a stage says "start fresh" explicitly.

    Example:
        >>> Transfer(paths={"encoder": "encoder"})
        Transfer(paths={'encoder': 'encoder'})
    """

    paths: dict[str, str] = field(default_factory=dict)

    @classmethod
    def example(cls) -> Transfer:
        return cls(paths={"encoder": "encoder", "head.layers[0]": "decoder.layers[0]"})

    def validate(self) -> None:
        for target_path, source_path in self.paths.items():
            parse_path(target_path)
            parse_path(source_path)
