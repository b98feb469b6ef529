"""``optimizer_config`` → a Keras optimizer, with the schedule as a `LearningRateSchedule` and a run-time scale.

The keys are read once, by `pipekit_train.optim._config.resolve_optimizer_config`; this module maps the result onto
Keras 3:

=================  =====================================================================================
key                Keras
=================  =====================================================================================
name               ``AdamW``, ``Adam``, ``SGD``, ``RMSprop`` (``rho`` = ``b2``), ``Lion``
schedule           `PipekitSchedule`: the JAX backends' schedule (same numbers), times the run-time scale
weight_decay       the optimizer's decoupled ``weight_decay``
decay_biases       ``false``: ``exclude_from_weight_decay`` of every variable with ndim <= 1
grad_clip_norm     ``global_clipnorm`` (applied to the accumulated gradient, like the JAX backends)
accum              ``gradient_accumulation_steps`` (the mean gradient; the schedule still counts loop steps)
=================  =====================================================================================

A key Keras cannot honour (``nesterov`` for ``rmsprop``) is a `pipekit.ConfigError` naming the backend and the
key. The run-time scale (`ReduceLROnPlateau`) is an optimizer variable, ``lr_scale``, so it is part of the
optimizer's state and of every checkpoint.
"""

# Keras has no type information: its classes are `Any` to the checker, so subclassing them is allowed here.
# mypy: disable-error-code="misc,name-defined,no-untyped-def"
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pipekit import ConfigError
from pipekit_train.backends.kit import build_schedule
from pipekit_train.optim import resolve_optimizer_config

from ._env import import_keras

keras = import_keras()

__all__ = ["PipekitSchedule", "build_keras_optimizer", "lr_scale_index"]

#: Names of weights excluded from weight decay when no variables are given (``model.compile`` / ``fit``).
_NO_DECAY_NAMES = ["bias", "gamma", "beta"]


class PipekitSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The learning rate an ``optimizer_config`` schedules, as a Keras `LearningRateSchedule`.

    The numbers are the JAX backends' (`pipekit_train.backends.kit.build_schedule`), by loop step: with
    gradient accumulation Keras passes the number of updates, which is multiplied back by `accum`. When `scale`
    is set (a Keras variable of the optimizer, see `build_keras_optimizer`) the rate is multiplied by it.

    Args:
        config: the ``optimizer_config`` mapping.
        max_steps: the stage's length in loop steps (the default decay horizon).
        accum: gradient accumulation steps.
    """

    def __init__(self, config: Mapping[str, Any], max_steps: int, accum: int = 1) -> None:
        self.config = dict(config)
        self.max_steps = int(max_steps)
        self.accum = int(accum)
        self.fn = build_schedule(self.config, max_steps=self.max_steps)
        self.scale: Any = None

    def __call__(self, step: Any) -> Any:
        step = keras.ops.convert_to_tensor(step)
        lr = self.fn(step * self.accum if self.accum > 1 else step)
        if self.scale is not None:
            lr = lr * keras.ops.convert_to_tensor(self.scale)
        return lr

    def get_config(self) -> dict[str, Any]:
        return {"config": self.config, "max_steps": self.max_steps, "accum": self.accum}


def _refuse(cfg: Mapping[str, Any]) -> None:
    if cfg["name"] == "rmsprop" and cfg.get("nesterov"):
        raise ConfigError(
            "backend 'keras' cannot honour optimizer_config.nesterov for name='rmsprop': keras.optimizers.RMSprop "
            "has no Nesterov momentum; set nesterov: false, or use name: sgd with nesterov: true"
        )


def _check_args(max_steps: Any, accum: Any, grad_clip_norm: Any) -> None:
    for name, value in (("max_steps", max_steps), ("accum", accum)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"build_keras_optimizer: {name} must be an int >= 1, got {value!r}")
    if grad_clip_norm is not None and (
        isinstance(grad_clip_norm, bool)
        or not isinstance(grad_clip_norm, (int, float))
        or not (math.isfinite(grad_clip_norm) and grad_clip_norm > 0)
    ):
        raise ConfigError(f"build_keras_optimizer: grad_clip_norm must be a float > 0 or None, got {grad_clip_norm!r}")


def build_keras_optimizer(
    config: Mapping[str, Any],
    *,
    max_steps: int,
    grad_clip_norm: float | None = None,
    accum: int = 1,
    variables: Sequence[Any] | None = None,
) -> Any:
    """The Keras optimizer an ``optimizer_config`` describes (the same keys as every backend).

    Args:
        config: the flat ``optimizer_config`` keys (see ``docs/backends.md`` for what Keras honours).
        max_steps: the run's length in loop steps; the default schedule horizon.
        grad_clip_norm: clip the (accumulated) gradient to this global norm (``global_clipnorm``).
        accum: accumulate the mean gradient over this many steps (``gradient_accumulation_steps``).
        variables: the trainable variables to build the optimizer for. With them, ``decay_biases: false``
            excludes exactly the variables with ndim <= 1 (as the JAX backends); without them (for
            ``model.compile``) it excludes variables named ``bias``, ``gamma`` or ``beta``.

    Returns:
        A ``keras.optimizers.Optimizer`` whose learning rate is a `PipekitSchedule` and whose variables include
        ``lr_scale`` (see `lr_scale_index`).

    Example:
        >>> opt = build_keras_optimizer({"name": "sgd", "lr": 0.5, "momentum": 0.9}, max_steps=10)
        >>> type(opt).__name__, float(opt.momentum)
        ('SGD', 0.9)
    """
    cfg = resolve_optimizer_config(config)
    _check_args(max_steps, accum, grad_clip_norm)
    _refuse(cfg)
    schedule = PipekitSchedule(config, max_steps, accum)
    common: dict[str, Any] = {"learning_rate": schedule}
    if grad_clip_norm is not None:
        common["global_clipnorm"] = float(grad_clip_norm)
    if accum > 1:
        common["gradient_accumulation_steps"] = accum
    name = cfg["name"]
    decay = float(cfg.get("weight_decay") or 0.0)
    if name in ("sgd", "rmsprop", "lion") and decay:
        common["weight_decay"] = decay
    if name == "adamw":
        opt = keras.optimizers.AdamW(
            beta_1=cfg["b1"], beta_2=cfg["b2"], epsilon=cfg["eps"], weight_decay=decay, **common
        )
    elif name == "adam":
        opt = keras.optimizers.Adam(beta_1=cfg["b1"], beta_2=cfg["b2"], epsilon=cfg["eps"], **common)
    elif name == "sgd":
        opt = keras.optimizers.SGD(momentum=cfg["momentum"], nesterov=cfg["nesterov"], **common)
    elif name == "rmsprop":
        opt = keras.optimizers.RMSprop(rho=cfg["b2"], momentum=cfg["momentum"], epsilon=cfg["eps"], **common)
    elif name == "lion":
        opt = keras.optimizers.Lion(beta_1=cfg["b1"], beta_2=cfg["b2"], **common)
    else:  # pragma: no cover - resolve_optimizer_config refuses other names
        raise ConfigError(f"backend 'keras' has no optimizer {name!r}")
    schedule.scale = opt.add_variable((), initializer="ones", dtype="float32", name="lr_scale")
    if decay and not cfg.get("decay_biases", False):
        if variables is not None:
            opt.exclude_from_weight_decay(var_list=[v for v in variables if len(v.shape) <= 1])
        else:
            opt.exclude_from_weight_decay(var_names=_NO_DECAY_NAMES)
    if variables is not None:
        opt.build(list(variables))
    return opt


def lr_scale_index(optimizer: Any) -> int:
    """The position of the run-time learning-rate scale in ``optimizer.variables``."""
    found = [i for i, v in enumerate(optimizer.variables) if v.name == "lr_scale"]
    if len(found) != 1:
        raise ConfigError(
            f"{type(optimizer).__name__} has no single 'lr_scale' variable; build it with build_keras_optimizer"
        )
    return found[0]
