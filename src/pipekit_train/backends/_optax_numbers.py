"""The optimizer's numbers as values in its state: `Hyperparams`, the node each verb of the optax mapping reads.

Every number of the optimizer (learning rate, schedule parameters and horizon, betas, eps, momentum, decay
strengths, clip norm, unfreezing step) is a float32 or int32 scalar array in a `Hyperparams` node of the optimizer
state instead of a constant of the program: a new value is a new array of the same shape and dtype, so the compiled
step that reads it is reused. `refresh_hyperparams` gives a restored state the numbers of the configuration being
run. The verbs that read them are in ``_optax_transforms.py`` and ``_optax_schedule.py``; ``design/optimizers.md``
says what is a value and what is structure, and why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = ["Hyperparams", "refresh_hyperparams"]


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
