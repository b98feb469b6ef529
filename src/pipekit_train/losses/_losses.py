"""The `Loss` base class and the common losses: `MSE`, `NLL`, `KL`, `CrossEntropy`, `Composite`.

Every loss subclasses `Loss`, a `pipekit.Operator`: defining the subclass registers it under its class name, so
it round-trips through YAML (``loss: {type: Huber, delta: 0.5}``). Losses are written in `jax.numpy` only, so
they can be called under `jax.jit` and differentiated with `jax.grad`. Shapes are static under tracing, so the
shape checks below raise while tracing, before anything is compiled.

A loss returns either a scalar or a ``(scalar, aux_metrics)`` pair; `split_loss_output` tells them apart.
"""

from __future__ import annotations

import abc
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pipekit import ConfigError, Operator, ShapeError

from ..optim._schedules import Schedule, schedule_value

if TYPE_CHECKING:
    import jax

# JAX is imported inside the functions that compute: registering the losses (reading a pipeline file) needs none.

__all__ = [
    "CLASS_TARGETS",
    "KL",
    "MSE",
    "NLL",
    "SAME_SHAPE_FLOATING",
    "Composite",
    "CrossEntropy",
    "Loss",
    "LossFunction",
    "TargetContract",
    "as_loss",
    "python_name",
    "split_loss_output",
    "target_problem",
]

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


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
            "indices must be integers: convert them with a Cast transform to int32)"
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


def target_problem(loss: Any, predicted: Any, target: Any) -> tuple[Any, str] | None:
    """``(loss, what is broken; the rule)`` for the first loss in `loss` (a `Composite`'s components too) whose
    declared `Loss.targets` contract the abstract `predicted` / `target` break; ``None`` when all fit.

    A loss that declares no contract (``targets = None``, every user loss unless it sets one) is not checked here.
    """
    if isinstance(loss, Composite):
        for _, component in loss.components:
            found = target_problem(component, predicted, target)
            if found is not None:
                return found
        return None
    contract = getattr(loss, "targets", None)
    if not isinstance(contract, TargetContract):
        return None
    if isinstance(loss, NLL) and isinstance(predicted, (tuple, list)) and len(predicted) == 2:
        predicted = predicted[0]  # (mean, log_var): the targets are compared with the mean
    problem = contract.check(predicted, target)
    if problem is None:
        return None
    return loss, f"{problem}; {type(loss).__name__} takes {contract.rule}"


class Loss(Operator, abc.ABC, register=False):
    """Base class of losses: a frozen, typed operator called as ``loss(predicted, target)`` by the adapter.

    Subclass it, declare the configuration as fields and implement ``__call__``; defining the subclass registers
    it under its class name (or ``name=``), so a YAML file can name it (``loss: {type: Huber, delta: 0.5}``).
    ``__call__`` gets the model's predictions for the whole batch and the batch's targets, and returns either a
    scalar or a ``(scalar, aux_metrics)`` pair (`split_loss_output` tells them apart). The loop logs each aux
    metric as ``<aux_prefix><name>``. Write it in `jax.numpy`: it runs under `jax.jit` and `jax.grad`.

    Example:
        >>> import jax.numpy as jnp
        >>> class WeightedL1(Loss):
        ...     weight: float = 1.0
        ...     def __call__(self, predicted, target):
        ...         return self.weight * jnp.mean(jnp.abs(predicted - target))
        >>> float(WeightedL1(weight=2)(jnp.array([0.5, -3.0]), jnp.zeros(2)))
        3.5
        >>> WeightedL1(weight=2)  # a frozen, typed value: the int became a float
        WeightedL1(weight=2.0)
    """

    #: The loop logs a loss's aux values as ``<aux_prefix><name>`` (``loss/MSE_0`` for a `Composite`'s terms).
    aux_prefix: ClassVar[str] = "loss/"
    #: What the loss needs of its targets (`TargetContract`: `CLASS_TARGETS`, `SAME_SHAPE_FLOATING` or your own),
    #: checked in pre-flight on abstract shapes; ``None`` (the default for your losses): not checked.
    targets: ClassVar[TargetContract | None] = None

    @abc.abstractmethod
    def __call__(self, predicted: Any, target: Any) -> Any:  # type: ignore[override]  # a loss is not a one-input step
        """The loss of `predicted` against `target`: a scalar, or ``(scalar, {name: scalar, ...})``."""


