"""Backend adapters, one package per backend, and the kit for writing one.

`TrainingLoop(backend=NAME)` finds its backend object by name (the ``pipekit_train.backends`` entry-point group,
or `pipekit_train.register_backend`). The object checks a stage, builds a fresh model, and ``start``s the
`StepBackend` for its framework; the backend-neutral `Engine` does everything else (schedule, callbacks, writers,
checkpoints, resume, signals). The contract (`pipekit_train.backends.Backend`), a template and the conformance
checks (`pipekit_train.adapters.conformance`) are described in the repository's ``adapters/README.md``.
"""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ..optim._config import check_schedule as check_schedule
    from ..optim._config import resolve_optimizer_config as resolve_optimizer_config
    from ..stage.engine import Engine as Engine
    from ..stage.engine import run_steps as run_steps
    from ..stage.loop import RunInfo as RunInfo
    from ..stage.steps import AdapterResult as AdapterResult
    from ..stage.steps import EngineSnapshot as EngineSnapshot
    from ..stage.steps import StageHooks as StageHooks
    from ..stage.steps import StepBackend as StepBackend

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
