"""Optimization: reading `optimizer_config`, the optax mapping every JAX backend shares, schedules for any
value, the gradient and parameter-group recipes, and the learning-rate finder. See ``docs/recipes.md``."""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ..backends._optax import FrozenUntilState as FrozenUntilState
    from ..backends._optax import Hyperparams as Hyperparams
    from ..backends._optax import L2SPState as L2SPState
    from ..backends._optax import LrScaleState as LrScaleState
    from ..backends._optax import StructuredOptimizer as StructuredOptimizer
    from ..backends._optax import add_decayed_weights as add_decayed_weights
    from ..backends._optax import add_decayed_weights_toward_start as add_decayed_weights_toward_start
    from ..backends._optax import build_optimizer as build_optimizer
    from ..backends._optax import build_schedule as build_schedule
    from ..backends._optax import clip_by_global_norm as clip_by_global_norm
    from ..backends._optax import frozen_until as frozen_until
    from ..backends._optax import get_lr_scale as get_lr_scale
    from ..backends._optax import learning_rate_at as learning_rate_at
    from ..backends._optax import refresh_hyperparams as refresh_hyperparams
    from ..backends._optax import reset_anchor as reset_anchor
    from ..backends._optax import scale_by_adam as scale_by_adam
    from ..backends._optax import scale_by_lion as scale_by_lion
    from ..backends._optax import scale_by_rms as scale_by_rms
    from ..backends._optax import scale_by_scheduled_lr as scale_by_scheduled_lr
    from ..backends._optax import set_lr_scale as set_lr_scale
    from ..backends._optax import trace as trace
    from ..sweep._lr_find import LRFindResult as LRFindResult
    from ..sweep._lr_find import lr_find as lr_find
    from ._config import check_optimizer_config as check_optimizer_config
    from ._config import check_schedule as check_schedule
    from ._config import resolve_optimizer_config as resolve_optimizer_config
    from ._config import schedule_numbers as schedule_numbers
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
