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
    from ..engine._loop import Engine as Engine
    from ..engine._loop import run_steps as run_steps
    from ..engine._protocol import AdapterResult as AdapterResult
    from ..engine._protocol import EngineSnapshot as EngineSnapshot
    from ..engine._protocol import StageHooks as StageHooks
    from ..engine._protocol import StepBackend as StepBackend
    from ..optim._config import check_schedule as check_schedule
    from ..optim._config import resolve_optimizer_config as resolve_optimizer_config
    from ..stage.loop import RunInfo as RunInfo

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
