"""The `Loss` base class: what a loss is, how it is called and what it returns (`split_loss_output`).

Every loss subclasses `Loss`, a `pipekit.Operator`: defining the subclass registers it under its class name, so
it round-trips through YAML (``loss: {type: Huber, delta: 0.5}``). Losses are written in `jax.numpy` only, so
they can be called under `jax.jit` and differentiated with `jax.grad`. A loss returns either a scalar or a
``(scalar, aux_metrics)`` pair; `split_loss_output` tells them apart.

The built-in losses are in ``_builtin.py``, `Composite` in ``_composite.py``, a plain callable as a loss
(`LossFunction`) in ``_function.py`` and what a loss declares of its targets (`TargetContract`) in ``_targets.py``.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

from pipekit import Operator

from ._targets import TargetContract

__all__ = ["Loss", "split_loss_output"]


class Loss(Operator, abc.ABC, register=False):
    """Base class of losses: a frozen, typed operator called as ``loss(predicted, target)`` by the adapter.

    Subclass it, declare the configuration as fields and implement ``__call__``; defining the subclass registers
    it under its class name (or ``name=``), so a YAML file can name it (``loss: {type: Huber, delta: 0.5}``).
    ``__call__`` gets the model's predictions for the whole batch and the batch's targets, and returns either a
    scalar or a ``(scalar, aux_metrics)`` pair (`split_loss_output` tells them apart). The loop logs each aux
    metric as ``<aux_prefix><name>``. Write it in `jax.numpy`: it runs under `jax.jit` and `jax.grad`.

    Example:
        >>> import jax.numpy as jnp
        >>> class WeightedL1(Loss):
        ...     weight: float = 1.0
        ...     def __call__(self, predicted, target):
        ...         return self.weight * jnp.mean(jnp.abs(predicted - target))
        >>> float(WeightedL1(weight=2)(jnp.array([0.5, -3.0]), jnp.zeros(2)))
        3.5
        >>> WeightedL1(weight=2)  # a frozen, typed value: the int became a float
        WeightedL1(weight=2.0)
    """

    #: The loop logs a loss's aux values as ``<aux_prefix><name>`` (``loss/MSE_0`` for a `Composite`'s terms).
    aux_prefix: ClassVar[str] = "loss/"
    #: What the loss needs of its targets (`TargetContract`: `CLASS_TARGETS`, `SAME_SHAPE_FLOATING` or your own),
    #: checked in pre-flight on abstract shapes; ``None`` (the default for your losses): not checked.
    targets: ClassVar[TargetContract | None] = None

    @abc.abstractmethod
    def __call__(self, predicted: Any, target: Any) -> Any:  # type: ignore[override]  # a loss is not a one-input step
        """The loss of `predicted` against `target`: a scalar, or ``(scalar, {name: scalar, ...})``."""


def split_loss_output(out: Any) -> tuple[Any, dict[str, Any]]:
    """Split what a `Loss` returned into ``(scalar, aux_metrics)``.

    A ``(value, mapping)`` pair is a scalar with auxiliary metrics; anything else is the scalar itself, with
    no auxiliary metrics.

    Example:
        >>> split_loss_output(1.5)
        (1.5, {})
        >>> split_loss_output((1.5, {"accuracy": 0.5}))
        (1.5, {'accuracy': 0.5})
    """
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        return out[0], dict(out[1])
    return out, {}
