"""The recipes' part of the compiled step: the SAM/ASAM gradient and the in-step diagnostics (and `frozen_count`,
the parameters frozen groups keep out of it).

`StepRecipe` is static (hashable, compared by value) and rides in the `StepLoss` the step specialises on, so a
loop without recipes compiles exactly the step it compiled before. See ``docs/recipes.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class StepRecipe(NamedTuple):
    """What the step does beyond ``grad → update``.

    Attributes:
        sam: ``(rho, adaptive, eps)`` of a `SAM` rule, or ``None``.
        diagnostics: Log gradient norm, parameter norm and update/parameter ratio.
        groups: With diagnostics, the group names and, per parameter leaf (in flat order), the index of its
            group (``-1``: no group); empty without groups.
    """

    sam: tuple[float, bool, float] | None = None
    diagnostics: bool = False
    groups: tuple[tuple[str, ...], tuple[int, ...]] = ((), ())


def sam_gradient(
    loss_of: Callable[[Any], tuple[jax.Array, Any]], params: Any, grads: Any, rho: float, adaptive: bool, eps: float
) -> Any:
    """The gradient at ``params + e``, ``e = rho g / ||g||`` (SAM) or ``rho w² g / ||w g||`` (ASAM)."""
    if adaptive:
        scaled = jax.tree.map(lambda p, g: jnp.abs(p) * g, params, grads)
        norm = _global_norm(scaled)
        perturbation = jax.tree.map(lambda p, g: rho * (p * p) * g / (norm + eps), params, grads)
    else:
        norm = _global_norm(grads)
        perturbation = jax.tree.map(lambda g: rho * g / (norm + eps), grads)
    perturbed = jax.tree.map(lambda p, e: p + e, params, perturbation)
    sharp_grads, _ = jax.grad(loss_of, has_aux=True)(perturbed)
    return sharp_grads


def _global_norm(tree: Any) -> jax.Array:
    norm: jax.Array = optax.tree.norm(tree)
    return norm


def diagnostics(recipe: StepRecipe, params: Any, grads: Any, updates: Any) -> dict[str, jax.Array]:
    """``diag/grad_norm``, ``diag/param_norm``, ``diag/update_ratio`` (‖update‖ / ‖param‖), globally and per group.

    `params` are the weights before the update. Computed inside the step: they travel with the loss in the
    step's metrics and cost no host transfer of their own.
    """
    p, g, u = jax.tree.leaves(params), jax.tree.leaves(grads), jax.tree.leaves(updates)
    sq = [(jnp.sum(jnp.square(a)), jnp.sum(jnp.square(b)), jnp.sum(jnp.square(c))) for a, b, c in zip(p, g, u)]
    names, index = recipe.groups
    selections: list[tuple[str, list[int]]] = [("", list(range(len(sq))))]
    for i, name in enumerate(names):
        selections.append((f"/{name}", [j for j, k in enumerate(index) if k == i]))
    out: dict[str, jax.Array] = {}
    for suffix, members in selections:
        p2 = sum((sq[j][0] for j in members), jnp.float32(0))
        g2 = sum((sq[j][1] for j in members), jnp.float32(0))
        u2 = sum((sq[j][2] for j in members), jnp.float32(0))
        out[f"diag/grad_norm{suffix}"] = jnp.sqrt(g2)
        out[f"diag/param_norm{suffix}"] = jnp.sqrt(p2)
        out[f"diag/update_ratio{suffix}"] = jnp.sqrt(u2) / jnp.maximum(jnp.sqrt(p2), 1e-12)
    return out


def frozen_count(loop: Any, params: Any) -> int:
    """How many parameters frozen groups hold for the whole stage (`ParamGroup.frozen` without `unfreeze_at`)."""
    from pipekit_train.backends.kit import group_labels, param_path

    groups = loop.param_groups
    if not any(g.frozen and g.unfreeze_at is None for g in groups):
        return 0
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    labels = group_labels([param_path(p) for p, _ in flat], groups)
    return int(
        sum(x.size for (_, x), i in zip(flat, labels) if i >= 0 and groups[i].frozen and groups[i].unfreeze_at is None)
    )
