"""Schedules for any value: a number that follows the optimizer step (`Schedule`, `Linear`, `Cosine`, ...).

A schedule is a frozen operator, so a YAML file declares one wherever a field accepts it
(``weight: {type: Linear, start: 0.0, end: 1.0, steps: 1000}``). Its value is a pure function of the step: inside
the compiled train step the step is a traced ``int32`` and the value is computed there, so it is exact on resume
and the step compiles once whatever the step is. The train step sets a `step_context` around the loss (and the EMA
update); `schedule_value` reads it and records the schedule, and the step returns every recorded value as a metric
``schedule/<name>``, logged with the loss at no extra host transfer. Outside a step (validation, test, calling a
loss yourself) a schedule takes its `final` value, so ``validate/loss`` measures the objective the schedule leads
to and stays comparable across the run. ``docs/recipes.md`` has the forms and when to use them.

The step counts optimizer steps taken before the current one (0 for the first step): the same count optax's
schedules receive. A train record at ``step: t`` averages the values of steps ``t - log_every_n_steps`` to
``t - 1``.

This module imports neither JAX nor NumPy until a schedule is evaluated.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

from pipekit import ConfigError, Operator

__all__ = [
    "Constant",
    "Cosine",
    "Exponential",
    "Linear",
    "Piecewise",
    "Schedule",
    "StepContext",
    "current_step",
    "fixed_value",
    "schedule_value",
    "schedules_in",
    "step_context",
]


def _is_host(step: Any) -> bool:
    """Whether `step` is a plain Python or NumPy integer (evaluated on the host) rather than a JAX value."""
    if isinstance(step, bool):
        return False
    if isinstance(step, int):
        return True
    return type(step).__module__ == "numpy" and getattr(step, "shape", None) == ()


def _finite(owner: str, name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"{owner}.{name} must be a finite float, got {value!r}")


class Schedule(Operator, register=False):
    """Base of schedules: ``schedule(step)`` is the value at `step` (optimizer steps taken so far).

    Subclass it, declare the configuration as fields and implement `at` with array operations from the module
    `xp` it receives (`jax.numpy` inside the compiled step, `numpy` on the host), plus `bounds` and `final`.
    Defining the subclass registers it under its class name, like every operator.

    Example:
        >>> s = Linear(start=0.0, end=1.0, steps=10)
        >>> s(0), s(5), s(10), s(100)
        (0.0, 0.5, 1.0, 1.0)
        >>> s.final(), s.bounds()
        (1.0, (0.0, 1.0))
    """

    @abc.abstractmethod
    def at(self, step: Any, xp: Any) -> Any:
        """The value at `step` (an integer array or scalar) computed with the array module `xp`."""

    @abc.abstractmethod
    def bounds(self) -> tuple[float, float]:
        """``(lowest, highest)`` value the schedule takes at any step: what a field's range check tests."""

    @abc.abstractmethod
    def final(self) -> float:
        """The value once the schedule has ended (what validation and test use)."""

    def __call__(self, step: Any) -> Any:  # type: ignore[override]  # a schedule maps a step, not a carrier
        """The value at `step`: a Python float for an integer step, a float32 JAX scalar for a JAX one."""
        if _is_host(step):
            import numpy as np

            return float(self.at(np.float64(step), np))
        import jax.numpy as jnp

        return jnp.asarray(self.at(jnp.asarray(step).astype(jnp.float32), jnp), jnp.float32)


class _Ramp(Schedule, register=False):
    """From `start` at step `begin` to `end` at step ``begin + steps``, constant before and after.

    Args:
        start: The value at step `begin` and before.
        end: The value at step ``begin + steps`` and after.
        steps: The length of the ramp, in steps (>= 1).
        begin: The step the ramp starts at (>= 0).
    """

    start: float
    end: float
    steps: int
    begin: int = 0

    def validate(self) -> None:
        owner = type(self).__name__
        _finite(owner, "start", self.start)
        _finite(owner, "end", self.end)
        if self.steps < 1:
            raise ConfigError(f"{owner}.steps must be an int >= 1 (the length of the ramp), got {self.steps}")
        if self.begin < 0:
            raise ConfigError(f"{owner}.begin must be an int >= 0 (the step the ramp starts at), got {self.begin}")

    def fraction(self, step: Any, xp: Any) -> Any:
        """How far along the ramp `step` is, in ``[0, 1]``."""
        return xp.clip((step - self.begin) / self.steps, 0.0, 1.0)

    def bounds(self) -> tuple[float, float]:
        return (min(self.start, self.end), max(self.start, self.end))

    def final(self) -> float:
        return self.end


