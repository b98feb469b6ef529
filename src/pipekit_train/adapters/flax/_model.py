"""`FlaxModel`: a Flax NNX model built by a registered factory, `register_flax_model`, and `FlaxState`.

Cheap to import (Flax and JAX are imported inside the methods that need them): this module is loaded whenever a
pipeline file is read, to make the ``FlaxModel`` type known. The built-in factories are registered on first lookup.

An ``nnx.Module`` is mutable (calling it in training mode updates its BatchNorm statistics and advances its RNG
streams), while a `ModelOp`'s copies share the bound model. So a bound `FlaxModel` holds a `FlaxState`, not a
module: the module split once (``nnx.split``) into its graph definition and its variables as immutable arrays,
the way NNX's functional API wants them inside `jax.jit`. Every call merges a fresh module from them, so nothing
a call does is seen by another holder; `FlaxModel.to_nnx` gives an ordinary ``nnx.Module`` holding a copy.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from pipekit import ConfigError, field
from pipekit_train.backends import ModelOp
from pipekit_train.backends.kit import FactoryRegistry

__all__ = ["FlaxModel", "FlaxState", "register_flax_model", "registered_flax_models"]


def _takes_rngs(name: str, fn: Callable[..., Any]) -> None:
    params = list(inspect.signature(fn).parameters.values()) if callable(fn) else []
    if not params or params[0].name not in ("rngs", "key"):
        raise ConfigError(
            f"register_flax_model({name!r}): the factory's first parameter must be `rngs` (an nnx.Rngs), got {fn!r}"
        )


#: The Flax model factories (built-ins: `_factories`, which imports no framework).
FACTORIES = FactoryRegistry(
    "FlaxModel", "Flax model factory", f"{__package__}._factories", leading=1, check=_takes_rngs
)


def register_flax_model(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a factory ``fn(rngs, **kwargs) -> nnx.Module`` under `name`, for ``FlaxModel(factory=name)``.

    `rngs` is an ``nnx.Rngs`` seeded from the stage's seed; the module takes a batch (a leading batch axis). Its
    ``nnx.Dropout`` and other random layers may keep the `rngs` they are given: the backend reseeds every RNG stream
    from ``(seed, step)`` before each training step, so a resumed run draws the same masks.

    Example:
        >>> @register_flax_model("doc_flax_linear")
        ... def doc_flax_linear(rngs, in_size: int, out_size: int = 1):
        ...     from flax import nnx
        ...     return nnx.Linear(in_size, out_size, rngs=rngs)
        >>> FlaxModel(factory="doc_flax_linear", kwargs={"in_size": 3})
        FlaxModel(factory='doc_flax_linear', kwargs={'in_size': 3})
    """
    return FACTORIES.register(name, "register_flax_model")


def registered_flax_models() -> list[str]:
    """The names `FlaxModel.factory` accepts, sorted."""
    return FACTORIES.names()


class FlaxState:
    """An ``nnx.Module`` split into its graph definition and its variables: what a bound `FlaxModel` holds.

    Attributes:
        graphdef: The module's structure (``nnx.split``'s graph definition): hashable, shared per architecture.
        params: The ``nnx.Param`` variables (an ``nnx.State``): what is trained.
        rest: Every other variable but the RNG streams (BatchNorm statistics, user ``nnx.Variable``\\ s).
        rngs: The RNG streams' state (``nnx.RngState``): reseeded from ``(seed, step)`` before each training step.
    """

    __slots__ = ("graphdef", "params", "rest", "rngs")

    def __init__(self, graphdef: Any, params: Any, rest: Any, rngs: Any) -> None:
        self.graphdef, self.params, self.rest, self.rngs = graphdef, params, rest, rngs

    def module(self) -> Any:
        """A fresh ``nnx.Module`` holding copies of the arrays (mutating it changes nothing here)."""
        from flax import nnx

        from ._tree import fresh  # new Variable objects, the same arrays

        return nnx.merge(self.graphdef, fresh(self.params), fresh(self.rngs), fresh(self.rest))

    def __call__(self, x: Any) -> Any:
        """Predictions (inference mode) for a batch, compiled once per architecture."""
        from . import _tree

        return _tree.predict(self, x)

    def __repr__(self) -> str:
        import jax

        n = sum(int(np.size(a)) for a in jax.tree.leaves(self.params))
        return f"FlaxState({self.graphdef.type.__name__ if hasattr(self.graphdef, 'type') else '?'}, {n} params)"


class FlaxModel(ModelOp):
    """A Flax NNX model built by a registered factory: ``factory(rngs, **kwargs)``.

    Built-in factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier``, ``transformer``,
    ``transformer_classifier``, with the Equinox backend's kwargs and parts (``layers[i]``, ``convs[i]``,
    ``encoder``, ``decoder``, ``head``; ``embed``, ``blocks[i]``, ``norm``, ``lm_head``), so the same `Transfer`
    paths work and the weights convert to and from the other backends one to one. Register more with
    `register_flax_model`.

    Args:
        factory: a name registered with `register_flax_model`.
        kwargs: keyword arguments for the factory, checked against its signature on construction.

    Example:
        >>> import numpy as np
        >>> op = FlaxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 2})
        >>> op.bind(op.build(0))(np.zeros((3, 4), np.float32)).shape
        (3, 2)
    """

    backend = "flax"

    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def example(cls) -> FlaxModel:
        return cls(factory="mlp", kwargs={"in_size": 4, "out_size": 2, "width_size": 8})

    def validate(self) -> None:
        FACTORIES.check_kwargs(self.factory, self.kwargs)

    # Building ------------------------------------------------------------------------------------------------
    def build(self, key: Any) -> FlaxState:
        """Freshly initialised variables for `key` (an int seed or a JAX key): the same key gives the same arrays."""
        from . import _tree

        return _tree.build_state(self, key)

    def to_nnx(self) -> Any:
        """An ordinary ``nnx.Module`` holding a copy of the bound variables."""
        module: FlaxState = self.require_module("to_nnx")
        return module.module()

    def bind(self, module: Any, *, check: bool = True) -> ModelOp:
        """Bound to a `FlaxState`, or to an ``nnx.Module`` of this architecture (split; its arrays are shared,
        never mutated)."""
        if not isinstance(module, FlaxState):
            from . import _tree

            module = _tree.state_of(module)
        return super().bind(module, check=check)

    # The ModelOp protocol ------------------------------------------------------------------------------------
    def factory_name(self) -> str:
        """The factory that builds it: converters between backends are found by it."""
        return self.factory

    def check_bind(self, module: Any) -> None:
        from . import _tree

        _tree.check_fits(self, module)

    def weights(self) -> dict[str, np.ndarray]:
        from . import _tree

        return _tree.weights(self.require_module("weights"))

    def with_weights(self, arrays: Mapping[str, np.ndarray]) -> FlaxModel:
        from . import _tree

        return self.bind(_tree.fill(self, arrays), check=False)  # type: ignore[return-value]

    def check_input(self, shape: tuple[int, ...], dtype: Any) -> Any:
        from . import _tree

        return _tree.check_input(self, shape, dtype)

    def inference_function(self) -> Any:
        """The merged module in inference mode (``eval()``: dropout off, running statistics) with the bound arrays
        closed over: a pure JAX function of the batch, what ``pipekit-train export`` serializes."""
        from . import _tree

        return _tree.inference_function(self.require_module("inference_function"))

    def __call__(self, x: Any) -> Any:
        """Predictions (inference mode) for a batch `x`."""
        module: FlaxState = self.require_module("__call__")
        return module(x)
