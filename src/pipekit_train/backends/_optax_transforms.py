"""The verbs the optimizer is made of: optax's transforms, with every number read from the state (`Hyperparams`).

`scale_by_adam`, `scale_by_lion`, `scale_by_rms` and `trace` (the direction), `add_decayed_weights` and
`clip_by_global_norm` do optax's arithmetic, bitwise, on numbers held in the state; `add_decayed_weights_toward_start`
(L2-SP, whose anchor `reset_anchor` moves) and `frozen_until` (gradual unfreezing) are this package's own. Each is an
``optax.GradientTransformation`` a user can chain by hand; `build_optimizer` (``_optax.py``) chains them with the
learning rate (``_optax_schedule.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._optax_numbers import Hyperparams, _hyper_init, _like

__all__ = [
    "FrozenUntilState",
    "L2SPState",
    "add_decayed_weights",
    "add_decayed_weights_toward_start",
    "clip_by_global_norm",
    "frozen_until",
    "reset_anchor",
    "scale_by_adam",
    "scale_by_lion",
    "scale_by_rms",
    "trace",
]


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
