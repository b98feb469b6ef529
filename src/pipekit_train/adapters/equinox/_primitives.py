"""The Equinox building blocks for hand-written loops: `TrainState`, `TrainTask`, `make_task`, `train_step`,
`save_state` and `restore_state`.

`train_step` is the reference step: ``eqx.filter_jit`` over the whole state, one optimizer update. The loop's fast
step (``jax.jit`` over partitioned arrays, donation, ``lax.scan``) must agree with it.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from pipekit import ConfigError, ShapeError
from pipekit_train.losses import Loss, split_loss_output

if TYPE_CHECKING:  # Orbax (and TensorStore with it) is imported when a checkpoint is saved or restored
    import orbax.checkpoint as ocp

__all__ = [
    "LossTask",
    "TrainState",
    "TrainTask",
    "check_task",
    "init_state",
    "make_task",
    "restore_state",
    "save_state",
    "task_loss",
    "train_step",
]


class TrainState(eqx.Module):
    """Everything that changes during training: the model, the optimizer state and the step counter.

    `step` is an int32 scalar array (an int is converted), so that incrementing it under `jax.jit` never
    triggers a recompile.
    """

    model: Any
    opt_state: Any
    step: jax.Array = eqx.field(converter=lambda s: jnp.asarray(s, jnp.int32))


def init_state(model: Any, optimizer: optax.GradientTransformation) -> TrainState:
    """A `TrainState` at step 0: the optimizer initialised on the model's array leaves."""
    # `step`'s converter makes the int an int32 array; mypy does not apply field converters.
    return TrainState(model=model, opt_state=optimizer.init(eqx.filter(model, eqx.is_array)), step=0)  # type: ignore[arg-type]


class TrainTask(eqx.Module):
    """What to optimise: ``loss_fn(model, batch, key) -> (scalar loss, metrics dict)``.

    Supply your own subclass for custom training behaviour (several forward passes, a teacher model, a loss that
    needs more of the batch than one input and one target) and pass it as ``TrainingLoop(task=..., loss=None)``;
    `make_task` synthesises one from a `Loss`. The loop differentiates the loss with respect to the model's
    trainable arrays only: a task's own arrays (a frozen teacher, class weights) are inputs of the compiled step,
    its other fields are static. A task is Python-only: it cannot be written to (or read from) a YAML file.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> class Regression(TrainTask):
        ...     weight: float = 1.0
        ...     def loss_fn(self, model, batch, key):
        ...         predicted = jax.vmap(model)(batch["x"])
        ...         loss = self.weight * jnp.mean((predicted - batch["y"]) ** 2)
        ...         return loss, {"loss": loss, "mae": jnp.mean(jnp.abs(predicted - batch["y"]))}
        >>> loss, metrics = Regression().loss_fn(lambda x: 2 * x, {"x": jnp.ones(3), "y": jnp.zeros(3)}, None)
        >>> float(loss), sorted(metrics)
        (4.0, ['loss', 'mae'])
    """

    @abc.abstractmethod
    def loss_fn(self, model: Any, batch: Any, key: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The scalar loss of `model` on `batch` and the metrics to log (including ``"loss"``)."""


class LossTask(TrainTask):
    """The task `make_task` builds: ``loss(vmap(model)(batch[input_key]), batch[target_key])``."""

    loss: Loss = eqx.field(static=True)
    input_key: str = eqx.field(static=True, default="x")
    target_key: str = eqx.field(static=True, default="y")

    def loss_fn(self, model: Any, batch: Any, key: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
        x, y = batch[self.input_key], batch[self.target_key]
        size = jax.tree.leaves(x)[0].shape[0]
        if key is None:
            predicted = jax.vmap(lambda xi: model(xi, key=None))(x)
        else:
            keys = jax.random.split(key, size)
            predicted = jax.vmap(lambda xi, ki: model(xi, key=ki))(x, keys)
        value, aux = split_loss_output(self.loss(predicted, y))
        if jnp.shape(value) != ():
            raise ShapeError(
                f"{self.loss!r} returned shape {jnp.shape(value)}; a training loss must be a scalar "
                "(reduction='none' gives per-element values: use 'mean' or 'sum')"
            )
        return value, {**aux, "loss": value}


def make_task(loss: Loss, input_key: str = "x", target_key: str = "y") -> TrainTask:
    """A `TrainTask` from a `Loss`: the model is vmapped over the batch with a key per example.

    The metrics hold ``"loss"`` and each auxiliary term the loss returns, under its own name.
    """
    if not isinstance(loss, Loss):
        raise TypeError(
            "make_task: loss must be a Loss (an instance of a pipekit_train.Loss subclass, called as "
            f"loss(predicted, target)), got {loss!r}"
        )
    return LossTask(loss=loss, input_key=input_key, target_key=target_key)


def task_loss(task: Any, model: Any, batch: Any, key: jax.Array | None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``task.loss_fn(model, batch, key)``, checked: a scalar loss and a mapping of metrics.

    The loop logs the metrics and watches ``metrics["loss"]`` for NaN; when the task reports no ``"loss"``, the
    returned scalar is added under that name.
    """
    name = type(task).__name__
    out = task.loss_fn(model, batch, key)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping)):
        shown = type(out).__name__ if not isinstance(out, tuple) else f"a tuple of {len(out)}"
        raise TypeError(f"{name}.loss_fn must return (scalar loss, metrics dict), got {shown}")
    value, metrics = out
    if jnp.shape(value) != ():
        raise ShapeError(
            f"{name}.loss_fn returned a loss of shape {jnp.shape(value)}; a training loss must be a scalar "
            "(reduce it with jnp.mean or jnp.sum)"
        )
    metrics = dict(metrics)
    metrics.setdefault("loss", value)
    return value, metrics


