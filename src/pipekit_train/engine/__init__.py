"""The engine: how one stage's steps run, backend-neutral (schedule, chunks, callbacks, records, evaluation,
divergence checks, checkpoint hooks, resume). The stage (`pipekit_train.stage`) hands it a started `StepBackend`;
the engine never names a backend."""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ._evaluation import evaluate as evaluate
    from ._loop import Engine as Engine
    from ._loop import run_steps as run_steps
    from ._protocol import AdapterResult as AdapterResult
    from ._protocol import EngineSnapshot as EngineSnapshot
    from ._protocol import HookCall as HookCall
    from ._protocol import NonFiniteLossError as NonFiniteLossError
    from ._protocol import NonFiniteWeightsError as NonFiniteWeightsError
    from ._protocol import StageHooks as StageHooks

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
