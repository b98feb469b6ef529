"""`optimizer_config` → an `optax.GradientTransformation`, plus a run-time learning-rate scale (the JAX backends).

The recipe is a chain of optax verbs, in this order::

    clip_by_global_norm            (when grad_clip_norm)
    scale_by_adam / scale_by_lion / scale_by_rms / trace       (the optimizer's direction)
    add_decayed_weights            (masked: skips leaves with ndim <= 1 unless decay_biases)
    scale_by_scheduled_lr          (the schedule times a run-time factor, for ReduceLROnPlateau)

wrapped in `optax.MultiSteps` when ``accum > 1``. Every state leaf is an array, so the state checkpoints with
Orbax's ``StandardSave``. See ``design/optimizers.md`` for the keys and why.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from pipekit import ConfigError, PipekitError

from .._optim import check_schedule, resolve_optimizer_config
from .._recipes import param_path

if TYPE_CHECKING:
    from .._recipes import ParamGroup

__all__ = [
    "FrozenUntilState",
    "L2SPState",
    "LrScaleState",
    "add_decayed_weights_toward_start",
    "build_optimizer",
    "build_schedule",
    "frozen_until",
    "get_lr_scale",
    "learning_rate_at",
    "reset_anchor",
    "scale_by_scheduled_lr",
    "set_lr_scale",
]


def _schedule(cfg: dict[str, Any], max_steps: int) -> optax.Schedule:
    lr, kind = cfg["lr"], cfg["schedule"]
    decay_steps, warmup = check_schedule(cfg, max_steps)
    if kind == "onecycle":
        assert warmup is not None
        final_div = 1e4 if cfg["end_lr"] is None else (lr / 25.0) / cfg["end_lr"]
        return optax.cosine_onecycle_schedule(
            decay_steps, lr, pct_start=warmup / decay_steps, final_div_factor=final_div
        )
    if kind == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, decay_steps, end_value=cfg["end_lr"])
    if kind == "exponential":
        main = optax.exponential_decay(lr, decay_steps, cfg["decay_rate"], end_value=cfg["end_lr"])
    else:
        main = optax.constant_schedule(lr)
    if not warmup:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), main], [warmup])


def build_schedule(config: Mapping[str, Any], *, max_steps: int) -> optax.Schedule:
    """The learning-rate schedule of `config`, a function of the step (steps as the loop counts them)."""
    return _schedule(resolve_optimizer_config(config), _check_positive_int("max_steps", max_steps))


def learning_rate_at(config: Mapping[str, Any], step: int, max_steps: int) -> float:
    """The scheduled learning rate at loop step `step`, for logging (multiply by `get_lr_scale` for the effective one).

    Example:
        >>> learning_rate_at({"lr": 1.0, "schedule": "warmup_cosine", "warmup_steps": 4}, 2, max_steps=100)
        0.5
    """
    return float(build_schedule(config, max_steps=max_steps)(step))


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"build_optimizer: {name} must be an int >= 1, got {value!r}")
    return value


# The run-time learning-rate scale ------------------------------------------------------------------------
class LrScaleState(NamedTuple):
    """State of `scale_by_scheduled_lr`: the step count and the run-time factor (float32 scalars)."""

    # `count` shadows `tuple.count`, as in optax's own states; the field names are checkpoint keys: keep them.
    count: jax.Array  # type: ignore[assignment]
    scale: jax.Array


def scale_by_scheduled_lr(schedule: optax.ScalarOrSchedule) -> optax.GradientTransformation:
    """Multiply updates by ``-schedule(count) * scale``; ``scale`` (1.0 at init) is changed with `set_lr_scale`.

    One transform, one multiply per leaf: the factor is folded into the learning rate before it meets the
    updates. A separate "multiply by scale" after optax's learning-rate scaling would add a second rounding
    step per element and change which product XLA contracts into a fused multiply-add with the parameter
    update, so results would drift from a plain optax optimizer in the last bit; folded, ``scale == 1`` gives
    exactly the numbers of ``optax.sgd`` / ``optax.adam`` (tests/test_loop.py checks bitwise).
    """
    schedule_fn = schedule if callable(schedule) else (lambda count: schedule)

    def init_fn(params: Any) -> LrScaleState:
        del params
        return LrScaleState(count=jnp.zeros((), jnp.int32), scale=jnp.ones((), jnp.float32))

    def update_fn(updates: Any, state: LrScaleState, params: Any = None) -> tuple[Any, LrScaleState]:
        del params
        step_size = -schedule_fn(state.count) * state.scale
        updates = jax.tree.map(lambda g: jnp.asarray(step_size, dtype=g.dtype) * g, updates)
        return updates, LrScaleState(count=optax.safe_increment(state.count), scale=state.scale)

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
    scale = jnp.asarray(value, jnp.float32)
    return jax.tree.map(lambda n: n._replace(scale=scale) if _is_scale(n) else n, opt_state, is_leaf=_is_scale)


# The recipe ----------------------------------------------------------------------------------------------
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
) -> optax.GradientTransformation:
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
        An `optax.GradientTransformation` whose state is a pytree of arrays and holds an `LrScaleState`.

    Example:
        >>> import jax.numpy as jnp
        >>> opt = build_optimizer({"name": "sgd", "lr": 0.5}, max_steps=10)
        >>> params = {"w": jnp.ones(2)}
        >>> updates, state = opt.update({"w": jnp.ones(2)}, opt.init(params), params)
        >>> updates["w"].tolist()
        [-0.5, -0.5]
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
    schedule = _schedule(cfg, max_steps)
    # Inside MultiSteps the schedule's count is the number of real updates; convert it back to loop steps.
    lr = schedule if accum == 1 else (lambda count: schedule(count * accum))

    parts: list[optax.GradientTransformation] = []
    if grad_clip_norm is not None:
        parts.append(optax.clip_by_global_norm(float(grad_clip_norm)))
    if not groups:
        parts.extend(_direction(cfg, cfg.get("weight_decay"), 0.0, lr))
    else:
        transforms: dict[str, optax.GradientTransformation] = {
            "rest": optax.chain(*_direction(cfg, cfg.get("weight_decay"), 0.0, lr))
        }
        for i, group in enumerate(groups):
            if group.frozen and group.unfreeze_at is None:
                transforms[f"g{i}"] = optax.set_to_zero()
                continue
            scaled = lr if group.lr_scale == 1.0 else _scaled(lr, group.lr_scale)
            decay = cfg.get("weight_decay") if group.weight_decay is None else group.weight_decay
            tx = optax.chain(*_direction(cfg, decay, group.l2sp, scaled))
            if group.unfreeze_at is not None:
                tx = frozen_until(tx, group.unfreeze_at, accum)
            transforms[f"g{i}"] = tx
        parts.append(optax.multi_transform(transforms, _labeller(tuple(g.pattern for g in groups))))
    optimizer = optax.chain(*parts)
    if accum > 1:
        optimizer = optax.MultiSteps(optimizer, every_k_schedule=accum).gradient_transformation()
    return optimizer


def _direction(
    cfg: dict[str, Any], weight_decay: float | None, l2sp: float, lr: optax.ScalarOrSchedule
) -> list[optax.GradientTransformation]:
    """The optimizer's direction, its weight decays and the scheduled learning rate, as a list of optax verbs."""
    parts: list[optax.GradientTransformation] = []
    name = cfg["name"]
    if name in ("adam", "adamw"):
        parts.append(optax.scale_by_adam(cfg["b1"], cfg["b2"], cfg["eps"]))
    elif name == "lion":
        parts.append(optax.scale_by_lion(cfg["b1"], cfg["b2"]))
    elif name == "rmsprop":
        parts.append(optax.scale_by_rms(decay=cfg["b2"], eps=cfg["eps"]))
    if cfg.get("momentum"):
        parts.append(optax.trace(decay=cfg["momentum"], nesterov=cfg["nesterov"]))
    if weight_decay:
        mask = None if cfg.get("decay_biases", False) else _decay_mask
        parts.append(optax.add_decayed_weights(weight_decay, mask=mask))
    if l2sp:
        parts.append(add_decayed_weights_toward_start(l2sp))
    parts.append(scale_by_scheduled_lr(lr))
    return parts


