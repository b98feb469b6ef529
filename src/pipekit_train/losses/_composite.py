"""`Composite`, a weighted sum of losses, and `target_problem`, the pre-flight walk of a loss (a `Composite`'s
components too) against the target contracts its losses declare.

Both know every kind of loss (the built-in ones, `LossFunction`), so they sit on top of the package.
"""

from __future__ import annotations

import math
from typing import Any

from pipekit import ConfigError

from ..optim._schedules import Schedule, schedule_value
from ._builtin import KL, MSE, NLL
from ._function import LossFunction, as_loss
from ._loss import Loss, split_loss_output
from ._targets import TargetContract

__all__ = ["Composite", "target_problem"]


class Composite(Loss):
    """Weighted sum: loss = sum(w_i * L_i).

    Returns ``(total, terms)``; `terms` maps ``f"{type(L).__name__}_{i}"`` to each component's (unweighted)
    scalar (a component given as a plain function: ``f"{function name}_{i}"``). A component that returns
    ``(scalar, aux)`` contributes its scalar, and its aux metrics appear in `terms` as
    ``f"{type(L).__name__}_{i}/{name}"``.

    A weight may be a `Schedule` (KL annealing: ``[{type: Linear, start: 0.0, end: 1.0, steps: 1000}, {type:
    KL}]``): inside the train step it follows the step and is logged as ``schedule/weight/<term>``
    (``schedule/weight/KL_1``); outside it (validation, test) it takes its final value.

    Args:
        components: ``((weight, loss), ...)``, at least one; every loss must reduce to a scalar. A weight is a
            float or a `Schedule`; a loss is a `Loss` or, from Python, a plain function (`LossFunction`).

    Example:
        >>> import jax.numpy as jnp
        >>> total, terms = Composite(components=((1.0, MSE()), (0.5, MSE(reduction="sum"))))(
        ...     jnp.array([1.0, 1.0]), jnp.zeros(2))
        >>> float(total), sorted(terms)
        (2.0, ['MSE_0', 'MSE_1'])
    """

    components: tuple[tuple[float | Schedule, Loss], ...]

    @classmethod
    def fill_fields(cls, given: dict[str, Any]) -> dict[str, Any]:
        """A component's loss given as a plain callable becomes a `LossFunction` (`as_loss`)."""
        components = given.get("components")
        if not isinstance(components, (list, tuple)):
            return given
        wrapped = [
            (c[0], as_loss(c[1], f"Composite.components[{i}][1]"))
            if isinstance(c, (list, tuple)) and len(c) == 2
            else c
            for i, c in enumerate(components)
        ]
        return {**given, "components": tuple(wrapped)}

    def validate(self) -> None:
        if not self.components:
            raise ConfigError("Composite.components must hold at least one (weight, loss) pair, got ()")
        for i, (weight, loss) in enumerate(self.components):
            if not isinstance(weight, Schedule) and not math.isfinite(weight):
                raise ConfigError(f"Composite.components[{i}] weight must be a finite float, got {weight!r}")
            if getattr(loss, "reduction", None) == "none":
                raise ConfigError(
                    f"Composite.components[{i}] is {loss!r}; a component must reduce to a scalar, "
                    "so reduction='none' is not allowed (use 'mean' or 'sum')"
                )

    @classmethod
    def example(cls) -> Composite:
        return cls(components=((1.0, MSE()), (0.5, KL())))

    def __call__(self, predicted: Any, target: Any) -> tuple[Any, dict[str, Any]]:  # type: ignore[override]  # see Loss.__call__
        terms: dict[str, Any] = {}
        total: Any = 0.0
        for i, (weight, loss) in enumerate(self.components):
            name = f"{_term_name(loss)}_{i}"
            value, aux = split_loss_output(loss(predicted, target))
            terms[name] = value
            for k, v in aux.items():
                terms[f"{name}/{k}"] = v
            total = total + schedule_value(weight, f"weight/{name}") * value
        return total, terms


def _term_name(loss: Any) -> str:
    """A `Composite` term's name before its index: the loss's class, or a wrapped function's own name."""
    if isinstance(loss, LossFunction):
        name = getattr(loss.fn, "__name__", "")
        if isinstance(name, str) and name.isidentifier():
            return name
    return type(loss).__name__


def target_problem(loss: Any, predicted: Any, target: Any) -> tuple[Any, str] | None:
    """``(loss, what is broken; the rule)`` for the first loss in `loss` (a `Composite`'s components too) whose
    declared `Loss.targets` contract the abstract `predicted` / `target` break; ``None`` when all fit.

    A loss that declares no contract (``targets = None``, every user loss unless it sets one) is not checked here.
    """
    if isinstance(loss, Composite):
        for _, component in loss.components:
            found = target_problem(component, predicted, target)
            if found is not None:
                return found
        return None
    contract = getattr(loss, "targets", None)
    if not isinstance(contract, TargetContract):
        return None
    if isinstance(loss, NLL) and isinstance(predicted, (tuple, list)) and len(predicted) == 2:
        predicted = predicted[0]  # (mean, log_var): the targets are compared with the mean
    problem = contract.check(predicted, target)
    if problem is None:
        return None
    return loss, f"{problem}; {type(loss).__name__} takes {contract.rule}"
