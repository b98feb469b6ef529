"""Metrics that accumulate over a whole split: ``update`` per batch on the device, ``merge``, ``compute`` once.

A `Metric` is an operator (its fields are its configuration; defining a subclass registers it, so YAML can name
it: ``metrics: [{type: Accuracy}, {type: PrecisionRecallF1, num_classes: 10}]``). Its running state is a small
pytree of arrays — sums and counts, never per-example values — so a pass over a split keeps the state on the
device: `update` runs inside one compiled call per batch and nothing is read back until `compute`, after the last
batch. `merge` adds two states (two shards, two hosts), which is why states hold sums rather than means.

``TrainingLoop(metrics=[...])`` computes them over the whole validation set at every evaluation and over the test
set at the end, next to the loss (docs/metrics.md). Whole-set precision, recall and F1 are not means of per-batch
values; these are exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pipekit import ConfigError, Operator

__all__ = [
    "MAE",
    "RMSE",
    "Accuracy",
    "ConfusionMatrix",
    "Metric",
    "PrecisionRecallF1",
    "TopKAccuracy",
    "compute_metrics",
    "evaluate_metrics",
    "init_states",
    "update_states",
]


class Metric(Operator, register=False):
    """Base class of accumulating metrics. Subclasses override `init`, `update` and `compute` (and `merge` when
    the state is not a sum).

    ``y_pred`` is the model's output for a batch (leading axis: examples); ``y_true`` the batch's target entry.
    """

    def init(self) -> Any:
        """The empty state: a pytree of arrays (zeros)."""
        raise NotImplementedError(f"{type(self).__name__}.init")

    def update(self, state: Any, y_pred: Any, y_true: Any) -> Any:
        """The state after one more batch. Traced by `jax.jit`: use `jax.numpy`, no host values."""
        raise NotImplementedError(f"{type(self).__name__}.update")

    def merge(self, a: Any, b: Any) -> Any:
        """The state of two disjoint parts of a split together (the default adds them leaf by leaf)."""
        import jax

        return jax.tree.map(lambda x, y: x + y, a, b)

    def compute(self, state: Any) -> dict[str, float]:
        """Named host floats from a final state (its leaves are NumPy arrays here)."""
        raise NotImplementedError(f"{type(self).__name__}.compute")


def _labels(y_pred: Any, y_true: Any) -> Any:
    """Class ids from `y_true`: integer ids as they are, one-hot (or probability) rows by their argmax."""
    import jax.numpy as jnp

    if y_true.ndim == y_pred.ndim and y_true.shape[-1] == y_pred.shape[-1] and y_pred.shape[-1] > 1:
        return jnp.argmax(y_true, axis=-1)
    return jnp.reshape(y_true, y_pred.shape[:-1]).astype(jnp.int32)


def _ratio(num: Any, den: Any) -> float:
    return float(num) / float(den) if float(den) else 0.0


class Accuracy(Metric):
    """The fraction of examples whose highest-scoring class is the target class. Names: ``accuracy``."""

    def init(self) -> Any:
        import jax.numpy as jnp

        return {"correct": jnp.zeros((), jnp.int32), "count": jnp.zeros((), jnp.int32)}

    def update(self, state: Any, y_pred: Any, y_true: Any) -> Any:
        import jax.numpy as jnp

        hit = jnp.argmax(y_pred, axis=-1) == _labels(y_pred, y_true)
        return {"correct": state["correct"] + jnp.sum(hit), "count": state["count"] + hit.size}

    def compute(self, state: Any) -> dict[str, float]:
        return {"accuracy": _ratio(state["correct"], state["count"])}


class TopKAccuracy(Metric):
    """The fraction of examples whose target class is among the `k` highest scores. Names: ``top<k>_accuracy``.

    Args:
        k: How many of the highest-scoring classes count as a hit.
    """

    k: int = 5

    def validate(self) -> None:
        if self.k < 1:
            raise ConfigError(f"TopKAccuracy.k must be a positive int, got {self.k}")

    def init(self) -> Any:
        import jax.numpy as jnp

        return {"correct": jnp.zeros((), jnp.int32), "count": jnp.zeros((), jnp.int32)}

    def update(self, state: Any, y_pred: Any, y_true: Any) -> Any:
        import jax
        import jax.numpy as jnp

        k = min(self.k, y_pred.shape[-1])
        _, top = jax.lax.top_k(y_pred, k)
        labels = _labels(y_pred, y_true)
        hit = jnp.any(top == labels[..., None], axis=-1)
        return {"correct": state["correct"] + jnp.sum(hit), "count": state["count"] + hit.size}

    def compute(self, state: Any) -> dict[str, float]:
        return {f"top{self.k}_accuracy": _ratio(state["correct"], state["count"])}


class _ClassCounts(Metric, register=False):
    """The state shared by `ConfusionMatrix` and `PrecisionRecallF1`: a (target, predicted) count matrix."""

    num_classes: int = 2

    def validate(self) -> None:
        if self.num_classes < 2:
            raise ConfigError(f"{type(self).__name__}.num_classes must be an int >= 2, got {self.num_classes}")

    def init(self) -> Any:
        import jax.numpy as jnp

        return {"matrix": jnp.zeros((self.num_classes, self.num_classes), jnp.int32)}

    def update(self, state: Any, y_pred: Any, y_true: Any) -> Any:
        import jax.numpy as jnp

        pred = jnp.reshape(jnp.argmax(y_pred, axis=-1), (-1,))
        true = jnp.reshape(_labels(y_pred, y_true), (-1,))
        flat = true * self.num_classes + pred
        counts = jnp.bincount(flat, length=self.num_classes * self.num_classes)
        return {"matrix": state["matrix"] + counts.reshape(self.num_classes, self.num_classes).astype(jnp.int32)}


class ConfusionMatrix(_ClassCounts):
    """Counts of (target class, predicted class) pairs. Names: ``confusion/<target>/<predicted>``.

    Args:
        num_classes: The number of classes (the model's output width).
    """

    def compute(self, state: Any) -> dict[str, float]:
        m = np.asarray(state["matrix"])
        return {f"confusion/{t}/{p}": float(m[t, p]) for t in range(m.shape[0]) for p in range(m.shape[1])}


class PrecisionRecallF1(_ClassCounts):
    """Precision, recall and F1 of each class over the whole split, and their unweighted (macro) means.

    Names: ``precision/<class>``, ``recall/<class>``, ``f1/<class>``, ``precision_macro``, ``recall_macro``,
    ``f1_macro``. A class never predicted has precision 0; one never present has recall 0.

    Args:
        num_classes: The number of classes (the model's output width).
    """

    def compute(self, state: Any) -> dict[str, float]:
        m = np.asarray(state["matrix"], dtype=np.float64)
        tp = np.diag(m)
        predicted, actual = m.sum(axis=0), m.sum(axis=1)
        precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
        recall = np.divide(tp, actual, out=np.zeros_like(tp), where=actual > 0)
        both = precision + recall
        f1 = np.divide(2 * precision * recall, both, out=np.zeros_like(tp), where=both > 0)
        out: dict[str, float] = {}
        for name, values in (("precision", precision), ("recall", recall), ("f1", f1)):
            out.update({f"{name}/{c}": float(v) for c, v in enumerate(values)})
            out[f"{name}_macro"] = float(values.mean())
        return out


class MAE(Metric):
    """The mean absolute error over every predicted number of the split. Names: ``mae``."""

    def init(self) -> Any:
        import jax.numpy as jnp

        return {"total": jnp.zeros((), jnp.float32), "count": jnp.zeros((), jnp.int32)}

    def update(self, state: Any, y_pred: Any, y_true: Any) -> Any:
        import jax.numpy as jnp

        err = jnp.abs(y_pred - jnp.reshape(y_true, y_pred.shape).astype(y_pred.dtype))
        return {"total": state["total"] + jnp.sum(err, dtype=jnp.float32), "count": state["count"] + err.size}

    def compute(self, state: Any) -> dict[str, float]:
        return {"mae": _ratio(state["total"], state["count"])}


class RMSE(Metric):
    """The root of the mean squared error over every predicted number of the split. Names: ``rmse``."""

    def init(self) -> Any:
        import jax.numpy as jnp

        return {"total": jnp.zeros((), jnp.float32), "count": jnp.zeros((), jnp.int32)}

    def update(self, state: Any, y_pred: Any, y_true: Any) -> Any:
        import jax.numpy as jnp

        err = jnp.square(y_pred - jnp.reshape(y_true, y_pred.shape).astype(y_pred.dtype))
        return {"total": state["total"] + jnp.sum(err, dtype=jnp.float32), "count": state["count"] + err.size}

    def compute(self, state: Any) -> dict[str, float]:
        return {"rmse": float(np.sqrt(_ratio(state["total"], state["count"])))}


# Running them --------------------------------------------------------------------------------------------
def init_states(metrics: Sequence[Metric]) -> tuple[Any, ...]:
    """Each metric's empty state."""
    return tuple(m.init() for m in metrics)


_UPDATE: Any = None


def update_states(metrics: tuple[Metric, ...], states: tuple[Any, ...], y_pred: Any, y_true: Any) -> tuple[Any, ...]:
    """Every metric's state after one batch: one compiled call, cached by the metrics' configuration and shapes;
    the states stay on the device."""
    global _UPDATE
    if _UPDATE is None:
        import jax

        def update(metrics: tuple[Metric, ...], states: tuple[Any, ...], y_pred: Any, y_true: Any) -> tuple[Any, ...]:
            return tuple(m.update(s, y_pred, y_true) for m, s in zip(metrics, states, strict=True))

        _UPDATE = jax.jit(update, static_argnums=0)
    return tuple(_UPDATE(tuple(metrics), states, y_pred, y_true))


def compute_metrics(metrics: Sequence[Metric], states: Sequence[Any]) -> dict[str, float]:
    """The named results of every metric: one transfer of all the states to the host, then `compute`."""
    import jax

    host = jax.device_get(list(states))
    out: dict[str, float] = {}
    for metric, state in zip(metrics, host, strict=True):
        out.update(metric.compute(state))
    return out


def evaluate_metrics(
    model: Any, batches: Any, metrics: Sequence[Metric], *, input_key: str = "x", target_key: str = "y"
) -> dict[str, float]:
    """`metrics` over every batch of `batches` (dicts of arrays), predicting with the bound model operator `model`.

    Nothing is read back to the host before the last batch.
    """
    metrics = tuple(metrics)
    states = init_states(metrics)
    for batch in batches:
        states = update_states(metrics, states, model(batch[input_key]), batch[target_key])
    return compute_metrics(metrics, states)
