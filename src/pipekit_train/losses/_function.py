"""A plain callable as a loss: `LossFunction` wraps it, `as_loss` decides when, and `python_name` names it.

``TrainingLoop(loss=my_loss)`` and a `Composite` component given as a function get a `LossFunction`, so every
backend sees the `Loss` protocol. It has no YAML form; records and resume fingerprints name the function by
`python_name` (its module and qualified name).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from pipekit import ConfigError, Operator

from ._loss import Loss

__all__ = ["LossFunction", "as_loss", "python_name"]


def python_name(fn: Any) -> str:
    """The name a Python callable goes by in records and resume fingerprints: ``module.qualname`` for a function
    or a method, ``functools.partial(module.qualname, 0.5, delta=1.0)`` for a partial (arguments other than
    numbers, strings, booleans and ``None`` by their type), ``module.Class`` for another callable object.

    Example:
        >>> import functools, math
        >>> python_name(math.hypot), python_name(functools.partial(math.hypot, 3.0))
        ('math.hypot', 'functools.partial(math.hypot, 3.0)')
    """
    if isinstance(fn, functools.partial):
        args = [_shown_argument(a) for a in fn.args]
        args += [f"{k}={_shown_argument(v)}" for k, v in fn.keywords.items()]
        return f"functools.partial({', '.join([python_name(fn.func), *args])})"
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}.{qualname}"
    cls = type(fn)
    return f"{cls.__module__}.{cls.__qualname__}"


def _shown_argument(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__name__


def _check_callable(fn: Any, where: str) -> None:
    """Refuse what cannot be called as ``fn(predicted, target)``, naming `where`."""
    if isinstance(fn, type):
        made = f"{fn.__name__}()" if issubclass(fn, Loss) else f"an instance of {fn.__name__}"
        raise ConfigError(f"{where} is the class {fn.__name__}, not a loss: give {made}")
    if isinstance(fn, Operator) or not callable(fn):
        raise ConfigError(
            f"{where} must be a Loss or a function called as loss(predicted, target), got {type(fn).__name__}"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin that does not say: its own error speaks when it is called
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise ConfigError(
            f"{where} is {python_name(fn)}{signature}, which cannot be called as loss(predicted, target): a loss "
            "takes the predictions and the targets as two positional arguments"
        ) from None


class LossFunction(Loss, register=False):
    """A plain callable as a `Loss`: ``TrainingLoop(loss=my_loss)`` wraps ``my_loss`` in one (so does a
    `Composite` component), so every backend sees the `Loss` protocol of design seed 002.

    ``fn(predicted, target)`` returns a scalar or a ``(scalar, aux_metrics)`` pair, like any loss; it runs inside
    the backend's compiled JAX step (Equinox, Keras), so write it in `jax.numpy`. Two wrappers are equal when they
    wrap the same object: the same function reuses the compiled step of an earlier stage, another function
    compiles its own. A backend that does not run JAX refuses it before training (``lightning``: write a `Loss`
    subclass and give it a torch version). It has no YAML form: `pipekit.dumps` refuses it, naming the function;
    a record, and a resume's fingerprint, name it by `python_name` (its module and qualified name, not its code:
    as a `Loss` subclass is compared by its name and fields, not its ``__call__``).

    Example:
        >>> import jax.numpy as jnp
        >>> def l1(predicted, target):
        ...     return jnp.mean(jnp.abs(predicted - target))
        >>> loss = LossFunction(fn=l1)
        >>> loss
        LossFunction(pipekit_train.losses._function.l1)
        >>> float(loss(jnp.array([0.5, -3.0]), jnp.zeros(2)))
        1.75
    """

    fn: Callable[..., Any]

    def validate(self) -> None:
        _check_callable(self.fn, "LossFunction.fn")

    def __call__(self, predicted: Any, target: Any) -> Any:  # type: ignore[override]  # see Loss.__call__
        return self.fn(predicted, target)

    def __repr__(self) -> str:
        return f"LossFunction({python_name(self.fn)})"

    def python_only(self) -> tuple[str, str]:
        return (
            python_name(self.fn),
            "to name a loss in a pipeline file, write it as a Loss subclass (class MyLoss(Loss) with "
            "__call__(self, predicted, target)), which registers itself under its class name (docs/yaml.md)",
        )


def as_loss(value: Any, where: str = "loss") -> Any:
    """`value` as a `Loss`: a plain callable (a function, a ``functools.partial``, an object with ``__call__``) is
    wrapped in a `LossFunction`; a `Loss`, ``None`` and what is not callable come back as they are (the field's
    type check speaks for them). A class, another operator, or a callable that cannot take ``(predicted,
    target)`` is refused naming `where`.

    Example:
        >>> import jax.numpy as jnp
        >>> as_loss(jnp.dot, "TrainingLoop.loss")
        LossFunction(jax.numpy.dot)
        >>> from pipekit_train.losses import MSE
        >>> as_loss(MSE)
        Traceback (most recent call last):
        ...
        pipekit._errors.ConfigError: loss is the class MSE, not a loss: give MSE()
    """
    if value is None or isinstance(value, Loss) or not callable(value):
        return value
    if isinstance(value, Operator):
        return value  # another operator (a callback, a metric): the field's type check names it
    _check_callable(value, where)
    return LossFunction(fn=value)
