"""Backend adapters, one package per backend, and the kit for writing one.

`TrainingLoop(backend=NAME)` finds its adapter by name (the ``pipekit_train.backends`` entry-point group, or
`pipekit_train.register_backend`). An adapter module implements ``preflight``, ``run`` and ``backend_info``; the
usual ``run`` builds a `StepBackend` for its framework and hands it to `run_steps`, and the backend-neutral
`Engine` does everything else (schedule, callbacks, writers, checkpoints, resume, signals). The contract, a
template and the conformance checks (`pipekit_train.adapters.conformance`) are described in the repository's
``adapters/README.md``.
"""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ..optim._config import check_schedule as check_schedule
    from ..optim._config import resolve_optimizer_config as resolve_optimizer_config
    from ..stage.engine import AdapterResult as AdapterResult
    from ..stage.engine import Engine as Engine
    from ..stage.engine import EngineSnapshot as EngineSnapshot
    from ..stage.engine import StageHooks as StageHooks
    from ..stage.engine import StepBackend as StepBackend
    from ..stage.engine import run_steps as run_steps
    from ..stage.loop import RunInfo as RunInfo

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
