"""The `EMA` callback as a backend honours it: the decay rule every backend applies after each step, so an EMA
means the same on every backend (`pipekit_train.callbacks.EMA`: ``ema = d * ema + (1 - d) * params``)."""

from __future__ import annotations

from typing import Any

__all__ = ["ema_decay"]


def ema_decay(decay: Any, warmup: bool, step: Any) -> Any:
    """The decay ``d`` used after `step` (0-based) updates: `decay`, or with `warmup` ``min(decay, (1 + t) / (10 +
    t))`` at ``t = step + 1``, so early averages are not dominated by the random initial weights.

    `step` is a Python int (a backend stepping in Python: float64 arithmetic) or a JAX integer array inside a
    compiled step (float32: pass `decay` as a float32 value, a `Schedule` already read with `schedule_value`).

    Example:
        >>> ema_decay(0.999, True, 0), ema_decay(0.999, False, 0)
        (0.18181818181818182, 0.999)
    """
    if not warmup:
        return decay
    if isinstance(step, int):
        t = float(step) + 1.0
        return min(decay, (1.0 + t) / (10.0 + t))
    import jax.numpy as jnp

    t = step.astype(jnp.float32) + 1.0
    return jnp.minimum(decay, (1.0 + t) / (10.0 + t))
