"""`optimizer_config` → an optax optimizer whose numbers are values in its state (the JAX backends).

The recipe is a chain of optax-style verbs, in this order::

    clip_by_global_norm            (when grad_clip_norm)
    scale_by_adam / scale_by_lion / scale_by_rms / trace       (the optimizer's direction)
    add_decayed_weights            (masked: skips leaves with ndim <= 1 unless decay_biases)
    add_decayed_weights_toward_start   (L2-SP, per parameter group)
    scale_by_scheduled_lr          (the schedule times a run-time factor, for ReduceLROnPlateau)

wrapped in `optax.MultiSteps` when ``accum > 1``. The verbs do optax's arithmetic, but every number (learning
rate, schedule parameters and horizon, betas, eps, momentum, decay strengths, clip norm, unfreezing step) is read
from a `Hyperparams` node of the optimizer state instead of being a constant of the program. `build_optimizer`
returns a `StructuredOptimizer`: equal to (and hashed like) any other of the same structure, so a `jax.jit` step
that takes it as a static argument compiles once for a learning-rate sweep or a pretrain → finetune pair. Every
state leaf is an array, so the state checkpoints with Orbax's ``StandardSave``. ``design/optimizers.md`` has the
keys, what is a value and what is structure, and why.
"""

from __future__ import annotations

import fnmatch
import functools
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipekit import ConfigError, PipekitError

from ..optim._config import resolve_optimizer_config, schedule_numbers
from ..optim._recipes import param_path

if TYPE_CHECKING:
    from ..optim._recipes import ParamGroup

__all__ = [
    "FrozenUntilState",
    "Hyperparams",
    "L2SPState",
    "LrScaleState",
    "StructuredOptimizer",
    "add_decayed_weights",
    "add_decayed_weights_toward_start",
    "build_optimizer",
    "build_schedule",
    "clip_by_global_norm",
    "frozen_until",
    "get_lr_scale",
    "learning_rate_at",
    "refresh_hyperparams",
    "reset_anchor",
    "restart_schedule",
    "scale_by_adam",
    "scale_by_lion",
    "scale_by_rms",
    "scale_by_scheduled_lr",
    "set_lr_scale",
    "trace",
]


# Numbers as state ----------------------------------------------------------------------------------------
class Hyperparams(NamedTuple):
    """The numbers one verb reads at run time: float32 / int32 scalar arrays by name, part of the state.

    A new value is a new array of the same shape and dtype, so the compiled step that reads it is reused.
    """

    values: dict[str, jax.Array]