def _scaled(lr: Any, factor: float) -> Any:
    return lambda count: lr(count) * factor


def _labeller(patterns: tuple[str, ...]) -> Any:
    """``params -> labels``: ``g<i>`` for the first pattern matching a leaf's dotted path, else ``rest``."""

    def label(path: Any) -> str:
        name = param_path(path)
        return next((f"g{i}" for i, p in enumerate(patterns) if fnmatch.fnmatchcase(name, p)), "rest")

    return lambda tree: jax.tree_util.tree_map_with_path(lambda path, _: label(path), tree)


# L2-SP and gradual unfreezing ------------------------------------------------------------------------------
class L2SPState(NamedTuple):
    """State of `add_decayed_weights_toward_start`: the weights the stage started from."""

    anchor: Any


def add_decayed_weights_toward_start(strength: float) -> optax.GradientTransformation:
    """Add ``strength * (params - anchor)`` to the updates; the anchor is the parameters `init` saw (L2-SP).

    Decoupled like `optax.add_decayed_weights` (put it before the learning rate), but toward the starting weights
    (a pretrained encoder) instead of toward zero. The anchor is part of the state, so it checkpoints and resumes
    with it; `reset_anchor` moves it (a warm start from `init_from`).
    """

    def init_fn(params: Any) -> L2SPState:
        # A copy: the compiled step donates parameters and optimizer state, and one buffer cannot be donated twice.
        return L2SPState(anchor=jax.tree.map(lambda p: jnp.array(p, copy=True), params))

    def update_fn(updates: Any, state: L2SPState, params: Any = None) -> tuple[Any, L2SPState]:
        if params is None:
            raise ValueError(
                "add_decayed_weights_toward_start needs the parameters: call update(updates, state, params)"
            )
        updates = jax.tree.map(lambda u, p, a: u + strength * (p - a), updates, params, state.anchor)
        return updates, state

    return optax.GradientTransformation(init_fn, update_fn)