def check_task(task: Any, model: Any, batch: Any) -> None:
    """Refuse a task that cannot train `model` on `batch`, before anything is compiled.

    `model` and `batch` may be abstract (`jax.ShapeDtypeStruct` leaves, as from ``eqx.filter_eval_shape``):
    `task_loss` is traced with `jax.eval_shape`, nothing runs. Raises `pipekit.ConfigError` when `task` has no
    ``loss_fn``, and `pipekit.ShapeError` naming the task and the batch when tracing it fails.
    """
    if not callable(getattr(task, "loss_fn", None)):
        raise ConfigError(
            "TrainingLoop.task must be a TrainTask (an eqx.Module with loss_fn(model, batch, key) returning "
            f"(scalar loss, metrics dict)), got {task!r}"
        )
    try:
        eqx.filter_eval_shape(task_loss, task, model, batch, jax.random.key(0))
    except Exception as e:
        shapes = {k: tuple(getattr(v, "shape", ())) for k, v in batch.items()} if isinstance(batch, Mapping) else batch
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShapeError(
            f"TrainingLoop.task {type(task).__name__}.loss_fn fails on a batch of shapes {shapes}: {first}"
        ) from e


@eqx.filter_jit
def train_step(
    state: TrainState,
    batch: Any,
    key: jax.Array,
    task: TrainTask,
    optimizer: optax.GradientTransformation,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimisation step. Pure function. A `Schedule` in the loss follows `state.step` (``schedule/<name>``)."""
    from pipekit_train.optim import step_context

    @eqx.filter_grad(has_aux=True)
    def grad_fn(model: Any, batch: Any, key: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        return task.loss_fn(model, batch, key)

    with step_context(state.step) as ctx:
        grads, metrics = grad_fn(state.model, batch, key)
    metrics = {**metrics, **ctx.metrics()}
    params = eqx.filter(state.model, eqx.is_array)
    updates, new_opt_state = optimizer.update(grads, state.opt_state, params)
    new_model = eqx.apply_updates(state.model, updates)
    return (
        TrainState(model=new_model, opt_state=new_opt_state, step=state.step + 1),
        metrics,
    )


def save_state(mngr: ocp.CheckpointManager, state: TrainState, step: int) -> None:
    """Save the array leaves of `state` as checkpoint `step` (asynchronously: `mngr.wait_until_finished()`)."""
    import orbax.checkpoint as ocp

    arrays, _ = eqx.partition(state, eqx.is_array)
    mngr.save(step, args=ocp.args.StandardSave(arrays))


def restore_state(
    mngr: ocp.CheckpointManager,
    template: TrainState,
    step: int,
) -> TrainState:
    """Restore checkpoint `step` into the structure of `template` (whose array values are ignored)."""
    import orbax.checkpoint as ocp

    arrays, static = eqx.partition(template, eqx.is_array)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, arrays)
    restored = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    state: TrainState = eqx.combine(restored, static)
    return state
