"""The training stage: `TrainingLoop` and its carry-state, pre-flight, the run driver (`run_pipeline`: the one way a
pipeline runs), where a stage's model starts, what it records, extensions and presets. ``design/overview.md`` lists
the stage flow through these modules."""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ..engine._protocol import NonFiniteLossError as NonFiniteLossError
    from ..engine._protocol import NonFiniteWeightsError as NonFiniteWeightsError
    from .driver import run_pipeline as run_pipeline
    from .extension import Extension as Extension
    from .extension import extend as extend
    from .loop import TrainerCarryState as TrainerCarryState
    from .loop import TrainingLoop as TrainingLoop
    from .loop import TrainingResult as TrainingResult
    from .loop import stage_name as stage_name
    from .preflight import StagePlan as StagePlan
    from .preflight import check_pipeline as check_pipeline
    from .preflight import plan_pipeline as plan_pipeline
    from .presets import preset_fields as preset_fields
    from .presets import register_preset as register_preset
    from .presets import registered_presets as registered_presets
    from .record import TrainingInterrupted as TrainingInterrupted
    from .settings import RunSettings as RunSettings
    from .settings import run_settings as run_settings

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
