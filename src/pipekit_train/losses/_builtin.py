"""The built-in losses: `MSE`, `NLL`, `KL` and `CrossEntropy`, written in `jax.numpy`.

Each is a `Loss`, registered under its class name, so it round-trips through YAML (``loss: {type: MSE}``). Shapes
are static under tracing, so the shape checks below raise while tracing, before anything is compiled.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pipekit import ConfigError, ShapeError

from ._loss import Loss
from ._targets import CLASS_TARGETS, SAME_SHAPE_FLOATING, TargetContract

if TYPE_CHECKING:
    import jax

# JAX is imported inside the functions that compute: registering the losses (reading a pipeline file) needs none.

__all__ = ["KL", "MSE", "NLL", "CrossEntropy"]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


# Helpers --------------------------------------------------------------------------------------------------
def _leaves(name: str, predicted: Any, target: Any) -> tuple[list[jax.Array], list[jax.Array]]:
    """Matching array leaves of `predicted` and `target`; differing shapes are refused (no silent broadcast)."""
    import jax
    import jax.numpy as jnp

    p_leaves = [jnp.asarray(p) for p in jax.tree.leaves(predicted)]
    t_leaves = [jnp.asarray(t) for t in jax.tree.leaves(target)]
    if len(p_leaves) != len(t_leaves):
        raise ShapeError(
            f"{name}: predicted has {len(p_leaves)} array leaves but target has {len(t_leaves)}; "
            "they must have the same structure"
        )
    for p, t in zip(p_leaves, t_leaves):
        if p.shape != t.shape:
            raise ShapeError(
                f"{name}: predicted shape {p.shape} != target shape {t.shape}; the shapes must match exactly "
                "(broadcasting, e.g. (B, 1) against (B,), would silently compare every pair)"
            )
    return p_leaves, t_leaves


def _reduce(values: list[jax.Array], reduction: str, treedef: Any = None) -> Any:
    """Reduce elementwise values over every leaf: mean over all elements, sum, or the elementwise tree."""
    import jax
    import jax.numpy as jnp

    if reduction == "none":
        if treedef is None:
            return values[0] if len(values) == 1 else values
        return jax.tree.unflatten(treedef, values)
    total = sum(jnp.sum(v) for v in values)
    if reduction == "sum":
        return total
    count = sum(v.size for v in values)
    return total / max(count, 1)


def _gaussian(name: str, value: Any, role: str) -> tuple[jax.Array, jax.Array]:
    import jax.numpy as jnp

    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise TypeError(
            f"{name}: {role} must be a (mean, log_var) pair or an object with "
            f"{'.log_prob(target)' if name == 'NLL' else '.kl_divergence(p)'}, got {type(value).__name__}"
        )
    mean, log_var = jnp.asarray(value[0]), jnp.asarray(value[1])
    if mean.shape != log_var.shape:
        raise ShapeError(f"{name}: {role} mean shape {mean.shape} != log_var shape {log_var.shape}")
    return mean, log_var


# Losses ---------------------------------------------------------------------------------------------------
class MSE(Loss):
    """Mean squared error. Carrier-agnostic over array-like leaves.

    `predicted` and `target` are arrays (or pytrees of arrays with the same structure) of identical shapes.

    Args:
        reduction: ``"mean"`` over every element of every leaf, ``"sum"``, or ``"none"`` for the elementwise
            squared errors (same structure as `predicted`; not usable as a training loss on its own).

    Example:
        >>> import jax.numpy as jnp
        >>> float(MSE()(jnp.array([1.0, 2.0]), jnp.array([0.0, 0.0])))
        2.5
    """

    reduction: Literal["mean", "sum", "none"] = "mean"
    targets: ClassVar[TargetContract | None] = SAME_SHAPE_FLOATING

    def __call__(self, predicted: Any, target: Any) -> Any:  # type: ignore[override]  # see Loss.__call__
        import jax
        import jax.numpy as jnp

        p_leaves, t_leaves = _leaves("MSE", predicted, target)
        errors = [jnp.square(p - t) for p, t in zip(p_leaves, t_leaves)]
        return _reduce(errors, self.reduction, jax.tree.structure(predicted))


class NLL(Loss):
    """Negative log-likelihood for distributional outputs.

    Used when the model predicts a distribution (mean + variance) or
    when the model is a conditional density (amortized inference).
    The `predicted` carrier is expected to be either a tuple
    (mean, log_var) or an object with .log_prob(target).

    For ``(mean, log_var)`` the elementwise loss is the full Gaussian NLL,
    ``0.5 * (log(2π) + log_var + (target - mean)² / exp(log_var))``. For a distribution object it is
    ``-predicted.log_prob(target)``.

    Args:
        reduction: ``"mean"`` over the elements, ``"sum"``, or ``"none"`` for the elementwise values.

    Example:
        >>> import jax.numpy as jnp
        >>> round(float(NLL()((jnp.zeros(2), jnp.zeros(2)), jnp.zeros(2))), 6)  # 0.5 * log(2π)
        0.918939
    """

    reduction: Literal["mean", "sum", "none"] = "mean"
    targets: ClassVar[TargetContract | None] = SAME_SHAPE_FLOATING

    def __call__(self, predicted: Any, target: Any) -> Any:  # type: ignore[override]  # see Loss.__call__
        import jax.numpy as jnp

        if hasattr(predicted, "log_prob"):
            values = -jnp.asarray(predicted.log_prob(target))
        else:
            mean, log_var = _gaussian("NLL", predicted, "predicted")
            (mean,), (target,) = _leaves("NLL", mean, target)
            values = _HALF_LOG_2PI + 0.5 * (log_var + jnp.square(target - mean) * jnp.exp(-log_var))
        return _reduce([values], self.reduction)


class KL(Loss):
    """KL divergence — for variational training.

    ``KL()(q, p)`` is KL(q ‖ p). `q` and `p` are ``(mean, log_var)`` pairs of diagonal Gaussians (analytic KL),
    or `q` is an object with ``.kl_divergence(p)`` (distrax / TFP style).

    Args:
        reduction: ``"batchmean"`` (default) sums over all elements and divides by the size of the leading
            (batch) axis: the KL per example, what a VAE's ELBO needs. ``"mean"`` averages over every element,
            ``"sum"`` sums, ``"none"`` returns the elementwise values.

    Example:
        >>> import jax.numpy as jnp
        >>> q, p = (jnp.zeros((1, 2)), jnp.zeros((1, 2))), (jnp.ones((1, 2)), jnp.zeros((1, 2)))
        >>> float(KL()(q, p))  # 0.5 * (mean difference)² per dimension, two dimensions
        1.0
    """

    reduction: Literal["batchmean", "mean", "sum", "none"] = "batchmean"

    def __call__(self, q_dist: Any, p_dist: Any) -> Any:  # type: ignore[override]  # see Loss.__call__
        import jax.numpy as jnp

        if hasattr(q_dist, "kl_divergence"):
            values = jnp.asarray(q_dist.kl_divergence(p_dist))
        else:
            mu_q, lv_q = _gaussian("KL", q_dist, "q")
            mu_p, lv_p = _gaussian("KL", p_dist, "p")
            if mu_q.shape != mu_p.shape:
                raise ShapeError(f"KL: q shape {mu_q.shape} != p shape {mu_p.shape}; the shapes must match exactly")
            values = 0.5 * (lv_p - lv_q + (jnp.exp(lv_q) + jnp.square(mu_q - mu_p)) * jnp.exp(-lv_p) - 1.0)
        if self.reduction == "batchmean":
            batch = values.shape[0] if values.ndim else 1
            return jnp.sum(values) / max(batch, 1)
        return _reduce([values], self.reduction)


class CrossEntropy(Loss):
    """Softmax cross-entropy over logits, for integer labels or one-hot (or soft) targets.

    `predicted` holds logits ``(..., classes)``. `target` is either integer labels ``(...)`` or a probability
    vector per example ``(..., classes)``. Returns ``(mean loss, {"accuracy": ...})``, the accuracy being the
    fraction of examples whose arg-max logit is the (arg-max) label.

    Args:
        label_smoothing: in ``[0, 1)``; the target becomes ``(1 - s) * target + s / classes``.

    Example:
        >>> import jax.numpy as jnp
        >>> loss, aux = CrossEntropy()(jnp.array([[0.0, 0.0]]), jnp.array([1]))
        >>> round(float(loss), 6), float(aux["accuracy"])  # log(2); argmax of a tie is class 0
        (0.693147, 0.0)
    """

    label_smoothing: float = 0.0
    #: The loop logs a loss's aux values as ``<aux_prefix><name>``; loss terms default to ``"loss/"``.
    #: Accuracy is a metric, not a loss term, so it is logged as plain ``accuracy``.
    aux_prefix: ClassVar[str] = ""
    targets: ClassVar[TargetContract | None] = CLASS_TARGETS

    def validate(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"CrossEntropy.label_smoothing must be in [0, 1), got {self.label_smoothing!r}")

    def __call__(self, predicted: Any, target: Any) -> tuple[jax.Array, dict[str, jax.Array]]:  # type: ignore[override]  # see Loss.__call__
        import jax
        import jax.numpy as jnp

        logits = jnp.asarray(predicted)
        target = jnp.asarray(target)
        classes = logits.shape[-1]
        if jnp.issubdtype(target.dtype, jnp.integer):
            if target.shape != logits.shape[:-1]:
                raise ShapeError(
                    f"CrossEntropy: integer labels of shape {target.shape} need logits of shape "
                    f"{target.shape} + (classes,), got {logits.shape}"
                )
            labels = target
            probs = jax.nn.one_hot(target, classes, dtype=logits.dtype)
        else:
            if target.shape != logits.shape:
                raise ShapeError(
                    f"CrossEntropy: one-hot target shape {target.shape} != logits shape {logits.shape}; "
                    "pass integer labels of shape logits.shape[:-1] or one-hot targets of the logits' shape"
                )
            labels = jnp.argmax(target, axis=-1)
            probs = target.astype(logits.dtype)
        if self.label_smoothing:
            probs = (1.0 - self.label_smoothing) * probs + self.label_smoothing / classes
        per_example = -jnp.sum(probs * jax.nn.log_softmax(logits, axis=-1), axis=-1)
        accuracy = jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))
        return jnp.mean(per_example), {"accuracy": accuracy}
