"""Mixed precision: the `TrainingLoop.precision` setting and the casts the compiled step makes.

``precision: {compute: bfloat16, params: float32}`` keeps the parameters, the optimizer state, the EMA, the
checkpoints and the registered model in float32 (the master weights) and runs the forward and backward pass in
bfloat16: inside the step the floating-point parameters, non-trained arrays and the model input are cast to the
compute dtype; the gradient flows back through the cast and arrives in float32; the loss against the float32
target is computed in float32 (JAX's type promotion). Evaluation uses the float32 weights.
"""

from __future__ import annotations

from typing import Any

from pipekit import ConfigError, suggestion

PRECISION_KEYS = ("compute", "params")
COMPUTE_DTYPES = ("float32", "bfloat16")
PARAM_DTYPES = ("float32",)


def compute_dtype(precision: Any, where: str = "TrainingLoop.precision") -> str | None:
    """The compute dtype's name when it is not float32 (``None``: full precision); one-line errors."""
    if precision is None:
        return None
    if not isinstance(precision, dict):
        raise ConfigError(f"{where} must be a mapping like {{compute: bfloat16, params: float32}}, got {precision!r}")
    for key in precision:
        if key not in PRECISION_KEYS:
            raise ConfigError(
                f"{where} has no setting {key!r}{suggestion(str(key), PRECISION_KEYS)}; "
                f"allowed: {', '.join(PRECISION_KEYS)}"
            )
    params = precision.get("params", "float32")
    if params not in PARAM_DTYPES:
        raise ConfigError(
            f"{where}.params must be float32 (the master weights; the optimizer updates them), got {params!r}"
        )
    compute = precision.get("compute", "float32")
    if compute == "float16":
        raise ConfigError(
            f"{where}.compute float16 needs loss scaling, which pipekit-train does not implement; use bfloat16"
        )
    if compute not in COMPUTE_DTYPES:
        raise ConfigError(
            f"{where}.compute must be one of {', '.join(COMPUTE_DTYPES)}, got {compute!r}"
            f"{suggestion(str(compute), COMPUTE_DTYPES)}"
        )
    return None if compute == "float32" else str(compute)


def check_precision(loop: Any) -> None:
    """Pre-flight: a compute dtype other than float32 only on a backend whose step casts (``precision``)."""
    from ..backends._registry import able_to
    from ._mesh import supports

    dtype = compute_dtype(loop.precision)
    if dtype is not None and not supports(loop, "precision"):
        raise ConfigError(
            f"TrainingLoop.precision is {loop.precision!r} but backend {loop.backend!r} trains in float32 only "
            f"(mixed precision: {able_to('precision')}); remove precision"
        )


def cast_floating(tree: Any, dtype: str | None) -> Any:
    """`tree` with every floating-point array leaf cast to `dtype` (unchanged when `dtype` is ``None``)."""
    if dtype is None:
        return tree
    import jax
    import jax.numpy as jnp

    def cast(x: Any) -> Any:
        if isinstance(x, jax.Array | jnp.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)
