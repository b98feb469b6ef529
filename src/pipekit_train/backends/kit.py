"""The adapter kit: what backends share, public, so that the backends shipped with pipekit-train and a backend in
your own package build on the same pieces (and import nothing private).

- **Model factories by name** (`FactoryRegistry`), the **built-in zoo** (`mlp`, `cnn`, `autoencoder`,
  `classifier` as backend-neutral layer lists: `describe`, `Architecture`, `factory`) and the canonical per-layer
  weight layout converters go through (`to_canonical`, `from_canonical`); the zoo's transformers likewise
  (`TRANSFORMERS`, `transformer_factory`, `transformer_weights`, `transformer_to_canonical`,
  `transformer_from_canonical`) and the size checks and default padding id their factories share on every backend
  (`check_transformer_sizes`, `default_pad_id`).
- **Pre-flight helpers**: the data keys a loop names against its batches (`check_input_and_target_keys`), the loss
  against the model's predictions (`check_loss_fits`), a model too large for the memory there is
  (`check_model_size`), the stage's name (`stage_name`).
- **The optax mapping** every JAX backend shares: `build_optimizer` (``optimizer_config`` to an optax optimizer
  whose numbers are values in its state, with the run-time learning-rate scale `get_lr_scale` / `set_lr_scale`),
  `build_schedule` and `learning_rate_at` (the scheduled rate at a step, for a backend computing its own;
  `LearningRateLog`, the logged rate of a state kept as leaves), the transforms it is made of, and the
  parameter-group labels (`group_labels`, `param_path`).
- **EMA**: the decay rule every backend applies (`ema_decay`).
- **Building weights**: how the one-off program that draws a model's initial weights compiles
  (`init_compiler_options`: a quarter to three quarters of the default compile time on the CPU, the same bits).
- **`TrainingLoop.carry`**: the setting (`carry_settings`) and the previous stage's saved trees matched to this
  stage's by path (`match_by_path`); the core hands them over as ``incoming.carried``.
- **Cheap imports**: `attach_lazily`, the lazy facade the backends' packages use (their framework is imported on
  first use, not when a pipeline file is read).

Names are imported on first use, so importing the kit costs nothing. ``adapters/README.md`` says how a backend uses
them; the contract itself (`Backend`, `StepBackend`, `ModelOp`) is in `pipekit_train.backends`.
"""

from typing import TYPE_CHECKING

from .._lazy import attach as _attach

if TYPE_CHECKING:
    from ..optim._recipes import group_labels as group_labels
    from ..optim._recipes import param_path as param_path
    from ..optim._schedules import fixed_value as fixed_value
    from ._carry import CARRY_KEYS as CARRY_KEYS
    from ._carry import WEIGHTS as WEIGHTS
    from ._carry import carry_settings as carry_settings
    from ._carry import match_by_path as match_by_path
    from ._carry import wants_checkpoint as wants_checkpoint
    from ._ema import ema_decay as ema_decay
    from ._init_compile import init_compiler_options as init_compiler_options
    from ._model import check_activation as check_activation
    from ._model import check_factory_kwargs as check_factory_kwargs
    from ._model import parse_path as parse_path
    from ._model import weights_digest as weights_digest
    from ._optax import StructuredOptimizer as StructuredOptimizer
    from ._optax import build_optimizer as build_optimizer
    from ._optax_numbers import Hyperparams as Hyperparams
    from ._optax_numbers import refresh_hyperparams as refresh_hyperparams
    from ._optax_schedule import LearningRateLog as LearningRateLog
    from ._optax_schedule import LrScaleState as LrScaleState
    from ._optax_schedule import build_schedule as build_schedule
    from ._optax_schedule import get_lr_scale as get_lr_scale
    from ._optax_schedule import learning_rate_at as learning_rate_at
    from ._optax_schedule import restart_schedule as restart_schedule
    from ._optax_schedule import scale_by_scheduled_lr as scale_by_scheduled_lr
    from ._optax_schedule import set_lr_scale as set_lr_scale
    from ._optax_transforms import FrozenUntilState as FrozenUntilState
    from ._optax_transforms import L2SPState as L2SPState
    from ._optax_transforms import add_decayed_weights as add_decayed_weights
    from ._optax_transforms import add_decayed_weights_toward_start as add_decayed_weights_toward_start
    from ._optax_transforms import clip_by_global_norm as clip_by_global_norm
    from ._optax_transforms import frozen_until as frozen_until
    from ._optax_transforms import reset_anchor as reset_anchor
    from ._optax_transforms import scale_by_adam as scale_by_adam
    from ._optax_transforms import scale_by_lion as scale_by_lion
    from ._optax_transforms import scale_by_rms as scale_by_rms
    from ._optax_transforms import trace as trace
    from ._shared import BUILTIN_FACTORIES as BUILTIN_FACTORIES
    from ._shared import MISSING as MISSING
    from ._shared import FactoryRegistry as FactoryRegistry
    from ._shared import check_input_and_target_keys as check_input_and_target_keys
    from ._shared import check_loss_fits as check_loss_fits
    from ._shared import check_model_size as check_model_size
    from ._shared import cnn_feature_size as cnn_feature_size
    from ._shared import memory_limit as memory_limit
    from ._shared import resolve_path as resolve_path
    from ._shared import stage_name as stage_name
    from ._shared import user_line as user_line
    from ._zoo import ZOO as ZOO
    from ._zoo import Architecture as Architecture
    from ._zoo import describe as describe
    from ._zoo import factory as factory
    from ._zoo import from_canonical as from_canonical
    from ._zoo import to_canonical as to_canonical
    from ._zoo_transformer import TRANSFORMERS as TRANSFORMERS
    from ._zoo_transformer import check_transformer_sizes as check_transformer_sizes
    from ._zoo_transformer import default_pad_id as default_pad_id
    from ._zoo_transformer import transformer_factory as transformer_factory
    from ._zoo_transformer import transformer_from_canonical as transformer_from_canonical
    from ._zoo_transformer import transformer_to_canonical as transformer_to_canonical
    from ._zoo_transformer import transformer_weights as transformer_weights

__getattr__, __dir__, __all__ = _attach(__name__, __file__, globals())

#: The lazy facade the backends' packages use: ``__getattr__, __dir__, __all__ = attach_lazily(__name__, __file__,
#: globals())`` imports each name of the module's ``if TYPE_CHECKING:`` imports on first use.
attach_lazily = _attach
__all__ = sorted([*__all__, "attach_lazily"])
