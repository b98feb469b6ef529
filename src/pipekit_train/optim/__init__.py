"""Optimization settings: reading `optimizer_config`, schedules for any value, the gradient and parameter-group
recipes, LoRA adapters (`optimizer_config.lora`). See ``docs/recipes.md``. (The optax mapping the JAX backends
share is `pipekit_train.backends.kit`; the learning-rate finder is `pipekit_train.sweep.lr_find`.)"""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ._config import check_optimizer_config as check_optimizer_config
    from ._config import check_schedule as check_schedule
    from ._config import resolve_optimizer_config as resolve_optimizer_config
    from ._config import schedule_numbers as schedule_numbers
    from ._lora import DEFAULT_TARGETS as DEFAULT_TARGETS
    from ._lora import LoraSettings as LoraSettings
    from ._lora import lora_settings as lora_settings
    from ._lora import resolve_lora as resolve_lora
    from ._lora import select_targets as select_targets
    from ._recipes import SAM as SAM
    from ._recipes import GradientRule as GradientRule
    from ._recipes import ParamGroup as ParamGroup
    from ._schedules import Constant as Constant
    from ._schedules import Cosine as Cosine
    from ._schedules import Exponential as Exponential
    from ._schedules import Linear as Linear
    from ._schedules import Piecewise as Piecewise
    from ._schedules import Schedule as Schedule
    from ._schedules import current_step as current_step
    from ._schedules import schedule_value as schedule_value
    from ._schedules import step_context as step_context

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())