def _scalar(value: Any) -> np.generic:
    """`value` as the scalar the program sees: int32 for a step count, float32 (rounded once, from the Python
    double, as JAX rounds a Python constant) for the rest."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"a hyperparameter is a number, got {value!r}")
    if isinstance(value, (int, np.integer)):
        return np.int32(value)
    return np.float32(value)


def _hyper_init(numbers: Mapping[str, Any]) -> Callable[[], Hyperparams]:
    """``() -> Hyperparams``: fresh arrays on every call (the compiled step donates its state)."""
    frozen = {k: _scalar(v) for k, v in numbers.items()}
    # `device_put`, not `jnp.asarray`: the same array, without compiling a conversion program for float32 scalars.
    return lambda: Hyperparams({k: jax.device_put(v) for k, v in frozen.items()})


def _like(h: jax.Array, leaf: jax.Array) -> jax.Array:
    """A float hyperparameter in the dtype of the leaf it meets, as a weakly typed Python constant would be."""
    return h.astype(leaf.dtype)


def _is_hyper(node: Any) -> bool:
    return isinstance(node, Hyperparams)


def refresh_hyperparams(opt_state: Any, fresh: Any) -> Any:
    """`opt_state` with every `Hyperparams` node taken from `fresh` (``optimizer.init(params)``); the rest kept.

    A restored checkpoint carries the numbers it was written with; the configuration being run decides them (a
    resume under ``--force-resume`` with another learning rate trains with the new one, as it always has). The
    run-time factor (`set_lr_scale`), the counters, the moments and the L2-SP anchors stay as restored.
    """
    return jax.tree.map(lambda old, new: new if _is_hyper(old) else old, opt_state, fresh, is_leaf=_is_hyper)


# The direction -------------------------------------------------------------------------------------------
class ScaleByAdamState(NamedTuple):
    """State of `scale_by_adam`: optax's counter and moments, and the numbers."""

    count: jax.Array  # type: ignore[assignment]
    mu: Any
    nu: Any
    hyper: Hyperparams


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """`optax.scale_by_adam` with ``b1``, ``b2`` and ``eps`` in the state (bitwise the same numbers).

    ``1 - b1`` and ``1 - b2`` are rounded once from the Python doubles, as optax's constants are: computing them
    in float32 at run time would change the last bit of every moment.
    """
    hyper = _hyper_init({"b1": b1, "one_minus_b1": 1 - b1, "b2": b2, "one_minus_b2": 1 - b2, "eps": eps})

    def init_fn(params: Any) -> ScaleByAdamState:
        mu, nu = optax.tree.zeros_like(params), optax.tree.zeros_like(params)
        return ScaleByAdamState(jnp.zeros([], jnp.int32), mu, nu, hyper())

    def update_fn(updates: Any, state: ScaleByAdamState, params: Any = None) -> tuple[Any, ScaleByAdamState]:
        del params
        h = state.hyper.values
        mu = jax.tree.map(lambda g, t: _like(h["one_minus_b1"], g) * g + _like(h["b1"], t) * t, updates, state.mu)
        nu = jax.tree.map(lambda g, t: _like(h["one_minus_b2"], g) * g**2 + _like(h["b2"], t) * t, updates, state.nu)
        count = optax.safe_increment(state.count)
        mu_hat = optax.tree.bias_correction(mu, h["b1"], count)
        nu_hat = optax.tree.bias_correction(nu, h["b2"], count)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + 0.0) + _like(h["eps"], m)), mu_hat, nu_hat)
        return updates, ScaleByAdamState(count, mu, nu, state.hyper)

    return optax.GradientTransformation(init_fn, update_fn)


class ScaleByLionState(NamedTuple):
    """State of `scale_by_lion`: optax's counter and moment, and the numbers."""

    count: jax.Array  # type: ignore[assignment]
    mu: Any
    hyper: Hyperparams


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> optax.GradientTransformation:
    """`optax.scale_by_lion` with ``b1`` and ``b2`` in the state."""
    hyper = _hyper_init({"b1": b1, "one_minus_b1": 1.0 - b1, "b2": b2, "one_minus_b2": 1 - b2})

    def init_fn(params: Any) -> ScaleByLionState:
        return ScaleByLionState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params), hyper())

    def update_fn(updates: Any, state: ScaleByLionState, params: Any = None) -> tuple[Any, ScaleByLionState]:
        del params
        h = state.hyper.values
        new = jax.tree.map(
            lambda g, m: jnp.sign(_like(h["one_minus_b1"], g) * g + _like(h["b1"], m) * m), updates, state.mu
        )
        mu = jax.tree.map(lambda g, t: _like(h["one_minus_b2"], g) * g + _like(h["b2"], t) * t, updates, state.mu)
        return new, ScaleByLionState(optax.safe_increment(state.count), mu, state.hyper)

    return optax.GradientTransformation(init_fn, update_fn)


class ScaleByRmsState(NamedTuple):
    """State of `scale_by_rms`: optax's second moment, and the numbers."""

    nu: Any
    hyper: Hyperparams


