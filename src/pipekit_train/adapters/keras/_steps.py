"""The compiled train and eval steps of the Keras backend: Keras' stateless API inside one `jax.jit` we own.

A step is ``model.stateless_call`` (training mode) → the pipekit loss on its outputs → `jax.grad` →
``optimizer.stateless_apply``, with every variable passed in and out as arrays: the state is explicit, so it
checkpoints as arrays and resumes bitwise. Per-step randomness comes from ``(seed, step)``: the model's
seed-generator states are set from ``fold_in(key, step)`` before each step. ``n > 1`` runs ``n`` steps in one
dispatch with `lax.scan`.

A `Program` (the Keras model, the built optimizer and the compiled functions) is cached per architecture, loss,
optimizer configuration and keys, so a second stage or run in the process compiles nothing new.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from pipekit_train.backends.kit import ema_decay
from pipekit_train.losses import split_loss_output

from ._optimizers import build_keras_optimizer, lr_scale_index
from ._tree import Layout, layout_of

State = tuple[list[jax.Array], list[jax.Array], list[jax.Array], list[jax.Array]]


@dataclass(eq=False)
class Program:
    """One architecture's compiled steps with one loss and optimizer."""

    model: Any
    optimizer: Any
    layout: Layout
    loss: Any
    input_key: str
    target_key: str
    aux_prefix: str
    ema_config: tuple[float, bool] | None
    scale_index: int = 0
    _train: dict[Any, Any] = field(default_factory=dict)
    _eval: Any = None

    def __post_init__(self) -> None:
        self.scale_index = lr_scale_index(self.optimizer)
        self._eval = jax.jit(self._metrics_eval)

    # The math ------------------------------------------------------------------------------------------------
    def _loss(
        self, trainable: list[Any], non_trainable: list[Any], batch: dict[str, Any], training: bool
    ) -> tuple[jax.Array, tuple[dict[str, Any], list[Any]]]:
        out, non_trainable, extra = self.model.stateless_call(
            trainable, non_trainable, batch[self.input_key], training=training, return_losses=True
        )
        total, aux = split_loss_output(self.loss(out, batch[self.target_key]))
        metrics = {"loss": total}
        for name, value in aux.items():
            metrics[f"{self.aux_prefix}{name}"] = value
        if extra:  # the model's own losses (kernel regularizers, add_loss), as Keras' fit adds them
            regularization = sum(extra)
            metrics["loss/regularization"] = regularization
            total = total + regularization
            metrics["loss"] = total
        return total, (metrics, non_trainable)

    def _seeded(self, non_trainable: list[Any], key: jax.Array) -> list[Any]:
        if not self.layout.seeds:
            return non_trainable
        non_trainable = list(non_trainable)
        for j, i in enumerate(self.layout.seeds):
            data = jax.random.key_data(jax.random.fold_in(key, j))
            non_trainable[i] = data.astype(non_trainable[i].dtype).reshape(non_trainable[i].shape)
        return non_trainable

    def _one(self, state: State, batch: dict[str, Any], step: jax.Array, base_key: jax.Array) -> tuple[State, Any]:
        trainable, non_trainable, opt_vars, ema = state
        non_trainable = self._seeded(non_trainable, jax.random.fold_in(base_key, step))
        grads, (metrics, non_trainable) = jax.grad(lambda t: self._loss(t, non_trainable, batch, True), has_aux=True)(
            trainable
        )
        trainable, opt_vars = self.optimizer.stateless_apply(opt_vars, grads, trainable)
        if self.ema_config is not None:
            decay, warmup = self.ema_config
            d = ema_decay(jnp.float32(decay), warmup, step)
            ema = [d * e + (1.0 - d) * p for e, p in zip(ema, trainable)]
        return (list(trainable), list(non_trainable), list(opt_vars), ema), metrics

    def _chunk(self, state: State, batches: dict[str, Any], step: jax.Array, base_key: jax.Array, n: int) -> Any:
        if n == 1:
            return self._one(state, batches, step, base_key)

        def body(carry: tuple[State, jax.Array], batch: dict[str, Any]) -> Any:
            s, i = carry
            s, m = self._one(s, batch, i, base_key)
            return (s, i + 1), m

        (state, _), metrics = jax.lax.scan(body, (state, step), batches)
        return state, metrics

    def _metrics_eval(self, trainable: list[Any], non_trainable: list[Any], batch: dict[str, Any]) -> Any:
        return self._loss(trainable, non_trainable, batch, False)[1][0]

    # Dispatch ------------------------------------------------------------------------------------------------
    def train(
        self, state: State, batches: dict[str, Any], step: Any, base_key: jax.Array, n: int, plan: Any = None
    ) -> Any:
        """`n` steps; with a `plan` (data parallel, `pipekit_train.scale._mesh`) the batch is split over the mesh's
        ``data`` axis and the state stays replicated, in one `jax.jit` with explicit shardings."""
        key = n if plan is None else (n, plan)
        fn = self._train.get(key)
        if fn is None:
            body = functools.partial(self._chunk, n=n)
            if plan is None:
                fn = jax.jit(body, donate_argnums=(0,))
            else:
                rep = plan.replicated
                fn = jax.jit(
                    body,
                    in_shardings=(rep, plan.batch(stacked=n > 1), rep, rep),
                    out_shardings=(rep, rep),
                    donate_argnums=(0,),
                )
            self._train[key] = fn
        return fn(state, batches, step, base_key)

    def evaluate(self, trainable: list[Any], non_trainable: list[Any], batch: dict[str, Any]) -> Any:
        return self._eval(trainable, non_trainable, batch)

    def initial_opt_vars(self) -> list[jax.Array]:
        return [jnp.array(v.value, copy=True) for v in self.optimizer.variables]

    def compiled_count(self) -> int:
        """How many variants of the train step are compiled (for tests: "compiled exactly once")."""
        return sum(fn._cache_size() for fn in self._train.values())


_PROGRAMS: dict[Any, Program] = {}


def program(loop: Any, model: Any, ema_config: tuple[float, bool] | None) -> Program:
    """The cached `Program` for `loop`'s loss, keys and optimizer on the Keras model `model`."""
    from pipekit import canonical

    key = (
        id(model),
        loop.loss,
        loop.input_key,
        loop.target_key,
        canonical(loop.optimizer_config),
        loop.max_steps,
        loop.grad_clip_norm,
        loop.accum,
        ema_config,
    )
    hit = _PROGRAMS.get(key)
    if hit is not None and hit.model is model:
        return hit
    optimizer = build_keras_optimizer(
        loop.optimizer_config,
        max_steps=loop.max_steps,
        grad_clip_norm=loop.grad_clip_norm,
        accum=loop.accum,
        variables=model.trainable_variables,
    )
    prog = Program(
        model=model,
        optimizer=optimizer,
        layout=layout_of(model),
        loss=loop.loss,
        input_key=loop.input_key,
        target_key=loop.target_key,
        aux_prefix=getattr(loop.loss, "aux_prefix", "loss/"),
        ema_config=ema_config,
    )
    _PROGRAMS[key] = prog
    return prog
