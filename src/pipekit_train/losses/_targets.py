"""What a loss needs of its targets: `TargetContract`, and the built-in losses' contracts (`CLASS_TARGETS`,
`SAME_SHAPE_FLOATING`).

A loss declares its contract (`Loss.targets`); pre-flight checks it on abstract shapes (`jax.ShapeDtypeStruct`
leaves: nothing runs and nothing of JAX is imported), so a classification loss given floating targets, or a
regression loss given class labels, is one clear error before anything is compiled. `target_problem`
(``_composite.py``) walks a loss, a `Composite`'s components too, against the contracts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["CLASS_TARGETS", "SAME_SHAPE_FLOATING", "TargetContract"]


@dataclass(frozen=True)
class TargetContract:
    """What a loss needs of its targets, checked by pre-flight on abstract shapes (nothing runs).

    Attributes:
        rule: The rule in words, for the error (``"class indices (integer) ... with >= 2 logits"``).
        check: ``check(predicted, target)`` on `jax.ShapeDtypeStruct` leaves (a batch of each): what the pair
            breaks, in words, or ``None`` when it fits.
    """

    rule: str
    check: Callable[[Any, Any], str | None]


def _shown(leaf: Any) -> str:
    return f"{leaf.dtype} of shape {tuple(leaf.shape)}"


def _kind(leaf: Any) -> str:
    """``"integer"``, ``"floating"``, ``"bool"`` or ``"other"`` for a leaf's dtype (NumPy's kinds: no JAX)."""
    import numpy as np

    kind = np.dtype(leaf.dtype).kind
    return {"i": "integer", "u": "integer", "f": "floating", "V": "floating", "b": "bool"}.get(kind, "other")


def _check_class_targets(predicted: Any, target: Any) -> str | None:
    if not hasattr(predicted, "shape") or not hasattr(target, "shape"):
        return f"the predictions are a {type(predicted).__name__}, not one array of logits"
    logits = tuple(predicted.shape)
    classes = logits[-1] if len(logits) > 1 else 1
    if classes < 2:
        return f"the model gives {classes} logit per example (predictions {_shown(predicted)})"
    kind = _kind(target)
    if kind == "integer" and tuple(target.shape) != logits[:-1]:
        return f"integer labels {_shown(target)} need logits of shape {tuple(target.shape)} + (classes,), got {logits}"
    if kind == "floating" and tuple(target.shape) != logits:
        return (
            f"floating targets {_shown(target)} are not class probabilities of the logits' shape {logits} (class "
            "indices must be integers: a CsvSource reads them with target_dtype: int32, or class names with "
            "class_labels: true; other sources, a Cast transform to int32)"
        )
    if kind not in ("integer", "floating"):
        return f"the targets are {_shown(target)}, neither integer class indices nor floating probabilities"
    return None


def _check_same_shape_floating(predicted: Any, target: Any) -> str | None:
    import numpy as np

    p_leaves = predicted if isinstance(predicted, (list, tuple)) else [predicted]
    t_leaves = target if isinstance(target, (list, tuple)) else [target]
    if not all(hasattr(x, "shape") for x in (*p_leaves, *t_leaves)) or len(p_leaves) != len(t_leaves):
        return None  # a tree of another structure: the loss's own shape checks speak
    for p, t in zip(p_leaves, t_leaves):
        if _kind(t) != "floating":
            return (
                f"the targets are {_shown(t)}, not floating values (class labels want a classification loss such "
                "as CrossEntropy; numbers stored as integers a Cast transform to float32)"
            )
        if tuple(p.shape) != tuple(t.shape):
            try:
                broadcast = f", which would broadcast to {np.broadcast_shapes(tuple(p.shape), tuple(t.shape))}"
            except ValueError:
                broadcast = ""
            return f"the predictions are {_shown(p)} and the targets {_shown(t)}{broadcast}"
    return None


#: Class indices (integer, the logits' shape without the last axis) or class probabilities (floating, the logits'
#: shape), with at least 2 logits per example: `CrossEntropy`.
CLASS_TARGETS = TargetContract(
    "class indices (integer, of the predictions' shape without the last axis) or class probabilities (floating, "
    "of the predictions' shape), with >= 2 logits per example",
    _check_class_targets,
)
#: Floating values of exactly the predictions' shape: `MSE`, `NLL` (the shape of the predicted mean).
SAME_SHAPE_FLOATING = TargetContract("floating values of exactly the predictions' shape", _check_same_shape_floating)