def scale_by_rms(decay: float = 0.9, eps: float = 1e-8) -> optax.GradientTransformation:
    """`optax.scale_by_rms` (eps inside the square root, no bias correction) with ``decay`` and ``eps`` in the
    state."""
    hyper = _hyper_init({"decay": decay, "one_minus_decay": 1 - decay, "eps": eps})

    def init_fn(params: Any) -> ScaleByRmsState:
        return ScaleByRmsState(optax.tree.full_like(params, 0.0), hyper())

    def update_fn(updates: Any, state: ScaleByRmsState, params: Any = None) -> tuple[Any, ScaleByRmsState]:
        del params
        h = state.hyper.values
        nu = jax.tree.map(
            lambda g, t: _like(h["one_minus_decay"], g) * g**2 + _like(h["decay"], t) * t, updates, state.nu
        )
        updates = jax.tree.map(lambda n, g: jax.lax.rsqrt(n + _like(h["eps"], n)) * g, nu, updates)
        return updates, ScaleByRmsState(nu, state.hyper)

    return optax.GradientTransformation(init_fn, update_fn)


class TraceState(NamedTuple):
    """State of `trace`: optax's momentum buffer, and the numbers."""

    trace: Any
    hyper: Hyperparams


def trace(decay: float, nesterov: bool = False) -> optax.GradientTransformation:
    """`optax.trace` (momentum) with ``decay`` in the state; ``nesterov`` is structure."""
    hyper = _hyper_init({"decay": decay})

    def init_fn(params: Any) -> TraceState:
        return TraceState(optax.tree.zeros_like(params), hyper())

    def update_fn(updates: Any, state: TraceState, params: Any = None) -> tuple[Any, TraceState]:
        del params
        decay_ = state.hyper.values["decay"]

        def f(g: jax.Array, t: jax.Array) -> jax.Array:
            return g + _like(decay_, t) * t

        new_trace = jax.tree.map(f, updates, state.trace)
        updates = jax.tree.map(f, updates, new_trace) if nesterov else new_trace
        return updates, TraceState(new_trace, state.hyper)

    return optax.GradientTransformation(init_fn, update_fn)