class Linear(_Ramp):
    """A straight line from `start` (at step `begin`) to `end` (at ``begin + steps``), then `end`.

    KL annealing: ``{type: Linear, start: 0.0, end: 1.0, steps: 1000}``.

    Args:
        start: The value up to step `begin`.
        end: The value from step ``begin + steps`` on.
        steps: The length of the ramp (>= 1).
        begin: The step the ramp starts at (>= 0).

    Example:
        >>> Linear(start=1.0, end=0.0, steps=4, begin=2)(4)
        0.5
    """

    @classmethod
    def example(cls) -> Linear:
        return cls(start=0.0, end=1.0, steps=1000)

    def at(self, step: Any, xp: Any) -> Any:
        return self.start + (self.end - self.start) * self.fraction(step, xp)


class Cosine(_Ramp):
    """Half a cosine from `start` to `end` over `steps` steps after `begin`: flat at both ends.

    Example:
        >>> Cosine(start=0.9, end=0.999, steps=100)(50)
        0.9495
    """

    @classmethod
    def example(cls) -> Cosine:
        return cls(start=0.9, end=0.999, steps=1000)

    def at(self, step: Any, xp: Any) -> Any:
        return self.end + (self.start - self.end) * 0.5 * (1.0 + xp.cos(math.pi * self.fraction(step, xp)))


class Exponential(_Ramp):
    """A geometric ramp: ``start * (end / start) ** fraction``; both must be > 0. Suits noise levels and rates.

    Example:
        >>> round(Exponential(start=1.0, end=0.01, steps=100)(50), 6)
        0.1
    """

    @classmethod
    def example(cls) -> Exponential:
        return cls(start=0.5, end=0.05, steps=1000)

    def validate(self) -> None:
        super().validate()
        if self.start <= 0 or self.end <= 0:
            raise ConfigError(
                f"Exponential.start and end must both be > 0 (a geometric ramp), got start={self.start}, "
                f"end={self.end}; use Linear to reach 0"
            )

    def at(self, step: Any, xp: Any) -> Any:
        return self.start * (self.end / self.start) ** self.fraction(step, xp)


class Piecewise(Schedule):
    """Constant pieces: ``values[i]`` from step ``boundaries[i - 1]`` until step ``boundaries[i]``.

    KL off for 500 steps, then on: ``{type: Piecewise, values: [0.0, 1.0], boundaries: [500]}``.

    Args:
        values: One more value than boundaries.
        boundaries: Strictly increasing steps (>= 1) at which the next value starts.

    Example:
        >>> p = Piecewise(values=(0.0, 0.5, 1.0), boundaries=(10, 20))
        >>> p(9), p(10), p(25)
        (0.0, 0.5, 1.0)
    """

    values: tuple[float, ...]
    boundaries: tuple[int, ...]

    @classmethod
    def example(cls) -> Piecewise:
        return cls(values=(0.0, 1.0), boundaries=(500,))

    def validate(self) -> None:
        if len(self.values) != len(self.boundaries) + 1:
            raise ConfigError(
                f"Piecewise.values must hold one more value than boundaries ({len(self.boundaries)} boundaries), "
                f"got {len(self.values)} values: {list(self.values)}"
            )
        for i, v in enumerate(self.values):
            _finite("Piecewise", f"values[{i}]", v)
        previous = 0
        for i, b in enumerate(self.boundaries):
            if b <= previous:
                raise ConfigError(
                    f"Piecewise.boundaries must be strictly increasing steps >= 1, got {list(self.boundaries)} "
                    f"(boundaries[{i}] = {b})"
                )
            previous = b

    def at(self, step: Any, xp: Any) -> Any:
        index = xp.searchsorted(xp.asarray(self.boundaries, dtype=xp.float32), step, side="right")
        return xp.asarray(self.values, dtype=xp.float32)[index]

    def bounds(self) -> tuple[float, float]:
        return (min(self.values), max(self.values))

    def final(self) -> float:
        return self.values[-1]


