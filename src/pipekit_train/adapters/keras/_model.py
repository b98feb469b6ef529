"""`KerasModel`: a Keras 3 model built by a registered factory, `register_keras_model`, and `KerasState`.

Cheap to import (Keras is imported inside the methods that need it): this module is loaded whenever a pipeline
file is read, to make the ``KerasModel`` type known. The built-in factories are registered on first lookup.

A bound `KerasModel` holds a `KerasState`: the model's variables as arrays next to the Keras model that gives them
meaning. That Keras model is one per architecture and process and is never mutated; the arrays are the weights.
This is how Keras' stateless API (``model.stateless_call``) wants state, so predictions, training and
checkpoints all read the same arrays. `KerasModel.to_keras` gives an ordinary, stateful ``keras.Model`` holding a
copy of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from pipekit import field
from pipekit_train.backends import ModelOp
from pipekit_train.backends.kit import FactoryRegistry

__all__ = ["KerasModel", "KerasState", "register_keras_model", "registered_keras_models"]

#: The Keras model factories (built-ins: `_factories`, which imports no framework).
FACTORIES = FactoryRegistry("KerasModel", "Keras model factory", f"{__package__}._factories")


def register_keras_model(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a factory ``fn(**kwargs) -> keras.Model`` under `name`, for ``KerasModel(factory=name)``.

    The factory returns a *built* model (give it a ``keras.Input`` or call ``model.build(shape)``). It runs with
    Python's, NumPy's and Keras' global seeds set from the stage's seed, so initialisers without an explicit seed
    are reproducible; the global random state is restored afterwards.

    Example:
        >>> @register_keras_model("doc_linear")
        ... def doc_linear(in_size: int, out_size: int = 1):
        ...     import keras
        ...     return keras.Sequential([keras.Input((in_size,)), keras.layers.Dense(out_size)])
        >>> KerasModel(factory="doc_linear", kwargs={"in_size": 3})
        KerasModel(factory='doc_linear', kwargs={'in_size': 3})
    """

    return FACTORIES.register(name, "register_keras_model")


def registered_keras_models() -> list[str]:
    """The names `KerasModel.factory` accepts, sorted."""
    return FACTORIES.names()


class KerasState:
    """A Keras model's variables as arrays: what a bound `KerasModel` holds.

    Attributes:
        model: The Keras model that gives the arrays meaning (shared per architecture, never mutated).
        trainable: Values of ``model.trainable_variables``, in that order.
        non_trainable: Values of ``model.non_trainable_variables`` (statistics, seed-generator states).
    """

    __slots__ = ("model", "non_trainable", "trainable")

    def __init__(self, model: Any, trainable: Any, non_trainable: Any) -> None:
        self.model = model
        self.trainable = tuple(trainable)
        self.non_trainable = tuple(non_trainable)

    def __call__(self, x: Any, training: bool = False) -> Any:
        """``model.stateless_call`` with these arrays, compiled once per architecture."""
        from . import _tree

        return _tree.predict(self, x, training)

    def __repr__(self) -> str:
        return (
            f"KerasState({type(self.model).__name__}, {len(self.trainable)} trainable, "
            f"{len(self.non_trainable)} non-trainable arrays)"
        )


class KerasModel(ModelOp):
    """A Keras 3 model (JAX backend) built by a registered factory: ``factory(**kwargs)``.

    Built-in factories: ``mlp``, ``cnn``, ``autoencoder``, ``classifier``, with the Equinox backend's kwargs and
    structure (``encoder``, ``decoder``, ``head``), so ``Transfer(paths={"encoder": "encoder"})`` works between
    Keras stages. Register more with `register_keras_model`.

    Args:
        factory: a name registered with `register_keras_model`.
        kwargs: keyword arguments for the factory, checked against its signature on construction.

    Example:
        >>> import numpy as np
        >>> op = KerasModel(factory="mlp", kwargs={"in_size": 4, "out_size": 2})
        >>> op.bind(op.build(0))(np.zeros((3, 4), np.float32)).shape
        (3, 2)
    """

    backend = "keras"

    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def example(cls) -> KerasModel:
        return cls(factory="mlp", kwargs={"in_size": 4, "out_size": 2, "width_size": 8})

    def validate(self) -> None:
        FACTORIES.check_kwargs(self.factory, self.kwargs)

    # Building ------------------------------------------------------------------------------------------------
    def build(self, key: Any) -> KerasState:
        """Freshly initialised weights for `key` (an int seed or a JAX key): the same key gives the same arrays."""
        from . import _tree

        return _tree.build_state(self, key)

    def new_keras_model(self) -> Any:
        """A fresh ``keras.Model`` from the factory (its own, unseeded initial weights)."""
        from . import _tree

        return _tree.call_factory(self, None)

    def to_keras(self) -> Any:
        """An ordinary ``keras.Model`` holding a copy of the bound weights (for ``predict``, ``save``, ``fit``...)."""
        from . import _tree

        return _tree.to_keras(self, self.require_module("to_keras"))

    def bind(self, module: Any, *, check: bool = True) -> ModelOp:
        """Bound to a `KerasState`, or to a built ``keras.Model`` of this architecture (its values are copied)."""
        if not isinstance(module, KerasState):
            from . import _tree

            module = _tree.state_of(self, module)
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

    def with_weights(self, arrays: Mapping[str, np.ndarray]) -> KerasModel:
        from . import _tree

        return self.bind(_tree.fill(self, arrays), check=False)  # type: ignore[return-value]

    def check_input(self, shape: tuple[int, ...], dtype: Any) -> Any:
        from . import _tree

        return _tree.check_input(self, shape, dtype)

    def inference_function(self) -> Any:
        """``model.stateless_call`` in inference mode with the bound arrays closed over: a pure JAX function of
        the batch, what ``pipekit-train export`` serializes with ``jax.export``."""
        from . import _tree

        return _tree.inference_function(self.require_module("inference_function"))

    def __call__(self, x: Any) -> Any:
        """Predictions (inference mode) for a batch `x`."""
        return self.require_module("__call__")(x)
