"""The Equinox primitives of Layer 1: `TrainState`, `TrainTask`, `make_task`, `train_step` and save/restore.

`train_step` is the reference step, exactly the seed's: ``eqx.filter_jit`` over the whole state. The loop's fast
step (``jax.jit`` over partitioned arrays, donation, ``lax.scan``) must agree with it.
"""

from __future__ import annotations

import abc
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp

from pipekit import ShapeError

from ..._losses import Loss, split_loss_output

__all__ = [
    "LossTask",
    "TrainState",
    "TrainTask",
    "init_state",
    "make_task",
    "restore_state",
    "save_state",
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
    return TrainState(model=model, opt_state=optimizer.init(eqx.filter(model, eqx.is_array)), step=0)


class TrainTask(eqx.Module):
    """What to optimise: ``loss_fn(model, batch, key) -> (scalar loss, metrics dict)``.

    Supply your own subclass for custom training behaviour; `make_task` synthesises one from a `Loss`.
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
        raise TypeError(f"make_task: loss must be a Loss (callable as loss(predicted, target)), got {loss!r}")
    return LossTask(loss=loss, input_key=input_key, target_key=target_key)


@eqx.filter_jit
def train_step(
    state: TrainState,
    batch: Any,
    key: jax.Array,
    task: TrainTask,
    optimizer: optax.GradientTransformation,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimisation step. Pure function."""

    @eqx.filter_grad(has_aux=True)
    def grad_fn(model: Any, batch: Any, key: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        return task.loss_fn(model, batch, key)

    grads, metrics = grad_fn(state.model, batch, key)
    params = eqx.filter(state.model, eqx.is_array)
    updates, new_opt_state = optimizer.update(grads, state.opt_state, params)
    new_model = eqx.apply_updates(state.model, updates)
    return (
        TrainState(model=new_model, opt_state=new_opt_state, step=state.step + 1),
        metrics,
    )


def save_state(mngr: ocp.CheckpointManager, state: TrainState, step: int) -> None:
    """Save the array leaves of `state` as checkpoint `step` (asynchronously: `mngr.wait_until_finished()`)."""
    arrays, _ = eqx.partition(state, eqx.is_array)
    mngr.save(step, args=ocp.args.StandardSave(arrays))


def restore_state(
    mngr: ocp.CheckpointManager,
    template: TrainState,
    step: int,
) -> TrainState:
    """Restore checkpoint `step` into the structure of `template` (whose array values are ignored)."""
    arrays, static = eqx.partition(template, eqx.is_array)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, arrays)
    restored = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    return eqx.combine(restored, static)
