"""The Equinox backend: `EquinoxModel` and its factories, the compiled optax steps, and the adapter contract.

`TrainingLoop(backend="equinox")` finds this package through the ``pipekit_train.backends`` entry point. Importing
it is cheap (it registers the ``EquinoxModel`` operator type); Equinox, JAX and optax are imported when a stage
runs. The contract functions (`preflight`, `run`, `backend_info`, `example_model`) are described in the
repository's ``adapters/README.md``.

The building blocks are public too: `TrainState`, `TrainTask`, `make_task`, `train_step`, `save_state` and
`restore_state` for hand-written loops, and `apply_transfer` for moving sub-trees between models.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..._lazy import attach as _attach
from ._model import EquinoxModel as EquinoxModel
from ._model import register_model as register_model
from ._model import registered_models as registered_models

#: The packages this backend needs (checked when a stage first uses it).
REQUIRES = ("equinox", "optax")
#: The `TrainingLoop` recipe fields this backend honours (docs/recipes.md); ``schedules``: values that follow the
#: step (a `Schedule` in the loss or the EMA decay).
RECIPES = ("gradient", "param_groups", "diagnostics", "schedules", "carry")
#: The scale settings this adapter honours (data parallel over a device mesh, mixed precision, several processes
#: with jax.distributed; docs/scale.md).
SCALE = ("mesh", "shard_params", "precision", "processes")

if TYPE_CHECKING:
    from ._factories import ACTIVATIONS as ACTIVATIONS
    from ._factories import get_activation as get_activation
    from ._primitives import TrainState as TrainState
    from ._primitives import TrainTask as TrainTask
    from ._primitives import make_task as make_task
    from ._primitives import restore_state as restore_state
    from ._primitives import save_state as save_state
    from ._primitives import train_step as train_step
    from ._tree import apply_transfer as apply_transfer

__getattr__, __dir__, _lazy_all = _attach(__name__, __file__, globals())
__all__ = [
    "EquinoxModel",
    "backend_info",
    "example_model",
    "preflight",
    "register_model",
    "run",
    "step_backend",
    *_lazy_all,
]


def preflight(loop: Any, incoming: Any, stage: str) -> Any:
    """Check `loop` before anything compiles; return the bound model the stage would start from."""
    from ._adapter import preflight as impl

    return impl(loop, incoming, stage)


def run(loop: Any, incoming: Any, info: Any, hooks: Any) -> Any:
    """Train one stage; see ``adapters/README.md``."""
    from ._adapter import run as impl

    return impl(loop, incoming, info, hooks)


def step_backend(loop: Any, incoming: Any, stage: str) -> Any:
    """Optional contract function: the stage's `StepBackend` at its start, stepped by hand (`lr_find`)."""
    from ._adapter import step_backend as impl

    return impl(loop, incoming, stage)


def backend_info() -> dict[str, Any]:
    """The framework versions and devices recorded in every artifact of this backend."""
    from ._adapter import backend_info as impl

    return impl()


def example_model(in_size: int, out_size: int) -> EquinoxModel:
    """A small model of ``in_size -> out_size`` for the conformance checks."""
    return EquinoxModel(factory="mlp", kwargs={"in_size": in_size, "out_size": out_size, "width_size": 8, "depth": 1})
