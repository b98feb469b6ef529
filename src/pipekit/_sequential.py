"""`Sequential`: run stages one after another, threading the carrier and the carry-state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._errors import ConfigError
from ._operator import Operator, StatefulOperator


class Sequential(StatefulOperator):
    """Apply `stages` in order. Itself an operator, so a `Sequential` can be a stage of another.

    Each stage receives the carrier the previous stage returned. Stateful stages also thread one
    carry-state: a stage receives the state its predecessor returned (this is how the model trained by a
    pretraining `TrainingLoop` reaches the finetuning one). Plain operators pass the state through untouched.

    Args:
        stages: The operators to apply, in order (at least one); a stage may itself be a `Sequential`.

    Example:
        >>> import pipekit
        >>> class Add(pipekit.Operator):
        ...     amount: int = 1
        ...     def __call__(self, x):
        ...         return x + self.amount
        >>> pipe = pipekit.Sequential(stages=(Add(amount=2), pipekit.Sequential(stages=(Add(),))))
        >>> pipe(10)
        13
    """

    stages: tuple[Operator, ...] = ()

    if TYPE_CHECKING:  # what type checkers see: the stages positionally or by keyword, as a list or a tuple

        def __init__(self, stages: Sequence[Operator] = ()) -> None: ...

    def validate(self) -> None:
        if not self.stages:
            raise ConfigError("Sequential.stages must hold at least one operator, got ()")

    def _apply(self, carrier: Any, state: Any) -> tuple[Any, Any]:
        for stage in self.stages:
            if isinstance(stage, StatefulOperator):
                carrier, state = stage._apply(carrier, state)
            else:
                carrier = stage(carrier)
        return carrier, state

    def initial_state(self) -> Any:
        first = next((s for s in self.stages if isinstance(s, StatefulOperator)), None)
        return first.initial_state() if first is not None else None

    @classmethod
    def example(cls) -> Sequential:
        from ._builtins import AssertShape, Tap

        return cls(stages=(Tap(sink="print"), Sequential(stages=(AssertShape(shapes={"x": (None, 3)}),))))


_generated_init = Sequential.__init__


def _init(self: Sequential, stages: Any = (), **kwargs: Any) -> None:
    """Build from a list of stages, positionally as in ``Sequential([pretrain, finetune])`` or by keyword."""
    _generated_init(self, stages=stages, **kwargs)


Sequential.__init__ = _init  # type: ignore[method-assign,assignment]
