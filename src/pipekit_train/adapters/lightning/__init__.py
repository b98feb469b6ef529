"""The Lightning backend: PyTorch models (CPU torch here) trained by pipekit's own step loop.

`TrainingLoop(backend="lightning")` finds this package through the ``pipekit_train.backends`` entry point.
Importing it is cheap (it registers the ``TorchModel`` operator type); torch is imported when a model is built or a
stage runs. The step is plain torch (forward, the mapped pipekit loss, ``backward``, a ``torch.optim`` step) driven
by the backend-neutral engine: no ``Trainer.fit``, whose per-step overhead is not ours to pay. Users who want a
``LightningModule`` get one from `build_lightning_module`. `backend` is the backend object of the contract in the
repository's ``adapters/README.md``; ``docs/backends.md`` says what it supports.

Also public: `to_torch_loss` / `register_torch_loss` (a pipekit loss as a torch function), `build_torch_optimizer`
(an ``optimizer_config`` for ``torch.optim``), and the converters of every built-in factory Equinox ⇄ torch and
Keras ⇄ torch (`pipekit_train.backends._zoo`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipekit_train.backends import LazyBackend
from pipekit_train.backends.kit import attach_lazily as _attach

from ._model import TorchModel as TorchModel
from ._model import register_torch_model as register_torch_model
from ._model import registered_torch_models as registered_torch_models

if TYPE_CHECKING:
    from ._adapter import build_lightning_module as build_lightning_module
    from ._losses import register_torch_loss as register_torch_loss
    from ._losses import to_torch_loss as to_torch_loss
    from ._optimizers import TorchOptimizer as TorchOptimizer
    from ._optimizers import build_torch_optimizer as build_torch_optimizer

__getattr__, __dir__, _lazy_all = _attach(__name__, __file__, globals())
__all__ = [
    "LightningBackendSpec",
    "TorchModel",
    "backend",
    "register_torch_model",
    "registered_torch_models",
    *_lazy_all,
]


class LightningBackendSpec(LazyBackend):
    """The Lightning backend (the contract: ``adapters/README.md``); `backend` is the object the entry point names.
    Lightning itself is needed only by `build_lightning_module`."""

    name = "lightning"
    requires = ("torch",)
    extra = "lightning"
    capabilities = frozenset({"weights", "transfer", "init_from", "schedule_segment", "ema"})
    impl = "pipekit_train.adapters.lightning._adapter"

    def example_model(self, in_size: int, out_size: int) -> TorchModel:
        """A small model of ``in_size -> out_size`` for the conformance kit."""
        return TorchModel(factory="mlp", kwargs={"in_size": in_size, "out_size": out_size, "width_size": 8, "depth": 1})

    def example_transfer(self) -> dict[str, str]:
        """The `Transfer` paths of `example_model` the conformance kit copies: its first layer."""
        return {"layers[0]": "layers[0]"}


backend = LightningBackendSpec()
