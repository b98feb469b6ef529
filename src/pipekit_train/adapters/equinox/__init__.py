"""The Equinox backend: `EquinoxModel` and its factories, the compiled optax steps, and the adapter contract.

`TrainingLoop(backend="equinox")` finds this package through the ``pipekit_train.backends`` entry point. Importing
it is cheap (it registers the ``EquinoxModel`` operator type); Equinox, JAX and optax are imported when a stage
runs. `backend` is the backend object of the contract in the repository's ``adapters/README.md``.

The building blocks are public too: `TrainState`, `TrainTask`, `make_task`, `train_step`, `save_state` and
`restore_state` for hand-written loops, and `apply_transfer` for moving sub-trees between models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipekit_train.backends import LazyBackend
from pipekit_train.backends.kit import attach_lazily as _attach

from ._model import EquinoxModel as EquinoxModel
from ._model import register_model as register_model
from ._model import registered_models as registered_models

if TYPE_CHECKING:
    from ._modules import ACTIVATIONS as ACTIVATIONS
    from ._modules import get_activation as get_activation
    from ._primitives import TrainState as TrainState
    from ._primitives import TrainTask as TrainTask
    from ._primitives import make_task as make_task
    from ._primitives import restore_state as restore_state
    from ._primitives import save_state as save_state
    from ._primitives import train_step as train_step
    from ._tree import apply_transfer as apply_transfer

__getattr__, __dir__, _lazy_all = _attach(__name__, __file__, globals())
__all__ = ["EquinoxModel", "EquinoxBackendSpec", "backend", "register_model", *_lazy_all]


class EquinoxBackendSpec(LazyBackend):
    """The Equinox backend (the contract: ``adapters/README.md``); `backend` is the object the entry point names."""

    name = "equinox"
    requires = ("equinox", "optax")
    capabilities = frozenset(
        {
            "weights",
            "transfer",
            "init_from",
            # recipes (docs/recipes.md); ``schedules``: values that follow the step (a `Schedule` in the loss or EMA)
            "gradient",
            "param_groups",
            "diagnostics",
            "schedules",
            "carry",
            "ema",
            # scale (docs/scale.md): data parallel over a device mesh, sharded parameters, mixed precision, processes
            "mesh",
            "shard_params",
            "precision",
            "processes",
            "lr_find",
            "export",
            "schedule_segment",
            # low-rank adapters on a frozen model (optimizer_config.lora; docs/recipes.md)
            "lora",
        }
    )
    impl = "pipekit_train.adapters.equinox._adapter"

    def example_model(self, in_size: int, out_size: int) -> EquinoxModel:
        """A small model of ``in_size -> out_size`` for the conformance kit."""
        return EquinoxModel(
            factory="mlp", kwargs={"in_size": in_size, "out_size": out_size, "width_size": 8, "depth": 1}
        )

    def example_transfer(self) -> dict[str, str]:
        """The `Transfer` paths of `example_model` the conformance kit copies: its first layer."""
        return {"layers[0]": "layers[0]"}


backend = EquinoxBackendSpec()