# Decays and clipping -------------------------------------------------------------------------------------
def add_decayed_weights(weight_decay: float, mask: Any = None) -> optax.GradientTransformation:
    """`optax.add_decayed_weights` with the strength in the state (a `Hyperparams` is the whole state)."""
    hyper = _hyper_init({"weight_decay": weight_decay})

    def init_fn(params: Any) -> Hyperparams:
        del params
        return hyper()

    def update_fn(updates: Any, state: Hyperparams, params: Any = None) -> tuple[Any, Hyperparams]:
        if params is None:
            raise ValueError(optax.NO_PARAMS_MSG)
        s = state.values["weight_decay"]
        return jax.tree.map(lambda g, p: g + _like(s, p) * p, updates, params), state

    tx = optax.GradientTransformation(init_fn, update_fn)
    return optax.masked(tx, mask) if mask is not None else tx


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` with the norm in the state."""
    hyper = _hyper_init({"max_norm": max_norm})

    def init_fn(params: Any) -> Hyperparams:
        del params
        return hyper()

    def update_fn(updates: Any, state: Hyperparams, params: Any = None) -> tuple[Any, Hyperparams]:
        del params
        max_norm_ = state.values["max_norm"]
        g_norm = optax.tree.norm(updates)
        trigger = jnp.squeeze(g_norm < max_norm_)

        def clip(t: jax.Array) -> jax.Array:
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * _like(max_norm_, t))

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(init_fn, update_fn)


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
    cfg = resolve_optimizer_config(config)
    scalars = _schedule_scalars(cfg["schedule"], schedule_numbers(cfg, _check_positive_int("max_steps", max_steps)))
    if cfg["schedule"] == "constant" and step >= int(scalars["warmup"]):
        return float(scalars["lr"])  # what the program returns past the warm-up, bitwise; nothing to compile
    return float(_scheduled_lr_jit(cfg["schedule"], scalars, np.int32(step)))


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
    found = [n for n in jax.tree.leaves(opt_state, is_leaf=_is_scale) if _is_scale(n)]
    if not found:
        raise PipekitError("opt_state holds no learning-rate scale; build the optimizer with build_optimizer")
    return float(found[0].scale)


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


# The recipe ----------------------------------------------------------------------------------------------
class StructuredOptimizer(optax.GradientTransformationExtraArgs):  # type: ignore[misc]  # optax is untyped here
    """An optax optimizer compared and hashed by its `structure` alone, not by its numbers.

    Its ``update`` reads every number from the state, so two optimizers of one structure run the same program:
    as a `jax.jit` static argument (the Equinox step), the second compiles nothing. ``init`` puts this
    optimizer's numbers into the state. ``update`` is shared by every optimizer of the same structure.
    """

    structure: Hashable
    _hash: int

    def __new__(cls, init: Any, update: Any, structure: Hashable) -> StructuredOptimizer:
        self: StructuredOptimizer = super().__new__(cls, init, update)
        self.structure = structure
        self._hash = hash(structure)
        return self

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, StructuredOptimizer) and self.structure == other.structure)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __repr__(self) -> str:
        return f"StructuredOptimizer(structure={self.structure!r})"


# A pytree with no leaves whose node data is the optimizer itself: `eqx.filter_jit` (and any tree flattening) keeps
# it whole, compared by structure, instead of rebuilding the NamedTuple from its two functions.
jax.tree_util.register_pytree_node(StructuredOptimizer, lambda o: ((), o), lambda o, _: o)

#: The ``update`` of the first optimizer built for each structure: later ones share it.
_UPDATES: dict[Hashable, Any] = {}


def _decay_mask(params: Any) -> Any:
    """True for leaves that are decayed: matrices and kernels, not biases or norm scales (ndim <= 1)."""
    return jax.tree.map(lambda p: jnp.ndim(p) > 1, params)


def build_optimizer(
    config: Mapping[str, Any],
    *,
    max_steps: int,
    grad_clip_norm: float | None = None,
    accum: int = 1,
    groups: Sequence[ParamGroup] = (),
) -> StructuredOptimizer:
    """Build the optax optimizer an ``optimizer_config`` describes.

    Args:
        config: flat keys: ``name`` (adamw, adam, sgd, lion, rmsprop; default adamw), ``lr`` (1e-3),
            ``weight_decay``, ``b1``, ``b2``, ``eps``, ``momentum``, ``nesterov``, ``decay_biases``,
            ``schedule`` (constant, warmup_cosine, onecycle, exponential; default constant), ``warmup_steps``,
            ``decay_steps``, ``end_lr``, ``decay_rate``. A key that does not apply to the chosen optimizer or
            schedule is an error, as is an unknown one.
        max_steps: the run's length in loop steps (calls to `update`); the default schedule horizon.
        grad_clip_norm: clip the (accumulated) gradient to this global norm first.
        accum: accumulate the mean gradient over this many calls and update once (`optax.MultiSteps`); the
            schedule still counts loop steps, so ``warmup_steps`` means the same with or without it.
        groups: `ParamGroup`\\ s: parameters matching a group's pattern get their own chain (learning-rate scale,
            weight decay, L2-SP, freezing) through `optax.multi_transform`; the rest keep `config` as it is. The
            gradient is clipped (globally) before the split. A frozen group has no state.

    Returns:
        A `StructuredOptimizer` whose state is a pytree of arrays holding the numbers (`Hyperparams`) and an
        `LrScaleState`. Its structure is the optimizer's name, the schedule kind, which verbs are present
        (momentum, nesterov, weight decay and its mask, clipping, L2-SP, freezing), ``accum`` and the groups'
        patterns; every number is a value.

    Example:
        >>> import jax.numpy as jnp
        >>> opt = build_optimizer({"name": "sgd", "lr": 0.5}, max_steps=10)
        >>> params = {"w": jnp.ones(2)}
        >>> updates, state = opt.update({"w": jnp.ones(2)}, opt.init(params), params)
        >>> updates["w"].tolist()
        [-0.5, -0.5]
        >>> opt == build_optimizer({"name": "sgd", "lr": 0.1}, max_steps=500)  # another value, same program
        True
    """
    cfg = resolve_optimizer_config(config)
    max_steps = _check_positive_int("max_steps", max_steps)
    accum = _check_positive_int("accum", accum)
    if grad_clip_norm is not None and (
        isinstance(grad_clip_norm, bool)
        or not isinstance(grad_clip_norm, (int, float))
        or not (math.isfinite(grad_clip_norm) and grad_clip_norm > 0)
    ):
        raise ConfigError(f"build_optimizer: grad_clip_norm must be a float > 0 or None, got {grad_clip_norm!r}")
    numbers = schedule_numbers(cfg, max_steps)
    base_decay = cfg.get("weight_decay") or 0.0

    def verbs(decay: float, l2sp: float, group_scale: float) -> list[optax.GradientTransformation]:
        lr = scale_by_scheduled_lr(cfg["schedule"], numbers, accum=accum, group_scale=group_scale)
        return [*_direction(cfg, decay, l2sp), lr]

    parts: list[optax.GradientTransformation] = []
    if grad_clip_norm is not None:
        parts.append(clip_by_global_norm(float(grad_clip_norm)))
    group_structure: list[tuple[Any, ...]] = []
    if not groups:
        parts.extend(verbs(base_decay, 0.0, 1.0))
    else:
        transforms: dict[str, optax.GradientTransformation] = {"rest": optax.chain(*verbs(base_decay, 0.0, 1.0))}
        for i, group in enumerate(groups):
            if group.frozen and group.unfreeze_at is None:
                transforms[f"g{i}"] = optax.set_to_zero()
                group_structure.append((group.pattern, "frozen"))
                continue
            decay = base_decay if group.weight_decay is None else group.weight_decay
            tx = optax.chain(*verbs(decay, group.l2sp, group.lr_scale))
            if group.unfreeze_at is not None:
                tx = frozen_until(tx, group.unfreeze_at, accum)
            transforms[f"g{i}"] = tx
            mode = "train" if group.unfreeze_at is None else "unfreeze"
            group_structure.append((group.pattern, mode, decay > 0, group.l2sp > 0))
        parts.append(optax.multi_transform(transforms, _labeller(tuple(g.pattern for g in groups))))
    optimizer: optax.GradientTransformation = optax.chain(*parts)
    if accum > 1:
        optimizer = optax.MultiSteps(optimizer, every_k_schedule=accum).gradient_transformation()
    structure = (
        "pipekit_train.backends._optax/1",
        cfg["name"],
        cfg["schedule"],
        bool(cfg.get("momentum")),
        bool(cfg.get("nesterov")),
        base_decay > 0,
        bool(cfg.get("decay_biases")),
        grad_clip_norm is not None,
        accum,
        tuple(group_structure),
    )
    update = _UPDATES.setdefault(structure, optimizer.update)
    return StructuredOptimizer(optimizer.init, update, structure)


def _direction(cfg: dict[str, Any], weight_decay: float, l2sp: float) -> list[optax.GradientTransformation]:
    """The optimizer's direction and its decoupled weight decays, as a list of verbs."""
    parts: list[optax.GradientTransformation] = []
    name = cfg["name"]
    if name in ("adam", "adamw"):
        parts.append(scale_by_adam(cfg["b1"], cfg["b2"], cfg["eps"]))
    elif name == "lion":
        parts.append(scale_by_lion(cfg["b1"], cfg["b2"]))
    elif name == "rmsprop":
        parts.append(scale_by_rms(decay=cfg["b2"], eps=cfg["eps"]))
    if cfg.get("momentum"):
        parts.append(trace(decay=cfg["momentum"], nesterov=cfg["nesterov"]))
    if weight_decay:
        parts.append(add_decayed_weights(weight_decay, mask=None if cfg.get("decay_biases") else _decay_mask))
    if l2sp:
        parts.append(add_decayed_weights_toward_start(l2sp))
    return parts


def _labeller(patterns: tuple[str, ...]) -> Any:
    """``params -> labels``: ``g<i>`` for the first pattern matching a leaf's dotted path, else ``rest``."""

    def label(path: Any) -> str:
        name = param_path(path)
        return next((f"g{i}" for i, p in enumerate(patterns) if fnmatch.fnmatchcase(name, p)), "rest")

    return lambda tree: jax.tree_util.tree_map_with_path(lambda path, _: label(path), tree)


# L2-SP and gradual unfreezing ------------------------------------------------------------------------------
class L2SPState(NamedTuple):
    """State of `add_decayed_weights_toward_start`: the weights the stage started from, and the strength."""

    anchor: Any
    hyper: Hyperparams


def add_decayed_weights_toward_start(strength: float) -> optax.GradientTransformation:
    """Add ``strength * (params - anchor)`` to the updates; the anchor is the parameters `init` saw (L2-SP).

    Decoupled like `optax.add_decayed_weights` (put it before the learning rate), but toward the starting weights
    (a pretrained encoder) instead of toward zero. The anchor is part of the state, so it checkpoints and resumes
    with it; `reset_anchor` moves it (a warm start from `init_from`).
    """
    hyper = _hyper_init({"strength": strength})

    def init_fn(params: Any) -> L2SPState:
        # A copy: the compiled step donates parameters and optimizer state, and one buffer cannot be donated twice.
        return L2SPState(anchor=jax.tree.map(lambda p: jnp.array(p, copy=True), params), hyper=hyper())

    def update_fn(updates: Any, state: L2SPState, params: Any = None) -> tuple[Any, L2SPState]:
        if params is None:
            raise ValueError(
                "add_decayed_weights_toward_start needs the parameters: call update(updates, state, params)"
            )
        s = state.hyper.values["strength"]
        updates = jax.tree.map(lambda u, p, a: u + _like(s, p) * (p - a), updates, params, state.anchor)
        return updates, state

    return optax.GradientTransformation(init_fn, update_fn)


def _is_l2sp(node: Any) -> bool:
    return isinstance(node, L2SPState)


def reset_anchor(opt_state: Any, fresh: Any) -> Any:
    """`opt_state` with every L2-SP anchor taken from `fresh` (``optimizer.init(new_params)``); the rest kept."""
    return jax.tree.map(
        lambda old, new: old._replace(anchor=new.anchor) if _is_l2sp(old) else old, opt_state, fresh, is_leaf=_is_l2sp
    )


class FrozenUntilState(NamedTuple):
    """State of `frozen_until`: the calls seen, the inner transform's state and the unfreezing step."""

    # `count` shadows `tuple.count`, as in optax's own states.
    count: jax.Array  # type: ignore[assignment]
    inner: Any
    hyper: Hyperparams


def frozen_until(inner: optax.GradientTransformation, step: int, accum: int = 1) -> optax.GradientTransformation:
    """Zero updates, with `inner`'s state left as it is, until `step` loop steps have passed; then `inner`.

    A mask computed from a counter in the state: the compiled step is the same before and after the boundary,
    and for any `step` (a value in the state). `inner`'s own counters (Adam's bias correction, the schedule)
    start at the unfreezing step.
    """
    hyper = _hyper_init({"until": int(step)})

    def init_fn(params: Any) -> FrozenUntilState:
        return FrozenUntilState(count=jnp.zeros((), jnp.int32), inner=inner.init(params), hyper=hyper())

    def update_fn(updates: Any, state: FrozenUntilState, params: Any = None) -> tuple[Any, FrozenUntilState]:
        active = state.count * accum >= state.hyper.values["until"]
        new_updates, new_inner = inner.update(updates, state.inner, params)
        updates = jax.tree.map(lambda u: jnp.where(active, u, jnp.zeros_like(u)), new_updates)
        kept = jax.tree.map(lambda n, o: jnp.where(active, n, o), new_inner, state.inner)
        return updates, FrozenUntilState(count=optax.safe_increment(state.count), inner=kept, hyper=state.hyper)

    return optax.GradientTransformation(init_fn, update_fn)