def _is_l2sp(node: Any) -> bool:
    return isinstance(node, L2SPState)


def reset_anchor(opt_state: Any, fresh: Any) -> Any:
    """`opt_state` with every L2-SP anchor taken from `fresh` (``optimizer.init(new_params)``); the rest kept."""
    return jax.tree.map(lambda old, new: new if _is_l2sp(old) else old, opt_state, fresh, is_leaf=_is_l2sp)


class FrozenUntilState(NamedTuple):
    """State of `frozen_until`: the calls seen and the inner transform's state."""

    # `count` shadows `tuple.count`, as in optax's own states.
    count: jax.Array  # type: ignore[assignment]
    inner: Any


def frozen_until(inner: optax.GradientTransformation, step: int, accum: int = 1) -> optax.GradientTransformation:
    """Zero updates, with `inner`'s state left as it is, until `step` loop steps have passed; then `inner`.

    A mask computed from a counter in the state: the compiled step is the same before and after the boundary.
    `inner`'s own counters (Adam's bias correction, the schedule) start at the unfreezing step.
    """

    def init_fn(params: Any) -> FrozenUntilState:
        return FrozenUntilState(count=jnp.zeros((), jnp.int32), inner=inner.init(params))

    def update_fn(updates: Any, state: FrozenUntilState, params: Any = None) -> tuple[Any, FrozenUntilState]:
        active = state.count * accum >= step
        new_updates, new_inner = inner.update(updates, state.inner, params)
        updates = jax.tree.map(lambda u: jnp.where(active, u, jnp.zeros_like(u)), new_updates)
        kept = jax.tree.map(lambda n, o: jnp.where(active, n, o), new_inner, state.inner)
        return updates, FrozenUntilState(count=optax.safe_increment(state.count), inner=kept)

    return optax.GradientTransformation(init_fn, update_fn)