def python_name(fn: Any) -> str:
    """The name a Python callable goes by in records and resume fingerprints: ``module.qualname`` for a function
    or a method, ``functools.partial(module.qualname, 0.5, delta=1.0)`` for a partial (arguments other than
    numbers, strings, booleans and ``None`` by their type), ``module.Class`` for another callable object.

    Example:
        >>> import functools, math
        >>> python_name(math.hypot), python_name(functools.partial(math.hypot, 3.0))
        ('math.hypot', 'functools.partial(math.hypot, 3.0)')
    """
    if isinstance(fn, functools.partial):
        args = [_shown_argument(a) for a in fn.args]
        args += [f"{k}={_shown_argument(v)}" for k, v in fn.keywords.items()]
        return f"functools.partial({', '.join([python_name(fn.func), *args])})"
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}.{qualname}"
    cls = type(fn)
    return f"{cls.__module__}.{cls.__qualname__}"


def _shown_argument(value: Any) -> str:
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__name__


def _check_callable(fn: Any, where: str) -> None:
    """Refuse what cannot be called as ``fn(predicted, target)``, naming `where`."""
    if isinstance(fn, type):
        made = f"{fn.__name__}()" if issubclass(fn, Loss) else f"an instance of {fn.__name__}"
        raise ConfigError(f"{where} is the class {fn.__name__}, not a loss: give {made}")
    if isinstance(fn, Operator) or not callable(fn):
        raise ConfigError(
            f"{where} must be a Loss or a function called as loss(predicted, target), got {type(fn).__name__}"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin that does not say: its own error speaks when it is called
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise ConfigError(
            f"{where} is {python_name(fn)}{signature}, which cannot be called as loss(predicted, target): a loss "
            "takes the predictions and the targets as two positional arguments"
        ) from None


class LossFunction(Loss, register=False):
    """A plain callable as a `Loss`: ``TrainingLoop(loss=my_loss)`` wraps ``my_loss`` in one (so does a
    `Composite` component), so every backend sees the `Loss` protocol of design seed 002.

    ``fn(predicted, target)`` returns a scalar or a ``(scalar, aux_metrics)`` pair, like any loss; it runs inside
    the backend's compiled JAX step (Equinox, Keras), so write it in `jax.numpy`. Two wrappers are equal when they
    wrap the same object: the same function reuses the compiled step of an earlier stage, another function
    compiles its own. A backend that does not run JAX refuses it before training (``lightning``: write a `Loss`
    subclass and give it a torch version). It has no YAML form: `pipekit.dumps` refuses it, naming the function;
    a record, and a resume's fingerprint, name it by `python_name` (its module and qualified name, not its code:
    as a `Loss` subclass is compared by its name and fields, not its ``__call__``).

    Example:
        >>> import jax.numpy as jnp
        >>> def l1(predicted, target):
        ...     return jnp.mean(jnp.abs(predicted - target))
        >>> loss = LossFunction(fn=l1)
        >>> loss
        LossFunction(pipekit_train.losses._losses.l1)
        >>> float(loss(jnp.array([0.5, -3.0]), jnp.zeros(2)))
        1.75
    """

    fn: Callable[..., Any]

    def validate(self) -> None:
        _check_callable(self.fn, "LossFunction.fn")

    def __call__(self, predicted: Any, target: Any) -> Any:  # type: ignore[override]  # see Loss.__call__
        return self.fn(predicted, target)

    def __repr__(self) -> str:
        return f"LossFunction({python_name(self.fn)})"

    def python_only(self) -> tuple[str, str]:
        return (
            python_name(self.fn),
            "to name a loss in a pipeline file, write it as a Loss subclass (class MyLoss(Loss) with "
            "__call__(self, predicted, target)), which registers itself under its class name (docs/yaml.md)",
        )


def as_loss(value: Any, where: str = "loss") -> Any:
    """`value` as a `Loss`: a plain callable (a function, a ``functools.partial``, an object with ``__call__``) is
    wrapped in a `LossFunction`; a `Loss`, ``None`` and what is not callable come back as they are (the field's
    type check speaks for them). A class, another operator, or a callable that cannot take ``(predicted,
    target)`` is refused naming `where`.

    Example:
        >>> import jax.numpy as jnp
        >>> as_loss(jnp.dot, "TrainingLoop.loss")
        LossFunction(jax.numpy.dot)
        >>> as_loss(MSE)
        Traceback (most recent call last):
        ...
        pipekit._errors.ConfigError: loss is the class MSE, not a loss: give MSE()
    """
    if value is None or isinstance(value, Loss) or not callable(value):
        return value
    if isinstance(value, Operator):
        return value  # another operator (a callback, a metric): the field's type check names it
    _check_callable(value, where)
    return LossFunction(fn=value)


def split_loss_output(out: Any) -> tuple[Any, dict[str, Any]]:
    """Split what a `Loss` returned into ``(scalar, aux_metrics)``.

    A ``(value, mapping)`` pair is a scalar with auxiliary metrics; anything else is the scalar itself, with
    no auxiliary metrics.

    Example:
        >>> split_loss_output(1.5)
        (1.5, {})
        >>> split_loss_output((1.5, {"accuracy": 0.5}))
        (1.5, {'accuracy': 0.5})
    """
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        return out[0], dict(out[1])
    return out, {}


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


class Composite(Loss):
    """Weighted sum: loss = sum(w_i * L_i).

    Returns ``(total, terms)``; `terms` maps ``f"{type(L).__name__}_{i}"`` to each component's (unweighted)
    scalar (a component given as a plain function: ``f"{function name}_{i}"``). A component that returns
    ``(scalar, aux)`` contributes its scalar, and its aux metrics appear in `terms` as
    ``f"{type(L).__name__}_{i}/{name}"``.

    A weight may be a `Schedule` (KL annealing: ``[{type: Linear, start: 0.0, end: 1.0, steps: 1000}, {type:
    KL}]``): inside the train step it follows the step and is logged as ``schedule/weight/<term>``
    (``schedule/weight/KL_1``); outside it (validation, test) it takes its final value.

    Args:
        components: ``((weight, loss), ...)``, at least one; every loss must reduce to a scalar. A weight is a
            float or a `Schedule`; a loss is a `Loss` or, from Python, a plain function (`LossFunction`).

    Example:
        >>> import jax.numpy as jnp
        >>> total, terms = Composite(components=((1.0, MSE()), (0.5, MSE(reduction="sum"))))(
        ...     jnp.array([1.0, 1.0]), jnp.zeros(2))
        >>> float(total), sorted(terms)
        (2.0, ['MSE_0', 'MSE_1'])
    """

    components: tuple[tuple[float | Schedule, Loss], ...]

    @classmethod
    def fill_fields(cls, given: dict[str, Any]) -> dict[str, Any]:
        """A component's loss given as a plain callable becomes a `LossFunction` (`as_loss`)."""
        components = given.get("components")
        if not isinstance(components, (list, tuple)):
            return given
        wrapped = [
            (c[0], as_loss(c[1], f"Composite.components[{i}][1]"))
            if isinstance(c, (list, tuple)) and len(c) == 2
            else c
            for i, c in enumerate(components)
        ]
        return {**given, "components": tuple(wrapped)}

    def validate(self) -> None:
        if not self.components:
            raise ConfigError("Composite.components must hold at least one (weight, loss) pair, got ()")
        for i, (weight, loss) in enumerate(self.components):
            if not isinstance(weight, Schedule) and not math.isfinite(weight):
                raise ConfigError(f"Composite.components[{i}] weight must be a finite float, got {weight!r}")
            if getattr(loss, "reduction", None) == "none":
                raise ConfigError(
                    f"Composite.components[{i}] is {loss!r}; a component must reduce to a scalar, "
                    "so reduction='none' is not allowed (use 'mean' or 'sum')"
                )

    @classmethod
    def example(cls) -> Composite:
        return cls(components=((1.0, MSE()), (0.5, KL())))

    def __call__(self, predicted: Any, target: Any) -> tuple[Any, dict[str, Any]]:  # type: ignore[override]  # see Loss.__call__
        terms: dict[str, Any] = {}
        total: Any = 0.0
        for i, (weight, loss) in enumerate(self.components):
            name = f"{_term_name(loss)}_{i}"
            value, aux = split_loss_output(loss(predicted, target))
            terms[name] = value
            for k, v in aux.items():
                terms[f"{name}/{k}"] = v
            total = total + schedule_value(weight, f"weight/{name}") * value
        return total, terms


def _term_name(loss: Any) -> str:
    """A `Composite` term's name before its index: the loss's class, or a wrapped function's own name."""
    if isinstance(loss, LossFunction):
        name = getattr(loss.fn, "__name__", "")
        if isinstance(name, str) and name.isidentifier():
            return name
    return type(loss).__name__
