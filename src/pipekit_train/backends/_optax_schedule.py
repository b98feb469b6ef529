"""The learning rate: the schedule's numbers and formulas, and the run-time factor on them.

`scale_by_scheduled_lr`, the last verb of every chain, multiplies the updates by ``-(schedule(count) *
group_scale) * scale``: the schedule (constant, warmup_cosine, onecycle, exponential: optax's formulas, bitwise) with
its numbers in the state, and ``scale``, the run-time factor ReduceLROnPlateau changes (`get_lr_scale`,
`set_lr_scale`); `restart_schedule` counts the schedules from 0 again (a new schedule segment). `build_schedule` and
`learning_rate_at` give the same rates outside the step (a backend computing its own, the logged ``lr``).
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipekit import ConfigError, PipekitError

from ..optim._config import resolve_optimizer_config, schedule_numbers
from ._optax_numbers import Hyperparams, _hyper_init, _scalar

__all__ = [
    "LrScaleState",
    "build_schedule",
    "get_lr_scale",
    "learning_rate_at",
    "restart_schedule",
    "scale_by_scheduled_lr",
    "set_lr_scale",
]


# The learning-rate schedule ------------------------------------------------------------------------------
def _inverse(steps: int) -> np.float32:
    """``1 / steps`` rounded as XLA rounds it: with a constant divisor it multiplies by the float32 reciprocal."""
    return np.float32(1) / np.float32(max(int(steps), 1))


def _schedule_scalars(kind: str, numbers: Mapping[str, Any]) -> dict[str, np.generic]:
    """`schedule_numbers` as the program's scalars, with what optax's program computes from constants done here.

    XLA folds arithmetic on constants and turns ``x / constant`` into ``x * (1 / constant)``. With the numbers
    in the state the program cannot, so the folded values (reciprocals, ``1 - alpha``, onecycle's products) are
    computed here once, in the same float32 arithmetic, and the schedule multiplies where optax's divides: the
    rates are bitwise those of optax's schedules.
    """
    if kind == "onecycle":
        # optax.cosine_onecycle_schedule: cumprod in float32 of (lr / 25, 25, 1 / (25 * final_div)).
        start = np.float32(numbers["lr"] / 25.0)
        peak = np.float32(start * np.float32(25.0))
        end = np.float32(peak * np.float32(1.0 / (25.0 * numbers["final_div"])))
        peak_at, end_at = int(numbers["peak_at"]), int(numbers["end_at"])
        return {
            "start": start,
            "peak": peak,
            "end": end,
            "peak_at": np.int32(peak_at),
            "end_at": np.int32(end_at),
            "inv_rise": _inverse(peak_at),
            "inv_fall": _inverse(end_at - peak_at),
        }
    out = {k: _scalar(v) for k, v in numbers.items()}
    out["inv_warmup"] = _inverse(numbers["warmup"])
    if kind == "warmup_cosine":
        # optax: lr * ((1 - alpha) * 0.5 * (1 + cos(pi * t / length)) + alpha), which XLA folds to
        # lr * ((1 + cos(t * (pi / length))) * ((1 - alpha) * 0.5) + alpha).
        out["half_one_minus_alpha"] = np.float32(np.float32(1 - numbers["alpha"]) * np.float32(0.5))
        out["pi_over_length"] = np.float32(np.float32(np.pi) * _inverse(numbers["decay_steps"] - numbers["warmup"]))
    elif kind == "exponential":
        out["inv_decay_steps"] = _inverse(numbers["decay_steps"])
    return out


def _scheduled_lr(kind: str, h: Mapping[str, Any], count: Any) -> jax.Array:
    """The learning rate at loop step `count` of a schedule of `kind` with the numbers `h` (optax's formulas).

    The numbers may be arrays in the state, NumPy scalars or tracers; `kind` is the only Python branch.
    """
    if kind == "onecycle":

        def segment(lo: Any, inv: Any, a: Any, b: Any) -> jax.Array:
            pct = (count - lo) * inv
            return jnp.asarray(b + (a - b) / 2.0 * (jnp.cos(jnp.pi * pct) + 1))

        falling = jnp.where(count < h["end_at"], segment(h["peak_at"], h["inv_fall"], h["peak"], h["end"]), h["end"])
        return jnp.where(count < h["peak_at"], segment(0, h["inv_rise"], h["start"], h["peak"]), falling)
    lr, warmup = h["lr"], h["warmup"]
    after = count - warmup
    main: Any
    if kind == "warmup_cosine":
        length = h["decay_steps"] - warmup
        cosine = 1 + jnp.cos(jnp.minimum(after, length) * h["pi_over_length"])
        main = (cosine * h["half_one_minus_alpha"] + h["alpha"]) * lr
    elif kind == "exponential":
        rate, bound = h["decay_rate"], h["bound"]
        decayed = jnp.where(after <= 0, lr, lr * jnp.power(rate, after * h["inv_decay_steps"]))
        main = jnp.where(rate < 1, jnp.maximum(decayed, bound), jnp.minimum(decayed, bound))
    else:
        main = lr
    # optax.linear_schedule(0, lr, warmup) joined to the main schedule at `warmup` (join_schedules).
    rising = (0.0 - lr) * (1 - jnp.clip(count, 0, warmup) * h["inv_warmup"]) + lr
    return jnp.where(count < warmup, rising, main)


_scheduled_lr_jit = jax.jit(_scheduled_lr, static_argnums=0)


def build_schedule(config: Mapping[str, Any], *, max_steps: int) -> Callable[[Any], jax.Array]:
    """The learning-rate schedule of `config`, a function of the step (steps as the loop counts them).

    It takes an int, an array or a tracer (Keras' step variable, a `jax.vmap` over steps).
    """
    cfg = resolve_optimizer_config(config)
    scalars = _schedule_scalars(cfg["schedule"], schedule_numbers(cfg, _check_positive_int("max_steps", max_steps)))
    return functools.partial(_scheduled_lr, cfg["schedule"], scalars)


def learning_rate_at(config: Mapping[str, Any], step: int, max_steps: int) -> float:
    """The scheduled learning rate at loop step `step`, for logging (multiply by `get_lr_scale` for the effective one).

    The same float32 arithmetic as the compiled step's, in one compiled call per schedule kind.

    Example:
        >>> learning_rate_at({"lr": 1.0, "schedule": "warmup_cosine", "warmup_steps": 4}, 2, max_steps=100)
        0.5
    """
    return logged_schedule(config, max_steps)(step)


def logged_schedule(config: Mapping[str, Any], max_steps: int) -> Callable[[int], float]:
    """`learning_rate_at` of one configuration as a function of the step, the configuration resolved once
    (`LearningRateLog` keeps one per stage)."""
    cfg = resolve_optimizer_config(config)
    kind = cfg["schedule"]
    scalars = _schedule_scalars(kind, schedule_numbers(cfg, _check_positive_int("max_steps", max_steps)))
    # A constant rate past its warm-up is what the program returns there, bitwise: nothing to compile.
    constant = (int(scalars["warmup"]), float(scalars["lr"])) if kind == "constant" else None

    def at(step: int) -> float:
        if constant is not None and step >= constant[0]:
            return constant[1]
        return float(_scheduled_lr_jit(kind, scalars, np.int32(step)))

    return at


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"build_optimizer: {name} must be an int >= 1, got {value!r}")
    return value


# The run-time learning-rate scale ------------------------------------------------------------------------
class LrScaleState(NamedTuple):
    """State of `scale_by_scheduled_lr`: the step count, the run-time factor and the schedule's numbers."""

    # `count` shadows `tuple.count`, as in optax's own states; the field names are checkpoint keys: keep them.
    count: jax.Array  # type: ignore[assignment]
    scale: jax.Array
    hyper: Hyperparams


def scale_by_scheduled_lr(
    kind: str, numbers: Mapping[str, Any], *, accum: int = 1, group_scale: float = 1.0
) -> optax.GradientTransformation:
    """Multiply updates by ``-(schedule(count) * group_scale) * scale``; ``scale`` (1.0 at init) is changed with
    `set_lr_scale`.

    Args:
        kind: the schedule (constant, warmup_cosine, onecycle, exponential): structure.
        numbers: its numbers, as `pipekit_train.optim._config.schedule_numbers` gives them: values in the state.
        accum: inside `optax.MultiSteps` the count is the number of real updates; it is multiplied back to loop
            steps.
        group_scale: a parameter group's ``lr_scale`` (a value in the state).

    One transform, one multiply per leaf: the factors are folded into the learning rate before it meets the
    updates. A separate "multiply by scale" after the learning rate would add a second rounding step per element
    and change which product XLA contracts into a fused multiply-add with the parameter update, so results would
    drift from a plain optax optimizer in the last bit; folded, ``scale == 1`` gives exactly the numbers of
    ``optax.sgd`` / ``optax.adam`` (tests/test_loop.py checks bitwise).
    """
    hyper = _hyper_init({**_schedule_scalars(kind, numbers), "group_scale": group_scale})

    def init_fn(params: Any) -> LrScaleState:
        del params
        return LrScaleState(count=jnp.zeros((), jnp.int32), scale=jnp.ones((), jnp.float32), hyper=hyper())

    def update_fn(updates: Any, state: LrScaleState, params: Any = None) -> tuple[Any, LrScaleState]:
        del params
        h = state.hyper.values
        step = state.count if accum == 1 else state.count * accum
        step_size = -(_scheduled_lr(kind, h, step) * h["group_scale"]) * state.scale
        updates = jax.tree.map(lambda g: jnp.asarray(step_size, dtype=g.dtype) * g, updates)
        return updates, state._replace(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def _is_scale(node: Any) -> bool:
    return isinstance(node, LrScaleState)


def get_lr_scale(opt_state: Any) -> float:
    """The current run-time learning-rate factor in `opt_state` (inside `optax.MultiSteps` too)."""
    return float(np.asarray(jax.tree.leaves(opt_state)[lr_scale_position(opt_state)]))


def lr_scale_position(opt_state: Any) -> int:
    """Where the run-time learning-rate factor is among ``jax.tree.leaves(opt_state)`` (the first one, with
    parameter groups: they are set together)."""
    for position, node in enumerate(jax.tree.leaves(opt_state, is_leaf=_is_scale)):  # arrays, until the first scale
        if _is_scale(node):
            return position + len(jax.tree.leaves(node.count))
    raise PipekitError("opt_state holds no learning-rate scale; build the optimizer with build_optimizer")


class LearningRateLog:
    """The learning rate a backend that keeps its optimizer state as leaves logs: the scheduled rate at a step
    (`learning_rate_at`) times the run-time scale (`get_lr_scale`), with what does not change over a stage found
    once (the resolved configuration, the scale's place among the leaves): rebuilding the state's tree and resolving
    the configuration at every log record took ~0.3 ms.

    And the scale is read from the device only when the host put it there: the compiled step carries it unchanged
    (`scale_by_scheduled_lr`), so a backend tells `stepped` the leaves its step took and returned, and the value
    read before holds for the new leaf. Read from the step's output, it made the host wait for the chunk just
    dispatched at every log record (the device then idled while the host prepared and dispatched the next chunk);
    a leaf the host wrote (`set_lr_scale`, a restored checkpoint) is another array, which is read.
    """

    def __init__(self) -> None:
        self._schedule: tuple[Mapping[str, Any], int, Callable[[int], float]] | None = None
        self._scale_at: int | None = None
        self._known: tuple[Any, float] | None = None  # (the leaf holding the scale, its value)
        self._fetch: Callable[[Any], Any] | None = None  # the scale's leaf of a state tree (`stepped_trees`)

    def scale(self, leaves: Sequence[Any], treedef: Any) -> float:
        """`get_lr_scale` of the optimizer state whose leaves are `leaves` (of the tree structure `treedef`)."""
        if self._scale_at is None:
            self._scale_at = lr_scale_position(jax.tree.unflatten(treedef, leaves))
        leaf = leaves[self._scale_at]
        known = self._known
        if known is not None and known[0] is leaf:
            return known[1]
        value = float(np.asarray(leaf))
        self._known = (leaf, value)
        return value

    def stepped(self, before: Sequence[Any], after: Sequence[Any]) -> None:
        """The compiled step took the leaves `before` and returned `after`: the same scale, in a new leaf (known if
        it was known in `before`'s; a scale the host set since it was read is not)."""
        known, at = self._known, self._scale_at
        if known is not None and at is not None:
            self._known = (after[at], known[1]) if before[at] is known[0] else None

    def stepped_trees(self, before: Any, after: Any) -> None:
        """`stepped` given the optimizer states rather than their leaves (trees of the structure `scale` was given):
        only the leaf holding the scale is fetched from each, by its path in the tree, found once. For a backend
        whose state is not kept as leaves: flattening the whole state twice per compiled call to hand `stepped` its
        leaves cost ~10 µs a call at twenty leaves, a few percent of a small step on the one-step path."""
        known, at = self._known, self._scale_at
        if known is None or at is None:
            return  # nothing read yet, or a host write since: the next record reads the leaf
        if self._fetch is None:
            self._fetch = _leaf_fetcher(before, at)
        self._known = (self._fetch(after), known[1]) if self._fetch(before) is known[0] else None

    def rate(self, config: Mapping[str, Any], max_steps: int, step: int, leaves: Sequence[Any], treedef: Any) -> float:
        """The effective learning rate at schedule step `step` of a stage of `config` and `max_steps`."""
        kept = self._schedule
        if kept is None or kept[0] is not config or kept[1] != max_steps:
            kept = self._schedule = (config, max_steps, logged_schedule(config, max_steps))
        return kept[2](step) * self.scale(leaves, treedef)


def _leaf_fetcher(tree: Any, position: int) -> Callable[[Any], Any]:
    """A function giving ``jax.tree.leaves(t)[position]`` of a tree `t` of `tree`'s structure without flattening
    it: the item and attribute lookups of that leaf's path (a whole flatten where a node names no key)."""
    path = jax.tree_util.tree_flatten_with_path(tree)[0][position][0]
    steps: list[Callable[[Any], Any]] = []
    for key in path:
        if isinstance(key, jax.tree_util.SequenceKey):
            steps.append(operator.itemgetter(key.idx))
        elif isinstance(key, jax.tree_util.DictKey):
            steps.append(operator.itemgetter(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            steps.append(operator.attrgetter(key.name))
        else:  # a FlattenedIndexKey: the node's children have no names to look up
            return lambda t: jax.tree.leaves(t)[position]

    def fetch(t: Any) -> Any:
        for step in steps:
            t = step(t)
        return t

    return fetch


def set_lr_scale(opt_state: Any, value: float) -> Any:
    """A copy of `opt_state` with the run-time learning-rate factor set to `value` (same dtype and shape)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"set_lr_scale: value must be a finite float >= 0, got {value!r}")
    get_lr_scale(opt_state)  # raises when there is none
    # A new array per node: with parameter groups there are several, and the step donates each buffer once.
    return jax.tree.map(
        lambda n: n._replace(scale=jnp.asarray(value, jnp.float32)) if _is_scale(n) else n, opt_state, is_leaf=_is_scale
    )


def restart_schedule(opt_state: Any) -> Any:
    """A copy of `opt_state` whose learning-rate schedules count from 0 again (a new schedule segment: a stage
    extended with ``new_segment``); the moments, the other counters and the run-time factor stay."""
    get_lr_scale(opt_state)  # raises when there is none
    return jax.tree.map(
        lambda n: n._replace(count=jnp.zeros((), jnp.int32)) if _is_scale(n) else n, opt_state, is_leaf=_is_scale
    )
