"""The Flax backend: Flax NNX models trained by our own `jax.jit` step over NNX's functional API.

`TrainingLoop(backend="flax")` finds this package through the ``pipekit_train.backends`` entry point (the
``flax`` extra installs Flax). Importing it is cheap (it registers the ``FlaxModel`` operator type); Flax is
imported when a model is built or a stage runs. `backend` is the backend object of the contract in the repository's
``adapters/README.md``; ``docs/backends.md`` says what it supports.

`FlaxModel` builds the zoo's four factories (``mlp``, ``cnn``, ``autoencoder``, ``classifier``) and its
transformers (``transformer``, ``transformer_classifier``), with the Equinox backend's kwargs and parts, and any
``nnx.Module`` factory registered with `register_flax_model`; a bound one holds a `FlaxState` (the module split
into immutable arrays). The four convert to and from Equinox, Keras and Lightning, the transformers to and from
Equinox (`pipekit_train.backends.convert_model`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipekit_train.backends import LazyBackend
from pipekit_train.backends.kit import attach_lazily as _attach

from ._model import FlaxModel as FlaxModel
from ._model import FlaxState as FlaxState
from ._model import register_flax_model as register_flax_model
from ._model import registered_flax_models as registered_flax_models

if TYPE_CHECKING:
    from ._tree import apply_transfer as apply_transfer

__getattr__, __dir__, _lazy_all = _attach(__name__, __file__, globals())
__all__ = [
    "FlaxBackendSpec",
    "FlaxModel",
    "FlaxState",
    "backend",
    "register_flax_model",
    "registered_flax_models",
    *_lazy_all,
]


class FlaxBackendSpec(LazyBackend):
    """The Flax backend (the contract: ``adapters/README.md``); `backend` is the object the entry point names."""

    name = "flax"
    requires = ("flax", "optax")
    extra = "flax"
    #: Models carried, converted, transferred and warm-started; NNX merged in inference mode is a pure JAX
    #: function of the batch, so its models export; the EMA callback; schedules on loss and EMA values (read at the
    #: traced step); data parallel with replicated variables and mixed precision (docs/scale.md); the learning-rate
    #: finder (it steps `train` at rates set through `set_lr_scale`); ``extend --new-segment``.
    capabilities = frozenset(
        {
            "weights",
            "transfer",
            "init_from",
            "export",
            "ema",
            "schedules",
            "mesh",
            "precision",
            "lr_find",
            "schedule_segment",
        }
    )
    impl = "pipekit_train.adapters.flax._adapter"

    def example_model(self, in_size: int, out_size: int) -> FlaxModel:
        """A small model of ``in_size -> out_size`` for the conformance kit."""
        return FlaxModel(factory="mlp", kwargs={"in_size": in_size, "out_size": out_size, "width_size": 8, "depth": 1})

    def example_transfer(self) -> dict[str, str]:
        """The `Transfer` paths of `example_model` the conformance kit copies: its first layer."""
        return {"layers[0]": "layers[0]"}


backend = FlaxBackendSpec()
