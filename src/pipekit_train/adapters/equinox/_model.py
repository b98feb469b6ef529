"""`EquinoxModel`: an Equinox model built by a registered factory, and `register_model`.

This module is cheap to import (Equinox and JAX are imported inside the methods that need them), because it is
loaded whenever a pipeline file is read, to make the ``EquinoxModel`` type known. The built-in factories live in
`_factories` and are registered the first time a factory is looked up.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from pipekit import ConfigError, field
from pipekit_train.backends import ModelOp
from pipekit_train.backends.kit import FactoryRegistry, init_compiler_options

__all__ = ["EquinoxModel", "register_model", "registered_models"]


def _takes_key(name: str, fn: Callable[..., Any]) -> None:
    params = list(inspect.signature(fn).parameters.values()) if callable(fn) else []
    if not params or params[0].name != "key":
        raise ConfigError(f"register_model({name!r}): the factory's first parameter must be `key`, got {fn!r}")


#: The Equinox model factories (built-ins: `_factories`).
FACTORIES = FactoryRegistry("EquinoxModel", "model factory", f"{__package__}._factories", leading=1, check=_takes_key)


def register_model(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a model factory ``fn(key, **kwargs) -> eqx.Module`` under `name`, for `EquinoxModel(factory=name)`.

    Example:
        >>> import equinox as eqx
        >>> @register_model("doc_linear")
        ... def doc_linear(key, in_size: int, out_size: int = 1):
        ...     return eqx.nn.Linear(in_size, out_size, key=key)
        >>> EquinoxModel(factory="doc_linear", kwargs={"in_size": 3})
        EquinoxModel(factory='doc_linear', kwargs={'in_size': 3})
    """
    return FACTORIES.register(name, "register_model")


def registered_models() -> list[str]:
    """The names `EquinoxModel.factory` accepts, sorted."""
    return FACTORIES.names()


def _traced_build(factory: Callable[..., Any], kwargs: Mapping[str, Any], key: Any) -> Any:
    """``factory(key, **kwargs)`` traced and compiled as ONE program (`eqx.filter_jit`), not run eagerly.

    Run eagerly, every ``jax.random`` call of a factory (a split, one ``uniform`` per weight and per bias) compiles
    a small program of its own: a dozen compiles (over a second on a small CPU) for an ``eqx.nn.MLP``. Traced,
    the same operations run as one program and give the same bits (threefry is integer arithmetic; the float
    conversion and scaling of `jax.random.uniform` are the same XLA operations either way: the tests compare the
    weights with an eager build bit for bit). A factory that needs concrete values (Python control flow on an
    array, ``np.asarray`` of a weight) cannot be traced: it runs eagerly, as before.
    """
    import equinox as eqx
    import jax

    def make(k: Any) -> Any:
        return factory(k, **kwargs)

    if isinstance(key, jax.core.Tracer):  # inside another trace (an abstract build): traced with it, as it is
        return make(key)

    # One jitted builder per factory and kwargs, kept for the process: a second build of the same architecture
    # (another seed, another stage, a sweep's next trial) reuses its compiled program instead of compiling anew.
    try:
        cache_key: Any = (id(factory), json.dumps(kwargs, sort_keys=True))  # plain values only; else not kept
    except (TypeError, ValueError):
        cache_key = None
    entry = _BUILDERS.get(cache_key) if cache_key is not None else None
    builder = entry[1] if entry is not None else eqx.filter_jit(make, **init_compiler_options())
    if entry is None and cache_key is not None:
        if len(_BUILDERS) >= _MAX_BUILDERS:
            _BUILDERS.pop(next(iter(_BUILDERS)))  # the oldest
        _BUILDERS[cache_key] = (factory, builder)  # holds the factory, so its id is not reused
    try:
        return builder(key)
    except jax.errors.JAXTypeError:  # concretization / tracer conversion: the factory needs concrete values
        if cache_key is not None:
            _BUILDERS.pop(cache_key, None)
        return make(key)


_BUILDERS: dict[Any, tuple[Any, Any]] = {}
_MAX_BUILDERS = 64


class EquinoxModel(ModelOp):
    """An Equinox model built by a registered factory: ``factory(key, **kwargs)``.

    Built-in factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier`` (see their docstrings). Register more
    with `register_model`.

    Args:
        factory: a name registered with `register_model`.
        kwargs: keyword arguments for the factory, checked against its signature on construction.

    Example:
        >>> import jax.numpy as jnp
        >>> op = EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 2})
        >>> op.bind(op.build(0))(jnp.zeros((3, 4))).shape
        (3, 2)
    """

    backend = "equinox"

    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def example(cls) -> EquinoxModel:
        return cls(factory="mlp", kwargs={"in_size": 4, "out_size": 2, "width_size": 8})

    def validate(self) -> None:
        FACTORIES.check_kwargs(self.factory, self.kwargs)

    def build(self, key: Any) -> Any:
        import equinox as eqx
        import jax

        factory, kwargs = FACTORIES.get(self.factory), self.kwargs
        try:
            module = _traced_build(factory, kwargs, jax.random.key(key) if isinstance(key, int) else key)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:  # a kwarg of the wrong kind: `in_size: 4.5`
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ConfigError(
                f"EquinoxModel: factory {self.factory!r} failed with kwargs {self.kwargs}: {type(e).__name__}: {first}"
            ) from e
        if not isinstance(module, eqx.Module):
            raise ConfigError(
                f"model factory {self.factory!r} returned {type(module).__name__}; it must return an equinox Module"
            )
        return module

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

    def with_weights(self, arrays: Mapping[str, np.ndarray]) -> EquinoxModel:
        from . import _tree

        return self.bind(_tree.fill(self, arrays), check=False)  # type: ignore[return-value]

    def check_input(self, shape: tuple[int, ...], dtype: Any) -> Any:
        from . import _tree

        return _tree.check_input(self, shape, dtype)

    def inference_function(self) -> Any:
        """``jax.vmap`` of the bound module in inference mode (dropout off): what `pipekit-train export` writes."""
        import equinox as eqx
        import jax

        module = eqx.nn.inference_mode(self.require_module("inference_function"))

        def predict(x: Any) -> Any:
            return jax.vmap(module)(x)

        return predict

    def __call__(self, x: Any) -> Any:
        """Run the bound module on a batch: the module maps one example, this maps it over the leading axis."""
        from . import _tree

        return _tree.batched_call(self.require_module("__call__"), x)
