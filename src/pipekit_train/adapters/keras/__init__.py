"""The Keras backend: Keras 3 on its JAX backend, trained by our own `jax.jit` step over Keras' stateless API.

`TrainingLoop(backend="keras")` finds this package through the ``pipekit_train.backends`` entry point. Importing
it is cheap (it registers the ``KerasModel`` operator type); Keras is imported when a model is built or a stage
runs, with ``KERAS_BACKEND`` set to ``jax`` if it is unset (another value is refused). `backend` is the backend
object of the contract in the repository's ``adapters/README.md``; ``docs/backends.md`` says what it supports.

Also public: `to_keras_loss` (a pipekit loss for ``model.compile``), `build_keras_optimizer` and
`PipekitSchedule` (an ``optimizer_config`` for Keras), and `register_converter` / `convert_model` (moving
models between backends; every built-in factory converts among Equinox, Keras, Lightning and Flax).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipekit_train.backends import LazyBackend
from pipekit_train.backends.kit import attach_lazily as _attach

from ._convert import convert_model as convert_model
from ._convert import register_converter as register_converter
from ._convert import registered_converters as registered_converters
from ._model import KerasModel as KerasModel
from ._model import KerasState as KerasState
from ._model import register_keras_model as register_keras_model
from ._model import registered_keras_models as registered_keras_models

if TYPE_CHECKING:
    from ._env import import_keras as import_keras
    from ._losses import PipekitKerasLoss as PipekitKerasLoss
    from ._losses import to_keras_loss as to_keras_loss
    from ._optimizers import PipekitSchedule as PipekitSchedule
    from ._optimizers import build_keras_optimizer as build_keras_optimizer
    from ._tree import apply_transfer as apply_transfer

__getattr__, __dir__, _lazy_all = _attach(__name__, __file__, globals())
__all__ = [
    "KerasBackendSpec",
    "KerasModel",
    "KerasState",
    "backend",
    "convert_model",
    "register_converter",
    "register_keras_model",
    "registered_converters",
    "registered_keras_models",
    *_lazy_all,
]


class KerasBackendSpec(LazyBackend):
    """The Keras backend (the contract: ``adapters/README.md``); `backend` is the object the entry point names."""

    name = "keras"
    requires = ("keras",)
    extra = "keras"
    #: Data parallel with replicated variables (docs/scale.md); models carried, converted and transferred; Keras on
    #: JAX is a pure JAX function through ``stateless_call``, so its models export; the EMA callback (``ema``).
    capabilities = frozenset({"weights", "transfer", "init_from", "mesh", "export", "ema"})
    impl = "pipekit_train.adapters.keras._adapter"

    def example_model(self, in_size: int, out_size: int) -> KerasModel:
        """A small model of ``in_size -> out_size`` for the conformance kit."""
        return KerasModel(factory="mlp", kwargs={"in_size": in_size, "out_size": out_size, "width_size": 8, "depth": 1})

    def example_transfer(self) -> dict[str, str]:
        """The `Transfer` paths of `example_model` the conformance kit copies: its first layer."""
        return {"layers[0]": "layers[0]"}


backend = KerasBackendSpec()
