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

The numbers' node is in ``_optax_numbers.py``, the verbs in ``_optax_transforms.py`` and the learning rate
(the schedule and its run-time factor) in ``_optax_schedule.py``; this module chains them.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from pipekit import ConfigError

from ..optim._config import resolve_optimizer_config, schedule_numbers
from ..optim._recipes import param_path
from ._optax_schedule import _check_positive_int, scale_by_scheduled_lr
from ._optax_transforms import (
    add_decayed_weights,
    add_decayed_weights_toward_start,
    clip_by_global_norm,
    frozen_until,
    scale_by_adam,
    scale_by_lion,
    scale_by_rms,
    trace,
)

if TYPE_CHECKING:
    from ..optim._recipes import ParamGroup

__all__ = ["StructuredOptimizer", "build_optimizer"]


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