class Constant(Schedule):
    """The same value at every step (a placeholder that keeps a field's form while you tune the others).

    Args:
        value: The value at every step.

    Example:
        >>> Constant(value=0.5)(123)
        0.5
    """

    value: float

    @classmethod
    def example(cls) -> Constant:
        return cls(value=1.0)

    def validate(self) -> None:
        _finite("Constant", "value", self.value)

    def at(self, step: Any, xp: Any) -> Any:
        return xp.zeros_like(step) + self.value

    def bounds(self) -> tuple[float, float]:
        return (self.value, self.value)

    def final(self) -> float:
        return self.value


# The step context --------------------------------------------------------------------------------------------
class StepContext:
    """What the compiled train step exposes while it is being traced: the step and the schedules read so far.

    Attributes:
        step: The optimizer steps taken before this one, a traced ``int32`` scalar.
        used: ``{name: schedule}`` of every `schedule_value` call made inside the context.
    """

    def __init__(self, step: Any) -> None:
        self.step = step
        self.used: dict[str, Schedule] = {}

    def record(self, name: str, schedule: Schedule) -> None:
        """Remember that `schedule` was read as `name` (two different schedules under one name are an error)."""
        old = self.used.get(name)
        if old is not None and old != schedule:
            raise ConfigError(
                f"two different schedules are logged as 'schedule/{name}' ({old!r} and {schedule!r}); "
                "give them distinct names"
            )
        self.used[name] = schedule

    def metrics(self) -> dict[str, Any]:
        """``{"schedule/<name>": value at this step}`` for every schedule read, computed from the step alone.

        Evaluated here rather than where the schedule was read: a read inside `jax.grad` happens in an inner
        trace, and its value must not leave it.
        """
        return {f"schedule/{name}": schedule(self.step) for name, schedule in sorted(self.used.items())}


_CONTEXT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("pipekit_train_step", default=None)


@contextlib.contextmanager
def step_context(step: Any) -> Iterator[StepContext]:
    """Expose `step` to `current_step` and `schedule_value` while the block runs (the train step uses it).

    Example:
        >>> with step_context(3) as ctx:
        ...     schedule_value(Linear(start=0.0, end=1.0, steps=4), "w")
        0.75
        >>> ctx.metrics()
        {'schedule/w': 0.75}
    """
    ctx = StepContext(step)
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def current_step() -> Any:
    """The step of the train step being traced (a traced ``int32``), or ``None`` outside one.

    A custom `Loss` reads it to follow the step in its own way; `schedule_value` is the usual road.
    """
    ctx = _CONTEXT.get()
    return None if ctx is None else ctx.step


def schedule_value(value: Any, name: str) -> Any:
    """`value` as it stands now: a plain number as it is, a `Schedule` at the current step.

    Inside the train step the schedule is evaluated at the traced step and logged as ``schedule/<name>``;
    outside one it takes its `final` value. Use it in a custom loss for any field declared as
    ``float | Schedule``.

    Example:
        >>> schedule_value(0.3, "w"), schedule_value(Linear(start=0.0, end=2.0, steps=10), "w")
        (0.3, 2.0)
    """
    if not isinstance(value, Schedule):
        return value
    ctx = _CONTEXT.get()
    if ctx is None:
        return value.final()
    ctx.record(name, value)
    return value(ctx.step)


def fixed_value(value: float | Schedule, where: str) -> float:
    """`value` as a float, for code that cannot follow a schedule (a backend without ``schedules`` in its
    ``capabilities``; pre-flight refuses schedules there first, so this is a second line of defence).

    Example:
        >>> fixed_value(0.5, "EMA.decay")
        0.5
    """
    if isinstance(value, Schedule):
        raise ConfigError(f"{where} is {value!r}, a schedule, where only a fixed value is supported")
    return float(value)


def schedules_in(value: Any, path: str = "") -> list[tuple[str, Schedule]]:
    """Every `Schedule` inside `value` (an operator, list, tuple or mapping), with the field path leading to it.

    Example:
        >>> from pipekit_train.losses import MSE, Composite
        >>> schedules_in(Composite(components=((1.0, MSE()), (Linear(start=0.0, end=1.0, steps=5), MSE()))))
        [('components[1][0]', Linear(start=0.0, end=1.0, steps=5))]
    """
    import dataclasses

    if isinstance(value, Schedule):
        return [(path, value)]
    out: list[tuple[str, Schedule]] = []
    if isinstance(value, Operator):
        for f in dataclasses.fields(value):  # type: ignore[arg-type]
            out += schedules_in(getattr(value, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            out += schedules_in(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, item in value.items():
            out += schedules_in(item, f"{path}.{k}" if path else str(k))
    return out
