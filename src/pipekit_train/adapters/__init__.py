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
    from .._engine import AdapterResult as AdapterResult
    from .._engine import Engine as Engine
    from .._engine import EngineSnapshot as EngineSnapshot
    from .._engine import StageHooks as StageHooks
    from .._engine import StepBackend as StepBackend
    from .._engine import run_steps as run_steps
    from .._loop import RunInfo as RunInfo
    from .._optim import check_schedule as check_schedule
    from .._optim import resolve_optimizer_config as resolve_optimizer_config

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
